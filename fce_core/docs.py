"""The parts of the public docstrings that are the same in both twins (the contract, docs/SPEC.md), and the
decorator that assembles a function's docstring from them and its framework's own parts."""
from .contract import FUSED_SOFTCAP_WITH_SMOOTHING, FUSED_SOFTCAP_WITH_SMOOTHING_F16

ENGINE_ARG = f"""\
    engine: "auto" (default), "fused" or "library". "fused": our logits GEMM with the row statistics in its
        epilogue, storing 16-bit exp-scaled tile values instead of float32 logits, and our dX / dW GEMMs
        (less memory; the twins bitwise equal; vocab-parallel too). "library": a library logits GEMM into
        float32 logits, then our row passes. "auto" is "fused" for bfloat16 / float16 inputs on a GPU where
        the fused engine takes the options (label smoothing under a softcap of at most {FUSED_SOFTCAP_WITH_SMOOTHING:g},
        {FUSED_SOFTCAP_WITH_SMOOTHING_F16:g} for float16), else "library" (float32 inputs, on which the fused engine is
        24-46x slower; the CPU). Both compute the same math within SPEC's bounds; their bits differ
        (docs/NUMERICS.md, "The fused engine").
"""

FLCE_SUMMARY = """Fused linear cross-entropy: ``cross_entropy(x @ weight.T + bias, targets)`` without the logits."""

FLCE_ARGS = """\
    x: ``[..., H]`` float32 / bfloat16 / float16 hidden states (any leading shape).
    weight: ``[V, H]`` LM head (may be the tied embedding table), same dtype as ``x``.
    targets: ``x.shape[:-1]`` integer class indices, already shifted; ``ignore_index`` rows take no part
        (the rows are put valid-first, and the chunks past the last valid row are skipped where the count of
        valid rows is known: always in JAX, with ``validate`` in torch).
    bias: optional ``[V]`` bias (float32 with 16-bit ``x`` is fine; its gradient comes back in its dtype).
    ignore_index: target value that marks a row to ignore (default -100).
    reduction: ``"mean"`` (CE over the class-weighted count D of valid rows, z-loss over their count n),
        ``"sum"`` or ``"none"`` (per row, 0 for ignored rows).
    label_smoothing: epsilon in [0, 1] (PyTorch's definition, class-weighted like ``F.cross_entropy``).
    z_loss: coefficient s >= 0 of the PaLM z-loss ``s * lse**2`` (Liger's ``lse_square_scale``).
    softcap: c > 0 applies ``c * tanh(logits / c)`` before the softmax (Gemma-2/3), or None.
    class_weights: optional ``[V]`` float weights of any real value (``F.cross_entropy``'s ``weight=``); no
        gradient flows to them.
    normalizer: for "mean", the denominators to use instead of this call's: a scalar (D = n) or a pair
        (D, n), numbers or 0-d arrays, e.g. the global counts over data-parallel ranks or micro-batches.
        The scale is folded into the gradient once. Ignored for "sum" and "none".
    token_scaling: scale each row's loss and gradient by its stop-gradient p(target) (Liger's
        ``use_token_scaling``).
    return_stats: also return a dict with ``lse`` (float32, shape of targets; 0 on ignored rows), ``z_loss``
        (the z-loss part of the loss, reduced the same way), ``accuracy`` (fraction of valid rows whose first
        argmax is the target; per-row 0/1 for "none") and ``argmax`` (first argmax per row, -1 on ignored
        rows; int64 in torch, int32 in JAX). The stats carry no gradient.
    chunk_rows: rows per chunk (default from the logits budget: see ``fce_core.plan``).
""" + ENGINE_ARG

CPO_SUMMARY = """Fused linear CPO loss (TRL's ``CPOTrainer.cpo_loss`` plus ``cpo_alpha`` NLL), without the logits."""

CPO_ARGS = """\
    x: ``[2B, T, H]`` hidden states: rows ``[0, B)`` chosen sequences, ``[B, 2B)`` rejected (Liger's layout).
    weight: ``[V, H]`` LM head, same dtype as ``x``.
    targets: ``[2B, T]`` integer targets, already shifted; ``ignore_index`` on prompt and padding tokens.
    bias: optional ``[V]`` bias.
    beta: the preference temperature (> 0).
    alpha: weight of the NLL term (mean of ``lse - z_y`` over the valid chosen tokens).
    label_smoothing: epsilon in [0, 1] of the sigmoid/simpo losses.
    loss_type: ``"sigmoid"`` (CPO), ``"hinge"``, ``"ipo"`` or ``"simpo"`` (margin ``simpo_gamma / beta``).
    average_log_prob: average the token log-probs of a sequence instead of summing them (default: True for
        ipo and simpo, False otherwise, as TRL does). A sequence without valid tokens has log-prob 0.
    return_stats: also return ``chosen_logps``, ``rejected_logps``, ``chosen_rewards`` (beta * logp),
        ``rejected_rewards`` ([B] each) and ``nll_loss`` (no gradient).
    chunk_rows: rows per chunk. When all rows' dZ would not fit (``fce_core.plan.plan_pairs``), the rows go
        in groups of whole pairs of at most this many rows (at least one pair), and chunks of this many rows
        run over each group.
""" + ENGINE_ARG

LOGPROBS_SUMMARY = """Per-token log-probabilities ``log softmax(z)[y]`` (and entropies) of ``z = x @ weight.T + bias``,
without the logits: the primitive under GRPO / PPO / DPO / distillation losses."""

LOGPROBS_ARGS = """\
    x: ``[..., H]`` float32 / bfloat16 / float16 hidden states (any leading shape).
    weight: ``[V, H]`` LM head, same dtype as ``x``.
    targets: ``x.shape[:-1]`` integer token ids, already shifted; ``ignore_index`` rows give 0.
    bias: optional ``[V]`` bias.
    ignore_index: target value that marks a row to ignore (default -100).
    softcap: c > 0 applies ``c * tanh(logits / c)`` first (Gemma-2/3), or None.
    temperature: the (softcapped) logits are divided by it (> 0) before the softmax.
    return_entropy: also return each row's entropy ``lse(z) - sum_c p_c z_c``.
    chunk_rows: rows per chunk (default from the logits budget: see ``fce_core.plan``).
""" + ENGINE_ARG

LOGPROBS_RETURNS = """``logp`` (float32, the shape of targets; 0 on ignored rows), and ``entropy`` likewise when
asked."""


def doc(summary, args, *, framework="", framework_args="", returns="", raises=""):
    """Set the decorated function's docstring: the summary, the framework's notes, the shared and the
    framework's arguments, Returns and Raises."""
    parts = [summary.strip() + "\n"]
    if framework:
        parts.append("\n" + framework.strip() + "\n")
    parts.append("\nArgs:\n" + args + framework_args)  # both already indented by 4
    for title, text in (("Returns", returns), ("Raises", raises)):
        if text:
            parts.append(f"\n{title}:\n    " + text.strip().replace("\n", "\n    ") + "\n")

    def decorate(fn):
        fn.__doc__ = "".join(parts)
        return fn

    return decorate

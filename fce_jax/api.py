"""Public signature of `fused_lce` (docs/SPEC.md §1): checks, operand preparation, and the choice of
autodiff rule. Twin: fce_torch/api.py."""
import jax
import jax.numpy as jnp

from fce_core.contract import check_normalizer, check_options
from fce_core.options import FlceOptions

from .autodiff import precomputed, recompute
from .checks import check_tensors, check_values
from .flce import rows_backward, rows_forward, run_precomputed
from .sums import pairwise_sum

F32 = jnp.float32


def normalizer_array(normalizer):
    """`normalizer` (None, a scalar or a pair (D, n)) as a float32 [2] array (no gradient)."""
    check_normalizer(normalizer)
    if normalizer is None:
        return None
    items = normalizer if isinstance(normalizer, (tuple, list)) else (normalizer, normalizer)
    items = items * 2 if len(items) == 1 else items
    return jax.lax.stop_gradient(jnp.stack([jnp.asarray(v, F32).reshape(()) for v in items]))


def flce_outputs(x, weight, targets, *, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                 z_loss=0.0, softcap=None, class_weights=None, normalizer=None, token_scaling=False,
                 chunk_rows=None):
    """Checks, then (loss, z stat, lse, correct, amax) over the flattened rows, differentiable in x, weight
    and bias."""
    check_options(reduction, label_smoothing, z_loss, softcap)
    hidden, vocab = check_tensors(x, weight, targets, bias, class_weights)
    check_values(targets, vocab, ignore_index, class_weights)
    opt = FlceOptions(ignore_index=int(ignore_index), reduction=reduction, label_smoothing=float(label_smoothing),
                      z_loss=float(z_loss), softcap=None if softcap is None else float(softcap),
                      token_scaling=bool(token_scaling), chunk_rows=chunk_rows)
    x2 = jnp.reshape(x, (-1, hidden))
    y = jnp.reshape(targets, (-1,)).astype(jnp.int32)
    cw = None if class_weights is None else jax.lax.stop_gradient(jnp.asarray(class_weights, F32))
    norm = normalizer_array(normalizer) if reduction == "mean" else None
    if reduction == "none":
        return recompute(rows_forward, rows_backward, opt, x2, weight, bias, y, cw, norm)
    loss, *extras = precomputed(run_precomputed, opt, x2, weight, bias, y, cw, norm)
    return (loss, *extras)


def fused_lce(x, weight, targets, *, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              z_loss=0.0, softcap=None, class_weights=None, normalizer=None, token_scaling=False,
              return_stats=False, chunk_rows=None):
    """Fused linear cross-entropy: ``cross_entropy(x @ weight.T + bias, targets)`` without the logits.

    Works under ``jax.jit``, ``jax.grad``, ``jax.value_and_grad`` and ``jax.vjp`` (a custom VJP: the forward pass
    of a differentiated "mean"/"sum" loss computes the gradients, chunk by chunk; the plain primal call computes
    the loss only, one GEMM per chunk).

    Args:
        x: ``[..., H]`` float32 / bfloat16 / float16 hidden states (any leading shape).
        weight: ``[V, H]`` LM head (may be the tied embedding table), same dtype as ``x``.
        targets: ``x.shape[:-1]`` integer class indices, already shifted; ``ignore_index`` rows take no part
            (the rows are put valid-first and the chunks past the last valid row never run).
        bias: optional ``[V]`` bias (float32 with 16-bit ``x`` is fine; its gradient comes back in its dtype).
        ignore_index: target value that marks a row to ignore (default -100).
        reduction: ``"mean"`` (CE over the class-weighted count D of valid rows, z-loss over their count n),
            ``"sum"`` or ``"none"`` (per row, 0 for ignored rows).
        label_smoothing: epsilon in [0, 1] (PyTorch's definition, class-weighted like ``F.cross_entropy``).
        z_loss: coefficient s >= 0 of the PaLM z-loss ``s * lse**2``.
        softcap: c > 0 applies ``c * tanh(logits / c)`` before the softmax (Gemma-2/3), or None.
        class_weights: optional ``[V]`` float weights of any real value (no gradient flows to them).
        normalizer: for "mean", the denominators to use instead of this call's: a scalar (D = n) or a pair
            (D, n), e.g. the global counts over data-parallel shards or micro-batches. The scale is folded into
            the gradient once. Ignored for "sum" and "none".
        token_scaling: scale each row's loss and gradient by its stop-gradient p(target).
        return_stats: also return a dict with ``lse`` (float32, shape of targets; 0 on ignored rows), ``z_loss``
            (the z-loss part of the loss, reduced the same way), ``accuracy`` (fraction of valid rows whose first
            argmax is the target; per-row 0/1 for "none") and ``argmax`` (int32 first argmax per row, -1 on
            ignored rows). The stats carry no gradient.
        chunk_rows: rows per chunk (default from the logits budget: see ``fce_core.plan``).

    Returns:
        The float32 loss (scalar, or ``targets.shape`` for "none"), and the stats dict when requested. float32
        inputs follow ``jax_default_matmul_precision`` (IEEE float32 when unset).

    Raises:
        ValueError: naming the argument, for shape/dtype mismatches and bad options; for out-of-range
            targets and non-finite class weights when their values are concrete (not traced).
    """
    loss, zstat, lse, correct, amax = flce_outputs(
        x, weight, targets, bias=bias, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, class_weights=class_weights,
        normalizer=normalizer, token_scaling=token_scaling, chunk_rows=chunk_rows)
    lead = tuple(targets.shape)
    if reduction == "none":
        loss, zstat = loss.reshape(lead), zstat.reshape(lead)
    if not return_stats:
        return loss
    return loss, stats(targets, ignore_index, reduction, zstat, lse, correct, amax)


def stats(targets, ignore_index, reduction, zstat, lse, correct, amax):
    """The stats dict of `fused_lce` (leading shape of the targets), without gradient."""
    lead = tuple(targets.shape)
    valid = jnp.reshape(targets, (-1,)) != ignore_index
    if reduction == "none":
        accuracy = correct.reshape(lead)
    else:
        n_valid = jnp.sum(valid.astype(jnp.int32)).astype(F32)
        accuracy = jnp.where(n_valid > 0, pairwise_sum(correct) / jnp.maximum(n_valid, 1.0), 0.0)
    argmax = jnp.where(valid, amax, -1).reshape(lead)
    out = {"lse": lse.reshape(lead), "z_loss": zstat, "accuracy": accuracy, "argmax": argmax}
    return jax.tree.map(jax.lax.stop_gradient, out)

"""Drop-ins for Liger-Kernel 0.8.5's fused linear cross-entropy and fused linear CPO (SPEC §2), on fce.

Each name mirrors one of Liger's, with the same arguments (positional order included) and the same outputs:

======================================  ================================================================
fce_torch.liger                          liger_kernel (0.8.5)
======================================  ================================================================
``FusedLinearCrossEntropyLoss``          ``transformers.LigerFusedLinearCrossEntropyLoss``
``liger_fused_linear_cross_entropy``     ``transformers.functional.liger_fused_linear_cross_entropy``
``FusedLinearCrossEntropyFunction``      ``ops.LigerFusedLinearCrossEntropyFunction`` (``.apply`` only)
``CrossEntropyOutput``                   ``transformers.functional.CrossEntropyOutput``
``FusedLinearCPOLoss``                   ``chunked_loss.LigerFusedLinearCPOLoss``
``FusedLinearCPOFunction``               ``chunked_loss.cpo_loss.LigerFusedLinearCPOFunction`` (``.apply``)
``liger_fused_linear_cpo``               ``chunked_loss.functional.liger_fused_linear_cpo``
======================================  ================================================================

They are thin adapters: the cross-entropy goes through `fce_torch.fused_lce` (its ``token_scaling``,
class weights, z-loss, softcap, label smoothing and ``return_stats``), the CPO loss through
`fce_torch.fused_cpo_loss`. Where fce and Liger differ, on purpose:

* The weight gradient is always accumulated in float32 (then returned in the weight's dtype), so
  ``accum_dtype`` may be ``None`` or ``torch.float32`` (both mean that); another dtype raises
  NotImplementedError rather than silently accumulating in float32 when something else was asked for.
* Gradients are computed by fce's own autograd (for "mean"/"sum" in the forward, as Liger does; for "none"
  the backward recomputes). They flow to ``_input``, ``weight`` and ``bias`` whichever of them requires grad.
* No NaN where Liger divides by zero: a batch without valid rows gives loss 0 and ``token_accuracy`` 0
  (Liger: 0/0); a CPO sequence without valid tokens has log-prob 0 with ``average_log_prob`` (Liger: NaN),
  and the NLL of a batch without valid chosen tokens is 0 (Liger: NaN).
* Bad arguments raise ValueError naming the argument (Liger: AssertionError or a Triton error), and targets
  outside [0, V) other than ``ignore_index`` raise ValueError (fce's one host check).
* Any leading shape of ``_input`` is accepted (Liger: [BT, H] only); per-row outputs have ``target``'s shape.
* ``CrossEntropyOutput`` is a NamedTuple (Liger's is a dataclass): same fields and attribute access, and it
  also unpacks as a 4-tuple.
"""
from typing import NamedTuple

import torch

from fce_core.contract import check_cpo_options, check_reduction, check_smoothing, check_softcap
from fce_core.options import LOSS_TYPES

from .api import fused_lce
from .cpo import fused_cpo_loss
from .dropin import check_flag, keep_arguments
from .sums import pairwise_sum

F32 = torch.float32

__all__ = ["CrossEntropyOutput", "FusedLinearCrossEntropyLoss", "FusedLinearCrossEntropyFunction",
           "liger_fused_linear_cross_entropy", "fused_linear_cross_entropy", "FusedLinearCPOLoss",
           "FusedLinearCPOFunction", "liger_fused_linear_cpo"]


class CrossEntropyOutput(NamedTuple):
    """What Liger's FLCE returns when a ``return_*`` flag is set (the fields of Liger's dataclass).

    Attributes:
        loss: the float32 loss (scalar, or per row for ``reduction="none"``).
        z_loss: the z-loss part of ``loss`` (``lse_square_scale * lse**2``, reduced like the loss, times p(y)
            with token scaling) in the input's dtype, as Liger returns it; None unless ``return_z_loss``.
        token_accuracy: float32 fraction of valid rows whose first argmax is the target (per row 0/1, 0 on
            ignored rows, for "none"); None unless ``return_token_accuracy``.
        predicted_tokens: int64 first argmax of each row, -1 on ignored rows, ``target``'s shape; None unless
            ``return_predicted_tokens``.
    """
    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------- checks

def _check_accum_dtype(accum_dtype):
    if accum_dtype not in (None, torch.float32):
        raise NotImplementedError(
            f"accum_dtype={accum_dtype}: fce always accumulates the weight and bias gradients in float32 "
            "(accum_dtype None or torch.float32)")


def _check_positive_int(name, value):
    """A Liger chunking argument that fce accepts and ignores (it plans its own chunks)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_ce_impl(ce_impl, ce_mode, chunk_mem_const):
    if ce_impl is not None or ce_mode is not None:
        raise NotImplementedError(
            f"ce_impl={ce_impl!r}, ce_mode={ce_mode!r}: these select one of Liger's inner cross-entropy "
            "backends; fce has a single implementation (pass None)")
    _check_positive_int("chunk_mem_const", chunk_mem_const)


def _check_flce_options(reduction, label_smoothing, softcap, return_z_loss, accum_dtype, use_token_scaling,
                        return_token_accuracy, return_predicted_tokens):
    """Liger's constructor checks (as ValueError), and what fce does not support."""
    check_reduction(reduction)
    check_smoothing(label_smoothing)
    check_softcap(softcap)
    for name, value in (("return_z_loss", return_z_loss), ("use_token_scaling", use_token_scaling),
                        ("return_token_accuracy", return_token_accuracy),
                        ("return_predicted_tokens", return_predicted_tokens)):
        check_flag(name, value)
    _check_accum_dtype(accum_dtype)


# ------------------------------------------------------------------------------- fused linear cross-entropy

def _flce(_input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
          softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
          return_predicted_tokens):
    """Liger's 4-tuple (loss, z_loss, token_accuracy, predicted_tokens) from one `fused_lce` call."""
    _check_flce_options(reduction, label_smoothing, softcap, return_z_loss, accum_dtype, use_token_scaling,
                        return_token_accuracy, return_predicted_tokens)
    loss, stats = fused_lce(_input, weight, target, bias=bias, ignore_index=ignore_index, reduction=reduction,
                            label_smoothing=label_smoothing, z_loss=lse_square_scale, softcap=softcap,
                            class_weights=ce_weight, token_scaling=use_token_scaling, return_stats=True)
    z_loss = stats["z_loss"].to(_input.dtype) if return_z_loss else None
    accuracy = stats["accuracy"] if return_token_accuracy else None
    predicted = stats["argmax"] if return_predicted_tokens else None
    return loss, z_loss, accuracy, predicted


class FusedLinearCrossEntropyFunction:
    """Liger's ``LigerFusedLinearCrossEntropyFunction``: call ``.apply`` with its positional arguments.

    ``apply(_input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
    label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
    use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False, ce_impl=None,
    ce_mode=None, chunk_mem_const=1)`` returns Liger's 4-tuple ``(loss, z_loss, token_accuracy,
    predicted_tokens)``; an output not asked for is None (see `CrossEntropyOutput` for dtypes and shapes).

    This is not itself a ``torch.autograd.Function``: the loss is differentiable through fce's op, and the
    other three outputs carry no gradient (as Liger's). ``ce_impl``/``ce_mode`` (Liger's choice of inner
    cross-entropy backend) must be None; ``chunk_mem_const`` (Liger's logits budget per chunk) is checked
    (a positive int) and has no effect: fce plans its own chunks (``fce_core.plan``).
    """

    supports_inner_impl_dispatch = True  # Liger's functional looks for it before passing the last 3 args

    @staticmethod
    def apply(_input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
              label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
              use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False, ce_impl=None,
              ce_mode=None, chunk_mem_const=1):
        _check_ce_impl(ce_impl, ce_mode, chunk_mem_const)
        return _flce(_input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
                     reduction, softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
                     return_predicted_tokens)


def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                                     lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                                     return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                                     return_token_accuracy=False, return_predicted_tokens=False,
                                     chunk_mem_const=1):
    """Liger's functional ``liger_fused_linear_cross_entropy``, computed by `fce_torch.fused_lce`.

    Args:
        input: ``[BT, H]`` hidden states (any leading shape is accepted), float32/bfloat16/float16.
        weight: ``[V, H]`` LM head, same dtype as ``input``.
        target: ``input.shape[:-1]`` integer targets (already shifted); ``ignore_index`` rows are ignored.
        bias: optional ``[V]`` bias.
        ce_weight: optional ``[V]`` float class weights (``F.cross_entropy``'s ``weight=``).
        ignore_index: the target value of ignored rows (any int, also one inside [0, V)).
        lse_square_scale: the z-loss coefficient (``lse_square_scale * lse**2`` per row).
        label_smoothing: in [0, 1], PyTorch's definition (class-weighted like ``F.cross_entropy``).
        reduction: "mean" (CE over the class-weighted count of valid rows, z-loss over their count), "sum" or
            "none" (per row, 0 on ignored rows).
        softcap: ``softcap * tanh(logits / softcap)`` before the softmax (> 0), or None.
        return_z_loss, return_token_accuracy, return_predicted_tokens: also return these (see
            `CrossEntropyOutput`).
        accum_dtype: None or torch.float32: fce always accumulates dW (and db) in float32.
        use_token_scaling: scale each row's loss (z-loss included) and gradient by its stop-gradient
            probability of the target, p(y) = softmax(z)_y.
        chunk_mem_const: Liger's transient-logits budget; checked (a positive int), no effect in fce.

    Returns:
        The float32 loss when no ``return_*`` flag is set, else a `CrossEntropyOutput`.

    Raises:
        ValueError: bad options or tensors (named), targets outside [0, V) other than ``ignore_index``.
        NotImplementedError: ``accum_dtype`` other than None/float32.
    """
    loss, z_loss, accuracy, predicted = FusedLinearCrossEntropyFunction.apply(
        input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
        softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy, return_predicted_tokens,
        None, None, chunk_mem_const)
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        return loss
    return CrossEntropyOutput(loss=loss, z_loss=z_loss, token_accuracy=accuracy, predicted_tokens=predicted)


fused_linear_cross_entropy = liger_fused_linear_cross_entropy


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """Liger's ``LigerFusedLinearCrossEntropyLoss`` (same constructor, call and outputs), computed by fce.

    ``forward(lin_weight, _input, target, bias=None)`` returns the float32 loss, or a `CrossEntropyOutput`
    when ``return_z_loss``, ``return_token_accuracy`` or ``return_predicted_tokens`` is set. Every argument
    means what it means in `liger_fused_linear_cross_entropy`: ``ce_weight`` are the class weights,
    ``lse_square_scale`` the z-loss coefficient, ``use_token_scaling`` scales each row's loss and gradient
    by its stop-gradient p(target), ``accum_dtype`` may be None or torch.float32 (fce accumulates the weight
    gradient in float32 whatever it says; another dtype raises NotImplementedError).

    Raises:
        ValueError: at construction for an unknown ``reduction``, ``label_smoothing`` outside [0, 1],
            ``softcap <= 0`` or a non-bool ``return_*``/``use_token_scaling`` flag (Liger asserts these);
            at the call for bad tensors (named) or targets outside [0, V) other than ``ignore_index``.
        NotImplementedError: ``accum_dtype`` other than None / torch.float32.
    """

    def __init__(self, ce_weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                 reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                 return_token_accuracy=False, return_predicted_tokens=False):
        super().__init__()
        keep_arguments(self, locals())
        _check_flce_options(reduction, label_smoothing, softcap, return_z_loss, accum_dtype, use_token_scaling,
                            return_token_accuracy, return_predicted_tokens)

    def forward(self, lin_weight, _input, target, bias=None):
        loss, z_loss, accuracy, predicted = _flce(
            _input, lin_weight, target, bias, self.ce_weight, self.ignore_index, self.lse_square_scale,
            self.label_smoothing, self.reduction, self.softcap, self.return_z_loss, self.accum_dtype,
            self.use_token_scaling, self.return_token_accuracy, self.return_predicted_tokens)
        if not (self.return_z_loss or self.return_token_accuracy or self.return_predicted_tokens):
            return loss
        return CrossEntropyOutput(loss=loss, z_loss=z_loss, token_accuracy=accuracy, predicted_tokens=predicted)


# ---------------------------------------------------------------------------------------------------- CPO

_ROW_BLOCK = 4096  # rows per block of the fixed-order column sums (a power of two: the same tree as one sum)


def _column_sum(rows2d):
    """float32 [H] sum over the rows of a [R, H] tensor by one fixed pairwise tree, in blocks of rows so that
    the float32 copy stays small."""
    r = rows2d.shape[0]
    if r <= _ROW_BLOCK:
        return pairwise_sum(rows2d.to(F32).t())
    parts = [pairwise_sum(rows2d[i:i + _ROW_BLOCK].to(F32).t()) for i in range(0, r, _ROW_BLOCK)]
    return pairwise_sum(torch.stack(parts, dim=-1))


def _logits_mean(x_half, weight, bias):
    """Mean of the logits ``x @ weight.T + bias`` over every position and class of one half of the batch
    (ignored tokens included, as Liger's ``chosen_logits_mean``), without the logits:
    ``(sum_i x_i) . (sum_c w_c) + R * sum_c b_c`` over ``R * V``, in float32 with fixed-order sums."""
    x2 = x_half.reshape(-1, x_half.shape[-1])
    rows, vocab = x2.shape[0], weight.shape[0]
    total = pairwise_sum(_column_sum(x2) * _column_sum(weight))
    if bias is not None:
        total = total + float(rows) * pairwise_sum(bias.to(F32))
    return (total / float(max(rows * vocab, 1))).detach()


def _check_cpo_flags(compute_nll_loss, compiled, average_log_prob, chunk_size):
    for name, value in (("compute_nll_loss", compute_nll_loss), ("compiled", compiled),
                        ("average_log_prob", average_log_prob)):
        check_flag(name, value)
    _check_positive_int("chunk_size", chunk_size)


class FusedLinearCPOFunction:
    """Liger's ``LigerFusedLinearCPOFunction``: call ``.apply`` with its positional arguments.

    ``apply(_input, weight, target, bias=None, ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0,
    compute_nll_loss=True, compiled=True, average_log_prob=False, chunk_size=1)`` returns Liger's
    ``(loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss,
    chosen_rewards, rejected_rewards))``:

    * ``_input`` ``[2B, T, H]`` (B chosen sequences, then B rejected), ``target`` ``[2B, T]`` already shifted.
    * ``loss = mean_i L_i + alpha * nll_loss`` with the sigmoid CPO loss ``L_i = -(1-eps) logsigmoid(beta d_i)
      - eps logsigmoid(-beta d_i)``, ``d_i = chosen_logps_i - rejected_logps_i`` (`fce_torch.fused_cpo_loss`,
      loss_type "sigmoid"); differentiable in ``_input``, ``weight``, ``bias``. The seven statistics carry no
      gradient (as Liger's).
    * ``chosen_logps``/``rejected_logps`` ``[B]``: the sum (mean with ``average_log_prob``) of the valid
      tokens' log-probabilities; ``chosen_rewards``/``rejected_rewards`` ``beta *`` those.
    * ``nll_loss``: the mean of ``lse - z_y`` over the valid chosen tokens (0 when ``compute_nll_loss`` is
      False, which also drops it from the loss).
    * ``chosen_logits_mean``/``rejected_logits_mean``: the mean of the raw logits over ALL positions and
      classes of that half, ignored tokens included (Liger's definition), computed without logits as
      ``(sum_rows x) . (sum_c w_c) + rows * sum_c b_c`` in float32 with fixed-order sums (Liger sums the
      logits in the input dtype, so at 16 bits the two differ by that rounding).

    ``compiled`` (Liger's torch.compile of its chunk loop) and ``chunk_size`` (pairs per Liger chunk) are
    accepted and have no effect: fce runs its own kernels and plans its own chunks. All float32.
    """

    @staticmethod
    def apply(_input, weight, target, bias=None, ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0,
              compute_nll_loss=True, compiled=True, average_log_prob=False, chunk_size=1):
        _check_cpo_flags(compute_nll_loss, compiled, average_log_prob, chunk_size)
        loss, st = fused_cpo_loss(_input, weight, target, bias=bias, ignore_index=ignore_index, beta=beta,
                                  alpha=alpha if compute_nll_loss else 0.0, label_smoothing=label_smoothing,
                                  loss_type="sigmoid", average_log_prob=average_log_prob, return_stats=True)
        half = _input.shape[0] // 2
        nll = st["nll_loss"] if compute_nll_loss else torch.zeros_like(st["nll_loss"])
        with torch.no_grad():
            chosen_mean = _logits_mean(_input[:half], weight, bias)
            rejected_mean = _logits_mean(_input[half:], weight, bias)
        return loss, (st["chosen_logps"], st["rejected_logps"], chosen_mean, rejected_mean, nll,
                      st["chosen_rewards"], st["rejected_rewards"])


liger_fused_linear_cpo = FusedLinearCPOFunction.apply


class FusedLinearCPOLoss(torch.nn.Module):
    """Liger's ``LigerFusedLinearCPOLoss`` (same constructor and call), computed by `fce_torch.fused_cpo_loss`.

    ``forward(lin_weight, _input, target, bias=None)`` returns what `FusedLinearCPOFunction.apply` returns:
    ``(loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss,
    chosen_rewards, rejected_rewards))``.

    Args:
        ignore_index: the target value of prompt/padding tokens.
        beta: the preference temperature (> 0).
        alpha: weight of the NLL term (>= 0).
        label_smoothing: eps in [0, 1] of the sigmoid loss.
        compute_nll_loss: add ``alpha * nll_loss`` (else the NLL term and ``nll_loss`` are 0).
        compiled: accepted, no effect (Liger: torch.compile of its chunk loop).
        average_log_prob: average the token log-probabilities of a sequence instead of summing them.
        chunk_size: accepted (a positive int), no effect (Liger: pairs per chunk); fce plans its own chunks.

    Raises:
        ValueError: bad options (named) at construction or call; an odd batch, shape/dtype mismatches or
            targets outside [0, V) other than ``ignore_index`` at the call.
    """

    def __init__(self, ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0, compute_nll_loss=True,
                 compiled=True, average_log_prob=False, chunk_size=1):
        super().__init__()
        keep_arguments(self, locals())
        check_cpo_options("sigmoid", beta, alpha, label_smoothing, LOSS_TYPES)
        _check_cpo_flags(compute_nll_loss, compiled, average_log_prob, chunk_size)

    def forward(self, lin_weight, _input, target, bias=None):
        return FusedLinearCPOFunction.apply(_input, lin_weight, target, bias, self.ignore_index, self.beta,
                                            self.alpha, self.label_smoothing, self.compute_nll_loss,
                                            self.compiled, self.average_log_prob, self.chunk_size)

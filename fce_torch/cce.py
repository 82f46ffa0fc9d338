"""A drop-in for Apple's Cut Cross-Entropy (``cut_cross_entropy``), on fce.

``from fce_torch.cce import linear_cross_entropy, LinearCrossEntropy`` in place of
``from cut_cross_entropy import ...``: the signature and semantics are those of CCE's GitHub main (25.6.x:
``bias``, ``return_lse`` with a differentiable lse, ``shift`` as bool or int), which contain PyPI 25.1.1's
(whose keyword arguments all keep their meaning). The loss is computed by `fce_torch.api.flce_outputs` (the
engine of `fce_torch.fused_lce`).

What CCE's options mean here:

* ``impl``: every CCE name is accepted ("cce", "torch_compile", "cce_exact", "cce_kahan_full_c",
  "cce_kahan_full_e", "cce_kahan_full_c_full_e", "cce_kahan_full", or a `LinearCrossEntropyImpl`) and all of
  them are computed the same way, by fce's kernels: float32 logits from the input dtype, float32
  accumulation of the weight gradient, no gradient filtering. That is at least as accurate as CCE's most exact
  preset ("cce_exact"). Another name raises NotImplementedError, as CCE does.
* ``filter_eps`` ("auto", PyPI 25.1.1's "high", a float or None), ``accum_e_fp32``, ``accum_c_fp32``,
  ``filter_e_grad``, ``filter_c_grad``: CCE's speed/accuracy knobs of its backward (skipping small softmax
  entries, Kahan-summed gradients). They are checked and have no effect: fce never filters and always
  accumulates in float32.
* ``vocab_parallel_options``: must be None (NotImplementedError otherwise; fce's own vocab parallelism is a
  separate API).

Where fce and CCE differ, on purpose:

* ``reduction="mean"`` over a batch without valid rows gives 0 and zero gradients (CCE: NaN).
* Bad arguments raise ValueError naming the argument (CCE: AssertionError), including targets outside
  [0, V) other than ``ignore_index`` (fce's one host check; CCE reads out of bounds) and ``softcap <= 0``.
* The 4th positional argument is ``bias`` (CCE main); PyPI 25.1.1 had ``ignore_index`` there. A non-tensor
  4th argument raises TypeError instead of being taken for a bias.
* fce runs wherever Triton runs (also in the Triton interpreter on a CPU); CCE's "cce" impl needs an
  Ampere-or-newer GPU.
"""
import enum
from enum import auto

import torch

from fce_core.contract import check_reduction

from .api import flce_outputs
from .dropin import check_flag, keep_arguments

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "LinearCrossEntropy", "LinearCrossEntropyImpl", "linear_cross_entropy"]


class LinearCrossEntropyImpl(enum.IntEnum):
    """CCE's implementation names (same members and values as CCE main). fce computes them all alike."""
    CCE = auto()
    TORCH_COMPILE = auto()
    CCE_KAHAN_FULL_C = auto()
    CCE_KAHAN_FULL_E = auto()
    CCE_EXACT = auto()
    CCE_KAHAN_FULL_C_FULL_E = auto()
    CCE_KAHAN_FULL = auto()


IMPL_NAMES = frozenset(v.name.lower() for v in LinearCrossEntropyImpl)
LCE_IMPL_DEFAULT = LinearCrossEntropyImpl.CCE


def _impl_name(impl):
    if isinstance(impl, LinearCrossEntropyImpl):
        return impl.name.lower()
    if isinstance(impl, str) and impl in IMPL_NAMES:
        return impl
    raise NotImplementedError(f"{impl} is not implemented (CCE's implementations: {sorted(IMPL_NAMES)}; fce "
                              "computes all of them the same way)")


def _check_knobs(filter_eps, accum_e_fp32, accum_c_fp32, filter_e_grad, filter_c_grad):
    if not (filter_eps is None or filter_eps in ("auto", "high")
            or (isinstance(filter_eps, float) and not isinstance(filter_eps, bool))):
        raise ValueError(f"filter_eps must be 'auto', 'high', a float or None, got {filter_eps!r}")
    for name, value in (("accum_e_fp32", accum_e_fp32), ("accum_c_fp32", accum_c_fp32),
                        ("filter_e_grad", filter_e_grad), ("filter_c_grad", filter_c_grad)):
        check_flag(name, value)


def _shifted_targets(targets, shift, ignore_index):
    """targets[..., shift:] padded at the end with `shift` ignored positions: row t of e then predicts the
    target at t + shift, and the last `shift` rows are ignored (their chunks are skipped, e is not copied)."""
    if shift == 0:
        return targets
    pad = targets.new_full(targets.shape[:-1] + (shift,), ignore_index)
    return torch.cat([targets[..., shift:], pad], dim=-1)


def linear_cross_entropy(e, c, targets, bias=None, ignore_index=IGNORE_INDEX, softcap=None, reduction="mean",
                         shift=False, return_lse=False, filter_eps="auto", accum_e_fp32=False,
                         accum_c_fp32=False, filter_e_grad=True, filter_c_grad=True, impl=LCE_IMPL_DEFAULT,
                         vocab_parallel_options=None):
    """CCE's ``linear_cross_entropy``: ``cross_entropy(e @ c.T + bias, targets)`` without the logits.

    Args:
        e: ``[..., D]`` embeddings (float32 / bfloat16 / float16; under autocast, the autocast dtype).
        c: ``[V, D]`` classifier (the LM head), same dtype as ``e``.
        targets: ``e.shape[:-1]`` integer targets; ``ignore_index`` positions take no part.
        bias: optional ``[V]`` bias (CCE main).
        ignore_index: the target value of ignored positions (default -100).
        softcap: ``softcap * tanh(logits / softcap)`` after the bias (> 0), or None.
        reduction: "mean" (over the valid positions), "sum" or "none".
        shift: False/0, or True/k in [1, T): position t of ``e`` predicts ``targets[..., t + k]`` along the
            last axis (``True`` is 1: next-token prediction on unshifted labels); the last k positions of
            ``e`` get no loss and a zero gradient.
        return_lse: also return the float32 log-sum-exp of each position's (softcapped) logits,
            differentiable: a loss written on it (e.g. a z-loss) backpropagates into ``e``, ``c``, ``bias``.
        filter_eps, accum_e_fp32, accum_c_fp32, filter_e_grad, filter_c_grad: CCE's backward knobs;
            checked, no effect (see the module docstring).
        impl: any CCE implementation name; all are computed the same way by fce.
        vocab_parallel_options: must be None.

    Returns:
        The float32 loss: a scalar for "mean"/"sum"; for "none" the shape ``targets.shape`` with the last
        axis shortened by the shift (``[..., T - k]``; entry t is the loss of position t of ``e``, 0 where
        its target is ignored). With ``return_lse``, ``(loss, lse)``, lse of that same shape, 0 at ignored
        positions (CCE's layout).

    Raises:
        ValueError: shape/dtype mismatches or bad options (named), shift outside [0, T), a bias of another
            size than ``c.size(0)``, targets outside [0, V) other than ``ignore_index``.
        TypeError: a non-tensor 4th positional argument (PyPI 25.1.1's ``ignore_index`` position).
        NotImplementedError: an unknown ``impl``, or ``vocab_parallel_options``.
    """
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a tensor or None, got {bias!r}: since CCE 25.6 the 4th positional "
                        "argument of linear_cross_entropy is bias; pass ignore_index=... by keyword")
    _impl_name(impl)
    _check_knobs(filter_eps, accum_e_fp32, accum_c_fp32, filter_e_grad, filter_c_grad)
    if vocab_parallel_options is not None:
        raise NotImplementedError("vocab_parallel_options is not supported by fce's CCE drop-in")
    if not isinstance(targets, torch.Tensor) or targets.dim() < 1:
        raise ValueError("targets must be an integer tensor with at least one axis")
    if not isinstance(shift, int):
        raise ValueError(f"shift must be a bool or an int, got {shift!r}")
    shift = int(shift)
    if shift < 0 or shift >= targets.size(-1):
        raise ValueError(f"Shift must be in the range [0, {targets.size(-1)}). Got {shift}.")
    if bias is not None and (bias.dim() != 1 or bias.size(0) != c.size(0)):
        raise ValueError(f"Bias has a different number of elements than c. {bias.numel()} vs. {c.size(0)}.")

    y = _shifted_targets(targets, shift, ignore_index)
    loss, _, lse, _, _ = flce_outputs(e, c, y, bias=bias, ignore_index=ignore_index, reduction=reduction,
                                      softcap=softcap, lse_grad=bool(return_lse))
    keep = targets.size(-1) - shift
    if reduction == "none":
        loss = loss.view(targets.shape)[..., :keep]
    if not return_lse:
        return loss
    return loss, lse.view(targets.shape)[..., :keep]


class LinearCrossEntropy(torch.nn.Module):
    """CCE's ``LinearCrossEntropy`` module (CCE main's constructor): ``forward(e, c, targets, bias=None)``
    calls `linear_cross_entropy` with the options given here. The constructor's positional order is CCE
    main's (``shift`` before ``filter_eps``; PyPI 25.1.1 had ``filter_eps, shift, impl``)."""

    def __init__(self, ignore_index=IGNORE_INDEX, softcap=None, reduction="mean", shift=False, filter_eps="auto",
                 accum_e_fp32=False, accum_c_fp32=False, filter_e_grad=True, filter_c_grad=True,
                 impl=LCE_IMPL_DEFAULT, return_lse=False):
        super().__init__()
        keep_arguments(self, locals())
        _impl_name(impl)
        _check_knobs(filter_eps, accum_e_fp32, accum_c_fp32, filter_e_grad, filter_c_grad)
        check_reduction(reduction)

    def forward(self, e, c, targets, bias=None):
        return linear_cross_entropy(e, c, targets, bias=bias, ignore_index=self.ignore_index, softcap=self.softcap,
                                    reduction=self.reduction, shift=self.shift, return_lse=self.return_lse,
                                    filter_eps=self.filter_eps, accum_e_fp32=self.accum_e_fp32,
                                    accum_c_fp32=self.accum_c_fp32, filter_e_grad=self.filter_e_grad,
                                    filter_c_grad=self.filter_c_grad, impl=self.impl)

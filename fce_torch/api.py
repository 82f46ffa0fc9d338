"""Public signature and input validation of `fused_lce` (SPEC §1). Twin: fce_jax/api.py."""
import functools

import torch

from .engine import FusedLCENone, Options, PrecomputedGrad, flce_run, flce_sweep, totals
from .head import pairwise_sum

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
REDUCTIONS = ("mean", "sum", "none")


def check_options(reduction, label_smoothing, z_loss, softcap):
    """ValueError for an option outside its domain (shared with fused_cpo_loss where it applies)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not z_loss >= 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not softcap > 0.0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")


def check_tensors(x, weight, targets, bias, class_weights):
    """ValueError naming the argument for shape and dtype mismatches. Returns (H, V)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOATS:
        raise ValueError(f"x must be a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x))}")
    if not isinstance(weight, torch.Tensor) or weight.dtype not in FLOATS:
        raise ValueError(f"weight must be a float32/bfloat16/float16 tensor, got "
                         f"{getattr(weight, 'dtype', type(weight))}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be [V, H] with H = x.shape[-1]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    vocab, hidden = weight.shape
    if not isinstance(targets, torch.Tensor) or targets.dtype.is_floating_point or targets.dtype.is_complex \
            or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor, got {getattr(targets, 'dtype', type(targets))}")
    if tuple(targets.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal x's leading shape {tuple(x.shape[:-1])}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (vocab,)
                             or bias.dtype not in FLOATS):
        raise ValueError(f"bias must be a float tensor of shape ({vocab},), got "
                         f"{getattr(bias, 'shape', type(bias))}")
    if class_weights is not None and (not isinstance(class_weights, torch.Tensor)
                                      or tuple(class_weights.shape) != (vocab,)
                                      or not class_weights.dtype.is_floating_point):
        raise ValueError(f"class_weights must be a float tensor of shape ({vocab},), got "
                         f"{getattr(class_weights, 'shape', type(class_weights))}")
    for name, t in (("weight", weight), ("targets", targets), ("bias", bias), ("class_weights", class_weights)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return hidden, vocab


def check_values(targets, vocab, ignore_index, class_weights):
    """The one host synchronization: targets outside [0, V) (other than ignore_index), negative class weights.
    Returns the number of valid targets (not ignore_index), which lets the engine skip the ignored rows."""
    bad_target = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
    flags = [bad_target.any().long(), (targets != ignore_index).sum()]
    if class_weights is not None:
        flags.append((class_weights < 0).any().long())
    flags = torch.stack(flags).tolist()
    if flags[0]:
        raise ValueError(f"targets must be in [0, {vocab}) or ignore_index={ignore_index}")
    if len(flags) > 2 and flags[2]:
        raise ValueError("class_weights must be >= 0")
    return flags[1]


def prepare(x, weight, targets, bias, class_weights):
    """Flatten to rows, apply autocast's dtype, make operands contiguous (a documented copy when strided)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = targets.reshape(-1)
    if y.dtype not in (torch.int32, torch.int64):
        y = y.to(torch.int64)
    cw = None if class_weights is None else class_weights.to(torch.float32).contiguous()
    return x2, weight.contiguous(), y.contiguous(), None if bias is None else bias.contiguous(), cw


def fused_lce(x, weight, targets, *, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              z_loss=0.0, softcap=None, class_weights=None, return_stats=False, validate=True, chunk_rows=None):
    """Fused linear cross-entropy: ``cross_entropy(x @ weight.T + bias, targets)`` without the logits.

    Args:
        x: ``[..., H]`` float32 / bfloat16 / float16 hidden states (any leading shape).
        weight: ``[V, H]`` LM head (may be the tied embedding table), same dtype as ``x``.
        targets: ``x.shape[:-1]`` integer class indices, already shifted; ``ignore_index`` rows are skipped:
            the rows are put valid-first and the chunks past the last valid row never run (their GEMMs
            shrink with the share of ignored rows, e.g. prompt tokens).
        bias: optional ``[V]`` bias.
        ignore_index: target value that marks a row to ignore (default -100).
        reduction: ``"mean"`` (CE over the class-weighted count of valid rows, z-loss over their count),
            ``"sum"`` or ``"none"`` (per row, 0 for ignored rows).
        label_smoothing: epsilon in [0, 1] (PyTorch's definition, class-weighted like ``F.cross_entropy``).
        z_loss: coefficient s >= 0 of the PaLM z-loss ``s * lse**2`` (Liger's ``lse_square_scale``).
        softcap: c > 0 applies ``c * tanh(logits / c)`` before the softmax (Gemma-2/3), or None.
        class_weights: optional ``[V]`` non-negative float weights (``F.cross_entropy``'s ``weight=``).
        return_stats: also return a dict with ``lse`` (float32, shape of targets; 0 on ignored rows), ``z_loss``
            (the z-loss part of the loss, reduced the same way) and ``accuracy`` (fraction of valid rows whose first
            argmax is the target; per-row 0/1 for "none").
        validate: check targets are in range and class weights non-negative (one host synchronization, which
            also counts the valid rows so that the ignored ones are skipped); pass False under CUDA graphs.
            Out-of-range targets then give undefined results, and every row is computed (same values; the last
            bits of the gradients may differ, as the GEMMs then run over other rows).
        chunk_rows: rows per chunk (default: float32 logits of one chunk take at most 1 GiB, or 512 MiB when
            every chunk's dZ is kept: see ``chunking.plan``).

    Returns:
        The float32 loss (scalar, or ``targets.shape`` for "none"), and the stats dict when requested.
        Gradients flow to ``x``, ``weight`` and ``bias`` in their own dtypes; under ``torch.no_grad()`` only
        the loss is computed (one GEMM per chunk). Under autocast the GEMMs run in the autocast dtype.

    Raises:
        ValueError: naming the argument, for shape/dtype mismatches, bad options, out-of-range targets or
            negative class weights (the last two only when ``validate``).
    """
    check_options(reduction, label_smoothing, z_loss, softcap)
    hidden, vocab = check_tensors(x, weight, targets, bias, class_weights)
    valid_rows = check_values(targets, vocab, ignore_index, class_weights) if validate else None
    lead_shape = tuple(targets.shape)
    opt = Options(ignore_index=int(ignore_index), reduction=reduction, label_smoothing=float(label_smoothing),
                  z_loss=float(z_loss), softcap=None if softcap is None else float(softcap),
                  chunk_rows=chunk_rows)
    x2, w, y, b, cw = prepare(x, weight, targets, bias, class_weights)
    differentiable = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x2, w, b))
    with torch.autocast(x.device.type, enabled=False):
        if differentiable and reduction == "none":
            loss, zstat, lse, correct = FusedLCENone.apply(x2, w, b, y, cw, opt, valid_rows)
        elif differentiable:
            run = functools.partial(flce_run, y=y, class_weights=cw, opt=opt, valid_rows=valid_rows)
            loss, zstat, lse, correct = PrecomputedGrad.apply(x2, w, b, run)
        else:
            rows, *_ = flce_sweep(x2, w, y, b, cw, opt, valid_rows=valid_rows)
            (loss, zstat), lse, correct = totals(rows, reduction), rows["lse"], rows["correct"]
    if reduction == "none":
        loss, zstat = loss.view(lead_shape), zstat.view(lead_shape)
    if not return_stats:
        return loss
    if reduction == "none":
        accuracy = correct.view(lead_shape)
    else:
        n_valid = (y != ignore_index).sum().to(torch.float32)
        accuracy = torch.where(n_valid > 0, pairwise_sum(correct) / n_valid.clamp(min=1.0), 0.0)
    return loss, {"lse": lse.view(lead_shape), "z_loss": zstat, "accuracy": accuracy}

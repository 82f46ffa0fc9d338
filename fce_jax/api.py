"""Public signature and input validation of `fused_lce` (SPEC §1). Twin: fce_torch/api.py."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .engine import Options, flce_run, fused_lce_none, precomputed_grad
from .head import pairwise_sum

FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)
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


def _is_float(a):
    return hasattr(a, "dtype") and any(a.dtype == f for f in FLOATS)


def check_tensors(x, weight, targets, bias, class_weights):
    """ValueError naming the argument for shape and dtype mismatches. Returns (H, V)."""
    if not _is_float(x):
        raise ValueError(f"x must be a float32/bfloat16/float16 array, got {getattr(x, 'dtype', type(x))}")
    if not _is_float(weight):
        raise ValueError(f"weight must be a float32/bfloat16/float16 array, got "
                         f"{getattr(weight, 'dtype', type(weight))}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if x.ndim < 1 or weight.ndim != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be [V, H] with H = x.shape[-1]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    vocab, hidden = weight.shape
    if not hasattr(targets, "dtype") or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be an integer array, got {getattr(targets, 'dtype', type(targets))}")
    if tuple(targets.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal x's leading shape {tuple(x.shape[:-1])}")
    if bias is not None and (not _is_float(bias) or tuple(bias.shape) != (vocab,)):
        raise ValueError(f"bias must be a float array of shape ({vocab},), got {getattr(bias, 'shape', type(bias))}")
    if class_weights is not None and (not hasattr(class_weights, "dtype")
                                      or not jnp.issubdtype(class_weights.dtype, jnp.floating)
                                      or tuple(class_weights.shape) != (vocab,)):
        raise ValueError(f"class_weights must be a float array of shape ({vocab},), got "
                         f"{getattr(class_weights, 'shape', type(class_weights))}")
    return hidden, vocab


def _concrete(a):
    return a is not None and not isinstance(a, jax.core.Tracer)


def check_values(targets, vocab, ignore_index, class_weights):
    """Out-of-range targets and negative class weights raise ValueError when the values are concrete (under
    tracing an out-of-range row gives a NaN loss instead)."""
    if _concrete(targets):
        t = np.asarray(targets)
        if np.any(((t < 0) | (t >= vocab)) & (t != ignore_index)):
            raise ValueError(f"targets must be in [0, {vocab}) or ignore_index={ignore_index}")
    if _concrete(class_weights) and np.any(np.asarray(class_weights) < 0):
        raise ValueError("class_weights must be >= 0")


def fused_lce(x, weight, targets, *, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              z_loss=0.0, softcap=None, class_weights=None, return_stats=False, chunk_rows=None):
    """Fused linear cross-entropy: ``cross_entropy(x @ weight.T + bias, targets)`` without the logits.

    Works under ``jax.jit``, ``jax.grad`` and ``jax.value_and_grad`` (a custom VJP: the forward pass of a
    differentiated "mean"/"sum" loss computes the gradients, chunk by chunk; the plain primal call computes
    the loss only, one GEMM per chunk).

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
        z_loss: coefficient s >= 0 of the PaLM z-loss ``s * lse**2``.
        softcap: c > 0 applies ``c * tanh(logits / c)`` before the softmax (Gemma-2/3), or None.
        class_weights: optional ``[V]`` non-negative float weights (no gradient flows to them).
        return_stats: also return a dict with ``lse`` (float32, shape of targets; 0 on ignored rows), ``z_loss``
            (the z-loss part of the loss, reduced the same way) and ``accuracy`` (fraction of valid rows whose first
            argmax is the target; per-row 0/1 for "none"). The stats carry no gradient.
        chunk_rows: rows per chunk (default: float32 logits of one chunk take at most 1 GiB, or 512 MiB when
            every chunk's dZ is kept: see ``chunking.plan``).

    Returns:
        The float32 loss (scalar, or ``targets.shape`` for "none"), and the stats dict when requested.

    Raises:
        ValueError: naming the argument, for shape/dtype mismatches and bad options; for out-of-range
            targets and negative class weights when their values are concrete (not traced).
    """
    check_options(reduction, label_smoothing, z_loss, softcap)
    hidden, vocab = check_tensors(x, weight, targets, bias, class_weights)
    check_values(targets, vocab, ignore_index, class_weights)
    lead_shape = tuple(targets.shape)
    opt = Options(ignore_index=int(ignore_index), reduction=reduction, label_smoothing=float(label_smoothing),
                  z_loss=float(z_loss), softcap=None if softcap is None else float(softcap),
                  chunk_rows=chunk_rows)
    x2 = jnp.reshape(x, (-1, hidden))
    y = jnp.reshape(targets, (-1,)).astype(jnp.int32)
    cw = None if class_weights is None else jax.lax.stop_gradient(jnp.asarray(class_weights, jnp.float32))
    if reduction == "none":
        loss, zstat, lse, correct = fused_lce_none(x2, weight, bias, y, cw, opt)
    else:
        run = functools.partial(flce_run, y=y, class_weights=cw, opt=opt)
        loss, zstat, lse, correct = precomputed_grad(x2, weight, bias, run)
    if reduction == "none":
        loss, zstat = loss.reshape(lead_shape), zstat.reshape(lead_shape)
    if not return_stats:
        return loss
    if reduction == "none":
        accuracy = correct.reshape(lead_shape)
    else:
        n_valid = jnp.sum((y != ignore_index).astype(jnp.int32)).astype(jnp.float32)
        accuracy = jnp.where(n_valid > 0, pairwise_sum(correct) / jnp.maximum(n_valid, 1.0), 0.0)
    stats = {"lse": lse.reshape(lead_shape), "z_loss": zstat, "accuracy": accuracy}
    return loss, jax.tree.map(jax.lax.stop_gradient, stats)

"""The chunked engine (C3): logits GEMM -> row statistics -> head -> dlogits -> dX and dW GEMMs, per chunk.

`sweep` runs it over all rows (the first chunk, a `lax.scan` over the full chunks after it, the tail chunk:
the same order as fce_torch's loop); `fused_lce_rows` pairs it with `jax.custom_vjp`. The primal call without
differentiation computes the loss only; for "mean"/"sum" the forward rule computes the gradients and the
backward only scales them; for "none" the backward sweeps again with the per-row cotangent folded into the
head (four GEMMs). Twin: fce_torch/engine.py.
"""
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from . import gemm
from .chunking import chunk_rows
from .dlogits import accumulate_bias_grad, dlogits
from .head import MEAN, NONE, ROW_OUTPUTS, SUM, flce_head, pairwise_sum
from .row_stats import row_stats

F32 = jnp.float32
_MODES = {"mean": MEAN, "sum": SUM, "none": NONE}


@dataclass(frozen=True)
class Options:
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    chunk_rows: int | None = None


def reduction_scalars(y, class_weights, ignore_index, vocab):
    """(float32 [D, n, W_sum], w_y [N] or None): class-weighted and plain counts of valid rows, the sum of
    class weights, and each row's target class weight."""
    valid = y != ignore_index
    n = jnp.sum(valid.astype(jnp.int32)).astype(F32)
    if class_weights is None:
        return jnp.stack([n, n, jnp.asarray(vocab, F32)]), None
    w_y = jnp.where(valid, class_weights[jnp.where((y >= 0) & (y < vocab), y, 0)], 0.0)
    return jnp.stack([pairwise_sum(w_y), n, pairwise_sum(class_weights)]), w_y


def _chunk(x_c, y_c, wy_c, g_c, w, bias, cw, scalars, opt, grads, dw_dtype, trace=None):
    """One chunk: (rows dict, dX_c, dZ) — dZ is None when no gradient is asked for."""
    vocab = w.shape[0]
    z = gemm.mm(x_c, w, F32, b_t=True)
    m, zy, amax, s_part, q_part = row_stats(z, bias, y_c, cw, softcap=opt.softcap,
                                            smoothing=opt.label_smoothing > 0)
    rows = flce_head(m, pairwise_sum(s_part), zy, None if q_part is None else pairwise_sum(q_part), amax, y_c,
                     wy_c, g_c, scalars, mode=_MODES[opt.reduction], ignore_index=opt.ignore_index,
                     label_smoothing=opt.label_smoothing, z_loss=opt.z_loss, vocab=vocab)
    if trace is not None:
        trace["logits"] = z
    if not any(grads):
        return rows, None, None
    dz = dlogits(z, bias, y_c, cw, rows["lse"], rows["a"], rows["b"], rows["c"], softcap=opt.softcap,
                 dtype=x_c.dtype)
    if trace is not None:
        trace["dlogits"] = dz
    dx_c = gemm.mm(dz, w, x_c.dtype) if grads[0] else None
    return rows, dx_c, dz


def sweep(x, w, y, bias, class_weights, opt, *, grads=(False, False, False), row_cotangent=None, trace=None):
    """One pass over all rows. x [N, H], w [V, H], y [N]. `grads` = which of (dx, dw, db) to compute.

    Returns (rows, dx, dw, db): rows = dict of float32 [N] (ROW_OUTPUTS); dw is float32 when accumulated over
    several chunks, in the input dtype for a single 16-bit chunk.
    """
    n_rows = x.shape[0]
    vocab = w.shape[0]
    need_dx, need_dw, need_db = grads
    scalars, w_y = reduction_scalars(y, class_weights, opt.ignore_index, vocab)
    if n_rows == 0:
        rows = {k: jnp.zeros((0,), F32) for k in ROW_OUTPUTS}
        return (rows, jnp.zeros_like(x) if need_dx else None, jnp.zeros_like(w) if need_dw else None,
                jnp.zeros((vocab,), F32) if need_db else None)
    nc = chunk_rows(n_rows, vocab, opt.chunk_rows)
    n_full, tail = divmod(n_rows, nc)
    per_row = (x, y, w_y, row_cotangent)

    def piece(arr, r0, r1):
        return None if arr is None else arr[r0:r1]

    def step(carry, xs, first=False, last=False):
        dw, db = carry
        x_c, y_c, wy_c, g_c = xs
        rows, dx_c, dz = _chunk(x_c, y_c, wy_c, g_c, w, bias, class_weights, scalars, opt, grads, None,
                                trace if first else None)
        if need_dw:
            dw_dtype = w.dtype if (first and last) else F32
            dw = gemm.mm(dz, x_c, dw_dtype, a_t=True) if first else gemm.addmm(dw, dz, x_c, a_t=True)
        if need_db:
            db = accumulate_bias_grad(dz, db)
        return (dw, db), (rows, dx_c)

    carry = (None, jnp.zeros((vocab,), F32) if need_db else None)
    carry, first_out = step(carry, [piece(a, 0, nc) for a in per_row], first=True, last=n_rows == nc)
    outs = [first_out]
    if n_full > 1:
        mid = [None if a is None else a[nc:n_full * nc].reshape(n_full - 1, nc, *a.shape[1:]) for a in per_row]
        carry, (rows_mid, dx_mid) = lax.scan(step, carry, mid)
        outs.append(({k: v.reshape(-1) for k, v in rows_mid.items()},
                     None if dx_mid is None else dx_mid.reshape(-1, x.shape[1])))
    if tail:
        carry, tail_out = step(carry, [piece(a, n_full * nc, n_rows) for a in per_row])
        outs.append(tail_out)
    rows = {k: jnp.concatenate([o[0][k] for o in outs]) for k in ROW_OUTPUTS}
    dx = jnp.concatenate([o[1] for o in outs]) if need_dx else None
    return rows, dx, carry[0], carry[1]


def totals(rows, reduction):
    """(loss, z_loss stat) from the per-row values: fixed-order sums for "mean"/"sum", the rows for "none"."""
    if reduction == "none":
        return rows["loss"], rows["zrow"]
    return pairwise_sum(rows["loss"]), pairwise_sum(rows["zrow"])


def _as_grad(grad, dtype, g=None):
    """dtype(dtype(grad) * g) with the product in float32 (exact when g == 1); fce_torch rounds the same way."""
    if grad is None:
        return None
    if g is None:
        return grad.astype(dtype)
    return (grad.astype(dtype).astype(F32) * g).astype(dtype)


def _outputs(rows, opt):
    loss, zstat = totals(rows, opt.reduction)
    return loss, zstat, rows["lse"], rows["correct"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def fused_lce_rows(x, w, bias, y, class_weights, opt):
    """(loss, z_loss stat, lse [N], correct [N]) from x [N, H], w [V, H]; differentiable in x, w, bias."""
    rows, *_ = sweep(x, w, y, bias, class_weights, opt)
    return _outputs(rows, opt)


def _fwd(x, w, bias, y, class_weights, opt):
    if opt.reduction == "none":
        rows, *_ = sweep(x, w, y, bias, class_weights, opt)
        return _outputs(rows, opt), (x, w, bias, y, class_weights)
    rows, dx, dw, db = sweep(x, w, y, bias, class_weights, opt, grads=(True, True, bias is not None))
    # Zero-size arrays carry the parameters' dtypes (residuals must be arrays).
    dtypes = (jnp.zeros((0,), w.dtype), None if bias is None else jnp.zeros((0,), bias.dtype))
    return _outputs(rows, opt), (dx, dw, db, dtypes)


def _bwd(opt, res, cotangents):
    g = cotangents[0]
    if opt.reduction == "none":
        x, w, bias, y, class_weights = res
        _, dx, dw, db = sweep(x, w, y, bias, class_weights, opt, grads=(True, True, bias is not None),
                              row_cotangent=g.astype(F32))
        return dx, _as_grad(dw, w.dtype), _as_grad(db, None if bias is None else bias.dtype), None, None
    dx, dw, db, (w_tag, b_tag) = res
    g = g.astype(F32)
    return (_as_grad(dx, dx.dtype, g), _as_grad(dw, w_tag.dtype, g),
            None if db is None else _as_grad(db, b_tag.dtype, g), None, None)


fused_lce_rows.defvjp(_fwd, _bwd)


def debug_intermediates(x, w, y, bias=None, class_weights=None, **options):
    """The stages of one forward+backward, for `python -m parity --explain`: float32 logits and the dlogits of
    the first chunk, lse of all rows, and the final dx, dw (db). Runs eagerly (not under jit)."""
    opt = Options(**options)
    trace = {}
    rows, dx, dw, db = sweep(x, w, y, bias, class_weights, opt, grads=(True, True, bias is not None),
                             trace=trace)
    trace.update(lse=rows["lse"], dx=dx, dw=_as_grad(dw, w.dtype))
    if bias is not None:
        trace["db"] = _as_grad(db, bias.dtype)
    return trace

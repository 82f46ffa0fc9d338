"""Fused linear cross-entropy on the engine: the FLCE head, its reduction scalars and the sweeps that
autodiff.py pairs with ``jax.custom_vjp``. Twin: fce_torch/flce.py."""
import jax.numpy as jnp

from fce_core.heads import StatsSpec
from fce_core.plan import plan_rows

from .engine import Head, sweep
from .kernels.flce_head import flce_head
from .kernels.grad_scale import as_grad
from .sums import pairwise_sum

F32 = jnp.float32


def reduction_scalars(y, class_weights, ignore_index, vocab, normalizer=None):
    """(float32 [D, n, W_sum], w_y [N] or None): class-weighted and plain counts of the valid rows (or the
    caller's `normalizer`: a [2] float32 array (D, n)), the sum of class weights, and each row's target
    class weight."""
    valid = y != ignore_index
    n = jnp.sum(valid.astype(jnp.int32)).astype(F32)
    if class_weights is None:
        w_y, counts, w_sum = None, jnp.stack([n, n]), jnp.asarray(vocab, F32)
    else:
        w_y = jnp.where(valid, class_weights[jnp.where((y >= 0) & (y < vocab), y, 0)], 0.0)
        counts, w_sum = jnp.stack([pairwise_sum(w_y), n]), pairwise_sum(class_weights)
    if normalizer is not None:
        counts = normalizer.astype(F32)
    return jnp.concatenate([counts, w_sum[None]]), w_y


def make_head(opt, scalars, vocab):
    """The FLCE `Head` of options `opt`: per-row inputs y, and w_y (class weights), g (loss cotangent), g_lse
    (lse cotangent) where given."""
    def fn(stats, inputs):
        out = flce_head(stats, inputs["y"], inputs.get("w_y"), inputs.get("g"), inputs.get("g_lse"), scalars,
                        opt=opt, vocab=vocab)
        out["amax"] = stats["amax"]
        return out

    return Head(fn, StatsSpec(q=opt.label_smoothing > 0))


def flce_sweep(x, w, y, bias, class_weights, opt, *, grads=(False, False, False), normalizer=None, g=None,
               g_lse=None, trace=None):
    """The FLCE sweep: outputs are float32 [N] rows lse, loss, zrow, correct, a, b, c and int32 amax, all 0 on
    ignored rows (lse too, whether their chunk ran or was skipped)."""
    vocab = w.shape[0]
    scalars, w_y = reduction_scalars(y, class_weights, opt.ignore_index, vocab, normalizer)
    inputs = {"y": y}
    for name, t in (("w_y", w_y), ("g", g), ("g_lse", g_lse)):
        if t is not None:
            inputs[name] = t
    plan = plan_rows(x.shape[0], x.shape[1], vocab, x.dtype.itemsize, need_grads=any(grads), need_dw=grads[1],
                     requested=opt.chunk_rows)
    rows, dx, dw, db = sweep(x, w, bias, class_weights, make_head(opt, scalars, vocab), inputs, plan, grads=grads,
                             transform=opt.transform, ignore_index=opt.ignore_index, trace=trace)
    rows["lse"] = jnp.where(y != opt.ignore_index, rows["lse"], 0.0)
    return rows, dx, dw, db


def totals(rows, reduction):
    """(loss, z_loss stat) from the per-row values: fixed-order sums for "mean"/"sum", the rows for "none"."""
    if reduction == "none":
        return rows["loss"], rows["zrow"]
    return pairwise_sum(rows["loss"]), pairwise_sum(rows["zrow"])


def run_precomputed(opt, x, w, bias, y, class_weights, normalizer, *, grads):
    """`autodiff.precomputed`'s run for "mean"/"sum": (loss, (z stat, lse, correct, amax), dx, dw, db)."""
    rows, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=grads, normalizer=normalizer)
    loss, zstat = totals(rows, opt.reduction)
    return loss, (zstat, rows["lse"], rows["correct"], rows["amax"]), dx, dw, db


def rows_forward(opt, x, w, bias, y, class_weights, normalizer):
    """`autodiff.recompute`'s forward: (loss, z stat, lse, correct, amax)."""
    rows, *_ = flce_sweep(x, w, y, bias, class_weights, opt, normalizer=normalizer)
    return (*totals(rows, opt.reduction), rows["lse"], rows["correct"], rows["amax"])


def rows_backward(opt, x, w, bias, y, class_weights, normalizer, *, cotangents):
    """`autodiff.recompute`'s backward: the gradients for the cotangent of the loss (scalar or rows)."""
    g = jnp.broadcast_to(cotangents[0].astype(F32), y.shape)
    _, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=(True, True, bias is not None),
                               normalizer=normalizer, g=g)
    return dx, as_grad(dw, w.dtype), None if db is None else as_grad(db, bias.dtype)

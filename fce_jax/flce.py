"""Fused linear cross-entropy on the engine: the FLCE head, its reduction scalars and the sweeps that
autodiff.py pairs with ``jax.custom_vjp``. Twin: fce_torch/flce.py."""
import jax.numpy as jnp

from fce_core.sweeps import flce_setup, totals

from . import arrays
from .engine import sweep
from .kernels.flce_head import flce_head
from .kernels.grad_gemms import accumulates_pair
from .kernels.grad_scale import as_grad
from .vocab_parallel import comm_for

F32 = jnp.float32


def flce_sweep(x, w, y, bias, class_weights, opt, *, grads=(False, False, False), normalizer=None, g=None,
               g_lse=None, comm=None, trace=None):
    """The FLCE sweep: outputs are float32 [N] rows lse, loss, zrow, correct, a, b, c and int32 amax, all 0 on
    ignored rows (lse too, whether their chunk ran or was skipped). With `comm` (vocab parallel), w, bias and
    class_weights are this device's shard."""
    head, inputs, plan = flce_setup(arrays, flce_head, x.shape, x.dtype.itemsize, w.shape[0], y, class_weights, opt,
                                    need_grads=any(grads), dw_pair=accumulates_pair(w.dtype),
                                    normalizer=normalizer, g=g, g_lse=g_lse, comm=comm)
    rows, dx, dw, db = sweep(x, w, bias, class_weights, head, inputs, plan, grads=grads,
                             transform=opt.transform, ignore_index=opt.ignore_index, comm=comm, trace=trace,
                             engine=opt.engine)
    rows["lse"] = jnp.where(y != opt.ignore_index, rows["lse"], 0.0)
    return rows, dx, dw, db


def run_precomputed(static, x, w, bias, y, class_weights, normalizer, *, grads):
    """`autodiff.precomputed`'s run for "mean"/"sum": (loss, (z rows, lse, correct, amax), dx, dw, db).
    `static` = (FlceOptions, VocabParallel or None)."""
    opt, vp = static
    rows, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=grads, normalizer=normalizer,
                                  comm=comm_for(vp, w.shape[0]))
    loss, zrow = totals(arrays, rows, opt.reduction)
    return loss, (zrow, rows["lse"], rows["correct"], rows["amax"]), dx, dw, db


def rows_forward(static, x, w, bias, y, class_weights, normalizer):
    """`autodiff.recompute`'s forward: (loss, z rows, lse, correct, amax)."""
    opt, vp = static
    rows, *_ = flce_sweep(x, w, y, bias, class_weights, opt, normalizer=normalizer, comm=comm_for(vp, w.shape[0]))
    return (*totals(arrays, rows, opt.reduction), rows["lse"], rows["correct"], rows["amax"])


def rows_backward(static, x, w, bias, y, class_weights, normalizer, *, cotangents):
    """`autodiff.recompute`'s backward: the gradients for the cotangent of the loss (scalar or rows)."""
    opt, vp = static
    g = jnp.broadcast_to(cotangents[0].astype(F32), y.shape)
    _, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=(True, True, bias is not None),
                               normalizer=normalizer, g=g, comm=comm_for(vp, w.shape[0]))
    return dx, as_grad(dw, w.dtype), None if db is None else as_grad(db, bias.dtype)

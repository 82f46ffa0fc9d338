"""The chunked engine (C3): logits GEMM -> row statistics -> loss head -> dlogits -> dX and dW GEMMs.

`sweep` runs it over all rows, chunk by chunk (the first chunk, a `lax.scan` over the full chunks after it,
the tail: fce_torch's loop order), for any loss head (FLCE here, CPO in cpo.py): the head turns one chunk's row
statistics into its outputs and the per-row gradient coefficients a, b, c. `precomputed_grad` pairs a sweep
that computed the gradients in the forward pass with `jax.custom_vjp` (the backward only scales); the plain
primal call computes the loss only. `fused_lce_none` serves reduction="none", whose backward sweeps again
with the per-row cotangent (four GEMMs). Twin: fce_torch/engine.py.
"""
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from . import gemm
from .chunking import plan
from .dlogits import accumulate_bias_grad, dlogits, scale_rows
from .grad_scale import as_grad
from .head import MEAN, NONE, SUM, flce_head, pairwise_sum
from .row_stats import row_stats

F32 = jnp.float32
MODES = {"mean": MEAN, "sum": SUM, "none": NONE}


@dataclass(frozen=True)
class Options:
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    chunk_rows: int | None = None


def sweep(x, w, bias, class_weights, opt, head, row_inputs, *, grads=(False, False, False), chunking=None,
          finish=None, trace=None):
    """One pass over all rows of x [N, H] with w [V, H]. `row_inputs`: per-row arrays (at least "y"), cut into
    chunks (`chunking` = (rows per chunk, store), default `plan(...)` from chunking.py) and handed to
    `head(stats, inputs) -> dict` with the chunk's statistics (m, s, zy, q, amax). The head's outputs (which
    must include lse, a, b, c when gradients are asked) are concatenated over chunks.

    With store, dZ of all rows is kept and the dX and dW GEMMs run once after the last chunk. `finish(outputs)`
    returns more outputs from all rows' outputs; its "scale" [N] multiplies the kept dZ rows before the GEMMs
    (for a loss whose coefficients need more rows than a chunk holds: the head gives unit coefficients, finish
    the scale), so a finish with "scale" needs store whenever gradients are asked.

    Returns (outputs, dx, dw, db) for `grads` = which of (dx, dw, db) to compute; dw is float32 when
    accumulated over several chunks, in the input dtype for a single 16-bit chunk or with store.
    """
    n_rows, vocab = x.shape[0], w.shape[0]
    need_dx, need_dw, need_db = grads
    nc, store = chunking or plan(n_rows, x.shape[1], vocab, x.dtype.itemsize, need_dw, opt.chunk_rows)
    store = store and any(grads)
    n_full, tail = divmod(n_rows, nc)

    def step(carry, xs, first=False, last=False):
        acc, db = carry  # acc: the float32 dW accumulator, or with store all rows' dZ
        x_c, inputs, r0 = xs
        z = gemm.mm(x_c, w, F32, b_t=True)
        m, zy, amax, s_part, q_part = row_stats(z, bias, inputs["y"], class_weights, softcap=opt.softcap,
                                                smoothing=opt.label_smoothing > 0)
        stats = dict(m=m, s=pairwise_sum(s_part), zy=zy, q=None if q_part is None else pairwise_sum(q_part),
                     amax=amax)
        out = head(stats, inputs)
        if trace is not None and first:
            trace["logits"] = z
        if not any(grads):
            return carry, (out, None)
        coefficients = (out["lse"], out["a"], out["b"], out["c"])
        if store:  # the first chunk makes the [N, V] buffer, the others write their rows into it in place
            acc = dlogits(z, bias, inputs["y"], class_weights, *coefficients, softcap=opt.softcap, dtype=x.dtype,
                          into=None if first else acc, row0=r0, out_rows=n_rows)
            if trace is not None and first:
                trace["dlogits"] = acc[:x_c.shape[0]]
            return (acc, db), (out, None)
        dz = dlogits(z, bias, inputs["y"], class_weights, *coefficients, softcap=opt.softcap, dtype=x.dtype)
        if trace is not None and first:
            trace["dlogits"] = dz
        dx_c = gemm.mm(dz, w, x.dtype) if need_dx else None
        if need_dw:  # one chunk: the GEMM writes the dtype; several: a float32 accumulator
            acc = (gemm.mm(dz, x_c, w.dtype if last else F32, a_t=True) if first
                   else gemm.addmm(acc, dz, x_c, a_t=True))
        if need_db:
            db = accumulate_bias_grad(dz, db)
        return (acc, db), (out, dx_c)

    def rows(r0, r1):
        return x[r0:r1], {k: v[r0:r1] for k, v in row_inputs.items()}, r0

    carry = (None, jnp.zeros((vocab,), F32) if need_db else None)
    carry, first = step(carry, rows(0, nc), first=True, last=n_rows <= nc)
    pieces = [first]
    if n_full > 1:
        def stack(a):
            return a[nc:n_full * nc].reshape(n_full - 1, nc, *a.shape[1:])
        starts = nc * jnp.arange(1, n_full, dtype=jnp.int32)
        carry, (out_mid, dx_mid) = lax.scan(step, carry, (stack(x), jax.tree.map(stack, row_inputs), starts))
        flat = functools.partial(jax.tree.map, lambda a: a.reshape(-1, *a.shape[2:]))
        pieces.append((flat(out_mid), None if dx_mid is None else flat(dx_mid)))
    if tail:
        carry, last = step(carry, rows(n_full * nc, n_rows))
        pieces.append(last)
    outputs = {k: jnp.concatenate([p[0][k] for p in pieces]) for k in first[0]}
    if finish is not None:
        outputs.update(finish(outputs))
    if "scale" in outputs and any(grads) and not store:
        raise ValueError("sweep: a finish with a scale needs store (the chunks' dZ are gone)")
    acc, db = carry
    if not store:
        dx = jnp.concatenate([p[1] for p in pieces]) if need_dx else None
        return outputs, dx, acc, db
    dz_rows = scale_rows(acc, outputs["scale"]) if "scale" in outputs else acc
    dx = gemm.mm(dz_rows, w, x.dtype) if need_dx else None
    dw = gemm.mm(dz_rows, x, w.dtype, a_t=True) if need_dw else None
    if need_db:
        db = accumulate_bias_grad(dz_rows, db)
    return outputs, dx, dw, db


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def precomputed_grad(x, w, bias, run):
    """(loss, *extras) for a scalar loss whose gradients `run` computes in the forward pass.

    `run(x, w, bias, grads) -> (loss, extras, dx, dw, db)`; called without differentiation it is asked for no
    gradients (the loss-only path). The extras carry no gradient.
    """
    loss, extras, *_ = run(x, w, bias, (False, False, False))
    return (loss, *extras)


def _precomputed_fwd(x, w, bias, run):
    loss, extras, dx, dw, db = run(x, w, bias, (True, True, bias is not None))
    # Zero-size arrays carry the parameters' dtypes (residuals must be arrays).
    tags = (jnp.zeros((0,), w.dtype), None if bias is None else jnp.zeros((0,), bias.dtype))
    return (loss, *extras), (dx, dw, db, tags)


def _precomputed_bwd(run, res, cotangents):
    dx, dw, db, (w_tag, b_tag) = res
    g = cotangents[0].astype(F32)
    return (as_grad(dx, dx.dtype, g), as_grad(dw, w_tag.dtype, g),
            None if db is None else as_grad(db, b_tag.dtype, g))


precomputed_grad.defvjp(_precomputed_fwd, _precomputed_bwd)


# ---- the FLCE head -------------------------------------------------------------------------------------------

def reduction_scalars(y, class_weights, ignore_index, vocab):
    """(float32 [D, n, W_sum], w_y [N] or None): class-weighted and plain counts of valid rows, the sum of
    class weights, and each row's target class weight."""
    valid = y != ignore_index
    n = jnp.sum(valid.astype(jnp.int32)).astype(F32)
    if class_weights is None:
        return jnp.stack([n, n, jnp.asarray(vocab, F32)]), None
    w_y = jnp.where(valid, class_weights[jnp.where((y >= 0) & (y < vocab), y, 0)], 0.0)
    return jnp.stack([pairwise_sum(w_y), n, pairwise_sum(class_weights)]), w_y


def _flce_head(stats, inputs, *, scalars, opt, vocab):
    return flce_head(stats["m"], stats["s"], stats["zy"], stats["q"], stats["amax"], inputs["y"],
                     inputs.get("w_y"), inputs.get("g"), scalars, mode=MODES[opt.reduction],
                     ignore_index=opt.ignore_index, label_smoothing=opt.label_smoothing, z_loss=opt.z_loss,
                     vocab=vocab)


def flce_sweep(x, w, y, bias, class_weights, opt, *, grads=(False, False, False), row_cotangent=None,
               trace=None):
    """The FLCE sweep: outputs are float32 [N] rows lse, loss, zrow, correct, a, b, c."""
    vocab = w.shape[0]
    scalars, w_y = reduction_scalars(y, class_weights, opt.ignore_index, vocab)
    row_inputs = {"y": y}
    if w_y is not None:
        row_inputs["w_y"] = w_y
    if row_cotangent is not None:
        row_inputs["g"] = row_cotangent
    head = functools.partial(_flce_head, scalars=scalars, opt=opt, vocab=vocab)
    return sweep(x, w, bias, class_weights, opt, head, row_inputs, grads=grads, trace=trace)


def totals(rows, reduction):
    """(loss, z_loss stat) from the per-row values: fixed-order sums for "mean"/"sum", the rows for "none"."""
    if reduction == "none":
        return rows["loss"], rows["zrow"]
    return pairwise_sum(rows["loss"]), pairwise_sum(rows["zrow"])


def flce_run(x, w, bias, grads, *, y, class_weights, opt):
    """`precomputed_grad`'s run for "mean"/"sum": (loss, (z_loss stat, lse, correct), dx, dw, db)."""
    rows, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=grads)
    loss, zstat = totals(rows, opt.reduction)
    return loss, (zstat, rows["lse"], rows["correct"]), dx, dw, db


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def fused_lce_none(x, w, bias, y, class_weights, opt):
    """reduction="none": (loss rows, z rows, lse, correct); the backward recomputes with the cotangent."""
    rows, *_ = flce_sweep(x, w, y, bias, class_weights, opt)
    return rows["loss"], rows["zrow"], rows["lse"], rows["correct"]


def _none_fwd(x, w, bias, y, class_weights, opt):
    return fused_lce_none(x, w, bias, y, class_weights, opt), (x, w, bias, y, class_weights)


def _none_bwd(opt, res, cotangents):
    x, w, bias, y, class_weights = res
    _, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=(True, True, bias is not None),
                               row_cotangent=cotangents[0].astype(F32))
    return dx, as_grad(dw, w.dtype), None if db is None else as_grad(db, bias.dtype), None, None


fused_lce_none.defvjp(_none_fwd, _none_bwd)


def debug_intermediates(x, w, y, bias=None, class_weights=None, **options):
    """The stages of one forward+backward, for `python -m parity --explain`: float32 logits and the dlogits of
    the first chunk, lse of all rows, and the final dx, dw (db). Runs eagerly (not under jit)."""
    opt = Options(**options)
    trace = {}
    rows, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=(True, True, bias is not None),
                                  trace=trace)
    trace.update(lse=rows["lse"], dx=dx, dw=as_grad(dw, w.dtype))
    if bias is not None:
        trace["db"] = as_grad(db, bias.dtype)
    return trace

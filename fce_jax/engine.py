"""The chunked engine (C3): logits GEMM -> row statistics -> loss head -> dlogits -> dX and dW GEMMs.

`sweep` runs it over all rows, chunk by chunk (the first chunk, which takes the remainder, then a loop over the
full chunks after it: fce_torch's loop order), for any loss head (FLCE here, CPO in cpo.py): the head turns one chunk's row
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
from .chunking import kept_granule, layout, plan
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


def valid_first(y, ignore_index):
    """(pos, order, n_valid): the stable permutation that puts the valid rows (y != ignore_index) first, the
    ignored rows after them, each in their order; row i goes to pos[i], and order[j] is the row at position j."""
    valid = y != ignore_index
    n_valid = jnp.sum(valid.astype(jnp.int32))
    pos = jnp.where(valid, jnp.cumsum(valid.astype(jnp.int32)) - 1,
                    n_valid + jnp.cumsum((~valid).astype(jnp.int32)) - 1)
    order = jnp.zeros_like(pos).at[pos].set(jnp.arange(y.shape[0], dtype=pos.dtype), unique_indices=True)
    return pos, order, n_valid


def sweep(x, w, bias, class_weights, opt, head, row_inputs, *, grads=(False, False, False), chunking=None,
          skip_ignored=False, finish=None, trace=None):
    """One pass over all rows of x [N, H] with w [V, H]. `row_inputs`: per-row arrays (at least "y"), cut into
    chunks (`chunking` = (rows per chunk, store), default `plan(...)` from chunking.py; `layout` places them)
    and handed to `head(stats, inputs) -> dict` with the chunk's statistics (m, s, zy, q, amax). The head's
    outputs (which must include lse, a, b, c when gradients are asked) are concatenated over chunks.

    `skip_ignored` skips the rows whose y is opt.ignore_index: the rows are put valid-first (`valid_first`)
    and the full chunks past the last valid row never run (an ignored row adds nothing to the loss or the
    gradients): a loop with a traced trip count, or with store a `lax.switch` over the possible numbers of
    chunks (rounded up by `chunking.kept_granule`), each with static shapes. The outputs of the rows that do
    not run are 0 (so every head output must be per row), their dX rows too. fce_torch skips the same chunks
    from the host's count of valid rows (`valid_rows`).

    With store, dZ of the rows that run is kept and the dX and dW GEMMs run once after the last chunk.
    `finish(outputs)` returns more outputs from all rows' outputs (in the caller's order); its "scale" [N]
    multiplies the kept dZ rows before the GEMMs (for a loss whose coefficients need more rows than a chunk
    holds: the head gives unit coefficients, finish the scale), so a finish with "scale" needs store whenever
    gradients are asked.

    Returns (outputs, dx, dw, db) for `grads` = which of (dx, dw, db) to compute; dw is float32 when
    accumulated over several chunks, in the input dtype for a single 16-bit chunk or with store.
    """
    n_rows, vocab = x.shape[0], w.shape[0]
    need_dx, need_dw, need_db = grads
    nc, store = chunking or plan(n_rows, x.shape[1], vocab, x.dtype.itemsize, need_dw, opt.chunk_rows)
    store = store and any(grads)
    first, n_chunks = layout(n_rows, nc)
    granule = kept_granule(n_chunks) if store else 1
    pos, n_run_chunks = None, n_chunks
    if skip_ignored:
        pos, order, n_valid = valid_first(row_inputs["y"], opt.ignore_index)
        x = x[order]
        row_inputs = {k: v[order] for k, v in row_inputs.items()}
        # chunking.chunks_to_run, on the device
        needed = 1 + jnp.clip(-((first - n_valid) // nc), 0, n_chunks - 1)
        n_run_chunks = jnp.minimum(n_chunks, -(-needed // granule) * granule)

    def chunk(acc, db, x_c, inputs, r0, is_first, kept_rows):
        """One chunk's outputs, and its dZ's share of the gradients: (acc, db, out, dx_c); acc is the float32
        dW accumulator, or with store the [kept_rows, V] dZ of the rows that run."""
        z = gemm.mm(x_c, w, F32, b_t=True)
        m, zy, amax, s_part, q_part = row_stats(z, bias, inputs["y"], class_weights, softcap=opt.softcap,
                                                smoothing=opt.label_smoothing > 0)
        stats = dict(m=m, s=pairwise_sum(s_part), zy=zy, q=None if q_part is None else pairwise_sum(q_part),
                     amax=amax)
        out = head(stats, inputs)
        if trace is not None and is_first:
            trace["logits"] = z
        if not any(grads):
            return acc, db, out, None
        coefficients = (out["lse"], out["a"], out["b"], out["c"])
        if store:  # the first chunk makes the dZ buffer, the others write their rows into it in place
            acc = dlogits(z, bias, inputs["y"], class_weights, *coefficients, softcap=opt.softcap, dtype=x.dtype,
                          into=None if is_first else acc, row0=r0, out_rows=kept_rows)
            if trace is not None and is_first:
                trace["dlogits"] = acc[:x_c.shape[0]]
            return acc, db, out, None
        dz = dlogits(z, bias, inputs["y"], class_weights, *coefficients, softcap=opt.softcap, dtype=x.dtype)
        if trace is not None and is_first:
            trace["dlogits"] = dz
        dx_c = gemm.mm(dz, w, x.dtype) if need_dx else None
        if need_dw:  # one chunk: the GEMM writes the dtype; several: a float32 accumulator
            acc = (gemm.mm(dz, x_c, w.dtype if n_chunks == 1 else F32, a_t=True) if is_first
                   else gemm.addmm(acc, dz, x_c, a_t=True))
        if need_db:
            db = accumulate_bias_grad(dz, db)
        return acc, db, out, dx_c

    def run(n_run_chunks):
        """The sweep over the first n_run_chunks chunks (static with store, else possibly traced)."""
        kept_rows = first + (n_run_chunks - 1) * nc if store else None

        def later(i, acc, db):
            r0 = first + (i - 1) * nc
            x_c = lax.dynamic_slice_in_dim(x, r0, nc)
            inputs = {k: lax.dynamic_slice_in_dim(v, r0, nc) for k, v in row_inputs.items()}
            return chunk(acc, db, x_c, inputs, r0, False, kept_rows)

        acc, db, out, dx_c = chunk(None, jnp.zeros((vocab,), F32) if need_db else None, x[:first],
                                   {k: v[:first] for k, v in row_inputs.items()}, 0, True, kept_rows)
        rows = (out, dx_c)
        if n_chunks > 1:  # the later chunks' pieces, stacked (0 for the chunks that do not run)
            _, _, *shapes = jax.eval_shape(functools.partial(later, 1), acc, db)
            stacked = jax.tree.map(lambda p: jnp.zeros((n_chunks - 1, *p.shape), p.dtype), tuple(shapes))

            def body(i, carry):
                acc, db, stacked = carry
                acc, db, *pieces = later(i, acc, db)
                return acc, db, jax.tree.map(lambda b, p: lax.dynamic_update_index_in_dim(b, p, i - 1, 0),
                                             stacked, tuple(pieces))

            acc, db, stacked = lax.fori_loop(1, n_run_chunks, body, (acc, db, stacked))
            rows = jax.tree.map(lambda p, b: jnp.concatenate([p, b.reshape(-1, *b.shape[2:])]), rows, stacked)
        outputs, dx = rows
        if pos is not None:
            outputs = {k: v[pos] for k, v in outputs.items()}
        if finish is not None:
            outputs.update(finish(outputs))
        if "scale" in outputs and any(grads) and not store:
            raise ValueError("sweep: a finish with a scale needs store (the chunks' dZ are gone)")
        dw = acc
        if store:
            if "scale" in outputs:
                scale = outputs["scale"] if pos is None else outputs["scale"][order]
                acc = scale_rows(acc, scale[:kept_rows])
            if need_dx:
                dx = jnp.pad(gemm.mm(acc, w, x.dtype), ((0, n_rows - kept_rows), (0, 0)))
            dw = gemm.mm(acc, x[:kept_rows], w.dtype, a_t=True) if need_dw else None
            if need_db:
                db = accumulate_bias_grad(acc, db)
        if dx is not None and pos is not None:
            dx = dx[pos]
        return outputs, dx, dw, db

    if not (store and skip_ignored):
        return run(n_run_chunks)
    if granule >= n_chunks:  # a single possible count
        return run(n_chunks)
    if trace is not None:  # debugging runs eagerly: the count is known
        return run(int(n_run_chunks))
    # With store, one program per possible count (the dZ buffer's shape is static): XLA keeps the temporary
    # memory of the largest, where a slice of one [N, V] buffer would be copied before the GEMMs.
    counts = [min(n_chunks, (j + 1) * granule) for j in range(-(-n_chunks // granule))]
    return lax.switch(n_run_chunks // granule - 1 + (n_run_chunks % granule > 0),
                      [functools.partial(run, c) for c in counts])


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
    """The FLCE sweep: outputs are float32 [N] rows lse, loss, zrow, correct, a, b, c (all 0 on ignored
    rows, lse too, whether their chunk ran or was skipped: see `sweep`'s skip_ignored)."""
    vocab = w.shape[0]
    scalars, w_y = reduction_scalars(y, class_weights, opt.ignore_index, vocab)
    row_inputs = {"y": y}
    if w_y is not None:
        row_inputs["w_y"] = w_y
    if row_cotangent is not None:
        row_inputs["g"] = row_cotangent
    head = functools.partial(_flce_head, scalars=scalars, opt=opt, vocab=vocab)
    rows, dx, dw, db = sweep(x, w, bias, class_weights, opt, head, row_inputs, grads=grads, skip_ignored=True,
                             trace=trace)
    rows["lse"] = jnp.where(y != opt.ignore_index, rows["lse"], 0.0)
    return rows, dx, dw, db


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

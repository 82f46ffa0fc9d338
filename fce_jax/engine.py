"""The chunked engine (C3): logits GEMM -> row statistics -> loss head -> dlogits -> dX and dW GEMMs.

`sweep` runs it over all rows, chunk by chunk (the first chunk, which takes the remainder, then a loop over the
full chunks after it: fce_torch's loop order), for any loss head (FLCE here, CPO in cpo.py): the head turns one
chunk's row statistics into its outputs and the per-row gradient coefficients a, b, c. `precomputed_grad` pairs
a sweep that computed the gradients in the forward pass with `jax.custom_vjp` (the backward only scales); the
plain primal call computes the loss only. `fused_lce_none` serves reduction="none", whose backward sweeps again
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
from .grad_scale import as_grad, kept_weight_grad
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


def _add_grads(dz, x_rows, w, dw, db, *, need_dx, need_dw, single):
    """The GEMMs of some rows' dZ: (dX rows or None, dW (+)= dZ^T X (the first writes it: in the dtype when it is
    the `single` one, else a float32 accumulator), db + column sums (if given))."""
    dx = gemm.mm(dz, w, x_rows.dtype) if need_dx else None
    if need_dw:
        dw = (gemm.mm(dz, x_rows, w.dtype if single else F32, a_t=True) if dw is None
              else gemm.addmm(dw, dz, x_rows, a_t=True))
    if db is not None:
        db = accumulate_bias_grad(dz, db)
    return dx, dw, db


def sweep(x, w, bias, class_weights, opt, head, row_inputs, *, grads=(False, False, False), chunking=None,
          group_rows=None, skip_ignored=False, finish=None, trace=None):
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
    `finish(outputs, inputs)` returns more outputs from all rows' outputs and inputs (in the caller's order);
    its "scale" [N] multiplies the kept dZ rows before the GEMMs (for a loss whose coefficients need more rows
    than a chunk holds: the head gives unit coefficients, finish the scale), so a finish with "scale" needs
    store whenever gradients are asked.

    `group_rows` (whole units of the loss, e.g. preference pairs; no skipping then) runs all this per group of
    rows (`layout` places the groups, then the chunks in each; a loop over the full groups): finish sees one
    group, its outputs are concatenated over groups, and with store each group's dZ is kept and its dW added
    to a float32 accumulator (the first group writes it).

    Returns (outputs, dx, dw, db) for `grads` = which of (dx, dw, db) to compute; dw is float32 when
    accumulated over several chunks or groups, in the input dtype for a single 16-bit chunk or group.
    """
    n_rows, vocab = x.shape[0], w.shape[0]
    need_dx, need_dw, need_db = grads
    nc, store = chunking or plan(n_rows, x.shape[1], vocab, x.dtype.itemsize, need_dw, opt.chunk_rows)
    store = store and any(grads)
    if group_rows is not None and any(grads) and not store:
        raise ValueError("sweep: groups need store when gradients are asked")
    g_first, n_groups = (n_rows, 1) if group_rows is None else layout(n_rows, group_rows)
    single_chunk = n_groups == 1 and layout(n_rows, nc)[1] == 1

    def chunk(acc, db, x_c, inputs, r0, is_first, traced, kept_rows):
        """One chunk's outputs, and its dZ's share of the gradients: (acc, db, out, dx_c); acc is the float32
        dW accumulator, or with store the [kept_rows, V] dZ of its group's rows that run."""
        z = gemm.mm(x_c, w, F32, b_t=True)
        m, zy, amax, s_part, q_part = row_stats(z, bias, inputs["y"], class_weights, softcap=opt.softcap,
                                                smoothing=opt.label_smoothing > 0)
        stats = dict(m=m, s=pairwise_sum(s_part), zy=zy, q=None if q_part is None else pairwise_sum(q_part),
                     amax=amax)
        out = head(stats, inputs)
        if traced:
            trace["logits"] = z
        if not any(grads):
            return acc, db, out, None
        coefficients = (out["lse"], out["a"], out["b"], out["c"])
        if store:  # the first chunk makes the dZ buffer, the others write their rows into it in place
            acc = dlogits(z, bias, inputs["y"], class_weights, *coefficients, softcap=opt.softcap, dtype=x.dtype,
                          into=None if is_first else acc, row0=r0, out_rows=kept_rows)
            if traced:
                trace["dlogits"] = acc[:x_c.shape[0]]
            return acc, db, out, None
        dz = dlogits(z, bias, inputs["y"], class_weights, *coefficients, softcap=opt.softcap, dtype=x.dtype)
        if traced:
            trace["dlogits"] = dz
        dx_c, acc, db = _add_grads(dz, x_c, w, acc, db, need_dx=need_dx, need_dw=need_dw, single=single_chunk)
        return acc, db, out, dx_c

    def stack_loop(step, start, stop, carry, n_slots):
        """carry, pieces = step(i, carry) for i in [start, stop) (stop may be traced): the pieces stacked in
        n_slots slots (0 in the slots of the steps that do not run)."""
        _, shapes = jax.eval_shape(functools.partial(step, start), carry)
        stacked = jax.tree.map(lambda p: jnp.zeros((n_slots, *p.shape), p.dtype), shapes)

        def body(i, c):
            carry, stacked = c
            carry, pieces = step(i, carry)
            return carry, jax.tree.map(lambda b, p: lax.dynamic_update_index_in_dim(b, p, i - start, 0), stacked,
                                       pieces)

        return lax.fori_loop(start, stop, body, (carry, stacked))

    def flat(first_pieces, stacked):
        return jax.tree.map(lambda p, b: jnp.concatenate([p, b.reshape(-1, *b.shape[2:])]), first_pieces, stacked)

    def group_pass(x_g, inputs_g, caller_g, n_run_chunks, dw, db, first_group, pos=None, order=None):
        """One group of rows: its chunks (the first n_run_chunks of them), finish, and with store its dX and its
        share of dW (`dw`: the accumulator, None before the first group). Returns (outputs, dx, dw, db)."""
        size = x_g.shape[0]
        first, n_chunks = layout(size, nc)
        kept_rows = first + (n_run_chunks - 1) * nc if store else None

        def later(i, carry):
            acc, db = carry
            r0 = first + (i - 1) * nc
            x_c = lax.dynamic_slice_in_dim(x_g, r0, nc)
            inputs = {k: lax.dynamic_slice_in_dim(v, r0, nc) for k, v in inputs_g.items()}
            acc, db, out, dx_c = chunk(acc, db, x_c, inputs, r0, False, False, kept_rows)
            return (acc, db), (out, dx_c)

        acc, db, out, dx_c = chunk(None if store else dw, db, x_g[:first],
                                   {k: v[:first] for k, v in inputs_g.items()}, 0, True,
                                   first_group and trace is not None, kept_rows)
        rows = (out, dx_c)
        if n_chunks > 1:  # the later chunks' pieces (0 for the chunks that do not run)
            (acc, db), stacked = stack_loop(later, 1, n_run_chunks, (acc, db), n_chunks - 1)
            rows = flat(rows, stacked)
        outputs, dx = rows
        if pos is not None:
            outputs = {k: v[pos] for k, v in outputs.items()}
        if finish is not None:
            outputs.update(finish(outputs, caller_g))
        if "scale" in outputs and any(grads) and not store:
            raise ValueError("sweep: a finish with a scale needs store (the chunks' dZ are gone)")
        if not store:
            return outputs, dx if dx is None or pos is None else dx[pos], acc, db
        if "scale" in outputs:
            scale = outputs["scale"] if order is None else outputs["scale"][order]
            acc = scale_rows(acc, scale[:kept_rows])
        dx, dw, db = _add_grads(acc, x_g[:kept_rows], w, dw, db, need_dx=need_dx, need_dw=need_dw,
                                single=n_groups == 1)
        if dx is not None:
            dx = jnp.pad(dx, ((0, size - kept_rows), (0, 0)))
            dx = dx if pos is None else dx[pos]
        return outputs, dx, dw, db

    db0 = jnp.zeros((vocab,), F32) if need_db else None
    if n_groups > 1:
        def later_group(i, carry):
            dw, db = carry
            sl = functools.partial(lax.dynamic_slice_in_dim, start_index=g_first + (i - 1) * group_rows,
                                   slice_size=group_rows)
            inputs = {k: sl(v) for k, v in row_inputs.items()}
            outputs, dx, dw, db = group_pass(sl(x), inputs, inputs, layout(group_rows, nc)[1], dw, db, False)
            return (dw, db), (outputs, dx)

        inputs = {k: v[:g_first] for k, v in row_inputs.items()}
        outputs, dx, dw, db = group_pass(x[:g_first], inputs, inputs, layout(g_first, nc)[1], None, db0, True)
        (dw, db), stacked = stack_loop(later_group, 1, n_groups, (dw, db), n_groups - 1)
        outputs, dx = flat((outputs, dx), stacked)
        return outputs, dx, dw, db

    first, n_chunks = layout(n_rows, nc)
    if not skip_ignored:
        return group_pass(x, row_inputs, row_inputs, n_chunks, None, db0, True)
    pos, order, n_valid = valid_first(row_inputs["y"], opt.ignore_index)
    x_v = x[order]
    inputs_v = {k: v[order] for k, v in row_inputs.items()}
    granule = kept_granule(n_chunks) if store else 1
    # chunking.chunks_to_run, on the device
    needed = 1 + jnp.clip(-((first - n_valid) // nc), 0, n_chunks - 1)
    n_run_chunks = jnp.minimum(n_chunks, -(-needed // granule) * granule)

    def run(n_run_chunks):
        return group_pass(x_v, inputs_v, row_inputs, n_run_chunks, None, db0, True, pos, order)

    if not store:
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
    return (loss, *extras), (dx, kept_weight_grad(dw, w.dtype), db, tags)


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

"""The chunked engine: logits GEMM -> row statistics -> loss head -> dlogits -> dX and dW GEMMs.

`sweep` runs it over all rows of x, chunk by chunk as a `fce_core.plan.Plan` says (the first chunk, which
takes the remainder, then a loop over the full chunks after it: fce_torch's order), for any `Head` (FLCE, token
log-probs, CPO). How its result reaches autodiff is autodiff.py's. Twin: fce_torch/engine.py.
"""
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fce_core.rows import target_logits, tile_weights
from fce_core.rows import valid_first as valid_first_of
from fce_core.heads import Head  # noqa: F401  (re-exported: the heads build it)
from fce_core.heads import LOAD_COEF, forms_dz_on_load
from fce_core.plan import layout

from . import arrays, gemm
from .kernels.dlogits import accumulate_bias_grad, dlogits, scale_rows, zero_rows_from
from .kernels.grad_gemms import TileValues, dw_accumulate, dw_first, dw_gemm, dx_gemm, dz_on_load_enabled
from .kernels.logit_tiles import gemm_config, logit_tiles, merge_tiles
from .kernels.row_stats import row_stats
from .kernels.tile_dlogits import tile_dlogits
from .sums import pairwise_sum

F32 = jnp.float32


def valid_first(y, ignore_index):
    """`fce_core.rows.valid_first` on this framework's arrays: (pos, order, n_valid)."""
    return valid_first_of(arrays, y, ignore_index)


def _varying_zeros(shape, dtype, varying):
    z = jnp.zeros(shape, dtype)
    return lax.pcast(z, tuple(sorted(varying)), to="varying") if varying else z


def zeros_like_shard(shape, dtype, like):
    """Zeros typed to vary along the mesh axes `like` varies along (inside ``jax.shard_map``: a buffer that
    the shard's kernels then write, e.g. the kept dZ or db of a vocabulary shard)."""
    return _varying_zeros(shape, dtype, jax.typeof(like).mat.varying)


def stack_loop(step, start, stop, carry, n_slots):
    """carry, pieces = step(i, carry) for i in [start, stop) (stop may be traced): the pieces stacked in
    n_slots slots (0 in the slots of the steps that do not run)."""
    _, shapes = jax.eval_shape(functools.partial(step, start), carry)
    mat = lambda p: p.manual_axis_type.varying if p.manual_axis_type is not None else frozenset()  # noqa: E731
    stacked = jax.tree.map(lambda p: _varying_zeros((n_slots, *p.shape), p.dtype, mat(p)), shapes)

    def body(i, c):
        carry, stacked = c
        carry, pieces = step(i, carry)
        return carry, jax.tree.map(lambda b, p: lax.dynamic_update_index_in_dim(b, p, i - start, 0), stacked, pieces)

    return lax.fori_loop(start, stop, body, (carry, stacked))


def _flat(first_pieces, stacked):
    return jax.tree.map(lambda p, b: jnp.concatenate([p, b.reshape(-1, *b.shape[2:])]), first_pieces, stacked)


@dataclass(frozen=True)
class _Sweep:
    """What every chunk of one sweep shares."""
    w: object
    bias: object
    class_weights: object
    head: Head
    transform: object
    grads: tuple
    keep: bool
    single: bool
    dtype: object
    comm: object = None
    engine: str = "library"
    tile_weights: object = None
    tracing: bool = False  # the sweep records its first chunk's stages (`trace`)

    def chunk(self, acc, x_c, inputs, r0, trace, r0_multiple=1):
        """One chunk: (acc, out, dx_c). acc is (dW accumulator or None, db) without kept dZ, else the group's
        [rows, V] dZ into which this chunk writes its rows from r0 (traced: a multiple of `r0_multiple`)."""
        if self.engine == "fused":
            return self.fused_chunk(acc, x_c, inputs, r0, trace, r0_multiple)
        z = gemm.mm(x_c, self.w, F32, b_t=True)
        y, comm = inputs["y"], self.comm
        r_y = target_logits(arrays, z, y, self.bias) if comm is None else comm.target_logits(z, y, self.bias)
        parts = row_stats(z, self.bias, r_y, self.class_weights, spec=self.head.stats, transform=self.transform)
        stats = {k: pairwise_sum(v) if v.ndim == 2 else v for k, v in parts.items()}
        if comm is not None:
            stats = comm.merge(stats)
            y = comm.local_targets(y)
        out = self.head.fn(stats, inputs)
        if trace is not None:
            trace["logits"] = z
        if not any(self.grads):
            return acc, out, None
        args = (z, self.bias, y, self.class_weights, out)
        if self.keep:
            acc = dlogits(*args, transform=self.transform, dtype=self.dtype, row0=r0, **_kept(acc))
            if trace is not None:
                trace["dlogits"] = acc[r0:r0 + x_c.shape[0]]
            return acc, out, None
        dz = dlogits(*args, transform=self.transform, dtype=self.dtype)
        if trace is not None:
            trace["dlogits"] = dz
        dx_c, dw, db = self.add(dz, x_c, *acc)
        return (dw, db), out, dx_c

    def fused_chunk(self, acc, x_c, inputs, r0, trace, r0_multiple=1):
        """`chunk` on the fused engine: the tile values go into the kept dZ rows (or a new [rows, V] array in
        the input dtype, not written without gradients) and dZ overwrites them, or the GEMMs form it on their
        operand load where fce_torch's `_FusedChunkRunner` does. Vocab-parallel, the target logit is the
        owner shard's and the shards' statistics are merged, as in `chunk`."""
        y, vocab, comm = inputs["y"], self.w.shape[0], self.comm
        local = y if comm is None else comm.local_targets(y)
        need = any(self.grads)
        row0 = r0 if self.keep else 0
        e, parts = logit_tiles(x_c, self.w, self.bias, local, self.class_weights,
                               spec=self.head.stats, transform=self.transform, precision=gemm.pallas_precision(x_c),
                               store=need, row0=row0, row0_multiple=r0_multiple,
                               **(_kept(acc) if self.keep else {}))
        zy = None if comm is None else comm.owner_values(jnp.max(parts["zy"], axis=1), y, vocab)
        stats = merge_tiles(parts, vocab, self.tile_weights, zy=zy)
        if comm is not None:
            stats = comm.merge(stats)
        out = self.head.fn(stats, inputs)
        rows = slice(r0, r0 + x_c.shape[0]) if self.keep else slice(None)
        if trace is not None and need:
            trace["tiles"] = e[rows]
        if not need:
            return acc, out, None
        if self.forms_on_load(out):
            if self.keep:  # the kept rows stay tile values: `_kept_dz` forms dZ in the group's GEMMs
                return e, {**out, KEPT_TILES: parts["m"]}, None
            dx_c, dw, db = self.add(TileValues(e, parts["m"], local, out, gemm_config().tile_n), x_c, *acc)
            return (dw, db), out, dx_c
        dz = tile_dlogits(e, parts["m"], local, stats["zy"], self.class_weights, out, transform=self.transform,
                          row0=row0, row0_multiple=r0_multiple)
        if trace is not None:
            trace["dlogits"] = dz[rows]
        if self.keep:
            return dz, out, None
        dx_c, dw, db = self.add(dz, x_c, *acc)
        return (dw, db), out, dx_c

    def forms_on_load(self, out):
        """Whether the GEMMs form this chunk's dZ on their operand load (`fce_core.heads.forms_dz_on_load`)."""
        return forms_dz_on_load(dz_on_load_enabled(), self.class_weights, out, self.transform, db=self.grads[2],
                                traced=self.tracing, vocab_parallel=self.comm is not None)

    def _dx(self, product, dtype, scale=None):
        """dX from product(out_dtype) = dZ W: in `dtype`, or from float32: vocab-parallel the shards' parts
        summed, with `scale` (the rows' scale) times it before its one rounding to `dtype`."""
        if self.comm is None and scale is None:
            return product(dtype)
        part = product(F32)
        part = part if self.comm is None else self.comm.sum_parts(part)
        return part.astype(dtype) if scale is None else scale_rows(part, scale, dtype)

    def add(self, dz, x_rows, dw, db, ran=None, last=False, scale=None):
        """The GEMMs of some rows' dZ: (dX rows or None, dW (+)= dZ^T X, db + column sums (if given));
        vocab-parallel, dX from the shards' float32 parts. `ran`, `last`, `scale`: as in fce_torch's
        `_Grads.add` (on the library engine `ran` may be traced: the rows past it are zeroed in place)."""
        need_dx, need_dw, _ = self.grads
        if self.engine == "fused":
            return self.add_own(dz, x_rows, dw, db, ran, last, scale)
        if ran is not None:
            dz = zero_rows_from(dz, ran)
        if scale is not None:
            dz = scale_rows(dz, scale)
        dx = self._dx(lambda dtype: gemm.mm(dz, self.w, dtype), x_rows.dtype) if need_dx else None
        if need_dw:
            dw = (gemm.mm(dz, x_rows, self.w.dtype if self.single else F32, a_t=True) if dw is None
                  else gemm.addmm(dw, dz, x_rows, a_t=True))
        if db is not None:
            db = accumulate_bias_grad(dz, db)
        return dx, dw, db

    def add_own(self, dz, x_rows, dw, db, ran=None, last=False, scale=None):
        """`add` with the fused engine's GEMMs: dW written once in the weight's dtype (`single`), or
        accumulated as `grad_gemms.dw_first` starts it (a bfloat16 (hi, lo) pair, else float32); with `ran`,
        dX, dW and db over the first `ran` rows, with `last` a pair's hi alone, with `scale` dZ's rows scaled
        in the GEMMs, as in fce_torch's `_Grads._add_own`; `dz` may be `fce_core.heads.TileValues`."""
        need_dx, need_dw, _ = self.grads
        precision = gemm.pallas_precision(x_rows)  # dZ's dtype: the tile values are in the input's
        dx = self._dx(lambda dtype: dx_gemm(dz, self.w, dtype, precision, rows=ran),
                      x_rows.dtype, scale) if need_dx else None
        if need_dw and scale is not None:
            x_rows = scale_rows(x_rows, scale, x_rows.dtype)
        if need_dw and self.single:
            dw = dw_gemm(dz, x_rows, self.w.dtype, precision, rows=ran)
        elif need_dw:
            dw = dw_first(dz, x_rows, self.w.dtype, precision, rows=ran) if dw is None else \
                dw_accumulate(dz, x_rows, dw, precision, rows=ran, last=last)
        if db is not None:
            db = accumulate_bias_grad(dz, db, scale, rows=ran)
        return dx, dw, db


def _after(operand, deps):
    """`operand` (a pytree), not available before `deps` are computed: an optimization barrier over both.
    Only where every leaf varies over the same manual axes (shard_map): the barrier would make each of its
    outputs vary over all of them (vocab-parallel, x does not vary over the vocabulary axis and dW does; no
    order is imposed there)."""
    if len({jax.typeof(a).mat.varying for a in jax.tree.leaves((operand, deps))}) > 1:
        return operand
    return lax.optimization_barrier((operand, deps))[0]


KEPT_TILES = "kept tile maxima"  # a chunk's output where its kept rows stay tile values, popped by `_kept_dz`


def _kept_dz(dz, outputs, y):
    """A group's kept dZ for its GEMMs, given its chunks' outputs (in the sweep's order) and targets: where the
    chunks left tile values (their tile maxima in `outputs`, popped), `TileValues` over them, as fce_torch's
    `kept_dz`."""
    m_tiles = outputs.pop(KEPT_TILES, None)
    if m_tiles is None:
        return dz
    return TileValues(dz, m_tiles, y, {k: outputs[k] for k in LOAD_COEF}, gemm_config().tile_n)


def _kept(acc):
    """The keywords that write a chunk's rows into the kept dZ: `into` the buffer, or before the first chunk
    (`acc` its ShapeDtypeStruct) `out_rows`, so that the first chunk's kernel makes it without zeros up front
    (the library engine zeroes the rows of chunks that do not run after them, `zero_rows_from`; the fused
    engine's GEMMs do not read them)."""
    return dict(out_rows=acc.shape[0]) if isinstance(acc, jax.ShapeDtypeStruct) else dict(into=acc)


def _weight_grad(dw):
    """dW from its accumulator: the hi of a (hi, lo) pair (`grad_gemms.dw_first`), else itself."""
    return dw[0] if isinstance(dw, tuple) else dw


def _chunks(sw, plan, x_g, inputs_g, n_run, acc, trace, order=None):
    """A group's chunks (the first n_run of them; n_run may be traced): (outputs, dx or None, acc), the rows
    of the chunks that do not run 0. With `order` (the valid-first permutation) a chunk's rows [r0, r1) are
    x_g's rows order[r0:r1], gathered per chunk, and its dX rows go back to those rows of dx (x_g's order),
    so that no permuted copy of x or dX exists."""
    first, n_chunks = layout(x_g.shape[0], plan.rows)

    def rows(r0, size):
        if order is None:
            return lax.dynamic_slice_in_dim(x_g, r0, size)
        return jnp.take(x_g, lax.dynamic_slice_in_dim(order, r0, size), axis=0)

    def place(dx, dx_c, r0):
        if order is None:
            return lax.dynamic_update_slice_in_dim(dx, dx_c, r0, 0)
        return dx.at[lax.dynamic_slice_in_dim(order, r0, dx_c.shape[0])].set(dx_c, unique_indices=True)

    def later(i, carry):
        acc, dx = carry
        r0 = first + (i - 1) * plan.rows
        inputs = {k: lax.dynamic_slice_in_dim(v, r0, plan.rows) for k, v in inputs_g.items()}
        acc, out, dx_c = sw.chunk(acc, rows(r0, plan.rows), inputs, r0, None, math.gcd(first, plan.rows))
        return (acc, dx if dx is None else place(dx, dx_c, r0)), out

    acc, out, dx_c = sw.chunk(acc, rows(0, first), {k: v[:first] for k, v in inputs_g.items()}, 0, trace)
    dx = None if dx_c is None else place(zeros_like_shard(x_g.shape, dx_c.dtype, dx_c), dx_c, 0)
    if n_chunks > 1:
        (acc, dx), stacked = stack_loop(later, 1, n_run, (acc, dx), n_chunks - 1)
        out = _flat(out, stacked)
    return out, dx, acc


def _group_pass(sw, plan, x_g, inputs_g, caller_inputs, n_run, dw, db, trace, finish, pos=None, order=None,
                last=False):
    """One group of rows: its chunks, finish, and with kept dZ its dX and its share of dW (`dw`: the
    accumulator, None before the first group; `last`: the last group). `pos`/`order`: the group's valid-first
    permutation.
    Returns (outputs, dx, dw, db) in the caller's order."""
    size, vocab = x_g.shape[0], sw.w.shape[0]
    acc = jax.ShapeDtypeStruct((size, vocab), sw.dtype) if sw.keep else (dw, db)
    if sw.keep and order is not None:  # the GEMMs over the kept dZ take all rows valid-first
        x_g = jnp.take(x_g, order, axis=0)
    outputs, dx, acc = _chunks(sw, plan, x_g, inputs_g, n_run, acc, trace, None if sw.keep else order)
    if sw.keep:
        acc = _kept_dz(acc, outputs, inputs_g["y"])
    first, n_chunks = layout(size, plan.rows)

    def rows_run(n):  # the rows of a group's first n chunks
        return first + (n - 1) * plan.rows

    if pos is not None:
        outputs = {k: v[pos] for k, v in outputs.items()}
    if finish is not None:
        outputs.update(finish(outputs, caller_inputs))
    if sw.keep:
        scale = outputs.get("scale")
        scale = scale if scale is None or order is None else scale[order]
        dx, dw, db = _kept_grads(sw, acc, x_g, dw, db, n_run, n_chunks, rows_run, last, scale)
        dx = dx if dx is None or pos is None else dx[pos]
    else:
        dw, db = acc
    return outputs, dx, dw, db


def _kept_grads(sw, dz, x_g, dw, db, n_run, n_chunks, rows_run, last=False, scale=None):
    """The GEMMs over a group's kept dZ (its rows' `scale`), whose rows past the first n_run of its n_chunks
    chunks (`rows_run(n)` rows) did not run (`_Sweep.add`): on the fused engine over the rows of those chunks,
    as fce_torch's sweep (a branch per count of chunks where n_run is traced, so that every GEMM has a static
    shape), on the library engine over all rows."""
    def over(n):
        return sw.add(dz, x_g, dw, db, ran=rows_run(n), last=last, scale=scale)

    if sw.engine != "fused":
        every = isinstance(n_run, int) and n_run == n_chunks
        return sw.add(dz, x_g, dw, db, ran=None if every else rows_run(n_run), scale=scale)
    if isinstance(n_run, int):
        return over(n_run)
    return lax.switch(n_run - 1, [functools.partial(over, n) for n in range(1, n_chunks + 1)])


def sweep(x, w, bias, class_weights, head, inputs, plan, *, grads=(False, False, False), transform,
          ignore_index, finish=None, comm=None, trace=None, engine="library", perm=None):
    """One pass over all rows of x [N, H] with w [V, H]. `inputs`: per-row arrays (at least "y"), cut into
    the plan's chunks and handed to the head with each chunk's statistics; the head's outputs are
    concatenated over chunks. Returns (outputs, dx, dw, db) for `grads` = which of (dx, dw, db) to compute;
    dw is float32 when accumulated over several chunks or groups, in the weight's dtype otherwise.

    Ignored rows (y == ignore_index) are skipped when the plan's groups have several chunks
    (`Plan.puts_valid_first`): each group's rows are put valid-first within it (`valid_first`), the valid
    ones counted on the device, and the group's full chunks past its last valid row never run (a loop with a
    traced trip count; for the single group, unless every chunk runs: the group under a `lax.cond`,
    NUMERICS.md); their outputs are 0 (so every head output must be per row), their dX rows too. With the
    plan's kept dZ the dX and dW GEMMs run once per group, as in fce_torch: on the fused engine over the rows
    of the chunks that ran (`_kept_grads`), on the library engine over all rows.

    `finish(outputs, inputs)` adds outputs from a whole group's outputs and inputs (in the caller's order);
    its "scale" [rows] multiplies the group's kept dZ rows (a loss whose coefficients need more rows than a
    chunk holds): on the library engine before the GEMMs, on the fused engine in them, as in fce_torch. With
    groups of rows (the plan's group_rows; a loop over the middle groups), each group's outputs are
    concatenated and dW accumulates over the groups.

    `comm` (a `vocab_parallel.VocabComm`): w, bias and class_weights are this device's vocabulary shard; the
    target logits and the row statistics are merged along the axis before the head, dX is summed along it,
    and dW and db stay the shard's.

    `engine`: "library" or "fused", as in fce_torch's `sweep`.

    `perm` (a NumPy [N]): the sweep's row r is x's row perm[r] (`inputs` and the outputs are in the sweep's
    order, dX in x's), each group's rows taken from x by it: CPO's pairs grouped, with no permuted copy of x.
    """
    need = any(grads)
    weights = None
    if engine == "fused" and class_weights is not None:
        weights = tile_weights(arrays, class_weights, gemm_config().tile_n)
    sw = _Sweep(w, bias, class_weights, head, transform, grads, plan.keep_dz and need, plan.single_product(need),
                x.dtype, comm, engine, weights, trace is not None)
    db = zeros_like_shard((w.shape[0],), F32, w) if grads[2] else None

    def valid_first_pass(x_g, inputs_g, dw, db, trace, whole=False, last=False):
        """One group, its rows valid-first within it where the plan says so (`whole`: the single group,
        under the `lax.cond` below; `last`: the last of several)."""
        size = x_g.shape[0]
        pos = order = None
        sorted_inputs, n_run = inputs_g, layout(size, plan.rows)[1]
        if plan.puts_valid_first:
            pos, order, n_valid = valid_first(inputs_g["y"], ignore_index)
            sorted_inputs = {k: jnp.take(v, order, axis=0) for k, v in inputs_g.items()}  # also numpy inputs
            n_run = plan.chunks_to_run(n_valid, jnp.clip, size)
        group = functools.partial(_group_pass, sw, plan, x_g, sorted_inputs, inputs_g, dw=dw, db=db, trace=trace,
                                  finish=finish, pos=pos, order=order, last=last)
        if isinstance(n_run, int) or trace is not None or not whole:
            return group(n_run)
        # XLA reads a traced loop bound on the host before every step of the loop, and the device idles until
        # the host has queued the step. Where every chunk runs (no row ignored) a loop of known length does the
        # same steps, queued at once: one read of the count instead of one per chunk. Around the whole group,
        # so that no buffer that the chunks update in place enters the branches (XLA would copy it): hence only
        # for the single group, whose dW accumulator does not exist before it.
        n_chunks = layout(size, plan.rows)[1]
        return lax.cond(n_run == n_chunks, lambda: group(n_chunks), lambda: group(n_run))

    def x_rows(sl):
        return sl(x) if perm is None else jnp.take(x, sl(jnp.asarray(perm)), axis=0)

    def in_x_order(dx):
        return dx if dx is None or perm is None else dx[np.argsort(perm)]

    if plan.group_rows is None:
        outputs, dx, dw, db = valid_first_pass(x_rows(lambda a: a), inputs, None, db, trace, whole=True)
        return outputs, in_x_order(dx), _weight_grad(dw), db
    g_first, n_groups = layout(plan.n_rows, plan.group_rows)

    def group_at(start, dw, db, last=False):
        sl = functools.partial(lax.dynamic_slice_in_dim, start_index=start, slice_size=plan.group_rows)
        # A group's chunks need nothing of the groups before it, so XLA could run them before the previous
        # group's GEMMs, with both groups' kept dZ alive (one [rows, V] more at the peak).
        x_g, inputs_g = _after((x_rows(sl), {k: sl(v) for k, v in inputs.items()}), (dw, db))
        return valid_first_pass(x_g, inputs_g, dw, db, None, last=last)

    def middle_group(i, carry):
        outputs, dx, dw, db = group_at(g_first + (i - 1) * plan.group_rows, *carry)
        return (dw, db), (outputs, dx)

    # The first group starts dW, the middle ones (a loop) add to it, the last ends it: after its product only
    # the (hi, lo) pair's hi is used, so its lo is only read (`dw_accumulate(last=True)`), which XLA would
    # otherwise copy (its update unused) before the GEMM writes it in place.
    outputs, dx, dw, db = valid_first_pass(x_rows(lambda a: a[:g_first]), {k: v[:g_first] for k, v in inputs.items()},
                                           None, db, trace)
    if n_groups > 2:
        (dw, db), stacked = stack_loop(middle_group, 1, n_groups - 1, (dw, db), n_groups - 2)
        outputs, dx = _flat((outputs, dx), stacked)
    last_outputs, last_dx, dw, db = group_at(plan.n_rows - plan.group_rows, dw, db, last=True)
    outputs, dx = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), (outputs, dx), (last_outputs, last_dx))
    return outputs, in_x_order(dx), _weight_grad(dw), db

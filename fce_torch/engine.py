"""The chunked engine: logits GEMM -> row statistics -> loss head -> dlogits -> dX and dW GEMMs.

`sweep` runs it over all rows of x, chunk by chunk as a `fce_core.plan.Plan` says, for any `Head` (FLCE,
token log-probs, CPO): the head turns one chunk's row statistics into its outputs and the per-row gradient
coefficients. How its result reaches autograd is autodiff.py's. Twin: fce_jax/engine.py.
"""
from dataclasses import dataclass

import torch

from fce_core.rows import target_logits, tile_weights
from fce_core.rows import valid_first_in_groups as valid_first_in_groups_of
from fce_core.heads import Head  # noqa: F401  (re-exported: the heads build it)
from fce_core.heads import LOAD_COEF, forms_dz_on_load

from . import arrays, gemm
from .checks import HostRead
from .kernels.dlogits import accumulate_bias_grad, dlogits, scale_rows
from .kernels.fastmath import ASM
from .kernels.grad_gemms import TileValues, dw_accumulate, dw_first, dw_gemm, dx_gemm, dz_on_load_enabled
from .kernels.logit_tiles import gemm_config, logit_tiles, merge_tiles
from .kernels.row_stats import row_stats
from .kernels.tile_dlogits import tile_dlogits
from .sums import pairwise_sum

F32 = torch.float32


def valid_first_in_groups(y, ignore_index, groups):
    """`fce_core.rows.valid_first_in_groups` on this framework's arrays: (order, counts)."""
    return valid_first_in_groups_of(arrays, y, ignore_index, groups)


def _rows_back(t, order, n_rows):
    """Rows [0, len(t)) of the valid-first order back to the caller's n_rows; the rows past t are 0."""
    if order is None:
        return t
    return t.new_zeros((n_rows, *t.shape[1:])).index_copy_(0, order[:t.shape[0]], t)


def _outputs(pieces, order, n_rows):
    """The chunks' per-row head outputs, concatenated, in the caller's row order. A single chunk's outputs
    are the head's own new arrays, so they are not copied (torch.cat of one array would copy it: a launch
    each, which the host pays at one chunk)."""
    if len(pieces) == 1:
        return {k: _rows_back(v, order, n_rows) for k, v in pieces[0].items()}
    return {k: _rows_back(torch.cat([p[k] for p in pieces]), order, n_rows) for k in pieces[0]}


def _dz_buffer(z, dtype):
    """dZ in the logits' own memory: a 16-bit row takes the first half of its float32 row."""
    return z if dtype == F32 else z.view(dtype)[:, : z.shape[1]]


class _Grads:
    """dX rows, the dW accumulator and db of one sweep. dW (+)= dZ^T X: the first product writes it, in the
    weight's dtype when it is the only one (`single`), else in float32. The dX rows of chunks that may be
    skipped start at 0. With `order` (the sweep's rows in x: the valid-first permutation, a caller's `perm`, or
    both composed), rows [r0, r1) of the sweep are x's rows order[r0:r1] (`rows` gathers them per chunk, or
    per group for the GEMMs over a kept dZ) and their dX goes back to those rows of dx, so that no permuted
    copy of x or dX exists."""

    def __init__(self, x, w, grads, single, comm, own=False, order=None):
        self.x, self.w, self.single, self.comm, self.own, self.order = x, w, single, comm, own, order
        self.need_dx, self.need_dw, need_db = grads
        self.dx = x.new_empty(x.shape) if self.need_dx else None
        self.dw = None
        self.db = torch.zeros(w.shape[0], device=x.device, dtype=F32) if need_db else None

    def rows(self, r0, r1):
        """x's rows [r0, r1) of the sweep's order."""
        return self.x[r0:r1] if self.order is None else self.x.index_select(0, self.order[r0:r1])

    def skip(self, r0):
        """The sweep's rows from r0 on do not run: their dX rows are 0."""
        if self.dx is not None:
            if self.order is None:
                self.dx[r0:].zero_()
            else:
                self.dx.index_fill_(0, self.order[r0:], 0)

    def _dx(self, r0, r1, product, scale=None):
        """dX of rows [r0, r1): product(out) writes dZ W into `out`, dx's rows (a new block put back at the
        caller's rows, with `order`) or a float32 block: vocab-parallel (the shards' parts then summed), or with
        `scale` [r1 - r0], the rows' scale, which multiplies it before its one rounding to dx's dtype."""
        dx = self.dx[r0:r1] if self.order is None else self.dx.new_empty(r1 - r0, self.dx.shape[1])
        if self.comm is None and scale is None:
            product(dx)
        else:
            part = product(dx.new_empty(dx.shape, dtype=F32))
            part = part if self.comm is None else self.comm.sum_parts(part)
            if scale is None:
                dx.copy_(part)
            else:
                scale_rows(part, scale, out=dx)
        if self.order is not None:
            self.dx.index_copy_(0, self.order[r0:r1], dx)

    def add(self, dz, r0, r1, x_rows, ran=None, last=False, scale=None):
        """The GEMMs of the dZ of rows [r0, r1), x_rows = `rows(r0, r1)` (vocab-parallel: dX from the shards'
        float32 parts). `ran`: a kept dZ's rows past its first `ran` did not run (unwritten); `scale`
        [r1 - r0]: the rows' scale of dZ. The fused engine's GEMMs leave those rows out and apply the scale
        (`_add_own`); the library's take every row, so those rows are set to 0 and dZ is scaled in place first.
        `last`: no product follows (the fused engine's (hi, lo) pair then writes hi alone)."""
        if self.own:
            return self._add_own(dz, r0, r1, x_rows, ran, last, scale)
        if ran is not None:
            dz[ran:].zero_()
        if scale is not None:
            scale_rows(dz, scale)
        if self.need_dx:
            self._dx(r0, r1, lambda out: gemm.mm(dz, self.w, out.dtype, out=out))
        if self.need_dw:
            if self.dw is None:
                self.dw = gemm.mm(dz.t(), x_rows, self.w.dtype if self.single else F32)
            else:
                gemm.addmm_(self.dw, dz.t(), x_rows)
        if self.db is not None:
            accumulate_bias_grad(dz, self.db)

    def _add_own(self, dz, r0, r1, x_rows, ran=None, last=False, scale=None):
        """`add` with the fused engine's GEMMs: dW written once in the weight's dtype (`single`), or
        accumulated as `grad_gemms.dw_first` starts it (a bfloat16 (hi, lo) pair, else float32); vocab-parallel,
        dX from the shards' float32 parts as in `add`. With `ran`, dX is 0 past those rows and dW's K is
        `ran`. With `scale` (dZ's rows times scale, docs/NUMERICS.md "CPO"), dX = scale (dZ W) rounded once
        from float32, dW = dZ^T (scale X) and db sums scale dZ: no pass over the [rows, V] dZ. `dz` may be
        `fce_core.heads.TileValues`, dZ formed on the GEMMs' operand load (no `scale`, `ran` or db then)."""
        precision = gemm.triton_precision(x_rows)  # dZ's dtype: the tile values are in the input's
        if self.need_dx:
            self._dx(r0, r1, lambda out: dx_gemm(dz, self.w, out, precision, rows=ran), scale)
        if self.need_dw:
            if scale is not None:
                x_rows = scale_rows(x_rows, scale, out=torch.empty_like(x_rows))
            if self.single:
                self.dw = dw_gemm(dz, x_rows, self.w.dtype, precision, rows=ran)
            elif self.dw is None:
                self.dw = dw_first(dz, x_rows, self.w.dtype, precision, rows=ran)
            else:
                self.dw = dw_accumulate(dz, x_rows, self.dw, precision, rows=ran, last=last)
        if self.db is not None:
            accumulate_bias_grad(dz, self.db, scale, rows=ran)

    def weight_grad(self):
        """dW: the hi half of a (hi, lo) pair (its rounded sum), else the accumulator or product."""
        return self.dw[0] if isinstance(self.dw, tuple) else self.dw


def sweep(x, w, bias, class_weights, head, inputs, plan, *, grads=(False, False, False), transform,
          ignore_index, check=None, finish=None, comm=None, trace=None, engine="library", perm=None):
    """One pass over all rows of x [N, H] with w [V, H]. `inputs`: per-row tensors (at least "y"), cut into
    the plan's chunks and handed to the head with each chunk's statistics; the head's outputs are
    concatenated over chunks. Returns (outputs, dx, dw, db) for `grads` = which of (dx, dw, db) to compute;
    dw is float32 when accumulated over several chunks or groups, in the weight's dtype otherwise.

    Ignored rows (y == ignore_index) are skipped when the plan's groups have several chunks
    (`Plan.puts_valid_first`): each group's rows are put valid-first within it (`valid_first_in_groups`),
    and with the value check (`check`, a `checks.ValueCheck`) a group's full chunks past its last valid row
    never run; their outputs are 0 (so every head output must be per row), their dX rows too. The sweep reads
    the check's count (and the groups' counts, through a `checks.HostRead` queued before the first chunk)
    once the first chunk is queued (or, without valid-first, once every chunk is); where it says that no row
    is ignored, the chunks after the first take the caller's rows directly (the same rows). Without the check
    every chunk runs: an ignored row's dZ is exactly 0, so the bits are the same either way. With the plan's kept
    dZ the dX and dW GEMMs run once per group: on the fused engine over the rows of the chunks that ran, whose
    left-out K steps would add exact zeros (the same bits, docs/NUMERICS.md), on the library engine over all
    rows (those that did not run set to 0), so that its shapes do not depend on the count.

    `finish(outputs, inputs)` adds outputs from a whole group's outputs and inputs (in the caller's order);
    its "scale" [rows] multiplies the group's kept dZ rows (a loss whose coefficients need more rows than a
    chunk holds: the head gives unit coefficients, finish the scale): on the library engine in place before
    the GEMMs, on the fused engine in them (`_Grads.add`), which leaves the dZ rows of chunks that did not
    run unwritten. With groups of rows (the plan's group_rows), each group's outputs are concatenated and dW
    accumulates over the groups.

    `engine`: "library" (a library logits GEMM into float32 logits, then the row passes) or "fused" (our logits
    GEMM with the statistics epilogue and 16-bit tile values, `kernels/logit_tiles.py`); docs/NUMERICS.md.

    `perm` [N]: the sweep's row r is x's row perm[r] (`inputs` and the outputs are in the sweep's order, dX in
    x's): CPO's pairs grouped, with no permuted copy of x or dX.
    """
    n_rows = x.shape[0]
    keep = plan.keep_dz and any(grads)
    groups = plan.groups
    order, counts, n_run, caller_inputs = None, None, None, inputs
    if plan.puts_valid_first:
        order, counts = valid_first_in_groups(inputs["y"], ignore_index, groups)
        counts = None if check is None or len(groups) == 1 else HostRead(counts)
        inputs = {k: v[order] for k, v in inputs.items()}
    acc = _Grads(x, w, grads, single=plan.single_product(any(grads)), comm=comm, own=engine == "fused",
                 order=_composed(perm, order))
    run = (_FusedChunkRunner if engine == "fused" else _ChunkRunner)(w, bias, class_weights, head, transform, grads,
                                                                    trace, comm)
    outs = []
    for g, (g0, g1) in enumerate(groups):
        chunks = plan.chunks(g1 - g0)
        dz_rows = x.new_empty(g1 - g0, w.shape[0]) if keep else None
        pieces = []
        for r0, r1 in chunks:
            if n_run is not None and len(pieces) == n_run[g]:
                break
            pieces.append(run(acc.rows(g0 + r0, g0 + r1), {k: v[g0 + r0:g0 + r1] for k, v in inputs.items()},
                              None if keep else (acc, g0 + r0, g0 + r1), None if dz_rows is None else dz_rows[r0:r1]))
            if order is not None and check is not None and n_run is None:  # one chunk queued: the counts now
                n_valid = check.valid_rows()
                group_valid = [n_valid] if counts is None else counts.get()
                n_run = [plan.chunks_to_run(n, size=b1 - b0) for n, (b0, b1) in zip(group_valid, groups)]
                if n_valid == n_rows:  # valid-first is the caller's order: the rest takes the caller's rows
                    order, inputs, acc.order = None, caller_inputs, perm
        if len(pieces) < len(chunks) and not keep:
            acc.skip(g0 + chunks[len(pieces)][0])
        chunks = chunks[:len(pieces)]
        group_order = None if order is None else order[g0:g1] - g0 if g0 else order[:g1]
        out = _outputs(pieces, group_order, g1 - g0)
        if finish is not None:
            out.update(finish(out, {k: v[g0:g1] for k, v in caller_inputs.items()}))
        if keep:
            scale = out.get("scale")
            scale = scale if scale is None or group_order is None else scale[group_order]
            # no name holds the kept dZ past its GEMMs: it is freed before the next group allocates its own
            acc.add(run.kept_dz(dz_rows, pieces, inputs["y"][g0:g0 + chunks[-1][1]]), g0, g1, acc.rows(g0, g1),
                    ran=chunks[-1][1], last=g == len(groups) - 1, scale=scale)
            dz_rows = None
        outs.append(out)
    if check is not None:
        check.valid_rows()  # read once every chunk is queued, where no chunk needed it
    outputs = {k: torch.cat([o[k] for o in outs]) for k in outs[0]} if len(outs) > 1 else outs[0]
    return outputs, acc.dx, acc.weight_grad(), acc.db


def _composed(perm, order):
    """The sweep's rows in x: x's rows `perm` taken in the valid-first `order` (either may be None)."""
    if perm is None or order is None:
        return order if perm is None else perm
    return perm[order]


class _ChunkRunner:
    """One chunk: the logits GEMM, its statistics, the head, and with gradients its dZ, written into the kept
    rows (`dz_rows`) or into the logits' memory and then added to the gradients (`add` = (grads, r0, r1))."""

    def __init__(self, w, bias, class_weights, head, transform, grads, trace, comm):
        self.w, self.bias, self.cw, self.head, self.transform = w, bias, class_weights, head, transform
        self.need_grads = any(grads)
        self.trace, self.comm = trace, comm

    def kept_dz(self, dz_rows, pieces, y):
        """A group's kept dZ for its GEMMs, given its chunks' head outputs `pieces` and targets `y` (the
        rows that ran, in the sweep's order): the rows themselves (the fused engine's may be tile values)."""
        return dz_rows

    def __call__(self, x_c, inputs, add, dz_rows):
        z = gemm.mm(x_c, self.w.t(), F32)
        y, comm = inputs["y"], self.comm
        r_y = target_logits(arrays, z, y, self.bias) if comm is None else comm.target_logits(z, y, self.bias)
        parts = row_stats(z, self.bias, r_y, self.cw, spec=self.head.stats, transform=self.transform, asm=ASM)
        stats = {k: pairwise_sum(v) if v.dim() == 2 else v for k, v in parts.items()}
        if comm is not None:
            stats = comm.merge(stats)
            y = comm.local_targets(y)
        out = self.head.fn(stats, inputs)
        trace, self.trace = self.trace, None  # the first chunk's stages only
        if trace is not None:
            trace["logits"] = z.clone()
        if self.need_grads:
            dz = dz_rows if dz_rows is not None else _dz_buffer(z, x_c.dtype)
            dlogits(z, dz, self.bias, y, self.cw, out, transform=self.transform, asm=ASM)
            if trace is not None:
                trace["dlogits"] = dz.clone()
            if add is not None:
                add[0].add(dz, add[1], add[2], x_c)
        return out


class _FusedChunkRunner(_ChunkRunner):
    """The same chunk on the fused engine: the tile values take the kept rows (or a new [rows, V] array in the
    input dtype) and dZ overwrites them, or, where the GEMMs form it on their operand load
    (`fce_core.heads.forms_dz_on_load` with `grad_gemms.dz_on_load_enabled`), the GEMMs take
    the tile values as they are: the chunk's own, or a group's kept rows (`kept_dz`). Vocab-parallel, the
    target logit is the owner shard's and the shards' statistics are merged, as in `_ChunkRunner`."""

    def __init__(self, w, bias, class_weights, head, transform, grads, trace, comm):
        super().__init__(w, bias, class_weights, head, transform, grads, trace, comm)
        self.tile_weights = None if class_weights is None else tile_weights(arrays, class_weights,
                                                                              gemm_config().tile_n)
        # the trace takes the first chunk's stages only, yet no chunk of a traced call forms dZ on load
        self.db, self.traced = grads[2], trace is not None
        self.kept_tiles = []  # with kept dZ formed on the load: the group's chunks' tile maxima so far

    def kept_dz(self, dz_rows, pieces, y):
        """`_ChunkRunner.kept_dz`: where the chunks left tile values (`kept_tiles`), `TileValues` over them."""
        if not self.kept_tiles:
            return dz_rows
        m_tiles, self.kept_tiles = torch.cat(self.kept_tiles), []
        coef = {k: torch.cat([p[k] for p in pieces]) for k in LOAD_COEF}
        return TileValues(dz_rows, m_tiles, y, coef, gemm_config().tile_n)

    def __call__(self, x_c, inputs, add, dz_rows):
        y, vocab, comm = inputs["y"], self.w.shape[0], self.comm
        local = y if comm is None else comm.local_targets(y)
        e, parts = logit_tiles(x_c, self.w, self.bias, local, self.cw,
                               spec=self.head.stats, transform=self.transform, precision=gemm.triton_precision(x_c),
                               out=dz_rows, store=self.need_grads)
        zy = None if comm is None else comm.owner_values(parts["zy"].amax(dim=1), y, vocab)
        stats = merge_tiles(parts, vocab, self.tile_weights, zy=zy)
        if comm is not None:
            stats = comm.merge(stats)
        out = self.head.fn(stats, inputs)
        trace, self.trace = self.trace, None
        if trace is not None and e is not None:
            trace["tiles"] = e.clone()
        if self.need_grads:
            if forms_dz_on_load(dz_on_load_enabled(), self.cw, out, self.transform, db=self.db,
                                traced=self.traced, vocab_parallel=comm is not None):
                if add is None:  # the kept rows stay tile values: `kept_dz` forms dZ in the group's GEMMs
                    self.kept_tiles.append(parts["m"])
                else:
                    add[0].add(TileValues(e, parts["m"], local, out, gemm_config().tile_n), add[1], add[2], x_c)
                return out
            tile_dlogits(e, parts["m"], local, stats["zy"], self.cw, out, transform=self.transform)
            del parts, stats  # the [rows, tiles] partials are free before the dX planes and dW take memory
            if trace is not None:
                trace["dlogits"] = e.clone()
            if add is not None:
                add[0].add(e, add[1], add[2], x_c)
        return out

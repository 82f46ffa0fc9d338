"""The fused engine's dX and dW GEMMs of grad_gemms.py on Pallas Mosaic GPU, for 16-bit operands
(`GradGemmConfig.mosaic`, the JAX twin's default for them on the GPU): the same K-ascending products and
epilogues (WRITE, ADD, the (hi, lo) PAIR), so the same bits, with TMA loads, a warp-specialized wgmma pipeline
and persistent programs. Launches: `mgpu.py`.

Two schedules: `_kernel`, whose two compute warpgroups split each tile's rows and run its epilogue together
(the tensor cores idle meanwhile), and `_pingpong_kernel` (`GradGemmConfig.pingpong`, where K is not sliced:
dW of a short chunk, GRAD_GEMM_MOSAIC_SHORT_K), whose warpgroups take tiles in turns off one ring of stages, so
that one's epilogue (the (hi, lo) pair's reads and writes, above all) runs under the other's products.
"""
import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fce_core.plan import ADD, PAIR, PAIR_LAST, WRITE, gemm_items, reads_c, rows_fast

from . import fastmath as fm
from . import mgpu
from .mgpu import COMPUTE_WGS, MEMORY_REGISTERS
from .grad_gemms import F32, tma_rows
from .launch import typed

EPILOGUE_ROWS = 64   # rows of a compute warpgroup's epilogue block in shared memory
LOADED_COLS = 64     # columns of an epilogue block that C is loaded into (ADD, PAIR), two of them in flight


def _kernel(a_gmem, b_gmem, *c_gmem, m, n, k, slice_k, slices, a_t, mode, first, cfg, stages_):
    """Output tiles of cfg.tile_m x cfg.tile_n on a persistent loop over (tile, slice) items. Per item, a
    warp-specialized pipeline over the slice's K steps (a memory warpgroup's TMA loads, two compute warpgroups'
    wgmma on their tile_m / 2 rows each), then each compute warpgroup's epilogue through shared memory and TMA
    stores, block by block (`_blocks`). ADD and PAIR read C: its first two blocks are loaded by TMA before the
    K loop (overlapping it), each later one as soon as the store two blocks before it has left its slot.
    Tiles walk rows or columns fastest as `fce_core.plan.rows_fast` says."""
    bm, bn, bk = cfg.tile_m // COMPUTE_WGS, cfg.tile_n, cfg.tile_k
    tiles = gemm_items(m, n, 1, cfg.tile_m, bn)
    planes = c_gmem[0].ndim == 3
    dtype = a_gmem.dtype
    a_block = (bk, cfg.tile_m) if a_t else (cfg.tile_m, bk)
    specs = [plgpu.BlockSpec(a_block, (lambda s: (s, 0)) if a_t else (lambda s: (0, s)),
                             transforms=mgpu.transforms(a_block[1], dtype)),
             plgpu.BlockSpec((bk, bn), lambda s: (s, 0), transforms=mgpu.transforms(bn, dtype))]

    def pipeline(body, context, steps):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps,), memory_registers=MEMORY_REGISTERS, in_specs=specs, wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS, max_concurrent_steps=stages_, compute_context=context)

    allocs = pipeline(None, None, pl.cdiv(slice_k, bk)).get_allocations(a_gmem, b_gmem)

    @functools.partial(pl.run_scoped, allocs=allocs, **_c_scratch(c_gmem, cfg, mode, first), collective_axes="wg")
    def _scope(allocs, epi, bars):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((tiles * slices,), collective_axes="sm")
        def _item(info):
            (item,) = info.index
            tile, sl = lax.rem(item, tiles), lax.div(item, tiles)
            r0, c0 = _origin(tile, m, n, cfg.tile_m, bn)
            k_lo = sl * slice_k
            steps = lax.div(jnp.minimum(k, k_lo + slice_k) - k_lo + bk - 1, bk)
            ks, rows, cols = pl.ds(k_lo, slice_k), pl.ds(r0, cfg.tile_m), pl.ds(c0, bn)
            wg_rows = pl.ds(wg * bm, bm)

            def mma(_, a_smem, b_smem, acc):
                a = plgpu.transpose_ref(a_smem.at[:, wg_rows], (1, 0)) if a_t else a_smem.at[wg_rows]
                plgpu.wgmma(acc, a, b_smem)
                plgpu.wgmma_wait(0)
                return acc

            def context(run):
                c_tile = _CTile(c_gmem, epi, bars, wg, r0 + wg * bm, c0, sl if planes else None, cfg, mode, first)
                c_tile.prefetch()

                @functools.partial(pl.run_scoped, acc=plgpu.ACC((bm, bn), F32))
                def _acc(acc):
                    run(acc)
                    c_tile.finish(acc[...])

            a_src = a_gmem.at[ks, rows] if a_t else a_gmem.at[rows, ks]
            pipeline(mma, context, steps)(a_src, b_gmem.at[ks, cols], allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _pingpong_kernel(a_gmem, b_gmem, *c_gmem, m, n, k, a_t, mode, first, cfg, stages_):
    """`_kernel` where K is not sliced, on tiles of cfg.tile_m / 2 x cfg.tile_n that the two compute
    warpgroups take in turns (`GradGemmConfig.pingpong`, on `mgpu.pingpong`): the next tile's products start as
    soon as its stages arrive, while this tile's owner runs its epilogue (C's prefetch before its K loop).
    Each output element takes the same K-ascending products and epilogue as in `_kernel`: the same bits."""
    bm, bn, bk = cfg.tile_m // COMPUTE_WGS, cfg.tile_n, cfg.tile_k
    tiles, steps = gemm_items(m, n, 1, bm, bn), pl.cdiv(k, bk)
    dtype = a_gmem.dtype
    a_block = (bk, bm) if a_t else (bm, bk)
    ring = dict(
        a_smem=plgpu.SMEM((stages_, *a_block), dtype, transforms=mgpu.transforms(a_block[1], dtype)),
        b_smem=plgpu.SMEM((stages_, bk, bn), dtype, transforms=mgpu.transforms(bn, dtype)),
        **mgpu.pingpong_barriers(stages_))

    @functools.partial(pl.run_scoped, **ring, **_c_scratch(c_gmem, cfg, mode, first), collective_axes="wg")
    def _scope(a_smem, b_smem, loaded, consumed, epi, bars):
        wg = lax.axis_index("wg")

        def load(at, s, slot, arrived):
            r0, c0 = at
            ks = pl.ds(s * bk, bk)
            a_src = a_gmem.at[ks, pl.ds(r0, bm)] if a_t else a_gmem.at[pl.ds(r0, bm), ks]
            plgpu.copy_gmem_to_smem(a_src, a_smem.at[slot], arrived)
            plgpu.copy_gmem_to_smem(b_gmem.at[ks, pl.ds(c0, bn)], b_smem.at[slot], arrived)

        def mma(acc, slot):
            a = plgpu.transpose_ref(a_smem.at[slot], (1, 0)) if a_t else a_smem.at[slot]
            plgpu.wgmma(acc, a, b_smem.at[slot])

        def prologue(at):
            c_tile = _CTile(c_gmem, epi, bars, wg, *at, None, cfg, mode, first)
            c_tile.prefetch()
            return c_tile

        mgpu.pingpong(tiles, steps, stages_, loaded, consumed, origin=lambda tile: _origin(tile, m, n, bm, bn),
                      load=load, mma=mma, prologue=prologue, epilogue=lambda _, acc, c_tile: c_tile.finish(acc[...]),
                      acc_shape=(bm, bn))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _origin(tile, m, n, tile_m, tile_n):
    """The first row and column of output tile `tile` of [m, n], the tiles walking rows or columns fastest as
    `fce_core.plan.rows_fast` says."""
    n_m, n_n = pl.cdiv(m, tile_m), pl.cdiv(n, tile_n)
    if rows_fast(m, n, tile_m, tile_n):
        return lax.rem(tile, n_m) * tile_m, lax.div(tile, n_m) * tile_n
    return lax.div(tile, n_n) * tile_m, lax.rem(tile, n_n) * tile_n


def _c_scratch(c_gmem, cfg, mode, first):
    """The epilogue's shared memory and barriers (`_CTile`): per compute warpgroup, `_blocks`' slots of every
    plane of C, and a barrier per slot and plane for C's loads."""
    _, (rows_e, cols_e), slots = _blocks(cfg, reads_c(mode, first))
    return dict(epi=[plgpu.SMEM((COMPUTE_WGS, slots, rows_e, cols_e), c.dtype,
                                transforms=mgpu.transforms(cols_e, c.dtype)) for c in c_gmem],
                bars=plgpu.Barrier(num_barriers=COMPUTE_WGS * slots * len(c_gmem)))


class _CTile:
    """One compute warpgroup's tile of C (tile_m / 2 rows from `row0`, tile_n columns from `col0`; `plane`: the
    K slice's plane of 3-d C, or None), through its `_blocks`: `prefetch` loads the first blocks that the
    epilogue reads (ADD, PAIR) before the K loop, `finish` takes the float32 product and writes each block,
    loading a later block as soon as the store two blocks before it has left its slot."""

    def __init__(self, c_gmem, epi, bars, wg, row0, col0, plane, cfg, mode, first):
        self.c_gmem, self.epi, self.bars, self.wg, self.row0, self.col0, self.plane = (c_gmem, epi, bars, wg, row0,
                                                                                       col0, plane)
        self.mode, self.first, self.loads = mode, first, reads_c(mode, first)
        self.blocks, (self.rows_e, self.cols_e), self.slots = _blocks(cfg, self.loads)

    def dst(self, b):  # block b's part of C in global memory
        i, j = self.blocks[b]
        out = pl.ds(self.row0 + i * self.rows_e, self.rows_e), pl.ds(self.col0 + j * self.cols_e, self.cols_e)
        return [c.at[out] if self.plane is None else c.at[(self.plane, *out)] for c in self.c_gmem]

    def smem(self, b):
        return [s_.at[self.wg, b % self.slots] for s_ in self.epi]

    def ready(self, b):  # the barriers of block b's loads
        base = (self.wg * self.slots + b % self.slots) * len(self.c_gmem)
        return [self.bars.at[base + i] for i in range(len(self.c_gmem))]

    def load(self, b):
        for d, s_, b_ in zip(self.dst(b), self.smem(b), self.ready(b)):
            plgpu.copy_gmem_to_smem(d, s_, b_)

    def prefetch(self):
        if self.loads:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's stores have left the slots
            for b in range(min(self.slots, len(self.blocks))):
                self.load(b)

    def finish(self, total):
        rows_e, cols_e = self.rows_e, self.cols_e
        for b, (i, j) in enumerate(self.blocks):
            part = total[i * rows_e:(i + 1) * rows_e, j * cols_e:(j + 1) * cols_e]
            _epilogue(part, self.dst(b), self.smem(b), self.ready(b) if self.loads else None, self.mode, self.first)
            if self.loads and b + self.slots < len(self.blocks):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # block b's stores left its slot
                self.load(b + self.slots)


def _blocks(cfg, loads):
    """A compute warpgroup's epilogue blocks: ([(row block, column block)], (rows, cols) of a block, slots in
    shared memory). Blocks of EPILOGUE_ROWS full-width rows in one slot; where C is loaded (ADD, PAIR), blocks
    of EPILOGUE_ROWS x LOADED_COLS in two slots, so that one block's load overlaps the other's arithmetic
    without the whole tile in shared memory (which would leave room for one pipeline stage at 256 x 128)."""
    bm = cfg.tile_m // COMPUTE_WGS
    rows = min(EPILOGUE_ROWS, bm)
    cols = min(LOADED_COLS, cfg.tile_n) if loads else cfg.tile_n
    return [(i, j) for i in range(bm // rows) for j in range(cfg.tile_n // cols)], (rows, cols), 2 if loads else 1


def _epilogue(acc, dst, smem, ready, mode, first):
    """One compute warpgroup's block of C from its float32 `acc`: written (WRITE), added to C (ADD), or the
    (hi, lo) pair updated (PAIR; PAIR_LAST stores hi alone), through its `smem` tiles (loaded from C, `ready`
    their barriers, when given) into the `dst` blocks of global memory."""
    if ready is not None:
        for b_ in ready:
            plgpu.barrier_wait(b_)
    else:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous block's stores have read the tiles
    if mode == WRITE:
        smem[0][...] = acc.astype(smem[0].dtype)
    elif mode == ADD:
        smem[0][...] = smem[0][...] + acc
    else:
        total = acc if first else fm.pair_value(smem[0][...], smem[1][...]) + acc
        smem[0][...], smem[1][...] = fm.pair_split(total, smem[0].dtype)
    plgpu.commit_smem()
    for d, s_ in zip(dst[:1] if mode == PAIR_LAST else dst, smem):
        plgpu.copy_smem_to_gmem(s_, d)


def mosaic_gemm(a, b, m, n, k, *, a_t, mode, outs, first, slices, slice_k, cfg, reads=()):
    """grad_gemms' `_run` on Mosaic GPU (mode WRITE / ADD / PAIR / PAIR_LAST as there): outs all new
    (ShapeDtypeStructs) or all given (updated in place as `jax.Ref`s), `reads` planes of C only read (after
    outs). Returns the list of results. Every row of the operands and outputs must be a multiple of 16 bytes
    (TMA), m, n, k at least 1, and dW's K (a_t: the first k rows of a and b) must end at their last row or on a
    whole K step (TMA loads whole steps, bounded by the arrays: the rows past K would be read); else
    ValueError."""
    if min(m, n, k) < 1:
        raise ValueError(f"the Mosaic GPU GEMMs need m, n, k >= 1 (a K loop of no steps has no pipeline), "
                         f"got {(m, n, k)}")
    if a_t and k < a.shape[0] and k % cfg.tile_k:
        raise ValueError(f"the Mosaic GPU GEMMs read whole K steps of {cfg.tile_k} rows: dW over the first {k} of "
                         f"{a.shape[0]} rows would read rows past them (the Triton lowering masks them)")
    planes = [*outs, *reads]
    for name, arr in (("A", a), ("B", b), *((f"C{i}", o) for i, o in enumerate(planes))):
        if not tma_rows(arr):
            raise ValueError(f"the Mosaic GPU GEMMs load and store by TMA, whose rows are multiples of 16 bytes: "
                             f"{name} has rows of {arr.shape[-1]} {jnp.dtype(arr.dtype).name} values")
    _, (rows_e, cols_e), slots = _blocks(cfg, reads_c(mode, first))
    epilogue_bytes = sum(COMPUTE_WGS * slots * rows_e * cols_e * jnp.dtype(o.dtype).itemsize for o in planes)
    pingpong = cfg.pingpong and slices == 1
    tile_m = cfg.tile_m // COMPUTE_WGS if pingpong else cfg.tile_m  # a stage holds one compute warpgroup's tile
    per_stage = (tile_m + cfg.tile_n) * cfg.tile_k * jnp.dtype(a.dtype).itemsize
    items = gemm_items(m, n, slices, tile_m, cfg.tile_n)
    kernel = _pingpong_kernel if pingpong else functools.partial(_kernel, slice_k=slice_k, slices=slices)
    body = functools.partial(kernel, m=m, n=n, k=k, a_t=a_t, mode=mode, first=first, cfg=cfg,
                             stages_=mgpu.stages(cfg, per_stage, epilogue_bytes))
    given = [o for o in outs if not isinstance(o, jax.ShapeDtypeStruct)]
    launch = functools.partial(mgpu.kernel, body, programs=mgpu.programs(items), compute_threads=COMPUTE_WGS)
    if not given:
        return list(launch(out_type=tuple(typed(outs, (a, b))))(a, b))
    refs = mgpu.in_place(given)
    launch(out_type=())(a, b, *refs, *reads)
    return [r[...] for r in refs]

"""The fused engine's dX and dW GEMMs of grad_gemms.py on Pallas Mosaic GPU, for 16-bit operands
(`GradGemmConfig.mosaic`, the JAX twin's default for them on the GPU): the same K-ascending products and
epilogues (WRITE, ADD, the (hi, lo) PAIR), so the same bits, with TMA loads, a warp-specialized wgmma pipeline
and persistent programs. Launches: `mgpu.py`.
"""
import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fce_core.plan import gemm_items, rows_fast

from . import fastmath as fm
from . import mgpu
from .grad_gemms import ADD, F32, PAIR, WRITE, tma_rows
from .launch import typed

COMPUTE_WGS = 2      # compute warpgroups of a block: on tile_m / 2 rows of a tile each, or in ping-pong on tiles
MEMORY_REGISTERS = 40     # per thread of the memory warpgroup, which only issues TMA loads
COMPUTE_REGISTERS = 232   # per thread of a compute warpgroup: the rest of the register file, in multiples of 8
EPILOGUE_ROWS = 64   # rows of a compute warpgroup's epilogue block in shared memory
LOADED_COLS = 64     # columns of an epilogue block that C is loaded into (ADD, PAIR), two of them in flight


def _cluster_tile(cfg):
    """The output block of a cluster (`GradGemmConfig.cluster`): two tiles side by side along M or N, or one."""
    return cfg.tile_m * (1 + (cfg.cluster == "m")), cfg.tile_n * (1 + (cfg.cluster == "n"))


def _item(item, m, n, k, slice_k, cfg, block=0):
    """A (tile, slice) work item's output origin (r0, c0) for the cluster's `block`, its slice, the slice's
    first K and its K steps. Cluster tiles walk rows or columns fastest as `fce_core.plan.rows_fast` says."""
    (ctm, ctn), bk = _cluster_tile(cfg), cfg.tile_k
    n_m, n_n = pl.cdiv(m, ctm), pl.cdiv(n, ctn)
    tile, sl = lax.rem(item, n_m * n_n), lax.div(item, n_m * n_n)
    if rows_fast(m, n, ctm, ctn):
        r0, c0 = lax.rem(tile, n_m) * ctm, lax.div(tile, n_m) * ctn
    else:
        r0, c0 = lax.div(tile, n_n) * ctm, lax.rem(tile, n_n) * ctn
    if cfg.cluster == "m":
        r0 = r0 + block * cfg.tile_m
    elif cfg.cluster == "n":
        c0 = c0 + block * cfg.tile_n
    k_lo = sl * slice_k
    return r0, c0, sl, k_lo, lax.div(jnp.minimum(k, k_lo + slice_k) - k_lo + bk - 1, bk)


def _epilogue_io(c_gmem, epi, bars, wg, r0, c0, sl, cfg, mode, first):
    """One compute warpgroup's epilogue of its rows from r0 of the tile at column c0 (the slice's plane `sl`
    where C has planes): `prefetch()` loads C's first blocks (ADD, PAIR) into the warpgroup's shared-memory
    slots, to overlap the K loop; `finish(total)` runs `_epilogue` block by block on the float32 product,
    loading each later block of C as soon as the store two blocks before it has left its slot."""
    loads = _reads_c(mode, first)
    blocks, (rows_e, cols_e), slots = _blocks(cfg, loads)
    planes = c_gmem[0].ndim == 3

    def dst(b):  # block b's part of C in global memory
        i, j = blocks[b]
        out = pl.ds(r0 + i * rows_e, rows_e), pl.ds(c0 + j * cols_e, cols_e)
        return [c.at[(sl, *out)] if planes else c.at[out] for c in c_gmem]

    def smem(b):
        return [s_.at[wg, b % slots] for s_ in epi]

    def ready(b):  # the barriers of block b's loads
        return [bars.at[(wg * slots + b % slots) * len(c_gmem) + i] for i in range(len(c_gmem))]

    def load(b):
        for d, s_, b_ in zip(dst(b), smem(b), ready(b)):
            plgpu.copy_gmem_to_smem(d, s_, b_)

    def prefetch():
        if loads:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's stores have left the slots
            for b in range(min(slots, len(blocks))):
                load(b)

    def finish(total):
        for b, (i, j) in enumerate(blocks):
            part = total[i * rows_e:(i + 1) * rows_e, j * cols_e:(j + 1) * cols_e]
            _epilogue(part, dst(b), smem(b), ready(b) if loads else None, mode, first)
            if loads and b + slots < len(blocks):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # block b's stores left its slot
                load(b + slots)

    return prefetch, finish


def _epilogue_allocs(c_gmem, cfg, mode, first):
    """The compute warpgroups' epilogue slots in shared memory and the barriers of C's loads into them."""
    _, (rows_e, cols_e), slots = _blocks(cfg, _reads_c(mode, first))
    epi = [plgpu.SMEM((COMPUTE_WGS, slots, rows_e, cols_e), c.dtype, transforms=mgpu.transforms(cols_e, c.dtype))
           for c in c_gmem]
    return dict(epi=epi, bars=plgpu.Barrier(num_barriers=COMPUTE_WGS * slots * len(c_gmem)))


def _kernel(a_gmem, b_gmem, *c_gmem, m, n, k, slice_k, slices, a_t, mode, first, cfg, stages_):
    """Cooperative: output tiles of cfg.tile_m x cfg.tile_n on a persistent loop over (tile, slice) items. Per
    item, a warp-specialized pipeline over the slice's K steps (a memory warpgroup's TMA loads, two compute
    warpgroups' wgmma on their tile_m / 2 rows each), then each compute warpgroup's epilogue through shared
    memory and TMA stores, block by block (`_epilogue_io`)."""
    bm, bn, bk = _wg_rows(cfg), cfg.tile_n, cfg.tile_k
    items = gemm_items(m, n, slices, *_cluster_tile(cfg))
    dtype = a_gmem.dtype
    a_block = (bk, cfg.tile_m) if a_t else (cfg.tile_m, bk)
    shared = {"n": 0, "m": 1}.get(cfg.cluster)  # the operand that a cluster's two blocks share: multicast
    specs = [plgpu.BlockSpec(a_block, (lambda s: (s, 0)) if a_t else (lambda s: (0, s)),
                             transforms=mgpu.transforms(a_block[1], dtype),
                             collective_axes=("cluster",) if shared == 0 else ()),
             plgpu.BlockSpec((bk, bn), lambda s: (s, 0), transforms=mgpu.transforms(bn, dtype),
                             collective_axes=("cluster",) if shared == 1 else ())]

    def pipeline(body, context, steps):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps,), memory_registers=MEMORY_REGISTERS, in_specs=specs, wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS, max_concurrent_steps=stages_, compute_context=context)

    allocs = pipeline(None, None, pl.cdiv(slice_k, bk)).get_allocations(a_gmem, b_gmem)

    @functools.partial(pl.run_scoped, allocs=allocs, **_epilogue_allocs(c_gmem, cfg, mode, first),
                       collective_axes="wg")
    def _scope(allocs, epi, bars):
        wg = lax.axis_index("wg")

        block = lax.axis_index("cluster") if cfg.cluster else 0

        @plgpu.nd_loop((items,), collective_axes="sm")
        def _item_loop(info):
            r0, c0, sl, k_lo, steps = _item(info.index[0], m, n, k, slice_k, cfg, block)
            ks, rows, cols = pl.ds(k_lo, slice_k), pl.ds(r0, cfg.tile_m), pl.ds(c0, bn)
            wg_rows = pl.ds(wg * bm, bm)

            def mma(_, a_smem, b_smem, acc):
                a = plgpu.transpose_ref(a_smem.at[:, wg_rows], (1, 0)) if a_t else a_smem.at[wg_rows]
                plgpu.wgmma(acc, a, b_smem)
                plgpu.wgmma_wait(0)
                return acc

            def context(run):
                prefetch, finish = _epilogue_io(c_gmem, epi, bars, wg, r0 + wg * bm, c0, sl, cfg, mode, first)
                prefetch()

                @functools.partial(pl.run_scoped, acc=plgpu.ACC((bm, bn), F32))
                def _acc(acc):
                    run(acc)
                    finish(acc[...])

            a_src = a_gmem.at[ks, rows] if a_t else a_gmem.at[rows, ks]
            pipeline(mma, context, steps)(a_src, b_gmem.at[ks, cols], allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _ring_kernel(a_gmem, b_gmem, *c_gmem, m, n, k, slice_k, slices, a_t, mode, first, cfg, stages_):
    """Output tiles on a persistent loop over (tile, slice) items, their K steps loaded by a memory warpgroup
    into one ring of `stages_` slots that runs on across the items (so that each slot is released only when
    the wgmma reading it is done, and the next item's loads overlap this one's epilogue), in one of two
    schedules:
    - cooperative: both compute warpgroups on every tile, each on its tile_m / 2 rows;
    - ping-pong (`cfg.pingpong`): each compute warpgroup owns whole tiles, the two taking the items in turn,
      so that one's epilogue runs while the other's wgmma keeps the tensor cores busy. The ring's order alone
      staggers them (an item's operands arrive only as the item before it releases its slots).
    A slot's full barrier is waited on by the warpgroups that read it: in ping-pong each has its own set
    (Mosaic GPU tracks a barrier's phase per thread, so a warpgroup must wait on every completion of the
    barriers it waits on). Its consumed barrier, which every reader arrives on, is waited on by the memory
    warpgroup before it refills the slot."""
    bm, bn, bk = _wg_rows(cfg), cfg.tile_n, cfg.tile_k
    readers = 1 if cfg.pingpong else COMPUTE_WGS
    dtype = a_gmem.dtype
    a_block = (bk, cfg.tile_m) if a_t else (cfg.tile_m, bk)
    shared = {"n": 0, "m": 1}.get(cfg.cluster)  # the operand that a cluster's two blocks share: multicast
    multicast = [("cluster",) if shared == i else None for i in range(2)]
    consumed = plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=readers, num_barriers=stages_) \
        if cfg.cluster else plgpu.Barrier(num_arrivals=readers, num_barriers=stages_)
    ring = dict(a_smem=plgpu.SMEM((stages_, *a_block), dtype, transforms=mgpu.transforms(a_block[1], dtype)),
                b_smem=plgpu.SMEM((stages_, bk, bn), dtype, transforms=mgpu.transforms(bn, dtype)),
                full=plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS // readers * stages_),
                consumed=consumed)

    @functools.partial(pl.run_scoped, **ring, **_epilogue_allocs(c_gmem, cfg, mode, first), collective_axes="wg")
    def _scope(a_smem, b_smem, full, consumed, epi, bars):
        wg = lax.axis_index("wg")
        block = lax.axis_index("cluster") if cfg.cluster else 0

        def full_at(reader, slot):
            return full.at[reader * stages_ + slot] if cfg.pingpong else full.at[slot]

        def items(body):
            """body(owner, r0, c0, sl, k_lo, first ring step, steps) over the program's items, in order (owner:
            the ping-pong warpgroup of the item); returns the ring steps taken."""
            @plgpu.nd_loop((gemm_items(m, n, slices, *_cluster_tile(cfg)),), collective_axes="sm",
                           init_carry=jnp.int32(0))
            def steps_taken(info, carry):
                owner = lax.rem(info.local_index, COMPUTE_WGS)
                r0, c0, sl, k_lo, steps = _item(info.index[0], m, n, k, slice_k, cfg, block)
                body(owner, r0, c0, sl, k_lo, carry, steps)
                return carry + steps

            return steps_taken

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

            def load(owner, r0, c0, sl, k_lo, g0, steps):
                @pl.loop(0, steps)
                def _step(s):
                    g = g0 + s
                    slot = lax.rem(g, stages_)

                    @pl.when(g >= stages_)
                    def _wait():
                        plgpu.barrier_wait(consumed.at[slot])

                    ks, rows = pl.ds(k_lo + s * bk, bk), pl.ds(r0, cfg.tile_m)
                    bar = full_at(owner, slot)
                    plgpu.copy_gmem_to_smem(a_gmem.at[ks, rows] if a_t else a_gmem.at[rows, ks], a_smem.at[slot],
                                            bar, collective_axes=multicast[0])
                    plgpu.copy_gmem_to_smem(b_gmem.at[ks, pl.ds(c0, bn)], b_smem.at[slot], bar,
                                            collective_axes=multicast[1])

            loaded = items(load)

            @pl.loop(jnp.maximum(loaded - stages_, 0), loaded)
            def _drain(g):  # observe the last releases too: every phase of a barrier is waited on
                plgpu.barrier_wait(consumed.at[lax.rem(g, stages_)])

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            rows = slice(None) if cfg.pingpong else pl.ds(wg * bm, bm)  # the warpgroup's rows of a tile

            @items
            def _compute_tiles(owner, r0, c0, sl, k_lo, g0, steps):
                def tile():
                    prefetch, finish = _epilogue_io(c_gmem, epi, bars, wg, r0 + (0 if cfg.pingpong else wg * bm),
                                                    c0, sl, cfg, mode, first)
                    prefetch()

                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((bm, bn), F32))
                    def _acc(acc):
                        @pl.loop(0, steps)
                        def _step(s):
                            slot = lax.rem(g0 + s, stages_)
                            plgpu.barrier_wait(full_at(wg, slot))
                            a_slot = a_smem.at[slot]
                            a = plgpu.transpose_ref(a_slot.at[:, rows], (1, 0)) if a_t else a_slot.at[rows]
                            plgpu.wgmma(acc, a, b_smem.at[slot])
                            plgpu.wgmma_wait(1)  # the step before's wgmma is done: release its slot

                            @pl.when(s > 0)
                            def _release():
                                plgpu.barrier_arrive(consumed.at[lax.rem(g0 + s - 1, stages_)])

                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(consumed.at[lax.rem(g0 + steps - 1, stages_)])
                        finish(acc[...])

                if cfg.pingpong:
                    pl.when(owner == wg)(tile)
                else:
                    tile()

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _reads_c(mode, first):
    """Whether the epilogue reads C: to add to it (ADD), or to the (hi, lo) pair after the first chunk's."""
    return mode == ADD or (mode == PAIR and not first)


def _wg_rows(cfg):
    """The rows of a compute warpgroup's part of a tile: all of them in ping-pong, else half."""
    return cfg.tile_m if cfg.pingpong else cfg.tile_m // COMPUTE_WGS


def _blocks(cfg, loads):
    """A compute warpgroup's epilogue blocks: ([(row block, column block)], (rows, cols) of a block, slots in
    shared memory). Blocks of EPILOGUE_ROWS full-width rows in one slot; where C is loaded (ADD, PAIR), blocks
    of EPILOGUE_ROWS x LOADED_COLS in two slots, so that one block's load overlaps the other's arithmetic
    without the whole tile in shared memory (which would leave room for one pipeline stage at 256 x 128)."""
    bm = _wg_rows(cfg)
    rows = min(EPILOGUE_ROWS, bm)
    cols = min(LOADED_COLS, cfg.tile_n) if loads else cfg.tile_n
    return [(i, j) for i in range(bm // rows) for j in range(cfg.tile_n // cols)], (rows, cols), 2 if loads else 1


def _epilogue(acc, dst, smem, ready, mode, first):
    """One compute warpgroup's block of C from its float32 `acc`: written (WRITE), added to C (ADD), or the
    (hi, lo) pair updated (PAIR), through its `smem` tiles (loaded from C, `ready` their barriers, when given)
    into the `dst` blocks of global memory."""
    if ready is not None:
        for b_ in ready:
            plgpu.barrier_wait(b_)
    else:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous block's stores have read the tiles
    if mode == WRITE:
        smem[0][...] = acc.astype(smem[0].dtype)
    elif mode == ADD:
        smem[0][...] = smem[0][...] + acc
    else:  # plain operations: every product of the pair's arithmetic is exact, so contraction cannot move bits
        total = acc if first else fm.pair_value(smem[0][...], smem[1][...], asm=False) + acc
        smem[0][...], smem[1][...] = fm.pair_split(total, smem[0].dtype, asm=False)
    plgpu.commit_smem()
    for d, s_ in zip(dst, smem):
        plgpu.copy_smem_to_gmem(s_, d)


def mosaic_gemm(a, b, m, n, k, *, a_t, mode, outs, first, slices, slice_k, cfg):
    """grad_gemms' `_run` on Mosaic GPU (mode WRITE / ADD / PAIR as there): outs all new (ShapeDtypeStructs) or
    all given (updated in place as `jax.Ref`s). Returns the list of results. Every row of the operands and
    outputs must be a multiple of 16 bytes (TMA), and m, n, k at least 1; else ValueError."""
    if min(m, n, k) < 1:
        raise ValueError(f"the Mosaic GPU GEMMs need m, n, k >= 1 (a K loop of no steps has no pipeline), "
                         f"got {(m, n, k)}")
    for name, arr in (("A", a), ("B", b), *((f"C{i}", o) for i, o in enumerate(outs))):
        if not tma_rows(arr):
            raise ValueError(f"the Mosaic GPU GEMMs load and store by TMA, whose rows are multiples of 16 bytes: "
                             f"{name} has rows of {arr.shape[-1]} {jnp.dtype(arr.dtype).name} values")
    _, (rows_e, cols_e), slots = _blocks(cfg, _reads_c(mode, first))
    epilogue_bytes = sum(COMPUTE_WGS * slots * rows_e * cols_e * jnp.dtype(o.dtype).itemsize for o in outs)
    per_stage = (cfg.tile_m + cfg.tile_n) * cfg.tile_k * jnp.dtype(a.dtype).itemsize
    items = gemm_items(m, n, slices, *_cluster_tile(cfg))
    stages_ = mgpu.stages(cfg, per_stage, epilogue_bytes)
    if cfg.ring and stages_ < 2:  # a step's slot is released after the next step's wgmma is issued
        raise ValueError(f"the ring kernel needs 2 slots or more; {cfg.tile_m}x{cfg.tile_n} tiles leave room for one "
                         f"next to the epilogue's {epilogue_bytes} bytes")
    body = functools.partial(_ring_kernel if cfg.ring else _kernel, m=m, n=n, k=k, slice_k=slice_k, slices=slices,
                             a_t=a_t, mode=mode, first=first, cfg=cfg, stages_=stages_)
    given = [o for o in outs if not isinstance(o, jax.ShapeDtypeStruct)]
    blocks = 2 if cfg.cluster else 1
    launch = functools.partial(mgpu.kernel, body, programs=mgpu.programs(items, blocks), cluster=blocks,
                               compute_threads=COMPUTE_WGS)
    if not given:
        return list(launch(out_type=tuple(typed(outs, (a, b))))(a, b))
    refs = mgpu.in_place(given)
    launch(out_type=())(a, b, *refs)
    return [r[...] for r in refs]

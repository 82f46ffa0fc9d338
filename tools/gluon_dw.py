"""Prototype: dW's (hi, lo) pair accumulation (`fce_torch.kernels.grad_gemms.dw_first` / `dw_accumulate` for a
bfloat16 weight) as a persistent Gluon kernel whose epilogue operand, the tile's (hi, lo) blocks of C, is
prefetched into shared memory by TMA at the start of each output tile, so that its load overlaps the K loop
(the Triton kernel loads C by descriptor after the K loop, a wait per load).

C [M, N] (+)= A @ B with A = dZᵀ (dZ [K, M], read as [BK, BM] blocks and fed to wgmma transposed) and B = x
[K, N]; M = V, N = H. The products are the Triton kernel's: wgmma with float32 accumulation, K ascending in
k16 steps (the step BK only groups them), so the bits must equal fce_torch's.

`_dw_pair_ws_kernel` (dw_pair(ws=True)) is the same computation warp-specialized: a loader warp issues every TMA
load (the ring, C's blocks), the 8 compute warps only wait, run the wgmma and the epilogue, and store; the barrier
protocol is described above the kernel; tools/ws_protocol_sim.py checks it on random schedules.
`_dw_pair_pp_kernel` (dw_pair(pingpong=True)) gives each of two compute warpgroups whole tiles in turns, so that
one's epilogue runs under the other's wgmma (the protocol above it; the simulator checks it too).
`_dw_pair_ep_kernel` (dw_pair(ep=True)) hands each tile's float32 accumulator through shared memory to an
epilogue partition of 2 warps; `_dw_pair_il_kernel` (dw_pair(il=True)) runs each tile's epilogue a row block at a
time between the next tile's wgmma issues, in the compute warps themselves. `_dw_pair_tx_kernel`
(dw_pair(tx_scale=s)) forms dZ = e ⊙ s from tile values e in a partition of 4 warps between the loader and the
wgmma: dZ's scale off the MMA warps' path (tools/scaled_operand_probe.py).

A development tool, not used by fce: it measures whether C's prefetch, a loader warp and these schedules make
the (hi, lo) accumulation faster than fce_torch's Triton kernel, bit for bit the same. Every schedule gave
fce_torch's bits on the H100; none beat its accumulation by more than 6% (bench/results/nvidia-h100/dw-epilogue/).

    python tools/gluon_dw.py [--short|--ep|--tx] [OUT.json]  # GPU: bits and times; no GPU: compile_check
    --short: the ping-pong and warp-specialized launches and the best plain one (SHORT_VARIANTS), with first-chunk
             timings
    --ep: the interleaved-epilogue and epilogue-partition launches (IL_VARIANTS, EP_VARIANTS) and the
          best warp-specialized ones, with first-chunk timings
    --tx: dW written by the tx kernel against the warp-specialized kernel over a formed dZ (tx_main)
"""
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: fce_core, fce_torch

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fce_core.config import GEMM
from fce_core.plan import cdiv, rows_fast
from fce_torch.kernels import fastmath as fm
from fce_torch.kernels.logit_tiles_gluon import owner_wait
from ptxas_usage import ptxas_usage
from fce_torch.kernels.tma import processors, shared_layout, tile_origin

SMEM_LIMIT = 232448  # sm_90a's shared memory per block (227 KiB)
# the epilogue partition's float32 accumulator in shared memory: 32-byte units swizzled by the row (mod 8), so that
# the wgmma layout's stores (8 rows of 4 threads' 8 bytes a warp) fall in 256 distinct bytes and each thread's
# row-major read of 8 columns is one unit
ACC_SMEM = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])


@gluon.jit
def _grid(M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """(row tiles, column tiles, tiles, K steps, this program, programs) of the persistent launch."""
    n_m = gl.cdiv(M, BM)
    n_n = gl.cdiv(N, BN)
    return n_m, n_n, n_m * n_n, gl.cdiv(K, BK), gl.program_id(0), gl.num_programs(0)


@gluon.jit
def _issue_k_step(a_desc, b_desc, a_ring, b_ring, ready, step, k0, r0, c0, STAGES: gl.constexpr, pred):
    """The TMA loads of A's and B's blocks at K offset k0 for the tile at (r0, c0) into the ring stage of
    K step `step` (the program's running count, across tiles), signalled on that stage's barrier; nothing
    where `pred` is false (a step past K, or a tile past the last)."""
    slot = step % STAGES
    bar = ready.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [k0, r0], bar, a_ring.index(slot), pred=pred)
    tma.async_copy_global_to_shared(b_desc, [k0, c0], bar, b_ring.index(slot), pred=pred)


@gluon.jit
def _issue_prologue(a_desc, b_desc, a_ring, b_ring, ready, step, r0, c0, n_k, BK: gl.constexpr,
                    STAGES: gl.constexpr, pred):
    """A tile's first STAGES - 1 K steps (those that exist), from the program's step `step` on. Every stage
    must be free: the previous tile's K loop has retired all its wgmma."""
    for j in gl.static_range(STAGES - 1):
        _issue_k_step(a_desc, b_desc, a_ring, b_ring, ready, step + j, j * BK, r0, c0, STAGES, pred & (j < n_k))


@gluon.jit
def _load_c(hi_desc, lo_desc, hi_s, lo_s, c_ready, r0, c0):
    """The TMA loads of C's (hi, lo) blocks at (r0, c0) into hi_s / lo_s, signalled on c_ready (the caller has
    made sure that no store still reads hi_s / lo_s)."""
    mbarrier.expect(c_ready, hi_desc.block_type.nbytes + lo_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(hi_desc, [r0, c0], c_ready, hi_s)
    tma.async_copy_global_to_shared(lo_desc, [r0, c0], c_ready, lo_s)


@gluon.jit
def _issue_c_loads(hi_desc, lo_desc, hi_s, lo_s, c_ready, r0, c0):
    """`_load_c` from the warps that issued the previous tile's TMA stores out of hi_s / lo_s: they wait for
    those stores first."""
    tma.store_wait(0)
    _load_c(hi_desc, lo_desc, hi_s, lo_s, c_ready, r0, c0)


@gluon.jit
def _column_halves(t):
    """A [R, W] register tile's left and right [R, W // 2] halves: a view of the same registers (the layouts
    follow; no data moves)."""
    return t.reshape([t.shape[0], 2, t.shape[1] // 2]).permute(0, 2, 1).split()


@gluon.jit
def _epilogue_part(part, hi_s, lo_s, col: gl.constexpr, FIRST: gl.constexpr, LAST: gl.constexpr,
                   ASM: gl.constexpr):
    """The (hi, lo) update of the tile's columns [col, col + W) from their float32 product `part` [BM, W]:
    C's pair read from hi_s / lo_s (not FIRST) in part's register layout, the new pair written back there.
    The same operations as `grad_gemms._epilogue`'s PAIR mode, so the same bits."""
    W: gl.constexpr = part.shape[1]
    hs = hi_s.slice(col, W, dim=1)
    ls = lo_s.slice(col, W, dim=1)
    if FIRST:
        s = part
    else:
        s = fm.pair_value(hs.load(part.type.layout), ls.load(part.type.layout)) + part
    hi, lo = fm.pair_split(s, gl.bfloat16, ASM)
    hs.store(hi)
    if not LAST:
        ls.store(lo)


@gluon.jit
def _epilogue_cols(t, hi_s, lo_s, col: gl.constexpr, PARTS: gl.constexpr, FIRST: gl.constexpr,
                   LAST: gl.constexpr, ASM: gl.constexpr):
    """`_epilogue_part` over t's columns (the tile's [col, col + W)) in PARTS column slices, left to right
    (PARTS a power of two: halved recursively)."""
    if PARTS == 1:
        _epilogue_part(t, hi_s, lo_s, col, FIRST, LAST, ASM)
    else:
        left, right = _column_halves(t)
        _epilogue_cols(left, hi_s, lo_s, col, PARTS // 2, FIRST, LAST, ASM)
        _epilogue_cols(right, hi_s, lo_s, col + t.shape[1] // 2, PARTS // 2, FIRST, LAST, ASM)


@gluon.jit
def _finish_tile(acc, hi_s, lo_s, hi_desc, lo_desc, c_ready, phase, r0, c0, FIRST: gl.constexpr,
                 LAST: gl.constexpr, EPI_SPLIT: gl.constexpr, ASM: gl.constexpr):
    """A tile after its K loop: C's blocks awaited on c_ready (parity `phase`; FIRST: the previous tile's stores
    awaited instead, hi_s / lo_s being their staging), the epilogue, and the TMA stores of hi (and lo, unless
    LAST) at (r0, c0)."""
    if FIRST:
        tma.store_wait(0)
    else:
        mbarrier.wait(c_ready, phase)
    _epilogue_cols(acc, hi_s, lo_s, 0, EPI_SPLIT, FIRST, LAST, ASM)
    hopper.fence_async_shared()  # the generic-proxy stores, before the TMA unit reads them (stores, C loads)
    tma.async_copy_shared_to_global(hi_desc, [r0, c0], hi_s)
    if not LAST:
        tma.async_copy_shared_to_global(lo_desc, [r0, c0], lo_s)


@gluon.jit
def _dw_pair_kernel(a_desc, b_desc, hi_desc, lo_desc, M, N, K, FIRST: gl.constexpr, LAST: gl.constexpr,
                    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                    ROWS_FAST: gl.constexpr, ASM: gl.constexpr, EPI_SPLIT: gl.constexpr = 8,
                    LOOKAHEAD: gl.constexpr = True, PREFETCH_C: gl.constexpr = True):
    # a_desc: dZ [K, M], blocks [BK, BM]; b_desc: x [K, N], blocks [BK, BN]; hi_desc / lo_desc: hi bf16 and
    # lo int8 [M, N], blocks [BM, BN]. FIRST: (hi, lo) = split(A @ B), C not read; else split(pair(C) +
    # A @ B). LAST: lo not written. Persistent: program pid computes the output tiles pid, pid + P, ... in
    # `_gemm_kernel`'s order. EPI_SPLIT: the epilogue's column slices (a power of two dividing BN / 8).
    # LOOKAHEAD: the next tile's first K steps are loaded during this tile's epilogue (as `_gemm_kernel`'s
    # flattened loop does), else at the next tile's start. PREFETCH_C (the hypothesis under test): C's
    # blocks are loaded at the tile's start, under its K loop; else after it (the control: the Triton
    # kernel's order, through the same shared memory).
    gl.static_assert(STAGES >= 2, "the ring refills the stage that the previous step's wgmma read")
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 16])
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BK, BM], a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BK, BN], b_desc.layout)
    # The tile's C blocks: TMA-loaded at the tile's start (not FIRST), then the staging of its stores.
    hi_s = gl.allocate_shared_memory(hi_desc.dtype, [BM, BN], hi_desc.layout)
    lo_s = gl.allocate_shared_memory(lo_desc.dtype, [BM, BN], lo_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(c_ready, count=1)
    hopper.fence_async_shared()  # the barriers' initialization, before the TMA unit signals them

    n_m, n_n, n_tiles, n_k, pid, programs = _grid(M, N, K, BM, BN, BK)
    step = 0  # K steps consumed by this program: stage step % STAGES, that barrier's phase (step // STAGES) & 1
    done = 0  # tiles finished by this program: c_ready's phase done & 1
    if LOOKAHEAD:  # the first tile's prologue; the later ones' are issued during the previous epilogue
        r0, c0 = tile_origin(pid, n_m, n_n, BM, BN, ROWS_FAST)
        _issue_prologue(a_desc, b_desc, a_ring, b_ring, ready, step, r0, c0, n_k, BK, STAGES, pid < n_tiles)
    for tile in range(pid, n_tiles, programs):
        r0, c0 = tile_origin(tile, n_m, n_n, BM, BN, ROWS_FAST)
        if not LOOKAHEAD:
            _issue_prologue(a_desc, b_desc, a_ring, b_ring, ready, step, r0, c0, n_k, BK, STAGES, True)
        if not FIRST and PREFETCH_C:  # C's blocks load under the K loop
            _issue_c_loads(hi_desc, lo_desc, hi_s, lo_s, c_ready, r0, c0)

        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        for kk in range(n_k):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            acc = hopper.warpgroup_mma(a_ring.index(slot).permute((1, 0)), b_ring.index(slot), acc, is_async=True)
            # At most this step's wgmma in flight: the previous step's stage is free for step kk + STAGES - 1.
            acc = hopper.warpgroup_mma_wait(1, deps=[acc])
            ahead = kk + STAGES - 1
            _issue_k_step(a_desc, b_desc, a_ring, b_ring, ready, step + STAGES - 1, ahead * BK, r0, c0, STAGES,
                          ahead < n_k)
            step += 1
        acc = hopper.warpgroup_mma_wait(0, deps=[acc])
        if LOOKAHEAD:  # every stage is free again: the next tile's first steps load under this epilogue
            nr0, nc0 = tile_origin(tile + programs, n_m, n_n, BM, BN, ROWS_FAST)
            _issue_prologue(a_desc, b_desc, a_ring, b_ring, ready, step, nr0, nc0, n_k, BK, STAGES,
                            tile + programs < n_tiles)
        if not FIRST and not PREFETCH_C:
            _issue_c_loads(hi_desc, lo_desc, hi_s, lo_s, c_ready, r0, c0)

        # The epilogue in EPI_SPLIT column slices, each written to hi_s / lo_s before the next is formed. With
        # LOOKAHEAD every split compiled without spills (255 registers in one piece, 170-210 in 8 slices);
        # without it the one piece spilled 28-992 bytes a thread, 8 slices none.
        _finish_tile(acc, hi_s, lo_s, hi_desc, lo_desc, c_ready, done & 1, r0, c0, FIRST, LAST, EPI_SPLIT, ASM)
        done += 1
    tma.store_wait(0)


# ------------------------------------------------------------------------------------ warp-specialized variant
#
# Two partitions over the same shared memory: the default one (the kernel's 8 warps: wgmma and the epilogue)
# and a loader of 1 warp (the TMA loads of the ring and of C's blocks). Every barrier has count 1: Gluon's
# mbarrier.arrive is a partition-wide operation (the partition synchronizes its warps, then one thread arrives),
# so the 8 compute warps make one arrival, after both warpgroups have passed the preceding wgmma wait.
#   ready[s]  (TMA -> compute)  the stage's A and B blocks have landed: expect + 2 loads by the loader.
#   empty[s]  (compute -> loader) the wgmma that read the stage has retired: after warpgroup_mma_wait(1) the
#             previous step's stage, after the tile's final wait(0) its last one; one arrival per stage use.
#             The loader's u-th use of a stage (u = step // STAGES) waits for parity (u & 1) ^ 1: the barrier's
#             phase "-1" counts as complete, so the first STAGES waits pass at once.
#   c_ready   (TMA -> compute)  C's (hi, lo) blocks of the tile have landed (not FIRST).
#   c_free    (compute -> loader) the previous tile's TMA stores have read hi_s / lo_s (tma.store_wait(0) by
#             the compute partition, which issued them). The loader's wait for tile d (d = tiles done) has
#             parity (d & 1) ^ 1: tile 0 passes at once, tile d >= 1 waits for the d-th arrival.
# The loader issues tile d's K steps 0 .. c_at (c_at = min(STAGES - 2, n_k - 1)), then waits c_free and
# issues C's loads, then the remaining K steps. The compute partition makes tile d's c_free arrival
# (C_FREE_STEP >= 0, d >= 1) in tile d's K loop after the wgmma of step min(C_FREE_STEP, n_k - 1) <= c_at, a
# step whose blocks the loader issued before its c_free wait; or (C_FREE_STEP < 0) right after issuing tile
# d - 1's stores (waiting for them there). No cycle: the loader's steps up to c_at reuse stages of tile d - 1
# or earlier, which the compute partition frees without anything of tile d.


@gluon.jit
def _retire_previous(acc, empty, step, has_previous, STAGES: gl.constexpr):
    """After K step `step`'s wgmma is issued: at most it in flight (warpgroup_mma_wait(1)), so the previous
    step's stage is free: its `empty` barrier arrived on, where the tile had a previous step."""
    acc = hopper.warpgroup_mma_wait(1, deps=[acc])
    mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=has_previous)
    return acc


@gluon.jit
def _retire_last(acc, empty, step, STAGES: gl.constexpr):
    """After a tile's K loop (`step` one past its last step): every wgmma retired, the last stage freed."""
    acc = hopper.warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
    return acc


@gluon.jit
def _load_k_step(a_desc, b_desc, a_ring, b_ring, bar, empty, step, kk, r0, c0, BK: gl.constexpr,
                 STAGES: gl.constexpr):
    """The loader's K step `step` (kk of the tile at (r0, c0)): once the wgmma that last read its stage has
    retired (empty's parity ((step // STAGES) & 1) ^ 1, the first STAGES pass at once), A's and B's blocks
    loaded into the stage, signalled on `bar`."""
    slot = step % STAGES
    mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [kk * BK, r0], bar, a_ring.index(slot))
    tma.async_copy_global_to_shared(b_desc, [kk * BK, c0], bar, b_ring.index(slot))


@gluon.jit
def _ws_load_partition(a_desc, b_desc, hi_desc, lo_desc, a_ring, b_ring, hi_s, lo_s, ready, empty, c_ready, c_free,
                       pid, programs, n_m, n_n, n_tiles, n_k, FIRST: gl.constexpr, BM: gl.constexpr,
                       BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, ROWS_FAST: gl.constexpr):
    step = 0  # K steps issued by this program (as the compute partition counts them)
    done = 0  # tiles issued
    c_at = gl.minimum(n_k - 1, STAGES - 2)  # C's loads follow this K step of the tile
    for tile in range(pid, n_tiles, programs):
        r0, c0 = tile_origin(tile, n_m, n_n, BM, BN, ROWS_FAST)
        for kk in range(n_k):
            _load_k_step(a_desc, b_desc, a_ring, b_ring, ready.index(step % STAGES), empty, step, kk, r0, c0, BK,
                         STAGES)
            if not FIRST:
                if kk == c_at:
                    mbarrier.wait(c_free, (done & 1) ^ 1)
                    _load_c(hi_desc, lo_desc, hi_s, lo_s, c_ready, r0, c0)
            step += 1
        done += 1


@gluon.jit
def _ws_compute_partition(a_ring, b_ring, hi_s, lo_s, ready, empty, c_ready, c_free, hi_desc, lo_desc, pid,
                          programs, n_m, n_n, n_tiles, n_k, FIRST: gl.constexpr, LAST: gl.constexpr,
                          BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, ROWS_FAST: gl.constexpr,
                          ASM: gl.constexpr, EPI_SPLIT: gl.constexpr, C_FREE_STEP: gl.constexpr, x_ring=None,
                          xready=None, TX: gl.constexpr = False):
    # TX: A is read from x_ring, once the tx partition has signalled the stage on xready (B still on ready)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 16])
    step = 0  # K steps consumed: stage step % STAGES, ready's phase (step // STAGES) & 1
    done = 0  # tiles finished: c_ready's phase done & 1
    free_at = gl.minimum(n_k - 1, C_FREE_STEP)
    for tile in range(pid, n_tiles, programs):
        r0, c0 = tile_origin(tile, n_m, n_n, BM, BN, ROWS_FAST)
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        for kk in range(n_k):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            a_src = a_ring
            if TX:
                mbarrier.wait(xready.index(slot), (step // STAGES) & 1)
                a_src = x_ring
            acc = hopper.warpgroup_mma(a_src.index(slot).permute((1, 0)), b_ring.index(slot), acc, is_async=True)
            if not FIRST and C_FREE_STEP >= 0:
                if kk == free_at:  # the previous tile's stores have read hi_s / lo_s: C's loads may follow
                    tma.store_wait(0)
                    mbarrier.arrive(c_free, pred=done > 0)
            acc = _retire_previous(acc, empty, step, kk > 0, STAGES)
            step += 1
        acc = _retire_last(acc, empty, step, STAGES)
        _finish_tile(acc, hi_s, lo_s, hi_desc, lo_desc, c_ready, done & 1, r0, c0, FIRST, LAST, EPI_SPLIT, ASM)
        if not FIRST and C_FREE_STEP < 0:
            tma.store_wait(0)
            mbarrier.arrive(c_free)
        done += 1
    tma.store_wait(0)


@gluon.jit
def _ring(a_desc, b_desc, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """The operand ring (STAGES blocks of A and of B) and its `ready` / `empty` barriers (count 1), initialized."""
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BK, BM], a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BK, BN], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return a_ring, b_ring, ready, empty


@gluon.jit
def _ws_buffers(a_desc, b_desc, hi_desc, lo_desc, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                STAGES: gl.constexpr):
    """The warp-specialized kernels' shared memory: `_ring`'s, C's (hi, lo) blocks and their c_ready / c_free
    barriers (initialized; the caller fences them)."""
    a_ring, b_ring, ready, empty = _ring(a_desc, b_desc, BM, BN, BK, STAGES)
    hi_s = gl.allocate_shared_memory(hi_desc.dtype, [BM, BN], hi_desc.layout)
    lo_s = gl.allocate_shared_memory(lo_desc.dtype, [BM, BN], lo_desc.layout)
    return a_ring, b_ring, ready, empty, hi_s, lo_s, _barrier(), _barrier()


@gluon.jit
def _barrier():
    """One mbarrier of count 1, initialized."""
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    return bar


@gluon.jit
def _dw_pair_ws_kernel(a_desc, b_desc, hi_desc, lo_desc, M, N, K, FIRST: gl.constexpr, LAST: gl.constexpr,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       ROWS_FAST: gl.constexpr, ASM: gl.constexpr, EPI_SPLIT: gl.constexpr = 8,
                       C_FREE_STEP: gl.constexpr = 0, LOADER_REGS: gl.constexpr = 24):
    # `_dw_pair_kernel`'s computation (C's blocks always prefetched, the next tile's first steps loaded under
    # the epilogue as the loader runs ahead), warp-specialized: see the protocol above.
    gl.static_assert(STAGES >= 2, "the ring refills the stage that the previous step's wgmma read")
    gl.static_assert(C_FREE_STEP <= STAGES - 2, "c_free's arrival must follow a K step the loader issued first")
    a_ring, b_ring, ready, empty, hi_s, lo_s, c_ready, c_free = _ws_buffers(a_desc, b_desc, hi_desc, lo_desc, BM,
                                                                           BN, BK, STAGES)
    hopper.fence_async_shared()  # the barriers' initialization, before the TMA unit signals them

    n_m, n_n, n_tiles, n_k, pid, programs = _grid(M, N, K, BM, BN, BK)
    gl.warp_specialize([
        (_ws_compute_partition, (a_ring, b_ring, hi_s, lo_s, ready, empty, c_ready, c_free, hi_desc, lo_desc, pid,
                                 programs, n_m, n_n, n_tiles, n_k, FIRST, LAST, BM, BN, STAGES, ROWS_FAST, ASM,
                                 EPI_SPLIT, C_FREE_STEP)),
        (_ws_load_partition, (a_desc, b_desc, hi_desc, lo_desc, a_ring, b_ring, hi_s, lo_s, ready, empty, c_ready,
                              c_free, pid, programs, n_m, n_n, n_tiles, n_k, FIRST, BM, BN, BK, STAGES, ROWS_FAST)),
    ], [1], [LOADER_REGS])


# ------------------------------------------------------------------------------ scaled-operand variant (tx)
#
# The warp-specialized kernel with a third partition of 4 warps between the loader and the wgmma, for dZ formed
# from the logits GEMM's tile values e off the MMA warps' path (tools/scaled_operand_probe.py measured the same
# transform in the MMA warps' registers: 16-65% slower GEMMs). Each K step's A block (eᵀ's [BK, BM] block: BK rows
# of e, BM of its columns, inside one tile of TILE) is read from the ring, its rows multiplied by s[row, tile],
# rounded to bfloat16 and written into the stage's x block, which the wgmma reads instead. One barrier more
# (count 1):
#   xready[s] (tx -> compute): the stage's x block is written (fenced for the async proxy first).
# The tx partition and the compute partition both wait for K step g on ready[s] with parity (g // STAGES) & 1;
# the compute partition then waits on xready[s] with the same parity. The tx partition rewrites x_ring[s] for step
# g only after ready[s]'s phase of step g, which the loader starts after empty[s] of step g - STAGES: the wgmma
# that read x_ring[s] last has retired. Neither barrier can run a phase ahead of a waiter: the next phase of
# ready[s] needs empty[s], and that needs the compute partition's wait on xready[s].


@gluon.jit
def _tx_partition(a_ring, x_ring, ready, xready, s_ptr, s_row, s_tile, pid, programs, n_m, n_n, n_tiles, n_k, K,
                  BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                  ROWS_FAST: gl.constexpr, TILE: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    step = 0
    for tile in range(pid, n_tiles, programs):
        r0, c0 = tile_origin(tile, n_m, n_n, BM, BN, ROWS_FAST)
        for kk in range(n_k):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            a = a_ring.index(slot).load(layout)
            ks = kk * BK + gl.arange(0, BK, layout=gl.SliceLayout(1, layout))
            scale = gl.load(s_ptr + ks * s_row + (r0 // TILE) * s_tile, mask=ks < K, other=0.0)
            x_ring.index(slot).store((a.to(gl.float32) * scale[:, None]).to(gl.bfloat16))
            hopper.fence_async_shared()
            mbarrier.arrive(xready.index(slot))
            step += 1


@gluon.jit
def _dw_pair_tx_kernel(a_desc, b_desc, hi_desc, lo_desc, s_ptr, s_row, s_tile, M, N, K, FIRST: gl.constexpr,
                       LAST: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                       STAGES: gl.constexpr, ROWS_FAST: gl.constexpr, ASM: gl.constexpr, EPI_SPLIT: gl.constexpr = 8,
                       C_FREE_STEP: gl.constexpr = 0, LOADER_REGS: gl.constexpr = 24, TX_REGS: gl.constexpr = 96,
                       TILE: gl.constexpr = GEMM.tile_n):
    # `_dw_pair_ws_kernel` over e ⊙ s: see the protocol above.
    gl.static_assert(STAGES >= 2, "the ring refills the stage that the previous step's wgmma read")
    gl.static_assert(C_FREE_STEP <= STAGES - 2, "c_free's arrival must follow a K step the loader issued first")
    gl.static_assert(TILE % BM == 0, "a tile of A's rows must lie in one tile of the scale")
    a_ring, b_ring, ready, empty, hi_s, lo_s, c_ready, c_free = _ws_buffers(a_desc, b_desc, hi_desc, lo_desc, BM,
                                                                           BN, BK, STAGES)
    x_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BK, BM], a_desc.layout)
    xready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(xready.index(i), count=1)
    hopper.fence_async_shared()  # the barriers' initialization, before the TMA unit signals them

    n_m, n_n, n_tiles, n_k, pid, programs = _grid(M, N, K, BM, BN, BK)
    gl.warp_specialize([
        (_ws_compute_partition, (a_ring, b_ring, hi_s, lo_s, ready, empty, c_ready, c_free, hi_desc, lo_desc, pid,
                                 programs, n_m, n_n, n_tiles, n_k, FIRST, LAST, BM, BN, STAGES, ROWS_FAST, ASM,
                                 EPI_SPLIT, C_FREE_STEP, x_ring, xready, True)),
        (_ws_load_partition, (a_desc, b_desc, hi_desc, lo_desc, a_ring, b_ring, hi_s, lo_s, ready, empty, c_ready,
                              c_free, pid, programs, n_m, n_n, n_tiles, n_k, FIRST, BM, BN, BK, STAGES, ROWS_FAST)),
        (_tx_partition, (a_ring, x_ring, ready, xready, s_ptr, s_row, s_tile, pid, programs, n_m, n_n, n_tiles, n_k,
                         K, BM, BN, BK, STAGES, ROWS_FAST, TILE)),
    ], [1, 4], [LOADER_REGS, TX_REGS])


# ------------------------------------------------------------------------------------------ ping-pong variant
#
# Three partitions: two compute partitions of one warpgroup each (owner 0: the default partition, the kernel's 4
# warps; owner 1: a worker of 4 warps), each computing a whole BM x BN tile, and the loader warp. The program's
# tiles pid + i * P (its local index i = 0, 1, ...) go to owner i % 2 in turns, so that one owner's epilogue runs
# under the other's wgmma; owner o's j-th tile is local tile i = 2j + o. The loader issues the tiles' K steps in
# order into one ring shared by both owners: global step g = i * n_k + kk in stage g % STAGES. Barriers (count 1;
# an arrival is the partition's: its warps synchronize, then one thread arrives):
#   ready[o][s] (TMA -> owner o) per owner: the stage's blocks for owner o's step have landed. One shared ready[s]
#             would be wrong: a try_wait.parity passes while the barrier is still in the phase before the awaited
#             one, and owner o's first step in stage s may follow the other owner's step there that has not landed
#             (nothing orders the two owners; owner 1's first wait would pass at once). Owner o's waits on its
#             ready[o][s] are in its own order, so each awaits the phase after the one it last saw. It keeps their
#             phase parities as a bit mask (bit s): its uses of a stage have no closed form unless STAGES | n_k.
#   empty[s]  (owner -> loader) the wgmma that read the stage has retired, as in the warp-specialized kernel:
#             shared by both owners, safe as only the loader waits on it, in stage order, and the next use's
#             arrival cannot come before the loader waited for this one (its blocks are loaded after).
#             The loader's wait for step g has parity ((g // STAGES) & 1) ^ 1.
#   c_ready[o] (TMA -> owner o) C's (hi, lo) blocks of owner o's tile j landed in its hi_s[o] / lo_s[o]: parity j & 1.
#   c_free[o]  (owner o -> loader) owner o's tile j - 1's stores have read hi_s[o] / lo_s[o]: owner o waits for
#             them (tma.store_wait(0)) and arrives after issuing its tile j's first wgmma (j >= 1), under the wgmma.
#             The loader's wait for tile j has parity (j & 1) ^ 1 (tile 0 passes at once).
# The loader issues tile i's K steps 0 .. c_at (c_at = min(STAGES - 2, n_k - 1) >= 0), then waits c_free[o] and
# issues C's loads, then the rest. No cycle: owner o's c_free arrival follows its step 0 of tile i, issued before
# the loader's wait; the loader's steps up to then reuse stages of tiles < i, freed by their owners' K loops,
# which wait for nothing of tile i. tools/ws_protocol_sim.py (pingpong) checks it on random schedules.


@gluon.jit
def _pp_load_partition(a_desc, b_desc, hi_desc, lo_desc, a_ring, b_ring, hi_s, lo_s, ready, empty, c_ready, c_free,
                       pid, programs, n_m, n_n, n_tiles, n_k, FIRST: gl.constexpr, BM: gl.constexpr,
                       BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, ROWS_FAST: gl.constexpr):
    step = 0  # K steps issued (global step g)
    i = 0  # the program's tiles issued (local index)
    c_at = gl.minimum(n_k - 1, STAGES - 2)  # C's loads follow this K step of the tile
    for tile in range(pid, n_tiles, programs):
        r0, c0 = tile_origin(tile, n_m, n_n, BM, BN, ROWS_FAST)
        owner = i % 2
        for kk in range(n_k):
            _load_k_step(a_desc, b_desc, a_ring, b_ring, ready.index(owner * STAGES + step % STAGES), empty, step,
                         kk, r0, c0, BK, STAGES)
            if not FIRST:
                if kk == c_at:
                    mbarrier.wait(c_free.index(owner), ((i // 2) & 1) ^ 1)
                    _load_c(hi_desc, lo_desc, hi_s.index(owner), lo_s.index(owner), c_ready.index(owner), r0, c0)
            step += 1
        i += 1


@gluon.jit
def _pp_compute_partition(a_ring, b_ring, hi_s, lo_s, ready, empty, c_ready, c_free, hi_desc, lo_desc, pid,
                          programs, n_m, n_n, n_tiles, n_k, OWNER: gl.constexpr, FIRST: gl.constexpr,
                          LAST: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                          ROWS_FAST: gl.constexpr, ASM: gl.constexpr, EPI_SPLIT: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 16])
    my_hi = hi_s.index(OWNER)
    my_lo = lo_s.index(OWNER)
    my_c_ready = c_ready.index(OWNER)
    my_c_free = c_free.index(OWNER)
    phases = 0  # bit s: the parity of ready[OWNER][s]'s next phase
    j = 0  # this owner's tiles done: c_ready's phase j & 1
    for tile in range(pid + OWNER * programs, n_tiles, 2 * programs):
        r0, c0 = tile_origin(tile, n_m, n_n, BM, BN, ROWS_FAST)
        step = (2 * j + OWNER) * n_k  # the tile's first global step, as the loader counts
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        for kk in range(n_k):
            slot, phases = owner_wait(ready, phases, step, OWNER, STAGES)
            acc = hopper.warpgroup_mma(a_ring.index(slot).permute((1, 0)), b_ring.index(slot), acc, is_async=True)
            if not FIRST:
                if kk == 0:  # under the first wgmma: the previous tile's stores have read my_hi / my_lo
                    tma.store_wait(0)
                    mbarrier.arrive(my_c_free, pred=j > 0)
            acc = _retire_previous(acc, empty, step, kk > 0, STAGES)
            step += 1
        acc = _retire_last(acc, empty, step, STAGES)
        _finish_tile(acc, my_hi, my_lo, hi_desc, lo_desc, my_c_ready, j & 1, r0, c0, FIRST, LAST, EPI_SPLIT, ASM)
        j += 1
    tma.store_wait(0)


@gluon.jit
def _dw_pair_pp_kernel(a_desc, b_desc, hi_desc, lo_desc, M, N, K, FIRST: gl.constexpr, LAST: gl.constexpr,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       ROWS_FAST: gl.constexpr, ASM: gl.constexpr, EPI_SPLIT: gl.constexpr = 4,
                       COMPUTE_REGS: gl.constexpr = 240, LOADER_REGS: gl.constexpr = 24):
    # `_dw_pair_ws_kernel`'s computation with two compute warpgroups taking the tiles in turns: see the protocol
    # above. Launched with num_warps=4 (owner 0); the accumulator [BM, BN] float32 must fit one warpgroup.
    gl.static_assert(STAGES >= 2, "the ring refills the stage that the previous step's wgmma read")
    gl.static_assert(STAGES <= 31, "an owner's ready phases are bits of one int32")
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BK, BM], a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BK, BN], b_desc.layout)
    hi_s = gl.allocate_shared_memory(hi_desc.dtype, [2, BM, BN], hi_desc.layout)  # per owner
    lo_s = gl.allocate_shared_memory(lo_desc.dtype, [2, BM, BN], lo_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())  # [owner * STAGES + s]
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    c_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(c_ready.index(i), count=1)
        mbarrier.init(c_free.index(i), count=1)
    hopper.fence_async_shared()  # the barriers' initialization, before the TMA unit signals them

    n_m, n_n, n_tiles, n_k, pid, programs = _grid(M, N, K, BM, BN, BK)
    gl.warp_specialize([
        (_pp_compute_partition, (a_ring, b_ring, hi_s, lo_s, ready, empty, c_ready, c_free, hi_desc, lo_desc, pid,
                                 programs, n_m, n_n, n_tiles, n_k, 0, FIRST, LAST, BM, BN, STAGES, ROWS_FAST, ASM,
                                 EPI_SPLIT)),
        (_pp_compute_partition, (a_ring, b_ring, hi_s, lo_s, ready, empty, c_ready, c_free, hi_desc, lo_desc, pid,
                                 programs, n_m, n_n, n_tiles, n_k, 1, FIRST, LAST, BM, BN, STAGES, ROWS_FAST, ASM,
                                 EPI_SPLIT)),
        (_pp_load_partition, (a_desc, b_desc, hi_desc, lo_desc, a_ring, b_ring, hi_s, lo_s, ready, empty, c_ready,
                              c_free, pid, programs, n_m, n_n, n_tiles, n_k, FIRST, BM, BN, BK, STAGES, ROWS_FAST)),
    ], [4, 1], [COMPUTE_REGS, LOADER_REGS])


# ------------------------------------------------------------------------------------------ epilogue partition
#
# The (hi, lo) update moved off the wgmma warps: the compute partition (the kernel's 8 warps, 2 warpgroups on a
# 128x256 or 256x128 tile as in the warp-specialized kernel) hands each finished float32 accumulator over in
# shared memory (acc_s, [BM, BN], swizzled so that the wgmma layout's stores and the row-major reads both take the
# fewest wavefronts) and starts the next tile's K loop; an epilogue partition of EPI_WARPS warps reads C's pair
# from global memory (plain loads, its next row block's issued before the current one is computed, the tile's
# first before acc_s is awaited), adds the accumulator and writes the new pair, EPI_ROWS rows at a time. Its
# work per tile must take less than a tile's K loop to be hidden. EPI_WARPS is 2: ptxas compiles every partition
# under the launch's register limit, 65536 / the warps rounded up to warpgroups (12 warps: 168; 16: 128, below
# the 154 that the compute partition's 128x256 float32 accumulator needs), and the loader warp shares the
# epilogue's warpgroup, so the epilogue gets 2 warps (200 registers, 8 rows of 256 a block: no spills).
# A loader warp fills the ring as in the warp-specialized kernel (no C loads). Barriers (count 1):
#   ready[s] / empty[s]  the ring, as in the warp-specialized kernel;
#   acc_full  (compute -> epilogue) acc_s holds tile d's accumulator: the epilogue waits parity d & 1;
#   acc_free  (epilogue -> compute) the epilogue has read all of acc_s for tile d: the compute partition's store
#             of tile d waits parity (d & 1) ^ 1 (tile 0 passes at once).
# acc_s is one buffer (128 KiB next to a 96 KiB ring); while the epilogue works through tile d's accumulator in
# it, the compute partition runs tile d + 1's K loop, and waits for acc_free only to store that one.


@gluon.jit
def _ep_load_partition(a_desc, b_desc, a_ring, b_ring, ready, empty, pid, programs, n_m, n_n, n_tiles, n_k,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       ROWS_FAST: gl.constexpr):
    step = 0
    for tile in range(pid, n_tiles, programs):
        r0, c0 = tile_origin(tile, n_m, n_n, BM, BN, ROWS_FAST)
        for kk in range(n_k):
            _load_k_step(a_desc, b_desc, a_ring, b_ring, ready.index(step % STAGES), empty, step, kk, r0, c0, BK,
                         STAGES)
            step += 1


@gluon.jit
def _ep_compute_partition(a_ring, b_ring, acc_s, ready, empty, acc_full, acc_free, pid, programs, n_tiles, n_k,
                          BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 16])
    step = 0
    done = 0
    for tile in range(pid, n_tiles, programs):
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        for kk in range(n_k):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            acc = hopper.warpgroup_mma(a_ring.index(slot).permute((1, 0)), b_ring.index(slot), acc, is_async=True)
            acc = _retire_previous(acc, empty, step, kk > 0, STAGES)
            step += 1
        acc = _retire_last(acc, empty, step, STAGES)
        mbarrier.wait(acc_free, (done & 1) ^ 1)
        acc_s.store(acc)
        mbarrier.arrive(acc_full)  # after the partition's warps synchronize: every warp's part is stored
        done += 1


@gluon.jit
def _ep_rows(hi_ptr, lo_ptr, M, N, r0, c0, rows, cols, valid):
    """The pair's pointers (hi, lo) and the mask of the rows r0 + rows, columns c0 + cols (none where not
    `valid`): a 64-bit base, 32-bit offsets within the block."""
    base = r0.to(gl.int64) * N + c0
    offs = rows[:, None] * N + cols[None, :]
    mask = ((r0 + rows) < M)[:, None] & ((c0 + cols) < N)[None, :] & valid
    return hi_ptr + base + offs, lo_ptr + base + offs, mask


@gluon.jit
def _ep_c(hi_ptr, lo_ptr, M, N, r0, c0, rows, cols, valid, FIRST: gl.constexpr):
    """C's (hi, lo) values of those rows (FIRST: placeholders, C is not read)."""
    hi = 0
    lo = 0
    if not FIRST:
        hi_p, lo_p, mask = _ep_rows(hi_ptr, lo_ptr, M, N, r0, c0, rows, cols, valid)
        hi = gl.load(hi_p, mask=mask)
        lo = gl.load(lo_p, mask=mask)
    return hi, lo


@gluon.jit
def _ep_block(blocks, b, hi_c, lo_c, hi_ptr, lo_ptr, M, N, r0, c0, rows, cols, layout: gl.constexpr,
              FIRST: gl.constexpr, LAST: gl.constexpr, ASM: gl.constexpr):
    """Row block b of the tile at (r0, c0): its float32 product from acc_s (`blocks`, [BLOCKS, EPI_ROWS, BN]) plus
    C's pair (hi_c, lo_c), split into the new pair and stored. The next block's C loads are issued first, so
    that they are in flight during this block's arithmetic; returns their values."""
    EPI_ROWS: gl.constexpr = blocks.shape[1]
    BLOCKS: gl.constexpr = blocks.shape[0]
    part = blocks.index(b).load(layout)
    nxt_hi, nxt_lo = _ep_c(hi_ptr, lo_ptr, M, N, r0 + (b + 1) * EPI_ROWS, c0, rows, cols, b + 1 < BLOCKS, FIRST)
    if FIRST:
        s = part
    else:
        s = fm.pair_value(hi_c, lo_c) + part
    hi, lo = fm.pair_split(s, gl.bfloat16, ASM)
    hi_p, lo_p, mask = _ep_rows(hi_ptr, lo_ptr, M, N, r0 + b * EPI_ROWS, c0, rows, cols, True)
    gl.store(hi_p, hi, mask=mask)
    if not LAST:
        gl.store(lo_p, lo, mask=mask)
    return nxt_hi, nxt_lo


@triton.constexpr_function
def _ep_layout(bn, warps):
    """The epilogue's row-major layout: a thread's 8 consecutive columns (16 bytes of hi), bn // 8 threads (at
    most a warp) across a row."""
    tn = min(bn // 8, 32)
    return gl.BlockedLayout([1, 8], [32 // tn, tn], [warps, 1], [1, 0])


@gluon.jit
def _ep_epilogue_partition(acc_s, acc_full, acc_free, hi_ptr, lo_ptr, M, N, pid, programs, n_m, n_n, n_tiles,
                           FIRST: gl.constexpr, LAST: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                           ROWS_FAST: gl.constexpr, ASM: gl.constexpr, EPI_ROWS: gl.constexpr):
    layout: gl.constexpr = _ep_layout(BN, gl.num_warps())
    rows = gl.arange(0, EPI_ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    BLOCKS: gl.constexpr = BM // EPI_ROWS
    # acc_s as BLOCKS buffers of [EPI_ROWS, BN], each swizzled alike: the same bytes, EPI_ROWS being a multiple of
    # the swizzle's period of 8 rows
    blocks = acc_s._reinterpret(gl.float32, [BLOCKS, EPI_ROWS, BN], ACC_SMEM)
    done = 0
    for tile in range(pid, n_tiles, programs):
        r0, c0 = tile_origin(tile, n_m, n_n, BM, BN, ROWS_FAST)
        hi_c, lo_c = _ep_c(hi_ptr, lo_ptr, M, N, r0, c0, rows, cols, True, FIRST)
        mbarrier.wait(acc_full, done & 1)
        for b in range(BLOCKS):
            hi_c, lo_c = _ep_block(blocks, b, hi_c, lo_c, hi_ptr, lo_ptr, M, N, r0, c0, rows, cols, layout, FIRST,
                                   LAST, ASM)
        mbarrier.arrive(acc_free)  # every warp has read acc_s: the next tile's accumulator may come
        done += 1


@gluon.jit
def _dw_pair_ep_kernel(a_desc, b_desc, hi_ptr, lo_ptr, M, N, K, FIRST: gl.constexpr, LAST: gl.constexpr,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       ROWS_FAST: gl.constexpr, ASM: gl.constexpr, EPI_ROWS: gl.constexpr = 8,
                       EPI_WARPS: gl.constexpr = 2, EPI_REGS: gl.constexpr = 200, LOADER_REGS: gl.constexpr = 24):
    # `_dw_pair_ws_kernel`'s computation with the epilogue in its own partition: see the protocol above. hi_ptr /
    # lo_ptr: the pair [M, N], rows contiguous.
    gl.static_assert(STAGES >= 2, "the ring refills the stage that the previous step's wgmma read")
    gl.static_assert(BM % EPI_ROWS == 0, "the epilogue's row blocks tile BM")
    a_ring, b_ring, ready, empty = _ring(a_desc, b_desc, BM, BN, BK, STAGES)
    acc_s = gl.allocate_shared_memory(gl.float32, [BM, BN], ACC_SMEM)
    acc_full = _barrier()
    acc_free = _barrier()
    hopper.fence_async_shared()  # the barriers' initialization, before the TMA unit signals them

    n_m, n_n, n_tiles, n_k, pid, programs = _grid(M, N, K, BM, BN, BK)
    gl.warp_specialize([
        (_ep_compute_partition, (a_ring, b_ring, acc_s, ready, empty, acc_full, acc_free, pid, programs, n_tiles,
                                 n_k, BM, BN, STAGES)),
        (_ep_epilogue_partition, (acc_s, acc_full, acc_free, hi_ptr, lo_ptr, M, N, pid, programs, n_m, n_n,
                                  n_tiles, FIRST, LAST, BM, BN, ROWS_FAST, ASM, EPI_ROWS)),
        (_ep_load_partition, (a_desc, b_desc, a_ring, b_ring, ready, empty, pid, programs, n_m, n_n, n_tiles, n_k,
                              BM, BN, BK, STAGES, ROWS_FAST)),
    ], [EPI_WARPS, 1], [EPI_REGS, LOADER_REGS])


# ------------------------------------------------------------------------------------------ interleaved epilogue
#
# The epilogue partition's 2 warps could not keep up (their issue slots are 2 of the multiprocessor's 4
# schedulers'). Here the compute partition (8 warps, all 4 schedulers) runs the previous tile's epilogue itself,
# a row block at a time between the wgmma issues of the current tile's K loop: at step kk it issues the step's
# wgmma, then (every SPREAD = n_k // BLOCKS steps) one block of the previous tile from acc_s, then retires the
# previous step's wgmma, so that the tensor cores hold two queued steps during the block's arithmetic. At the
# tile's end the accumulator goes to acc_s (the warps synchronized before, every block of the previous tile
# having been read, and after). The last tile's blocks run after the loop. A loader warp fills the ring (ready /
# empty as in the warp-specialized kernel); acc_s is the compute partition's alone, so it needs no mbarrier.


# the warps' barrier (within a warp-specialized partition, its warps'): Triton 3.6's name, 3.7's
_partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _il_compute_partition(a_ring, b_ring, acc_s, ready, empty, hi_ptr, lo_ptr, M, N, pid, programs, n_m, n_n,
                          n_tiles, n_k, FIRST: gl.constexpr, LAST: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                          STAGES: gl.constexpr, ROWS_FAST: gl.constexpr, ASM: gl.constexpr,
                          EPI_ROWS: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 16])
    layout: gl.constexpr = _ep_layout(BN, gl.num_warps())
    rows = gl.arange(0, EPI_ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    BLOCKS: gl.constexpr = BM // EPI_ROWS
    blocks = acc_s._reinterpret(gl.float32, [BLOCKS, EPI_ROWS, BN], ACC_SMEM)
    spread = gl.maximum(n_k // BLOCKS, 1)
    step = 0
    p_r0 = 0  # the previous tile's origin; pending: its blocks still to run (0 before the first tile)
    p_c0 = 0
    pending = 0
    for tile in range(pid, n_tiles, programs):
        r0, c0 = tile_origin(tile, n_m, n_n, BM, BN, ROWS_FAST)
        b = 0
        hi_c, lo_c = _ep_c(hi_ptr, lo_ptr, M, N, p_r0, p_c0, rows, cols, pending > 0, FIRST)
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        for kk in range(n_k):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            acc = hopper.warpgroup_mma(a_ring.index(slot).permute((1, 0)), b_ring.index(slot), acc, is_async=True)
            if (b < pending) & (kk % spread == 0):
                hi_c, lo_c = _ep_block(blocks, b, hi_c, lo_c, hi_ptr, lo_ptr, M, N, p_r0, p_c0, rows, cols, layout,
                                       FIRST, LAST, ASM)
                b += 1
            acc = _retire_previous(acc, empty, step, kk > 0, STAGES)
            step += 1
        acc = _retire_last(acc, empty, step, STAGES)
        for rest in range(b, pending):  # n_k < BLOCKS: the blocks that the K loop did not take
            hi_c, lo_c = _ep_block(blocks, rest, hi_c, lo_c, hi_ptr, lo_ptr, M, N, p_r0, p_c0, rows, cols, layout,
                                   FIRST, LAST, ASM)
        _partition_barrier()  # every warp has read acc_s
        acc_s.store(acc)
        _partition_barrier()  # every warp's part is in acc_s
        p_r0 = r0
        p_c0 = c0
        pending = BLOCKS
    hi_c, lo_c = _ep_c(hi_ptr, lo_ptr, M, N, p_r0, p_c0, rows, cols, pending > 0, FIRST)
    for b in range(pending):  # the last tile's blocks
        hi_c, lo_c = _ep_block(blocks, b, hi_c, lo_c, hi_ptr, lo_ptr, M, N, p_r0, p_c0, rows, cols, layout, FIRST,
                               LAST, ASM)


@gluon.jit
def _dw_pair_il_kernel(a_desc, b_desc, hi_ptr, lo_ptr, M, N, K, FIRST: gl.constexpr, LAST: gl.constexpr,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       ROWS_FAST: gl.constexpr, ASM: gl.constexpr, EPI_ROWS: gl.constexpr = 8,
                       LOADER_REGS: gl.constexpr = 24):
    # `_dw_pair_ws_kernel`'s computation with each tile's epilogue run during the next tile's K loop: see above.
    gl.static_assert(STAGES >= 2, "the ring refills the stage that the previous step's wgmma read")
    gl.static_assert(BM % EPI_ROWS == 0, "the epilogue's row blocks tile BM")
    a_ring, b_ring, ready, empty = _ring(a_desc, b_desc, BM, BN, BK, STAGES)
    acc_s = gl.allocate_shared_memory(gl.float32, [BM, BN], ACC_SMEM)
    hopper.fence_async_shared()  # the barriers' initialization, before the TMA unit signals them

    n_m, n_n, n_tiles, n_k, pid, programs = _grid(M, N, K, BM, BN, BK)
    gl.warp_specialize([
        (_il_compute_partition, (a_ring, b_ring, acc_s, ready, empty, hi_ptr, lo_ptr, M, N, pid, programs, n_m,
                                 n_n, n_tiles, n_k, FIRST, LAST, BM, BN, STAGES, ROWS_FAST, ASM, EPI_ROWS)),
        (_ep_load_partition, (a_desc, b_desc, a_ring, b_ring, ready, empty, pid, programs, n_m, n_n, n_tiles, n_k,
                              BM, BN, BK, STAGES, ROWS_FAST)),
    ], [1], [LOADER_REGS])


def shared_bytes(bm, bn, bk, stages, pingpong=False, ep=False, tx=False):
    """The kernel's explicit shared memory: the operand ring (tx: with its scaled A blocks), hi_s and lo_s
    (ping-pong: one pair per owner; epilogue partition: the float32 acc_s instead; the barriers aside)."""
    return stages * (bm * (2 if tx else 1) + bn) * bk * 2 + bm * bn * (4 if ep else 3 * (2 if pingpong else 1))


def _c_free_step(stages):
    """The warp-specialized kernel's default C_FREE_STEP: the K step of a tile after whose wgmma the compute
    partition waits for the previous tile's stores and frees hi_s / lo_s (at most STAGES - 2)."""
    return min(1, stages - 2)


def dw_pair(dz, x, hi=None, lo=None, first=False, last=False, bm=128, bn=256, bk=64, stages=2, epi_split=8,
            lookahead=True, prefetch_c=True, ws=False, c_free_step=None, loader_regs=24, pingpong=False,
            compute_regs=240, ep=False, epi_rows=None, epi_warps=2, epi_regs=200, il=False, tx_scale=None,
            tx_regs=96):
    """dZᵀ @ x (dZ [K, V], x [K, H]: bfloat16, rows contiguous) into a (hi bfloat16, lo int8) [V, H] pair: with
    `first` a new pair (`grad_gemms.dw_first`), else (hi, lo) updated in place (`grad_gemms.dw_accumulate`);
    with `last`, lo is not written and hi alone is returned, else (hi, lo). One persistent program per
    multiprocessor (fewer where there are fewer tiles). `ws`: the warp-specialized kernel (a loader warp; C
    always prefetched, lookahead / prefetch_c unused), c_free_step and loader_regs its C_FREE_STEP and
    LOADER_REGS. `pingpong`: the ping-pong kernel (two compute warpgroups taking tiles in turns, a loader warp;
    ws / lookahead / prefetch_c / c_free_step unused), compute_regs the register count of owner 1 (a worker).
    `ep`: the epilogue-partition kernel (epi_rows rows a block, default 2048 // bn; epi_warps warps with epi_regs
    registers; the other options but loader_regs unused). `tx_scale` [K, ceil(V / GEMM.tile_n)] float32: the
    warp-specialized kernel over dZ = dz ⊙ tx_scale (per row and logits tile, rounded to bfloat16 by a partition
    of 4 warps with tx_regs registers; dz holds tile values)."""
    k, m = dz.shape
    n = x.shape[1]
    need = shared_bytes(bm, bn, bk, stages, pingpong, ep or il, tx_scale is not None)
    if need > SMEM_LIMIT:
        raise ValueError(f"{bm}x{bn}x{bk} in {stages} stages needs {need} bytes of shared memory, more than "
                         f"{SMEM_LIMIT}")
    if first:
        hi = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
        lo = torch.empty(m, n, device=x.device, dtype=torch.int8)
    grid = (min(cdiv(m, bm) * cdiv(n, bn), processors(x.device)),)
    if il:
        ab = [TensorDescriptor.from_tensor(t, block, shared_layout(block, gl.bfloat16)) for t, block in [
            (dz, [bk, bm]), (x, [bk, bn])]]
        _dw_pair_il_kernel[grid](*ab, hi, lo, m, n, k, FIRST=first, LAST=last, BM=bm, BN=bn, BK=bk, STAGES=stages,
                                 ROWS_FAST=rows_fast(m, n, bm, bn), ASM=fm.ASM, EPI_ROWS=epi_rows or 2048 // bn,
                                 LOADER_REGS=loader_regs, num_warps=8)
        return hi if last else (hi, lo)
    if ep:
        ab = [TensorDescriptor.from_tensor(t, block, shared_layout(block, gl.bfloat16)) for t, block in [
            (dz, [bk, bm]), (x, [bk, bn])]]
        _dw_pair_ep_kernel[grid](*ab, hi, lo, m, n, k, FIRST=first, LAST=last, BM=bm, BN=bn, BK=bk, STAGES=stages,
                                 ROWS_FAST=rows_fast(m, n, bm, bn), ASM=fm.ASM, EPI_ROWS=epi_rows or 2048 // bn,
                                 EPI_WARPS=epi_warps, EPI_REGS=epi_regs, LOADER_REGS=loader_regs, num_warps=8)
        return hi if last else (hi, lo)
    descs = [TensorDescriptor.from_tensor(t, block, shared_layout(block, dt)) for t, block, dt in [
        (dz, [bk, bm], gl.bfloat16), (x, [bk, bn], gl.bfloat16), (hi, [bm, bn], gl.bfloat16),
        (lo, [bm, bn], gl.int8)]]
    if pingpong:
        _dw_pair_pp_kernel[grid](*descs, m, n, k, FIRST=first, LAST=last, BM=bm, BN=bn, BK=bk, STAGES=stages,
                                 ROWS_FAST=rows_fast(m, n, bm, bn), ASM=fm.ASM, EPI_SPLIT=epi_split,
                                 COMPUTE_REGS=compute_regs, LOADER_REGS=loader_regs, num_warps=4)
        return hi if last else (hi, lo)
    if tx_scale is not None:
        _dw_pair_tx_kernel[grid](*descs, tx_scale, tx_scale.stride(0), tx_scale.stride(1), m, n, k, FIRST=first,
                                 LAST=last, BM=bm, BN=bn, BK=bk, STAGES=stages, ROWS_FAST=rows_fast(m, n, bm, bn),
                                 ASM=fm.ASM, EPI_SPLIT=epi_split,
                                 C_FREE_STEP=_c_free_step(stages) if c_free_step is None else c_free_step,
                                 LOADER_REGS=loader_regs, TX_REGS=tx_regs, TILE=GEMM.tile_n, num_warps=8)
        return hi if last else (hi, lo)
    if ws:
        _dw_pair_ws_kernel[grid](*descs, m, n, k, FIRST=first, LAST=last, BM=bm, BN=bn, BK=bk, STAGES=stages,
                                 ROWS_FAST=rows_fast(m, n, bm, bn), ASM=fm.ASM, EPI_SPLIT=epi_split,
                                 C_FREE_STEP=_c_free_step(stages) if c_free_step is None else c_free_step,
                                 LOADER_REGS=loader_regs, num_warps=8)
        return hi if last else (hi, lo)
    _dw_pair_kernel[grid](*descs, m, n, k, FIRST=first, LAST=last, BM=bm, BN=bn, BK=bk, STAGES=stages,
                          ROWS_FAST=rows_fast(m, n, bm, bn), ASM=fm.ASM, EPI_SPLIT=epi_split, LOOKAHEAD=lookahead,
                          PREFETCH_C=prefetch_c, num_warps=8)
    return hi if last else (hi, lo)


# ------------------------------------------------------------------------------------------ compile check

def _compile(bm, bn, bk, stages, first, last, epi_split=8, lookahead=True, prefetch_c=True, ws=False,
             c_free_step=None, loader_regs=24, pingpong=False, compute_regs=240, ep=False, epi_rows=None, epi_warps=2,
             epi_regs=200, il=False, tx=False, tx_regs=96):
    """The kernel compiled for sm_90a (no GPU needed), as `dw_pair` launches it for dW (ROWS_FAST False)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = dict(a_desc=f"tensordesc<bf16[{bk}, {bm}],{shared_layout([bk, bm], gl.bfloat16)!r}>",
               b_desc=f"tensordesc<bf16[{bk}, {bn}],{shared_layout([bk, bn], gl.bfloat16)!r}>",
               hi_desc=f"tensordesc<bf16[{bm}, {bn}],{shared_layout([bm, bn], gl.bfloat16)!r}>",
               lo_desc=f"tensordesc<i8[{bm}, {bn}],{shared_layout([bm, bn], gl.int8)!r}>",
               M="i32", N="i32", K="i32")
    consts = dict(FIRST=first, LAST=last, BM=bm, BN=bn, BK=bk, STAGES=stages, ROWS_FAST=False, ASM=True,
                  EPI_SPLIT=epi_split)
    if ep or il:
        del sig["hi_desc"], sig["lo_desc"], consts["EPI_SPLIT"]
        sig = dict(a_desc=sig["a_desc"], b_desc=sig["b_desc"], hi_ptr="*bf16", lo_ptr="*i8", M="i32", N="i32",
                   K="i32")
        consts.update(EPI_ROWS=epi_rows or 2048 // bn, LOADER_REGS=loader_regs)
        if ep:
            consts.update(EPI_WARPS=epi_warps, EPI_REGS=epi_regs)
    elif pingpong:
        consts.update(COMPUTE_REGS=compute_regs, LOADER_REGS=loader_regs)
    elif ws or tx:
        consts.update(C_FREE_STEP=_c_free_step(stages) if c_free_step is None else c_free_step,
                      LOADER_REGS=loader_regs)
        if tx:
            sig = dict(**{k: v for k, v in sig.items() if k.endswith("desc")}, s_ptr="*fp32", s_row="i32",
                       s_tile="i32", M="i32", N="i32", K="i32")
            consts.update(TX_REGS=tx_regs, TILE=GEMM.tile_n)
    else:
        consts.update(LOOKAHEAD=lookahead, PREFETCH_C=prefetch_c)
    for name in consts:
        sig[name] = "constexpr"
    kernel = (_dw_pair_il_kernel if il else _dw_pair_ep_kernel if ep else _dw_pair_pp_kernel if pingpong
              else _dw_pair_tx_kernel if tx else _dw_pair_ws_kernel if ws else _dw_pair_kernel)
    # the launch's specializations: pointers 16-byte aligned, N (H) a multiple of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name in ("hi_ptr", "lo_ptr", "N")}
    return triton.compile(GluonASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4 if pingpong else 8))


def _variant(bm, bn, bk, stages, lookahead=True, prefetch_c=True, epi_split=8, ws=False, pingpong=False, ep=False,
             il=False, **ep_options):
    """A launch of `dw_pair`; ep_options: epi_rows, epi_warps, epi_regs of the epilogue partition."""
    return dict(bm=bm, bn=bn, bk=bk, stages=stages, lookahead=lookahead, prefetch_c=prefetch_c, epi_split=epi_split,
                ws=ws, pingpong=pingpong, ep=ep, il=il, **ep_options)


# dw_pair's launch variants: the ring plus hi_s and lo_s within 227 KiB (BK = 64 allows 2 stages, BK = 32 up to
# 5). The first six test the hypothesis; then its controls (C loaded after the K loop, through the same shared
# memory), the look-ahead's, and the epilogue's in one piece (no slices of hi_s / lo_s: a bit mismatch that
# only the sliced variants show would point at the slices).
VARIANTS = [_variant(128, 256, 64, 2), _variant(128, 256, 32, 4), _variant(128, 256, 32, 5),
            _variant(256, 128, 64, 2), _variant(256, 128, 32, 4), _variant(256, 128, 32, 5),
            _variant(128, 256, 64, 2, prefetch_c=False), _variant(128, 256, 32, 4, prefetch_c=False),
            _variant(256, 128, 64, 2, prefetch_c=False), _variant(256, 128, 32, 4, prefetch_c=False),
            _variant(128, 256, 32, 4, lookahead=False), _variant(256, 128, 32, 4, lookahead=False),
            _variant(128, 256, 64, 2, epi_split=1), _variant(256, 128, 64, 2, epi_split=1)]
# the ping-pong and warp-specialized launches (first-chunk timings too), and the best plain one. Ping-pong: a tile
# per warpgroup (128 x 128 or 64 x 256), two C pairs (96 KiB), the ring in the rest (BK = 64: 3 or 4 stages).
SHORT_VARIANTS = [_variant(128, 128, 64, 3, epi_split=4, pingpong=True),
                  _variant(128, 128, 64, 4, epi_split=4, pingpong=True),
                  _variant(128, 128, 32, 7, epi_split=4, pingpong=True),
                  _variant(64, 256, 64, 3, epi_split=4, pingpong=True),
                  _variant(256, 128, 32, 5, ws=True), _variant(128, 256, 32, 5, ws=True),
                  _variant(256, 128, 64, 2, ws=True), _variant(256, 128, 32, 5)]
# the epilogue partition's launches: a 96 or 72 KiB ring next to the 128 KiB float32 acc_s
# the interleaved epilogue's launches; the epilogue partition's (registers: the most for the epilogue's warpgroup
# that leaves the compute partition without spills)
IL_VARIANTS = [_variant(128, 256, 32, 4, il=True), _variant(256, 128, 32, 4, il=True),
               _variant(128, 256, 32, 3, il=True), _variant(256, 128, 32, 3, il=True),
               _variant(128, 256, 64, 2, il=True), _variant(128, 256, 32, 4, il=True, epi_rows=16)]
EP_VARIANTS = [_variant(128, 256, 32, 4, ep=True), _variant(256, 128, 32, 4, ep=True, epi_regs=168),
               _variant(128, 256, 32, 3, ep=True), _variant(256, 128, 32, 3, ep=True, epi_regs=168)]
EP_REFERENCES = [_variant(256, 128, 32, 5, ws=True), _variant(128, 256, 32, 5, ws=True)]  # --ep: the best before
SETMAXNREG = r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)"
MODES = [("first", True, False), ("accumulate", False, False), ("last", False, True)]


def _variant_name(bm, bn, bk, stages, lookahead, prefetch_c, epi_split, ws=False, pingpong=False, ep=False,
                  il=False, **ep_options):
    return (f"gluon {bm}x{bn}x{bk} s{stages}{' ws' if ws else ''}{' pp' if pingpong else ''}{' ep' if ep else ''}"
            f"{' il' if il else ''}"
            f"{''.join(f' {k}={v}' for k, v in ep_options.items())}"
            f"{'' if lookahead else ' no-lookahead'}"
            f"{'' if prefetch_c else ' C-after-loop'}{'' if epi_split == 8 else f' epi/{epi_split}'}")


def compile_check():
    """Compile every variant in every mode for sm_90a on this CPU (FIRST's C is never loaded, so its variants
    differing only in prefetch_c are one); print shared memory, registers and spills (ptxas -v), and the
    PTX's TMA copies and wgmma instructions. Returns the rows."""
    print(f"triton {triton.__version__} (sm_90a; warps: the launch's, 4 for ping-pong)")
    print(f"{'variant':<42} {'mode':>10} {'shared':>7} {'regs':>4} {'spill st/ld':>11} {'tma':>4} {'wgmma':>5} "
          f"{'warps':>5} {'setmaxnreg':>10}")
    rows, seen = [], set()
    for variant in VARIANTS + SHORT_VARIANTS + IL_VARIANTS + EP_VARIANTS:
        for mode, first, last in MODES:
            key = tuple(dict(variant, prefetch_c=variant["prefetch_c"] or first).values()) + (first, last)
            if key in seen:
                continue
            seen.add(key)
            name = _variant_name(**variant)
            row = dict(variant=name, mode=mode, **variant)
            try:
                compiled = _compile(first=first, last=last, **variant)
            except Exception as e:  # noqa: BLE001 - report it, go on with the other configs
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                print(f"{name:<42} {mode:>10} FAILED: {row['error']}")
                rows.append(row)
                continue
            ptx = compiled.asm["ptx"]
            regs, spill_st, spill_ld = ptxas_usage(ptx)
            row.update(shared=compiled.metadata.shared, regs=regs, spill_stores=spill_st, spill_loads=spill_ld,
                       tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                       wgmma=len(re.findall(r"wgmma\.mma_async", ptx)), warps=compiled.metadata.num_warps,
                       # warp-specialized: the partitions' register counts (setmaxnreg), the launch's is `regs`
                       setmaxnreg=sorted({int(r) for r in re.findall(SETMAXNREG, ptx)}))
            nreg = "/".join(map(str, row["setmaxnreg"])) or "-"
            print(f"{name:<42} {mode:>10} {row['shared']:>7} {regs:>4} {spill_st:>5}/{spill_ld:<5} "
                  f"{row['tma']:>4} {row['wgmma']:>5} {row['warps']:>5} {nreg:>10}")
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ GPU run

SHAPES = [(768, 640, 262144), (2048, 2048, 128256)]  # (K = a chunk's rows, H, V)


def _bits_equal(a, b):
    """Whether two arrays, or two (hi, lo) pairs, hold the same bits (a bfloat16 array viewed as int16)."""
    if isinstance(a, tuple):
        return all(_bits_equal(x, y) for x, y in zip(a, b, strict=True))
    view = torch.int16 if a.dtype == torch.bfloat16 else a.dtype
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(view), b.view(view)))


def _time(fn, pair, reps=20, warmup=3):
    """Median ms of fn(hi, lo) over `reps` calls, each on its own clone of `pair` (the same inputs every time)
    with L2 flushed before it; CUDA events bracket the call alone. A sleep on the GPU ahead of the start event
    keeps the host's launch work (descriptors) out of the measured time."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device=pair[0].device)
    times = []
    for i in range(warmup + reps):
        hi, lo = pair[0].clone(), pair[1].clone()
        flush.zero_()
        torch.cuda._sleep(1_000_000)  # ~0.5 ms of GPU clock cycles
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(hi, lo)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
        del hi, lo
    return statistics.median(times)


def _clone(pair):
    return pair[0].clone(), pair[1].clone()


def gpu_main(out_path=None, variants=VARIANTS, shapes=SHAPES, dev="cuda"):
    """At each of SHAPES: a (hi, lo) pair from dw_first of one chunk; every variant's first-chunk pair,
    accumulation of a second chunk and last accumulation compared bit for bit with fce_torch's, then its
    accumulation timed against fce_torch's dw_accumulate (its default launch) and torch.mm(dz.t(), x). With
    warp-specialized or ping-pong variants, also fce_torch's first chunk and dW written, and their first chunks."""
    from fce_torch.kernels.grad_gemms import _dw_config, dw_accumulate, dw_first
    torch.manual_seed(0)
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"{processors(torch.device(dev))} SMs", flush=True)
    rows = []
    for k, h, v in shapes:
        base = dict(K=k, H=h, V=v)
        shape_rows = []
        dz0 = (torch.randn(k, v, device=dev) * 1e-3).to(torch.bfloat16)  # chunk 0: the pair
        x0 = torch.randn(k, h, device=dev).to(torch.bfloat16)
        dz = (torch.randn(k, v, device=dev) * 1e-3).to(torch.bfloat16)  # chunk 1: accumulated into it
        x = torch.randn(k, h, device=dev).to(torch.bfloat16)
        ref_first = dw_first(dz0, x0, torch.bfloat16)
        ref_acc = dw_accumulate(dz, x, _clone(ref_first))
        ref_last = dw_accumulate(dz, x, _clone(ref_first), last=True)
        torch.cuda.synchronize()

        cfg = _dw_config(h)
        shape_rows.append(dict(base, variant=f"fce dw_accumulate ({cfg.tile_m}x{cfg.tile_n}x{cfg.tile_k})",
                               ms=_time(lambda hi, lo: dw_accumulate(dz, x, (hi, lo)), ref_first), bits=True))
        if any(kw["ws"] or kw["pingpong"] or kw["ep"] or kw["il"] for kw in variants):
            from fce_torch.kernels.grad_gemms import dw_gemm
            shape_rows.append(dict(base, variant="fce dw_first", bits=None,
                                   ms=_time(lambda hi, lo: dw_first(dz, x, torch.bfloat16), ref_first)))
            shape_rows.append(dict(base, variant="fce dw_gemm (bf16 written)",
                                   ms=_time(lambda hi, lo: dw_gemm(dz, x, torch.bfloat16), ref_first), bits=None))
            for kw in [kw for kw in variants if kw["ws"] or kw["pingpong"] or kw["ep"] or kw["il"]]:
                print(f"  (K={k} H={h}: timing {_variant_name(**kw)} first)", file=sys.stderr, flush=True)
                shape_rows.append(dict(base, variant=_variant_name(**kw) + " first", bits=None,
                                       ms=_time(lambda hi, lo, kw=kw: dw_pair(dz, x, first=True, **kw), ref_first)))
        shape_rows.append(dict(base, variant="torch.mm(dz.t(), x)",
                               ms=_time(lambda hi, lo: torch.mm(dz.t(), x), ref_first), bits=None))
        for kw in variants:
            row = dict(base, variant=_variant_name(**kw), **kw)
            # a hung launch (a barrier protocol's deadlock) is named by the last of these lines
            print(f"  (K={k} H={h}: checking {row['variant']})", file=sys.stderr, flush=True)
            try:
                out_first = dw_pair(dz0, x0, first=True, **kw)
                out_acc = dw_pair(dz, x, *_clone(ref_first), **kw)
                out_last = dw_pair(dz, x, *_clone(ref_first), last=True, **kw)
                torch.cuda.synchronize()
                checks = dict(first=_bits_equal(out_first, ref_first), accumulate=_bits_equal(out_acc, ref_acc),
                              last=_bits_equal(out_last, ref_last))
                del out_first, out_acc, out_last
                row.update(ms=_time(lambda hi, lo: dw_pair(dz, x, hi, lo, **kw), ref_first),
                           bits=all(checks.values()), bit_checks=checks)
            except Exception as e:  # noqa: BLE001 - one variant's failure should not hide the others
                row.update(ms=None, bits=None, error=f"{type(e).__name__}: {e}"[:1000])
            shape_rows.append(row)
        fce_ms = shape_rows[0]["ms"]
        for r in shape_rows:
            ms = "      -" if r["ms"] is None else f"{r['ms']:7.3f}"
            ratio = "" if r["ms"] is None else f"{r['ms'] / fce_ms:5.2f}x fce"
            extra = r.get("error") or ("" if r["bits"] else r.get("bit_checks", ""))
            print(f"K={k:5d} H={h:5d} V={v:6d}  {r['variant']:<42} {ms} ms {ratio:>10}  bits={r['bits']}  {extra}",
                  flush=True)
        rows += shape_rows
        del dz0, x0, dz, x, ref_first, ref_acc, ref_last
        torch.cuda.empty_cache()
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {out_path}")
    return rows


# --tx: the scaled-operand kernel's one launch that compiles (128x256 tiles run out of registers beside the tx
# partition), and the warp-specialized launches over a formed dZ that it is timed against
TX_LAUNCH = dict(bm=256, bn=128, bk=32, stages=3)
TX_REFERENCES = [_variant(256, 128, 32, 3, ws=True), _variant(256, 128, 32, 5, ws=True)]


def tx_main(out_path=None, shapes=SHAPES, dev="cuda"):
    """dW written once (FIRST and LAST) at SHAPES from tile values e [K, V] in [0, 1) and a scale s per (row,
    logits tile): the tx kernel forming dZ = e ⊙ s in its partition, against the warp-specialized kernel over
    the dZ that torch formed (the pass), bit for bit; both timed (`_time`), with fce_torch's dw_gemm over that dZ
    and an in-place multiply of e standing in for the pass's traffic."""
    from fce_torch.kernels.grad_gemms import dw_gemm
    from scaled_operand_probe import scaled
    torch.manual_seed(0)
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rows, none = [], (torch.empty(1, device=dev), torch.empty(1, device=dev))
    for k, h, v in shapes:
        e = torch.rand(k, v, device=dev).to(torch.bfloat16)
        scale = torch.rand(k, cdiv(v, GEMM.tile_n), device=dev)
        scale_t = scale.t().contiguous().t()  # tile-major: the tx partition's K steps read a column
        x = torch.randn(k, h, device=dev).to(torch.bfloat16)
        dz = scaled(e, scale)
        ref = dw_pair(dz, x, first=True, last=True, **TX_REFERENCES[0])
        print(f"  (K={k} H={h}: checking the tx kernel)", file=sys.stderr, flush=True)
        out = dw_pair(e, x, first=True, last=True, tx_scale=scale_t, **TX_LAUNCH)
        torch.cuda.synchronize()
        row = dict(K=k, H=h, V=v, tx_bits=_bits_equal(out, ref),
                   tx_ms=_time(lambda hi, lo: dw_pair(e, x, first=True, last=True, tx_scale=scale_t, **TX_LAUNCH),
                               none),
                   pass_standin_ms=_time(lambda hi, lo: torch.mul(e, 1.0, out=e), none),
                   fce_dw_gemm_ms=_time(lambda hi, lo: dw_gemm(dz, x, torch.bfloat16), none))
        for kw in TX_REFERENCES:
            row[_variant_name(**kw) + " ms"] = _time(lambda hi, lo, kw=kw: dw_pair(dz, x, first=True, last=True,
                                                                                    **kw), none)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del e, scale, scale_t, x, dz, ref, out
        torch.cuda.empty_cache()
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a not in ("--short", "--ep", "--tx")]
    if torch.cuda.is_available() and "--tx" in sys.argv:
        tx_main(args[0] if args else None)
    elif torch.cuda.is_available():
        gpu_main(args[0] if args else None, IL_VARIANTS + EP_VARIANTS + EP_REFERENCES if "--ep" in sys.argv
                 else SHORT_VARIANTS if "--short" in sys.argv else VARIANTS)
    else:
        compile_check()

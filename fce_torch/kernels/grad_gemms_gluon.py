"""dW's (hi, lo) accumulation (grad_gemms.py's PAIR and PAIR_LAST modes: C (+)= dZᵀ X for a bfloat16 weight) on
sm_90 in Gluon, on the schedule of the JAX twin's Mosaic GPU kernel (fce_jax/kernels/grad_gemms_mgpu.py,
`_kernel`). The Triton kernel loads each block of C by descriptor after the K loop and waits on each load, with
the tensor cores idle; here C's blocks arrive under the K loop and leave as each is done:

- a loader warp fills a ring of TMA stages (each: dZᵀ's two [tile_k, tile_m / 2] blocks and X's
  [tile_k, tile_n] block);
- two compute warpgroups multiply every stage, each on its half of the tile's rows, and each then runs its
  half's epilogue alone, in `epilogue_cols`-wide column blocks: two shared-memory slots hold their (hi, lo)
  blocks of C, the first two loaded by TMA before the tile's K loop, each later one as soon as the store of the
  block two before it has left its slot; each block is stored by TMA as soon as it is done.

Every output element takes the Triton kernel's products (wgmma, float32 accumulation, K ascending in k16 steps)
and the same elementwise epilogue (`fastmath.pair_value`, `pair_split`), so the bits are the same whatever the
tiles (tests/test_grad_gemms_gluon.py on the GPU; tools/gluon_grads.py times both).

Barriers (count 1 unless said; g: the program's running count of K steps, in stage g % STAGES):
  ready[s]  (TMA -> both compute warpgroups): step g's blocks have landed; each warpgroup waits with parity
            (g // STAGES) & 1: both take every step in order, and the stage is not refilled before both left it.
  empty[s]  (count 2: each compute warpgroup, once its wgmma that read the stage has retired -> loader): the
            loader's wait for step g has parity ((g // STAGES) & 1) ^ 1, so the first STAGES pass at once.
  c_ready[w * 2 + slot] (TMA -> compute warpgroup w): the C blocks that w loaded into its slot have landed; w's
            j-th tile uses each slot blocks / 2 times, so block b waits with parity (j * blocks / 2 + b // 2) & 1.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fce_core.config import GRAD_GEMM_GLUON
from fce_core.plan import PAIR, PAIR_LAST, cdiv, rows_fast

from . import fastmath as fm
from .launch import launched
from .tma import column_halves, processors, shared_layout, sm90, tile_origin, tma_ready

COMPUTE_WGS = 2


@gluon.jit
def _loader(a_desc, b_desc, a_ring, b_ring, ready, empty, pid, programs, n_m, n_n, n_tiles, n_k, HM: gl.constexpr,
            BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, ROWS_FAST: gl.constexpr):
    step = 0
    for tile in range(pid, n_tiles, programs):
        r0, c0 = tile_origin(tile, n_m, n_n, 2 * HM, BN, ROWS_FAST)
        for kk in range(n_k):
            slot = step % STAGES
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [kk * BK, r0], bar, a_ring.index(2 * slot))
            tma.async_copy_global_to_shared(a_desc, [kk * BK, r0 + HM], bar, a_ring.index(2 * slot + 1))
            tma.async_copy_global_to_shared(b_desc, [kk * BK, c0], bar, b_ring.index(slot))
            step += 1


@gluon.jit
def _load_c(hi_desc, lo_desc, hi_s, lo_s, c_ready, r0, c0, b: gl.constexpr, W: gl.constexpr,
            EPI: gl.constexpr):
    """C's (hi, lo) block b of warpgroup W's rows from r0 into its slot b % 2."""
    at = W * 2 + b % 2
    bar = c_ready.index(at)
    mbarrier.expect(bar, hi_desc.block_type.nbytes + lo_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(hi_desc, [r0, c0 + b * EPI], bar, hi_s.index(at))
    tma.async_copy_global_to_shared(lo_desc, [r0, c0 + b * EPI], bar, lo_s.index(at))


@gluon.jit
def _block(part, hi_s, lo_s, c_ready, hi_desc, lo_desc, r0, c0, parity, b: gl.constexpr, W: gl.constexpr,
           BLOCKS: gl.constexpr, FIRST: gl.constexpr, LAST: gl.constexpr, ASM: gl.constexpr):
    """Column block b of warpgroup W's rows: the (hi, lo) update of its product `part` [HM, EPI] in its slot, the
    block's TMA stores, and then (C read) the load of block b + 2 into the slot once those stores have read it."""
    EPI: gl.constexpr = part.shape[1]
    at = W * 2 + b % 2
    hs = hi_s.index(at)
    ls = lo_s.index(at)
    if FIRST:
        tma.store_wait(2)  # the stores of block b - 2 (this tile's or the last one's) have read the slot
        s = part
    else:
        mbarrier.wait(c_ready.index(at), (parity + b // 2) & 1)
        s = fm.pair_value(hs.load(part.type.layout), ls.load(part.type.layout)) + part
    hi, lo = fm.pair_split(s, gl.bfloat16, ASM)
    hs.store(hi)
    if not LAST:
        ls.store(lo)
    hopper.fence_async_shared()  # the generic-proxy stores, before the TMA unit reads them
    tma.async_copy_shared_to_global(hi_desc, [r0, c0 + b * EPI], hs)
    if not LAST:
        tma.async_copy_shared_to_global(lo_desc, [r0, c0 + b * EPI], ls)
    if not FIRST:
        if b + 2 < BLOCKS:
            tma.store_wait(0)
            _load_c(hi_desc, lo_desc, hi_s, lo_s, c_ready, r0, c0, b + 2, W, EPI)


@gluon.jit
def _blocks(t, hi_s, lo_s, c_ready, hi_desc, lo_desc, r0, c0, parity, b: gl.constexpr, W: gl.constexpr,
            BLOCKS: gl.constexpr, PARTS: gl.constexpr, FIRST: gl.constexpr, LAST: gl.constexpr, ASM: gl.constexpr):
    """`_block` over t's PARTS column blocks (blocks b .. b + PARTS of the warpgroup's tile), left to right."""
    if PARTS == 1:
        _block(t, hi_s, lo_s, c_ready, hi_desc, lo_desc, r0, c0, parity, b, W, BLOCKS, FIRST, LAST, ASM)
    else:
        left, right = column_halves(t)
        _blocks(left, hi_s, lo_s, c_ready, hi_desc, lo_desc, r0, c0, parity, b, W, BLOCKS, PARTS // 2, FIRST, LAST,
                ASM)
        _blocks(right, hi_s, lo_s, c_ready, hi_desc, lo_desc, r0, c0, parity, b + PARTS // 2, W, BLOCKS, PARTS // 2,
                FIRST, LAST, ASM)


@gluon.jit
def _compute(a_ring, b_ring, ready, empty, hi_s, lo_s, c_ready, hi_desc, lo_desc, pid, programs, n_m, n_n, n_tiles,
             n_k, W: gl.constexpr, HM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, EPI: gl.constexpr,
             ROWS_FAST: gl.constexpr, FIRST: gl.constexpr, LAST: gl.constexpr, ASM: gl.constexpr):
    BLOCKS: gl.constexpr = BN // EPI
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 16])
    step = 0
    j = 0  # tiles done
    for tile in range(pid, n_tiles, programs):
        r0, c0 = tile_origin(tile, n_m, n_n, 2 * HM, BN, ROWS_FAST)
        r0 = r0 + W * HM
        if not FIRST:
            tma.store_wait(0)  # the last tile's stores have left the slots
            _load_c(hi_desc, lo_desc, hi_s, lo_s, c_ready, r0, c0, 0, W, EPI)
            _load_c(hi_desc, lo_desc, hi_s, lo_s, c_ready, r0, c0, 1, W, EPI)
        acc = gl.zeros([HM, BN], gl.float32, acc_layout)
        for kk in range(n_k):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            acc = hopper.warpgroup_mma(a_ring.index(2 * slot + W).permute((1, 0)), b_ring.index(slot), acc,
                                       is_async=True)
            # at most this step's wgmma in flight: the previous step's stage is free
            acc = hopper.warpgroup_mma_wait(1, deps=[acc])
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=kk > 0)
            step += 1
        acc = hopper.warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
        _blocks(acc, hi_s, lo_s, c_ready, hi_desc, lo_desc, r0, c0, j * (BLOCKS // 2), 0, W, BLOCKS, BLOCKS, FIRST,
                LAST, ASM)
        j += 1
    tma.store_wait(0)


@launched
@gluon.jit
def _dw_pair_kernel(a_desc, b_desc, hi_desc, lo_desc, M, N, K, FIRST: gl.constexpr, LAST: gl.constexpr,
                    HM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, EPI: gl.constexpr,
                    ROWS_FAST: gl.constexpr, ASM: gl.constexpr, COMPUTE_REGS: gl.constexpr,
                    LOADER_REGS: gl.constexpr):
    # a_desc: dZ [K, M] in [BK, HM] blocks (each stage holds a tile's two); b_desc: x [K, N] in [BK, BN] blocks;
    # hi_desc / lo_desc: C's hi (bfloat16) and lo (int8) [M, N] in [HM, EPI] blocks. Launched with num_warps=4:
    # the default partition is compute warpgroup 0.
    gl.static_assert(STAGES >= 2, "the ring refills the stage that the previous step's wgmma read")
    gl.static_assert(BN % EPI == 0, "a tile's columns are whole epilogue blocks")
    gl.static_assert(BN // EPI % 2 == 0, "the two slots take a tile's blocks in turns, each as many")
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, BK, HM], a_desc.layout)  # [stage * 2 + w]
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BK, BN], b_desc.layout)
    hi_s = gl.allocate_shared_memory(hi_desc.dtype, [4, HM, EPI], hi_desc.layout)  # [w * 2 + slot]
    lo_s = gl.allocate_shared_memory(lo_desc.dtype, [4, HM, EPI], lo_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(4):
        mbarrier.init(c_ready.index(i), count=1)
    hopper.fence_async_shared()  # the barriers' initialization, before the TMA unit signals them

    n_m = gl.cdiv(M, 2 * HM)
    n_n = gl.cdiv(N, BN)
    n_tiles = n_m * n_n
    n_k = gl.cdiv(K, BK)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    gl.warp_specialize([
        (_compute, (a_ring, b_ring, ready, empty, hi_s, lo_s, c_ready, hi_desc, lo_desc, pid, programs, n_m, n_n,
                    n_tiles, n_k, 0, HM, BN, STAGES, EPI, ROWS_FAST, FIRST, LAST, ASM)),
        (_compute, (a_ring, b_ring, ready, empty, hi_s, lo_s, c_ready, hi_desc, lo_desc, pid, programs, n_m, n_n,
                    n_tiles, n_k, 1, HM, BN, STAGES, EPI, ROWS_FAST, FIRST, LAST, ASM)),
        (_loader, (a_desc, b_desc, a_ring, b_ring, ready, empty, pid, programs, n_m, n_n, n_tiles, n_k, HM, BN, BK,
                   STAGES, ROWS_FAST)),
    ], [4, 1], [COMPUTE_REGS, LOADER_REGS])


def applies(dz, x, hi, lo, k):
    """Whether this kernel runs dW's (hi, lo) update of bfloat16 hi and int8 lo from dZ's and x's first k rows
    (dZ [n, V] and x [n, H] tensors): compiled kernels (not the interpreter) on an sm_90 GPU, bfloat16
    operands, at least one row, arrays that TMA can move (rows of whole 16 bytes: H a multiple of 16 for lo's
    int8 rows)."""
    return (fm.ASM and isinstance(dz, torch.Tensor) and x.is_cuda and k >= 1
            and dz.dtype == x.dtype == hi.dtype == torch.bfloat16 and lo.dtype == torch.int8
            and sm90(x.device)
            and tma_ready(dz, x, hi, lo))


def dw_pair(dz, x, hi, lo, mode, first, cfg=GRAD_GEMM_GLUON):
    """(hi, lo) (+)= dZᵀ x in place (PAIR; PAIR_LAST: hi alone written), dZ [K, V] and x [K, H] cut to the
    chunk's rows, hi [V, H] bfloat16 and lo [V, H] int8, where `applies`. `first`: the pair is new (C not read)."""
    if mode not in (PAIR, PAIR_LAST):
        raise ValueError(f"the Gluon dW kernel updates a (hi, lo) pair, not mode {mode}")
    (k, m), n = dz.shape, x.shape[1]
    hm, bn, bk = cfg.tile_m // COMPUTE_WGS, cfg.tile_n, cfg.tile_k
    blocks = [(dz, [bk, hm], gl.bfloat16), (x, [bk, bn], gl.bfloat16), (hi, [hm, cfg.epilogue_cols], gl.bfloat16),
              (lo, [hm, cfg.epilogue_cols], gl.int8)]
    descs = [TensorDescriptor.from_tensor(t, block, shared_layout(block, dt)) for t, block, dt in blocks]
    grid = (min(cdiv(m, cfg.tile_m) * cdiv(n, bn), processors(x.device)),)
    _dw_pair_kernel[grid](*descs, m, n, k, FIRST=first, LAST=mode == PAIR_LAST, HM=hm, BN=bn, BK=bk,
                          STAGES=cfg.num_stages, EPI=cfg.epilogue_cols, ROWS_FAST=rows_fast(m, n, cfg.tile_m, bn),
                          ASM=fm.ASM, COMPUTE_REGS=cfg.compute_regs, LOADER_REGS=cfg.loader_regs, num_warps=4)

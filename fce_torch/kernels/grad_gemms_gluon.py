"""The fused engine's gradient GEMMs on sm_90 in Gluon for bfloat16 operands, on the schedule of the JAX twin's Mosaic
GPU kernel (fce_jax/kernels/grad_gemms_mgpu.py, `_kernel`): dX = dZ W (WRITE, dX's rows or the float32 planes of
its slices of V) and dW's (hi, lo) accumulation (grad_gemms.py's PAIR and PAIR_LAST modes: C (+)= dZᵀ X for a
bfloat16 weight). The Triton kernel runs each tile's epilogue after its K loop with the TMA loads issued by the
same warps, and loads each block of C by descriptor there, waiting on it with the tensor cores idle; here:

- a loader warp fills a ring of TMA stages (each: A's two [tile_m / 2]-row blocks, dZ's or dZᵀ's, and B's
  [tile_k, tile_n] block, W's or X's);
- two compute warpgroups multiply every stage, each on its half of the tile's rows, and each then runs its
  half's epilogue alone, in `epilogue_cols`-wide column blocks through two shared-memory slots, each block stored
  by TMA as soon as it is done; for the pair's update the slots hold C's (hi, lo) blocks, the first two loaded
  by TMA before the tile's K loop, each later one as soon as the store of the block two before it has left.

A work item is an output tile and one slice of K (`fce_core.plan.dx_slices`: dX's planes, each slice's K range
whole K steps of the Triton kernel's launch), so the items, their K order and the products (wgmma, float32
accumulation, K ascending in k16 steps) are the Triton kernel's, as is the elementwise epilogue
(`fastmath.to_dtype`, `pair_value`, `pair_split`): the bits are the same whatever the tiles
(tests/test_grad_gemms_gluon.py on the GPU; tools/gluon_grads.py times both).

Barriers (count 1 unless said; g: the program's running count of K steps, in stage g % STAGES):
  ready[s]  (TMA -> both compute warpgroups): step g's blocks have landed; each warpgroup waits with parity
            (g // STAGES) & 1: both take every step in order, and the stage is not refilled before both left it.
  empty[s]  (count 2: each compute warpgroup, once its wgmma that read the stage has retired -> loader): the
            loader's wait for step g has parity ((g // STAGES) & 1) ^ 1, so the first STAGES pass at once.
  c_ready[w * 2 + slot] (TMA -> compute warpgroup w; the pair's update only): the C blocks that w loaded into its
            slot have landed; w's j-th tile uses each slot blocks / 2 times, so block b waits with parity
            (j * blocks / 2 + b // 2) & 1.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fce_core.config import GRAD_GEMM_GLUON
from fce_core.plan import PAIR, PAIR_LAST, WRITE, cdiv, reads_c, rows_fast

from . import fastmath as fm
from .launch import launched
from .tma import column_halves, processors, shared_layout, sm90, tile_origin, tma_ready

COMPUTE_WGS = 2
_WRITE = gl.constexpr(WRITE)
_PAIR = gl.constexpr(PAIR)
# the element types of C that each mode writes (WRITE: dX's rows or float32 planes; the pair's hi)
C_DTYPES = {WRITE: {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}, PAIR: {torch.bfloat16: gl.bfloat16},
            PAIR_LAST: {torch.bfloat16: gl.bfloat16}}


@gluon.jit
def _item(item, n_tiles, K, SLICE_K, BK: gl.constexpr):
    """Work item `item`'s output tile, its plane (slice of K), the slice's first K and its K steps."""
    plane = item // n_tiles
    k_lo = plane * SLICE_K
    return item % n_tiles, plane, k_lo, gl.cdiv(gl.minimum(K, k_lo + SLICE_K) - k_lo, BK)


@gluon.jit
def _loader(a_desc, b_desc, a_ring, b_ring, ready, empty, pid, programs, n_m, n_n, n_tiles, n_items, K, SLICE_K,
            HM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, ROWS_FAST: gl.constexpr,
            A_T: gl.constexpr):
    step = 0
    for item in range(pid, n_items, programs):
        tile, plane, k_lo, n_k = _item(item, n_tiles, K, SLICE_K, BK)
        r0, c0 = tile_origin(tile, n_m, n_n, 2 * HM, BN, ROWS_FAST)
        for kk in range(n_k):
            k = k_lo + kk * BK
            slot = step % STAGES
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            if A_T:  # dZᵀ's rows are dZ's columns
                tma.async_copy_global_to_shared(a_desc, [k, r0], bar, a_ring.index(2 * slot))
                tma.async_copy_global_to_shared(a_desc, [k, r0 + HM], bar, a_ring.index(2 * slot + 1))
            else:
                tma.async_copy_global_to_shared(a_desc, [r0, k], bar, a_ring.index(2 * slot))
                tma.async_copy_global_to_shared(a_desc, [r0 + HM, k], bar, a_ring.index(2 * slot + 1))
            tma.async_copy_global_to_shared(b_desc, [k, c0], bar, b_ring.index(slot))
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
           BLOCKS: gl.constexpr, MODE: gl.constexpr, READS_C: gl.constexpr, ASM: gl.constexpr):
    """Column block b of warpgroup W's rows from its product `part` [HM, EPI] in its slot: C written (WRITE) or
    the (hi, lo) update, the block's TMA stores, and then (C read) the load of block b + 2 into the slot once
    those stores have read it."""
    EPI: gl.constexpr = part.shape[1]
    STORES: gl.constexpr = 2 if MODE == _PAIR else 1  # TMA stores a block
    at = W * 2 + b % 2
    hs = hi_s.index(at)
    ls = lo_s.index(at)
    if READS_C:
        mbarrier.wait(c_ready.index(at), (parity + b // 2) & 1)
        part = fm.pair_value(hs.load(part.type.layout), ls.load(part.type.layout)) + part
    else:
        tma.store_wait(STORES)  # the stores of block b - 2 (this tile's or the last one's) have read the slot
    if MODE == _WRITE:
        hs.store(fm.to_dtype(part, hi_desc.dtype, ASM))
    else:
        hi, lo = fm.pair_split(part, gl.bfloat16, ASM)
        hs.store(hi)
        if MODE == _PAIR:
            ls.store(lo)
    hopper.fence_async_shared()  # the generic-proxy stores, before the TMA unit reads them
    tma.async_copy_shared_to_global(hi_desc, [r0, c0 + b * EPI], hs)
    if MODE == _PAIR:
        tma.async_copy_shared_to_global(lo_desc, [r0, c0 + b * EPI], ls)
    if READS_C:
        if b + 2 < BLOCKS:
            tma.store_wait(0)
            _load_c(hi_desc, lo_desc, hi_s, lo_s, c_ready, r0, c0, b + 2, W, EPI)


@gluon.jit
def _blocks(t, hi_s, lo_s, c_ready, hi_desc, lo_desc, r0, c0, parity, b: gl.constexpr, W: gl.constexpr,
            BLOCKS: gl.constexpr, PARTS: gl.constexpr, MODE: gl.constexpr, READS_C: gl.constexpr, ASM: gl.constexpr):
    """`_block` over t's PARTS column blocks (blocks b .. b + PARTS of the warpgroup's tile), left to right."""
    if PARTS == 1:
        _block(t, hi_s, lo_s, c_ready, hi_desc, lo_desc, r0, c0, parity, b, W, BLOCKS, MODE, READS_C, ASM)
    else:
        left, right = column_halves(t)
        _blocks(left, hi_s, lo_s, c_ready, hi_desc, lo_desc, r0, c0, parity, b, W, BLOCKS, PARTS // 2, MODE,
                READS_C, ASM)
        _blocks(right, hi_s, lo_s, c_ready, hi_desc, lo_desc, r0, c0, parity, b + PARTS // 2, W, BLOCKS, PARTS // 2,
                MODE, READS_C, ASM)


@gluon.jit
def _compute(a_ring, b_ring, ready, empty, hi_s, lo_s, c_ready, hi_desc, lo_desc, pid, programs, n_m, n_n, n_tiles,
             n_items, K, SLICE_K, M_PLANE, W: gl.constexpr, HM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
             STAGES: gl.constexpr, EPI: gl.constexpr, ROWS_FAST: gl.constexpr, A_T: gl.constexpr,
             MODE: gl.constexpr, READS_C: gl.constexpr, ASM: gl.constexpr):
    BLOCKS: gl.constexpr = BN // EPI
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 16])
    step = 0
    j = 0  # items done
    for item in range(pid, n_items, programs):
        tile, plane, k_lo, n_k = _item(item, n_tiles, K, SLICE_K, BK)
        r0, c0 = tile_origin(tile, n_m, n_n, 2 * HM, BN, ROWS_FAST)
        r0 = plane * M_PLANE + r0 + W * HM  # C's row: planes of M_PLANE rows, each a whole number of tiles
        if READS_C:
            tma.store_wait(0)  # the last tile's stores have left the slots
            _load_c(hi_desc, lo_desc, hi_s, lo_s, c_ready, r0, c0, 0, W, EPI)
            _load_c(hi_desc, lo_desc, hi_s, lo_s, c_ready, r0, c0, 1, W, EPI)
        acc = gl.zeros([HM, BN], gl.float32, acc_layout)
        for kk in range(n_k):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            a = a_ring.index(2 * slot + W)
            if A_T:
                a = a.permute((1, 0))
            acc = hopper.warpgroup_mma(a, b_ring.index(slot), acc, is_async=True)
            # at most this step's wgmma in flight: the previous step's stage is free
            acc = hopper.warpgroup_mma_wait(1, deps=[acc])
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=kk > 0)
            step += 1
        acc = hopper.warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
        _blocks(acc, hi_s, lo_s, c_ready, hi_desc, lo_desc, r0, c0, j * (BLOCKS // 2), 0, W, BLOCKS, BLOCKS, MODE,
                READS_C, ASM)
        j += 1
    tma.store_wait(0)


@launched
@gluon.jit
def _grad_kernel(a_desc, b_desc, hi_desc, lo_desc, M, N, K, SLICE_K, slices, M_PLANE, A_T: gl.constexpr,
                 MODE: gl.constexpr, READS_C: gl.constexpr, HM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                 STAGES: gl.constexpr, EPI: gl.constexpr, ROWS_FAST: gl.constexpr, ASM: gl.constexpr,
                 COMPUTE_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    # a_desc: A [M, K] in [HM, BK] blocks, or with A_T dZ [K, M] in [BK, HM] blocks (each stage holds a tile's
    # two); b_desc: B [K, N] in [BK, BN] blocks; hi_desc: C [slices * M_PLANE, N] (WRITE) or hi (bfloat16) in
    # [HM, EPI] blocks, lo_desc: lo (int8 [M, N]; WRITE: hi_desc again). Launched with num_warps=4: the default
    # partition is compute warpgroup 0.
    gl.static_assert(STAGES >= 2, "the ring refills the stage that the previous step's wgmma read")
    gl.static_assert(BN % EPI == 0, "a tile's columns are whole epilogue blocks")
    gl.static_assert(BN // EPI % 2 == 0, "the two slots take a tile's blocks in turns, each as many")
    if A_T:  # [stage * 2 + w]
        a_ring = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, BK, HM], a_desc.layout)
    else:
        a_ring = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HM, BK], a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BK, BN], b_desc.layout)
    hi_s = gl.allocate_shared_memory(hi_desc.dtype, [4, HM, EPI], hi_desc.layout)  # [w * 2 + slot]
    if MODE == _WRITE:
        lo_s = hi_s  # no lo
    else:
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
    n_items = n_tiles * slices
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    gl.warp_specialize([
        (_compute, (a_ring, b_ring, ready, empty, hi_s, lo_s, c_ready, hi_desc, lo_desc, pid, programs, n_m, n_n,
                    n_tiles, n_items, K, SLICE_K, M_PLANE, 0, HM, BN, BK, STAGES, EPI, ROWS_FAST, A_T, MODE, READS_C,
                    ASM)),
        (_compute, (a_ring, b_ring, ready, empty, hi_s, lo_s, c_ready, hi_desc, lo_desc, pid, programs, n_m, n_n,
                    n_tiles, n_items, K, SLICE_K, M_PLANE, 1, HM, BN, BK, STAGES, EPI, ROWS_FAST, A_T, MODE, READS_C,
                    ASM)),
        (_loader, (a_desc, b_desc, a_ring, b_ring, ready, empty, pid, programs, n_m, n_n, n_tiles, n_items, K,
                   SLICE_K, HM, BN, BK, STAGES, ROWS_FAST, A_T)),
    ], [4, 1], [COMPUTE_REGS, LOADER_REGS])


def applies(a, b, c, k, mode, lo=None):
    """Whether this kernel runs C = A @ B with the epilogue `mode` from the first k rows of dZ (`a`, [n, V]) and
    `b` ([n, H]: x, for dW; or w [V, H], for dX): compiled kernels (not the interpreter) on an sm_90 GPU,
    bfloat16 operands, at least one K step, C of a type that the mode writes (`C_DTYPES`; the pair's lo int8),
    arrays that TMA can move (rows of whole 16 bytes: H a multiple of 16 for lo's int8 rows)."""
    arrays = (a, b, c) if lo is None else (a, b, c, lo)
    return (fm.ASM and isinstance(a, torch.Tensor) and b.is_cuda and k >= 1
            and a.dtype == b.dtype == torch.bfloat16 and c.dtype in C_DTYPES.get(mode, ())
            and (lo is None) == (mode == WRITE) and (lo is None or lo.dtype == torch.int8)
            and sm90(b.device) and tma_ready(*arrays))


def check_slices(slice_k, slices, bk):
    """Every slice of K but the last (the only one included) whole K steps of bk: the last may end inside one, whose
    columns past K TMA reads as zeros."""
    if slices > 1 and slice_k % bk:
        raise ValueError(f"a slice of K ({slice_k}) must be whole K steps of {bk} where there are several")


def _launch(a, a_t, b, c, lo, m, mode, first, cfg, slices=1, slice_k=None, m_plane=0):
    hm, bn, bk, epi = cfg.tile_m // COMPUTE_WGS, cfg.tile_n, cfg.tile_k, cfg.epilogue_cols
    k, n = b.shape
    slice_k = k if slice_k is None else slice_k
    check_slices(slice_k, slices, bk)
    outs = [(c, [hm, epi], C_DTYPES[mode][c.dtype])]
    if lo is not None:
        outs.append((lo, [hm, epi], gl.int8))
    blocks = [(a, [bk, hm] if a_t else [hm, bk], gl.bfloat16), (b, [bk, bn], gl.bfloat16)] + outs
    descs = [TensorDescriptor.from_tensor(t, block, shared_layout(block, dt)) for t, block, dt in blocks]
    if lo is None:
        descs.append(descs[-1])
    grid = (min(cdiv(m, cfg.tile_m) * cdiv(n, bn) * slices, processors(b.device)),)
    _grad_kernel[grid](*descs, m, n, k, slice_k, slices, m_plane, A_T=a_t, MODE=mode, READS_C=reads_c(mode, first),
                       HM=hm, BN=bn, BK=bk, STAGES=cfg.num_stages, EPI=epi,
                       ROWS_FAST=rows_fast(m, n, cfg.tile_m, bn), ASM=fm.ASM, COMPUTE_REGS=cfg.compute_regs,
                       LOADER_REGS=cfg.loader_regs, num_warps=4)


def dx_planes(dz, w, c, slices, slice_k, cfg=GRAD_GEMM_GLUON):
    """dZ W over `slices` slices of V (each slice_k long but the last) where `applies`: dZ [m, V] cut to the
    rows that count, w [V, H]; c [m, H] (one slice: dX's rows, in its dtype) or the float32 planes
    [slices, M_plane, H], M_plane a multiple of cfg.tile_m (`plane_rows`) so that no tile's store crosses into the
    next plane; their rows past m are left with zeros' products."""
    m = dz.shape[0]
    m_plane = c.shape[1] if c.dim() == 3 else 0
    if c.dim() == 3 and (m_plane % cfg.tile_m or m_plane < m):
        raise ValueError(f"the planes' rows ({m_plane}) must be a multiple of {cfg.tile_m} and at least {m}")
    _launch(dz, False, w, c.reshape(-1, c.shape[-1]), None, m, WRITE, False, cfg, slices, slice_k, m_plane)


def plane_rows(m, cfg=GRAD_GEMM_GLUON):
    """The rows of each float32 plane of `dx_planes`: m rounded up to whole tiles."""
    return cdiv(m, cfg.tile_m) * cfg.tile_m


def dw(dz, x, hi, lo, mode, first, cfg=GRAD_GEMM_GLUON):
    """C = dZᵀ x (WRITE: c = hi, lo None) or the pair's (hi, lo) (+)= dZᵀ x in place (PAIR; PAIR_LAST: hi alone
    written), dZ [K, V] and x [K, H] cut to the chunk's rows, hi [V, H], lo [V, H] int8, where `applies`.
    `first`: the pair is new (C not read)."""
    if mode not in C_DTYPES:
        raise ValueError(f"the Gluon gradient GEMMs write C or update a (hi, lo) pair, not mode {mode}")
    _launch(dz, True, x, hi, lo, dz.shape[1], mode, first, cfg)

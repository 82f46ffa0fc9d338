"""The fused engine's logits GEMM with its statistics epilogue on sm_90, in Gluon: `logit_tiles`' computation
and bits, its two compute warpgroups taking output tiles in turns (ping-pong), so that one warpgroup's epilogue
runs under the other's wgmma, and a loader warp issuing every TMA load. The Triton kernel (logit_tiles.py) runs
each tile's epilogue after its K loop with the tensor cores idle.

Each warpgroup holds a [tile_m, tile_n] float32 accumulator (64 x 256: 128 registers a thread). The partials
are per (row, tile_n-column tile) as in the Triton kernel; a row's statistics depend on its tile's columns,
the wgmma's K order (ascending, k16 steps) and the epilogue's fixed trees, not on the row block, so both
kernels give the same bits (checked on the GPU by tests/test_logits_pingpong.py and tools/gluon_logits.py).
The epilogue takes e and the sums in `parts` column blocks, left to right; each pair of blocks' sums is added as
`row_sum`'s tree adds the halves of a width.

Barriers (count 1; an arrival is its partition's): the operand ring is shared by both owners in the loader's
order (global step g = i * n_k + kk of the program's i-th tile, in stage g % STAGES; owner i % 2):
  ready[o][s] (TMA -> owner o): the stage's blocks for owner o's step have landed. One per owner: a wait on a
              shared one could pass on the phase of the other owner's earlier step. Owner o keeps the parities
              of its next phases as a bit mask (its uses of a stage have no closed form unless STAGES | n_k).
  empty[s]   (owner -> loader): the wgmma that read the stage has retired; the loader's wait for step g has
              parity ((g // STAGES) & 1) ^ 1, so the first STAGES pass at once.
This is tools/gluon_dw.py's ping-pong protocol without its loads of C, which tools/ws_protocol_sim.py checks on
random interleavings. Each owner stages its e blocks for their TMA stores in shared memory of its own.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fce_core.config import LOGITS_PINGPONG
from fce_core.plan import cdiv

from . import fastmath as fm
from .fastmath import LOG2E
from .launch import launched
from .tma import ELEMENT_TYPES, column_halves, processors, shared_layout, sm90, tma_ready
from ..sums import row_sum

@gluon.jit
def _load_partition(x_desc, w_desc, x_ring, w_ring, ready, empty, pid, programs, n_m, n_tiles, n_k,
                    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    step = 0  # K steps issued (global step g)
    i = 0  # the program's tiles issued
    for tile in range(pid, n_tiles, programs):
        r0 = (tile % n_m) * BM  # row blocks fastest, as the Triton kernel: programs at work share a W tile
        c0 = (tile // n_m) * BN
        owner = i % 2
        for kk in range(n_k):
            slot = step % STAGES
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(owner * STAGES + slot)
            mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [r0, kk * BK], bar, x_ring.index(slot))
            tma.async_copy_global_to_shared(w_desc, [c0, kk * BK], bar, w_ring.index(slot))
            step += 1
        i += 1


@gluon.jit
def owner_wait(ready, phases, step, OWNER: gl.constexpr, STAGES: gl.constexpr):
    """Owner OWNER's wait for the blocks of the ring's global step `step` on its ready barriers; (the stage,
    `phases` with the stage's bit flipped: bit s holds the parity of ready[OWNER][s]'s next phase)."""
    slot = step % STAGES
    mbarrier.wait(ready.index(OWNER * STAGES + slot), (phases >> slot) & 1)
    return slot, phases ^ (1 << slot)


@gluon.jit
def _part_sums(z, m_t, c0, V, cw_ptr, partial, e_s, e_desc, r0, HAS_Q: gl.constexpr, HAS_PZ: gl.constexpr,
               HAS_CW: gl.constexpr, STORE: gl.constexpr, E_BUFS: gl.constexpr, ASM: gl.constexpr):
    """s, q and pz (s where not asked for) of the columns c0 .. c0 + W of a tile from their z (-inf past V) and
    the tile's maxima, their e stored from e_s (once the store that last read it is done): the Triton kernel's
    `_half_sums` on one block of columns."""
    BM: gl.constexpr = z.shape[0]
    W: gl.constexpr = z.shape[1]
    LOG2_W: gl.constexpr = W.bit_length() - 1
    layout: gl.constexpr = z.type.layout
    local = gl.arange(0, W, layout=gl.SliceLayout(0, layout))
    d = z - gl.convert_layout(m_t, gl.SliceLayout(1, layout))[:, None]  # the same rows' registers: no data moves
    e = fm.ex2(d * LOG2E, ASM)
    s = row_sum(e, BM, W, LOG2_W, ASM)
    if STORE:
        tma.store_wait(E_BUFS - 1)
        e_s.store(fm.to_dtype(e, e_desc.dtype, ASM))
        hopper.fence_async_shared()  # the generic-proxy stores, before the TMA unit reads them
        tma.async_copy_shared_to_global(e_desc, [r0, c0], e_s)
    if partial:
        d = gl.where((local < V - c0)[None, :], d, 0.0)
    q = s
    pz = s
    if HAS_Q:
        d_w = d
        if HAS_CW:
            d_w = fm.mul(gl.load(cw_ptr + c0 + local, mask=local < V - c0, other=0.0)[None, :], d, ASM)
        q = row_sum(d_w, BM, W, LOG2_W, ASM)
    if HAS_PZ:
        pz = row_sum(fm.mul(e, d, ASM), BM, W, LOG2_W, ASM)
    return s, q, pz


@gluon.jit
def _cols_sums(z, m_t, c0, V, cw_ptr, partial, e_s, e0, e_desc, r0, p: gl.constexpr, PARTS: gl.constexpr,
               HAS_Q: gl.constexpr, HAS_PZ: gl.constexpr, HAS_CW: gl.constexpr, STORE: gl.constexpr,
               E_BUFS: gl.constexpr, ASM: gl.constexpr):
    """`_part_sums` over z's columns in PARTS blocks (part p of the tile on), each pair of sums added as
    `row_sum`'s tree adds the two halves of a width: the bits of one tree over all the columns."""
    if PARTS == 1:
        s, q, pz = _part_sums(z, m_t, c0, V, cw_ptr, partial, e_s.index(e0 + p % E_BUFS), e_desc, r0, HAS_Q, HAS_PZ,
                              HAS_CW, STORE, E_BUFS, ASM)
    else:
        left, right = column_halves(z)
        s_l, q_l, pz_l = _cols_sums(left, m_t, c0, V, cw_ptr, partial, e_s, e0, e_desc, r0, p, PARTS // 2, HAS_Q,
                                    HAS_PZ, HAS_CW, STORE, E_BUFS, ASM)
        s_r, q_r, pz_r = _cols_sums(right, m_t, c0 + z.shape[1] // 2, V, cw_ptr, partial, e_s, e0, e_desc, r0,
                                    p + PARTS // 2, PARTS // 2, HAS_Q, HAS_PZ, HAS_CW, STORE, E_BUFS, ASM)
        s = s_l + s_r
        q = q_l + q_r
        pz = pz_l + pz_r
    return s, q, pz


@gluon.jit
def _epilogue(z, e_s, e0, e_desc, y_ptr, cw_ptr, m_ptr, s_ptr, arg_ptr, zy_ptr, q_ptr, pz_ptr, r0, c0, n_rows, V,
              n_tiles, HAS_CW: gl.constexpr, HAS_Q: gl.constexpr, HAS_PZ: gl.constexpr, STORE: gl.constexpr,
              PARTS: gl.constexpr, E_BUFS: gl.constexpr, ASM: gl.constexpr):
    """The Triton kernel's epilogue of one tile of raw logits z: its max m_t, the first argmax, e and the sums
    by column blocks, the target logit."""
    BM: gl.constexpr = z.shape[0]
    BN: gl.constexpr = z.shape[1]
    layout: gl.constexpr = z.type.layout
    rows = r0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    # column indices within the tile: with c0 + them held beside the accumulator, the target logit's branch
    # spilled hundreds of bytes a thread (ptxas compiles each partition under 168 registers: 65536 over the
    # launch's 12 warps, the loader's warpgroup counted whole)
    local = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    row_ok = rows < n_rows
    partial = c0 + BN > V
    if partial:
        z = gl.where((local < V - c0)[None, :], z, float("-inf"))
    m_t = gl.max(z, axis=1)
    part = rows.to(gl.int64) * n_tiles + c0 // BN
    gl.store(m_ptr + part, m_t, mask=row_ok)
    arg = gl.min(gl.where(z == m_t[:, None], local[None, :], 2147483647), axis=1)
    gl.store(arg_ptr + part, gl.where(arg < BN, arg + c0, arg), mask=row_ok)  # none equals a NaN max: as Triton's
    s, q, pz = _cols_sums(z, m_t, c0, V, cw_ptr, partial, e_s, e0, e_desc, r0, 0, PARTS, HAS_Q, HAS_PZ, HAS_CW,
                          STORE, E_BUFS, ASM)
    gl.store(s_ptr + part, gl.convert_layout(s, part.type.layout), mask=row_ok)
    if HAS_Q:
        gl.store(q_ptr + part, gl.convert_layout(q, part.type.layout), mask=row_ok)
    if HAS_PZ:
        gl.store(pz_ptr + part, gl.convert_layout(pz, part.type.layout), mask=row_ok)
    # the target logit last, where z dies: a max over one column, skipped where no row's target is in the tile
    y = gl.load(y_ptr + rows, mask=row_ok, other=-1)
    y = gl.where((y >= 0) & (y < V), y, 0)  # `fce_core.rows.safe_targets`, as the Triton kernel
    zy_t = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, layout))
    if gl.max(((y >= c0) & (y < c0 + BN)).to(gl.int32), axis=0) > 0:
        zy_t = gl.max(gl.where(local[None, :] == (y - c0)[:, None], z, float("-inf")), axis=1)
    gl.store(zy_ptr + part, zy_t, mask=row_ok)


@gluon.jit
def _compute_partition(x_ring, w_ring, ready, empty, e_s, e_desc, y_ptr, cw_ptr, m_ptr, s_ptr, arg_ptr, zy_ptr,
                       q_ptr, pz_ptr, pid, programs, n_m, n_tiles, n_k, n_rows, V, n_vt, OWNER: gl.constexpr,
                       BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, HAS_CW: gl.constexpr,
                       HAS_Q: gl.constexpr, HAS_PZ: gl.constexpr, STORE: gl.constexpr, PARTS: gl.constexpr,
                       E_BUFS: gl.constexpr, ASM: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BN, 16])
    phases = 0  # bit s: the parity of ready[OWNER][s]'s next phase
    j = 0  # this owner's tiles done
    for tile in range(pid + OWNER * programs, n_tiles, 2 * programs):
        r0 = (tile % n_m) * BM
        c0 = (tile // n_m) * BN
        step = (2 * j + OWNER) * n_k  # the tile's first global step, as the loader counts
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        for kk in range(n_k):
            slot, phases = owner_wait(ready, phases, step, OWNER, STAGES)
            acc = hopper.warpgroup_mma(x_ring.index(slot), w_ring.index(slot).permute((1, 0)), acc, is_async=True)
            # at most this step's wgmma in flight: the previous step's stage is free
            acc = hopper.warpgroup_mma_wait(1, deps=[acc])
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=kk > 0)
            step += 1
        acc = hopper.warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
        _epilogue(acc, e_s, OWNER * E_BUFS, e_desc, y_ptr, cw_ptr, m_ptr, s_ptr, arg_ptr, zy_ptr, q_ptr, pz_ptr,
                  r0, c0, n_rows, V, n_vt, HAS_CW, HAS_Q, HAS_PZ, STORE, PARTS, E_BUFS, ASM)
        j += 1
    tma.store_wait(0)


@launched
@gluon.jit
def _logit_tiles_pp_kernel(x_desc, w_desc, e_desc, y_ptr, cw_ptr, m_ptr, s_ptr, arg_ptr, zy_ptr, q_ptr, pz_ptr,
                           n_rows, V, H, HAS_CW: gl.constexpr, HAS_Q: gl.constexpr, HAS_PZ: gl.constexpr,
                           STORE: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                           STAGES: gl.constexpr, PARTS: gl.constexpr, E_BUFS: gl.constexpr, ASM: gl.constexpr,
                           COMPUTE_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, LOADER_WARPS: gl.constexpr):
    # x_desc: x [n, H], blocks [BM, BK]; w_desc: w [V, H], blocks [BN, BK]; e_desc: e [n, V], blocks
    # [BM, BN // PARTS] (unused without STORE). Launched with num_warps=4: the default partition is owner 0.
    gl.static_assert(STAGES >= 2, "the ring refills the stage that the previous step's wgmma read")
    gl.static_assert(STAGES <= 31, "an owner's ready phases are bits of one int32")
    gl.static_assert(PARTS % E_BUFS == 0, "a tile's column blocks cycle through its owner's e buffers")
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    w_ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    if STORE:
        e_s = gl.allocate_shared_memory(e_desc.dtype, [2 * E_BUFS, BM, BN // PARTS], e_desc.layout)  # [o * E_BUFS + b]
    else:
        e_s = x_ring  # never read
    ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())  # [owner * STAGES + s]
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=1)
    hopper.fence_async_shared()  # the barriers' initialization, before the TMA unit signals them

    n_m = gl.cdiv(n_rows, BM)
    n_vt = gl.cdiv(V, BN)
    n_tiles = n_m * n_vt
    n_k = gl.cdiv(H, BK)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    gl.warp_specialize([
        (_compute_partition, (x_ring, w_ring, ready, empty, e_s, e_desc, y_ptr, cw_ptr, m_ptr, s_ptr, arg_ptr, zy_ptr,
                              q_ptr, pz_ptr, pid, programs, n_m, n_tiles, n_k, n_rows, V, n_vt, 0, BM, BN, STAGES,
                              HAS_CW, HAS_Q, HAS_PZ, STORE, PARTS, E_BUFS, ASM)),
        (_compute_partition, (x_ring, w_ring, ready, empty, e_s, e_desc, y_ptr, cw_ptr, m_ptr, s_ptr, arg_ptr, zy_ptr,
                              q_ptr, pz_ptr, pid, programs, n_m, n_tiles, n_k, n_rows, V, n_vt, 1, BM, BN, STAGES,
                              HAS_CW, HAS_Q, HAS_PZ, STORE, PARTS, E_BUFS, ASM)),
        (_load_partition, (x_desc, w_desc, x_ring, w_ring, ready, empty, pid, programs, n_m, n_tiles, n_k, BM, BN,
                           BK, STAGES)),
    ], [4, LOADER_WARPS], [COMPUTE_REGS, LOADER_REGS])


def applies(x, w, e, bias, transform):
    """Whether this kernel runs the logits GEMM of x [n, H] against w [V, H] into e (or None): compiled kernels
    (not the interpreter) on an sm_90 GPU, 16-bit operands of one dtype, arrays that TMA can move, raw logits
    (no bias, softcap or temperature: the softcap's tanh of the whole tile spilled kilobytes a thread under the
    partitions' 168 registers, and with a bias and a temperature it was 7-47% slower than the Triton kernel on
    the H100, bench/results/nvidia-h100/logits-pingpong/)."""
    return (fm.ASM and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and bias is None
            and transform.softcap is None and not transform.has_temperature
            and sm90(x.device)
            and tma_ready(x, w, *(() if e is None else (e,))))


def logit_tiles_pp(x, w, y, class_weights, e, parts, *, spec, tile_n, cfg=LOGITS_PINGPONG):
    """`logit_tiles`' launch on this kernel (where `applies`): fills e (unless None) and the [n, T] partials
    `parts` of its caller."""
    n, hidden = x.shape
    V = w.shape[0]
    gdt = ELEMENT_TYPES[x.dtype]  # Gluon's element types are Triton's
    col_blocks = cfg.parts_q_pz if spec.q or spec.pz else cfg.parts
    e_block = [cfg.tile_m, tile_n // col_blocks]
    blocks = [(x, [cfg.tile_m, cfg.tile_k]), (w, [tile_n, cfg.tile_k]), (e if e is not None else x, e_block)]
    descs = [TensorDescriptor.from_tensor(t, block, shared_layout(block, gdt)) for t, block in blocks]
    m = parts["m"]
    grid = (min(cdiv(n, cfg.tile_m) * cdiv(V, tile_n), processors(x.device)),)
    _logit_tiles_pp_kernel[grid](
        *descs, y, class_weights if class_weights is not None else m, m, parts["s"], parts["amax"], parts["zy"],
        parts.get("q", m), parts.get("pz", m), n, V, hidden, HAS_CW=class_weights is not None, HAS_Q=spec.q,
        HAS_PZ=spec.pz, STORE=e is not None, BM=cfg.tile_m, BN=tile_n, BK=cfg.tile_k, STAGES=cfg.num_stages,
        PARTS=col_blocks, E_BUFS=cfg.e_buffers, ASM=fm.ASM, COMPUTE_REGS=cfg.compute_regs,
        LOADER_REGS=cfg.loader_regs, LOADER_WARPS=cfg.loader_warps, num_warps=4)

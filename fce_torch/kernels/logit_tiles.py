"""The fused engine's forward, in Triton: the logits GEMM with a statistics epilogue, and the merge of its
per-tile partials (docs/NUMERICS.md, "The fused engine").

One program computes one [tile_m, tile_n] tile of Z = X_c Wᵀ (+ b) with float32 accumulation, K ascending,
then, per row of the tile: the tile max m_t, e = ex2((z - m_t) log2 e) stored in the input dtype (so no
float32 [Nc, V] exists), and the partials s_t = Σ e, the first argmax, the target logit (a max over one
column), q_t = Σ w (z - m_t) and pz_t = Σ e (z - m_t) where the head asks; each sum by a fixed pairwise
tree (`row_sum`), never a reduction whose order the compiler picks. `merge_tiles` rescales the partials
to the row max and sums them over the tiles in a fixed order. Twin: fce_jax/kernels/logit_tiles.py.
"""
import torch
import triton
import triton.language as tl

from fce_core.config import GEMM, GEMM_INTERPRETER, GEMM_SHORT, MERGE_ROWS, short
from fce_core.plan import cdiv

from . import fastmath as fm
from . import logit_tiles_gluon
from .fastmath import LOG2E
from .launch import launched
from .row_stats import logit_transform
from .tma import ELEMENT_TYPES, column_halves, descriptors, programs, stages
from ..sums import row_sum

F32 = torch.float32


@launched
@triton.jit
def _logit_tiles_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, cw_ptr, e_ptr, stride_e,
                        m_ptr, s_ptr, arg_ptr, zy_ptr, q_ptr, pz_ptr,
                        n_rows, V, H, n_tiles, softcap, temperature,
                        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr,
                        HAS_CW: tl.constexpr, HAS_Q: tl.constexpr, HAS_PZ: tl.constexpr, STORE: tl.constexpr,
                        PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        LOG2_BN: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, E_DESC: tl.constexpr,
                        E_DT: tl.constexpr, FLATTEN: tl.constexpr, ASM: tl.constexpr):
    # x_ptr / w_ptr: TMA descriptors of x [n, H] and w [V, H] when TMA; e_ptr one of e [n, V] (blocks of half a
    # tile's columns) when E_DESC: a pointer tensor of the whole tile would not fit in the registers next to
    # the accumulator (ptxas spilled kilobytes per thread). A program computes the output tiles pid, pid + P,
    # ... (P programs: one per tile, or persistent). Row blocks vary fastest: the programs that run together
    # share one W tile, and the chunk's X stays in L2.
    n_m = tl.cdiv(n_rows, BM)
    for pid in tl.range(tl.program_id(0), n_m * n_tiles, tl.num_programs(0), flatten=FLATTEN):
        t = pid // n_m
        r0 = (pid % n_m) * BM
        rows = r0 + tl.arange(0, BM)
        cols = t * BN + tl.arange(0, BN)
        row_ok = rows < n_rows
        col_ok = cols < V
        rows64 = rows.to(tl.int64)
        ks = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, H, BK):
            if TMA:
                a = x_ptr.load([r0, k0])
                b = w_ptr.load([t * BN, k0])
            else:
                k_ok = ((k0 + ks) < H) | EVEN_K
                a = tl.load(x_ptr + rows64[:, None] * H + (k0 + ks)[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_ptr + cols.to(tl.int64)[:, None] * H + (k0 + ks)[None, :],
                            mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc += fm.dot(a, tl.trans(b), PRECISION, ASM)  # as the JAX twin writes it: one IR

        r = acc
        if HAS_BIAS:
            r = r + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        z, _t = logit_transform(r, softcap, temperature, HAS_SOFTCAP, HAS_TEMP, ASM)
        # Per-element work that changes no value is skipped where it can be: the column mask in every tile but
        # a partial last one, the target's column where no row of the block has its target in the tile.
        partial = (t + 1) * BN > V
        if partial:
            z = tl.where(col_ok[None, :], z, float("-inf"))
        m_t = tl.max(z, axis=1)
        y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
        y = tl.where((y >= 0) & (y < V), y, 0)  # `fce_core.rows.safe_targets` here: no torch ops on the host
        part = rows64 * n_tiles + t
        tl.store(m_ptr + part, m_t, mask=row_ok)
        # z's own reductions before e exists: z and e live together only where the head needs z - m_t
        tl.store(arg_ptr + part, tl.min(tl.where(z == m_t[:, None], cols[None, :], 2147483647), axis=1),
                 mask=row_ok)
        zy_t = tl.full([BM], float("-inf"), tl.float32)
        if tl.max(((y >= t * BN) & (y < t * BN + BN)).to(tl.int32), axis=0) > 0:
            zy_t = tl.max(tl.where(cols[None, :] == y[:, None], z, float("-inf")), axis=1)
        tl.store(zy_ptr + part, zy_t, mask=row_ok)
        # e and the sums a half tile at a time: with q or pz, z, e and z - m_t of the whole tile did not fit in
        # the registers beside each other (sm_90a: 176 bytes spilled per thread with q and pz, 0 by halves);
        # each sum's last pair is the halves' trees
        z_l, z_r = column_halves(z)
        s_l, q_l, pz_l = _half_sums(z_l, m_t, t * BN, V, cw_ptr, partial, e_ptr, r0, rows64, row_ok, stride_e,
                                    HAS_Q, HAS_PZ, HAS_CW, STORE, E_DESC, E_DT, BM, BN // 2, LOG2_BN - 1, ASM)
        s_r, q_r, pz_r = _half_sums(z_r, m_t, t * BN + BN // 2, V, cw_ptr, partial, e_ptr, r0, rows64, row_ok,
                                    stride_e, HAS_Q, HAS_PZ, HAS_CW, STORE, E_DESC, E_DT, BM, BN // 2, LOG2_BN - 1,
                                    ASM)
        tl.store(s_ptr + part, s_l + s_r, mask=row_ok)
        if HAS_Q:
            tl.store(q_ptr + part, q_l + q_r, mask=row_ok)
        if HAS_PZ:
            tl.store(pz_ptr + part, pz_l + pz_r, mask=row_ok)


@triton.jit
def _half_sums(z, m_t, c0, V, cw_ptr, partial, e_ptr, r0, rows64, row_ok, stride_e, HAS_Q: tl.constexpr,
               HAS_PZ: tl.constexpr, HAS_CW: tl.constexpr, STORE: tl.constexpr, E_DESC: tl.constexpr,
               E_DT: tl.constexpr, BM: tl.constexpr, W: tl.constexpr, LOG2_W: tl.constexpr, ASM: tl.constexpr):
    """s, q and pz (s where not asked for) of the W columns c0 .. c0 + W of a tile, given their z (-inf past V)
    and the tile's maxima, and its e stored: the kernel's arithmetic on part of the columns."""
    cols = c0 + tl.arange(0, W)
    d = z - m_t[:, None]
    e = fm.ex2(d * LOG2E, ASM)
    s = row_sum(e, BM, W, LOG2_W, ASM)
    if STORE:
        e16 = fm.to_dtype(e, E_DT, ASM)
        if E_DESC:
            e_ptr.store([r0, c0], e16)
        else:
            tl.store(e_ptr + rows64[:, None] * stride_e + cols[None, :], e16,
                     mask=row_ok[:, None] & (cols < V)[None, :])
    if partial:
        d = tl.where((cols < V)[None, :], d, 0.0)
    q = s
    pz = s
    if HAS_Q:
        d_w = d
        if HAS_CW:
            d_w = fm.mul(tl.load(cw_ptr + cols, mask=cols < V, other=0.0)[None, :], d, ASM)
        q = row_sum(d_w, BM, W, LOG2_W, ASM)
    if HAS_PZ:
        pz = row_sum(fm.mul(e, d, ASM), BM, W, LOG2_W, ASM)
    return s, q, pz


@triton.jit
def _max_nan(a, b):
    """The max that torch.amax takes: NaN wins (tl.maximum's default returns the other operand)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_max_nan(v):
    """`_max_nan` over v's rows by the built-in reductions: the interpreter runs a reduction with a jit combine
    one Python call per element (the CPU tests' merges took 7x as long)."""
    return tl.where(tl.max((v != v).to(tl.int32), axis=1) > 0, float("nan"), tl.max(v, axis=1))


@triton.jit
def _block_sum(sums, units, ok, block, BR: tl.constexpr, BT: tl.constexpr, LOG2_BT: tl.constexpr,
               NB: tl.constexpr, ASM: tl.constexpr):
    """sums [BR, NB] with column `block` set to the tree sum of the block's units [BR, BT] (+0 where not ok)."""
    total = row_sum(tl.where(ok, units, 0.0), BR, BT, LOG2_BT, ASM)
    return tl.where(tl.arange(0, NB)[None, :] == block, total[:, None], sums)


@launched
@triton.jit
def _merge_tiles_kernel(m_ptr, s_ptr, q_ptr, pz_ptr, amax_ptr, zyt_ptr, wt_ptr, big_ptr, zy_ptr, arg_ptr, ss_ptr,
                        sq_ptr, spz_ptr, n_rows, n_tiles, V, ZY_TILES: tl.constexpr, HAS_Q: tl.constexpr,
                        HAS_PZ: tl.constexpr, HAS_CW: tl.constexpr, TILE_N: tl.constexpr, BR: tl.constexpr,
                        BT: tl.constexpr, LOG2_BT: tl.constexpr, NB: tl.constexpr, LOG2_NB: tl.constexpr,
                        ASM: tl.constexpr):
    # A program takes BR rows through all their tiles twice: their max (and z_y's, ZY_TILES), then the units,
    # their sums and the first tile holding the max. One launch instead of eight torch ops around a per-tile
    # kernel and a pairwise_sum launch per unit. The sums are `pairwise_sum`'s tree over the T tiles: the tree
    # of each aligned block of BT (a power of two, at most T's), then the tree of the NB block sums, which
    # start as the padding's +0.
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < n_rows
    base = rows.to(tl.int64)[:, None] * n_tiles
    # The maxima and the first tile are taken lane-wise over the blocks, then reduced once: a reduction
    # accumulated in the loop failed Triton 3.6's thread-locality pass on sm_90 (T a multiple of 16).
    big_l = tl.full([BR, BT], float("-inf"), tl.float32)
    zy_l = tl.full([BR, BT], float("-inf"), tl.float32)
    for t0 in range(0, n_tiles, BT):
        tiles = t0 + tl.arange(0, BT)
        ok = row_ok[:, None] & (tiles < n_tiles)[None, :]
        big_l = _max_nan(big_l, tl.load(m_ptr + base + tiles[None, :], mask=ok, other=float("-inf")))
        if ZY_TILES:
            zy_l = _max_nan(zy_l, tl.load(zyt_ptr + base + tiles[None, :], mask=ok, other=float("-inf")))
    big = _row_max_nan(big_l)
    if ZY_TILES:
        zy = _row_max_nan(zy_l)
        tl.store(zy_ptr + rows, zy, mask=row_ok)
    else:
        zy = tl.load(zy_ptr + rows, mask=row_ok, other=0.0)
    first_l = tl.full([BR, BT], n_tiles, tl.int32)
    sums_s = tl.zeros([BR, NB], tl.float32)
    sums_q = tl.zeros([BR, NB], tl.float32)
    sums_pz = tl.zeros([BR, NB], tl.float32)
    for t0 in range(0, n_tiles, BT):
        tiles = t0 + tl.arange(0, BT)
        ok = row_ok[:, None] & (tiles < n_tiles)[None, :]
        at = base + tiles[None, :]
        block = t0 // BT
        m_t = tl.load(m_ptr + at, mask=ok, other=0.0)
        s_t = tl.load(s_ptr + at, mask=ok, other=0.0)
        first_l = tl.minimum(first_l, tl.where(ok & (m_t == big[:, None]), tiles[None, :], n_tiles))
        shift = m_t - big[:, None]
        f = fm.ex2(shift * LOG2E, ASM)
        sums_s = _block_sum(sums_s, fm.mul(s_t, f, ASM), ok, block, BR, BT, LOG2_BT, NB, ASM)
        if HAS_PZ:
            pz_t = tl.load(pz_ptr + at, mask=ok, other=0.0)
            sums_pz = _block_sum(sums_pz, fm.mul(fm.fma(shift, s_t, pz_t, ASM), f, ASM), ok, block, BR, BT,
                                 LOG2_BT, NB, ASM)
        if HAS_Q:
            if HAS_CW:
                w_t = tl.load(wt_ptr + tiles, mask=tiles < n_tiles, other=0.0)
            else:  # the tile's column count
                w_t = tl.minimum(V - tiles * TILE_N, TILE_N).to(tl.float32)
            sums_q = _block_sum(sums_q, fm.fma(m_t - zy[:, None], w_t[None, :],
                                               tl.load(q_ptr + at, mask=ok, other=0.0), ASM), ok, block, BR, BT,
                                LOG2_BT, NB, ASM)
    tl.store(ss_ptr + rows, row_sum(sums_s, BR, NB, LOG2_NB, ASM), mask=row_ok)
    if HAS_Q:
        tl.store(sq_ptr + rows, row_sum(sums_q, BR, NB, LOG2_NB, ASM), mask=row_ok)
    if HAS_PZ:
        tl.store(spz_ptr + rows, row_sum(sums_pz, BR, NB, LOG2_NB, ASM), mask=row_ok)
    first = tl.min(first_l, axis=1)
    first = tl.where(first < n_tiles, first, 0)  # no tile equals a NaN max: the first, as argmax of none
    tl.store(big_ptr + rows, big, mask=row_ok)
    tl.store(arg_ptr + rows, tl.load(amax_ptr + rows.to(tl.int64) * n_tiles + first, mask=row_ok, other=0),
             mask=row_ok)


def gemm_config(cfg=None, rows=None):
    """The logits GEMM's tiles: `cfg`, else the GPU's (its launch for a chunk of at most SHORT_ROWS `rows`), or
    the interpreter's small ones."""
    if cfg is not None:
        return cfg
    if not fm.ASM:
        return GEMM_INTERPRETER
    return GEMM_SHORT if short(rows) else GEMM


def partials(x, n_tiles, spec):
    """New [rows of x, n_tiles] arrays for the logits GEMM's partials {m, s, amax, zy[, q][, pz]} (what `spec`
    asks for): float32, amax int32."""
    return {k: x.new_empty((x.shape[0], n_tiles), dtype=torch.int32 if k == "amax" else F32)
            for k, on in (("m", 1), ("s", 1), ("amax", 1), ("zy", 1), ("q", spec.q), ("pz", spec.pz)) if on}


def logit_tiles(x, w, bias, y, class_weights, *, spec, transform, precision, out=None, store=True, cfg=None):
    """The fused logits GEMM of the rows x [n, H] against w [V, H]. `y` [n]: the targets, read as 0 where
    outside [0, V) (`fce_core.rows.safe_targets`, in the kernel: torch's ops would cost the host). Writes the
    exp-scaled tile values into `out` (or a new [n, V] array in x's dtype; neither without `store`) and returns
    (that array or None, the [n, T] partials {m, s, amax, zy[, q][, pz]} of the T = ceil(V / tile_n) tiles).
    Without `cfg`, a chunk of more than SHORT_ROWS rows runs on the ping-pong kernel where it applies
    (logit_tiles_gluon.py: sm_90, 16-bit operands, raw logits; the same bits)."""
    n, hidden = x.shape
    pingpong = cfg is None and not short(n)
    cfg = gemm_config(cfg, n)
    V = w.shape[0]
    n_tiles = cdiv(V, cfg.tile_n)
    e = out if out is not None else x.new_empty((n, V)) if store else None
    parts = partials(x, n_tiles, spec)
    if n == 0:
        return e, parts
    if pingpong and logit_tiles_gluon.applies(x, w, e, bias, transform):
        logit_tiles_gluon.logit_tiles_pp(x, w, y, class_weights, e, parts, spec=spec, tile_n=cfg.tile_n)
        return e, parts
    m = parts["m"]
    (xa, wa), tma = descriptors([(x, (cfg.tile_m, cfg.tile_k)), (w, (cfg.tile_n, cfg.tile_k))], cfg)
    (ea,), e_desc = descriptors([(e, (cfg.tile_m, cfg.tile_n // 2))], cfg) if e is not None else ([x], False)
    _logit_tiles_kernel[(programs(cdiv(n, cfg.tile_m) * n_tiles, cfg, x.device),)](
        xa, wa, bias if bias is not None else x, y, class_weights if class_weights is not None else m,
        ea, 0 if e is None else e.stride(0), m, parts["s"], parts["amax"], parts["zy"],
        parts.get("q", m), parts.get("pz", m), n, V, hidden, n_tiles, float(transform.softcap or 1.0),
        float(transform.temperature), HAS_BIAS=bias is not None, HAS_SOFTCAP=transform.softcap is not None,
        HAS_TEMP=transform.has_temperature, HAS_CW=class_weights is not None, HAS_Q=spec.q, HAS_PZ=spec.pz,
        STORE=e is not None, PRECISION=precision, BM=cfg.tile_m, BN=cfg.tile_n, BK=cfg.tile_k,
        LOG2_BN=cfg.tile_n.bit_length() - 1, EVEN_K=hidden % cfg.tile_k == 0, TMA=tma,
        E_DESC=e_desc, E_DT=ELEMENT_TYPES[(x if e is None else e).dtype],
        FLATTEN=cfg.persistent and cfg.flatten, ASM=fm.ASM,
        num_warps=cfg.num_warps, num_stages=stages(cfg, x.element_size()))
    return e, parts


def merge_tiles(parts, vocab, tile_weights=None, cfg=None, zy=None):
    """The rows' statistics {m, s, zy, amax[, q][, pz]} ([n] each, as `row_stats` + `pairwise_sum` give them)
    from the [n, T] partials of `logit_tiles`: the max over tiles; the first tile holding it gives the argmax;
    s (and pz) rescaled to the row max and q shifted to z_y by the tile's class weight sum (`tile_weights`
    [T], `fce_core.rows.tile_weights`; without class weights its column count), then summed over the tiles by
    `pairwise_sum`'s tree, in the same launch. `zy`: the rows' target logits where another shard may hold them
    (vocab-parallel: the owner's), else the max of the tiles' (the one tile holding the target)."""
    tile_n = gemm_config(cfg).tile_n
    m_t = parts["m"]
    n, n_tiles = m_t.shape
    stats = {"m": m_t.new_empty(n), "zy": m_t.new_empty(n) if zy is None else zy,
             "amax": parts["amax"].new_empty(n), **{k: m_t.new_empty(n) for k in ("s", "q", "pz") if k in parts}}
    # The interpreter pays per program: 64 rows a program there, and 16 tiles a block, so that the CPU tests
    # loop over blocks.
    rows, block = (MERGE_ROWS.block, 128) if fm.ASM else (64, 16)
    block = min(block, triton.next_power_of_2(n_tiles))
    n_blocks = triton.next_power_of_2(cdiv(n_tiles, block))
    if n:
        _merge_tiles_kernel[(cdiv(n, rows),)](
            m_t, parts["s"], parts.get("q", m_t), parts.get("pz", m_t), parts["amax"], parts["zy"],
            tile_weights if tile_weights is not None else m_t, stats["m"], stats["zy"], stats["amax"], stats["s"],
            stats.get("q", m_t), stats.get("pz", m_t), n, n_tiles, vocab, ZY_TILES=zy is None, HAS_Q="q" in parts,
            HAS_PZ="pz" in parts, HAS_CW=tile_weights is not None, TILE_N=tile_n, BR=rows, BT=block,
            LOG2_BT=block.bit_length() - 1, NB=n_blocks, LOG2_NB=n_blocks.bit_length() - 1, ASM=fm.ASM,
            num_warps=MERGE_ROWS.num_warps)
    return stats

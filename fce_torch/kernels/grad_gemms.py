"""The fused engine's gradient GEMMs, in Triton: dX = dZ W and dW (+)= dZᵀ X with float32 accumulation, K
ascending and never split, so both twins give the same bits whatever the tiles (docs/NUMERICS.md, "The
fused engine"). dW over several chunks is accumulated either in float32 or, for a bfloat16 weight, as a pair
(hi, lo) of a bfloat16 [V, H] and an int8 [V, H] array (`fastmath.pair_split`): hi = rne(s), lo the rest of s
in units of 2**8 of its float32 bit pattern, after each chunk's s = (hi + lo) + dZᵀ X. hi is then the rounded
result, so no float32 [V, H] buffer and no final conversion exist, and the pair costs 3 bytes per weight element
where float32 costs 4: each chunk reads and writes less, and the planner gives the byte it saves to larger chunks
(`fce_core.plan.fused_rows`). Each step rounds s to 16 significant bits (2**-16 relative error at most, 2**-15
where lo is clipped), far below the final rounding, by integer adds and shifts alone (docs/NUMERICS.md, "dX and
dW"). Twin: fce_jax/kernels/grad_gemms.py.
"""
import torch
import triton
import triton.language as tl

from fce_core.config import (GLUON_GRADS, GRAD_GEMM_GLUON, GRAD_GEMM_INTERPRETER_TORCH, GRAD_GEMM_TORCH,
                             GRAD_GEMM_TORCH_ON_LOAD, GRAD_GEMM_TORCH_TALL, GradGemmConfig, SplitTileGradConfig)
from fce_core.heads import TileValues
from fce_core.plan import ADD, PAIR, PAIR_LAST, WRITE, cdiv, dx_slices, gemm_items, rows_fast, waves

from . import fastmath as fm
from . import grad_gemms_gluon
from .dlogits import row_coefficients
from .launch import launched
from .tile_dlogits import dz_on_load
from .tma import ELEMENT_TYPES, column_halves, descriptors, processors, programs, stages, tile_origin
from ..sums import pairwise_sum

F32 = torch.float32


@triton.jit
def _c_load(c_ptr, r0, c0, s_cm, M, N, BM: tl.constexpr, BN: tl.constexpr, DESC: tl.constexpr):
    """The [BM, BN] block of the 2-D C at (r0, c0), zeros past its end (a descriptor's load reads zeros there)."""
    if DESC:
        v = c_ptr.load([r0, c0])
    else:
        rows = r0 + tl.arange(0, BM)
        cols = c0 + tl.arange(0, BN)
        v = tl.load(c_ptr + rows.to(tl.int64)[:, None] * s_cm + cols[None, :],
                    mask=(rows < M)[:, None] & (cols < N)[None, :], other=0.0)
    return v


@triton.jit
def _c_store(c_ptr, plane, r0, c0, v, s_cm, M, N, DESC: tl.constexpr, PLANES: tl.constexpr):
    """v into C's block at (r0, c0) of its plane `plane` (C [n_slices, M, N] when PLANES), clipped at C's end."""
    BM: tl.constexpr = v.shape[0]
    BN: tl.constexpr = v.shape[1]
    if DESC:
        if PLANES:
            c_ptr.store([plane, r0, c0], v.reshape([1, BM, BN]))
        else:
            c_ptr.store([r0, c0], v)
    else:
        rows = r0 + tl.arange(0, BM)
        cols = c0 + tl.arange(0, BN)
        tl.store(c_ptr + plane.to(tl.int64) * M * N + rows.to(tl.int64)[:, None] * s_cm + cols[None, :], v,
                 mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _epilogue(c_ptr, lo_ptr, plane, r0, c0, acc, s_cm, M, N, MODE: tl.constexpr, FIRST: tl.constexpr,
              C_DT: tl.constexpr, DESC: tl.constexpr, PLANES: tl.constexpr, ASM: tl.constexpr):
    """C's block at (r0, c0) from the float32 product `acc`: WRITE, ADD, the (hi, lo) PAIR update, or PAIR_LAST
    (hi alone)."""
    BM: tl.constexpr = acc.shape[0]
    BN: tl.constexpr = acc.shape[1]
    if MODE == 0:
        _c_store(c_ptr, plane, r0, c0, fm.to_dtype(acc, C_DT, ASM), s_cm, M, N, DESC, PLANES)
    elif MODE == 1:
        _c_store(c_ptr, plane, r0, c0, _c_load(c_ptr, r0, c0, s_cm, M, N, BM, BN, DESC) + acc, s_cm, M, N, DESC,
                 False)
    else:
        s = acc
        if not FIRST:
            s = fm.pair_value(_c_load(c_ptr, r0, c0, s_cm, M, N, BM, BN, DESC),
                              _c_load(lo_ptr, r0, c0, s_cm, M, N, BM, BN, DESC)) + acc
        hi, lo = fm.pair_split(s, C_DT, ASM)
        _c_store(c_ptr, plane, r0, c0, hi, s_cm, M, N, DESC, False)
        if MODE == 2:
            _c_store(lo_ptr, plane, r0, c0, lo, s_cm, M, N, DESC, False)


@launched
@triton.jit
def _gemm_kernel(a_ptr, s_am, s_ak, b_ptr, s_bk, s_bn, c_ptr, lo_ptr, s_cm, M, N, K, SLICE_K, n_slices,
                 mt_ptr, y_ptr, lse_ptr, ca_ptr, cb_ptr, cc_ptr, dz_rows, V, n_tiles,
                 MODE: tl.constexpr, FIRST: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, A_T: tl.constexpr,
                 C_DESC: tl.constexpr, C_DT: tl.constexpr, PLANES: tl.constexpr,
                 ROWS_FAST: tl.constexpr, FLATTEN: tl.constexpr, SLICED: tl.constexpr,
                 ON_LOAD: tl.constexpr, TILE_N: tl.constexpr, ASM: tl.constexpr):
    # a_ptr / b_ptr: TMA descriptors when TMA, of A [M, K] (of Aᵀ [K, M] when A_T) and B [K, N]; c_ptr / lo_ptr
    # when C_DESC (of C [n_slices, M, N] when PLANES). A program computes the (tile, slice) items pid, pid + P,
    # ... (P programs: one per item, or persistent); an item is its slice's K range [k_lo, k_hi) into the
    # slice's [M, N] plane of C; tiles walk rows or columns fastest as `fce_core.plan.rows_fast` says. The
    # epilogue runs on the tile's two column halves: a pointer tensor of the whole tile would not fit in the
    # registers next to the accumulator (ptxas spilled kilobytes per thread), nor would a descriptor store's
    # staging of a float32 tile fit in shared memory next to the pipeline. ON_LOAD: A's blocks are tile values
    # (dz_rows rows, V columns, n_tiles tiles; mt_ptr .. cc_ptr as `TileValues.arrays`), turned into dZ in
    # registers before their product: A = dZ's rows (dX) or, with A_T, its columns (dW), each block in one tile.
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    n_out = n_m * n_n
    for pid in tl.range(tl.program_id(0), n_out * n_slices, tl.num_programs(0), flatten=FLATTEN):
        tile = pid % n_out
        k_lo = 0
        k_hi = K
        if SLICED:  # bounds that vary by item keep Triton from pipelining the two loops as one (FLATTEN)
            k_lo = (pid // n_out) * SLICE_K
            k_hi = tl.minimum(K, k_lo + SLICE_K)
        r0, c0 = tile_origin(tile, n_m, n_n, BM, BN, ROWS_FAST)
        rows64 = (r0 + tl.arange(0, BM)).to(tl.int64)
        cols = c0 + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        if ON_LOAD and not A_T:  # dZ's rows are the tile's: their coefficients once per tile
            z_rows = r0 + tl.arange(0, BM)
            y, lse, ca, cb, cc, live = row_coefficients(y_ptr, lse_ptr, ca_ptr, cb_ptr, cc_ptr, z_rows,
                                                        z_rows < dz_rows)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            if TMA:  # a slice's K range is whole tile_k steps: a load past k_hi is past K, zeros
                if A_T:
                    a = a_ptr.load([k0, r0])
                else:
                    a = a_ptr.load([r0, k0])
                b = b_ptr.load([k0, c0])
            else:
                k = k0 + ks
                k_ok = (k < k_hi) | EVEN_K
                k64 = k.to(tl.int64)
                if A_T:  # dZᵀ's block as dZ's [BK, BM]
                    a = tl.load(a_ptr + k64[:, None] * s_ak + rows64[None, :] * s_am,
                                mask=k_ok[:, None] & (rows64 < M)[None, :], other=0.0)
                else:
                    a = tl.load(a_ptr + rows64[:, None] * s_am + k64[None, :] * s_ak,
                                mask=(rows64 < M)[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptr + k64[:, None] * s_bk + cols[None, :] * s_bn,
                            mask=k_ok[:, None] & (cols < N)[None, :], other=0.0)
            if ON_LOAD:
                if A_T:  # dZ's rows are this step's K: their coefficients here
                    z_rows = k0 + ks
                    y, lse, ca, cb, cc, live = row_coefficients(y_ptr, lse_ptr, ca_ptr, cb_ptr, cc_ptr, z_rows,
                                                                z_rows < dz_rows)
                    a = dz_on_load(a, mt_ptr, z_rows, r0, n_tiles, y, lse, ca, cb, cc, live, V, TILE_N, ASM)
                else:
                    a = dz_on_load(a, mt_ptr, z_rows, k0, n_tiles, y, lse, ca, cb, cc, live, V, TILE_N, ASM)
            if A_T:
                a = tl.trans(a)
            acc += fm.dot(a, b, PRECISION, ASM)
        plane = pid // n_out
        left, right = column_halves(acc)
        _epilogue(c_ptr, lo_ptr, plane, r0, c0, left, s_cm, M, N, MODE, FIRST, C_DT, C_DESC, PLANES, ASM)
        _epilogue(c_ptr, lo_ptr, plane, r0, c0 + BN // 2, right, s_cm, M, N, MODE, FIRST, C_DT, C_DESC, PLANES,
                  ASM)


def _config():
    return GRAD_GEMM_TORCH if fm.ASM else GRAD_GEMM_INTERPRETER_TORCH


def dz_on_load_enabled():
    """`GradGemmConfig.dz_on_load` of the GPU's or the interpreter's launch: whether the fused engine hands these
    GEMMs `TileValues` where `fce_core.heads.forms_dz_on_load` allows."""
    return _config().dz_on_load


def _tall_where(cost, dz=None):
    """GRAD_GEMM_TORCH (128x256 tiles), or GRAD_GEMM_TORCH_TALL (256x128) where `cost(config)` is lower; for dZ
    formed on the load (`dz` is `TileValues`) GRAD_GEMM_TORCH_ON_LOAD; the interpreter's tiles off the GPU."""
    if not fm.ASM:
        return GRAD_GEMM_INTERPRETER_TORCH
    if isinstance(dz, TileValues):
        return GRAD_GEMM_TORCH_ON_LOAD
    return GRAD_GEMM_TORCH_TALL if cost(GRAD_GEMM_TORCH_TALL) < cost(GRAD_GEMM_TORCH) else GRAD_GEMM_TORCH


def _dx_config(n, hidden, slices, device, dz=None):
    """dX's launch: the tiles that take fewer rounds of the multiprocessors (H = 640: 3 column tiles of 256
    make 144 items at 1024 rows, two rounds of 132 programs, the second nearly empty; 256x128 makes 120). The
    slices are the same (NUMERICS fields)."""
    sms = processors(device)
    return _tall_where(lambda c: waves(n, hidden, slices, c.tile_m, c.tile_n, sms), dz)


def flattened(cfg, mode):
    """Whether the launch pipelines its tile and K loops as one (`cfg.flatten`, persistent). ADD is not
    flattened: its float32 C tile, staged in shared memory, would not fit next to the pipeline (sm_90a: 279 KB
    of 227 for 16-bit operands)."""
    return cfg.persistent and cfg.flatten and mode != ADD


def _slice_k(k, slices, cfg):
    """The K of each of `slices` slices (the last one's up to K): whole K steps of cfg, the Triton launch."""
    return cdiv(cdiv(k, slices), cfg.tile_k) * cfg.tile_k


def _run(a, a_t, b, c, lo, m, n, k, mode, first=False, precision="ieee", slices=1, cfg=None):
    """C (or its `slices` [m, n] planes, one per slice of K: C [slices, m, n]) = A @ B with the epilogue
    `mode`: A [m, k] is `a`'s first m rows, or `a`ᵀ when `a_t` (`a`'s first k rows); B [k, n] is `b`'s first k
    rows; all with unit column strides, C's rows contiguous. The operands are cut to those rows (views): a
    descriptor's loads take whole tiles, bounded by its array, and the rows past them may hold no values (a
    kept dZ's rows that did not run). `a` may be `TileValues`: dZ formed on the load, each A block then inside
    one of its tiles."""
    cfg = cfg or _config()
    if m == 0 or n == 0:
        return
    formed = isinstance(a, TileValues)
    if formed:
        if a.tile_n % (cfg.tile_m if a_t else cfg.tile_k):
            raise ValueError(f"dZ formed on the load needs A's blocks inside the tiles of {a.tile_n} columns")
        values = (*a.arrays(), k if a_t else m, a.shape[1], a.m_tiles.shape[1])  # no dZ past A's cut rows
        tile_n, a = a.tile_n, a.e
    else:
        values, tile_n = (b,) * 6 + (0, 0, 0), 1
    a, b = a[:k] if a_t else a[:m], b[:k]
    slice_k = _slice_k(k, slices, cfg)
    a_block = (cfg.tile_k, cfg.tile_m) if a_t else (cfg.tile_m, cfg.tile_k)
    (aa, bb), tma = descriptors([(a, a_block), (b, (cfg.tile_k, cfg.tile_n))], cfg)
    outs = [c] if lo is None else [c, lo]
    half = (1,) * (c.dim() - 2) + (cfg.tile_m, cfg.tile_n // 2)  # the epilogue's column halves of a tile
    outs, c_desc = descriptors([(o, half) for o in outs], cfg)
    a_strides = (1, a.stride(0)) if a_t else (a.stride(0), 1)
    _gemm_kernel[(programs(gemm_items(m, n, slices, cfg.tile_m, cfg.tile_n), cfg, a.device),)](
        aa, *a_strides, bb, b.stride(0), 1, outs[0], outs[-1], n, m, n, k, slice_k, slices, *values, MODE=mode,
        FIRST=first, PRECISION=precision, BM=cfg.tile_m, BN=cfg.tile_n, BK=cfg.tile_k, EVEN_K=k % cfg.tile_k == 0,
        TMA=tma, A_T=a_t, C_DESC=c_desc, C_DT=ELEMENT_TYPES[c.dtype],
        PLANES=c.dim() == 3, ROWS_FAST=rows_fast(m, n, cfg.tile_m, cfg.tile_n),
        FLATTEN=flattened(cfg, mode), SLICED=slices > 1, ON_LOAD=formed, TILE_N=tile_n, ASM=fm.ASM,
        num_warps=cfg.num_warps,
        num_stages=stages(cfg, a.element_size()))


def _gluon(cfg, gemm, applies):
    """The Gluon kernel's launch (grad_gemms_gluon.py) for `gemm` (a name of GLUON_GRADS): cfg where it is one,
    GRAD_GEMM_GLUON where no launch is given, GLUON_GRADS names it and `applies()`; else None, the Triton kernel."""
    if isinstance(cfg, SplitTileGradConfig):
        return cfg
    return GRAD_GEMM_GLUON if cfg is None and gemm in GLUON_GRADS and applies() else None


def dx_gemm(dz, w, out, precision="ieee", cfg=None, rows=None):
    """out [n, H] (contiguous) = dZ [n, V] @ w [V, H], rounded once to out's dtype; over
    `fce_core.plan.dx_slices` slices of V, their float32 planes summed by `pairwise_sum` straight into out,
    when that is more than one. `rows`: only dZ's first `rows` rows count (the others did not run and are
    not read), so the product runs over those and out's other rows are 0; the slices are still those of all n
    rows, so a row's bits are the same. On the Gluon kernel where `cfg` is its launch, or where none is given,
    GLUON_GRADS names dX and the kernel applies (grad_gemms_gluon.py: the same slices, the same bits)."""
    (n, vocab), hidden = dz.shape, w.shape[1]
    triton_cfg = cfg if isinstance(cfg, GradGemmConfig) else _config()
    slices = dx_slices(n, hidden, vocab, triton_cfg)
    m = n if rows is None else rows
    gluon = _gluon(cfg, "dx", lambda: m > 0 and grad_gemms_gluon.applies(dz[:m], w, out, vocab, WRITE))
    plane_rows = m if gluon is None else grad_gemms_gluon.plane_rows(m, gluon)
    planes = out[:m] if slices == 1 else torch.empty(slices, plane_rows, hidden, device=dz.device, dtype=F32)
    if gluon is not None:
        grad_gemms_gluon.dx_planes(dz[:m], w, planes, slices, _slice_k(vocab, slices, triton_cfg), gluon)
    else:
        _run(dz, False, w, planes, None, m, hidden, vocab, WRITE, precision=precision, slices=slices,
             cfg=cfg or _dx_config(m, hidden, slices, dz.device, dz))
    if slices > 1:
        pairwise_sum(planes[:, :m].permute(1, 2, 0), out=out[:m])
    if m < n:
        out[m:].zero_()
    return out


def _dw_config(hidden, dz=None):
    """dW's launch: the tiles whose columns pad H less (H = 640: 3 column tiles of 256, the last half empty,
    against 5 of 128; the (hi, lo) accumulation of 512 rows 0.94 -> 0.88 ms, at H = 896 0.79 -> 0.76,
    bench/results/nvidia-h200/two-programs-per-sm/). Speed only: the tiles do not touch the bits."""
    return _tall_where(lambda c: -(-hidden // c.tile_n) * c.tile_n - hidden, dz)


def _dz_t_x(dz, x, c, lo, mode, first=False, precision="ieee", cfg=None, rows=None):
    """C = dZᵀ @ x (dZ [n, V] read transposed through its strides, x [n, H]) with the epilogue `mode`, K the
    first `rows` rows (default all). On the Gluon kernel where `cfg` is its launch, or where none is given,
    GLUON_GRADS names this GEMM and the kernel applies (grad_gemms_gluon.py: the same bits)."""
    k = dz.shape[0] if rows is None else rows
    gluon = _gluon(cfg, "dw" if lo is None else "pair",
                   lambda: grad_gemms_gluon.applies(dz[:k], x[:k], c, k, mode, lo))
    if gluon is not None:
        grad_gemms_gluon.dw(dz[:k], x[:k], c, lo, mode, first, gluon)
        return
    _run(dz, True, x, c, lo, dz.shape[1], x.shape[1], k, mode, first=first, precision=precision,
         cfg=cfg or _dw_config(x.shape[1], dz))


def dw_gemm(dz, x, dtype, precision="ieee", cfg=None, rows=None):
    """A new [V, H] dZᵀ @ x (dZ [n, V], x [n, H]) rounded once to `dtype`. `rows`: only dZ's first `rows`
    rows count, K leaves the others out (had they run as ignored rows, their zero dZ would add exact zeros: the
    same bits)."""
    out = torch.empty(dz.shape[1], x.shape[1], device=x.device, dtype=dtype)
    _dz_t_x(dz, x, out, None, WRITE, precision=precision, cfg=cfg, rows=rows)
    return out


def dw_accumulate(dz, x, acc, precision="ieee", cfg=None, rows=None, last=False):
    """acc += dZᵀ @ x in place, acc being `dw_first`'s: a float32 [V, H] tensor or a (hi, lo) pair; `rows`
    as in `dw_gemm`. Returns acc; with `last` (no product follows), a pair's hi alone, its lo not written."""
    if not isinstance(acc, tuple):
        _dz_t_x(dz, x, acc, None, ADD, precision=precision, cfg=cfg, rows=rows)
        return acc
    _dz_t_x(dz, x, *acc, PAIR_LAST if last else PAIR, precision=precision, cfg=cfg, rows=rows)
    return acc[0] if last else acc


def accumulates_pair(dtype):
    """Whether dW of a weight of `dtype` is accumulated as a (hi, lo) pair (`dw_first`), which the fused plan
    budgets for (`fce_core.plan.fused_rows`, dw_pair)."""
    return dtype == torch.bfloat16


def dw_first(dz, x, dtype, precision="ieee", cfg=None, rows=None):
    """The first chunk's accumulator: a (hi bfloat16, lo int8) pair for a bfloat16 weight, else float32;
    `rows` as in `dw_gemm`."""
    if not accumulates_pair(dtype):
        return dw_gemm(dz, x, F32, precision, cfg, rows)
    hi = torch.empty(dz.shape[1], x.shape[1], device=x.device, dtype=dtype)
    lo = torch.empty(hi.shape, device=x.device, dtype=torch.int8)
    _dz_t_x(dz, x, hi, lo, PAIR, first=True, precision=precision, cfg=cfg, rows=rows)
    return hi, lo

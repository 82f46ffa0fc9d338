"""The fused engine's gradient GEMMs, in Triton: dX = dZ W and dW (+)= dZᵀ X with float32 accumulation, K
ascending and never split, so both twins give the same bits whatever the tiles (docs/NUMERICS.md, "The
fused engine"). dW over several chunks is accumulated either in float32 or, for a bfloat16 weight, as a pair
of bfloat16 arrays (hi, lo) with hi + lo the running sum: hi = rne(s), lo = rne(s - hi) after each chunk's
s = (hi + lo) + dZᵀ X. hi is then the rounded result, so no float32 [V, H] buffer and no final conversion
exist (the pair has about 16 significant bits: each step adds at most 2**-18 relative error, far below the
final rounding). Twin: fce_jax/kernels/grad_gemms.py.
"""
import torch
import triton
import triton.language as tl

from fce_core.config import GRAD_GEMM_INTERPRETER_TORCH, GRAD_GEMM_TORCH, GRAD_GEMM_TORCH_TALL
from fce_core.plan import dx_slices, gemm_items, rows_fast, waves

from . import fastmath as fm
from .tma import descriptors, processors, programs, stages
from ..sums import pairwise_sum

F32 = torch.float32
WRITE, ADD, PAIR = 0, 1, 2  # the epilogues: C = acc in C's dtype; C (float32) += acc; the (hi, lo) pair


@triton.jit
def _gemm_kernel(a_ptr, s_am, s_ak, b_ptr, s_bk, s_bn, c_ptr, lo_ptr, s_cm, M, N, K, SLICE_K, n_slices,
                 MODE: tl.constexpr, FIRST: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, A_T: tl.constexpr,
                 ROWS_FAST: tl.constexpr, FLATTEN: tl.constexpr, ASM: tl.constexpr):
    # a_ptr / b_ptr: TMA descriptors when TMA, of A [M, K] (of Aᵀ [K, M] when A_T) and B [K, N]. A program
    # computes the (tile, slice) items pid, pid + P, ... (P programs: one per item, or persistent); an item is
    # its slice's K range [k_lo, k_hi) into the slice's [M, N] plane of C; tiles walk rows or columns
    # fastest as `fce_core.plan.rows_fast` says.
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    n_out = n_m * n_n
    for pid in tl.range(tl.program_id(0), n_out * n_slices, tl.num_programs(0), flatten=FLATTEN):
        tile = pid % n_out
        k_lo = (pid // n_out) * SLICE_K
        k_hi = tl.minimum(K, k_lo + SLICE_K)
        plane = (pid // n_out).to(tl.int64) * M * N
        if ROWS_FAST:
            r0 = (tile % n_m) * BM
            c0 = (tile // n_m) * BN
        else:
            r0 = (tile // n_n) * BM
            c0 = (tile % n_n) * BN
        rows = r0 + tl.arange(0, BM)
        cols = c0 + tl.arange(0, BN)
        row_ok = rows < M
        col_ok = cols < N
        rows64 = rows.to(tl.int64)
        ks = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            if TMA:  # a slice's K range is whole tile_k steps: a load past k_hi is past K, zeros
                if A_T:
                    a = tl.trans(a_ptr.load([k0, r0]))
                else:
                    a = a_ptr.load([r0, k0])
                b = b_ptr.load([k0, c0])
            else:
                k = k0 + ks
                k_ok = (k < k_hi) | EVEN_K
                k64 = k.to(tl.int64)
                a = tl.load(a_ptr + rows64[:, None] * s_am + k64[None, :] * s_ak,
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptr + k64[:, None] * s_bk + cols[None, :] * s_bn,
                            mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if not ASM:  # the interpreter's dot would keep raw 16-bit products
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc += tl.dot(a, b, input_precision=PRECISION)
        ptrs = plane + rows64[:, None] * s_cm + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        if MODE == 0:
            tl.store(c_ptr + ptrs, fm.to_dtype(acc, c_ptr.dtype.element_ty, ASM), mask=mask)
        elif MODE == 1:
            tl.store(c_ptr + ptrs, tl.load(c_ptr + ptrs, mask=mask, other=0.0) + acc, mask=mask)
        else:
            s = acc
            if not FIRST:
                s = (tl.load(c_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
                     + tl.load(lo_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)) + acc
            hi = fm.to_dtype(s, c_ptr.dtype.element_ty, ASM)
            tl.store(c_ptr + ptrs, hi, mask=mask)
            tl.store(lo_ptr + ptrs, fm.to_dtype(s - hi.to(tl.float32), lo_ptr.dtype.element_ty, ASM), mask=mask)


def _config():
    return GRAD_GEMM_TORCH if fm.ASM else GRAD_GEMM_INTERPRETER_TORCH


def _dx_config(n, hidden, slices, device):
    """dX's launch: GRAD_GEMM_TORCH's 128x256 tiles, or 256x128 (GRAD_GEMM_TORCH_TALL) where those take fewer
    rounds of the multiprocessors (H = 640: 3 column tiles of 256 make 144 items at 1024 rows, two rounds of
    132 programs, the second nearly empty; 256x128 makes 120). The slices are the same (NUMERICS fields)."""
    if not fm.ASM:
        return GRAD_GEMM_INTERPRETER_TORCH
    sms = processors(device)
    rounds = [waves(n, hidden, slices, c.tile_m, c.tile_n, sms) for c in (GRAD_GEMM_TORCH, GRAD_GEMM_TORCH_TALL)]
    return GRAD_GEMM_TORCH_TALL if rounds[1] < rounds[0] else GRAD_GEMM_TORCH


def _run(a, a_t, b, c, lo, m, n, k, mode, first=False, precision="ieee", slices=1, cfg=None):
    """C (or its `slices` [m, n] planes, one per slice of K) = A @ B with the epilogue `mode`: A [m, k] is
    `a`, or `a`ᵀ when `a_t` (`a` [k, m]); B [k, n] is `b`; all with unit column strides."""
    cfg = cfg or _config()
    if m == 0 or n == 0:
        return
    slice_k = triton.cdiv(triton.cdiv(k, slices), cfg.tile_k) * cfg.tile_k
    a_block = (cfg.tile_k, cfg.tile_m) if a_t else (cfg.tile_m, cfg.tile_k)
    (aa, bb), tma = descriptors([(a, a_block), (b, (cfg.tile_k, cfg.tile_n))], cfg)
    a_strides = (1, a.stride(0)) if a_t else (a.stride(0), 1)
    _gemm_kernel[(programs(gemm_items(m, n, slices, cfg.tile_m, cfg.tile_n), cfg, a.device),)](
        aa, *a_strides, bb, b.stride(0), 1, c, c if lo is None else lo, n, m, n, k, slice_k, slices, MODE=mode,
        FIRST=first, PRECISION=precision, BM=cfg.tile_m, BN=cfg.tile_n, BK=cfg.tile_k, EVEN_K=k % cfg.tile_k == 0,
        TMA=tma, A_T=a_t, ROWS_FAST=rows_fast(m, n, cfg.tile_m, cfg.tile_n),
        FLATTEN=cfg.persistent and cfg.flatten, ASM=fm.ASM, num_warps=cfg.num_warps,
        num_stages=stages(cfg, a.element_size()))


def dx_gemm(dz, w, out, precision="ieee", cfg=None):
    """out [n, H] (contiguous rows) = dZ [n, V] @ w [V, H], rounded once to out's dtype; over
    `fce_core.plan.dx_slices` slices of V, their float32 planes summed by `pairwise_sum`, when that is
    more than one."""
    (n, vocab), hidden = dz.shape, w.shape[1]
    slices = dx_slices(n, hidden, vocab, cfg or _config())
    cfg = cfg or _dx_config(n, hidden, slices, dz.device)
    planes = out if slices == 1 else torch.empty(slices, n, hidden, device=dz.device, dtype=F32)
    _run(dz, False, w, planes, None, n, hidden, vocab, WRITE, precision=precision, slices=slices, cfg=cfg)
    return out if slices == 1 else out.copy_(pairwise_sum(planes.permute(1, 2, 0)))


def _dz_t_x(dz, x, c, lo, mode, first=False, precision="ieee", cfg=None):
    """C = dZᵀ @ x (dZ [n, V] read transposed through its strides, x [n, H]) with the epilogue `mode`."""
    _run(dz, True, x, c, lo, dz.shape[1], x.shape[1], dz.shape[0], mode, first=first, precision=precision,
         cfg=cfg)


def dw_gemm(dz, x, dtype, precision="ieee", cfg=None):
    """A new [V, H] dZᵀ @ x (dZ [n, V], x [n, H]) rounded once to `dtype`."""
    out = torch.empty(dz.shape[1], x.shape[1], device=x.device, dtype=dtype)
    _dz_t_x(dz, x, out, None, WRITE, precision=precision, cfg=cfg)
    return out


def dw_accumulate(dz, x, acc, precision="ieee", cfg=None):
    """acc += dZᵀ @ x in place, acc being `dw_first`'s: a float32 [V, H] tensor or a (hi, lo) pair.
    Returns acc."""
    if isinstance(acc, tuple):
        _dz_t_x(dz, x, *acc, PAIR, precision=precision, cfg=cfg)
    else:
        _dz_t_x(dz, x, acc, None, ADD, precision=precision, cfg=cfg)
    return acc


def dw_first(dz, x, dtype, precision="ieee", cfg=None):
    """The first chunk's accumulator: a (hi, lo) pair for a bfloat16 weight, else float32."""
    if dtype != torch.bfloat16:
        return dw_gemm(dz, x, F32, precision, cfg)
    hi = torch.empty(dz.shape[1], x.shape[1], device=x.device, dtype=dtype)
    lo = torch.empty_like(hi)
    _dz_t_x(dz, x, hi, lo, PAIR, first=True, precision=precision, cfg=cfg)
    return hi, lo

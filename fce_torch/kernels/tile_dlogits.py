"""The fused engine's dZ, in Triton: from the exp-scaled tile values e that `logit_tiles` stored, in place.

p = e * ex2((m_t - lse) log2 e) with the tile's max m_t; then the same terms as `dlogits` (docs/NUMERICS.md,
"Per chunk", step 6). Where a term needs the logit itself (the entropy's z - mu, a softcap's derivative) it is
z = m_t + ln e (exact to e's rounding), except in the target column, which uses the exact z_y. One program
owns one (block of rows, tile) and rewrites it in place. Twin: fce_jax/kernels/tile_dlogits.py.
"""
import triton
import triton.language as tl

from fce_core.config import TILE_ROWS
from fce_core.plan import cdiv

from . import fastmath as fm
from .fastmath import LN2, LOG2E
from .dlogits import row_coefficients
from .launch import launched
from .logit_tiles import gemm_config


@triton.jit
def dz_terms(e, m_t, y, lse, a, b, cols, ASM: tl.constexpr):
    """p = e * ex2((m_t - lse) log2 e) and the loss terms a p + b [c == y] of a block e [R, C] (float32) of one
    tile's values, given its rows' tile max, target, lse, a and b ([R]) and its columns [C]: the part of dZ
    that this pass and the gradient GEMMs' operand load (`grad_gemms`, `dz_on_load`) compute alike."""
    p = fm.mul(e, fm.ex2((m_t - lse) * LOG2E, ASM)[:, None], ASM)
    return p, fm.fma(a[:, None], p, tl.where(cols[None, :] == y[:, None], b[:, None], 0.0), ASM)


@triton.jit
def dz_on_load(e, mt_ptr, rows, c0, n_tiles, y, lse, a, b, c, live, V, TILE_N: tl.constexpr, ASM: tl.constexpr):
    """dZ of a block e [R, C] of tile values (any dtype, returned in it) at `rows` [R] and columns c0 .. c0 + C
    (inside one tile of TILE_N), given the rows' `row_coefficients` (0 past the rows), for the heads that
    `fce_core.heads.forms_dz_on_load` admits: a p + b [c == y] + c, 0 in rows without a gradient and in columns
    past V, the values this pass stores (its columns past V are never read)."""
    m_t = tl.load(mt_ptr + rows.to(tl.int64) * n_tiles + c0 // TILE_N, mask=live, other=0.0)
    cols = c0 + tl.arange(0, e.shape[1])
    _p, dz = dz_terms(e.to(tl.float32), m_t, y, lse, a, b, cols, ASM)
    dz = tl.where(live[:, None] & (cols < V)[None, :], dz + c[:, None], 0.0)
    return fm.to_dtype(dz, e.dtype, ASM)


@launched
@triton.jit
def _tile_dlogits_kernel(e_ptr, stride_e, mt_ptr, y_ptr, zy_ptr, cw_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, d_ptr,
                         mu_ptr, n_rows, V, n_tiles, softcap, temperature,
                         HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, HAS_CW: tl.constexpr,
                         HAS_ENTROPY: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    t = tl.program_id(1)
    cols = t * BN + tl.arange(0, BN)
    row_ok = rows < n_rows
    col_ok = cols < V
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    y, lse, a, b, c, live = row_coefficients(y_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, rows, row_ok)
    m_t = tl.load(mt_ptr + rows64 * n_tiles + t, mask=row_ok, other=0.0)
    ptrs = e_ptr + rows64[:, None] * stride_e + cols[None, :]
    e = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    p, dz = dz_terms(e, m_t, y, lse, a, b, cols, ASM)
    is_y = cols[None, :] == y[:, None]
    if HAS_CW:
        dz = fm.fma(c[:, None], tl.load(cw_ptr + cols, mask=col_ok, other=0.0)[None, :], dz, ASM)
    else:
        dz = dz + c[:, None]
    if HAS_ENTROPY or HAS_SOFTCAP:
        # an e that underflowed to 0 has p = 0; its z stands in as m_t (the plan refuses the one case where a
        # term would still need it: label smoothing under a softcap above 43)
        z = tl.where(e > 0.0, fm.fma(fm.lg2(tl.where(e > 0.0, e, 1.0), ASM), LN2, m_t[:, None], ASM), m_t[:, None])
        z = tl.where(is_y, tl.load(zy_ptr + rows, mask=row_ok, other=0.0)[:, None], z)
    if HAS_ENTROPY:
        d = tl.load(d_ptr + rows, mask=row_ok, other=0.0)
        mu = tl.load(mu_ptr + rows, mask=row_ok, other=0.0)
        live = live | (d != 0.0)
        dz = fm.fma(fm.mul(d[:, None], p, ASM), z - mu[:, None], dz, ASM)
    if HAS_SOFTCAP:
        capped = fm.mul(z, temperature, ASM) if HAS_TEMP else z
        th = fm.div(capped, softcap, ASM)
        dz = fm.mul(dz, fm.fma(-th, th, 1.0, ASM), ASM)
    if HAS_TEMP:
        dz = fm.div(dz, temperature, ASM)
    dz = tl.where(live[:, None], dz, 0.0)
    tl.store(ptrs, fm.to_dtype(dz, e_ptr.dtype.element_ty, ASM), mask=mask)


def tile_dlogits(e, m_tiles, y, zy, class_weights, coef, *, transform, cfg=None):
    """Overwrite the tile values `e` [n, V] (row stride may exceed V) with dZ, given `logit_tiles`' tile maxima
    `m_tiles` [n, T], the rows' exact target logits `zy` and the head's lse, a, b, c (and d, mu)."""
    n, V = e.shape
    if n == 0:
        return
    tile_n = gemm_config(cfg).tile_n
    entropy = "d" in coef
    _tile_dlogits_kernel[(cdiv(n, TILE_ROWS.block), cdiv(V, tile_n))](
        e, e.stride(0), m_tiles, y, zy, class_weights if class_weights is not None else zy, coef["lse"], coef["a"],
        coef["b"], coef["c"], coef["d"] if entropy else zy, coef["mu"] if entropy else zy, n, V, m_tiles.shape[1],
        float(transform.softcap or 1.0), float(transform.temperature), HAS_SOFTCAP=transform.softcap is not None,
        HAS_TEMP=transform.has_temperature, HAS_CW=class_weights is not None, HAS_ENTROPY=entropy,
        BR=TILE_ROWS.block, BN=tile_n, ASM=fm.ASM, num_warps=TILE_ROWS.num_warps)

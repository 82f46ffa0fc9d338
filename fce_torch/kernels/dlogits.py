"""Pass B over a chunk of float32 logits: dZ = a p + b [c == y] + c w_c (+ d p (z - mu)), times the derivative of
the logit transform; a later per-row scale of rows (kept dZ rows, or the rows of X and dX that the GEMMs over
them take); and db.

p = softmax(z) comes from the row's lse; the entropy term (d, mu = E[z]) is compiled in only when a head asks
for it. A row whose coefficients are all 0 (ignored) gets dZ = 0 exactly, whatever its logits (even NaN).

The dZ kernel walks each block of rows left to right, so it may write its output into the logits' own memory
(a 16-bit dZ row occupies the first half of its float32 row): every write lands on columns this program has
already read, once a barrier has made sure that all of its warps have read the current block (`IN_PLACE`).
Twin: fce_jax/kernels/dlogits.py.
"""
import torch
import triton
import triton.language as tl

from fce_core.plan import cdiv

from . import fastmath as fm
from .fastmath import LOG2E
from .launch import launched
from .row_stats import logit_transform, row_pass


@triton.jit
def row_coefficients(y_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, rows, row_ok):
    """A block of rows' targets and head coefficients (lse, a, b, c), and whether each row has a gradient."""
    y = tl.load(y_ptr + rows, mask=row_ok, other=0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    a = tl.load(a_ptr + rows, mask=row_ok, other=0.0)
    b = tl.load(b_ptr + rows, mask=row_ok, other=0.0)
    c = tl.load(c_ptr + rows, mask=row_ok, other=0.0)
    return y, lse, a, b, c, (a != 0.0) | (b != 0.0) | (c != 0.0)


@launched
@triton.jit
def _dlogits_kernel(z_ptr, stride_z, dz_ptr, stride_dz, bias_ptr, y_ptr, cw_ptr, lse_ptr, a_ptr, b_ptr, c_ptr,
                    d_ptr, mu_ptr, n_rows, V, softcap, temperature,
                    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr,
                    HAS_CW: tl.constexpr, HAS_ENTROPY: tl.constexpr, IN_PLACE: tl.constexpr,
                    BR: tl.constexpr, BV: tl.constexpr, ASM: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    y, lse, a, b, c, live = row_coefficients(y_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, rows, row_ok)
    if HAS_ENTROPY:
        d = tl.load(d_ptr + rows, mask=row_ok, other=0.0)
        mu = tl.load(mu_ptr + rows, mask=row_ok, other=0.0)
        live = live | (d != 0.0)
    cols0 = tl.arange(0, BV)
    for start in range(0, V, BV):
        cols = start + cols0
        col_ok = cols < V
        mask = row_ok[:, None] & col_ok[None, :]
        r = tl.load(z_ptr + rows64[:, None] * stride_z + cols[None, :], mask=mask, other=0.0)
        if HAS_BIAS:
            r = r + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        z, t = logit_transform(r, softcap, temperature, HAS_SOFTCAP, HAS_TEMP, ASM)
        p = fm.ex2((z - lse[:, None]) * LOG2E, ASM)
        dz = fm.fma(a[:, None], p, tl.where(cols[None, :] == y[:, None], b[:, None], 0.0), ASM)
        if HAS_CW:
            w = tl.load(cw_ptr + cols, mask=col_ok, other=0.0)
            dz = fm.fma(c[:, None], w[None, :], dz, ASM)
        else:
            dz = dz + c[:, None]
        if HAS_ENTROPY:
            dz = fm.fma(fm.mul(d[:, None], p, ASM), z - mu[:, None], dz, ASM)
        if HAS_SOFTCAP:
            dz = fm.mul(dz, fm.fma(-t, t, 1.0, ASM), ASM)
        if HAS_TEMP:
            dz = fm.div(dz, temperature, ASM)
        dz = tl.where(live[:, None], dz, 0.0)
        if IN_PLACE:
            tl.debug_barrier()
        tl.store(dz_ptr + rows64[:, None] * stride_dz + cols[None, :], fm.to_dtype(dz, dz_ptr.dtype.element_ty, ASM),
                 mask=mask)


@launched
@triton.jit
def _scale_rows_kernel(a_ptr, stride_a, out_ptr, stride_out, scale_ptr, n_rows, V, BR: tl.constexpr,
                       BV: tl.constexpr, ASM: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < V)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    a = tl.load(a_ptr + rows64 * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows64 * stride_out + cols[None, :],
             fm.to_dtype(fm.mul(a, scale[:, None], ASM), out_ptr.dtype.element_ty, ASM), mask=mask)


@launched
@triton.jit
def _bias_grad_kernel(dz_ptr, stride_dz, db_ptr, scale_ptr, n_rows, V, BV: tl.constexpr, HAS_SCALE: tl.constexpr,
                      ASM: tl.constexpr):
    cols = tl.program_id(0) * BV + tl.arange(0, BV)
    col_ok = cols < V
    acc = tl.load(db_ptr + cols, mask=col_ok, other=0.0)
    for i in range(0, n_rows):
        dz = tl.load(dz_ptr + i * stride_dz + cols, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_SCALE:
            dz = fm.mul(dz, tl.load(scale_ptr + i), ASM)
        acc += dz
    tl.store(db_ptr + cols, acc, mask=col_ok)


def dlogits(z, dz, bias, y, class_weights, coef, *, transform, asm, cfg=None):
    """Write dZ for the float32 logits `z` [n, V] into `dz` [n, V] (may alias z's memory, see above).
    `coef`: the head's per-row float32 lse, a, b, c, and d, mu when it has an entropy term."""
    cfg = row_pass(cfg)
    n, V = z.shape
    if n == 0:
        return
    entropy = "d" in coef
    _dlogits_kernel[(cdiv(n, cfg.block_rows),)](
        z, z.stride(0), dz, dz.stride(0), bias if bias is not None else z, y,
        class_weights if class_weights is not None else z, coef["lse"], coef["a"], coef["b"], coef["c"],
        coef["d"] if entropy else z, coef["mu"] if entropy else z,
        n, V, float(transform.softcap or 1.0), float(transform.temperature),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=transform.softcap is not None, HAS_TEMP=transform.has_temperature,
        HAS_CW=class_weights is not None, HAS_ENTROPY=entropy,
        IN_PLACE=dz.data_ptr() == z.data_ptr() and dz.dtype != z.dtype, BR=cfg.block_rows, BV=cfg.block_v,
        ASM=asm, num_warps=cfg.num_warps)


def scale_rows(a, scale, out=None, cfg=None):
    """out [n, V] = a [n, V] * scale [n] (float32) row by row, the float32 product rounded once to out's dtype;
    in place without `out`. Returns out."""
    cfg = row_pass(cfg)
    out = a if out is None else out
    n, V = a.shape
    if n:
        _scale_rows_kernel[(cdiv(n, cfg.block_rows), cdiv(V, cfg.block_v))](
            a, a.stride(0), out, out.stride(0), scale, n, V, BR=cfg.block_rows, BV=cfg.block_v, ASM=fm.ASM,
            num_warps=cfg.num_warps)
    return out


def accumulate_bias_grad(dz, db, scale=None, rows=None, cfg=None):
    """db [V] float32 += column sums of dz [n, V] (its first `rows` rows), adding the rows in order
    (deterministic); with `scale` [n] (float32), of `mul(float32(dz), scale)` row by row (a kept dZ whose rows
    are scaled in the GEMMs instead, `engine._Grads`)."""
    cfg = row_pass(cfg)
    V = dz.shape[1]
    n = dz.shape[0] if rows is None else rows
    if n == 0:
        return
    _bias_grad_kernel[(cdiv(V, cfg.block_v),)](dz, dz.stride(0), db, dz if scale is None else scale, n, V,
                                                      BV=cfg.block_v, HAS_SCALE=scale is not None, ASM=fm.ASM,
                                                      num_warps=cfg.num_warps)

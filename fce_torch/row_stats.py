"""Pass A over a chunk of float32 logits: per-row statistics, with no float reduction of compiler-chosen order.

For rows i of the chunk (blocks of BR rows, a sequential loop over V in blocks of BV columns) the kernel keeps
the running max `m_i` and, per (row, slot j), the elementwise accumulators

    S[i, j] = sum over blocks of 2**((z - m_i) * log2 e)     (rescaled when m_i moves)
    Q[i, j] = sum over blocks of w_c * (z_c - z_y)             (label smoothing only)

plus the exact target logit z_y and the first argmax. The [rows, BV] partials are summed by
`head.pairwise_sum` in a fixed order. Twin: fce_jax/row_stats.py.
"""
import torch
import triton
import triton.language as tl

from . import fastmath as fm
from .fastmath import LOG2E

BLOCK_ROWS = 2
BLOCK_V = 1024


@triton.jit
def logit_transform(r, softcap, HAS_SOFTCAP: tl.constexpr, ASM: tl.constexpr):
    """Float32 logits (bias added) -> z (softcapped); also returns t = tanh(r / cap) for the derivative."""
    if HAS_SOFTCAP:
        t = fm.tanh(fm.div(r, softcap, ASM), ASM)
        z = fm.mul(t, softcap, ASM)
    else:
        t = r
        z = r
    return z, t


@triton.jit
def _row_stats_kernel(z_ptr, stride_z, bias_ptr, ry_ptr, by_ptr, cw_ptr,
                      m_ptr, zy_ptr, amax_ptr, s_ptr, q_ptr,
                      n_rows, V, softcap,
                      HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr,
                      HAS_Q: tl.constexpr, BR: tl.constexpr, BV: tl.constexpr, ASM: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    r_y = tl.load(ry_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        r_y = r_y + tl.load(by_ptr + rows, mask=row_ok, other=0.0)
    z_y, _ = logit_transform(r_y, softcap, HAS_SOFTCAP, ASM)

    m = tl.full([BR], float("-inf"), tl.float32)
    arg = tl.zeros([BR], tl.int32)
    s = tl.zeros([BR, BV], tl.float32)
    q = tl.zeros([BR, BV], tl.float32)
    cols0 = tl.arange(0, BV)
    for start in range(0, V, BV):
        cols = start + cols0
        col_ok = cols < V
        r = tl.load(z_ptr + rows64[:, None] * stride_z + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if HAS_BIAS:
            r = r + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        z, _t = logit_transform(r, softcap, HAS_SOFTCAP, ASM)
        z = tl.where(col_ok[None, :], z, float("-inf"))

        blk_max = tl.max(z, axis=1)
        blk_arg = tl.min(tl.where(z == blk_max[:, None], cols[None, :], 2147483647), axis=1)
        arg = tl.where(blk_max > m, blk_arg, arg)
        m_new = tl.maximum(m, blk_max)
        rescale = fm.ex2((m - m_new) * LOG2E, ASM)
        e = fm.ex2((z - m_new[:, None]) * LOG2E, ASM)
        s = fm.fma(s, rescale[:, None], e, ASM)
        m = m_new
        if HAS_Q:
            d = tl.where(col_ok[None, :], z - z_y[:, None], 0.0)
            if HAS_CW:
                w = tl.load(cw_ptr + cols, mask=col_ok, other=0.0)
                q = fm.fma(w[None, :], d, q, ASM)
            else:
                q = q + d

    tl.store(m_ptr + rows, m, mask=row_ok)
    tl.store(zy_ptr + rows, z_y, mask=row_ok)
    tl.store(amax_ptr + rows, arg, mask=row_ok)
    part = rows64[:, None] * BV + cols0[None, :]
    tl.store(s_ptr + part, s, mask=row_ok[:, None])
    if HAS_Q:
        tl.store(q_ptr + part, q, mask=row_ok[:, None])


def row_stats(z, bias, y, class_weights, *, softcap, smoothing, asm):
    """Per-row statistics of the float32 logits `z` [n, V] (row stride may exceed V); y [n] targets.

    Returns (m [n], z_y [n], argmax [n] int32, S partials [n, BV], Q partials [n, BV] or None).
    """
    n, V = z.shape
    dev = z.device
    m = torch.empty(n, device=dev, dtype=torch.float32)
    zy = torch.empty_like(m)
    amax = torch.empty(n, device=dev, dtype=torch.int32)
    s = torch.empty(n, BLOCK_V, device=dev, dtype=torch.float32)
    q = torch.empty_like(s) if smoothing else None
    if n == 0:
        return m, zy, amax, s, q
    y_safe = torch.where((y >= 0) & (y < V), y, 0)
    r_y = z.gather(1, y_safe[:, None])[:, 0]
    b_y = bias[y_safe].to(torch.float32) if bias is not None else r_y
    _row_stats_kernel[(triton.cdiv(n, BLOCK_ROWS),)](
        z, z.stride(0), bias if bias is not None else z, r_y, b_y,
        class_weights if class_weights is not None else z,
        m, zy, amax, s, q if q is not None else s,
        n, V, float(softcap or 1.0),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, HAS_CW=class_weights is not None,
        HAS_Q=smoothing, BR=BLOCK_ROWS, BV=BLOCK_V, ASM=asm, num_warps=4)
    return m, zy, amax, s, q

"""Pass A over a chunk of float32 logits, in Triton: per row the max, the target logit, the first argmax, and
per (row, slot) the elementwise partial sums S (exponentials), Q (label smoothing) and P (entropy) that
`sums.pairwise_sum` then adds in a fixed order (docs/NUMERICS.md, "Per chunk", step 2). One program holds a
block of rows and walks V left to right. Twin: fce_jax/kernels/row_stats.py.
"""
import torch
import triton
import triton.language as tl

from fce_core.config import ROW_PASS, ROW_PASS_INTERPRETER_TORCH
from fce_core.plan import cdiv

from . import fastmath as fm
from .fastmath import LOG2E
from .launch import launched


@triton.jit
def logit_transform(r, softcap, temperature, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr,
                    ASM: tl.constexpr):
    """Raw float32 logits (bias added) -> z (softcapped, then divided by the temperature); also returns
    t = tanh(r / cap) for the derivative."""
    if HAS_SOFTCAP:
        t = fm.tanh(fm.div(r, softcap, ASM), ASM)
        z = fm.mul(t, softcap, ASM)
    else:
        t = r
        z = r
    if HAS_TEMP:
        z = fm.div(z, temperature, ASM)
    return z, t


@launched
@triton.jit
def _row_stats_kernel(z_ptr, stride_z, bias_ptr, ry_ptr, cw_ptr,
                      m_ptr, zy_ptr, amax_ptr, s_ptr, q_ptr, pz_ptr,
                      n_rows, V, softcap, temperature,
                      HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr,
                      HAS_CW: tl.constexpr, HAS_Q: tl.constexpr, HAS_PZ: tl.constexpr,
                      BR: tl.constexpr, BV: tl.constexpr, ASM: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    r_y = tl.load(ry_ptr + rows, mask=row_ok, other=0.0)
    z_y, _ = logit_transform(r_y, softcap, temperature, HAS_SOFTCAP, HAS_TEMP, ASM)

    m = tl.full([BR], float("-inf"), tl.float32)
    arg = tl.zeros([BR], tl.int32)
    s = tl.zeros([BR, BV], tl.float32)
    q = tl.zeros([BR, BV], tl.float32)
    pz = tl.zeros([BR, BV], tl.float32)
    cols0 = tl.arange(0, BV)
    for start in range(0, V, BV):
        cols = start + cols0
        col_ok = cols < V
        r = tl.load(z_ptr + rows64[:, None] * stride_z + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if HAS_BIAS:
            r = r + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        z, _t = logit_transform(r, softcap, temperature, HAS_SOFTCAP, HAS_TEMP, ASM)
        z = tl.where(col_ok[None, :], z, float("-inf"))

        blk_max = tl.max(z, axis=1)
        blk_arg = tl.min(tl.where(z == blk_max[:, None], cols[None, :], 2147483647), axis=1)
        arg = tl.where(blk_max > m, blk_arg, arg)
        m_new = tl.maximum(m, blk_max)
        rescale = fm.ex2((m - m_new) * LOG2E, ASM)
        e = fm.ex2((z - m_new[:, None]) * LOG2E, ASM)
        s_old = s
        s = fm.fma(s, rescale[:, None], e, ASM)
        if HAS_PZ:
            shift = tl.where(m > float("-inf"), m - m_new, 0.0)
            ez = fm.mul(e, tl.where(col_ok[None, :], z - m_new[:, None], 0.0), ASM)
            pz = fm.fma(fm.fma(shift[:, None], s_old, pz, ASM), rescale[:, None], ez, ASM)
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
    if HAS_PZ:
        tl.store(pz_ptr + part, pz, mask=row_ok[:, None])


def row_pass(cfg=None):
    """The row-pass configuration: `cfg`, else the GPU's, or the interpreter's wider row blocks."""
    return cfg or (ROW_PASS if fm.ASM else ROW_PASS_INTERPRETER_TORCH)


def row_stats(z, bias, r_y, class_weights, *, spec, transform, asm, cfg=None):
    """Per-row statistics of the float32 logits `z` [n, V] (row stride may exceed V); `r_y` [n] the raw
    target logits (`target_logits`). Returns a dict: m, zy [n] float32, amax [n] int32 and the [n, BV]
    partials s, q (spec.q) and pz (spec.pz) whose pairwise sums give the row sums."""
    cfg = row_pass(cfg)
    n, V = z.shape
    dev = z.device
    out = {"m": torch.empty(n, device=dev, dtype=torch.float32), "zy": torch.empty(n, device=dev, dtype=torch.float32),
           "amax": torch.empty(n, device=dev, dtype=torch.int32)}
    for name, wanted in (("s", True), ("q", spec.q), ("pz", spec.pz)):
        if wanted:
            out[name] = torch.empty(n, cfg.block_v, device=dev, dtype=torch.float32)
    if n == 0:
        return out
    _row_stats_kernel[(cdiv(n, cfg.block_rows),)](
        z, z.stride(0), bias if bias is not None else z, r_y, class_weights if class_weights is not None else z,
        out["m"], out["zy"], out["amax"], out["s"], out.get("q", out["s"]), out.get("pz", out["s"]),
        n, V, float(transform.softcap or 1.0), float(transform.temperature),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=transform.softcap is not None,
        HAS_TEMP=transform.has_temperature, HAS_CW=class_weights is not None, HAS_Q=spec.q, HAS_PZ=spec.pz,
        BR=cfg.block_rows, BV=cfg.block_v, ASM=asm, num_warps=cfg.num_warps)
    return out

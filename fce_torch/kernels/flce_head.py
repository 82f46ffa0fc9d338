"""The FLCE head in Triton: a chunk's row statistics -> each row's loss, z-loss part, lse, correctness and the
coefficients a, b, c of its logits' gradient, for the three reductions, an optional per-row cotangent of the
loss (g) and of lse (g_lse), and token scaling (docs/NUMERICS.md, "The head kernels", gives the formulas).
Twin: fce_jax/kernels/flce_head.py.
"""
import torch
import triton
import triton.language as tl

from fce_core.config import HEAD
from fce_core.plan import cdiv

from . import fastmath as fm
from .fastmath import LN2, LOG2E
from .launch import launched

ROW_OUTPUTS = ("lse", "loss", "zrow", "correct", "a", "b", "c")


@triton.jit
def row_lse(m_ptr, s_ptr, zy_ptr, y_ptr, rows, ok, V, ignore_index, ASM: tl.constexpr):
    """A block of rows' targets and statistics -> (y, valid, y in [0, V), s, lg2 s, lse, L1 = lse - z_y)."""
    y = tl.load(y_ptr + rows, mask=ok, other=0)
    m = tl.load(m_ptr + rows, mask=ok, other=0.0)
    s = tl.load(s_ptr + rows, mask=ok, other=1.0)
    zy = tl.load(zy_ptr + rows, mask=ok, other=0.0)
    lg = fm.lg2(s, ASM)
    return (y, ok & (y != ignore_index), (y >= 0) & (y < V), s, lg, fm.fma(lg, LN2, m, ASM),
            fm.fma(lg, LN2, m - zy, ASM))


@launched
@triton.jit
def _flce_head_kernel(m_ptr, s_ptr, zy_ptr, q_ptr, amax_ptr, y_ptr, wy_ptr, g_ptr, glse_ptr, scal_ptr,
                      lse_ptr, loss_ptr, zrow_ptr, correct_ptr, a_ptr, b_ptr, c_ptr,
                      n_rows, V, ignore_index, one_minus_eps, eps_over_v, zcoef, two_zcoef,
                      MODE: tl.constexpr, HAS_Q: tl.constexpr, HAS_CW: tl.constexpr, HAS_G: tl.constexpr,
                      HAS_GLSE: tl.constexpr, TOKEN_SCALING: tl.constexpr, BLOCK: tl.constexpr,
                      ASM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n_rows
    y, valid, in_range, s, lg, lse, l1 = row_lse(m_ptr, s_ptr, zy_ptr, y_ptr, rows, ok, V, ignore_index, ASM)
    w_sum = tl.load(scal_ptr + 2)
    if HAS_CW:
        w_y = tl.load(wy_ptr + rows, mask=valid, other=0.0)
    else:
        w_y = tl.where(valid, 1.0, 0.0)
    k1w = fm.mul(one_minus_eps, w_y, ASM)
    if HAS_Q:
        q = tl.load(q_ptr + rows, mask=ok, other=0.0)
        ce = fm.fma(k1w, l1, fm.mul(eps_over_v, fm.fma(w_sum, l1, -q, ASM), ASM), ASM)
    else:
        ce = fm.mul(k1w, l1, ASM)
    zl = fm.mul(zcoef, fm.mul(lse, lse, ASM), ASM)

    if MODE == 0:
        d = tl.load(scal_ptr)
        n = tl.load(scal_ptr + 1)
        rho = tl.where(d != 0.0, fm.div(1.0, d, ASM), 0.0)
        rho_z = tl.where(n > 0.0, fm.div(1.0, n, ASM), 0.0)
    else:
        rho = tl.full([BLOCK], 1.0, tl.float32)
        rho_z = rho
    if HAS_G:
        g = tl.load(g_ptr + rows, mask=ok, other=0.0)
        rho = fm.mul(rho, g, ASM)
        rho_z = fm.mul(rho_z, g, ASM)
    if TOKEN_SCALING:
        p_y = fm.ex2((tl.load(zy_ptr + rows, mask=ok, other=0.0) - lse) * LOG2E, ASM)
        rho = fm.mul(rho, p_y, ASM)
        rho_z = fm.mul(rho_z, p_y, ASM)
    zrow = fm.mul(zl, rho_z, ASM)
    loss = fm.fma(ce, rho, zrow, ASM)
    a = fm.fma(rho, fm.fma(eps_over_v, w_sum, k1w, ASM), fm.mul(fm.mul(rho_z, two_zcoef, ASM), lse, ASM), ASM)
    if HAS_GLSE:
        a = a + tl.load(glse_ptr + rows, mask=ok, other=0.0)
    b = -fm.mul(rho, k1w, ASM)
    c = -fm.mul(rho, eps_over_v, ASM)

    # A target outside [0, V) (only reachable with validate=False) poisons its row: NaN, never a wrong number.
    nan = float("nan")
    loss = tl.where(in_range, loss, nan)
    a = tl.where(in_range, a, nan)
    amax = tl.load(amax_ptr + rows, mask=ok, other=-1)
    tl.store(lse_ptr + rows, lse, mask=ok)
    tl.store(loss_ptr + rows, tl.where(valid, loss, 0.0), mask=ok)
    tl.store(zrow_ptr + rows, tl.where(valid, zrow, 0.0), mask=ok)
    tl.store(correct_ptr + rows, tl.where(valid & (amax == y), 1.0, 0.0), mask=ok)
    tl.store(a_ptr + rows, tl.where(valid, a, 0.0), mask=ok)
    tl.store(b_ptr + rows, tl.where(valid, b, 0.0), mask=ok)
    tl.store(c_ptr + rows, tl.where(valid, c, 0.0), mask=ok)


def flce_head(stats, y, w_y, g, g_lse, scalars, *, opt, vocab, asm=fm.ASM, cfg=HEAD):
    """Run the head on one chunk's rows. `stats`: the chunk's m, s, zy, amax (and q with label smoothing);
    `scalars` = float32 [D, n, W_sum]; `w_y` the targets' class weights, `g`/`g_lse` the rows' cotangents of
    the loss and of lse (each or None). `opt`: the FlceOptions. Returns a dict of float32 [rows] tensors named
    ROW_OUTPUTS."""
    m = stats["m"]
    n = m.shape[0]
    out = {k: torch.empty(n, device=m.device, dtype=torch.float32) for k in ROW_OUTPUTS}
    if n == 0:
        return out
    eps, q = float(opt.label_smoothing), stats.get("q")
    _flce_head_kernel[(cdiv(n, cfg.block),)](
        m, stats["s"], stats["zy"], m if q is None else q, stats["amax"], y, m if w_y is None else w_y,
        m if g is None else g, m if g_lse is None else g_lse, scalars, *(out[k] for k in ROW_OUTPUTS),
        n, vocab, opt.ignore_index, 1.0 - eps, eps / vocab, float(opt.z_loss), 2.0 * float(opt.z_loss),
        MODE=opt.mode, HAS_Q=q is not None, HAS_CW=w_y is not None, HAS_G=g is not None,
        HAS_GLSE=g_lse is not None, TOKEN_SCALING=opt.token_scaling, BLOCK=cfg.block, ASM=asm,
        num_warps=cfg.num_warps)
    return out

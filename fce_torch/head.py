"""The loss head: per-row statistics -> per-row loss and gradient coefficients; the fixed-order sums.

For a valid row (target y != ignore_index), with L1 = lse - z_y and q = sum_c w_c (z_c - z_y):

    CE   = (1 - eps) w_y L1 + (eps / V) (W_sum L1 - q)          Z = s lse^2
    dloss/dz_c = a p_c + b [c == y] + c_ w_c                    (before the softcap derivative)
    a = rho ((1 - eps) w_y + (eps / V) W_sum) + rho_z 2 s lse,  b = -rho (1 - eps) w_y,  c_ = -rho eps / V

rho, rho_z are 1/D, 1/n ("mean"), 1 ("sum"), or the row's cotangent ("none", backward). Ignored rows give 0.
Twin: fce_jax/head.py.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import fastmath as fm
from .fastmath import LN2

BLOCK = 1024
MEAN, SUM, NONE = 0, 1, 2
ROW_OUTPUTS = ("lse", "loss", "zrow", "correct", "a", "b", "c")


def pairwise_sum(x):
    """Sum over the last axis by a fixed pairwise tree (zero-padded to a power of two): x[0::2] + x[1::2]."""
    n = x.shape[-1]
    if n == 0:
        return x.new_zeros(x.shape[:-1])
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


@triton.jit
def _flce_head_kernel(m_ptr, s_ptr, zy_ptr, q_ptr, amax_ptr, y_ptr, wy_ptr, g_ptr, scal_ptr,
                      lse_ptr, loss_ptr, zrow_ptr, correct_ptr, a_ptr, b_ptr, c_ptr,
                      n_rows, V, ignore_index, one_minus_eps, eps_over_v, zcoef, two_zcoef,
                      MODE: tl.constexpr, HAS_Q: tl.constexpr, HAS_CW: tl.constexpr, HAS_G: tl.constexpr,
                      BLOCK: tl.constexpr, ASM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n_rows
    y = tl.load(y_ptr + rows, mask=ok, other=0)
    valid = ok & (y != ignore_index)
    in_range = (y >= 0) & (y < V)
    m = tl.load(m_ptr + rows, mask=ok, other=0.0)
    s = tl.load(s_ptr + rows, mask=ok, other=1.0)
    zy = tl.load(zy_ptr + rows, mask=ok, other=0.0)
    w_sum = tl.load(scal_ptr + 2)
    if HAS_CW:
        w_y = tl.load(wy_ptr + rows, mask=valid, other=0.0)
    else:
        w_y = tl.where(valid, 1.0, 0.0)

    lg = fm.lg2(s, ASM)
    lse = fm.fma(lg, LN2, m, ASM)
    l1 = fm.fma(lg, LN2, m - zy, ASM)
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
        rho = tl.where(d > 0.0, fm.div(1.0, d, ASM), 0.0)
        rho_z = tl.where(n > 0.0, fm.div(1.0, n, ASM), 0.0)
        zrow = fm.mul(zl, rho_z, ASM)
        loss = fm.fma(ce, rho, zrow, ASM)
    elif MODE == 1:
        rho = 1.0
        rho_z = 1.0
        zrow = zl
        loss = ce + zl
    else:
        if HAS_G:
            rho = tl.load(g_ptr + rows, mask=ok, other=0.0)
        else:
            rho = 1.0
        rho_z = rho
        zrow = zl
        loss = ce + zl
    a = fm.fma(rho, fm.fma(eps_over_v, w_sum, k1w, ASM), fm.mul(fm.mul(rho_z, two_zcoef, ASM), lse, ASM), ASM)
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


def flce_head(m, s, zy, q, amax, y, w_y, g, scalars, *, mode, ignore_index, label_smoothing, z_loss, vocab,
              asm):
    """Run the head on one chunk's rows. `scalars` = float32 [D, n, W_sum]; `w_y` the targets' class weights
    (or None). Returns a dict of float32 [rows] tensors named ROW_OUTPUTS."""
    n = m.shape[0]
    out = {k: torch.empty(n, device=m.device, dtype=torch.float32) for k in ROW_OUTPUTS}
    if n == 0:
        return out
    eps = float(label_smoothing)
    _flce_head_kernel[(triton.cdiv(n, BLOCK),)](
        m, s, zy, q if q is not None else s, amax, y, w_y if w_y is not None else m, g if g is not None else m,
        scalars, *(out[k] for k in ROW_OUTPUTS),
        n, vocab, ignore_index, 1.0 - eps, eps / vocab, float(z_loss), 2.0 * float(z_loss),
        MODE=mode, HAS_Q=q is not None, HAS_CW=w_y is not None, HAS_G=g is not None,
        BLOCK=BLOCK, ASM=asm, num_warps=4)
    return out

"""The loss head: per-row statistics -> per-row loss and gradient coefficients; the fixed-order sums.

For a valid row (target y != ignore_index), with L1 = lse - z_y and q = sum_c w_c (z_c - z_y):

    CE   = (1 - eps) w_y L1 + (eps / V) (W_sum L1 - q)          Z = s lse^2
    dloss/dz_c = a p_c + b [c == y] + c_ w_c                    (before the softcap derivative)
    a = rho ((1 - eps) w_y + (eps / V) W_sum) + rho_z 2 s lse,  b = -rho (1 - eps) w_y,  c_ = -rho eps / V

rho, rho_z are 1/D, 1/n ("mean"), 1 ("sum"), or the row's cotangent ("none", backward). Ignored rows give 0.
Twin: fce_torch/head.py.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import fastmath as fm
from .fastmath import LN2
from .pallas_call import call, interpret_mode

BLOCK = 1024
MEAN, SUM, NONE = 0, 1, 2
F32 = jnp.float32
ROW_OUTPUTS = ("lse", "loss", "zrow", "correct", "a", "b", "c")


def pairwise_sum(x):
    """Sum over the last axis by a fixed pairwise tree (zero-padded to a power of two): x[0::2] + x[1::2]."""
    n = x.shape[-1]
    if n == 0:
        return jnp.zeros(x.shape[:-1], x.dtype)
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def _flce_head_kernel(m_ref, s_ref, zy_ref, q_ref, amax_ref, y_ref, wy_ref, g_ref, scal_ref,
                      lse_ref, loss_ref, zrow_ref, correct_ref, a_ref, b_ref, c_ref,
                      *, n_rows, vocab, ignore_index, one_minus_eps, eps_over_v, zcoef, two_zcoef,
                      mode, has_q, has_cw, has_g, asm):
    r0 = pl.program_id(0) * BLOCK
    rows = r0 + lax.iota(jnp.int32, BLOCK)
    ok = rows < n_rows
    rs = pl.ds(r0, BLOCK)
    y = pltriton.load(y_ref.at[rs], mask=ok, other=0)
    valid = ok & (y != ignore_index)
    in_range = (y >= 0) & (y < vocab)
    m = pltriton.load(m_ref.at[rs], mask=ok, other=0.0)
    s = pltriton.load(s_ref.at[rs], mask=ok, other=1.0)
    zy = pltriton.load(zy_ref.at[rs], mask=ok, other=0.0)
    w_sum = jnp.broadcast_to(scal_ref[2], (BLOCK,))
    if has_cw:
        w_y = pltriton.load(wy_ref.at[rs], mask=valid, other=0.0)
    else:
        w_y = jnp.where(valid, 1.0, 0.0).astype(F32)

    lg = fm.lg2(s, asm)
    lse = fm.fma(lg, LN2, m, asm)
    l1 = fm.fma(lg, LN2, m - zy, asm)
    k1w = fm.mul(one_minus_eps, w_y, asm)
    if has_q:
        q = pltriton.load(q_ref.at[rs], mask=ok, other=0.0)
        ce = fm.fma(k1w, l1, fm.mul(eps_over_v, fm.fma(w_sum, l1, -q, asm), asm), asm)
    else:
        ce = fm.mul(k1w, l1, asm)
    zl = fm.mul(zcoef, fm.mul(lse, lse, asm), asm)

    if mode == MEAN:
        d = jnp.broadcast_to(scal_ref[0], (BLOCK,))
        n = jnp.broadcast_to(scal_ref[1], (BLOCK,))
        rho = jnp.where(d > 0.0, fm.div(1.0, d, asm), 0.0)
        rho_z = jnp.where(n > 0.0, fm.div(1.0, n, asm), 0.0)
        zrow = fm.mul(zl, rho_z, asm)
        loss = fm.fma(ce, rho, zrow, asm)
    elif mode == SUM:
        rho = rho_z = jnp.ones((BLOCK,), F32)
        zrow = zl
        loss = ce + zl
    else:
        rho = pltriton.load(g_ref.at[rs], mask=ok, other=0.0) if has_g else jnp.ones((BLOCK,), F32)
        rho_z = rho
        zrow = zl
        loss = ce + zl
    a = fm.fma(rho, fm.fma(eps_over_v, w_sum, k1w, asm), fm.mul(fm.mul(rho_z, two_zcoef, asm), lse, asm), asm)
    b = -fm.mul(rho, k1w, asm)
    c = -fm.mul(rho, eps_over_v, asm)

    # A target outside [0, V) (an unchecked, traced input) poisons its row: NaN, never a wrong number.
    loss = jnp.where(in_range, loss, jnp.nan)
    a = jnp.where(in_range, a, jnp.nan)
    amax = pltriton.load(amax_ref.at[rs], mask=ok, other=-1)
    pltriton.store(lse_ref.at[rs], lse, mask=ok)
    pltriton.store(loss_ref.at[rs], jnp.where(valid, loss, 0.0), mask=ok)
    pltriton.store(zrow_ref.at[rs], jnp.where(valid, zrow, 0.0), mask=ok)
    pltriton.store(correct_ref.at[rs], jnp.where(valid & (amax == y), 1.0, 0.0).astype(F32), mask=ok)
    pltriton.store(a_ref.at[rs], jnp.where(valid, a, 0.0), mask=ok)
    pltriton.store(b_ref.at[rs], jnp.where(valid, b, 0.0), mask=ok)
    pltriton.store(c_ref.at[rs], jnp.where(valid, c, 0.0), mask=ok)


def flce_head(m, s, zy, q, amax, y, w_y, g, scalars, *, mode, ignore_index, label_smoothing, z_loss, vocab):
    """Run the head on one chunk's rows. `scalars` = float32 [D, n, W_sum]; `w_y` the targets' class weights
    (or None). Returns a dict of float32 [rows] arrays named ROW_OUTPUTS."""
    n = m.shape[0]
    if n == 0:
        return {k: jnp.zeros((0,), F32) for k in ROW_OUTPUTS}
    eps = float(label_smoothing)
    row = jax.ShapeDtypeStruct((n,), F32)
    outs = call(_flce_head_kernel, out_shape=[row] * len(ROW_OUTPUTS), grid=(pl.cdiv(n, BLOCK),),
                n_rows=n, vocab=vocab, ignore_index=ignore_index, one_minus_eps=1.0 - eps,
                eps_over_v=eps / vocab, zcoef=float(z_loss), two_zcoef=2.0 * float(z_loss), mode=mode,
                has_q=q is not None, has_cw=w_y is not None, has_g=g is not None, asm=not interpret_mode())(
        m, s, zy, s if q is None else q, amax, y, m if w_y is None else w_y, m if g is None else g, scalars)
    return dict(zip(ROW_OUTPUTS, outs))

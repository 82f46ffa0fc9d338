"""The FLCE head as a Pallas kernel, the twin of fce_torch's: loss rows, z-loss part, lse, correctness and the
gradient coefficients a, b, c, with the same optional cotangents g, g_lse and token scaling (formulas in
docs/NUMERICS.md, "The head kernels"). The options arrive as a static FlceOptions.
Twin: fce_torch/kernels/flce_head.py.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fce_core.config import HEAD
from fce_core.options import MEAN

from . import fastmath as fm
from .fastmath import LN2, LOG2E
from .launch import call, interpret_mode

F32 = jnp.float32
ROW_OUTPUTS = ("lse", "loss", "zrow", "correct", "a", "b", "c")


def row_lse(m_ref, s_ref, zy_ref, y_ref, rs, ok, vocab, ignore_index, asm):
    """A block of rows' targets and statistics -> (y, valid, y in [0, V), s, lg2 s, lse, L1 = lse - z_y)."""
    y = pltriton.load(y_ref.at[rs], mask=ok, other=0)
    m = pltriton.load(m_ref.at[rs], mask=ok, other=0.0)
    s = pltriton.load(s_ref.at[rs], mask=ok, other=1.0)
    zy = pltriton.load(zy_ref.at[rs], mask=ok, other=0.0)
    lg = fm.lg2(s, asm)
    return (y, ok & (y != ignore_index), (y >= 0) & (y < vocab), s, lg, fm.fma(lg, LN2, m, asm),
            fm.fma(lg, LN2, m - zy, asm))


def _flce_head_kernel(m_ref, s_ref, zy_ref, q_ref, amax_ref, y_ref, wy_ref, g_ref, glse_ref, scal_ref,
                      lse_ref, loss_ref, zrow_ref, correct_ref, a_ref, b_ref, c_ref,
                      *, n_rows, vocab, opt, has_q, has_cw, has_g, has_glse, asm, block):
    r0 = pl.program_id(0) * block
    rows = r0 + lax.iota(jnp.int32, block)
    ok = rows < n_rows
    rs = pl.ds(r0, block)
    y, valid, in_range, s, lg, lse, l1 = row_lse(m_ref, s_ref, zy_ref, y_ref, rs, ok, vocab, opt.ignore_index, asm)
    w_sum = jnp.broadcast_to(scal_ref[2], (block,))
    if has_cw:
        w_y = pltriton.load(wy_ref.at[rs], mask=valid, other=0.0)
    else:
        w_y = jnp.where(valid, 1.0, 0.0).astype(F32)
    eps = float(opt.label_smoothing)
    one_minus_eps, eps_over_v = 1.0 - eps, eps / vocab
    zcoef, two_zcoef = float(opt.z_loss), 2.0 * float(opt.z_loss)

    k1w = fm.mul(one_minus_eps, w_y, asm)
    if has_q:
        q = pltriton.load(q_ref.at[rs], mask=ok, other=0.0)
        ce = fm.fma(k1w, l1, fm.mul(eps_over_v, fm.fma(w_sum, l1, -q, asm), asm), asm)
    else:
        ce = fm.mul(k1w, l1, asm)
    zl = fm.mul(zcoef, fm.mul(lse, lse, asm), asm)

    if opt.mode == MEAN:
        d = jnp.broadcast_to(scal_ref[0], (block,))
        n = jnp.broadcast_to(scal_ref[1], (block,))
        rho = jnp.where(d != 0.0, fm.div(1.0, d, asm), 0.0)
        rho_z = jnp.where(n > 0.0, fm.div(1.0, n, asm), 0.0)
    else:
        rho = rho_z = jnp.ones((block,), F32)
    if has_g:
        g = pltriton.load(g_ref.at[rs], mask=ok, other=0.0)
        rho, rho_z = fm.mul(rho, g, asm), fm.mul(rho_z, g, asm)
    if opt.token_scaling:
        p_y = fm.ex2((pltriton.load(zy_ref.at[rs], mask=ok, other=0.0) - lse) * LOG2E, asm)
        rho, rho_z = fm.mul(rho, p_y, asm), fm.mul(rho_z, p_y, asm)
    zrow = fm.mul(zl, rho_z, asm)
    loss = fm.fma(ce, rho, zrow, asm)
    a = fm.fma(rho, fm.fma(eps_over_v, w_sum, k1w, asm), fm.mul(fm.mul(rho_z, two_zcoef, asm), lse, asm), asm)
    if has_glse:
        a = a + pltriton.load(glse_ref.at[rs], mask=ok, other=0.0)
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


def flce_head(stats, y, w_y, g, g_lse, scalars, *, opt, vocab, cfg=HEAD):
    """Run the head on one chunk's rows. `stats`: the chunk's m, s, zy, amax (and q with label smoothing);
    `scalars` = float32 [D, n, W_sum]; `w_y` the targets' class weights, `g`/`g_lse` the rows' cotangents of
    the loss and of lse (each or None). `opt`: the FlceOptions. Returns a dict of float32 [rows] arrays named
    ROW_OUTPUTS."""
    m = stats["m"]
    n = m.shape[0]
    if n == 0:
        return {k: jnp.zeros((0,), F32) for k in ROW_OUTPUTS}
    q = stats.get("q")
    row = jax.ShapeDtypeStruct((n,), F32)
    outs = call(_flce_head_kernel, out_shape=[row] * len(ROW_OUTPUTS), grid=(pl.cdiv(n, cfg.block),),
                num_warps=cfg.num_warps, n_rows=n, vocab=vocab, opt=opt, has_q=q is not None,
                has_cw=w_y is not None, has_g=g is not None, has_glse=g_lse is not None, asm=not interpret_mode(),
                block=cfg.block)(
        m, stats["s"], stats["zy"], m if q is None else q, stats["amax"], y, m if w_y is None else w_y,
        m if g is None else g, m if g_lse is None else g_lse, scalars)
    return dict(zip(ROW_OUTPUTS, outs))

"""The token log-prob head as a Pallas kernel, fce_torch's twin: logp, entropy, E[z] and the coefficients for
the cotangents of both (docs/NUMERICS.md, "The head kernels"). Ignored rows give 0.
Twin: fce_torch/kernels/logprob_head.py.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fce_core.config import HEAD

from . import fastmath as fm
from .fastmath import LN2
from .flce_head import row_lse
from .launch import call, interpret_mode

F32 = jnp.float32
ROW_OUTPUTS = ("lse", "logp", "entropy", "mu", "a", "b", "c", "d")


def _logprob_head_kernel(m_ref, s_ref, zy_ref, pz_ref, y_ref, g_ref, h_ref,
                         lse_ref, logp_ref, ent_ref, mu_ref, a_ref, b_ref, c_ref, d_ref,
                         *, n_rows, vocab, ignore_index, has_pz, has_g, has_h, asm, block):
    r0 = pl.program_id(0) * block
    rows = r0 + lax.iota(jnp.int32, block)
    ok = rows < n_rows
    rs = pl.ds(r0, block)
    y, valid, in_range, s, lg, lse, l1 = row_lse(m_ref, s_ref, zy_ref, y_ref, rs, ok, vocab, ignore_index, asm)
    m = pltriton.load(m_ref.at[rs], mask=ok, other=0.0)
    logp = -l1
    # A target outside [0, V) (an unchecked, traced input) poisons its row: NaN, never a wrong number.
    logp = jnp.where(in_range, logp, jnp.nan)
    zeros = jnp.zeros((block,), F32)
    if has_pz:
        ratio = fm.div(pltriton.load(pz_ref.at[rs], mask=ok, other=0.0), s, asm)
        ent = fm.fma(lg, LN2, -ratio, asm)
        mu = m + ratio
    else:
        ent = mu = zeros
    g = pltriton.load(g_ref.at[rs], mask=ok, other=0.0) if has_g else zeros
    h = pltriton.load(h_ref.at[rs], mask=ok, other=0.0) if has_h else zeros
    a = jnp.where(in_range, -g, jnp.nan)
    pltriton.store(lse_ref.at[rs], lse, mask=ok)
    pltriton.store(logp_ref.at[rs], jnp.where(valid, logp, 0.0), mask=ok)
    pltriton.store(ent_ref.at[rs], jnp.where(valid, ent, 0.0), mask=ok)
    pltriton.store(mu_ref.at[rs], mu, mask=ok)
    pltriton.store(a_ref.at[rs], jnp.where(valid, a, 0.0), mask=ok)
    pltriton.store(b_ref.at[rs], jnp.where(valid, g, 0.0), mask=ok)
    pltriton.store(c_ref.at[rs], zeros, mask=ok)
    pltriton.store(d_ref.at[rs], jnp.where(valid, -h, 0.0), mask=ok)


def logprob_head(stats, y, g, h, *, ignore_index, vocab, cfg=HEAD):
    """Run the head on one chunk's rows. `stats`: the chunk's m, s, zy (and pz for the entropy); `g`, `h`: the
    rows' cotangents of logp and of the entropy (each or None). Returns a dict of float32 [rows] arrays named
    ROW_OUTPUTS (d, mu only where the entropy is computed)."""
    m = stats["m"]
    n = m.shape[0]
    pz = stats.get("pz")
    if n == 0:
        out = {k: jnp.zeros((0,), F32) for k in ROW_OUTPUTS}
    else:
        row = jax.ShapeDtypeStruct((n,), F32)
        outs = call(_logprob_head_kernel, out_shape=[row] * len(ROW_OUTPUTS), grid=(pl.cdiv(n, cfg.block),),
                    num_warps=cfg.num_warps, n_rows=n, vocab=vocab, ignore_index=ignore_index,
                    has_pz=pz is not None, has_g=g is not None, has_h=h is not None, asm=not interpret_mode(),
                    block=cfg.block)(m, stats["s"], stats["zy"], m if pz is None else pz, y,
                                     m if g is None else g, m if h is None else h)
        out = dict(zip(ROW_OUTPUTS, outs))
    if pz is None:
        del out["d"], out["mu"]
    return out

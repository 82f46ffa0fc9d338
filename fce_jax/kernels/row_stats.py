"""The row-statistics pass as a Pallas kernel (the Triton lowering on the GPU): the same per-row max, target
logit, first argmax and slot partials S, Q, P as fce_torch's, instruction for instruction (docs/NUMERICS.md,
"Per chunk", step 2), with the loop over V as a `lax.fori_loop`. Twin: fce_torch/kernels/row_stats.py.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fce_core.config import ROW_PASS, ROW_PASS_INTERPRETER

from . import fastmath as fm
from .fastmath import LOG2E
from .launch import call, interpret_mode

F32 = jnp.float32


def logit_transform(r, transform, asm):
    """Raw float32 logits (bias added) -> z (softcapped, then divided by the temperature); also returns
    t = tanh(r / cap) for the derivative."""
    t = z = r
    if transform.softcap is not None:
        t = fm.tanh(fm.div(r, transform.softcap, asm), asm)
        z = fm.mul(t, transform.softcap, asm)
    if transform.has_temperature:
        z = fm.div(z, transform.temperature, asm)
    return z, t


def _row_stats_kernel(z_ref, bias_ref, ry_ref, cw_ref, m_ref, zy_ref, amax_ref, s_ref, *part_refs,
                      n_rows, vocab, transform, has_bias, has_cw, has_q, has_pz, asm, cfg):
    br, bv = cfg.block_rows, cfg.block_v
    q_ref = part_refs[0] if has_q else None
    pz_ref = part_refs[-1] if has_pz else None
    r0 = pl.program_id(0) * br
    rows = r0 + lax.iota(jnp.int32, br)
    row_ok = rows < n_rows
    rs = pl.ds(r0, br)
    z_y, _ = logit_transform(pltriton.load(ry_ref.at[rs], mask=row_ok, other=0.0), transform, asm)

    def body(k, carry):
        m, arg, s, q, pz = carry
        c0 = k * bv
        cols = c0 + lax.iota(jnp.int32, bv)
        col_ok = cols < vocab
        r = pltriton.load(z_ref.at[rs, pl.ds(c0, bv)], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if has_bias:
            r = r + pltriton.load(bias_ref.at[pl.ds(c0, bv)], mask=col_ok, other=0.0).astype(F32)[None, :]
        z, _ = logit_transform(r, transform, asm)
        z = jnp.where(col_ok[None, :], z, -jnp.inf)

        blk_max = jnp.max(z, axis=1)
        blk_arg = jnp.min(jnp.where(z == blk_max[:, None], cols[None, :], jnp.iinfo(jnp.int32).max), axis=1)
        arg = jnp.where(blk_max > m, blk_arg, arg)
        m_new = jnp.maximum(m, blk_max)
        rescale = fm.ex2((m - m_new) * LOG2E, asm)
        e = fm.ex2((z - m_new[:, None]) * LOG2E, asm)
        if has_pz:
            shift = jnp.where(m > -jnp.inf, m - m_new, 0.0)
            ez = fm.mul(e, jnp.where(col_ok[None, :], z - m_new[:, None], 0.0), asm)
            pz = fm.fma(fm.fma(shift[:, None], s, pz, asm), rescale[:, None], ez, asm)
        s = fm.fma(s, rescale[:, None], e, asm)
        if has_q:
            d = jnp.where(col_ok[None, :], z - z_y[:, None], 0.0)
            if has_cw:
                w = pltriton.load(cw_ref.at[pl.ds(c0, bv)], mask=col_ok, other=0.0)
                q = fm.fma(w[None, :], d, q, asm)
            else:
                q = q + d
        return m_new, arg, s, q, pz

    zeros = jnp.zeros((br, bv), F32)
    init = (jnp.full((br,), -jnp.inf, F32), jnp.zeros((br,), jnp.int32), zeros, zeros, zeros)
    m, arg, s, q, pz = lax.fori_loop(0, pl.cdiv(vocab, bv), body, init)

    pltriton.store(m_ref.at[rs], m, mask=row_ok)
    pltriton.store(zy_ref.at[rs], z_y, mask=row_ok)
    pltriton.store(amax_ref.at[rs], arg, mask=row_ok)
    part_ok = jnp.broadcast_to(row_ok[:, None], (br, bv))
    pltriton.store(s_ref.at[rs, :], s, mask=part_ok)
    if has_q:
        pltriton.store(q_ref.at[rs, :], q, mask=part_ok)
    if has_pz:
        pltriton.store(pz_ref.at[rs, :], pz, mask=part_ok)


def row_pass(cfg=None):
    """The row-pass configuration: `cfg`, else the GPU's, or the interpreter's wider row blocks."""
    return cfg or (ROW_PASS_INTERPRETER if interpret_mode() else ROW_PASS)


def row_stats(z, bias, r_y, class_weights, *, spec, transform, cfg=None):
    """Per-row statistics of the float32 logits `z` [n, V]; `r_y` [n] the raw target logits
    (`target_logits`). Returns a dict: m, zy [n] float32, amax [n] int32 and the [n, BV] partials s, q
    (spec.q) and pz (spec.pz) whose pairwise sums give the row sums."""
    cfg = row_pass(cfg)
    n, vocab = z.shape
    names = ["m", "zy", "amax", "s"] + [k for k, on in (("q", spec.q), ("pz", spec.pz)) if on]
    shapes = {"m": (n,), "zy": (n,), "amax": (n,)}
    dtypes = {"amax": jnp.int32}
    out_shape = [jax.ShapeDtypeStruct(shapes.get(k, (n, cfg.block_v)), dtypes.get(k, F32)) for k in names]
    if n == 0:
        return {k: jnp.zeros(o.shape, o.dtype) for k, o in zip(names, out_shape)}
    dummy = jnp.zeros((1,), F32)
    outs = call(_row_stats_kernel, out_shape=out_shape, grid=(pl.cdiv(n, cfg.block_rows),),
                num_warps=cfg.num_warps, n_rows=n, vocab=vocab, transform=transform, has_bias=bias is not None,
                has_cw=class_weights is not None, has_q=spec.q, has_pz=spec.pz, asm=not interpret_mode(),
                cfg=cfg)(z, dummy if bias is None else bias, r_y, dummy if class_weights is None else class_weights)
    return dict(zip(names, outs))

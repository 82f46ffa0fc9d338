"""The fused engine's dZ as a Pallas kernel: from the exp-scaled tile values e that `logit_tiles` stored, in
their buffer (see fce_torch/kernels/tile_dlogits.py for the formulas). Twin: fce_torch/kernels/tile_dlogits.py.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fce_core.config import TILE_ROWS

from . import fastmath as fm
from .fastmath import LN2, LOG2E
from .launch import call, interpret_mode
from .logit_tiles import gemm_config

F32 = jnp.float32


def _tile_dlogits_kernel(e_ref, mt_ref, y_ref, zy_ref, cw_ref, lse_ref, a_ref, b_ref, c_ref, d_ref, mu_ref,
                         row0_ref, dz_ref, *, n_rows, vocab, transform, has_cw, entropy, tile_n, asm):
    br = TILE_ROWS.block
    r0 = pl.program_id(0) * br
    t = pl.program_id(1)
    cols = t * tile_n + lax.iota(jnp.int32, tile_n)
    row_ok = r0 + lax.iota(jnp.int32, br) < n_rows
    col_ok = cols < vocab
    mask = row_ok[:, None] & col_ok[None, :]
    rs = pl.ds(r0, br)
    block = (pl.ds(row0_ref[0] + r0, br), pl.ds(t * tile_n, tile_n))
    y = pltriton.load(y_ref.at[rs], mask=row_ok, other=0)
    lse, a, b, c = (pltriton.load(ref.at[rs], mask=row_ok, other=0.0) for ref in (lse_ref, a_ref, b_ref, c_ref))
    live = (a != 0.0) | (b != 0.0) | (c != 0.0)
    m_t = pltriton.load(mt_ref.at[rs, pl.ds(t, 1)], mask=row_ok[:, None], other=0.0)
    e = pltriton.load(e_ref.at[block], mask=mask, other=0.0).astype(F32)
    p = fm.mul(e, fm.ex2((m_t - lse[:, None]) * LOG2E, asm), asm)
    is_y = cols[None, :] == y[:, None]
    dz = fm.fma(a[:, None], p, jnp.where(is_y, b[:, None], 0.0), asm)
    if has_cw:
        dz = fm.fma(c[:, None], pltriton.load(cw_ref.at[pl.ds(t * tile_n, tile_n)], mask=col_ok, other=0.0)[None, :],
                    dz, asm)
    else:
        dz = dz + c[:, None]
    if entropy or transform.softcap is not None:
        z = jnp.where(e > 0.0, fm.fma(fm.lg2(jnp.where(e > 0.0, e, 1.0), asm), LN2, m_t, asm), m_t)
        z = jnp.where(is_y, pltriton.load(zy_ref.at[rs], mask=row_ok, other=0.0)[:, None], z)
    if entropy:
        d, mu = (pltriton.load(ref.at[rs], mask=row_ok, other=0.0) for ref in (d_ref, mu_ref))
        live = live | (d != 0.0)
        dz = fm.fma(fm.mul(d[:, None], p, asm), z - mu[:, None], dz, asm)
    if transform.softcap is not None:
        capped = fm.mul(z, transform.temperature, asm) if transform.has_temperature else z
        th = fm.div(capped, transform.softcap, asm)
        dz = fm.mul(dz, fm.fma(-th, th, 1.0, asm), asm)
    if transform.has_temperature:
        dz = fm.div(dz, transform.temperature, asm)
    dz = jnp.where(live[:, None], dz, 0.0)
    pltriton.store(dz_ref.at[block], dz.astype(dz_ref.dtype), mask=mask)


def tile_dlogits(e, m_tiles, y, zy, class_weights, coef, *, transform, row0=0, cfg=None):
    """dZ over the tile values: rows [row0, row0 + n) of `e` (n = the rows of `m_tiles` [n, T]) rewritten in
    place (the returned array is `e`, updated), given the rows' exact target logits `zy` and the head's lse,
    a, b, c (and d, mu)."""
    n, n_tiles = m_tiles.shape
    if n == 0:
        return e
    dummy = jnp.zeros((1,), F32)
    entropy = "d" in coef
    tile_n = gemm_config(cfg).tile_n
    return call(_tile_dlogits_kernel, out_shape=jax.ShapeDtypeStruct(e.shape, e.dtype),
                grid=(pl.cdiv(n, TILE_ROWS.block), n_tiles), num_warps=TILE_ROWS.num_warps,
                input_output_aliases={0: 0}, n_rows=n, vocab=e.shape[1], transform=transform,
                has_cw=class_weights is not None, entropy=entropy, tile_n=tile_n, asm=not interpret_mode())(
        e, m_tiles, y, zy, dummy if class_weights is None else class_weights, coef["lse"], coef["a"], coef["b"],
        coef["c"], coef["d"] if entropy else dummy, coef["mu"] if entropy else dummy,
        jnp.asarray(row0, jnp.int32).reshape(1))

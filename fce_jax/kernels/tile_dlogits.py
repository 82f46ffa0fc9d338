"""The fused engine's dZ as a Pallas kernel: from the exp-scaled tile values e that `logit_tiles` stored, in
their buffer (see fce_torch/kernels/tile_dlogits.py for the formulas). Twin: fce_torch/kernels/tile_dlogits.py.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fce_core.config import DZ_PASS, TILE_ROWS

from . import fastmath as fm
from .fastmath import LN2, LOG2E
from .launch import call, interpret_mode
from .logit_tiles import gemm_config

F32 = jnp.float32


def across(v, shape, dim=0):
    """v [R] (dim 0) or [C] (dim 1) broadcast to the block `shape` [R, C]: one broadcast, whose layout Mosaic
    GPU's layout inference derives from v's (a reshape to [R, 1] first leaves it unsolved)."""
    return lax.broadcast_in_dim(v, shape, (dim,))


def dz_terms(e, m_t, y, lse, a, b, cols, asm):
    """fce_torch's `dz_terms`: p and a p + b [c == y] of a float32 block e [R, C] of one tile's values (m_t,
    y, lse, a, b: [R]; `cols` the columns' indices, broadcastable to [R, C])."""
    shape = e.shape
    p = fm.mul(e, across(fm.ex2((m_t - lse) * LOG2E, asm), shape), asm)
    return p, fm.fma(across(a, shape), p, jnp.where(cols == across(y, shape), across(b, shape), 0.0), asm)


def row_coefficients(refs, rows, row_ok):
    """fce_torch's `row_coefficients`: the targets and lse, a, b, c of the rows `rows` (a slice; 0 where not
    `row_ok`), and whether each has a gradient; `refs` (y, lse, a, b, c)."""
    y, lse, a, b, c = (pltriton.load(ref.at[rows], mask=row_ok, other=0.0 if i else 0) for i, ref in enumerate(refs))
    return y, lse, a, b, c, (a != 0.0) | (b != 0.0) | (c != 0.0)


def dz_on_load(e, mt_ref, rows, c0, coef, live, vocab, tile_n, asm):
    """fce_torch's `dz_on_load`: dZ of a block e [R, C] of tile values at the rows `rows` (a slice) and columns
    c0 .. c0 + C (one tile), given their `row_coefficients` `coef` (y, lse, a, b, c) and `live`, in e's dtype."""
    y, lse, a, b, c = coef
    m_t = pltriton.load(mt_ref.at[rows, pl.ds(c0 // tile_n, 1)], mask=live[:, None], other=0.0)[:, 0]
    cols = c0 + lax.iota(jnp.int32, e.shape[1])
    _, dz = dz_terms(e.astype(F32), m_t, y, lse, a, b, cols[None, :], asm)
    return jnp.where(live[:, None] & (cols < vocab)[None, :], dz + c[:, None], 0.0).astype(e.dtype)


def dz_block(e, m_t, y, lse, a, b, c, live, cols, cw, zy, d, mu, transform, asm):
    """dZ of a float32 block e [R, C] of one tile's values (fce_torch's `_tile_dlogits_kernel`), 0 in the rows
    without a gradient: m_t, y, lse, a, b, c, `live` [R]; `cols` the columns' indices, broadcastable to [R, C];
    the columns' class weights `cw` [C] or None; the rows' target logits `zy` where the entropy (d, mu [R],
    else None) or a softcap needs the logit. Shared by this pass's two kernels: the same operations in the same
    order."""
    shape = e.shape
    p, dz = dz_terms(e, m_t, y, lse, a, b, cols, asm)
    c = across(c, shape)
    dz = dz + c if cw is None else fm.fma(c, across(cw, shape, 1), dz, asm)
    if d is not None or transform.softcap is not None:
        m_t = across(m_t, shape)
        z = jnp.where(e > 0.0, fm.fma(fm.lg2(jnp.where(e > 0.0, e, 1.0), asm), LN2, m_t, asm), m_t)
        z = jnp.where(cols == across(y, shape), across(zy, shape), z)
    if d is not None:
        live = live | (d != 0.0)
        dz = fm.fma(fm.mul(across(d, shape), p, asm), z - across(mu, shape), dz, asm)
    if transform.softcap is not None:
        capped = fm.mul(z, transform.temperature, asm) if transform.has_temperature else z
        th = fm.div(capped, transform.softcap, asm)
        dz = fm.mul(dz, fm.fma(-th, th, 1.0, asm), asm)
    if transform.has_temperature:
        dz = fm.div(dz, transform.temperature, asm)
    return jnp.where(across(live, shape), dz, 0.0)


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
    y, lse, a, b, c, live = row_coefficients((y_ref, lse_ref, a_ref, b_ref, c_ref), rs, row_ok)

    def rows(ref):
        return pltriton.load(ref.at[rs], mask=row_ok, other=0.0)

    m_t = pltriton.load(mt_ref.at[rs, pl.ds(t, 1)], mask=row_ok[:, None], other=0.0)[:, 0]
    e = pltriton.load(e_ref.at[block], mask=mask, other=0.0).astype(F32)
    cw = pltriton.load(cw_ref.at[pl.ds(t * tile_n, tile_n)], mask=col_ok, other=0.0) if has_cw else None
    zy = rows(zy_ref) if entropy or transform.softcap is not None else None
    d, mu = (rows(d_ref), rows(mu_ref)) if entropy else (None, None)
    dz = dz_block(e, m_t, y, lse, a, b, c, live, cols[None, :], cw, zy, d, mu, transform, asm)
    pltriton.store(dz_ref.at[block], dz.astype(dz_ref.dtype), mask=mask)


def tile_dlogits(e, m_tiles, y, zy, class_weights, coef, *, transform, row0=0, row0_multiple=1, cfg=None,
                 dz_cfg=None):
    """dZ over the tile values: rows [row0, row0 + n) of `e` (n = the rows of `m_tiles` [n, T]) rewritten in
    place (the returned array is `e`, updated), given the rows' exact target logits `zy` and the head's lse,
    a, b, c (and d, mu). `dz_cfg` (DZ_PASS by default): with `mosaic`, on Mosaic GPU where its kernel takes
    these tile values (`tile_dlogits_mgpu.supports`; a traced row0 a multiple of `row0_multiple`), with the same
    bits; else on the Triton lowering."""
    from . import tile_dlogits_mgpu  # which imports this module's dz_block

    n, n_tiles = m_tiles.shape
    if n == 0:
        return e
    dz_cfg = DZ_PASS if dz_cfg is None else dz_cfg
    tile_n = gemm_config(cfg).tile_n
    if dz_cfg.mosaic and tile_dlogits_mgpu.supports(e, m_tiles, row0, dz_cfg, tile_n, row0_multiple):
        return tile_dlogits_mgpu.mosaic_tile_dlogits(e, m_tiles, y, zy, class_weights, coef, transform=transform,
                                                     tile_n=tile_n, cfg=dz_cfg, row0=row0)
    dummy = jnp.zeros((1,), F32)
    entropy = "d" in coef
    return call(_tile_dlogits_kernel, out_shape=jax.ShapeDtypeStruct(e.shape, e.dtype),
                grid=(pl.cdiv(n, TILE_ROWS.block), n_tiles), num_warps=TILE_ROWS.num_warps,
                input_output_aliases={0: 0}, n_rows=n, vocab=e.shape[1], transform=transform,
                has_cw=class_weights is not None, entropy=entropy, tile_n=tile_n, asm=not interpret_mode())(
        e, m_tiles, y, zy, dummy if class_weights is None else class_weights, coef["lse"], coef["a"], coef["b"],
        coef["c"], coef["d"] if entropy else dummy, coef["mu"] if entropy else dummy,
        jnp.asarray(row0, jnp.int32).reshape(1))

"""Pass B over a chunk of float32 logits: dZ = (a p + b onehot(y) + c w) (x softcap derivative), and db.

Twin: fce_torch/dlogits.py (which writes dZ into the logits' own memory; XLA owns the buffers here).
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import fastmath as fm
from .fastmath import LOG2E
from .pallas_call import call, interpret_mode
from .row_stats import BLOCK_ROWS, BLOCK_V, logit_transform

F32 = jnp.float32


def _dlogits_kernel(z_ref, bias_ref, y_ref, cw_ref, lse_ref, a_ref, b_ref, c_ref, dz_ref,
                    *, n_rows, vocab, softcap, has_bias, has_cw, asm):
    br, bv = BLOCK_ROWS, BLOCK_V
    r0 = pl.program_id(0) * br
    rows = r0 + lax.iota(jnp.int32, br)
    row_ok = rows < n_rows
    rs = pl.ds(r0, br)
    y = pltriton.load(y_ref.at[rs], mask=row_ok, other=0)
    lse = pltriton.load(lse_ref.at[rs], mask=row_ok, other=0.0)
    a = pltriton.load(a_ref.at[rs], mask=row_ok, other=0.0)
    b = pltriton.load(b_ref.at[rs], mask=row_ok, other=0.0)
    c = pltriton.load(c_ref.at[rs], mask=row_ok, other=0.0)

    def body(k, carry):
        c0 = k * bv
        cols = c0 + lax.iota(jnp.int32, bv)
        col_ok = cols < vocab
        mask = row_ok[:, None] & col_ok[None, :]
        r = pltriton.load(z_ref.at[rs, pl.ds(c0, bv)], mask=mask, other=0.0)
        if has_bias:
            r = r + pltriton.load(bias_ref.at[pl.ds(c0, bv)], mask=col_ok, other=0.0).astype(F32)[None, :]
        z, t = logit_transform(r, softcap, asm)
        p = fm.ex2((z - lse[:, None]) * LOG2E, asm)
        dz = fm.fma(a[:, None], p, jnp.where(cols[None, :] == y[:, None], b[:, None], 0.0), asm)
        if has_cw:
            w = pltriton.load(cw_ref.at[pl.ds(c0, bv)], mask=col_ok, other=0.0)
            dz = fm.fma(c[:, None], w[None, :], dz, asm)
        else:
            dz = dz + c[:, None]
        if softcap is not None:
            dz = fm.mul(dz, fm.fma(-t, t, 1.0, asm), asm)
        pltriton.store(dz_ref.at[rs, pl.ds(c0, bv)], dz.astype(dz_ref.dtype), mask=mask)
        return carry

    lax.fori_loop(0, pl.cdiv(vocab, bv), body, 0)


def _bias_grad_kernel(dz_ref, db_in_ref, db_ref, *, n_rows, vocab):
    bv = BLOCK_V
    c0 = pl.program_id(0) * bv
    col_ok = c0 + lax.iota(jnp.int32, bv) < vocab
    cs = pl.ds(c0, bv)

    def body(i, acc):
        return acc + pltriton.load(dz_ref.at[i, cs], mask=col_ok, other=0.0).astype(F32)

    acc = lax.fori_loop(0, n_rows, body, pltriton.load(db_in_ref.at[cs], mask=col_ok, other=0.0))
    pltriton.store(db_ref.at[cs], acc, mask=col_ok)


def dlogits(z, bias, y, class_weights, lse, a, b, c, *, softcap, dtype):
    """dZ [n, V] in `dtype` for the float32 logits `z` [n, V]."""
    n, vocab = z.shape
    if n == 0:
        return jnp.zeros((0, vocab), dtype)
    dummy = jnp.zeros((1,), F32)
    return call(_dlogits_kernel, out_shape=jax.ShapeDtypeStruct((n, vocab), dtype),
                grid=(pl.cdiv(n, BLOCK_ROWS),), n_rows=n, vocab=vocab, softcap=softcap,
                has_bias=bias is not None, has_cw=class_weights is not None, asm=not interpret_mode())(
        z, dummy if bias is None else bias, y, dummy if class_weights is None else class_weights, lse, a, b, c)


def accumulate_bias_grad(dz, db):
    """db [V] float32 + column sums of dz [n, V], adding the rows in order (deterministic)."""
    n, vocab = dz.shape
    if n == 0:
        return db
    return call(_bias_grad_kernel, out_shape=jax.ShapeDtypeStruct((vocab,), F32),
                grid=(pl.cdiv(vocab, BLOCK_V),), n_rows=n, vocab=vocab)(dz, db)

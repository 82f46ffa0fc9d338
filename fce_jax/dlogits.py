"""Pass B over a chunk of float32 logits: dZ = (a p + b onehot(y) + c w) (x softcap derivative), a later
per-row scale of kept dZ rows, and db.

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


def _dlogits_kernel(z_ref, bias_ref, y_ref, cw_ref, lse_ref, a_ref, b_ref, c_ref, row0_ref, *refs,
                    n_rows, vocab, softcap, has_bias, has_cw, asm):
    dz_ref = refs[-1]  # refs[0] is the same buffer when the output is written into a given array
    br, bv = BLOCK_ROWS, BLOCK_V
    r0 = pl.program_id(0) * br
    rows = r0 + lax.iota(jnp.int32, br)
    row_ok = rows < n_rows
    rs = pl.ds(r0, br)
    out_rs = pl.ds(row0_ref[0] + r0, br)
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
        pltriton.store(dz_ref.at[out_rs, pl.ds(c0, bv)], dz.astype(dz_ref.dtype), mask=mask)
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


def dlogits(z, bias, y, class_weights, lse, a, b, c, *, softcap, dtype, into=None, row0=0, out_rows=None):
    """dZ in `dtype` for the float32 logits `z` [n, V], as rows [row0, row0 + n) of an [out_rows, V] array
    (default: the n rows alone). With `into` (an [N, V] array in `dtype`) the rows are written into it in
    place (the returned array is `into`, updated); without, the other rows of the new array are undefined."""
    n, vocab = z.shape
    shape = into.shape if into is not None else (n if out_rows is None else out_rows, vocab)
    if n == 0:
        return into if into is not None else jnp.zeros(shape, dtype)
    dummy = jnp.zeros((1,), F32)
    args = [z, dummy if bias is None else bias, y, dummy if class_weights is None else class_weights, lse, a, b, c,
            jnp.asarray(row0, jnp.int32).reshape(1)]
    aliases = {}
    if into is not None:
        aliases[len(args)] = 0
        args.append(into)
    return call(_dlogits_kernel, out_shape=jax.ShapeDtypeStruct(shape, dtype), grid=(pl.cdiv(n, BLOCK_ROWS),),
                input_output_aliases=aliases, n_rows=n, vocab=vocab, softcap=softcap, has_bias=bias is not None,
                has_cw=class_weights is not None, asm=not interpret_mode())(*args)


def _scale_rows_kernel(dz_in_ref, scale_ref, dz_ref, *, n_rows, vocab, asm):
    br, bv = BLOCK_ROWS, BLOCK_V
    r0 = pl.program_id(0) * br
    c0 = pl.program_id(1) * bv
    row_ok = r0 + lax.iota(jnp.int32, br) < n_rows
    mask = row_ok[:, None] & (c0 + lax.iota(jnp.int32, bv) < vocab)[None, :]
    block = (pl.ds(r0, br), pl.ds(c0, bv))
    scale = pltriton.load(scale_ref.at[pl.ds(r0, br)], mask=row_ok, other=0.0)
    dz = pltriton.load(dz_in_ref.at[block], mask=mask, other=0.0).astype(F32)
    pltriton.store(dz_ref.at[block], fm.mul(dz, scale[:, None], asm).astype(dz_ref.dtype), mask=mask)


def scale_rows(dz, scale):
    """dz [n, V] times scale [n] (float32) row by row, rounded once to dz's dtype (in dz's buffer)."""
    n, vocab = dz.shape
    if n == 0:
        return dz
    return call(_scale_rows_kernel, out_shape=jax.ShapeDtypeStruct(dz.shape, dz.dtype),
                grid=(pl.cdiv(n, BLOCK_ROWS), pl.cdiv(vocab, BLOCK_V)), input_output_aliases={0: 0}, n_rows=n,
                vocab=vocab, asm=not interpret_mode())(dz, scale)


def accumulate_bias_grad(dz, db, *, n_rows=None):
    """db [V] float32 + column sums of dz's first `n_rows` rows (default all), in order (deterministic)."""
    n = dz.shape[0] if n_rows is None else n_rows
    vocab = dz.shape[1]
    if n == 0:
        return db
    return call(_bias_grad_kernel, out_shape=jax.ShapeDtypeStruct((vocab,), F32),
                grid=(pl.cdiv(vocab, BLOCK_V),), n_rows=n, vocab=vocab)(dz, db)

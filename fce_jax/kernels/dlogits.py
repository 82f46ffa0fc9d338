"""Pass B over a chunk of float32 logits: dZ = a p + b [c == y] + c w_c (+ d p (z - mu)), times the derivative of
the logit transform; a later per-row scale of rows (kept dZ rows, or the rows of X and dX that the GEMMs over
them take); and db. A row whose coefficients are all 0
(ignored) gets dZ = 0 exactly, whatever its logits (even NaN).

Twin: fce_torch/kernels/dlogits.py (which writes dZ into the logits' own memory; XLA owns the buffers here).
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import fastmath as fm
from .fastmath import LOG2E
from .launch import call, interpret_mode
from .row_stats import logit_transform, row_pass

F32 = jnp.float32


def _dlogits_kernel(z_ref, bias_ref, y_ref, cw_ref, lse_ref, a_ref, b_ref, c_ref, d_ref, mu_ref, row0_ref, *refs,
                    n_rows, vocab, transform, has_bias, has_cw, entropy, asm, cfg):
    dz_ref = refs[-1]  # refs[0] is the same buffer when the output is written into a given array
    br, bv = cfg.block_rows, cfg.block_v
    r0 = pl.program_id(0) * br
    rows = r0 + lax.iota(jnp.int32, br)
    row_ok = rows < n_rows
    rs = pl.ds(r0, br)
    out_rs = pl.ds(row0_ref[0] + r0, br)
    y = pltriton.load(y_ref.at[rs], mask=row_ok, other=0)
    lse, a, b, c = (pltriton.load(ref.at[rs], mask=row_ok, other=0.0) for ref in (lse_ref, a_ref, b_ref, c_ref))
    live = (a != 0.0) | (b != 0.0) | (c != 0.0)
    if entropy:
        d, mu = (pltriton.load(ref.at[rs], mask=row_ok, other=0.0) for ref in (d_ref, mu_ref))
        live = live | (d != 0.0)

    def body(k, carry):
        c0 = k * bv
        cols = c0 + lax.iota(jnp.int32, bv)
        col_ok = cols < vocab
        mask = row_ok[:, None] & col_ok[None, :]
        r = pltriton.load(z_ref.at[rs, pl.ds(c0, bv)], mask=mask, other=0.0)
        if has_bias:
            r = r + pltriton.load(bias_ref.at[pl.ds(c0, bv)], mask=col_ok, other=0.0).astype(F32)[None, :]
        z, t = logit_transform(r, transform, asm)
        p = fm.ex2((z - lse[:, None]) * LOG2E, asm)
        dz = fm.fma(a[:, None], p, jnp.where(cols[None, :] == y[:, None], b[:, None], 0.0), asm)
        if has_cw:
            w = pltriton.load(cw_ref.at[pl.ds(c0, bv)], mask=col_ok, other=0.0)
            dz = fm.fma(c[:, None], w[None, :], dz, asm)
        else:
            dz = dz + c[:, None]
        if entropy:
            dz = fm.fma(fm.mul(d[:, None], p, asm), z - mu[:, None], dz, asm)
        if transform.softcap is not None:
            dz = fm.mul(dz, fm.fma(-t, t, 1.0, asm), asm)
        if transform.has_temperature:
            dz = fm.div(dz, transform.temperature, asm)
        dz = jnp.where(live[:, None], dz, 0.0)
        pltriton.store(dz_ref.at[out_rs, pl.ds(c0, bv)], dz.astype(dz_ref.dtype), mask=mask)
        return carry

    lax.fori_loop(0, pl.cdiv(vocab, bv), body, 0)


def _bias_grad_kernel(dz_ref, db_in_ref, scale_ref, db_ref, *, n_rows, vocab, has_scale, asm, cfg):
    bv = cfg.block_v
    c0 = pl.program_id(0) * bv
    col_ok = c0 + lax.iota(jnp.int32, bv) < vocab
    cs = pl.ds(c0, bv)

    def body(i, acc):
        dz = pltriton.load(dz_ref.at[i, cs], mask=col_ok, other=0.0).astype(F32)
        return acc + (fm.mul(dz, scale_ref[i], asm) if has_scale else dz)

    acc = lax.fori_loop(0, n_rows, body, pltriton.load(db_in_ref.at[cs], mask=col_ok, other=0.0))
    pltriton.store(db_ref.at[cs], acc, mask=col_ok)


def dlogits(z, bias, y, class_weights, coef, *, transform, dtype, into=None, row0=0, out_rows=None,
            cfg=None):
    """dZ in `dtype` for the float32 logits `z` [n, V], as rows [row0, row0 + n) of an [out_rows, V] array
    (default: the n rows alone). `coef`: the head's per-row float32 lse, a, b, c, and d, mu when it has an
    entropy term. With `into` (an [N, V] array in `dtype`) the rows are written into it in place (the returned
    array is `into`, updated); without, the other rows of the new array are undefined."""
    cfg = row_pass(cfg)
    n, vocab = z.shape
    shape = into.shape if into is not None else (n if out_rows is None else out_rows, vocab)
    if n == 0:
        return into if into is not None else jnp.zeros(shape, dtype)
    dummy = jnp.zeros((1,), F32)
    entropy = "d" in coef
    args = [z, dummy if bias is None else bias, y, dummy if class_weights is None else class_weights,
            coef["lse"], coef["a"], coef["b"], coef["c"], coef["d"] if entropy else dummy,
            coef["mu"] if entropy else dummy, jnp.asarray(row0, jnp.int32).reshape(1)]
    aliases = {}
    if into is not None:
        aliases[len(args)] = 0
        args.append(into)
    return call(_dlogits_kernel, out_shape=jax.ShapeDtypeStruct(shape, dtype), grid=(pl.cdiv(n, cfg.block_rows),),
                num_warps=cfg.num_warps, input_output_aliases=aliases, n_rows=n, vocab=vocab, transform=transform,
                has_bias=bias is not None, has_cw=class_weights is not None, entropy=entropy,
                asm=not interpret_mode(), cfg=cfg)(*args)


def _scale_rows_kernel(a_ref, scale_ref, out_ref, *, n_rows, vocab, asm, cfg):
    br, bv = cfg.block_rows, cfg.block_v
    r0 = pl.program_id(0) * br
    c0 = pl.program_id(1) * bv
    row_ok = r0 + lax.iota(jnp.int32, br) < n_rows
    mask = row_ok[:, None] & (c0 + lax.iota(jnp.int32, bv) < vocab)[None, :]
    block = (pl.ds(r0, br), pl.ds(c0, bv))
    scale = pltriton.load(scale_ref.at[pl.ds(r0, br)], mask=row_ok, other=0.0)
    a = pltriton.load(a_ref.at[block], mask=mask, other=0.0).astype(F32)
    pltriton.store(out_ref.at[block], fm.mul(a, scale[:, None], asm).astype(out_ref.dtype), mask=mask)


def _blocks(kernel, a, operand, cfg, dtype=None, **static):
    """`kernel` over a [n, V] in blocks of rows and columns with one operand, written into a's buffer, or into a
    new array of another `dtype`."""
    cfg = row_pass(cfg)
    n, vocab = a.shape
    dtype = a.dtype if dtype is None else dtype
    if n == 0:
        return a.astype(dtype)
    return call(kernel, out_shape=jax.ShapeDtypeStruct(a.shape, dtype),
                grid=(pl.cdiv(n, cfg.block_rows), pl.cdiv(vocab, cfg.block_v)), num_warps=cfg.num_warps,
                input_output_aliases={0: 0} if dtype == a.dtype else {}, n_rows=n, vocab=vocab, cfg=cfg,
                **static)(a, operand)


def scale_rows(a, scale, dtype=None, cfg=None):
    """a [n, V] times scale [n] (float32) row by row, the float32 product rounded once to `dtype` (default a's
    own, in a's buffer)."""
    return _blocks(_scale_rows_kernel, a, scale, cfg, dtype, asm=not interpret_mode())


def _zero_rows_kernel(dz_in_ref, start_ref, dz_ref, *, n_rows, vocab, cfg):
    br, bv = cfg.block_rows, cfg.block_v
    r0 = pl.program_id(0) * br
    c0 = pl.program_id(1) * bv
    start = start_ref[0]

    @pl.when(r0 + br > start)
    def _():
        rows = r0 + lax.iota(jnp.int32, br)
        mask = ((rows >= start) & (rows < n_rows))[:, None] & (c0 + lax.iota(jnp.int32, bv) < vocab)[None, :]
        pltriton.store(dz_ref.at[pl.ds(r0, br), pl.ds(c0, bv)], jnp.zeros((br, bv), dz_ref.dtype), mask=mask)


def zero_rows_from(dz, start, cfg=None):
    """dz [n, V] with its rows from `start` (an integer, possibly traced) on set to 0, in dz's buffer: the kept
    dZ rows of the chunks that did not run, which no kernel wrote. (fce_torch zeroes them with a slice: its
    host has the count. Zeros made up front cost a write of the whole buffer, 0.6 ms at 4096 x 128256.)"""
    return _blocks(_zero_rows_kernel, dz, jnp.asarray(start, jnp.int32).reshape(1), cfg)


def accumulate_bias_grad(dz, db, scale=None, rows=None, cfg=None):
    """db [V] float32 + column sums of dz [n, V] (its first `rows` rows), in row order (deterministic); with
    `scale` [n] (float32), of `mul(float32(dz), scale)` row by row, as fce_torch's."""
    cfg = row_pass(cfg)
    vocab = dz.shape[1]
    n = dz.shape[0] if rows is None else rows
    if n == 0:
        return db
    return call(_bias_grad_kernel, out_shape=jax.ShapeDtypeStruct((vocab,), F32),
                grid=(pl.cdiv(vocab, cfg.block_v),), num_warps=cfg.num_warps, n_rows=n, vocab=vocab,
                has_scale=scale is not None, asm=not interpret_mode(),
                cfg=cfg)(dz, db, jnp.zeros((1,), F32) if scale is None else scale)

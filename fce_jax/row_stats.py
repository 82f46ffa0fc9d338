"""Pass A over a chunk of float32 logits: per-row statistics, with no float reduction of compiler-chosen order.

For rows i of the chunk (blocks of BR rows, a sequential loop over V in blocks of BV columns) the kernel keeps
the running max `m_i` and, per (row, slot j), the elementwise accumulators

    S[i, j] = sum over blocks of 2**((z - m_i) * log2 e)     (rescaled when m_i moves)
    Q[i, j] = sum over blocks of w_c * (z_c - z_y)             (label smoothing only)

plus the exact target logit z_y and the first argmax. The [rows, BV] partials are summed by
`head.pairwise_sum` in a fixed order. Twin: fce_torch/row_stats.py.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import fastmath as fm
from .fastmath import LOG2E
from .pallas_call import call, interpret_mode

BLOCK_ROWS = 2
BLOCK_V = 1024
F32 = jnp.float32


def logit_transform(r, softcap, asm):
    """Float32 logits (bias added) -> z (softcapped); also returns t = tanh(r / cap) for the derivative."""
    if softcap is None:
        return r, r
    t = fm.tanh(fm.div(r, softcap, asm), asm)
    return fm.mul(t, softcap, asm), t


def _row_stats_kernel(z_ref, bias_ref, ry_ref, by_ref, cw_ref, m_ref, zy_ref, amax_ref, s_ref, *q_ref,
                      n_rows, vocab, softcap, has_bias, has_cw, has_q, asm):
    br, bv = BLOCK_ROWS, BLOCK_V
    r0 = pl.program_id(0) * br
    rows = r0 + lax.iota(jnp.int32, br)
    row_ok = rows < n_rows
    rs = pl.ds(r0, br)
    r_y = pltriton.load(ry_ref.at[rs], mask=row_ok, other=0.0)
    if has_bias:
        r_y = r_y + pltriton.load(by_ref.at[rs], mask=row_ok, other=0.0)
    z_y, _ = logit_transform(r_y, softcap, asm)

    def body(k, carry):
        m, arg, s, q = carry
        c0 = k * bv
        cols = c0 + lax.iota(jnp.int32, bv)
        col_ok = cols < vocab
        r = pltriton.load(z_ref.at[rs, pl.ds(c0, bv)], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if has_bias:
            r = r + pltriton.load(bias_ref.at[pl.ds(c0, bv)], mask=col_ok, other=0.0).astype(F32)[None, :]
        z, _ = logit_transform(r, softcap, asm)
        z = jnp.where(col_ok[None, :], z, -jnp.inf)

        blk_max = jnp.max(z, axis=1)
        blk_arg = jnp.min(jnp.where(z == blk_max[:, None], cols[None, :], jnp.iinfo(jnp.int32).max), axis=1)
        arg = jnp.where(blk_max > m, blk_arg, arg)
        m_new = jnp.maximum(m, blk_max)
        rescale = fm.ex2((m - m_new) * LOG2E, asm)
        e = fm.ex2((z - m_new[:, None]) * LOG2E, asm)
        s = fm.fma(s, rescale[:, None], e, asm)
        if has_q:
            d = jnp.where(col_ok[None, :], z - z_y[:, None], 0.0)
            if has_cw:
                w = pltriton.load(cw_ref.at[pl.ds(c0, bv)], mask=col_ok, other=0.0)
                q = fm.fma(w[None, :], d, q, asm)
            else:
                q = q + d
        return m_new, arg, s, q

    init = (jnp.full((br,), -jnp.inf, F32), jnp.zeros((br,), jnp.int32), jnp.zeros((br, bv), F32),
            jnp.zeros((br, bv), F32))
    m, arg, s, q = lax.fori_loop(0, pl.cdiv(vocab, bv), body, init)

    pltriton.store(m_ref.at[rs], m, mask=row_ok)
    pltriton.store(zy_ref.at[rs], z_y, mask=row_ok)
    pltriton.store(amax_ref.at[rs], arg, mask=row_ok)
    part_ok = jnp.broadcast_to(row_ok[:, None], (br, bv))
    pltriton.store(s_ref.at[rs, :], s, mask=part_ok)
    if has_q:
        pltriton.store(q_ref[0].at[rs, :], q, mask=part_ok)


def row_stats(z, bias, y, class_weights, *, softcap, smoothing):
    """Per-row statistics of the float32 logits `z` [n, V]; y [n] targets.

    Returns (m [n], z_y [n], argmax [n] int32, S partials [n, BV], Q partials [n, BV] or None).
    """
    n, vocab = z.shape
    y_safe = jnp.where((y >= 0) & (y < vocab), y, 0)
    r_y = jnp.take_along_axis(z, y_safe[:, None], axis=1)[:, 0]
    b_y = bias[y_safe].astype(F32) if bias is not None else r_y
    dummy = jnp.zeros((1,), F32)
    out_shape = [jax.ShapeDtypeStruct((n,), F32), jax.ShapeDtypeStruct((n,), F32),
                 jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n, BLOCK_V), F32)]
    if smoothing:
        out_shape.append(jax.ShapeDtypeStruct((n, BLOCK_V), F32))
    if n == 0:
        outs = [jnp.zeros(o.shape, o.dtype) for o in out_shape]
        return (*outs[:4], outs[4] if smoothing else None)
    outs = call(_row_stats_kernel, out_shape=out_shape, grid=(pl.cdiv(n, BLOCK_ROWS),),
                n_rows=n, vocab=vocab, softcap=softcap, has_bias=bias is not None,
                has_cw=class_weights is not None, has_q=smoothing, asm=not interpret_mode())(
        z, dummy if bias is None else bias, r_y, b_y, dummy if class_weights is None else class_weights)
    return (*outs[:4], outs[4] if smoothing else None)

"""The fused engine's forward as Pallas kernels (the Triton lowering on the GPU): the logits GEMM with the
same statistics epilogue as fce_torch's, instruction for instruction, and the merge of its per-tile partials
(docs/NUMERICS.md, "The fused engine"). Twin: fce_torch/kernels/logit_tiles.py.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fce_core.config import GEMM, GEMM_INTERPRETER, GEMM_SHORT, LOGITS_PINGPONG_MOSAIC, TILE_ROWS, short
from fce_core.rows import safe_targets

from .. import arrays

from . import fastmath as fm
from .fastmath import LOG2E
from .launch import call, interpret_mode
from .logit_tiles_mgpu import mosaic_logit_tiles, pingpong_supports, supports
from .row_stats import logit_transform
from ..sums import pairwise_sum

F32 = jnp.float32
I32_MAX = jnp.iinfo(jnp.int32).max


def row_sum(v):
    """The sum over the columns (a power of two) of v [rows, W] by fce_torch's fixed pairwise tree."""
    rows, w = v.shape
    while w > 1:
        w //= 2
        v = jnp.sum(v.reshape(rows, w, 2), axis=2)
    return v.reshape(rows)


def _logit_tiles_kernel(x_ref, w_ref, bias_ref, y_ref, cw_ref, row0_ref, *refs, n_rows, vocab, hidden, n_tiles,
                        transform, has_bias, has_cw, has_q, has_pz, store, precision, asm, cfg):
    e_ref, m_ref, s_ref, arg_ref, zy_ref, *extra = refs[-(5 + has_q + has_pz):]
    bm, bn, bk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    # Row blocks vary fastest: the programs that run together share one W tile, and the chunk's X stays in L2.
    pid = pl.program_id(0)
    n_m = pl.cdiv(n_rows, bm)
    t = pid // n_m
    r0 = (pid % n_m) * bm
    c0 = t * bn
    rows = r0 + lax.iota(jnp.int32, bm)
    cols = c0 + lax.iota(jnp.int32, bn)
    row_ok = rows < n_rows
    col_ok = cols < vocab
    rs, cs = pl.ds(r0, bm), pl.ds(c0, bn)

    def k_step(k, acc):
        k0 = k * bk
        k_ok = (k0 + lax.iota(jnp.int32, bk) < hidden) | (hidden % bk == 0)
        a = pltriton.load(x_ref.at[rs, pl.ds(k0, bk)], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = pltriton.load(w_ref.at[cs, pl.ds(k0, bk)], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=F32)

    acc = lax.fori_loop(0, pl.cdiv(hidden, bk), k_step, jnp.zeros((bm, bn), F32))
    r = acc
    if has_bias:
        r = r + pltriton.load(bias_ref.at[cs], mask=col_ok, other=0.0).astype(F32)[None, :]
    z, _ = logit_transform(r, transform, asm)
    # Per-element work that changes no value is skipped where it can be: the column mask in every tile but a
    # partial last one, the target's column where no row of the block has its target in the tile.
    partial = c0 + bn > vocab
    z = lax.cond(partial, lambda: jnp.where(col_ok[None, :], z, -jnp.inf), lambda: z)
    m_t = jnp.max(z, axis=1)
    y = pltriton.load(y_ref.at[rs], mask=row_ok, other=-1)

    def put(ref, v):
        pltriton.store(ref.at[rs, pl.ds(t, 1)], v[:, None], mask=row_ok[:, None])

    put(m_ref, m_t)
    # z's own reductions before e exists: z and e live together only where the head needs z - m_t
    put(arg_ref, jnp.min(jnp.where(z == m_t[:, None], cols[None, :], I32_MAX), axis=1))
    put(zy_ref, lax.cond(jnp.max(((y >= c0) & (y < c0 + bn)).astype(jnp.int32)) > 0,
                         lambda: jnp.max(jnp.where(cols[None, :] == y[:, None], z, -jnp.inf), axis=1),
                         lambda: jnp.full((bm,), -jnp.inf, F32)))
    # e and the sums a half tile at a time, as in fce_torch's epilogue: z, e and z - m_t of the whole tile at once
    # cost 8.49 ms against 6.16 at (8192, 640, 262144) on the H100. Each sum's last pair is the halves' trees.
    halves = [_half_sums(z_h, m_t, c0 + i * (bn // 2), partial, e_ref, cw_ref, row0_ref[0] + r0, row_ok,
                         vocab=vocab, has_cw=has_cw, has_q=has_q, has_pz=has_pz, store=store, asm=asm)
              for i, z_h in enumerate(jnp.split(z, 2, axis=1))]
    (s_l, q_l, pz_l), (s_r, q_r, pz_r) = halves
    put(s_ref, s_l + s_r)
    if has_q:
        put(extra[0], q_l + q_r)
    if has_pz:
        put(extra[-1], pz_l + pz_r)


def _half_sums(z, m_t, c0, partial, e_ref, cw_ref, e_row0, row_ok, *, vocab, has_cw, has_q, has_pz, store, asm):
    """s, q and pz (None where not asked for) of the columns c0 .. c0 + W of a tile, given their z (-inf past V)
    and the tile's maxima, and its e stored from row e_row0: the kernel's arithmetic on part of the columns."""
    w = z.shape[1]
    cs = pl.ds(c0, w)
    col_ok = c0 + lax.iota(jnp.int32, w) < vocab
    d = z - m_t[:, None]
    e = fm.ex2(d * LOG2E, asm)
    s = row_sum(e)
    if store:
        pltriton.store(e_ref.at[pl.ds(e_row0, z.shape[0]), cs], e.astype(e_ref.dtype),
                       mask=row_ok[:, None] & col_ok[None, :])
    q = pz = None
    if has_q or has_pz:
        d = lax.cond(partial, lambda: jnp.where(col_ok[None, :], d, 0.0), lambda: d)
    if has_q:
        d_w = d
        if has_cw:
            d_w = fm.mul(pltriton.load(cw_ref.at[cs], mask=col_ok, other=0.0)[None, :], d, asm)
        q = row_sum(d_w)
    if has_pz:
        pz = row_sum(fm.mul(e, d, asm))
    return s, q, pz


def _merge_tiles_kernel(m_ref, s_ref, q_ref, pz_ref, wt_ref, big_ref, zy_ref, *out_refs, n_rows, n_tiles, vocab,
                        has_q, has_pz, has_cw, tile_n, asm):
    us_ref, *extra = out_refs
    br, bt = TILE_ROWS.block, 128
    r0 = pl.program_id(0) * br
    t0 = pl.program_id(1) * bt
    tiles = t0 + lax.iota(jnp.int32, bt)
    row_ok = r0 + lax.iota(jnp.int32, br) < n_rows
    ok = row_ok[:, None] & (tiles < n_tiles)[None, :]
    rs, block = pl.ds(r0, br), (pl.ds(r0, br), pl.ds(t0, bt))
    big = pltriton.load(big_ref.at[rs], mask=row_ok, other=0.0)
    m_t = pltriton.load(m_ref.at[block], mask=ok, other=0.0)
    s_t = pltriton.load(s_ref.at[block], mask=ok, other=0.0)
    shift = m_t - big[:, None]
    f = fm.ex2(shift * LOG2E, asm)
    pltriton.store(us_ref.at[block], fm.mul(s_t, f, asm), mask=ok)
    if has_pz:
        pz_t = pltriton.load(pz_ref.at[block], mask=ok, other=0.0)
        pltriton.store(extra[-1].at[block], fm.mul(fm.fma(shift, s_t, pz_t, asm), f, asm), mask=ok)
    if has_q:
        zy = pltriton.load(zy_ref.at[rs], mask=row_ok, other=0.0)
        if has_cw:
            w_t = pltriton.load(wt_ref.at[pl.ds(t0, bt)], mask=tiles < n_tiles, other=0.0)
        else:  # the tile's column count
            w_t = jnp.minimum(vocab - tiles * tile_n, tile_n).astype(F32)
        q_t = pltriton.load(q_ref.at[block], mask=ok, other=0.0)
        pltriton.store(extra[0].at[block], fm.fma(m_t - zy[:, None], w_t[None, :], q_t, asm), mask=ok)


def gemm_config(cfg=None, rows=None):
    """The logits GEMM's tiles: `cfg`, else the GPU's (its launch for a chunk of at most SHORT_ROWS `rows`), or
    the interpreter's small ones."""
    if cfg is not None:
        return cfg
    if interpret_mode():
        return GEMM_INTERPRETER
    return GEMM_SHORT if short(rows) else GEMM


def takes_pingpong(x, store, into, cfg):
    """Whether the launch `cfg` asks for the Mosaic GPU ping-pong kernel (which runs where `pingpong_supports`
    also holds: 16-bit operands among its rules): `cfg.mosaic`, or on the GPU rows of at most
    `cfg.pingpong_max_hidden` columns whose tile values are stored (`store`), not into a kept dZ (`into`); the
    config tells why."""
    return cfg.mosaic or (not interpret_mode() and store and into is None and x.shape[1] <= cfg.pingpong_max_hidden)


def logit_tiles(x, w, bias, y, class_weights, *, spec, transform, precision, into=None, row0=0,
                out_rows=None, store=True, cfg=None, row0_multiple=1):
    """The fused logits GEMM of the rows x [n, H] against w [V, H]. `y` [n]: the targets, read as 0 where
    outside [0, V) (`fce_core.rows.safe_targets`: here an XLA op before the kernel, in fce_torch in its kernel,
    where torch's ops would cost the host). Returns (the exp-scaled tile values: rows [row0, row0 + n) of
    `into`, updated, or of a new [out_rows, V] array in x's dtype (default: the n rows alone; its other rows
    undefined), None without `store`; the [n, T] partials {m, s, amax, zy[, q][, pz]} of the T = ceil(V /
    tile_n) tiles). With `cfg.mosaic` (opt-in) it runs on Mosaic GPU, with the same bits: on the ping-pong
    kernel (LOGITS_PINGPONG_MOSAIC, fce_torch's schedule) where `logit_tiles_mgpu.pingpong_supports` says it
    applies, else on the split-tile kernel where `logit_tiles_mgpu.supports` does (`row0_multiple`: what a
    traced row0 is known to be a multiple of). Without `cfg.mosaic`, the ping-pong kernel where `takes_pingpong`
    and `pingpong_supports` say so (GEMM: at H <= `pingpong_max_hidden`)."""
    cfg = gemm_config(cfg, x.shape[0])
    y_safe = safe_targets(arrays, y, w.shape[0])
    places = dict(into=into, out_rows=out_rows, row0=row0, row0_multiple=row0_multiple)
    if takes_pingpong(x, store, into, cfg) and pingpong_supports(x, w, bias, class_weights, transform, cfg,
                                                                 LOGITS_PINGPONG_MOSAIC, has_pz=spec.pz, **places):
        return mosaic_logit_tiles(x, w, y_safe, has_q=spec.q, has_pz=spec.pz, store=store, cfg=cfg, into=into,
                                  row0=row0, out_rows=out_rows, pingpong=LOGITS_PINGPONG_MOSAIC)
    if cfg.mosaic and supports(x, w, bias, class_weights, transform, cfg, **places):
        return mosaic_logit_tiles(x, w, y_safe, has_q=spec.q, has_pz=spec.pz, store=store, cfg=cfg, bias=bias,
                                  class_weights=class_weights, temperature=transform.temperature, into=into,
                                  row0=row0, out_rows=out_rows)
    n, hidden = x.shape
    vocab = w.shape[0]
    n_tiles = pl.cdiv(vocab, cfg.tile_n)
    names = ["m", "s", "amax", "zy"] + [k for k, on in (("q", spec.q), ("pz", spec.pz)) if on]
    part = {k: jax.ShapeDtypeStruct((n, n_tiles), jnp.int32 if k == "amax" else F32) for k in names}
    new_shape = (n if out_rows is None else out_rows, vocab) if store else (1, 1)
    e_shape = jax.ShapeDtypeStruct(into.shape if into is not None else new_shape, x.dtype)
    if n == 0:
        return (into if into is not None else jnp.zeros(e_shape.shape, e_shape.dtype),
                {k: jnp.zeros(s.shape, s.dtype) for k, s in part.items()})
    dummy = jnp.zeros((1,), F32)
    args = [x, w, dummy if bias is None else bias, y_safe, dummy if class_weights is None else class_weights,
            jnp.asarray(row0, jnp.int32).reshape(1)]
    aliases = {}
    if into is not None:
        aliases[len(args)] = 0
        args.append(into)
    e, *parts = call(_logit_tiles_kernel, out_shape=[e_shape, *part.values()],
                     grid=(pl.cdiv(n, cfg.tile_m) * n_tiles,), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                     input_output_aliases=aliases, n_rows=n, vocab=vocab, hidden=hidden, n_tiles=n_tiles,
                     transform=transform, has_bias=bias is not None, has_cw=class_weights is not None,
                     has_q=spec.q, has_pz=spec.pz, store=store, precision=precision, asm=not interpret_mode(),
                     cfg=cfg)(*args)
    return e if store else None, dict(zip(names, parts))


def merge_tiles(parts, vocab, tile_weights=None, cfg=None, zy=None):
    """The rows' statistics {m, s, zy, amax[, q][, pz]} ([n] each, as `row_stats` + `pairwise_sum` give them)
    from the [n, T] partials of `logit_tiles` (see fce_torch's `merge_tiles`, and its `zy`)."""
    tile_n = gemm_config(cfg).tile_n
    m_t = parts["m"]
    n, n_tiles = m_t.shape
    big = jnp.max(m_t, axis=1)
    first = jnp.argmax(m_t == big[:, None], axis=1)
    stats = {"m": big, "zy": jnp.max(parts["zy"], axis=1) if zy is None else zy,
             "amax": jnp.take_along_axis(parts["amax"], first[:, None], axis=1)[:, 0]}
    names = [k for k in ("s", "q", "pz") if k in parts]
    if n == 0:
        return {**stats, **{k: jnp.zeros((0,), F32) for k in names}}
    dummy = jnp.zeros((1,), F32)
    units = call(_merge_tiles_kernel, out_shape=[jax.ShapeDtypeStruct(m_t.shape, F32) for _ in names],
                 grid=(pl.cdiv(n, TILE_ROWS.block), pl.cdiv(n_tiles, 128)), num_warps=TILE_ROWS.num_warps,
                 n_rows=n, n_tiles=n_tiles, vocab=vocab, has_q="q" in parts, has_pz="pz" in parts,
                 has_cw=tile_weights is not None, tile_n=tile_n, asm=not interpret_mode())(
        m_t, parts["s"], parts.get("q", dummy), parts.get("pz", dummy),
        dummy if tile_weights is None else tile_weights, big, stats["zy"])
    stats.update({k: pairwise_sum(v) for k, v in zip(names, units)})
    return stats

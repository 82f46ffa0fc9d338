"""The vocab-parallel merge as a Pallas kernel: [P, rows] partials from every device -> the rows' statistics,
in axis-index order, as fce_torch's kernel does (docs/NUMERICS.md, "Vocabulary parallelism").
Twin: fce_torch/kernels/merge.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fce_core.config import HEAD

from . import fastmath as fm
from .fastmath import LOG2E
from .launch import call, interpret_mode

F32 = jnp.float32


def _merge_kernel(m_ref, s_ref, amax_ref, q_ref, pz_ref, off_ref, m_out, s_out, amax_out, *refs, n_rows, n_shards,
                  has_q, has_pz, asm, block):
    q_out = refs[0] if has_q else None
    pz_out = refs[-1] if has_pz else None
    r0 = pl.program_id(0) * block
    ok = r0 + lax.iota(jnp.int32, block) < n_rows
    rs = pl.ds(r0, block)

    def load(ref, r, other=0.0):  # a static shard index as an int32 scalar, as Pallas' discharge rules expect
        return pltriton.load(ref.at[np.int32(r), rs], mask=ok, other=other)

    big = jnp.full((block,), -jnp.inf, F32)
    for r in range(n_shards):
        big = jnp.maximum(big, load(m_ref, r))
    s = q = pz = jnp.zeros((block,), F32)
    arg = jnp.full((block,), -1, jnp.int32)
    for r in range(n_shards):
        m_r, s_r = load(m_ref, r), load(s_ref, r)
        f = fm.ex2((m_r - big) * LOG2E, asm)  # 0 for an empty shard (m_r = -inf)
        if has_pz:
            shift = jnp.where(m_r > -jnp.inf, m_r - big, 0.0)
            pz = fm.fma(fm.fma(shift, s_r, load(pz_ref, r), asm), f, pz, asm)
        s = fm.fma(s_r, f, s, asm)
        if has_q:
            q = q + load(q_ref, r)
        a_r = load(amax_ref, r, 0) + off_ref[np.int32(r)]
        arg = jnp.where((arg < 0) & (m_r == big), a_r, arg)
    pltriton.store(m_out.at[rs], big, mask=ok)
    pltriton.store(s_out.at[rs], s, mask=ok)
    pltriton.store(amax_out.at[rs], arg, mask=ok)
    if has_q:
        pltriton.store(q_out.at[rs], q, mask=ok)
    if has_pz:
        pltriton.store(pz_out.at[rs], pz, mask=ok)


def merge(parts, offsets, cfg=HEAD):
    """`parts`: the shards' statistics {m, s, amax[, q][, pz]}, each [P, n] (rank order); `offsets` [P] int32 the
    shards' first columns. Returns the rows' statistics {m, s, amax[, q][, pz]} ([n] each)."""
    n_shards, n = parts["m"].shape
    names = ["m", "s", "amax"] + [k for k in ("q", "pz") if k in parts]
    if n == 0:
        return {k: jnp.zeros((0,), parts[k].dtype) for k in names}
    m = parts["m"]
    outs = call(_merge_kernel, out_shape=[jax.ShapeDtypeStruct((n,), parts[k].dtype) for k in names],
                grid=(pl.cdiv(n, cfg.block),), num_warps=cfg.num_warps, n_rows=n, n_shards=n_shards,
                has_q="q" in parts, has_pz="pz" in parts, asm=not interpret_mode(), block=cfg.block)(
        m, parts["s"], parts["amax"], parts.get("q", m), parts.get("pz", m), offsets)
    return dict(zip(names, outs))

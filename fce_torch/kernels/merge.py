"""Vocab parallelism in Triton: the P shards' row partials (max, sum of exponentials, argmax, Q, P) -> the
rows' statistics, merged sequentially in rank order (docs/NUMERICS.md, "Vocabulary parallelism").
Twin: fce_jax/kernels/merge.py.
"""
import torch
import triton
import triton.language as tl

from fce_core.config import HEAD
from fce_core.plan import cdiv

from . import fastmath as fm
from .fastmath import LOG2E
from .launch import launched


@launched
@triton.jit
def _merge_kernel(m_ptr, s_ptr, amax_ptr, q_ptr, pz_ptr, off_ptr, m_out, s_out, amax_out, q_out, pz_out, n_rows,
                  P: tl.constexpr, HAS_Q: tl.constexpr, HAS_PZ: tl.constexpr, BLOCK: tl.constexpr,
                  ASM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n_rows
    big = tl.full([BLOCK], float("-inf"), tl.float32)
    for r in tl.static_range(P):
        big = tl.maximum(big, tl.load(m_ptr + r * n_rows + rows, mask=ok, other=0.0))
    s = tl.zeros([BLOCK], tl.float32)
    q = tl.zeros([BLOCK], tl.float32)
    pz = tl.zeros([BLOCK], tl.float32)
    arg = tl.full([BLOCK], -1, tl.int32)
    for r in tl.static_range(P):
        m_r = tl.load(m_ptr + r * n_rows + rows, mask=ok, other=0.0)
        s_r = tl.load(s_ptr + r * n_rows + rows, mask=ok, other=0.0)
        f = fm.ex2((m_r - big) * LOG2E, ASM)  # 0 for an empty shard (m_r = -inf)
        if HAS_PZ:
            shift = tl.where(m_r > float("-inf"), m_r - big, 0.0)
            shifted = fm.fma(shift, s_r, tl.load(pz_ptr + r * n_rows + rows, mask=ok, other=0.0), ASM)
            pz = fm.fma(shifted, f, pz, ASM)
        s = fm.fma(s_r, f, s, ASM)
        if HAS_Q:
            q = q + tl.load(q_ptr + r * n_rows + rows, mask=ok, other=0.0)
        a_r = tl.load(amax_ptr + r * n_rows + rows, mask=ok, other=0) + tl.load(off_ptr + r)
        arg = tl.where((arg < 0) & (m_r == big), a_r, arg)
    tl.store(m_out + rows, big, mask=ok)
    tl.store(s_out + rows, s, mask=ok)
    tl.store(amax_out + rows, arg, mask=ok)
    if HAS_Q:
        tl.store(q_out + rows, q, mask=ok)
    if HAS_PZ:
        tl.store(pz_out + rows, pz, mask=ok)


def merge(parts, offsets, cfg=HEAD):
    """`parts`: the shards' statistics {m, s, amax[, q][, pz]}, each [P, n] (rank order); `offsets` [P] int32 the
    shards' first columns. Returns the rows' statistics {m, s, amax[, q][, pz]} ([n] each)."""
    n_shards, n = parts["m"].shape
    out = {k: torch.empty(n, device=v.device, dtype=v.dtype) for k, v in parts.items()}
    if n:
        m = parts["m"]
        _merge_kernel[(cdiv(n, cfg.block),)](
            m, parts["s"], parts["amax"], parts.get("q", m), parts.get("pz", m), offsets,
            out["m"], out["s"], out["amax"], out.get("q", out["m"]), out.get("pz", out["m"]), n,
            P=n_shards, HAS_Q="q" in parts, HAS_PZ="pz" in parts, BLOCK=cfg.block, ASM=fm.ASM,
            num_warps=cfg.num_warps)
    return out

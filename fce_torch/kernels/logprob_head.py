"""The token log-prob head in Triton: a chunk's row statistics -> log p(y), the entropy, E[z], and the gradient
coefficients for the cotangents g (of logp) and h (of the entropy): a = -g, b = g, d = -h, mu = E[z]
(docs/NUMERICS.md, "The head kernels"). Ignored rows give 0. Twin: fce_jax/kernels/logprob_head.py.
"""
import torch
import triton
import triton.language as tl

from fce_core.config import HEAD
from fce_core.plan import cdiv

from . import fastmath as fm
from .fastmath import LN2
from .flce_head import row_lse
from .launch import launched

ROW_OUTPUTS = ("lse", "logp", "entropy", "mu", "a", "b", "c", "d")


@launched
@triton.jit
def _logprob_head_kernel(m_ptr, s_ptr, zy_ptr, pz_ptr, y_ptr, g_ptr, h_ptr,
                         lse_ptr, logp_ptr, ent_ptr, mu_ptr, a_ptr, b_ptr, c_ptr, d_ptr,
                         n_rows, V, ignore_index, HAS_PZ: tl.constexpr, HAS_G: tl.constexpr, HAS_H: tl.constexpr,
                         BLOCK: tl.constexpr, ASM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n_rows
    y, valid, in_range, s, lg, lse, l1 = row_lse(m_ptr, s_ptr, zy_ptr, y_ptr, rows, ok, V, ignore_index, ASM)
    m = tl.load(m_ptr + rows, mask=ok, other=0.0)
    logp = -l1
    # A target outside [0, V) (only reachable with validate=False) poisons its row: NaN, never a wrong number.
    logp = tl.where(in_range, logp, float("nan"))
    if HAS_PZ:
        ratio = fm.div(tl.load(pz_ptr + rows, mask=ok, other=0.0), s, ASM)
        ent = fm.fma(lg, LN2, -ratio, ASM)
        mu = m + ratio
    else:
        ent = tl.zeros([BLOCK], tl.float32)
        mu = ent
    g = tl.zeros([BLOCK], tl.float32)
    h = tl.zeros([BLOCK], tl.float32)
    if HAS_G:
        g = tl.load(g_ptr + rows, mask=ok, other=0.0)
    if HAS_H:
        h = tl.load(h_ptr + rows, mask=ok, other=0.0)
    a = tl.where(in_range, -g, float("nan"))
    tl.store(lse_ptr + rows, lse, mask=ok)
    tl.store(logp_ptr + rows, tl.where(valid, logp, 0.0), mask=ok)
    tl.store(ent_ptr + rows, tl.where(valid, ent, 0.0), mask=ok)
    tl.store(mu_ptr + rows, mu, mask=ok)
    tl.store(a_ptr + rows, tl.where(valid, a, 0.0), mask=ok)
    tl.store(b_ptr + rows, tl.where(valid, g, 0.0), mask=ok)
    tl.store(c_ptr + rows, tl.zeros([BLOCK], tl.float32), mask=ok)
    tl.store(d_ptr + rows, tl.where(valid, -h, 0.0), mask=ok)


def logprob_head(stats, y, g, h, *, ignore_index, vocab, asm=fm.ASM, cfg=HEAD):
    """Run the head on one chunk's rows. `stats`: the chunk's m, s, zy (and pz for the entropy); `g`, `h`: the
    rows' cotangents of logp and of the entropy (each or None). Returns a dict of float32 [rows] tensors named
    ROW_OUTPUTS (d, mu only where the entropy is computed)."""
    m = stats["m"]
    n = m.shape[0]
    out = {k: torch.empty(n, device=m.device, dtype=torch.float32) for k in ROW_OUTPUTS}
    pz = stats.get("pz")
    if n:
        _logprob_head_kernel[(cdiv(n, cfg.block),)](
            m, stats["s"], stats["zy"], m if pz is None else pz, y, m if g is None else g, m if h is None else h,
            *(out[k] for k in ROW_OUTPUTS), n, vocab, ignore_index, HAS_PZ=pz is not None, HAS_G=g is not None,
            HAS_H=h is not None, BLOCK=cfg.block, ASM=asm, num_warps=cfg.num_warps)
    if pz is None:
        del out["d"], out["mu"]
    return out

"""The fixed-order sum every float reduction of fce goes through. Twin: fce_jax/sums.py.

In torch the tree runs as one Triton kernel per level of at most `PAIRWISE.block_cols` columns (one launch
for the usual widths), not as log2(width) slicing adds: the slices cost a launch each, and at small shapes
the host's launches, not the GPU, set the time (tools/profile_torch.py measures both). The adjacent-pairs
tree of a width 2^a is the tree of its subtrees over aligned blocks of 2^b columns, so the blocked sum adds
the same pairs in the same order. Under torch.compile tracing the slicing adds run instead (the compiler
fuses them; same bits).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from torch._subclasses.fake_tensor import is_fake

from fce_core.config import PAIRWISE, PAIRWISE_INTERPRETER
from fce_core.plan import cdiv

from .kernels import fastmath as fm
from .kernels.launch import launched


def traced(t):
    """Whether `t` is being traced (torch.compile's Dynamo, or AOTAutograd's fake / functional tensors), so
    no kernel may run on it: only torch ops, or opaque custom ops. Fake and functional tensors are subclasses,
    so a plain tensor or parameter skips `is_fake`'s walk (microseconds a call, paid per launch at small N)."""
    return torch.compiler.is_compiling() or (type(t) not in _PLAIN and is_fake(t))


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a parameter made of a fake tensor is a FakeTensor itself


@triton.jit
def row_sum(v, BM: tl.constexpr, W: tl.constexpr, LOG2_W: tl.constexpr, ASM: tl.constexpr):
    """The sum over the W (a power of two) columns of v [BM, W] by the fixed pairwise tree of `pairwise_sum`
    (adjacent columns first): each step adds pairs, so no compiler chooses the order. On the GPU (ASM) a pair is
    summed by a reduction over its axis of two: one add of the two, either way round (IEEE addition commutes;
    no identity is added, so -0 stays -0: tests/test_sm90_registers.py reads it from the PTX). Where the pair's
    halves lie in other lanes of the warp (in the wgmma layout, the pairs 4 and 8 columns wide) that is a warp
    shuffle, where a split would move the whole tile through shared memory (in the logits GEMM's epilogue 32
    rounds of two barriers). The interpreter splits the pairs: its reductions (numpy's) start from +0."""
    for i in tl.static_range(LOG2_W):
        if ASM:
            v = tl.sum(tl.reshape(v, [BM, W >> (i + 1), 2]), axis=2)
        else:
            a, b = tl.split(tl.reshape(v, [BM, W >> (i + 1), 2]))
            v = a + b
    return tl.reshape(v, [BM])


@launched
@triton.jit
def _pairwise_sum_kernel(x_ptr, out_ptr, n_rows, n, s_row, s_col, n_out, BR: tl.constexpr, BW: tl.constexpr,
                         LOG2_BW: tl.constexpr, ASM: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BW + tl.arange(0, BW)
    rows64 = rows.to(tl.int64)
    v = tl.load(x_ptr + rows64[:, None] * s_row + cols.to(tl.int64)[None, :] * s_col,
                mask=(rows < n_rows)[:, None] & (cols < n)[None, :], other=0.0)
    total = fm.to_dtype(row_sum(v, BR, BW, LOG2_BW, ASM), out_ptr.dtype.element_ty, ASM)  # rounded once, to out's
    tl.store(out_ptr + rows64 * n_out + tl.program_id(1), total, mask=rows < n_rows)


def pairwise_sum(x, cfg=None, out=None):
    """Sum over the last axis by a fixed pairwise tree (zero-padded to a power of two): x[0::2] + x[1::2].
    With `out` (contiguous, of x's leading shape, any floating dtype) the sum is rounded once into it and
    `out` returned, so that no sum in x's dtype is allocated (the dX slices' float32 planes summed straight
    into the bfloat16 dX)."""
    cfg = cfg or (PAIRWISE if fm.ASM else PAIRWISE_INTERPRETER)
    n = x.shape[-1]
    lead = x.shape[:-1]
    if out is not None and (out.shape != lead or not out.is_contiguous() or not out.dtype.is_floating_point):
        raise ValueError(f"pairwise_sum: out must be a contiguous floating tensor of shape {tuple(lead)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if n == 0 or x.numel() == 0:
        return x.new_zeros(lead) if out is None else out.zero_()
    if not x.dtype.is_floating_point:
        raise TypeError(f"pairwise_sum sums floating-point arrays, got {x.dtype}")
    if traced(x):
        return sliced_sum(x) if out is None else out.copy_(sliced_sum(x))
    v = x.reshape(-1, n)  # a view wherever the leading axes collapse (the dX planes' permutation does)
    while n > 1:
        width = min(1 << (n - 1).bit_length(), cfg.block_cols)
        n_out = cdiv(n, width)
        rows = max(1, min(v.shape[0], cfg.block // width))
        rows = 1 << (rows.bit_length() - 1)
        into_out = n_out == 1 and out is not None
        level = out.view(-1, 1) if into_out else torch.empty(v.shape[0], n_out, device=x.device, dtype=x.dtype)
        _pairwise_sum_kernel[(cdiv(v.shape[0], rows), n_out)](
            v, level, v.shape[0], n, v.stride(0), v.stride(1), n_out, BR=rows, BW=width,
            LOG2_BW=width.bit_length() - 1, ASM=fm.ASM, num_warps=cfg.num_warps)
        v, n = level, n_out
    if out is None:
        return v.reshape(lead)  # [rows, 1]
    return out if x.shape[-1] > 1 else out.copy_(v.reshape(lead))  # one column: no level ran


def sliced_sum(x):
    """`pairwise_sum` by slicing adds, x[..., 0::2] + x[..., 1::2] (for the compiler to trace and fuse)."""
    n = x.shape[-1]
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]

"""The flags of fce_torch's one host check of the values (checks.py) in one launch: the torch expression
took ten small ops, each a launch that the host pays at small shapes. One program walks every target and
class weight, so the counts need no second pass nor atomics. Beside the flags it writes the FLCE head's
reduction scalars (`fce_core.rows.reduction_scalars`), so that the engine needs no host count for them."""
import torch
import triton
import triton.language as tl

from fce_core.config import VALUE_FLAGS

from .launch import launched


@launched
@triton.jit
def _value_flags_kernel(y_ptr, n, vocab, ignore_index, cw_ptr, n_cw, out_ptr, scalars_ptr, HAS_CW: tl.constexpr,
                        BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    bad = tl.zeros([BLOCK], tl.int64)
    valid = tl.zeros([BLOCK], tl.int64)
    for i in range(0, n, BLOCK):
        idx = i + lanes
        y = tl.load(y_ptr + idx, mask=idx < n, other=ignore_index)
        kept = y != ignore_index
        bad = tl.maximum(bad, (kept & ((y < 0) | (y >= vocab))).to(tl.int64))
        valid += kept.to(tl.int64)
    n_valid = tl.sum(valid, axis=0)
    tl.store(out_ptr, tl.max(bad, axis=0))
    tl.store(out_ptr + 1, n_valid)
    # float32 [D, n, W_sum] without class weights: the count and the vocabulary rounded to nearest, as the
    # host's conversion and the torch ops of `reduction_scalars` round them
    tl.store(scalars_ptr, n_valid.to(tl.float32))
    tl.store(scalars_ptr + 1, n_valid.to(tl.float32))
    tl.store(scalars_ptr + 2, tl.zeros([], tl.float32) + vocab)  # int32 vocab, or a constexpr 1
    if HAS_CW:
        odd = tl.zeros([BLOCK], tl.int64)
        for i in range(0, n_cw, BLOCK):
            idx = i + lanes
            c = tl.load(cw_ptr + idx, mask=idx < n_cw, other=0.0)
            odd = tl.maximum(odd, ((c - c) != 0.0).to(tl.int64))  # NaN and inf: c - c is NaN
        tl.store(out_ptr + 2, tl.max(odd, axis=0))


def value_flags(targets, vocab, ignore_index, class_weights=None, cfg=VALUE_FLAGS):
    """(flags, scalars): flags int64 [2] (or [3] with class weights): whether a target other than ignore_index
    is outside [0, vocab), the number of targets that are not ignore_index, and whether a class weight is not
    finite; scalars float32 [3]: that number twice and vocab (the reduction scalars without class weights)."""
    out = torch.empty(2 if class_weights is None else 3, device=targets.device, dtype=torch.int64)
    scalars = torch.empty(3, device=targets.device, dtype=torch.float32)
    cw = targets if class_weights is None else class_weights
    _value_flags_kernel[(1,)](targets, targets.numel(), vocab, ignore_index, cw, cw.numel(), out, scalars,
                              HAS_CW=class_weights is not None, BLOCK=cfg.block, num_warps=cfg.num_warps)
    return out, scalars

"""Gradients handed to autograd: dtype(float32(grad) * g), in one pass, into a new tensor or in place.
Twin: fce_jax/kernels/grad_scale.py (XLA reuses the buffer itself, so JAX has no in-place form)."""
import torch
import triton
import triton.language as tl

from fce_core.config import GRAD_SCALE
from fce_core.plan import cdiv

from . import fastmath as fm
from .launch import launched


@launched
@triton.jit
def _scale_cast_kernel(src_ptr, dst_ptr, g_ptr, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr)
    v = tl.load(src_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, fm.to_dtype(v * g, dst_ptr.dtype.element_ty, ASM), mask=ok)


@triton.jit
def _scale_part(t_ptr, g, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < n
        v = tl.load(t_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(t_ptr + offs, fm.to_dtype(v * g, t_ptr.dtype.element_ty, ASM), mask=ok)


@launched
@triton.jit
def _scale_in_place_kernel(a_ptr, b_ptr, c_ptr, g_ptr, n_a, n_b, n_c, BLOCK: tl.constexpr, ASM: tl.constexpr):
    # program_id(1) picks the tensor: one launch for dX, dW and db, which the host pays per launch at small N
    g = tl.load(g_ptr)
    if g != 1.0:  # decided on the device: loss.backward() (g = 1) costs a launch, not a pass over dW
        part = tl.program_id(1)
        if part == 0:
            _scale_part(a_ptr, g, n_a, BLOCK, ASM)
        elif part == 1:
            _scale_part(b_ptr, g, n_b, BLOCK, ASM)
        else:
            _scale_part(c_ptr, g, n_c, BLOCK, ASM)


def as_grad(grad, dtype, g=None, cfg=GRAD_SCALE):
    """A new tensor dtype(float32(grad) * g) (exact when g == 1); `grad` is untouched, so a second backward
    (retain_graph=True) starts from the same saved values. Without g: grad rounded to dtype."""
    if grad is None:
        return None
    if g is None:
        return grad.to(dtype)
    out = torch.empty(grad.shape, device=grad.device, dtype=dtype)
    n = grad.numel()
    if n:
        _scale_cast_kernel[(cdiv(n, cfg.block),)](grad.contiguous(), out, g.to(torch.float32).reshape(1),
                                                        n, BLOCK=cfg.block, ASM=fm.ASM, num_warps=cfg.num_warps)
    return out


MAX_IN_PLACE = 3  # dX, dW, db


def scale_in_place(grads, g, cfg=GRAD_SCALE):
    """Each tensor of `grads` (at most MAX_IN_PLACE, contiguous, that nothing reads afterwards) =
    its dtype(float32(it) * g) in place (the bits of `as_grad(t, t.dtype, g)`), all in one launch. Returns
    grads."""
    if len(grads) > MAX_IN_PLACE:
        raise ValueError(f"scale_in_place takes at most {MAX_IN_PLACE} tensors, got {len(grads)}")
    live = [t for t in grads if t.numel()]
    if live:
        blocks = max(cdiv(t.numel(), cfg.block) for t in live)
        pad = MAX_IN_PLACE - len(live)  # slots past the grid's second axis: never read
        _scale_in_place_kernel[(min(blocks, cfg.max_programs or blocks), len(live))](
            *live, *[live[0]] * pad, g.to(torch.float32).reshape(1), *[t.numel() for t in live], *[0] * pad,
            BLOCK=cfg.block, ASM=fm.ASM, num_warps=cfg.num_warps)
    return grads


def kept_weight_grad(dw, dtype):
    """The dW to keep for the backward: a float32 accumulator of a bfloat16 weight is rounded now (bfloat16
    has float32's range, and the accumulator's memory is released before the backward); otherwise dw as is (a
    float16 dW could underflow before the backward applies a loss scale)."""
    if dw is None or dtype != torch.bfloat16 or dw.dtype == dtype:
        return dw
    return dw.to(dtype)


def kept_weight_grad_dtype(plan, dtype):
    """The dtype of `kept_weight_grad`'s dW under `plan` for a weight of `dtype` (the ops' fake functions)."""
    return dtype if plan.single_product(True) or dtype == torch.bfloat16 else torch.float32

"""Gradients handed to autograd: dtype(float32(grad) * g), in one pass, into a new tensor or in place.
Twin: fce_jax/kernels/grad_scale.py (XLA reuses the buffer itself, so JAX has no in-place form)."""
import torch
import triton
import triton.language as tl

from fce_core.config import GRAD_SCALE
from fce_core.plan import cdiv

from . import fastmath as fm


@triton.jit
def _scale_cast_kernel(src_ptr, dst_ptr, g_ptr, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr)
    v = tl.load(src_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, fm.to_dtype(v * g, dst_ptr.dtype.element_ty, ASM), mask=ok)


@triton.jit
def _scale_in_place_kernel(t_ptr, g_ptr, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
    g = tl.load(g_ptr)
    if g != 1.0:  # decided on the device: loss.backward() (g = 1) costs a launch, not a pass over dW
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < n
            v = tl.load(t_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(t_ptr + offs, fm.to_dtype(v * g, t_ptr.dtype.element_ty, ASM), mask=ok)


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


def scale_in_place(grad, g, cfg=GRAD_SCALE):
    """grad = grad.dtype(float32(grad) * g) in place (the bits of `as_grad(grad, grad.dtype, g)`), for a
    contiguous grad that nothing reads afterwards. Returns grad."""
    n = grad.numel()
    if n:
        blocks = cdiv(n, cfg.block)
        _scale_in_place_kernel[(min(blocks, cfg.max_programs or blocks),)](
            grad, g.to(torch.float32).reshape(1), n, BLOCK=cfg.block, ASM=fm.ASM, num_warps=cfg.num_warps)
    return grad


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

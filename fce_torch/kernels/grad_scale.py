"""Gradients handed to autograd: dtype(float32(grad) * g), in one pass. Twin: fce_jax/kernels/grad_scale.py."""
import torch
import triton
import triton.language as tl

from fce_core.config import GRAD_SCALE

from . import fastmath as fm


@triton.jit
def _scale_cast_kernel(src_ptr, dst_ptr, g_ptr, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr)
    v = tl.load(src_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, fm.to_dtype(v * g, dst_ptr.dtype.element_ty, ASM), mask=ok)


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
        _scale_cast_kernel[(triton.cdiv(n, cfg.block),)](grad.contiguous(), out, g.to(torch.float32).reshape(1),
                                                        n, BLOCK=cfg.block, ASM=fm.ASM, num_warps=cfg.num_warps)
    return out


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

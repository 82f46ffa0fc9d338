"""Gradients handed to autodiff: dtype(float32(grad) * g), in one pass. Twin: fce_torch/kernels/grad_scale.py."""
import jax.numpy as jnp


def as_grad(grad, dtype, g=None):
    """dtype(float32(grad) * g) (exact when g == 1). Without g: grad rounded to dtype."""
    if grad is None:
        return None
    if g is None:
        return grad.astype(dtype)
    return (grad.astype(jnp.float32) * g.astype(jnp.float32)).astype(dtype)


def kept_weight_grad(dw, dtype):
    """The dW to keep for the backward: a float32 accumulator of a bfloat16 weight is rounded now (bfloat16
    has float32's range, and the accumulator's memory is released before the backward); otherwise dw as is (a
    float16 dW could underflow before the backward applies a loss scale)."""
    if dw is None or dtype != jnp.bfloat16 or dw.dtype == dtype:
        return dw
    return dw.astype(dtype)

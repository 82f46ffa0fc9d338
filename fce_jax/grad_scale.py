"""Gradients handed to autodiff: dtype(float32(grad) * g), in one pass. Twin: fce_torch/grad_scale.py."""
import jax.numpy as jnp


def as_grad(grad, dtype, g=None):
    """dtype(float32(grad) * g) (exact when g == 1). Without g: grad rounded to dtype."""
    if grad is None:
        return None
    if g is None:
        return grad.astype(dtype)
    return (grad.astype(jnp.float32) * g.astype(jnp.float32)).astype(dtype)

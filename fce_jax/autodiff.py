"""The engine's sweeps paired with ``jax.custom_vjp``, in the two shapes of fce_torch/autodiff.py:

- `precomputed`: the forward sweep of a scalar loss also computes dX, dW, db (the plain primal call, outside
  differentiation, computes the loss only); the backward scales them by the cotangent, one rounding;
- `recompute`: the forward computes the outputs only; the backward sweeps again with the outputs'
  cotangents, row by row.

The static parts (the function that sweeps, the frozen options) are the non-differentiated arguments; every
array, the integer targets and the class weights too, is a primal argument whose cotangent is None.
"""
import functools

import jax
import jax.numpy as jnp

from .kernels.grad_scale import as_grad, kept_weight_grad

F32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def precomputed(run, opt, x, w, bias, *data):
    """(loss, *extras) of `run(opt, x, w, bias, *data, grads=...) -> (loss, extras, dx, dw, db)`, a scalar
    loss whose gradients `run` computes in the forward pass; the extras carry no gradient."""
    loss, extras, *_ = run(opt, x, w, bias, *data, grads=(False, False, False))
    return (loss, *extras)


def _precomputed_fwd(run, opt, x, w, bias, *data):
    loss, extras, dx, dw, db = run(opt, x, w, bias, *data, grads=(True, True, bias is not None))
    # Zero-size arrays carry the parameters' dtypes (residuals must be arrays).
    tags = (jnp.zeros((0,), w.dtype), None if bias is None else jnp.zeros((0,), bias.dtype))
    return (loss, *extras), (dx, kept_weight_grad(dw, w.dtype), db, tags, len(data))


def _precomputed_bwd(run, opt, res, cotangents):
    dx, dw, db, (w_tag, b_tag), n_data = res
    g = cotangents[0].astype(F32)
    return (as_grad(dx, dx.dtype, g), as_grad(dw, w_tag.dtype, g),
            None if db is None else as_grad(db, b_tag.dtype, g), *([None] * n_data))


precomputed.defvjp(_precomputed_fwd, _precomputed_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def recompute(forward, backward, opt, x, w, bias, *data):
    """`forward(opt, x, w, bias, *data)`'s outputs; the VJP is `backward(opt, x, w, bias, *data, cotangents)
    -> (dx, dw, db)` in the parameters' dtypes."""
    return forward(opt, x, w, bias, *data)


def _recompute_fwd(forward, backward, opt, x, w, bias, *data):
    return forward(opt, x, w, bias, *data), (x, w, bias, data)


def _recompute_bwd(forward, backward, opt, res, cotangents):
    x, w, bias, data = res
    dx, dw, db = backward(opt, x, w, bias, *data, cotangents=cotangents)
    return (dx, dw, db, *([None] * len(data)))


recompute.defvjp(_recompute_fwd, _recompute_bwd)

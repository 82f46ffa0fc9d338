"""fce_core.arrays for JAX arrays."""
import jax.numpy as jnp

from .sums import pairwise_sum

where = jnp.where
stack = jnp.stack
concat = jnp.concatenate
pairwise_sum = pairwise_sum


def count(mask):
    return jnp.sum(mask.astype(jnp.int32))


def cumsum(a):
    return jnp.cumsum(a.astype(jnp.int32))


def invert_permutation(pos):
    return jnp.zeros_like(pos).at[pos].set(jnp.arange(pos.shape[0], dtype=pos.dtype), unique_indices=True)


def f32(a):
    return jnp.asarray(a).astype(jnp.float32)


def full_like(a, value):
    return jnp.full_like(a, value)


def take_rows(z, idx):
    return jnp.take_along_axis(z, idx[:, None], axis=1)[:, 0]


def pad_to(v, n):
    return jnp.pad(v, (0, n - v.shape[0]))

"""The argument checks of the JAX twin: `fce_core.contract` on JAX arrays, and the value checks where the
values are concrete. Twin: fce_torch/checks.py."""
import jax
import jax.numpy as jnp
import numpy as np

from fce_core.contract import ArrayDesc, check_arrays, class_weights_error, resolve_engine, target_error

from .kernels.launch import interpret_mode


def describe(a):
    """The `ArrayDesc` of an array (JAX, numpy or a tracer; None for anything else)."""
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        return None
    dt = jnp.dtype(a.dtype)
    kind = ("float" if jnp.issubdtype(dt, jnp.floating) else "complex" if jnp.issubdtype(dt, jnp.complexfloating)
            else "bool" if dt == jnp.bool_ else "int" if jnp.issubdtype(dt, jnp.integer) else "other")
    return ArrayDesc(tuple(a.shape), dt.name, kind)


def engine_for(engine, x, **options):
    """`fce_core.contract.resolve_engine` for a call on x (its dtype; the GPU where kernels are not interpreted)
    with these options."""
    return resolve_engine(engine, dtype=describe(x).dtype, gpu=not interpret_mode(), **options)


def check_tensors(x, weight, targets, bias=None, class_weights=None):
    """Shapes and dtypes of the inputs (ValueError naming the argument). Returns (H, V)."""
    return check_arrays(describe(x), describe(weight), describe(targets), describe(bias), describe(class_weights),
                        array="array")


def check_vocab_shard(x, targets, weight, vocab_parallel):
    """Inside ``jax.shard_map``: a weight that varies along a mesh axis x and targets do not is a vocabulary
    shard, which needs ``vocab_parallel`` naming that axis (ValueError otherwise, before the target range check
    that such a shard would fail with a misleading message)."""
    shard_axes = jax.typeof(weight).mat.varying - jax.typeof(x).mat.varying - jax.typeof(targets).mat.varying
    unnamed = shard_axes - (set() if vocab_parallel is None else {vocab_parallel.axis_name})
    if unnamed:
        raise ValueError(f"weight varies along the mesh axis {sorted(unnamed)} and x does not: a vocabulary "
                         "shard needs vocab_parallel=fce_jax.VocabParallel(axis_name)")


def _concrete(a):
    return a is not None and not isinstance(a, jax.core.Tracer)


def check_values(targets, vocab, ignore_index, class_weights=None):
    """Out-of-range targets and non-finite class weights raise ValueError when the values are concrete (under
    tracing an out-of-range row gives a NaN loss instead). vocab None: the range is not known here (a shard)."""
    if vocab is not None and _concrete(targets):
        t = np.asarray(targets)
        if np.any(((t < 0) | (t >= vocab)) & (t != ignore_index)):
            raise target_error(vocab, ignore_index)
    if _concrete(class_weights) and not np.all(np.isfinite(np.asarray(class_weights, np.float32))):
        raise class_weights_error()

"""Plain ``jax.jit`` with sharded inputs: a weight split over V along a mesh axis runs vocab-parallel.

Pallas kernels are opaque to XLA's partitioner, which would otherwise replicate their operands. Under an
Explicit-axes mesh (``jax.make_mesh``'s default) the shardings are in the types at trace time, so the public
functions read them: when the weight is split over its first dimension along one mesh axis (``P(axis,
None)``), the call runs in an internal ``jax.shard_map`` with `VocabParallel(axis)`. The rows of x (and the
targets) may be split along another axis (data parallel): "mean" then takes the global counts as its
`normalizer`, and the partial losses are summed in a fixed order of that axis. The compiled program then
holds no [V, H]- or [N, V]-sized collective or replicated buffer. Other layouts run as given.
"""
import jax
import jax.numpy as jnp
from jax._src.lax.parallel import all_gather_invariant  # the public all_gather types its result varying
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from fce_core.vocab import ordered_total

from .vocab_parallel import VocabParallel

F32 = jnp.float32


def layout(x, weight, targets, rows_may_split=True):
    """(mesh, vocab axis, row axis or None) when `weight` is split over V along one Explicit mesh axis, x's
    and the targets' only split (if any) is along another axis on their first dimension; else None."""
    tw = jax.typeof(weight)
    sharding = getattr(tw, "sharding", None)
    if not isinstance(sharding, NamedSharding) or tw.mat.varying:  # inside shard_map: the caller's business
        return None
    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None, None)
    vax = spec[0]
    if not isinstance(vax, str) or spec[1] is not None or mesh.axis_types[mesh.axis_names.index(vax)] != \
            AxisType.Explicit:
        return None
    lead = []
    for a in (x, targets):
        s = tuple(getattr(jax.typeof(a).sharding, "spec", ())) + (None,) * a.ndim
        lead.append(s[0])
        if any(d is not None for d in s[1:a.ndim]):
            return None
    rax = lead[0]
    if rax != lead[1] or rax == vax or (rax is not None and (not rows_may_split or not isinstance(rax, str))):
        return None
    return mesh, vax, rax


def ordered_sum(v, axis):
    """The sum of `v` over the mesh axis in index order (bitwise reproducible)."""
    return ordered_total(all_gather_invariant(v, axis))


def specs(mesh_layout, x, *vectors):
    """(in_specs of x, the targets and the [V] vectors, spec of row outputs)."""
    _, vax, rax = mesh_layout
    lead = P(rax, *([None] * (x.ndim - 1)))
    rows = P(rax, *([None] * (x.ndim - 2)))
    return (lead, rows, *(None if v is None else P(vax) for v in vectors)), rows


def run(mesh_layout, body, args, in_specs, out_specs):
    """`body(*args, vp)` in a shard_map over the mesh (None-valued args passed through)."""
    mesh, vax, _ = mesh_layout
    present = [i for i, a in enumerate(args) if a is not None]

    def inner(*present_args):
        full = list(args)
        for i, a in zip(present, present_args):
            full[i] = a
        return body(*full, VocabParallel(vax))

    return jax.shard_map(inner, mesh=mesh, in_specs=tuple(in_specs[i] for i in present), out_specs=out_specs,
                         check_vma=True)(*(args[i] for i in present))


def weight_spec(mesh_layout):
    return P(mesh_layout[1], None)

"""Vocab parallelism (docs/SPEC.md §5) inside ``jax.shard_map``: the weight is split over the vocabulary along
a mesh axis, x and the targets are the same along it.

Each device runs the engine on its shard; `VocabComm` (the axis's all-gather under
`fce_core.vocab.VocabShards`, which holds the logic of both twins) is what the engine asks of the axis: the
owner's target logit, the merge of the row partials, the class weights whole, dX as the index-ordered float32
sum of the shards' parts. dW and db stay local. Only copies cross the wire (all-gathers, typed invariant so that
``check_vma=True`` holds); no float is summed in a collective. Twin: fce_torch/vocab_parallel.py.
"""
from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax
from jax._src.lax.parallel import all_gather_invariant  # the public all_gather types its result varying

from fce_core.vocab import VocabShards, equal_offsets

from . import arrays
from .kernels.merge import merge

F32 = jnp.float32


@dataclass(frozen=True)
class VocabParallel:
    """`vocab_parallel=VocabParallel(axis_name)`, inside ``jax.shard_map``: the weight (and bias, class weights)
    passed is this device's shard, in axis-index order, of a weight split in equal shards over V along the
    mesh axis `axis_name`; x and the targets are the same along it."""
    axis_name: str


class VocabComm(VocabShards):
    """The collectives of one vocab-parallel sweep along `axis_name`, with shards of `vocab_local` columns."""

    def __init__(self, axis_name, vocab_local):
        self.axis_name = axis_name
        size = lax.axis_size(axis_name)
        super().__init__(equal_offsets(vocab_local, size), lax.axis_index(axis_name) * vocab_local,
                         arrays, merge)

    def gather(self, t):
        return all_gather_invariant(t, self.axis_name)

    def first_columns(self, like):
        return jnp.asarray(self.offsets[:-1], jnp.int32)


def comm_for(vocab_parallel, vocab_local):
    """The VocabComm of a `VocabParallel` (None: not vocab-parallel)."""
    if vocab_parallel is None:
        return None
    if not isinstance(vocab_parallel, VocabParallel):
        raise ValueError(f"vocab_parallel must be a fce_jax.VocabParallel, got {type(vocab_parallel).__name__}")
    return VocabComm(vocab_parallel.axis_name, vocab_local)

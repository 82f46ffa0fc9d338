"""Vocab parallelism (docs/SPEC.md §5): the weight is split over the vocabulary across the ranks of a process
group, x and the targets are the same on every rank.

Each rank runs the engine on its shard; `VocabComm` (the group's all-gather under `fce_core.vocab.VocabShards`,
which holds the logic of both twins) is what the engine asks of the group: the owner's target logit, the merge
of the row partials, the class weights whole, dX as the rank-ordered float32 sum of the shards' parts. dW and
db stay local. Only copies cross the wire (all-gathers); no float is summed in a collective.
Twin: fce_jax/vocab_parallel.py.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fce_core.vocab import VocabShards, equal_offsets

from . import arrays
from .kernels.merge import merge

F32 = torch.float32
# all_gather_single is the newer name of all_gather_into_tensor (torch 2.13 deprecates the latter)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass(frozen=True)
class VocabParallel:
    """`vocab_parallel=VocabParallel(group)`: the weight (and bias, class weights) passed is this rank's
    contiguous shard, in rank order, of a weight split over V across `group` (None: the default group), in
    shards of equal size. A DTensor weight sharded over V (``Shard(0)``) needs no VocabParallel: its mesh and
    (possibly uneven) shard sizes are read from it."""
    group: object = None


class VocabComm(VocabShards):
    """The collectives of one vocab-parallel sweep over `group`, whose shards start at `offsets[r]`."""

    def __init__(self, group, offsets, device):
        self.group, self.device = group, device
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if len(offsets) != size + 1:
            raise ValueError(f"vocab_parallel: {len(offsets) - 1} shard offsets for a group of {size}")
        super().__init__(offsets, offsets[rank], arrays, merge)

    def check_shards(self, vocab_local):
        """ValueError unless every rank's shard has the columns the offsets say (one host synchronization:
        part of `validate`)."""
        sizes = self.gather(torch.tensor([vocab_local], device=self.device)).view(-1).tolist()
        expected = [b - a for a, b in zip(self.offsets, self.offsets[1:])]
        if sizes != expected:
            raise ValueError(f"vocab_parallel: the ranks' weight shards have {sizes} rows; expected {expected} "
                             "(VocabParallel needs equal shards in rank order; a DTensor weight may be uneven)")

    def gather(self, t):
        out = t.new_empty((self.size * t.numel(),))
        _all_gather(out, t.contiguous().view(-1), group=self.group)
        return out.view(self.size, *t.shape)

    def first_columns(self, like):
        return torch.tensor(self.offsets[:-1], device=like.device, dtype=torch.int32)


def comm_for(group_name, offsets, weight, validate):
    """The VocabComm of a custom op's arguments (None: not vocab-parallel); with `validate`, the shards'
    sizes are checked."""
    if group_name is None:
        return None
    comm = VocabComm(dist.distributed_c10d._resolve_process_group(group_name), offsets, weight.device)
    if validate:
        comm.check_shards(weight.shape[0])
    return comm


def resolve(weight, bias, class_weights, vocab_parallel):
    """(weight, bias, class weights, group name, shard offsets) for the ops: DTensor shards (``Shard(0)`` on a 1-D
    mesh) become their local tensors (differentiably: the weight's gradient comes back as a DTensor), a
    `VocabParallel` names the group of equal shards; otherwise (weight, bias, class weights, None, [])."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(weight, dtensor):
        mesh, placements = weight.device_mesh, weight.placements
        if mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard(0):
            raise ValueError(f"a DTensor weight must be sharded over V on a 1-D mesh (Shard(0)); got {placements}")
        group, vocab = mesh.get_group(), weight.shape[0]
        step = -(-vocab // mesh.size())  # torch.chunk's split, which Shard(0) follows
        offsets = [min(r * step, vocab) for r in range(mesh.size() + 1)]
        local = [t.to_local() if isinstance(t, dtensor) else t for t in (weight, bias, class_weights)]
        return (*local, group.group_name, offsets)
    if vocab_parallel is None:
        return weight, bias, class_weights, None, []
    if not isinstance(vocab_parallel, VocabParallel):
        raise ValueError(f"vocab_parallel must be a fce_torch.VocabParallel, got {type(vocab_parallel).__name__}")
    group = vocab_parallel.group or dist.group.WORLD
    return weight, bias, class_weights, group.group_name, equal_offsets(weight.shape[0], dist.get_world_size(group))


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor

"""What a vocab-parallel sweep asks of the shards (docs/SPEC.md §5), once for both twins: each twin's
`VocabComm` subclass gives the all-gather along its group or mesh axis (`gather`, rank order), this shard's
first column (`offset`), its array namespace (`xp`, fce_core.arrays) and its merge kernel (`merge_kernel`,
kernels/merge.py). Everything crossing the shards is a copy; every sum over them runs in rank order."""


def equal_offsets(vocab_local, size):
    """Column boundaries [P + 1] of P equal shards of `vocab_local` columns (a `VocabParallel`'s shards)."""
    return [r * vocab_local for r in range(size + 1)]


def ordered_total(parts):
    """parts[0] + parts[1] + ... in that order (a sum over ranks that is the same on every rank and run)."""
    out = parts[0]
    for r in range(1, parts.shape[0]):
        out = out + parts[r]
    return out


class VocabShards:
    def __init__(self, offsets, offset, xp, merge_kernel):
        self.offsets = list(offsets)
        self.size = len(self.offsets) - 1
        self.vocab = self.offsets[-1]
        self.width = max(b - a for a, b in zip(self.offsets, self.offsets[1:]))
        self.offset, self.xp, self.merge_kernel = offset, xp, merge_kernel

    def gather(self, t):
        """[P, *t.shape]: every shard's t, in rank order."""
        raise NotImplementedError

    def first_columns(self, like):
        """The shards' first columns as an int32 array on `like`'s device."""
        raise NotImplementedError

    def local_targets(self, y):
        """Targets as this shard's columns (outside [0, V_local) where another shard owns them)."""
        return y - self.offset

    def owns(self, y, vocab_local):
        """Whether this shard (`vocab_local` columns) holds each row's target."""
        local = self.local_targets(y)
        return (local >= 0) & (local < vocab_local)

    def owner_values(self, v, y, vocab_local):
        """Every row's float32 `v` from the shard that owns its target (v computed at that target on each shard,
        0 where not owned): selected, not summed."""
        parts = self.gather(self.xp.where(self.owns(y, vocab_local), v, 0.0))
        out = parts[0]
        for r in range(1, self.size):
            out = self.xp.where((y >= self.offsets[r]) & (y < self.offsets[r + 1]), parts[r], out)
        return out

    def target_logits(self, z, y, bias):
        """The raw target logit of every row (bias added), from the shard that owns it: selected, not summed."""
        xp, local = self.xp, self.local_targets(y)
        safe = xp.where(self.owns(y, z.shape[1]), local, 0)
        r_y = xp.take_rows(z, safe)
        if bias is not None:
            r_y = r_y + xp.f32(bias[safe])
        return self.owner_values(r_y, y, z.shape[1])

    def merge(self, stats):
        """The rows' statistics from this shard's (m, s, amax, q, pz; zy, from the owner's target logit, is the
        same on every shard: the first's is taken)."""
        parts = {k: self.gather(v) for k, v in stats.items()}
        zy = parts.pop("zy")[0]
        return {**self.merge_kernel(parts, self.first_columns(stats["m"])), "zy": zy}

    def full_vector(self, v):
        """A [V_local] vector's [V] whole (for the class weights' sums and the targets' weights)."""
        parts = self.gather(self.xp.pad_to(v, self.width))
        return self.xp.concat([parts[r, :b - a] for r, (a, b) in enumerate(zip(self.offsets, self.offsets[1:]))])

    def sum_parts(self, t):
        """The rank-ordered sum of every shard's float32 `t` (dX: each shard's dZ W_shard)."""
        return ordered_total(self.gather(t))

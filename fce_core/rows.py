"""Row bookkeeping shared by both engines, over a twin's `fce_core.arrays.Arrays` namespace `xp`: the
valid-first order of the rows, the raw target logits, and the reduction scalars of the FLCE head."""
from .plan import cdiv


def valid_first(xp, y, ignore_index):
    """(pos, order, n_valid): the stable permutation that puts the valid rows (y != ignore_index) first, the
    ignored rows after them, each in their order; row i goes to pos[i], and order[j] is the row at position
    j; n_valid the count (an integer array)."""
    valid = y != ignore_index
    n_valid = xp.count(valid)
    pos = xp.where(valid, xp.cumsum(valid) - 1, n_valid + xp.cumsum(~valid) - 1)
    return pos, xp.invert_permutation(pos), n_valid


def valid_first_in_groups(xp, y, ignore_index, groups):
    """`valid_first` within each group of rows [(start, stop)] (a row stays in its group): (order, counts),
    counts the valid rows of each group (an integer array [n_groups])."""
    parts = [valid_first(xp, y[g0:g1], ignore_index)[1:] for g0, g1 in groups]
    order = xp.concat([o + g0 if g0 else o for (o, _), (g0, _) in zip(parts, groups)])
    return order, xp.stack([n for _, n in parts])


def safe_targets(xp, y, vocab):
    """The targets with every one outside [0, vocab) replaced by 0, for reading a row's target column (the
    row's loss is masked, or NaN when y is not ignore_index)."""
    return xp.where((y >= 0) & (y < vocab), y, 0)


def target_logits(xp, z, y, bias):
    """The raw target logit of each row of the float32 logits z (bias added); a row whose y is outside
    [0, V) reads column 0 (`safe_targets`)."""
    safe = safe_targets(xp, y, z.shape[1])
    r_y = xp.take_rows(z, safe)
    return r_y if bias is None else r_y + xp.f32(bias[safe])


def reduction_scalars(xp, y, class_weights, ignore_index, vocab, normalizer=None, counts=None):
    """(float32 [D, n, W_sum], w_y [N] or None): class-weighted and plain counts of the valid rows (or the
    caller's `normalizer`, a [2] float32 array (D, n)), the sum of class weights, and each row's target
    class weight. `counts`: float32 [n, n, vocab] where the twin's value check computed them on the device
    (fce_torch's, `kernels/value_flags.py`: one launch it makes anyway, instead of six small ops; the same
    float32 values, the count rounded to nearest either way); used without class weights or normalizer."""
    if counts is not None and class_weights is None and normalizer is None:
        return counts, None
    valid = y != ignore_index
    n = xp.f32(xp.count(valid))
    if class_weights is None:
        w_y, counts, w_sum = None, xp.stack([n, n]), xp.full_like(n, float(vocab))
    else:
        w_y = xp.where(valid, class_weights[safe_targets(xp, y, vocab)], 0.0)
        counts, w_sum = xp.stack([xp.pairwise_sum(w_y), n]), xp.pairwise_sum(class_weights)
    if normalizer is not None:
        counts = xp.f32(normalizer)
    return xp.concat([counts, w_sum[None]]), w_y


def tile_weights(xp, class_weights, tile_n):
    """The class weights summed per tile of `tile_n` columns (fixed pairwise order; the last tile padded with
    zeros): what the fused engine's merge needs for label smoothing (`merge_tiles`)."""
    vocab = class_weights.shape[0]
    n_tiles = cdiv(vocab, tile_n)
    return xp.pairwise_sum(xp.pad_to(class_weights, n_tiles * tile_n).reshape(n_tiles, tile_n))

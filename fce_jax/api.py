"""Public signature of `fused_lce` (docs/SPEC.md §1): checks, operand preparation, and the choice of
autodiff rule. Twin: fce_torch/api.py."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fce_core import docs
from fce_core.contract import check_normalizer, check_options
from fce_core.docs import doc
from fce_core.options import FlceOptions
from fce_core.sweeps import reduced

from . import arrays, sharding
from .autodiff import precomputed, recompute
from .checks import check_tensors, check_values, check_vocab_shard, engine_for
from .flce import rows_backward, rows_forward, run_precomputed
from .sums import pairwise_sum

F32 = jnp.float32


def normalizer_array(normalizer):
    """`normalizer` (None, a scalar or a pair (D, n)) as a float32 [2] array (no gradient)."""
    check_normalizer(normalizer)
    if normalizer is None:
        return None
    items = normalizer if isinstance(normalizer, (tuple, list)) else (normalizer, normalizer)
    items = items * 2 if len(items) == 1 else items
    return jax.lax.stop_gradient(jnp.stack([jnp.asarray(v, F32).reshape(()) for v in items]))


def match_axes(x, y, *params):
    """The parameters cast to vary along the mesh axes that x or y vary along and they do not (inside
    ``jax.shard_map``, e.g. rows split over a data axis with a replicated weight): their gradients are then
    summed along those axes by JAX, as for any replicated parameter. Outside shard_map: unchanged."""
    varying = jax.typeof(x).mat.varying | jax.typeof(y).mat.varying
    out = []
    for p in params:
        extra = () if p is None else tuple(sorted(varying - jax.typeof(p).mat.varying))
        out.append(jax.lax.pcast(p, extra, to="varying") if extra else p)
    return out


def flce_outputs(x, weight, targets, *, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                 z_loss=0.0, softcap=None, class_weights=None, normalizer=None, vocab_parallel=None,
                 token_scaling=False, chunk_rows=None, engine="auto"):
    """Checks, then (loss, z rows, lse, correct, amax) over the flattened rows, differentiable in x, weight
    and bias."""
    check_options(reduction, label_smoothing, z_loss, softcap)
    hidden, vocab = check_tensors(x, weight, targets, bias, class_weights)
    engine = engine_for(engine, x, label_smoothing=label_smoothing, softcap=softcap)
    check_vocab_shard(x, targets, weight, vocab_parallel)
    check_values(targets, vocab if vocab_parallel is None else None, ignore_index, class_weights)
    opt = FlceOptions(ignore_index=int(ignore_index), reduction=reduction, label_smoothing=float(label_smoothing),
                      z_loss=float(z_loss), softcap=None if softcap is None else float(softcap),
                      token_scaling=bool(token_scaling), chunk_rows=chunk_rows, engine=engine)
    x2 = jnp.reshape(x, (-1, hidden))
    y = jnp.reshape(targets, (-1,)).astype(jnp.int32)
    cw = None if class_weights is None else jax.lax.stop_gradient(jnp.asarray(class_weights, F32))
    norm = normalizer_array(normalizer) if reduction == "mean" else None
    static = (opt, vocab_parallel)
    weight, bias = match_axes(x2, y, weight, bias)
    if reduction == "none":
        return recompute(rows_forward, rows_backward, static, x2, weight, bias, y, cw, norm)
    loss, *extras = precomputed(run_precomputed, static, x2, weight, bias, y, cw, norm)
    return (loss, *extras)


@doc(docs.FLCE_SUMMARY, docs.FLCE_ARGS,
     framework="""\
Works under ``jax.jit``, ``jax.grad``, ``jax.value_and_grad`` and ``jax.vjp`` (a custom VJP: the forward pass
of a differentiated "mean"/"sum" loss computes the gradients, chunk by chunk; the plain primal call computes
the loss only, one GEMM per chunk).""",
     framework_args="""\
    vocab_parallel: a `fce_jax.VocabParallel(axis_name)`, inside ``jax.shard_map`` (``check_vma=True`` is
        fine): ``weight`` (and ``bias``, ``class_weights``) is this device's shard of a weight split in equal
        shards over V along that mesh axis; ``x`` and ``targets`` are the same along it (docs/SPEC.md §5).
        Every device returns the same loss and stats; dx is the full gradient, dW/db the shard's. A weight
        with NamedSharding ``P(axis, None)`` under plain ``jax.jit`` (Explicit mesh axes) is vocab-parallel
        without this argument; a weight shard inside ``shard_map`` without it is refused (ValueError).
""",
     returns="""The float32 loss (scalar, or ``targets.shape`` for "none"), and the stats dict when requested. float32
inputs follow ``jax_default_matmul_precision`` (IEEE float32 when unset).""",
     raises="""ValueError: naming the argument, for shape/dtype mismatches and bad options; for out-of-range
    targets and non-finite class weights when their values are concrete (not traced).""")
def fused_lce(x, weight, targets, *, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              z_loss=0.0, softcap=None, class_weights=None, normalizer=None, vocab_parallel=None,
              token_scaling=False, return_stats=False, chunk_rows=None, engine="auto"):
    kw = dict(bias=bias, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
              z_loss=z_loss, softcap=softcap, class_weights=class_weights, normalizer=normalizer,
              token_scaling=token_scaling, chunk_rows=chunk_rows, engine=engine)
    mesh_layout = sharding.layout(x, weight, targets) if vocab_parallel is None else None
    if mesh_layout is not None:
        loss, out_stats = _sharded(mesh_layout, x, weight, targets, kw)
    else:
        outs = flce_outputs(x, weight, targets, vocab_parallel=vocab_parallel, **kw)
        loss, out_stats = _results(targets, ignore_index, reduction, *outs)
    return (loss, out_stats) if return_stats else loss


def _results(targets, ignore_index, reduction, loss, zrow, lse, correct, amax, n_valid=None, row_axis=None):
    """(loss, stats) of `fused_lce` in the leading shape of the targets, the stats without gradient; with a
    row axis (data-parallel shards), the sums over the axis and the global count `n_valid`."""
    lead = tuple(targets.shape)
    valid = jnp.reshape(targets, (-1,)) != ignore_index
    zstat = reduced(arrays, zrow, reduction)
    if reduction == "none":
        loss, zstat, accuracy = loss.reshape(lead), zstat.reshape(lead), correct.reshape(lead)
    else:
        n_correct = pairwise_sum(correct)
        if row_axis is not None:
            loss, zstat, n_correct = (sharding.ordered_sum(v, row_axis) for v in (loss, zstat, n_correct))
        n_valid = jnp.sum(valid.astype(jnp.int32)).astype(F32) if n_valid is None else n_valid
        accuracy = jnp.where(n_valid > 0, n_correct / jnp.maximum(n_valid, 1.0), 0.0)
    out = {"lse": lse.reshape(lead), "z_loss": zstat, "accuracy": accuracy,
           "argmax": jnp.where(valid, amax, -1).reshape(lead)}
    return loss, jax.tree.map(jax.lax.stop_gradient, out)


def _sharded(mesh_layout, x, weight, targets, kw):
    """`fused_lce` of a weight split over V along a mesh axis (`sharding.layout`), in a shard_map."""
    _, vax, rax = mesh_layout
    (x_spec, t_spec, b_spec, cw_spec), rows = sharding.specs(mesh_layout, x, kw["bias"], kw["class_weights"])
    reduction, ignore_index = kw["reduction"], kw["ignore_index"]

    def body(x, w, t, b, cw, vp):
        args = {**kw, "bias": b, "class_weights": cw}
        n_valid = None
        if rax is not None:
            n_valid = sharding.ordered_sum(jnp.sum((t != ignore_index).astype(jnp.int32)).astype(F32), rax)
        if rax is not None and reduction == "mean":
            counts = normalizer_array(kw["normalizer"])
            if counts is None:
                counts = jnp.stack([_class_weighted_count(t, cw, ignore_index, vax, rax), n_valid])
            args["normalizer"] = (counts[0], counts[1])
        outs = flce_outputs(x, w, t, vocab_parallel=vp, **args)
        return _results(t, ignore_index, reduction, *outs, n_valid=n_valid, row_axis=rax)

    scalar = rows if reduction == "none" else P()
    stats_specs = {"lse": rows, "z_loss": scalar, "accuracy": scalar, "argmax": rows}
    return sharding.run(mesh_layout, body, (x, weight, targets, kw["bias"], kw["class_weights"]),
                        (x_spec, sharding.weight_spec(mesh_layout), t_spec, b_spec, cw_spec), (scalar, stats_specs))


def _class_weighted_count(t, cw, ignore_index, vax, rax):
    """D over all rows: the valid targets' class weights (the whole vector from the vocabulary shards)."""
    y = jnp.reshape(t, (-1,))
    if cw is None:
        return sharding.ordered_sum(jnp.sum((y != ignore_index).astype(jnp.int32)).astype(F32), rax)
    whole = sharding.all_gather_invariant(cw, vax).reshape(-1)
    w_y = jnp.where(y != ignore_index, whole[jnp.clip(y, 0, whole.shape[0] - 1)], 0.0)
    return sharding.ordered_sum(pairwise_sum(w_y), rax)

"""Public signature of `fused_lce` (docs/SPEC.md §1): checks, operand preparation, and the choice of op.
Twin: fce_jax/api.py."""
import torch

from fce_core import docs
from fce_core.contract import check_normalizer, check_options
from fce_core.docs import doc
from fce_core.sweeps import reduced

from . import arrays
from .checks import check_tensors, engine_for
from .flce import flce, flce_rows
from .sums import pairwise_sum
from .vocab_parallel import resolve

F32 = torch.float32


def prepare(x, weight, targets, bias=None, class_weights=None):
    """Flatten to rows, apply autocast's dtype, make operands contiguous (a copy when strided). Returns
    (x [N, H], weight, y [N] int32/int64, bias, class weights float32)."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = targets.reshape(-1)
    if y.dtype not in (torch.int32, torch.int64):
        y = y.to(torch.int64)
    cw = None if class_weights is None else class_weights.detach().to(F32).contiguous()
    return x2, weight.contiguous(), y.contiguous(), None if bias is None else bias.contiguous(), cw


def normalizer_tensor(normalizer, device):
    """`normalizer` (None, a scalar or a pair (D, n), numbers or 0-d tensors) as a float32 [2] tensor."""
    check_normalizer(normalizer)
    if normalizer is None:
        return None
    items = normalizer if isinstance(normalizer, (tuple, list)) else (normalizer, normalizer)
    items = items * 2 if len(items) == 1 else items
    return torch.stack([torch.as_tensor(v, dtype=F32, device=device).detach().reshape(()) for v in items])


def requires_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def flce_outputs(x, weight, targets, *, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                 z_loss=0.0, softcap=None, class_weights=None, normalizer=None, vocab_parallel=None,
                 token_scaling=False, validate=True, chunk_rows=None, engine="auto", lse_grad=False):
    """Checks, then (loss, z rows, lse, correct, amax) over the flattened rows, differentiable in x, weight
    and bias (and through lse when `lse_grad`). Shared by `fused_lce` and the drop-ins."""
    check_options(reduction, label_smoothing, z_loss, softcap)
    weight, bias, class_weights, vp_group, vp_offsets = resolve(weight, bias, class_weights, vocab_parallel)
    check_tensors(x, weight, targets, bias, class_weights)
    x2, w, y, b, cw = prepare(x, weight, targets, bias, class_weights)
    engine = engine_for(engine, x2, label_smoothing=label_smoothing, softcap=softcap)
    norm = normalizer_tensor(normalizer, x.device) if reduction == "mean" else None
    args = (x2, w, b, y, cw, norm, int(ignore_index), reduction, float(label_smoothing), float(z_loss),
            None if softcap is None else float(softcap), bool(token_scaling), chunk_rows, engine, bool(validate),
            vp_group, vp_offsets)
    if requires_grad(x2, w, b) and (reduction == "none" or lse_grad):
        return flce_rows(*args, bool(lse_grad))
    needs = [requires_grad(x2), requires_grad(w), b is not None and requires_grad(b)]
    return flce(*args, needs)[:5]


@doc(docs.FLCE_SUMMARY, docs.FLCE_ARGS,
     framework_args="""\
    vocab_parallel: a `fce_torch.VocabParallel(group)`: ``weight`` (and ``bias``, ``class_weights``) is this
        rank's shard of a weight split over V across the group, in rank order, equal shards; ``x`` and
        ``targets`` are the same on every rank (docs/SPEC.md §5). Every rank returns the same loss and
        stats; dx is the full gradient, dW/db the shard's. A DTensor weight sharded over V (``Shard(0)``)
        is vocab-parallel without this argument.
    validate: check that targets are in range and class weights finite (one host synchronization, which
        also counts the valid rows so that the chunks holding only ignored rows are skipped). Pass False
        under CUDA-graph capture: every chunk then runs, with the same result bits; out-of-range targets
        then give NaN rows.
""",
     returns="""The float32 loss (scalar, or ``targets.shape`` for "none"), and the stats dict when requested.
Gradients flow to ``x``, ``weight`` and ``bias`` in their own dtypes; under ``torch.no_grad()`` only the
loss is computed (one GEMM per chunk). Under autocast the GEMMs run in the autocast dtype. float32
inputs follow torch's float32 matmul setting (IEEE by default, TF32 when enabled). Works under
``torch.compile`` (``fullgraph=True`` too) and, with ``validate=False``, CUDA graphs.""",
     raises="""ValueError: naming the argument, for shape/dtype mismatches, bad options, out-of-range targets or
    non-finite class weights (the last two only when ``validate``).""")
def fused_lce(x, weight, targets, *, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              z_loss=0.0, softcap=None, class_weights=None, normalizer=None, vocab_parallel=None,
              token_scaling=False, return_stats=False, validate=True, chunk_rows=None, engine="auto"):
    lead = tuple(targets.shape) if isinstance(targets, torch.Tensor) else ()
    loss, zrow, lse, correct, amax = flce_outputs(
        x, weight, targets, bias=bias, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, class_weights=class_weights,
        normalizer=normalizer, vocab_parallel=vocab_parallel, token_scaling=token_scaling, validate=validate,
        chunk_rows=chunk_rows, engine=engine)
    if reduction == "none":
        loss = loss.view(lead)
    if not return_stats:
        return loss
    return loss, stats(targets, ignore_index, reduction, zrow, lse, correct, amax)


def stats(targets, ignore_index, reduction, zrow, lse, correct, amax):
    """The stats dict of `fused_lce` (leading shape of the targets), from the flattened rows' outputs."""
    lead = tuple(targets.shape)
    valid = targets.reshape(-1) != ignore_index
    zstat = reduced(arrays, zrow, reduction)
    if reduction == "none":
        zstat, accuracy = zstat.view(lead), correct.view(lead)
    else:
        n_valid = valid.sum().to(F32)
        accuracy = torch.where(n_valid > 0, pairwise_sum(correct) / n_valid.clamp(min=1.0), 0.0)
    argmax = torch.where(valid, amax.to(torch.int64), -1).view(lead)
    return {"lse": lse.view(lead), "z_loss": zstat, "accuracy": accuracy, "argmax": argmax}

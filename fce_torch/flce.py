"""Fused linear cross-entropy on the engine: the FLCE head, its reduction scalars and the sweeps that
autodiff.py pairs with autograd. Twin: fce_jax/flce.py."""
from typing import Optional

import torch

from fce_core.heads import StatsSpec
from fce_core.options import FlceOptions
from fce_core.plan import plan_rows

from .autodiff import absent, finish_grads, grads_fake, register_precomputed, register_recompute
from .checks import check_values
from .engine import Head, sweep
from .kernels.fastmath import ASM
from .kernels.flce_head import flce_head
from .kernels.grad_scale import kept_weight_grad
from .sums import pairwise_sum

F32 = torch.float32
Tensor = torch.Tensor
Rows = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]  # loss, z stat, lse, correct, amax
RowsAndGrads = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]  # ..., dx, dw, db


def reduction_scalars(y, class_weights, ignore_index, vocab, normalizer=None):
    """(float32 [D, n, W_sum], w_y [N] or None): class-weighted and plain counts of the valid rows (or the
    caller's `normalizer`: a [2] float32 tensor (D, n)), the sum of class weights, and each row's target
    class weight."""
    valid = y != ignore_index
    n = valid.sum().to(F32)
    if class_weights is None:
        w_y, counts, w_sum = None, torch.stack([n, n]), torch.full_like(n, float(vocab))
    else:
        w_y = torch.where(valid, class_weights[torch.where((y >= 0) & (y < vocab), y, 0)], 0.0)
        counts, w_sum = torch.stack([pairwise_sum(w_y), n]), pairwise_sum(class_weights)
    if normalizer is not None:
        counts = normalizer.to(F32)
    return torch.cat([counts, w_sum[None]]), w_y


def make_head(opt, scalars, vocab):
    """The FLCE `Head` of options `opt`: per-row inputs y, and w_y (class weights), g (loss cotangent), g_lse
    (lse cotangent) where given."""
    def fn(stats, inputs):
        out = flce_head(stats, inputs["y"], inputs.get("w_y"), inputs.get("g"), inputs.get("g_lse"), scalars,
                        opt=opt, vocab=vocab, asm=ASM)
        out["amax"] = stats["amax"]
        return out

    return Head(fn, StatsSpec(q=opt.label_smoothing > 0))


def flce_sweep(x, w, y, bias, class_weights, opt, *, grads=(False, False, False), normalizer=None, g=None,
               g_lse=None, valid_rows=None, trace=None):
    """The FLCE sweep: outputs are float32 [N] rows lse, loss, zrow, correct, a, b, c and int32 amax, all 0 on
    ignored rows (lse too, whether their chunk ran or was skipped)."""
    vocab = w.shape[0]
    scalars, w_y = reduction_scalars(y, class_weights, opt.ignore_index, vocab, normalizer)
    inputs = {"y": y}
    for name, t in (("w_y", w_y), ("g", g), ("g_lse", g_lse)):
        if t is not None:
            inputs[name] = t
    plan = plan_rows(x.shape[0], x.shape[1], vocab, x.element_size(), need_grads=any(grads), need_dw=grads[1],
                     requested=opt.chunk_rows)
    rows, dx, dw, db = sweep(x, w, bias, class_weights, make_head(opt, scalars, vocab), inputs, plan, grads=grads,
                             transform=opt.transform, ignore_index=opt.ignore_index, valid_rows=valid_rows,
                             trace=trace)
    rows["lse"] = torch.where(y != opt.ignore_index, rows["lse"], 0.0)
    return rows, dx, dw, db


def totals(rows, reduction):
    """(loss, z_loss stat) from the per-row values: fixed-order sums for "mean"/"sum", the rows for "none"."""
    if reduction == "none":
        return rows["loss"], rows["zrow"]
    return pairwise_sum(rows["loss"]), pairwise_sum(rows["zrow"])


# ---- the ops (autodiff.py has the autograd shapes) -------------------------------------------------------

def _options(ignore_index, reduction, label_smoothing, z_loss, softcap, token_scaling, chunk_rows):
    return FlceOptions(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                       z_loss=z_loss, softcap=softcap, token_scaling=token_scaling, chunk_rows=chunk_rows)


def _plan(x, w, needs, chunk_rows):
    return plan_rows(x.shape[0], x.shape[1], w.shape[0], x.element_size(), need_grads=any(needs),
                     need_dw=needs[1], requested=chunk_rows)


def _row_outputs(x, reduction):
    n = x.shape[0]
    loss = x.new_empty((n,) if reduction == "none" else (), dtype=F32)
    return (loss, torch.empty_like(loss), x.new_empty((n,), dtype=F32), x.new_empty((n,), dtype=F32),
            x.new_empty((n,), dtype=torch.int32))


def _weight_grad_dtype(x, w, needs, chunk_rows):
    """The dtype of the dW a precomputed op keeps: the weight's when one GEMM writes it or for bfloat16 (the
    float32 accumulator is rounded in the forward: `kept_weight_grad`), else float32."""
    single = _plan(x, w, needs, chunk_rows).single_product(True)
    return w.dtype if single or w.dtype == torch.bfloat16 else F32


@torch.library.custom_op("fce::flce", mutates_args=())
def flce_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor,
            class_weights: Optional[torch.Tensor], normalizer: Optional[torch.Tensor], ignore_index: int,
            reduction: str, label_smoothing: float, z_loss: float, softcap: Optional[float], token_scaling: bool,
            chunk_rows: Optional[int], validate: bool, needs: list[bool]) -> RowsAndGrads:
    """(loss, z stat, lse, correct, amax, dx, dw, db): a "mean"/"sum" loss with its gradients (`needs`)
    computed in the forward, or any loss without gradients."""
    return _flce(x, w, bias, y, class_weights, normalizer,
                 _options(ignore_index, reduction, label_smoothing, z_loss, softcap, token_scaling, chunk_rows),
                 validate, needs)


def _flce(x, w, bias, y, class_weights, normalizer, opt, validate, needs):
    with torch.autocast(x.device.type, enabled=False):
        valid_rows = check_values(y, w.shape[0], opt.ignore_index, class_weights) if validate else None
        rows, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=tuple(needs), normalizer=normalizer,
                                      valid_rows=valid_rows)
        loss, zstat = totals(rows, opt.reduction)
        dw = kept_weight_grad(dw, w.dtype)
    return (loss, zstat, rows["lse"], rows["correct"], rows["amax"],
            *(absent(x) if t is None else t for t in (dx, dw, db)))


@flce_op.register_fake
def _(x, w, bias, y, class_weights, normalizer, ignore_index, reduction, label_smoothing, z_loss, softcap,
      token_scaling, chunk_rows, validate, needs):
    dw_dtype = _weight_grad_dtype(x, w, needs, chunk_rows)
    return (*_row_outputs(x, reduction), x.new_empty(x.shape) if needs[0] else absent(x),
            w.new_empty(w.shape, dtype=dw_dtype) if needs[1] else absent(x),
            x.new_empty(w.shape[:1], dtype=F32) if needs[2] else absent(x))


register_precomputed(flce_op, 5)


@torch.library.custom_op("fce::flce_rows", mutates_args=())
def flce_rows_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor,
                 class_weights: Optional[torch.Tensor], normalizer: Optional[torch.Tensor], ignore_index: int,
                 reduction: str, label_smoothing: float, z_loss: float, softcap: Optional[float],
                 token_scaling: bool, chunk_rows: Optional[int], validate: bool,
                 lse_grad: bool) -> Rows:
    """(loss, z stat, lse, correct, amax) of a loss whose backward recomputes: "none", or any reduction with
    a differentiable lse (`lse_grad`)."""
    opt = _options(ignore_index, reduction, label_smoothing, z_loss, softcap, token_scaling, chunk_rows)
    return _flce(x, w, bias, y, class_weights, normalizer, opt, validate, [False, False, False])[:5]


@flce_rows_op.register_fake
def _(x, w, bias, y, class_weights, normalizer, ignore_index, reduction, *rest):
    return _row_outputs(x, reduction)


@torch.library.custom_op("fce::flce_rows_grads", mutates_args=())
def flce_rows_grads_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor,
                       class_weights: Optional[torch.Tensor], normalizer: Optional[torch.Tensor], ignore_index: int,
                       reduction: str, label_smoothing: float, z_loss: float, softcap: Optional[float],
                       token_scaling: bool, chunk_rows: Optional[int], validate: bool,
                       g_loss: Optional[torch.Tensor], g_lse: Optional[torch.Tensor],
                       needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db) in the parameters' dtypes for the cotangents of the loss (scalar or rows) and of lse."""
    opt = _options(ignore_index, reduction, label_smoothing, z_loss, softcap, token_scaling, chunk_rows)
    needs = [needs[0], needs[1], needs[2] and bias is not None]
    with torch.autocast(x.device.type, enabled=False):
        valid_rows = check_values(y, w.shape[0], ignore_index, class_weights) if validate else None
        g = torch.zeros(x.shape[0], device=x.device, dtype=F32) if g_loss is None else \
            g_loss.to(F32).expand(x.shape[0]).contiguous()
        _, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=tuple(needs), normalizer=normalizer,
                                   g=g, g_lse=None if g_lse is None else g_lse.to(F32).contiguous(),
                                   valid_rows=valid_rows)
    return finish_grads(dx, dw, db, x, w, bias, needs)


@flce_rows_grads_op.register_fake
def _(x, w, bias, *rest):
    return grads_fake(x, w, bias, rest[-1])


def _rows_grads(inputs, cotangents, needs):
    return flce_rows_grads_op(*inputs[:-1], cotangents[0], cotangents.get(2), needs)


register_recompute(flce_rows_op, lambda *inputs: (0, 2) if inputs[-1] else (0,), _rows_grads)

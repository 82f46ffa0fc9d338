"""Fused linear cross-entropy on the engine: the FLCE head, its reduction scalars and the sweeps that
autodiff.py pairs with autograd. Twin: fce_jax/flce.py."""
from typing import Optional

import torch

from fce_core.sweeps import flce_setup, totals
from fce_core.options import FlceOptions
from fce_core.plan import plan_rows

from .autodiff import absent, finish_grads, grads_fake, register_precomputed, register_recompute
from . import arrays
from .checks import ValueCheck
from .engine import sweep
from .kernels.flce_head import flce_head
from .kernels.grad_gemms import accumulates_pair
from .kernels.grad_scale import kept_weight_grad, kept_weight_grad_dtype
from .vocab_parallel import comm_for

F32 = torch.float32
Tensor = torch.Tensor
Rows = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]  # loss, z rows, lse, correct, amax
RowsAndGrads = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]  # ..., dx, dw, db


def flce_sweep(x, w, y, bias, class_weights, opt, *, grads=(False, False, False), normalizer=None, g=None,
               g_lse=None, check=None, comm=None, trace=None):
    """The FLCE sweep: outputs are float32 [N] rows lse, loss, zrow, correct, a, b, c and int32 amax, all 0 on
    ignored rows (lse too, whether their chunk ran or was skipped). With `comm` (vocab parallel), w, bias and
    class_weights are this rank's shard. `check`: the value check (`checks.ValueCheck`, which the sweep
    reads, engine.py), or None."""
    counts = None if check is None else check.scalars
    head, inputs, plan = flce_setup(arrays, flce_head, x.shape, x.element_size(), w.shape[0], y, class_weights, opt,
                                    need_grads=any(grads), dw_pair=accumulates_pair(w.dtype),
                                    normalizer=normalizer, g=g, g_lse=g_lse, comm=comm, counts=counts)
    rows, dx, dw, db = sweep(x, w, bias, class_weights, head, inputs, plan, grads=grads,
                             transform=opt.transform, ignore_index=opt.ignore_index, check=check, comm=comm,
                             trace=trace, engine=opt.engine)
    # the count (read by the sweep already) says whether any row is ignored: two ops fewer if none
    if check is None or check.valid_rows() != x.shape[0]:
        rows["lse"] = torch.where(y != opt.ignore_index, rows["lse"], 0.0)
    return rows, dx, dw, db


# ---- the ops (autodiff.py has the autograd shapes) -------------------------------------------------------

def _options(ignore_index, reduction, label_smoothing, z_loss, softcap, token_scaling, chunk_rows, engine):
    return FlceOptions(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                       z_loss=z_loss, softcap=softcap, token_scaling=token_scaling, chunk_rows=chunk_rows,
                       engine=engine)


def _row_outputs(x, reduction):
    n = x.shape[0]
    loss = x.new_empty((n,) if reduction == "none" else (), dtype=F32)
    return (loss, *(x.new_empty((n,), dtype=F32) for _ in range(3)), x.new_empty((n,), dtype=torch.int32))


def _flce_body(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor,
               class_weights: Optional[torch.Tensor], normalizer: Optional[torch.Tensor], ignore_index: int,
               reduction: str, label_smoothing: float, z_loss: float, softcap: Optional[float], token_scaling: bool,
               chunk_rows: Optional[int], engine: str, validate: bool, vp_group: Optional[str], vp_offsets: list[int],
               needs: list[bool]) -> RowsAndGrads:
    """(loss, z rows, lse, correct, amax, dx, dw, db): a "mean"/"sum" loss with its gradients (`needs`)
    computed in the forward, or any loss without gradients. `vp_group`/`vp_offsets`: the process group's name
    and the shards' column boundaries of a vocab-parallel call (None / [] otherwise)."""
    return _flce(x, w, bias, y, class_weights, normalizer,
                 _options(ignore_index, reduction, label_smoothing, z_loss, softcap, token_scaling, chunk_rows,
                          engine),
                 validate, comm_for(vp_group, vp_offsets, w, validate), needs)


flce_op = torch.library.custom_op("fce::flce", _flce_body, mutates_args=())


def _flce(x, w, bias, y, class_weights, normalizer, opt, validate, comm, needs):
    with torch.autocast(x.device.type, enabled=False):
        vocab = w.shape[0] if comm is None else comm.vocab
        check = ValueCheck(y, vocab, opt.ignore_index, class_weights) if validate else None
        rows, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=tuple(needs), normalizer=normalizer,
                                      check=check, comm=comm)
        loss, zrow = totals(arrays, rows, opt.reduction)
        dw = kept_weight_grad(dw, w.dtype)
    return (loss, zrow, rows["lse"], rows["correct"], rows["amax"],
            *(absent(x) if t is None else t for t in (dx, dw, db)))


@flce_op.register_fake
def _(x, w, bias, y, class_weights, normalizer, ignore_index, reduction, label_smoothing, z_loss, softcap,
      token_scaling, chunk_rows, engine, validate, vp_group, vp_offsets, needs):
    plan = plan_rows(x.shape[0], x.shape[1], w.shape[0], x.element_size(), need_grads=any(needs),
                     requested=chunk_rows, engine=engine, dw_pair=accumulates_pair(w.dtype))
    dw_dtype = kept_weight_grad_dtype(plan, w.dtype)
    return (*_row_outputs(x, reduction), x.new_empty(x.shape) if needs[0] else absent(x),
            w.new_empty(w.shape, dtype=dw_dtype) if needs[1] else absent(x),
            x.new_empty(w.shape[:1], dtype=F32) if needs[2] else absent(x))


flce = register_precomputed(flce_op, _flce_body, 5)


def _flce_rows_body(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor,
                    class_weights: Optional[torch.Tensor], normalizer: Optional[torch.Tensor], ignore_index: int,
                    reduction: str, label_smoothing: float, z_loss: float, softcap: Optional[float],
                    token_scaling: bool, chunk_rows: Optional[int], engine: str, validate: bool,
                    vp_group: Optional[str], vp_offsets: list[int], lse_grad: bool) -> Rows:
    """(loss, z rows, lse, correct, amax) of a loss whose backward recomputes: "none", or any reduction with
    a differentiable lse (`lse_grad`)."""
    opt = _options(ignore_index, reduction, label_smoothing, z_loss, softcap, token_scaling, chunk_rows, engine)
    return _flce(x, w, bias, y, class_weights, normalizer, opt, validate, comm_for(vp_group, vp_offsets, w, validate),
                 [False, False, False])[:5]


flce_rows_op = torch.library.custom_op("fce::flce_rows", _flce_rows_body, mutates_args=())


@flce_rows_op.register_fake
def _(x, w, bias, y, class_weights, normalizer, ignore_index, reduction, *rest):
    return _row_outputs(x, reduction)


@torch.library.custom_op("fce::flce_rows_grads", mutates_args=())
def flce_rows_grads_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], y: torch.Tensor,
                       class_weights: Optional[torch.Tensor], normalizer: Optional[torch.Tensor], ignore_index: int,
                       reduction: str, label_smoothing: float, z_loss: float, softcap: Optional[float],
                       token_scaling: bool, chunk_rows: Optional[int], engine: str, validate: bool,
                       vp_group: Optional[str],
                       vp_offsets: list[int], g_loss: Optional[torch.Tensor], g_lse: Optional[torch.Tensor],
                       needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db) in the parameters' dtypes for the cotangents of the loss (scalar or rows) and of lse."""
    opt = _options(ignore_index, reduction, label_smoothing, z_loss, softcap, token_scaling, chunk_rows, engine)
    needs = [needs[0], needs[1], needs[2] and bias is not None]
    comm = comm_for(vp_group, vp_offsets, w, validate)
    with torch.autocast(x.device.type, enabled=False):
        vocab = w.shape[0] if comm is None else comm.vocab
        check = ValueCheck(y, vocab, ignore_index, class_weights) if validate else None
        g = torch.zeros(x.shape[0], device=x.device, dtype=F32) if g_loss is None else \
            g_loss.to(F32).expand(x.shape[0]).contiguous()
        _, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=tuple(needs), normalizer=normalizer,
                                   g=g, g_lse=None if g_lse is None else g_lse.to(F32).contiguous(),
                                   check=check, comm=comm)
    return finish_grads(dx, dw, db, x, w, bias, needs)


@flce_rows_grads_op.register_fake
def _(x, w, bias, *rest):
    return grads_fake(x, w, bias, rest[-1])


def _rows_grads(inputs, cotangents, needs):
    return flce_rows_grads_op(*inputs[:-1], cotangents[0], cotangents.get(2), needs)


flce_rows = register_recompute(flce_rows_op, _flce_rows_body, lambda *inputs: (0, 2) if inputs[-1] else (0,),
                               _rows_grads)

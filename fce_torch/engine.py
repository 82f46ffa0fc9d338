"""The chunked engine (C3): logits GEMM -> row statistics -> head -> dlogits -> dX and dW GEMMs, per chunk.

`sweep` runs it over all rows; `FusedLCEFunction` pairs it with autograd. For "mean"/"sum" the gradients are
computed in the forward pass and the backward only scales them; for "none" the backward sweeps again with the
per-row cotangent folded into the head (four GEMMs). Twin: fce_jax/engine.py.
"""
import os
from dataclasses import dataclass

import torch

from . import gemm
from .chunking import chunk_rows
from .dlogits import accumulate_bias_grad, dlogits
from .head import MEAN, NONE, SUM, flce_head, pairwise_sum
from .row_stats import row_stats

F32 = torch.float32
# Inline PTX on the GPU; plain operations in the Triton interpreter (which cannot run assembly).
ASM = os.environ.get("TRITON_INTERPRET", "0") != "1"
_MODES = {"mean": MEAN, "sum": SUM, "none": NONE}
ROW_OUTPUTS = ("lse", "loss", "zrow", "correct", "a", "b", "c")


@dataclass(frozen=True)
class Options:
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    chunk_rows: int | None = None


def reduction_scalars(y, class_weights, ignore_index, vocab):
    """float32 [D, n, W_sum]: the class-weighted and plain counts of valid rows, and the sum of class weights."""
    valid = y != ignore_index
    n = valid.sum().to(F32)
    if class_weights is None:
        return torch.stack([n, n, torch.full_like(n, float(vocab))])
    w_y = torch.where(valid, class_weights[torch.where(valid, y, 0)], 0.0)
    return torch.stack([pairwise_sum(w_y), n, pairwise_sum(class_weights)])


def _dz_buffer(z, dtype):
    """dZ in the logits' own memory: a 16-bit row takes the first half of its float32 row."""
    if dtype == F32:
        return z
    return z.view(dtype)[:, : z.shape[1]]


def sweep(x, w, y, bias, class_weights, opt, *, grads=(False, False, False), row_cotangent=None, trace=None):
    """One pass over all rows. x [N, H], w [V, H], y [N]. `grads` = which of (dx, dw, db) to compute.

    Returns (rows, dx, dw, db): rows = dict of float32 [N] (ROW_OUTPUTS); dw is float32 when accumulated over
    several chunks, in the input dtype for a single 16-bit chunk.
    """
    n_rows, _ = x.shape
    vocab = w.shape[0]
    dev = x.device
    nc = chunk_rows(n_rows, vocab, opt.chunk_rows)
    scalars = reduction_scalars(y, class_weights, opt.ignore_index, vocab)
    rows = {k: torch.empty(n_rows, device=dev, dtype=F32) for k in ROW_OUTPUTS}
    need_dx, need_dw, need_db = grads
    dx = torch.empty_like(x) if need_dx else None
    dw = None
    db = torch.zeros(vocab, device=dev, dtype=F32) if need_db else None
    mode = _MODES[opt.reduction]
    for r0 in range(0, n_rows, nc):
        r1 = min(n_rows, r0 + nc)
        x_c, y_c = x[r0:r1], y[r0:r1]
        z = gemm.mm(x_c, w.t(), F32)
        m, zy, amax, s_part, q_part = row_stats(z, bias, y_c, class_weights, ignore_index=opt.ignore_index,
                                                softcap=opt.softcap, smoothing=opt.label_smoothing > 0, asm=ASM)
        out = {k: v[r0:r1] for k, v in rows.items()}
        flce_head(m, pairwise_sum(s_part), zy, None if q_part is None else pairwise_sum(q_part), amax, y_c,
                  class_weights, None if row_cotangent is None else row_cotangent[r0:r1], scalars, out,
                  mode=mode, ignore_index=opt.ignore_index, label_smoothing=opt.label_smoothing,
                  z_loss=opt.z_loss, vocab=vocab, asm=ASM)
        if trace is not None and r0 == 0:
            trace["logits"] = z.clone()
        if not any(grads):
            continue
        dz = _dz_buffer(z, x.dtype)
        dlogits(z, dz, bias, y_c, class_weights, out["lse"], out["a"], out["b"], out["c"],
                softcap=opt.softcap, asm=ASM)
        if trace is not None and r0 == 0:
            trace["dlogits"] = dz.clone()
        if need_dx:
            dx[r0:r1] = gemm.mm(dz, w, x.dtype)
        if need_dw:
            if dw is None:  # one chunk: the GEMM writes the dtype; several: a float32 accumulator
                dw = gemm.mm(dz.t(), x_c, w.dtype if r1 == n_rows else F32)
            else:
                gemm.addmm_(dw, dz.t(), x_c)
        if need_db:
            accumulate_bias_grad(dz, db)
    if need_dw and dw is None:
        dw = torch.zeros_like(w)
    return rows, dx, dw, db


def totals(rows, reduction):
    """(loss, z_loss stat) from the per-row values: fixed-order sums for "mean"/"sum", the rows for "none"."""
    if reduction == "none":
        return rows["loss"], rows["zrow"]
    return pairwise_sum(rows["loss"]), pairwise_sum(rows["zrow"])


def _as_grad(grad, dtype, g=None):
    """A new tensor dtype(dtype(grad) * g) (the product in float32); exact when g == 1. `grad` is untouched,
    so a second backward (retain_graph=True) starts from the same saved values."""
    if grad is None:
        return None
    if g is None:
        return grad.to(dtype)
    return grad.to(dtype, copy=True).mul_(g)


class FusedLCEFunction(torch.autograd.Function):
    """loss (and the lse row statistic) from (x [N, H], w [V, H], bias, y, class_weights)."""

    @staticmethod
    def forward(ctx, x, w, bias, y, class_weights, opt):
        grads = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        ctx.opt, ctx.grads = opt, grads
        if opt.reduction == "none":
            rows, *_ = sweep(x, w, y, bias, class_weights, opt)
            ctx.save_for_backward(x, w, bias, y, class_weights)
        else:
            rows, dx, dw, db = sweep(x, w, y, bias, class_weights, opt, grads=grads)
            ctx.save_for_backward(dx, dw, db)
            ctx.dtypes = (x.dtype, w.dtype, None if bias is None else bias.dtype)
        loss, zstat = totals(rows, opt.reduction)
        ctx.mark_non_differentiable(zstat, rows["lse"], rows["correct"])
        return loss, zstat, rows["lse"], rows["correct"]

    @staticmethod
    def backward(ctx, g_loss, *unused):
        opt = ctx.opt
        if opt.reduction == "none":
            x, w, bias, y, class_weights = ctx.saved_tensors
            _, dx, dw, db = sweep(x, w, y, bias, class_weights, opt, grads=ctx.grads,
                                  row_cotangent=g_loss.to(F32).contiguous())
            dw = _as_grad(dw, w.dtype)
            db = None if db is None else _as_grad(db, bias.dtype)
        else:
            dx, dw, db = ctx.saved_tensors
            x_dtype, w_dtype, b_dtype = ctx.dtypes
            g = g_loss.to(F32)
            dx, dw, db = _as_grad(dx, x_dtype, g), _as_grad(dw, w_dtype, g), _as_grad(db, b_dtype, g)
        return dx, dw, db, None, None, None


def debug_intermediates(x, w, y, bias=None, class_weights=None, **options):
    """The stages of one forward+backward, for `python -m parity --explain`: float32 logits and the dlogits of
    the first chunk, lse of all rows, and the final dx, dw (db)."""
    opt = Options(**options)
    trace = {}
    rows, dx, dw, db = sweep(x, w, y, bias, class_weights, opt, grads=(True, True, bias is not None), trace=trace)
    trace.update(lse=rows["lse"], dx=dx, dw=_as_grad(dw, w.dtype))
    if bias is not None:
        trace["db"] = _as_grad(db, bias.dtype)
    return trace

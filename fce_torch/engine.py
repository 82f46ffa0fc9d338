"""The chunked engine (C3): logits GEMM -> row statistics -> loss head -> dlogits -> dX and dW GEMMs.

`sweep` runs it over all rows, chunk by chunk, for any loss head (FLCE here, CPO in cpo.py): the head turns one
chunk's row statistics into its outputs and the per-row gradient coefficients a, b, c. `PrecomputedGrad`
pairs a sweep that computed the gradients in the forward pass with autograd (the backward only scales);
`FusedLCENone` serves reduction="none", whose backward sweeps again with the per-row cotangent (four GEMMs).
Twin: fce_jax/engine.py.
"""
import functools
from dataclasses import dataclass

import torch

from . import gemm
from .chunking import chunks_to_run, kept_granule, layout, plan
from .dlogits import accumulate_bias_grad, dlogits, scale_rows
from .fastmath import ASM
from .grad_scale import as_grad, kept_weight_grad
from .head import MEAN, NONE, SUM, flce_head, pairwise_sum
from .row_stats import row_stats

F32 = torch.float32
MODES = {"mean": MEAN, "sum": SUM, "none": NONE}


@dataclass(frozen=True)
class Options:
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    chunk_rows: int | None = None


def _dz_buffer(z, dtype):
    """dZ in the logits' own memory: a 16-bit row takes the first half of its float32 row."""
    if dtype == F32:
        return z
    return z.view(dtype)[:, : z.shape[1]]


def valid_first(y, ignore_index):
    """(pos, order): the stable permutation that puts the valid rows (y != ignore_index) first, the ignored
    rows after them, each in their order; row i goes to pos[i], and order[j] is the row at position j."""
    valid = y != ignore_index
    pos = torch.where(valid, valid.cumsum(0) - 1, valid.sum() + (~valid).cumsum(0) - 1)
    order = torch.empty_like(pos).scatter_(0, pos, torch.arange(y.shape[0], device=y.device))
    return pos, order


def _rows_back(t, order, n_rows):
    """Rows [0, len(t)) of the valid-first order back to the caller's n_rows; the rows past t are 0."""
    if order is None:
        return t
    return t.new_zeros((n_rows, *t.shape[1:])).index_copy_(0, order[:t.shape[0]], t)


def _add_grads(dz, x_rows, w, dx_rows, dw, db, *, need_dw, single):
    """The GEMMs of some rows' dZ: dX rows into `dx_rows` (if given), dW (+)= dZ^T X (the first writes it: in
    the dtype when it is the `single` one, else a float32 accumulator), db += column sums (if given).
    Returns dw."""
    if dx_rows is not None:
        gemm.mm(dz, w, x_rows.dtype, out=dx_rows)
    if need_dw:
        if dw is None:
            dw = gemm.mm(dz.t(), x_rows, w.dtype if single else F32)
        else:
            gemm.addmm_(dw, dz.t(), x_rows)
    if db is not None:
        accumulate_bias_grad(dz, db)
    return dw


def sweep(x, w, bias, class_weights, opt, head, row_inputs, *, grads=(False, False, False), chunking=None,
          group_rows=None, valid_rows=None, finish=None, trace=None):
    """One pass over all rows of x [N, H] with w [V, H]. `row_inputs`: per-row arrays (at least "y"), cut into
    chunks (`chunking` = (rows per chunk, store), default `plan(...)` from chunking.py; `layout` places them)
    and handed to `head(stats, inputs) -> dict` with the chunk's statistics (m, s, zy, q, amax). The head's
    outputs (which must include lse, a, b, c when gradients are asked) are concatenated over chunks.

    `valid_rows`, the host's count of rows whose y is not opt.ignore_index (None: unknown), skips the ignored
    rows: the rows are put valid-first (`valid_first`) and the full chunks past the last valid row never run
    (an ignored row adds nothing to the loss or the gradients); with store, the number that runs is rounded
    up by `chunking.kept_granule`. The outputs of the rows that do not run are 0 (so every head output must
    be per row), their dX rows too. fce_jax counts on the device and skips the same chunks (`skip_ignored`).

    With store, dZ of the rows that run is kept and the dX and dW GEMMs run once after the last chunk.
    `finish(outputs, inputs)` returns more outputs from all rows' outputs and inputs (in the caller's order);
    its "scale" [N] multiplies the kept dZ rows before the GEMMs (for a loss whose coefficients need more rows
    than a chunk holds: the head gives unit coefficients, finish the scale), so a finish with "scale" needs
    store whenever gradients are asked.

    `group_rows` (whole units of the loss, e.g. preference pairs; no skipping then) runs all this per group of
    rows (`layout` places the groups, then the chunks in each): finish sees one group, its outputs are
    concatenated over groups, and with store each group's dZ is kept and its dW added to a float32
    accumulator (the first group writes it).

    Returns (outputs, dx, dw, db) for `grads` = which of (dx, dw, db) to compute; dw is float32 when
    accumulated over several chunks or groups, in the input dtype for a single 16-bit chunk or group.
    """
    n_rows, vocab = x.shape[0], w.shape[0]
    need_dx, need_dw, need_db = grads
    nc, store = chunking or plan(n_rows, x.shape[1], vocab, x.element_size(), need_dw, opt.chunk_rows)
    store = store and any(grads)
    if group_rows is not None and any(grads) and not store:
        raise ValueError("sweep: groups need store when gradients are asked")
    g_first, n_groups = (n_rows, 1) if group_rows is None else layout(n_rows, group_rows)
    caller_inputs, order, n_run = row_inputs, None, n_rows
    first, n_chunks = layout(n_rows, nc)
    n_run_chunks = n_chunks
    if n_groups == 1 and valid_rows is not None and valid_rows < n_rows:
        _, order = valid_first(row_inputs["y"], opt.ignore_index)
        x = x[order]
        row_inputs = {k: v[order] for k, v in row_inputs.items()}
        n_run_chunks = chunks_to_run(valid_rows, first, nc, n_chunks, kept_granule(n_chunks) if store else 1)
        n_run = first + (n_run_chunks - 1) * nc  # the rows of the chunks that run
    dx = x.new_empty(n_run, x.shape[1]) if need_dx else None
    dw = None
    db = torch.zeros(vocab, device=x.device, dtype=F32) if need_db else None
    outs = []
    for gi in range(n_groups):
        g0, g1 = (0, g_first) if gi == 0 else (g_first + (gi - 1) * group_rows, g_first + gi * group_rows)
        if n_groups > 1:
            first, n_chunks = layout(g1 - g0, nc)
            n_run_chunks, g_run = n_chunks, g1 - g0
        else:
            g_run = n_run
        dz_rows = x.new_empty(g_run, vocab) if store else None
        g_outs = []
        for i in range(n_run_chunks):
            r0, r1 = (0, first) if i == 0 else (first + (i - 1) * nc, first + i * nc)  # within the group
            z = dz = None  # release the last chunk's logits before the next GEMM allocates its own
            x_c = x[g0 + r0:g0 + r1]
            inputs = {k: v[g0 + r0:g0 + r1] for k, v in row_inputs.items()}
            z = gemm.mm(x_c, w.t(), F32)
            m, zy, amax, s_part, q_part = row_stats(z, bias, inputs["y"], class_weights, softcap=opt.softcap,
                                                    smoothing=opt.label_smoothing > 0, asm=ASM)
            stats = dict(m=m, s=pairwise_sum(s_part), zy=zy, q=None if q_part is None else pairwise_sum(q_part),
                         amax=amax)
            out = head(stats, inputs)
            g_outs.append(out)
            if trace is not None and gi == i == 0:
                trace["logits"] = z.clone()
            if not any(grads):
                continue
            dz = dz_rows[r0:r1] if store else _dz_buffer(z, x.dtype)
            dlogits(z, dz, bias, inputs["y"], class_weights, out["lse"], out["a"], out["b"], out["c"],
                    softcap=opt.softcap, asm=ASM)
            if trace is not None and gi == i == 0:
                trace["dlogits"] = dz.clone()
            if not store:
                dw = _add_grads(dz, x_c, w, None if dx is None else dx[r0:r1], dw, db, need_dw=need_dw,
                                single=n_chunks == 1)
        z = dz = None
        g_out = {k: _rows_back(torch.cat([o[k] for o in g_outs]), order, n_rows) for k in g_outs[0]}
        if finish is not None:
            g_out.update(finish(g_out, {k: v[g0:g1] for k, v in caller_inputs.items()}))
        outs.append(g_out)
        if "scale" in g_out and any(grads) and not store:
            raise ValueError("sweep: a finish with a scale needs store (the chunks' dZ are gone)")
        if not store:
            continue
        if "scale" in g_out:
            scale = g_out["scale"] if order is None else g_out["scale"][order]
            scale_rows(dz_rows, scale[:g_run])
        dw = _add_grads(dz_rows, x[g0:g0 + g_run], w, None if dx is None else dx[g0:g0 + g_run], dw, db,
                        need_dw=need_dw, single=n_groups == 1)
        dz_rows = None  # release this group's dZ before the next group allocates its own
    outputs = {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
    return outputs, None if dx is None else _rows_back(dx, order, n_rows), dw, db


class PrecomputedGrad(torch.autograd.Function):
    """Autograd for a scalar loss whose gradients `run` computes in the forward pass.

    `run(x, w, bias, grads) -> (loss, extras, dx, dw, db)`; forward returns (loss, *extras) (extras carry no
    gradient); backward returns grad_output times the saved gradients.
    """

    @staticmethod
    def forward(ctx, x, w, bias, run):
        grads = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        loss, extras, dx, dw, db = run(x, w, bias, grads)
        ctx.save_for_backward(dx, kept_weight_grad(dw, w.dtype), db)
        ctx.dtypes = (x.dtype, w.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(*extras)
        return (loss, *extras)

    @staticmethod
    def backward(ctx, g_loss, *unused):
        g = g_loss.to(F32)
        return (*(as_grad(t, dtype, g) for t, dtype in zip(ctx.saved_tensors, ctx.dtypes)), None)


# ---- the FLCE head -------------------------------------------------------------------------------------------

def reduction_scalars(y, class_weights, ignore_index, vocab):
    """(float32 [D, n, W_sum], w_y [N] or None): class-weighted and plain counts of valid rows, the sum of
    class weights, and each row's target class weight."""
    valid = y != ignore_index
    n = valid.sum().to(F32)
    if class_weights is None:
        return torch.stack([n, n, torch.full_like(n, float(vocab))]), None
    w_y = torch.where(valid, class_weights[torch.where((y >= 0) & (y < vocab), y, 0)], 0.0)
    return torch.stack([pairwise_sum(w_y), n, pairwise_sum(class_weights)]), w_y


def _flce_head(stats, inputs, *, scalars, opt, vocab):
    return flce_head(stats["m"], stats["s"], stats["zy"], stats["q"], stats["amax"], inputs["y"],
                     inputs.get("w_y"), inputs.get("g"), scalars, mode=MODES[opt.reduction],
                     ignore_index=opt.ignore_index, label_smoothing=opt.label_smoothing, z_loss=opt.z_loss,
                     vocab=vocab, asm=ASM)


def flce_sweep(x, w, y, bias, class_weights, opt, *, grads=(False, False, False), row_cotangent=None,
               valid_rows=None, trace=None):
    """The FLCE sweep: outputs are float32 [N] rows lse, loss, zrow, correct, a, b, c (all 0 on ignored
    rows, lse too, whether their chunk ran or was skipped: see `sweep`'s valid_rows)."""
    vocab = w.shape[0]
    scalars, w_y = reduction_scalars(y, class_weights, opt.ignore_index, vocab)
    row_inputs = {"y": y}
    if w_y is not None:
        row_inputs["w_y"] = w_y
    if row_cotangent is not None:
        row_inputs["g"] = row_cotangent
    head = functools.partial(_flce_head, scalars=scalars, opt=opt, vocab=vocab)
    rows, dx, dw, db = sweep(x, w, bias, class_weights, opt, head, row_inputs, grads=grads, valid_rows=valid_rows,
                             trace=trace)
    rows["lse"] = torch.where(y != opt.ignore_index, rows["lse"], 0.0)
    return rows, dx, dw, db


def totals(rows, reduction):
    """(loss, z_loss stat) from the per-row values: fixed-order sums for "mean"/"sum", the rows for "none"."""
    if reduction == "none":
        return rows["loss"], rows["zrow"]
    return pairwise_sum(rows["loss"]), pairwise_sum(rows["zrow"])


def flce_run(x, w, bias, grads, *, y, class_weights, opt, valid_rows):
    """`PrecomputedGrad`'s run for "mean"/"sum": (loss, (z_loss stat, lse, correct), dx, dw, db)."""
    rows, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=grads, valid_rows=valid_rows)
    loss, zstat = totals(rows, opt.reduction)
    return loss, (zstat, rows["lse"], rows["correct"]), dx, dw, db


class FusedLCENone(torch.autograd.Function):
    """reduction="none": the forward computes the rows' losses; the backward recomputes with the cotangent."""

    @staticmethod
    def forward(ctx, x, w, bias, y, class_weights, opt, valid_rows):
        rows, *_ = flce_sweep(x, w, y, bias, class_weights, opt, valid_rows=valid_rows)
        ctx.save_for_backward(x, w, bias, y, class_weights)
        ctx.opt, ctx.valid_rows = opt, valid_rows
        ctx.grads = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                     bias is not None and ctx.needs_input_grad[2])
        ctx.mark_non_differentiable(rows["zrow"], rows["lse"], rows["correct"])
        return rows["loss"], rows["zrow"], rows["lse"], rows["correct"]

    @staticmethod
    def backward(ctx, g_loss, *unused):
        x, w, bias, y, class_weights = ctx.saved_tensors
        _, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, ctx.opt, grads=ctx.grads,
                                   row_cotangent=g_loss.to(F32).contiguous(), valid_rows=ctx.valid_rows)
        return dx, as_grad(dw, w.dtype), None if db is None else as_grad(db, bias.dtype), None, None, None, None


def debug_intermediates(x, w, y, bias=None, class_weights=None, **options):
    """The stages of one forward+backward, for `python -m parity --explain`: float32 logits and the dlogits of
    the first chunk, lse of all rows, and the final dx, dw (db). Counts the valid rows on the host, as
    `fused_lce`'s validation does, so that the same chunks run."""
    opt = Options(**options)
    trace = {}
    valid_rows = int((y != opt.ignore_index).sum())
    rows, dx, dw, db = flce_sweep(x, w, y, bias, class_weights, opt, grads=(True, True, bias is not None),
                                  valid_rows=valid_rows, trace=trace)
    trace.update(lse=rows["lse"], dx=dx, dw=as_grad(dw, w.dtype))
    if bias is not None:
        trace["db"] = as_grad(db, bias.dtype)
    return trace

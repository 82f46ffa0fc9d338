"""The setup of each loss's sweep, once for both twins: its head, its per-row inputs and its plan; and the
fixed-order totals of the FLCE rows. `xp` is the twin's array namespace (fce_core.arrays), `kernel` its head
kernel (kernels/flce_head.py, kernels/logprob_head.py)."""
from .heads import Head, StatsSpec, flce_head
from .plan import plan_rows
from .rows import reduction_scalars


def flce_setup(xp, kernel, x_shape, itemsize, w_rows, y, class_weights, opt, *, need_grads, dw_pair,
               normalizer=None, g=None, g_lse=None, comm=None, counts=None):
    """(head, per-row inputs, plan) of an FLCE sweep of x `x_shape` over `w_rows` weight rows (a shard's with
    `comm`, whose class weights are made whole for the reduction scalars); g / g_lse: the rows' cotangents
    of the loss and of lse, where given; counts: the value check's float32 [n, n, vocab], where it made them
    (`reduction_scalars`); dw_pair: a bfloat16 weight (`fce_core.plan.fused_rows`)."""
    vocab = w_rows if comm is None else comm.vocab
    all_weights = class_weights if comm is None or class_weights is None else comm.full_vector(class_weights)
    scalars, w_y = reduction_scalars(xp, y, all_weights, opt.ignore_index, vocab, normalizer, counts)
    inputs = {"y": y, **{k: t for k, t in (("w_y", w_y), ("g", g), ("g_lse", g_lse)) if t is not None}}
    plan = plan_rows(x_shape[0], x_shape[1], w_rows, itemsize, need_grads=need_grads, requested=opt.chunk_rows,
                     engine=opt.engine, dw_pair=dw_pair)
    return flce_head(kernel, opt, scalars, vocab), inputs, plan


def logprob_setup(xp, kernel, x_shape, itemsize, w_rows, y, opt, *, entropy, need_grads, dw_pair, g=None,
                  h=None, comm=None):
    """(head, per-row inputs, plan) of a token log-prob sweep; with the cotangents g (of logp) and h (of the
    entropy), the rows whose cotangents are all zero count as ignored (their chunks may be skipped)."""
    vocab = w_rows if comm is None else comm.vocab
    inputs = {"y": y}
    if g is not None:
        moving = g != 0 if h is None else (g != 0) | (h != 0)
        inputs = {"y": xp.where(moving, y, opt.ignore_index), "g": xp.f32(g)}
        if h is not None:
            inputs["h"] = xp.f32(h)
    head = Head(lambda stats, rows: kernel(stats, rows["y"], rows.get("g"), rows.get("h"),
                                           ignore_index=opt.ignore_index, vocab=vocab), StatsSpec(pz=entropy))
    plan = plan_rows(x_shape[0], x_shape[1], w_rows, itemsize, need_grads=need_grads, requested=opt.chunk_rows,
                     engine=opt.engine, dw_pair=dw_pair)
    return head, inputs, plan


def totals(xp, rows, reduction):
    """(loss, z rows) from the per-row values: the loss `reduced`; the z-loss statistic's rows stay rows (the
    APIs reduce them where the stats are asked for, so a call without stats runs no sum for them)."""
    return reduced(xp, rows["loss"], reduction), rows["zrow"]


def reduced(xp, rows, reduction):
    """Per-row values reduced: their fixed-order sum for "mean"/"sum", the rows for "none"."""
    return rows if reduction == "none" else xp.pairwise_sum(rows)

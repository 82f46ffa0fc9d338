"""`fused_cpo_loss`: CPO / SimPO / IPO / hinge preference loss (docs/SPEC.md §3) on the engine, as a torch
custom op with precomputed gradients.

x [2B, T, H] holds B chosen sequences, then B rejected ones. The FLCE head (mode "none") writes each token's
dZ with unit coefficients; `kernels.cpo_pairs` scales it once a group of whole pairs is in
(`fce_core.plan.plan_pairs` says which groups; docs/NUMERICS.md, "CPO"). Twin: fce_jax/cpo.py.
"""
from typing import Optional

import torch

from fce_core import docs
from fce_core.docs import doc
from fce_core.contract import check_cpo_options, check_pair_batch
from fce_core.options import LOSS_TYPES, CpoOptions, FlceOptions
from fce_core.plan import bounds, pair_order, plan_pairs

from .api import prepare, requires_grad
from .autodiff import absent, register_precomputed
from .checks import ValueCheck, check_tensors, describe, engine_for
from .engine import Head, sweep
from .kernels import cpo_pairs
from .kernels.fastmath import ASM
from .kernels.flce_head import flce_head
from .kernels.grad_scale import kept_weight_grad, kept_weight_grad_dtype
from .sums import pairwise_sum
from .vocab_parallel import comm_for, resolve

F32 = torch.float32
Tensor = torch.Tensor
CpoOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _token_head(ignore_index, scalars, vocab):
    """The FLCE head in mode "none" on a chunk: every token's lse, L1 (0 when ignored), a = 1, b = -1."""
    opt = FlceOptions(ignore_index=ignore_index, reduction="none")
    return Head(lambda stats, inputs: flce_head(stats, inputs["y"], None, None, None, scalars, opt=opt,
                                                vocab=vocab, asm=ASM))


def _finish_pairs(outputs, inputs, *, opt, scalars):
    """A group of whole pairs' token L1 -> the pairs' outputs and the scale of the tokens' dZ."""
    y, l1 = inputs["y"], outputs["loss"]
    n_seq = y.shape[0] // opt.seq_len
    sums = pairwise_sum(l1.view(n_seq, opt.seq_len))
    counts = (y != opt.ignore_index).view(n_seq, opt.seq_len).sum(-1).to(F32)
    out = cpo_pairs.pairs(sums, counts, y, scalars, opt)
    n_pairs = n_seq // 2
    chosen = torch.arange(y.shape[0], device=y.device) < n_pairs * opt.seq_len
    # Separate tensors (an op's outputs may not alias each other).
    return {"nll": torch.where(chosen, l1, 0.0), "pair_loss": out["pair_loss"], "scale": out["scale"],
            "logp_c": out["logp"][:n_pairs].clone(), "logp_r": out["logp"][n_pairs:].clone(),
            "reward_c": out["reward"][:n_pairs].clone(), "reward_r": out["reward"][n_pairs:].clone()}


def _pair_order(n_pairs, seq_len, plan, device):
    """`fce_core.plan.pair_order` made on the device: a copy of the host list would wait for the device to
    finish the work queued before the call (a pageable copy synchronizes its stream), leaving the device idle
    while the host sets up the rest of the call; and a CUDA graph may not hold host data."""
    seqs = torch.arange(2 * n_pairs, device=device).view(2, n_pairs)  # chosen, rejected
    return torch.cat([seqs[:, g0:g1].reshape(-1) for g0, g1 in bounds(n_pairs, plan.group_rows // (2 * seq_len))])


def _unpermute(t, order, seqs):
    """t's sequences (shape `seqs` = [2B, T, ...]) from group order back to the caller's."""
    return torch.empty_like(t).view(seqs).index_copy_(0, order, t.view(seqs)).view(t.shape)


def _cpo(x, w, bias, y, opt, validate, comm, needs):
    """(loss, chosen/rejected logps and rewards, nll, dx, dw, db) of x [2B * T, H]."""
    vocab = w.shape[0] if comm is None else comm.vocab
    n_pairs, seq_len = y.shape[0] // (2 * opt.seq_len), opt.seq_len
    check = ValueCheck(y, vocab, opt.ignore_index) if validate else None
    n_chosen = (y[:n_pairs * seq_len] != opt.ignore_index).sum().to(F32)
    scalars = torch.stack([torch.full_like(n_chosen, float(n_pairs)), n_chosen,
                           torch.full_like(n_chosen, float(vocab))])
    plan = plan_pairs(n_pairs, seq_len, x.shape[1], w.shape[0], x.element_size(),
                      need_grads=any(needs), requested=opt.chunk_rows, engine=opt.engine)
    order, rows = pair_order(n_pairs, seq_len, plan), None
    seqs = (2 * n_pairs, seq_len, x.shape[1])
    if order is not None:  # the sweep takes x's rows in this order and gives dX back in x's
        order = _pair_order(n_pairs, seq_len, plan, x.device)
        rows = (order[:, None] * seq_len + torch.arange(seq_len, device=x.device)).view(-1)
        y = y.view(seqs[:2])[order].view(y.shape)
    finish = lambda outputs, inputs: _finish_pairs(outputs, inputs, opt=opt, scalars=scalars)  # noqa: E731
    out, dx, dw, db = sweep(x, w, bias, None, _token_head(opt.ignore_index, scalars, vocab), {"y": y}, plan,
                            grads=tuple(needs), transform=FlceOptions().transform, ignore_index=opt.ignore_index,
                            check=check, finish=finish, comm=comm, engine=opt.engine, perm=rows)
    if order is not None:  # back to the caller's order (the NLL's sum too, so that both ways give one loss)
        out["nll"] = _unpermute(out["nll"], order, seqs[:2])
    loss, nll = cpo_pairs.total(pairwise_sum(out["pair_loss"]), pairwise_sum(out["nll"]), scalars, opt.alpha)
    return (loss, out["logp_c"], out["logp_r"], out["reward_c"], out["reward_r"], nll,
            *(absent(x) if t is None else t for t in (dx, kept_weight_grad(dw, w.dtype), db)))


def _cpo_body(x: Tensor, w: Tensor, bias: Optional[Tensor], y: Tensor, seq_len: int, ignore_index: int, beta: float,
              alpha: float, label_smoothing: float, loss_type: str, simpo_gamma: float, average_log_prob: bool,
              chunk_rows: Optional[int], engine: str, validate: bool, vp_group: Optional[str], vp_offsets: list[int],
              needs: list[bool]) -> CpoOutputs:
    opt = CpoOptions(seq_len=seq_len, ignore_index=ignore_index, beta=beta, alpha=alpha,
                     label_smoothing=label_smoothing, loss_type=loss_type, simpo_gamma=simpo_gamma,
                     average_log_prob=average_log_prob, chunk_rows=chunk_rows, engine=engine)
    with torch.autocast(x.device.type, enabled=False):
        return _cpo(x, w, bias, y, opt, validate, comm_for(vp_group, vp_offsets, w, validate), needs)


cpo_op = torch.library.custom_op("fce::cpo", _cpo_body, mutates_args=())


@cpo_op.register_fake
def _(x, w, bias, y, seq_len, ignore_index, beta, alpha, label_smoothing, loss_type, simpo_gamma,
      average_log_prob, chunk_rows, engine, validate, vp_group, vp_offsets, needs):
    n_pairs = y.shape[0] // (2 * seq_len)
    plan = plan_pairs(n_pairs, seq_len, x.shape[1], w.shape[0], x.element_size(),
                      need_grads=any(needs), requested=chunk_rows, engine=engine)
    dw_dtype = kept_weight_grad_dtype(plan, w.dtype)
    pair = x.new_empty((n_pairs,), dtype=F32)
    return (x.new_empty((), dtype=F32), pair, torch.empty_like(pair), torch.empty_like(pair), torch.empty_like(pair),
            x.new_empty((), dtype=F32), x.new_empty(x.shape) if needs[0] else absent(x),
            w.new_empty(w.shape, dtype=dw_dtype) if needs[1] else absent(x),
            x.new_empty(w.shape[:1], dtype=F32) if needs[2] else absent(x))


cpo = register_precomputed(cpo_op, _cpo_body, 6)


@doc(docs.CPO_SUMMARY, docs.CPO_ARGS, framework_args="""\
    vocab_parallel: a `fce_torch.VocabParallel(group)` (or a DTensor weight sharded over V), as in `fused_lce`.
    validate: check the targets are in range (one host synchronization, which also counts the valid tokens so
        that the chunks holding only ignored tokens are skipped); False for CUDA graphs.
""", returns="""The float32 scalar loss (and the stats dict). Gradients flow to ``x``, ``weight`` and ``bias``. Works
under ``torch.compile`` (``fullgraph=True`` too).""", raises="""ValueError: naming the argument for an odd batch,
    shape/dtype mismatches, bad options, out-of-range targets.""")
def fused_cpo_loss(x, weight, targets, *, bias=None, ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0,
                   loss_type="sigmoid", simpo_gamma=0.5, average_log_prob=None, vocab_parallel=None,
                   return_stats=False, validate=True, chunk_rows=None, engine="auto"):
    check_cpo_options(loss_type, beta, alpha, label_smoothing, LOSS_TYPES)
    check_pair_batch(describe(x))
    weight, bias, _, vp_group, vp_offsets = resolve(weight, bias, None, vocab_parallel)
    check_tensors(x, weight, targets, bias)
    if average_log_prob is None:
        average_log_prob = loss_type in ("ipo", "simpo")
    x2, w, y, b, _ = prepare(x, weight, targets, bias)
    engine = engine_for(engine, x2)
    needs = [requires_grad(x2), requires_grad(w), b is not None and requires_grad(b)]
    loss, logp_c, logp_r, reward_c, reward_r, nll = cpo(
        x2, w, b, y, x.shape[1], int(ignore_index), float(beta), float(alpha), float(label_smoothing), loss_type,
        float(simpo_gamma), bool(average_log_prob), chunk_rows, engine, bool(validate), vp_group, vp_offsets,
        needs)[:6]
    if not return_stats:
        return loss
    return loss, {"chosen_logps": logp_c, "rejected_logps": logp_r, "chosen_rewards": reward_c,
                  "rejected_rewards": reward_r, "nll_loss": nll}

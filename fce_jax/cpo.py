"""`fused_cpo_loss`: CPO / SimPO / IPO / hinge preference loss (docs/SPEC.md §3) on the engine.

x [2B, T, H] holds B chosen sequences, then B rejected ones. The FLCE head (mode "none") gives every token's
L1 = lse - z_y and writes its dZ with unit coefficients; once a group's rows are in, `kernels.cpo_pairs` turns
each pair's sequence log-probs into its loss and the scale of its tokens' dZ (so dZ is always kept). The plan
(`fce_core.plan.plan_pairs`) puts all rows in one group when their dZ fits (chunks then cut pairs anywhere and
the ignored rows are skipped), else groups of whole pairs (sequences permuted group by group: its chosen, then
its rejected ones), dW accumulating over the groups. Twin: fce_torch/cpo.py.
"""
import jax
import jax.numpy as jnp
import numpy as np

from fce_core.contract import check_cpo_options, check_pair_batch
from fce_core.options import LOSS_TYPES, CpoOptions, FlceOptions
from fce_core.plan import pair_order, plan_pairs

from .autodiff import precomputed
from .checks import check_tensors, check_values, describe
from .engine import Head, sweep
from .kernels import cpo_pairs
from .kernels.flce_head import flce_head
from .sums import pairwise_sum

F32 = jnp.float32


def _token_head(ignore_index, scalars, vocab):
    """The FLCE head in mode "none" on a chunk: every token's lse, L1 (0 when ignored), a = 1, b = -1."""
    opt = FlceOptions(ignore_index=ignore_index, reduction="none")
    return Head(lambda stats, inputs: flce_head(stats, inputs["y"], None, None, None, scalars, opt=opt,
                                                vocab=vocab))


def _finish_pairs(outputs, inputs, *, opt, scalars):
    """A group of whole pairs' token L1 -> the pairs' outputs and the scale of the tokens' dZ."""
    y, l1 = inputs["y"], outputs["loss"]
    n_seq = y.shape[0] // opt.seq_len
    sums = pairwise_sum(l1.reshape(n_seq, opt.seq_len))
    counts = jnp.sum((y != opt.ignore_index).reshape(n_seq, opt.seq_len).astype(jnp.int32), -1).astype(F32)
    out = cpo_pairs.pairs(sums, counts, y, scalars, opt)
    n_pairs = n_seq // 2
    chosen = jnp.arange(y.shape[0]) < n_pairs * opt.seq_len
    return {"nll": jnp.where(chosen, l1, 0.0), "pair_loss": out["pair_loss"], "scale": out["scale"],
            "logp_c": out["logp"][:n_pairs], "logp_r": out["logp"][n_pairs:],
            "reward_c": out["reward"][:n_pairs], "reward_r": out["reward"][n_pairs:]}


def _unpermute(t, order, seqs):
    """t's sequences (shape `seqs` = [2B, T, ...]) from group order back to the caller's."""
    return t.reshape(seqs)[np.argsort(order)].reshape(t.shape)


def run_cpo(opt, x, w, bias, y, *, grads):
    """`autodiff.precomputed`'s run: (loss, (chosen/rejected logps and rewards, nll), dx, dw, db)."""
    vocab, n_pairs, seq_len = w.shape[0], y.shape[0] // (2 * opt.seq_len), opt.seq_len
    n_chosen = jnp.sum((y[:n_pairs * seq_len] != opt.ignore_index).astype(jnp.int32)).astype(F32)
    scalars = jnp.stack([jnp.asarray(n_pairs, F32), n_chosen, jnp.asarray(vocab, F32)])
    plan = plan_pairs(n_pairs, seq_len, x.shape[1], vocab, x.dtype.itemsize, need_grads=any(grads),
                      need_dw=grads[1], requested=opt.chunk_rows)
    order = pair_order(n_pairs, seq_len, plan)
    seqs = (2 * n_pairs, seq_len, x.shape[1])
    if order is not None:
        order = np.asarray(order)
        x, y = x.reshape(seqs)[order].reshape(x.shape), y.reshape(seqs[:2])[order].reshape(y.shape)
    finish = lambda outputs, inputs: _finish_pairs(outputs, inputs, opt=opt, scalars=scalars)  # noqa: E731
    out, dx, dw, db = sweep(x, w, bias, None, _token_head(opt.ignore_index, scalars, vocab), {"y": y}, plan,
                            grads=grads, transform=FlceOptions().transform, ignore_index=opt.ignore_index,
                            finish=finish)
    if order is not None:  # back to the caller's order (the NLL's sum too, so that both ways give one loss)
        out["nll"] = _unpermute(out["nll"], order, seqs[:2])
        dx = None if dx is None else _unpermute(dx, order, seqs)
    loss, nll = cpo_pairs.total(pairwise_sum(out["pair_loss"]), pairwise_sum(out["nll"]), scalars, opt.alpha)
    return loss, (out["logp_c"], out["logp_r"], out["reward_c"], out["reward_r"], nll), dx, dw, db


def fused_cpo_loss(x, weight, targets, *, bias=None, ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0,
                   loss_type="sigmoid", simpo_gamma=0.5, average_log_prob=None, return_stats=False,
                   chunk_rows=None):
    """Fused linear CPO loss (TRL's ``CPOTrainer.cpo_loss`` plus ``cpo_alpha`` NLL), without the logits.

    Args:
        x: ``[2B, T, H]`` hidden states: rows ``[0, B)`` chosen sequences, ``[B, 2B)`` rejected (Liger's layout).
        weight: ``[V, H]`` LM head, same dtype as ``x``.
        targets: ``[2B, T]`` integer targets, already shifted; ``ignore_index`` on prompt and padding tokens.
        bias: optional ``[V]`` bias.
        beta: the preference temperature (> 0).
        alpha: weight of the NLL term (mean of ``lse - z_y`` over the valid chosen tokens).
        label_smoothing: epsilon in [0, 1] of the sigmoid/simpo losses.
        loss_type: ``"sigmoid"`` (CPO), ``"hinge"``, ``"ipo"`` or ``"simpo"`` (margin ``simpo_gamma / beta``).
        average_log_prob: average the token log-probs of a sequence instead of summing them (default: True for
            ipo and simpo, False otherwise, as TRL does). A sequence without valid tokens has log-prob 0.
        return_stats: also return ``chosen_logps``, ``rejected_logps``, ``chosen_rewards`` (beta * logp),
            ``rejected_rewards`` ([B] each) and ``nll_loss`` (no gradient).
        chunk_rows: rows per chunk. When all rows' dZ would not fit (``fce_core.plan.plan_pairs``), the rows go
            in groups of whole pairs of at most this many rows (at least one pair), and chunks of this many rows
            run over each group.

    Returns:
        The float32 scalar loss (and the stats dict). Differentiable in ``x``, ``weight`` and ``bias``.

    Raises:
        ValueError: naming the argument for an odd batch, shape/dtype mismatches, bad options, and
            out-of-range targets when they are concrete.
    """
    check_cpo_options(loss_type, beta, alpha, label_smoothing, LOSS_TYPES)
    check_pair_batch(describe(x))
    _, vocab = check_tensors(x, weight, targets, bias)
    check_values(targets, vocab, ignore_index)
    if average_log_prob is None:
        average_log_prob = loss_type in ("ipo", "simpo")
    opt = CpoOptions(seq_len=x.shape[1], ignore_index=int(ignore_index), beta=float(beta), alpha=float(alpha),
                     label_smoothing=float(label_smoothing), loss_type=loss_type, simpo_gamma=float(simpo_gamma),
                     average_log_prob=bool(average_log_prob), chunk_rows=chunk_rows)
    x2 = jnp.reshape(x, (-1, x.shape[2]))
    y = jnp.reshape(targets, (-1,)).astype(jnp.int32)
    loss, logp_c, logp_r, reward_c, reward_r, nll = precomputed(run_cpo, opt, x2, weight, bias, y)
    if not return_stats:
        return loss
    stats = {"chosen_logps": logp_c, "rejected_logps": logp_r, "chosen_rewards": reward_c,
             "rejected_rewards": reward_r, "nll_loss": nll}
    return loss, jax.tree.map(jax.lax.stop_gradient, stats)

"""`fused_cpo_loss` for JAX (docs/SPEC.md §3): the preference loss on the engine with a custom VJP whose
forward computes the gradients. With the plan's groups, the sweep takes the sequences of each group of pairs
together (`fce_core.plan.pair_order`) and its per-sequence outputs are put back after; the math is
fce_torch/cpo.py's (docs/NUMERICS.md, "CPO"). Twin: fce_torch/cpo.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from fce_core import docs
from fce_core.docs import doc
from fce_core.contract import check_cpo_options, check_pair_batch
from fce_core.options import LOSS_TYPES, CpoOptions, FlceOptions
from fce_core.plan import pair_order, plan_pairs

from . import sharding
from .api import match_axes
from .autodiff import precomputed
from .checks import check_tensors, check_values, check_vocab_shard, describe, engine_for
from .engine import Head, sweep
from .kernels import cpo_pairs
from .kernels.flce_head import flce_head
from .sums import pairwise_sum
from .vocab_parallel import comm_for

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


def run_cpo(static, x, w, bias, y, *, grads):
    """`autodiff.precomputed`'s run: (loss, (chosen/rejected logps and rewards, nll), dx, dw, db). `static` =
    (CpoOptions, VocabParallel or None)."""
    opt, vp = static
    comm = comm_for(vp, w.shape[0])
    vocab = w.shape[0] if comm is None else comm.vocab
    n_pairs, seq_len = y.shape[0] // (2 * opt.seq_len), opt.seq_len
    n_chosen = jnp.sum((y[:n_pairs * seq_len] != opt.ignore_index).astype(jnp.int32)).astype(F32)
    scalars = jnp.stack([jnp.asarray(n_pairs, F32), n_chosen, jnp.asarray(vocab, F32)])
    plan = plan_pairs(n_pairs, seq_len, x.shape[1], w.shape[0], x.dtype.itemsize,
                      need_grads=any(grads), requested=opt.chunk_rows, engine=opt.engine)
    order, rows = pair_order(n_pairs, seq_len, plan), None
    seqs = (2 * n_pairs, seq_len, x.shape[1])
    if order is not None:  # the sweep takes x's rows in this order and gives dX back in x's
        order = np.asarray(order)
        rows = (order[:, None] * seq_len + np.arange(seq_len)).reshape(-1)
        y = y.reshape(seqs[:2])[order].reshape(y.shape)
    finish = lambda outputs, inputs: _finish_pairs(outputs, inputs, opt=opt, scalars=scalars)  # noqa: E731
    out, dx, dw, db = sweep(x, w, bias, None, _token_head(opt.ignore_index, scalars, vocab), {"y": y}, plan,
                            grads=grads, transform=FlceOptions().transform, ignore_index=opt.ignore_index,
                            finish=finish, comm=comm, engine=opt.engine, perm=rows)
    if order is not None:  # back to the caller's order (the NLL's sum too, so that both ways give one loss)
        out["nll"] = _unpermute(out["nll"], order, seqs[:2])
    loss, nll = cpo_pairs.total(pairwise_sum(out["pair_loss"]), pairwise_sum(out["nll"]), scalars, opt.alpha)
    return loss, (out["logp_c"], out["logp_r"], out["reward_c"], out["reward_r"], nll), dx, dw, db


@doc(docs.CPO_SUMMARY, docs.CPO_ARGS, framework_args="""\
    vocab_parallel: a `fce_jax.VocabParallel(axis_name)`, as in `fused_lce`.
""", returns="""The float32 scalar loss (and the stats dict). Differentiable in ``x``, ``weight`` and ``bias``.""",
     raises="""ValueError: naming the argument for an odd batch, shape/dtype mismatches, bad options, and
    out-of-range targets when they are concrete.""")
def fused_cpo_loss(x, weight, targets, *, bias=None, ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0,
                   loss_type="sigmoid", simpo_gamma=0.5, average_log_prob=None, vocab_parallel=None,
                   return_stats=False, chunk_rows=None, engine="auto"):
    check_cpo_options(loss_type, beta, alpha, label_smoothing, LOSS_TYPES)
    check_pair_batch(describe(x))
    mesh_layout = sharding.layout(x, weight, targets, rows_may_split=False) if vocab_parallel is None else None
    if mesh_layout is not None:  # a weight split over V under plain jit: vocab-parallel in a shard_map
        (x_spec, t_spec, b_spec), _ = sharding.specs(mesh_layout, x, bias)
        call = lambda x, w, t, b, vp: fused_cpo_loss(  # noqa: E731
            x, w, t, bias=b, ignore_index=ignore_index, beta=beta, alpha=alpha, label_smoothing=label_smoothing,
            loss_type=loss_type, simpo_gamma=simpo_gamma, average_log_prob=average_log_prob, vocab_parallel=vp,
            return_stats=return_stats, chunk_rows=chunk_rows, engine=engine)
        stats_spec = dict.fromkeys(("chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards",
                                    "nll_loss"), P())
        return sharding.run(mesh_layout, call, (x, weight, targets, bias),
                            (x_spec, sharding.weight_spec(mesh_layout), t_spec, b_spec),
                            (P(), stats_spec) if return_stats else P())
    engine = engine_for(engine, x)
    _, vocab = check_tensors(x, weight, targets, bias)
    check_vocab_shard(x, targets, weight, vocab_parallel)
    check_values(targets, vocab if vocab_parallel is None else None, ignore_index)
    if average_log_prob is None:
        average_log_prob = loss_type in ("ipo", "simpo")
    opt = CpoOptions(seq_len=x.shape[1], ignore_index=int(ignore_index), beta=float(beta), alpha=float(alpha),
                     label_smoothing=float(label_smoothing), loss_type=loss_type, simpo_gamma=float(simpo_gamma),
                     average_log_prob=bool(average_log_prob), chunk_rows=chunk_rows, engine=engine)
    x2 = jnp.reshape(x, (-1, x.shape[2]))
    y = jnp.reshape(targets, (-1,)).astype(jnp.int32)
    weight, bias = match_axes(x2, y, weight, bias)
    loss, logp_c, logp_r, reward_c, reward_r, nll = precomputed(run_cpo, (opt, vocab_parallel), x2, weight, bias, y)
    if not return_stats:
        return loss
    stats = {"chosen_logps": logp_c, "rejected_logps": logp_r, "chosen_rewards": reward_c,
             "rejected_rewards": reward_r, "nll_loss": nll}
    return loss, jax.tree.map(jax.lax.stop_gradient, stats)

"""`fused_cpo_loss`: CPO / SimPO / IPO / hinge preference loss (SPEC §3) on the chunked engine.

x [2B, T, H] holds B chosen sequences, then B rejected ones. The FLCE head gives every token's
L1 = lse - z_y; fixed-order sums over T give each sequence's -logp; the pair kernel turns a pair's logps into
its loss and the tokens' gradient coefficients

    dloss/dz_c = a_t p_c + b_t [c == y_t],   a_t = kappa [t chosen] - v_seq,  b_t = -a_t   (valid tokens)

with v = dloss/dlogp_seq * d logp_seq / d sum and kappa = alpha / n_chosen (the NLL term). dZ is written with
a_t = 1 and kept, and scaled by a_t once its pairs are known: in one group of all rows (chunks cut pairs
anywhere) when that fits, else in groups of whole pairs (rows permuted group by group: chosen then rejected
sequences of its pairs). Twin: fce_torch/cpo.py.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import chunking
from . import fastmath as fm
from .api import check_tensors, check_values
from .chunking import layout, plan
from .engine import NONE, Options, flce_head, pairwise_sum, precomputed_grad, sweep
from .fastmath import LN2, LOG2E
from .pallas_call import call, interpret_mode

LOSS_TYPES = {"sigmoid": 0, "hinge": 1, "ipo": 2, "simpo": 3}
BLOCK_PAIRS = 16
BLOCK_T = 256
F32 = jnp.float32


def _side(i):
    """A static index into the chosen/rejected axis (an int32 scalar, as Pallas' discharge rules expect)."""
    return np.int32(i)


_CHOSEN, _REJECTED = _side(0), _side(1)


def _log1p(e, asm):
    """log(1 + e) for e in [0, 1], accurate for tiny e (Goldberg's correction)."""
    w = 1.0 + e
    return jnp.where(w == 1.0, e, fm.mul(fm.mul(fm.lg2(w, asm), LN2, asm), fm.div(e, w - 1.0, asm), asm))


def _cpo_pair_kernel(sum_ref, cnt_ref, y_ref, scal_ref, pair_loss_ref, logp_ref, reward_ref, a_ref, b_ref,
                     *, n_pairs, seq_len, ignore_index, beta, one_minus_eps, eps, gamma_over_beta, half_inv_beta,
                     alpha, loss_type, average, asm):
    bp, bt = BLOCK_PAIRS, BLOCK_T
    p0 = pl.program_id(0) * bp
    pairs = p0 + lax.iota(jnp.int32, bp)
    ok = pairs < n_pairs
    ps = pl.ds(p0, bp)
    n_b = jnp.broadcast_to(scal_ref[0], (bp,))
    n_ch = jnp.broadcast_to(scal_ref[1], (bp,))
    sum_c = pltriton.load(sum_ref.at[_CHOSEN, ps], mask=ok, other=0.0)
    sum_r = pltriton.load(sum_ref.at[_REJECTED, ps], mask=ok, other=0.0)
    if average:
        cnt_c = pltriton.load(cnt_ref.at[_CHOSEN, ps], mask=ok, other=0.0)
        cnt_r = pltriton.load(cnt_ref.at[_REJECTED, ps], mask=ok, other=0.0)
        scale_c = jnp.where(cnt_c > 0.0, fm.div(1.0, cnt_c, asm), 0.0)
        scale_r = jnp.where(cnt_r > 0.0, fm.div(1.0, cnt_r, asm), 0.0)
        logp_c = jnp.where(cnt_c > 0.0, fm.div(-sum_c, cnt_c, asm), 0.0)
        logp_r = jnp.where(cnt_r > 0.0, fm.div(-sum_r, cnt_r, asm), 0.0)
    else:
        scale_c = scale_r = jnp.ones((bp,), F32)
        logp_c, logp_r = -sum_c, -sum_r
    delta = logp_c - logp_r
    if loss_type == LOSS_TYPES["simpo"]:
        delta = delta - gamma_over_beta
    if loss_type == LOSS_TYPES["ipo"]:
        d = delta - half_inv_beta
        loss = fm.mul(d, d, asm)
        dl_ddelta = d + d
    else:
        u = fm.mul(beta, delta, asm)
        if loss_type == LOSS_TYPES["hinge"]:
            loss = jnp.maximum(1.0 - u, 0.0)
            dl_du = jnp.where(1.0 - u > 0.0, -1.0, 0.0).astype(F32)
        else:
            e = fm.ex2(fm.mul(-jnp.abs(u), LOG2E, asm), asm)
            l1p = _log1p(e, asm)
            sp_pos = jnp.maximum(u, 0.0) + l1p  # softplus(u) = -log sigmoid(-u)
            sp_neg = jnp.maximum(-u, 0.0) + l1p  # softplus(-u) = -log sigmoid(u)
            sig_big = fm.div(1.0, 1.0 + e, asm)
            sig_small = fm.div(e, 1.0 + e, asm)
            sig_pos = jnp.where(u >= 0.0, sig_big, sig_small)  # sigmoid(u)
            sig_neg = jnp.where(u >= 0.0, sig_small, sig_big)  # sigmoid(-u)
            loss = fm.fma(one_minus_eps, sp_neg, fm.mul(eps, sp_pos, asm), asm)
            dl_du = fm.fma(-one_minus_eps, sig_neg, fm.mul(eps, sig_pos, asm), asm)
        dl_ddelta = fm.mul(beta, dl_du, asm)
    g = fm.div(dl_ddelta, n_b, asm)
    v_c = fm.mul(g, scale_c, asm)
    v_r = -fm.mul(g, scale_r, asm)
    kappa = jnp.where(n_ch > 0.0, fm.div(alpha, n_ch, asm), 0.0)
    pltriton.store(pair_loss_ref.at[ps], fm.div(loss, n_b, asm), mask=ok)
    pltriton.store(logp_ref.at[_CHOSEN, ps], logp_c, mask=ok)
    pltriton.store(logp_ref.at[_REJECTED, ps], logp_r, mask=ok)
    pltriton.store(reward_ref.at[_CHOSEN, ps], fm.mul(beta, logp_c, asm), mask=ok)
    pltriton.store(reward_ref.at[_REJECTED, ps], fm.mul(beta, logp_r, asm), mask=ok)

    a_c = kappa - v_c
    a_r = -v_r

    def body(k, carry):
        t0 = k * bt
        mask = ok[:, None] & (t0 + lax.iota(jnp.int32, bt) < seq_len)[None, :]
        for side, a_side in ((_CHOSEN, a_c), (_REJECTED, a_r)):
            ref = (side, ps, pl.ds(t0, bt))
            valid = pltriton.load(y_ref.at[ref], mask=mask, other=ignore_index) != ignore_index
            tok = jnp.where(valid, a_side[:, None], 0.0)
            pltriton.store(a_ref.at[ref], tok, mask=mask)
            pltriton.store(b_ref.at[ref], -tok, mask=mask)
        return carry

    lax.fori_loop(0, pl.cdiv(seq_len, bt), body, 0)


def _cpo_total_kernel(sums_ref, scal_ref, out_ref, *, alpha, asm):
    i = lax.iota(jnp.int32, 2)
    sums = sums_ref[...]  # [sum of the pairs' losses / B, sum of the chosen tokens' L1]
    n_ch = jnp.broadcast_to(scal_ref[1], (2,))
    nll = jnp.where(n_ch > 0.0, fm.div(jnp.where(i == 1, sums, 0.0), n_ch, asm), 0.0)
    pair_sum = jnp.where(i == 0, sums, 0.0)
    loss = fm.fma(alpha, nll, pair_sum, asm)
    out_ref[...] = jnp.where(i == 0, jnp.sum(loss), jnp.sum(nll))


def _token_rows(stats, inputs, *, cfg, scalars, vocab):
    """The FLCE head (mode "none") on a chunk: every token's lse, L1 = lse - z_y (0 when ignored) and the unit
    coefficients a = 1, b = -1 of a valid token."""
    return flce_head(stats["m"], stats["s"], stats["zy"], None, stats["amax"], inputs["y"], None, None, scalars,
                     mode=NONE, ignore_index=cfg["ignore_index"], label_smoothing=0.0, z_loss=0.0, vocab=vocab)


def _pairs(l1, y, *, cfg, scalars):
    """Tokens' L1 of whole pairs (chosen sequences, then rejected) -> the pairs' outputs and the tokens'
    coefficients a (b = -a)."""
    seq_len = cfg["seq_len"]
    n_pairs = y.shape[0] // (2 * seq_len)
    sums = pairwise_sum(l1.reshape(2, n_pairs, seq_len))
    counts = jnp.sum((y != cfg["ignore_index"]).reshape(2, n_pairs, seq_len).astype(jnp.int32), -1).astype(F32)
    pair = jax.ShapeDtypeStruct((n_pairs,), F32)
    side_pair = jax.ShapeDtypeStruct((2, n_pairs), F32)
    token = jax.ShapeDtypeStruct((2, n_pairs, seq_len), F32)
    pair_loss, logp, reward, a, b = call(
        _cpo_pair_kernel, out_shape=[pair, side_pair, side_pair, token, token],
        grid=(pl.cdiv(n_pairs, BLOCK_PAIRS),), n_pairs=n_pairs, seq_len=seq_len,
        ignore_index=cfg["ignore_index"], beta=cfg["beta"], one_minus_eps=1.0 - cfg["label_smoothing"],
        eps=cfg["label_smoothing"], gamma_over_beta=cfg["simpo_gamma"] / cfg["beta"], half_inv_beta=0.5 / cfg["beta"],
        alpha=cfg["alpha"], loss_type=LOSS_TYPES[cfg["loss_type"]], average=cfg["average_log_prob"],
        asm=not interpret_mode())(sums, counts, y.reshape(2, n_pairs, seq_len), scalars)
    chosen = jnp.arange(y.shape[0]) < n_pairs * seq_len
    return {"a": a.reshape(-1), "b": b.reshape(-1), "nll": jnp.where(chosen, l1, 0.0), "pair_loss": pair_loss,
            "logp_c": logp[0], "logp_r": logp[1], "reward_c": reward[0], "reward_r": reward[1]}


def _finish_pairs(outputs, inputs, *, cfg, scalars):
    """Whole pairs' tokens' L1 (their dZ written with unit coefficients) -> the pairs' outputs and the tokens'
    dZ scale."""
    pairs = _pairs(outputs["loss"], inputs["y"], cfg=cfg, scalars=scalars)
    del pairs["b"]
    pairs["scale"] = pairs.pop("a")
    return pairs


def _cpo_run(x, w, bias, grads, *, y, n_chosen, cfg, chunk_rows):
    """`precomputed_grad`'s run: (loss, (chosen/rejected logps and rewards, nll), dx, dw, db). `n_chosen`
    counts the valid chosen tokens.

    The head gives every token unit coefficients and the pairs' scale comes once their rows are in: dZ is kept
    (`sweep`'s store). When all rows' dZ fits (chunking.plan's store), or without gradients, chunks cut the
    rows anywhere and the ignored rows are skipped. Otherwise the rows go in groups of whole pairs (sequences
    permuted group by group, every row computed), each group's dZ kept while chunks of a quarter of the
    logits budget run over it, and dW accumulates over the groups in float32.
    """
    vocab = w.shape[0]
    seq_len = cfg["seq_len"]
    n_pairs = y.shape[0] // (2 * seq_len)
    # [B, n_chosen, W_sum]: the first two feed the pair kernel, W_sum the FLCE head (no class weights).
    scalars = jnp.stack([jnp.asarray(n_pairs, F32), n_chosen, jnp.asarray(vocab, F32)])
    opt = Options(ignore_index=cfg["ignore_index"])
    head = functools.partial(_token_rows, cfg=cfg, scalars=scalars, vocab=vocab)
    finish = functools.partial(_finish_pairs, cfg=cfg, scalars=scalars)
    nc, store = plan(y.shape[0], x.shape[1], vocab, x.dtype.itemsize, grads[1], chunk_rows)
    order = group_rows = None
    if any(grads) and not store:
        per_group, order = pair_groups(n_pairs, seq_len, nc)
        group_rows = 2 * per_group * seq_len
        nc = chunking.chunk_rows(group_rows, vocab, chunk_rows, budget=chunking.GROUPED_LOGITS_BUDGET_BYTES)
        store = True
    seqs = (2 * n_pairs, seq_len, x.shape[1])
    if order is not None:
        order = np.asarray(order)
        x, y = x.reshape(seqs)[order].reshape(x.shape), y.reshape(seqs[:2])[order].reshape(y.shape)
    out, dx, dw, db = sweep(x, w, bias, None, opt, head, {"y": y}, grads=grads, chunking=(nc, store),
                            group_rows=None if order is None else group_rows, skip_ignored=order is None,
                            finish=finish)
    if order is not None:  # back to the caller's order (the NLL's sum too, so that both ways give one loss)
        out["nll"] = _unpermute(out["nll"], order, seqs[:2])
        dx = None if dx is None else _unpermute(dx, order, seqs)
    sums = jnp.stack([pairwise_sum(out["pair_loss"]), pairwise_sum(out["nll"])])
    total = call(_cpo_total_kernel, out_shape=jax.ShapeDtypeStruct((2,), F32), grid=(1,), alpha=cfg["alpha"],
                 asm=not interpret_mode())(sums, scalars)
    extras = (out["logp_c"], out["logp_r"], out["reward_c"], out["reward_r"], total[1])
    return total[0], extras, dx, dw, db


def _unpermute(t, order, seqs):
    """t's sequences (shape `seqs` = [2B, T, ...]) from chunk order back to the caller's."""
    return t.reshape(seqs)[np.argsort(order)].reshape(t.shape)


def pair_groups(n_pairs, seq_len, rows):
    """(pairs per group, sequence permutation or None): whole pairs in groups of at most `rows` rows (at least
    one pair), placed as the engine places groups (`chunking.layout`: the remainder first), the sequences
    ordered group by group (its chosen sequences, then its rejected ones)."""
    per_group = max(1, rows // (2 * seq_len))
    if per_group >= n_pairs:
        return n_pairs, None
    first, n_groups = layout(n_pairs, per_group)
    order = []
    for p0, p1 in zip([0] + [first + i * per_group for i in range(n_groups - 1)],
                      [first + i * per_group for i in range(n_groups)]):
        order += list(range(p0, p1)) + list(range(n_pairs + p0, n_pairs + p1))
    return per_group, order


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
        chunk_rows: rows per chunk. When all rows' dZ would not fit (``fce_jax.chunking.plan``), the rows go in
            groups of whole pairs of at most this many rows (at least one pair), and chunks of this many rows
            run over each group.

    Returns:
        The float32 scalar loss (and the stats dict). Differentiable in ``x``, ``weight`` and ``bias``.

    Raises:
        ValueError: naming the argument for an odd batch, shape/dtype mismatches, bad options, and
            out-of-range targets when they are concrete.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {tuple(LOSS_TYPES)}, got {loss_type!r}")
    if not beta > 0.0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not alpha >= 0.0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if getattr(x, "ndim", None) != 3:
        raise ValueError(f"x must be [2B, T, H], got shape {tuple(getattr(x, 'shape', ()))}")
    if x.shape[0] % 2:
        raise ValueError(f"x's batch must be even (B chosen, then B rejected), got {x.shape[0]}")
    _, vocab = check_tensors(x, weight, targets, bias, None)
    check_values(targets, vocab, ignore_index, None)
    if average_log_prob is None:
        average_log_prob = loss_type in ("ipo", "simpo")
    n_pairs, seq_len, hidden = x.shape[0] // 2, x.shape[1], x.shape[2]
    cfg = dict(ignore_index=int(ignore_index), beta=float(beta), alpha=float(alpha),
               label_smoothing=float(label_smoothing), loss_type=loss_type, simpo_gamma=float(simpo_gamma),
               average_log_prob=bool(average_log_prob), seq_len=seq_len)
    n_chosen = jnp.sum((targets[:n_pairs] != ignore_index).astype(jnp.int32)).astype(F32)
    x2 = jnp.reshape(x, (-1, hidden))
    y = jnp.reshape(targets, (-1,)).astype(jnp.int32)
    run = functools.partial(_cpo_run, y=y, n_chosen=n_chosen, cfg=cfg, chunk_rows=chunk_rows)
    loss, logp_c, logp_r, reward_c, reward_r, nll = precomputed_grad(x2, weight, bias, run)
    if not return_stats:
        return loss
    stats = {"chosen_logps": logp_c, "rejected_logps": logp_r, "chosen_rewards": reward_c,
             "rejected_rewards": reward_r, "nll_loss": nll}
    return loss, jax.tree.map(lax.stop_gradient, stats)

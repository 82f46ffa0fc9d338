"""`fused_cpo_loss`: CPO / SimPO / IPO / hinge preference loss (SPEC §3) on the chunked engine.

x [2B, T, H] holds B chosen sequences, then B rejected ones. The FLCE head gives every token's
L1 = lse - z_y; fixed-order sums over T give each sequence's -logp; the pair kernel turns a pair's logps into
its loss and the tokens' gradient coefficients

    dloss/dz_c = a_t p_c + b_t [c == y_t],   a_t = kappa [t chosen] - v_seq,  b_t = -a_t   (valid tokens)

with v = dloss/dlogp_seq * d logp_seq / d sum and kappa = alpha / n_chosen (the NLL term). dZ is written with
a_t = 1 and kept, and scaled by a_t once its pairs are known: in one group of all rows (chunks cut pairs
anywhere) when that fits, else in groups of whole pairs (rows permuted group by group: chosen then rejected
sequences of its pairs). Twin: fce_jax/cpo.py.
"""
import functools

import torch
import triton
import triton.language as tl

from . import chunking
from . import fastmath as fm
from .api import check_tensors, check_values
from .chunking import layout, plan
from .engine import NONE, Options, PrecomputedGrad, flce_head, pairwise_sum, sweep
from .fastmath import ASM, LN2, LOG2E

LOSS_TYPES = {"sigmoid": 0, "hinge": 1, "ipo": 2, "simpo": 3}
BLOCK_PAIRS = 16
BLOCK_T = 256


@triton.jit
def _log1p(e, ASM: tl.constexpr):
    """log(1 + e) for e in [0, 1], accurate for tiny e (Goldberg's correction)."""
    w = 1.0 + e
    return tl.where(w == 1.0, e, fm.mul(fm.mul(fm.lg2(w, ASM), LN2, ASM), fm.div(e, w - 1.0, ASM), ASM))


@triton.jit
def _cpo_pair_kernel(sum_ptr, cnt_ptr, y_ptr, scal_ptr, pair_loss_ptr, logp_ptr, reward_ptr, a_ptr, b_ptr,
                     n_pairs, T, ignore_index, beta, one_minus_eps, eps, gamma_over_beta, half_inv_beta, alpha,
                     LOSS_TYPE: tl.constexpr, AVERAGE: tl.constexpr, BP: tl.constexpr, BT: tl.constexpr,
                     ASM: tl.constexpr):
    pairs = tl.program_id(0) * BP + tl.arange(0, BP)
    ok = pairs < n_pairs
    n_b = tl.load(scal_ptr + tl.zeros([BP], tl.int32))
    n_ch = tl.load(scal_ptr + 1 + tl.zeros([BP], tl.int32))
    sum_c = tl.load(sum_ptr + pairs, mask=ok, other=0.0)
    sum_r = tl.load(sum_ptr + n_pairs + pairs, mask=ok, other=0.0)
    if AVERAGE:
        cnt_c = tl.load(cnt_ptr + pairs, mask=ok, other=0.0)
        cnt_r = tl.load(cnt_ptr + n_pairs + pairs, mask=ok, other=0.0)
        scale_c = tl.where(cnt_c > 0.0, fm.div(1.0, cnt_c, ASM), 0.0)
        scale_r = tl.where(cnt_r > 0.0, fm.div(1.0, cnt_r, ASM), 0.0)
        logp_c = tl.where(cnt_c > 0.0, fm.div(-sum_c, cnt_c, ASM), 0.0)
        logp_r = tl.where(cnt_r > 0.0, fm.div(-sum_r, cnt_r, ASM), 0.0)
    else:
        scale_c = tl.full([BP], 1.0, tl.float32)
        scale_r = scale_c
        logp_c = -sum_c
        logp_r = -sum_r
    delta = logp_c - logp_r
    if LOSS_TYPE == 3:
        delta = delta - gamma_over_beta
    if LOSS_TYPE == 2:
        d = delta - half_inv_beta
        loss = fm.mul(d, d, ASM)
        dl_ddelta = d + d
    else:
        u = fm.mul(beta, delta, ASM)
        if LOSS_TYPE == 1:
            loss = tl.maximum(1.0 - u, 0.0)
            dl_du = tl.where(1.0 - u > 0.0, -1.0, 0.0)
        else:
            e = fm.ex2(fm.mul(-tl.abs(u), LOG2E, ASM), ASM)
            l1p = _log1p(e, ASM)
            sp_pos = tl.maximum(u, 0.0) + l1p  # softplus(u) = -log sigmoid(-u)
            sp_neg = tl.maximum(-u, 0.0) + l1p  # softplus(-u) = -log sigmoid(u)
            sig_big = fm.div(1.0, 1.0 + e, ASM)
            sig_small = fm.div(e, 1.0 + e, ASM)
            sig_pos = tl.where(u >= 0.0, sig_big, sig_small)  # sigmoid(u)
            sig_neg = tl.where(u >= 0.0, sig_small, sig_big)  # sigmoid(-u)
            loss = fm.fma(one_minus_eps, sp_neg, fm.mul(eps, sp_pos, ASM), ASM)
            dl_du = fm.fma(-one_minus_eps, sig_neg, fm.mul(eps, sig_pos, ASM), ASM)
        dl_ddelta = fm.mul(beta, dl_du, ASM)
    g = fm.div(dl_ddelta, n_b, ASM)
    v_c = fm.mul(g, scale_c, ASM)
    v_r = -fm.mul(g, scale_r, ASM)
    kappa = tl.where(n_ch > 0.0, fm.div(alpha, n_ch, ASM), 0.0)
    tl.store(pair_loss_ptr + pairs, fm.div(loss, n_b, ASM), mask=ok)
    tl.store(logp_ptr + pairs, logp_c, mask=ok)
    tl.store(logp_ptr + n_pairs + pairs, logp_r, mask=ok)
    tl.store(reward_ptr + pairs, fm.mul(beta, logp_c, ASM), mask=ok)
    tl.store(reward_ptr + n_pairs + pairs, fm.mul(beta, logp_r, ASM), mask=ok)

    a_c = kappa - v_c
    a_r = -v_r
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        mask = ok[:, None] & (t < T)[None, :]
        idx_c = pairs[:, None] * T + t[None, :]
        idx_r = (n_pairs + pairs[:, None]) * T + t[None, :]
        valid_c = tl.load(y_ptr + idx_c, mask=mask, other=ignore_index) != ignore_index
        valid_r = tl.load(y_ptr + idx_r, mask=mask, other=ignore_index) != ignore_index
        tok_c = tl.where(valid_c, a_c[:, None], 0.0)
        tok_r = tl.where(valid_r, a_r[:, None], 0.0)
        tl.store(a_ptr + idx_c, tok_c, mask=mask)
        tl.store(b_ptr + idx_c, -tok_c, mask=mask)
        tl.store(a_ptr + idx_r, tok_r, mask=mask)
        tl.store(b_ptr + idx_r, -tok_r, mask=mask)


@triton.jit
def _cpo_total_kernel(sums_ptr, scal_ptr, out_ptr, alpha, ASM: tl.constexpr):
    i = tl.arange(0, 2)
    sums = tl.load(sums_ptr + i)  # [sum of the pairs' losses / B, sum of the chosen tokens' L1]
    n_ch = tl.load(scal_ptr + 1 + tl.zeros([2], tl.int32))
    nll = tl.where(n_ch > 0.0, fm.div(tl.where(i == 1, sums, 0.0), n_ch, ASM), 0.0)
    pair_sum = tl.where(i == 0, sums, 0.0)
    loss = fm.fma(alpha, nll, pair_sum, ASM)
    tl.store(out_ptr + i, tl.where(i == 0, tl.sum(loss, axis=0), tl.sum(nll, axis=0)))


def _token_rows(stats, inputs, *, cfg, scalars, vocab):
    """The FLCE head (mode "none") on a chunk: every token's lse, L1 = lse - z_y (0 when ignored) and the unit
    coefficients a = 1, b = -1 of a valid token."""
    return flce_head(stats["m"], stats["s"], stats["zy"], None, stats["amax"], inputs["y"], None, None, scalars,
                     mode=NONE, ignore_index=cfg["ignore_index"], label_smoothing=0.0, z_loss=0.0, vocab=vocab,
                     asm=ASM)


def _pairs(l1, y, *, cfg, scalars):
    """Tokens' L1 of whole pairs (chosen sequences, then rejected) -> the pairs' outputs and the tokens'
    coefficients a (b = -a)."""
    seq_len = cfg["seq_len"]
    n_pairs = y.shape[0] // (2 * seq_len)
    sums = pairwise_sum(l1.view(2 * n_pairs, seq_len))
    counts = (y != cfg["ignore_index"]).view(2 * n_pairs, seq_len).sum(-1).to(torch.float32)
    dev = y.device
    pair_loss = torch.empty(n_pairs, device=dev, dtype=torch.float32)
    logp = torch.empty(2 * n_pairs, device=dev, dtype=torch.float32)
    reward = torch.empty_like(logp)
    a = torch.empty_like(l1)
    b = torch.empty_like(l1)
    _cpo_pair_kernel[(triton.cdiv(n_pairs, BLOCK_PAIRS),)](
        sums, counts, y, scalars, pair_loss, logp, reward, a, b,
        n_pairs, seq_len, cfg["ignore_index"], cfg["beta"], 1.0 - cfg["label_smoothing"], cfg["label_smoothing"],
        cfg["simpo_gamma"] / cfg["beta"], 0.5 / cfg["beta"], cfg["alpha"],
        LOSS_TYPE=LOSS_TYPES[cfg["loss_type"]], AVERAGE=cfg["average_log_prob"], BP=BLOCK_PAIRS, BT=BLOCK_T,
        ASM=ASM, num_warps=4)
    chosen = torch.arange(y.shape[0], device=dev) < n_pairs * seq_len
    return {"a": a, "b": b, "nll": torch.where(chosen, l1, 0.0), "pair_loss": pair_loss,
            "logp_c": logp[:n_pairs], "logp_r": logp[n_pairs:], "reward_c": reward[:n_pairs],
            "reward_r": reward[n_pairs:]}


def _finish_pairs(outputs, inputs, *, cfg, scalars):
    """Whole pairs' tokens' L1 (their dZ written with unit coefficients) -> the pairs' outputs and the tokens'
    dZ scale."""
    pairs = _pairs(outputs["loss"], inputs["y"], cfg=cfg, scalars=scalars)
    del pairs["b"]
    pairs["scale"] = pairs.pop("a")
    return pairs


def _cpo_run(x, w, bias, grads, *, y, n_chosen, cfg, chunk_rows, valid_rows):
    """`PrecomputedGrad`'s run: (loss, (chosen/rejected logps and rewards, nll), dx, dw, db). `n_chosen`
    counts the valid chosen tokens, `valid_rows` (host int or None) all valid tokens.

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
    scalars = torch.stack([torch.full_like(n_chosen, float(n_pairs)), n_chosen, torch.full_like(n_chosen,
                                                                                              float(vocab))])
    opt = Options(ignore_index=cfg["ignore_index"])
    head = functools.partial(_token_rows, cfg=cfg, scalars=scalars, vocab=vocab)
    finish = functools.partial(_finish_pairs, cfg=cfg, scalars=scalars)
    nc, store = plan(y.shape[0], x.shape[1], vocab, x.element_size(), grads[1], chunk_rows)
    order = group_rows = None
    if any(grads) and not store:
        per_group, order = pair_groups(n_pairs, seq_len, nc)
        group_rows = 2 * per_group * seq_len
        nc = chunking.chunk_rows(group_rows, vocab, chunk_rows, budget=chunking.GROUPED_LOGITS_BUDGET_BYTES)
        store = True
    seqs = (2 * n_pairs, seq_len, x.shape[1])
    if order is not None:
        order = torch.tensor(order, device=x.device)
        x, y = x.view(seqs)[order].view(x.shape), y.view(seqs[:2])[order].view(y.shape)
    out, dx, dw, db = sweep(x, w, bias, None, opt, head, {"y": y}, grads=grads, chunking=(nc, store),
                            group_rows=None if order is None else group_rows, valid_rows=valid_rows,
                            finish=finish)
    if order is not None:  # back to the caller's order (the NLL's sum too, so that both ways give one loss)
        out["nll"] = _unpermute(out["nll"], order, seqs[:2])
        dx = None if dx is None else _unpermute(dx, order, seqs)
    total = torch.empty(2, device=x.device, dtype=torch.float32)
    _cpo_total_kernel[(1,)](torch.stack([pairwise_sum(out["pair_loss"]), pairwise_sum(out["nll"])]), scalars,
                            total, cfg["alpha"], ASM=ASM)
    extras = (out["logp_c"], out["logp_r"], out["reward_c"], out["reward_r"], total[1])
    return total[0], extras, dx, dw, db


def _unpermute(t, order, seqs):
    """t's sequences (shape `seqs` = [2B, T, ...]) from chunk order back to the caller's."""
    return torch.empty_like(t).view(seqs).index_copy_(0, order, t.view(seqs)).view(t.shape)


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
                   validate=True, chunk_rows=None):
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
        validate: check the targets are in range (one host synchronization, which also counts the valid
            tokens so that the ignored ones are skipped when all rows go in one group).
        chunk_rows: rows per chunk. When all rows' dZ would not fit (``fce_torch.chunking.plan``), the rows go in
            groups of whole pairs of at most this many rows (at least one pair), and chunks of this many rows
            run over each group.

    Returns:
        The float32 scalar loss (and the stats dict). Gradients flow to ``x``, ``weight`` and ``bias``.

    Raises:
        ValueError: naming the argument for an odd batch, shape/dtype mismatches, bad options, out-of-range
            targets.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {tuple(LOSS_TYPES)}, got {loss_type!r}")
    if not beta > 0.0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not alpha >= 0.0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x must be [2B, T, H], got shape {tuple(getattr(x, 'shape', ()))}")
    if x.shape[0] % 2:
        raise ValueError(f"x's batch must be even (B chosen, then B rejected), got {x.shape[0]}")
    _, vocab = check_tensors(x, weight, targets, bias, None)
    valid_rows = check_values(targets, vocab, ignore_index, None) if validate else None
    if average_log_prob is None:
        average_log_prob = loss_type in ("ipo", "simpo")
    n_pairs, seq_len, hidden = x.shape[0] // 2, x.shape[1], x.shape[2]
    cfg = dict(ignore_index=int(ignore_index), beta=float(beta), alpha=float(alpha),
               label_smoothing=float(label_smoothing), loss_type=loss_type, simpo_gamma=float(simpo_gamma),
               average_log_prob=bool(average_log_prob), seq_len=seq_len)
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    n_chosen = (targets[:n_pairs] != ignore_index).sum().to(torch.float32)
    x2 = x.reshape(-1, hidden).contiguous()
    y = targets.reshape(-1).to(torch.int64).contiguous()
    run = functools.partial(_cpo_run, y=y, n_chosen=n_chosen, cfg=cfg, chunk_rows=chunk_rows,
                            valid_rows=valid_rows)
    w = weight.contiguous()
    b = None if bias is None else bias.contiguous()
    with torch.autocast(x.device.type, enabled=False):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x2, w, b)):
            loss, logp_c, logp_r, reward_c, reward_r, nll = PrecomputedGrad.apply(x2, w, b, run)
        else:
            loss, (logp_c, logp_r, reward_c, reward_r, nll), *_ = run(x2, w, b, (False, False, False))
    if not return_stats:
        return loss
    return loss, {"chosen_logps": logp_c, "rejected_logps": logp_r, "chosen_rewards": reward_c,
                  "rejected_rewards": reward_r, "nll_loss": nll}

"""The CPO kernels in Triton: each pair's summed token log-probs -> its loss (sigmoid / hinge / ipo / simpo,
label smoothing, averaging), the rewards, and the per-token scale of the unit-coefficient dZ; and the total
with the NLL term (docs/NUMERICS.md, "CPO"). Twin: fce_jax/kernels/cpo_pairs.py.
"""
import torch
import triton
import triton.language as tl

from fce_core.config import PAIRS
from fce_core.plan import cdiv

from . import fastmath as fm
from .fastmath import LN2, LOG2E
from .launch import launched


@triton.jit
def _log1p(e, ASM: tl.constexpr):
    """log(1 + e) for e in [0, 1], accurate for tiny e (Goldberg's correction)."""
    w = 1.0 + e
    return tl.where(w == 1.0, e, fm.mul(fm.mul(fm.lg2(w, ASM), LN2, ASM), fm.div(e, w - 1.0, ASM), ASM))


@launched
@triton.jit
def _cpo_pair_kernel(sum_ptr, cnt_ptr, y_ptr, scal_ptr, pair_loss_ptr, logp_ptr, reward_ptr, scale_ptr,
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
        tl.store(scale_ptr + idx_c, tl.where(valid_c, a_c[:, None], 0.0), mask=mask)
        tl.store(scale_ptr + idx_r, tl.where(valid_r, a_r[:, None], 0.0), mask=mask)


@launched
@triton.jit
def _cpo_total_kernel(sums_ptr, scal_ptr, out_ptr, alpha, ASM: tl.constexpr):
    i = tl.arange(0, 2)
    sums = tl.load(sums_ptr + i)  # [sum of the pairs' losses / B, sum of the chosen tokens' L1]
    n_ch = tl.load(scal_ptr + 1 + tl.zeros([2], tl.int32))
    nll = tl.where(n_ch > 0.0, fm.div(tl.where(i == 1, sums, 0.0), n_ch, ASM), 0.0)
    pair_sum = tl.where(i == 0, sums, 0.0)
    loss = fm.fma(alpha, nll, pair_sum, ASM)
    tl.store(out_ptr + i, tl.where(i == 0, tl.sum(loss, axis=0), tl.sum(nll, axis=0)))


def pairs(sums, counts, y, scalars, opt, cfg=PAIRS):
    """The pairs' outputs from the sequences' sums of L1 and counts of valid tokens ([2B] each, chosen then
    rejected), y [2B * T] and scalars [B, n_chosen, ...]: pair_loss [B] (divided by B), logp and reward [2B],
    scale [2B * T]."""
    n_pairs = sums.shape[0] // 2
    dev = y.device
    out = {"pair_loss": torch.empty(n_pairs, device=dev, dtype=torch.float32),
           "logp": torch.empty(2 * n_pairs, device=dev, dtype=torch.float32),
           "reward": torch.empty(2 * n_pairs, device=dev, dtype=torch.float32),
           "scale": torch.empty(y.shape[0], device=dev, dtype=torch.float32)}
    if n_pairs == 0:
        return out
    _cpo_pair_kernel[(cdiv(n_pairs, cfg.block_pairs),)](
        sums, counts, y, scalars, out["pair_loss"], out["logp"], out["reward"], out["scale"],
        n_pairs, opt.seq_len, opt.ignore_index, opt.beta, 1.0 - opt.label_smoothing, opt.label_smoothing,
        opt.simpo_gamma / opt.beta, 0.5 / opt.beta, opt.alpha, LOSS_TYPE=opt.loss_code,
        AVERAGE=opt.average_log_prob, BP=cfg.block_pairs, BT=cfg.block_t, ASM=fm.ASM, num_warps=cfg.num_warps)
    return out


def total(pair_sum, nll_sum, scalars, alpha):
    """(loss, nll): the pairs' summed losses plus alpha times the chosen tokens' mean NLL (0 without any)."""
    out = torch.empty(2, device=scalars.device, dtype=torch.float32)
    _cpo_total_kernel[(1,)](torch.stack([pair_sum, nll_sum]), scalars, out, alpha, ASM=fm.ASM)
    return out[0].clone(), out[1].clone()  # separate tensors: an op's outputs may not alias each other

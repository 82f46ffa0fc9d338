"""The CPO pair and total kernels in Pallas, fce_torch's twin: the pairs' losses, rewards and token scales
from the sequences' sums of L1, then the total (docs/NUMERICS.md, "CPO"). Chosen and rejected sides are the
leading axis of the refs. Twin: fce_torch/kernels/cpo_pairs.py.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fce_core.config import PAIRS
from fce_core.options import LOSS_TYPES

from . import fastmath as fm
from .fastmath import LN2, LOG2E
from .launch import call, interpret_mode

F32 = jnp.float32


def _side(i):
    """A static index into the chosen/rejected axis (an int32 scalar, as Pallas' discharge rules expect)."""
    return np.int32(i)


_CHOSEN, _REJECTED = _side(0), _side(1)


def _log1p(e, asm):
    """log(1 + e) for e in [0, 1], accurate for tiny e (Goldberg's correction)."""
    w = 1.0 + e
    return jnp.where(w == 1.0, e, fm.mul(fm.mul(fm.lg2(w, asm), LN2, asm), fm.div(e, w - 1.0, asm), asm))


def _cpo_pair_kernel(sum_ref, cnt_ref, y_ref, scal_ref, pair_loss_ref, logp_ref, reward_ref, scale_ref,
                     *, n_pairs, seq_len, ignore_index, beta, one_minus_eps, eps, gamma_over_beta, half_inv_beta,
                     alpha, loss_type, average, asm, cfg):
    bp, bt = cfg.block_pairs, cfg.block_t
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
            pltriton.store(scale_ref.at[ref], jnp.where(valid, a_side[:, None], 0.0), mask=mask)
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


def pairs(sums, counts, y, scalars, opt, cfg=PAIRS):
    """The pairs' outputs from the sequences' sums of L1 and counts of valid tokens ([2B] each, chosen then
    rejected), y [2B * T] and scalars [B, n_chosen, ...]: pair_loss [B] (divided by B), logp and reward [2B],
    scale [2B * T]."""
    n_pairs, seq_len = sums.shape[0] // 2, opt.seq_len
    pair = jax.ShapeDtypeStruct((n_pairs,), F32)
    side_pair = jax.ShapeDtypeStruct((2, n_pairs), F32)
    token = jax.ShapeDtypeStruct((2, n_pairs, seq_len), F32)
    if n_pairs == 0:
        return {"pair_loss": jnp.zeros((0,), F32), "logp": jnp.zeros((0,), F32), "reward": jnp.zeros((0,), F32),
                "scale": jnp.zeros(y.shape, F32)}
    pair_loss, logp, reward, scale = call(
        _cpo_pair_kernel, out_shape=[pair, side_pair, side_pair, token], grid=(pl.cdiv(n_pairs, cfg.block_pairs),),
        num_warps=cfg.num_warps, n_pairs=n_pairs, seq_len=seq_len, ignore_index=opt.ignore_index, beta=opt.beta,
        one_minus_eps=1.0 - opt.label_smoothing, eps=opt.label_smoothing, gamma_over_beta=opt.simpo_gamma / opt.beta,
        half_inv_beta=0.5 / opt.beta, alpha=opt.alpha, loss_type=opt.loss_code, average=opt.average_log_prob,
        asm=not interpret_mode(), cfg=cfg)(sums.reshape(2, n_pairs), counts.reshape(2, n_pairs),
                                           y.reshape(2, n_pairs, seq_len), scalars)
    return {"pair_loss": pair_loss, "logp": logp.reshape(-1), "reward": reward.reshape(-1),
            "scale": scale.reshape(-1)}


def total(pair_sum, nll_sum, scalars, alpha):
    """(loss, nll): the pairs' summed losses plus alpha times the chosen tokens' mean NLL (0 without any)."""
    out = call(_cpo_total_kernel, out_shape=jax.ShapeDtypeStruct((2,), F32), grid=(1,), alpha=alpha,
               asm=not interpret_mode())(jnp.stack([pair_sum, nll_sum]), scalars)
    return out[0], out[1]

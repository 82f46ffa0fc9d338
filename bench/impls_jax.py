"""The JAX implementations under test, each behind a guarded import.

A builder returns ``loss(x, weight, targets) -> scalar`` (``x: [..., H]`` bf16, ``weight: [V, H]``, mean
reduction) or raises ``Unavailable``; ``fwd_bwd`` / ``loss_only`` give the functions that ``timing.measure_jax``
compiles and times (forward+backward = ``jax.value_and_grad`` w.r.t. ``x`` and ``weight``).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from bench.common import Settings, Unavailable, fce_logprobs, fce_none_rows, guarded_import

IGNORE = -100
Loss = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _token_logps(x: jax.Array, w: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Plain full-logits path: log p(target) per position (0 where ignored) and the validity mask."""
    logits = jnp.dot(x, w.T).astype(jnp.float32)  # bf16 logits, then upcast, as a plain model does
    valid = t != IGNORE
    logp = jax.nn.log_softmax(logits, axis=-1)
    tok = jnp.take_along_axis(logp, jnp.where(valid, t, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(valid, tok, 0.0), valid


# --- fused linear cross-entropy -------------------------------------------------------------------------


def fce(settings: Settings, engine: str = "auto") -> Loss:
    fused_lce = guarded_import("fce_jax", "fused_lce")
    return lambda x, w, t: fused_lce(x, w, t, engine=engine)


def naive(settings: Settings) -> Loss:
    def loss(x, w, t):
        tok, valid = _token_logps(x, w, t)
        return -tok.sum() / jnp.maximum(valid.sum(), 1)

    return loss


def tokamax_chunked(settings: Settings) -> Loss:
    """tokamax's ``linear_softmax_cross_entropy_loss(implementation="chunked_xla")`` (weights are [H, V])."""
    try:
        from tokamax._src.ops.linear_softmax_cross_entropy_loss import api
    except Exception as exc:
        raise Unavailable(f"tokamax not importable ({type(exc).__name__}: {exc})") from None
    if "chunked_xla" not in api.IMPLEMENTATIONS:
        raise Unavailable("this tokamax has no chunked_xla implementation")
    return lambda x, w, t: api.linear_softmax_cross_entropy_loss(
        x, t, w.T, reduction="mean", implementation="chunked_xla")


FLCE = {"fce_jax": fce, "fce_jax_fused": functools.partial(fce, engine="fused"),
        "fce_jax_library": functools.partial(fce, engine="library"),
        "tokamax_chunked_xla": tokamax_chunked, "jax_naive": naive}


def fwd_bwd(loss: Loss) -> Callable:
    return jax.value_and_grad(loss, argnums=(0, 1))


def loss_only(loss: Loss) -> Callable:
    return loss


# --- per-token log-probabilities and entropy -------------------------------------------------------------


def naive_logprobs(settings: Settings):
    def rows(x, w, t):
        logp = jax.nn.log_softmax(jnp.dot(x, w.T).astype(jnp.float32), axis=-1)
        tok = jnp.take_along_axis(logp, jnp.maximum(t, 0)[..., None], axis=-1)[..., 0]
        return jnp.where(t != IGNORE, tok, 0.0), -jnp.sum(jnp.exp(logp) * logp, axis=-1)

    return rows


LOGPROBS = {"fce_jax": fce_logprobs("fce_jax"), "fce_jax_fused": fce_logprobs("fce_jax", "fused"),
            "fce_jax_library": fce_logprobs("fce_jax", "library"),
            "fce_jax_none": fce_none_rows("fce_jax"), "jax_naive": naive_logprobs}


def fwd_bwd_rows(rows: Callable) -> Callable:
    """``jax.value_and_grad`` of ``sum(logp * g + entropy * h)`` w.r.t. x and weight (g, h: arguments)."""
    def total(x, w, t, g, h):
        logp, ent = rows(x, w, t)
        return jnp.sum(logp * g) if ent is None else jnp.sum(logp * g + ent * h)

    return jax.value_and_grad(total, argnums=(0, 1))


# --- fused linear CPO -----------------------------------------------------------------------------------


def fce_cpo(settings: Settings, beta: float, alpha: float, engine: str = "auto") -> Loss:
    fused_cpo_loss = guarded_import("fce_jax", "fused_cpo_loss")
    return lambda x, w, t: fused_cpo_loss(x, w, t, beta=beta, alpha=alpha, engine=engine)


def trl_cpo(settings: Settings, beta: float, alpha: float) -> Loss:
    """TRL's ``CPOTrainer`` (loss_type="sigmoid", cpo_alpha=alpha) on full logits (bf16, upcast to float32)."""

    def loss(x, w, t):
        tok, valid = _token_logps(x, w, t)  # [2B, T]
        b = x.shape[0] // 2
        logps = tok.sum(-1)
        pref = -jnp.mean(jax.nn.log_sigmoid(beta * (logps[:b] - logps[b:])))
        nll = -tok[:b].sum() / jnp.maximum(valid[:b].sum(), 1)
        return pref + alpha * nll

    return loss


CPO = {"fce_jax": fce_cpo, "fce_jax_fused": functools.partial(fce_cpo, engine="fused"),
       "fce_jax_library": functools.partial(fce_cpo, engine="library"), "trl_jax": trl_cpo}


# --- inputs ---------------------------------------------------------------------------------------------


def make_inputs(lead: tuple[int, ...], h: int, v: int, *, sets: int, seed: int = 0,
                ignore_prefix: int = 0) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """Same distributions as ``impls_torch.make_inputs`` (not the same numbers): bf16 ``x ~ N(0, 1)``,
    ``weight ~ N(0, 1/H)``, int32 targets uniform in ``[0, V)`` with an ignored prefix of ``ignore_prefix``."""
    key = jax.random.key(seed)
    out = []
    for _ in range(sets):
        key, kx, kw, kt = jax.random.split(key, 4)
        x = jax.random.normal(kx, (*lead, h), jnp.bfloat16)
        w = jax.random.normal(kw, (v, h), jnp.bfloat16) * jnp.bfloat16(h**-0.5)
        t = jax.random.randint(kt, lead, 0, v, jnp.int32)
        if ignore_prefix:
            t = t.at[..., :ignore_prefix].set(IGNORE)
        out.append((x, w, t))
    return out

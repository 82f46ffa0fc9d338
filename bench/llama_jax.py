"""A compact Llama-style causal LM in pure JAX for the ``sft`` benchmark: the JAX twin of the HF models.

RMSNorm, rotary embeddings (HF's rotate-half form), grouped-query attention through
``jax.nn.dot_product_attention`` (cuDNN's fused kernel on the GPU), SwiGLU MLP, embeddings tied to the LM
head; bf16 weights, layers stacked and run by ``lax.scan``. ``train_step`` is one forward, backward and AdamW
update (written here: float32 moments, bf16 weights), with a plain full-logits loss or ``fce_jax.fused_lce``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

INIT_STD = 0.02  # HF's initializer_range


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float


def init(cfg: Config, seed: int = 0) -> dict:
    """bf16 weights ~ N(0, 0.02²), norms at one; per-layer tensors stacked on a leading layer axis."""
    h, i, hd, n_layers = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_hidden_layers
    shapes = {"wq": (h, cfg.num_attention_heads * hd), "wk": (h, cfg.num_key_value_heads * hd),
              "wv": (h, cfg.num_key_value_heads * hd), "wo": (cfg.num_attention_heads * hd, h),
              "w_gate": (h, i), "w_up": (h, i), "w_down": (i, h)}
    keys = jax.random.split(jax.random.key(seed), len(shapes) + 1)

    def normal(key, shape):
        return (jax.random.normal(key, shape, jnp.float32) * INIT_STD).astype(jnp.bfloat16)

    layers = {name: normal(k, (n_layers, *shape)) for k, (name, shape) in zip(keys[1:], shapes.items())}
    layers["attn_norm"] = jnp.ones((n_layers, h), jnp.bfloat16)
    layers["mlp_norm"] = jnp.ones((n_layers, h), jnp.bfloat16)
    return {"embed": normal(keys[0], (cfg.vocab_size, h)), "layers": layers,
            "final_norm": jnp.ones((h,), jnp.bfloat16)}


def _rms_norm(x, g, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype) * g


def _rope(x, cos, sin):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def hidden_states(params: dict, ids: jax.Array, cfg: Config, attention: str | None) -> jax.Array:
    """The decoder's final normed hidden states ``[B, T, H]`` for token ids ``[B, T]``."""
    b, t = ids.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    freqs = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
    ang = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
    cos, sin = jnp.cos(ang).astype(jnp.bfloat16), jnp.sin(ang).astype(jnp.bfloat16)

    def layer(x, p):
        h = _rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        q = _rope((h @ p["wq"]).reshape(b, t, nh, hd), cos, sin)
        k = _rope((h @ p["wk"]).reshape(b, t, nkv, hd), cos, sin)
        v = (h @ p["wv"]).reshape(b, t, nkv, hd)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
        x = x + a.reshape(b, t, nh * hd) @ p["wo"]
        h = _rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
        return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"], None

    x, _ = jax.lax.scan(layer, params["embed"][ids], params["layers"])
    return _rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def plain_lce(h: jax.Array, w: jax.Array, t: jax.Array) -> jax.Array:
    """Full logits in bf16, upcast to float32, mean cross-entropy (what the HF stock loss does)."""
    return _mean_ce((h @ w.T).astype(jnp.float32), t)


def plain_lce_f32(h: jax.Array, w: jax.Array, t: jax.Array) -> jax.Array:
    """Full logits accumulated and kept in float32 (fce's logits precision), mean cross-entropy."""
    return _mean_ce(jnp.dot(h, w.T, preferred_element_type=jnp.float32), t)


def _mean_ce(logits: jax.Array, t: jax.Array) -> jax.Array:
    zy = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - zy)


def lm_loss(cfg: Config, lce: Callable, attention: str | None) -> Callable:
    """Next-token loss ``(params, ids) -> scalar``: hidden states of positions ``[0, T-1)`` against ids
    ``[1, T)``, through ``lce(h [N, H], embed [V, H], targets [N])``."""

    def loss(params, ids):
        h = hidden_states(params, ids, cfg, attention)[:, :-1].reshape(-1, cfg.hidden_size)
        return lce(h, params["embed"], ids[:, 1:].reshape(-1))

    return loss


def adamw_init(params: dict) -> dict:
    def zeros():  # distinct buffers for m and v: both are donated to the step
        return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    return {"m": zeros(), "v": zeros(), "step": jnp.zeros((), jnp.int32)}


def train_step(loss: Callable, lr: float, weight_decay: float, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8) -> Callable:
    """``(params, opt, ids) -> (params, opt, loss)``: value_and_grad, then torch-style AdamW (decoupled decay)."""

    def step(params, opt, ids):
        value, grads = jax.value_and_grad(loss)(params, ids)
        n = opt["step"] + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g.astype(jnp.float32), opt["m"], grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g.astype(jnp.float32)), opt["v"], grads)
        c1, c2 = 1 - b1 ** n.astype(jnp.float32), 1 - b2 ** n.astype(jnp.float32)

        def update(p, m, v):
            p32 = p.astype(jnp.float32) * (1 - lr * weight_decay)
            return (p32 - lr * (m / c1) / (jnp.sqrt(v / c2) + eps)).astype(p.dtype)

        return jax.tree.map(update, params, m, v), {"m": m, "v": v, "step": n}, value

    return step

"""``python -m bench sft``: training steps of a causal LM with each loss: tokens/s, peak memory, loss curves.

torch: ``transformers`` models from configs (tied embeddings, random init, bf16 weights, no downloads), a fixed
random batch, forward + backward + ``torch.optim.AdamW`` for ``STEPS`` steps, each loss on identical weights:
- ``hf_stock``:  ``model(input_ids, labels=input_ids).loss`` (bf16 logits, upcast, ``F.cross_entropy``);
- ``liger``:     the decoder's hidden states into ``LigerForCausalLMLoss``, the call Liger's patched
                 ``forward`` makes (done directly, so no class is monkey-patched for the runs after it);
- ``fce_torch``: the model patched by ``fce_torch.hf.patch(model)``, then ``model(input_ids, labels=...)``.
JAX: the same architecture in ``bench.llama_jax`` with a plain full-logits loss (``jax_naive``) vs ``fce_jax``.

Per run: median step time after ``WARM`` steps (tokens/s), peak memory (torch: ``max_memory_allocated`` over
the run, weights and optimizer included; JAX: the compiled step's arguments + outputs - aliased + temp), the
step-1 loss and its difference to the framework's plain loss, and whether the whole loss curve agrees
within bf16 noise (``STEP1_RTOL``, ``CURVE_RTOL``).
"""

from __future__ import annotations

import gc
import statistics
import time

import numpy as np

from bench import report
from bench.common import Progress, Settings, Unavailable, meta, rel_diff, short_error
from bench.timing import Stopwatch, free_torch_cache

MODELS = {
    "qwen2.5-0.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                         rope_theta=1e6, rms_norm_eps=1e-6),
    "llama-3.2-1b": dict(arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         rope_theta=5e5, rms_norm_eps=1e-5),
}
_TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-6)
SMOKE_MODELS = {"tiny-qwen2": dict(arch="qwen2", **_TINY), "tiny-llama": dict(arch="llama", **_TINY)}
BATCH, SEQ, STEPS, WARM = 8, 2048, 20, 3  # 16384 tokens a step
SMOKE_BATCH, SMOKE_SEQ, SMOKE_STEPS, SMOKE_WARM = 1, 32, 3, 1
LR, WEIGHT_DECAY = 3e-4, 0.01
STEP1_RTOL, CURVE_RTOL = 5e-3, 2e-2  # bf16 noise: same weights and batch, different loss numerics
PLAIN = {"torch": "hf_stock", "jax": "jax_naive"}

COLUMNS = [
    report.Column("model", "model"), report.Column("framework", "fw"), report.Column("impl", "impl"),
    report.Column("tokens_per_s", "tokens/s", report.count),
    report.Column("step_ms", "step ms", report.ms),
    report.Column("peak_gib", "peak GiB", report.gib),
    report.Column("loss1", "loss@1", lambda v: f"{v:.4f}"),
    report.Column("d_step1", "d loss@1", report.rel),
    report.Column("d_curve", "d curve", report.rel),
    report.Column("agree", "agree"),
    report.Column("note", "note"),
]
PLOTS = [
    report.Plot("sft_tokens", "impl", "tokens_per_s", "tokens/s", "training step throughput", panel=("model",),
                kind="bar", logy=False),
    report.Plot("sft_memory", "impl", "peak_gib", "peak memory (GiB)", "training step peak memory",
                panel=("model",), kind="bar", logy=False),
]


# --- torch / transformers -------------------------------------------------------------------------------


def _hf_model(spec: dict, settings: Settings):
    import torch
    import transformers

    arch, kw = spec["arch"], {k: v for k, v in spec.items() if k != "arch"}
    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[arch]
    cfg = cls(**kw, tie_word_embeddings=True, attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device(settings.device):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")


def _stock(model):
    return lambda ids: model(input_ids=ids, labels=ids).loss


def _liger(model):
    try:
        from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss
    except Exception as exc:
        raise Unavailable(f"liger_kernel not importable ({exc})") from None
    hidden = model.config.hidden_size

    def loss(ids):
        h = model.model(input_ids=ids).last_hidden_state
        return LigerForCausalLMLoss(h, model.lm_head.weight, ids, hidden_size=hidden)

    return loss


def _fce(model):
    try:
        from fce_torch import hf
    except Exception as exc:
        raise Unavailable(f"fce_torch.hf not importable ({type(exc).__name__}: {exc})") from None
    if not hasattr(hf, "patch"):
        raise Unavailable("fce_torch.hf has no patch(model) yet")
    hf.patch(model)  # in place: this instance's forward only
    return lambda ids: model(input_ids=ids, labels=ids).loss


TORCH = {"hf_stock": _stock, "liger": _liger, "fce_torch": _fce}


def _torch_run(spec: dict, impl: str, ids_np: np.ndarray, steps: int, settings: Settings) -> dict:
    import torch

    model = _hf_model(spec, settings)
    loss_fn = TORCH[impl](model)  # may raise Unavailable
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=settings.gpu)
    ids = torch.from_numpy(ids_np).to(settings.device)
    if settings.gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    watch, losses = Stopwatch(settings.gpu), []
    try:
        for _ in range(steps):
            watch.start()
            loss = loss_fn(ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            watch.stop()
            losses.append(loss.item())
        peak = torch.cuda.max_memory_allocated() if settings.gpu else None
        return {"times": watch.times_ms(), "losses": losses, "peak": peak}
    finally:
        del model, opt, loss_fn
        free_torch_cache(settings)


# --- JAX ------------------------------------------------------------------------------------------------


def _jax_run(spec: dict, impl: str, ids_np: np.ndarray, steps: int, settings: Settings) -> dict:
    import jax

    from bench import llama_jax

    if impl == "fce_jax":
        try:
            from fce_jax import fused_lce as lce
        except Exception as exc:
            raise Unavailable(f"fce_jax.fused_lce not importable ({type(exc).__name__}: {exc})") from None
    else:
        lce = llama_jax.plain_lce
    cfg = llama_jax.Config(**{k: v for k, v in spec.items() if k != "arch"})
    ids = jax.numpy.asarray(ids_np)
    note = ""
    attentions = ["cudnn", "xla"] if jax.default_backend() == "gpu" else ["xla"]
    for attention in attentions:  # cuDNN's fused attention; XLA's (materialized scores) if cuDNN refuses
        params = llama_jax.init(cfg)
        opt = llama_jax.adamw_init(params)
        step = jax.jit(llama_jax.train_step(llama_jax.lm_loss(cfg, lce, attention), LR, WEIGHT_DECAY),
                       donate_argnums=(0, 1))
        try:
            compiled = step.lower(params, opt, ids).compile()
            break
        except Exception as exc:
            if attention == attentions[-1]:
                raise
            note = f"attention: xla ({attention} failed: {type(exc).__name__})"
    mem = compiled.memory_analysis()
    peak = None
    if jax.default_backend() != "cpu" and mem is not None:
        peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                + mem.temp_size_in_bytes)
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, opt, loss = jax.block_until_ready(compiled(params, opt, ids))
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(loss))
    return {"times": times, "losses": losses, "peak": peak, "note": note}


# --- the benchmark --------------------------------------------------------------------------------------


def _agreement(rows: list[dict]) -> None:
    """Compare every run's loss curve with its framework's plain loss on the same model."""
    base = {(r["model"], r["framework"]): r for r in rows if r["impl"] == PLAIN[r["framework"]] and r["losses"]}
    for r in rows:
        ref = base.get((r["model"], r["framework"]))
        if not r["losses"] or ref is None or ref is r:
            continue
        r["d_step1"] = rel_diff(r["losses"][0], ref["losses"][0])
        diffs = [rel_diff(a, b) for a, b in zip(r["losses"], ref["losses"])]
        r["d_curve"] = None if None in diffs else max(diffs)
        ok = r["d_curve"] is not None and r["d_step1"] <= STEP1_RTOL and r["d_curve"] <= CURVE_RTOL
        r["agree"] = "yes" if ok else "NO"


def run(settings: Settings, progress: Progress) -> dict:
    models = SMOKE_MODELS if settings.smoke else MODELS
    batch, seq, steps, warm = ((SMOKE_BATCH, SMOKE_SEQ, SMOKE_STEPS, SMOKE_WARM) if settings.smoke
                               else (BATCH, SEQ, STEPS, WARM))
    runners = [("torch", name, _torch_run) for name in TORCH] + [("jax", name, _jax_run)
                                                                 for name in ("jax_naive", "fce_jax")]
    notes: dict[str, str] = {}
    rows: list[dict] = []
    # All torch runs first: JAX's allocator keeps what it has taken, torch's gives it back between runs.
    for framework, impl, runner in runners:
        for model, spec in models.items():
            if not settings.wanted(impl) or impl in notes:
                continue
            ids = np.random.default_rng(1).integers(0, spec["vocab_size"], (batch, seq), dtype=np.int64)
            row = dict(model=model, framework=framework, impl=impl, tokens=batch * seq, step_ms=None,
                       tokens_per_s=None, peak_gib=None, loss1=None, d_step1=None, d_curve=None, agree=None,
                       note="", losses=[])
            try:
                out = runner(spec, impl, ids, steps, settings)
            except Unavailable as exc:
                notes[impl] = str(exc)
                progress.log(f"sft: skipping {impl}: {exc}")
                continue
            except Exception as exc:  # OOM, ...: record it, go on
                row["note"] = short_error(exc)
            else:
                step_ms = statistics.median(out["times"][warm:])
                row.update(step_ms=step_ms, tokens_per_s=batch * seq / step_ms * 1e3, losses=out["losses"],
                           loss1=out["losses"][0], peak_gib=None if out["peak"] is None else out["peak"] / 2**30,
                           note=out.get("note", ""))
            gc.collect()
            rows.append(row)
            progress.log(f"sft {model:<14} {framework:<5} {impl:<10} "
                         + (row["note"] or f"{row['step_ms']:9.2f} ms/step  loss@1 {row['loss1']:.4f}"))
    rows.sort(key=lambda r: list(models).index(r["model"]))  # stable: per model, in the order run
    _agreement(rows)
    m = meta(settings, batch=batch, seq=seq, steps=steps, warm_steps=warm, lr=LR, weight_decay=WEIGHT_DECAY,
             models=models, tolerances={"step1": STEP1_RTOL, "curve": CURVE_RTOL})
    return {"bench": "sft", "title": f"Training step, bf16, {batch}x{seq} tokens ({m['device']})", "meta": m,
            "notes": notes, "rows": rows}

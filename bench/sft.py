"""``python -m bench sft``: training steps of a causal LM with each loss: tokens/s, peak memory, loss curves.

torch: ``transformers`` models from configs (tied embeddings, random init, bf16 weights, no downloads), a fixed
random batch, forward + backward + ``torch.optim.AdamW`` for ``STEPS`` steps, each loss on identical weights:
- ``hf_stock``:  ``model(input_ids, labels=input_ids).loss`` (bf16 logits, upcast, ``F.cross_entropy``);
- ``liger``:     the decoder's hidden states into ``LigerForCausalLMLoss``, the call Liger's patched
                 ``forward`` makes (done directly, so no class is monkey-patched for the runs after it);
- ``fce_torch``: the model patched by ``fce_torch.hf.patch(model)``, then ``model(input_ids, labels=...)``
  (the default engine, "auto"); ``fce_torch_fused`` and ``fce_torch_library``: the same with that engine.
JAX: the same architecture in ``bench.llama_jax`` with a plain full-logits loss (``jax_naive``: bf16 logits,
as HF does; ``jax_f32_logits``: float32 logits, the precision fce keeps, to tell a logits-precision drift of
the curve from an error) vs ``fce_jax`` (and ``fce_jax_fused``, ``fce_jax_library``: that engine). ``--model`` picks
models.

Per run: median step time after ``WARM`` steps (tokens/s), peak memory (torch: ``max_memory_allocated`` over
the run, weights and optimizer included; JAX: the compiled step's arguments + outputs - aliased + temp), the
step-1 loss and its difference to the framework's plain loss, and whether the whole loss curve agrees
within bf16 noise (``STEP1_RTOL``; ``CURVE_RTOL`` or twice the plain loss's own run-to-run difference, the
``rerun`` column: the plain loss runs twice).

``--compile-body`` compiles every torch model's decoder (``model.model``) with ``torch.compile`` (`_hf_model`): the
step as a compiled training stack runs it, the same decoder before every loss.

``--profile`` answers "where does the step time go". It adds, per framework that runs, an ablation row
``body_only`` (also selectable alone with ``--impl body_only``): the same step with the loss replaced by
``mean(h**2)`` of the decoder's last hidden states (torch: ``model.model(...).last_hidden_state``; JAX:
``llama_jax.hidden_states``), so no LM head and no logits but the decoder's whole backward and the optimizer.
step(impl) - step(body_only) is what the LM head and the loss cost inside a step (``head_loss_ms`` and
``head_loss_share`` in the rows); the agreement columns do not apply to the ablation. After all timed torch
runs, every torch run that worked (``body_only`` included) is repeated on a fresh model: ``WARM`` steps, then
``profiling.PROFILE_STEPS`` steps under ``torch.profiler``, whose kernel time is summed into GEMM / attention /
loss / optimizer / other, with the top kernels (``bench.profiling``). That pass comes after the timed torch
runs because CUPTI stays attached after a capture (unless torn down) and would slow the launches of the runs
after it; the JAX runs do come after it, but a JAX step is one compiled launch, the same for all JAX rows.
The captures go into the result's ``profile`` list, and a ``Profile`` section into the Markdown.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time

import numpy as np

from bench import profiling, report
from bench.common import Progress, Settings, Unavailable, guarded_import, meta, rel_diff, short_error
from bench.timing import Stopwatch, free_torch_cache

MODELS = {
    "qwen2.5-0.5b": dict(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                         rope_theta=1e6, rms_norm_eps=1e-6),
    "llama-3.2-1b": dict(arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         rope_theta=5e5, rms_norm_eps=1e-5),
    # Gemma-3-270M's shapes (tied, V=262144, H=640) in the Llama architecture: its LM head and loss are
    # the largest share of a step among the models here.
    "gemma-3-270m-shaped": dict(arch="llama", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                                num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                rope_theta=1e6, rms_norm_eps=1e-6),
}
_TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-6)
SMOKE_MODELS = {"tiny-qwen2": dict(arch="qwen2", **_TINY), "tiny-llama": dict(arch="llama", **_TINY)}
BATCH, SEQ, STEPS, WARM = 8, 2048, 20, 3  # 16384 tokens a step
SMOKE_BATCH, SMOKE_SEQ, SMOKE_STEPS, SMOKE_WARM = 1, 32, 3, 1
LR, WEIGHT_DECAY = 3e-4, 0.01
STEP1_RTOL, CURVE_RTOL = 5e-3, 2e-2  # bf16 noise: same weights and batch, different loss numerics
PLAIN = {"torch": "hf_stock", "jax": "jax_naive"}
ABLATION = "body_only"  # --profile: the step without LM head and loss, in each framework

COLUMNS = [
    report.Column("model", "model"), report.Column("framework", "fw"), report.Column("impl", "impl"),
    report.Column("tokens_per_s", "tokens/s", report.count),
    report.Column("step_ms", "step ms", report.ms),
    report.Column("peak_gib", "peak GiB", report.gib),
    report.Column("loss1", "loss@1", lambda v: f"{v:.4f}"),
    report.Column("d_step1", "d loss@1", report.rel),
    report.Column("d_curve", "d curve", report.rel),
    report.Column("noise", "rerun", report.rel),
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


def _hf_model(spec: dict, settings: Settings, compile_body: bool = False):
    """The model of ``spec``; with ``compile_body`` its decoder (``model.model``) is ``torch.compile``'d in place,
    so every loss, which all take that decoder's hidden states, runs after the same compiled body."""
    import torch
    import transformers

    arch, kw = spec["arch"], {k: v for k, v in spec.items() if k != "arch"}
    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[arch]
    cfg = cls(**kw, tie_word_embeddings=True, attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device(settings.device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    if compile_body:
        model.model.compile()
    return model


def _stock(model):
    return lambda ids: model(input_ids=ids, labels=ids).loss


def _liger(model):
    LigerForCausalLMLoss = guarded_import("liger_kernel.transformers.model.loss_utils", "LigerForCausalLMLoss")
    hidden = model.config.hidden_size

    def loss(ids):
        h = model.model(input_ids=ids).last_hidden_state
        return LigerForCausalLMLoss(h, model.lm_head.weight, ids, hidden_size=hidden)

    return loss


def _fce(model, engine="auto"):
    guarded_import("fce_torch.hf", "patch")(model, engine=engine)  # in place: this instance's forward only
    return lambda ids: model(input_ids=ids, labels=ids).loss


def _body(model):
    """The ablation: the decoder's whole forward and backward, a loss that costs ~nothing, no LM head."""
    return lambda ids: model.model(input_ids=ids).last_hidden_state.float().square().mean()


TORCH = {"hf_stock": _stock, "liger": _liger, "fce_torch": _fce,
         "fce_torch_fused": functools.partial(_fce, engine="fused"),
         "fce_torch_library": functools.partial(_fce, engine="library")}
FCE_JAX = {"fce_jax": "auto", "fce_jax_fused": "fused", "fce_jax_library": "library"}  # impl: engine
JAX = ("jax_naive", "jax_f32_logits", *FCE_JAX)


def _torch_run(spec: dict, impl: str, ids_np: np.ndarray, steps: int, settings: Settings,
               profile_steps: int = 0, compile_body: bool = False) -> dict:
    """``steps`` timed training steps; then, with ``profile_steps``, that many more under torch.profiler."""
    import torch

    model = _hf_model(spec, settings, compile_body)
    loss_fn = (_body if impl == ABLATION else TORCH[impl])(model)  # may raise Unavailable
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=settings.gpu)
    ids = torch.from_numpy(ids_np).to(settings.device)

    def step():
        loss = loss_fn(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if settings.gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    watch, losses = Stopwatch(settings.gpu), []
    try:
        for _ in range(steps):
            watch.start()
            loss = step()
            watch.stop()
            losses.append(loss.item())
        peak = torch.cuda.max_memory_allocated() if settings.gpu else None
        out = {"times": watch.times_ms(), "losses": losses, "peak": peak}
        if profile_steps:
            out["profile"] = profiling.capture(step, settings.gpu, profile_steps)
        return out
    finally:
        del model, opt, loss_fn, step
        free_torch_cache(settings)


# --- JAX ------------------------------------------------------------------------------------------------


def _jax_loss(cfg, impl: str, attention: str):
    """``(params, ids) -> loss`` of ``impl`` (``body_only``: ``mean(h**2)`` of the final hidden states)."""
    import jax.numpy as jnp

    from bench import llama_jax

    if impl == ABLATION:
        return lambda params, ids: jnp.mean(jnp.square(
            llama_jax.hidden_states(params, ids, cfg, attention).astype(jnp.float32)))
    if impl in FCE_JAX:
        lce = functools.partial(guarded_import("fce_jax", "fused_lce"), engine=FCE_JAX[impl])
    else:
        lce = llama_jax.plain_lce_f32 if impl == "jax_f32_logits" else llama_jax.plain_lce
    return llama_jax.lm_loss(cfg, lce, attention)


def _jax_run(spec: dict, impl: str, ids_np: np.ndarray, steps: int, settings: Settings) -> dict:
    import jax

    from bench import llama_jax

    cfg = llama_jax.Config(**{k: v for k, v in spec.items() if k != "arch"})
    ids = jax.numpy.asarray(ids_np)
    note = ""
    attentions = ["cudnn", "xla"] if jax.default_backend() == "gpu" else ["xla"]
    for attention in attentions:  # cuDNN's fused attention; XLA's (materialized scores) if cuDNN refuses
        params = llama_jax.init(cfg)
        opt = llama_jax.adamw_init(params)
        step = jax.jit(llama_jax.train_step(_jax_loss(cfg, impl, attention), LR, WEIGHT_DECAY),
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


def _curve_diff(a: list[float], b: list[float]) -> float | None:
    diffs = [rel_diff(x, y) for x, y in zip(a, b)]
    return None if not diffs or None in diffs else max(diffs)


def _agreement(rows: list[dict]) -> None:
    """Compare every run's loss curve with its framework's plain loss on the same model (not the ablation's).

    The plain loss ran twice; its two curves differ too (the GPU runs are not bitwise repeatable, and 20 steps
    of training amplify that). That difference is the run-to-run noise; a curve
    agrees when it stays within CURVE_RTOL or twice the noise, whichever is larger.
    """
    base = {(r["model"], r["framework"]): r for r in rows if r["impl"] == PLAIN[r["framework"]] and r["losses"]}
    for ref in base.values():
        ref["noise"] = _curve_diff(ref.get("rerun_losses", []), ref["losses"])
    for r in rows:
        ref = base.get((r["model"], r["framework"]))
        if not r["losses"] or ref is None or ref is r or r["impl"] == ABLATION:
            continue
        r["d_step1"] = rel_diff(r["losses"][0], ref["losses"][0])
        r["d_curve"] = _curve_diff(r["losses"], ref["losses"])
        bound = max(CURVE_RTOL, 2 * (ref["noise"] or 0.0))
        ok = r["d_curve"] is not None and r["d_step1"] <= STEP1_RTOL and r["d_curve"] <= bound
        r["agree"] = "yes" if ok else "NO"


def _head_loss(rows: list[dict]) -> None:
    """``head_loss_ms`` = step - ``body_only`` step of the same model and framework (and its share)."""
    body = {(r["model"], r["framework"]): r["step_ms"] for r in rows if r["impl"] == ABLATION and r["step_ms"]}
    for r in rows:
        b = body.get((r["model"], r["framework"]))
        if r["impl"] != ABLATION and b is not None and r["step_ms"] is not None:
            r.update(body_ms=b, head_loss_ms=r["step_ms"] - b, head_loss_share=(r["step_ms"] - b) / r["step_ms"])


def _impls(framework: str, settings: Settings, profile: bool) -> list[str]:
    """The framework's implementations that ``--impl`` selects, then the ablation when profiling them (or
    when ``--impl body_only`` names it)."""
    chosen = [name for name in (TORCH if framework == "torch" else JAX) if settings.wanted(name)]
    if ABLATION in (settings.impls or ()) or (profile and chosen):
        chosen.append(ABLATION)
    return chosen


def _ids(spec: dict, batch: int, seq: int) -> np.ndarray:
    return np.random.default_rng(1).integers(0, spec["vocab_size"], (batch, seq), dtype=np.int64)


def _timed_runs(framework: str, impls: list[str], models: dict, shape: tuple, settings: Settings,
                notes: dict[str, str], progress: Progress, compile_body: bool) -> list[dict]:
    """One row per (implementation, model) that can run here; why the others cannot goes into ``notes``."""
    batch, seq, steps, warm = shape
    runner = functools.partial(_torch_run, compile_body=compile_body) if framework == "torch" else _jax_run
    rows: list[dict] = []
    for impl in impls:
        for model, spec in models.items():
            if impl in notes:
                continue
            row = dict(model=model, framework=framework, impl=impl, tokens=batch * seq, step_ms=None,
                       tokens_per_s=None, peak_gib=None, loss1=None, d_step1=None, d_curve=None, noise=None,
                       agree=None,
                       note="ablation" if impl == ABLATION else "", losses=[])
            try:
                out = runner(spec, impl, _ids(spec, batch, seq), steps, settings)
            except Unavailable as exc:
                notes[impl] = str(exc)
                progress.log(f"sft: skipping {impl}: {exc}")
                continue
            except Exception as exc:  # OOM, ...: record it, go on
                row["note"] = short_error(exc)
            else:
                step_ms = statistics.median(out["times"][warm:])
                row.update(step_ms=step_ms, tokens_per_s=batch * seq / step_ms * 1e3, losses=out["losses"],
                           loss1=out["losses"][0], peak_gib=None if out["peak"] is None else out["peak"] / 2**30)
                row["note"] = "; ".join(x for x in (row["note"], out.get("note", "")) if x)
                if impl == PLAIN[framework]:  # the same run again: how far its own curve moves
                    row["rerun_losses"] = runner(spec, impl, _ids(spec, batch, seq), steps, settings)["losses"]
            gc.collect()
            rows.append(row)
            progress.log(f"sft {model:<14} {framework:<5} {impl:<10} "
                         + (f"{row['step_ms']:9.2f} ms/step  loss@1 {row['loss1']:.4f}" if row["step_ms"]
                            else row["note"]))
    return rows


def _profile_torch(rows: list[dict], models: dict, shape: tuple, settings: Settings, notes: dict[str, str],
                   progress: Progress, compile_body: bool) -> list[dict]:
    """Profile every torch run that worked, each on a fresh model: ``warm`` steps, then the captured ones."""
    batch, seq, _, warm = shape
    captures = []
    for r in rows:
        if r["framework"] != "torch" or r["step_ms"] is None:
            continue
        spec, label = models[r["model"]], f"sft profile {r['model']:<14} {r['impl']:<10}"
        try:
            out = _torch_run(spec, r["impl"], _ids(spec, batch, seq), warm, settings, profiling.PROFILE_STEPS,
                             compile_body)
        except Exception as exc:  # OOM under the profiler, ...: the timed row stands, the split is missing
            notes[f"profile {r['model']} {r['impl']}"] = short_error(exc)
            progress.log(f"{label} {short_error(exc)}")
            continue
        captures.append(dict(model=r["model"], impl=r["impl"], step_ms=r["step_ms"], **out["profile"]))
        progress.log(f"{label} {profiling.one_line(out['profile'])}")
    return captures


def run(settings: Settings, progress: Progress, profile: bool = False, model_names: list[str] | None = None,
        compile_body: bool = False) -> dict:
    """The steps of every implementation on each model (`model_names`: names of MODELS, default all); with
    `compile_body`, the torch runs' decoders are ``torch.compile``'d (`_hf_model`)."""
    catalog = SMOKE_MODELS if settings.smoke else MODELS
    unknown = sorted(set(model_names or ()) - set(catalog))
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; known: {sorted(catalog)}")
    models = {name: spec for name, spec in catalog.items() if not model_names or name in model_names}
    shape = (SMOKE_BATCH, SMOKE_SEQ, SMOKE_STEPS, SMOKE_WARM) if settings.smoke else (BATCH, SEQ, STEPS, WARM)
    batch, seq, steps, warm = shape
    notes: dict[str, str] = {}
    rows: list[dict] = []
    captures: list[dict] = []
    # All torch runs first: JAX's allocator keeps what it has taken, torch's gives it back between runs. The
    # profiling pass right after the timed torch runs, so that the profiler cannot slow any of them.
    for framework in ("torch", "jax"):
        rows += _timed_runs(framework, _impls(framework, settings, profile), models, shape, settings, notes,
                            progress, compile_body)
        if framework == "torch" and profile:
            captures = _profile_torch(rows, models, shape, settings, notes, progress, compile_body)
    order = list(models)
    rows.sort(key=lambda r: order.index(r["model"]))  # stable: per model, in the order run
    captures.sort(key=lambda c: order.index(c["model"]))
    _agreement(rows)
    _head_loss(rows)
    for r in rows:
        if r.get("head_loss_ms") is not None:
            progress.log(f"sft {r['model']:<14} {r['framework']:<5} {r['impl']:<10} head+loss "
                         f"{r['head_loss_ms']:8.2f} of {r['step_ms']:.2f} ms/step ({r['head_loss_share']:.0%})")
    m = meta(settings, batch=batch, seq=seq, steps=steps, warm_steps=warm, lr=LR, weight_decay=WEIGHT_DECAY,
             models=models, tolerances={"step1": STEP1_RTOL, "curve": CURVE_RTOL}, profile=profile,
             torch_decoder="torch.compile" if compile_body else "eager")
    body = ", torch decoder compiled" if compile_body else ""
    result = {"bench": "sft", "title": f"Training step, bf16, {batch}x{seq} tokens{body} ({m['device']})", "meta": m,
              "notes": notes, "rows": rows}
    if profile:
        m["profile_steps"] = profiling.PROFILE_STEPS
        result["profile"] = captures
        result["sections"] = [{"title": "Profile", "markdown": profiling.markdown(rows, captures, warm)}]
    return result

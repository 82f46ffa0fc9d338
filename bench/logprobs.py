"""``python -m bench logprobs``: per-token log-probs and entropies (the RL primitive), bf16, forward + backward
with random cotangents on both outputs.

Implementations: ``fused_token_logprobs`` of each twin, the plain computation of each framework (logits,
``log_softmax``, gather, entropy), and each twin's ``fused_lce(..., reduction="none")`` at the same shape (its
CE rows, one cotangent): the time that fused_token_logprobs is held to (``x_none``, target <= 1.10).
``x_plain`` is the time over the framework's plain computation. Memory as in every bench (bench/timing.py):
torch's peak during one call over what was allocated before it, the gradients included; JAX's compiled temp
buffers plus its outputs.
"""

from __future__ import annotations

import torch

from bench import impls_torch, report
from bench.common import Progress, Settings, implementations, meta, run_cell
from bench.timing import free_torch_cache, measure_jax, measure_torch

SHAPES = [(8192, 4096, 151936), (16384, 2048, 128256)]
SMOKE = [(64, 128, 512)]
INPUT_SETS = 2
COLUMNS = [
    report.Column("N", "N"), report.Column("H", "H"), report.Column("V", "V"), report.Column("impl", "impl"),
    report.Column("ms", "ms", report.ms), report.Column("x_none", "x_none", report.ratio),
    report.Column("x_plain", "x_plain", report.ratio), report.Column("extra_gib", "peak GiB", report.gib),
    report.Column("note", "note"),
]
PLOTS = [report.Plot("logprobs_time", "N", "ms", "median time (ms)", "logp + entropy, fwd+bwd, bf16",
                     panel=("H", "V"))]


def _cotangents(n: int, settings: Settings):
    g = torch.Generator(device=settings.device).manual_seed(7)
    return (torch.randn(n, device=settings.device, generator=g),
            torch.randn(n, device=settings.device, generator=g))


def _torch_rows(shape, impls: dict, settings: Settings, progress: Progress) -> list[dict]:
    n, h, v = shape
    rows: list[dict] = []
    sets = impls_torch.make_inputs((n,), h, v, sets=INPUT_SETS, settings=settings)
    cot = _cotangents(n, settings)
    for name, build in impls.items():
        fn = impls_torch.fwd_bwd_rows(build, *cot)
        run_cell(rows, progress, f"logprobs N={n} H={h} V={v} {name}",
                 lambda: measure_torch(fn, sets, settings=settings),
                 impl=name, framework="torch", N=n, H=h, V=v)
        free_torch_cache(settings)
    return rows


def _jax_rows(shape, impls: dict, impls_jax, settings: Settings, progress: Progress) -> list[dict]:
    import jax.numpy as jnp

    n, h, v = shape
    rows: list[dict] = []
    g, hh = (jnp.asarray(t.cpu().numpy()) for t in _cotangents(n, settings))
    sets = [(*s, g, hh) for s in impls_jax.make_inputs((n,), h, v, sets=INPUT_SETS)]
    for name, build in impls.items():
        fn = impls_jax.fwd_bwd_rows(build)
        run_cell(rows, progress, f"logprobs N={n} H={h} V={v} {name}",
                 lambda: measure_jax(fn, sets, settings=settings), impl=name, framework="jax", N=n, H=h, V=v)
    return rows


def _compare(rows: list[dict]) -> None:
    by = {(r["N"], r["H"], r["V"], r["impl"]): r for r in rows}
    for r in rows:
        fw = r["framework"]
        none = by.get((r["N"], r["H"], r["V"], f"fce_{fw}_none"))
        plain = by.get((r["N"], r["H"], r["V"], f"{fw}_naive"))
        r["x_none"] = r["ms"] / none["ms"] if r.get("ms") and none and none.get("ms") else None
        r["x_plain"] = r["ms"] / plain["ms"] if r.get("ms") and plain and plain.get("ms") else None


def run(settings: Settings, progress: Progress, shapes=None) -> dict:
    torch_impls, impls_jax, jax_impls, notes = implementations("LOGPROBS", settings, progress)
    shapes = shapes or (SMOKE if settings.smoke else SHAPES)
    rows: list[dict] = []
    for shape in shapes:
        rows += _torch_rows(shape, torch_impls, settings, progress)
        if jax_impls:
            rows += _jax_rows(shape, jax_impls, impls_jax, settings, progress)
    _compare(rows)
    m = meta(settings, shapes=shapes, input_sets=INPUT_SETS)
    return {"bench": "logprobs", "title": f"Token log-probs + entropy, bf16, fwd+bwd ({m['device']})",
            "meta": m, "notes": notes, "rows": rows}

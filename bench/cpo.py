"""``python -m bench cpo``: the fused linear CPO loss (SPEC §3, loss_type="sigmoid"), forward+backward, bf16.

``x: [2B, T, H]`` (B chosen then B rejected sequences), ``weight: [V, H]``, targets with the first quarter of
every sequence ignored (the prompt). Implementations: ``fce_torch`` / ``fce_jax`` ``fused_cpo_loss``, Liger's
``LigerFusedLinearCPOLoss`` (torch.compile'd chunks), and TRL's ``CPOTrainer`` loss on full bf16 logits
upcast to float32, in torch and in JAX. ``xLiger`` is the time ratio to Liger; ``dloss`` the loss's relative
difference from the TRL loss of the same framework on the same inputs (mostly the TRL loss's own bf16-logits
error: fce keeps the logits in float32).
"""

from __future__ import annotations

from bench import impls_torch, report
from bench.common import Progress, Settings, implementations, meta, rel_diff, run_cell
from bench.timing import free_torch_cache, measure_jax, measure_torch

PAIRS, T, H, V = (1, 2, 4, 8), 1024, 4096, 128256
# V: 8 tiles of the Triton interpreter's 32 columns; at 500, fce_torch's fused engine took a third of the smoke run
SMOKE_PAIRS, SMOKE_T, SMOKE_H, SMOKE_V = (1, 2), 16, 32, 256
BETA, ALPHA = 0.1, 1.0
INPUT_SETS = 2
PLAIN = {"torch": "trl_torch", "jax": "trl_jax"}

COLUMNS = [
    report.Column("B", "pairs"), report.Column("T", "T"), report.Column("H", "H"), report.Column("V", "V"),
    report.Column("impl", "impl"),
    report.Column("ms", "ms", report.ms),
    report.Column("x_liger", "xLiger", report.ratio),
    report.Column("extra_gib", "peak GiB", report.gib),
    report.Column("loss", "loss", lambda v: f"{v:.5f}"),
    report.Column("dloss", "dloss", report.rel),
    report.Column("note", "note"),
]
PLOTS = [
    report.Plot("cpo_time", "B", "ms", "median time (ms)", "fused linear CPO, forward+backward, bf16",
                panel=("T", "H", "V")),
    report.Plot("cpo_memory", "B", "extra_gib", "peak memory over the inputs, gradients included (GiB)",
                "fused linear CPO, forward+backward",
                panel=("T", "H", "V")),
]


def _compare(rows: list[dict]) -> None:
    by = {(r["B"], r["impl"]): r for r in rows}
    for r in rows:
        lig, base = by.get((r["B"], "liger")), by.get((r["B"], PLAIN[r["framework"]]))
        r["x_liger"] = r["ms"] / lig["ms"] if r["ms"] and lig and lig["ms"] else None
        r["dloss"] = rel_diff(r["loss"], base["loss"]) if base and r is not base else None


def run(settings: Settings, progress: Progress, pairs: tuple[int, ...] | None = None) -> dict:
    """The table's rows at each number of `pairs` (default PAIRS; smoke SMOKE_PAIRS)."""
    default, t, h, v = (SMOKE_PAIRS, SMOKE_T, SMOKE_H, SMOKE_V) if settings.smoke else (PAIRS, T, H, V)
    pairs = pairs or default
    torch_losses, impls_jax, jax_losses, notes = implementations("CPO", settings, progress, beta=BETA, alpha=ALPHA)

    rows: list[dict] = []
    for b in pairs:
        cell = dict(B=b, T=t, H=h, V=v)
        sets = impls_torch.make_inputs((2 * b, t), h, v, sets=INPUT_SETS, settings=settings, ignore_prefix=t // 4)
        for name, loss in torch_losses.items():
            run_cell(rows, progress, f"cpo B={b} {name:<10}",
                     lambda: measure_torch(impls_torch.fwd_bwd(loss), sets, settings=settings),
                     impl=name, framework="torch", **cell)
            free_torch_cache(settings)
        del sets
        free_torch_cache(settings)
        if jax_losses:
            sets = impls_jax.make_inputs((2 * b, t), h, v, sets=INPUT_SETS, ignore_prefix=t // 4)
            for name, loss in jax_losses.items():
                run_cell(rows, progress, f"cpo B={b} {name:<10}",
                         lambda: measure_jax(impls_jax.fwd_bwd(loss), sets, settings=settings),
                         impl=name, framework="jax", **cell)
            del sets
    _compare(rows)
    m = meta(settings, pairs=pairs, T=t, H=h, V=v, beta=BETA, alpha=ALPHA, prompt_tokens_ignored=t // 4,
             input_sets=INPUT_SETS)
    return {"bench": "cpo", "title": f"Fused linear CPO loss, bf16 ({m['device']})", "meta": m, "notes": notes,
            "rows": rows}

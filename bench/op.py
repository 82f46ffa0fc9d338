"""``python -m bench op``: the fused linear cross-entropy alone, bf16, mean reduction, random inputs.

Every implementation runs forward+backward (gradients w.r.t. ``x`` and ``weight``) and loss-only at each shape
``(N, H, V)``. The reference line ``cublas_3gemm`` is the three bf16 GEMMs of forward+backward (logits with a
float32 output, ``dX = dZ W``, ``dW = dZᵀ x``) timed as one closure in the same process, and the logits GEMM
alone for loss-only; ratios are to it (``x3gemm``) and to Liger's default (``xLiger``). ``dloss`` is the relative
difference of the loss from the plain full-logits loss of the same framework on the same inputs. ``peak GiB``
is the peak over what was allocated before the call, the gradients included (bench/timing.py), alike for all.
"""

from __future__ import annotations

from bench import impls_torch, report
from bench.common import Progress, Settings, implementations, meta, rel_diff, run_cell
from bench.timing import free_torch_cache, measure_jax, measure_torch

ANCHORS = [(1024, 4096, 128256), (4096, 4096, 128256), (16384, 4096, 128256), (8192, 896, 151936),
           (8192, 2304, 256000)]
SMOKE = [(64, 128, 512), (128, 128, 512)]  # V/H small: few Liger chunks in the slow interpreter
REFERENCE = "cublas_3gemm"
INPUT_SETS = 2  # rotated between repetitions; each set's weight is far larger than L2 at the anchor shapes

COLUMNS = [
    report.Column("N", "N"), report.Column("H", "H"), report.Column("V", "V"),
    report.Column("mode", "mode"), report.Column("impl", "impl"),
    report.Column("ms", "ms", report.ms),
    report.Column("x_ref", "x3gemm", report.ratio),
    report.Column("x_liger", "xLiger", report.ratio),
    report.Column("extra_gib", "peak GiB", report.gib),
    report.Column("dloss", "dloss", report.rel),
    report.Column("note", "note"),
]
PLOTS = [
    report.Plot("op_time", "N", "ms", "median time (ms)", "forward+backward, bf16", panel=("H", "V"),
                where=(("mode", "fwd+bwd"),)),
    report.Plot("op_time_loss", "N", "ms", "median time (ms)", "loss only, bf16", panel=("H", "V"),
                where=(("mode", "loss"),)),
    report.Plot("op_memory", "N", "extra_gib", "peak memory over the inputs, gradients included (GiB)",
                "forward+backward, bf16",
                panel=("H", "V"), where=(("mode", "fwd+bwd"),)),
]


def _cell(rows: list, progress: Progress, measure, *, impl: str, framework: str, shape, mode: str) -> None:
    n, h, v = shape
    run_cell(rows, progress, f"op N={n} H={h} V={v}  {impl:<20} {mode:<8}", measure,
             impl=impl, framework=framework, N=n, H=h, V=v, mode=mode)


def _torch_cells(shape, losses: dict, settings: Settings, progress: Progress) -> list[dict]:
    n, h, v = shape
    rows: list[dict] = []
    sets = impls_torch.make_inputs((n,), h, v, sets=INPUT_SETS, settings=settings)
    dz = impls_torch.grad_cotangent(n, v, settings)
    ref_sets = [(x.detach(), w.detach(), dz) for x, w, _ in sets]
    for mode, closure in (("fwd+bwd", impls_torch.three_gemm), ("loss", impls_torch.logits_gemm)):
        _cell(rows, progress, lambda: measure_torch(closure, ref_sets, settings=settings),
              impl=REFERENCE, framework="torch", shape=shape, mode=mode)
    del ref_sets, dz
    for name, loss in losses.items():
        for mode, make in (("fwd+bwd", impls_torch.fwd_bwd), ("loss", impls_torch.loss_only)):
            closure = make(loss)
            _cell(rows, progress, lambda: measure_torch(closure, sets, settings=settings),
                  impl=name, framework="torch", shape=shape, mode=mode)
            if isinstance(loss, impls_torch.Graphed):  # a replay allocates nothing: its pool holds the memory
                rows[-1].update(extra_gib=None, note=rows[-1]["note"] or loss.NOTE)
            del closure  # a graph's pool goes with it
            free_torch_cache(settings)
    return rows


def _jax_cells(shape, losses: dict, impls_jax, settings: Settings, progress: Progress) -> list[dict]:
    n, h, v = shape
    rows: list[dict] = []
    sets = impls_jax.make_inputs((n,), h, v, sets=INPUT_SETS)
    for name, loss in losses.items():
        for mode, fn in (("fwd+bwd", impls_jax.fwd_bwd(loss)), ("loss", impls_jax.loss_only(loss))):
            _cell(rows, progress, lambda: measure_jax(fn, sets, settings=settings),
                  impl=name, framework="jax", shape=shape, mode=mode)
    return rows


def _compare(rows: list[dict]) -> None:
    """Fill the ratios to the reference and to Liger, and the loss difference to the plain loss."""
    def key(r):
        return r["N"], r["H"], r["V"], r["mode"]

    by = {(key(r), r["impl"]): r for r in rows}
    plain = {"torch": "torch_naive", "jax": "jax_naive"}
    for r in rows:
        ref, lig = by.get((key(r), REFERENCE)), by.get((key(r), "liger"))
        base = by.get((key(r), plain[r["framework"]]))
        r["x_ref"] = r["ms"] / ref["ms"] if r["ms"] and ref and ref["ms"] else None
        r["x_liger"] = r["ms"] / lig["ms"] if r["ms"] and lig and lig["ms"] else None
        r["dloss"] = rel_diff(r["loss"], base["loss"]) if base and r is not base else None


def run(settings: Settings, shapes: list[tuple[int, int, int]], progress: Progress) -> dict:
    torch_losses, impls_jax, jax_losses, notes = implementations("FLCE", settings, progress)

    rows: list[dict] = []
    for shape in shapes:
        rows += _torch_cells(shape, torch_losses, settings, progress)
        free_torch_cache(settings)
        if jax_losses:
            rows += _jax_cells(shape, jax_losses, impls_jax, settings, progress)
    _compare(rows)
    m = meta(settings, shapes=shapes, input_sets=INPUT_SETS,
             reference=f"{REFERENCE}: torch.mm(x, W.T, out_dtype=fp32) + dZ @ W + dZ.T @ x, bf16")
    return {"bench": "op", "title": f"Fused linear cross-entropy, bf16, mean reduction ({m['device']})",
            "meta": m, "notes": notes, "rows": rows}

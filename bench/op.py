"""``python -m bench op``: the fused linear cross-entropy alone, bf16, mean reduction, random inputs.

Every implementation runs forward+backward (gradients w.r.t. ``x`` and ``weight``) and loss-only at each shape
``(N, H, V)``. The reference line ``cublas_3gemm`` is the three bf16 GEMMs of forward+backward (logits with a
float32 output, ``dX = dZ W``, ``dW = dZᵀ x``) timed as one closure in the same process, and the logits GEMM
alone for loss-only; ratios are to it (``x3gemm``) and to Liger's default (``xLiger``). ``dloss`` is the relative
difference of the loss from the plain full-logits loss of the same framework on the same inputs. ``peak GiB``
is the peak over what was allocated before the call, the gradients included (bench/timing.py), alike for all.
``--isolate`` runs each implementation in a process of its own (`run_isolated`).
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys

from bench import impls_torch, report
from bench.common import Progress, Settings, implementations, meta, rel_diff, run_cell
from bench.timing import free_torch_cache, measure_jax, measure_torch

ANCHORS = [(1024, 4096, 128256), (4096, 4096, 128256), (16384, 4096, 128256), (8192, 896, 151936),
           (8192, 2304, 256000)]
SMOKE = [(64, 128, 512), (128, 128, 512)]  # V/H small: few Liger chunks in the slow interpreter
REFERENCE = "cublas_3gemm"
REFERENCE_TEXT = f"{REFERENCE}: torch.mm(x, W.T, out_dtype=fp32) + dZ @ W + dZ.T @ x, bf16"
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


def _key(r: dict) -> tuple:
    return r["N"], r["H"], r["V"], r["mode"]


def _ratio_to_reference(rows: list[dict]) -> None:
    """Fill each row's ratio to the reference of the same shape and mode among ``rows`` (one process's)."""
    ref = {_key(r): r["ms"] for r in rows if r["impl"] == REFERENCE}
    for r in rows:
        r["x_ref"] = r["ms"] / ref[_key(r)] if r["ms"] and ref.get(_key(r)) else None


def _compare_implementations(rows: list[dict]) -> None:
    """Fill the ratios to Liger and the loss difference to the plain loss of the same framework."""
    by = {(_key(r), r["impl"]): r for r in rows}
    plain = {"torch": "torch_naive", "jax": "jax_naive"}
    for r in rows:
        lig, base = by.get((_key(r), "liger")), by.get((_key(r), plain[r["framework"]]))
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
    _ratio_to_reference(rows)
    _compare_implementations(rows)
    m = meta(settings, shapes=shapes, input_sets=INPUT_SETS, reference=REFERENCE_TEXT)
    return {"bench": "op", "title": f"Fused linear cross-entropy, bf16, mean reduction ({m['device']})",
            "meta": m, "notes": notes, "rows": rows}


def run_isolated(settings: Settings, shapes: list[tuple[int, int, int]], progress: Progress,
                 child_args: list[str]) -> dict:
    """`run` with each implementation in a Python process of its own (``--isolate``), one after the other.

    A process holds one implementation's imports, allocators, compiled kernels and threads, so none of them can
    slow another's timing (host-bound cells are the sensitive ones). Every process also measures the reference,
    and an implementation's ``x3gemm`` is to its own process's reference; the reference rows shown are the
    first process's (whose meta, date included, heads the result), and ``meta["reference_ms"]`` lists every
    process's. ``xLiger`` and ``dloss`` compare across processes: the inputs come from the same seeds in each.
    Each process's report stays in ``<out>/processes/<impl>/``; `child_args` are the command line's shapes,
    repetitions and launch changes.
    """
    from bench import impls_jax

    names = [n for n in (*impls_torch.FLCE, *impls_jax.FLCE) if settings.wanted(n)]
    rows: list[dict] = []
    notes: dict[str, str] = {}
    reference: dict[str, list[float | None]] = {}
    child_meta = None
    for name in names:
        out = settings.out / "processes" / name
        progress.log(f"op: {name} in a process of its own -> {out}")
        cmd = [sys.executable, "-m", "bench", "op", *child_args, "--impl", name, "--out", str(out)]
        report_path = out / "op.json"
        report_path.unlink(missing_ok=True)  # an earlier run's report is not this process's
        tail: collections.deque[str] = collections.deque(maxlen=4)
        with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
            for line in proc.stderr:  # its progress, as it comes
                sys.stderr.write(line)
                tail.append(line.strip())
        if not report_path.exists():
            notes[name] = f"its process wrote no report (exit {proc.returncode}): {' | '.join(tail)}"
            continue
        child = json.loads(report_path.read_text())
        child_meta = child_meta or child["meta"]
        notes.update(child["notes"])
        for r in child["rows"]:
            if r["impl"] == REFERENCE:
                times = reference.setdefault(f"{r['N']},{r['H']},{r['V']} {r['mode']}", [])
                times.append(r["ms"])
                if len(times) > 1:  # the first process's reference row is the one shown
                    continue
            rows.append(r)
    order = {shape: i for i, shape in enumerate(shapes)}
    rows.sort(key=lambda r: order[(r["N"], r["H"], r["V"])])  # stable: per shape, the processes in turn
    _compare_implementations(rows)
    m = child_meta or meta(settings, shapes=shapes, input_sets=INPUT_SETS, reference=REFERENCE_TEXT)
    m.update(isolated=names, reference_ms=reference)
    return {"bench": "op", "title": f"Fused linear cross-entropy, bf16, mean reduction, one process per "
                                    f"implementation ({m['device']})", "meta": m, "notes": notes, "rows": rows}

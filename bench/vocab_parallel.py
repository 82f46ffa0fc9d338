"""``python -m bench op --vocab-parallel P``: the loss with the weight split over V in P shards, time per step and
peak memory per device, next to the same op on one device (bf16, forward+backward, mean).

torch runs one process per GPU (NCCL; gloo on the CPU), JAX one process over P devices (``jax.shard_map``,
``VocabParallel("model")``), both through :mod:`parity.ranks`. Each measures as every other bench does
(bench/timing.py: the median over rotating input sets; torch's peak during one call minus what was allocated
before it, the gradients included; JAX's compiled temp buffers plus outputs); torch's step time is the slowest
rank's median, its memory the largest rank's.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bench import report
from bench.common import Settings, meta, run_cell
from bench.timing import Measurement
from parity.ranks import jax_child, jax_process, torch_ranks

INPUT_SETS = 2
COLUMNS = [report.Column("N", "N"), report.Column("H", "H"), report.Column("V", "V"), report.Column("impl", "impl"),
           report.Column("P", "P"), report.Column("ms", "ms", report.ms),
           report.Column("x_one", "x one device", report.ratio),
           report.Column("extra_gib", "peak GiB/device", report.gib), report.Column("note", "note")]
PLOTS: list = []


def torch_rank(rank, size, out_dir, shape, settings) -> None:
    """One rank (a :func:`parity.ranks.torch_ranks` job): its Measurement to ``torch-<rank>.json``."""
    import fce_torch
    from bench import impls_torch
    from bench.timing import measure_torch

    n, h, v = shape
    local = v // size
    sets = [(x, w[rank * local:(rank + 1) * local].detach().clone().requires_grad_(), t)
            for x, w, t in impls_torch.make_inputs((n,), h, v, sets=INPUT_SETS, settings=settings)]
    vp = fce_torch.VocabParallel() if size > 1 else None

    def step(x, w, t):
        loss = fce_torch.fused_lce(x, w, t, vocab_parallel=vp)
        loss.backward()
        return loss.detach()

    m = measure_torch(step, sets, settings=settings)
    Path(out_dir, f"torch-{rank}.json").write_text(json.dumps({"ms": m.ms, "peak": m.extra_bytes,
                                                               "value": m.value}))


def _torch_cell(shape, size, settings) -> Measurement:
    with tempfile.TemporaryDirectory() as tmp:
        torch_ranks(torch_rank, size, tmp, shape, settings, cuda=settings.gpu)
        ranks = [json.loads(Path(tmp, f"torch-{r}.json").read_text()) for r in range(size)]
    peaks = [r["peak"] for r in ranks if r["peak"] is not None]
    return Measurement(max(r["ms"] for r in ranks), max(peaks) if peaks else None, ranks[0]["value"])


def jax_main(n, h, v, size, device, reps, warmup) -> None:
    """In a process whose JAX sees P devices: the Measurement of the shard_map program, as JSON on stdout."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import fce_jax
    from bench import impls_jax
    from bench.timing import measure_jax

    settings = Settings(device=device, smoke=False, reps=reps, warmup=warmup, impls=None, out=Path("."))
    mesh = jax.make_mesh((size,), ("model",), devices=jax.devices()[:size])
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    sets = [(put(x, P()), put(w, P("model")), put(t, P()))
            for x, w, t in impls_jax.make_inputs((n,), h, v, sets=INPUT_SETS)]
    vp = fce_jax.VocabParallel("model") if size > 1 else None
    grad = jax.value_and_grad(lambda x, w, t: fce_jax.fused_lce(x, w, t, vocab_parallel=vp), argnums=(0, 1))
    fn = grad if size == 1 else jax.shard_map(grad, mesh=mesh, in_specs=(P(), P("model"), P()),
                                              out_specs=(P(), (P(), P("model"))), check_vma=True)
    m = measure_jax(fn, sets, settings=settings)
    print(json.dumps({"ms": m.ms, "peak": m.extra_bytes, "value": m.value}))


def _jax_cell(shape, size, settings) -> Measurement:
    out = jax_process("bench.vocab_parallel", (*shape, size, settings.device, settings.reps, settings.warmup), size,
                      cpu=not settings.gpu)
    m = json.loads(out.strip().splitlines()[-1])
    return Measurement(m["ms"], m["peak"], m["value"])


def run(settings, shapes, size: int, progress) -> dict:
    rows: list[dict] = []
    for n, h, v in shapes:
        for impl, cell in (("fce_torch", _torch_cell), ("fce_jax", _jax_cell)):
            for p in sorted({1, size}):
                run_cell(rows, progress, f"op vocab-parallel N={n} H={h} V={v} {impl} P={p}",
                         lambda: cell((n, h, v), p, settings), N=n, H=h, V=v, impl=impl, P=p)
    for row in rows:
        one = next(r for r in rows if r["P"] == 1 and all(r[k] == row[k] for k in ("N", "H", "V", "impl")))
        row["x_one"] = row["ms"] / one["ms"] if row["ms"] and one["ms"] else None
    m = meta(settings, shapes=shapes, vocab_parallel=size, input_sets=INPUT_SETS)
    return {"bench": "op-vocab-parallel", "title": f"Vocab-parallel loss, P={size}, bf16 ({m['device']})",
            "meta": m, "notes": {}, "rows": rows}


if __name__ == "__main__":
    jax_child(jax_main, *map(int, sys.argv[1:5]), sys.argv[5], int(sys.argv[6]), int(sys.argv[7]))

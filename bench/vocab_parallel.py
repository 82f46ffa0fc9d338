"""``python -m bench op --vocab-parallel P``: the loss with the weight split over V in P shards, time per step and
peak memory per device, next to the same op on one device (bf16, forward+backward, mean).

torch runs one process per GPU (NCCL; gloo with ``--smoke``), each timing its shard's call with CUDA events after
a barrier; the step time is the slowest rank's median. JAX runs one process over P devices (``jax.shard_map``,
``VocabParallel("model")``); its memory is the compiled program's temp buffers plus outputs per device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import report

COLUMNS = [report.Column("N", "N"), report.Column("H", "H"), report.Column("V", "V"), report.Column("impl", "impl"),
           report.Column("P", "P"), report.Column("ms", "ms", report.ms),
           report.Column("x_one", "x one device", report.ratio),
           report.Column("extra_gib", "peak GiB/device", report.gib), report.Column("note", "note")]
PLOTS: list = []


def _torch_rank(rank, size, shape, reps, warmup, smoke, out_dir):
    import torch
    import torch.distributed as dist

    import fce_torch
    from bench.timing import Stopwatch

    cuda = not smoke
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size,
                            init_method=f"file://{out_dir}/store")
    try:
        n, h, v = shape
        dev = f"cuda:{rank}" if cuda else "cpu"
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, h, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
        w = (torch.randn(v // size, h, device=dev, dtype=torch.bfloat16, generator=g) * h ** -0.5).requires_grad_()
        t = torch.randint(0, v, (n,), device=dev, generator=g)
        vp = fce_torch.VocabParallel() if size > 1 else None

        def step():
            x.grad = w.grad = None
            fce_torch.fused_lce(x, w, t, vocab_parallel=vp).backward()

        for _ in range(warmup):
            step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        dist.barrier()
        watch = Stopwatch(cuda)
        for _ in range(reps):
            watch.start()
            step()
            watch.stop()
        times = sorted(watch.times_ms())
        peak = torch.cuda.max_memory_allocated() - base if cuda else None
        Path(out_dir, f"torch-{size}-{rank}.json").write_text(json.dumps({"ms": times[len(times) // 2], "peak": peak}))
    finally:
        dist.destroy_process_group()


def _torch_cell(shape, size, settings) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:  # also the file store's: no free-port probe to race for
        mp.start_processes(_torch_rank, args=(size, shape, settings.reps, settings.warmup, settings.smoke, tmp),
                           nprocs=size, start_method="spawn")
        ranks = [json.loads(Path(tmp, f"torch-{size}-{r}.json").read_text()) for r in range(size)]
    peaks = [r["peak"] for r in ranks if r["peak"] is not None]
    return {"ms": max(r["ms"] for r in ranks), "peak": max(peaks) if peaks else None}


def _jax_cell(shape, size, settings) -> dict:
    env = dict(os.environ)
    if settings.smoke:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={size}")
    args = [sys.executable, "-m", "bench.vocab_parallel_jax", *map(str, shape), str(size), str(settings.reps),
            str(settings.warmup)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(settings, shapes, size: int, progress) -> dict:
    from bench.common import gib, meta, short_error

    rows = []
    for shape in shapes:
        n, h, v = shape
        for impl, cell in (("fce_torch", _torch_cell), ("fce_jax", _jax_cell)):
            one = None
            for p in (1, size):
                row = {"N": n, "H": h, "V": v, "impl": impl, "P": p, "ms": None, "extra_gib": None, "note": ""}
                try:
                    m = cell(shape, p, settings)
                    row.update(ms=m["ms"], extra_gib=gib(m["peak"]))
                except Exception as exc:  # noqa: BLE001  (the row's note)
                    row["note"] = short_error(exc)
                one = row if p == 1 else one
                row["x_one"] = row["ms"] / one["ms"] if row["ms"] and one and one["ms"] else None
                progress.log(f"op vocab-parallel N={n} H={h} V={v} {impl} P={p}: {row['ms']} ms {row['note']}")
                rows.append(row)
    m = meta(settings, shapes=shapes, vocab_parallel=size)
    return {"bench": "op-vocab-parallel", "title": f"Vocab-parallel loss, P={size}, bf16 ({m['device']})",
            "meta": m, "notes": {}, "rows": rows}

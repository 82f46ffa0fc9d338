"""Kernel times under sustained load, where the H200 runs at its power cap, against the same kernels from an
idle GPU: the fused engine's logits GEMM with its statistics epilogue, cuBLAS's logits GEMM, and fce_torch's
dX GEMM and (hi, lo) accumulation, at CPO's 1024-row chunk and 3072-row group of (H = 4096, V = 128256).

Each phase launches its kernel back to back for about `--ms` of device time, with CUDA events around every
launch, and reports the median of the second half of its launches; the phases follow one another without a
pause, so that the GPU stays loaded. Then, after a pause of two seconds each, the logits GEMMs once more from an
idle GPU (their first launches). With `--smi`, `nvidia-smi` samples the SM clock, the power draw and the
clock-event reasons every 20 ms in the background, and the table shows them per phase (reason 0x4: the software
power cap).

Usage (GPU): python tools/steady_rates.py OUT_DIR [--ms 300] [--smi]   (OUT_DIR/steady_rates.json, smi.csv)
A development tool: the benchmark's numbers are taken under the same cap, this tells how far a kernel slows
there.
"""
import argparse
import datetime
import json
import os
import subprocess
import time

import torch

from fce_core.heads import StatsSpec
from fce_core.options import Transform
from fce_torch.kernels import grad_gemms as tg
from fce_torch.kernels import logit_tiles as tt

H, V, CHUNK, GROUP = 4096, 128256, 1024, 3072
SMI_FIELDS = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"


def kernels():
    """[(name, rows, fn)]: each phase's kernel on fixed random inputs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(GROUP, H, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(V, H, device="cuda", generator=g) / H ** 0.5).to(torch.bfloat16)
    y = torch.randint(0, V, (GROUP,), device="cuda", generator=g)
    tiles = torch.empty(GROUP, V, device="cuda", dtype=torch.bfloat16)
    dz = (torch.randn(GROUP, V, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    dx = torch.empty(GROUP, H, device="cuda", dtype=torch.bfloat16)
    pair = tg.dw_first(dz, x, torch.bfloat16)

    def logits(n):
        return lambda: tt.logit_tiles(x[:n], w, None, y[:n], None, spec=StatsSpec(), transform=Transform(),
                                      precision="ieee", out=tiles[:n])

    return [("cublas logits", GROUP, lambda: torch.mm(x, w.t())),
            ("fce logits", CHUNK, logits(CHUNK)),
            ("fce logits", GROUP, logits(GROUP)),
            ("cublas logits", CHUNK, lambda: torch.mm(x[:CHUNK], w.t())),
            ("fce dX", GROUP, lambda: tg.dx_gemm(dz, w, dx)),
            ("fce dW (hi, lo) +=", GROUP, lambda: tg.dw_accumulate(dz, x, pair)),
            ("fce logits", CHUNK, logits(CHUNK))]


def phase(name, rows, fn, ms, idle=False):
    """Launch fn back to back for about `ms` of device time; the launches' times by CUDA events."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    count = max(20, min(300, int(ms / max((time.perf_counter() - t) * 1e3, 0.05))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
    if idle:
        time.sleep(2.0)
    start = time.time()
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in events]
    tail = sorted(times[count // 2:])
    median = tail[len(tail) // 2]
    return dict(phase=name + " from idle" * idle, rows=rows, launches=count, first=[round(v, 4) for v in times[:5]],
                median_ms=round(median, 4), ms_per_1024_rows=round(median * 1024 / rows, 4),
                tflops=round(2 * rows * H * V / median / 1e9, 1), start=start, stop=time.time())


def smi_rows(path):
    """(unix time, SM MHz, watts, reasons) per nvidia-smi sample."""
    rows = []
    for line in open(path):
        p = [v.strip() for v in line.split(",")]
        try:
            t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((t, float(p[1].split()[0]), float(p[2].split()[0]), p[3]))
        except (ValueError, IndexError):
            continue
    return rows


def with_samples(rows, samples):
    """Each phase's median SM clock and power and its set of clock-event reasons, from the samples taken while
    it ran (none where no sample fell in it)."""
    for r in rows:
        s = [q for q in samples if r["start"] <= q[0] <= r["stop"]]
        if s:
            r["sm_mhz_median"] = sorted(q[1] for q in s)[len(s) // 2]
            r["watts_median"] = sorted(q[2] for q in s)[len(s) // 2]
            r["reasons"] = sorted({q[3] for q in s})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--ms", type=float, default=300.0, help="device time per phase (about)")
    ap.add_argument("--smi", action="store_true", help="sample clocks and power with nvidia-smi")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    phases = kernels()
    for _, _, fn in phases:  # compiled and autotuned before the first timed phase
        fn()
    smi = None
    if args.smi:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader", "-lms", "20"],
                               stdout=open(f"{args.out}/smi.csv", "w"), stderr=subprocess.STDOUT)
        time.sleep(0.5)
    rows = []
    for name, n, fn in phases:
        rows.append(phase(name, n, fn, args.ms))
        print(json.dumps(rows[-1]), flush=True)
    for name, n, fn in phases[1:4]:
        rows.append(phase(name, n, fn, args.ms / 2, idle=True))
        print(json.dumps(rows[-1]), flush=True)
    if smi is not None:
        smi.terminate()
        smi.wait()
        with_samples(rows, smi_rows(f"{args.out}/smi.csv"))
    with open(f"{args.out}/steady_rates.json", "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'phase':<30} {'rows':>5} {'first':>7} {'median':>7} {'/1024':>7} {'TFLOP/s':>8} {'MHz':>5} {'W':>4}")
    for r in rows:
        print(f"{r['phase']:<30} {r['rows']:>5} {r['first'][1]:>7.3f} {r['median_ms']:>7.3f} "
              f"{r['ms_per_1024_rows']:>7.3f} {r['tflops']:>8.1f} {r.get('sm_mhz_median', 0):>5.0f} "
              f"{r.get('watts_median', 0):>4.0f}")


if __name__ == "__main__":
    main()

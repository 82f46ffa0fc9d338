"""fce_torch's two gradient GEMMs of one chunk, launched one after the other or as one kernel
(`grad_gemms.dx_and_dw`) at several `dx_spread` values, on the GPU: the time of each (median of 20 runs), its
bits against the separate launches', and cuBLAS's two GEMMs (dZ W, dZᵀ X into a new array) beside them. The
chunk is the fused engine's at (N, H, V); dW's step is the (hi, lo) accumulation of a second chunk, or
written when one chunk holds every row.

Usage (GPU): python tools/dx_dw_launch.py OUT_DIR [N,H,V ...]
"""
import dataclasses
import json
import sys
import time

import numpy as np
import torch

from fce_core.config import GRAD_GEMM_TORCH
from fce_core.plan import fused_rows
from fce_torch.kernels import grad_gemms as tg

SPREADS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _time(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return float(np.median(out)) * 1e3


def shape_rows(n, h, v):
    plan = fused_rows(n, h, v, 2, need_grads=True)
    m, single = min(n, plan.rows), plan.rows >= n
    g = torch.Generator(device="cuda").manual_seed(1)
    dz = (torch.randn(m, v, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
    x = torch.randn(m, h, device="cuda", generator=g).to(torch.bfloat16)
    dx = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)
    start = None if single else tg.dw_first(dz, x, torch.bfloat16)
    acc = [None if start is None else tuple(p.clone() for p in start)]  # the timings' own accumulator

    def separate():
        tg.dx_gemm(dz, w, dx)
        acc[0] = tg.dw_step(dz, x, acc[0] if not single else None, torch.bfloat16, single)

    def both(cfg):
        acc[0] = tg.dx_and_dw(dz, w, dx, x, acc[0] if not single else None, torch.bfloat16, single, cfg=cfg)

    def bits(run):  # one run from `start`: dX's and dW's bits
        acc[0] = None if start is None else tuple(p.clone() for p in start)
        run()
        torch.cuda.synchronize()
        return [dx.clone()] + list(acc[0] if isinstance(acc[0], tuple) else (acc[0],))

    tag = dict(shape=(m, h, v), dw="written" if single else "(hi, lo) accumulated")
    rows = [dict(tag, impl="cublas dZ W + dZt X", ms=_time(lambda: (torch.mm(dz, w), torch.mm(dz.t(), x))))]
    ref = bits(separate)
    rows.append(dict(tag, impl="fce_torch separate launches", ms=_time(separate), bits=True))
    for spread in SPREADS:
        cfg = dataclasses.replace(GRAD_GEMM_TORCH, dx_spread=spread)
        got = bits(lambda: both(cfg))
        rows.append(dict(tag, impl=f"fce_torch one launch, dx_spread {spread}", ms=_time(lambda: both(cfg)),
                         bits=all(torch.equal(a, b) for a, b in zip(ref, got))))
    for r in rows:
        r["vs_cublas"] = r["ms"] / rows[0]["ms"]
        print(json.dumps(r), flush=True)
    return rows


def main():
    out_dir, *shapes = sys.argv[1:]
    shapes = [tuple(int(v) for v in s.split(",")) for s in shapes] or [
        (16384, 4096, 128256), (16384, 2048, 128256), (8192, 896, 151936), (8192, 640, 262144),
        (256, 4096, 128256)]
    rows = []
    for n, h, v in shapes:
        rows += shape_rows(n, h, v)
        with open(f"{out_dir}/dx_dw_launch.json", "w") as f:
            json.dump(rows, f, indent=1)
    lines = ["| chunk (rows, H, V) | dW | launch | ms | vs cuBLAS | bits as separate |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['dw']} | {r['impl']} | {r['ms']:.3f} | {r['vs_cublas']:.2f}x | "
              f"{r.get('bits', '')} |" for r in rows]
    with open(f"{out_dir}/dx_dw_launch.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""fce_torch and fce_jax on the fused engine with ignored rows (random rows, 0 / 25 / 50 %), on the GPU: fwd+bwd
time of fce_torch with validate=True and validate=False (CUDA events, 10 calls after 2) and whether the two give
the same bits of loss, dx and dw (they must: the sweep's chunks past the valid rows, and with a kept dZ the GEMM
rows of those chunks, are left out only where that adds exact zeros), fce_jax's time (10 calls back to back)
and whether its bits equal fce_torch's. Shapes: (4096, 4096, 128256) (dZ kept) and (8192, 896, 151936) (dZ
not kept). One JSON line per case, tagged; the results of bench/results/nvidia-h200/kept-rows-that-ran/.

Usage (GPU): python tools/kept_rows.py TAG. A development tool.
"""
import json
import sys
import time

import jax
import numpy as np
import torch

import fce_jax
import fce_torch

CASES = [(4096, 4096, 128256, 0.5), (4096, 4096, 128256, 0.25), (4096, 4096, 128256, 0.0), (8192, 896, 151936, 0.5)]
dev = "cuda"


def inputs(n, h, v, ignored_frac, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(n, h, device=dev, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, h, device=dev, generator=g) / h ** 0.5).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device=dev, generator=g)
    y[torch.rand(n, device=dev, generator=g) < ignored_frac] = -100
    return x, w, y


def bits(t):
    return t.detach().float().cpu().numpy().view(np.uint32)


def torch_step(x, w, y, validate):
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

    def step():
        xr.grad = wr.grad = None
        loss = fce_torch.fused_lce(xr, wr, y, engine="fused", validate=validate)
        loss.backward()
        return loss, xr.grad, wr.grad
    return step


def events_ms(fn, reps=10):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def jax_ms(x, w, y, reps=10):
    xj, wj, yj = (jax.dlpack.from_dlpack(t) for t in (x, w, y.to(torch.int32)))
    f = jax.jit(jax.value_and_grad(lambda a, b: fce_jax.fused_lce(a, b, yj, engine="fused"), argnums=(0, 1)))
    jax.block_until_ready(f(xj, wj))
    t = time.perf_counter()
    for _ in range(reps):
        r = f(xj, wj)
    jax.block_until_ready(r)
    out = f(xj, wj)
    return (time.perf_counter() - t) / reps * 1e3, out


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/kept_rows.py TAG")
    for n, h, v, frac in CASES:
        x, w, y = inputs(n, h, v, frac, seed=n + h)
        row = dict(tag=sys.argv[1], shape=(n, h, v), ignored=frac, n_valid=int((y != -100).sum()))
        got = {}
        for validate in (True, False):
            step = torch_step(x, w, y, validate)
            row[f"torch_ms_validate_{validate}"] = events_ms(step)
            got[validate] = [bits(t) for t in step()]
        row["torch_validate_bits_equal"] = all(np.array_equal(a, b) for a, b in zip(got[True], got[False]))
        row["jax_ms"], (loss_j, (dx_j, dw_j)) = jax_ms(x, w, y)
        row["twins_bitwise"] = all(np.array_equal(a, np.asarray(b, np.float32).view(np.uint32))
                                   for a, b in zip(got[True], (loss_j, dx_j, dw_j)))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

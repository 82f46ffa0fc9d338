"""float32 inputs (IEEE GEMMs, the frameworks' defaults): both engines of both twins at two shapes, the median
fwd+bwd time of REPS calls (torch: CUDA events around each call; JAX: one jitted value_and_grad call each, waited
for), peak memory (torch: peak allocated minus allocated before the call, the gradients included; JAX: the
compiled program's temp + outputs), the loss, and whether the twins' loss, dX and dW are bitwise equal. Tells
whether `engine="auto"` should take the fused engine for float32 inputs (bench/results/nvidia-h100/engine-auto/).

Usage (GPU): PYTHONPATH=. python tools/f32_engines.py. A development tool.
"""
import time

import numpy as np
import torch

import jax
import jax.numpy as jnp

import fce_jax
import fce_torch

SHAPES = [(4096, 2048, 32000), (2048, 4096, 128256)]
REPS = 5


def torch_cell(x, w, y, engine):
    def step():
        xs = x.detach().requires_grad_(True)
        ws = w.detach().requires_grad_(True)
        loss = fce_torch.fused_lce(xs, ws, y, engine=engine)
        loss.backward()
        return loss.detach(), xs.grad, ws.grad
    out = step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    ts = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        ts.append(start.elapsed_time(end))
    return float(np.median(ts)), peak, out


def jax_cell(x, w, y, engine):
    f = jax.jit(jax.value_and_grad(lambda x, w: fce_jax.fused_lce(x, w, y, engine=engine), argnums=(0, 1)))
    out = jax.block_until_ready(f(x, w))
    mem = f.lower(x, w).compile().memory_analysis()
    peak = (mem.temp_size_in_bytes + mem.output_size_in_bytes) / 2**30
    ts = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, w))
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts)), peak, out


def bits(a):
    return np.asarray(a).view(np.uint32)


for n, h, v in SHAPES:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=g)
    w = torch.randn(v, h, device="cuda", generator=g) * h ** -0.5
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    xj, wj = jnp.asarray(x.cpu().numpy()), jnp.asarray(w.cpu().numpy())
    yj = jnp.asarray(y.cpu().numpy().astype(np.int32))
    res = {}
    for e in ("library", "fused"):
        res["torch", e] = torch_cell(x, w, y, e)
        res["jax", e] = jax_cell(xj, wj, yj, e)
    for (fw, e), (ms, gib, out) in res.items():
        print(f"{n},{h},{v} {fw:5s} {e:8s} {ms:9.2f} ms {gib:6.2f} GiB loss {float(out[0]):.6f}", flush=True)
    for e in ("library", "fused"):
        t = res["torch", e][2]
        jl, (jdx, jdw) = res["jax", e][2]
        same = [np.array_equal(bits(a.cpu().numpy()), bits(b)) for a, b in zip(t, (jl, jdx, jdw))]
        print(f"{n},{h},{v} {e}: torch = jax bitwise (loss, dx, dw): {same}", flush=True)

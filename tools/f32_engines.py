"""float32 inputs (IEEE GEMMs, the frameworks' defaults): both engines of both twins at two shapes, fwd+bwd timed
and its peak memory measured as the op bench does (`bench.timing`), the loss, and whether the twins' loss, dX and
dW are bitwise equal. Tells whether `engine="auto"` should take the fused engine for float32 inputs
(bench/results/nvidia-h100/engine-auto/f32/).

Usage (GPU): PYTHONPATH=. python tools/f32_engines.py. A development tool.
"""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

import fce_jax
import fce_torch
from bench.common import Settings
from bench.timing import measure_jax, measure_torch

SHAPES = [(4096, 2048, 32000), (2048, 4096, 128256)]
SETTINGS = Settings(device="cuda", smoke=False, reps=5, warmup=1, impls=None, out=Path("."))
GIB = 2**30


def _torch_grads(x, w, y, engine):
    xs, ws = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    loss = fce_torch.fused_lce(xs, ws, y, engine=engine)
    loss.backward()
    return [loss.detach(), xs.grad, ws.grad]


def _torch_step(engine):
    def step(x, w, y):
        loss = fce_torch.fused_lce(x, w, y, engine=engine)
        loss.backward()
        return loss.detach()
    return step


def _jax_grads(engine, y):
    return jax.value_and_grad(lambda x, w: fce_jax.fused_lce(x, w, y, engine=engine), argnums=(0, 1))


def _bits(a):
    return np.asarray(a).view(np.uint32)


def main(shapes=SHAPES, settings=SETTINGS):
    dev = settings.device
    for n, h, v in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, h, device=dev, generator=g)
        w = torch.randn(v, h, device=dev, generator=g) * h ** -0.5
        y = torch.randint(0, v, (n,), device=dev, generator=g)
        xj, wj = jnp.asarray(x.cpu().numpy()), jnp.asarray(w.cpu().numpy())
        yj = jnp.asarray(y.cpu().numpy().astype(np.int32))
        for engine in ("library", "fused"):
            leaves = [x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True), y]
            cells = {"torch": measure_torch(_torch_step(engine), [leaves], settings=settings),
                     "jax": measure_jax(_jax_grads(engine, yj), [(xj, wj)], settings=settings)}
            for fw, m in cells.items():
                gib = "n/a" if m.extra_bytes is None else f"{m.extra_bytes / GIB:.2f}"
                print(f"{n},{h},{v} {fw:5s} {engine:8s} {m.ms:9.2f} ms {gib:>6s} GiB loss {m.value:.6f}", flush=True)
            loss, (dx, dw) = _jax_grads(engine, yj)(xj, wj)
            same = [np.array_equal(_bits(a.cpu().numpy()), _bits(b))
                    for a, b in zip(_torch_grads(x, w, y, engine), (loss, dx, dw))]
            print(f"{n},{h},{v} {engine}: torch = jax bitwise (loss, dx, dw): {same}", flush=True)


if __name__ == "__main__":
    main()

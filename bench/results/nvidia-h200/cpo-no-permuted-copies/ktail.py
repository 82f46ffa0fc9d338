"""GPU check of this folder's README: the fused engine's dW where a kept dZ's chunks are skipped and K = the rows
that ran ends mid-step (N = 5000, chunks of 1024: the first 904 rows), the caching allocator's memory made NaN
first. Run from the repository root."""
import jax
import torch

import fce_jax
import fce_torch

n, h, v = 5000, 4096, 32000
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
w = (torch.randn(v, h, device="cuda", generator=g) / 64).to(torch.bfloat16)
y = torch.randint(0, v, (n,), device="cuda", generator=g)
y[2500:] = -100


def torch_grads(engine):
    junk = torch.full(((4 << 30) // 4,), float("nan"), device="cuda")
    del junk
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    fce_torch.fused_lce(xx, ww, y, engine=engine, chunk_rows=1024).backward()
    return xx.grad.float(), ww.grad.float()


def jax_grads(engine):
    f = jax.jit(jax.grad(lambda a, b, t: fce_jax.fused_lce(a, b, t, engine=engine, chunk_rows=1024), argnums=(0, 1)))
    gx, gw = f(jax.dlpack.from_dlpack(x), jax.dlpack.from_dlpack(w), jax.dlpack.from_dlpack(y.to(torch.int32)))
    return torch.from_dlpack(gx).float(), torch.from_dlpack(gw).float()


ref = torch_grads("library")
for name, fn in (("torch fused", torch_grads), ("jax fused", jax_grads)):
    runs = [fn("fused") for _ in range(2)]
    for i, (gx, gw) in enumerate(runs):
        err = [float((a - r).norm() / r.norm()) for a, r in zip((gx, gw), ref)]
        print(f"{name} run {i}: finite dx {bool(gx.isfinite().all())} dw {bool(gw.isfinite().all())}, "
              f"rel err vs library dx {err[0]:.2e} dw {err[1]:.2e}", flush=True)
    print(f"{name} deterministic: {all(torch.equal(a, b) for a, b in zip(*runs))}", flush=True)
    if name == "torch fused":
        t_runs = runs
print("torch == jax fused:", [torch.equal(a, b) for a, b in zip(t_runs[0], runs[0])])

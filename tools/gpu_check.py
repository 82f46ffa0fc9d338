"""One GPU call: do the kernels compile and run, are the twins bitwise equal, how far from float64, how fast.

Usage (on the GPU machine): python tools/gpu_check.py [--quick]. Prints a short table last; writes
$OUT/gpu_check.json when OUT is set. A development tool: the full reports are `python -m parity` and
`python -m bench`.
"""
import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import fce_jax
import fce_torch
from parity.suite import flce_reference_torch64

DEV = "cuda"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def inputs(n, h, v, dtype, seed=0, bias=False, cw=False, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(n, h, device=DEV, generator=g).to(dtype)
    w = (torch.randn(v, h, device=DEV, generator=g) * (scale / h ** 0.5)).to(dtype)
    y = torch.randint(0, v, (n,), device=DEV, generator=g)
    y[torch.rand(n, device=DEV, generator=g) < 0.1] = -100
    b = (torch.randn(v, device=DEV, generator=g) * 0.1).to(dtype) if bias else None
    c = (torch.rand(v, device=DEV, generator=g) + 0.5) if cw else None
    return x, w, y, b, c


def run_torch(x, w, y, b, c, **opt):
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    bs = None if b is None else b.clone().requires_grad_()
    loss = fce_torch.fused_lce(xs, ws, y, bias=bs, class_weights=c, **opt)
    loss.backward(torch.ones_like(loss))
    return {"loss": loss.detach(), "dx": xs.grad, "dw": ws.grad, "db": None if bs is None else bs.grad}


def jx(t):
    return jax.dlpack.from_dlpack(t.detach())


def run_jax(x, w, y, b, c, **opt):
    argn = (0, 1) if b is None else (0, 1, 2)

    def f(x, w, b):
        loss = fce_jax.fused_lce(x, w, jx(y.to(torch.int32)), bias=b, class_weights=None if c is None else jx(c), **opt)
        return jnp.sum(loss)
    loss, grads = jax.jit(jax.value_and_grad(f, argnums=argn))(jx(x), jx(w), None if b is None else jx(b))
    out = {"loss": loss, "dx": grads[0], "dw": grads[1], "db": grads[2] if b is not None else None}
    return {k: None if a is None else torch.from_dlpack(a) for k, a in out.items()}


def compare(a, b):
    """(bitwise equal, number of differing elements)."""
    if a is None or b is None:
        return None, None
    a, b = a.reshape(-1), b.reshape(-1)
    diff = (a.view(torch.int16 if a.element_size() == 2 else torch.int32)
            != b.view(torch.int16 if b.element_size() == 2 else torch.int32))
    n = int(diff.sum())
    return n == 0, n


def rel(a, ref):
    if a is None:
        return None
    a = a.double().reshape(-1)
    r = ref.double().reshape(-1)
    return float((a - r).norm() / r.norm().clamp(min=1e-300))


def correctness(cases):
    rows = []
    for name, (n, h, v, dtype), extra in cases:
        opt = dict(extra)
        x, w, y, b, c = inputs(n, h, v, dtype, bias=opt.pop("bias", False), cw=opt.pop("cw", False),
                               scale=opt.pop("scale", 1.0))
        t0 = time.time()
        rt, rj = run_torch(x, w, y, b, c, **opt), run_jax(x, w, y, b, c, **opt)
        rt2 = run_torch(x, w, y, b, c, **opt)
        ref = flce_reference_torch64(x, w, y, bias=b, class_weights=c, **{k: v_ for k, v_ in opt.items()
                                                                          if k != "chunk_rows"})
        row = {"case": name}
        for k in ("loss", "dx", "dw", "db"):
            if rt[k] is None:
                continue
            eq, nd = compare(rt[k], rj[k])
            row[k] = {"tj_bitwise": eq, "tj_ndiff": nd, "torch_det": compare(rt[k], rt2[k])[0],
                      "err_torch": rel(rt[k], ref[k]), "err_jax": rel(rj[k], ref[k])}
        rows.append(row)
        log(f"[{time.time() - t0:6.1f}s] {name}: " + " ".join(
            f"{k}: eq={r['tj_bitwise']} nd={r['tj_ndiff']} et={r['err_torch']:.2e} ej={r['err_jax']:.2e}"
            for k, r in row.items() if k != "case"))
        del rt, rj, rt2, ref
        torch.cuda.empty_cache()
    return rows


def _events(fn, reps):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return float(np.median(ts))


def speed(shapes, reps):
    rows = []
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        LigerFusedLinearCrossEntropyLoss = None
    for n, h, v in shapes:
        x, w, y, _, _ = inputs(n, h, v, torch.bfloat16)
        row = {"shape": (n, h, v)}
        dz = torch.randn(n, v, device=DEV, dtype=torch.bfloat16)

        def gemms():
            torch.mm(x, w.t(), out_dtype=torch.float32)
            torch.mm(dz, w)
            torch.mm(dz.t(), x, out_dtype=torch.float32)
        row["3gemm"] = _events(gemms, reps)
        del dz
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()

        def ours():
            xs.grad = ws.grad = None
            fce_torch.fused_lce(xs, ws, y).backward()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        row["torch"] = _events(ours, reps)
        row["torch_mem_gib"] = (torch.cuda.max_memory_allocated() - base - xs.grad.nbytes - ws.grad.nbytes) / 2**30
        if LigerFusedLinearCrossEntropyLoss is not None:
            lig = LigerFusedLinearCrossEntropyLoss()

            def liger():
                xs.grad = ws.grad = None
                lig(ws, xs, y).backward()
            row["liger"] = _events(liger, max(3, reps // 2))
        xj, wj, yj = jx(x), jx(w), jx(y.to(torch.int32))
        g = jax.jit(jax.value_and_grad(lambda x, w: fce_jax.fused_lce(x, w, yj), argnums=(0, 1)))
        comp = g.lower(xj, wj).compile()
        ma = comp.memory_analysis()
        row["jax_temp_gib"] = None if ma is None else ma.temp_size_in_bytes / 2**30

        def jax_step():
            jax.block_until_ready(comp(xj, wj))
        row["jax"] = _events(jax_step, reps)
        rows.append(row)
        log(f"speed {row}")
        del x, w, xs, ws
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--speed-only", action="store_true")
    args = ap.parse_args()
    bf, f32 = torch.bfloat16, torch.float32
    cases = [
        ("bf16 4096x4096x128256 mean", (4096, 4096, 128256, bf), {}),
        ("bf16 1024x1024x32000 all-options", (1024, 1024, 32000, bf),
         dict(bias=True, cw=True, label_smoothing=0.1, z_loss=1e-4, softcap=30.0)),
        ("bf16 1000x1024x32000 sum chunk=384", (1000, 1024, 32000, bf), dict(reduction="sum", chunk_rows=384)),
        ("bf16 1000x1024x32000 none chunk=384", (1000, 1024, 32000, bf), dict(reduction="none", chunk_rows=384)),
        ("bf16 2048x896x151936 chunked", (2048, 896, 151936, bf), dict(chunk_rows=768)),
        ("f32 512x1024x32000 options", (512, 1024, 32000, f32),
         dict(bias=True, label_smoothing=0.1, z_loss=1e-4, softcap=30.0, chunk_rows=256)),
        ("f32 512x1024x32000 huge logits", (512, 1024, 32000, f32), dict(scale=100.0)),
    ]
    shapes = [(1024, 4096, 128256), (4096, 4096, 128256), (16384, 4096, 128256), (8192, 896, 151936),
              (8192, 2304, 256000)]
    if args.quick:
        cases, shapes = cases[:2], shapes[:2]
    log(torch.cuda.get_device_name(), "torch", torch.__version__, "jax", jax.__version__, jax.devices())
    result = {"correctness": [] if args.speed_only else correctness(cases), "speed": speed(shapes, reps=10)}
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_check.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
    print("\ncase | output | torch==jax (n diff) | err torch | err jax | torch deterministic")
    for r in result["correctness"]:
        for k, v in r.items():
            if k != "case":
                print(f"{r['case']} | {k} | {v['tj_bitwise']} ({v['tj_ndiff']}) | {v['err_torch']:.2e} | "
                      f"{v['err_jax']:.2e} | {v['torch_det']}")
    print("\nN,H,V | 3-GEMM ms | torch ms (x) | jax ms (x) | liger ms (x) | torch extra GiB | jax temp GiB")
    for r in result["speed"]:
        g = r["3gemm"]
        lig = r.get("liger")
        print(f"{r['shape']} | {g:.2f} | {r['torch']:.2f} ({r['torch'] / g:.2f}) | {r['jax']:.2f} ({r['jax'] / g:.2f})"
              f" | {'n/a' if lig is None else f'{lig:.2f} ({lig / g:.2f})'} | {r['torch_mem_gib']:.2f} | "
              f"{r['jax_temp_gib']}")


if __name__ == "__main__":
    main()

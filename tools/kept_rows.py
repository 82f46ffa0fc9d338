"""fce_torch and fce_jax on the fused engine with ignored rows (random rows, 0 / 25 / 50 %), on the GPU: fwd+bwd
time of fce_torch with validate=True and validate=False and of fce_jax (`bench.timing`: torch's CUDA events, JAX
back to back), whether fce_torch's two give the same bits of loss, dx and dw (they must: the sweep's chunks past
the valid rows, and with a kept dZ the GEMM rows of those chunks, are left out only where that adds exact zeros),
and whether fce_jax's bits equal fce_torch's; a digest of fce_torch's bits (to compare two trees' runs) and
fce_jax's first call in seconds (its compile: a branch of dX and dW GEMMs per count of chunks that ran).
Shapes: (2048 and 4096, 4096, 128256) (dZ kept; 2048 rows in 4 chunks of 512 since kept-chunk/) and (8192,
896, 151936) (dZ not kept). One JSON line per case, tagged; the measurements of
bench/results/nvidia-h200/kept-rows-that-ran/ (taken by this tool's first form, which timed 10 calls after 2
with its own loops) and bench/results/nvidia-h100/kept-chunk/.

Usage (GPU): python tools/kept_rows.py TAG [N ...] (only the cases of these row counts). A development tool.
"""
import hashlib
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
import torch

import fce_jax
import fce_torch
from bench import impls_jax, impls_torch, timing
from bench.common import Settings

CASES = [(2048, 4096, 128256, 0.25), (2048, 4096, 128256, 0.0), (4096, 4096, 128256, 0.5),
         (4096, 4096, 128256, 0.25), (4096, 4096, 128256, 0.0), (8192, 896, 151936, 0.5)]
SETTINGS = Settings(device="cuda", smoke=False, reps=10, warmup=2, impls=None, out=Path("/tmp"))


def inputs(n, h, v, ignored_frac, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[torch.rand(n, device="cuda", generator=g) < ignored_frac] = -100
    return x, w, y


def bits(t):
    return np.asarray(t.detach().float().cpu() if isinstance(t, torch.Tensor) else np.asarray(t, np.float32)
                      ).view(np.uint32)


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: python tools/kept_rows.py TAG [N ...]  (N: only the cases of these row counts)")
    only = {int(a) for a in sys.argv[2:]}
    for n, h, v, frac in CASES:
        if only and n not in only:
            continue
        x, w, y = inputs(n, h, v, frac, seed=n + h)
        row = dict(tag=sys.argv[1], shape=(n, h, v), ignored=frac, n_valid=int((y != -100).sum()))
        got = {}
        for validate in (True, False):
            fn = impls_torch.fwd_bwd(lambda a, b, t: fce_torch.fused_lce(a, b, t, engine="fused", validate=validate))
            row[f"torch_ms_validate_{validate}"] = timing.measure_torch(fn, [(x, w, y)], settings=SETTINGS).ms
            x.grad = w.grad = None
            got[validate] = [bits(t) for t in (fn(x, w, y), x.grad, w.grad)]
        x.grad = w.grad = None
        row["torch_validate_bits_equal"] = all(np.array_equal(a, b) for a, b in zip(got[True], got[False]))
        row["torch_bits_sha256"] = hashlib.sha256(b"".join(a.tobytes() for a in got[True])).hexdigest()[:16]
        args = [tuple(jax.dlpack.from_dlpack(t.detach()) for t in (x, w, y.to(torch.int32)))]
        jfn = impls_jax.fwd_bwd(lambda a, b, t: fce_jax.fused_lce(a, b, t, engine="fused"))
        start = time.perf_counter()
        loss_j, (dx_j, dw_j) = jax.block_until_ready(jax.jit(jfn)(*args[0]))
        row["jax_first_call_s"] = round(time.perf_counter() - start, 2)
        row["jax_ms"] = timing.measure_jax(jfn, args, settings=SETTINGS).ms
        row["twins_bitwise"] = all(np.array_equal(a, bits(b)) for a, b in zip(got[True], (loss_j, dx_j, dw_j)))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

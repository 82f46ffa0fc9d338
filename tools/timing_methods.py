"""The bench's two timing methods on both twins' fused fwd+bwd, in one process: each call up to a host
synchronization (wall clock) against back to back (`bench.timing`: torch's CUDA events, JAX's one call queued
behind the running one), twice per shape. Why the op bench times JAX back to back:
bench/results/nvidia-h200/jax-known-length/timing_ab.txt.

Usage (GPU): python tools/timing_methods.py N,H,V [N,H,V ...]. A development tool.
"""
import statistics
import sys
import time
from pathlib import Path

import jax
import torch

from bench import impls_jax, impls_torch, timing
from bench.common import Settings

SETTINGS = Settings(device="cuda", smoke=False, reps=10, warmup=3, impls=None, out=Path("/tmp"))


def torch_per_call(fn, sets):
    times = []
    for r in range(SETTINGS.reps):
        args = sets[r % len(sets)]
        timing._clear_grads(args)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def jax_per_call(compiled, sets):
    times = []
    for r in range(SETTINGS.reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*sets[r % len(sets)]))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main():
    for n, h, v in (tuple(int(d) for d in a.split(",")) for a in sys.argv[1:]):
        for round_ in range(2):
            sets = impls_torch.make_inputs((n,), h, v, sets=2, settings=SETTINGS)
            fn = impls_torch.fwd_bwd(impls_torch.FLCE["fce_torch_fused"](SETTINGS))
            events = timing.measure_torch(fn, sets, settings=SETTINGS).ms
            torch_wall = torch_per_call(fn, sets)
            del sets, fn
            timing.free_torch_cache(SETTINGS)
            jsets = impls_jax.make_inputs((n,), h, v, sets=2)
            jfn = impls_jax.fwd_bwd(impls_jax.FLCE["fce_jax_fused"](SETTINGS))
            back_to_back = timing.measure_jax(jfn, jsets, settings=SETTINGS).ms
            jax_wall = jax_per_call(jax.jit(jfn).lower(*jsets[0]).compile(), jsets)
            print(f"{n}x{h}x{v} round {round_}: torch events {events:.3f} per-call {torch_wall:.3f} | "
                  f"jax back-to-back {back_to_back:.3f} per-call {jax_wall:.3f}", flush=True)


if __name__ == "__main__":
    main()

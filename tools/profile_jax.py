"""Where fce_jax's fused engine spends a fwd+bwd on the GPU: the wall time of 50 back-to-back calls of the jitted
value_and_grad per shape, and a perfetto trace of 5 (DIR/jax_NxHxV/) read by `trace_gaps.report`: device busy
time, idle gaps, device time per kernel. The JAX counterpart of `profile_torch.py --trace`.

Usage (GPU): python tools/profile_jax.py DIR N,H,V [N,H,V ...]. A development tool.
"""
import glob
import gzip
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

import fce_jax
from trace_gaps import report

STEPS = 5


def profile(out, n, h, v):
    kx, kw, ky = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (n, h), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (v, h), jnp.float32) / h ** 0.5).astype(jnp.bfloat16)
    y = jax.random.randint(ky, (n,), 0, v)
    step = jax.jit(jax.value_and_grad(lambda x, w, y: fce_jax.fused_lce(x, w, y, engine="fused"), argnums=(0, 1)))
    jax.block_until_ready(step(x, w, y))
    start = time.perf_counter()
    for _ in range(50):
        result = step(x, w, y)
    jax.block_until_ready(result)
    ms = (time.perf_counter() - start) / 50 * 1e3
    where = os.path.join(out, f"jax_{n}x{h}x{v}")
    with jax.profiler.trace(where, create_perfetto_trace=True):
        for _ in range(STEPS):
            result = step(x, w, y)
        jax.block_until_ready(result)
    traces = sorted(glob.glob(os.path.join(where, "**", "perfetto_trace.json.gz"), recursive=True),
                    key=os.path.getmtime, reverse=True)  # this run's, where DIR holds an earlier one
    print(f"== ({n}, {h}, {v}) fce_jax fused: {ms:.3f} ms per fwd+bwd, 50 back to back")
    if not traces:
        print(f"no perfetto trace under {where}")
        return
    text = report(traces[0], STEPS)
    print(text)
    if text.endswith("no device events"):  # which threads the trace does have
        with gzip.open(traces[0], "rt") as f:
            meta = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "M" and "name" in e.get("args", {})]
        print(sorted({(e["pid"], e["name"], e["args"]["name"]) for e in meta})[:40])


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    for shape in sys.argv[2:]:
        profile(sys.argv[1], *(int(s) for s in shape.split(",")))


if __name__ == "__main__":
    main()

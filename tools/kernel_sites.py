"""The kernels in fce_jax's differentiated fused calls as lowered for CUDA, on any machine (no GPU needed): the
custom-call sites by kind (Pallas' Triton lowering, Mosaic GPU), how many distinct ones, and the seconds that
tracing and lowering take in Python. Each Mosaic GPU kernel, and each distinct Triton kernel, is compiled when the
call first runs on the GPU, so these counts are what a first call's compile grows with (fce_jax's fused CPO:
about 90 s at 8 pairs on an H100).

Usage: python tools/kernel_sites.py [cpo:PAIRS[:T:H:V] | flce:N:H:V ...]   (default cpo:1 cpo:8 at T = 1024,
H = 4096, V = 128256, the bench's CPO shapes). A development tool.
"""
import collections
import hashlib
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fce_jax  # noqa: E402
from fce_jax.kernels import launch, mgpu  # noqa: E402

SM90_CORES = 132
CPO_SHAPE = (1024, 4096, 128256)  # T, H, V of `python -m bench cpo`
KINDS = {"__gpu$xla.gpu.triton": "triton", "mosaic_gpu_v2": "mosaic_gpu"}


def lower_for_cuda():
    """Make fce_jax choose its GPU kernels (not the interpreter) although JAX's backend is the CPU."""
    launch.interpret_mode = lambda: False
    for name, module in list(sys.modules.items()):
        if name.startswith("fce_jax") and getattr(module, "interpret_mode", None) is not None:
            module.interpret_mode = launch.interpret_mode
    mgpu._cores = lambda: SM90_CORES


def sites(text):
    """{kind: Counter(kernel key -> sites)} of a lowered module's custom calls: a Mosaic GPU kernel keyed by its
    `kernel_hash` (the hash of its module), any other by its call's attributes (its serialized kernel among
    them) without source locations."""
    out = collections.defaultdict(collections.Counter)
    for call in re.finditer(r"custom_call @([\w$.]+)\([^)]*\) (.*)", text):  # past the operands
        attributes = call.group(2).split(" : (")[0]
        kernel_hash = re.search(r'kernel_hash = "((?:[^"\\]|\\.)*)"', attributes)
        key = kernel_hash.group(1) if kernel_hash else re.sub(r"loc\([^)]*\)", "", attributes)
        out[KINDS.get(call.group(1), call.group(1))][hashlib.md5(key.encode()).hexdigest()] += 1
    return out


def case(spec):
    """(name, function, argument shapes) of a spec: cpo:PAIRS[:T:H:V] or flce:N:H:V, bfloat16, engine="fused",
    the gradient in x and the weight."""
    kind, *dims = spec.split(":")
    dims = [int(d) for d in dims]
    bf16 = jnp.bfloat16
    if kind == "cpo":
        pairs, (t, h, v) = dims[0], dims[1:] or CPO_SHAPE
        shapes = [((2 * pairs, t, h), bf16), ((v, h), bf16), ((2 * pairs, t), jnp.int32)]
        loss = fce_jax.fused_cpo_loss
    elif kind == "flce":
        n, h, v = dims
        shapes = [((n, h), bf16), ((v, h), bf16), ((n,), jnp.int32)]
        loss = fce_jax.fused_lce
    else:
        raise ValueError(f"unknown case {spec!r}: cpo:PAIRS[:T:H:V] or flce:N:H:V")
    fn = jax.grad(lambda x, w, y: loss(x, w, y, engine="fused"), argnums=(0, 1))
    return spec, fn, [jax.ShapeDtypeStruct(s, d) for s, d in shapes]


def measure(spec):
    """A case's tracing and lowering seconds and its kernel sites by kind: (sites, distinct)."""
    name, fn, args = case(spec)
    start = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    mid = time.perf_counter()
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    end = time.perf_counter()
    found = sites(text)
    return {"case": name, "trace_s": mid - start, "lower_s": end - mid,
            "kernels": {k: (sum(c.values()), len(c)) for k, c in sorted(found.items())}}


def main(specs):
    lower_for_cuda()
    for spec in specs or ["cpo:1", "cpo:8"]:
        r = measure(spec)
        kernels = ", ".join(f"{k} {n} sites ({d} distinct)" for k, (n, d) in r["kernels"].items())
        print(f"{r['case']}: {kernels}; traced in {r['trace_s']:.1f} s, lowered in {r['lower_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

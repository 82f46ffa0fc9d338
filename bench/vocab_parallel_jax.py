"""The JAX cell of bench/vocab_parallel.py, in its own process (its devices are set before JAX starts):
``python -m bench.vocab_parallel_jax N H V P REPS WARMUP`` prints {"ms", "peak"} as JSON."""
import json
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fce_jax


def main(n, h, v, size, reps, warmup):
    mesh = jax.make_mesh((size,), ("model",), devices=jax.devices()[:size])
    kx, kw, kt = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (n, h), jnp.bfloat16)
    w = (jax.random.normal(kw, (v, h), jnp.float32) * h ** -0.5).astype(jnp.bfloat16)
    t = jax.random.randint(kt, (n,), 0, v)
    vp = fce_jax.VocabParallel("model") if size > 1 else None
    grad = jax.value_and_grad(lambda x, w: fce_jax.fused_lce(x, w, t, vocab_parallel=vp), argnums=(0, 1))
    fn = jax.jit(grad if size == 1 else jax.shard_map(grad, mesh=mesh, in_specs=(P(), P("model")),
                                                      out_specs=(P(), (P(), P("model"))), check_vma=True))
    args = (jax.device_put(x, NamedSharding(mesh, P())), jax.device_put(w, NamedSharding(mesh, P("model"))))
    compiled = fn.lower(*args).compile()
    stats = compiled.memory_analysis() if jax.default_backend() != "cpu" else None
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    peak = None if stats is None else int(stats.temp_size_in_bytes + stats.output_size_in_bytes)
    print(json.dumps({"ms": sorted(times)[len(times) // 2], "peak": peak}))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:7]))

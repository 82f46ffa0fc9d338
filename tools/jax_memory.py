"""Where fce_jax's temp memory goes: compile (no run) value_and_grad of fused_lce / fused_cpo_loss at given
shapes and print XLA's memory analysis and the instructions of the optimized HLO with results of 1/4 GiB or more.

Usage (GPU, with fce installed or PYTHONPATH=.): python tools/jax_memory.py [--dtype float32] [--engine fused]
[--chunk-rows R] cpo:B,T,H,V ... lce:N,H,V ... (default bfloat16, the library engine, the planner's chunks). On
the CPU the analysis is XLA CPU's: it widens some bfloat16 ops to float32 buffers of its own, so compare float32
programs there. A development tool.
"""
import argparse
import functools
import math
import re

import jax
import jax.numpy as jnp

import fce_jax

GIB = 2**30
BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "s8": 1, "pred": 1}
RESULT = re.compile(r"\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\]")  # an instruction's (non-tuple) result


def compiled(kind, dims, dtype=jnp.bfloat16, **options):
    if kind == "cpo":
        b, t, h, v = dims
        args = (jax.ShapeDtypeStruct((2 * b, t, h), dtype), jax.ShapeDtypeStruct((v, h), dtype),
                jax.ShapeDtypeStruct((2 * b, t), jnp.int32))
        fn = functools.partial(fce_jax.fused_cpo_loss, **options)
    else:
        n, h, v = dims
        args = (jax.ShapeDtypeStruct((n, h), dtype), jax.ShapeDtypeStruct((v, h), dtype),
                jax.ShapeDtypeStruct((n,), jnp.int32))
        fn = functools.partial(fce_jax.fused_lce, **options)
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).compile()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("specs", nargs="+", help="cpo:B,T,H,V or lce:N,H,V")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--engine", default="library", choices=["library", "fused"])
    parser.add_argument("--chunk-rows", type=int, default=None)
    args = parser.parse_args()
    for spec in args.specs:
        kind, dims = spec.split(":")
        c = compiled(kind, tuple(int(d) for d in dims.split(",")), jnp.dtype(args.dtype), engine=args.engine,
                     chunk_rows=args.chunk_rows)
        m = c.memory_analysis()
        print(f"== {spec}: temp {m.temp_size_in_bytes / GIB:.2f} GiB, args {m.argument_size_in_bytes / GIB:.2f}, "
              f"out {m.output_size_in_bytes / GIB:.2f}, alias {m.alias_size_in_bytes / GIB:.2f}")
        for line in c.as_text().splitlines():
            hit = RESULT.match(line)
            if hit and hit.group(1) in BYTES:
                size = BYTES[hit.group(1)] * math.prod(int(d) for d in hit.group(2).split(",") if d)
                if size >= GIB // 4:
                    print(f"  {size / GIB:5.2f} GiB  {line.strip()[:170]}")


if __name__ == "__main__":
    main()

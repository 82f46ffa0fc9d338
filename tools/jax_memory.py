"""Where fce_jax's temp memory goes: compile (no run) value_and_grad of fused_lce / fused_cpo_loss at given
shapes and print XLA's memory analysis and the instructions of the optimized HLO with results of 1/4 GiB or more.

Usage (GPU, with fce installed or PYTHONPATH=.): python tools/jax_memory.py cpo:B,T,H,V ... lce:N,H,V ...
A development tool.
"""
import math
import re
import sys

import jax
import jax.numpy as jnp

import fce_jax

GIB = 2**30
BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "pred": 1}
RESULT = re.compile(r"\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\]")  # an instruction's (non-tuple) result


def compiled(kind, dims):
    bf16 = jnp.bfloat16
    if kind == "cpo":
        b, t, h, v = dims
        args = (jax.ShapeDtypeStruct((2 * b, t, h), bf16), jax.ShapeDtypeStruct((v, h), bf16),
                jax.ShapeDtypeStruct((2 * b, t), jnp.int32))
        fn = fce_jax.fused_cpo_loss
    else:
        n, h, v = dims
        args = (jax.ShapeDtypeStruct((n, h), bf16), jax.ShapeDtypeStruct((v, h), bf16),
                jax.ShapeDtypeStruct((n,), jnp.int32))
        fn = fce_jax.fused_lce
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).compile()


def main():
    for spec in sys.argv[1:]:
        kind, dims = spec.split(":")
        c = compiled(kind, tuple(int(d) for d in dims.split(",")))
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

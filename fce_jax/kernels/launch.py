"""How our kernels are launched: Pallas' Triton lowering on the GPU, interpret mode on the CPU.

The Triton lowering is chosen explicitly (jax 0.11 defaults to Mosaic GPU): the kernels here are
memory-bound row passes whose inline PTX (fastmath.py) must match fce_torch's instruction for instruction.
"""
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def interpret_mode() -> bool:
    """Kernels run in Pallas interpret mode when JAX's default backend is the CPU."""
    return jax.default_backend() == "cpu"


def call(kernel, *, out_shape, grid, num_warps=4, num_stages=3, input_output_aliases=None, **static):
    """pallas_call(kernel with its static keywords bound) for this backend."""
    interpret = interpret_mode()
    params = None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(functools.partial(kernel, **static), out_shape=out_shape, grid=grid,
                          interpret=interpret, compiler_params=params,
                          input_output_aliases=input_output_aliases or {})

"""How our kernels are launched: Pallas' Triton lowering on the GPU, interpret mode on the CPU.

The Triton lowering is chosen explicitly (jax 0.11 defaults to Mosaic GPU): the kernels here are
memory-bound row passes whose inline PTX (fastmath.py) must match fce_torch's instruction for instruction.

Inside ``jax.shard_map(check_vma=True)`` every output carries its manual-axis type: the union of the inputs'
varying axes (an elementwise kernel varies where its operands do). Twin: fce_torch/kernels/launch.py (the torch
twin's Triton launches, which have a host path of their own; here XLA launches the compiled program).
"""
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.sharding import ManualAxisType


def interpret_mode() -> bool:
    """Kernels run in Pallas interpret mode when JAX's default backend is the CPU."""
    return jax.default_backend() == "cpu"


def typed(out_shape, args):
    """`out_shape`'s ShapeDtypeStructs varying over the manual mesh axes that any of `args` varies over, as a
    kernel's outputs must be declared under ``shard_map(check_vma=True)``."""
    varying = frozenset().union(*(jax.typeof(a).mat.varying for a in args))
    mat = ManualAxisType(varying=varying)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat), out_shape)


def call(kernel, *, out_shape, grid, num_warps=4, num_stages=3, input_output_aliases=None, **static):
    """pallas_call(kernel with its static keywords bound) for this backend, as a function of the operands."""
    interpret = interpret_mode()
    if interpret:
        _lower_interpreter_without_vma()
    params = None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)

    def run(*args):
        return pl.pallas_call(functools.partial(kernel, **static), out_shape=typed(out_shape, args), grid=grid,
                              interpret=interpret, compiler_params=params,
                              input_output_aliases=input_output_aliases or {})(*args)

    return run


@functools.cache
def _lower_interpreter_without_vma():
    """A workaround for Pallas' CPU interpreter under ``shard_map(check_vma=True)`` (jax 0.10 and 0.11): at
    lowering it evaluates the kernel again with the check still on, where the kernel's invariant constants
    meet varying blocks ("Primitive pad requires varying manual axes to match"). The types were checked when
    the program was traced, so the CPU lowering of pallas_call runs with the check off and the operands'
    manual-axis types stripped. The GPU lowering is untouched; the CPU lowering of a pallas_call outside
    shard_map is unchanged (no types to strip)."""
    from jax._src import config, core
    from jax._src.interpreters import mlir
    from jax._src.pallas import pallas_call as pallas_call_module

    def strip(avals):
        return [a.update_manual_axis_type(core.empty_mat) if isinstance(a, core.ShapedArray) else a for a in avals]

    def lower(ctx, *args, **params):
        ctx = ctx.replace(avals_in=strip(ctx.avals_in), avals_out=strip(ctx.avals_out))
        with config._check_vma(False):
            return pallas_call_module._pallas_call_lowering(ctx, *args, **params)

    mlir.register_lowering(pallas_call_module.pallas_call_p, lower, platform="cpu")

"""The elementwise float32 operations whose bits the two twins must share (see docs/NUMERICS.md).

On the GPU each one is a single PTX instruction emitted as inline assembly, so no compiler can contract,
re-associate or substitute it; `fce_torch/kernels/fastmath.py` emits the same instructions. `asm` says how: True in
kernels on Pallas' Triton lowering, MOSAIC in kernels on Mosaic GPU (through `plgpu.inline_mgpu`, on arrays of
a WGMMA layout or its rows, with Python numbers as the instruction's immediates). Pallas interpret mode has no
inline assembly: there (`asm=False`) the same formulas run with plain operations.
"""
import struct

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm

from fce_core.config import (LN2, LOG2E, PAIR_LO_BITS, PAIR_LO_HALF, PAIR_LO_MAX, TANH_C3, TANH_C5,
                             TANH_C7, TANH_POLY_BELOW)

__all__ = ["LN2", "LOG2E", "MOSAIC", "ex2", "lg2", "mul", "div", "fma", "tanh", "pair_split", "pair_value"]


MOSAIC = "mosaic"


def _asm(op, asm, *args):
    if asm == MOSAIC:
        return _asm_mosaic(op, *args)
    shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in args))
    args = [jnp.broadcast_to(jnp.asarray(a, jnp.float32), shape) for a in args]
    operands = ", ".join(f"${i}" for i in range(len(args) + 1))
    [out] = pltriton.elementwise_inline_asm(
        f"{op} {operands};", args=args, constraints=",".join(["=f"] + ["f"] * len(args)), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
    return out


def _asm_mosaic(op, *args):
    """`op` on Mosaic GPU: the array arguments (broadcast to one shape, laid out as a WGMMA tile or, 1-d, as its
    rows) as operands, the Python numbers as immediates (float32)."""
    arrays = [a for a in args if not isinstance(a, (int, float))]
    shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in arrays))
    arrays = [jnp.broadcast_to(jnp.asarray(a, jnp.float32), shape) for a in arrays]
    layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
    operands, i = [], 1
    for a in args:
        if isinstance(a, (int, float)):
            operands.append("0f%08X" % struct.unpack("<I", struct.pack("<f", a))[0])
        else:
            operands.append(f"${i}")
            i += 1
    text = f"{op} $0, {', '.join(operands)};"

    def instruction(*values):
        return llvm.inline_asm(ir.F32Type.get(), list(values), text, "=f" + ",f" * len(values))

    @plgpu.inline_mgpu(arg_types=(layout,) * len(arrays),
                       return_type=plgpu.ShapeDtypeStruct(shape, jnp.float32, layout))
    def run(_, first, *rest):
        return first._pointwise(first._lift_fast_instr(instruction), *rest)

    return run(*arrays)


def ex2(x, asm):
    """2**x (`ex2.approx.ftz.f32`)."""
    return _asm("ex2.approx.ftz.f32", asm, x) if asm else jnp.exp2(x)


def lg2(x, asm):
    """log2(x) (`lg2.approx.ftz.f32`)."""
    return _asm("lg2.approx.ftz.f32", asm, x) if asm else jnp.log2(x)


def mul(x, y, asm):
    """x * y, never contracted into an FMA (`mul.rn.f32`)."""
    return _asm("mul.rn.f32", asm, x, y) if asm else x * y


def div(x, y, asm):
    """x / y, correctly rounded (`div.rn.f32`)."""
    return _asm("div.rn.f32", asm, x, y) if asm else x / y


def fma(x, y, z, asm):
    """x * y + z with one rounding (`fma.rn.f32`)."""
    return _asm("fma.rn.f32", asm, x, y, z) if asm else x * y + z


def tanh(u, asm):
    """tanh(u): an odd polynomial below |u| = 0.125, else (1 - e) / (1 + e) with e = 2**(-2|u| log2 e)."""
    u2 = mul(u, u, asm)
    poly = fma(u2, TANH_C7, TANH_C5, asm)
    poly = fma(u2, poly, TANH_C3, asm)
    small = fma(u, mul(poly, u2, asm), u, asm)
    e = ex2(mul(jnp.abs(u), -2.0 * LOG2E, asm), asm)
    big = div(1.0 - e, 1.0 + e, asm)
    big = jnp.where(u < 0.0, -big, big)
    return jnp.where(jnp.abs(u) < TANH_POLY_BELOW, small, big)


def _bits(f):
    return lax.bitcast_convert_type(f, jnp.int32)


def pair_split(s, hi_dtype):
    """The (hi, lo) pair of float32 s (fce_core.config, PAIR_*): hi = rne(s) in hi_dtype, lo = the difference of
    s's and hi's float32 bit patterns in units of 2**PAIR_LO_BITS, rounded to nearest even (integer ops) and
    clipped to +-PAIR_LO_MAX."""
    hi = s.astype(hi_dtype)
    d = _bits(s) - _bits(hi.astype(jnp.float32))
    q = (d + PAIR_LO_HALF + ((d >> PAIR_LO_BITS) & 1)) >> PAIR_LO_BITS
    return hi, jnp.clip(q, -PAIR_LO_MAX, PAIR_LO_MAX).astype(jnp.int8)


def pair_value(hi, lo):
    """The float32 of a `pair_split` pair: hi's bit pattern plus lo units of 2**PAIR_LO_BITS (exact)."""
    u = _bits(hi.astype(jnp.float32)) + (lo.astype(jnp.int32) << PAIR_LO_BITS)
    return lax.bitcast_convert_type(u, jnp.float32)

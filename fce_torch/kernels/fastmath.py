"""The elementwise float32 operations whose bits the two twins must share (see docs/NUMERICS.md).

On the GPU each one is a single PTX instruction emitted as inline assembly, so no compiler can contract,
re-associate or substitute it; `fce_jax/kernels/fastmath.py` emits the same instructions. The Triton interpreter has
no inline assembly: there (`ASM=False`) the same formulas run with plain operations.
"""
import os

import triton
import triton.language as tl

from fce_core import config

# Inline PTX on the GPU; plain operations in the Triton interpreter (which cannot run assembly).
ASM = os.environ.get("TRITON_INTERPRET", "0") != "1"
LOG2E = tl.constexpr(config.LOG2E)
LN2 = tl.constexpr(config.LN2)
_TANH_BELOW = tl.constexpr(config.TANH_POLY_BELOW)
_TANH_C3 = tl.constexpr(config.TANH_C3)
_TANH_C5 = tl.constexpr(config.TANH_C5)
_TANH_C7 = tl.constexpr(config.TANH_C7)
_PAIR_LO_BITS = tl.constexpr(config.PAIR_LO_BITS)
_PAIR_LO_HALF = tl.constexpr(config.PAIR_LO_HALF)
_PAIR_LO_MAX = tl.constexpr(config.PAIR_LO_MAX)


@triton.jit
def _asm1(op: tl.constexpr, x):
    return tl.inline_asm_elementwise(op + " $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _asm2(op: tl.constexpr, x, y):
    return tl.inline_asm_elementwise(op + " $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def ex2(x, ASM: tl.constexpr):
    """2**x (`ex2.approx.ftz.f32`)."""
    if ASM:
        out = _asm1("ex2.approx.ftz.f32", x)
    else:
        out = tl.exp2(x)
    return out


@triton.jit
def lg2(x, ASM: tl.constexpr):
    """log2(x) (`lg2.approx.ftz.f32`)."""
    if ASM:
        out = _asm1("lg2.approx.ftz.f32", x)
    else:
        out = tl.log2(x)
    return out


@triton.jit
def mul(x, y, ASM: tl.constexpr):
    """x * y, never contracted into an FMA (`mul.rn.f32`)."""
    if ASM:
        out = _asm2("mul.rn.f32", x, y)
    else:
        out = x * y
    return out


@triton.jit
def div(x, y, ASM: tl.constexpr):
    """x / y, correctly rounded (`div.rn.f32`)."""
    if ASM:
        out = _asm2("div.rn.f32", x, y)
    else:
        out = x / y
    return out


@triton.jit
def fma(x, y, z, ASM: tl.constexpr):
    """x * y + z with one rounding (`fma.rn.f32`)."""
    if ASM:
        out = tl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", [x, y, z], dtype=tl.float32,
                                        is_pure=True, pack=1)
    else:
        out = x * y + z
    return out


@triton.jit
def tanh(u, ASM: tl.constexpr):
    """tanh(u): an odd polynomial below |u| = 0.125, else (1 - e) / (1 + e) with e = 2**(-2|u| log2 e)."""
    u2 = mul(u, u, ASM)
    poly = fma(u2, _TANH_C7, _TANH_C5, ASM)
    poly = fma(u2, poly, _TANH_C3, ASM)
    small = fma(u, mul(poly, u2, ASM), u, ASM)
    e = ex2(mul(tl.abs(u), -2.0 * LOG2E, ASM), ASM)
    big = div(1.0 - e, 1.0 + e, ASM)
    big = tl.where(u < 0.0, -big, big)
    return tl.where(tl.abs(u) < _TANH_BELOW, small, big)


@triton.jit
def to_dtype(x, dtype: tl.constexpr, ASM: tl.constexpr):
    """float32 x rounded to nearest even in `dtype`. The Triton interpreter truncates float32 -> bfloat16
    (and mangles subnormals), so there the rounding is done on the bits."""
    if not ASM and dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = u + 0x7FFF + ((u >> 16) & 1)
        r = (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        r = x.to(dtype)
    return r


@triton.jit
def _widened_bits(hi):
    """The float32 bit pattern of bfloat16 hi, as an int32 (by the bits: the interpreter's conversion mangles
    subnormals)."""
    return hi.to(tl.uint16, bitcast=True).to(tl.int32) << 16


@triton.jit
def pair_split(s, HI_DT: tl.constexpr, ASM: tl.constexpr):
    """The (hi, lo) pair of float32 s (fce_core.config, PAIR_*): hi = rne(s) in HI_DT, lo = the difference of
    s's and hi's float32 bit patterns in units of 2**PAIR_LO_BITS, rounded to nearest even (integer ops) and
    clipped to +-PAIR_LO_MAX."""
    hi = to_dtype(s, HI_DT, ASM)
    d = s.to(tl.int32, bitcast=True) - _widened_bits(hi)
    q = (d + _PAIR_LO_HALF + ((d >> _PAIR_LO_BITS) & 1)) >> _PAIR_LO_BITS
    return hi, tl.minimum(tl.maximum(q, -_PAIR_LO_MAX), _PAIR_LO_MAX).to(tl.int8)


@triton.jit
def pair_value(hi, lo):
    """The float32 of a `pair_split` pair: hi's bit pattern plus lo units of 2**PAIR_LO_BITS (exact)."""
    u = _widened_bits(hi) + (lo.to(tl.int32) << _PAIR_LO_BITS)
    return u.to(tl.float32, bitcast=True)


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, ASM: tl.constexpr):
    """a @ b with float32 accumulation. The interpreter's tl.dot is numpy's matmul, whose order of summation,
    hence whose float32 bits, depends on the operand shapes (OpenBLAS' kernels): there the products are summed
    in float64, exact for 16-bit operands (and all but exact for float32), then rounded once, so that every
    tiling of a GEMM gives the same bits as on the GPU, where the K order alone sets them."""
    if ASM:
        r = tl.dot(a, b, input_precision=PRECISION)
    else:
        r = tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee").to(tl.float32)
    return r

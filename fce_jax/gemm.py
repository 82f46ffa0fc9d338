"""The three GEMMs: float32 accumulation from the input dtype, rounded once. Twin: fce_torch/gemm.py.

16-bit operands stay 16-bit (`preferred_element_type` sets the float32 accumulator); float32 operands run at
`Precision.HIGHEST` (IEEE float32, no TF32).
"""
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def mm(a, b, out_dtype, *, a_t=False, b_t=False):
    """op(a) @ op(b) (op = transpose where asked), accumulated in float32, rounded once to out_dtype."""
    dims = (((0,) if a_t else (1,), (1,) if b_t else (0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == F32 else None
    out = lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)
    return out.astype(out_dtype)


def addmm(acc, a, b, *, a_t=False, b_t=False):
    """acc (float32) + op(a) @ op(b) (XLA fuses the add into the GEMM's output where it can)."""
    return acc + mm(a, b, F32, a_t=a_t, b_t=b_t)

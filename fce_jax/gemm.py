"""The three GEMMs: float32 accumulation from the input dtype, rounded once. Twin: fce_torch/gemm.py.

16-bit operands stay 16-bit (float32 accumulation; `preferred_element_type` is float32 for a float32 result and
the operands' dtype for a 16-bit one). float32 operands run at `Precision.HIGHEST` (IEEE float32) unless the
user has set ``jax_default_matmul_precision`` (``jax.config.update`` or the ``jax.default_matmul_precision``
context): then fce follows that setting, as ``jnp.matmul`` does.
"""
import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def float32_precision():
    """The precision of a float32 GEMM: the user's ``jax_default_matmul_precision`` when set (None lets JAX
    apply it), else HIGHEST."""
    return None if jax.config.jax_default_matmul_precision is not None else lax.Precision.HIGHEST


def mm(a, b, out_dtype, *, a_t=False, b_t=False):
    """op(a) @ op(b) (op = transpose where asked), accumulated in float32, rounded once to out_dtype."""
    dims = (((0,) if a_t else (1,), (1,) if b_t else (0,)), ((), ()))
    precision = float32_precision() if a.dtype == F32 else None
    # A 16-bit result comes out of the GEMM itself (float32 accumulation, one rounding in its epilogue, as
    # cuBLAS does for fce_torch): as a float32 dot and a cast, XLA may keep the float32 [M, N] in memory.
    acc = out_dtype if a.dtype == out_dtype != F32 else F32
    out = lax.dot_general(a, b, dims, precision=precision, preferred_element_type=acc)
    return out.astype(out_dtype)


def addmm(acc, a, b, *, a_t=False, b_t=False):
    """acc (float32) + op(a) @ op(b) (XLA fuses the add into the GEMM's output where it can)."""
    return acc + mm(a, b, F32, a_t=a_t, b_t=b_t)


def pallas_precision(a):
    """The precision of our own Pallas GEMMs for operand `a`: float32 operands IEEE (HIGHEST) unless the user
    set ``jax_default_matmul_precision`` to something lower (TF32, as `mm` follows it); 16-bit operands ignore
    it."""
    setting = jax.config.jax_default_matmul_precision
    tf32 = a.dtype == F32 and setting is not None and setting not in ("highest", "float32", "HIGHEST")
    return lax.Precision.DEFAULT if tf32 else lax.Precision.HIGHEST

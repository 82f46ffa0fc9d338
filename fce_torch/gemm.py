"""The three GEMMs: float32 accumulation from the input dtype, rounded once. Twin: fce_jax/gemm.py.

On CUDA the operands go straight to cuBLAS (16-bit operands with a float32 or 16-bit output). float32 operands
follow torch's own float32 matmul setting, as ``torch.mm`` does: IEEE float32 by default, TF32 when the user
enabled it (``torch.backends.cuda.matmul.allow_tf32`` or ``torch.set_float32_matmul_precision``). On the CPU
the operands are upcast to float32 first (16-bit -> float32 is exact), which is the same arithmetic.
"""
import torch

F32 = torch.float32


def mm(a, b, out_dtype, out=None):
    """a @ b, accumulated in float32 and rounded once to out_dtype (written into `out` when given)."""
    if not a.is_cuda:
        c = torch.mm(a.to(F32), b.to(F32)).to(out_dtype)
        return c if out is None else out.copy_(c)
    if out_dtype == a.dtype:
        return torch.mm(a, b, out=out)
    return torch.mm(a, b, out_dtype=out_dtype, out=out)


def addmm_(acc, a, b):
    """acc (float32) += a @ b in place; on CUDA the add is the GEMM's epilogue (beta = 1)."""
    if not a.is_cuda or a.dtype == F32:
        return acc.addmm_(a.to(F32), b.to(F32))
    return torch.addmm(acc, a, b, out_dtype=F32, out=acc)


def triton_precision(a):
    """The `input_precision` of our own Triton GEMMs for operand `a`: "tf32" for float32 operands when torch's
    float32 matmul setting allows TF32 (as `mm` follows it), else "ieee" (16-bit operands ignore it)."""
    tf32 = a.dtype == F32 and a.is_cuda and torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 else "ieee"

"""The three GEMMs: float32 accumulation from the input dtype, rounded once. Twin: fce_jax/gemm.py.

On CUDA the operands go straight to cuBLAS (16-bit operands with a float32 or 16-bit output); float32
operands run at IEEE float32 (TF32 is refused by reading the global flag, never by flipping it). On the CPU the
operands are upcast to float32 first (16-bit -> float32 is exact), which is the same arithmetic.
"""
import torch

F32 = torch.float32


def _check_no_tf32(t):
    if t.dtype == F32 and t.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        raise RuntimeError("fce_torch: float32 inputs need IEEE float32 GEMMs, but "
                           "torch.backends.cuda.matmul.allow_tf32 is True; set it to False or use bf16 inputs.")


def mm(a, b, out_dtype, out=None):
    """a @ b, accumulated in float32 and rounded once to out_dtype (written into `out` when given)."""
    if not a.is_cuda:
        c = torch.mm(a.to(F32), b.to(F32)).to(out_dtype)
        return c if out is None else out.copy_(c)
    _check_no_tf32(a)
    if out_dtype == a.dtype:
        return torch.mm(a, b, out=out)
    return torch.mm(a, b, out_dtype=out_dtype, out=out)


def addmm_(acc, a, b):
    """acc (float32) += a @ b in place; on CUDA the add is the GEMM's epilogue (beta = 1)."""
    if not a.is_cuda or a.dtype == F32:
        _check_no_tf32(a)
        return acc.addmm_(a.to(F32), b.to(F32))
    return torch.addmm(acc, a, b, out_dtype=F32, out=acc)

"""dW's (hi, lo) accumulation on fce_torch's Gluon kernel (fce_torch/kernels/grad_gemms_gluon.py, sm_90) against
the Triton kernel that it stands in for (grad_gemms with an explicit launch): the same bits in hi and lo for the
first chunk's pair, an accumulation and the last one's hi, on a GPU (`tools/gpu_run.sh gputests`), at shapes with
partial row and column tiles and K steps, one row, and K cut short of dZ's rows. Where it does not apply (the CPU's interpreter,
a float32 accumulator, dZ formed on the load) `dw_first` / `dw_accumulate` run the Triton kernel. Its compile for
sm_90a (shared memory, spills): tests/test_sm90_registers.py."""
import pytest
import torch

from fce_core.config import GRAD_GEMM_TORCH
from fce_core.plan import WRITE
from fce_torch.kernels import grad_gemms as tg
from fce_torch.kernels import grad_gemms_gluon


def _chunk(k, h, v, device):
    g = torch.Generator(device=device).manual_seed(k + h + v)
    dz = (torch.randn(k, v, device=device, generator=g) * 1e-2).to(torch.bfloat16)
    dz[:, 3] *= 2.0 ** 12  # a column whose sums dwarf the rest: lo clipped in its row of dW
    x = torch.randn(k, h, device=device, generator=g).to(torch.bfloat16)
    return dz, x


def test_gluon_dw_does_not_apply_on_the_interpreter():
    """Not on CPU tensors (the interpreter's machine), nor for another mode than the pair's."""
    dz, x = _chunk(40, 64, 96, "cpu")
    hi, lo = torch.empty(96, 64, dtype=torch.bfloat16), torch.empty(96, 64, dtype=torch.int8)
    assert not grad_gemms_gluon.applies(dz, x, hi, lo, 40)
    with pytest.raises(ValueError, match="pair"):
        grad_gemms_gluon.dw_pair(dz, x, hi, lo, WRITE, False)


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@pytest.mark.gpu
@pytest.mark.parametrize("n, rows, h, v", [(200, None, 640, 1000), (1, None, 128, 520), (300, 200, 896, 4104),
                                            (768, None, 256, 2 * 256), (130, None, 208, 392)])
def test_gluon_dw_bits_equal_triton(n, rows, h, v, device):
    if device != "cuda" or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon dW kernel runs on sm_90 GPUs")
    dz, x = _chunk(n, h, v, device)
    k = n if rows is None else rows
    first_t = tg.dw_first(dz, x, torch.bfloat16, cfg=GRAD_GEMM_TORCH, rows=rows)  # the Triton kernel
    assert grad_gemms_gluon.applies(dz, x, *first_t, k)
    first_g = tg.dw_first(dz, x, torch.bfloat16, rows=rows)  # the default: the Gluon kernel
    for a, b in zip(first_g, first_t):
        assert torch.equal(_bits(a), _bits(b))
    acc_t = tg.dw_accumulate(dz, x, tuple(p.clone() for p in first_t), cfg=GRAD_GEMM_TORCH, rows=rows)
    acc_g = tg.dw_accumulate(dz, x, tuple(p.clone() for p in first_t), rows=rows)
    assert bool((acc_t[1] != 0).any())  # the rest carried in lo, which the accumulation read
    for a, b in zip(acc_g, acc_t):
        assert torch.equal(_bits(a), _bits(b))
    last_t = tg.dw_accumulate(dz, x, tuple(p.clone() for p in acc_t), cfg=GRAD_GEMM_TORCH, rows=rows, last=True)
    last_g = tg.dw_accumulate(dz, x, tuple(p.clone() for p in acc_t), rows=rows, last=True)
    assert torch.equal(_bits(last_g), _bits(last_t))
    # the pair's value, against float64: three chunks of the same product
    want = 3.0 * (dz[:k].double().t() @ x[:k].double())
    scale = want.abs().amax(dim=1, keepdim=True)
    assert bool(((last_g.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-3 * scale).all())

"""fce_torch's gradient GEMMs on their Gluon kernel (fce_torch/kernels/grad_gemms_gluon.py, sm_90) against the
Triton kernel that it stands in for (grad_gemms with an explicit launch), on a GPU (`tools/gpu_run.sh gputests`):
the same bits in dX (its rows, in bfloat16 and float32, over one slice of V or several), in dW written once, and in
hi and lo for the first chunk's pair, an accumulation and the last one's hi, at shapes with partial row and column
tiles and K steps, one row, and rows cut short of dZ's. Where it does not apply (the CPU's interpreter, a float32
accumulator, dZ formed on the load) the Triton kernel runs. Its compile for sm_90a (shared memory, spills):
tests/test_sm90_registers.py."""
import pytest
import torch

from fce_core.config import GRAD_GEMM_GLUON, GRAD_GEMM_TORCH
from fce_core.plan import ADD, PAIR, WRITE, dx_slices
from fce_torch.kernels import grad_gemms as tg
from fce_torch.kernels import grad_gemms_gluon


def _chunk(k, h, v, device):
    g = torch.Generator(device=device).manual_seed(k + h + v)
    dz = (torch.randn(k, v, device=device, generator=g) * 1e-2).to(torch.bfloat16)
    dz[:, 3] *= 2.0 ** 12  # a column whose sums dwarf the rest: lo clipped in its row of dW
    x = torch.randn(k, h, device=device, generator=g).to(torch.bfloat16)
    return dz, x


def test_gluon_grads_do_not_apply_on_the_interpreter():
    """Not on CPU tensors (the interpreter's machine); ADD (a float32 accumulator) is not one of its modes; planes
    whose rows are not whole tiles are refused."""
    dz, x = _chunk(40, 64, 96, "cpu")
    hi, lo = torch.empty(96, 64, dtype=torch.bfloat16), torch.empty(96, 64, dtype=torch.int8)
    assert not grad_gemms_gluon.applies(dz, x, hi, 40, PAIR, lo)
    assert not grad_gemms_gluon.applies(dz, x, hi, 40, WRITE)
    with pytest.raises(ValueError, match="pair"):
        grad_gemms_gluon.dw(dz, x, hi.float(), None, ADD, False)
    with pytest.raises(ValueError, match="multiple"):
        grad_gemms_gluon.dx_planes(dz, x[:96], torch.empty(2, 40, 64), 2, 64)


def test_gluon_grads_take_a_ragged_k_only_in_the_last_slice():
    """One slice may end inside a K step (a chunk of 200 rows, dW's K); slices before the last may not."""
    bk = GRAD_GEMM_GLUON.tile_k
    grad_gemms_gluon.check_slices(200, 1, bk)
    grad_gemms_gluon.check_slices(4 * bk, 3, bk)
    with pytest.raises(ValueError, match="whole K steps"):
        grad_gemms_gluon.check_slices(4 * bk + 8, 3, bk)


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _gluon_on(device):
    if device != "cuda" or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon gradient GEMMs run on sm_90 GPUs")


@pytest.mark.gpu
@pytest.mark.parametrize("n, rows, h, v", [(200, None, 640, 1000), (1, None, 128, 520), (300, 200, 896, 4104),
                                            (768, None, 256, 2 * 256), (130, None, 208, 392)])
def test_gluon_dw_bits_equal_triton(n, rows, h, v, device):
    _gluon_on(device)
    dz, x = _chunk(n, h, v, device)
    k = n if rows is None else rows
    first_t = tg.dw_first(dz, x, torch.bfloat16, cfg=GRAD_GEMM_TORCH, rows=rows)  # the Triton kernel
    assert grad_gemms_gluon.applies(dz[:k], x[:k], first_t[0], k, PAIR, first_t[1])
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


@pytest.mark.gpu
@pytest.mark.parametrize("n, rows, h, v", [(200, None, 640, 3000), (1, None, 128, 520), (300, 200, 896, 4104),
                                            (1100, None, 256, 2 * 256), (130, None, 208, 392), (40, None, 4096, 9000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gluon_dx_bits_equal_triton(n, rows, h, v, dtype, device):
    """dX (its slices of V and their planes' sum, or one slice straight into its rows) and dW written once."""
    _gluon_on(device)
    dz, x = _chunk(n, h, v, device)
    w = (torch.randn(v, h, device=device) * 0.05).to(torch.bfloat16)
    m = n if rows is None else rows
    out_t, out_g = (torch.full((n, h), 7.0, device=device, dtype=dtype) for _ in range(2))
    assert grad_gemms_gluon.applies(dz[:m], w, out_g, v, WRITE)
    tg.dx_gemm(dz, w, out_t, cfg=GRAD_GEMM_TORCH, rows=rows)  # the Triton kernel
    tg.dx_gemm(dz, w, out_g, cfg=GRAD_GEMM_GLUON, rows=rows)
    assert torch.equal(_bits(out_g), _bits(out_t))
    want = dz[:m].double() @ w.double()
    assert bool(((out_g[:m].double() - want).abs() <= 2 ** -7 * want.abs() + 1e-4 * want.abs().amax()).all())
    assert not bool(out_g[m:].any())
    if dtype == torch.bfloat16:
        dw_t = tg.dw_gemm(dz, x, torch.bfloat16, cfg=GRAD_GEMM_TORCH, rows=rows)
        assert torch.equal(_bits(tg.dw_gemm(dz, x, torch.bfloat16, cfg=GRAD_GEMM_GLUON, rows=rows)), _bits(dw_t))


def test_gluon_dx_cases_cover_one_and_several_slices():
    """The GPU test's shapes take dX over one slice of V and over several (the planes)."""
    slices = {dx_slices(n, h, v) for n, _, h, v in [(200, None, 640, 3000), (1, None, 128, 520),
                                                     (1100, None, 256, 512), (40, None, 4096, 9000)]}
    assert 1 in slices and max(slices) > 1

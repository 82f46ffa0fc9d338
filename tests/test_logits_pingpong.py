"""fce_torch's logits GEMM on sm_90 (fce_torch/kernels/logit_tiles_gluon.py, the ping-pong kernel) against the
Triton kernel that it stands in for (logit_tiles with cfg=GEMM): the same bits in e and in every partial, for the
options it takes, on a GPU (`tools/gpu_run.sh gputests`). Where it does not apply (the CPU's interpreter, a bias,
a temperature, a softcap, a chunk of few rows) `logit_tiles` runs the Triton kernel."""
import pytest
import torch

from fce_core.config import GEMM, SHORT_ROWS
from fce_core.heads import StatsSpec
from fce_core.options import Transform
from fce_torch.kernels import logit_tiles_gluon
from fce_torch.kernels.logit_tiles import logit_tiles


def _inputs(n, h, v, dtype, device):
    g = torch.Generator(device=device).manual_seed(n + v)
    x = torch.randn(n, h, device=device, generator=g).to(dtype)
    w = (torch.randn(v, h, device=device, generator=g) / h ** 0.5).to(dtype)
    x[5] *= 300.0  # huge logits in one row
    y = torch.randint(0, v, (n,), device=device, generator=g)
    y[::3] = -100  # ignored rows, and a target past V: both read as 0
    y[1] = v + 7
    cw = torch.rand(v, device=device, generator=g)
    return x, w, y, cw


def test_pingpong_does_not_apply_off_sm90():
    """Not on CPU tensors (the interpreter's machine): there the Triton kernel runs. (A bias, a softcap and a
    temperature are refused on the GPU, in `test_pingpong_bits_equal_triton`.)"""
    x, w, _, _ = _inputs(300, 64, 300, torch.bfloat16, "cpu")
    assert not logit_tiles_gluon.applies(x, w, None, None, Transform())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, h, v", [(SHORT_ROWS + 77, 320, 1000), (700, 640, 2 * GEMM.tile_n)])
@pytest.mark.parametrize("spec, with_cw, store", [
    (StatsSpec(), False, True), (StatsSpec(q=True, pz=True), False, True), (StatsSpec(q=True), True, True),
    (StatsSpec(), False, False)])
def test_pingpong_bits_equal_triton(n, h, v, dtype, spec, with_cw, store, device):
    if device != "cuda" or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the ping-pong kernel runs on sm_90 GPUs")
    x, w, y, cw = _inputs(n, h, v, dtype, device)
    cw = cw if with_cw else None
    e_ref = x.new_empty((n, v)) if store else None
    assert logit_tiles_gluon.applies(x, w, e_ref, None, Transform())
    assert not logit_tiles_gluon.applies(x, w, e_ref, w[:, 0], Transform())
    assert not logit_tiles_gluon.applies(x, w, e_ref, None, Transform(softcap=30.0))
    assert not logit_tiles_gluon.applies(x, w, e_ref, None, Transform(temperature=0.7))
    kw = dict(spec=spec, transform=Transform(), precision="ieee", store=store)
    e_t, p_t = logit_tiles(x, w, None, y, cw, cfg=GEMM, **kw)  # the Triton kernel
    e_p, p_p = logit_tiles(x, w, None, y, cw, **kw)  # the default: the ping-pong kernel
    assert p_p.keys() == p_t.keys()
    for k in p_t:
        bits = torch.int32 if p_t[k].dtype == torch.float32 else p_t[k].dtype
        assert torch.equal(p_p[k].view(bits), p_t[k].view(bits)), k
    if store:
        assert torch.equal(e_p.view(torch.int16), e_t.view(torch.int16))
    else:
        assert e_p is None and e_t is None

"""The JAX twin's Mosaic GPU GEMMs lowered for CUDA on this CPU, at the H200 launch (GRAD_GEMM_MOSAIC) and real
chunk shapes: `jax.export` with platforms=["cuda"] runs Mosaic GPU's own lowering (layout inference, wgmma,
TMA, barriers) in Python, so a kernel that the GPU interpret mode runs but Mosaic cannot lower fails here, not
first on the GPU. The PTX that XLA then compiles on the GPU is not built here, and the lowering is this
machine's jax (0.10.2; the H200 has 0.11.2). The CPU tests of the same kernels' values are in
test_fused_engine.py (interpret mode)."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax import export

from fce_core.config import GRAD_GEMM_MOSAIC
from fce_core.plan import dx_slices
from fce_jax.kernels import grad_gemms, mgpu

S = jax.ShapeDtypeStruct
BF16, F16 = jnp.bfloat16, jnp.float16


@pytest.fixture
def gpu_launch(monkeypatch):
    """The GPU's launch (no interpret mode, persistent programs on the H200's 132 multiprocessors)."""
    monkeypatch.setattr(mgpu, "interpret_mode", lambda: False)
    monkeypatch.setattr(mgpu, "_cores", lambda: 132)


def _mosaic_calls(fn, *args):
    """The Mosaic GPU kernels of fn's program lowered for CUDA."""
    return export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module().count("custom_call @mosaic_gpu")


CASES = {  # name: (function of the operands, operand shapes and dtypes)
    "dx sliced 512x640x262144": (lambda dz, w: grad_gemms.dx_gemm(dz, w, BF16, cfg=GRAD_GEMM_MOSAIC),
                                 [((512, 262144), BF16), ((262144, 640), BF16)]),
    "dx 4096x4096x128256": (lambda dz, w: grad_gemms.dx_gemm(dz, w, BF16, cfg=GRAD_GEMM_MOSAIC),
                            [((4096, 128256), BF16), ((128256, 4096), BF16)]),
    "dw written": (lambda dz, x: grad_gemms.dw_gemm(dz, x, BF16, cfg=GRAD_GEMM_MOSAIC),
                   [((512, 262144), BF16), ((512, 640), BF16)]),
    "(hi, lo) first": (lambda dz, x: grad_gemms.dw_first(dz, x, BF16, cfg=GRAD_GEMM_MOSAIC),
                       [((768, 151936), BF16), ((768, 896), BF16)]),
    "(hi, lo) accumulated": (lambda dz, x, hi, lo: grad_gemms.dw_accumulate(dz, x, (hi, lo), cfg=GRAD_GEMM_MOSAIC),
                             [((1024, 128256), BF16), ((1024, 4096), BF16), ((128256, 4096), BF16),
                              ((128256, 4096), jnp.int8)]),
    "(hi, lo) last": (lambda dz, x, hi, lo: grad_gemms.dw_accumulate(dz, x, (hi, lo), cfg=GRAD_GEMM_MOSAIC,
                                                                     last=True),
                      [((1024, 128256), BF16), ((1024, 4096), BF16), ((128256, 4096), BF16),
                       ((128256, 4096), jnp.int8)]),
    "float32 accumulated": (lambda dz, x, acc: grad_gemms.dw_accumulate(dz, x, acc, cfg=GRAD_GEMM_MOSAIC),
                            [((512, 262144), F16), ((512, 640), F16), ((262144, 640), jnp.float32)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mosaic_gemms_lower_for_cuda(gpu_launch, name):
    fn, shapes = CASES[name]
    assert _mosaic_calls(fn, *(S(shape, dtype) for shape, dtype in shapes)) == 1


def test_the_sliced_case_takes_the_planes_path():
    """"dx sliced" lowers dX over several slices of V (float32 planes), "dx 4096x..." over one."""
    assert dx_slices(512, 640, 262144, GRAD_GEMM_MOSAIC) > 1
    assert dx_slices(4096, 4096, 128256, GRAD_GEMM_MOSAIC) == 1


def test_a_tile_mosaic_cannot_lower_fails(gpu_launch):
    """The check has teeth: 32 rows per compute warpgroup (64-row tiles over two of them), below wgmma's 64,
    is refused by the lowering."""
    cfg = dataclasses.replace(GRAD_GEMM_MOSAIC, tile_m=64)
    with pytest.raises(ValueError, match="divisible by the tile size"):
        _mosaic_calls(lambda dz, x: grad_gemms.dw_gemm(dz, x, BF16, cfg=cfg), S((512, 262144), BF16),
                      S((512, 640), BF16))

"""The fused engine's GEMMs at one chunk's shape, once each inside an NVTX range named "profiled", for Nsight
Compute: warm-up calls first (compiles), then the profiled ones.

    ncu --clock-control none --nvtx --nvtx-include "profiled/" --section SpeedOfLight \
        --section WarpStateStats --section SourceCounters python tools/ncu_gemms.py K,H,V torch|jax|gluon|gluon-il

(with `PYTHONPATH=$PWD`; for jax also `XLA_PYTHON_CLIENT_PREALLOCATE=false`, and filter by count instead of
NVTX, `--launch-count 12`: JAX launches from its own threads). K is the chunk's rows, H and V the weight's shape.
- torch: cuBLAS's dZᵀx, fce_torch's dW written in bfloat16, its (hi, lo) first chunk and accumulation, cuBLAS's
  float32-out logits GEMM and fce_torch's logits GEMM with its statistics;
- jax: the JAX twin's Mosaic GPU (hi, lo) accumulation, its default schedule and `pingpong`;
- gluon: fce_torch's dW written, first chunk and accumulation, then tools/gluon_dw.py's first chunk and
  accumulation (256x128x32, 5 stages);
- gluon-il: fce_torch's dW written, the warp-specialized prototype's first chunk (256x128x32, 5 stages), the
  interleaved epilogue's first chunk and accumulation (128x256x32, 4 stages);
- logits: the twins' ping-pong logits GEMMs with the loss's statistics and tile values stored, fce_torch's
  (Gluon, `_logit_tiles_pp_kernel`) and the JAX twin's (Mosaic GPU, `_pingpong_kernel_mosaic_gpu_kernel`); with
  `-k regex:"_logit_tiles_pp|_pingpong_kernel_mosaic" --launch-count 2 --set full` and then
  `ncu -i REPORT --page source --csv --print-source sass > SASS.csv`, `python tools/ncu_sass.py SASS.csv`.
A development tool (GPU only); results in bench/results/nvidia-h100/dw-epilogue/ and mosaic-logits-epilogue/.
"""
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _calls(k, h, v, which):
    from fce_torch.kernels import grad_gemms as tg
    g = torch.Generator(device="cuda").manual_seed(1)
    dz = (torch.randn(k, v, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    x = torch.randn(k, h, device="cuda", generator=g).to(torch.bfloat16)
    pair = tg.dw_first(dz, x, torch.bfloat16)
    if which == "torch":
        from fce_core.heads import StatsSpec
        from fce_core.options import Transform
        from fce_torch.kernels import logit_tiles as tt
        w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
        y = torch.randint(0, v, (k,), device="cuda", generator=g)
        return [lambda: torch.mm(dz.t(), x), lambda: tg.dw_gemm(dz, x, torch.bfloat16),
                lambda: tg.dw_first(dz, x, torch.bfloat16), lambda: tg.dw_accumulate(dz, x, pair),
                lambda: torch.mm(x, w.t(), out_dtype=torch.float32),
                lambda: tt.logit_tiles(x, w, None, y, None, spec=StatsSpec(), transform=Transform(),
                                       precision="ieee")]
    if which == "logits":
        return _logits_calls(x, k, h, v, g)
    if which == "jax":
        import jax
        from fce_core.config import GRAD_GEMM_MOSAIC
        from fce_jax.kernels import grad_gemms as jg
        dzj, xj = jax.dlpack.from_dlpack(dz), jax.dlpack.from_dlpack(x)
        state = [tuple(jax.dlpack.from_dlpack(p.clone()) for p in pair)]
        runs = {pp: jax.jit(lambda a, b, c, pp=pp: jg.dw_accumulate(
            a, b, c, cfg=dataclasses.replace(GRAD_GEMM_MOSAIC, pingpong=pp))) for pp in (False, True)}

        def acc(pp):
            state[0] = jax.block_until_ready(runs[pp](dzj, xj, state[0]))
        return [lambda: acc(False), lambda: acc(True)]
    import gluon_dw as gd
    kw = dict(bm=256, bn=128, bk=32, stages=5)
    gluon_pair = tuple(p.clone() for p in pair)
    if which == "gluon-il":
        il = dict(bm=128, bn=256, bk=32, stages=4, il=True)
        return [lambda: tg.dw_gemm(dz, x, torch.bfloat16), lambda: gd.dw_pair(dz, x, first=True, ws=True, **kw),
                lambda: gd.dw_pair(dz, x, first=True, **il), lambda: gd.dw_pair(dz, x, *gluon_pair, **il)]
    return [lambda: tg.dw_gemm(dz, x, torch.bfloat16), lambda: tg.dw_first(dz, x, torch.bfloat16),
            lambda: tg.dw_accumulate(dz, x, pair), lambda: gd.dw_pair(dz, x, first=True, **kw),
            lambda: gd.dw_pair(dz, x, *gluon_pair, **kw)]


def _logits_calls(x, k, h, v, g):
    import jax
    from fce_core.config import GEMM, LOGITS_PINGPONG_MOSAIC
    from fce_core.heads import StatsSpec
    from fce_core.options import Transform
    from fce_jax.kernels import logit_tiles as jt
    from fce_jax.kernels import logit_tiles_mgpu as jm
    from fce_torch.kernels import logit_tiles as tt
    w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
    y = torch.randint(0, v, (k,), device="cuda", generator=g)
    xj, wj = jax.dlpack.from_dlpack(x), jax.dlpack.from_dlpack(w)
    y_safe = jt.safe_targets(jt.arrays, jax.dlpack.from_dlpack(y.to(torch.int32)), v)
    mosaic = jax.jit(lambda a, b, c: jm.mosaic_logit_tiles(a, b, c, has_q=False, has_pz=False, store=True, cfg=GEMM,
                                                           pingpong=LOGITS_PINGPONG_MOSAIC))
    return [lambda: tt.logit_tiles(x, w, None, y, None, spec=StatsSpec(), transform=Transform(), precision="ieee"),
            lambda: jax.block_until_ready(mosaic(xj, wj, y_safe))]


def main():
    k, h, v = (int(s) for s in sys.argv[1].split(","))
    calls = _calls(k, h, v, sys.argv[2])
    for f in calls:
        f()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profiled")
    for f in calls:
        f()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()

"""The JAX twin's logits GEMM on its Mosaic GPU ping-pong kernel (fce_jax/kernels/logit_tiles_mgpu.py,
`pingpong=`) against fce_torch's (the Gluon ping-pong kernel where it applies, the same bits as its Triton
kernel) and the JAX twin's kernel on Pallas' Triton lowering, per chunk: bits of e and of every partial against
fce_torch's, and times, over launch variants of LOGITS_PINGPONG_MOSAIC (the epilogue's parts, the loader's
warps), and over the options that the kernel takes (the loss's statistics; q and pz; no e stored); at the first
shape also the bits with NaN in the logits (`_nan_bits`). On the same GPU tensors (DLPack); with
MOSAIC_GPU_DUMP_PTXAS=1 each variant's ptxas report follows its "===" line.

    python tools/mosaic_logits.py [OUT.json [N,H,V ...]]   # GPU only

A development tool.
"""
import dataclasses
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gluon_logits
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import torch

from fce_core.config import GEMM, LOGITS_PINGPONG_MOSAIC
from fce_core.heads import StatsSpec
from fce_core.options import Transform
from fce_jax.kernels import logit_tiles as jt
from fce_jax.kernels import logit_tiles_mgpu as jm
from fce_jax.kernels import mgpu
from fce_torch.kernels import logit_tiles as tt
from gluon_logits import bits_equal, chunk_inputs, emitter, report, time_cuda

TRITON_LOWERING = dataclasses.replace(GEMM, pingpong_max_hidden=0)  # the JAX twin's kernel on Pallas' Triton lowering
SHAPES = [(2048, 2048, 128256), (768, 640, 262144), (1280, 896, 151936), (1024, 4096, 128256), (512, 4096, 128256)]
# the JAX twin's launch first, then its epilogue parts and loader warps varied
VARIANTS = [dataclasses.replace(LOGITS_PINGPONG_MOSAIC, parts=parts, loader_warps=warps)
            for parts in (2, 4) for warps in (4, 1)]
OPTIONS = [("loss", StatsSpec(), True), ("q pz", StatsSpec(q=True, pz=True), True), ("no store", StatsSpec(), False)]


def _name(cfg):
    return (f"mosaic pp {cfg.tile_m}x{GEMM.tile_n}x{cfg.tile_k} s{cfg.num_stages} p{cfg.parts}/{cfg.parts_q_pz} "
            f"r{mgpu.COMPUTE_REGISTERS}/{mgpu.MEMORY_REGISTERS} loader {cfg.loader_warps}w")


def _time_jax(fn, reps=20, rounds=3):
    """ms per call of a jitted `fn`: the best of `rounds` rounds of `reps` calls, dispatched back to back and
    waited for once."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) * 1e3 / reps)
    return best


def _nan_bits(x, w, y, variant):
    """The bits of the kernel (launch `variant`) against fce_torch's on logits with NaN: a row of x NaN (every
    logit of the row), a row of w NaN (a column in every row), one row's target there. Untimed."""
    x, w, y = x.clone(), w.clone(), y.clone()
    x[10], w[17], y[11] = float("nan"), float("nan"), 17
    e_ref, p_ref = tt.logit_tiles(x, w, None, y, None, spec=StatsSpec(), transform=Transform(), precision="ieee")
    xj, wj, yj = (jax.dlpack.from_dlpack(t) for t in (x, w, y.to(torch.int32)))
    e, parts = jm.mosaic_logit_tiles(xj, wj, jt.safe_targets(jt.arrays, yj, w.shape[0]), has_q=False,
                                     has_pz=False, store=True, cfg=GEMM, pingpong=variant)
    bits = {k: bits_equal(torch.from_dlpack(parts[k]), p_ref[k]) for k in p_ref}
    bits["e"] = bits_equal(torch.from_dlpack(e), e_ref)
    return dict(impl=_name(variant), options="loss, NaN", bits=bits)


def main(out_path=None, shapes=SHAPES, variants=VARIANTS):
    print(f"jax {jax.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for n, h, v in shapes:
        x, w, y, _ = chunk_inputs(n, h, v)
        x[5 % n] *= 64.0  # logits in the hundreds in one row
        xj, wj, yj = (jax.dlpack.from_dlpack(t) for t in (x, w, y.to(torch.int32)))
        y_safe = jt.safe_targets(jt.arrays, yj, v)
        emit = emitter(rows, n, h, v)
        emit(dict(impl="cublas bf16 out (torch)", ms=time_cuda(lambda: torch.mm(x, w.t()))))
        for name, spec, store in OPTIONS:
            run_torch = lambda: tt.logit_tiles(x, w, None, y, None, spec=spec, transform=Transform(),  # noqa: E731
                                               precision="ieee", store=store)
            e_ref, p_ref = run_torch()
            emit(dict(impl="fce_torch default", options=name, ms=time_cuda(run_torch)))
            lowering = jax.jit(lambda a, b, c: jt.logit_tiles(a, b, None, c, None, spec=spec, transform=Transform(),
                                                              precision=None, store=store, cfg=TRITON_LOWERING))
            emit(dict(impl="fce_jax triton lowering", options=name, ms=_time_jax(lambda: lowering(xj, wj, yj))))
            for variant in variants if name != "q pz" else variants[:1]:
                print(f"=== {n}x{h}x{v}: {_name(variant)}, {name}", flush=True)  # before its ptxas lines
                row = dict(impl=_name(variant), options=name)
                try:
                    fn = jax.jit(lambda a, b, c, cfg=variant: jm.mosaic_logit_tiles(
                        a, b, c, has_q=spec.q, has_pz=spec.pz, store=store, cfg=GEMM, pingpong=cfg))
                    t0 = time.perf_counter()
                    e, parts = jax.block_until_ready(fn(xj, wj, y_safe))
                    row["first_call_s"] = round(time.perf_counter() - t0, 2)
                    row["bits"] = {k: bits_equal(torch.from_dlpack(parts[k]), p_ref[k]) for k in p_ref}
                    if store:
                        row["bits"]["e"] = bits_equal(torch.from_dlpack(e), e_ref)
                    del e, parts
                    row["ms"] = _time_jax(lambda fn=fn: fn(xj, wj, y_safe))
                except Exception as exc:  # noqa: BLE001 - one variant's failure should not hide the others
                    row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                    traceback.print_exc()
                emit(row)
            del e_ref, p_ref
        if (n, h, v) == shapes[0]:
            emit(_nan_bits(x, w, y, variants[0]))
        del x, w, y, xj, wj, yj
        torch.cuda.empty_cache()
    return report(rows, out_path)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("tools/mosaic_logits.py needs a GPU (the CPU tests run the kernel in Mosaic GPU's interpret mode)")
    shapes = [tuple(map(int, a.split(","))) for a in sys.argv[2:]] or SHAPES
    main(sys.argv[1] if len(sys.argv) > 1 else None, shapes)

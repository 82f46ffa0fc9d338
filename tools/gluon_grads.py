"""fce_torch's gradient GEMMs on their Gluon kernel (fce_torch/kernels/grad_gemms_gluon.py) against the Triton
kernel (grad_gemms.py, its default launch for each) and cuBLAS, per chunk: dX = dZ W (over the chunk's slices of V,
their planes summed), dW written once, and dW's (hi, lo) accumulation (the first chunk's pair, an accumulation,
the last one's hi; also against the JAX twin's Mosaic GPU kernel, through DLPack on the same tensors): each
output's bits against the Triton kernel's and ms per call, over launch variants of GRAD_GEMM_GLUON. Without a GPU:
each variant and mode compiled for sm_90a, with its registers and spills (ptxas -v).

    python tools/gluon_grads.py [OUT.json]

A development tool.
"""
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ptxas_usage, gluon_logits

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from fce_core.config import GRAD_GEMM_GLUON
from fce_core.plan import PAIR, PAIR_LAST, WRITE, dx_slices, reads_c
from fce_torch.kernels import grad_gemms as tg
from fce_torch.kernels import grad_gemms_gluon as gg
from fce_torch.kernels.tma import shared_layout
from ptxas_usage import ptxas_usage

VARIANTS = [dataclasses.replace(GRAD_GEMM_GLUON, **kw) for kw in (
    {}, dict(tile_m=128, tile_n=256), dict(tile_k=64, num_stages=3))]
# K = a chunk's rows, H, V: the fused engine's chunks at (8192, 640, 262144), (16384, 2048, 128256),
# (8192, 896, 151936) and (16384, 4096, 128256); N = 256 (one chunk) and (4096, 4096, 128256)'s kept dZ (its GEMMs
# over all 4096 rows)
SHAPES = [(768, 640, 262144), (2048, 2048, 128256), (1280, 896, 151936), (1024, 4096, 128256),
          (256, 4096, 128256), (4096, 4096, 128256)]
# (name, A transposed (dW), epilogue mode, first chunk, C's dtype)
MODES = [("dx", False, WRITE, False, gl.bfloat16), ("dx planes", False, WRITE, False, gl.float32),
         ("dw", True, WRITE, False, gl.bfloat16), ("first", True, PAIR, True, gl.bfloat16),
         ("acc", True, PAIR, False, gl.bfloat16), ("last", True, PAIR_LAST, False, gl.bfloat16)]


def _name(cfg):
    return (f"gluon {cfg.tile_m}x{cfg.tile_n}x{cfg.tile_k} s{cfg.num_stages} e{cfg.epilogue_cols} "
            f"r{cfg.compute_regs}")


def _compile(cfg, a_t, mode, first, c_dt):
    """The kernel compiled for sm_90a (no GPU needed), as grad_gemms_gluon launches it."""
    hm = cfg.tile_m // gg.COMPUTE_WGS

    def desc(block, dt):
        name = {gl.bfloat16: "bf16", gl.float32: "fp32", gl.int8: "i8"}[dt]
        return f"tensordesc<{name}[{block[0]}, {block[1]}],{shared_layout(block, dt)!r}>"

    c = desc([hm, cfg.epilogue_cols], c_dt)
    sig = dict(a_desc=desc([cfg.tile_k, hm] if a_t else [hm, cfg.tile_k], gl.bfloat16),
               b_desc=desc([cfg.tile_k, cfg.tile_n], gl.bfloat16), hi_desc=c,
               lo_desc=c if mode == WRITE else desc([hm, cfg.epilogue_cols], gl.int8),
               M="i32", N="i32", K="i32", SLICE_K="i32", slices="i32", M_PLANE="i32")
    consts = dict(A_T=a_t, MODE=mode, READS_C=reads_c(mode, first), HM=hm, BN=cfg.tile_n, BK=cfg.tile_k,
                  STAGES=cfg.num_stages, EPI=cfg.epilogue_cols, ROWS_FAST=False, ASM=True,
                  COMPUTE_REGS=cfg.compute_regs, LOADER_REGS=cfg.loader_regs)
    for name in consts:
        sig[name] = "constexpr"
    return triton.compile(GluonASTSource(gg._grad_kernel.fn, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4))


def usage(cfg, mode_name):
    """(shared bytes, registers, spill store bytes, spill load bytes) of the kernel compiled for sm_90a, for the
    MODES entry `mode_name`."""
    compiled = _compile(cfg, *next(m[1:] for m in MODES if m[0] == mode_name))
    return (compiled.metadata.shared,) + ptxas_usage(compiled.asm["ptx"])


def compile_check():
    print(f"triton {triton.__version__} (sm_90a)")
    rows = []
    for cfg in VARIANTS:
        for mode in MODES:
            shared, regs, spill_st, spill_ld = usage(cfg, mode[0])
            rows.append(dict(variant=_name(cfg), mode=mode[0], shared=shared, regs=regs, spill_stores=spill_st,
                             spill_loads=spill_ld))
            print(f"{_name(cfg):<34} {mode[0]:<9} shared {shared:>7} regs {regs:>4} spills {spill_st}/{spill_ld}")
    return rows


def _chunk(k, h, v):
    g = torch.Generator(device="cuda").manual_seed(1)
    dz = (torch.randn(k, v, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    x = torch.randn(k, h, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    return dz, x, w


def _jax_accumulation(dz, x, pair):
    """ms of the JAX twin's Mosaic GPU accumulation (its default launch, the accumulator donated as in the
    engine) on the same tensors, and whether its pair equals fce_torch's."""
    import jax
    import numpy as np
    from fce_jax.kernels import grad_gemms as jg
    from gluon_logits import time_cuda

    dzj, xj = jax.dlpack.from_dlpack(dz), jax.dlpack.from_dlpack(x)
    step = jax.jit(lambda a, b, c: jg.dw_accumulate(a, b, c), donate_argnums=2)
    got = step(dzj, xj, tuple(jax.dlpack.from_dlpack(p.clone()) for p in pair))
    want = tg.dw_accumulate(dz, x, tuple(p.clone() for p in pair), cfg=tg._dw_config(x.shape[1]))
    same = all(np.array_equal(np.asarray(a).view(np.int8), b.cpu().view(torch.int8).numpy())
               for a, b in zip(got, want))
    state = [tuple(jax.dlpack.from_dlpack(p.clone()) for p in pair)]

    def call():
        state[0] = jax.block_until_ready(step(dzj, xj, state[0]))

    return time_cuda(call), same


def _calls(dz, x, w, pair, cfg):
    """Per MODES name (but "dx planes", which is dX's own where it has slices), a call of fce_torch's GEMM on the
    launch `cfg` returning its outputs: cfg a GradGemmConfig runs the Triton kernel, a SplitTileGradConfig the
    Gluon one."""
    out = torch.empty(dz.shape[0], w.shape[1], device="cuda", dtype=torch.bfloat16)
    held = [tuple(p.clone() for p in pair) for _ in range(2)]
    return {"dx": lambda: (tg.dx_gemm(dz, w, out, cfg=cfg),),
            "dw": lambda: (tg.dw_gemm(dz, x, torch.bfloat16, cfg=cfg),),
            "first": lambda: tg.dw_first(dz, x, torch.bfloat16, cfg=cfg),
            "acc": lambda: tg.dw_accumulate(dz, x, held[0], cfg=cfg),
            "last": lambda: (tg.dw_accumulate(dz, x, held[1], cfg=cfg, last=True),)}


def gpu_main(out_path=None):
    from gluon_logits import bits_equal, time_cuda

    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out_path:
            with open(out_path, "w") as f:
                json.dump(rows, f, indent=1)

    for k, h, v in SHAPES:
        dz, x, w = _chunk(k, h, v)
        slices = dx_slices(k, h, v)
        shape = dict(K=k, H=h, V=v, slices=slices)
        emit(dict(**shape, impl="cublas", dx_ms=time_cuda(lambda: torch.mm(dz, w)),
                  dw_ms=time_cuda(lambda: torch.mm(dz.t(), x))))
        pair = tg.dw_first(dz, x, torch.bfloat16, cfg=tg._dw_config(h))
        triton_calls = _calls(dz, x, w, pair, None)
        triton_calls["dx"] = (lambda out=torch.empty(k, h, device="cuda", dtype=torch.bfloat16):
                              (tg.dx_gemm(dz, w, out, cfg=tg._dx_config(k, h, slices, dz.device)),))
        for name, cfg in (("dw", tg._dw_config(h)), ("first", tg._dw_config(h)), ("acc", tg._dw_config(h)),
                          ("last", tg._dw_config(h))):
            triton_calls[name] = _calls(dz, x, w, pair, cfg)[name]
        want = {name: tuple(t.clone() for t in call()) for name, call in triton_calls.items()}
        for name in ("acc", "last"):  # each call accumulates into its own copy of the pair: from the pair again
            want[name] = _calls(dz, x, w, pair, tg._dw_config(h))[name]()
        triton_ms = {name: time_cuda(call) for name, call in triton_calls.items()}
        emit(dict(**shape, impl="triton (default launch)", **{f"{m}_ms": t for m, t in triton_ms.items()}))
        try:
            jax_ms, jax_same = _jax_accumulation(dz, x, pair)
            emit(dict(**shape, impl="jax mosaic (default)", acc_ms=jax_ms, bits_acc=jax_same))
        except Exception as exc:  # noqa: BLE001  (reported, the Gluon rows still run)
            emit(dict(**shape, impl="jax mosaic (default)", error=f"{type(exc).__name__}: {str(exc)[:400]}"))
        for cfg in VARIANTS:
            row = dict(**shape, impl=_name(cfg))
            for name in triton_calls:
                try:
                    got = _calls(dz, x, w, pair, cfg)[name]()
                    row[f"bits_{name}"] = all(bits_equal(a, b) for a, b in zip(got, want[name]))
                    row[f"{name}_ms"] = time_cuda(_calls(dz, x, w, pair, cfg)[name])
                    row[f"{name}_vs_triton"] = row[f"{name}_ms"] / triton_ms[name]
                except Exception as exc:  # noqa: BLE001  (a variant that fails is reported)
                    row[f"error_{name}"] = f"{type(exc).__name__}: {str(exc)[:600]}"
            emit(row)
    names = ["dx", "dw", "first", "acc", "last"]
    print("\n| K, H, V (slices) | launch | " + " | ".join(names) + " | bits |\n|---|---|" + "---|" * (len(names) + 1))
    for r in rows:
        bits = all(r[key] for key in r if key.startswith("bits_")) if any(key.startswith("bits_") for key in r) else ""
        cells = [f"{r[f'{m}_ms']:.3f}" if f"{m}_ms" in r else "" for m in names]
        errors = "; ".join(f"{key}: {r[key][:60]}" for key in r if key.startswith("error"))
        print(f"| {r['K']}, {r['H']}, {r['V']} ({r['slices']}) | {r['impl']} | {' | '.join(cells)} | {bits} "
              f"{errors} |")
    return rows


if __name__ == "__main__":
    if torch.cuda.is_available():
        gpu_main(sys.argv[1] if len(sys.argv) > 1 else None)
    else:
        compile_check()

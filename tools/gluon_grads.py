"""dW's (hi, lo) accumulation on fce_torch's Gluon kernel (fce_torch/kernels/grad_gemms_gluon.py) against its
Triton kernel (grad_gemms.py, the default launch), the JAX twin's Mosaic GPU kernel (GRAD_GEMM_MOSAIC, through
DLPack on the same tensors) and cuBLAS's dZᵀ x, per chunk: the bits of the first chunk's pair, of an
accumulation and of the last one's hi against the Triton kernel's, and ms per call, over launch variants of
GRAD_GEMM_GLUON. Without a GPU: each variant compiled for sm_90a, with its registers and spills (ptxas -v).

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
from fce_core.plan import PAIR, PAIR_LAST
from fce_torch.kernels import grad_gemms as tg
from fce_torch.kernels import grad_gemms_gluon as gg
from fce_torch.kernels.tma import shared_layout
from ptxas_usage import ptxas_usage

VARIANTS = [dataclasses.replace(GRAD_GEMM_GLUON, **kw) for kw in (
    {}, dict(tile_k=64, num_stages=3), dict(num_stages=5))]
# K = a chunk's rows, H, V: the fused engine's chunks at (8192, 640, 262144), (16384, 2048, 128256),
# (8192, 896, 151936) and (16384, 4096, 128256)
SHAPES = [(768, 640, 262144), (2048, 2048, 128256), (1280, 896, 151936), (1024, 4096, 128256)]
MODES = [("first", PAIR, True), ("acc", PAIR, False), ("last", PAIR_LAST, False)]


def _name(cfg):
    return (f"gluon {cfg.tile_m}x{cfg.tile_n}x{cfg.tile_k} s{cfg.num_stages} e{cfg.epilogue_cols} "
            f"r{cfg.compute_regs}")


def _compile(cfg, first, last):
    """The kernel compiled for sm_90a (no GPU needed), as `dw_pair` launches it."""
    hm = cfg.tile_m // gg.COMPUTE_WGS

    def desc(block, dt, name):
        return f"tensordesc<{name}[{block[0]}, {block[1]}],{shared_layout(block, dt)!r}>"

    sig = dict(a_desc=desc([cfg.tile_k, hm], gl.bfloat16, "bf16"),
               b_desc=desc([cfg.tile_k, cfg.tile_n], gl.bfloat16, "bf16"),
               hi_desc=desc([hm, cfg.epilogue_cols], gl.bfloat16, "bf16"),
               lo_desc=desc([hm, cfg.epilogue_cols], gl.int8, "i8"), M="i32", N="i32", K="i32")
    consts = dict(FIRST=first, LAST=last, HM=hm, BN=cfg.tile_n, BK=cfg.tile_k, STAGES=cfg.num_stages,
                  EPI=cfg.epilogue_cols, ROWS_FAST=False, ASM=True, COMPUTE_REGS=cfg.compute_regs,
                  LOADER_REGS=cfg.loader_regs)
    for name in consts:
        sig[name] = "constexpr"
    return triton.compile(GluonASTSource(gg._dw_pair_kernel.fn, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4))


def usage(cfg, first, last):
    """(shared bytes, registers, spill store bytes, spill load bytes) of the kernel compiled for sm_90a."""
    compiled = _compile(cfg, first, last)
    return (compiled.metadata.shared,) + ptxas_usage(compiled.asm["ptx"])


def compile_check():
    print(f"triton {triton.__version__} (sm_90a)")
    rows = []
    for cfg in VARIANTS:
        for mode, _, first in MODES:
            shared, regs, spill_st, spill_ld = usage(cfg, first, mode == "last")
            rows.append(dict(variant=_name(cfg), mode=mode, shared=shared, regs=regs, spill_stores=spill_st,
                             spill_loads=spill_ld))
            print(f"{_name(cfg):<34} {mode:<6} shared {shared:>7} regs {regs:>4} spills {spill_st}/{spill_ld}")
    return rows


def _chunk(k, h, v):
    g = torch.Generator(device="cuda").manual_seed(1)
    dz = (torch.randn(k, v, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    x = torch.randn(k, h, device="cuda", generator=g).to(torch.bfloat16)
    return dz, x


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
    want = tg.dw_accumulate(dz, x, tuple(p.clone() for p in pair))
    same = all(np.array_equal(np.asarray(a).view(np.int8), b.cpu().view(torch.int8).numpy())
               for a, b in zip(got, want))
    state = [tuple(jax.dlpack.from_dlpack(p.clone()) for p in pair)]

    def call():
        state[0] = jax.block_until_ready(step(dzj, xj, state[0]))

    return time_cuda(call), same


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
        dz, x = _chunk(k, h, v)
        shape = dict(K=k, H=h, V=v)
        emit(dict(**shape, impl="cublas dz.t() @ x", ms=time_cuda(lambda: torch.mm(dz.t(), x))))
        pair = tg.dw_first(dz, x, torch.bfloat16)
        want = {"first": pair, "acc": tg.dw_accumulate(dz, x, tuple(p.clone() for p in pair)),
                "last": (tg.dw_accumulate(dz, x, tuple(p.clone() for p in pair), last=True),)}
        triton_ms = {}
        for mode, code, first in MODES:
            held = tuple(p.clone() for p in pair)
            fn = ((lambda: tg.dw_first(dz, x, torch.bfloat16)) if first else
                  (lambda: tg.dw_accumulate(dz, x, held, last=code == PAIR_LAST)))
            triton_ms[mode] = time_cuda(fn)
        emit(dict(**shape, impl="triton (default)", **{f"{m}_ms": t for m, t in triton_ms.items()}))
        try:
            jax_ms, jax_same = _jax_accumulation(dz, x, pair)
            emit(dict(**shape, impl="jax mosaic (default)", acc_ms=jax_ms, bits_acc=jax_same))
        except Exception as exc:  # noqa: BLE001  (reported, the Gluon rows still run)
            emit(dict(**shape, impl="jax mosaic (default)", error=f"{type(exc).__name__}: {str(exc)[:400]}"))
        for cfg in VARIANTS:
            row = dict(**shape, impl=_name(cfg))
            try:
                for mode, code, first in MODES:
                    hi = torch.empty_like(pair[0]) if first else pair[0].clone()
                    lo = torch.empty_like(pair[1]) if first else pair[1].clone()
                    gg.dw_pair(dz, x, hi, lo, code, first, cfg)
                    got = (hi,) if code == PAIR_LAST else (hi, lo)
                    row[f"bits_{mode}"] = all(bits_equal(a, b) for a, b in zip(got, want[mode]))
                    row[f"{mode}_ms"] = time_cuda(lambda: gg.dw_pair(dz, x, hi, lo, code, first, cfg))
                    row[f"{mode}_vs_triton"] = row[f"{mode}_ms"] / triton_ms[mode]
            except Exception as exc:  # noqa: BLE001  (a variant that fails is reported)
                row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
            emit(row)
    print("\n| K, H, V | launch | first | acc | last | bits |\n|---|---|---|---|---|---|")
    for r in rows:
        bits = all(r[key] for key in r if key.startswith("bits_")) if any(key.startswith("bits_") for key in r) else ""
        cells = [f"{r[f'{m}_ms']:.3f}" if f"{m}_ms" in r else "" for m, _, _ in MODES]
        if "ms" in r:
            cells[0] = f"{r['ms']:.3f} (dW)"
        verdict = bits or r.get("error", "")[:60]
        print(f"| {r['K']}, {r['H']}, {r['V']} | {r['impl']} | {' | '.join(cells)} | {verdict} |")
    return rows


if __name__ == "__main__":
    if torch.cuda.is_available():
        gpu_main(sys.argv[1] if len(sys.argv) > 1 else None)
    else:
        compile_check()

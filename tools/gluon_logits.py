"""The logits GEMM's ping-pong kernel (fce_torch/kernels/logit_tiles_gluon.py) against the Triton kernel
(logit_tiles.py, GEMM) and cuBLAS, per chunk: bits of e and of every partial, and times, over launch variants
of LOGITS_PINGPONG and over the epilogue's options (the loss's; smoothing's and entropy's q and pz; class
weights; no e stored). Without a GPU: each variant and option set compiled for sm_90a, with its registers and
spills (ptxas -v). The kernel takes raw logits only (`logit_tiles_gluon.applies`): a bias, a temperature and a
softcap were measured on it before they were left to the Triton kernel (bench/results/nvidia-h100/
logits-pingpong/).

    python tools/gluon_logits.py [OUT.json]

A development tool.
"""
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ptxas_usage

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from fce_core.config import GEMM, LOGITS_PINGPONG
from fce_core.heads import StatsSpec
from fce_core.options import Transform
from fce_core.plan import cdiv
from fce_torch.kernels import logit_tiles_gluon as lg
from fce_torch.kernels.logit_tiles import logit_tiles, partials
from fce_torch.kernels.tma import processors, shared_layout
from ptxas_usage import ptxas_usage

VARIANTS = [dataclasses.replace(LOGITS_PINGPONG, **kw) for kw in (
    {}, dict(e_buffers=2), dict(parts=4), dict(parts=8), dict(parts=8, e_buffers=2), dict(num_stages=3, e_buffers=2))]
OPTION_VARIANTS = [LOGITS_PINGPONG, dataclasses.replace(LOGITS_PINGPONG, parts_q_pz=2)]
# (name, StatsSpec, class weights, store)
OPTIONS = [("loss", StatsSpec(), False, True), ("q pz", StatsSpec(q=True, pz=True), False, True),
           ("q cw", StatsSpec(q=True), True, True), ("no store", StatsSpec(), False, False)]


def _name(cfg):
    return (f"pp {cfg.tile_m}x{GEMM.tile_n}x{cfg.tile_k} s{cfg.num_stages} p{cfg.parts}/{cfg.parts_q_pz} "
            f"e{cfg.e_buffers} r{cfg.compute_regs}")


def _compile(cfg, spec, cw, store):
    """The kernel compiled for sm_90a (no GPU needed), as `logit_tiles_pp` launches it for bfloat16."""
    desc = lambda b: f"tensordesc<bf16[{b[0]}, {b[1]}],{shared_layout(b, gl.bfloat16)!r}>"  # noqa: E731
    bn = GEMM.tile_n
    parts = cfg.parts_q_pz if spec.q or spec.pz else cfg.parts
    sig = dict(x_desc=desc([cfg.tile_m, cfg.tile_k]), w_desc=desc([bn, cfg.tile_k]),
               e_desc=desc([cfg.tile_m, bn // parts]), y_ptr="*i64", cw_ptr="*fp32", m_ptr="*fp32",
               s_ptr="*fp32", arg_ptr="*i32", zy_ptr="*fp32", q_ptr="*fp32", pz_ptr="*fp32", n_rows="i32", V="i32",
               H="i32")
    consts = dict(HAS_CW=cw, HAS_Q=spec.q, HAS_PZ=spec.pz, STORE=store, BM=cfg.tile_m, BN=bn, BK=cfg.tile_k,
                  STAGES=cfg.num_stages, PARTS=parts, E_BUFS=cfg.e_buffers, ASM=True,
                  COMPUTE_REGS=cfg.compute_regs, LOADER_REGS=cfg.loader_regs, LOADER_WARPS=cfg.loader_warps)
    for name in consts:
        sig[name] = "constexpr"
    return triton.compile(GluonASTSource(lg._logit_tiles_pp_kernel.fn, sig, consts, {}),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def usage(cfg, *option):
    """(shared bytes, registers, spill store bytes, spill load bytes) of the kernel compiled for sm_90a."""
    compiled = _compile(cfg, *option)
    return (compiled.metadata.shared,) + ptxas_usage(compiled.asm["ptx"])


def compile_check():
    """Every variant with the loss's options, and OPTION_VARIANTS with every other option set, for sm_90a."""
    print(f"triton {triton.__version__} (sm_90a)")
    rows = []
    for cfg, option in [(c, OPTIONS[0]) for c in VARIANTS] + [(c, o) for o in OPTIONS[1:] for c in OPTION_VARIANTS]:
        shared, regs, spill_st, spill_ld = usage(cfg, *option[1:])
        rows.append(dict(variant=_name(cfg), options=option[0], shared=shared, regs=regs, spill_stores=spill_st,
                         spill_loads=spill_ld))
        print(f"{_name(cfg):<30} {option[0]:<16} shared {shared:>7} regs {regs:>4} spills {spill_st}/{spill_ld}")
    return rows


# ------------------------------------------------------------------------------------------------ GPU run

# (a chunk's rows, H, V): the fused engine's chunks at (16384, 2048, 128256), (8192, 640, 262144),
# (8192, 896, 151936), (4096, 4096, 128256) and (256, 4096, 128256)
SHAPES = [(2048, 2048, 128256), (768, 640, 262144), (1280, 896, 151936), (1024, 4096, 128256), (256, 4096, 128256)]


def bits_equal(a, b):
    view = {torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(a.dtype, a.dtype)
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(view), b.view(view)))


def time_cuda(fn, reps=20, rounds=3):
    """ms per call: the best of `rounds` rounds of `reps` calls back to back (CUDA events around each round)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def chunk_inputs(n, h, v):
    """A chunk's seeded bfloat16 x [n, h] and w [v, h] on the GPU, its targets y (every 7th row ignored and one
    past V: both read as 0 by every kernel) and class weights [v]."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[::7] = -100
    y[3 % n] = v + 5
    return x, w, y, torch.rand(v, device="cuda", generator=g)


def emitter(rows, n, h, v):
    """emit(row): the row with the chunk's shape and its TFLOP/s added to `rows`, and printed as JSON."""
    def emit(row):
        row = dict(N=n, H=h, V=v, **row)
        if row.get("ms"):
            row["tflops"] = 2 * n * h * v / row["ms"] / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)

    return emit


def _pp(x, w, y, cw, spec, store, cfg):
    """`logit_tiles` through the ping-pong kernel with launch `cfg` (its partials allocated as logit_tiles does)."""
    e = x.new_empty((x.shape[0], w.shape[0])) if store else None
    parts = partials(x, cdiv(w.shape[0], GEMM.tile_n), spec)
    lg.logit_tiles_pp(x, w, y, cw, e, parts, spec=spec, tile_n=GEMM.tile_n, cfg=cfg)
    return e, parts


def gpu_main(out_path=None, variants=VARIANTS, shapes=SHAPES):
    """At each shape: the loss's options on every variant, and every other option set on OPTION_VARIANTS: e and
    each partial against the Triton kernel's (`logit_tiles` with cfg=GEMM) bit for bit, and times against it and
    against cuBLAS's GEMM (float32 and bfloat16 out)."""
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"{processors(torch.device('cuda'))} SMs", flush=True)
    rows = []
    for n, h, v in shapes:
        x, w, y, cw = chunk_inputs(n, h, v)
        emit = emitter(rows, n, h, v)
        emit(dict(impl="cublas f32 out", ms=time_cuda(lambda: torch.mm(x, w.t(), out_dtype=torch.float32))))
        emit(dict(impl="cublas bf16 out", ms=time_cuda(lambda: torch.mm(x, w.t()))))
        for name, spec, has_cw, store in OPTIONS:
            args = (x, w, y, cw if has_cw else None)
            run = lambda: logit_tiles(x, w, None, y, args[3], spec=spec, transform=Transform(),  # noqa: E731
                                      precision="ieee", store=store, cfg=GEMM)
            e_ref, p_ref = run()
            emit(dict(impl="logit_tiles (triton, GEMM)", options=name, ms=time_cuda(run)))
            for cfg in variants if name == "loss" else OPTION_VARIANTS:
                print(f"  ({n}x{h}x{v}: checking {_name(cfg)}, {name})", file=sys.stderr, flush=True)
                row = dict(impl=_name(cfg), options=name)
                try:
                    e, parts = _pp(*args, spec, store, cfg)
                    torch.cuda.synchronize()
                    row["bits"] = {k: bits_equal(parts[k], p_ref[k]) for k in p_ref}
                    if store:
                        row["bits"]["e"] = bits_equal(e, e_ref)
                    del e, parts
                    row["ms"] = time_cuda(lambda cfg=cfg: _pp(*args, spec, store, cfg))
                except Exception as exc:  # noqa: BLE001 - one variant's failure should not hide the others
                    row["error"] = f"{type(exc).__name__}: {exc}"[:1000]
                emit(row)
            del e_ref, p_ref
        del x, w, y, cw
        torch.cuda.empty_cache()
    return report(rows, out_path)


def report(rows, out_path=None):
    """The rows as a table on stdout (bits: "all" where every output matched) and, given a path, as JSON."""
    print(f"\n N, H, V               {'impl':<33} {'options':<9}      ms  TFLOP/s  bits")
    for r in rows:
        bits = "" if "bits" not in r else ("all" if all(r["bits"].values()) else r["bits"])
        ms = f"{r['ms']:8.3f}" if r.get("ms") else "       -"
        tf = f"{r['tflops']:6.0f}" if r.get("tflops") else "     -"
        print(f"{r['N']:5d},{r['H']:5d},{r['V']:7d}  {r['impl']:<33} {r.get('options', ''):<9} {ms} {tf}  {bits} "
              f"{r.get('error', '')[:300]}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {out_path}")
    return rows


if __name__ == "__main__":
    if torch.cuda.is_available():
        gpu_main(sys.argv[1] if len(sys.argv) > 1 else None)
    else:
        compile_check()

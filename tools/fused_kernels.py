"""The fused engine's kernels on the GPU, one call: every GemmConfig variant of the logits GEMM with its
statistics epilogue in both twins (time, TFLOP/s, the twins' bits of the tile values and partials; with
--mosaic-logits the JAX twin's Mosaic GPU kernel, GEMM_MOSAIC, against fce_torch's default), against
cuBLAS / XLA's plain logits GEMM; then the dX and dW GEMMs and the (hi, lo) accumulation, in each twin's
launch variants (fce_torch's Triton, the JAX twin's Mosaic GPU and Triton), every one's bits against fce_torch's
default; and with --on-load a chunk's backward with dZ formed on the GEMMs' operand load against the dZ pass
(`on_load_rows`; the JAX twin's pass also on Mosaic GPU, DzPassConfig.mosaic, its bits against fce_torch's).
The logits variants (TMA loads, persistent programs) are fce_torch's; the JAX twin runs its one kernel for
each. A development tool: its table guides GemmConfig and GradGemmConfig.

Usage (GPU): python tools/fused_kernels.py OUT_DIR [--grads | --logits] [--variants I,J,...]
[--grad-variants I,J,...] [--jax-grad-variants I,J,...] [--on-load] [--mosaic-logits] [N,H,V ...]
(--grads: the gradient GEMMs only; --logits: the logits GEMM only; --variants, --grad-variants,
--jax-grad-variants: only those VARIANTS, GRAD_VARIANTS, JAX_GRAD_VARIANTS, by index, none for an empty list;
--on-load: also the chunk's backward with dZ formed on the GEMMs' load, `on_load_rows`; --mosaic-logits: also the
JAX twin's Mosaic GPU logits GEMM, which did not return on the H200 (tools/mosaic_probe.py runs it under a
limit); every row is printed with its seconds since the start and saved as it comes)
"""
import dataclasses
import json
import os
import sys
import time

import numpy as np
import torch

import jax
import jax.numpy as jnp

from fce_core.config import GEMM, GEMM_MOSAIC, GRAD_GEMM, GRAD_GEMM_MOSAIC, GRAD_GEMM_TORCH
from fce_core.heads import StatsSpec
from fce_core.options import Transform
from fce_core.plan import fused_rows
from fce_jax.kernels import grad_gemms as jg
from fce_jax.kernels import logit_tiles as jt
from fce_torch.kernels import grad_gemms as tg
from fce_torch.kernels import logit_tiles as tt

# fce_torch's pointer-load kernels, one program per tile; the JAX twin's on the Triton lowering
LAUNCH = dict(tma=False, persistent=False, programs_per_sm=1, pingpong_max_hidden=0)
VARIANTS = [dataclasses.replace(GEMM, **{**LAUNCH, **kw}) for kw in (
    dict(tma=True, persistent=True), dict(tma=True), {}, dict(tma=True, persistent=True, num_stages=4),
    # the next tile's loads under this one's epilogue (spill-free since the row sums stay in registers)
    dict(tma=True, persistent=True, flatten=True), dict(tma=True, persistent=True, flatten=True, num_stages=4),
    dict(tma=True, num_stages=4), dict(num_stages=4),
    # two programs per multiprocessor (registers and shared memory for both): one's epilogue beside the other's MMAs
    dict(tma=True, tile_m=64, num_warps=4, num_stages=2), dict(tma=True, persistent=True, programs_per_sm=2,
                                                               tile_m=64, num_warps=4, num_stages=2),
    dict(tma=True, tile_m=64, num_warps=4, num_stages=3), dict(tma=True, tile_n=128, num_warps=4),
    dict(tma=True, persistent=True, programs_per_sm=2, tile_n=128, num_warps=4),
    dict(tma=True, tile_n=128, num_warps=8))]
GRAD_VARIANTS = [dataclasses.replace(GRAD_GEMM_TORCH, **kw) for kw in (  # fce_torch's Triton launches
    {}, dict(flatten=False), dict(tile_m=256, tile_n=128), dict(tile_m=256, tile_n=128, flatten=False))]
# the JAX twin's launches: the Triton lowering (its float32 one) and Mosaic GPU's (its default, 128x256, and the
# two compute warpgroups in turns on 128x128 tiles where K is not sliced, off a ring of up to 5 stages)
JAX_GRAD_VARIANTS = [GRAD_GEMM, GRAD_GEMM_MOSAIC, dataclasses.replace(GRAD_GEMM_MOSAIC, tile_m=128, tile_n=256),
                     dataclasses.replace(GRAD_GEMM_MOSAIC, pingpong=True, num_stages=5)]


def _tag(cfg):
    return (f"{cfg.tile_m}x{cfg.tile_n}x{cfg.tile_k} w{cfg.num_warps} s{cfg.num_stages}"
            + " tma" * cfg.tma + " persistent" * cfg.persistent + " flatten" * cfg.flatten
            + f" {cfg.programs_per_sm}/sm" * (cfg.persistent and cfg.programs_per_sm > 1)
            + " mosaic" * getattr(cfg, "mosaic", False) + " pingpong" * getattr(cfg, "pingpong", False))


def grad_rows(n, h, v, rows, out_dir, t0, torch_variants=GRAD_VARIANTS, jax_variants=JAX_GRAD_VARIANTS):
    """dX, dW and the (hi, lo) accumulation of a second chunk (of the fused engine's plan for bfloat16 at
    (n, h, v)) with each launch variant of either twin, appended to `rows` (saved as each comes); every variant's
    bits against fce_torch's default."""
    m = min(n, fused_rows(n, h, v, 2, need_grads=True, dw_pair=True).rows)
    g = torch.Generator(device="cuda").manual_seed(1)
    dz = (torch.randn(m, v, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
    x = torch.randn(m, h, device="cuda", generator=g).to(torch.bfloat16)
    dzj, wj, xj = (jax.dlpack.from_dlpack(t) for t in (dz, w, x))
    flop = 2 * m * h * v
    rows.append(dict(shape=(m, h, v), impl="cublas dx / dw",
                     ms=best_ms(lambda: torch.mm(dz, w)), ms_dw=best_ms(lambda: torch.mm(dz.t(), x))))
    out = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)
    pair = tg.dw_first(dz, x, torch.bfloat16)
    ref = dict(dx=_bits(tg.dx_gemm(dz, w, out)), dw=_bits(tg.dw_gemm(dz, x, torch.bfloat16)),
               pair=[_bits(p) for p in tg.dw_accumulate(dz, x, tuple(p.clone() for p in pair))])
    for twin, variants in (("torch", torch_variants), ("jax", jax_variants)):
        for cfg in variants:
            row = dict(shape=(m, h, v), twin=twin, cfg=f"grad {_tag(cfg)}")
            try:
                if twin == "torch":
                    fdx = lambda: tg.dx_gemm(dz, w, out, cfg=cfg)  # noqa: E731
                    fdw = lambda: tg.dw_gemm(dz, x, torch.bfloat16, cfg=cfg)  # noqa: E731
                    timed = tuple(p.clone() for p in pair)  # the timing's own accumulator: `pair` stays as it is
                    facc = lambda: tg.dw_accumulate(dz, x, timed, cfg=cfg)  # noqa: E731
                    got = dict(dx=fdx(), dw=fdw(), pair=tg.dw_accumulate(dz, x, tuple(p.clone() for p in pair),
                                                                         cfg=cfg))
                else:
                    jdx = jax.jit(lambda a, b: jg.dx_gemm(a, b, jnp.bfloat16, cfg=cfg))
                    jdw = jax.jit(lambda a, b: jg.dw_gemm(a, b, jnp.bfloat16, cfg=cfg))
                    # the accumulator donated, as it is dead in the engine: updated in place, no copy
                    jacc = jax.jit(lambda a, b, c: jg.dw_accumulate(a, b, c, cfg=cfg), donate_argnums=2)
                    fdx = lambda: jdx(dzj, wj).block_until_ready()  # noqa: E731
                    fdw = lambda: jdw(dzj, xj).block_until_ready()  # noqa: E731
                    state = [tuple(jax.dlpack.from_dlpack(p.clone()) for p in pair)]

                    def facc():
                        state[0] = jax.block_until_ready(jacc(dzj, xj, state[0]))

                    got = dict(dx=fdx(), dw=fdw(),
                               pair=jacc(dzj, xj, tuple(jax.dlpack.from_dlpack(p.clone()) for p in pair)))
                row.update(dx_ms=best_ms(fdx), dw_ms=best_ms(fdw), acc_ms=best_ms(facc))
                row["bits"] = {"dx": bool(np.array_equal(_bits(got["dx"]), ref["dx"])),
                               "dw": bool(np.array_equal(_bits(got["dw"]), ref["dw"])),
                               "pair": all(np.array_equal(_bits(a), b) for a, b in zip(got["pair"], ref["pair"]))}
                row["tflops_dx"], row["tflops_dw"] = flop / row["dx_ms"] / 1e9, flop / row["dw_ms"] / 1e9
            except Exception as exc:  # noqa: BLE001  (a variant that does not compile is reported)
                row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
            _emit(out_dir, rows, row, t0)


def on_load_rows(n, h, v):
    """One chunk's backward with dZ formed on the GEMMs' operand load (`TileValues`, GradGemmConfig.dz_on_load)
    against the dZ pass (`tile_dlogits`) and the GEMMs over its dZ: each kernel's time and the chunk's total,
    fce_torch on its launches (GRAD_GEMM_TORCH_ON_LOAD, and the flattened / 256x128 ones, which spill), the
    JAX twin on the Triton lowering (the one that forms dZ on load) against its default; bits against the dZ
    path. The tile values and maxima are the logits GEMM's, of the fused plan's chunk at (n, h, v)."""
    from fce_core.config import DZ_PASS, GRAD_GEMM_TORCH_ON_LOAD, GRAD_GEMM_TORCH_TALL
    from fce_jax.kernels.tile_dlogits import tile_dlogits as jax_tile_dlogits
    from fce_torch.kernels.tile_dlogits import tile_dlogits

    m = min(n, fused_rows(n, h, v, 2, need_grads=True, dw_pair=True).rows)
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(m, h, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
    y = torch.randint(0, v, (m,), device="cuda", generator=g)
    e, parts = tt.logit_tiles(x, w, None, y, None, spec=StatsSpec(), transform=Transform(), precision="ieee")
    stats = tt.merge_tiles(parts, v)
    lse = stats["m"] + torch.log(stats["s"])
    coef = {"lse": lse, "a": torch.full_like(lse, 1 / m), "b": torch.full_like(lse, -1 / m),
            "c": torch.full_like(lse, 1e-5)}
    pair = tg.dw_first(e, x, torch.bfloat16)
    dz = e.clone()
    tile_dlogits(dz, parts["m"], y, stats["zy"], None, coef, transform=Transform())
    out = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)
    ref = [_bits(tg.dx_gemm(dz, w, out).clone()),
           *[_bits(p) for p in tg.dw_accumulate(dz, x, tuple(p.clone() for p in pair))]]
    tv = tg.TileValues(e, parts["m"], y, coef, tt.gemm_config().tile_n)
    scratch = e.clone()
    rows = [dict(shape=(m, h, v), twin="torch", cfg="on load: dZ pass", ms=best_ms(
        lambda: tile_dlogits(scratch, parts["m"], y, stats["zy"], None, coef, transform=Transform())))]
    timed = tuple(p.clone() for p in pair)
    rows.append(dict(shape=(m, h, v), twin="torch", cfg="on load: GEMMs over dZ (default launches)",
                     dx_ms=best_ms(lambda: tg.dx_gemm(dz, w, out)),
                     acc_ms=best_ms(lambda: tg.dw_accumulate(dz, x, timed))))
    for cfg in (GRAD_GEMM_TORCH_ON_LOAD, GRAD_GEMM_TORCH, GRAD_GEMM_TORCH_TALL):
        row = dict(shape=(m, h, v), twin="torch", cfg=f"on load: GEMMs forming dZ, {_tag(cfg)}")
        try:
            got = [_bits(tg.dx_gemm(tv, w, out, cfg=cfg).clone()),
                   *[_bits(p) for p in tg.dw_accumulate(tv, x, tuple(p.clone() for p in pair), cfg=cfg)]]
            row.update(dx_ms=best_ms(lambda: tg.dx_gemm(tv, w, out, cfg=cfg)),
                       acc_ms=best_ms(lambda: tg.dw_accumulate(tv, x, timed, cfg=cfg)),
                       bits=all(np.array_equal(a, b) for a, b in zip(got, ref)))
        except Exception as exc:  # noqa: BLE001  (a variant that does not compile is reported)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        rows.append(row)
    ej, mj, yj, dzj, wj, xj = (jax.dlpack.from_dlpack(t) for t in (e, parts["m"], y.to(torch.int32), dz, w, x))
    cj = {k: jax.dlpack.from_dlpack(c) for k, c in coef.items()}
    zyj = jax.dlpack.from_dlpack(stats["zy"])
    jpass = jax.jit(lambda a: jax_tile_dlogits(a, mj, yj, zyj, None, cj, transform=Transform()))
    rows.append(dict(shape=(m, h, v), twin="jax", cfg="on load: dZ pass",
                     ms=best_ms(lambda: jpass(ej).block_until_ready())))
    mosaic = dataclasses.replace(DZ_PASS, mosaic=True)  # port plan step 2: its bits against fce_torch's pass
    jpass_m = jax.jit(lambda a: jax_tile_dlogits(a, mj, yj, zyj, None, cj, transform=Transform(), dz_cfg=mosaic))
    rows.append(dict(shape=(m, h, v), twin="jax", cfg="on load: dZ pass (Mosaic GPU)",
                     ms=best_ms(lambda: jpass_m(ej).block_until_ready()),
                     bits=bool(np.array_equal(_bits(jpass_m(ej)), _bits(dz)))))
    # the operand's arrays go in as arguments (a jitted closure would hold them as constants), its form built inside
    for label, arrays, operand in (("GEMMs over dZ (default launches)", (dzj,), lambda a: a),
                                   ("GEMMs forming dZ (Triton lowering)", (ej, mj, yj, cj),
                                    lambda *a: jg.TileValues(*a, tt.gemm_config().tile_n))):
        row = dict(shape=(m, h, v), twin="jax", cfg=f"on load: {label}")
        try:
            jdx = jax.jit(lambda a, b, form=operand: jg.dx_gemm(form(*a), b, jnp.bfloat16))
            jacc = jax.jit(lambda a, b, c, form=operand: jg.dw_accumulate(form(*a), b, c), donate_argnums=2)
            state = [tuple(jax.dlpack.from_dlpack(p.clone()) for p in pair)]

            def facc(a=arrays, j=jacc):
                state[0] = jax.block_until_ready(j(a, xj, state[0]))

            got = [_bits(jdx(arrays, wj)), *[_bits(p) for p in jacc(arrays, xj, tuple(
                jax.dlpack.from_dlpack(p.clone()) for p in pair))]]
            row.update(dx_ms=best_ms(lambda: jdx(arrays, wj).block_until_ready()), acc_ms=best_ms(facc),
                       bits=all(np.array_equal(a, b) for a, b in zip(got, ref)))
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        rows.append(row)
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def _guarded(rows_of, n, h, v):
    """rows_of(n, h, v), or one row with its error: the rows before it stay."""
    try:
        return rows_of(n, h, v)
    except Exception as exc:  # noqa: BLE001
        return [dict(shape=(n, h, v), cfg=rows_of.__name__, error=f"{type(exc).__name__}: {str(exc)[:600]}")]


def _mosaic_logits_row(x, w, y, xj, wj, yj, flop, spec, temperature=1.0, bias=None, cw=None):
    """The JAX twin's logits GEMM on Mosaic GPU (GEMM_MOSAIC) against fce_torch's default (GEMM) for the head's
    partials `spec`, a temperature, a bias and class weights `cw`: both times, and the bits of the tile values
    and partials."""
    kw = dict(spec=spec, transform=Transform(temperature=temperature))
    extra = "".join(f" +{k}" for k in ("q", "pz") if getattr(spec, k)) + f" T={temperature}" * (temperature != 1.0)
    extra += " +bias" * (bias is not None) + " +class weights" * (cw is not None)
    row = dict(shape=tuple(x.shape) + (w.shape[0],), cfg=f"jax {_tag(GEMM_MOSAIC)}{extra} vs torch default")
    bj, cj = (None if a is None else jax.dlpack.from_dlpack(a) for a in (bias, cw))
    try:
        run_t = lambda: tt.logit_tiles(x, w, bias, y, cw, precision="ieee", cfg=GEMM, **kw)  # noqa: E731
        row["torch_ms"] = best_ms(run_t)
        # compiled apart from its first run, and said so at once: a call that never returns (the first on the
        # H200 did not within 129 s, bench/results/nvidia-h200/op-after-shuffles/) then shows which step hung
        t = time.perf_counter()
        print(f"  {row['cfg']}: compiling", flush=True)
        fj = jax.jit(lambda a, b, c: jt.logit_tiles(a, b, bj, c, cj, precision=None, cfg=GEMM_MOSAIC, **kw)).lower(
            xj, wj, yj).compile()
        row["jax_compile_s"] = time.perf_counter() - t
        print(f"  compiled in {row['jax_compile_s']:.1f} s, running", flush=True)
        jax.block_until_ready(fj(xj, wj, yj))
        print("  ran", flush=True)
        row["jax_ms"] = best_ms(lambda: jax.block_until_ready(fj(xj, wj, yj)))
        (e_t, p_t), (e_j, p_j) = run_t(), fj(xj, wj, yj)
        row["tflops_torch"], row["tflops_jax"] = flop / row["torch_ms"] / 1e9, flop / row["jax_ms"] / 1e9
        row["bits_e"] = bool(np.array_equal(_bits(e_t), _bits(e_j)))
        row["bits_parts"] = _same_parts(p_t, p_j)
    except Exception as exc:  # noqa: BLE001  (reported in its row, as a kernel that does not compile)
        row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
    return row


def best_ms(fn, reps=10, rounds=3):
    """ms per call: the best of `rounds` rounds of `reps` calls back to back (one call with a synchronization
    each had varied by 15% between identical kernels)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e3


def _same_parts(p_t, p_j):
    """Per partial of the logits GEMM: whether fce_torch's and the JAX twin's are bit for bit equal."""
    return {k: bool(np.array_equal(_bits(p_t[k]) if k != "amax" else p_t[k].cpu().numpy(),
                                   _bits(p_j[k]) if k != "amax" else np.asarray(p_j[k]))) for k in p_t}


def _bits(a):
    a = np.asarray(a.detach().cpu().float() if isinstance(a, torch.Tensor) else np.asarray(a, np.float32))
    return a.view(np.uint32)


def _save(out_dir, rows):
    with open(f"{out_dir}/fused_kernels.json", "w") as f:
        json.dump(rows, f, indent=1)


def _emit(out_dir, rows, row, t0):
    rows.append(row)
    _save(out_dir, rows)
    print(f"{time.perf_counter() - t0:7.1f} s", json.dumps(row), flush=True)


def main():
    args = sys.argv[1:]
    grads_only, logits_only = "--grads" in args, "--logits" in args
    if grads_only and logits_only:
        sys.exit("fused_kernels.py: --grads and --logits exclude each other (neither: both kinds of kernel)")
    picked = {}
    for option, variants in (("--variants", VARIANTS), ("--grad-variants", GRAD_VARIANTS),
                             ("--jax-grad-variants", JAX_GRAD_VARIANTS)):
        if option in args:
            at = args.index(option)
            picked[option] = [variants[int(i)] for i in args[at + 1].split(",") if i != "none"]
            del args[at:at + 2]
    on_load, mosaic_logits = "--on-load" in args, "--mosaic-logits" in args
    out_dir, *shapes = [a for a in args if a not in ("--grads", "--logits", "--on-load", "--mosaic-logits")]
    os.makedirs(out_dir, exist_ok=True)
    shapes = [tuple(int(v) for v in s.split(",")) for s in shapes] or [
        (4096, 4096, 128256), (256, 4096, 128256), (8192, 640, 262144)]
    rows, t0 = [], time.perf_counter()

    def backward_rows(n, h, v):
        grad_rows(n, h, v, rows, out_dir, t0, picked.get("--grad-variants", GRAD_VARIANTS),
                  picked.get("--jax-grad-variants", JAX_GRAD_VARIANTS))
        rows.extend(_guarded(on_load_rows, n, h, v) if on_load else [])
        _save(out_dir, rows)  # a call stopped at its time limit keeps the shapes done

    for n, h, v in shapes:
        if grads_only:
            backward_rows(n, h, v)
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
        y = torch.randint(0, v, (n,), device="cuda", generator=g)
        xj, wj, yj = (jax.dlpack.from_dlpack(t) for t in (x, w, y.to(torch.int32)))
        flop = 2 * n * h * v
        jax_runs = {}
        ms = best_ms(lambda: torch.mm(x, w.t(), out_dtype=torch.float32))
        _emit(out_dir, rows, dict(shape=(n, h, v), impl="cublas_f32_out", ms=ms, tflops=flop / ms / 1e9), t0)
        xla = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                       preferred_element_type=jnp.float32))
        ms = best_ms(lambda: xla(xj, wj).block_until_ready())
        _emit(out_dir, rows, dict(shape=(n, h, v), impl="xla_f32_out", ms=ms, tflops=flop / ms / 1e9), t0)
        for cfg in picked.get("--variants", VARIANTS):
            tag = _tag(cfg)
            kw = dict(spec=StatsSpec(), transform=Transform(), cfg=cfg)
            row = dict(shape=(n, h, v), cfg=tag)
            try:
                run_t = lambda: tt.logit_tiles(x, w, None, y, None, precision="ieee", **kw)  # noqa: E731
                row["torch_ms"] = best_ms(run_t)
                e_t, p_t = run_t()
                base = dataclasses.replace(cfg, **LAUNCH)
                if base not in jax_runs:
                    kw_j = dict(kw, cfg=base)
                    fj = jax.jit(lambda a, b, c: jt.logit_tiles(a, b, None, c, None, precision=None, **kw_j))
                    jax_runs[base] = (best_ms(lambda: jax.block_until_ready(fj(xj, wj, yj))), fj(xj, wj, yj))
                row["jax_ms"], (e_j, p_j) = jax_runs[base]
                row["tflops_torch"] = flop / row["torch_ms"] / 1e9
                row["tflops_jax"] = flop / row["jax_ms"] / 1e9
                row["bits_e"] = bool(np.array_equal(_bits(e_t), _bits(e_j)))
                row["bits_parts"] = _same_parts(p_t, p_j)
            except Exception as exc:  # noqa: BLE001  (a variant that does not compile is reported)
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            _emit(out_dir, rows, row, t0)
        bias = torch.randn(v, device="cuda", generator=g).to(torch.bfloat16)
        cw = torch.rand(v, device="cuda", generator=g)
        # the loss's partials; smoothing's and entropy's; those past a bias and a temperature (RL's log-probs),
        # and with class weights
        for spec, extra in ((StatsSpec(), {}), (StatsSpec(q=True, pz=True), {}),
                            (StatsSpec(q=True, pz=True), dict(temperature=0.7, bias=bias)),
                            (StatsSpec(q=True), dict(cw=cw))) if mosaic_logits else ():
            _emit(out_dir, rows, _mosaic_logits_row(x, w, y, xj, wj, yj, flop, spec, **extra), t0)
        if not logits_only:
            backward_rows(n, h, v)
        _save(out_dir, rows)
    print("\n| N,H,V | variant | torch ms | jax ms | torch TF/s | jax TF/s | bits e | bits parts |")
    for r in rows:
        if "impl" in r and "ms_dw" in r:
            print(f"| {r['shape']} | {r['impl']} | {r['ms']:.3f} / {r['ms_dw']:.3f} | | | | | |")
        elif r.get("cfg", "").startswith("on load") and "error" not in r:
            times = " ".join(f"{k[:-3]} {r[k]:.3f}" for k in ("ms", "dx_ms", "acc_ms") if k in r)
            print(f"| {r['shape']} | {r['twin']} {r['cfg']} | {times} | | | | | {r.get('bits', '')} |")
        elif r.get("cfg", "").startswith("grad") and "error" not in r:
            print(f"| {r['shape']} | {r['twin']} {r['cfg']} | dx {r['dx_ms']:.3f} dw {r['dw_ms']:.3f} acc "
                  f"{r['acc_ms']:.3f} | | {r['tflops_dx']:.0f} / {r['tflops_dw']:.0f} | | {r['bits']} |")
        elif "cfg" not in r:
            print(f"| {r['shape']} | {r['impl']} | {r['ms']:.3f} | | {r['tflops']:.0f} | | | |")
        elif "error" in r:
            print(f"| {r['shape']} | {r['cfg']} | error: {r['error'][:120]} |")
        else:
            print(f"| {r['shape']} | {r['cfg']} | {r['torch_ms']:.3f} | {r['jax_ms']:.3f} | {r['tflops_torch']:.0f} | "
                  f"{r['tflops_jax']:.0f} | {r['bits_e']} | {all(r['bits_parts'].values())} {r['bits_parts']} |")


if __name__ == "__main__":
    main()

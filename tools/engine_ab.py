"""fce_jax's fused engine, forward+backward, under launch variants of its kernels, in one process: each variant is
compiled ahead of time under its settings, then all are timed interleaved, one call of each in turn, back to back
(`--order calls`; so that a drift of the clocks or of the power cap falls on every variant alike), and every
output's bits (the loss, dX, dW) are compared with the first variant's, the package's defaults.

A variant is NAME:FIELD=VALUE[,FIELD=VALUE...] with FIELD one of
- `gemm.F`: a field of the logits GEMM's GemmConfig (`fce_jax.kernels.logit_tiles.GEMM`), e.g.
  gemm.pingpong_max_hidden=2048;
- `pingpong.F`: a field of the ping-pong kernel's PingPongConfig (`logit_tiles.LOGITS_PINGPONG_MOSAIC`), e.g.
  pingpong.loader_warps=1;
- `dz.F`: a field of the dZ pass's DzPassConfig (`fce_jax.kernels.tile_dlogits.DZ_PASS`), e.g. dz.mosaic=1 (the
  pass on Mosaic GPU, port plan step 2);
- `mgpu.C`: a constant of `fce_jax.kernels.mgpu`, e.g. mgpu.MEMORY_REGISTERS=56.
These are launch settings: a variant whose bits differ from the defaults' is a defect, and the table says so.

    python tools/engine_ab.py [--rounds R] [--reps K] [--order calls|blocks] [--out F.json] [--variant V]...
        N,H,V ...

Without --variant: the ping-pong kernel's loader in one warp with 4 epilogue parts, that with the ping-pong
kernel up to H = 2048, and the dZ pass on Mosaic GPU. A development tool (GPU).
"""
import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

import jax
import numpy as np

import fce_jax
from bench.impls_jax import make_inputs
from bench.timing import _back_to_back
from fce_jax.kernels import logit_tiles, mgpu, tile_dlogits

DEFAULT_VARIANTS = ["loader1w_p4:pingpong.loader_warps=1,pingpong.parts=4",
                    "loader1w_p4_pp2048:pingpong.loader_warps=1,pingpong.parts=4,gemm.pingpong_max_hidden=2048",
                    "dz_mosaic:dz.mosaic=1"]
TARGETS = {"gemm": (logit_tiles, "GEMM"), "pingpong": (logit_tiles, "LOGITS_PINGPONG_MOSAIC"),
           "dz": (tile_dlogits, "DZ_PASS")}


def parse_variant(text):
    """NAME:FIELD=VALUE,... -> (name, {(where, field): int value})."""
    name, _, fields = text.partition(":")
    changes = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        where, _, field = key.partition(".")
        if where not in (*TARGETS, "mgpu") or not field or not value:
            raise argparse.ArgumentTypeError(f"expected gemm.F=V, pingpong.F=V, dz.F=V or mgpu.C=V, got {item!r}")
        if where == "mgpu" and not hasattr(mgpu, field):
            raise argparse.ArgumentTypeError(f"fce_jax.kernels.mgpu has no constant {field!r}")
        if where in TARGETS:
            module, attr = TARGETS[where]
            config = getattr(module, attr)
            if field not in {f.name for f in dataclasses.fields(config)} or field in config.NUMERICS:
                raise argparse.ArgumentTypeError(f"{attr} has no launch field {field!r} (NUMERICS {config.NUMERICS} "
                                                 f"set the bits)")
        changes[(where, field)] = int(value)
    if not name:
        raise argparse.ArgumentTypeError(f"expected NAME:FIELD=VALUE,..., got {text!r}")
    return name, changes


@contextlib.contextmanager
def applied(changes):
    """The variant's settings in place for a trace; the defaults back after it."""
    saved = {}
    for (where, field), value in changes.items():
        module, attr = (mgpu, field) if where == "mgpu" else TARGETS[where]
        saved.setdefault((module, attr), getattr(module, attr))
        current = getattr(module, attr)
        setattr(module, attr, value if where == "mgpu" else dataclasses.replace(current, **{field: value}))
    try:
        yield
    finally:
        for (module, attr), value in saved.items():
            setattr(module, attr, value)


def _bits(a):
    return np.atleast_1d(np.asarray(a)).view(np.uint8)


def step(x, w, y):
    return jax.value_and_grad(lambda x, w: fce_jax.fused_lce(x, w, y, engine="fused"), argnums=(0, 1))(x, w)


def run_shape(n, h, v, variants, rounds, reps, order):
    args = make_inputs((n,), h, v, sets=1)[0]
    compiled, outputs, rows = {}, {}, []
    for name, changes in variants:
        jax.clear_caches()  # no trace of another variant's kernels reused under this one's settings
        t0 = time.perf_counter()
        with applied(changes):
            compiled[name] = jax.jit(step).lower(*args).compile()
        outputs[name] = jax.tree.leaves(jax.block_until_ready(compiled[name](*args)))
        print(f"  ({n}, {h}, {v}) {name}: compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    times = {name: [] for name, _ in variants}
    for r in range(rounds):
        if order == "blocks":
            for name, _ in variants:
                _back_to_back(compiled[name], [args] * 3)  # the queue and the clocks settled after the last variant
                times[name] += _back_to_back(compiled[name], [args] * reps)
        else:  # one call of each variant in turn, so that a drift of the clocks within a round falls on all alike
            turns = [name for _ in range(reps) for name, _ in variants]
            for name, ms in zip(turns, _back_to_back(lambda name: compiled[name](*args), [(k,) for k in turns])):
                times[name].append(ms)
        print(f"  ({n}, {h}, {v}) round {r + 1}/{rounds}: " + ", ".join(
            f"{k} {statistics.median(t[-reps:]):.3f}" for k, t in times.items()), file=sys.stderr, flush=True)
    base_name = variants[0][0]
    base = statistics.median(times[base_name])
    for name, changes in variants:
        stats = compiled[name].memory_analysis()
        same = [bool(np.array_equal(_bits(a), _bits(b))) for a, b in zip(outputs[name], outputs[base_name])]
        ms = statistics.median(times[name])
        rows.append(dict(shape=[n, h, v], variant=name, changes={f"{w}.{f}": val for (w, f), val in changes.items()},
                         ms=ms, ms_rounds=[statistics.median(times[name][i * reps:(i + 1) * reps])
                                           for i in range(rounds)],
                         vs_default=ms / base, bitwise_default=all(same), outputs_bitwise=same,
                         temp_bytes=None if stats is None else int(stats.temp_size_in_bytes)))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="+", metavar="N,H,V")
    parser.add_argument("--variant", action="append", type=parse_variant, metavar="NAME:FIELD=VALUE,...")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--order", choices=("calls", "blocks"), default="calls",
                        help="calls: each round is --reps turns of one call per variant; blocks: --reps calls of "
                             "one variant, then the next (stop 69's runs)")
    parser.add_argument("--out", metavar="F.json")
    args = parser.parse_args()
    variants = [("default", {})] + (args.variant or [parse_variant(t) for t in DEFAULT_VARIANTS])
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", file=sys.stderr, flush=True)
    rows = []
    for shape in args.shapes:
        rows += run_shape(*(int(s) for s in shape.split(",")), variants, args.rounds, args.reps, args.order)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rounds=args.rounds,
                               reps=args.reps, order=args.order, rows=rows), f, indent=1)
    print("| N, H, V | variant | ms (median) | per round | vs default | bitwise default | temp GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        temp = "" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**30:.2f}"
        print(f"| {', '.join(map(str, r['shape']))} | {r['variant']} | {r['ms']:.3f} | "
              f"{' '.join(f'{t:.2f}' for t in r['ms_rounds'])} | {r['vs_default']:.3f} | "
              f"{'yes' if r['bitwise_default'] else 'NO ' + str(r['outputs_bitwise'])} | {temp} |")


if __name__ == "__main__":
    main()

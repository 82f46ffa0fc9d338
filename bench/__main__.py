"""Command line: ``python -m bench {op,sft,cpo,logprobs} [--smoke] [--shape N,H,V|anchors]... [--impl NAME]...
[--out DIR] [--reps K] [--warmup K] [--logits-gemm FIELD=VALUE]... [--grad-gemms FIELD=VALUE]...
[--gluon-grads NAMES]``; ``sft``
also takes ``--profile`` (where the step time goes) and ``--compile-body``, ``op`` ``--isolate`` (a process per
implementation), ``cpo`` ``--pairs B[,B...]``.

Progress goes to stderr (one line per cell), the final table to stdout, and JSON + Markdown + PNG files to
``--out`` (default ``bench/results/<gpu-name>/``, ``bench/results/cpu-smoke/`` with ``--smoke``).
``--smoke`` runs tiny shapes on the CPU only: the Triton interpreter (``TRITON_INTERPRET=1``) and JAX's CPU
backend (Pallas in interpret mode), which is what CI runs. Without a GPU and without ``--smoke``, ``op`` needs
explicit (small) ``--shape``s and ``sft``/``cpo`` refuse to start.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path

from fce_core.config import GLUON_GEMMS, GLUON_GRADS, GemmConfig, GradGemmConfig  # nothing imports triton or jax here


def _shape(text: str) -> tuple[int, int, int] | str:
    if text == "anchors":
        return text
    try:
        n, h, v = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,H,V (three integers), got {text!r}") from None
    if min(n, h, v) <= 0:
        raise argparse.ArgumentTypeError(f"N, H and V must be positive, got {text!r}")
    return n, h, v


def _pairs(text: str) -> tuple[int, ...]:
    try:
        pairs = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B[,B...], got {text!r}") from None
    if not pairs or min(pairs) < 1:
        raise argparse.ArgumentTypeError(f"pairs must be positive, got {text!r}")
    return pairs


def _launch_field(config):
    """The argparse type of FIELD=VALUE for a launch field of the dataclass `config` (bool: true/false, or int);
    its NUMERICS fields, which set the bits, are refused."""

    def parse(text: str) -> tuple[str, bool | int]:
        name, _, value = text.partition("=")
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        if name not in defaults or name in config.NUMERICS:
            launch = sorted(set(defaults) - set(config.NUMERICS))
            raise argparse.ArgumentTypeError(f"expected FIELD=VALUE with FIELD one of {config.__name__}'s launch "
                                             f"fields {launch} (the NUMERICS fields set the bits), got {text!r}")
        if isinstance(defaults[name], bool):
            if value.lower() not in ("true", "false"):
                raise argparse.ArgumentTypeError(f"{name} takes true or false, got {value!r}")
            return name, value.lower() == "true"
        try:
            return name, int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes an integer, got {value!r}") from None

    return parse


def _gluon_grads(text: str) -> tuple[str, ...]:
    """The argparse type of --gluon-grads: names of `fce_core.config.GLUON_GEMMS`, comma-separated, or none."""
    names = () if text == "none" else tuple(text.split(","))
    if not set(names) <= set(GLUON_GEMMS) or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"expected 'none' or distinct names of {GLUON_GEMMS}, comma-separated, "
                                         f"got {text!r}")
    return names


def with_launches(logits: dict, grads: dict, gluon: tuple[str, ...] | None = None) -> None:
    """The fused engine's GEMM launches of both twins with these launch fields changed, for this process (a
    bench run that times a launch variant in the engine): `logits` in the logits GEMM's GemmConfig, `grads` in
    the dX/dW GEMMs' (fce_torch's Triton configs, the JAX twin's Mosaic GPU one; fce_torch's Gluon kernel keeps
    GRAD_GEMM_GLUON); `gluon`: fce_torch's gradient GEMMs that take that kernel where it applies, in place of
    GLUON_GRADS. Launches only: every twin keeps its bits."""
    from fce_jax.kernels import grad_gemms as jax_grads
    from fce_jax.kernels import logit_tiles as jax_logits
    from fce_torch.kernels import grad_gemms as torch_grads
    from fce_torch.kernels import logit_tiles as torch_logits

    for changes, targets in ((logits, ((torch_logits, ("GEMM", "GEMM_SHORT")), (jax_logits, ("GEMM", "GEMM_SHORT")))),
                             (grads, ((torch_grads, ("GRAD_GEMM_TORCH", "GRAD_GEMM_TORCH_TALL",
                                                     "GRAD_GEMM_TORCH_ON_LOAD")),
                                      (jax_grads, ("GRAD_GEMM_MOSAIC", "GRAD_GEMM_MOSAIC_SHORT_K"))))):
        for module, names in targets if changes else ():
            for name in names:
                setattr(module, name, dataclasses.replace(getattr(module, name), **changes))
    if gluon is not None:
        torch_grads.GLUON_GRADS = gluon


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU (Triton interpreter, Pallas interpret mode), 2 reps: for CI")
    common.add_argument("--impl", action="append", metavar="NAME",
                        help="run only these implementations (repeatable, or comma-separated)")
    common.add_argument("--out", type=Path, metavar="DIR", help="output folder (default bench/results/<gpu>/)")
    common.add_argument("--reps", type=int, metavar="K",
                        help="timed repetitions per cell, op and cpo (default 20; smoke 2)")
    common.add_argument("--warmup", type=int, metavar="K", help="untimed calls per cell first (default 3; smoke 0)")
    common.add_argument("--logits-gemm", action="append", type=_launch_field(GemmConfig), default=[],
                        metavar="FIELD=VALUE",
                        help="run the fused engine's logits GEMM of both twins with this launch field of GemmConfig "
                             "changed, e.g. mosaic=true (repeatable; recorded in the JSON)")
    common.add_argument("--grad-gemms", action="append", type=_launch_field(GradGemmConfig), default=[],
                        metavar="FIELD=VALUE",
                        help="the same for the dX/dW GEMMs' GradGemmConfig, e.g. pingpong=true")
    common.add_argument("--gluon-grads", type=_gluon_grads, metavar="NAMES",
                        help=f"fce_torch's gradient GEMMs that take the Gluon kernel on sm_90: 'none' or names of "
                             f"{GLUON_GEMMS}, comma-separated (default {','.join(GLUON_GRADS)}; recorded in the JSON)")
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1])
    sub = parser.add_subparsers(dest="bench", required=True)
    op = sub.add_parser("op", parents=[common], help="the loss alone, forward+backward and loss-only")
    op.add_argument("--shape", action="append", type=_shape, metavar="N,H,V",
                    help="run this shape (repeatable; 'anchors' = the five anchor shapes of DESIGN.md); "
                         "default: the anchors (smoke: two tiny shapes)")
    op.add_argument("--isolate", action="store_true",
                    help="run each implementation in a process of its own, one after the other (each also "
                         "measures the cuBLAS reference), then write one table from them")
    op.add_argument("--vocab-parallel", type=int, default=None, metavar="P",
                    help="the weight split over V in P shards: time and peak memory per device against one "
                         "device (torch: one process per GPU, NCCL; JAX: shard_map over P devices)")
    sft = sub.add_parser("sft", parents=[common], help="training steps of HF causal LMs (and a JAX twin)")
    sft.add_argument("--profile", action="store_true",
                     help="also run a body_only ablation (no LM head, no loss) per framework and profile each "
                          "torch run's kernels by category (GEMM, attention, loss, optimizer, other)")
    sft.add_argument("--model", action="append", metavar="NAME",
                     help="run this model of bench.sft.MODELS (repeatable; default: all)")
    sft.add_argument("--compile-body", action="store_true",
                     help="torch.compile the torch models' decoders (model.model), for every loss alike; the "
                          "heads and losses stay as each implementation ships them")
    cpo = sub.add_parser("cpo", parents=[common], help="the fused linear CPO preference loss")
    cpo.add_argument("--pairs", type=_pairs, metavar="B[,B...]",
                     help="run these numbers of preference pairs (default 1,2,4,8; smoke 1,2)")
    sub.add_parser("logprobs", parents=[common], help="per-token log-probs and entropy, forward+backward")
    return parser


def _child_args(args: argparse.Namespace, shapes: list, settings) -> list[str]:
    """The ``op`` arguments that an implementation's own process repeats under ``--isolate`` (not --impl, --out)."""
    def value(v):
        return str(v).lower() if isinstance(v, bool) else str(v)

    out = [x for n, h, v in shapes for x in ("--shape", f"{n},{h},{v}")]
    out += ["--reps", str(settings.reps), "--warmup", str(settings.warmup)] + ["--smoke"] * args.smoke
    out += [x for name, v in args.logits_gemm for x in ("--logits-gemm", f"{name}={value(v)}")]
    out += [x for name, v in args.grad_gemms for x in ("--grad-gemms", f"{name}={value(v)}")]
    if args.gluon_grads is not None:
        out += ["--gluon-grads", ",".join(args.gluon_grads) or "none"]
    return out


def _select_device(smoke: bool) -> str:
    """Choose torch's device and set the environment that must precede importing triton / jax."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with torch
    if not smoke:
        import torch  # does not import triton

        if torch.cuda.is_available():
            return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    # Tiny shapes on a few shared cores: torch's OpenMP threads and XLA's Eigen pool wait on each other and on
    # other processes (a 128x128x512 GEMM then takes 30 ms instead of 0.3 ms), so one thread each; and XLA's
    # LLVM optimizations cost seconds per compile while the programs run for milliseconds, so none.
    flags = " --xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + flags).strip()
    import torch

    torch.set_num_threads(1)
    return "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "isolate", False) and args.vocab_parallel:
        parser.error("--isolate and --vocab-parallel do not go together: the vocab-parallel run has its processes")
    device = _select_device(args.smoke)

    from bench import common, report

    gpu = device == "cuda"
    if not gpu and not args.smoke and not (args.bench == "op" and args.shape):
        hint = " or small --shape N,H,V" if args.bench == "op" else ""
        print(f"bench {args.bench}: no GPU here; use --smoke{hint}", file=sys.stderr)
        return 2
    name = common.device_name(device)
    slug = "cpu-smoke" if args.smoke else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    settings = common.Settings(
        device=device, smoke=args.smoke,
        reps=args.reps or (20 if gpu else 2),
        warmup=args.warmup if args.warmup is not None else 3 if gpu else 0 if args.smoke else 1,
        impls=None if not args.impl else frozenset(x for arg in args.impl for x in arg.split(",") if x),
        out=args.out or common.RESULTS / slug)
    progress = common.Progress()
    progress.log(f"bench {args.bench} on {name} -> {settings.out}")
    launches = {"logits_gemm": dict(args.logits_gemm), "grad_gemms": dict(args.grad_gemms)}
    if args.gluon_grads is not None:
        launches["gluon_grads"] = list(args.gluon_grads) or ["none"]
    if any(launches.values()):
        with_launches(launches["logits_gemm"], launches["grad_gemms"], args.gluon_grads)
        progress.log(f"the fused engine's GEMM launches changed: {launches}")

    if args.bench == "op":
        from bench import op as mod

        shapes = [s for arg in args.shape or [] for s in (mod.ANCHORS if arg == "anchors" else [arg])]
        shapes = shapes or (mod.SMOKE if args.smoke else mod.ANCHORS)
        if args.vocab_parallel:
            from bench import vocab_parallel as mod

            result = mod.run(settings, shapes, args.vocab_parallel, progress)
        elif args.isolate:
            result = mod.run_isolated(settings, shapes, progress, _child_args(args, shapes, settings))
        else:
            result = mod.run(settings, shapes, progress)
    elif args.bench == "sft":
        from bench import sft as mod

        result = mod.run(settings, progress, profile=args.profile, model_names=args.model,
                         compile_body=args.compile_body)
    elif args.bench == "logprobs":
        from bench import logprobs as mod

        result = mod.run(settings, progress)
    else:
        from bench import cpo as mod

        result = mod.run(settings, progress, pairs=args.pairs)

    if any(launches.values()):
        result["launches_changed"] = launches
    for path in report.write(result, mod.COLUMNS, mod.PLOTS, settings.out):
        progress.log(f"wrote {path}")
    print(report.table(result, mod.COLUMNS))
    measured = [r for r in result["rows"] if r.get("ms") is not None or r.get("step_ms") is not None]
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())

"""``python -m parity``: the cross-framework parity report (fce_torch vs fce_jax vs Liger vs float64).

    python -m parity                  # the default table for this machine (CPU: small cases in the
                                      # interpreters, a few minutes; GPU: the real shapes)
    python -m parity --quick          # a few representative cases
    python -m parity --case bias,cpo  # cases whose name contains "bias" or "cpo" (fnmatch wildcards work)
    python -m parity --no-cpo --no-logprobs   # the fused_lce cases only
    python -m parity --device cpu --out /tmp/parity --explain
    python -m parity --list           # the cases, without running them
    python -m parity --vocab-parallel 2   # the weight split over V in 2 shards (2 GPUs, or the CPU)

Progress goes to stderr, the table and the summary to stdout, ``parity.json`` and ``parity.md`` to ``--out``
(default ``parity/results/<device>/``). Exit code: 1 when any SPEC accuracy bound is violated, or a twin is
missing, raises (``NotImplementedError`` included) or writes to its inputs, or nothing ran at all (the full
list: :mod:`parity.verdicts`); 0 otherwise. Bitwise differences are reported, not failures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m parity", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few representative cases only")
    p.add_argument("--case", action="append", default=[], metavar="PATTERN",
                   help="run the cases matching PATTERN (substring, or fnmatch wildcards; comma-separated; "
                        "repeatable)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the tensors live (auto: cuda when torch sees a GPU)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="directory for parity.json and parity.md (default: parity/results/<device>/)")
    p.add_argument("--explain", action="store_true",
                   help="when the twins differ on a case, compare their intermediates stage by stage")
    p.add_argument("--impls", default="torch,jax,liger",
                   help="comma-separated implementations to run (default: torch,jax,liger)")
    p.add_argument("--no-cpo", action="store_true", help="leave out the fused_cpo_loss cases")
    p.add_argument("--no-logprobs", action="store_true", help="leave out the fused_token_logprobs cases")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--vocab-parallel", type=int, default=None, metavar="P",
                   help="the vocab-parallel report instead: the weight in P shards, torch in P processes "
                        "(NCCL on the GPUs, gloo on the CPU), JAX over P devices (parity/vocab_parallel.py)")
    return p.parse_args(argv)


def _pick_device(requested: str) -> str:
    if requested == "cpu":
        return "cpu"
    has_smi = shutil.which("nvidia-smi") is not None
    if requested == "auto" and not has_smi:
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if requested == "cuda":
        raise SystemExit("python -m parity: --device cuda, but torch sees no CUDA device")
    return "cpu"


def _prepare_environment(device: str) -> None:
    """Set before triton kernels or jax are imported (fce_torch, liger_kernel, fce_jax are imported later)."""
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")      # fce_torch and Liger run in the Triton interpreter
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # torch and JAX share the GPU: JAX must not grab 75% of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _select(args, device: str) -> list:
    """The cases of the run: the default table, then ``--case`` patterns, then ``--quick``; [] when no case
    matches the patterns."""
    from .catalog import default_cases, quick_cases, select_cases

    cases = default_cases(device, cpo=not args.no_cpo, logprobs=not args.no_logprobs)
    if _patterns(args):
        cases = select_cases(cases, _patterns(args))
    return quick_cases(cases, device) if args.quick and cases else cases


def _patterns(args) -> list[str]:
    """The ``--case`` patterns (each argument may hold several, comma-separated)."""
    return [p.strip() for arg in args.case for p in arg.split(",") if p.strip()]


def _out_dir(args, device: str, name: str = "") -> Path:
    """``--out``, else ``parity/results/<device slug>[/name]``."""
    from .environment import device_slug

    return Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / device_slug(device) / name


def main(argv=None) -> int:
    args = _parse(argv)
    device = _pick_device(args.device)
    _prepare_environment(device)
    if args.vocab_parallel:
        from .vocab_parallel import run

        return run(args.vocab_parallel, device, _patterns(args), _out_dir(args, device,
                                                                        f"vocab-parallel-{args.vocab_parallel}"))

    # imported only now: the environment above must be set before triton or jax load
    from .catalog import case_meta, default_cases
    from .explain import format_explain
    from .impls import IMPLS
    from .report import Progress, describe, format_summary, format_table, write_reports
    from .runner import run_suite

    impl_names = tuple(s.strip() for s in args.impls.split(",") if s.strip())
    unknown = [s for s in impl_names if s not in IMPLS]
    if unknown:
        print(f"python -m parity: unknown implementation(s) {unknown}; known: {list(IMPLS)}", file=sys.stderr)
        return 2
    cases = _select(args, device)
    if not cases:
        names = ", ".join(c.name for c in default_cases(device))
        print(f"python -m parity: no case matches {args.case}. Cases on {device}: {names}", file=sys.stderr)
        return 2
    if args.list:
        for c in cases:
            print(f"{c.name:<44} {describe(case_meta(c))}")
        return 0

    out_dir = _out_dir(args, device)

    def annotate(results):
        results["args"] = vars(args)
        return results

    progress = Progress(enabled=not args.no_progress)
    results = run_suite(cases, device, impl_names=impl_names, explain=args.explain, progress=progress,
                        on_case=lambda partial: write_reports(annotate(partial), out_dir))
    files = write_reports(annotate(results), out_dir)
    print(format_table(results))
    if args.explain:
        for e in results["cases"]:
            if e.get("explain"):
                print(f"\nexplain {e['case']}:\n{format_explain(e['explain'])}")
    print()
    print(format_summary(results, files))
    return results["exit_code"]


if __name__ == "__main__":
    sys.exit(main())

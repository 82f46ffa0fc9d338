"""``python -m parity``: the cross-framework parity report (fce_torch vs fce_jax vs Liger vs float64).

    python -m parity                  # the default table for this machine (CPU: small cases in the
                                      # interpreters, a few minutes; GPU: the real shapes)
    python -m parity --quick          # a few representative cases
    python -m parity --case bias,cpo  # cases whose name contains "bias" or "cpo" (fnmatch wildcards work)
    python -m parity --device cpu --out /tmp/parity --explain
    python -m parity --list           # the cases, without running them

Progress goes to stderr, the table and the summary to stdout, ``parity.json`` and ``parity.md`` to ``--out``
(default ``parity/results/<device>/``). Exit code: 1 when any SPEC accuracy bound is violated (or a twin
raises / writes to its inputs), 0 otherwise; bitwise differences are reported, not failures. Missing
implementations are reported as "missing"; with both twins missing the run exits 0 and says so.
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
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
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


def main(argv=None) -> int:
    args = _parse(argv)
    device = _pick_device(args.device)
    _prepare_environment(device)

    from . import suite
    from .report import Progress, format_summary, format_table, write_reports

    impl_names = tuple(s.strip() for s in args.impls.split(",") if s.strip())
    unknown = [s for s in impl_names if s not in suite.IMPLS]
    if unknown:
        print(f"python -m parity: unknown implementation(s) {unknown}; known: {list(suite.IMPLS)}", file=sys.stderr)
        return 2

    patterns = [p.strip() for arg in args.case for p in arg.split(",") if p.strip()]
    cases = suite.default_cases(device, cpo=not args.no_cpo)
    notes = []
    if not args.no_cpo and not patterns:
        impls = suite.load_impls(tuple(t for t in suite.TWINS if t in impl_names))
        if not any(impl.fns.get("cpo") is not None for impl in impls.values()):
            cases = [c for c in cases if suite.case_kind(c) != "cpo"]
            notes.append("CPO cases left out: fused_cpo_loss exists in neither twin yet "
                         "(select them with --case cpo to see them reported as missing)")
    if patterns:
        cases = suite.select_cases(cases, patterns)
        if not cases:
            names = ", ".join(c.name for c in suite.default_cases(device))
            print(f"python -m parity: no case matches {patterns}. Cases on {device}: {names}", file=sys.stderr)
            return 2
    if args.quick:
        cases = suite.quick_cases(cases, device)

    if args.list:
        from .report import _describe
        for c in cases:
            print(f"{c.name:<44} {_describe(suite.case_meta(c))}")
        return 0

    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    out_dir = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / suite.device_slug(device)

    def annotate(results):
        results["summary"]["notes"] = notes
        results["args"] = vars(args)
        return results

    progress = Progress(enabled=not args.no_progress)
    results = suite.run_suite(cases, device, impl_names=impl_names, explain=args.explain, progress=progress,
                              on_case=lambda partial: write_reports(annotate(partial), out_dir))
    files = write_reports(annotate(results), out_dir)
    print(format_table(results))
    if args.explain:
        from .explain import format_explain
        for e in results["cases"]:
            if e.get("explain"):
                print(f"\nexplain {e['case']}:\n{format_explain(e['explain'])}")
    print()
    for n in notes:
        print(f"note: {n}")
    print(format_summary(results, files))
    return results["exit_code"]


if __name__ == "__main__":
    sys.exit(main())

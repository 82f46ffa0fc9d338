"""Verdicts: the SPEC accuracy bounds (one table), the rule for one output, a case's report entry, the
summary of a run and its exit code.

What counts as a failure (exit code 1); everything else is reported only:

* a twin (``torch`` / ``jax``) output outside the SPEC accuracy bound of its dtype (:data:`BOUNDS`);
* a twin output that is non-finite where the reference is finite, has the wrong shape or dtype, or is
  missing (``db`` with a bias);
* a twin that is missing (no module or function), raises ``NotImplementedError`` or raises anything else;
  the reference raising;
* an implementation writing to its inputs;
* a run in which no implementation produced a result at all;
* a report written before every selected case ran (``summary["pending"]``: the run was stopped after it).

Bitwise differences and run-to-run nondeterminism are reported, not failures (until the twins match).
"""

from __future__ import annotations

import math
from typing import Any

from .impls import TWINS
from .measures import compare_pair, dtype_name, rel_err

__all__ = ["BOUNDS", "MEASURE", "LIGER_FACTOR", "LIGER_FLOOR", "PAIRS", "bound", "judge", "evaluate_case",
           "summarize", "exit_code"]

#: SPEC §1 "Accuracy" and §4: relative errors against float64, per input dtype and kind of output.
BOUNDS = {
    "float32": {"loss": 1e-6, "grad": 5e-5, "entropy": 1e-4},
    "bfloat16": {"loss": 1e-5, "grad": 1e-2, "entropy": 1e-4},
    "float16": {"loss": 1e-5, "grad": 1e-2, "entropy": 1e-4},
}
#: Which bound an output takes: ``logp`` the loss bound (SPEC §4), the gradients the gradient bound.
MEASURE = {"loss": "loss", "logp": "loss", "entropy": "entropy", "dx": "grad", "dw": "grad", "db": "grad"}
#: bf16/fp16 gradients must also be within this factor of Liger's error on the same tensors (SPEC §1) ...
LIGER_FACTOR = 1.25
#: ... unless both errors are below this floor (float64-level round-off, e.g. all-zero gradients).
LIGER_FLOOR = 1e-7
PAIRS = (("torch", "jax"), ("torch", "liger"), ("jax", "liger"))


def bound(output: str, dtype: str) -> float:
    """The SPEC bound of ``output`` ("loss", "logp", "entropy", "dx", "dw", "db") for input ``dtype``."""
    if dtype not in BOUNDS:
        raise ValueError(f"no SPEC accuracy bound for dtype {dtype!r}")
    return BOUNDS[dtype][MEASURE[output]]


def judge(output: str, dtype: str, err: float | None, liger_err: float | None) -> tuple[bool, str, float]:
    """(ok, reason, bound) of the SPEC accuracy rule for one twin output: the bound of :func:`bound`, and
    for 16-bit gradients also <= ``LIGER_FACTOR`` x Liger's error when Liger ran (not below ``LIGER_FLOOR``)."""
    b = bound(output, dtype)
    if err is None or not math.isfinite(err):
        return False, f"relative error {'nan' if err is None else f'{err:.2e}'} (non-finite output)", b
    if err > b:
        return False, f"relative error {err:.3e} > {b:.0e}", b
    if (MEASURE[output] == "grad" and dtype != "float32" and liger_err is not None and math.isfinite(liger_err)
            and err > LIGER_FACTOR * liger_err and err > LIGER_FLOOR):
        return False, f"relative error {err:.3e} > {LIGER_FACTOR}x Liger's {liger_err:.3e}", b
    return True, "", b


def _case_violations(results: dict, ref_status: str, ref_reason: str, mutated: list[str]) -> list[str]:
    out = []
    for impl in TWINS:
        r = results.get(impl)
        if r is not None and r.status == "error":
            out.append(f"{impl}: raised {r.reason}")
        elif r is not None and r.status == "missing":
            out.append(f"{impl}: missing ({r.reason})")
    if ref_status == "error":
        out.append(f"reference: raised {ref_reason}")
    return out + [f"{who}: wrote to its inputs" for who in mutated]


def _twin_verdict(output: str, expected: str, dtype: str, r, t, ref_t, err, liger_err) -> tuple[str, list[str]]:
    """(verdict, problems) of one twin's output ``t`` (its ImplResult ``r``, its error ``err``)."""
    if r is None or r.status != "ok":
        return (r.status if r is not None else "n/a"), []
    problems = []
    if t is None:
        problems.append("missing output")
    else:
        if dtype_name(t.dtype) != expected:
            problems.append(f"dtype {dtype_name(t.dtype)}, expected {expected}")
        if ref_t is not None and tuple(t.shape) != tuple(ref_t.shape):
            problems.append(f"shape {list(t.shape)}, expected {list(ref_t.shape)}")
    if ref_t is not None and not problems:
        ok, why, _ = judge(output, dtype, err, liger_err)
        if not ok:
            problems.append(why)
    if problems:
        return "FAIL", problems
    return ("ok" if ref_t is not None else "unchecked"), []


def _output_record(output: str, expected: str, dtype: str, results: dict, ref_t) -> tuple[dict, list[str]]:
    """The report record of one output (errors, determinism, pairs, verdicts) and its violations."""
    rec: dict[str, Any] = {"dtype": expected, "err": {}, "deterministic": {}, "pairs": {}, "verdict": {},
                           "bound": bound(output, dtype)}
    tensors = {impl: (r.outputs.get(output) if r.status == "ok" else None) for impl, r in results.items()}
    for impl, r in results.items():
        t = tensors[impl]
        rec["deterministic"][impl] = r.deterministic.get(output) if r.status == "ok" else None
        same_shape = t is not None and ref_t is not None and tuple(t.shape) == tuple(ref_t.shape)
        rec["err"][impl] = rel_err(t, ref_t) if same_shape else None
    for a, b in PAIRS:
        if a in results and b in results:
            rec["pairs"][f"{a}~{b}"] = compare_pair(tensors[a], tensors[b])
    problems = []
    for impl in TWINS:
        verdict, why = _twin_verdict(output, expected, dtype, results.get(impl), tensors.get(impl), ref_t,
                                     rec["err"].get(impl), rec["err"].get("liger"))
        rec["verdict"][impl] = verdict
        problems += [f"{impl} {output}: " + "; ".join(why)] if why else []
    return rec, problems


def evaluate_case(meta: dict, results: dict, ref: dict | None, *, ref_status: str = "ok", ref_reason: str = "",
                  mutated: list[str] | None = None) -> dict:
    """Turn the implementations' outputs and the float64 reference into the case's report entry.

    ``meta``: :func:`parity.catalog.case_meta` (needs ``name``, ``dtype`` and ``outputs``); ``results``: impl ->
    :class:`parity.impls.ImplResult`; ``ref``: output -> float64 tensor (or None). Returns a JSON-friendly dict
    with ``outputs`` (per output: dtype, errors, determinism, pairs, bound, verdict per twin) and
    ``violations`` (the failures of the module docstring).
    """
    violations = _case_violations(results, ref_status, ref_reason, mutated or [])
    entry: dict[str, Any] = {
        "case": meta["name"], "meta": meta,
        "impls": {k: {"status": r.status, "reason": r.reason, "seconds": r.seconds, "notes": r.notes}
                  for k, r in results.items()},
        "reference": {"status": ref_status, "reason": ref_reason},
        "outputs": {}, "violations": violations, "explain": None,
    }
    for output, expected in meta["outputs"].items():
        rec, problems = _output_record(output, expected, meta["dtype"], results, ref.get(output) if ref else None)
        entry["outputs"][output] = rec
        violations += problems
    return entry


def summarize(entries: list[dict]) -> dict:
    """Counts over the case entries, and the list of violations."""
    impl_status: dict[str, dict[str, int]] = {}
    nondeterministic: dict[str, list[str]] = {}
    bitwise = {"equal": 0, "different": 0, "n/a": 0}
    for e in entries:
        for impl, info in e["impls"].items():
            counts = impl_status.setdefault(impl, {})
            counts[info["status"]] = counts.get(info["status"], 0) + 1
            outs = [o for o, rec in e["outputs"].items() if rec["deterministic"].get(impl) is False]
            if outs:
                nondeterministic.setdefault(impl, []).append(f"{e['case']} ({', '.join(outs)})")
        for rec in e["outputs"].values():
            p = rec["pairs"].get("torch~jax")
            bitwise["n/a" if p is None else ("equal" if p["bitwise"] else "different")] += 1
    ran = {impl: c.get("ok", 0) for impl, c in impl_status.items()}
    return {"cases": len(entries), "violations": [f"{e['case']}: {v}" for e in entries for v in e["violations"]],
            "impl_status": impl_status, "ran": ran, "nothing_ran": sum(ran.values()) == 0,
            "torch_jax_outputs": bitwise, "nondeterministic": nondeterministic}


def exit_code(summary: dict) -> int:
    """1 when anything in the module docstring's list of failures happened, else 0."""
    return 1 if summary["violations"] or summary["nothing_ran"] or summary.get("pending") else 0

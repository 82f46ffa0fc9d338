"""Running the parity suite (``python -m parity`` without the command line).

For each case the inputs, cotangents included, are made **once** in torch (:func:`parity.cases.case_inputs`),
and the same device memory goes to every implementation (:mod:`parity.impls`: fce_torch, fce_jax through
DLPack, Liger) and to the float64 reference (:mod:`parity.reference`, evaluated on the same device by chunks).
Each implementation runs twice (run-to-run determinism); the inputs are checked bit for bit after each one
(an implementation must not write to them). A float32 case runs entirely under IEEE float32 matmuls
(:func:`parity.environment.precision_for`). Per case and output, :mod:`parity.verdicts` then reports
(SPEC §6) bitwise equality and the ULP distance of each pair of implementations, the relative error against
float64 and the SPEC verdict for the two twins; with ``explain``, an FLCE case whose twins differ is taken
apart stage by stage (:mod:`parity.explain`).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from . import reference
from .cases import case_inputs
from .catalog import case_meta
from .environment import environment, precision_for
from .explain import explain_case
from .impls import IMPLS, Impl, load_impls, run_impl
from .measures import bitwise_equal
from .verdicts import evaluate_case, exit_code, summarize

__all__ = ["reference_for", "run_case", "run_suite"]


def reference_for(case, inp: dict, device: str) -> tuple[dict, str]:
    """(float64 outputs on ``device``, which evaluator) for ``case`` on its inputs ``inp``."""
    x, w, t, b = inp["x"], inp["weight"], inp["targets"], inp["bias"]
    if case.kind == "flce":
        out = reference.flce_on_device(x, w, t, bias=b, class_weights=inp["class_weights"],
                                       grad_output=inp["grad_loss"], **case.math_options())
    elif case.kind == "cpo":
        out = reference.cpo_on_device(x, w, t, bias=b, **case.math_options())
    else:
        out = reference.logprobs_on_device(x, w, t, bias=b, grad_logp=inp["grad_logp"],
                                           grad_entropy=inp["grad_entropy"], **case.math_options())
    return out, f"parity.reference (float64 on {device}, chunked)"


def _run_impls(case, inp: dict, device: str, impls: dict[str, Impl], tick) -> tuple[dict, list[str], dict]:
    """Every implementation on ``inp``; (results, who wrote to its inputs, the inputs as they were)."""
    snap = {k: v.clone() for k, v in inp.items() if v is not None}
    results, mutated = {}, []
    for name, impl in impls.items():
        tick(f"{case.name}: {name}")
        results[name] = run_impl(impl, case, inp, device)
        changed = [k for k, v in snap.items() if not bitwise_equal(inp[k], v)]
        if changed:
            mutated.append(f"{name} ({', '.join(changed)})")
            inp = {k: (snap[k].clone() if k in snap else None) for k in inp}   # the next one gets clean inputs
    return results, mutated, inp


def _twins_differ(entry: dict) -> bool:
    return any((rec["pairs"].get("torch~jax") or {}).get("bitwise") is False for rec in entry["outputs"].values())


def run_case(case, device: str, impls: dict[str, Impl], *, explain: bool = False,
             progress: Callable[[str], None] | None = None) -> dict:
    """Run every implementation and the reference on one case; return its report entry."""
    tick = progress or (lambda label: None)
    with precision_for(case):
        results, mutated, inp = _run_impls(case, case_inputs(case, device), device, impls, tick)
        tick(f"{case.name}: float64 reference")
        ref, ref_status, ref_reason, ref_impl = None, "ok", "", ""
        try:
            ref, ref_impl = reference_for(case, inp, device)
        except Exception as e:  # noqa: BLE001 - reported as a failure
            ref_status, ref_reason = "error", f"{type(e).__name__}: {e}"
        tick(f"{case.name}: compare" + (" + explain" if explain else ""))
        entry = evaluate_case(case_meta(case), results, ref, ref_status=ref_status, ref_reason=ref_reason,
                              mutated=mutated)
        entry["reference"]["impl"] = ref_impl
        if explain and case.kind == "flce" and _twins_differ(entry):
            entry["explain"] = explain_case(case, inp, device)
    del inp, results, ref
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return entry


def _results(entries: list[dict], env: dict, impls: dict[str, Impl], kinds: set, seconds: float,
             pending: list[str]) -> dict:
    summary = summarize(entries)
    summary["seconds"] = round(seconds, 2)
    summary["pending"] = pending  # the cases not run yet: a report written mid-run says so
    summary["missing"] = {name: {k: w for k, w in impl.why.items() if w and k in kinds}
                          for name, impl in impls.items()}
    return {"environment": env, "cases": entries, "summary": summary, "exit_code": exit_code(summary)}


def run_suite(cases: list, device: str, *, impl_names=IMPLS, explain: bool = False, progress=None,
              on_case: Callable[[dict], None] | None = None) -> dict:
    """Run ``cases`` on ``device``; returns ``{"environment", "cases", "summary", "exit_code"}``.

    ``progress``: an object with ``start(total)``, ``step(label)`` and ``done()`` (see
    :class:`parity.report.Progress`), or None. ``on_case``: called with the partial results after each case
    (``python -m parity`` rewrites its files then, so a run cut short still leaves its finished cases; such a
    report lists the cases not run in ``summary["pending"]`` and exits 1).
    """
    impls = load_impls(impl_names)
    kinds = {c.kind for c in cases}
    if progress is not None:
        progress.start(len(cases) * (len(impls) + 2))    # each implementation, the reference, the comparison
    env = environment(device)
    entries = []
    t0 = time.perf_counter()
    for i, case in enumerate(cases):
        entries.append(run_case(case, device, impls, explain=explain,
                                progress=progress.step if progress is not None else None))
        if on_case is not None:
            pending = [c.name for c in cases[i + 1:]]
            on_case(_results(entries, env, impls, kinds, time.perf_counter() - t0, pending))
    if progress is not None:
        progress.done()
    return _results(entries, env, impls, kinds, time.perf_counter() - t0, [])

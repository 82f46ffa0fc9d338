"""``python -m parity --explain``: where do the twins part?

When ``fce_torch`` and ``fce_jax`` give different bits on a case, the final outputs alone do not say which
step of the engine (docs/NUMERICS.md) is responsible. Both twins expose
``debug.debug_intermediates(x, weight, targets, bias=..., class_weights=..., **options)``, returning the
stages of one forward+backward on the same inputs:

``logits`` (float32, first chunk) -> ``lse`` (float32, all rows) -> ``dlogits`` (first chunk, input dtype)
-> ``dx`` -> ``dw`` (-> ``db``).

:func:`explain_case` feeds both the same memory (JAX through :mod:`parity.bridge`), compares the stages in
that order (shape and dtype, then bitwise, then the max ULP distance and where it occurs) and names the
first stage where they differ, with the NUMERICS.md step that decides those bits. Stages after the first
difference usually differ as a consequence; stages before it are bit-identical, so the fix is local.
"""

from __future__ import annotations

import importlib
import traceback

import torch

from .bridge import targets_to_jax, to_jax, to_torch
from .measures import INT_VIEW, bitwise_equal, ulp_distance

__all__ = ["STAGES", "HINTS", "compare_stage", "first_divergence", "explain_case", "explain_intermediates",
           "format_explain"]

STAGES = ("logits", "lse", "dlogits", "dx", "dw", "db")

HINTS = {
    "logits": "NUMERICS step 1, the logits GEMM: float32 operands must be IEEE float32 (no TF32: "
              "precision=HIGHEST in JAX, allow_tf32 off in torch); 16-bit operands accumulate in float32; "
              "nothing may split K (cuBLAS/XLA split-K or stream-K); the same chunk boundaries (chunk_rows).",
    "lse": "NUMERICS steps 2-4 (row_stats, pairwise_sum, head): r = Z + float32(b); the softcap tanh form; "
           "exp2((z - m)*LOG2E) and the rescale FMA when the max moves; the fixed pairwise tree over the "
           "slots; lse = m + lg2(S)*LN2 as one FMA; ex2/lg2 approx (GPU) vs plain ops (interpreters).",
    "dlogits": "NUMERICS steps 4-5 (head coefficients, dlogits kernel): a_i, b_i, c_i and their scaling "
               "(1/D, 1/n, cotangent); p = exp2((z - lse)*LOG2E); dz = fma(c, w, fma(a, p, b*[c==y])); the "
               "softcap derivative fma(-t, t, 1); one rounding to the input dtype.",
    "dx": "NUMERICS step 6, dX = dZ @ W: float32 accumulation over K = V without split-K, rounded once to the "
          "input dtype; the gradient scaling (grad.float32 * g).to(dtype).",
    "dw": "NUMERICS step 6, dW += dZ^T @ X_c: the float32 accumulator, the chunk order (first chunk writes, "
          "the rest add in the GEMM epilogue), the direct 16-bit write of a single 16-bit chunk.",
    "db": "NUMERICS step 6, db: column sums of dZ walking the rows of each chunk in order, accumulated "
          "over chunks in float32, then cast to the bias dtype.",
}


def _as_torch(a):
    if a is None:
        return None
    if isinstance(a, torch.Tensor):
        return a.detach()
    return to_torch(a)


def compare_stage(name: str, a: torch.Tensor | None, b: torch.Tensor | None) -> dict:
    """Compare one stage of the two twins (``a`` torch, ``b`` jax) on the same device."""
    rec = {"stage": name, "present": a is not None and b is not None, "bitwise": None, "max_ulp": None,
           "n_diff": None, "numel": None, "note": "", "first_diff": None, "worst_diff": None}
    if a is None or b is None:
        rec["note"] = ("missing in " + " and ".join(w for w, t in (("torch", a), ("jax", b)) if t is None))
        return rec
    if b.device != a.device:
        b = b.to(a.device)
    rec["numel"] = int(a.numel())
    rec["torch"] = {"shape": list(a.shape), "dtype": str(a.dtype).removeprefix("torch.")}
    rec["jax"] = {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")}
    if a.shape != b.shape or a.dtype != b.dtype:
        rec["bitwise"] = False
        rec["note"] = f"torch {rec['torch']}, jax {rec['jax']}"
        return rec
    rec["bitwise"] = bitwise_equal(a, b)
    if rec["bitwise"]:
        rec["max_ulp"], rec["n_diff"] = 0, 0
        return rec
    if not a.is_floating_point():
        rec["n_diff"] = int((a != b).sum())
        return rec
    rec["max_ulp"], rec["n_diff"] = ulp_distance(a, b)
    iv = INT_VIEW[a.element_size()]
    fa, fb = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    neq = (fa.view(iv) != fb.view(iv)).nonzero()
    if neq.numel():
        i = int(neq[0, 0])
        rec["first_diff"] = {"index": _unravel(i, a.shape), "torch": float(fa[i]), "jax": float(fb[i])}
    diff = (fa.double() - fb.double()).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    j = int(diff.argmax())
    rec["worst_diff"] = {"index": _unravel(j, a.shape), "torch": float(fa[j]), "jax": float(fb[j]),
                         "abs": float(diff[j])}
    return rec


def _unravel(i: int, shape) -> list[int]:
    idx = []
    for s in reversed(tuple(shape)):
        idx.append(i % s if s else 0)
        i = i // s if s else 0
    return list(reversed(idx))


def first_divergence(stages: list[dict]) -> str | None:
    """The first stage (in engine order) that is present in both and not bitwise equal."""
    for rec in stages:
        if rec["present"] and rec["bitwise"] is False:
            return rec["stage"]
    return None


def explain_intermediates(torch_stages: dict, jax_stages: dict) -> dict:
    """Compare two ``debug_intermediates`` dicts (values: torch tensors or JAX arrays)."""
    stages = []
    for name in STAGES:
        if name not in torch_stages and name not in jax_stages:
            continue
        stages.append(compare_stage(name, _as_torch(torch_stages.get(name)), _as_torch(jax_stages.get(name))))
    first = first_divergence(stages)
    return {"status": "ok", "reason": "", "stages": stages, "first_divergence": first,
            "hint": HINTS.get(first, "") if first else "the intermediates are bit-identical"}


def explain_case(case, inputs: dict, device: str) -> dict:
    """Run both twins' ``debug_intermediates`` on ``inputs`` (a ``make_inputs`` dict) and compare them.

    Never raises: a missing engine is ``status="missing"``, an exception ``status="error"``.
    """
    fns = {}
    for twin in ("torch", "jax"):
        try:
            mod = importlib.import_module(f"fce_{twin}.debug")
            fns[twin] = getattr(mod, "debug_intermediates")
        except (ImportError, AttributeError) as e:
            return {"status": "missing", "reason": f"fce_{twin}.debug.debug_intermediates: {e}", "stages": [],
                    "first_divergence": None, "hint": ""}
    h = inputs["x"].shape[-1]
    x2 = inputs["x"].reshape(-1, h)
    t1 = inputs["targets"].reshape(-1)
    opts = dict(case.options())
    try:
        tor = fns["torch"](x2, inputs["weight"], t1, bias=inputs["bias"],
                           class_weights=inputs["class_weights"], **opts)
        jx = fns["jax"](to_jax(x2), to_jax(inputs["weight"]), targets_to_jax(t1),
                        bias=to_jax(inputs["bias"]) if inputs["bias"] is not None else None,
                        class_weights=(to_jax(inputs["class_weights"])
                                       if inputs["class_weights"] is not None else None), **opts)
        return explain_intermediates(tor, jx)
    except Exception as e:  # noqa: BLE001
        return {"status": "error", "reason": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=-4),
                "stages": [], "first_divergence": None, "hint": ""}


def format_explain(ex: dict) -> str:
    """A few lines per stage, and the verdict."""
    if ex["status"] != "ok":
        return f"explain: {ex['status']}: {ex['reason']}"
    lines = []
    for rec in ex["stages"]:
        if not rec["present"]:
            lines.append(f"  {rec['stage']:<8} {rec['note']}")
            continue
        if rec["bitwise"]:
            lines.append(f"  {rec['stage']:<8} bit-identical ({rec['numel']} elements)")
            continue
        if rec["max_ulp"] is None:
            lines.append(f"  {rec['stage']:<8} DIFFERS: {rec['note'] or str(rec['n_diff']) + ' elements'}")
            continue
        s = f"  {rec['stage']:<8} DIFFERS: max {rec['max_ulp']} ulp, {rec['n_diff']}/{rec['numel']} elements"
        if rec.get("first_diff"):
            f = rec["first_diff"]
            s += f"; first at {f['index']}: torch {f['torch']!r} vs jax {f['jax']!r}"
        if rec.get("worst_diff"):
            w = rec["worst_diff"]
            s += f"; worst at {w['index']}: {w['torch']!r} vs {w['jax']!r}"
        lines.append(s)
    first = ex["first_divergence"]
    if first:
        lines.append(f"  => the twins part at '{first}'. {ex['hint']}")
    else:
        lines.append("  => no stage differs here (the difference must come from the autograd wrapper / "
                     "gradient scaling after the engine).")
    return "\n".join(lines)

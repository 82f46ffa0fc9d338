"""The cross-framework parity suite (``python -m parity``): the logic, without the command line.

For each case the inputs are made **once** in torch (:func:`parity.cases.make_inputs`), and the same device
memory is handed to

* ``fce_torch`` (leaf tensors made with ``detach()``: the same storage),
* ``fce_jax`` through the zero-copy DLPack bridge (:mod:`parity.bridge`; targets are converted to int32
  explicitly when JAX's x64 is off, the one documented copy),
* Liger-Kernel (``LigerFusedLinearCrossEntropyLoss`` / ``LigerFusedLinearCPOLoss`` / ``...SimPOLoss``) where
  it supports the options ("n/a" otherwise),

and to the float64 evaluation of SPEC §1/§3. Per case and per output (loss, dx, dw, db) the suite reports
(SPEC §4): bitwise equality and the ULP distance (max, number of differing elements, in the output dtype) for
each pair of implementations, the relative-norm error against float64, run-to-run determinism (each
implementation runs twice; bitwise), and the SPEC accuracy verdict for the two twins.

Gradients: torch through ``.backward()``; JAX through ``jax.value_and_grad`` over (x, weight, bias) under
``jax.jit`` (``jax.vjp`` with the per-row cotangent for ``reduction="none"``). "mean"/"sum" use a cotangent
of 1; "none" uses a fixed per-row cotangent in [0.5, 1.5) (the same tensor for every implementation and the
reference), so that the backward's handling of a non-uniform cotangent is checked too.

The float64 reference: on the CPU :func:`parity.reference.flce_reference` / ``cpo_reference`` (float64 CPU
copies, autograd). On CUDA the real shapes make CPU float64 far too slow (13-30 TFLOP per case), so
:func:`flce_reference_torch64` / :func:`cpo_reference_torch64` evaluate the same formulas in float64 *on the
device*, by chunks of rows (autograd per chunk; the mean's normalizers are computed first). They follow
``parity/reference.py`` choice for choice and are checked against it in ``tests/test_parity_suite.py``.

What counts as a failure (exit code 1), everything else is reported only:
* a twin (``torch`` / ``jax``) outside the SPEC accuracy bound of its dtype (:func:`accuracy_bounds`);
* a twin output that is non-finite where the reference is finite, has the wrong shape or dtype, or is
  missing (``db`` with a bias);
* a twin raising an exception other than ``NotImplementedError`` (that one means "not built yet": reported
  as "missing", like a missing module or function); the reference raising;
* an implementation writing to its inputs.
Bitwise differences and run-to-run nondeterminism are reported, not failures (until the twins match).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .cases import IGNORE_INDEX, Case, make_inputs, small_cases, torch_dtype

__all__ = [
    "OUTPUTS", "IMPLS", "TWINS", "PAIRS", "CpoCase", "make_cpo_inputs", "small_cpo_cases",
    "gpu_cases", "gpu_cpo_cases", "default_cases", "quick_cases", "select_cases", "case_meta",
    "accuracy_bounds", "rel_err", "ulp_stats", "bitwise_equal", "compare_pair", "ImplResult",
    "evaluate_case", "run_case", "run_suite", "summarize", "exit_code", "load_impls",
    "flce_reference_torch64", "cpo_reference_torch64", "device_slug",
]

OUTPUTS = ("loss", "dx", "dw", "db")
IMPLS = ("torch", "jax", "liger")
TWINS = ("torch", "jax")
PAIRS = (("torch", "jax"), ("torch", "liger"), ("jax", "liger"))

# SPEC §1 "Accuracy": (loss relative error, gradient relative-norm error); float16 takes the bfloat16 bounds.
_BOUNDS = {"float32": (1e-6, 5e-5), "bfloat16": (1e-5, 1e-2), "float16": (1e-5, 1e-2)}
#: bf16/fp16 gradients must also be within this factor of Liger's error on the same tensors (SPEC §1) ...
LIGER_FACTOR = 1.25
#: ... unless both errors are below this floor (float64-level round-off, e.g. all-zero gradients).
LIGER_FLOOR = 1e-7

_F64 = torch.float64


# ================================================================================================ cases
@dataclass(frozen=True)
class CpoCase:
    """A ``fused_cpo_loss`` case (SPEC §3): ``x`` is ``[2*pairs, t, h]``, rows ``[0, pairs)`` chosen."""

    name: str
    pairs: int
    t: int
    h: int
    v: int
    dtype: str
    bias: bool = False
    loss_type: str = "sigmoid"
    beta: float = 0.1
    alpha: float = 1.0
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    average_log_prob: bool | None = None
    prompt_frac: float = 0.25     # leading tokens of each sequence set to ignore_index (the prompt)
    pad_frac: float = 0.1         # up to this fraction of trailing tokens set to ignore_index (padding)
    logit_scale: float = 1.0
    seed: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return (2 * self.pairs, self.t)

    @property
    def rows(self) -> int:
        return 2 * self.pairs * self.t

    @property
    def reduction(self) -> str:  # the loss is a scalar mean over pairs
        return "mean"

    def options(self) -> dict:
        """Keyword arguments of ``fused_cpo_loss`` (without ``bias``)."""
        return {"beta": self.beta, "alpha": self.alpha, "label_smoothing": self.label_smoothing,
                "loss_type": self.loss_type, "simpo_gamma": self.simpo_gamma,
                "average_log_prob": self.average_log_prob}

    def resolved_average_log_prob(self) -> bool:
        if self.average_log_prob is not None:
            return bool(self.average_log_prob)
        return self.loss_type in ("ipo", "simpo")


def make_cpo_inputs(case: CpoCase, device="cpu") -> dict:
    """Torch tensors for a CPO case, deterministic from ``case.seed`` (on any device): ``x`` ~ N(0, 1),
    ``weight`` ~ N(0, (logit_scale/√h)²), ``bias`` ~ N(0, (0.1·logit_scale)²), ``targets`` int64 uniform in
    [0, v) with a prompt prefix and a random padding suffix set to ``IGNORE_INDEX`` (at least one valid token
    per sequence)."""
    g = torch.Generator().manual_seed(case.seed)
    dt = torch_dtype(case.dtype)
    b2, t, h, v = 2 * case.pairs, case.t, case.h, case.v
    x = torch.randn(b2, t, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (case.logit_scale / math.sqrt(h))
    targets = torch.randint(0, v, (b2, t), generator=g)
    prompt = min(t - 1, round(case.prompt_frac * t))
    targets[:, :prompt] = IGNORE_INDEX
    max_pad = min(t - prompt - 1, round(case.pad_frac * t))
    if max_pad > 0:
        pads = torch.randint(0, max_pad + 1, (b2,), generator=g)
        for k in range(b2):
            if int(pads[k]):
                targets[k, t - int(pads[k]):] = IGNORE_INDEX
    bias = (torch.randn(v, generator=g) * (0.1 * case.logit_scale)).to(dt) if case.bias else None
    out = {"x": x.to(dt), "weight": weight.to(dt), "targets": targets, "bias": bias, "class_weights": None}
    return {k: (a.to(device) if a is not None else None) for k, a in out.items()}


def small_cpo_cases() -> list[CpoCase]:
    """Tiny CPO cases for the CPU interpreters: each loss type, both dtypes, bias, label smoothing."""
    return [
        CpoCase("cpo_sigmoid_f32", 2, 8, 32, 130, "float32", seed=21),
        CpoCase("cpo_sigmoid_ls_bias_bf16", 2, 8, 32, 130, "bfloat16", bias=True, label_smoothing=0.1, seed=22),
        CpoCase("simpo_bf16", 2, 8, 32, 130, "bfloat16", loss_type="simpo", seed=23),
        CpoCase("ipo_f32", 1, 12, 16, 130, "float32", loss_type="ipo", seed=24),
        CpoCase("hinge_f32", 2, 6, 16, 130, "float32", loss_type="hinge", beta=0.5, seed=25),
    ]


def gpu_cases() -> list[Case]:
    """The real shapes (SPEC anchors): bf16 at (N, H, V) = (4096, 4096, 128256) over the option grid
    (each option, three reductions, all options at once), (8192, 2304, 256000) over the reductions and all
    options, both with half the rows ignored, and float32 at (1024, 1024, 32000)."""
    a = dict(shape=(4096,), h=4096, v=128256, dtype="bfloat16")
    b = dict(shape=(8192,), h=2304, v=256000, dtype="bfloat16")
    f = dict(shape=(1024,), h=1024, v=32000, dtype="float32")
    all_opts = dict(bias=True, label_smoothing=0.1, z_loss=1e-4, softcap=30.0, class_weights=True,
                    logit_scale=30.0)
    out = []
    for tag, shp, seed in (("4k_4k_128k", a, 100), ("8k_2304_256k", b, 200)):
        out += [Case(f"bf16_{tag}_mean", **shp, seed=seed),
                Case(f"bf16_{tag}_sum", **shp, reduction="sum", seed=seed + 1),
                Case(f"bf16_{tag}_none", **shp, reduction="none", seed=seed + 2)]
        if tag == "4k_4k_128k":
            out += [Case(f"bf16_{tag}_bias", **shp, bias=True, seed=seed + 3),
                    Case(f"bf16_{tag}_label_smoothing", **shp, label_smoothing=0.1, seed=seed + 4),
                    Case(f"bf16_{tag}_z_loss", **shp, z_loss=1e-4, seed=seed + 5),
                    Case(f"bf16_{tag}_softcap", **shp, softcap=30.0, logit_scale=30.0, seed=seed + 6),
                    Case(f"bf16_{tag}_class_weights", **shp, class_weights=True, seed=seed + 7)]
        out.append(Case(f"bf16_{tag}_all_options", **shp, **all_opts, seed=seed + 8))
        # Half the rows ignored: the chunks past the valid rows are skipped (kept dZ at 4k, accumulated at 8k).
        out.append(Case(f"bf16_{tag}_half_ignored", **shp, ignore_frac=0.5, seed=seed + 9))
    out += [Case("f32_1k_1k_32k_mean", **f, seed=300),
            Case("f32_1k_1k_32k_large_logits", **f, logit_scale=50.0, seed=301),
            Case("f32_1k_1k_32k_none", **f, reduction="none", seed=302),
            Case("f32_1k_1k_32k_all_options", **f, **all_opts, seed=303)]
    return out


def gpu_cpo_cases() -> list[CpoCase]:
    """CPO at the anchor shape of DESIGN.md (B=2 pairs, T=1024, H=4096, V=128256, bf16), each loss type, and
    at B=8 pairs."""
    s = dict(pairs=2, t=1024, h=4096, v=128256, dtype="bfloat16")
    return [CpoCase("cpo_sigmoid_bf16_2x1024_4k_128k", **s, seed=400),
            CpoCase("cpo_sigmoid_ls_bias_bf16_2x1024_4k_128k", **s, bias=True, label_smoothing=0.1, seed=401),
            CpoCase("simpo_bf16_2x1024_4k_128k", **s, loss_type="simpo", seed=402),
            CpoCase("ipo_bf16_2x1024_4k_128k", **s, loss_type="ipo", seed=403),
            CpoCase("hinge_bf16_2x1024_4k_128k", **s, loss_type="hinge", seed=404),
            # 8 pairs: all rows' dZ would outgrow the dW accumulator, so groups of whole pairs run.
            CpoCase("cpo_sigmoid_bf16_8x1024_4k_128k", **{**s, "pairs": 8}, seed=405)]


def default_cases(device: str, *, cpo: bool = True) -> list:
    """The default table: small cases in the interpreters on a CPU, the real shapes on a GPU."""
    if device == "cpu":
        return list(small_cases()) + (small_cpo_cases() if cpo else [])
    return gpu_cases() + (gpu_cpo_cases() if cpo else [])


_QUICK_CPU = ("f32_basic", "bias_bf16", "none_3d", "all_options_bf16", "cpo_sigmoid_f32")
_QUICK_GPU = ("bf16_4k_4k_128k_mean", "bf16_8k_2304_256k_mean", "f32_1k_1k_32k_all_options",
              "cpo_sigmoid_bf16_2x1024_4k_128k")


def quick_cases(cases: list, device: str) -> list:
    """``--quick``: a few representative cases of ``cases`` (the first four when none of the usual ones exist)."""
    wanted = _QUICK_CPU if device == "cpu" else _QUICK_GPU
    picked = [c for c in cases if c.name in wanted]
    return picked or cases[:4]


def select_cases(cases: list, patterns: list[str] | None) -> list:
    """Cases whose name matches any pattern (``fnmatch`` wildcards; a plain word matches as a substring)."""
    if not patterns:
        return list(cases)
    pats = [p if any(ch in p for ch in "*?[") else f"*{p}*" for p in patterns]
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in pats)]


def case_kind(case) -> str:
    return "cpo" if isinstance(case, CpoCase) else "flce"


def case_meta(case) -> dict:
    """A JSON-friendly description of a case."""
    d = dataclasses.asdict(case)
    d["kind"] = case_kind(case)
    d["shape"] = list(case.shape)
    d["rows"] = case.rows
    return d


def case_inputs(case, device) -> dict:
    return make_cpo_inputs(case, device) if isinstance(case, CpoCase) else make_inputs(case, device)


def grad_output_for(case, device) -> torch.Tensor | None:
    """The cotangent of the loss: None (1) for scalar losses, a fixed float32 tensor in [0.5, 1.5) for "none"."""
    if case_kind(case) == "flce" and case.reduction == "none":
        g = torch.Generator().manual_seed(10_000 + case.seed)
        return (0.5 + torch.rand(case.shape, generator=g)).to(device)
    return None


# ================================================================================================ measures
def _dtype_name(dt) -> str:
    return str(dt).removeprefix("torch.")


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24  # elements per chunk in the device-side measures (bounded temporaries at the real shapes)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every bit equal (same shape and dtype required; -0 != +0; NaNs equal only with the same payload)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    if a.is_floating_point():
        iv = _INT_VIEW[a.element_size()]
        return bool(torch.equal(_flat(a).view(iv), _flat(b).view(iv)))
    return bool(torch.equal(a, b))


def _ordered(bits: torch.Tensor, nbits: int) -> torch.Tensor:
    """Sign-magnitude bit patterns (int64, unsigned) -> a monotonic integer line; +0 and -0 both map to 0."""
    sign = bits >> (nbits - 1)
    mag = bits & ((1 << (nbits - 1)) - 1)
    return torch.where(sign == 1, -mag, mag)


def ulp_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """``(max_ulp, n_diff)`` between two float tensors of the same shape, in their common dtype.

    The conventions of :func:`parity.reference.ulp_distance`: +0 and -0 are 0 ULP apart, NaN vs NaN is 0,
    NaN vs a number is ``2**bits - 1``. Computed on the tensors' device, in chunks.
    """
    if a.shape != b.shape:
        raise ValueError(f"ulp_stats: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.dtype != b.dtype or not a.is_floating_point():
        raise ValueError(f"ulp_stats: need one float dtype, got {a.dtype} and {b.dtype}")
    if b.device != a.device:
        b = b.to(a.device)
    nbits = 8 * a.element_size()
    iv = _INT_VIEW[a.element_size()]
    worst = (1 << nbits) - 1
    mask = (1 << nbits) - 1
    fa, fb = _flat(a), _flat(b)
    max_ulp, n_diff = 0, 0
    for s in range(0, fa.numel(), _CHUNK):
        ca, cb = fa[s:s + _CHUNK], fb[s:s + _CHUNK]
        oa = _ordered(ca.view(iv).to(torch.int64) & mask, nbits)
        ob = _ordered(cb.view(iv).to(torch.int64) & mask, nbits)
        d = (oa - ob).abs()
        na, nb = torch.isnan(ca), torch.isnan(cb)
        d = torch.where(na & nb, torch.zeros_like(d), d)
        d = torch.where(na ^ nb, torch.full_like(d, worst), d)
        max_ulp = max(max_ulp, int(d.max()))
        n_diff += int((d > 0).sum())
    return max_ulp, n_diff


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖a − ref‖ / ‖ref‖`` in float64 (``‖a − ref‖`` when ``‖ref‖ == 0``; ``inf`` when ``a`` holds a NaN or
    the difference is not finite): the conventions of :func:`parity.reference.rel_err`, on the device."""
    if a.shape != ref.shape:
        raise ValueError(f"rel_err: shapes differ: {tuple(a.shape)} vs {tuple(ref.shape)}")
    if ref.device != a.device:
        ref = ref.to(a.device)
    fa, fr = _flat(a), _flat(ref)
    num2 = torch.zeros((), dtype=_F64, device=a.device)
    den2 = torch.zeros((), dtype=_F64, device=a.device)
    has_nan = torch.zeros((), dtype=torch.bool, device=a.device)
    for s in range(0, fa.numel(), _CHUNK):
        ca, cr = fa[s:s + _CHUNK].to(_F64), fr[s:s + _CHUNK].to(_F64)
        has_nan |= torch.isnan(ca).any()
        num2 += torch.square(ca - cr).sum()
        den2 += torch.square(cr).sum()
    if bool(has_nan):
        return float("inf")
    num, den = math.sqrt(float(num2)), math.sqrt(float(den2))
    if not math.isfinite(num):
        return float("inf")
    return num / den if den > 0 else num


def compare_pair(a: torch.Tensor | None, b: torch.Tensor | None) -> dict | None:
    """Bitwise equality and ULP distance of two outputs (None when either is missing)."""
    if a is None or b is None:
        return None
    out = {"bitwise": bitwise_equal(a, b), "max_ulp": None, "n_diff": None, "numel": int(a.numel()),
           "note": ""}
    if a.shape != b.shape:
        out["note"] = f"shapes differ: {list(a.shape)} vs {list(b.shape)}"
    elif a.dtype != b.dtype:
        out["note"] = f"dtypes differ: {_dtype_name(a.dtype)} vs {_dtype_name(b.dtype)}"
    elif out["bitwise"]:
        out["max_ulp"], out["n_diff"] = 0, 0
    else:
        out["max_ulp"], out["n_diff"] = ulp_stats(a, b)
    return out


def accuracy_bounds(dtype: str) -> tuple[float, float]:
    """(loss bound, gradient bound) of SPEC §1 "Accuracy" for the case's input dtype."""
    if dtype not in _BOUNDS:
        raise ValueError(f"no SPEC accuracy bound for dtype {dtype!r}")
    return _BOUNDS[dtype]


def _fmt(e) -> str:
    return "nan" if e is None else f"{e:.2e}"


def judge(output: str, dtype: str, err: float | None, liger_err: float | None) -> tuple[bool, str, float]:
    """(ok, reason, bound) of the SPEC accuracy rule for one twin output.

    float32: loss <= 1e-6, gradients <= 5e-5. bfloat16/float16: loss <= 1e-5, gradients <= 1e-2 and
    <= 1.25x Liger's error on the same tensors when Liger ran (not applied below ``LIGER_FLOOR``).
    """
    loss_b, grad_b = accuracy_bounds(dtype)
    bound = loss_b if output == "loss" else grad_b
    if err is None or not math.isfinite(err):
        return False, f"relative error {_fmt(err)} (non-finite output)", bound
    if err > bound:
        return False, f"relative error {err:.3e} > {bound:.0e}", bound
    if (output != "loss" and dtype != "float32" and liger_err is not None and math.isfinite(liger_err)
            and err > LIGER_FACTOR * liger_err and err > LIGER_FLOOR):
        return False, f"relative error {err:.3e} > {LIGER_FACTOR}x Liger's {liger_err:.3e}", bound
    return True, "", bound


# ================================================================================================ results
@dataclass
class ImplResult:
    """What one implementation gave on one case."""

    status: str                                   # "ok" | "missing" | "n/a" | "error"
    reason: str = ""
    outputs: dict[str, torch.Tensor | None] = field(default_factory=dict)   # run 1
    deterministic: dict[str, bool | None] = field(default_factory=dict)     # run 1 vs run 2, bitwise
    seconds: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _expected_dtypes(meta: dict) -> dict[str, str]:
    dt = meta["dtype"]
    return {"loss": "float32", "dx": dt, "dw": dt, "db": dt if meta.get("bias") else None}


def evaluate_case(meta: dict, results: dict[str, ImplResult], ref: dict | None, *,
                  ref_status: str = "ok", ref_reason: str = "", mutated: list[str] | None = None) -> dict:
    """Turn the implementations' outputs and the float64 reference into the case's report entry.

    ``meta``: :func:`case_meta` (needs ``dtype``, ``bias``, ``name``); ``results``: impl -> ImplResult;
    ``ref``: output -> float64 tensor (or None). Returns a JSON-friendly dict with ``outputs`` (per output:
    dtype, errors, determinism, pairs, bound, verdict per twin) and ``violations`` (SPEC failures).
    """
    dtype = meta["dtype"]
    expected = _expected_dtypes(meta)
    outputs_present = [o for o in OUTPUTS if expected[o] is not None]
    violations: list[str] = []
    entry: dict[str, Any] = {
        "case": meta["name"], "meta": meta,
        "impls": {k: {"status": r.status, "reason": r.reason, "seconds": r.seconds, "notes": r.notes}
                  for k, r in results.items()},
        "reference": {"status": ref_status, "reason": ref_reason},
        "outputs": {}, "violations": violations, "explain": None,
    }
    for impl in TWINS:
        r = results.get(impl)
        if r is not None and r.status == "error":
            violations.append(f"{impl}: raised {r.reason}")
    if ref_status == "error":
        violations.append(f"reference: raised {ref_reason}")
    for who in mutated or []:
        violations.append(f"{who}: wrote to its inputs")

    for o in outputs_present:
        exp_dt = expected[o]
        ref_t = ref.get(o) if ref else None
        rec: dict[str, Any] = {"dtype": exp_dt, "err": {}, "deterministic": {}, "pairs": {}, "verdict": {},
                               "bound": None}
        tensors: dict[str, torch.Tensor | None] = {}
        for impl, r in results.items():
            t = r.outputs.get(o) if r.status == "ok" else None
            tensors[impl] = t
            rec["deterministic"][impl] = r.deterministic.get(o) if r.status == "ok" else None
            if t is None:
                rec["err"][impl] = None
                continue
            if ref_t is not None and tuple(t.shape) == tuple(ref_t.shape):
                rec["err"][impl] = rel_err(t, ref_t)
            else:
                rec["err"][impl] = None
        for a, b in PAIRS:
            if a in results and b in results:
                rec["pairs"][f"{a}~{b}"] = compare_pair(tensors.get(a), tensors.get(b))
        liger_err = rec["err"].get("liger")
        for impl in TWINS:
            r = results.get(impl)
            if r is None or r.status != "ok":
                rec["verdict"][impl] = r.status if r is not None else "n/a"
                continue
            t = tensors[impl]
            problems = []
            if t is None:
                problems.append("missing output")
            else:
                if _dtype_name(t.dtype) != exp_dt:
                    problems.append(f"dtype {_dtype_name(t.dtype)}, expected {exp_dt}")
                if ref_t is not None and tuple(t.shape) != tuple(ref_t.shape):
                    problems.append(f"shape {list(t.shape)}, expected {list(ref_t.shape)}")
            if ref_t is not None and not problems:
                ok, why, bound = judge(o, dtype, rec["err"][impl], liger_err)
                rec["bound"] = bound
                if not ok:
                    problems.append(why)
            if problems:
                rec["verdict"][impl] = "FAIL"
                violations.append(f"{impl} {o}: " + "; ".join(problems))
            else:
                rec["verdict"][impl] = "ok" if ref_t is not None else "unchecked"
        if rec["bound"] is None:
            rec["bound"] = accuracy_bounds(dtype)[0 if o == "loss" else 1]
        entry["outputs"][o] = rec
    return entry


# ================================================================================================ implementations
@dataclass
class Impl:
    """A loaded implementation: a callable per kind ("flce", "cpo"), or why it is missing."""

    name: str
    fns: dict[str, Callable | None]
    why: dict[str, str]


def _import(modname: str):
    """(module, "") or (None, why). A module (or a dependency) that is not there is "missing"; one that is
    there but fails to import (``cannot import name ...``, a SyntaxError, ...) is an error."""
    try:
        return importlib.import_module(modname), ""
    except ModuleNotFoundError as e:
        return None, f"cannot import {modname}: {e}"
    except Exception as e:  # a module that is there but broken
        return None, f"ERROR importing {modname}: {type(e).__name__}: {e}"


def load_impls(names=IMPLS) -> dict[str, Impl]:
    """Import the implementations; a missing module or function is recorded, never raised."""
    out = {}
    for name in names:
        fns, why = {}, {}
        if name in ("torch", "jax"):
            mod, err = _import(f"fce_{name}")
            for kind, attr in (("flce", "fused_lce"), ("cpo", "fused_cpo_loss")):
                fn = getattr(mod, attr, None) if mod is not None else None
                fns[kind] = fn
                why[kind] = err or ("" if fn is not None else f"fce_{name}.{attr} does not exist yet")
        elif name == "liger":
            mod, err = _import("liger_kernel.transformers")
            fns["flce"] = getattr(mod, "LigerFusedLinearCrossEntropyLoss", None) if mod else None
            why["flce"] = err or ("" if fns["flce"] else "no LigerFusedLinearCrossEntropyLoss")
            mod2, err2 = _import("liger_kernel.chunked_loss")
            cpo = getattr(mod2, "LigerFusedLinearCPOLoss", None) if mod2 else None
            simpo = getattr(mod2, "LigerFusedLinearSimPOLoss", None) if mod2 else None
            fns["cpo"] = (cpo, simpo) if cpo is not None else None
            why["cpo"] = err2 or ("" if cpo else "no LigerFusedLinearCPOLoss")
        else:
            raise ValueError(f"unknown implementation {name!r}; known: {IMPLS}")
        out[name] = Impl(name, fns, why)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    """A fresh autograd leaf on the same memory (``detach`` shares the storage)."""
    return None if t is None else t.detach().requires_grad_(True)


def _grad(t):
    return None if t is None else t.grad


# ---- torch twin
def _torch_flce(fn, case, inp, g):
    x, w, b = _leaf(inp["x"]), _leaf(inp["weight"]), _leaf(inp["bias"])
    loss = fn(x, w, inp["targets"], bias=b, class_weights=inp["class_weights"], **case.options())
    loss.backward(g if g is not None else None)
    return {"loss": loss.detach(), "dx": x.grad, "dw": w.grad, "db": _grad(b)}


def _torch_cpo(fn, case, inp, g):
    x, w, b = _leaf(inp["x"]), _leaf(inp["weight"]), _leaf(inp["bias"])
    loss = fn(x, w, inp["targets"], bias=b, **case.options())
    loss.backward()
    return {"loss": loss.detach(), "dx": x.grad, "dw": w.grad, "db": _grad(b)}


# ---- JAX twin (through the bridge)
def _jax_inputs(inp, g):
    from .bridge import same_memory, targets_to_jax, to_jax

    j = {k: (to_jax(inp[k]) if inp.get(k) is not None else None) for k in ("x", "weight", "bias", "class_weights")}
    j["targets"] = targets_to_jax(inp["targets"])
    j["g"] = to_jax(g) if g is not None else None
    notes = []
    if not same_memory(inp["targets"], j["targets"]):
        notes.append(f"targets: explicit {_dtype_name(inp['targets'].dtype)}->int32 copy (JAX x64 off)")
    return j, notes


def _jax_step(fn, kind, case, has_bias, has_g):
    import jax

    opts = case.options()
    if kind == "flce":
        def f(x, w, b, t, cw):
            return fn(x, w, t, bias=b, class_weights=cw, **opts)
    else:
        def f(x, w, b, t, cw):
            return fn(x, w, t, bias=b, **opts)
    argnums = (0, 1, 2) if has_bias else (0, 1)
    if has_g:
        def step(x, w, b, t, cw, g):
            if has_bias:
                loss, vjp = jax.vjp(lambda x_, w_, b_: f(x_, w_, b_, t, cw), x, w, b)
                return loss, vjp(g)
            loss, vjp = jax.vjp(lambda x_, w_: f(x_, w_, None, t, cw), x, w)
            return loss, vjp(g) + (None,)
    else:
        def step(x, w, b, t, cw, g):
            loss, grads = jax.value_and_grad(f, argnums=argnums)(x, w, b, t, cw)
            return loss, tuple(grads) + ((None,) if not has_bias else ())
    return jax.jit(step)


def _jax_run_factory(fn, kind, case, inp, g):
    from .bridge import to_torch

    j, notes = _jax_inputs(inp, g)
    step = _jax_step(fn, kind, case, j["bias"] is not None, j["g"] is not None)

    def run():
        loss, (dx, dw, db) = step(j["x"], j["weight"], j["bias"], j["targets"], j["class_weights"], j["g"])
        loss.block_until_ready()
        return {"loss": to_torch(loss), "dx": to_torch(dx), "dw": to_torch(dw),
                "db": to_torch(db) if db is not None else None}
    return run, notes


# ---- Liger
def _liger_flce(cls, case, inp, g):
    h = inp["x"].shape[-1]
    lead = tuple(inp["x"].shape[:-1])
    x = inp["x"].detach().reshape(-1, h).requires_grad_(True)      # a view: same memory
    w, b = _leaf(inp["weight"]), _leaf(inp["bias"])
    o = case.options()
    loss_fn = cls(ce_weight=inp["class_weights"], ignore_index=IGNORE_INDEX, lse_square_scale=o["z_loss"],
                  label_smoothing=o["label_smoothing"], reduction=o["reduction"], softcap=o["softcap"])
    loss = loss_fn(w, x, inp["targets"].reshape(-1), b)
    loss.backward(g.reshape(-1) if g is not None else None)
    loss = loss.detach()
    if o["reduction"] == "none":
        loss = loss.reshape(lead)
    return {"loss": loss, "dx": x.grad.reshape(inp["x"].shape), "dw": w.grad, "db": _grad(b)}


def _liger_cpo_support(case: CpoCase) -> str:
    """"" when Liger computes this CPO case, else why not."""
    if case.loss_type not in ("sigmoid", "simpo"):
        return f"Liger has no CPO loss_type {case.loss_type!r} (sigmoid: LigerFusedLinearCPOLoss, simpo: ...SimPOLoss)"
    if case.loss_type == "simpo" and not case.resolved_average_log_prob():
        return "LigerFusedLinearSimPOLoss always averages the log-probs (average_log_prob=False unsupported)"
    return ""


def _liger_cpo(classes, case, inp, g):
    cpo_cls, simpo_cls = classes
    x, w, b = _leaf(inp["x"]), _leaf(inp["weight"]), _leaf(inp["bias"])
    if case.loss_type == "sigmoid":
        loss_fn = cpo_cls(ignore_index=IGNORE_INDEX, beta=case.beta, alpha=case.alpha,
                          label_smoothing=case.label_smoothing, compute_nll_loss=True, compiled=False,
                          average_log_prob=case.resolved_average_log_prob())
    else:
        loss_fn = simpo_cls(ignore_index=IGNORE_INDEX, beta=case.beta, alpha=case.alpha,
                            label_smoothing=case.label_smoothing, compute_nll_loss=True, compiled=False,
                            gamma=case.simpo_gamma)
    out = loss_fn(w, x, inp["targets"], b)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return {"loss": loss.detach(), "dx": x.grad, "dw": w.grad, "db": _grad(b)}


def liger_support(case, device: str) -> str:
    """"" when Liger can run ``case`` here, else the reason ("n/a")."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if case_kind(case) == "flce":
        if device == "cpu" and not interpreted:
            return "Liger's Triton kernels need a GPU or TRITON_INTERPRET=1"
        if interpreted and (case.softcap is not None or case.class_weights):
            # liger_cross_entropy_kernel calls `.to(tl.float32)` on Python floats (softcap, the class-weight
            # sums): fine when compiled, an AttributeError in the Triton interpreter (liger-kernel 0.8.5).
            what = "softcap" if case.softcap is not None else "class-weight"
            return f"Liger's {what} path does not run in the Triton interpreter (GPU only)"
    if case_kind(case) == "cpo":
        return _liger_cpo_support(case)
    return ""


def _run_twice(run: Callable[[], dict], device: str, result: ImplResult) -> None:
    outs = []
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        o = run()
        _sync(device)
        result.seconds.append(round(time.perf_counter() - t0, 4))
        outs.append(o)
    first, second = outs
    result.outputs = first
    for k, v in first.items():
        w = second.get(k)
        result.deterministic[k] = None if v is None or w is None else bitwise_equal(v, w)


def run_impl(impl: Impl, case, inp: dict, g, device: str) -> ImplResult:
    """Run one implementation twice on ``inp``; never raises (errors become the result's status)."""
    kind = case_kind(case)
    fn = impl.fns.get(kind)
    if fn is None:
        status = "error" if impl.why.get(kind, "").startswith("ERROR") else "missing"
        return ImplResult(status, impl.why.get(kind, "missing"))
    if impl.name == "liger":
        why = liger_support(case, device)
        if why:
            return ImplResult("n/a", why)
    res = ImplResult("ok")
    try:
        if impl.name == "torch":
            body = _torch_flce if kind == "flce" else _torch_cpo
            run = lambda: body(fn, case, inp, g)  # noqa: E731
        elif impl.name == "jax":
            run, res.notes = _jax_run_factory(fn, kind, case, inp, g)
        else:
            body = _liger_flce if kind == "flce" else _liger_cpo
            run = lambda: body(fn, case, inp, g)  # noqa: E731
        _run_twice(run, device, res)
    except NotImplementedError as e:
        return ImplResult("missing", f"NotImplementedError: {e}")
    except Exception as e:  # noqa: BLE001 - reported, and a failure for the twins
        tb = traceback.format_exc(limit=-3)
        return ImplResult("error", f"{type(e).__name__}: {e}", notes=[tb])
    return res


# ================================================================================================ reference
def _chunk_rows(v: int, budget_bytes: int, per_row_factor: int = 1) -> int:
    return max(1, budget_bytes // max(1, v * 8 * per_row_factor))


def flce_reference_torch64(x, weight, targets, *, bias=None, ignore_index=-100, reduction="mean",
                           label_smoothing=0.0, z_loss=0.0, softcap=None, class_weights=None,
                           grad_output=None, chunk_bytes: int = 1 << 30) -> dict:
    """SPEC §1 in float64 on the tensors' device, by chunks of rows: loss, dx, dw, db (float64 tensors).

    The same formulas and choices as :func:`parity.reference.flce_reference` (ignored rows are outside the
    loss graph; "mean" divides the CE part by D = Σ w_y and the z-loss part by n, 0 when those are 0).
    """
    dev = x.device
    v, h = weight.shape
    lead = tuple(targets.shape)
    X = x.detach().reshape(-1, h)
    T = targets.detach().reshape(-1).to(torch.int64)
    eps, s = float(label_smoothing), float(z_loss)
    W = weight.detach().to(_F64).requires_grad_(True)
    B = bias.detach().to(_F64).requires_grad_(True) if bias is not None else None
    cw = class_weights.detach().to(dev, _F64) if class_weights is not None else torch.ones(v, dtype=_F64,
                                                                                            device=dev)
    valid_all = T != ignore_index
    n = int(valid_all.sum())
    d = float(cw[T[valid_all]].sum()) if n else 0.0
    if reduction == "none":
        g_rows = (torch.ones(lead, dtype=_F64, device=dev) if grad_output is None
                  else grad_output.detach().to(dev, _F64).expand(lead)).reshape(-1)
    else:
        g_scalar = 1.0 if grad_output is None else float(grad_output)
    dx = torch.zeros(X.shape, dtype=_F64, device=dev)
    dw = torch.zeros((v, h), dtype=_F64, device=dev)
    db = torch.zeros(v, dtype=_F64, device=dev) if B is not None else None
    loss_rows = torch.zeros(X.shape[0], dtype=_F64, device=dev)
    loss_ce = torch.zeros((), dtype=_F64, device=dev)
    loss_z = torch.zeros((), dtype=_F64, device=dev)
    step = _chunk_rows(v, chunk_bytes)
    for s0 in range(0, X.shape[0], step):
        t_c = T[s0:s0 + step]
        idx = (t_c != ignore_index).nonzero().squeeze(1)
        if idx.numel() == 0:
            continue
        y = t_c[idx]
        xc = X[s0:s0 + step][idx].to(_F64).requires_grad_(True)
        r = xc @ W.T
        if B is not None:
            r = r + B
        z = r if softcap is None else softcap * torch.tanh(r / softcap)
        lse = torch.logsumexp(z, dim=1)
        zy = z.gather(1, y[:, None]).squeeze(1)
        ce = (1.0 - eps) * cw[y] * (lse - zy)
        if eps > 0:
            ce = ce + (eps / v) * ((lse[:, None] - z) * cw).sum(dim=1)
        zl = s * lse * lse if s > 0 else torch.zeros_like(lse)
        if reduction == "none":
            rows = ce + zl
            total = (rows * g_rows[s0:s0 + step][idx]).sum()
            loss_rows[s0 + idx] = rows.detach()
        elif reduction == "sum":
            total = (ce + zl).sum() * g_scalar
            loss_ce += (ce + zl).sum().detach()
        else:
            part_ce = ce.sum() / d if d > 0 else ce.sum() * 0.0
            part_z = zl.sum() / n
            total = (part_ce + part_z) * g_scalar
            loss_ce += part_ce.detach()
            loss_z += part_z.detach()
        leaves = [xc, W] + ([B] if B is not None else [])
        grads = torch.autograd.grad(total, leaves, allow_unused=True)
        if grads[0] is not None:
            dx[s0 + idx] = grads[0]
        if grads[1] is not None:
            dw += grads[1]
        if B is not None and grads[2] is not None:
            db += grads[2]
        del r, z, lse, zy, ce, zl, total, grads, xc
    loss = loss_rows.reshape(lead) if reduction == "none" else loss_ce + loss_z
    return {"loss": loss, "dx": dx.reshape(x.shape), "dw": dw, "db": db}


def cpo_reference_torch64(x, weight, targets, *, bias=None, ignore_index=-100, beta=0.1, alpha=1.0,
                          label_smoothing=0.0, loss_type="sigmoid", simpo_gamma=0.5, average_log_prob=None,
                          chunk_bytes: int = 1 << 30) -> dict:
    """SPEC §3 in float64 on the tensors' device, by chunks of whole pairs: loss, dx, dw, db.

    The choices of :func:`parity.reference.cpo_reference` (a sequence without valid tokens has logp 0;
    NLL is 0 without valid chosen tokens).
    """
    F = torch.nn.functional
    dev = x.device
    v, h = weight.shape
    b2, tlen = x.shape[:2]
    nb = b2 // 2
    eps = float(label_smoothing)
    if average_log_prob is None:
        average_log_prob = loss_type in ("ipo", "simpo")
    T = targets.detach().to(torch.int64)
    n_chosen = int((T[:nb] != ignore_index).sum())
    W = weight.detach().to(_F64).requires_grad_(True)
    B = bias.detach().to(_F64).requires_grad_(True) if bias is not None else None
    dx = torch.zeros((b2, tlen, h), dtype=_F64, device=dev)
    dw = torch.zeros((v, h), dtype=_F64, device=dev)
    db = torch.zeros(v, dtype=_F64, device=dev) if B is not None else None
    loss = torch.zeros((), dtype=_F64, device=dev)
    step = max(1, chunk_bytes // max(1, 2 * tlen * v * 8))
    for p0 in range(0, nb, step):
        p1 = min(nb, p0 + step)
        sel = torch.cat([torch.arange(p0, p1), torch.arange(nb + p0, nb + p1)]).to(dev)
        k = p1 - p0
        tc = T[sel].reshape(-1)
        valid = tc != ignore_index
        idx = valid.nonzero().squeeze(1)
        seq = idx // tlen
        y = tc[idx]
        xc = x.detach()[sel].to(_F64).requires_grad_(True)
        r = xc.reshape(-1, h)[idx] @ W.T
        if B is not None:
            r = r + B
        tok = r.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(r, dim=1)
        logp = torch.zeros(2 * k, dtype=_F64, device=dev).index_add(0, seq, tok)
        if average_log_prob:
            logp = logp / torch.bincount(seq, minlength=2 * k).to(_F64).clamp(min=1.0)
        delta = logp[:k] - logp[k:]
        if loss_type == "simpo":
            delta = delta - simpo_gamma / beta
        if loss_type in ("sigmoid", "simpo"):
            per_pair = -(1.0 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
        elif loss_type == "hinge":
            per_pair = torch.relu(1.0 - beta * delta)
        elif loss_type == "ipo":
            per_pair = (delta - 1.0 / (2.0 * beta)) ** 2
        else:
            raise ValueError(f"loss_type: unknown {loss_type!r}")
        total = per_pair.sum() / nb
        if n_chosen > 0:
            total = total - alpha * tok[seq < k].sum() / n_chosen
        leaves = [xc, W] + ([B] if B is not None else [])
        grads = torch.autograd.grad(total, leaves, allow_unused=True)
        if grads[0] is not None:
            dx[sel] = grads[0]
        if grads[1] is not None:
            dw += grads[1]
        if B is not None and grads[2] is not None:
            db += grads[2]
        loss += total.detach()
    return {"loss": loss, "dx": dx, "dw": dw, "db": db}


def reference_for(case, inp: dict, g, device: str) -> tuple[dict, str]:
    """(float64 outputs on ``device``, which evaluator): ``parity.reference`` on the CPU, torch64 on CUDA."""
    kind = case_kind(case)
    if device == "cpu":
        ref_mod = importlib.import_module("parity.reference")
        if kind == "flce":
            r = ref_mod.flce_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"],
                                       class_weights=inp["class_weights"], grad_output=g, **case.options())
        else:
            r = ref_mod.cpo_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"],
                                      **case.options())
        out = {o: (torch.from_numpy(r[o]) if r.get(o) is not None else None) for o in OUTPUTS}
        return out, "parity.reference (float64, CPU)"
    if kind == "flce":
        r = flce_reference_torch64(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"],
                                   class_weights=inp["class_weights"], grad_output=g, **case.options())
    else:
        r = cpo_reference_torch64(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"], **case.options())
    return r, f"parity.suite torch64 (float64 on {device}, chunked)"


# ================================================================================================ driver
def _snapshot(inp: dict) -> dict:
    return {k: v.clone() for k, v in inp.items() if v is not None}


def _mutated(inp: dict, snap: dict) -> list[str]:
    return [k for k, v in snap.items() if not bitwise_equal(inp[k], v)]


def run_case(case, device: str, impls: dict[str, Impl], *, explain: bool = False,
             progress: Callable[[str], None] | None = None) -> dict:
    """Run every implementation and the reference on one case; return its report entry."""
    tick = progress or (lambda label: None)
    inp = case_inputs(case, device)
    g = grad_output_for(case, device)
    snap = _snapshot(inp)
    results: dict[str, ImplResult] = {}
    mutated: list[str] = []
    for name, impl in impls.items():
        tick(f"{case.name}: {name}")
        results[name] = run_impl(impl, case, inp, g, device)
        changed = _mutated(inp, snap)
        if changed:
            mutated.append(f"{name} ({', '.join(changed)})")
            inp = {k: (snap[k].clone() if k in snap else None) for k in inp}
    tick(f"{case.name}: float64 reference")
    ref, ref_status, ref_reason, ref_impl = None, "ok", "", ""
    try:
        ref, ref_impl = reference_for(case, inp, g, device)
    except ImportError as e:
        ref_status, ref_reason = "missing", f"{e}"
    except Exception as e:  # noqa: BLE001
        ref_status, ref_reason = "error", f"{type(e).__name__}: {e}"
    tick(f"{case.name}: compare" + (" + explain" if explain else ""))
    entry = evaluate_case(case_meta(case), results, ref, ref_status=ref_status, ref_reason=ref_reason,
                          mutated=mutated)
    entry["reference"]["impl"] = ref_impl
    if explain and case_kind(case) == "flce":
        pair = entry["outputs"]
        differs = any((rec["pairs"].get("torch~jax") or {}).get("bitwise") is False for rec in pair.values())
        if differs:
            from .explain import explain_case
            entry["explain"] = explain_case(case, inp, device)
    del inp, snap, results, ref
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return entry


def summarize(entries: list[dict]) -> dict:
    """Counts over the case entries, and the list of violations."""
    impl_status: dict[str, dict[str, int]] = {}
    violations = []
    bitwise = {"equal": 0, "different": 0, "n/a": 0}
    for e in entries:
        for impl, info in e["impls"].items():
            d = impl_status.setdefault(impl, {})
            d[info["status"]] = d.get(info["status"], 0) + 1
        violations += [f"{e['case']}: {v}" for v in e["violations"]]
        for rec in e["outputs"].values():
            p = rec["pairs"].get("torch~jax")
            if p is None:
                bitwise["n/a"] += 1
            elif p["bitwise"]:
                bitwise["equal"] += 1
            else:
                bitwise["different"] += 1
    nondeterministic: dict[str, list[str]] = {}
    for e in entries:
        for impl in e["impls"]:
            outs = [o for o, rec in e["outputs"].items() if rec["deterministic"].get(impl) is False]
            if outs:
                nondeterministic.setdefault(impl, []).append(f"{e['case']} ({', '.join(outs)})")
    ran = {impl: c.get("ok", 0) for impl, c in impl_status.items()}
    twins_missing = all(impl_status.get(t, {}).get("ok", 0) == 0 and impl_status.get(t, {}).get("error", 0) == 0
                        for t in TWINS)
    ref_missing = sum(1 for e in entries if e["reference"]["status"] == "missing")
    return {"cases": len(entries), "violations": violations, "impl_status": impl_status, "ran": ran,
            "nothing_ran": sum(ran.values()) == 0, "twins_missing": twins_missing,
            "reference_missing": ref_missing, "torch_jax_outputs": bitwise, "nondeterministic": nondeterministic}


def exit_code(summary: dict) -> int:
    """1 when any SPEC accuracy bound (or another failure, see the module docstring) was violated, else 0.

    When no implementation ran at all, 0 only if both twins are missing (nothing built yet), else 1.
    """
    if summary["violations"]:
        return 1
    if summary["nothing_ran"] and not summary["twins_missing"]:
        return 1
    return 0


def device_slug(device: str) -> str:
    """"cpu", or the GPU's name in lower case with dashes (e.g. "nvidia-h200")."""
    if device == "cpu":
        return "cpu"
    try:
        name = torch.cuda.get_device_name(torch.device(device))
    except Exception:
        name = device
    slug = "".join(ch if ch.isalnum() else "-" for ch in name.lower())
    while "--" in slug:
        slug = slug.replace("--", "-")
    return slug.strip("-") or "gpu"


def environment(device: str) -> dict:
    """Versions and the machine, for the report header."""
    env = {"device": device, "torch": torch.__version__, "python": sys.version.split()[0]}
    if device != "cpu":
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    from importlib.metadata import version
    for mod in ("jax", "jaxlib", "triton", "liger_kernel", "numpy"):
        try:
            env[mod] = version(mod.replace("_", "-"))
        except Exception:  # no distribution metadata: a package on PYTHONPATH, or not there at all
            try:
                env[mod] = getattr(importlib.import_module(mod), "__version__", "importable, version unknown")
            except Exception:
                env[mod] = "missing"
    try:
        import jax
        env["jax_devices"] = [str(d) for d in jax.devices()]
        env["jax_x64"] = bool(jax.config.read("jax_enable_x64"))
    except Exception as e:  # noqa: BLE001
        env["jax_devices"] = f"unavailable: {type(e).__name__}"
    env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "")
    return env


def _results(entries: list[dict], env: dict, impls: dict, seconds: float) -> dict:
    summary = summarize(entries)
    summary["seconds"] = round(seconds, 2)
    summary["missing"] = {name: {k: w for k, w in impl.why.items() if w} for name, impl in impls.items()}
    return {"environment": env, "cases": entries, "summary": summary, "exit_code": exit_code(summary)}


def run_suite(cases: list, device: str, *, impl_names=IMPLS, explain: bool = False, progress=None,
              on_case: Callable[[dict], None] | None = None) -> dict:
    """Run ``cases`` on ``device``; returns ``{"environment", "cases", "summary", "exit_code"}``.

    ``progress``: an object with ``start(total)``, ``step(label)`` and ``done()`` (see
    :class:`parity.report.Progress`), or None. ``on_case``: called with the partial results after each case
    (``python -m parity`` rewrites its files then, so a run cut short still leaves its finished cases).
    """
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False   # float32 GEMMs at IEEE float32 (SPEC §1)
        torch.backends.cudnn.allow_tf32 = False
    impls = load_impls(impl_names)
    steps_per_case = len(impls) + 2          # each implementation, the reference, the comparison
    if progress is not None:
        progress.start(len(cases) * steps_per_case)
    entries = []
    env = environment(device)
    t0 = time.perf_counter()
    for case in cases:
        entries.append(run_case(case, device, impls, explain=explain,
                                progress=progress.step if progress is not None else None))
        if on_case is not None:
            on_case(_results(entries, env, impls, time.perf_counter() - t0))
    if progress is not None:
        progress.done()
    return _results(entries, env, impls, time.perf_counter() - t0)

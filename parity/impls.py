"""The implementations under test, each run twice on the *same* tensors (:func:`parity.cases.case_inputs`):

* ``fce_torch`` on leaf tensors made with ``detach()`` (the same storage), gradients through
  ``torch.autograd.backward`` with the case's cotangents, ``validate=True``;
* ``fce_jax`` on the same memory through the zero-copy DLPack bridge (:mod:`parity.bridge`; int64 targets
  become an explicit int32 copy when JAX's x64 is off), gradients through ``jax.vjp`` under ``jax.jit``
  (the cotangent 1 of a scalar loss is what ``jax.grad`` uses);
* Liger-Kernel (``LigerFusedLinearCrossEntropyLoss`` / ``LigerFusedLinearCPOLoss`` / ``...SimPOLoss``)
  where it has the op and the options ("n/a" otherwise).

Each run returns the case's values (``loss``, or ``logp`` and ``entropy``) and ``dx``, ``dw``, ``db``. Nothing
here raises: a missing module or function is recorded in :class:`Impl`, an exception in :class:`ImplResult`.
"""

from __future__ import annotations

import importlib
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from .bridge import same_memory, targets_to_jax, to_jax, to_torch
from .cases import IGNORE_INDEX, call_options
from .measures import bitwise_equal, dtype_name

__all__ = ["IMPLS", "TWINS", "OPS", "Impl", "ImplResult", "load_impls", "liger_support", "run_impl", "set_runs"]

IMPLS = ("torch", "jax", "liger")
TWINS = ("torch", "jax")
#: The twins' function for each case kind.
OPS = {"flce": "fused_lce", "cpo": "fused_cpo_loss", "logprobs": "fused_token_logprobs"}
_GRADS = ("dx", "dw", "db")


@dataclass
class Impl:
    """A loaded implementation: a callable per case kind, or (in ``why``) why there is none."""

    name: str
    fns: dict[str, Callable | None]
    why: dict[str, str]


@dataclass
class ImplResult:
    """What one implementation gave on one case."""

    status: str                                   # "ok" | "missing" | "n/a" | "error"
    reason: str = ""
    outputs: dict[str, torch.Tensor | None] = field(default_factory=dict)   # run 1
    deterministic: dict[str, bool | None] = field(default_factory=dict)     # run 1 vs run 2, bitwise
    seconds: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ================================================================================================ loading
def _import(modname: str):
    """(module, "") or (None, why). A module (or a dependency) that is not there is "missing"; one that is
    there but fails to import (``cannot import name ...``, a SyntaxError, ...) is an error."""
    try:
        return importlib.import_module(modname), ""
    except ModuleNotFoundError as e:
        return None, f"cannot import {modname}: {e}"
    except Exception as e:  # a module that is there but broken
        return None, f"ERROR importing {modname}: {type(e).__name__}: {e}"


def _load_twin(name: str) -> Impl:
    mod, err = _import(f"fce_{name}")
    fns = {kind: getattr(mod, attr, None) if mod is not None else None for kind, attr in OPS.items()}
    why = {kind: err or ("" if fns[kind] is not None else f"fce_{name}.{attr} does not exist")
           for kind, attr in OPS.items()}
    return Impl(name, fns, why)


def _load_liger() -> Impl:
    mod, err = _import("liger_kernel.transformers")
    flce = getattr(mod, "LigerFusedLinearCrossEntropyLoss", None) if mod else None
    mod2, err2 = _import("liger_kernel.chunked_loss")
    cpo = getattr(mod2, "LigerFusedLinearCPOLoss", None) if mod2 else None
    simpo = getattr(mod2, "LigerFusedLinearSimPOLoss", None) if mod2 else None
    return Impl("liger", {"flce": flce, "cpo": (cpo, simpo) if cpo is not None else None, "logprobs": None},
                {"flce": err or ("" if flce else "no LigerFusedLinearCrossEntropyLoss"),
                 "cpo": err2 or ("" if cpo else "no LigerFusedLinearCPOLoss"),
                 "logprobs": ""})     # not missing: never there (liger_support says "n/a")


def load_impls(names=IMPLS) -> dict[str, Impl]:
    """Import the implementations; a missing module or function is recorded, never raised."""
    unknown = [n for n in names if n not in IMPLS]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; known: {IMPLS}")
    return {n: (_load_liger() if n == "liger" else _load_twin(n)) for n in names}


# ================================================================================================ runners
def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    """A fresh autograd leaf on the same memory (``detach`` shares the storage)."""
    return None if t is None else t.detach().requires_grad_(True)


def _grad(t):
    return None if t is None else t.grad


def _call_options(case, class_weights) -> dict:
    """The case's keyword arguments for the twins (tensors other than the bias included)."""
    kw = call_options(case)
    if case.kind == "flce":
        kw["class_weights"] = class_weights
    if case.kind == "logprobs":
        kw["return_entropy"] = True
    return kw


def _outputs(case, values, grads) -> dict:
    return {**dict(zip(case.values, values)), **dict(zip(_GRADS, grads))}


def _torch_factory(fn, case, inp):
    def run():
        x, w, b = _leaf(inp["x"]), _leaf(inp["weight"]), _leaf(inp["bias"])
        values = fn(x, w, inp["targets"], bias=b, validate=True, chunk_rows=None,
                    **_call_options(case, inp.get("class_weights")))
        values = values if isinstance(values, tuple) else (values,)
        torch.autograd.backward(values, [inp[f"grad_{v}"] for v in case.values])
        return _outputs(case, [v.detach() for v in values], (x.grad, w.grad, _grad(b)))
    return run, []


def _jax_step(fn, case, has_bias: bool):
    import jax
    import jax.numpy as jnp

    def step(x, w, b, t, cw, cots):
        def f(*leaves):
            return fn(leaves[0], leaves[1], t, bias=leaves[2] if has_bias else None, chunk_rows=None,
                      **_call_options(case, cw))
        values, vjp = jax.vjp(f, *((x, w, b) if has_bias else (x, w)))
        many = isinstance(values, tuple)
        vals = values if many else (values,)
        cot = tuple(jnp.ones_like(v) if c is None else c for v, c in zip(vals, cots))
        grads = vjp(cot if many else cot[0])
        return vals, tuple(grads) + ((None,) if not has_bias else ())
    return jax.jit(step)


def _jax_factory(fn, case, inp):
    import jax

    def j(t):
        return to_jax(t) if t is not None else None
    t = targets_to_jax(inp["targets"])
    notes = [] if same_memory(inp["targets"], t) else [
        f"targets: explicit {dtype_name(inp['targets'].dtype)}->int32 copy (JAX x64 off)"]
    args = (j(inp["x"]), j(inp["weight"]), j(inp["bias"]), t, j(inp.get("class_weights")),
            tuple(j(inp[f"grad_{v}"]) for v in case.values))
    step = _jax_step(fn, case, inp["bias"] is not None)

    def run():
        values, grads = jax.block_until_ready(step(*args))     # the timing covers the gradients too
        return _outputs(case, [to_torch(v) for v in values], [to_torch(g) if g is not None else None for g in grads])
    return run, notes


def _liger_flce(cls, case, inp) -> dict:
    h, lead = inp["x"].shape[-1], tuple(inp["x"].shape[:-1])
    x = inp["x"].detach().reshape(-1, h).requires_grad_(True)      # a view: same memory
    w, b = _leaf(inp["weight"]), _leaf(inp["bias"])
    o = case.options()
    loss_fn = cls(ce_weight=inp["class_weights"], ignore_index=IGNORE_INDEX, lse_square_scale=o["z_loss"],
                  label_smoothing=o["label_smoothing"], reduction=o["reduction"], softcap=o["softcap"],
                  use_token_scaling=case.token_scaling)
    loss = loss_fn(w, x, inp["targets"].reshape(-1), b)
    g = inp["grad_loss"]
    loss.backward(g.reshape(-1) if g is not None else None)
    loss = loss.detach().reshape(lead) if case.reduction == "none" else loss.detach()
    return {"loss": loss, "dx": x.grad.reshape(inp["x"].shape), "dw": w.grad, "db": _grad(b)}


def _liger_cpo(classes, case, inp) -> dict:
    cpo_cls, simpo_cls = classes
    x, w, b = _leaf(inp["x"]), _leaf(inp["weight"]), _leaf(inp["bias"])
    common = dict(ignore_index=IGNORE_INDEX, beta=case.beta, alpha=case.alpha,
                  label_smoothing=case.label_smoothing, compute_nll_loss=True, compiled=False)
    if case.loss_type == "sigmoid":
        loss_fn = cpo_cls(**common, average_log_prob=case.resolved_average_log_prob())
    else:
        loss_fn = simpo_cls(**common, gamma=case.simpo_gamma)
    out = loss_fn(w, x, inp["targets"], b)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return {"loss": loss.detach(), "dx": x.grad, "dw": w.grad, "db": _grad(b)}


def _liger_factory(fn, case, inp):
    body = _liger_flce if case.kind == "flce" else _liger_cpo
    return (lambda: body(fn, case, inp)), []


_FACTORIES = {"torch": _torch_factory, "jax": _jax_factory, "liger": _liger_factory}


def liger_support(case, device: str) -> str:
    """"" when Liger can run ``case`` here, else the reason ("n/a")."""
    if case.kind == "logprobs":
        return "Liger has no fused per-token log-prob op"
    if case.kind == "cpo":
        if case.loss_type not in ("sigmoid", "simpo"):
            return (f"Liger has no CPO loss_type {case.loss_type!r} (sigmoid: LigerFusedLinearCPOLoss, "
                    f"simpo: ...SimPOLoss)")
        if case.loss_type == "simpo" and not case.resolved_average_log_prob():
            return "LigerFusedLinearSimPOLoss always averages the log-probs (average_log_prob=False unsupported)"
        return ""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device == "cpu" and not interpreted:
        return "Liger's Triton kernels need a GPU or TRITON_INTERPRET=1"
    if case.normalizer is not None:
        return "Liger has no normalizer (the caller's mean denominators)"
    if case.bias and (case.bias_dtype or case.dtype) != case.dtype:
        # the logits chunk takes the bias dtype, and its dX GEMM then mixes dtypes (liger-kernel 0.8.5)
        return "Liger's dX GEMM raises for a bias dtype other than x's (float != BFloat16)"
    if interpreted and (case.softcap is not None or case.class_weights):
        # liger_cross_entropy_kernel calls `.to(tl.float32)` on Python floats (softcap, the class-weight
        # sums): fine when compiled, an AttributeError in the Triton interpreter (liger-kernel 0.8.5).
        what = "softcap" if case.softcap is not None else "class-weight"
        return f"Liger's {what} path does not run in the Triton interpreter (GPU only)"
    return ""


# ================================================================================================ running
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _run_twice(run: Callable[[], dict], device: str, result: ImplResult) -> None:
    outs = []
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        outs.append(run())
        _sync(device)
        result.seconds.append(round(time.perf_counter() - t0, 4))
    set_runs(result, *outs)


def set_runs(result: ImplResult, first: dict, second: dict) -> None:
    """The first run's outputs into ``result``, and per output whether the second run gave the same bits."""
    result.outputs = first
    for k, v in first.items():
        w = second.get(k)
        result.deterministic[k] = None if v is None or w is None else bitwise_equal(v, w)


def run_impl(impl: Impl, case, inp: dict, device: str) -> ImplResult:
    """Run one implementation twice on ``inp``; never raises (errors become the result's status).

    A missing function, or one that raises ``NotImplementedError``, is "missing" (a failure for a twin, see
    :mod:`parity.verdicts`); any other exception is "error".
    """
    if impl.name == "liger" and liger_support(case, device):
        return ImplResult("n/a", liger_support(case, device))
    fn = impl.fns.get(case.kind)
    if fn is None:
        why = impl.why.get(case.kind, "missing")
        return ImplResult("error" if why.startswith("ERROR") else "missing", why)
    res = ImplResult("ok")
    try:
        run, res.notes = _FACTORIES[impl.name](fn, case, inp)
        _run_twice(run, device, res)
    except NotImplementedError as e:
        return ImplResult("missing", f"NotImplementedError: {e}")
    except Exception as e:  # noqa: BLE001 - reported, and a failure for the twins
        return ImplResult("error", f"{type(e).__name__}: {e}", notes=[traceback.format_exc(limit=-3)])
    return res

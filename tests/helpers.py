"""Assertion helpers shared by the tests: SPEC accuracy bounds against the float64 reference."""

from __future__ import annotations

import numpy as np

from parity.cases import Case
from parity.reference import as_float64, rel_err
from parity.verdicts import BOUNDS

# SPEC "Accuracy" (parity.verdicts.BOUNDS, one table): (loss relative error, gradient relative-norm error).
TOLERANCES = {dtype: (b["loss"], b["grad"]) for dtype, b in BOUNDS.items()}
LOSS_KEYS = ("loss", "lse", "z_loss", "chosen_logps", "rejected_logps", "chosen_rewards",
             "rejected_rewards", "nll_loss")
GRAD_KEYS = ("dx", "dw", "db")


def dtype_name(dtype) -> str:
    """"float32" | "bfloat16" | "float16" from a string, a torch dtype, a numpy / ml_dtypes / jnp dtype."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = str(dtype)
        if not name.startswith("torch."):
            try:
                name = np.dtype(dtype).name
            except TypeError:
                pass
    name = name.removeprefix("torch.").removeprefix("jnp.")
    if name not in TOLERANCES:
        raise ValueError(f"no SPEC accuracy bound for dtype {dtype!r}")
    return name


def tolerances(dtype) -> tuple[float, float]:
    """(loss bound, gradient bound) of SPEC "Accuracy" for ``dtype``."""
    return TOLERANCES[dtype_name(dtype)]


def assert_close_to_reference(out: dict, ref: dict, dtype, *, accuracy_atol: float = 1e-6) -> dict:
    """Assert that ``out`` meets the SPEC accuracy bounds against ``ref`` (a float64 reference dict).

    ``out`` maps the reference's keys to arrays (torch, JAX or numpy; any dtype); keys missing from ``out``
    are not checked, but ``loss`` is required. Loss-like keys (loss, lse, z_loss, the CPO stats) use the loss
    bound, ``dx``/``dw``/``db`` the gradient bound, both as relative-norm errors; ``accuracy`` must match to
    ``accuracy_atol``. Returns the measured errors {key: error}.
    """
    loss_tol, grad_tol = tolerances(dtype)
    assert "loss" in out, "out has no 'loss'"
    errors, failures = {}, []
    for key, tol in [(k, loss_tol) for k in LOSS_KEYS] + [(k, grad_tol) for k in GRAD_KEYS]:
        if key not in out or key not in ref:
            continue
        a, r = out[key], ref[key]
        if r is None or a is None:
            if (r is None) != (a is None):
                failures.append(f"{key}: {'missing' if a is None else 'unexpected'} (reference: {r is not None})")
            continue
        a64, r64 = as_float64(a), as_float64(r)
        if a64.shape != r64.shape:
            failures.append(f"{key}: shape {a64.shape} != reference shape {r64.shape}")
            continue
        errors[key] = err = rel_err(a64, r64)
        if not err <= tol:
            failures.append(f"{key}: relative error {err:.3e} > {tol:.0e}")
    if "accuracy" in out and "accuracy" in ref:
        a64, r64 = as_float64(out["accuracy"]), as_float64(ref["accuracy"])
        if a64.shape != r64.shape:
            failures.append(f"accuracy: shape {a64.shape} != reference shape {r64.shape}")
        else:
            errors["accuracy"] = diff = float(np.max(np.abs(a64 - r64), initial=0.0))
            if not diff <= accuracy_atol:
                failures.append(f"accuracy: max difference {diff:.3e} > {accuracy_atol:.0e}")
    assert not failures, f"{dtype_name(dtype)}: " + "; ".join(failures) + f" (all errors: {errors})"
    return errors


def targets_avoiding(n, v, avoid, g):
    """n random targets in [0, v) (torch generator g), none of them equal to ``avoid``."""
    import torch

    t = torch.randint(0, v, (n,), generator=g)
    return torch.where(t == avoid, (avoid + 1) % v, t)


# ------------------------------------------------------------------------- twin runs (tests/twins.py)
# Rows per chunk for each small case in the twin tests: several chunks for most cases (a first chunk with the
# remainder, then full chunks in a loop), the default (one chunk at these sizes) for the others.
CASE_CHUNK_ROWS = {
    "f32_basic": 8, "f16_basic": None, "single_row": 16, "all_ignored": 4, "x3d_bf16": None,
    "large_logits_f32": 16, "large_logits_bf16": 8, "bias_bf16": None, "label_smoothing": 16, "z_loss": 8,
    "softcap": None, "class_weights": 16, "sum_bf16": 8, "none_3d": 4, "all_options_bf16": 4,
    "all_options_none_f16": 4,
}


def case_chunk_rows(case: Case):
    """chunk_rows used for ``case`` by the twin tests (CASE_CHUNK_ROWS; 8 for a case not listed there)."""
    return CASE_CHUNK_ROWS.get(case.name, 8)


def valid_rows(targets, ignore_index=-100) -> np.ndarray:
    """Boolean numpy mask (shape of targets) of the rows whose target is not ignore_index."""
    return np.asarray(as_float64(targets) != ignore_index)


def restrict_lse(out: dict, ref: dict, targets, ignore_index=-100) -> tuple[dict, dict]:
    """Copies of out/ref with ``lse`` restricted to the valid rows (the contract's lse of an ignored row is
    not checked)."""
    mask = valid_rows(targets, ignore_index)
    out, ref = dict(out), dict(ref)
    if "lse" in out and "lse" in ref:
        out["lse"] = as_float64(out["lse"])[mask]
        ref["lse"] = as_float64(ref["lse"])[mask]
    return out, ref


def to_jax(t):
    """A JAX array with the same values and dtype as the torch tensor ``t`` (None stays None)."""
    if t is None:
        return None
    import jax.numpy as jnp
    import torch

    names = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}
    if t.dtype in names:
        return jnp.asarray(t.detach().to(torch.float32).cpu().numpy()).astype(names[t.dtype])
    return jnp.asarray(t.detach().cpu().numpy())


def to_torch(a):
    """A torch tensor with the same values and dtype as the JAX array ``a`` (float32 / bfloat16 / float16;
    integers as they are)."""
    import torch

    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if a.dtype.name not in names:
        return torch.from_numpy(np.array(a))
    return torch.from_numpy(np.asarray(a.astype("float32"))).to(names[a.dtype.name])


def dtype_name_or_str(dtype) -> str:
    """"float32" | "bfloat16" | "float16" | "int64"...: a framework-neutral dtype name."""
    try:
        return dtype_name(dtype)
    except ValueError:
        return str(dtype).removeprefix("torch.")


def assert_twins_agree(a: dict, b: dict, dtype) -> dict:
    """SPEC bounds between two implementations' outputs (float64 numpy dicts): loss-like keys (loss, z_loss,
    lse) within the loss bound, dx/dw/db within the gradient bound, both as relative-norm errors of ``a``
    against ``b``; accuracy equal. Returns the errors."""
    loss_tol, grad_tol = tolerances(dtype)
    errors, failures = {}, []
    for key in ("loss", "lse", "z_loss", "accuracy", "dx", "dw", "db"):
        if a.get(key) is None and b.get(key) is None:
            continue
        if a.get(key) is None or b.get(key) is None:
            failures.append(f"{key}: present in only one output")
            continue
        tol = grad_tol if key in GRAD_KEYS else (0.0 if key == "accuracy" else loss_tol)
        errors[key] = err = rel_err(a[key], b[key]) if key != "accuracy" else float(
            np.max(np.abs(as_float64(a[key]) - as_float64(b[key])), initial=0.0))
        if not err <= tol:
            failures.append(f"{key}: {err:.3e} > {tol:.0e}")
    assert not failures, "; ".join(failures) + f" (all: {errors})"
    return errors

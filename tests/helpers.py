"""Assertion helpers shared by the tests: SPEC accuracy bounds against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

from parity.cases import Case, small_cases
from parity.reference import as_float64, flce_reference, rel_err

# SPEC "Accuracy": (loss relative error, gradient relative-norm error). float16 takes the bfloat16 bounds.
TOLERANCES = {
    "float32": (1e-6, 5e-5),
    "bfloat16": (1e-5, 1e-2),
    "float16": (1e-5, 1e-2),
}
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


def reference_for_case(case: Case, inputs: dict, grad_output=None) -> dict:
    """``flce_reference`` on the tensors of ``make_inputs(case)`` with the case's options."""
    return flce_reference(inputs["x"], inputs["weight"], inputs["targets"], bias=inputs["bias"],
                          class_weights=inputs["class_weights"], grad_output=grad_output, **case.options())


def parametrize_cases(cases=None):
    """``@pytest.mark.parametrize("case", ...)`` over ``cases`` (default: ``small_cases()``), ids = names."""
    cases = small_cases() if cases is None else list(cases)
    return pytest.mark.parametrize("case", cases, ids=[c.name for c in cases])

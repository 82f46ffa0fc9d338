"""float32 inputs follow the framework's matmul precision setting (docs/SPEC.md §1): IEEE by default, TF32
when the user enables it; never an error. On the CPU the TF32 settings change nothing, so the results there are
the IEEE ones."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import fce_jax
import fce_torch
from parity.reference import flce_reference, rel_err

# TF32 keeps 10 mantissa bits of each operand: relative errors of ~1e-3 on the loss and gradients.
TF32_TOL = 1e-2


def _inputs(device):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=g)
    w = torch.randn(500, 64, generator=g) / 8
    y = torch.randint(0, 500, (40,), generator=g)
    return x.to(device), w.to(device), y.to(device)


def _torch_run(x, w, y):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fce_torch.fused_lce(x, w, y)
    loss.backward()
    return [t.detach().cpu().numpy() for t in (loss, x.grad, w.grad)]


@pytest.mark.parametrize("setting", ["allow_tf32", "precision_high"])
def test_torch_follows_tf32(device, setting):
    x, w, y = _inputs(device)
    ref = flce_reference(x, w, y)
    old = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    try:
        if setting == "allow_tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
        else:
            torch.set_float32_matmul_precision("high")
        loss, dx, dw = _torch_run(x, w, y)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old[0]
        torch.set_float32_matmul_precision(old[1])
    for got, key in ((loss, "loss"), (dx, "dx"), (dw, "dw")):
        assert rel_err(got, ref[key]) <= TF32_TOL, key
    ieee = _torch_run(x, w, y)  # the default again: IEEE float32, SPEC's float32 bounds
    assert rel_err(ieee[0], ref["loss"]) <= 1e-6 and rel_err(ieee[2], ref["dw"]) <= 5e-5


def test_jax_follows_default_matmul_precision():
    x, w, y = (jnp.asarray(t.numpy()) for t in _inputs("cpu"))
    ref = flce_reference(np.asarray(x), np.asarray(w), np.asarray(y))
    f = jax.jit(jax.value_and_grad(lambda x, w: fce_jax.fused_lce(x, w, y), argnums=(0, 1)))
    with jax.default_matmul_precision("tensorfloat32"):
        loss, (dx, dw) = jax.jit(jax.value_and_grad(lambda x, w: fce_jax.fused_lce(x, w, y), argnums=(0, 1)))(x, w)
    for got, key in ((loss, "loss"), (dx, "dx"), (dw, "dw")):
        assert rel_err(np.asarray(got), ref[key]) <= TF32_TOL, key
    loss, (dx, dw) = f(x, w)
    assert rel_err(np.asarray(loss), ref["loss"]) <= 1e-6 and rel_err(np.asarray(dw), ref["dw"]) <= 5e-5

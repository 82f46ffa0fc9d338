"""float32 inputs follow the framework's matmul precision setting (docs/SPEC.md §1): IEEE by default, TF32
when the user enables it; never an error. On the CPU the TF32 settings change nothing, so the results there are
the IEEE ones bit for bit; on a GPU they differ from them (the setting is followed)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import fce_jax
import fce_torch
from parity.reference import flce_reference, rel_err
from parity.verdicts import bound

# TF32 keeps 10 mantissa bits of each operand: relative errors of ~1e-3 on the loss and gradients.
TF32_TOL = 1e-2


def _inputs(device):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=g)
    w = torch.randn(500, 64, generator=g) / 8
    y = torch.randint(0, 500, (40,), generator=g)
    return x.to(device), w.to(device), y.to(device)


def _check_follows(tf32, ieee, ref, on_gpu):
    """TF32 results (loss, dx, dw) within TF32's error; the IEEE ones within SPEC's float32 bounds; the two
    bitwise equal on the CPU (no TF32 there), different on a GPU."""
    for got, key in zip(tf32, ("loss", "dx", "dw")):
        assert rel_err(got, ref[key]) <= TF32_TOL, key
    for got, key in zip(ieee, ("loss", "dx", "dw")):
        assert rel_err(got, ref[key]) <= bound(key, "float32"), key
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(tf32, ieee))
    assert same != on_gpu


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
        tf32 = _torch_run(x, w, y)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old[0]
        torch.set_float32_matmul_precision(old[1])
    _check_follows(tf32, _torch_run(x, w, y), ref, device == "cuda")  # then the default again: IEEE


def test_jax_follows_default_matmul_precision():
    x, w, y = (jnp.asarray(t.numpy()) for t in _inputs("cpu"))
    ref = flce_reference(np.asarray(x), np.asarray(w), np.asarray(y))
    f = jax.jit(jax.value_and_grad(lambda x, w: fce_jax.fused_lce(x, w, y), argnums=(0, 1)))
    with jax.default_matmul_precision("tensorfloat32"):  # part of jit's cache key: traced again
        loss, (dx, dw) = f(x, w)
    ieee_loss, (ieee_dx, ieee_dw) = f(x, w)
    _check_follows((loss, dx, dw), (ieee_loss, ieee_dx, ieee_dw), ref, jax.default_backend() == "gpu")

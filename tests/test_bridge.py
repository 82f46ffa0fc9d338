"""parity.bridge: zero-copy torch <-> JAX through DLPack, and every case where zero-copy does not hold."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from parity.bridge import (CPU_ALIGNMENT, BridgeError, same_memory, targets_to_jax, to_jax, to_torch,
                           x64_enabled)
from parity.cases import case_inputs
from parity.catalog import default_cases

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _np(a):
    """Exact float64 numpy values of a torch tensor or JAX array (bf16 included)."""
    if isinstance(a, torch.Tensor):
        return a.detach().to(torch.float64).cpu().numpy()
    return np.asarray(jnp.asarray(a, jnp.float32) if a.dtype == jnp.bfloat16 else a).astype(np.float64)


@contextlib.contextmanager
def x64(on: bool):
    old = x64_enabled()
    jax.config.update("jax_enable_x64", on)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", old)


# ------------------------------------------------------------------------------------------ zero-copy
@pytest.mark.parametrize("dtype", FLOATS + [torch.int32, torch.int8, torch.uint8, torch.bool],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_is_zero_copy(dtype):
    t = (torch.randn(6, 70) * 10).to(dtype)
    a = to_jax(t)
    assert same_memory(t, a), "torch -> jax copied"
    assert a.shape == tuple(t.shape)
    assert str(a.dtype) == str(t.dtype).removeprefix("torch.")
    np.testing.assert_array_equal(_np(a), _np(t))
    back = to_torch(a)
    assert back.data_ptr() == t.data_ptr(), "jax -> torch copied"
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_three_dimensional_and_scalar_are_zero_copy():
    t = torch.randn(2, 5, 64)
    assert same_memory(t, to_jax(t))
    s = torch.tensor(3.5)
    a = to_jax(s)
    assert a.shape == () and float(a) == 3.5 and same_memory(s, a)


def test_aligned_row_slice_is_zero_copy():
    base = torch.randn(8, 64)          # one row = 256 bytes: every row start stays 64-byte aligned
    view = base[2:5]
    assert view.data_ptr() % CPU_ALIGNMENT == 0
    a = to_jax(view)
    assert same_memory(view, a)
    np.testing.assert_array_equal(_np(a), _np(view))


def test_aliasing_is_real():
    """The JAX array views torch memory: a write through torch shows in JAX (hence: never write)."""
    t = torch.zeros(16)
    a = to_jax(t)
    t[3] = 7.0
    assert float(a[3]) == 7.0


def test_jax_result_to_torch_is_zero_copy_and_copy_true_copies():
    a = jnp.arange(32, dtype=jnp.float32).reshape(4, 8) * 2
    t = to_torch(a)
    assert same_memory(t, a)
    np.testing.assert_array_equal(t.cpu().numpy(), np.asarray(a))
    c = to_torch(a, copy=True)
    assert not same_memory(c, a)
    c[0, 0] = -1.0
    assert float(a[0, 0]) == 0.0


def test_empty_tensor():
    t = torch.zeros(0, 4)
    a = to_jax(t)
    assert a.shape == (0, 4)


# ------------------------------------------------------------------------------------------ what breaks it
def test_misaligned_cpu_view_raises_unless_copy():
    """JAX's CPU client copies buffers that are not 64-byte aligned; the bridge refuses to do it silently."""
    base = torch.randn(1 + 256)
    view = base[1:]                      # 4 bytes past an aligned start
    assert view.is_contiguous() and view.data_ptr() % CPU_ALIGNMENT != 0
    with pytest.raises(BridgeError, match="aligned"):
        to_jax(view)
    a = to_jax(view, copy=True)
    assert not same_memory(view, a)
    np.testing.assert_array_equal(_np(a), _np(view))


@pytest.mark.parametrize("make", [lambda t: t[:, 1:], lambda t: t.T, lambda t: t[::2]],
                         ids=["column_slice", "transpose", "row_stride"])
def test_non_contiguous_raises_unless_copy(make):
    t = make(torch.randn(8, 64))
    assert not t.is_contiguous()
    with pytest.raises(BridgeError, match="not contiguous"):
        to_jax(t)
    a = to_jax(t, copy=True)             # the documented copy: t.contiguous()
    assert a.shape == tuple(t.shape)
    assert not same_memory(t, a)
    np.testing.assert_array_equal(_np(a), _np(t))


def test_requires_grad_is_detached_explicitly_and_stays_zero_copy():
    t = torch.randn(4, 64, requires_grad=True)
    with pytest.raises(BufferError):     # what the bridge protects against
        jax.dlpack.from_dlpack(t)
    a = to_jax(t)
    assert same_memory(t, a)
    assert t.requires_grad and t.grad is None   # the caller's tensor is untouched
    np.testing.assert_array_equal(_np(a), _np(t))


def test_type_errors():
    with pytest.raises(TypeError):
        to_jax(np.zeros(3, np.float32))
    with pytest.raises(TypeError):
        to_torch(np.zeros(3, np.float32))


def test_tracer_raises():
    @jax.jit
    def f(a):
        to_torch(a)
        return a

    with pytest.raises(BridgeError, match="tracer"):
        f(jnp.ones(3))


# ------------------------------------------------------------------------------------------ integer targets
def test_int64_without_x64_is_refused_by_to_jax():
    """JAX would narrow int64 to int32 with a silent copy (even when asked for copy=False)."""
    assert not x64_enabled()
    t = torch.arange(10)
    raw = jax.dlpack.from_dlpack(t)
    assert raw.dtype == jnp.int32 and not same_memory(t, raw)     # the silent conversion, measured
    with pytest.raises(BridgeError, match="targets_to_jax"):
        to_jax(t)


def test_targets_to_jax_converts_int64_explicitly():
    t = torch.tensor([[0, 5, -100], [128255, 3, 7]], dtype=torch.int64)
    a = targets_to_jax(t)
    assert a.dtype == jnp.int32 and a.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    assert not same_memory(t, a)           # the one documented copy
    assert t.dtype == torch.int64          # the caller's tensor is untouched


def test_targets_to_jax_checks_the_range():
    with pytest.raises(BridgeError, match="int32"):
        targets_to_jax(torch.tensor([0, 2**31], dtype=torch.int64))
    with pytest.raises(BridgeError, match="int32"):
        targets_to_jax(torch.tensor([-(2**31) - 1], dtype=torch.int64))
    a = targets_to_jax(torch.tensor([2**31 - 1, -(2**31)], dtype=torch.int64))
    assert np.asarray(a).tolist() == [2**31 - 1, -(2**31)]


def test_targets_to_jax_int32_is_zero_copy():
    t = torch.arange(12, dtype=torch.int32)
    assert same_memory(t, targets_to_jax(t))


def test_targets_to_jax_non_contiguous_int64_is_converted():
    t = torch.arange(20, dtype=torch.int64).reshape(4, 5)[:, 1:]
    a = targets_to_jax(t)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_targets_to_jax_rejects_floats():
    with pytest.raises(BridgeError, match="integer"):
        targets_to_jax(torch.zeros(3))


def test_int64_with_x64_is_zero_copy():
    with x64(True):
        t = torch.arange(10)
        a = targets_to_jax(t)
        assert a.dtype == jnp.int64 and same_memory(t, a)
        assert same_memory(t, to_jax(t))


# ------------------------------------------------------------------------------------------ the suite's inputs
@pytest.mark.parametrize("kind", ["flce", "cpo", "logprobs"])
def test_case_inputs_cross_without_copies(kind):
    """Every float tensor a parity case hands to the JAX twin (cotangents included) is aliased, not copied;
    int64 targets are the one documented int32 copy."""
    name = {"flce": "token_scaling_none_bf16", "cpo": "cpo_sigmoid_ls_bias_bf16", "logprobs": "logprobs_bias_bf16"}
    inp = case_inputs(next(c for c in default_cases("cpu") if c.name == name[kind]))
    floats = {k: t for k, t in inp.items() if t is not None and t.is_floating_point()}
    assert {"x", "weight"} <= set(floats) and (kind == "cpo" or any(k.startswith("grad_") for k in floats))
    for name, t in floats.items():
        assert same_memory(t, to_jax(t)), name
    y = targets_to_jax(inp["targets"])
    assert y.dtype == (jnp.int64 if x64_enabled() else jnp.int32) and y.shape == tuple(inp["targets"].shape)
    np.testing.assert_array_equal(np.asarray(y), inp["targets"].numpy())


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: str(d).removeprefix("torch."))
def test_cuda_round_trip_is_zero_copy(dtype):
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU backend here")
    t = torch.randn(64, 128, device="cuda").to(dtype)
    a = to_jax(t)
    assert same_memory(t, a)
    assert a.devices().pop().platform == "gpu"
    back = to_torch(a)
    assert back.data_ptr() == t.data_ptr() and back.device == t.device
    y = targets_to_jax(torch.randint(0, 100, (64,), device="cuda"))
    assert y.dtype == jnp.int32

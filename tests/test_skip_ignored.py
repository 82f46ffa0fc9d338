"""Skipping the ignored rows (both twins): the valid-first permutation, which chunks run, and the results of
runs where whole chunks are skipped, in both dZ modes (kept and accumulated), against the float64 reference."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import fce_jax
import fce_torch
from fce_jax import engine as jax_engine
from fce_torch import engine as torch_engine
from fce_torch.chunking import chunks_to_run, kept_granule, layout, plan
from helpers import check_case, jax_run, to_jax, torch_run
from parity.cases import IGNORE_INDEX, Case, make_inputs
from parity.reference import as_float64


def _targets(n, v, n_valid, seed):
    """n targets, n_valid of them valid at random places, the others IGNORE_INDEX."""
    g = torch.Generator().manual_seed(seed)
    t = torch.full((n,), IGNORE_INDEX, dtype=torch.int64)
    t[torch.randperm(n, generator=g)[:n_valid]] = torch.randint(0, v, (n_valid,), generator=g)
    return t


@pytest.mark.parametrize("n,n_valid", [(1, 0), (1, 1), (13, 0), (13, 5), (13, 13)])
def test_valid_first(n, n_valid):
    """A stable permutation, valid rows first; pos and order are inverse; both twins give the same one."""
    y = _targets(n, 50, n_valid, seed=n + n_valid)
    pos, order = torch_engine.valid_first(y, IGNORE_INDEX)
    j_pos, j_order, j_n = jax_engine.valid_first(to_jax(y), IGNORE_INDEX)
    assert np.array_equal(pos.numpy(), np.asarray(j_pos)) and np.array_equal(order.numpy(), np.asarray(j_order))
    assert int(j_n) == n_valid
    valid = (y != IGNORE_INDEX).numpy()
    expected = np.concatenate([np.flatnonzero(valid), np.flatnonzero(~valid)])
    assert np.array_equal(order.numpy(), expected)
    assert np.array_equal(pos.numpy()[order.numpy()], np.arange(n))


def _marker_head(stats, inputs):
    """1 on every row of a chunk that ran (skipped chunks leave 0), and the coefficients of no gradient."""
    one = torch.ones_like(stats["m"]) if isinstance(stats["m"], torch.Tensor) else jnp.ones_like(stats["m"])
    return {"ran": one, "lse": one, "a": 0 * one, "b": 0 * one, "c": 0 * one}


@pytest.mark.parametrize("store", [False, True], ids=["accumulated", "kept"])
@pytest.mark.parametrize("n,nc,n_valid", [(29, 4, 0), (29, 4, 1), (29, 4, 2), (29, 4, 10), (29, 4, 29),
                                          (32, 8, 9), (5, 8, 3), (40, 2, 5), (40, 2, 39)])
def test_chunks_past_the_valid_rows_do_not_run(n, nc, n_valid, store):
    """Exactly the chunks holding valid rows run (the first always; with store, their number rounded up to
    the kept granule, 3 for the 20 chunks of 40 rows), the same rows in both twins; fce_torch without a
    count runs them all."""
    h, v = 8, 40
    y = _targets(n, v, n_valid, seed=n_valid)
    x = torch.randn(n, h)
    w = torch.randn(v, h)
    first, n_chunks = layout(n, nc)
    granule = kept_granule(n_chunks) if store else 1
    n_run = first + (chunks_to_run(n_valid, first, nc, n_chunks, granule) - 1) * nc
    pos, _ = torch_engine.valid_first(y, IGNORE_INDEX)
    expected = (pos < n_run).float().numpy()
    kw = dict(grads=(True, True, False), chunking=(nc, True)) if store else {}
    opt_t = torch_engine.Options(chunk_rows=nc)
    outs, dx, *_ = torch_engine.sweep(x, w, None, None, opt_t, _marker_head, {"y": y}, valid_rows=n_valid, **kw)
    assert np.array_equal(outs["ran"].numpy(), expected)
    outs, *_ = torch_engine.sweep(x, w, None, None, opt_t, _marker_head, {"y": y}, **kw)
    assert np.all(outs["ran"].numpy() == 1)
    opt_j = jax_engine.Options(chunk_rows=nc)
    outs, j_dx, *_ = jax_engine.sweep(to_jax(x), to_jax(w), None, None, opt_j, _marker_head, {"y": to_jax(y)},
                                      skip_ignored=True, **kw)
    assert np.array_equal(np.asarray(outs["ran"]), expected)
    if store:
        assert dx.shape == j_dx.shape == (n, h) and not dx.any() and not np.asarray(j_dx).any()
    assert n_run == n or expected.sum() < n  # the case really skips rows where it can


# 64 rows, 16 of them valid: with 8 rows a chunk, only the first two of eight chunks run.
SKIP_CASES = [
    Case("skip_kept_f32", (64,), 64, 130, "float32", bias=True, seed=41),  # 64 * 4 <= 4 * 64: dZ kept
    Case("skip_accumulated_f32", (64,), 16, 130, "float32", bias=True, seed=42),  # dZ accumulated
    Case("skip_kept_bf16", (64,), 32, 300, "bfloat16", z_loss=1e-3, label_smoothing=0.1, seed=43),
    Case("skip_none_f32", (4, 16), 16, 130, "float32", reduction="none", class_weights=True, seed=44),
]


@pytest.mark.parametrize("case", SKIP_CASES, ids=[c.name for c in SKIP_CASES])
@pytest.mark.parametrize("twin", ["torch", "jax"])
def test_skipped_chunks_match_reference(case, twin):
    """Runs that skip 6 of 8 chunks give the reference's loss and gradients (0 on ignored rows), lse 0 on
    ignored rows, and the same results without skipping (fce_torch with validate=False)."""
    inp = make_inputs(case)
    n = inp["targets"].numel()
    inp["targets"] = _targets(n, case.v, 16, seed=case.seed).view(inp["targets"].shape)
    store = plan(n, case.h, case.v, 4 if case.dtype == "float32" else 2, True, 8)[1]
    assert store == ("kept" in case.name)
    if twin == "torch":
        out = torch_run(fce_torch.fused_lce, inp, case.options(), chunk_rows=8)
        unskipped = torch_run(fce_torch.fused_lce, inp, case.options(), chunk_rows=8, validate=False)
        for k in ("loss", "dx", "dw", "db"):
            if out[k] is not None:
                np.testing.assert_allclose(out[k].float().numpy(), unskipped[k].float().numpy(), rtol=1e-2,
                                           atol=1e-6)
    else:
        out = jax_run(fce_jax.fused_lce, inp, case.options(), chunk_rows=8)
    check_case(case, inp, out)
    ignored = (inp["targets"] == IGNORE_INDEX).numpy()
    assert np.all(as_float64(out["lse"])[ignored] == 0)
    assert np.all(as_float64(out["dx"]).reshape(n, -1)[ignored.reshape(-1)] == 0)

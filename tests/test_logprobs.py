"""fused_token_logprobs (SPEC §4) of both twins against the float64 reference, with random cotangents on both
outputs: torch.autograd.grad / jax.vjp (under jax.jit) of ``sum(logp * g + entropy * h)``.

Bounds: logp takes the loss bounds of SPEC §1 (relative norm error 1e-6 for float32, 1e-5 for 16-bit inputs);
the entropy 1e-4 for float32 and the gradient bound 1e-2 for 16-bit inputs; dx, dw, db the gradient bounds.
Ignored rows give logp = entropy = 0 exactly and no gradient.
"""

import numpy as np
import pytest
import torch

from fce_core.plan import plan_rows
from helpers import tolerances
from parity.cases import IGNORE_INDEX, LogprobCase, make_logprob_inputs
from parity.reference import as_float64, logprobs_reference, rel_err
from parity.verdicts import bound
from twins import JAX, TORCH, each_twin

CASES = {c.name: c for c in [
    LogprobCase("f32_bias", (37,), 32, 1000, "float32", bias=True, logit_scale=3.0, seed=1),
    LogprobCase("softcap_temperature", (29,), 32, 777, "float32", bias=True, softcap=5.0, temperature=0.7,
                logit_scale=4.0, seed=2),
    LogprobCase("bf16_3d", (2, 3, 5), 64, 777, "bfloat16", softcap=20.0, temperature=1.5, logit_scale=10.0,
                seed=3),
    LogprobCase("f16_kept", (24,), 48, 500, "float16", bias=True, temperature=2.0, seed=4),
    LogprobCase("huge_logits", (13,), 32, 1000, "float32", logit_scale=50.0, seed=5),
    LogprobCase("single_row", (1,), 16, 1500, "float32", ignore_frac=0.0, seed=6),
]}
# Rows per chunk by case: several chunks, dZ kept (f16_kept, bf16_3d) or accumulated; one chunk for the others.
CHUNK_ROWS = {"f32_bias": 8, "softcap_temperature": None, "bf16_3d": 7, "f16_kept": 5, "huge_logits": None,
              "single_row": None}


def _cotangents(case, zero_rows=(), zero_logp_rows=()):
    g = torch.Generator().manual_seed(1000 + case.seed)
    g_logp, g_ent = torch.randn(case.shape, generator=g), torch.randn(case.shape, generator=g)
    for i in zero_rows:       # rows of all-zero cotangents (the backward counts them as ignored)
        g_logp.view(-1)[i] = g_ent.view(-1)[i] = 0.0
    for i in zero_logp_rows:
        g_logp.view(-1)[i] = 0.0
    return g_logp, g_ent


def _run(twin, case, *, return_entropy=True, zero_rows=(), zero_logp_rows=(), chunk_rows="case", grads=True,
         fresh=False, **kw):
    inp = make_logprob_inputs(case)
    g_logp, g_ent = _cotangents(case, zero_rows, zero_logp_rows)
    if not return_entropy:
        g_ent = None
    nc = CHUNK_ROWS.get(case.name) if chunk_rows == "case" else chunk_rows
    out = twin.logprobs(twin.array(inp["x"]), twin.array(inp["weight"]), twin.array(inp["targets"]),
                        bias=twin.array(inp["bias"]), g_logp=g_logp, g_entropy=g_ent, return_entropy=return_entropy,
                        grads=grads, softcap=case.softcap, temperature=case.temperature, chunk_rows=nc, fresh=fresh,
                        **kw)
    return inp, (g_logp, g_ent), out


def check_logprobs(case, inp, cotangents, out):
    """out against logprobs_reference within the bounds above; dtypes, shapes; exact zeros on ignored rows."""
    g_logp, g_ent = cotangents
    has_entropy = out["entropy"] is not None
    ref = logprobs_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"], softcap=case.softcap,
                             temperature=case.temperature, grad_logp=g_logp,
                             grad_entropy=g_ent if has_entropy else None)
    loss_tol, grad_tol = tolerances(case.dtype)
    keys = [("logp", loss_tol)] + ([("entropy", bound("entropy", case.dtype))] if has_entropy else [])
    if out["dx"] is not None:
        keys += [("dx", grad_tol), ("dw", grad_tol)] + ([("db", grad_tol)] if inp["bias"] is not None else [])
    errors = {k: rel_err(out[k], ref[k]) for k, _ in keys}
    assert all(errors[k] <= tol for k, tol in keys), errors
    for k in ("logp", "entropy"):
        if out[k] is not None:
            assert TORCH.dtype(out[k]) == "float32" and tuple(out[k].shape) == tuple(inp["targets"].shape), k
    if out["dx"] is not None:
        for k, d in (("x", "dx"), ("weight", "dw"), ("bias", "db")):
            if inp[k] is not None:
                assert TORCH.dtype(out[d]) == TORCH.dtype(inp[k]) and tuple(out[d].shape) == tuple(inp[k].shape)
    ignored = (inp["targets"] == IGNORE_INDEX).numpy()
    for k in ("logp", "entropy"):
        if out[k] is not None:
            assert np.all(as_float64(out[k])[ignored] == 0), k
    if out["dx"] is not None:
        assert np.all(as_float64(out["dx"])[ignored] == 0)
    return ref


_RESULTS = {}


def _cached(twin, name):
    if (twin.name, name) not in _RESULTS:
        _RESULTS[twin.name, name] = _run(twin, CASES[name])
    return _RESULTS[twin.name, name]


@each_twin
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(twin, name):
    """logp, entropy and the gradients of random cotangents on both: every case (f32 with bias, softcap and
    temperature, bf16 3-D, f16 with dZ kept, huge logits, a single row with V not a multiple of the block)."""
    case = CASES[name]
    inp, cot, out = _cached(twin, name)
    nc = CHUNK_ROWS[name]
    if nc is not None:
        itemsize = 4 if case.dtype == "float32" else 2
        assert plan_rows(case.rows, case.h, case.v, itemsize, need_grads=True,
                         requested=nc).keep_dz == (name in ("f16_kept", "bf16_3d"))
    check_logprobs(case, inp, cot, out)


@each_twin
@pytest.mark.parametrize("name", ["f32_bias", "bf16_3d", "f16_kept", "single_row"])
def test_fused_engine_matches_reference(twin, name):
    """engine="fused" (the logits GEMM with the statistics epilogue, 16-bit tile values, the tiled dlogits):
    logp, entropy and the gradients within the same bounds, over several chunks with dZ accumulated
    (f32_bias) or kept (bf16_3d, f16_kept, whose fused plan keeps it too), and a single row."""
    case = CASES[name]
    nc = CHUNK_ROWS[name]
    if nc is not None:
        itemsize = 4 if case.dtype == "float32" else 2
        fused = plan_rows(case.rows, case.h, case.v, itemsize, need_grads=True, requested=nc, engine="fused")
        assert fused.keep_dz == (name in ("f16_kept", "bf16_3d"))
    inp, cot, out = _run(twin, case, engine="fused")
    check_logprobs(case, inp, cot, out)
    if case.dtype != "float32":  # the option reaches the engine: its 16-bit tile values give other bits
        assert not np.array_equal(twin.bits(out["dw"]), twin.bits(_cached(twin, name)[2]["dw"]))


@each_twin
def test_unknown_engine_raises(twin):
    inp = make_logprob_inputs(CASES["f32_bias"])
    with pytest.raises(ValueError, match="engine must be one of"):
        twin.logprobs_call(*(twin.array(inp[k]) for k in ("x", "weight", "targets")), engine="cuda")



@pytest.mark.parametrize("name", ["f32_bias", "bf16_3d"])
def test_twins_agree(name):
    """fce_torch and fce_jax within the bounds of each other (the CPU interpreters are not bitwise twins)."""
    case = CASES[name]
    (_, _, t), (_, _, j) = _cached(TORCH, name), _cached(JAX, name)
    loss_tol, grad_tol = tolerances(case.dtype)
    assert rel_err(t["logp"], j["logp"]) <= loss_tol
    assert rel_err(t["entropy"], j["entropy"]) <= bound("entropy", case.dtype)
    for k in ("dx", "dw"):
        assert TORCH.dtype(t[k]) == JAX.dtype(j[k]) and rel_err(t[k], j[k]) <= grad_tol, k


@each_twin
def test_deterministic(twin):
    """Two runs (two compilations in JAX) give the same bits."""
    _, _, a = _cached(twin, "bf16_3d")
    _, _, b = _run(twin, CASES["bf16_3d"], fresh=True)
    for k in ("logp", "entropy", "dx", "dw"):
        assert np.array_equal(twin.bits(a[k]), twin.bits(b[k])), k


@each_twin
def test_logp_only(twin):
    """return_entropy=False: logp alone (no entropy statistic), the gradient of the logp cotangent alone."""
    case = CASES["softcap_temperature"]
    inp, cot, out = _run(twin, case, return_entropy=False, chunk_rows=twin.option_chunk_rows)
    assert out["entropy"] is None
    check_logprobs(case, inp, cot, out)


@each_twin
def test_zero_cotangent_rows(twin):
    """Valid rows whose two cotangents are 0 take no part in the backward (their chunks may be skipped): the
    gradients are still the reference's, and those rows' dx is 0; rows with one zero cotangent still count."""
    case = LogprobCase("zero_cot", (40,), 16, 300, "float32", bias=True, softcap=10.0, logit_scale=4.0,
                       ignore_frac=0.2, seed=7)
    zero = list(range(8, 40))                  # valid-first, the chunks past the first 8 rows have no cotangent
    inp, cot, out = _run(twin, case, zero_rows=zero, zero_logp_rows=[3], chunk_rows=8)
    assert (inp["targets"][3] != IGNORE_INDEX) and cot[0][3] == 0 and cot[1][3] != 0
    check_logprobs(case, inp, cot, out)
    assert np.all(as_float64(out["dx"])[zero] == 0)


@each_twin
def test_no_grad_path(twin):
    """Without gradients (torch: inputs that do not require grad, and torch.no_grad(); JAX: the primal call
    under jit) the same logp and entropy bits as the differentiated call."""
    case = CASES["f32_bias"]
    inp, cot, diff = _cached(twin, "f32_bias")
    _, _, plain = _run(twin, case, grads=False)
    for k in ("logp", "entropy"):
        assert np.array_equal(twin.bits(plain[k]), twin.bits(diff[k])), k
    if twin is TORCH:
        x = inp["x"].clone().requires_grad_(True)
        with torch.no_grad():
            logp, ent = TORCH.lib.fused_token_logprobs(x, inp["weight"], inp["targets"], bias=inp["bias"],
                                                       return_entropy=True, chunk_rows=CHUNK_ROWS["f32_bias"])
        assert logp.grad_fn is None and ent.grad_fn is None
        assert torch.equal(logp, diff["logp"]) and torch.equal(ent, diff["entropy"])


@each_twin
def test_all_rows_ignored(twin):
    """logp and entropy 0, gradients exactly 0, no NaN."""
    case = LogprobCase("all_ignored", (2, 6), 16, 130, "float32", bias=True, softcap=3.0, ignore_frac=1.0, seed=8)
    inp, cot, out = _run(twin, case, chunk_rows=twin.option_chunk_rows)
    for k in ("logp", "entropy", "dx", "dw", "db"):
        assert np.all(as_float64(out[k]) == 0), k
    check_logprobs(case, inp, cot, out)


@each_twin
@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["0rows", "2x0rows"])
def test_empty_input(twin, lead):
    """No rows: empty logp and entropy, empty dx, zero dw and db."""
    g = torch.Generator().manual_seed(9)
    x, w, b = torch.randn(*lead, 16, generator=g), torch.randn(130, 16, generator=g), torch.randn(130, generator=g)
    t = torch.zeros(lead, dtype=torch.int64)
    out = twin.logprobs(twin.array(x), twin.array(w), twin.array(t), bias=twin.array(b), g_logp=torch.zeros(lead),
                        g_entropy=torch.zeros(lead))
    assert tuple(out["logp"].shape) == tuple(out["entropy"].shape) == lead
    assert tuple(out["dx"].shape) == tuple(x.shape)
    assert np.all(as_float64(out["dw"]) == 0) and np.all(as_float64(out["db"]) == 0)


BAD = {
    "temperature_zero": ({"temperature": 0.0}, "temperature"),
    "temperature_negative": ({"temperature": -1.0}, "temperature"),
    "temperature_inf": ({"temperature": float("inf")}, "temperature"),
    "temperature_nan": ({"temperature": float("nan")}, "temperature"),
    "softcap_zero": ({"softcap": 0.0}, "softcap"),
    "softcap_negative": ({"softcap": -2.0}, "softcap"),
    "weight_H_mismatch": ({"weight": torch.randn(13, 9)}, "weight"),
    "x_weight_dtype_mismatch": ({"weight": torch.randn(13, 8).bfloat16()}, "weight"),
    "targets_float": ({"targets": torch.zeros(6)}, "targets"),
    "targets_shape": ({"targets": torch.zeros(5, dtype=torch.int64)}, "targets"),
    "bias_shape": ({"bias": torch.randn(12)}, "bias"),
    "target_out_of_range": ({"targets": torch.tensor([0, 1, 13, 2, 3, 4])}, "targets"),
    "target_negative": ({"targets": torch.tensor([0, 1, -1, 2, 3, 4])}, "targets"),
}


@each_twin
@pytest.mark.parametrize("bad", list(BAD))
def test_bad_input_raises(twin, bad):
    """ValueError naming the argument (the out-of-range targets: torch's host check, JAX's on concrete
    targets)."""
    g = torch.Generator().manual_seed(10)
    args = {"x": torch.randn(6, 8, generator=g), "weight": torch.randn(13, 8, generator=g),
            "targets": torch.randint(0, 13, (6,), generator=g)}
    change, name = BAD[bad]
    args.update(change)
    args = {k: twin.array(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(ValueError, match=name):
        twin.logprobs_call(args.pop("x"), args.pop("weight"), args.pop("targets"), return_entropy=True, **args)


@each_twin
def test_custom_ignore_index(twin):
    """ignore_index=7 (inside [0, V)): rows with target 7 give 0 and no gradient; -100 is then out of range."""
    case = LogprobCase("ign7", (17,), 16, 300, "float32", bias=True, ignore_frac=0.0, seed=11)
    inp = make_logprob_inputs(case)
    t = inp["targets"].clone()
    t = torch.where(t == 7, 8, t)
    t[[1, 4, 5]] = 7
    g_logp, g_ent = _cotangents(case)
    out = twin.logprobs(twin.array(inp["x"]), twin.array(inp["weight"]), twin.array(t), bias=twin.array(inp["bias"]),
                        g_logp=g_logp, g_entropy=g_ent, ignore_index=7, chunk_rows=twin.option_chunk_rows)
    ref = logprobs_reference(inp["x"], inp["weight"], t, bias=inp["bias"], ignore_index=7, grad_logp=g_logp,
                             grad_entropy=g_ent)
    for k in ("logp", "entropy", "dx", "dw", "db"):
        assert rel_err(out[k], ref[k]) <= bound(k, case.dtype), k
    for k in ("logp", "entropy", "dx"):
        assert np.all(as_float64(out[k])[[1, 4, 5]] == 0), k
    bad = t.clone()
    bad[0] = IGNORE_INDEX
    with pytest.raises(ValueError, match="targets"):
        twin.logprobs_call(twin.array(inp["x"]), twin.array(inp["weight"]), twin.array(bad), ignore_index=7)


@each_twin
def test_out_of_range_targets_unchecked(twin):
    """Without the check (torch validate=False; JAX traced targets) an out-of-range row gives a NaN logp, the
    other rows their values."""
    case = LogprobCase("oor", (9,), 16, 130, "float32", ignore_frac=0.0, seed=12)
    inp = make_logprob_inputs(case)
    t = inp["targets"].clone()
    t[[2, 6]] = torch.tensor([130, -1])
    extra = {"validate": False} if twin is TORCH else {}
    out = twin.logprobs(twin.array(inp["x"]), twin.array(inp["weight"]), twin.array(t), grads=False,
                        return_entropy=False, **extra)
    logp = as_float64(out["logp"])
    assert np.isnan(logp[[2, 6]]).all() and np.isfinite(np.delete(logp, [2, 6])).all(), logp
    ok = np.delete(np.arange(9), [2, 6])
    ref = logprobs_reference(inp["x"][ok], inp["weight"], inp["targets"][ok])
    assert rel_err(logp[ok], ref["logp"]) <= 1e-6

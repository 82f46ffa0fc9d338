"""The parity suite's own logic, on synthetic arrays and fake implementations, plus a few log-prob cases of the
real twins through the suite.

A deliberately perturbed gradient must be caught: one element off by 1 ULP is "not bitwise, 1 ULP, 1
element" (reported, not a failure); a 10% perturbation is a SPEC violation and a non-zero exit code. A twin
that is missing or raises NotImplementedError is a failure too.
"""

import ast
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from parity import catalog, environment, impls, measures, reference, report, runner, verdicts
from parity.cases import Case, CpoCase, LogprobCase, case_inputs, make_cpo_inputs, make_inputs, small_cases
from parity.explain import explain_intermediates, format_explain
from parity.impls import Impl, ImplResult, run_impl
from parity.measures import compare_pair, rel_err, ulp_distance
from parity.verdicts import evaluate_case, exit_code, judge, summarize

TINY = Case("tiny_f32", (6,), 16, 50, "float32", seed=1)
TINY_BF16 = Case("tiny_bf16_bias", (5,), 16, 40, "bfloat16", bias=True, seed=2)
TINY_LP = LogprobCase("tiny_lp_f32", (7,), 16, 50, "float32", softcap=5.0, temperature=0.7, seed=3)


def next_up(t: torch.Tensor, index=0) -> torch.Tensor:
    """A copy of ``t`` with one element moved up by exactly one ULP (in t's dtype)."""
    out = t.clone()
    flat = out.view(-1)
    bits = flat.view({2: torch.int16, 4: torch.int32}[t.element_size()])
    bits[index] += 1 if float(flat[index]) >= 0 else -1
    return out


def rounded(ref: dict, dtypes: dict) -> dict:
    """What a correctly rounded implementation would return: each reference output in its expected dtype."""
    return {k: (ref[k].to(getattr(torch, dt)) if dt else None) for k, dt in dtypes.items()}


def reference_tensors(case) -> dict:
    """The suite's float64 reference of ``case`` on the CPU."""
    return runner.reference_for(case, case_inputs(case), "cpu")[0]


def good_outputs(case) -> tuple[dict, dict]:
    ref = reference_tensors(case)
    return ref, rounded(ref, case.output_dtypes())


def ok_result(outputs: dict) -> ImplResult:
    return ImplResult("ok", outputs=outputs, deterministic={k: True for k in outputs})


def meta(case) -> dict:
    return catalog.case_meta(case)


# ------------------------------------------------------------------------------------------ measures
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
def test_one_ulp_perturbation_is_seen(dtype):
    a = torch.randn(7, 9).to(dtype)
    b = next_up(a, index=11)
    p = compare_pair(a, b)
    assert p["bitwise"] is False and p["max_ulp"] == 1 and p["n_diff"] == 1 and p["numel"] == 63
    name = str(dtype).removeprefix("torch.")
    assert ulp_distance(a.double(), b.double(), name) == (1, 1)      # through a cast to the named dtype
    assert compare_pair(a, a.clone()) == {"bitwise": True, "max_ulp": 0, "n_diff": 0, "numel": 63, "note": ""}


def test_ulp_conventions():
    a = torch.tensor([0.0, -0.0, float("nan"), 1.0, -1.0, float("inf"), 1e-45, -3.0])
    b = torch.tensor([-0.0, 0.0, float("nan"), float("nan"), 1.0, 3.4028235e38, -1e-45, -3.0000002])
    # per element: 0, 0, 0 (NaN = NaN), 2**32-1 (NaN vs a number), 2 * bits(1.0), 1, 2, 1
    assert ulp_distance(a, b) == (2**32 - 1, 5)
    assert ulp_distance(torch.tensor([1.0, -1.0]), torch.tensor([1.0, 1.0])) == (2 * 0x3F800000, 1)
    assert not measures.bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0])) == (0, 0)
    with pytest.raises(ValueError, match="one float dtype"):
        ulp_distance(a, b.double())


def test_measures_chunk(monkeypatch):
    a = torch.randn(100)
    b = next_up(next_up(a, 3), 95)
    b[50] = a[50] * 1.5
    ref = a.double() + 1e-3
    want_ulp, want_err = ulp_distance(a, b), rel_err(a, ref)
    monkeypatch.setattr(measures, "CHUNK", 7)
    assert ulp_distance(a, b) == want_ulp and want_ulp[1] == 3
    assert math.isclose(rel_err(a, ref), want_err, rel_tol=1e-12)


def test_rel_err_against_numpy():
    ref = torch.randn(33, 17, dtype=torch.float64)
    a = (ref * (1 + 1e-3 * torch.randn_like(ref))).to(torch.bfloat16)
    a64 = a.double().numpy()
    want = np.linalg.norm(a64 - ref.numpy()) / np.linalg.norm(ref.numpy())
    assert math.isclose(rel_err(a, ref), want, rel_tol=1e-12)
    assert rel_err(torch.zeros(3), torch.zeros(3, dtype=torch.float64)) == 0.0
    assert rel_err(torch.tensor([float("nan"), 1.0]), torch.ones(2, dtype=torch.float64)) == float("inf")
    assert rel_err(torch.tensor([2.0]), torch.zeros(1, dtype=torch.float64)) == 2.0   # ‖ref‖ = 0: absolute
    assert reference.rel_err is rel_err and reference.ulp_distance is ulp_distance   # one implementation


def test_bounds_and_judge():
    assert {k: (verdicts.bound("loss", k), verdicts.bound("dx", k)) for k in verdicts.BOUNDS} == {
        "float32": (1e-6, 5e-5), "bfloat16": (1e-5, 1e-2), "float16": (1e-5, 1e-2)}
    assert verdicts.bound("logp", "bfloat16") == 1e-5 and verdicts.bound("entropy", "float32") == 1e-4
    assert judge("dx", "float32", 4e-5, None)[0]
    assert not judge("dx", "float32", 6e-5, None)[0]
    assert not judge("loss", "float32", 2e-6, None)[0]
    assert not judge("logp", "float32", 2e-6, None)[0]
    assert judge("entropy", "float32", 5e-5, None)[0] and not judge("entropy", "bfloat16", 2e-4, None)[0]
    assert judge("dw", "bfloat16", 4e-3, None)[0]
    assert not judge("dw", "bfloat16", 2e-2, None)[0]
    ok, why, _ = judge("dw", "bfloat16", 4e-3, 3e-3)               # 4e-3 > 1.25 * 3e-3
    assert not ok and "Liger" in why
    assert judge("dw", "bfloat16", 3.7e-3, 3e-3)[0]
    assert judge("dw", "bfloat16", 5e-8, 0.0)[0]                    # both below the floor
    assert judge("loss", "bfloat16", 9e-6, 1e-9)[0]                 # the Liger rule is for gradients
    assert not judge("dx", "float32", float("inf"), None)[0]


# ------------------------------------------------------------------------------------------ evaluate_case
def test_one_ulp_off_gradient_is_reported_not_failed():
    ref, good = good_outputs(TINY)
    off = dict(good, dx=next_up(good["dx"], index=5))
    entry = evaluate_case(meta(TINY), {"torch": ok_result(good), "jax": ok_result(off)}, ref)
    p = entry["outputs"]["dx"]["pairs"]["torch~jax"]
    assert p["bitwise"] is False and p["max_ulp"] == 1 and p["n_diff"] == 1
    assert entry["outputs"]["dw"]["pairs"]["torch~jax"]["bitwise"] is True
    assert entry["outputs"]["loss"]["pairs"]["torch~jax"]["bitwise"] is True
    assert entry["violations"] == []
    assert entry["outputs"]["dx"]["verdict"] == {"torch": "ok", "jax": "ok"}
    assert "db" not in entry["outputs"]


def test_ten_percent_gradient_perturbation_is_a_violation():
    ref, good = good_outputs(TINY_BF16)
    bad = dict(good, dw=(good["dw"].float() * 1.1).to(torch.bfloat16))
    entry = evaluate_case(meta(TINY_BF16), {"torch": ok_result(good), "jax": ok_result(bad)}, ref)
    assert entry["outputs"]["dw"]["verdict"] == {"torch": "ok", "jax": "FAIL"}
    assert entry["outputs"]["dw"]["err"]["jax"] > 0.09
    assert any(v.startswith("jax dw:") for v in entry["violations"])
    assert exit_code(summarize([entry])) == 1
    good_only = evaluate_case(meta(TINY_BF16), {"torch": ok_result(good)}, ref)
    assert exit_code(summarize([good_only])) == 0


def test_liger_rule_in_bf16():
    """A twin gradient within 1e-2 but worse than 1.25x Liger's error on the same tensors is a violation."""
    ref, good = good_outputs(TINY_BF16)
    worse = dict(good, dx=(good["dx"].double() * (1 + 8e-3)).to(torch.bfloat16))
    results = {"torch": ok_result(worse), "jax": ok_result(good), "liger": ok_result(good)}
    entry = evaluate_case(meta(TINY_BF16), results, ref)
    assert entry["outputs"]["dx"]["verdict"]["torch"] == "FAIL"
    assert "Liger" in " ".join(entry["violations"])
    assert entry["outputs"]["dx"]["verdict"]["jax"] == "ok"
    assert "torch~liger" in entry["outputs"]["dx"]["pairs"]
    del results["liger"]                 # without Liger, only the 1e-2 bound applies
    assert evaluate_case(meta(TINY_BF16), results, ref)["violations"] == []


def test_wrong_dtype_missing_output_and_nan_are_violations():
    ref, good = good_outputs(TINY_BF16)
    f32_dw = dict(good, dw=ref["dw"].to(torch.float32))
    no_db = dict(good, db=None)
    nan_dx = dict(good, dx=good["dx"].clone())
    nan_dx["dx"][0, 0] = float("nan")
    entry = evaluate_case(meta(TINY_BF16), {"torch": ok_result(f32_dw), "jax": ok_result(no_db)}, ref)
    text = " ".join(entry["violations"])
    assert "torch dw: dtype float32, expected bfloat16" in text and "jax db: missing output" in text
    entry = evaluate_case(meta(TINY_BF16), {"torch": ok_result(nan_dx)}, ref)
    assert entry["outputs"]["dx"]["verdict"]["torch"] == "FAIL"


def test_float32_bias_with_bf16_x_expects_a_float32_db():
    case = Case("b32", (5,), 16, 40, "bfloat16", bias=True, bias_dtype="float32", seed=4)
    assert make_inputs(case)["bias"].dtype == torch.float32
    ref, good = good_outputs(case)
    assert good["db"].dtype == torch.float32
    assert evaluate_case(meta(case), {"torch": ok_result(good)}, ref)["violations"] == []
    bf16_db = dict(good, db=good["db"].to(torch.bfloat16))
    entry = evaluate_case(meta(case), {"torch": ok_result(bf16_db)}, ref)
    assert entry["violations"] == ["torch db: dtype bfloat16, expected float32"]


def test_logprob_outputs_and_bounds():
    """logp takes the loss bound, entropy its own 1e-4, both are float32; the gradients the gradient bound."""
    ref, good = good_outputs(TINY_LP)
    assert set(meta(TINY_LP)["outputs"]) == {"logp", "entropy", "dx", "dw"}
    entry = evaluate_case(meta(TINY_LP), {"torch": ok_result(good), "jax": ok_result(good)}, ref)
    assert entry["violations"] == [] and entry["outputs"]["entropy"]["bound"] == 1e-4
    near = dict(good, entropy=(good["entropy"].double() * (1 + 5e-5)).float())      # above 1e-6, below 1e-4
    far = dict(good, entropy=(good["entropy"].double() * (1 + 5e-4)).float(),
               logp=(good["logp"].double() * (1 + 5e-6)).float())
    assert evaluate_case(meta(TINY_LP), {"torch": ok_result(near)}, ref)["violations"] == []
    entry = evaluate_case(meta(TINY_LP), {"torch": ok_result(far)}, ref)
    assert [v.split(":")[0] for v in entry["violations"]] == ["torch logp", "torch entropy"]


def test_errors_missing_and_exit_codes():
    ref, good = good_outputs(TINY)
    m = meta(TINY)
    # a twin that raises: a failure
    e = evaluate_case(m, {"torch": ok_result(good), "jax": ImplResult("error", "RuntimeError: boom")}, ref)
    assert e["violations"] == ["jax: raised RuntimeError: boom"] and exit_code(summarize([e])) == 1
    # a twin that is missing (or raised NotImplementedError): a failure too
    e = evaluate_case(m, {"torch": ok_result(good), "jax": ImplResult("missing", "NotImplementedError: x")}, ref)
    assert e["violations"] == ["jax: missing (NotImplementedError: x)"]
    assert e["outputs"]["dx"]["verdict"]["jax"] == "missing" and exit_code(summarize([e])) == 1
    assert "FAIL missing" in report.format_table({"cases": [e]})
    # nothing ran at all: exit 1, said clearly
    e = evaluate_case(m, {"liger": ImplResult("n/a", "z")}, ref)
    s = summarize([e])
    assert s["nothing_ran"] and e["violations"] == [] and exit_code(s) == 1
    assert "NOTHING RAN" in report.format_summary({"summary": s, "environment": {"device": "cpu"},
                                                    "exit_code": 1})
    # inputs written to: a failure; the reference raising: a failure, outputs unchecked
    assert exit_code(summarize([evaluate_case(m, {"torch": ok_result(good)}, ref, mutated=["torch (x)"])])) == 1
    e = evaluate_case(m, {"torch": ok_result(good)}, None, ref_status="error", ref_reason="ValueError: v")
    assert e["violations"] == ["reference: raised ValueError: v"]
    assert e["outputs"]["dx"]["verdict"]["torch"] == "unchecked"


# ------------------------------------------------------------------------------------------ runners (fakes)
def naive_fused_lce(x, weight, targets, *, bias=None, ignore_index=-100, reduction="mean",
                    label_smoothing=0.0, z_loss=0.0, softcap=None, class_weights=None, **_):
    """Plain float32 torch (TINY's options only): a stand-in twin for the suite's plumbing."""
    z = (x.float() @ weight.float().T)
    if bias is not None:
        z = z + bias.float()
    return torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1),
                                             ignore_index=ignore_index, reduction=reduction)


def naive_logprobs(x, weight, targets, *, bias=None, ignore_index=-100, softcap=None, temperature=1.0,
                   return_entropy=False, **_):
    z = x.float() @ weight.float().T
    z = (z if softcap is None else softcap * torch.tanh(z / softcap)) / temperature
    lp = torch.log_softmax(z, dim=-1)
    valid = targets != ignore_index
    logp = torch.where(valid, lp.gather(-1, torch.where(valid, targets, 0)[..., None])[..., 0], 0.0)
    ent = torch.where(valid, -(lp.exp() * lp).sum(-1), 0.0)
    return (logp, ent) if return_entropy else logp


def fake(name, **fns):
    return Impl(name, fns, {k: "" for k in fns})


def test_run_impl_torch_runner_and_determinism():
    inp = case_inputs(TINY)
    r = run_impl(fake("torch", flce=naive_fused_lce), TINY, inp, "cpu")
    assert r.status == "ok" and all(r.deterministic[k] for k in ("loss", "dx", "dw"))
    assert r.outputs["dx"].shape == inp["x"].shape and r.outputs["db"] is None
    assert rel_err(r.outputs["dx"], reference_tensors(TINY)["dx"]) < 1e-5

    calls = []

    def flaky(*args, **kw):               # a different last bit on the second run
        loss = naive_fused_lce(*args, **kw)
        calls.append(1)
        return loss * (1 + 2.0**-23) if len(calls) == 2 else loss

    r = run_impl(fake("torch", flce=flaky), TINY, inp, "cpu")
    assert r.status == "ok" and r.deterministic["loss"] is False


def test_not_implemented_and_missing_twins_fail():
    inp = case_inputs(TINY)

    def unbuilt(*a, **k):
        raise NotImplementedError("softcap")

    def broken(*a, **k):
        raise RuntimeError("boom")

    r = run_impl(fake("torch", flce=unbuilt), TINY, inp, "cpu")
    assert r.status == "missing" and "NotImplementedError: softcap" in r.reason
    r2 = run_impl(Impl("jax", {"flce": None}, {"flce": "fce_jax.fused_lce does not exist"}), TINY, inp, "cpu")
    assert r2.status == "missing"
    r3 = run_impl(fake("torch", flce=broken), TINY, inp, "cpu")
    assert r3.status == "error" and "boom" in r3.reason
    ref, good = good_outputs(TINY)
    for twin, res in (("torch", r), ("jax", r2)):
        other = "jax" if twin == "torch" else "torch"
        e = evaluate_case(meta(TINY), {twin: res, other: ok_result(good)}, ref)
        assert e["violations"] == [f"{twin}: missing ({res.reason})"] and exit_code(summarize([e])) == 1


def test_torch_and_jax_runners_on_logprobs():
    """Both runners hand the same fixed cotangents of logp and entropy to the backward as the reference."""
    import jax
    import jax.numpy as jnp

    def jax_logprobs(x, w, t, *, bias=None, ignore_index=-100, softcap=None, temperature=1.0, **_):
        z = x.astype(jnp.float32) @ w.astype(jnp.float32).T
        z = softcap * jnp.tanh(z / softcap) / temperature
        lp = jax.nn.log_softmax(z, axis=-1)
        valid = t != ignore_index
        logp = jnp.where(valid, jnp.take_along_axis(lp, jnp.where(valid, t, 0)[..., None], -1)[..., 0], 0.0)
        return logp, jnp.where(valid, -(jnp.exp(lp) * lp).sum(-1), 0.0)

    inp = case_inputs(TINY_LP)
    ref = reference_tensors(TINY_LP)
    for impl in (fake("torch", logprobs=naive_logprobs), fake("jax", logprobs=jax_logprobs)):
        r = run_impl(impl, TINY_LP, inp, "cpu")
        assert r.status == "ok", r.reason + "".join(r.notes)
        assert set(r.outputs) == {"logp", "entropy", "dx", "dw", "db"} and r.outputs["db"] is None
        for k in ("logp", "entropy", "dx", "dw"):
            assert rel_err(r.outputs[k], ref[k]) < 1e-5, (impl.name, k)
        assert float(ref["dx"].abs().max()) > 1e-3          # both cotangents reach the gradients


def test_jax_runner_through_the_bridge():
    """The JAX path: zero-copy inputs, vjp under jit, the cotangent for "none"."""
    import jax
    import jax.numpy as jnp

    def jax_naive(x, w, t, *, bias=None, class_weights=None, reduction="mean", **_):
        z = x.astype(jnp.float32) @ w.astype(jnp.float32).T
        lse = jax.nn.logsumexp(z, axis=-1)
        valid = t != -100
        zy = jnp.take_along_axis(z, jnp.where(valid, t, 0)[..., None], axis=-1)[..., 0]
        rows = jnp.where(valid, lse - zy, 0.0)
        if reduction == "none":
            return rows
        return rows.sum() / valid.sum() if reduction == "mean" else rows.sum()

    for case in (TINY, Case("tiny_none", (2, 3), 16, 50, "float32", reduction="none", seed=3)):
        inp = case_inputs(case)
        r = run_impl(fake("jax", flce=jax_naive), case, inp, "cpu")
        assert r.status == "ok", r.reason + "".join(r.notes)
        assert any("int64->int32" in n for n in r.notes)
        ref = reference_tensors(case)
        for k in ("loss", "dx", "dw"):
            assert rel_err(r.outputs[k], ref[k]) < 1e-5, k


def test_liger_runner_and_support(device):
    inp = case_inputs(TINY, device)          # the Triton interpreter on a CPU machine (conftest), else the GPU
    loaded = impls.load_impls(("liger",))
    if loaded["liger"].fns["flce"] is None:
        pytest.skip("Liger is not installed")
    r = run_impl(loaded["liger"], TINY, inp, device)
    assert r.status == "ok", r.reason
    assert rel_err(r.outputs["dw"], reference_tensors(TINY)["dw"].to(device)) < 1e-5
    support = impls.liger_support
    assert "hinge" in support(CpoCase("h", 1, 4, 8, 20, "float32", loss_type="hinge"), "cpu")
    assert support(CpoCase("s", 1, 4, 8, 20, "float32", loss_type="simpo", average_log_prob=False), "cpu")
    assert support(CpoCase("c", 1, 4, 8, 20, "float32"), "cpu") == ""
    assert "log-prob" in support(TINY_LP, device)
    assert "normalizer" in support(Case("n", (4,), 8, 20, "float32", normalizer=3.0), device)
    assert "bias dtype" in support(Case("b", (4,), 8, 20, "bfloat16", bias=True, bias_dtype="float32"), device)
    assert run_impl(loaded["liger"], TINY_LP, case_inputs(TINY_LP), "cpu").status == "n/a"


def test_cpo_inputs():
    case = catalog.small_cpo_cases()[0]
    a, b = make_cpo_inputs(case), make_cpo_inputs(case)
    assert a["x"].shape == (2 * case.pairs, case.t, case.h) and a["targets"].shape == (2 * case.pairs, case.t)
    assert torch.equal(a["targets"], b["targets"]) and torch.equal(a["x"], b["x"])
    assert ((a["targets"] != -100).sum(dim=1) >= 1).all()
    assert (a["targets"][:, 0] == -100).all()       # the prompt


def test_case_inputs_cotangents():
    lp = case_inputs(TINY_LP)
    assert lp["grad_logp"].shape == TINY_LP.shape and lp["grad_entropy"].dtype == torch.float32
    assert not torch.equal(lp["grad_logp"], lp["grad_entropy"]) and (lp["grad_logp"] < 0).any()
    assert torch.equal(case_inputs(TINY_LP)["grad_entropy"], lp["grad_entropy"])      # fixed
    none = case_inputs(Case("n", (2, 3), 8, 20, "float32", reduction="none", seed=3))["grad_loss"]
    assert none.shape == (2, 3) and 0.5 <= float(none.min()) and float(none.max()) < 1.5
    assert case_inputs(TINY)["grad_loss"] is None


# ------------------------------------------------------------------------------------------ the real twins
@pytest.mark.parametrize("name", ["logprobs_bias_bf16", "logprobs_softcap_temp_f32", "logprobs_ignored_3d_bf16"])
def test_logprob_cases_through_the_suite(name):
    """fce_torch and fce_jax fused_token_logprobs in the interpreters, through the suite: within the SPEC
    bounds, deterministic, every output present."""
    case = next(c for c in catalog.small_logprob_cases() if c.name == name)
    entry = runner.run_case(case, "cpu", impls.load_impls(("torch", "jax")))
    assert {k: v["status"] for k, v in entry["impls"].items()} == {"torch": "ok", "jax": "ok"}, entry["impls"]
    assert entry["violations"] == []
    assert set(entry["outputs"]) == {"logp", "entropy", "dx", "dw"} | ({"db"} if case.bias else set())
    for out, rec in entry["outputs"].items():
        assert rec["verdict"] == {"torch": "ok", "jax": "ok"}, out
        assert rec["deterministic"] == {"torch": True, "jax": True}, out
        assert 0 < rec["err"]["torch"] <= rec["bound"] and rec["pairs"]["torch~jax"] is not None, out


# ------------------------------------------------------------------------------------------ float32 policy
def test_float32_ieee_is_set_around_float32_cases_and_reported(monkeypatch):
    import jax

    seen = {}

    def recording(x, weight, targets, **kw):
        seen.setdefault(str(x.dtype), []).append(
            (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             jax.config.jax_default_matmul_precision))
        return naive_fused_lce(x, weight, targets, **kw)

    monkeypatch.setattr(runner, "load_impls", lambda names: {"torch": fake("torch", flce=recording)})
    before = environment.float32_settings()
    torch.backends.cuda.matmul.allow_tf32 = True          # a user who enabled TF32
    jax.config.update("jax_default_matmul_precision", "tensorfloat32")
    try:
        res = runner.run_suite([TINY, TINY_BF16], "cpu", impl_names=("torch",))
        after = environment.float32_settings()
    finally:
        torch.set_float32_matmul_precision(before["torch.float32_matmul_precision"])
        jax.config.update("jax_default_matmul_precision", before["jax_default_matmul_precision"])
    assert set(seen["torch.float32"]) == {(False, False, "highest")}
    assert set(seen["torch.bfloat16"]) == {(True, before["torch.backends.cudnn.allow_tf32"], "tensorfloat32")}
    assert after["torch.backends.cuda.matmul.allow_tf32"] and after["jax_default_matmul_precision"] == "tensorfloat32"
    env = res["environment"]
    assert env["float32_set"] == environment.FLOAT32_IEEE
    assert env["float32_found"]["jax_default_matmul_precision"] == "tensorfloat32"
    assert env["float32_found"]["torch.backends.cuda.matmul.allow_tf32"] is True
    assert "torch.backends.cuda.matmul.allow_tf32=False" in report.to_markdown(res)


def test_report_written_mid_run_says_it_is_unfinished(monkeypatch):
    """The report rewritten after each case (so that a run stopped by a time limit leaves its finished cases)
    names the cases not run yet and exits 1 until the last case is in: a cut run never reads as a pass."""
    monkeypatch.setattr(runner, "load_impls", lambda names: {"torch": fake("torch", flce=naive_fused_lce)})
    partials = []
    res = runner.run_suite([TINY, TINY_BF16], "cpu", impl_names=("torch",), on_case=partials.append)
    first, last = partials
    assert first["summary"]["pending"] == ["tiny_bf16_bias"] and first["exit_code"] == 1
    assert "UNFINISHED: 1 of 2 case(s) ran when this report was written; not run: tiny_bf16_bias" in \
        report.format_summary(first)
    for done in (last, res):
        assert done["summary"]["pending"] == [] and done["exit_code"] == 0
        assert "UNFINISHED" not in report.format_summary(done)


# ------------------------------------------------------------------------------------------ cases, explain
def test_case_selection():
    cases = catalog.default_cases("cpu")
    names = {c.name for c in cases}
    assert {c.name for c in small_cases() + catalog.small_option_cases()} <= names
    assert {c.kind for c in cases} == {"flce", "cpo", "logprobs"} and len(names) == len(cases)
    opts = catalog.small_option_cases()
    assert any(c.token_scaling for c in opts) and any(isinstance(c.normalizer, tuple) for c in opts)
    assert any(c.negative_class_weights for c in opts) and any(c.bias_dtype == "float32" for c in opts)
    lps = catalog.small_logprob_cases()
    assert {c.dtype for c in lps} == {"float32", "bfloat16"} and any(len(c.shape) == 2 for c in lps)
    assert any(c.softcap and c.temperature != 1.0 for c in lps) and any(c.ignore_frac >= 0.5 for c in lps)
    assert [c.name for c in catalog.select_cases(cases, ["f32_basic"])] == ["f32_basic"]
    assert all("bf16" in c.name for c in catalog.select_cases(cases, ["*bf16*"]))
    assert catalog.select_cases(cases, ["no_such_case"]) == []
    assert 0 < len(catalog.quick_cases(cases, "cpu")) <= 6
    assert {c.kind for c in catalog.default_cases("cpu", cpo=False, logprobs=False)} == {"flce"}


def test_gpu_case_table():
    gpu = catalog.default_cases("cuda")
    flce = [c for c in gpu if c.kind == "flce"]
    assert {(4096, 4096, 128256), (8192, 2304, 256000)} <= {(c.rows, c.h, c.v) for c in flce}
    big = [c for c in flce if c.rows == 4096]
    assert {c.reduction for c in big} == {"mean", "sum", "none"}
    assert any(c.bias for c in big) and any(c.class_weights for c in big) and any(c.softcap for c in big)
    assert any(c.label_smoothing for c in big) and any(c.z_loss for c in big)
    assert any(c.token_scaling for c in big) and any(isinstance(c.normalizer, tuple) for c in big)
    assert any(c.negative_class_weights for c in big) and any(c.bias_dtype == "float32" for c in big)
    assert any(c.dtype == "float32" for c in flce) and any(c.kind == "cpo" for c in gpu)
    lp = {(c.rows, c.h, c.v, c.dtype, c.temperature) for c in gpu if c.kind == "logprobs"}
    assert {(4096, 4096, 128256, "bfloat16", 1.0), (8192, 2048, 151936, "bfloat16", 0.7)} <= lp


def test_explain_names_the_first_divergent_stage():
    logits = torch.randn(4, 10)
    lse = torch.logsumexp(logits, dim=1)
    dl = torch.randn(4, 10).to(torch.bfloat16)
    a = {"logits": logits, "lse": lse, "dlogits": dl, "dx": torch.randn(4, 3), "dw": torch.randn(10, 3)}
    b = dict(a, lse=next_up(lse, 2), dlogits=next_up(dl, 7))
    ex = explain_intermediates(a, b)
    assert ex["first_divergence"] == "lse"
    stages = {s["stage"]: s for s in ex["stages"]}
    assert stages["logits"]["bitwise"] and stages["lse"]["max_ulp"] == 1
    assert stages["lse"]["first_diff"]["index"] == [2]
    assert stages["dlogits"]["first_diff"]["index"] == [0, 7]
    text = format_explain(ex)
    assert "part at 'lse'" in text and "row_stats" in text
    assert explain_intermediates(a, dict(a))["first_divergence"] is None
    dt = explain_intermediates(a, dict(a, dw=a["dw"].double()))
    assert dt["first_divergence"] == "dw" and "dtype" in dt["stages"][-1]["note"]


def test_parity_imports_run_in_no_circle():
    """Each parity module imports only modules before it in some order (no cycle, also not through a
    function-level import)."""
    pkg = Path(runner.__file__).parent
    deps = {}
    for f in pkg.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names |= {node.module} if node.module else {a.name for a in node.names}
        deps[f.stem] = names & {p.stem for p in pkg.glob("*.py")}
    done: set[str] = set()
    while len(done) < len(deps):
        ready = {m for m, d in deps.items() if m not in done and d <= done}
        assert ready, f"import cycle among {sorted(set(deps) - done)}"
        done |= ready


# ------------------------------------------------------------------------------------------ end to end (fakes)
def test_suite_end_to_end_with_fakes(monkeypatch, tmp_path, capsys):
    """python -m parity's path with a correct torch stand-in and a JAX stand-in whose dW is 10% off."""
    import jax
    import jax.numpy as jnp

    def jax_ce(x, w, t):
        z = x.astype(jnp.float32) @ w.astype(jnp.float32).T
        lse = jax.nn.logsumexp(z, axis=-1)
        valid = t != -100
        zy = jnp.take_along_axis(z, jnp.where(valid, t, 0)[..., None], axis=-1)[..., 0]
        return jnp.where(valid, lse - zy, 0.0).sum() / valid.sum()

    @jax.custom_vjp
    def perturbed(x, w, t):
        return jax_ce(x, w, t)

    def fwd(x, w, t):
        loss, vjp = jax.vjp(lambda x_, w_: jax_ce(x_, w_, t), x, w)
        return loss, vjp

    def bwd(vjp, g):
        dx, dw = vjp(g)
        return dx, (dw.astype(jnp.float32) * 1.1).astype(dw.dtype), None

    perturbed.defvjp(fwd, bwd)
    fakes = {"torch": fake("torch", flce=naive_fused_lce),
             "jax": fake("jax", flce=lambda x, w, t, **k: perturbed(x, w, t))}
    monkeypatch.setattr(runner, "load_impls", lambda names: {k: fakes[k] for k in names if k in fakes})
    monkeypatch.setattr(catalog, "default_cases", lambda device, cpo=True, logprobs=True: [TINY])

    from parity.__main__ import main

    rc = main(["--device", "cpu", "--out", str(tmp_path), "--impls", "torch,jax", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL jax" in out and "SPEC VIOLATIONS" in out and "jax dw:" in out
    data = json.loads((tmp_path / "parity.json").read_text())
    assert data["exit_code"] == 1
    (entry,) = data["cases"]
    assert entry["outputs"]["dw"]["verdict"] == {"torch": "ok", "jax": "FAIL"}
    assert entry["outputs"]["dw"]["pairs"]["torch~jax"]["bitwise"] is False
    assert entry["outputs"]["loss"]["deterministic"] == {"torch": True, "jax": True}
    assert data["environment"]["float32_set"]["jax_default_matmul_precision"] == "highest"
    md = (tmp_path / "parity.md").read_text()
    assert "| case | out | torch=jax" in md and "FAIL jax" in md and "`tiny_f32`" in md

    # the same with a correct JAX stand-in: exit 0; with an unbuilt one: exit 1
    fakes["jax"] = fake("jax", flce=lambda x, w, t, **k: jax_ce(x, w, t))
    assert main(["--device", "cpu", "--out", str(tmp_path), "--impls", "torch,jax", "--no-progress"]) == 0

    def unbuilt(*a, **k):
        raise NotImplementedError("not yet")

    fakes["jax"] = fake("jax", flce=unbuilt)
    assert main(["--device", "cpu", "--out", str(tmp_path), "--impls", "torch,jax", "--no-progress"]) == 1
    assert "jax: missing (NotImplementedError: not yet)" in capsys.readouterr().out


def test_cli_list_and_bad_case(capsys):
    from parity.__main__ import main

    assert main(["--device", "cpu", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "f32_basic" in listed and "logprobs_softcap_temp_f32" in listed and "temperature=0.7" in listed
    assert main(["--device", "cpu", "--list", "--no-logprobs", "--no-cpo", "--case", "normalizer"]) == 0
    assert capsys.readouterr().out.split()[0] == "normalizer_pair_bf16"
    assert main(["--device", "cpu", "--case", "no_such_case"]) == 2


def test_progress_and_json_helpers():
    import io

    s = io.StringIO()
    p = report.Progress(stream=s)
    p.start(2)
    p.step("a: torch")
    p.step("a: jax")
    p.done()
    lines = s.getvalue().splitlines()
    assert len(lines) == 3 and "a: torch" in lines[0] and "2/2" in lines[-1] and "#" * 28 in lines[-1]
    assert report.jsonable({"e": float("inf"), "n": float("nan"), "t": (1, 2)}) == {"e": "inf", "n": "nan",
                                                                                   "t": [1, 2]}


def test_nondeterminism_is_summarized_not_failed():
    ref, good = good_outputs(TINY)
    flaky = ok_result(good)
    flaky.deterministic["dw"] = False
    entry = evaluate_case(meta(TINY), {"torch": flaky, "jax": ok_result(good)}, ref)
    s = summarize([entry])
    assert s["nondeterministic"] == {"torch": ["tiny_f32 (dw)"]} and exit_code(s) == 0
    text = report.format_summary({"summary": s, "environment": {"device": "cpu"}, "exit_code": 0})
    assert "NOT bitwise deterministic: torch in 1 case(s): tiny_f32 (dw)" in text
    assert "N" in report.format_table({"cases": [entry]}).split("\n")[4]     # the dw row: determ "N/y"

"""The parity suite's own logic, on synthetic arrays and fake implementations (fast; no twin needed).

A deliberately perturbed gradient must be caught: one element off by 1 ULP is "not bitwise, 1 ULP, 1
element" (reported, not a failure); a 10% perturbation is a SPEC violation and a non-zero exit code.
"""

import json
import math

import pytest
import torch

from parity import reference, report, suite
from parity.cases import Case, make_inputs, small_cases
from parity.explain import explain_intermediates, format_explain
from parity.suite import (CpoCase, ImplResult, compare_pair, evaluate_case, exit_code, judge, rel_err,
                          summarize, ulp_stats)

TINY = Case("tiny_f32", (6,), 16, 50, "float32", seed=1)
TINY_BF16 = Case("tiny_bf16_bias", (5,), 16, 40, "bfloat16", bias=True, seed=2)


def next_up(t: torch.Tensor, index=0) -> torch.Tensor:
    """A copy of ``t`` with one element moved up by exactly one ULP (in t's dtype)."""
    out = t.clone()
    flat = out.view(-1)
    iv = {2: torch.int16, 4: torch.int32}[t.element_size()]
    bits = flat.view(iv)
    v = float(flat[index])
    bits[index] += 1 if v >= 0 else -1
    return out


def rounded_outputs(ref: dict, dtype: torch.dtype, bias: bool) -> dict:
    """What a correctly rounded implementation would return: loss float32, gradients in ``dtype``."""
    out = {"loss": ref["loss"].to(torch.float32), "dx": ref["dx"].to(dtype), "dw": ref["dw"].to(dtype)}
    out["db"] = ref["db"].to(dtype) if bias else None
    return out


def reference_tensors(case) -> dict:
    inp = make_inputs(case)
    r = reference.flce_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"],
                                 class_weights=inp["class_weights"], **case.options())
    return {k: (torch.from_numpy(r[k]) if r[k] is not None else None) for k in suite.OUTPUTS}


def ok_result(outputs: dict) -> ImplResult:
    return ImplResult("ok", outputs=outputs, deterministic={k: True for k in outputs})


# ------------------------------------------------------------------------------------------ measures
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
def test_one_ulp_perturbation_is_seen(dtype):
    a = torch.randn(7, 9).to(dtype)
    b = next_up(a, index=11)
    p = compare_pair(a, b)
    assert p["bitwise"] is False and p["max_ulp"] == 1 and p["n_diff"] == 1 and p["numel"] == 63
    name = str(dtype).removeprefix("torch.")
    assert reference.ulp_distance(a, b, name) == (1, 1)     # the same answer as parity.reference
    assert compare_pair(a, a.clone()) == {"bitwise": True, "max_ulp": 0, "n_diff": 0, "numel": 63, "note": ""}


def test_ulp_conventions_match_reference():
    a = torch.tensor([0.0, -0.0, float("nan"), 1.0, -1.0, float("inf"), 1e-45, -3.0])
    b = torch.tensor([-0.0, 0.0, float("nan"), float("nan"), 1.0, 3.4028235e38, -1e-45, -3.0000002])
    assert ulp_stats(a, b) == reference.ulp_distance(a, b, "float32")
    assert not suite.bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert ulp_stats(torch.tensor([0.0]), torch.tensor([-0.0])) == (0, 0)
    big = torch.tensor([1.0, -1.0])       # across zero: the distance runs through both signs
    assert ulp_stats(big, -big)[0] == 2 * 0x3F800000


def test_ulp_stats_chunks(monkeypatch):
    monkeypatch.setattr(suite, "_CHUNK", 7)
    a = torch.randn(100)
    b = next_up(next_up(a, 3), 95)
    b[50] = a[50] * 1.5
    assert ulp_stats(a, b) == reference.ulp_distance(a, b, "float32")


def test_rel_err_matches_reference():
    ref = torch.randn(33, 17, dtype=torch.float64)
    a = (ref * (1 + 1e-3 * torch.randn_like(ref))).to(torch.bfloat16)
    assert math.isclose(rel_err(a, ref), reference.rel_err(a, ref), rel_tol=1e-12)
    assert rel_err(torch.zeros(3), torch.zeros(3, dtype=torch.float64)) == 0.0
    assert rel_err(torch.tensor([float("nan"), 1.0]), torch.ones(2, dtype=torch.float64)) == float("inf")
    assert rel_err(torch.tensor([2.0]), torch.zeros(1, dtype=torch.float64)) == 2.0   # ‖ref‖ = 0: absolute


def test_bounds_and_judge():
    assert suite.accuracy_bounds("float32") == (1e-6, 5e-5)
    assert suite.accuracy_bounds("bfloat16") == (1e-5, 1e-2)
    assert suite.accuracy_bounds("float16") == (1e-5, 1e-2)
    assert judge("dx", "float32", 4e-5, None)[0]
    assert not judge("dx", "float32", 6e-5, None)[0]
    assert not judge("loss", "float32", 2e-6, None)[0]
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
    ref = reference_tensors(TINY)
    good = rounded_outputs(ref, torch.float32, bias=False)
    off = dict(good, dx=next_up(good["dx"], index=5))
    entry = evaluate_case(suite.case_meta(TINY), {"torch": ok_result(good), "jax": ok_result(off)}, ref)
    p = entry["outputs"]["dx"]["pairs"]["torch~jax"]
    assert p["bitwise"] is False and p["max_ulp"] == 1 and p["n_diff"] == 1
    assert entry["outputs"]["dw"]["pairs"]["torch~jax"]["bitwise"] is True
    assert entry["outputs"]["loss"]["pairs"]["torch~jax"]["bitwise"] is True
    assert entry["violations"] == []
    assert entry["outputs"]["dx"]["verdict"] == {"torch": "ok", "jax": "ok"}
    assert "db" not in entry["outputs"]


def test_ten_percent_gradient_perturbation_is_a_violation():
    ref = reference_tensors(TINY_BF16)
    good = rounded_outputs(ref, torch.bfloat16, bias=True)
    bad = dict(good, dw=(good["dw"].float() * 1.1).to(torch.bfloat16))
    results = {"torch": ok_result(good), "jax": ok_result(bad)}
    entry = evaluate_case(suite.case_meta(TINY_BF16), results, ref)
    assert entry["outputs"]["dw"]["verdict"] == {"torch": "ok", "jax": "FAIL"}
    assert entry["outputs"]["dw"]["err"]["jax"] > 0.09
    assert any(v.startswith("jax dw:") for v in entry["violations"])
    summary = summarize([entry])
    assert exit_code(summary) == 1
    good_only = evaluate_case(suite.case_meta(TINY_BF16), {"torch": ok_result(good)}, ref)
    assert exit_code(summarize([good_only])) == 0


def test_liger_rule_in_bf16():
    """A twin gradient within 1e-2 but worse than 1.25x Liger's error on the same tensors is a violation."""
    ref = reference_tensors(TINY_BF16)
    good = rounded_outputs(ref, torch.bfloat16, bias=True)
    worse = dict(good, dx=(good["dx"].double() * (1 + 8e-3)).to(torch.bfloat16))
    results = {"torch": ok_result(worse), "jax": ok_result(good), "liger": ok_result(good)}
    entry = evaluate_case(suite.case_meta(TINY_BF16), results, ref)
    assert entry["outputs"]["dx"]["verdict"]["torch"] == "FAIL"
    assert "Liger" in " ".join(entry["violations"])
    assert entry["outputs"]["dx"]["verdict"]["jax"] == "ok"
    assert "torch~liger" in entry["outputs"]["dx"]["pairs"]
    del results["liger"]                 # without Liger, only the 1e-2 bound applies
    assert evaluate_case(suite.case_meta(TINY_BF16), results, ref)["violations"] == []


def test_wrong_dtype_missing_output_and_nan_are_violations():
    ref = reference_tensors(TINY_BF16)
    good = rounded_outputs(ref, torch.bfloat16, bias=True)
    f32_dw = dict(good, dw=ref["dw"].to(torch.float32))
    no_db = dict(good, db=None)
    nan_dx = dict(good, dx=good["dx"].clone())
    nan_dx["dx"][0, 0] = float("nan")
    entry = evaluate_case(suite.case_meta(TINY_BF16),
                          {"torch": ok_result(f32_dw), "jax": ok_result(no_db)}, ref)
    text = " ".join(entry["violations"])
    assert "torch dw: dtype float32, expected bfloat16" in text and "jax db: missing output" in text
    entry = evaluate_case(suite.case_meta(TINY_BF16), {"torch": ok_result(nan_dx)}, ref)
    assert entry["outputs"]["dx"]["verdict"]["torch"] == "FAIL"


def test_errors_missing_and_exit_codes():
    ref = reference_tensors(TINY)
    good = rounded_outputs(ref, torch.float32, bias=False)
    meta = suite.case_meta(TINY)
    # a twin that raises: a failure
    e = evaluate_case(meta, {"torch": ok_result(good), "jax": ImplResult("error", "RuntimeError: boom")}, ref)
    assert e["violations"] == ["jax: raised RuntimeError: boom"] and exit_code(summarize([e])) == 1
    # a twin that is missing: reported, not a failure
    e = evaluate_case(meta, {"torch": ok_result(good), "jax": ImplResult("missing", "not yet")}, ref)
    assert e["violations"] == [] and e["outputs"]["dx"]["verdict"]["jax"] == "missing"
    assert exit_code(summarize([e])) == 0
    # nothing ran, both twins missing: exit 0, said clearly
    e = evaluate_case(meta, {"torch": ImplResult("missing", "x"), "jax": ImplResult("missing", "y"),
                             "liger": ImplResult("n/a", "z")}, ref)
    s = summarize([e])
    assert s["nothing_ran"] and s["twins_missing"] and exit_code(s) == 0
    assert "NOTHING RAN" in report.format_summary({"summary": s, "environment": {"device": "cpu"},
                                                    "exit_code": 0})
    # nothing ran because a twin only raised: exit 1
    e = evaluate_case(meta, {"torch": ImplResult("error", "boom"), "jax": ImplResult("missing", "y")}, ref)
    assert exit_code(summarize([e])) == 1
    # inputs written to: a failure; reference missing: reported, outputs unchecked
    e = evaluate_case(meta, {"torch": ok_result(good)}, ref, mutated=["torch (x)"])
    assert exit_code(summarize([e])) == 1
    e = evaluate_case(meta, {"torch": ok_result(good)}, None, ref_status="missing", ref_reason="no module")
    s = summarize([e])
    assert s["reference_missing"] == 1 and exit_code(s) == 0
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


def test_run_impl_torch_runner_and_determinism():
    inp = make_inputs(TINY)
    impl = suite.Impl("torch", {"flce": naive_fused_lce}, {"flce": ""})
    r = suite.run_impl(impl, TINY, inp, None, "cpu")
    assert r.status == "ok" and all(r.deterministic[k] for k in ("loss", "dx", "dw"))
    assert r.outputs["dx"].shape == inp["x"].shape and r.outputs["db"] is None
    ref = reference_tensors(TINY)
    assert rel_err(r.outputs["dx"], ref["dx"]) < 1e-5

    calls = []

    def flaky(*args, **kw):               # a different last bit on the second run
        loss = naive_fused_lce(*args, **kw)
        calls.append(1)
        return loss * (1 + 2.0**-23) if len(calls) == 2 else loss

    r = suite.run_impl(suite.Impl("torch", {"flce": flaky}, {"flce": ""}), TINY, inp, None, "cpu")
    assert r.status == "ok" and r.deterministic["loss"] is False

    def unbuilt(*a, **k):
        raise NotImplementedError("softcap")

    def broken(*a, **k):
        raise RuntimeError("boom")

    assert suite.run_impl(suite.Impl("torch", {"flce": unbuilt}, {}), TINY, inp, None, "cpu").status == "missing"
    r = suite.run_impl(suite.Impl("torch", {"flce": broken}, {}), TINY, inp, None, "cpu")
    assert r.status == "error" and "boom" in r.reason
    r = suite.run_impl(suite.Impl("jax", {"flce": None}, {"flce": "fce_jax.fused_lce does not exist yet"}),
                       TINY, inp, None, "cpu")
    assert r.status == "missing"


def test_jax_runner_through_the_bridge():
    """The JAX path: zero-copy inputs, value_and_grad under jit, vjp with the cotangent for "none"."""
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
        inp = make_inputs(case)
        g = suite.grad_output_for(case, "cpu")
        r = suite.run_impl(suite.Impl("jax", {"flce": jax_naive}, {}), case, inp, g, "cpu")
        assert r.status == "ok", r.reason + "".join(r.notes)
        assert any("int64->int32" in n for n in r.notes)
        ref = reference.flce_reference(inp["x"], inp["weight"], inp["targets"], grad_output=g, **case.options())
        for k in ("loss", "dx", "dw"):
            assert reference.rel_err(r.outputs[k], ref[k]) < 1e-5, k


def test_liger_runner_and_support(device):
    inp = make_inputs(TINY, device)          # the Triton interpreter on a CPU machine (conftest), else the GPU
    impls = suite.load_impls(("liger",))
    if impls["liger"].fns["flce"] is None:
        pytest.skip("Liger is not installed")
    r = suite.run_impl(impls["liger"], TINY, inp, None, device)
    assert r.status == "ok", r.reason
    ref = reference_tensors(TINY)
    assert rel_err(r.outputs["dw"], ref["dw"]) < 1e-5
    hinge = CpoCase("h", 1, 4, 8, 20, "float32", loss_type="hinge")
    assert "hinge" in suite.liger_support(hinge, "cpu")
    assert suite.liger_support(CpoCase("s", 1, 4, 8, 20, "float32", loss_type="simpo",
                                       average_log_prob=False), "cpu")
    assert suite.liger_support(CpoCase("c", 1, 4, 8, 20, "float32"), "cpu") == ""


# ------------------------------------------------------------------------------------------ torch64 reference
@pytest.mark.parametrize("name", ["all_options_bf16", "all_options_none_f16", "all_ignored", "softcap",
                                  "class_weights", "none_3d", "sum_bf16"])
def test_torch64_reference_matches_parity_reference(name):
    case = next(c for c in small_cases() if c.name == name)
    inp = make_inputs(case)
    g = suite.grad_output_for(case, "cpu")
    want = reference.flce_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"],
                                    class_weights=inp["class_weights"], grad_output=g, **case.options())
    got = suite.flce_reference_torch64(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"],
                                       class_weights=inp["class_weights"], grad_output=g,
                                       chunk_bytes=3 * case.v * 8, **case.options())   # 3-row chunks
    for k in suite.OUTPUTS:
        if want[k] is None:
            assert got[k] is None
            continue
        assert reference.rel_err(got[k], want[k]) < 1e-12, k


@pytest.mark.parametrize("case", suite.small_cpo_cases() + [
    CpoCase("simpo_avg_false_bias", 3, 5, 16, 40, "float32", loss_type="simpo", bias=True,
            average_log_prob=False, prompt_frac=0.4, seed=9)], ids=lambda c: c.name)
def test_torch64_cpo_reference_matches_parity_reference(case):
    inp = suite.make_cpo_inputs(case)
    want = reference.cpo_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"], **case.options())
    got = suite.cpo_reference_torch64(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"],
                                      chunk_bytes=1, **case.options())                  # one pair per chunk
    for k in suite.OUTPUTS:
        if want[k] is None:
            assert got[k] is None
            continue
        assert reference.rel_err(got[k], want[k]) < 1e-12, k


def test_cpo_inputs():
    case = suite.small_cpo_cases()[0]
    a, b = suite.make_cpo_inputs(case), suite.make_cpo_inputs(case)
    assert a["x"].shape == (2 * case.pairs, case.t, case.h) and a["targets"].shape == (2 * case.pairs, case.t)
    assert torch.equal(a["targets"], b["targets"]) and torch.equal(a["x"], b["x"])
    assert ((a["targets"] != -100).sum(dim=1) >= 1).all()
    assert (a["targets"][:, 0] == -100).all()       # the prompt


# ------------------------------------------------------------------------------------------ cases, explain
def test_case_selection():
    cases = suite.default_cases("cpu")
    assert {c.name for c in small_cases()} <= {c.name for c in cases}
    assert any(isinstance(c, CpoCase) for c in cases)
    assert [c.name for c in suite.select_cases(cases, ["f32_basic"])] == ["f32_basic"]
    assert all("bf16" in c.name for c in suite.select_cases(cases, ["*bf16*"]))
    assert suite.select_cases(cases, ["no_such_case"]) == []
    assert 0 < len(suite.quick_cases(cases, "cpu")) <= 6
    gpu = suite.default_cases("cuda")
    shapes = {(c.rows, c.h, c.v) for c in gpu if not isinstance(c, CpoCase)}
    assert {(4096, 4096, 128256), (8192, 2304, 256000)} <= shapes
    big = [c for c in gpu if not isinstance(c, CpoCase) and c.rows == 4096]
    assert {c.reduction for c in big} == {"mean", "sum", "none"}
    assert any(c.bias for c in big) and any(c.class_weights for c in big) and any(c.softcap for c in big)
    assert any(c.label_smoothing for c in big) and any(c.z_loss for c in big)
    assert any(c.dtype == "float32" for c in gpu)


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
    same = explain_intermediates(a, dict(a))
    assert same["first_divergence"] is None
    dt = explain_intermediates(a, dict(a, dw=a["dw"].double()))
    assert dt["first_divergence"] == "dw" and "dtype" in dt["stages"][-1]["note"]


# ------------------------------------------------------------------------------------------ end to end (fakes)
def test_suite_end_to_end_with_fakes(monkeypatch, tmp_path, capsys):
    """python -m parity's path with a correct torch stand-in and a JAX stand-in whose dW is 10% off."""
    import jax.numpy as jnp

    import jax

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

    def jax_fn(x, w, t, *, bias=None, class_weights=None, **_):
        return perturbed(x, w, t)

    fake = {"torch": suite.Impl("torch", {"flce": naive_fused_lce, "cpo": None}, {"flce": "", "cpo": "n/a"}),
            "jax": suite.Impl("jax", {"flce": jax_fn, "cpo": None}, {"flce": "", "cpo": "n/a"})}
    monkeypatch.setattr(suite, "load_impls", lambda names=suite.IMPLS: {k: fake[k] for k in names if k in fake})
    monkeypatch.setattr(suite, "default_cases", lambda device, cpo=True: [TINY])

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
    md = (tmp_path / "parity.md").read_text()
    assert "| case | out | torch=jax" in md and "FAIL jax" in md and "`tiny_f32`" in md

    # the same with a correct JAX stand-in: exit 0
    fake["jax"] = suite.Impl("jax", {"flce": lambda x, w, t, **k: jax_ce(x, w, t)}, {"flce": ""})
    assert main(["--device", "cpu", "--out", str(tmp_path), "--impls", "torch,jax", "--no-progress"]) == 0


def test_cli_list_and_bad_case(capsys):
    from parity.__main__ import main

    assert main(["--device", "cpu", "--list"]) == 0
    assert "f32_basic" in capsys.readouterr().out
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
    ref = reference_tensors(TINY)
    good = rounded_outputs(ref, torch.float32, bias=False)
    flaky = ok_result(good)
    flaky.deterministic["dw"] = False
    entry = evaluate_case(suite.case_meta(TINY), {"torch": flaky, "jax": ok_result(good)}, ref)
    s = summarize([entry])
    assert s["nondeterministic"] == {"torch": ["tiny_f32 (dw)"]} and exit_code(s) == 0
    text = report.format_summary({"summary": s, "environment": {"device": "cpu"}, "exit_code": 0})
    assert "NOT bitwise deterministic: torch in 1 case(s): tiny_f32 (dw)" in text
    assert "N" in report.format_table({"cases": [entry]}).split("\n")[4]     # the dw row: determ "N/y"

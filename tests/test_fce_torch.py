"""fce_torch.fused_lce (SPEC §1) and FusedLinearCrossEntropyLoss (SPEC §2) against the float64 reference.

Every numerical check compares with ``parity.reference.flce_reference`` evaluated in float64 on fresh random
inputs (``parity.cases.make_inputs``); an implementation is compared with itself only for determinism and
repeated backward. The twin file is tests/test_fce_jax.py (same test names where the test applies to both).
On a CPU the kernels run in the Triton interpreter, so every shape here is tiny.
"""

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fce_torch
import fce_torch.engine
import fce_torch.gemm
from fce_torch import FusedLinearCrossEntropyLoss, fused_lce
from helpers import (assert_close_to_reference, assert_twins_agree, case_chunk_rows, case_result, check_case,
                     reference_for_case, restrict_lse, targets_avoiding, tolerances, torch_run, valid_rows)
from parity.cases import IGNORE_INDEX, Case, make_inputs, small_cases
from parity.reference import as_float64, flce_reference, rel_err


def _check_dtypes(out: dict, inp: dict):
    assert out["loss"].dtype == torch.float32
    assert out["lse"].dtype == torch.float32
    assert out["dx"].dtype == inp["x"].dtype and out["dx"].shape == inp["x"].shape
    assert out["dw"].dtype == inp["weight"].dtype and out["dw"].shape == inp["weight"].shape
    if inp["bias"] is not None:
        assert out["db"].dtype == inp["bias"].dtype and out["db"].shape == inp["bias"].shape


# ============================================================================ 1. every small case
def test_small_case_matches_reference(case):
    """loss, dx, dw, db and the stats (lse of valid rows, z_loss, accuracy) of every small case within the SPEC
    bounds; chunk_rows 8 / default / 16 by case so that several chunks and a tail chunk run."""
    res = case_result("torch", case, case_chunk_rows(case))
    ref = reference_for_case(case, make_inputs(case))
    out, ref = restrict_lse(res, ref, make_inputs(case)["targets"])
    assert_close_to_reference(out, ref, case.dtype)
    dt = res["dtypes"]
    assert dt["loss"] == "float32" and dt["lse"] == "float32"
    assert dt["dx"] == dt["dw"] == case.dtype
    assert dt["db"] == (case.dtype if case.bias else None)
    assert res["loss"].shape == (() if case.reduction != "none" else case.shape)
    assert res["lse"].shape == case.shape


# ============================================================================ 2. every option
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions_with_bias(reduction):
    case = Case("bias", (37,), 32, 1000, "float32", bias=True, reduction=reduction, logit_scale=3.0, seed=21)
    inp = make_inputs(case)
    out = torch_run(fused_lce, inp, case.options(), chunk_rows=8)
    _check_dtypes(out, inp)
    check_case(case, inp, out)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_custom_ignore_index(reduction):
    """ignore_index=7: rows with target 7 are skipped; 7 is never a target of a valid row here."""
    case = Case("ign7", (29,), 16, 130, "float32", bias=True, reduction=reduction, seed=22)
    inp = make_inputs(case)
    g = torch.Generator().manual_seed(22)
    t = targets_avoiding(29, 130, 7, g)
    t[[0, 5, 6, 20]] = 7
    inp["targets"] = t
    out = torch_run(fused_lce, inp, case.options(), chunk_rows=8, ignore_index=7)
    check_case(case, inp, out, ignore_index=7)
    if reduction == "none":
        assert torch.all(out["loss"][[0, 5, 6, 20]] == 0)
        assert torch.all(out["dx"][[0, 5, 6, 20]] == 0)


@pytest.mark.parametrize("eps,weighted,reduction", [(0.3, False, "mean"), (1.0, False, "sum"),
                                                     (0.2, True, "mean"), (0.5, True, "none")])
def test_label_smoothing(eps, weighted, reduction):
    case = Case("ls", (21,), 32, 777, "float32", label_smoothing=eps, class_weights=weighted, reduction=reduction,
                logit_scale=4.0, seed=23)
    inp = make_inputs(case)
    check_case(case, inp, torch_run(fused_lce, inp, case.options(), chunk_rows=16))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_z_loss(reduction):
    case = Case("zl", (19,), 32, 777, "float32", z_loss=1e-2, reduction=reduction, logit_scale=5.0, seed=24)
    inp = make_inputs(case)
    out = torch_run(fused_lce, inp, case.options(), chunk_rows=8)
    check_case(case, inp, out)
    assert torch.all(out["z_loss"] > 0) if reduction != "none" else out["z_loss"].max() > 0


@pytest.mark.parametrize("softcap", [1.0, 15.0])
def test_softcap(softcap):
    case = Case("cap", (17,), 32, 1000, "float32", bias=True, softcap=softcap, logit_scale=30.0, seed=25)
    inp = make_inputs(case)
    check_case(case, inp, torch_run(fused_lce, inp, case.options(), chunk_rows=8))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_class_weights_with_zeros(reduction):
    """Class weights with exact zeros, some of them on targets of valid rows."""
    case = Case("cw", (31,), 24, 130, "float32", class_weights=True, reduction=reduction, seed=26)
    inp = make_inputs(case)
    t = inp["targets"]
    cw = inp["class_weights"].clone()
    cw[t[valid_rows(t)][:3]] = 0.0
    inp["class_weights"] = cw
    check_case(case, inp, torch_run(fused_lce, inp, case.options(), chunk_rows=8))


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_class_weights_zero_on_every_target(z_loss):
    """D = 0 ("mean"): the CE part is 0 (not NaN); the z-loss part is still averaged over the valid rows."""
    case = Case("d0", (13,), 16, 130, "float32", class_weights=True, z_loss=z_loss, seed=27)
    inp = make_inputs(case)
    t = inp["targets"]
    cw = inp["class_weights"].clone()
    cw[t[valid_rows(t)]] = 0.0
    inp["class_weights"] = cw
    out = torch_run(fused_lce, inp, case.options(), chunk_rows=8)
    assert torch.isfinite(out["loss"]) and torch.isfinite(out["dx"]).all() and torch.isfinite(out["dw"]).all()
    check_case(case, inp, out)
    if z_loss == 0.0:
        assert out["loss"].item() == 0.0
        assert torch.all(out["dx"] == 0) and torch.all(out["dw"] == 0)
    else:
        assert out["loss"].item() == pytest.approx(out["z_loss"].item(), rel=1e-6)


@pytest.mark.parametrize("dtype,lead", [("float32", (3, 7)), ("bfloat16", (23,)), ("float16", (3, 7))],
                         ids=["float32-3d", "bfloat16-2d", "float16-3d"])
def test_dtypes_and_rank(dtype, lead):
    case = Case("dt", lead, 32, 777, dtype, bias=True, label_smoothing=0.1, z_loss=1e-4, logit_scale=4.0, seed=28)
    inp = make_inputs(case)
    out = torch_run(fused_lce, inp, case.options(), chunk_rows=8)
    _check_dtypes(out, inp)
    assert out["lse"].shape == lead
    check_case(case, inp, out)


@pytest.mark.parametrize("tdtype", [torch.int32, torch.int16, torch.uint8])
def test_integer_target_dtypes(tdtype):
    case = Case("tdt", (14,), 16, 130, "float32", ignore_frac=0.0 if tdtype == torch.uint8 else 0.2, seed=29)
    inp = make_inputs(case)
    ref_inp = dict(inp)
    inp = dict(inp, targets=inp["targets"].to(tdtype))
    out = torch_run(fused_lce, inp, case.options(), chunk_rows=8)
    check_case(case, ref_inp, out)


def test_strided_inputs():
    """Non-contiguous x (a transposed view), weight (a transposed [H, V] tensor) and targets."""
    case = Case("strided", (6, 3), 16, 130, "float32", bias=True, seed=30)
    inp = make_inputs(case)
    x_t = inp["x"].transpose(0, 1).contiguous().transpose(0, 1).detach().requires_grad_(True)   # (6, 3, 16)
    w_t = inp["weight"].t().contiguous().t().detach().requires_grad_(True)
    t_t = inp["targets"].t().contiguous().t()
    assert not x_t.is_contiguous() and not w_t.is_contiguous() and not t_t.is_contiguous()
    loss = fused_lce(x_t, w_t, t_t, bias=inp["bias"], chunk_rows=8)
    loss.backward()
    out = {"loss": loss.detach(), "dx": x_t.grad, "dw": w_t.grad}
    check_case(case, inp, out)


def test_bias_dtype_differs():
    """bfloat16 x / weight with a float32 bias: accepted, and db comes back float32 (its own dtype)."""
    case = Case("biasf32", (19,), 32, 777, "bfloat16", bias=True, seed=45)
    inp = make_inputs(case)
    inp["bias"] = (torch.randn(777, generator=torch.Generator().manual_seed(45)) * 0.3).float()
    out = torch_run(fused_lce, inp, case.options(), chunk_rows=8)
    assert out["db"].dtype == torch.float32 and out["dx"].dtype == torch.bfloat16
    check_case(case, inp, out)


@pytest.mark.parametrize("wrt", ["x", "weight"])
def test_gradient_subset(wrt):
    """Only one of x / weight requires a gradient (a frozen head, or frozen activations)."""
    case = Case("subset", (21,), 16, 130, "float32", bias=True, seed=46)
    inp = make_inputs(case)
    x = inp["x"].clone().requires_grad_(wrt == "x")
    w = inp["weight"].clone().requires_grad_(wrt == "weight")
    loss = fused_lce(x, w, inp["targets"], bias=inp["bias"], chunk_rows=8)
    loss.backward()
    ref = reference_for_case(case, inp)
    key = "dx" if wrt == "x" else "dw"
    assert (x.grad is None) == (wrt != "x") and (w.grad is None) == (wrt != "weight")
    assert_close_to_reference({"loss": loss, key: x.grad if wrt == "x" else w.grad}, ref, "float32")


def test_no_gradient_to_class_weights():
    """class_weights that require grad receive none (SPEC: gradients never flow to them)."""
    case = Case("cwgrad", (13,), 16, 130, "float32", class_weights=True, label_smoothing=0.1, seed=47)
    inp = make_inputs(case)
    cw = inp["class_weights"].clone().requires_grad_(True)
    x = inp["x"].clone().requires_grad_(True)
    loss = fused_lce(x, inp["weight"], inp["targets"], class_weights=cw, label_smoothing=0.1)
    loss.backward()
    assert cw.grad is None or torch.all(cw.grad == 0)
    assert_close_to_reference({"loss": loss, "dx": x.grad}, reference_for_case(case, inp), "float32")


# ============================================================================ 3. bad input
def _bad_inputs():
    g = torch.Generator().manual_seed(31)
    x = torch.randn(6, 8, generator=g)
    w = torch.randn(13, 8, generator=g)
    t = torch.randint(0, 13, (6,), generator=g)
    b = torch.randn(13, generator=g)
    cw = torch.rand(13, generator=g) + 0.5
    return dict(x=x, weight=w, targets=t, bias=b, class_weights=cw)


def _neg_cw(a):
    cw = a["class_weights"].clone()
    cw[3] = -1.0
    return {"class_weights": cw}


BAD_INPUTS = {  # id: (changes to the good arguments, argument the message must name)
    "weight_H_mismatch": (lambda a: {"weight": torch.randn(13, 9)}, "weight"),
    "weight_not_2d": (lambda a: {"weight": torch.randn(13, 8, 1)}, "weight"),
    "targets_shape": (lambda a: {"targets": a["targets"][:5]}, "targets"),
    "targets_shape_3d": (lambda a: {"x": a["x"].reshape(2, 3, 8), "targets": a["targets"]}, "targets"),
    "bias_shape": (lambda a: {"bias": torch.randn(12)}, "bias"),
    "bias_int": (lambda a: {"bias": torch.zeros(13, dtype=torch.int32)}, "bias"),
    "class_weights_shape": (lambda a: {"class_weights": torch.rand(12)}, "class_weights"),
    "class_weights_int": (lambda a: {"class_weights": torch.ones(13, dtype=torch.int64)}, "class_weights"),
    "x_int": (lambda a: {"x": torch.ones(6, 8, dtype=torch.int32)}, "x"),
    "x_float64": (lambda a: {"x": a["x"].double(), "weight": a["weight"].double()}, "x"),
    "weight_int": (lambda a: {"weight": torch.ones(13, 8, dtype=torch.int32)}, "weight"),
    "x_weight_dtype_mismatch": (lambda a: {"weight": a["weight"].bfloat16()}, "weight"),
    "targets_float": (lambda a: {"targets": a["targets"].float()}, "targets"),
    "targets_bool": (lambda a: {"targets": a["targets"] > 3}, "targets"),
    "reduction": (lambda a: {"reduction": "avg"}, "reduction"),
    "label_smoothing_negative": (lambda a: {"label_smoothing": -0.1}, "label_smoothing"),
    "label_smoothing_above_1": (lambda a: {"label_smoothing": 1.5}, "label_smoothing"),
    "label_smoothing_nan": (lambda a: {"label_smoothing": float("nan")}, "label_smoothing"),
    "softcap_zero": (lambda a: {"softcap": 0.0}, "softcap"),
    "softcap_negative": (lambda a: {"softcap": -5.0}, "softcap"),
    "z_loss_negative": (lambda a: {"z_loss": -1e-4}, "z_loss"),
    "z_loss_nan": (lambda a: {"z_loss": float("nan")}, "z_loss"),
    "class_weights_negative": (_neg_cw, "class_weights"),
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_raises(bad):
    change, name = BAD_INPUTS[bad]
    args = _bad_inputs()
    args.update(change(args))
    x, w, t = args.pop("x"), args.pop("weight"), args.pop("targets")
    with pytest.raises(ValueError) as info:
        fused_lce(x, w, t, **args)
    assert re.search(rf"(?<![A-Za-z0-9_]){name}(?![A-Za-z0-9_])", str(info.value)), \
        f"message does not name {name!r}: {info.value}"


@pytest.mark.parametrize("value,ignore_index", [(13, -100), (-1, -100), (1000, -100), (-100, 7)],
                         ids=["V", "minus1", "far", "default_ignore_with_custom_ignore_index"])
def test_out_of_range_targets_raise(value, ignore_index):
    a = _bad_inputs()
    t = a["targets"].clone()
    t = torch.where(t == 7, 8, t)
    t[2] = value
    with pytest.raises(ValueError, match="targets"):
        fused_lce(a["x"], a["weight"], t, ignore_index=ignore_index)
    x = a["x"].clone().requires_grad_(True)
    with pytest.raises(ValueError, match="targets"):
        fused_lce(x, a["weight"], t, ignore_index=ignore_index)


def test_out_of_range_targets_unchecked():
    """validate=False skips the host check: no exception (the result is undefined)."""
    a = _bad_inputs()
    t = a["targets"].clone()
    t[2], t[4] = 13, -1
    fused_lce(a["x"], a["weight"], t, validate=False)
    fused_lce(a["x"], a["weight"], t, reduction="none", validate=False)


# ============================================================================ 4. all ignored, empty
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored(reduction):
    """Every option on: loss 0 and gradients exactly 0, no NaN."""
    case = Case("allign", (2, 9), 16, 130, "float32", bias=True, reduction=reduction, label_smoothing=0.1,
                z_loss=1e-3, softcap=20.0, class_weights=True, ignore_frac=1.0, seed=32)
    inp = make_inputs(case)
    out = torch_run(fused_lce, inp, case.options(), chunk_rows=8)
    for k in ("loss", "z_loss", "accuracy", "dx", "dw", "db"):
        assert torch.all(out[k] == 0), f"{k} = {out[k]}"
    assert out["loss"].shape == (() if reduction != "none" else (2, 9))
    check_case(case, inp, out)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["0rows", "2x0rows"])
def test_empty_input(reduction, lead):
    x = torch.randn(*lead, 16, requires_grad=True)
    w = torch.randn(130, 16, requires_grad=True)
    b = torch.randn(130, requires_grad=True)
    t = torch.zeros(lead, dtype=torch.int64)
    loss, stats = fused_lce(x, w, t, bias=b, reduction=reduction, z_loss=1e-3, return_stats=True)
    assert loss.dtype == torch.float32
    if reduction == "none":
        assert loss.shape == lead
    else:
        assert loss.shape == () and loss.item() == 0.0
    assert stats["lse"].shape == lead
    loss.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.all(w.grad == 0) and torch.all(b.grad == 0)


# ============================================================================ 5. NaN and huge logits
@pytest.mark.parametrize("where", ["x_nan", "x_inf", "weight_nan"])
def test_nan_propagates(where):
    """NaN / inf in x or weight: the "mean" loss is not finite (NaN for a NaN), and so is the "none" loss of the
    row concerned (every row for a NaN weight); the other rows stay finite."""
    case = Case("nan", (12,), 16, 130, "float32", ignore_frac=0.0, seed=33)
    inp = make_inputs(case)
    x, w = inp["x"].clone(), inp["weight"].clone()
    if where == "x_nan":
        x[4, 3] = float("nan")
    elif where == "x_inf":
        x[4, 3] = float("inf")
    else:
        w[5, 2] = float("nan")
    mean = fused_lce(x, w, inp["targets"], chunk_rows=8)
    rows = fused_lce(x, w, inp["targets"], reduction="none", chunk_rows=8)
    assert not torch.isfinite(mean), mean
    if where != "x_inf":
        assert torch.isnan(mean), mean
    if where == "weight_nan":
        assert torch.isnan(rows).all(), rows
    else:
        assert not torch.isfinite(rows[4]), rows
        assert torch.isfinite(torch.cat([rows[:4], rows[5:]])).all(), rows


@pytest.mark.parametrize("dtype,reduction", [("float32", "mean"), ("float32", "none"), ("float16", "sum"),
                                             ("bfloat16", "mean")])
def test_huge_logits_finite_and_accurate(dtype, reduction):
    """logit_scale 100 (logits ~ N(0, 100²)) with bias, label smoothing and z-loss: finite and within SPEC."""
    case = Case("huge", (21,), 32, 1000, dtype, bias=True, label_smoothing=0.1, z_loss=1e-4, reduction=reduction,
                logit_scale=100.0, seed=34)
    inp = make_inputs(case)
    out = torch_run(fused_lce, inp, case.options(), chunk_rows=8)
    for k in ("loss", "lse", "dx", "dw", "db"):
        assert torch.isfinite(out[k]).all(), k
    check_case(case, inp, out)


# ============================================================================ 6. autograd
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_only_path(reduction, monkeypatch):
    """torch.no_grad(): the same loss bits as the grad path, no grad_fn, one GEMM per chunk and no dlogits."""
    case = Case("nograd", (37,), 32, 777, "float32", bias=True, reduction=reduction, label_smoothing=0.1,
                z_loss=1e-4, seed=35)
    inp = make_inputs(case)
    x = inp["x"].clone().requires_grad_(True)
    w = inp["weight"].clone().requires_grad_(True)
    kw = dict(bias=inp["bias"], return_stats=True, chunk_rows=8, **case.options())
    loss_g, stats_g = fused_lce(x, w, inp["targets"], **kw)
    assert loss_g.grad_fn is not None

    calls = []
    real_mm = fce_torch.gemm.mm

    def counting_mm(*args, **kwargs):
        calls.append(args[0].shape)
        return real_mm(*args, **kwargs)

    def no_grad_kernel(*args, **kwargs):
        raise AssertionError("a gradient kernel ran on the loss-only path")

    monkeypatch.setattr(fce_torch.gemm, "mm", counting_mm)
    monkeypatch.setattr(fce_torch.gemm, "addmm_", no_grad_kernel)
    monkeypatch.setattr(fce_torch.engine, "dlogits", no_grad_kernel)
    monkeypatch.setattr(fce_torch.engine, "accumulate_bias_grad", no_grad_kernel)
    with torch.no_grad():
        loss_n, stats_n = fused_lce(x, w, inp["targets"], **kw)
    assert loss_n.grad_fn is None and not loss_n.requires_grad
    assert len(calls) == math.ceil(37 / 8), calls
    assert torch.equal(loss_n, loss_g.detach())
    for k in ("lse", "z_loss", "accuracy"):
        assert torch.equal(stats_n[k], stats_g[k]), k
    # Inputs that do not require grad take the same path outside no_grad.
    calls.clear()
    loss_p = fused_lce(inp["x"], inp["weight"], inp["targets"], **kw)[0]
    assert loss_p.grad_fn is None and len(calls) == math.ceil(37 / 8)
    assert torch.equal(loss_p, loss_g.detach())
    out = {"loss": loss_n, "lse": stats_n["lse"], "z_loss": stats_n["z_loss"], "accuracy": stats_n["accuracy"]}
    check_case(case, inp, out)


def test_no_logits_buffer_materialized(monkeypatch):
    """No GEMM output or operand is larger than the largest of the chunk's logits (chunk_rows * V), the weight
    (V * H) and x (N * H): never the [N, V] logits; forward and backward, for "mean" and "none"."""
    n, h, v, nc = 40, 16, 1000, 8
    sizes = []
    real_mm, real_addmm = fce_torch.gemm.mm, fce_torch.gemm.addmm_

    def mm(a, b, *args, **kwargs):
        out = real_mm(a, b, *args, **kwargs)
        sizes.extend([a.numel(), b.numel(), out.numel()])
        return out

    def addmm_(acc, a, b, *args, **kwargs):
        sizes.extend([acc.numel(), a.numel(), b.numel()])
        return real_addmm(acc, a, b, *args, **kwargs)

    monkeypatch.setattr(fce_torch.gemm, "mm", mm)
    monkeypatch.setattr(fce_torch.gemm, "addmm_", addmm_)
    for reduction in ("mean", "none"):
        case = Case("mem", (n,), h, v, "float32", bias=True, reduction=reduction, seed=36)
        inp = make_inputs(case)
        sizes.clear()
        out = torch_run(fused_lce, inp, case.options(), chunk_rows=nc)
        assert sizes and max(sizes) <= max(nc * v, v * h, n * h) < n * v, (reduction, max(sizes))
        check_case(case, inp, out)


@pytest.mark.parametrize("case_name", ["none_3d", "all_options_none_f16"])
def test_none_reduction_random_grad_output(case_name):
    case = next(c for c in small_cases() if c.name == case_name)
    inp = make_inputs(case)
    g = torch.randn(case.shape, generator=torch.Generator().manual_seed(37))
    out = torch_run(fused_lce, inp, case.options(), chunk_rows=4, grad_output=g)
    check_case(case, inp, out, grad_output=g)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_repeated_backward_no_compounding(reduction):
    """backward(2.5, retain_graph=True) twice: identical gradients (zeroed between), exactly double when
    accumulated, and equal to the reference with grad_output 2.5."""
    case = Case("retain", (2, 9), 32, 777, "bfloat16", bias=True, reduction=reduction, z_loss=1e-4, seed=38)
    inp = make_inputs(case)
    x = inp["x"].clone().requires_grad_(True)
    w = inp["weight"].clone().requires_grad_(True)
    b = inp["bias"].clone().requires_grad_(True)
    loss = fused_lce(x, w, inp["targets"], bias=b, chunk_rows=8, **case.options())
    g = torch.full_like(loss, 2.5)
    leaves = (x, w, b)
    loss.backward(g, retain_graph=True)
    first = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    loss.backward(g, retain_graph=True)
    second = [t.grad.clone() for t in leaves]
    for a, c in zip(first, second):
        assert torch.equal(a, c)
    loss.backward(g, retain_graph=True)      # accumulate into .grad
    for t, a in zip(leaves, first):
        assert torch.equal(t.grad, a + a)
    out = {"loss": loss.detach(), "dx": first[0], "dw": first[1], "db": first[2]}
    check_case(case, inp, out, grad_output=2.5)


def test_autocast_bf16():
    """autocast(cpu, bfloat16) with float32 leaves: float32 loss and gradients, close to the reference of the
    bfloat16-cast inputs (the GEMMs ran in bfloat16)."""
    case = Case("autocast", (3, 7), 32, 777, "float32", bias=True, seed=39)
    inp = make_inputs(case)
    x = inp["x"].clone().requires_grad_(True)
    w = torch.nn.Parameter(inp["weight"].clone())
    b = torch.nn.Parameter(inp["bias"].clone())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, stats = fused_lce(x, w, inp["targets"], bias=b, return_stats=True, chunk_rows=8)
    assert loss.dtype == torch.float32
    loss.backward()
    for t in (x, w, b):
        assert t.grad is not None and t.grad.dtype == torch.float32
    bf = {k: (None if v is None else v.bfloat16()) for k, v in inp.items() if k in ("x", "weight", "bias")}
    ref = flce_reference(bf["x"], bf["weight"], inp["targets"], bias=bf["bias"])
    out = {"loss": loss.detach(), "lse": stats["lse"], "dx": x.grad, "dw": w.grad, "db": b.grad}
    out, ref = restrict_lse(out, ref, inp["targets"])
    assert_close_to_reference(out, ref, "bfloat16")


def _tied_problem(seed=40, v=130, h=16, shape=(2, 9)):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(v, h, generator=g) * 0.5
    a = torch.randn(h, h, generator=g) / math.sqrt(h)
    ids = torch.randint(0, v, shape, generator=g)
    targets = torch.randint(0, v, shape, generator=g)
    targets[0, :3] = IGNORE_INDEX
    return emb, a, ids, targets


def _tied_reference(emb, a, ids, targets):
    """float64 embedding -> tanh(e @ A) -> head (the same table) -> F.cross_entropy; (loss, dE, dA)."""
    e64 = emb.double().requires_grad_(True)
    a64 = a.double().requires_grad_(True)
    hid = torch.tanh(F.embedding(ids, e64) @ a64)
    loss = F.cross_entropy((hid @ e64.T).reshape(-1, e64.shape[0]), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    de, da = torch.autograd.grad(loss, (e64, a64))
    return loss.item(), de, da


def test_tied_embedding_head():
    """One nn.Parameter is the input embedding and the head: its gradient is the sum of both uses."""
    emb0, a0, ids, targets = _tied_problem()
    embedding = torch.nn.Embedding(*emb0.shape)
    with torch.no_grad():
        embedding.weight.copy_(emb0)
    a = torch.nn.Parameter(a0.clone())
    hid = torch.tanh(embedding(ids) @ a)
    loss = fused_lce(hid, embedding.weight, targets, chunk_rows=8)
    loss.backward()
    ref_loss, de, da = _tied_reference(emb0, a0, ids, targets)
    loss_tol, grad_tol = tolerances("float32")
    assert abs(loss.item() - ref_loss) <= loss_tol * abs(ref_loss)
    assert rel_err(embedding.weight.grad, de) <= grad_tol
    assert rel_err(a.grad, da) <= grad_tol
    # Both uses contribute: the head-only gradient alone is far from the total.
    head_only = flce_reference(hid.detach(), emb0, targets)["dw"]
    assert rel_err(embedding.weight.grad, head_only) > 1e-2


# ---------------------------------------------------------------------------- Liger drop-in (SPEC §2)
LIGER_CONFIGS = {
    "default": (dict(), False),
    "bias_zloss_smoothing_ignore7": (dict(ignore_index=7, lse_square_scale=1e-3, label_smoothing=0.1), True),
    "sum": (dict(reduction="sum"), True),
    "none_zloss": (dict(reduction="none", lse_square_scale=1e-3), True),
    "stats": (dict(lse_square_scale=1e-3, return_z_loss=True, return_token_accuracy=True), False),
    "accum_float32": (dict(accum_dtype=torch.float32), False),
}


@pytest.mark.parametrize("config", list(LIGER_CONFIGS))
def test_liger_module_matches_liger(config):
    """FusedLinearCrossEntropyLoss vs Liger's LigerFusedLinearCrossEntropyLoss (Triton interpreter on a CPU),
    float32, same tensors; both also against the float64 reference. (Liger's softcap and ce_weight paths do
    not run in the Triton interpreter in liger-kernel 0.8.5; they are checked against the reference below.)"""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    kw, with_bias = LIGER_CONFIGS[config]
    ignore_index = kw.get("ignore_index", IGNORE_INDEX)
    g = torch.Generator().manual_seed(41)
    n, h, v = 24, 16, 130
    x0 = torch.randn(n, h, generator=g)
    w0 = torch.randn(v, h, generator=g) * (3.0 / math.sqrt(h))
    b0 = torch.randn(v, generator=g) * 0.3 if with_bias else None
    t = targets_avoiding(n, v, 7, g)
    t[[1, 10, 11]] = ignore_index
    g_out = torch.randn(n, generator=g) if kw.get("reduction") == "none" else None
    outs = {}
    for name, cls in (("fce", FusedLinearCrossEntropyLoss), ("liger", LigerFusedLinearCrossEntropyLoss)):
        x = x0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        b = None if b0 is None else b0.clone().requires_grad_(True)
        res = cls(**kw)(w, x, t, b)
        loss = res if isinstance(res, torch.Tensor) else res.loss
        loss.backward(g_out)
        outs[name] = {"loss": loss.detach(), "dx": x.grad, "dw": w.grad, "db": None if b is None else b.grad,
                      "res": res}
    fce, liger = outs["fce"], outs["liger"]
    for k in ("loss", "dx", "dw", "db"):
        if liger[k] is None:
            assert fce[k] is None
            continue
        tol = 2e-6 if k == "loss" else 1e-4
        assert rel_err(fce[k], liger[k]) <= tol, (k, rel_err(fce[k], liger[k]))
    if kw.get("return_z_loss") or kw.get("return_token_accuracy"):
        assert type(fce["res"]).__name__ == "CrossEntropyOutput"
        assert abs(fce["res"].z_loss.item() - liger["res"].z_loss.item()) <= 1e-6 * abs(liger["res"].z_loss.item())
        assert fce["res"].token_accuracy.item() == pytest.approx(liger["res"].token_accuracy.item(), abs=1e-6)
    else:
        assert isinstance(fce["res"], torch.Tensor)
    ref = flce_reference(x0, w0, t, bias=b0, ignore_index=ignore_index, z_loss=kw.get("lse_square_scale", 0.0),
                         label_smoothing=kw.get("label_smoothing", 0.0), reduction=kw.get("reduction", "mean"),
                         grad_output=g_out)
    assert_close_to_reference({k: fce[k] for k in ("loss", "dx", "dw", "db")}, ref, "float32")


def test_liger_module_ce_weight_and_softcap_match_reference():
    g = torch.Generator().manual_seed(42)
    n, h, v = 20, 16, 130
    x0 = torch.randn(n, h, generator=g)
    w0 = torch.randn(v, h, generator=g) * (20.0 / math.sqrt(h))
    cw = torch.rand(v, generator=g) + 0.5
    cw[:5] = 0.0
    t = torch.randint(0, v, (n,), generator=g)
    t[3] = IGNORE_INDEX
    x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    res = FusedLinearCrossEntropyLoss(ce_weight=cw, softcap=10.0, label_smoothing=0.1, lse_square_scale=1e-4,
                                      return_z_loss=True)(w, x, t)
    res.loss.backward()
    ref = flce_reference(x0, w0, t, class_weights=cw, softcap=10.0, label_smoothing=0.1, z_loss=1e-4)
    assert_close_to_reference({"loss": res.loss, "z_loss": res.z_loss, "dx": x.grad, "dw": w.grad}, ref, "float32")


@pytest.mark.parametrize("option", [{"accum_dtype": torch.bfloat16}, {"use_token_scaling": True},
                                    {"return_predicted_tokens": True}], ids=lambda o: next(iter(o)))
def test_liger_module_not_implemented(option):
    with pytest.raises(NotImplementedError) as info:
        FusedLinearCrossEntropyLoss(**option)
    assert next(iter(option)) in str(info.value)


# ============================================================================ 8. determinism
@pytest.mark.parametrize("case_name", ["all_options_bf16", "all_options_none_f16", "f32_basic"])
def test_deterministic(case_name):
    """Separate runs give the same bits (one of them is the run of test_small_case_matches_reference, cached and
    compared through float64, which is exact)."""
    case = next(c for c in small_cases() if c.name == case_name)
    nc = case_chunk_rows(case)
    cached = case_result("torch", case, nc)
    a = torch_run(fused_lce, make_inputs(case), case.options(), chunk_rows=nc)
    b = torch_run(fused_lce, make_inputs(case), case.options(), chunk_rows=nc)
    for k in ("loss", "lse", "z_loss", "accuracy", "dx", "dw", "db"):
        if a[k] is None:
            assert b[k] is None and cached[k] is None
            continue
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        assert np.array_equal(cached[k], as_float64(a[k]), equal_nan=True), k


# ============================================================================ 9. cross-twin agreement
def test_cross_twin_agreement(case):
    """fce_torch and fce_jax on the same inputs agree within the SPEC bounds (the CPU interpreters are not
    bitwise twins); lse compared on valid rows, accuracy exactly."""
    nc = case_chunk_rows(case)
    t, j = case_result("torch", case, nc), case_result("jax", case, nc)
    assert t["dtypes"] == j["dtypes"]
    targets = make_inputs(case)["targets"]
    t, j = restrict_lse(t, j, targets)
    assert_twins_agree(t, j, case.dtype)


def test_chunk_plan():
    """dZ of all rows is kept only with several chunks, a weight gradient, and no more bytes than the float32
    dW accumulator it replaces; then the chunks take half the logits budget. Both twins plan alike, and the
    small cases of the twin tests run both ways."""
    import itertools

    from fce_jax import chunking as jax_chunking
    from fce_torch.chunking import plan

    assert plan(4096, 4096, 128256, 2, True) == (1024, True)  # 2 chunks of 1 GiB -> 4 of 512 MiB, dZ kept
    assert plan(4096, 4096, 128256, 2, False) == (2048, False)
    assert plan(16384, 4096, 128256, 2, True) == (2048, False)  # dZ (4 GiB) > accumulator (2 GiB)
    assert plan(2048, 4096, 128256, 2, True) == (2048, False)  # one chunk
    assert plan(30, 16, 100, 2, True, 8) == (8, True)
    assert plan(30, 16, 100, 4, True, 8) == (8, False)
    for args in itertools.product([1, 30, 4096, 5000], [16, 4096], [100, 128256], [2, 4], [True, False],
                                  [None, 7]):
        assert plan(*args) == jax_chunking.plan(*args), args
    modes = {plan(c.rows, c.h, c.v, 4 if c.dtype == "float32" else 2, True, case_chunk_rows(c))[1]
             for c in small_cases()}
    assert modes == {True, False}

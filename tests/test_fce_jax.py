"""fce_jax.fused_lce (SPEC §1) against the float64 reference.

Every numerical check compares with ``parity.reference.flce_reference`` evaluated in float64 on fresh random
inputs (``parity.cases.make_inputs``, converted to JAX arrays); an implementation is compared with itself only
for determinism and repeated VJPs. The twin file is tests/test_fce_torch.py (same test names where the test
applies to both). On a CPU the kernels run in Pallas interpret mode, so every shape here is tiny, and the
differentiated calls run under ``jax.jit`` (one compilation, then a fast run).
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from fce_jax import fused_lce
from helpers import (assert_close_to_reference, assert_twins_agree, case_chunk_rows, case_result, check_case,
                     dtype_name_or_str, jax_run, reference_for_case, restrict_lse, targets_avoiding, to_jax,
                     tolerances, valid_rows)
from parity.cases import IGNORE_INDEX, Case, make_inputs, small_cases
from parity.reference import as_float64, flce_reference, rel_err

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Rows per chunk in most option tests. One chunk compiles about twice as fast in interpret mode as several
# (first chunk + lax.scan + tail); several chunks are exercised by the small cases, reductions_with_bias,
# all_rows_ignored, loss_only_path, none_reduction_random_grad_output, repeated_backward and determinism.
# (tests/test_fce_torch.py uses 8 everywhere: the Triton interpreter has no compile step.)
OPT_CHUNK = None


def _check_dtypes(out: dict, case: Case):
    dt = DTYPES[case.dtype]
    assert out["loss"].dtype == jnp.float32
    assert out["lse"].dtype == jnp.float32
    assert out["dx"].dtype == dt and out["dw"].dtype == dt
    if case.bias:
        assert out["db"].dtype == dt


def _arrays(inp):
    return {k: to_jax(v) for k, v in inp.items()}


# ============================================================================ 1. every small case
def test_small_case_matches_reference(case):
    """loss, dx, dw, db and the stats (lse of valid rows, z_loss, accuracy) of every small case within the SPEC
    bounds; chunk_rows 8 / default / 16 by case so that several chunks (lax.scan) and a tail chunk run."""
    res = case_result("jax", case, case_chunk_rows(case))
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
    out = jax_run(fused_lce, inp, case.options(), chunk_rows=8)
    _check_dtypes(out, case)
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
    out = jax_run(fused_lce, inp, case.options(), chunk_rows=OPT_CHUNK, ignore_index=7)
    check_case(case, inp, out, ignore_index=7)
    if reduction == "none":
        assert np.all(np.asarray(out["loss"])[[0, 5, 6, 20]] == 0)
        assert np.all(np.asarray(out["dx"])[[0, 5, 6, 20]] == 0)


@pytest.mark.parametrize("eps,weighted,reduction", [(0.3, False, "mean"), (1.0, False, "sum"),
                                                     (0.2, True, "mean"), (0.5, True, "none")])
def test_label_smoothing(eps, weighted, reduction):
    case = Case("ls", (21,), 32, 777, "float32", label_smoothing=eps, class_weights=weighted, reduction=reduction,
                logit_scale=4.0, seed=23)
    inp = make_inputs(case)
    check_case(case, inp, jax_run(fused_lce, inp, case.options(), chunk_rows=OPT_CHUNK))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_z_loss(reduction):
    case = Case("zl", (19,), 32, 777, "float32", z_loss=1e-2, reduction=reduction, logit_scale=5.0, seed=24)
    inp = make_inputs(case)
    out = jax_run(fused_lce, inp, case.options(), chunk_rows=OPT_CHUNK)
    check_case(case, inp, out)
    assert np.max(np.asarray(out["z_loss"])) > 0


@pytest.mark.parametrize("softcap", [1.0, 15.0])
def test_softcap(softcap):
    case = Case("cap", (17,), 32, 1000, "float32", bias=True, softcap=softcap, logit_scale=30.0, seed=25)
    inp = make_inputs(case)
    check_case(case, inp, jax_run(fused_lce, inp, case.options(), chunk_rows=OPT_CHUNK))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_class_weights_with_zeros(reduction):
    """Class weights with exact zeros, some of them on targets of valid rows."""
    case = Case("cw", (31,), 24, 130, "float32", class_weights=True, reduction=reduction, seed=26)
    inp = make_inputs(case)
    t = inp["targets"]
    cw = inp["class_weights"].clone()
    cw[t[valid_rows(t)][:3]] = 0.0
    inp["class_weights"] = cw
    check_case(case, inp, jax_run(fused_lce, inp, case.options(), chunk_rows=OPT_CHUNK))


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_class_weights_zero_on_every_target(z_loss):
    """D = 0 ("mean"): the CE part is 0 (not NaN); the z-loss part is still averaged over the valid rows."""
    case = Case("d0", (13,), 16, 130, "float32", class_weights=True, z_loss=z_loss, seed=27)
    inp = make_inputs(case)
    t = inp["targets"]
    cw = inp["class_weights"].clone()
    cw[t[valid_rows(t)]] = 0.0
    inp["class_weights"] = cw
    out = jax_run(fused_lce, inp, case.options(), chunk_rows=OPT_CHUNK)
    for k in ("loss", "dx", "dw"):
        assert np.isfinite(np.asarray(out[k])).all(), k
    check_case(case, inp, out)
    if z_loss == 0.0:
        assert float(out["loss"]) == 0.0
        assert np.all(np.asarray(out["dx"]) == 0) and np.all(np.asarray(out["dw"]) == 0)
    else:
        assert float(out["loss"]) == pytest.approx(float(out["z_loss"]), rel=1e-6)


@pytest.mark.parametrize("dtype,lead", [("float32", (3, 7)), ("bfloat16", (23,)), ("float16", (3, 7))],
                         ids=["float32-3d", "bfloat16-2d", "float16-3d"])
def test_dtypes_and_rank(dtype, lead):
    case = Case("dt", lead, 32, 777, dtype, bias=True, label_smoothing=0.1, z_loss=1e-4, logit_scale=4.0, seed=28)
    inp = make_inputs(case)
    out = jax_run(fused_lce, inp, case.options(), chunk_rows=OPT_CHUNK)
    _check_dtypes(out, case)
    assert out["lse"].shape == lead and out["dx"].shape == inp["x"].shape
    check_case(case, inp, out)


@pytest.mark.parametrize("tdtype", [jnp.int32, jnp.int16, jnp.uint8], ids=["int32", "int16", "uint8"])
def test_integer_target_dtypes(tdtype):
    case = Case("tdt", (14,), 16, 130, "float32", ignore_frac=0.0 if tdtype == jnp.uint8 else 0.2, seed=29)
    inp = make_inputs(case)
    a = _arrays(inp)
    t = a["targets"].astype(tdtype)
    f = jax.jit(jax.value_and_grad(lambda x, w: fused_lce(x, w, t, chunk_rows=OPT_CHUNK), argnums=(0, 1)))
    loss, (dx, dw) = f(a["x"], a["weight"])
    check_case(case, inp, {"loss": loss, "dx": dx, "dw": dw})
    if tdtype == jnp.int16:   # concrete targets of a small integer dtype pass the eager range check too
        assert float(fused_lce(a["x"], a["weight"], t)) == pytest.approx(float(loss), rel=1e-6)


def test_strided_inputs():
    """Arrays produced by transposes (XLA picks the layout; the values are what count)."""
    case = Case("strided", (6, 3), 16, 130, "float32", bias=True, seed=30)
    inp = make_inputs(case)
    a = _arrays(inp)
    x_t = jnp.transpose(jnp.transpose(a["x"], (1, 0, 2)), (1, 0, 2))
    w_t = jnp.asarray(np.asarray(a["weight"]).T.copy()).T
    t_t = jnp.transpose(jnp.transpose(a["targets"]))

    def f(x, w):
        return fused_lce(x, w, t_t, bias=a["bias"], chunk_rows=OPT_CHUNK)

    loss, (dx, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x_t, w_t)
    check_case(case, inp, {"loss": loss, "dx": dx, "dw": dw})


def test_bias_dtype_differs():
    """bfloat16 x / weight with a float32 bias: accepted, and db comes back float32 (its own dtype)."""
    case = Case("biasf32", (19,), 32, 777, "bfloat16", bias=True, seed=45)
    inp = make_inputs(case)
    inp["bias"] = (torch.randn(777, generator=torch.Generator().manual_seed(45)) * 0.3).float()
    out = jax_run(fused_lce, inp, case.options(), chunk_rows=OPT_CHUNK)
    assert out["db"].dtype == jnp.float32 and out["dx"].dtype == jnp.bfloat16
    check_case(case, inp, out)


@pytest.mark.parametrize("wrt", ["x", "weight"])
def test_gradient_subset(wrt):
    """jax.grad with respect to only one of x / weight (a frozen head, or frozen activations)."""
    case = Case("subset", (21,), 16, 130, "float32", bias=True, seed=46)
    inp = make_inputs(case)
    a = _arrays(inp)
    argnum = 0 if wrt == "x" else 1
    f = jax.jit(jax.value_and_grad(lambda x, w: fused_lce(x, w, a["targets"], bias=a["bias"], chunk_rows=OPT_CHUNK),
                                   argnums=argnum))
    loss, grad = f(a["x"], a["weight"])
    ref = reference_for_case(case, inp)
    assert_close_to_reference({"loss": loss, "dx" if wrt == "x" else "dw": grad}, ref, "float32")


def test_no_gradient_to_class_weights():
    """jax.grad with respect to class_weights is zero (SPEC: gradients never flow to them)."""
    case = Case("cwgrad", (13,), 16, 130, "float32", class_weights=True, label_smoothing=0.1, seed=47)
    inp = make_inputs(case)
    a = _arrays(inp)
    f = jax.jit(jax.value_and_grad(lambda x, cw: fused_lce(x, a["weight"], a["targets"], class_weights=cw,
                                                           label_smoothing=0.1), argnums=(0, 1)))
    loss, (dx, dcw) = f(a["x"], a["class_weights"])
    assert np.all(np.asarray(dcw) == 0)
    assert_close_to_reference({"loss": loss, "dx": dx}, reference_for_case(case, inp), "float32")


# ============================================================================ 3. bad input
def _bad_inputs():
    g = torch.Generator().manual_seed(31)
    x = torch.randn(6, 8, generator=g)
    w = torch.randn(13, 8, generator=g)
    t = torch.randint(0, 13, (6,), generator=g)
    b = torch.randn(13, generator=g)
    cw = torch.rand(13, generator=g) + 0.5
    return {k: to_jax(v) for k, v in dict(x=x, weight=w, targets=t, bias=b, class_weights=cw).items()}


BAD_INPUTS = {  # id: (changes to the good arguments, argument the message must name)
    "weight_H_mismatch": (lambda a: {"weight": jnp.ones((13, 9))}, "weight"),
    "weight_not_2d": (lambda a: {"weight": jnp.ones((13, 8, 1))}, "weight"),
    "targets_shape": (lambda a: {"targets": a["targets"][:5]}, "targets"),
    "targets_shape_3d": (lambda a: {"x": a["x"].reshape(2, 3, 8), "targets": a["targets"]}, "targets"),
    "bias_shape": (lambda a: {"bias": jnp.ones((12,))}, "bias"),
    "bias_int": (lambda a: {"bias": jnp.zeros((13,), jnp.int32)}, "bias"),
    "class_weights_shape": (lambda a: {"class_weights": jnp.ones((12,))}, "class_weights"),
    "class_weights_int": (lambda a: {"class_weights": jnp.ones((13,), jnp.int32)}, "class_weights"),
    "x_int": (lambda a: {"x": jnp.ones((6, 8), jnp.int32)}, "x"),
    "x_float64": (lambda a: {"x": np.asarray(a["x"], np.float64), "weight": np.asarray(a["weight"], np.float64)},
                  "x"),
    "weight_int": (lambda a: {"weight": jnp.ones((13, 8), jnp.int32)}, "weight"),
    "x_weight_dtype_mismatch": (lambda a: {"weight": a["weight"].astype(jnp.bfloat16)}, "weight"),
    "targets_float": (lambda a: {"targets": a["targets"].astype(jnp.float32)}, "targets"),
    "targets_bool": (lambda a: {"targets": a["targets"] > 3}, "targets"),
    "reduction": (lambda a: {"reduction": "avg"}, "reduction"),
    "label_smoothing_negative": (lambda a: {"label_smoothing": -0.1}, "label_smoothing"),
    "label_smoothing_above_1": (lambda a: {"label_smoothing": 1.5}, "label_smoothing"),
    "label_smoothing_nan": (lambda a: {"label_smoothing": float("nan")}, "label_smoothing"),
    "softcap_zero": (lambda a: {"softcap": 0.0}, "softcap"),
    "softcap_negative": (lambda a: {"softcap": -5.0}, "softcap"),
    "z_loss_negative": (lambda a: {"z_loss": -1e-4}, "z_loss"),
    "z_loss_nan": (lambda a: {"z_loss": float("nan")}, "z_loss"),
    "class_weights_negative": (lambda a: {"class_weights": a["class_weights"].at[3].set(-1.0)}, "class_weights"),
}


def _names(msg, name):
    return re.search(rf"(?<![A-Za-z0-9_]){name}(?![A-Za-z0-9_])", msg) is not None


@pytest.mark.parametrize("bad", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_raises(bad):
    change, name = BAD_INPUTS[bad]
    args = _bad_inputs()
    args.update(change(args))
    x, w, t = args.pop("x"), args.pop("weight"), args.pop("targets")
    with pytest.raises(ValueError) as info:
        fused_lce(x, w, t, **args)
    assert _names(str(info.value), name), f"message does not name {name!r}: {info.value}"


# Errors found from shapes, dtypes and static options are raised while tracing, under jit too.
JIT_BAD = [k for k in BAD_INPUTS if k not in ("class_weights_negative", "x_float64")]


@pytest.mark.parametrize("bad", JIT_BAD, ids=JIT_BAD)
def test_bad_input_raises_under_jit(bad):
    change, name = BAD_INPUTS[bad]
    args = _bad_inputs()
    args.update(change(args))
    x, w, t = args.pop("x"), args.pop("weight"), args.pop("targets")
    arrays = {k: v for k, v in args.items() if k in ("bias", "class_weights")}
    static = {k: v for k, v in args.items() if k not in arrays}
    f = jax.jit(lambda x, w, t, arrays: fused_lce(x, w, t, **arrays, **static))
    with pytest.raises(ValueError) as info:
        f(x, w, t, arrays)
    assert _names(str(info.value), name), f"message does not name {name!r}: {info.value}"


@pytest.mark.parametrize("value,ignore_index", [(13, -100), (-1, -100), (1000, -100), (-100, 7)],
                         ids=["V", "minus1", "far", "default_ignore_with_custom_ignore_index"])
def test_out_of_range_targets_raise(value, ignore_index):
    """Concrete targets: ValueError, for the plain call and under jax.grad (targets closed over)."""
    a = _bad_inputs()
    t = jnp.where(a["targets"] == 7, 8, a["targets"]).at[2].set(value)
    with pytest.raises(ValueError, match="targets"):
        fused_lce(a["x"], a["weight"], t, ignore_index=ignore_index)
    with pytest.raises(ValueError, match="targets"):
        jax.grad(lambda x: fused_lce(x, a["weight"], t, ignore_index=ignore_index))(a["x"])


def test_out_of_range_targets_unchecked():
    """Traced targets (under jax.jit) cannot be checked: such a row gives a NaN loss ("mean": NaN; "none": NaN
    on those rows, the other rows unaffected)."""
    a = _bad_inputs()
    t = a["targets"].at[2].set(13).at[4].set(-1)
    f = jax.jit(lambda x, w, t: (fused_lce(x, w, t), fused_lce(x, w, t, reduction="none")))
    mean, rows = f(a["x"], a["weight"], t)
    rows = np.asarray(rows)
    assert np.isnan(float(mean)), float(mean)
    assert np.isnan(rows[2]) and np.isnan(rows[4]), rows
    assert np.isfinite(np.delete(rows, [2, 4])).all(), rows


# ============================================================================ 4. all ignored, empty
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored(reduction):
    """Every option on: loss 0 and gradients exactly 0, no NaN."""
    case = Case("allign", (2, 9), 16, 130, "float32", bias=True, reduction=reduction, label_smoothing=0.1,
                z_loss=1e-3, softcap=20.0, class_weights=True, ignore_frac=1.0, seed=32)
    inp = make_inputs(case)
    out = jax_run(fused_lce, inp, case.options(), chunk_rows=8)
    for k in ("loss", "z_loss", "accuracy", "dx", "dw", "db"):
        assert np.all(np.asarray(out[k]) == 0), f"{k} = {out[k]}"
    assert out["loss"].shape == (() if reduction != "none" else (2, 9))
    check_case(case, inp, out)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["0rows", "2x0rows"])
def test_empty_input(reduction, lead):
    x = jnp.ones((*lead, 16), jnp.float32)
    w = jnp.asarray(np.random.default_rng(43).standard_normal((130, 16)), jnp.float32)
    b = jnp.ones((130,), jnp.float32)
    t = jnp.zeros(lead, jnp.int32)

    def f(x, w, b):
        loss, stats = fused_lce(x, w, t, bias=b, reduction=reduction, z_loss=1e-3, return_stats=True)
        return loss.sum(), (loss, stats)

    (_, (loss, stats)), (dx, dw, db) = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(x, w, b)
    assert loss.dtype == jnp.float32
    if reduction == "none":
        assert loss.shape == lead
    else:
        assert loss.shape == () and float(loss) == 0.0
    assert stats["lse"].shape == lead
    assert dx.shape == x.shape
    assert np.all(np.asarray(dw) == 0) and np.all(np.asarray(db) == 0)


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
    f = jax.jit(lambda x, w, t: (fused_lce(x, w, t, chunk_rows=8),
                                 fused_lce(x, w, t, reduction="none", chunk_rows=8)))
    mean, rows = (np.asarray(a) for a in f(to_jax(x), to_jax(w), to_jax(inp["targets"])))
    assert not np.isfinite(mean), mean
    if where != "x_inf":
        assert np.isnan(mean), mean
    if where == "weight_nan":
        assert np.isnan(rows).all(), rows
    else:
        assert not np.isfinite(rows[4]), rows
        assert np.isfinite(np.delete(rows, 4)).all(), rows


@pytest.mark.parametrize("dtype,reduction", [("float32", "mean"), ("float32", "none"), ("float16", "sum"),
                                             ("bfloat16", "mean")])
def test_huge_logits_finite_and_accurate(dtype, reduction):
    """logit_scale 100 (logits ~ N(0, 100²)) with bias, label smoothing and z-loss: finite and within SPEC."""
    case = Case("huge", (21,), 32, 1000, dtype, bias=True, label_smoothing=0.1, z_loss=1e-4, reduction=reduction,
                logit_scale=100.0, seed=34)
    inp = make_inputs(case)
    out = jax_run(fused_lce, inp, case.options(), chunk_rows=OPT_CHUNK)
    for k in ("loss", "lse", "dx", "dw", "db"):
        assert np.isfinite(np.asarray(out[k], np.float32)).all(), k
    check_case(case, inp, out)


# ============================================================================ 6/7. transformations
def test_jit_grad_value_and_grad():
    """The plain call, jax.jit, jax.grad and jax.value_and_grad (jitted, and value_and_grad also eagerly) all
    meet the SPEC bounds."""
    case = Case("transforms", (20,), 16, 130, "float32", bias=True, label_smoothing=0.1, z_loss=1e-4, seed=44)
    inp = make_inputs(case)
    a = _arrays(inp)
    t = a["targets"]

    def f(x, w, b):
        return fused_lce(x, w, t, bias=b, chunk_rows=8, **case.options())

    ref = reference_for_case(case, inp)
    loss_tol, _ = tolerances("float32")
    xs = (a["x"], a["weight"], a["bias"])
    def f_eager(x, w, b):   # one chunk: eager dispatch in interpret mode is slow per operation
        return fused_lce(x, w, t, bias=b, **case.options())

    for loss in (f_eager(*xs), jax.jit(f)(*xs)):
        assert rel_err(loss, ref["loss"]) <= loss_tol
    dx, dw, db = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(*xs)
    assert_close_to_reference({"loss": ref["loss"], "dx": dx, "dw": dw, "db": db}, ref, "float32")
    for vag in (jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))), jax.value_and_grad(f_eager, argnums=(0, 1, 2))):
        loss, (dx, dw, db) = vag(*xs)
        assert_close_to_reference({"loss": loss, "dx": dx, "dw": dw, "db": db}, ref, "float32")


def _dot_output_shapes(jaxpr_text):
    return [tuple(int(d) for d in m.split(",")) for m in re.findall(r"f32\[([\d,]+)\] = dot_general", jaxpr_text)]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_only_path(reduction):
    """The primal call without differentiation, under jit: the same loss bits as the differentiated call, and
    only logits GEMMs ([rows, V]: no dX / dW GEMM) in its program."""
    case = Case("nograd", (37,), 32, 777, "float32", bias=True, reduction=reduction, label_smoothing=0.1,
                z_loss=1e-4, seed=35)
    inp = make_inputs(case)
    a = _arrays(inp)
    t = a["targets"]

    def f(x, w, b):
        return fused_lce(x, w, t, bias=b, return_stats=True, chunk_rows=8, **case.options())

    xs = (a["x"], a["weight"], a["bias"])
    loss_p, stats_p = jax.jit(f)(*xs)

    def total(x, w, b):
        loss, stats = f(x, w, b)
        return loss.sum(), (loss, stats)

    (_, (loss_g, stats_g)), _ = jax.jit(jax.value_and_grad(total, argnums=(0, 1, 2), has_aux=True))(*xs)
    assert np.array_equal(np.asarray(loss_p), np.asarray(loss_g))
    for k in ("lse", "z_loss", "accuracy"):
        assert np.array_equal(np.asarray(stats_p[k]), np.asarray(stats_g[k])), k
    shapes = _dot_output_shapes(str(jax.make_jaxpr(f)(*xs)))
    assert shapes and all(s[-1] == 777 and s[0] <= 8 for s in shapes), shapes
    grad_shapes = _dot_output_shapes(str(jax.make_jaxpr(jax.grad(lambda *a: total(*a)[0], argnums=(0, 1, 2)))(*xs)))
    assert any(s[-1] == 32 for s in grad_shapes), grad_shapes     # the differentiated program does have them
    out = {"loss": loss_p, "lse": stats_p["lse"], "z_loss": stats_p["z_loss"], "accuracy": stats_p["accuracy"]}
    check_case(case, inp, out)


@pytest.mark.parametrize("dtype,reduction", [("float32", "mean"), ("bfloat16", "none")])
def test_no_logits_buffer_materialized(dtype, reduction):
    """Compile (do not run) jit(value_and_grad) at N=2048, V=4096, chunk_rows=256: no [N, V] buffer (nor any
    buffer of >= N*V/2 elements) in the optimized HLO, and XLA's temporary memory < N*V*4 bytes."""
    n, h, v = 2048, 16, 4096
    dt = DTYPES[dtype]

    def f(x, w, t):
        return fused_lce(x, w, t, reduction=reduction, chunk_rows=256).sum()

    compiled = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(
        jax.ShapeDtypeStruct((n, h), dt), jax.ShapeDtypeStruct((v, h), dt),
        jax.ShapeDtypeStruct((n,), jnp.int32)).compile()
    text = compiled.as_text()
    for name in ("f32", "bf16", "f16"):
        assert f"{name}[{n},{v}]" not in text and f"{name}[{v},{n}]" not in text
    shapes = re.findall(r"\b(?:f32|bf16|f16|s32|pred)\[([\d,]+)\]", text)
    sizes = [math.prod(int(d) for d in s.split(",")) for s in shapes if s]
    assert sizes and max(sizes) < n * v // 2, max(sizes)
    stats = compiled.memory_analysis()
    assert stats is not None
    assert stats.temp_size_in_bytes < n * v * 4, stats


@pytest.mark.parametrize("case_name", ["none_3d", "all_options_none_f16"])
def test_none_reduction_random_grad_output(case_name):
    """reduction="none" with a random cotangent through jax.vjp."""
    case = next(c for c in small_cases() if c.name == case_name)
    inp = make_inputs(case)
    g = torch.randn(case.shape, generator=torch.Generator().manual_seed(37))
    out = jax_run(fused_lce, inp, case.options(), chunk_rows=4, grad_output=g)
    check_case(case, inp, out, grad_output=g)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_repeated_backward_no_compounding(reduction):
    """The VJP function of one forward called twice with cotangent 2.5: identical results, equal to the
    reference with grad_output 2.5."""
    case = Case("retain", (2, 9), 32, 777, "bfloat16", bias=True, reduction=reduction, z_loss=1e-4, seed=38)
    inp = make_inputs(case)
    a = _arrays(inp)
    t = a["targets"]
    forward = jax.jit(lambda x, w, b: jax.vjp(
        lambda x, w, b: fused_lce(x, w, t, bias=b, chunk_rows=8, **case.options()), x, w, b))
    loss, vjp = forward(a["x"], a["weight"], a["bias"])       # vjp: a jax.tree_util.Partial (residuals inside)
    g = jnp.full(loss.shape, 2.5, jnp.float32)
    backward = jax.jit(lambda vjp, g: vjp(g))
    first, second = backward(vjp, g), backward(vjp, g)
    for p, q in zip(first, second):
        assert p.dtype == q.dtype and np.array_equal(np.asarray(p), np.asarray(q))
    out = {"loss": loss, "dx": first[0], "dw": first[1], "db": first[2]}
    check_case(case, inp, out, grad_output=2.5)


def test_autocast_bf16():
    """The JAX counterpart of autocast: float32 parameters cast to bfloat16 inside the differentiated function.
    Float32 loss and gradients, close to the reference of the bfloat16-cast inputs."""
    case = Case("autocast", (3, 7), 32, 777, "float32", bias=True, seed=39)
    inp = make_inputs(case)
    a = _arrays(inp)
    t = a["targets"]

    def f(x, w, b):
        bf = jnp.bfloat16
        loss, stats = fused_lce(x.astype(bf), w.astype(bf), t, bias=b.astype(bf), return_stats=True, chunk_rows=8)
        return loss, stats

    (loss, stats), (dx, dw, db) = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
        a["x"], a["weight"], a["bias"])
    assert loss.dtype == jnp.float32
    assert dx.dtype == dw.dtype == db.dtype == jnp.float32
    bf = {k: inp[k].bfloat16() for k in ("x", "weight", "bias")}
    ref = flce_reference(bf["x"], bf["weight"], inp["targets"], bias=bf["bias"])
    out = {"loss": loss, "lse": stats["lse"], "dx": dx, "dw": dw, "db": db}
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
    hid = torch.tanh(torch.nn.functional.embedding(ids, e64) @ a64)
    loss = torch.nn.functional.cross_entropy((hid @ e64.T).reshape(-1, e64.shape[0]), targets.reshape(-1),
                                             ignore_index=IGNORE_INDEX)
    de, da = torch.autograd.grad(loss, (e64, a64))
    return loss.item(), de, da


def test_tied_embedding_head():
    """The embedding table is also the head: jax.grad of the fused model equals the plain-jnp model's gradient
    (and the float64 one), i.e. the sum of both uses."""
    emb0, a0, ids0, targets0 = _tied_problem()
    emb, a, ids, targets = to_jax(emb0), to_jax(a0), to_jax(ids0), to_jax(targets0)
    hi = jax.lax.Precision.HIGHEST

    def hidden(e, a):
        return jnp.tanh(jnp.matmul(e[ids], a, precision=hi))

    def fused(e, a):
        return fused_lce(hidden(e, a), e, targets, chunk_rows=8)

    def plain(e, a):
        z = jnp.matmul(hidden(e, a), e.T, precision=hi)
        valid = targets != IGNORE_INDEX
        zy = jnp.take_along_axis(z, jnp.where(valid, targets, 0)[..., None], axis=-1)[..., 0]
        nll = jax.nn.logsumexp(z, axis=-1) - zy
        return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.sum(valid)

    loss_f, (de_f, da_f) = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(emb, a)
    loss_p, (de_p, da_p) = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(emb, a)
    loss_tol, grad_tol = tolerances("float32")
    assert rel_err(de_f, de_p) <= grad_tol and rel_err(da_f, da_p) <= grad_tol
    ref_loss, de, da = _tied_reference(emb0, a0, ids0, targets0)
    assert abs(float(loss_f) - ref_loss) <= loss_tol * abs(ref_loss)
    assert rel_err(de_f, de) <= grad_tol and rel_err(da_f, da) <= grad_tol
    head_only = flce_reference(np.asarray(hidden(emb, a)), emb0, targets0)["dw"]
    assert rel_err(de_f, head_only) > 1e-2


# ============================================================================ 8. determinism
@pytest.mark.parametrize("case_name", ["all_options_bf16", "all_options_none_f16", "f32_basic"])
def test_deterministic(case_name):
    """Two separately compiled runs give the same bits (the first run is the one of
    test_small_case_matches_reference, cached; compared through float64, which is exact)."""
    case = next(c for c in small_cases() if c.name == case_name)
    nc = case_chunk_rows(case)
    a = case_result("jax", case, nc)
    b = jax_run(fused_lce, make_inputs(case), case.options(), chunk_rows=nc)
    for k in ("loss", "lse", "z_loss", "accuracy", "dx", "dw", "db"):
        if a[k] is None:
            assert b[k] is None
            continue
        assert a["dtypes"][k] == dtype_name_or_str(b[k].dtype), k
        assert np.array_equal(a[k], as_float64(b[k]), equal_nan=True), k


# ============================================================================ 9. cross-twin agreement
def test_cross_twin_agreement(case):
    """fce_jax and fce_torch on the same inputs agree within the SPEC bounds (the CPU interpreters are not
    bitwise twins); lse compared on valid rows, accuracy exactly."""
    nc = case_chunk_rows(case)
    j, t = case_result("jax", case, nc), case_result("torch", case, nc)
    assert j["dtypes"] == t["dtypes"]
    targets = make_inputs(case)["targets"]
    j, t = restrict_lse(j, t, targets)
    assert_twins_agree(j, t, case.dtype)

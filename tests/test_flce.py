"""fused_lce (SPEC §1) of both twins against the float64 reference, one test body per behaviour.

Every numerical check compares with ``parity.reference.flce_reference`` evaluated in float64 on fresh random
inputs (``parity.cases.make_inputs``), through `twins.check_flce` (SPEC bounds, lse 0 on ignored rows, argmax
equal to the reference's first argmax); a twin is compared with itself only for determinism and with the other
twin within the SPEC bounds. Framework-specific behaviour (torch: no_grad, autocast, retain_graph, the Liger
module; JAX: jit/grad/vjp, traced inputs) is in test_flce_torch_only.py / test_flce_jax_only.py, the planner
and the skipping of ignored rows in test_plan.py. On a CPU the kernels run in the Triton interpreter / Pallas
interpret mode, so every shape is tiny.
"""

import math
import re

import numpy as np
import pytest
import torch

from fce_core.plan import plan_rows
from helpers import assert_twins_agree, restrict_lse, targets_avoiding, tolerances, valid_rows
from parity.cases import IGNORE_INDEX, Case, make_inputs, small_cases
from parity.reference import as_float64, flce_reference, rel_err
from twins import JAX, TORCH, case_result, check_flce, each_twin


def _check_dtypes(twin, out: dict, inp: dict):
    assert twin.dtype(out["loss"]) == "float32" and twin.dtype(out["lse"]) == "float32"
    for k, d in (("x", "dx"), ("weight", "dw"), ("bias", "db")):
        if inp[k] is not None and d in out:
            assert twin.dtype(out[d]) == twin.dtype(inp[k]), d
            assert tuple(out[d].shape) == tuple(inp[k].shape), d


# ============================================================================ 1. every small case
@each_twin
def test_small_case_matches_reference(twin, case):
    """loss, dx, dw, db and the stats of every small case within the SPEC bounds; chunk_rows 8 / default / 16 by
    case (helpers.CASE_CHUNK_ROWS), so that several chunks and both dZ plans run."""
    res = case_result(twin, case)
    inp = make_inputs(case)
    check_flce(case, inp, res)
    dt = res["dtypes"]
    assert dt["loss"] == "float32" and dt["lse"] == "float32"
    assert dt["dx"] == dt["dw"] == case.dtype
    assert dt["db"] == (case.dtype if case.bias else None)
    assert dt["argmax"].startswith("int")
    assert res["loss"].shape == (() if case.reduction != "none" else case.shape)
    assert res["lse"].shape == res["argmax"].shape == case.shape


def test_cross_twin_agreement(case):
    """fce_torch and fce_jax on the same inputs agree within the SPEC bounds (the CPU interpreters are not
    bitwise twins); lse on valid rows; accuracy and argmax exactly; the same output dtypes (argmax: int64 in
    torch, int32 in JAX)."""
    t, j = case_result(TORCH, case), case_result(JAX, case)
    assert {k: v for k, v in t["dtypes"].items() if k != "argmax"} == \
        {k: v for k, v in j["dtypes"].items() if k != "argmax"}
    assert t["dtypes"]["argmax"] == "int64" and j["dtypes"]["argmax"] == "int32"
    assert np.array_equal(t["argmax"], j["argmax"])
    targets = make_inputs(case)["targets"]
    t, j = restrict_lse(t, j, targets)
    assert_twins_agree(t, j, case.dtype)


@each_twin
@pytest.mark.parametrize("case_name", ["all_options_bf16", "all_options_none_f16", "f32_basic"])
def test_deterministic(twin, case_name):
    """Two separate runs (two compilations in JAX) give the same bits of every output."""
    case = next(c for c in small_cases() if c.name == case_name)
    cached, again = case_result(twin, case), case_result(twin, case, fresh=True)
    for k, bits in cached["bits"].items():
        if bits is None:
            assert again["bits"][k] is None, k
            continue
        assert cached["dtypes"][k] == again["dtypes"][k], k
        assert np.array_equal(bits, again["bits"][k]), k


# ============================================================================ 2. every option
@each_twin
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions_with_bias_and_custom_ignore_index(twin, reduction):
    """Each reduction with a bias and ignore_index=7 (a value inside [0, V), never the target of a valid row
    here): rows with target 7 take no part; for "none" their loss and dx are exactly 0."""
    case = Case("ign7", (37,), 32, 1000, "float32", bias=True, reduction=reduction, logit_scale=3.0, seed=21)
    inp = make_inputs(case)
    t = targets_avoiding(37, 1000, 7, torch.Generator().manual_seed(22))
    ignored = [0, 5, 6, 20, 36]
    t[ignored] = 7
    inp["targets"] = t
    out = twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows, ignore_index=7)
    _check_dtypes(twin, out, inp)
    check_flce(case, inp, out, ignore_index=7)
    assert np.all(as_float64(out["argmax"])[ignored] == -1)
    if reduction == "none":
        assert np.all(as_float64(out["loss"])[ignored] == 0)
        assert np.all(as_float64(out["dx"])[ignored] == 0)


@each_twin
@pytest.mark.parametrize("eps,weighted,reduction", [(0.3, False, "mean"), (1.0, False, "sum"),
                                                     (0.2, True, "mean"), (0.5, True, "none")])
def test_label_smoothing(twin, eps, weighted, reduction):
    case = Case("ls", (21,), 32, 777, "float32", label_smoothing=eps, class_weights=weighted, reduction=reduction,
                logit_scale=4.0, seed=23)
    inp = make_inputs(case)
    check_flce(case, inp, twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows))


@each_twin
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_z_loss(twin, reduction):
    case = Case("zl", (19,), 32, 777, "float32", z_loss=1e-2, reduction=reduction, logit_scale=5.0, seed=24)
    inp = make_inputs(case)
    out = twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows)
    check_flce(case, inp, out)
    z = as_float64(out["z_loss"])
    assert np.all(z > 0) if reduction != "none" else z.max() > 0


@each_twin
@pytest.mark.parametrize("softcap", [1.0, 15.0])
def test_softcap(twin, softcap):
    case = Case("cap", (17,), 32, 1000, "float32", bias=True, softcap=softcap, logit_scale=30.0, seed=25)
    inp = make_inputs(case)
    check_flce(case, inp, twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows))


@each_twin
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_class_weights_with_zeros(twin, reduction):
    """Class weights with exact zeros, some of them on targets of valid rows."""
    case = Case("cw", (31,), 24, 130, "float32", class_weights=True, reduction=reduction, seed=26)
    inp = make_inputs(case)
    t = inp["targets"]
    cw = inp["class_weights"].clone()
    cw[t[valid_rows(t)][:3]] = 0.0
    inp["class_weights"] = cw
    check_flce(case, inp, twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows))


@each_twin
@pytest.mark.parametrize("reduction,eps", [("mean", 0.1), ("none", 0.0)])
def test_negative_class_weights(twin, reduction, eps):
    """Class weights of any real value are accepted (F.cross_entropy and Liger accept them): weights drawn from
    [-1, 2), against the reference."""
    case = Case("negcw", (29,), 24, 130, "float32", class_weights=True, negative_class_weights=True,
                reduction=reduction, label_smoothing=eps, z_loss=1e-3, seed=48)
    inp = make_inputs(case)
    assert (inp["class_weights"] < 0).any()
    check_flce(case, inp, twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows))


@each_twin
@pytest.mark.parametrize("d_sign", ["zero", "negative"])
def test_negative_class_weights_denominator(twin, d_sign):
    """"mean" with D = sum of the valid rows' target weights exactly 0 (weights +1.5 and -1.5 on as many rows
    each): the CE part is 0 and only the z-loss part remains (loss = z_loss stat, finite gradients); with D < 0
    the CE part is CE / D."""
    case = Case("dneg", (24,), 16, 130, "float32", class_weights=True, z_loss=1e-3, logit_scale=2.0, seed=49)
    inp = make_inputs(case)
    t = torch.full((24,), IGNORE_INDEX)
    t[:20] = torch.tensor([3, 4] * 10)
    cw = torch.rand(130, generator=torch.Generator().manual_seed(49)) + 0.5
    cw[3], cw[4] = (1.5, -1.5) if d_sign == "zero" else (0.5, -1.5)
    inp["targets"], inp["class_weights"] = t, cw
    out = twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows)
    for k in ("loss", "dx", "dw"):
        assert np.isfinite(as_float64(out[k])).all(), k
    check_flce(case, inp, out)
    if d_sign == "zero":
        assert float(out["loss"]) == pytest.approx(float(out["z_loss"]), rel=1e-6)
    else:
        assert float(out["loss"]) - float(out["z_loss"]) > 1.0   # CE / D, D = -10: the mean CE, not 0


@each_twin
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_class_weights_zero_on_every_target(twin, z_loss):
    """D = 0 ("mean", all target weights 0): the CE part is 0 (not NaN); the z-loss part is still averaged
    over the valid rows."""
    case = Case("d0", (13,), 16, 130, "float32", class_weights=True, z_loss=z_loss, seed=27)
    inp = make_inputs(case)
    t = inp["targets"]
    cw = inp["class_weights"].clone()
    cw[t[valid_rows(t)]] = 0.0
    inp["class_weights"] = cw
    out = twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows)
    for k in ("loss", "dx", "dw"):
        assert np.isfinite(as_float64(out[k])).all(), k
    check_flce(case, inp, out)
    if z_loss == 0.0:
        assert float(out["loss"]) == 0.0
        assert np.all(as_float64(out["dx"]) == 0) and np.all(as_float64(out["dw"]) == 0)
    else:
        assert float(out["loss"]) == pytest.approx(float(out["z_loss"]), rel=1e-6)


@each_twin
@pytest.mark.parametrize("reduction,options", [
    ("mean", dict(z_loss=1e-2, label_smoothing=0.1, class_weights=True)),
    ("sum", dict(softcap=10.0, bias=True)),
    ("none", dict(z_loss=1e-3)),
], ids=["mean", "sum", "none"])
def test_token_scaling(twin, reduction, options):
    """token_scaling (Liger's use_token_scaling): each row's loss (z-loss included) and gradient times the
    stop-gradient p(target); "mean" keeps the denominators D and n. "none" with a random cotangent."""
    case = Case("ts", (23,), 32, 777, "float32", reduction=reduction, token_scaling=True, logit_scale=2.0,
                seed=50, **options)
    inp = make_inputs(case)
    g = torch.randn(case.shape, generator=torch.Generator().manual_seed(50)) if reduction == "none" else None
    out = twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows, grad_output=g)
    ref = check_flce(case, inp, out, grad_output=g)
    plain = flce_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"],
                           class_weights=inp["class_weights"], **{**case.options(), "token_scaling": False})
    assert rel_err(ref["loss"], plain["loss"]) > 1e-2          # the scaling changes the loss


@each_twin
@pytest.mark.parametrize("normalizer", [50.0, (37.5, 20.0), "tensor"], ids=["scalar", "pair", "0d_array"])
def test_normalizer(twin, normalizer):
    """"mean" with the caller's denominators: a scalar (D = n), a pair (D, n), a 0-d array of the framework."""
    case = Case("norm", (29,), 32, 777, "float32", class_weights=True, z_loss=1e-2, label_smoothing=0.1,
                seed=51)
    ref_norm = normalizer
    if normalizer == "tensor":
        ref_norm = 41.0
        normalizer = twin.array(torch.tensor(41.0))
    case_opts = {**case.options(), "normalizer": normalizer}
    inp = make_inputs(case)
    out = twin.run(inp, case_opts, chunk_rows=twin.option_chunk_rows)
    check_flce(case, inp, out, normalizer=ref_norm)


@each_twin
def test_normalizer_ignored_for_sum_and_none(twin):
    """normalizer changes nothing for "sum" and "none": the same bits as without it. (The case of test_z_loss,
    another seed: the runs without normalizer share its compilations.)"""
    for reduction in ("sum", "none"):
        case = Case("normsum", (19,), 32, 777, "float32", z_loss=1e-2, reduction=reduction, logit_scale=5.0,
                    seed=52)
        inp = make_inputs(case)
        a = twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows)
        b = twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows, normalizer=(3.0, 5.0))
        for k in ("loss", "dx", "dw"):
            assert np.array_equal(twin.bits(a[k]), twin.bits(b[k])), (reduction, k)
        check_flce(case, inp, b)


@each_twin
@pytest.mark.parametrize("dtype,lead", [("float32", (3, 7)), ("bfloat16", (23,)), ("float16", (3, 7))],
                         ids=["float32-3d", "bfloat16-2d", "float16-3d"])
def test_dtypes_and_rank(twin, dtype, lead):
    case = Case("dt", lead, 32, 777, dtype, bias=True, label_smoothing=0.1, z_loss=1e-4, logit_scale=4.0, seed=28)
    inp = make_inputs(case)
    out = twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows)
    _check_dtypes(twin, out, inp)
    assert tuple(out["lse"].shape) == tuple(out["argmax"].shape) == lead
    check_flce(case, inp, out)


@each_twin
@pytest.mark.parametrize("tdtype", ["int32", "int16", "uint8"])
def test_integer_target_dtypes(twin, tdtype):
    """Targets of any integer dtype (uint8 cannot hold -100: no ignored row there); int16 also through the
    plain call with concrete targets (which the value check reads)."""
    case = Case("tdt", (14,), 16, 130, "float32", ignore_frac=0.0 if tdtype == "uint8" else 0.2, seed=29)
    inp = make_inputs(case)
    narrow = dict(inp, targets=inp["targets"].to(getattr(torch, tdtype)))
    out = twin.run(narrow, case.options(), chunk_rows=twin.option_chunk_rows)
    check_flce(case, inp, out)
    if tdtype == "int16":      # concrete int16 targets: the value check reads them, then the same loss
        loss = twin.call(twin.array(inp["x"]), twin.array(inp["weight"]), twin.array(narrow["targets"]),
                         jit="concrete")
        assert float(loss) == pytest.approx(float(out["loss"]), rel=1e-6)


@each_twin
def test_strided_inputs(twin):
    """Non-contiguous x (a transposed copy transposed back), weight (a transposed [H, V] tensor) and targets in
    torch; the same values through transposes in JAX."""
    case = Case("strided", (6, 3), 16, 130, "float32", bias=True, seed=30)
    inp = make_inputs(case)
    x, w, t = (twin.strided(twin.array(inp[k])) for k in ("x", "weight", "targets"))
    if twin is TORCH:
        assert not x.is_contiguous() and not w.is_contiguous() and not t.is_contiguous()
    out = twin.run_arrays(x, w, t, bias=twin.array(inp["bias"]), chunk_rows=twin.option_chunk_rows)
    check_flce(case, inp, out)


@each_twin
def test_bias_dtype_differs(twin):
    """bfloat16 x / weight with a float32 bias: accepted, and db comes back float32 (its own dtype)."""
    case = Case("biasf32", (19,), 32, 777, "bfloat16", bias=True, bias_dtype="float32", seed=45)
    inp = make_inputs(case)
    assert inp["bias"].dtype == torch.float32
    out = twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows)
    assert twin.dtype(out["db"]) == "float32" and twin.dtype(out["dx"]) == "bfloat16"
    check_flce(case, inp, out)


@each_twin
@pytest.mark.parametrize("wrt", ["x", "weight"])
def test_gradient_subset(twin, wrt):
    """Only one of x / weight is differentiated (a frozen head, or frozen activations); bias present but
    frozen."""
    case = Case("subset", (21,), 16, 130, "float32", bias=True, seed=46)
    inp = make_inputs(case)
    out = twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows, wrt=(wrt,))
    key = "dx" if wrt == "x" else "dw"
    assert set(out) & {"dx", "dw", "db"} == {key}
    check_flce(case, inp, out)


@each_twin
def test_no_gradient_to_class_weights(twin):
    """class_weights that are differentiated receive none (torch: no .grad; JAX: a zero cotangent)."""
    case = Case("cwgrad", (13,), 16, 130, "float32", class_weights=True, label_smoothing=0.1, seed=47)
    inp = make_inputs(case)
    out = twin.run(inp, case.options(), wrt=("x", "class_weights"))
    assert out["dcw"] is None or np.all(as_float64(out["dcw"]) == 0)
    check_flce(case, inp, out)


@each_twin
def test_tied_embedding_head(twin):
    """One table is the input embedding and the head: its gradient is the sum of both uses (float64
    reference of the whole model), far from the head-only gradient."""
    g = torch.Generator().manual_seed(40)
    v, h, shape = 130, 16, (2, 9)
    emb = torch.randn(v, h, generator=g) * 0.5
    a = torch.randn(h, h, generator=g) / math.sqrt(h)
    ids = torch.randint(0, v, shape, generator=g)
    targets = torch.randint(0, v, shape, generator=g)
    targets[0, :3] = IGNORE_INDEX
    loss, de, da = twin.tied(emb, a, ids, targets, chunk_rows=8)

    e64, a64 = emb.double().requires_grad_(True), a.double().requires_grad_(True)
    hid = torch.tanh(torch.nn.functional.embedding(ids, e64) @ a64)
    ref = torch.nn.functional.cross_entropy((hid @ e64.T).reshape(-1, v), targets.reshape(-1),
                                            ignore_index=IGNORE_INDEX)
    ref_de, ref_da = torch.autograd.grad(ref, (e64, a64))
    loss_tol, grad_tol = tolerances("float32")
    assert rel_err(loss, ref.detach()) <= loss_tol
    assert rel_err(de, ref_de) <= grad_tol and rel_err(da, ref_da) <= grad_tol
    head_only = flce_reference(hid.detach(), emb, targets)["dw"]
    assert rel_err(de, head_only) > 1e-2


# ============================================================================ 3. chunking variants
@each_twin
@pytest.mark.parametrize("plan,chunk_rows", [("kept", 1), ("kept", 12), ("accumulated", 5), ("accumulated", 100)])
def test_chunking_variants(twin, plan, chunk_rows):
    """chunk_rows of 1 row, a remainder chunk plus full ones, and more rows than N, with dZ kept (N * 4 <= 4 H)
    and with a float32 dW accumulator; every option on; the same results as the reference."""
    h = 64 if plan == "kept" else 16
    case = Case("chunks", (37,), h, 300, "float32", bias=True, class_weights=True, label_smoothing=0.1,
                z_loss=1e-3, softcap=20.0, logit_scale=5.0, ignore_frac=0.3, seed=53)
    inp = make_inputs(case)
    p = plan_rows(37, h, 300, 4, need_grads=True, requested=chunk_rows)
    assert p.keep_dz == (plan == "kept" and chunk_rows < 37)
    check_flce(case, inp, twin.run(inp, case.options(), chunk_rows=chunk_rows))


# ============================================================================ 4. bad input
def _good_args():
    g = torch.Generator().manual_seed(31)
    return dict(x=torch.randn(6, 8, generator=g), weight=torch.randn(13, 8, generator=g),
                targets=torch.randint(0, 13, (6,), generator=g), bias=torch.randn(13, generator=g),
                class_weights=torch.rand(13, generator=g) + 0.5)


def _set(name, index, value):
    def change(a):
        t = a[name].clone()
        t[index] = value
        return {name: t}
    return change


BAD_INPUTS = {  # id: (changes to the good arguments, argument the message must name)
    "weight_H_mismatch": (lambda a: {"weight": torch.randn(13, 9)}, "weight"),
    "weight_not_2d": (lambda a: {"weight": torch.randn(13, 8, 1)}, "weight"),
    "weight_no_rows": (lambda a: {"weight": torch.randn(0, 8)}, "weight"),
    "weight_no_columns": (lambda a: {"x": torch.randn(6, 0), "weight": torch.randn(13, 0)}, "weight"),
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
    "normalizer_three_values": (lambda a: {"normalizer": (1.0, 2.0, 3.0)}, "normalizer"),
    "normalizer_not_scalar": (lambda a: {"normalizer": torch.ones(2)}, "normalizer"),
    "chunk_rows_zero": (lambda a: {"chunk_rows": 0}, "chunk_rows"),
    "class_weights_nan": (_set("class_weights", 3, float("nan")), "class_weights"),
    "class_weights_inf": (_set("class_weights", 0, float("inf")), "class_weights"),
}
VALUE_CHECKS = ("class_weights_nan", "class_weights_inf")   # need the values: torch validate, JAX concrete


def _bad_call(twin, bad):
    change, name = BAD_INPUTS[bad]
    args = _good_args()
    args.update(change(args))
    args = {k: twin.array(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    return args.pop("x"), args.pop("weight"), args.pop("targets"), args, name


def _names(msg, name):
    return re.search(rf"(?<![A-Za-z0-9_]){name}(?![A-Za-z0-9_])", msg) is not None


@each_twin
@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_bad_input_raises(twin, bad):
    """ValueError naming the argument (messages from fce_core.contract); the value checks of class weights
    run on concrete values (torch: validate=True, the default; JAX: outside tracing)."""
    x, w, t, kw, name = _bad_call(twin, bad)
    with pytest.raises(ValueError) as info:
        twin.call(x, w, t, **kw)
    assert _names(str(info.value), name), f"message does not name {name!r}: {info.value}"


@each_twin
@pytest.mark.parametrize("bad", VALUE_CHECKS)
def test_non_finite_class_weights_unchecked(twin, bad):
    """Without the value checks (torch validate=False; JAX traced class weights) non-finite class weights do
    not raise."""
    x, w, t, kw, _ = _bad_call(twin, bad)
    twin.call(x, w, t, **kw, **twin.unchecked)


@each_twin
@pytest.mark.parametrize("value,ignore_index", [(13, -100), (-1, -100), (1000, -100), (-100, 7)],
                         ids=["V", "minus1", "far", "default_ignore_with_custom_ignore_index"])
def test_out_of_range_targets_raise(twin, value, ignore_index):
    """Targets outside [0, V) other than ignore_index: ValueError naming targets, for the plain call and the
    differentiated one."""
    a = _good_args()
    t = torch.where(a["targets"] == 7, 8, a["targets"])
    t[2] = value
    x, w, t = twin.array(a["x"]), twin.array(a["weight"]), twin.array(t)
    with pytest.raises(ValueError, match="targets"):
        twin.call(x, w, t, ignore_index=ignore_index)
    with pytest.raises(ValueError, match="targets"):
        twin.loss_and_dx(x, w, t, ignore_index=ignore_index)


@each_twin
def test_out_of_range_targets_unchecked(twin):
    """Without the check (torch validate=False; JAX traced targets) an out-of-range row gives a NaN loss, never
    a wrong number: "mean" is NaN, "none" is NaN on those rows and finite elsewhere."""
    a = _good_args()
    t = a["targets"].clone()
    t[2], t[4] = 13, -1
    x, w, t = twin.array(a["x"]), twin.array(a["weight"]), twin.array(t)
    mean = as_float64(twin.call(x, w, t, **twin.unchecked))
    rows = as_float64(twin.call(x, w, t, reduction="none", **twin.unchecked))
    assert np.isnan(mean), mean
    assert np.isnan(rows[2]) and np.isnan(rows[4]), rows
    assert np.isfinite(np.delete(rows, [2, 4])).all(), rows


# ============================================================================ 5. all ignored, empty
@each_twin
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored(twin, reduction):
    """Every option on: loss 0 and gradients exactly 0, no NaN; argmax -1 everywhere."""
    case = Case("allign", (2, 9), 16, 130, "float32", bias=True, reduction=reduction, label_smoothing=0.1,
                z_loss=1e-3, softcap=20.0, class_weights=True, ignore_frac=1.0, seed=32)
    inp = make_inputs(case)
    out = twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows)
    for k in ("loss", "z_loss", "accuracy", "dx", "dw", "db"):
        assert np.all(as_float64(out[k]) == 0), f"{k} = {out[k]}"
    assert np.all(as_float64(out["argmax"]) == -1)
    assert tuple(out["loss"].shape) == (() if reduction != "none" else (2, 9))
    check_flce(case, inp, out)


@each_twin
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["0rows", "2x0rows"])
def test_empty_input(twin, reduction, lead):
    """No rows: a float32 loss 0 ("mean"/"sum") or empty ("none"), empty stats and dx, zero dw and db."""
    g = torch.Generator().manual_seed(43)
    inp = {"x": torch.randn(*lead, 16, generator=g), "weight": torch.randn(130, 16, generator=g),
           "bias": torch.randn(130, generator=g), "targets": torch.zeros(lead, dtype=torch.int64),
           "class_weights": None}
    out = twin.run(inp, {"reduction": reduction, "z_loss": 1e-3})
    assert twin.dtype(out["loss"]) == "float32"
    if reduction == "none":
        assert tuple(out["loss"].shape) == lead
    else:
        assert tuple(out["loss"].shape) == () and float(out["loss"]) == 0.0
    assert tuple(out["lse"].shape) == tuple(out["argmax"].shape) == lead
    assert tuple(out["dx"].shape) == tuple(inp["x"].shape)
    assert np.all(as_float64(out["dw"]) == 0) and np.all(as_float64(out["db"]) == 0)


# ============================================================================ 6. NaN and huge logits
@each_twin
@pytest.mark.parametrize("engine", ["library", "fused"])
@pytest.mark.parametrize("where", ["x_nan", "x_inf", "weight_nan"])
def test_nan_propagates(twin, where, engine):
    """NaN / inf in x or weight: the "mean" loss is not finite (NaN for a NaN), and so is the "none" loss of the
    row concerned (every row for a NaN weight); the other rows stay finite. Both engines (the fused one merges
    its tiles' maxima in a kernel, where NaN must win as in a max over the row)."""
    case = Case("nan", (12,), 16, 130, "float32", ignore_frac=0.0, seed=33)
    inp = make_inputs(case)
    x, w = inp["x"].clone(), inp["weight"].clone()
    if where == "x_nan":
        x[4, 3] = float("nan")
    elif where == "x_inf":
        x[4, 3] = float("inf")
    else:
        w[5, 2] = float("nan")
    x, w, t = twin.array(x), twin.array(w), twin.array(inp["targets"])
    mean = as_float64(twin.call(x, w, t, chunk_rows=8, jit=True, engine=engine))
    rows = as_float64(twin.call(x, w, t, reduction="none", chunk_rows=8, jit=True, engine=engine))
    assert not np.isfinite(mean), mean
    if where != "x_inf":
        assert np.isnan(mean), mean
    if where == "weight_nan":
        assert np.isnan(rows).all(), rows
    else:
        assert not np.isfinite(rows[4]), rows
        assert np.isfinite(np.delete(rows, 4)).all(), rows


@each_twin
@pytest.mark.parametrize("dtype,reduction", [("float32", "mean"), ("float32", "none"), ("float16", "sum"),
                                             ("bfloat16", "mean")])
def test_huge_logits_finite_and_accurate(twin, dtype, reduction):
    """logit_scale 100 (logits ~ N(0, 100²)) with bias, label smoothing and z-loss: finite and within SPEC."""
    case = Case("huge", (21,), 32, 1000, dtype, bias=True, label_smoothing=0.1, z_loss=1e-4, reduction=reduction,
                logit_scale=100.0, seed=34)
    inp = make_inputs(case)
    out = twin.run(inp, case.options(), chunk_rows=twin.option_chunk_rows)
    for k in ("loss", "lse", "dx", "dw", "db"):
        assert np.isfinite(as_float64(out[k])).all(), k
    check_flce(case, inp, out)


@each_twin
@pytest.mark.parametrize("case_name", ["none_3d", "all_options_none_f16"])
def test_none_reduction_random_grad_output(twin, case_name):
    """reduction="none" with a random (signed) cotangent per row, several chunks."""
    case = next(c for c in small_cases() if c.name == case_name)
    inp = make_inputs(case)
    g = torch.randn(case.shape, generator=torch.Generator().manual_seed(37))
    out = twin.run(inp, case.options(), chunk_rows=4, grad_output=g)
    check_flce(case, inp, out, grad_output=g)

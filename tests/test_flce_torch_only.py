"""fce_torch.fused_lce behaviour that only torch has (SPEC §1, §2): the torch.no_grad() loss-only path, no
[N, V] buffer, repeated backward(retain_graph=True) with a grad_output, the last backward's in-place scaling,
autocast, and the Liger drop-in `FusedLinearCrossEntropyLoss`. Everything else is checked for both twins in
test_flce.py; that the bits do not depend on ``validate`` is in test_plan.py."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fce_torch.api
import fce_torch.autodiff
import fce_torch.cce
import fce_torch.engine
import fce_torch.flce
import fce_torch.gemm
import fce_torch.liger
from fce_torch import FusedLinearCrossEntropyLoss, fused_lce
from fce_torch.kernels.grad_scale import scale_in_place
from helpers import assert_close_to_reference, restrict_lse, targets_avoiding
from parity.cases import IGNORE_INDEX, Case, make_inputs
from parity.reference import flce_reference, rel_err
from twins import TORCH, check_flce


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_only_path(reduction, monkeypatch):
    """torch.no_grad(): the same loss and stats bits as the grad path, no grad_fn, one GEMM per chunk and no
    gradient kernel; inputs that do not require grad take the same path outside no_grad."""
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
    monkeypatch.setattr(fce_torch.engine, "scale_rows", no_grad_kernel)
    n_valid = int((inp["targets"] != IGNORE_INDEX).sum())
    assert n_valid > 37 - 5      # the valid rows reach the last chunk: every chunk runs
    with torch.no_grad():
        loss_n, stats_n = fused_lce(x, w, inp["targets"], **kw)
    assert loss_n.grad_fn is None and not loss_n.requires_grad
    assert len(calls) == math.ceil(37 / 8), calls
    assert all(tuple(s)[1] == 32 for s in calls), calls   # [rows, H] @ [H, V]: logits GEMMs only
    assert torch.equal(loss_n, loss_g.detach())
    for k in ("lse", "z_loss", "accuracy", "argmax"):
        assert torch.equal(stats_n[k], stats_g[k]), k
    calls.clear()
    loss_p = fused_lce(inp["x"], inp["weight"], inp["targets"], **kw)[0]
    assert loss_p.grad_fn is None and len(calls) == math.ceil(37 / 8)
    assert torch.equal(loss_p, loss_g.detach())
    out = {"loss": loss_n, **{k: stats_n[k] for k in ("lse", "z_loss", "accuracy", "argmax")}}
    check_flce(case, inp, out)


def test_no_logits_buffer_materialized(monkeypatch):
    """With the float32 dW accumulator (N * 4 > 4 H), no GEMM output or operand is larger than the largest of
    a chunk's logits (chunk_rows * V), the weight (V * H) and x (N * H): never the [N, V] logits; forward and
    backward, for "mean" and "none"."""
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
        out = TORCH.run(inp, case.options(), chunk_rows=nc)
        assert sizes and max(sizes) <= max(nc * v, v * h, n * h) < n * v, (reduction, max(sizes))
        check_flce(case, inp, out)


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
    check_flce(case, inp, out, grad_output=2.5)


@pytest.mark.parametrize("g_out", [2.5, 1.0])
def test_last_backward_scales_in_place(g_out, monkeypatch):
    """A backward that frees the graph scales the forward's gradients in place, dX and dW in one launch, and
    autograd keeps those very buffers as .grad (no second dW-sized buffer): the same bits as a retained
    backward's new tensors. (db stays a new tensor: the forward keeps it as float32 for a bfloat16 bias.)"""
    buffers = []

    def spy(grads, g):
        buffers.append([t.data_ptr() for t in grads])
        return scale_in_place(grads, g)

    monkeypatch.setattr(fce_torch.autodiff, "scale_in_place", spy)
    case = Case("in_place", (2, 9), 32, 777, "bfloat16", bias=True, z_loss=1e-4, seed=41)
    inp = make_inputs(case)
    leaves = [inp[k].clone().requires_grad_(True) for k in ("x", "weight", "bias")]
    loss = fused_lce(leaves[0], leaves[1], inp["targets"], bias=leaves[2], chunk_rows=8, **case.options())
    g = torch.full_like(loss, g_out)
    loss.backward(g, retain_graph=True)
    assert buffers == [[]]
    retained = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    loss.backward(g)
    assert buffers[1] == [t.grad.data_ptr() for t in leaves[:2]]  # dX and dW, in one launch
    for t, r in zip(leaves, retained):
        assert torch.equal(t.grad, r)
    check_flce(case, inp, {"loss": loss.detach(), "dx": retained[0], "dw": retained[1], "db": retained[2]},
               grad_output=g_out)


class SeenOps(TorchDispatchMode):
    """The dispatcher's op packets (e.g. "aten.index_select", "fce.flce") that run inside the context."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_eager_calls_run_the_ops_body_with_the_same_bits(reduction, monkeypatch):
    """In eager mode fused_lce runs the custom op's body as an autograd.Function (`autodiff._routed`): the
    autograd'd op (fce::flce, or fce::flce_rows for "none") never reaches the dispatcher, whose eager round
    trip cost ~0.3 ms of host time a call; forced through the dispatcher, the same loss and gradients bit for
    bit."""
    op = "fce.flce" if reduction == "mean" else "fce.flce_rows"
    case = Case("eager", (2, 9), 32, 777, "bfloat16", bias=True, reduction=reduction, z_loss=1e-4, seed=43)
    inp = make_inputs(case)

    def run():
        leaves = [inp[k].clone().requires_grad_(True) for k in ("x", "weight", "bias")]
        with SeenOps() as seen:
            loss = fused_lce(leaves[0], leaves[1], inp["targets"], bias=leaves[2], chunk_rows=8, **case.options())
            loss.sum().backward()
        return seen.ops, [loss.detach()] + [t.grad for t in leaves]

    eager_ops, eager = run()
    assert op not in eager_ops and any(o.startswith("aten.") for o in eager_ops)
    monkeypatch.setattr(fce_torch.api, "flce", fce_torch.flce.flce_op)
    monkeypatch.setattr(fce_torch.api, "flce_rows", fce_torch.flce.flce_rows_op)
    op_ops, through_op = run()
    assert op in op_ops
    for a, b in zip(eager, through_op):
        assert torch.equal(a, b)


@pytest.mark.parametrize("engine", ["library", "fused"])
@pytest.mark.parametrize("validate", [True, False])
def test_one_chunk_keeps_the_callers_row_order(engine, validate):
    """With one chunk (`Plan.puts_valid_first` false) the rows stay in the caller's order whatever is ignored:
    no valid-first permutation, so no gathered rows of x, no index_copy of dX or of the outputs back, with or
    without the host count; with several chunks and ignored rows the permutation is there. The values:
    against the float64 reference."""
    case = Case("one_chunk", (37,), 32, 300, "float32", ignore_frac=0.4, seed=44)
    inp = make_inputs(case)
    permuting = {"aten.index_select", "aten.index_copy_", "aten.index_copy", "aten.index"}
    for chunk_rows, permutes in ((None, False), (8, True)):
        x, w = (inp[k].clone().requires_grad_(True) for k in ("x", "weight"))
        with SeenOps() as seen:
            loss = fused_lce(x, w, inp["targets"], chunk_rows=chunk_rows, engine=engine, validate=validate)
            loss.backward()
        assert bool(seen.ops & permuting) == permutes, (chunk_rows, sorted(seen.ops & permuting))
        check_flce(case, inp, {"loss": loss, "dx": x.grad, "dw": w.grad})


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
    bf = {k: inp[k].bfloat16() for k in ("x", "weight", "bias")}
    ref = flce_reference(bf["x"], bf["weight"], inp["targets"], bias=bf["bias"])
    out = {"loss": loss.detach(), "lse": stats["lse"], "dx": x.grad, "dw": w.grad, "db": b.grad}
    out, ref = restrict_lse(out, ref, inp["targets"])
    assert_close_to_reference(out, ref, "bfloat16")


# ---------------------------------------------------------------------------- Liger drop-in (SPEC §2)
LIGER_CONFIGS = {
    "default": (dict(), False),
    "bias_zloss_smoothing_ignore7": (dict(ignore_index=7, lse_square_scale=1e-3, label_smoothing=0.1), True),
    "sum": (dict(reduction="sum"), True),
    "none_zloss": (dict(reduction="none", lse_square_scale=1e-3), True),
    "stats": (dict(lse_square_scale=1e-3, return_z_loss=True, return_token_accuracy=True,
                   return_predicted_tokens=True), False),
    "token_scaling": (dict(use_token_scaling=True, lse_square_scale=1e-3, return_z_loss=True), True),
    "accum_float32": (dict(accum_dtype=torch.float32), False),
}


def _liger_problem(ignore_index, with_bias, reduction):
    g = torch.Generator().manual_seed(41)
    n, h, v = 24, 16, 130
    x0 = torch.randn(n, h, generator=g)
    w0 = torch.randn(v, h, generator=g) * (3.0 / math.sqrt(h))
    b0 = torch.randn(v, generator=g) * 0.3 if with_bias else None
    t = targets_avoiding(n, v, 7, g)
    t[[1, 10, 11]] = ignore_index
    g_out = torch.randn(n, generator=g) if reduction == "none" else None
    return x0, w0, b0, t, g_out


@pytest.mark.parametrize("config", list(LIGER_CONFIGS))
def test_liger_module_matches_liger(config):
    """FusedLinearCrossEntropyLoss vs Liger's LigerFusedLinearCrossEntropyLoss (Triton interpreter on a CPU),
    float32, same tensors, same constructor arguments; fce also against the float64 reference. The extra
    outputs (z_loss, token_accuracy, predicted_tokens) match Liger's."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    kw, with_bias = LIGER_CONFIGS[config]
    ignore_index = kw.get("ignore_index", IGNORE_INDEX)
    x0, w0, b0, t, g_out = _liger_problem(ignore_index, with_bias, kw.get("reduction"))
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
    if any(kw.get(f) for f in ("return_z_loss", "return_token_accuracy", "return_predicted_tokens")):
        assert type(fce["res"]).__name__ == "CrossEntropyOutput"
        if kw.get("return_z_loss"):
            assert rel_err(fce["res"].z_loss, liger["res"].z_loss) <= 1e-6
        if kw.get("return_token_accuracy"):
            assert fce["res"].token_accuracy.item() == pytest.approx(liger["res"].token_accuracy.item(), abs=1e-6)
        if kw.get("return_predicted_tokens"):
            assert torch.equal(fce["res"].predicted_tokens, liger["res"].predicted_tokens.to(torch.int64))
            assert torch.all(fce["res"].predicted_tokens[[1, 10, 11]] == -1)
    else:
        assert isinstance(fce["res"], torch.Tensor)
    ref = flce_reference(x0, w0, t, bias=b0, ignore_index=ignore_index, z_loss=kw.get("lse_square_scale", 0.0),
                         label_smoothing=kw.get("label_smoothing", 0.0), reduction=kw.get("reduction", "mean"),
                         token_scaling=kw.get("use_token_scaling", False), grad_output=g_out)
    assert_close_to_reference({k: fce[k] for k in ("loss", "dx", "dw", "db")}, ref, "float32")


def test_liger_module_ce_weight_and_softcap_match_reference():
    """ce_weight (with zeros) and softcap, which Liger 0.8.5 does not run in the Triton interpreter: fce's
    module against the float64 reference."""
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


def test_liger_module_accum_dtype_not_implemented():
    """accum_dtype other than None / float32: NotImplementedError naming it (fce accumulates dW in float32)."""
    with pytest.raises(NotImplementedError) as info:
        FusedLinearCrossEntropyLoss(accum_dtype=torch.bfloat16)
    assert "accum_dtype" in str(info.value)


@pytest.mark.parametrize("make, name", [
    (lambda: FusedLinearCrossEntropyLoss(reduction="avg"), "reduction"),
    (lambda: FusedLinearCrossEntropyLoss(label_smoothing=1.5), "label_smoothing"),
    (lambda: FusedLinearCrossEntropyLoss(softcap=0.0), "softcap"),
    (lambda: FusedLinearCrossEntropyLoss(return_z_loss=1), "return_z_loss"),
    (lambda: fce_torch.liger.FusedLinearCPOLoss(chunk_size=0), "chunk_size"),
    (lambda: fce_torch.liger.FusedLinearCPOLoss(compiled="yes"), "compiled"),
    (lambda: fce_torch.cce.LinearCrossEntropy(reduction="avg"), "reduction"),
    (lambda: fce_torch.cce.LinearCrossEntropy(filter_c_grad=None), "filter_c_grad"),
])
def test_dropin_constructors_name_the_bad_argument(make, name):
    """The drop-ins check their options at construction, where the peers assert: ValueError naming it."""
    with pytest.raises(ValueError, match=name):
        make()

"""The float64 reference (parity/reference.py) pinned to independent evaluations: torch.nn.functional.cross_entropy,
torch.log_softmax, hand formulas in numpy (gradients derived by hand), explicit Python loops for CPO, and finite
differences; its chunked on-device evaluation against the one-chunk CPU one. Plus the error measures and the case
generator."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close_to_reference, tolerances
from parity import reference
from parity.catalog import small_cpo_cases, small_logprob_cases, small_option_cases
from parity.cases import IGNORE_INDEX, Case, CpoCase, case_inputs, make_cpo_inputs, make_inputs, small_cases
from parity.reference import as_float64, cpo_reference, flce_reference, logprobs_reference, rel_err, ulp_distance

F64 = torch.float64


def _problem(n=12, h=8, v=37, seed=0, ignored=(1, 7), scale=2.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=F64)
    w = torch.randn(v, h, generator=g, dtype=F64) * (scale / math.sqrt(h))
    b = torch.randn(v, generator=g, dtype=F64) * 0.3
    t = torch.randint(0, v, (n,), generator=g)
    t[list(ignored)] = IGNORE_INDEX
    cw = 0.5 + 1.5 * torch.rand(v, generator=g, dtype=F64)
    cw[int(t[0])] = 0.0          # one valid row has a zero class weight
    return x, w, b, t, cw


def _close(a, b, rtol=1e-11, atol=1e-13, what=""):
    np.testing.assert_allclose(as_float64(a), as_float64(b), rtol=rtol, atol=atol, err_msg=what)


# ----------------------------------------------------------------------------- hand evaluation in numpy
def _hand_flce(x, w, t, *, b=None, cw=None, reduction="mean", eps=0.0, s=0.0, cap=None, g=None, ts=False,
               norm=None):
    """SPEC §1 written out in numpy, with the gradient derived by hand (not by autograd). ``ts``: token
    scaling (each row's terms and gradient times the constant p(y)); ``norm``: the "mean" (D, n)."""
    x, w = as_float64(x), as_float64(w)
    t = np.asarray(t.numpy() if isinstance(t, torch.Tensor) else t, dtype=np.int64)
    lead, (v, h) = t.shape, w.shape
    X, T = x.reshape(-1, h), t.reshape(-1)
    wc = np.ones(v) if cw is None else as_float64(cw)
    r = X @ w.T + (0.0 if b is None else as_float64(b))
    z = cap * np.tanh(r / cap) if cap else r
    m = z.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(z - lse[:, None])
    valid = T != IGNORE_INDEX
    y = np.where(valid, T, 0)
    rows = np.arange(len(T))
    onehot = np.zeros_like(z)
    onehot[rows, y] = 1.0
    ce = (1 - eps) * wc[y] * (lse - z[rows, y]) + (eps / v) * ((lse[:, None] - z) * wc).sum(axis=1)
    zl = s * lse**2
    dce = (1 - eps) * wc[y][:, None] * (p - onehot) + (eps / v) * (wc.sum() * p - wc)   # dCE_i/dz
    dzl = 2 * s * lse[:, None] * p                                                       # dZ_i/dz
    if ts:                                                  # p(y) is a constant factor of the row
        py = p[rows, y]
        ce, zl, dce, dzl = ce * py, zl * py, dce * py[:, None], dzl * py[:, None]
    n, d = valid.sum(), wc[y][valid].sum()
    if norm is not None:
        d, n = norm if isinstance(norm, tuple) else (norm, norm)
    if reduction == "none":
        gv = np.broadcast_to(1.0 if g is None else as_float64(g), lead).reshape(-1)
        loss = np.where(valid, ce + zl, 0.0).reshape(lead)
        c_ce = c_z = np.where(valid, gv, 0.0)
    else:
        gs = 1.0 if g is None else float(g)
        if reduction == "sum":
            loss = (ce + zl)[valid].sum()
            c_ce = c_z = valid * gs
        else:
            loss = (ce[valid].sum() / d if d != 0 else 0.0) + (zl[valid].sum() / n if n > 0 else 0.0)
            c_ce = valid * gs * (1 / d if d != 0 else 0.0)
            c_z = valid * gs * (1 / n if n > 0 else 0.0)
    dz = c_ce[:, None] * dce + c_z[:, None] * dzl
    dr = dz * (1 - np.tanh(r / cap) ** 2) if cap else dz
    return {"loss": np.asarray(loss), "lse": lse.reshape(lead), "dx": (dr @ w).reshape(x.shape),
            "dw": dr.T @ X, "db": dr.sum(axis=0)}


# ----------------------------------------------------------------------------- FLCE vs F.cross_entropy
def _torch_ce(x, w, b, t, cw, reduction, eps, g, cap=None):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    bb = b.clone().requires_grad_() if b is not None else None
    logits = xx @ ww.T + (bb if bb is not None else 0.0)
    if cap:
        logits = cap * torch.tanh(logits / cap)
    loss = F.cross_entropy(logits.reshape(-1, w.shape[0]), t.reshape(-1), weight=cw, ignore_index=IGNORE_INDEX,
                           reduction=reduction, label_smoothing=eps)
    if reduction == "none":
        loss = loss.reshape(t.shape)
    (loss * g).sum().backward()
    return loss.detach(), xx.grad, ww.grad, (bb.grad if bb is not None else None)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.15])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_torch_cross_entropy(reduction, eps, weighted):
    x, w, b, t, cw = _problem(seed=1)
    cw = cw if weighted else None
    if reduction == "none":
        g = torch.randn(t.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    else:
        g = torch.tensor(1.7, dtype=F64)
    loss, dx, dw, db = _torch_ce(x, w, b, t, cw, reduction, eps, g)
    ref = flce_reference(x, w, t, bias=b, class_weights=cw, reduction=reduction, label_smoothing=eps,
                         grad_output=g)
    assert ref["loss"].shape == tuple(loss.shape)
    for key, want in [("loss", loss), ("dx", dx), ("dw", dw), ("db", db)]:
        _close(ref[key], want, what=key)
    assert np.abs(ref["dx"]).max() > 1e-3        # the comparison is not between zeros


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_matches_torch_cross_entropy_3d_and_softcap(reduction):
    x, w, b, t, cw = _problem(n=12, seed=2, scale=40.0)
    x3, t3 = x.reshape(3, 4, -1), t.reshape(3, 4)
    g = torch.linspace(0.5, 2.0, 12, dtype=F64).reshape(3, 4) if reduction == "none" else 1.0
    loss, dx, dw, _ = _torch_ce(x3, w, None, t3, cw, reduction, 0.1, g, cap=20.0)
    ref = flce_reference(x3, w, t3, class_weights=cw, reduction=reduction, label_smoothing=0.1, softcap=20.0,
                         grad_output=g)
    assert ref["dx"].shape == (3, 4, 8) and ref["lse"].shape == (3, 4)
    for key, want in [("loss", loss), ("dx", dx), ("dw", dw)]:
        _close(ref[key], want, what=key)
    assert ref["db"] is None


@pytest.mark.parametrize("case", small_cases() + small_option_cases(), ids=lambda c: c.name)
def test_every_small_case_matches_hand_formulas(case):
    """All options of SPEC §1 (the shared cases and the suite's option cases: token scaling, a normalizer,
    negative class weights, a float32 bias) against the numpy formulas with a hand-derived gradient."""
    inp = make_inputs(case)
    g = (torch.linspace(-1.0, 2.0, case.rows).reshape(case.shape) if case.reduction == "none" else 0.75)
    ref = flce_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"],
                         class_weights=inp["class_weights"], grad_output=g, **case.math_options())
    hand = _hand_flce(inp["x"], inp["weight"], inp["targets"], b=inp["bias"], cw=inp["class_weights"],
                      reduction=case.reduction, eps=case.label_smoothing, s=case.z_loss, cap=case.softcap, g=g,
                      ts=case.token_scaling, norm=case.normalizer)
    for key in ("loss", "lse", "dx", "dw") + (("db",) if case.bias else ()):
        assert ref[key].shape == hand[key].shape, key
        assert rel_err(ref[key], hand[key]) <= 1e-11, key
    assert (ref["db"] is None) == (not case.bias)
    assert all(np.isfinite(ref[k]).all() for k in ("loss", "lse", "z_loss", "accuracy", "dx", "dw"))


def test_z_loss_hand_formula():
    x, w, b, t, _ = _problem(seed=3, scale=5.0)
    s = 3e-3
    ref0 = flce_reference(x, w, t, bias=b)
    ref = flce_reference(x, w, t, bias=b, z_loss=s)
    r = (x @ w.T + b).numpy()
    lse = np.log(np.exp(r).sum(axis=1))                       # small logits: no shift needed
    valid = (t != IGNORE_INDEX).numpy()
    zpart = s * np.mean(lse[valid] ** 2)
    assert ref["z_loss"] == pytest.approx(zpart, rel=1e-12)
    assert ref["loss"] - ref0["loss"] == pytest.approx(zpart, rel=1e-9)
    p = np.exp(r - lse[:, None])
    ddx = ((2 * s / valid.sum()) * (lse * valid)[:, None] * p) @ w.numpy()
    _close(ref["dx"] - ref0["dx"], ddx, rtol=1e-9, atol=1e-14)
    _close(ref["lse"], lse)                                   # every row, ignored ones included
    none = flce_reference(x, w, t, bias=b, z_loss=s, reduction="none")
    _close(none["z_loss"], np.where(valid, s * lse**2, 0.0))
    assert flce_reference(x, w, t, bias=b, z_loss=s, reduction="sum")["z_loss"] == pytest.approx(
        s * np.sum(lse[valid] ** 2), rel=1e-12)


def test_softcap_hand_formula():
    x, w, _, t, _ = _problem(seed=4, scale=60.0)
    c = 10.0
    ref = flce_reference(x, w, t, softcap=c, reduction="sum")
    r = (x @ w.T).numpy()
    z = c * np.tanh(r / c)
    lse = np.log(np.exp(z).sum(axis=1))                       # |z| <= 10: no shift needed
    valid = (t != IGNORE_INDEX).numpy()
    y = np.where(valid, t.numpy(), 0)
    assert ref["loss"] == pytest.approx(np.sum((lse - z[np.arange(len(y)), y])[valid]), rel=1e-12)
    assert np.abs(r).max() > 3 * c                            # the cap is active
    dz = (np.exp(z - lse[:, None]) - np.eye(w.shape[0])[y]) * valid[:, None]
    _close(ref["dx"], (dz * (1 - np.tanh(r / c) ** 2)) @ w.numpy())


def test_accuracy_and_lse_by_hand():
    w = torch.eye(4, dtype=F64)                               # logits == x
    x = torch.tensor([[1.0, 3, 3, 0], [5, 0, 0, 0], [0, 0, 0, 2], [1, 1, 1, 1]], dtype=F64)
    t = torch.tensor([2, 0, 3, IGNORE_INDEX])                 # row 0: first argmax is 1 (a tie with 2)
    ref = flce_reference(x, w, t)
    assert ref["accuracy"] == pytest.approx(2 / 3)
    np.testing.assert_array_equal(flce_reference(x, w, t, reduction="none")["accuracy"], [0, 1, 1, 0])
    assert flce_reference(x, w, t, reduction="sum")["accuracy"] == pytest.approx(2 / 3)
    assert flce_reference(x, w, t, softcap=2.0)["accuracy"] == pytest.approx(2 / 3)
    lse = [math.log(2 * math.e**3 + math.e + 1), math.log(math.e**5 + 3), math.log(math.e**2 + 3),
           1 + math.log(4)]
    _close(ref["lse"], lse, rtol=1e-14)
    want = (lse[0] - 3 + lse[1] - 5 + lse[2] - 2) / 3
    assert ref["loss"] == pytest.approx(want, rel=1e-14)


# ----------------------------------------------------------------------------- n = 0, D = 0, errors
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored_gives_zero(reduction):
    x, w, b, t, cw = _problem(seed=5)
    t[:] = IGNORE_INDEX
    ref = flce_reference(x, w, t, bias=b, class_weights=cw, reduction=reduction, label_smoothing=0.1,
                         z_loss=1e-2, softcap=5.0)
    for key in ("loss", "z_loss", "accuracy", "dx", "dw", "db"):
        assert np.all(ref[key] == 0.0), key
    assert np.isfinite(ref["lse"]).all() and ref["lse"].shape == (12,)
    empty = flce_reference(x[:0], w, t[:0], reduction=reduction)
    assert np.all(empty["loss"] == 0.0) and empty["dx"].shape == (0, 8) and not empty["dw"].any()


def test_zero_weight_sum_gives_zero_ce_part():
    x, w, b, t, cw = _problem(seed=6)
    cw[t[t != IGNORE_INDEX]] = 0.0                            # D = 0, smoothing term still nonzero
    ref = flce_reference(x, w, t, class_weights=cw, label_smoothing=0.2)
    assert ref["loss"] == 0.0 and not ref["dx"].any() and not ref["dw"].any()
    s = 1e-2
    ref = flce_reference(x, w, t, class_weights=cw, label_smoothing=0.2, z_loss=s)
    hand = _hand_flce(x, w, t, cw=cw, eps=0.2, s=s)
    assert ref["loss"] == pytest.approx(float(hand["loss"]), rel=1e-12)
    assert ref["loss"] == pytest.approx(float(ref["z_loss"]), rel=1e-12) and ref["loss"] > 0
    assert rel_err(ref["dx"], hand["dx"]) < 1e-11 and rel_err(ref["dw"], hand["dw"]) < 1e-11


def test_targets_out_of_range_raise():
    x, w, _, t, _ = _problem(seed=7)
    for bad in (37, 1000, -1, -101):
        tt = t.clone()
        tt[3] = bad
        with pytest.raises(ValueError, match="targets"):
            flce_reference(x, w, tt)
    tt = t.clone()
    tt[tt == IGNORE_INDEX] = -1
    flce_reference(x, w, tt, ignore_index=-1)                 # -1 is the ignore_index here: fine
    with pytest.raises(ValueError, match="targets"):
        flce_reference(x, w, t, ignore_index=-1)              # now -100 is out of range
    with pytest.raises(ValueError, match="targets"):
        cpo_reference(x.reshape(2, 6, 8), w, torch.full((2, 6), 37))


@pytest.mark.parametrize("kwargs, name", [
    ({"reduction": "avg"}, "reduction"), ({"label_smoothing": 1.5}, "label_smoothing"),
    ({"z_loss": -1.0}, "z_loss"), ({"softcap": 0.0}, "softcap"),
    ({"class_weights": torch.full((37,), math.inf, dtype=F64)}, "class_weights"),
    ({"class_weights": torch.ones(36, dtype=F64)}, "class_weights"), ({"bias": torch.zeros(5)}, "bias"),
    ({"normalizer": (1.0, 2.0, 3.0)}, "normalizer"),
])
def test_bad_arguments_raise(kwargs, name):
    x, w, _, t, _ = _problem(seed=8)
    with pytest.raises(ValueError, match=name):
        flce_reference(x, w, t, **kwargs)


def test_inputs_any_dtype_and_untouched():
    x, w, b, t, cw = _problem(seed=9)
    xb, wb, bb = x.bfloat16().requires_grad_(), w.bfloat16(), b.bfloat16()
    copies = [a.detach().clone() for a in (xb, wb, bb, t)]
    ref = flce_reference(xb, wb, t.int(), bias=bb, class_weights=cw.float(), label_smoothing=0.1)
    for a, c in zip((xb, wb, bb, t), copies):
        assert torch.equal(a.detach(), c)
    assert xb.grad is None
    hand = _hand_flce(xb.detach().double(), wb.double(), t, b=bb.double(), cw=cw.float().double(), eps=0.1)
    assert ref["loss"] == pytest.approx(float(hand["loss"]), rel=1e-12)
    assert ref["dx"].dtype == np.float64 and rel_err(ref["dx"], hand["dx"]) < 1e-11
    ref_np = flce_reference(x.numpy(), w.numpy(), t.numpy().astype(np.int32))
    assert ref_np["loss"] == pytest.approx(float(_hand_flce(x, w, t)["loss"]), rel=1e-12)
    with pytest.raises(ValueError, match="targets"):
        flce_reference(x, w, t.double())


def test_finite_difference_flce():
    x, w, b, t, cw = _problem(seed=10)
    opts = dict(class_weights=cw, label_smoothing=0.1, z_loss=1e-2, softcap=3.0)
    ref = flce_reference(x, w, t, bias=b, **opts)

    def loss_at(w_):
        return float(_hand_flce(x, w_, t, b=b, cw=cw, eps=0.1, s=1e-2, cap=3.0)["loss"])

    h = 1e-5
    for (i, j) in [(int(t[2]), 3), (5, 0)]:
        wp, wm = w.clone(), w.clone()
        wp[i, j] += h
        wm[i, j] -= h
        fd = (loss_at(wp) - loss_at(wm)) / (2 * h)
        assert ref["dw"][i, j] == pytest.approx(fd, rel=1e-6, abs=1e-10)


# ----------------------------------------------------------------------------- token scaling, normalizer, signs
def _scaled_torch(x, w, b, t, cw, eps, s, reduction, g):
    """Liger's token scaling composed from F.cross_entropy: each row's CE and z-loss times p(y).detach()."""
    xx, ww, bb = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    logits = xx @ ww.T + bb
    valid = t != IGNORE_INDEX
    y = torch.where(valid, t, 0)
    ce = F.cross_entropy(logits, t, weight=cw, ignore_index=IGNORE_INDEX, reduction="none", label_smoothing=eps)
    lse = torch.logsumexp(logits, dim=1)
    p_y = torch.softmax(logits, dim=1).gather(1, y[:, None])[:, 0].detach()
    ce, zl = ce * p_y, torch.where(valid, s * lse**2, 0.0) * p_y
    if reduction == "none":
        loss = ce + zl
    else:
        d, n = (cw[y] * valid).sum(), valid.sum()
        loss = ce.sum() / d + zl.sum() / n if reduction == "mean" else (ce + zl).sum()
    (loss * g).sum().backward()
    return {"loss": loss.detach(), "dx": xx.grad, "dw": ww.grad, "db": bb.grad}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_token_scaling_matches_scaled_cross_entropy(reduction):
    x, w, b, t, cw = _problem(seed=11, scale=4.0)
    g = torch.linspace(-1.0, 2.0, 12, dtype=F64) if reduction == "none" else torch.tensor(1.3, dtype=F64)
    want = _scaled_torch(x, w, b, t, cw, 0.1, 1e-2, reduction, g)
    ref = flce_reference(x, w, t, bias=b, class_weights=cw, label_smoothing=0.1, z_loss=1e-2, reduction=reduction,
                         token_scaling=True, grad_output=g)
    for key in ("loss", "dx", "dw", "db"):
        _close(ref[key], want[key], what=key)
    plain = flce_reference(x, w, t, bias=b, class_weights=cw, label_smoothing=0.1, z_loss=1e-2,
                           reduction=reduction, grad_output=g)
    assert rel_err(ref["dx"], plain["dx"]) > 0.1              # the scaling is not a no-op here
    zpart = _scaled_torch(x, w, b, t, cw, 0.1, 1e-2, reduction, g)["loss"] - _scaled_torch(
        x, w, b, t, cw, 0.1, 0.0, reduction, g)["loss"]
    _close(ref["z_loss"], zpart, rtol=1e-9, atol=1e-15)        # the z-loss stat is the scaled part


def test_normalizer_replaces_the_mean_denominators():
    x, w, b, t, cw = _problem(seed=12)
    s = 1e-2
    ce_sum = F.cross_entropy(x @ w.T + b, t, weight=cw, ignore_index=IGNORE_INDEX, reduction="sum")
    lse = torch.logsumexp(x @ w.T + b, dim=1)[t != IGNORE_INDEX]
    for norm, (d, n) in (((40.0, 25.0), (40.0, 25.0)), (30.0, (30.0, 30.0)), (torch.tensor(7.0), (7.0, 7.0))):
        ref = flce_reference(x, w, t, bias=b, class_weights=cw, z_loss=s, normalizer=norm)
        assert ref["loss"] == pytest.approx(float(ce_sum) / d + s * float((lse**2).sum()) / n, rel=1e-12)
        hand = _hand_flce(x, w, t, b=b, cw=cw, s=s, norm=(d, n))
        assert rel_err(ref["dw"], hand["dw"]) < 1e-11 and rel_err(ref["db"], hand["db"]) < 1e-11
    for red in ("sum", "none"):                                          # ignored for "sum" and "none"
        a = flce_reference(x, w, t, bias=b, class_weights=cw, reduction=red, normalizer=(3.0, 4.0))
        c = flce_reference(x, w, t, bias=b, class_weights=cw, reduction=red)
        assert np.array_equal(a["loss"], c["loss"]) and np.array_equal(a["dx"], c["dx"])
    zero_d = flce_reference(x, w, t, bias=b, class_weights=cw, z_loss=s, normalizer=(0.0, 25.0))
    assert zero_d["loss"] == pytest.approx(s * float((lse**2).sum()) / 25.0, rel=1e-12)   # CE part 0


def test_negative_class_weights_match_cross_entropy_and_zero_d_is_zero():
    x, w, b, t, cw = _problem(seed=13)
    cw = cw - 1.2                                             # both signs, D = Σ w_y still away from 0
    assert (cw < 0).any() and (cw > 0).any()
    loss, dx, dw, db = _torch_ce(x, w, b, t, cw, "mean", 0.1, torch.tensor(1.0, dtype=F64))
    ref = flce_reference(x, w, t, bias=b, class_weights=cw, label_smoothing=0.1)
    for key, want in [("loss", loss), ("dx", dx), ("dw", dw), ("db", db)]:
        _close(ref[key], want, what=key)
    valid = (t != IGNORE_INDEX).nonzero()[:, 0]
    t2 = torch.full_like(t, IGNORE_INDEX)
    t2[valid[:2]] = torch.tensor([3, 4])
    cw2 = torch.zeros(37, dtype=F64)
    cw2[3], cw2[4] = 1.5, -1.5                                # D = 0 exactly, with nonzero weights
    ref = flce_reference(x, w, t2, class_weights=cw2, z_loss=1e-2)
    assert np.isfinite(ref["loss"]) and np.isfinite(ref["dx"]).all()
    assert ref["loss"] == pytest.approx(float(ref["z_loss"]), rel=1e-12) and ref["loss"] > 0


def test_argmax_stat_by_hand():
    w = torch.eye(4, dtype=F64)                               # logits == x
    x = torch.tensor([[1.0, 3, 3, 0], [5, 0, 0, 0], [0, 0, 0, 2], [1, 1, 1, 1]], dtype=F64)
    t = torch.tensor([2, 0, 3, IGNORE_INDEX])
    for red in ("mean", "none"):
        np.testing.assert_array_equal(flce_reference(x, w, t, reduction=red)["argmax"], [1, 0, 3, -1])
    x3, t3 = x.reshape(2, 2, 4), t.reshape(2, 2)
    got = flce_reference(x3, w, t3, softcap=1.0)["argmax"]
    assert got.shape == (2, 2) and got.dtype == np.int64 and got.tolist() == [[1, 0], [3, -1]]


# ----------------------------------------------------------------------------- CPO by explicit loops
def _log_sigmoid(u):
    return -math.log1p(math.exp(-u)) if u >= 0 else u - math.log1p(math.exp(u))


def _hand_cpo(x, w, t, b=None, *, beta=0.1, alpha=1.0, eps=0.0, loss_type="sigmoid", gamma=0.5, avg=None):
    """SPEC §3 with plain Python loops over sequences, tokens, classes and features."""
    x, w, t = as_float64(x).tolist(), as_float64(w).tolist(), np.asarray(t).tolist()
    b = as_float64(b).tolist() if b is not None else [0.0] * len(w)
    avg = loss_type in ("ipo", "simpo") if avg is None else avg
    nb = len(x) // 2
    logps, nll_sum, nll_n = [], 0.0, 0
    for k in range(2 * nb):
        total, count = 0.0, 0
        for j in range(len(x[k])):
            y = t[k][j]
            if y == IGNORE_INDEX:
                continue
            logits = [sum(x[k][j][f] * w[c][f] for f in range(len(w[c]))) + b[c] for c in range(len(w))]
            mx = max(logits)
            lse = mx + math.log(sum(math.exp(l - mx) for l in logits))
            total += logits[y] - lse
            count += 1
            if k < nb:
                nll_sum += lse - logits[y]
                nll_n += 1
        logps.append(total / count if (avg and count) else total)
    per_pair = []
    for i in range(nb):
        d = logps[i] - logps[nb + i]
        if loss_type == "simpo":
            d -= gamma / beta
        if loss_type in ("sigmoid", "simpo"):
            per_pair.append(-(1 - eps) * _log_sigmoid(beta * d) - eps * _log_sigmoid(-beta * d))
        elif loss_type == "hinge":
            per_pair.append(max(0.0, 1 - beta * d))
        else:
            per_pair.append((d - 1 / (2 * beta)) ** 2)
    nll = nll_sum / nll_n if nll_n else 0.0
    return {"loss": sum(per_pair) / nb + alpha * nll, "chosen_logps": logps[:nb],
            "rejected_logps": logps[nb:], "nll_loss": nll}


def _cpo_problem(seed=0):
    """B = 2 pairs, T = 4, H = 3, V = 5; pair 1's rejected sequence (row 3) is fully ignored."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 4, 3, generator=g, dtype=F64)
    w = torch.randn(5, 3, generator=g, dtype=F64)
    b = torch.randn(5, generator=g, dtype=F64) * 0.5
    t = torch.tensor([[-100, 1, 4, 2], [-100, -100, 0, 3], [-100, 2, 2, -100], [-100, -100, -100, -100]])
    return x, w, b, t


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "simpo"])
@pytest.mark.parametrize("avg", [None, True, False])
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_cpo_matches_loops(loss_type, avg, eps):
    x, w, b, t = _cpo_problem()
    beta = 0.7
    ref = cpo_reference(x, w, t, bias=b, beta=beta, alpha=1.0, label_smoothing=eps, loss_type=loss_type,
                        simpo_gamma=0.3, average_log_prob=avg)
    hand = _hand_cpo(x, w, t, b, beta=beta, alpha=1.0, eps=eps, loss_type=loss_type, gamma=0.3, avg=avg)
    for key in ("loss", "chosen_logps", "rejected_logps", "nll_loss"):
        _close(ref[key], hand[key], what=key)
    assert ref["rejected_logps"][1] == 0.0                   # the fully ignored sequence
    _close(ref["chosen_rewards"], beta * np.array(hand["chosen_logps"]), rtol=1e-14)
    _close(ref["rejected_rewards"], beta * np.array(hand["rejected_logps"]), rtol=1e-14)
    assert np.isfinite(ref["dx"]).all() and not ref["dx"][3].any() and not ref["dx"][:, 0].any()


def test_cpo_alpha_zero_and_no_chosen_tokens():
    x, w, b, t = _cpo_problem(seed=1)
    ref = cpo_reference(x, w, t, alpha=0.0)
    hand = _hand_cpo(x, w, t, alpha=0.0)
    assert ref["loss"] == pytest.approx(hand["loss"], rel=1e-12)
    assert ref["nll_loss"] == pytest.approx(hand["nll_loss"], rel=1e-12) and ref["nll_loss"] > 0
    assert ref["db"] is None
    t2 = t.clone()
    t2[:2] = IGNORE_INDEX                                     # no valid chosen token anywhere
    for avg in (True, False):
        ref = cpo_reference(x, w, t2, bias=b, average_log_prob=avg)
        assert ref["nll_loss"] == 0.0 and np.all(ref["chosen_logps"] == 0.0)
        assert ref["loss"] == pytest.approx(_hand_cpo(x, w, t2, b, avg=avg)["loss"], rel=1e-12)
        assert np.isfinite(ref["dx"]).all() and np.isfinite(ref["dw"]).all()


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_cpo_finite_difference(loss_type):
    x, w, b, t = _cpo_problem(seed=2)
    kw = dict(beta=0.5, alpha=0.8, eps=0.1, loss_type=loss_type)
    ref = cpo_reference(x, w, t, bias=b, beta=0.5, alpha=0.8, label_smoothing=0.1, loss_type=loss_type)
    h = 1e-6
    xp, xm = x.clone(), x.clone()
    xp[2, 1, 0] += h                                          # a valid rejected token
    xm[2, 1, 0] -= h
    fd = (_hand_cpo(xp, w, t, b, **kw)["loss"] - _hand_cpo(xm, w, t, b, **kw)["loss"]) / (2 * h)
    assert ref["dx"][2, 1, 0] == pytest.approx(fd, rel=1e-6)
    bp, bm = b.clone(), b.clone()
    bp[2] += h
    bm[2] -= h
    fd = (_hand_cpo(x, w, t, bp, **kw)["loss"] - _hand_cpo(x, w, t, bm, **kw)["loss"]) / (2 * h)
    assert ref["db"][2] == pytest.approx(fd, rel=1e-6)


# ----------------------------------------------------------------------------- SPEC §4 log-probs
def _hand_logprobs(x, w, t, *, b=None, cap=None, temp=1.0, gl=None, ge=None):
    """SPEC §4 in numpy with the gradient derived by hand: dlogp/dz = onehot − p, dH/dz = −p (z − Σ p z)."""
    x, w, t = as_float64(x), as_float64(w), np.asarray(t)
    lead, h = t.shape, w.shape[1]
    X, T = x.reshape(-1, h), t.reshape(-1)
    r = X @ w.T + (0.0 if b is None else as_float64(b))
    z = (cap * np.tanh(r / cap) if cap else r) / temp
    m = z.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(z - lse[:, None])
    valid = T != IGNORE_INDEX
    rows, y = np.arange(len(T)), np.where(valid, T, 0)
    mu = (p * z).sum(axis=1)
    logp, ent = np.where(valid, z[rows, y] - lse, 0.0), np.where(valid, lse - mu, 0.0)
    onehot = np.zeros_like(z)
    onehot[rows, y] = 1.0
    cot = [np.zeros(len(T)) if c is None else as_float64(c).reshape(-1) * valid for c in (gl, ge)]
    dz = cot[0][:, None] * (onehot - p) - cot[1][:, None] * p * (z - mu[:, None])
    dr = dz / temp * ((1 - np.tanh(r / cap) ** 2) if cap else 1.0)
    return {"logp": logp.reshape(lead), "entropy": ent.reshape(lead), "dx": (dr @ w).reshape(x.shape),
            "dw": dr.T @ X, "db": dr.sum(axis=0)}


@pytest.mark.parametrize("cap, temp", [(None, 1.0), (None, 0.7), (4.0, 1.3)])
def test_logprobs_match_log_softmax_and_hand_formulas(cap, temp):
    x, w, b, t, _ = _problem(seed=14, scale=10.0)
    gen = torch.Generator().manual_seed(3)
    gl, ge = torch.randn(12, generator=gen, dtype=F64), torch.randn(12, generator=gen, dtype=F64)
    ref = logprobs_reference(x, w, t, bias=b, softcap=cap, temperature=temp, grad_logp=gl, grad_entropy=ge)
    xx, ww, bb = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    r = xx @ ww.T + bb
    lp = torch.log_softmax((cap * torch.tanh(r / cap) if cap else r) / temp, dim=1)
    valid = t != IGNORE_INDEX
    logp = torch.where(valid, lp.gather(1, torch.where(valid, t, 0)[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -(lp.exp() * lp).sum(dim=1), 0.0)
    (logp * gl + ent * ge).sum().backward()
    for key, want in [("logp", logp), ("entropy", ent), ("dx", xx.grad), ("dw", ww.grad), ("db", bb.grad)]:
        # entropy = lse − Σ p z: float64 round-off of the two O(lse) terms, absolute
        _close(ref[key], want.detach(), atol=1e-12 if key == "entropy" else 1e-13, what=key)
    hand = _hand_logprobs(x, w, t, b=b, cap=cap, temp=temp, gl=gl, ge=ge)
    for key in hand:
        assert rel_err(ref[key], hand[key]) < 1e-11, key
    assert ref["logp"][1] == 0.0 and ref["entropy"][7] == 0.0 and np.abs(ref["entropy"]).min() == 0.0
    assert (ref["entropy"][valid.numpy()] > 0).all() and (ref["logp"] <= 0).all()


def test_logprobs_cotangents_are_optional_and_ignored_rows_stay_out():
    x, w, _, t, _ = _problem(seed=15)
    x3, t3 = x.reshape(3, 4, 8).clone(), t.reshape(3, 4)
    x3[0, 1] = float("nan")                                    # row 1 is ignored: NaN must not leak
    gl = torch.linspace(-1, 1, 12, dtype=F64).reshape(3, 4)
    none = logprobs_reference(x3, w, t3)
    assert not none["dx"].any() and not none["dw"].any() and none["db"] is None and none["logp"].shape == (3, 4)
    only_lp = logprobs_reference(x3, w, t3, grad_logp=gl)
    hand = _hand_logprobs(np.nan_to_num(as_float64(x3)), w, t3, gl=gl)
    assert rel_err(only_lp["dw"], hand["dw"]) < 1e-11 and rel_err(only_lp["dx"], hand["dx"]) < 1e-11
    assert np.isfinite(only_lp["dx"]).all() and not only_lp["dx"][0, 1].any()
    only_ent = logprobs_reference(x3, w, t3, grad_entropy=gl)
    assert rel_err(only_ent["dw"], _hand_logprobs(np.nan_to_num(as_float64(x3)), w, t3, ge=gl)["dw"]) < 1e-11
    for bad, name in (({"temperature": 0.0}, "temperature"), ({"softcap": -1.0}, "softcap")):
        with pytest.raises(ValueError, match=name):
            logprobs_reference(x, w, t, **bad)


def test_logprobs_finite_difference():
    x, w, b, t, _ = _problem(seed=16, scale=6.0)
    ge = torch.ones(12, dtype=F64)
    ref = logprobs_reference(x, w, t, bias=b, softcap=3.0, temperature=0.7, grad_entropy=ge)
    h = 1e-6
    bp, bm = b.clone(), b.clone()
    bp[5] += h
    bm[5] -= h
    ent = lambda bb: _hand_logprobs(x, w, t, b=bb, cap=3.0, temp=0.7)["entropy"].sum()  # noqa: E731
    assert ref["db"][5] == pytest.approx((ent(bp) - ent(bm)) / (2 * h), rel=1e-6)


# ----------------------------------------------------------------------------- chunked on the device
def _chunked_equals_whole(got: dict, want: dict, keys):
    for k in keys:
        if want[k] is None:
            assert got[k] is None, k
            continue
        assert rel_err(got[k], want[k]) < 1e-12, k


@pytest.mark.parametrize("case", [c for c in small_cases() if c.name in (
    "all_options_bf16", "all_options_none_f16", "all_ignored", "softcap", "class_weights", "none_3d", "sum_bf16")]
    + small_option_cases(), ids=lambda c: c.name)
def test_flce_on_device_by_chunks_matches_the_whole(case):
    inp = case_inputs(case)
    want = flce_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"],
                          class_weights=inp["class_weights"], grad_output=inp["grad_loss"],
                          **case.math_options())
    got = reference.flce_on_device(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"],
                                   class_weights=inp["class_weights"], grad_output=inp["grad_loss"],
                                   chunk_bytes=3 * case.v * 8, stats=True, **case.math_options())  # 3-row chunks
    assert got["dx"].dtype == torch.float64 and got["dw"].device == inp["weight"].device
    _chunked_equals_whole(got, want, ("loss", "dx", "dw", "db", "lse", "z_loss", "accuracy"))
    assert torch.equal(got["argmax"], torch.from_numpy(want["argmax"]))


@pytest.mark.parametrize("case", small_cpo_cases() + [
    CpoCase("simpo_avg_false_bias", 3, 5, 16, 40, "float32", loss_type="simpo", bias=True,
            average_log_prob=False, prompt_frac=0.4, seed=9)], ids=lambda c: c.name)
def test_cpo_on_device_by_pairs_matches_the_whole(case):
    inp = make_cpo_inputs(case)
    want = cpo_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"], **case.math_options())
    got = reference.cpo_on_device(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"], chunk_bytes=1,
                                  **case.math_options())                          # one pair per chunk
    _chunked_equals_whole(got, want, ("loss", "dx", "dw", "db", "nll_loss"))
    want_logps = np.concatenate([want["chosen_logps"], want["rejected_logps"]])
    assert rel_err(got["logps"], want_logps) < 1e-12


@pytest.mark.parametrize("case", small_logprob_cases(), ids=lambda c: c.name)
def test_logprobs_on_device_by_chunks_matches_the_whole(case):
    inp = case_inputs(case)
    kw = dict(bias=inp["bias"], grad_logp=inp["grad_logp"], grad_entropy=inp["grad_entropy"], **case.math_options())
    want = logprobs_reference(inp["x"], inp["weight"], inp["targets"], **kw)
    got = reference.logprobs_on_device(inp["x"], inp["weight"], inp["targets"], chunk_bytes=2 * case.v * 8, **kw)
    _chunked_equals_whole(got, want, ("logp", "entropy", "dx", "dw", "db"))
    hand = _hand_logprobs(inp["x"], inp["weight"], inp["targets"], b=inp["bias"], cap=case.softcap,
                          temp=case.temperature, gl=inp["grad_logp"], ge=inp["grad_entropy"])
    for key in ("logp", "entropy", "dx", "dw") + (("db",) if case.bias else ()):
        assert rel_err(want[key], hand[key]) < 1e-11, key


# ----------------------------------------------------------------------------- error measures
def test_rel_err_known_values():
    assert rel_err(np.array([3.0, 5.0]), np.array([3.0, 4.0])) == pytest.approx(0.2)
    assert rel_err([3.0, 4.0], [0.0, 0.0]) == pytest.approx(5.0)
    assert rel_err(np.array([1.0, np.nan]), np.array([1.0, 1.0])) == math.inf
    assert rel_err(np.array([1.0, np.inf]), np.array([1.0, 1.0])) == math.inf
    assert rel_err(torch.tensor([1.0, 2.0], dtype=torch.bfloat16), [1.0, 2.0]) == 0.0
    assert rel_err(torch.tensor(1.5), 1.0) == pytest.approx(0.5)


def test_ulp_distance_known_values():
    one = np.float32(1.0)
    up = np.nextafter(one, np.float32(2))
    assert ulp_distance(np.array([one]), np.array([up]), "float32") == (1, 1)
    assert ulp_distance(np.array([-one]), np.array([np.nextafter(-one, np.float32(-2))]), "float32") == (1, 1)
    tiny = np.float32(1e-45)                                  # smallest subnormal
    assert ulp_distance(np.array([tiny, 0.0], np.float32), np.array([-tiny, -0.0], np.float32),
                        "float32") == (2, 1)
    big = np.finfo(np.float32).max
    assert ulp_distance(np.array([big]), np.array([np.inf], np.float32), "float32") == (1, 1)
    a = np.array([1.0, 2.0, np.nan, np.nan], np.float32)
    b = np.array([1.0, 2.0 + 2 * 2.0**-22, np.nan, 3.0], np.float32)
    assert ulp_distance(a, b, "float32") == (2**32 - 1, 2)
    assert ulp_distance(a[:3], b[:3], "float32") == (2, 1)
    # bfloat16: 7 mantissa bits; float16: 10.
    assert ulp_distance(torch.tensor([1.0, 4.0]), torch.tensor([1.0 + 2**-7, 4.0]), "bfloat16") == (1, 1)
    assert ulp_distance(np.array([1.0]), np.array([1.0 + 3 * 2**-10]), "float16") == (3, 1)
    import ml_dtypes
    assert ulp_distance(np.array([2.0], ml_dtypes.bfloat16), np.array([2.0 - 2**-7], ml_dtypes.bfloat16),
                        "bfloat16") == (1, 1)
    assert ulp_distance(np.zeros(0), np.zeros(0), "float16") == (0, 0)
    with pytest.raises(ValueError):
        ulp_distance(np.zeros(2), np.zeros(3), "float32")


def test_assert_close_to_reference_can_fail():
    case = Case("t", (9,), 16, 130, "float32", bias=True, seed=3)
    inp = make_inputs(case)
    ref = flce_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"])
    loss_tol, grad_tol = tolerances(torch.float32)
    near = {k: (v * (1 + 0.3 * loss_tol) if v is not None else None) for k, v in ref.items()}
    assert_close_to_reference(near, ref, "float32")
    for key, factor in [("loss", 1 + 3 * loss_tol), ("dw", 1 + 3 * grad_tol)]:
        bad = dict(ref, **{key: ref[key] * factor})
        with pytest.raises(AssertionError, match=key):
            assert_close_to_reference(bad, ref, "float32")
    with pytest.raises(AssertionError, match="db"):
        assert_close_to_reference(dict(ref, db=None), ref, "float32")
    bf = {"loss": torch.tensor(ref["loss"]).bfloat16().float(), "dx": torch.tensor(ref["dx"]).bfloat16()}
    assert_close_to_reference({"loss": ref["loss"], "dx": bf["dx"]}, ref, torch.bfloat16)
    with pytest.raises(AssertionError, match="dx"):
        assert_close_to_reference({"loss": ref["loss"], "dx": -bf["dx"]}, ref, "bfloat16")


# ----------------------------------------------------------------------------- the case generator
def test_small_cases_cover_the_spec():
    cases = small_cases()
    assert 12 <= len(cases) <= 16 and len({c.name for c in cases}) == len(cases)
    assert {c.dtype for c in cases} == {"float32", "bfloat16", "float16"}
    assert {c.reduction for c in cases} == {"mean", "sum", "none"}
    assert any(c.bias for c in cases) and any(c.class_weights for c in cases)
    assert any(c.label_smoothing for c in cases) and any(c.z_loss for c in cases)
    assert any(c.softcap for c in cases)
    assert any(c.rows == 1 for c in cases) and any(c.ignore_frac == 1.0 for c in cases)
    assert any(len(c.shape) == 2 for c in cases) and any(c.logit_scale >= 30 for c in cases)
    assert all(c.h <= 64 and c.v % 16 != 0 and c.rows <= 64 for c in cases)


def test_make_inputs():
    case = Case("gen", (4, 50), 32, 300, "bfloat16", bias=True, class_weights=True, ignore_frac=0.25,
                logit_scale=4.0, seed=7)
    a, b = make_inputs(case), make_inputs(case)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert a["x"].shape == (4, 50, 32) and a["x"].dtype == torch.bfloat16
    assert a["weight"].shape == (300, 32) and a["weight"].dtype == torch.bfloat16
    assert a["bias"].dtype == torch.bfloat16 and a["class_weights"].dtype == torch.float32
    t = a["targets"]
    assert t.shape == (4, 50) and t.dtype == torch.int64
    assert int((t == IGNORE_INDEX).sum()) == 50
    valid = t[t != IGNORE_INDEX]
    assert valid.min() >= 0 and valid.max() < 300
    cw = a["class_weights"]
    assert int((cw == 0).sum()) == 3 and cw[cw > 0].min() >= 0.5 and cw.max() <= 2.0
    std = (a["x"].float() @ a["weight"].float().T).std().item()
    assert 3.6 < std < 4.4                                     # logits ~ N(0, logit_scale²)
    assert not torch.equal(make_inputs(Case("gen", (4, 50), 32, 300, "bfloat16", seed=8))["x"], a["x"])
    none = make_inputs(Case("n", (5,), 8, 130, "float32", ignore_frac=1.0))
    assert bool((none["targets"] == IGNORE_INDEX).all()) and none["bias"] is None


def test_make_inputs_new_options():
    base = Case("opt", (40,), 16, 500, "bfloat16", bias=True, class_weights=True, seed=5)
    signed = make_inputs(Case("opt", (40,), 16, 500, "bfloat16", bias=True, class_weights=True, seed=5,
                              negative_class_weights=True, bias_dtype="float32", token_scaling=True))
    plain = make_inputs(base)
    cw = signed["class_weights"]
    assert (cw < 0).any() and cw.min() >= -1.0 and cw.max() < 2.0 and int((cw == 0).sum()) == 5
    assert torch.equal(cw == 0, plain["class_weights"] == 0)           # the same draws, another range
    assert signed["bias"].dtype == torch.float32 and plain["bias"].dtype == torch.bfloat16
    assert torch.equal(signed["bias"].bfloat16(), plain["bias"]) and torch.equal(signed["x"], plain["x"])
    assert base.options() == {"reduction": "mean", "label_smoothing": 0.0, "z_loss": 0.0, "softcap": None}
    assert Case("n", (4,), 8, 20, "float32", normalizer=(3.0, 4.0)).options()["normalizer"] == (3.0, 4.0)

"""Each kernel of each twin against a float64 reference computed here, on fresh random inputs.

The kernels: row_stats (m, z_y, first argmax, the per-slot partials S, Q, P and their pairwise sums), dlogits
(every coefficient term, softcap, temperature; torch's in-place 16-bit dZ in the float32 logits' memory, JAX's
writes into a given array), scale_rows, accumulate_bias_grad, the FLCE head (modes, cotangents, token scaling,
label smoothing, z-loss, zero and negative D, out-of-range targets), the log-prob head, the CPO pair and total
kernels, grad_scale.as_grad / kept_weight_grad and sums.pairwise_sum. Heads' gradient coefficients are checked
as gradients: the dZ they assemble against torch.autograd of the float64 loss. Shapes are odd (V not a
multiple of the 1024-column block, a single row), small (rows * V <= ~50k per call), and include huge logits.
"""

import math

import numpy as np
import pytest
import torch

from fce_core.config import ROW_PASS
from fce_core.heads import StatsSpec
from fce_core.options import CpoOptions, FlceOptions, Transform
from helpers import to_jax
from parity.measures import bitwise_equal
from parity.reference import as_float64, rel_err
from twins import quick_jit

BV = ROW_PASS.block_v
IGNORE = -100
F64 = torch.float64


# ==================================================================================== the kernels of each twin
class TorchKernels:
    name = "torch"

    def __init__(self):
        from fce_torch.kernels import cpo_pairs, dlogits, flce_head, grad_scale, logprob_head, row_stats
        from fce_torch.kernels.fastmath import ASM
        from fce_torch import sums

        self.rs, self.dl, self.fh, self.lh, self.cp, self.gs, self.sums = (row_stats, dlogits, flce_head,
                                                                          logprob_head, cpo_pairs, grad_scale, sums)
        self.asm = ASM

    @staticmethod
    def arr(a, dtype=None):
        t = torch.as_tensor(a)
        return t if dtype is None else t.to(dtype)

    @staticmethod
    def dt(name):
        return getattr(torch, name)

    def target_logits(self, z, y, bias):
        from fce_core.rows import target_logits
        from fce_torch import arrays

        return target_logits(arrays, z, y, bias)

    def row_stats(self, z, bias, r_y, cw, spec, transform):
        return self.rs.row_stats(z, bias, r_y, cw, spec=spec, transform=transform, asm=self.asm)

    def dlogits(self, z, bias, y, cw, coef, transform, dtype):
        dz = torch.full(z.shape, 7.0, dtype=dtype)
        self.dl.dlogits(z, dz, bias, y, cw, coef, transform=transform, asm=self.asm)
        return dz

    def scale_rows(self, dz, scale, dtype=None):
        if dtype is not None:
            return self.dl.scale_rows(dz, scale, out=torch.empty(dz.shape, dtype=dtype))
        out = dz.clone()
        self.dl.scale_rows(out, scale)
        return out

    def accumulate_bias_grad(self, dz, db, scale=None, rows=None):
        out = db.clone()
        self.dl.accumulate_bias_grad(dz, out, scale, rows=rows)
        return out

    def flce_head(self, stats, y, w_y, g, g_lse, scalars, opt, vocab):
        return self.fh.flce_head(stats, y, w_y, g, g_lse, scalars, opt=opt, vocab=vocab, asm=self.asm)

    def logprob_head(self, stats, y, g, h, vocab):
        return self.lh.logprob_head(stats, y, g, h, ignore_index=IGNORE, vocab=vocab, asm=self.asm)

    def pairs(self, sums, counts, y, scalars, opt):
        return self.cp.pairs(sums, counts, y, scalars, opt)

    def total(self, pair_sum, nll_sum, scalars, alpha):
        return self.cp.total(pair_sum, nll_sum, scalars, alpha)

    def as_grad(self, grad, dtype, g=None):
        return self.gs.as_grad(grad, dtype, g)

    def kept_weight_grad(self, dw, dtype):
        return self.gs.kept_weight_grad(dw, dtype)

    def pairwise_sum(self, x):
        return self.sums.pairwise_sum(x)


class JaxKernels(TorchKernels):
    """The Pallas kernels, each call under its own jax.jit (`twins.quick_jit`: one quick compilation per call,
    as an eager call would compile its interpret-mode program)."""

    name = "jax"

    def __init__(self):
        from fce_jax import sums
        from fce_jax.kernels import cpo_pairs, dlogits, flce_head, grad_scale, logprob_head, row_stats

        self.rs, self.dl, self.fh, self.lh, self.cp, self.gs, self.sums = (row_stats, dlogits, flce_head,
                                                                          logprob_head, cpo_pairs, grad_scale, sums)

    @staticmethod
    def arr(a, dtype=None):
        import jax.numpy as jnp

        a = to_jax(a) if isinstance(a, torch.Tensor) else jnp.asarray(a)
        return a if dtype is None else a.astype(dtype)

    @staticmethod
    def dt(name):
        import jax.numpy as jnp

        return getattr(jnp, name)

    def row_stats(self, z, bias, r_y, cw, spec, transform):
        return quick_jit(lambda *a: self.rs.row_stats(*a, spec=spec, transform=transform))(z, bias, r_y, cw)

    def dlogits(self, z, bias, y, cw, coef, transform, dtype):
        return quick_jit(lambda *a: self.dl.dlogits(*a, transform=transform, dtype=dtype))(z, bias, y, cw, coef)

    def dlogits_into(self, z, bias, y, cw, coef, transform, dtype, into, row0):
        return quick_jit(lambda *a, into: self.dl.dlogits(*a, transform=transform, dtype=dtype, into=into,
                                                          row0=row0))(z, bias, y, cw, coef, into=into)

    def scale_rows(self, dz, scale, dtype=None):
        return quick_jit(lambda d, s: self.dl.scale_rows(d, s, dtype))(dz, scale)

    def accumulate_bias_grad(self, dz, db, scale=None, rows=None):
        return quick_jit(lambda d, b, s: self.dl.accumulate_bias_grad(d, b, s, rows=rows))(dz, db, scale)

    def flce_head(self, stats, y, w_y, g, g_lse, scalars, opt, vocab):
        return quick_jit(lambda *a: self.fh.flce_head(*a, opt=opt, vocab=vocab))(stats, y, w_y, g, g_lse, scalars)

    def logprob_head(self, stats, y, g, h, vocab):
        return quick_jit(lambda *a: self.lh.logprob_head(*a, ignore_index=IGNORE, vocab=vocab))(stats, y, g, h)

    def target_logits(self, z, y, bias):
        from fce_core.rows import target_logits
        from fce_jax import arrays

        return quick_jit(lambda *a: target_logits(arrays, *a))(z, y, bias)

    def pairwise_sum(self, x):
        return quick_jit(self.sums.pairwise_sum)(x)

    def pairs(self, sums, counts, y, scalars, opt):
        return quick_jit(lambda *a: self.cp.pairs(*a, opt))(sums, counts, y, scalars)

    def total(self, pair_sum, nll_sum, scalars, alpha):
        return quick_jit(lambda *a: self.cp.total(*a, alpha))(pair_sum, nll_sum, scalars)


KERNELS = [TorchKernels(), JaxKernels()]
each_twin = pytest.mark.parametrize("k", KERNELS, ids=[k.name for k in KERNELS])


def f64(a):
    return torch.from_numpy(as_float64(a))


def _raw64(z, bias):
    """r = z + b as the kernels form it (one float32 addition: the engine's logits are float32), in float64."""
    return f64(z if bias is None else z.float() + bias.float())


def _transform64(r, softcap=None, temperature=1.0):
    z = r if softcap is None else softcap * torch.tanh(r / softcap)
    return z / temperature


def _rand(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _assert_rel(a, ref, tol, what):
    err = rel_err(a, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


# ==================================================================================== row_stats
ROW_STATS = {  # id: (rows, V, logit scale, bias, softcap, temperature, class weights, q, pz)
    "plain_1_block": (13, 777, 1.0, False, None, 1.0, False, False, False),
    "bias_q_pz_3_blocks": (17, 2500, 3.0, True, None, 1.0, False, True, True),
    "weighted_q_softcap": (9, 1500, 20.0, False, 5.0, 1.0, True, True, False),
    "temperature_pz_softcap": (11, 2100, 4.0, True, 30.0, 0.6, False, False, True),
    "single_row_huge": (1, 3000, 1e4, True, None, 1.0, True, True, True),
}


def _row_stats_reference(z, bias, y, cw, softcap, temperature):
    """float64: the transformed logits, m, z_y, first argmax, and the per-slot sums S, Q, P ([n, BV])."""
    zt = _transform64(_raw64(z, bias), softcap, temperature)
    n, v = zt.shape
    m = zt.max(dim=1).values
    zy = zt.gather(1, torch.from_numpy(np.asarray(y, np.int64))[:, None])[:, 0]
    e = torch.exp(zt - m[:, None])
    w = torch.ones(v, dtype=F64) if cw is None else f64(cw)
    cols = torch.arange(v) % BV
    slot = lambda t: torch.zeros(n, BV, dtype=F64).index_add_(1, cols, t)  # noqa: E731
    return {"z": zt, "m": m, "zy": zy, "amax": torch.from_numpy(np.argmax(zt.numpy(), axis=1)),
            "s": slot(e), "q": slot(w * (zt - zy[:, None])), "q_scale": slot(w.abs() * (zt.abs() + zy.abs()[:, None])),
            "pz": slot(e * (zt - m[:, None]))}


def _row_stats_inputs(n, v, scale, has_bias, has_cw, seed):
    z = _rand((n, v), seed, scale)
    # the max moves to a later block on the first rows (rescaling), stays in block 0 on others
    z[0, v - 3] = z[0].max() + 1.0
    if n > 2:
        z[2, 4] = z[2].max() + 1.0
    bias = _rand((v,), seed + 1, 0.1 * scale) if has_bias else None
    cw = (torch.rand(v, generator=torch.Generator().manual_seed(seed + 2)) * 3 - 1) if has_cw else None
    y = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed + 3))
    return z, bias, cw, y


@each_twin
@pytest.mark.parametrize("cfg", list(ROW_STATS))
def test_row_stats(k, cfg):
    n, v, scale, has_bias, cap, temp, has_cw, q, pz = ROW_STATS[cfg]
    z, bias, cw, y = _row_stats_inputs(n, v, scale, has_bias, has_cw, seed=len(cfg) + n)
    ref = _row_stats_reference(z, bias, y.numpy(), cw, cap, temp)
    kz, kb, kcw, ky = k.arr(z), None if bias is None else k.arr(bias), None if cw is None else k.arr(cw), k.arr(y)
    r_y = k.target_logits(kz, ky, kb)
    _assert_rel(r_y, _raw64(z, bias).gather(1, y[:, None])[:, 0], 1e-7, "r_y")
    out = k.row_stats(kz, kb, r_y, kcw, StatsSpec(q=q, pz=pz), Transform(softcap=cap, temperature=temp))
    assert set(out) == {"m", "zy", "amax", "s"} | ({"q"} if q else set()) | ({"pz"} if pz else set())
    for key in ("s", "q", "pz"):
        if key in out:
            assert tuple(out[key].shape) == (n, BV) and k.dt("float32") == out[key].dtype, key
    _assert_rel(out["m"], ref["m"], 1e-6, "m")
    _assert_rel(out["zy"], ref["zy"], 1e-6, "zy")
    got = torch.from_numpy(as_float64(out["amax"]).astype(np.int64))
    tie = ref["z"].gather(1, got[:, None])[:, 0] >= ref["m"] - 1e-6 * ref["m"].abs()   # a float32 tie
    assert torch.all((got == ref["amax"]) | tie), (got, ref["amax"])
    if cap is None:
        assert torch.equal(got, ref["amax"])
    _assert_rel(out["s"], ref["s"], 1e-5, "S partials")
    _assert_rel(k.pairwise_sum(out["s"]), ref["s"].sum(1), 1e-6, "s")
    if q:   # differences of float32 logits, of both signs: bounded by their operands' magnitudes
        err = np.abs(as_float64(out["q"]) - ref["q"].numpy())
        assert np.all(err <= 2e-6 * ref["q_scale"].numpy()), (err / ref["q_scale"].numpy()).max()
    if pz:   # terms below float32's range (huge logits) flush to 0: measured against the scale of S too
        err = np.linalg.norm(as_float64(out["pz"]) - ref["pz"].numpy())
        assert err <= 1e-5 * max(np.linalg.norm(ref["pz"].numpy()), np.linalg.norm(ref["s"].numpy())), err


@each_twin
def test_row_stats_first_argmax_of_ties(k):
    """Equal maxima within a block and across blocks: the lowest column wins."""
    z = _rand((4, 2100), 5)
    top = float(z.max()) + 2.0
    for row, cols in enumerate([(5, 7), (5, 1500), (1030, 2100 - 1), (2000, 1024, 3)]):
        z[row, list(cols)] = top
    out = k.row_stats(k.arr(z), None, k.arr(z[:, 0].clone()), None, StatsSpec(), Transform())
    assert as_float64(out["amax"]).tolist() == [5, 5, 1030, 3]


# ==================================================================================== dlogits
DLOGITS = {  # id: (rows, V, logit scale, bias, softcap, temperature, class weights, entropy, dZ dtype)
    "plain_f32": (13, 777, 2.0, False, None, 1.0, False, False, "float32"),
    "weighted_bias_bf16": (9, 2500, 3.0, True, None, 1.0, True, False, "bfloat16"),
    "softcap_entropy_f32": (11, 1500, 20.0, True, 5.0, 1.0, False, True, "float32"),
    "temperature_entropy_cw_f16": (7, 2100, 4.0, False, 30.0, 0.7, True, True, "float16"),
    "single_row_huge_f32": (1, 3000, 1e3, True, None, 1.0, False, False, "float32"),
}
TOL16 = {"float32": 1e-5, "bfloat16": 4e-3, "float16": 1e-3}


def _dlogits_case(n, v, scale, has_bias, cap, temp, has_cw, entropy, seed):
    z = _rand((n, v), seed, scale)
    bias = _rand((v,), seed + 1, 0.1 * scale) if has_bias else None
    cw = (torch.rand(v, generator=torch.Generator().manual_seed(seed + 2)) * 3 - 1) if has_cw else None
    y = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed + 3))
    if n > 2:
        y[1] = IGNORE
    zt = _transform64(_raw64(z, bias), cap, temp)
    lse = torch.logsumexp(zt, 1)
    g = torch.Generator().manual_seed(seed + 4)
    coef = {"lse": lse.float(), "a": torch.randn(n, generator=g), "b": torch.randn(n, generator=g),
            "c": torch.randn(n, generator=g) * 1e-3}
    if entropy:
        coef["d"] = torch.randn(n, generator=g)
        coef["mu"] = ((torch.softmax(zt, 1) * zt).sum(1)).float()
    # float64 reference from the float32 coefficients
    p = torch.exp(zt - f64(coef["lse"])[:, None])
    onehot = torch.zeros(n, v, dtype=F64)
    ok = y != IGNORE
    onehot[ok.nonzero()[:, 0], y[ok]] = 1.0
    w = torch.ones(v, dtype=F64) if cw is None else f64(cw)
    dz = f64(coef["a"])[:, None] * p + f64(coef["b"])[:, None] * onehot + f64(coef["c"])[:, None] * w
    if entropy:
        dz = dz + f64(coef["d"])[:, None] * p * (zt - f64(coef["mu"])[:, None])
    if cap is not None:
        t = torch.tanh(_raw64(z, bias) / cap)
        dz = dz * (1 - t * t)
    return z, bias, cw, y, coef, dz / temp


@each_twin
@pytest.mark.parametrize("cfg", list(DLOGITS))
def test_dlogits(k, cfg):
    n, v, scale, has_bias, cap, temp, has_cw, entropy, dtype = DLOGITS[cfg]
    z, bias, cw, y, coef, ref = _dlogits_case(n, v, scale, has_bias, cap, temp, has_cw, entropy, seed=n + v)
    tr = Transform(softcap=cap, temperature=temp)
    out = k.dlogits(k.arr(z), None if bias is None else k.arr(bias), k.arr(y), None if cw is None else k.arr(cw),
                    {key: k.arr(c) for key, c in coef.items()}, tr, k.dt(dtype))
    assert out.dtype == k.dt(dtype) and tuple(out.shape) == (n, v)
    _assert_rel(out, ref, TOL16[dtype], "dZ")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dlogits_torch_in_place(dtype):
    """torch writes a 16-bit dZ into the first half of each float32 logits row (the view fce_torch's engine
    uses; float32 dZ overwrites the logits): the same bits as a separate dZ buffer, and the reference."""
    kt = KERNELS[0]
    n, v = 9, 2500
    z, bias, cw, y, coef, ref = _dlogits_case(n, v, 3.0, True, 5.0, 1.0, True, True, seed=77)
    tr = Transform(softcap=5.0)
    separate = kt.dlogits(z, bias, y, cw, coef, tr, getattr(torch, dtype))
    logits = z.clone()
    dz = logits if dtype == "float32" else logits.view(getattr(torch, dtype))[:, :v]
    assert dz.data_ptr() == logits.data_ptr() and dz.stride(0) == (v if dtype == "float32" else 2 * v)
    kt.dl.dlogits(logits, dz, bias, y, cw, coef, transform=tr, asm=kt.asm)
    assert bitwise_equal(dz, separate)
    _assert_rel(dz, ref, TOL16[dtype], "in-place dZ")


def test_dlogits_jax_into_rows():
    """JAX writes a chunk's dZ as rows [row0, row0 + n) of a given [N, V] array, leaving the other rows."""
    import jax.numpy as jnp

    kj = KERNELS[1]
    n, v, total, row0 = 5, 1500, 12, 4
    z, bias, cw, y, coef, ref = _dlogits_case(n, v, 2.0, True, None, 1.0, False, False, seed=78)
    into = jnp.full((total, v), 3.0, jnp.bfloat16)
    out = kj.dlogits_into(kj.arr(z), kj.arr(bias), kj.arr(y), None, {c: kj.arr(t) for c, t in coef.items()},
                          Transform(), jnp.bfloat16, into, row0)
    out = as_float64(out)
    assert out.shape == (total, v)
    assert np.all(out[:row0] == 3.0) and np.all(out[row0 + n:] == 3.0)
    _assert_rel(out[row0:row0 + n], ref, TOL16["bfloat16"], "dZ rows")


# ==================================================================================== scale_rows, bias grad
@each_twin
@pytest.mark.parametrize("dtype, out_dtype", [("float32", None), ("bfloat16", None), ("float32", "bfloat16")])
def test_scale_rows(k, dtype, out_dtype):
    """dz * scale row by row, rounded once: exactly float32(dz) * scale (IEEE float32 product) rounded to
    nearest even in dz's dtype, or into another dtype (a float32 dX block to the input dtype)."""
    n, v = 13, 2100
    dz = _rand((n, v), 80).to(getattr(torch, dtype))
    scale = _rand((n,), 81, 10.0)
    scale[3] = 0.0
    out_dtype = out_dtype or dtype
    want = (dz.float() * scale[:, None]).to(getattr(torch, out_dtype))
    out = k.scale_rows(k.arr(dz), k.arr(scale), None if out_dtype == dtype else k.dt(out_dtype))
    assert out.dtype == k.dt(out_dtype)
    assert np.array_equal(as_float64(out), as_float64(want))
    _assert_rel(out, f64(dz) * f64(scale)[:, None], 1e-7 if out_dtype == "float32" else 4e-3, "scaled")


@pytest.mark.parametrize("start", [0, 5, 12, 13, 40])
def test_zero_rows_from(start):
    """fce_jax's zero_rows_from (the kept dZ rows of chunks that did not run): rows from `start` on are 0, the
    rows before it keep their bits (NaN and inf too), whether start is a constant or traced."""
    import jax
    import jax.numpy as jnp

    from fce_jax.kernels.dlogits import zero_rows_from
    dz = _rand((13, 2100), 84).to(torch.bfloat16)
    dz[1, 7], dz[2, 8] = float("nan"), float("inf")
    want = dz.clone()
    want[start:] = 0.0
    for run in (jax.jit(lambda d: zero_rows_from(d, start)), lambda d: jax.jit(zero_rows_from)(d, start)):
        out = run(to_jax(dz))
        assert np.array_equal(np.asarray(out.astype(jnp.float32)).view(np.uint32),
                              want.float().numpy().view(np.uint32))


@each_twin
@pytest.mark.parametrize("dtype, scaled, rows", [("float32", False, None), ("bfloat16", False, None),
                                                 ("bfloat16", True, 11)])
def test_accumulate_bias_grad(k, dtype, scaled, rows):
    """db + the column sums of dz (its first `rows` rows, each times its scale), rows added in order into the
    float32 accumulator: exactly the sequential float32 sum of the float32 products, and the float64 one within
    rounding. The rows past `rows` are NaN: never read."""
    n, v = 17, 1500
    dz = _rand((n, v), 82).to(getattr(torch, dtype))
    db = _rand((v,), 83)
    scale = _rand((n,), 85, 3.0) if scaled else torch.ones(n)
    used = n if rows is None else rows
    dz[used:] = float("nan")
    want = db.clone()
    for i in range(used):
        want = want + dz[i].float() * scale[i]
    out = k.accumulate_bias_grad(k.arr(dz), k.arr(db), k.arr(scale) if scaled else None, rows)
    assert out.dtype == k.dt("float32")
    assert np.array_equal(as_float64(out), as_float64(want))
    _assert_rel(out, f64(db) + (f64(dz[:used]) * f64(scale[:used])[:, None]).sum(0), 1e-6, "db")


# ==================================================================================== the FLCE head
def _head_stats(n, v, seed, scale=2.0, cw=None):
    """float32 row statistics of random float64 logits z [n, V] (as the engine hands them to a head) and z."""
    z = _rand((n, v), seed, scale).double()
    y = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed + 1))
    m = z.max(1).values
    w = torch.ones(v, dtype=F64) if cw is None else cw.double()
    zy = z.gather(1, y[:, None])[:, 0]
    stats = {"m": m, "s": torch.exp(z - m[:, None]).sum(1), "zy": zy, "amax": z.argmax(1),
             "q": (w * (z - zy[:, None])).sum(1), "pz": (torch.exp(z - m[:, None]) * (z - m[:, None])).sum(1)}
    return z, y, {key: (t.to(torch.int32) if key == "amax" else t.float()) for key, t in stats.items()}


HEAD_CASES = {  # id: (mode, label smoothing, z-loss, class weights, g, g_lse, token scaling, D override)
    "mean_plain": ("mean", 0.0, 0.0, False, False, False, False, None),
    "mean_all_terms": ("mean", 0.1, 1e-2, True, False, False, False, None),
    "mean_token_scaling_zero_D": ("mean", 0.0, 1e-2, True, False, False, True, 0.0),
    "mean_negative_D_g_lse": ("mean", 0.2, 0.0, True, False, True, False, -7.5),
    "sum_token_scaling": ("sum", 0.1, 1e-3, False, False, False, True, None),
    "none_g_lse_smoothing": ("none", 0.3, 1e-3, True, True, True, False, None),
}


@each_twin
@pytest.mark.parametrize("cfg", list(HEAD_CASES))
def test_flce_head(k, cfg):
    """Per-row loss, zrow, lse, correct, and the coefficients a, b, c as a gradient: a p + b [c == y] + c w_c
    equals d/dz of the float64 row loss (CE/D + Z/n or the sums, times g, times the stop-gradient p(y) with
    token scaling) plus g_lse * d lse/dz. Ignored rows give 0 (lse stays); an out-of-range target gives NaN."""
    mode, eps, zl, weighted, has_g, has_glse, ts, d_override = HEAD_CASES[cfg]
    n, v = 23, 1300
    cw = (torch.rand(v, generator=torch.Generator().manual_seed(90)) * 3 - 1) if weighted else None
    z, y, stats = _head_stats(n, v, 91, cw=cw)
    y[[2, 9]] = IGNORE
    y[13] = v                        # out of range (only reachable unchecked): NaN, never a wrong number
    valid = (y != IGNORE) & (y != v)
    gen = torch.Generator().manual_seed(92)
    g = torch.randn(n, generator=gen) if has_g else None
    g_lse = torch.randn(n, generator=gen) if has_glse else None
    y_safe = torch.where(valid, y, 0)
    w_y = None if cw is None else torch.where(y != IGNORE, cw[torch.where((y >= 0) & (y < v), y, 0)], 0.0)
    w64 = torch.ones(v, dtype=F64) if cw is None else cw.double()
    d = float(w64[y_safe][valid].sum()) if d_override is None else d_override
    n_valid = float(valid.sum() + 1)   # the out-of-range row counts as valid (not ignore_index)
    scalars = torch.tensor([d, n_valid, float(w64.sum())], dtype=torch.float32)
    opt = FlceOptions(ignore_index=IGNORE, reduction=mode, label_smoothing=eps, z_loss=zl, token_scaling=ts)
    kstats = {key: k.arr(t) for key, t in stats.items() if key != "pz" and (key != "q" or eps > 0)}
    out = k.flce_head(kstats, k.arr(y.to(torch.int32)), None if w_y is None else k.arr(w_y.float()),
                      None if g is None else k.arr(g), None if g_lse is None else k.arr(g_lse), k.arr(scalars),
                      opt, v)
    out = {key: as_float64(t) for key, t in out.items()}

    # float64 reference on the valid rows, from z
    zv = z[valid].clone().requires_grad_(True)
    yv = y[valid]
    lse = torch.logsumexp(zv, 1)
    zyv = zv.gather(1, yv[:, None])[:, 0]
    ce = (1 - eps) * w64[yv] * (lse - zyv) + (eps / v) * ((lse[:, None] - zv) * w64).sum(1)
    zrow = zl * lse * lse
    rho = (1.0 / d if d != 0 else 0.0) if mode == "mean" else 1.0
    rho_z = (1.0 / n_valid) if mode == "mean" else 1.0
    scale = torch.ones(len(yv), dtype=F64)
    if g is not None:
        scale = scale * g[valid].double()
    if ts:
        scale = scale * torch.exp(zyv - lse).detach()
    loss = (rho * ce + rho_z * zrow) * scale
    total = loss.sum() + ((g_lse[valid].double() * lse).sum() if g_lse is not None else 0.0)
    (dz_ref,) = torch.autograd.grad(total, zv)
    p = torch.softmax(zv.detach(), 1)
    onehot = torch.nn.functional.one_hot(yv, v).double()
    dz = (torch.from_numpy(out["a"])[valid][:, None] * p + torch.from_numpy(out["b"])[valid][:, None] * onehot
          + torch.from_numpy(out["c"])[valid][:, None] * w64)
    _assert_rel(dz, dz_ref, 1e-5, "dZ from a, b, c")
    _assert_rel(out["loss"][valid.numpy()], loss.detach(), 1e-6, "loss")
    _assert_rel(out["zrow"][valid.numpy()], (rho_z * zrow * scale).detach(), 1e-6, "zrow")
    _assert_rel(out["lse"], torch.logsumexp(z, 1), 1e-6, "lse")
    assert np.array_equal(out["correct"], ((stats["amax"] == y) & valid).double().numpy())
    ign = (y == IGNORE).numpy()
    for key in ("loss", "zrow", "correct", "a", "b", "c"):
        assert np.all(out[key][ign] == 0), key
    assert np.isnan(out["loss"][13]) and np.isnan(out["a"][13])


# ==================================================================================== the log-prob head
@each_twin
@pytest.mark.parametrize("entropy,cotangents", [(True, "both"), (True, "entropy_only"), (False, "logp")])
def test_logprob_head(k, entropy, cotangents):
    """logp = z_y - lse, entropy = lse - E[z], mu = E[z], and a, b, d as a gradient: a p + b [c == y] +
    d p (z - mu) equals d/dz of g logp + h entropy (c = 0). Ignored rows give 0; an out-of-range target NaN."""
    n, v = 19, 2200
    z, y, stats = _head_stats(n, v, 95, scale=4.0)
    y[[0, 7]] = IGNORE
    y[11] = -3
    valid = (y != IGNORE) & (y >= 0)
    gen = torch.Generator().manual_seed(96)
    g = torch.randn(n, generator=gen) if cotangents != "entropy_only" else None
    h = torch.randn(n, generator=gen) if cotangents != "logp" else None
    kstats = {key: k.arr(t) for key, t in stats.items() if key not in ("q",) and (key != "pz" or entropy)}
    out = k.logprob_head(kstats, k.arr(y.to(torch.int32)), None if g is None else k.arr(g),
                         None if h is None else k.arr(h), v)
    assert set(out) == {"lse", "logp", "entropy", "a", "b", "c"} | ({"d", "mu"} if entropy else set())
    out = {key: as_float64(t) for key, t in out.items()}
    zv = z[valid].clone().requires_grad_(True)
    lse = torch.logsumexp(zv, 1)
    p = torch.softmax(zv, 1)
    logp = zv.gather(1, y[valid][:, None])[:, 0] - lse
    ent = lse - (p * zv).sum(1)
    total = 0.0
    if g is not None:
        total = total + (g[valid].double() * logp).sum()
    if h is not None and entropy:
        total = total + (h[valid].double() * ent).sum()
    (dz_ref,) = torch.autograd.grad(total, zv)
    vm = valid.numpy()
    _assert_rel(out["logp"][vm], logp.detach(), 1e-6, "logp")
    _assert_rel(out["lse"], torch.logsumexp(z, 1), 1e-6, "lse")
    pd = p.detach()
    coef = {key: torch.from_numpy(out[key])[valid][:, None] for key in ("a", "b", "d", "mu") if key in out}
    dz = coef["a"] * pd + coef["b"] * torch.nn.functional.one_hot(y[valid], v).double()
    if entropy:
        _assert_rel(out["entropy"][vm], ent.detach(), 1e-5, "entropy")
        _assert_rel(out["mu"], (torch.softmax(z, 1) * z).sum(1), 1e-6, "mu")
        dz = dz + coef["d"] * pd * (zv.detach() - coef["mu"])
        assert np.all(out["d"][~vm & (y.numpy() != -3)] == 0)
    else:
        assert np.all(out["entropy"] == 0)
    _assert_rel(dz, dz_ref, 1e-5, "dZ from a, b, d")
    assert np.all(out["c"] == 0)
    ign = (y == IGNORE).numpy()
    for key in ("logp", "entropy", "a", "b"):
        assert np.all(out[key][ign] == 0), key
    assert np.isnan(out["logp"][11]) and np.isnan(out["a"][11])


# ==================================================================================== CPO pairs and total
def _cpo_reference(sums, counts, valid, opt, n_chosen):
    """float64 pair outputs and the dZ scale of every token (d loss / d L1_t) by autograd over the sums."""
    s = sums.double().clone().requires_grad_(True)
    c = counts.double()
    b = s.shape[0] // 2
    if opt.average_log_prob:
        logp = torch.where(c > 0, -s / c.clamp(min=1.0), torch.zeros_like(s))
    else:
        logp = -s
    delta = logp[:b] - logp[b:]
    if opt.loss_type == "simpo":
        delta = delta - opt.simpo_gamma / opt.beta
    u = opt.beta * delta
    eps = opt.label_smoothing
    if opt.loss_type in ("sigmoid", "simpo"):
        loss = -(1 - eps) * torch.nn.functional.logsigmoid(u) - eps * torch.nn.functional.logsigmoid(-u)
    elif opt.loss_type == "hinge":
        loss = torch.relu(1 - u)
    else:
        loss = (delta - 1 / (2 * opt.beta)) ** 2
    pair_loss = loss / b
    (grad,) = torch.autograd.grad(pair_loss.sum(), s)
    t = opt.seq_len
    kappa = opt.alpha / n_chosen if n_chosen > 0 else 0.0
    per_seq = grad[:, None].expand(2 * b, t).clone()
    per_seq[:b] += kappa
    scale = torch.where(valid.view(2 * b, t), per_seq, torch.zeros_like(per_seq)).reshape(-1)
    return {"pair_loss": pair_loss.detach(), "logp": logp.detach(), "reward": opt.beta * logp.detach(), "scale": scale}


@each_twin
@pytest.mark.parametrize("loss_type,average,eps", [("sigmoid", False, 0.0), ("sigmoid", True, 0.2),
                                                   ("hinge", False, 0.0), ("ipo", True, 0.0),
                                                   ("simpo", True, 0.1), ("simpo", False, 0.0)])
def test_cpo_pairs(k, loss_type, average, eps):
    """Each loss type, with and without average_log_prob: the pairs' losses (/ B), log-probs, rewards and the
    scale of every token's dZ (0 on ignored tokens), against autograd of the float64 loss; 20 pairs (two
    programs of 16), T = 300 (two steps of 256), a sequence without valid tokens."""
    n_pairs, t, v = 20, 300, 1000
    gen = torch.Generator().manual_seed(97)
    y = torch.randint(0, v, (2 * n_pairs, t), generator=gen)
    y[:, :40] = IGNORE
    y[3, 100:] = IGNORE
    y[n_pairs + 5] = IGNORE              # a rejected sequence without valid tokens
    valid = y != IGNORE
    counts = valid.sum(1).float()
    sums = torch.rand(2 * n_pairs, generator=gen) * counts * 3.0        # sum of L1 >= 0
    n_chosen = float(valid[:n_pairs].sum())
    opt = CpoOptions(seq_len=t, ignore_index=IGNORE, beta=0.3, alpha=0.7, label_smoothing=eps,
                     loss_type=loss_type, simpo_gamma=0.8, average_log_prob=average)
    scalars = torch.tensor([n_pairs, n_chosen, v], dtype=torch.float32)
    out = k.pairs(k.arr(sums), k.arr(counts), k.arr(y.reshape(-1).to(torch.int32)), k.arr(scalars), opt)
    ref = _cpo_reference(sums, counts, valid, opt, n_chosen)
    for key in ("pair_loss", "logp", "reward"):
        _assert_rel(out[key], ref[key], 1e-6, key)
    _assert_rel(out["scale"], ref["scale"], 1e-6, "scale")
    assert np.all(as_float64(out["scale"])[~valid.reshape(-1).numpy()] == 0)
    if average:
        assert as_float64(out["logp"])[n_pairs + 5] == 0.0


@each_twin
@pytest.mark.parametrize("n_chosen", [37.0, 0.0])
def test_cpo_total(k, n_chosen):
    """loss = pairs' sum + alpha * nll_sum / n_chosen, nll = nll_sum / n_chosen; both 0-safe without chosen
    tokens."""
    pair_sum, nll_sum, alpha = 0.8125, 91.5, 0.7
    scalars = torch.tensor([4.0, n_chosen, 1000.0])
    loss, nll = k.total(k.arr(torch.tensor(pair_sum)), k.arr(torch.tensor(nll_sum)), k.arr(scalars), alpha)
    want_nll = nll_sum / n_chosen if n_chosen else 0.0
    assert float(nll) == pytest.approx(want_nll, rel=1e-6)
    assert float(loss) == pytest.approx(pair_sum + alpha * want_nll, rel=1e-6)
    assert tuple(loss.shape) == tuple(nll.shape) == ()


# ==================================================================================== grad_scale, pairwise sums
@each_twin
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_as_grad(k, dtype):
    """dtype(float32(grad) * g): exactly the IEEE float32 product rounded to nearest even; without g the
    rounding alone; the input is left as it was (a second backward starts from the same values)."""
    grad = _rand((37, 130), 98)
    grad[0, :3] = torch.tensor([1e-30, -0.0, 3e4])
    g = torch.tensor(2.5)
    src = k.arr(grad)
    before = as_float64(src).copy()
    out = k.as_grad(src, k.dt(dtype), k.arr(g))
    assert out.dtype == k.dt(dtype) and tuple(out.shape) == (37, 130)
    assert np.array_equal(as_float64(out), as_float64((grad * g).to(getattr(torch, dtype))))
    assert np.array_equal(as_float64(src), before)
    plain = k.as_grad(src, k.dt(dtype))
    assert np.array_equal(as_float64(plain), as_float64(grad.to(getattr(torch, dtype))))
    assert k.as_grad(None, k.dt(dtype)) is None
    empty = k.as_grad(k.arr(torch.zeros(0, 5)), k.dt(dtype), k.arr(g))
    assert tuple(empty.shape) == (0, 5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("g", [2.5, 1.0, 0.0])
def test_scale_in_place(dtype, g):
    """torch's in-place form (the last backward's): the bits of as_grad into the same buffers, for up to three
    tensors of different dtypes and sizes in one launch (dX, dW, db), also with programs looping over several
    blocks; g = 1 leaves every bit as it was (the kernel skips its pass on the device)."""
    from fce_core.config import GRAD_SCALE, BlockConfig
    from fce_torch.kernels.grad_scale import as_grad, scale_in_place
    for cfg in (GRAD_SCALE, BlockConfig(block=64, max_programs=3)):
        grad = _rand((37, 130), 99).to(getattr(torch, dtype))
        grad[0, :3] = torch.tensor([1e-30, -0.0, 3e4])
        others = [_rand((5, 9), 7).to(torch.bfloat16), _rand((300,), 8)]
        for grads in ([grad.clone()], [grad.clone(), *others], [torch.zeros(0, 3), grad.clone()]):
            want = [as_grad(t, t.dtype, torch.tensor(g)) for t in grads]
            ptrs = [t.data_ptr() for t in grads]
            out = scale_in_place(grads, torch.tensor(g), cfg)
            assert out is grads and [t.data_ptr() for t in out] == ptrs
            assert all(np.array_equal(as_float64(a), as_float64(b)) for a, b in zip(out, want))
    assert scale_in_place([torch.zeros(0, 5)], torch.tensor(g))[0].shape == (0, 5)
    with pytest.raises(ValueError, match="at most 3"):
        scale_in_place([torch.zeros(2)] * 4, torch.tensor(g))


@each_twin
def test_kept_weight_grad(k):
    """A float32 dW accumulator of a bfloat16 weight is rounded to bfloat16 (to nearest even); of a float16 or
    float32 weight it stays float32; a dW already in the weight's dtype stays."""
    dw = _rand((13, 8), 99)
    out = k.kept_weight_grad(k.arr(dw), k.dt("bfloat16"))
    assert out.dtype == k.dt("bfloat16")
    assert np.array_equal(as_float64(out), as_float64(dw.bfloat16()))
    for name in ("float16", "float32"):
        kept = k.kept_weight_grad(k.arr(dw), k.dt(name))
        assert kept.dtype == k.dt("float32") and np.array_equal(as_float64(kept), dw.numpy())
    same = k.kept_weight_grad(k.arr(dw.bfloat16()), k.dt("bfloat16"))
    assert same.dtype == k.dt("bfloat16")
    assert k.kept_weight_grad(None, k.dt("bfloat16")) is None


def _tree_sum(x):
    """The fixed pairwise tree in float32 numpy: zero-padded to a power of two, x[0::2] + x[1::2]."""
    x = np.asarray(x, np.float32)
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    x = np.concatenate([x, np.zeros((*x.shape[:-1], width - n), np.float32)], axis=-1)
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


@pytest.mark.parametrize("shape", [(1,), (5,), (3, 37), (2, 3, 300), (4, 64)], ids=str)
def test_pairwise_sum_levels(shape):
    """fce_torch's pairwise kernel over several levels (4 columns a level here), on a strided view (the dX
    planes' permutation) and on negative zeros, and the slicing form traced under torch.compile: the tree's
    bits exactly."""
    from fce_core.config import PairwiseConfig
    from fce_torch.sums import pairwise_sum, sliced_sum
    cfg = PairwiseConfig(block_cols=4, block=16)
    x = _rand(shape, 101) * torch.logspace(-3, 3, shape[-1])
    assert np.array_equal(pairwise_sum(x, cfg).numpy(), _tree_sum(x.numpy()))
    assert np.array_equal(sliced_sum(x).numpy(), _tree_sum(x.numpy()))    # the form torch.compile traces
    planes = _rand((shape[-1], 3, 5), 102)
    view = planes.permute(1, 2, 0)
    assert np.array_equal(pairwise_sum(view, cfg).numpy(), _tree_sum(view.numpy()))
    zeros = -torch.zeros(shape)
    assert np.array_equal(pairwise_sum(zeros, cfg).numpy().view(np.uint32), _tree_sum(zeros.numpy()).view(np.uint32))
    with pytest.raises(TypeError, match="floating"):
        pairwise_sum(torch.ones(shape, dtype=torch.int32))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("shape", [(3, 1), (3, 5), (2, 3, 300), (4, 0)], ids=str)
def test_pairwise_sum_into_out(shape, dtype):
    """fce_torch's pairwise sum written into a given tensor (the dX slices summed straight into the 16-bit dX):
    the float32 tree's sum rounded once to nearest even in out's dtype, over one column, one level and several
    (4 columns a level), and zeros for no columns; an out of another shape is refused."""
    from fce_core.config import PairwiseConfig
    from fce_torch.sums import pairwise_sum
    dt = getattr(torch, dtype)
    x = _rand(shape, 103) * torch.logspace(-3, 3, shape[-1]) if shape[-1] else torch.zeros(shape)
    planes = x.movedim(-1, 0).contiguous()
    for cfg in (None, PairwiseConfig(block_cols=4, block=16)):
        out = torch.full(shape[:-1], 7.0, dtype=dt)
        assert pairwise_sum(planes.movedim(0, -1), cfg, out=out) is out
        assert torch.equal(out, torch.from_numpy(_tree_sum(x.numpy())).to(dt))
    with pytest.raises(ValueError, match="shape"):
        pairwise_sum(x, out=torch.empty(shape[:-1] + (2,), dtype=dt))


@pytest.mark.parametrize("shape", [(1,), (7,), (1024,), (3, 1000), (2, 3, 37), (4, 0)], ids=str)
def test_pairwise_sum(shape):
    """Sum over the last axis: exactly the fixed pairwise tree (so both twins give the same bits), within
    float32 rounding of the float64 sum; no columns give zeros."""
    x = _rand(shape, 100) * torch.logspace(-3, 3, shape[-1]) if shape[-1] else torch.zeros(shape)
    want = _tree_sum(x.numpy())
    outs = [kk.pairwise_sum(kk.arr(x)) for kk in KERNELS]
    for out in outs:
        assert tuple(out.shape) == shape[:-1]
        assert np.array_equal(np.asarray(as_float64(out), np.float32), want)
        if shape[-1]:
            err = np.abs(as_float64(out) - as_float64(x).sum(-1))
            assert np.all(err <= 1e-6 * np.abs(as_float64(x)).sum(-1) * math.log2(2 * shape[-1]))


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("n", [0, 1, 37, 4099])
def test_value_flags(dtype, n):
    """fce_torch's host check in one launch (one program looping over blocks, here 64 wide): the flags and the
    count of the torch expression it replaced, on fresh targets in and out of range, ignore_index negative,
    in range or out, and class weights with one NaN, +inf or -inf anywhere; beside them the reduction
    scalars [n, n, V] in float32, as `fce_core.rows.reduction_scalars` computes them by torch ops."""
    from fce_core.rows import reduction_scalars
    from fce_torch import arrays
    from fce_core.config import BlockConfig
    from fce_torch.kernels.value_flags import value_flags
    cfg = BlockConfig(block=64)
    gen = torch.Generator().manual_seed(n)
    for vocab, ignore in ((50, -100), (50, -1), (60, 7), (10, 7)):
        y = torch.randint(-3, 55, (n,), generator=gen).to(getattr(torch, dtype))
        y[::3] = ignore
        for targets in (y, y.clamp(0, vocab - 1).where(y != ignore, ignore)):
            kept = targets != ignore
            want = [int((kept & ((targets < 0) | (targets >= vocab))).any()), int(kept.sum())]
            flags, scalars = value_flags(targets, vocab, ignore, cfg=cfg)
            assert flags.tolist() == want
            by_ops, _ = reduction_scalars(arrays, targets, None, ignore, vocab)
            assert scalars.dtype == torch.float32 and torch.equal(scalars, by_ops)
    weights = torch.randn(301, generator=gen)
    assert value_flags(y, 60, -100, weights, cfg)[0].tolist()[2] == 0
    for odd in (float("nan"), float("inf"), -float("inf")):
        for at in (0, 150, 300):
            w = weights.clone()
            w[at] = odd
            assert value_flags(y, 60, -100, w, cfg)[0].tolist()[2] == 1


def test_interpreter_dtype_cache_answers_as_triton():
    """conftest's memoized `_get_np_dtype` (tests/triton_interpreter.py) gives the interpreter's own answer for
    every scalar type it maps, blocks of each, and pointers, scalar and in blocks."""
    import triton.language as tl
    from triton.runtime import interpreter

    import triton_interpreter

    original = getattr(interpreter._get_np_dtype, "original", interpreter._get_np_dtype)
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
               tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv]
    types = scalars + [tl.block_type(t, [4, 8]) for t in scalars]
    types += [tl.pointer_type(tl.float32), tl.block_type(tl.pointer_type(tl.bfloat16), [16])]
    saved = interpreter._get_np_dtype
    try:
        interpreter._get_np_dtype = original
        triton_interpreter.memoize_np_dtypes()
        memo = interpreter._get_np_dtype
        assert memo.original is original
        for _ in range(2):  # the second pass answers from the cache
            assert [memo(t) for t in types] == [original(t) for t in types]
    finally:
        interpreter._get_np_dtype = saved

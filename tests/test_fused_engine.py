"""fused_lce(..., engine="fused") (SPEC §1) of both twins against the float64 reference, and its kernels.

The fused engine computes the logits with our own GEMM, whose epilogue keeps per-(row, tile) statistics and
stores exp-scaled 16-bit tile values instead of float32 logits (fce_*/kernels/logit_tiles.py, merged by
`merge_tiles`), then rewrites those values into dZ (fce_*/kernels/tile_dlogits.py); `fce_core.plan.fused_rows`
plans its chunks and `fce_core.contract.resolve_engine` its refusals.

- every option of SPEC §1 on the fused engine (each dtype, V not a multiple of the interpreter's tile width
  ``GEMM_INTERPRETER.tile_n`` = 32 and V below it, one row, all rows ignored, huge logits, 3-D x, bias, class
  weights with label smoothing, z-loss, softcap with label smoothing up to the accepted 43, token scaling, each
  reduction, "none" with a random cotangent) through `twins.check_flce` (SPEC bounds of loss, dx, dw, db,
  z_loss, accuracy; lse and argmax), with several chunks in both of the fused planner's dZ plans (kept, and the
  float32 dW accumulator: asserted from ``plan_rows(..., engine="fused")``);
- the kernels of each twin against float64 computed here: `logit_tiles` + `merge_tiles` (m, s, zy, first
  argmax, q with and without class weights, pz; the tile maxima and the stored tile values e = exp(z - m_t) to
  their dtype's rounding; nothing written outside the given rows and columns) and `tile_dlogits` (dZ from given
  coefficient rows, elementwise within the rounding of e and of dZ). Their inputs lie on a coarse binary grid
  so that the float32 GEMM is exact: m, zy and the argmax (planted ties across and within tiles) compare
  exactly; and that fused_lce's engine="fused" runs them (its stages hold tile values, not float32 logits);
- bad input (an unknown engine, the refused softcap with label smoothing: tests/test_engine_choice.py too) and
  determinism (two runs, two compilations in JAX, give the same bits). Vocab-parallel: tests/dist_*.py.

"""

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from fce_core.config import GEMM_INTERPRETER
from fce_core.contract import FUSED_SOFTCAP_WITH_SMOOTHING, FUSED_SOFTCAP_WITH_SMOOTHING_F16
from fce_core.heads import StatsSpec
from fce_core.options import Transform
from fce_core.plan import layout, plan_rows
from fce_core.rows import tile_weights
from fce_torch.kernels import fastmath as tfm
from helpers import to_jax, to_torch
from parity.cases import IGNORE_INDEX, Case, make_inputs
from parity.reference import as_float64
from twins import STAT_KEYS, check_flce, each_twin, quick_jit

TILE_N = GEMM_INTERPRETER.tile_n
F64 = torch.float64
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _fused(case: Case) -> Case:
    return dataclasses.replace(case, engine="fused")


def _check(twin, case: Case, inp: dict, out: dict, **kw) -> dict:
    """`check_flce` of a fused run and the output dtypes and shapes: a float32 loss and lse, each gradient in
    its input's dtype."""
    assert case.engine == "fused"
    assert twin.dtype(out["loss"]) == "float32" and twin.dtype(out["lse"]) == "float32"
    for k, d in (("x", "dx"), ("weight", "dw"), ("bias", "db")):
        assert (out[d] is None) == (inp[k] is None), d
        if inp[k] is not None:
            assert tuple(out[d].shape) == tuple(inp[k].shape), d
            assert twin.dtype(out[d]) == twin.dtype(inp[k]), d
    return check_flce(case, inp, out, **kw)


# ============================================================================ 1. fused_lce: the case grid
FUSED_CASES = {  # id: (case, chunk_rows)
    "f32_v777_bias": (Case("f32", (37,), 32, 777, "float32", bias=True, seed=101), 8),
    "bf16_3d_f32_bias": (Case("bf16_3d", (2, 5), 24, 130, "bfloat16", bias=True, bias_dtype="float32", seed=102), 4),
    "f16_v777": (Case("f16", (15,), 32, 777, "float16", seed=103), None),
    "single_row": (Case("one", (1,), 16, 130, "float32", ignore_frac=0.0, label_smoothing=0.1, seed=104), None),
    "vocab_below_tile": (Case("v20", (9,), 16, 20, "float32", label_smoothing=0.1, z_loss=1e-3, seed=105), 4),
    "huge_f32": (Case("huge32", (19,), 32, 777, "float32", bias=True, label_smoothing=0.1, z_loss=1e-4,
                      logit_scale=50.0, seed=106), 8),
    "huge_bf16": (Case("hugebf", (13,), 48, 1000, "bfloat16", bias=True, label_smoothing=0.1, logit_scale=50.0,
                       seed=107), 8),
    "huge_f16_sum": (Case("huge16", (13,), 32, 1000, "float16", reduction="sum", logit_scale=50.0, seed=108), None),
    "class_weights": (Case("cw", (29,), 40, 777, "float32", class_weights=True, seed=109), 8),
    "cw_smoothing": (Case("cwls", (21,), 32, 777, "float32", class_weights=True, label_smoothing=0.2,
                          logit_scale=4.0, seed=110), 8),
    "cw_smoothing_bf16": (Case("cwlsbf", (17,), 32, 130, "bfloat16", class_weights=True, label_smoothing=0.6,
                               logit_scale=4.0, seed=111), 4),
    "z_loss": (Case("zl", (23,), 40, 130, "float32", z_loss=1e-2, logit_scale=5.0, seed=112), 8),
    "softcap43_smoothing_f32": (Case("cap43", (17,), 32, 777, "float32", softcap=FUSED_SOFTCAP_WITH_SMOOTHING,
                                     label_smoothing=0.1, logit_scale=100.0, seed=113), 8),
    "softcap_smoothing_bf16": (Case("capbf", (17,), 32, 777, "bfloat16", softcap=30.0, label_smoothing=0.5,
                                    logit_scale=30.0, seed=114), 8),
    "softcap_smoothing_f16": (Case("cap16", (17,), 32, 777, "float16", softcap=FUSED_SOFTCAP_WITH_SMOOTHING_F16,
                                   label_smoothing=0.5, logit_scale=30.0, seed=114), 8),
    "softcap_f16": (Case("cap16ns", (13,), 32, 777, "float16", softcap=15.0, logit_scale=30.0, seed=115), None),
    "token_scaling": (Case("ts", (19,), 32, 777, "float32", bias=True, token_scaling=True, z_loss=1e-3,
                           label_smoothing=0.1, seed=116), 8),
    "sum_bf16": (Case("sumbf", (11,), 32, 130, "bfloat16", reduction="sum", seed=117), 4),
}


@each_twin
@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_fused_case_matches_reference(twin, name):
    """loss, dx, dw, db and the stats (lse, z_loss, accuracy, argmax) within the SPEC bounds."""
    case, chunk_rows = FUSED_CASES[name]
    case = _fused(case)
    inp = make_inputs(case)
    out = twin.run(inp, case.options(), chunk_rows=chunk_rows)
    assert tuple(out["loss"].shape) == (() if case.reduction != "none" else case.shape)
    assert tuple(out["lse"].shape) == tuple(out["argmax"].shape) == case.shape
    _check(twin, case, inp, out)


NONE_CASES = {
    "f32_cw_smoothing": (Case("none32", (2, 7), 32, 777, "float32", reduction="none", class_weights=True,
                              label_smoothing=0.1, seed=120), 4),
    "f16_all_options": (Case("none16", (3, 2), 16, 130, "float16", bias=True, reduction="none",
                             label_smoothing=0.2, z_loss=1e-3, softcap=FUSED_SOFTCAP_WITH_SMOOTHING_F16,
                             class_weights=True, ignore_frac=0.3,
                             seed=121), 4),
}


@each_twin
@pytest.mark.parametrize("name", list(NONE_CASES))
def test_fused_none_random_grad_output(twin, name):
    """reduction="none" with a random signed cotangent per row, several chunks."""
    case, chunk_rows = NONE_CASES[name]
    case = _fused(case)
    inp = make_inputs(case)
    g = torch.randn(case.shape, generator=torch.Generator().manual_seed(122))
    out = twin.run(inp, case.options(), chunk_rows=chunk_rows, grad_output=g)
    assert tuple(out["loss"].shape) == case.shape
    _check(twin, case, inp, out, grad_output=g)


@each_twin
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_all_rows_ignored(twin, reduction):
    """Every option on, every row ignored: loss, z_loss, accuracy and the gradients exactly 0 (finite), lse 0,
    argmax -1."""
    case = _fused(Case("allign", (2, 9), 16, 130, "float32", bias=True, reduction=reduction, label_smoothing=0.1,
                       z_loss=1e-3, softcap=20.0, class_weights=True, ignore_frac=1.0, seed=123))
    inp = make_inputs(case)
    out = twin.run(inp, case.options(), chunk_rows=8)
    for k in ("loss", "z_loss", "accuracy", "lse", "dx", "dw", "db"):
        v = as_float64(out[k])
        assert np.isfinite(v).all() and np.all(v == 0), f"{k} = {v}"
    assert np.all(as_float64(out["argmax"]) == -1)
    _check(twin, case, inp, out)


CHUNKING = {  # id: (plan, dtype, H, chunk_rows, N)
    # 13 rows: chunks of one row cost one kept-dZ GEMM branch each in JAX (`engine._kept_grads`), 27 s at 37 rows
    "kept_bf16_rows1": ("kept", "bfloat16", 48, 1, 13),
    "kept_bf16_rows12": ("kept", "bfloat16", 48, 12, 37),
    "accumulated_bf16_rows5": ("accumulated", "bfloat16", 16, 5, 37),
    "accumulated_f32_rows12": ("accumulated", "float32", 48, 12, 37),
    "one_chunk_f32_rows100": ("one", "float32", 16, 100, 37),
}


def _chunking_case(dtype, h, n=37):
    return _fused(Case("chunks", (n,), h, 300, dtype, bias=True, class_weights=True, label_smoothing=0.1,
                       z_loss=1e-3, softcap=20.0, logit_scale=5.0, ignore_frac=0.3, seed=124))


@each_twin
@pytest.mark.parametrize("name", list(CHUNKING))
def test_fused_chunking_plans(twin, name):
    """Chunks of one row, a remainder chunk plus full ones, and more rows than N, with the fused plan keeping
    every chunk's dZ (N * itemsize <= H * (4 - itemsize) + rows * itemsize: only 16-bit inputs) and with the
    float32 dW accumulator; every option on; the reference's results."""
    plan_kind, dtype, h, chunk_rows, n = CHUNKING[name]
    case = _chunking_case(dtype, h, n)
    p = plan_rows(n, h, 300, ITEMSIZE[dtype], need_grads=True, requested=chunk_rows, engine="fused")
    n_chunks = layout(n, p.rows)[1]
    if plan_kind == "one":
        assert n_chunks == 1 and p.single_product(True)
    else:
        assert n_chunks > 1 and p.keep_dz == (plan_kind == "kept")
        assert p.single_product(True) == (plan_kind == "kept")    # accumulated: a float32 dW accumulator
    if name == "accumulated_f32_rows12":   # the library engine would keep this dZ (N * 4 <= 4 H)
        assert plan_rows(n, h, 300, 4, need_grads=True, requested=chunk_rows).keep_dz
    inp = make_inputs(case)
    _check(twin, case, inp, twin.run(inp, case.options(), chunk_rows=chunk_rows))


@each_twin
def test_fused_loss_without_gradients_keeps_its_bits_in_one_chunk(twin):
    """Without gradients the fused plan's budget holds per-tile statistics, not tile values
    (`plan.fused_rows`), so the rows run in one chunk where the gradient call takes several: a row's outputs
    do not depend on its chunk, so the loss and the stats are the same bits either way. Every option on, rows
    ignored, chunks of 5 rows against the plan's one."""
    case = _chunking_case("bfloat16", 16)
    assert layout(37, plan_rows(37, 16, 300, 2, need_grads=False, engine="fused").rows)[1] == 1
    inp = make_inputs(case)
    with_grads = twin.run(inp, case.options(), chunk_rows=5)
    args = [twin.array(inp[k]) for k in ("x", "weight", "targets", "bias", "class_weights")]
    for rows in (5, None):
        def call(x, w, t, b, cw, rows=rows):
            return twin.lib.fused_lce(x, w, t, bias=b, class_weights=cw, return_stats=True, chunk_rows=rows,
                                      **case.options())

        if twin.name == "torch":
            with torch.no_grad():
                loss, stats = call(*args)
        else:  # jitted, as the gradient call is (XLA fuses the row math otherwise)
            loss, stats = quick_jit(call)(*args)
        for k, v in (("loss", loss), *((k, stats[k]) for k in STAT_KEYS)):
            assert np.array_equal(twin.bits(v), twin.bits(with_grads[k])), (rows, k)


# ============================================================================ 2. the kernels
class TorchTiles:
    name = "torch"

    @staticmethod
    def arr(t):
        return t

    def forward(self, x, w, bias, y, cw, spec, tr, n_extra):
        """(e [n, V] in a buffer of n_extra more columns filled with 3.0, that buffer, partials, stats, the
        partials of store=False)."""
        from fce_torch import arrays, gemm
        from fce_torch.kernels.logit_tiles import gemm_config, logit_tiles, merge_tiles

        assert gemm_config().tile_n == TILE_N
        n, v = x.shape[0], w.shape[0]
        buf = torch.full((n, v + n_extra), 3.0, dtype=x.dtype)
        kw = dict(spec=spec, transform=tr, precision=gemm.triton_precision(x))
        e, parts = logit_tiles(x, w, bias, y, cw, out=buf[:, :v], **kw)
        assert e.data_ptr() == buf.data_ptr()
        none, parts_no_store = logit_tiles(x, w, bias, y, cw, store=False, **kw)
        assert none is None
        tw = None if cw is None else tile_weights(arrays, cw, TILE_N)
        return e.clone(), buf.clone(), parts, merge_tiles(parts, v, tw), parts_no_store

    def dlogits(self, buf, v, m_tiles, y, zy, cw, coef, tr):
        """dZ written over the tile values in place (rows of the buffer, stride v + extra)."""
        from fce_torch.kernels.tile_dlogits import tile_dlogits

        buf = buf.clone()
        tile_dlogits(buf[:, :v], m_tiles, y, zy, cw, coef, transform=tr)
        return buf


class JaxTiles:
    """The Pallas kernels under one quick jax.jit per call (the tile values go into rows [ROW0, ROW0 + n) of a
    larger array, as the engine's kept dZ takes them)."""

    name = "jax"
    ROW0 = 2

    @staticmethod
    def arr(t):
        return None if t is None else to_jax(t)

    def forward(self, x, w, bias, y, cw, spec, tr, n_extra):
        import jax.numpy as jnp

        from fce_jax import arrays, gemm
        from fce_jax.kernels.logit_tiles import gemm_config, logit_tiles, merge_tiles

        assert gemm_config().tile_n == TILE_N
        n, v = x.shape[0], w.shape[0]

        def f(x, w, bias, y, cw, into):
            kw = dict(spec=spec, transform=tr, precision=gemm.pallas_precision(x))
            e, parts = logit_tiles(x, w, bias, y, cw, into=into, row0=self.ROW0, **kw)
            none, parts_no_store = logit_tiles(x, w, bias, y, cw, store=False, **kw)
            assert none is None
            tw = None if cw is None else tile_weights(arrays, cw, TILE_N)
            return e, parts, merge_tiles(parts, v, tw), parts_no_store

        into = jnp.full((n + n_extra, v), 3.0, x.dtype)
        buf, parts, stats, parts_no_store = quick_jit(f)(x, w, bias, y, cw, into)
        return buf[self.ROW0:self.ROW0 + n], buf, parts, stats, parts_no_store

    def dlogits(self, buf, v, m_tiles, y, zy, cw, coef, tr):
        from fce_jax.kernels.tile_dlogits import tile_dlogits

        return quick_jit(lambda *a: tile_dlogits(*a, transform=tr, row0=self.ROW0))(buf, m_tiles, y, zy, cw, coef)


TILES = [TorchTiles(), JaxTiles()]
each_kernel_twin = pytest.mark.parametrize("k", TILES, ids=[k.name for k in TILES])

TILE_CASES = {  # id: (dtype, rows, H, V, logit scale, bias, class weights, q, pz, softcap, temperature)
    "f32_bias_q_pz": ("float32", 21, 40, 130, 3.0, True, False, True, True, None, 1.0),
    "bf16_cw_q_softcap": ("bfloat16", 21, 32, 130, 5.0, False, True, True, False, 10.0, 1.0),
    "f16_cw_q_pz_softcap_temperature": ("float16", 17, 24, 100, 3.0, True, True, True, True, 3.0, 0.7),
    "f32_one_row_huge_pz": ("float32", 1, 48, 777, 50.0, True, False, False, True, None, 1.0),
    "bf16_full_tiles_bias_cw_q_pz": ("bfloat16", 19, 32, 128, 3.0, True, True, True, True, None, 1.0),  # V % 32 == 0
}
UNIT = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}     # unit roundoff
TINY = {"float32": 2.0 ** -126, "bfloat16": 2.0 ** -126, "float16": 2.0 ** -24}  # what may flush / round away
U32 = 2.0 ** -24


def _exact_logits(x, w, bias):
    return x.double() @ w.double().T + (0.0 if bias is None else bias.double())


def _grid_inputs(dtype, n, h, v, scale, has_bias, has_cw, seed):
    """x in quarters of [-2, 2], weight and bias integer multiples of a power of two: every product and
    partial sum of the logits GEMM is exact in float32 (and every value exact in the 16-bit dtypes). The
    logits are ~ N(0, scale²). Planted maxima: row 0's at columns 5 and 70 (tiles 0 and 2, equal), row 1's at
    33 and 40 (one tile, equal), each just above the row's other logits. Targets in [0, V), row 3 ignored."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (n, h), generator=g) / 4.0
    step = 2.0 ** round(math.log2(scale / (11.6 * math.sqrt(h))))
    w = torch.randint(-16, 17, (v, h), generator=g) * step
    bias = torch.randint(-16, 17, (v,), generator=g) * (step / 4) if has_bias else None
    cw = (torch.rand(v, generator=g) * 3 - 1) if has_cw else None
    if cw is not None:
        cw[[7, 64]] = 0.0
    planted = [(0, (5, 70)), (1, (33, 40))][:n]
    for row, cols in planted:    # copies of the row's top column, raised by 2 steps along its largest |x|
        top, k = int(_exact_logits(x, w, bias)[row].argmax()), int(x[row].abs().argmax())
        for c in cols:
            w[c] = w[top]
            w[c, k] += 2 * step * float(torch.sign(x[row, k]))
            if bias is not None:
                bias[c] = bias[top]
    r = _exact_logits(x, w, bias)
    for row, cols in planted:
        assert r[row, cols[0]] == r[row, cols[1]] == r[row].max() and int(r[row].argmax()) == cols[0]
    y = torch.randint(0, v, (n,), generator=g)
    if n > 3:
        y[3] = IGNORE_INDEX
    dt = getattr(torch, dtype)
    out = {"x": x.to(dt), "w": w.to(dt), "bias": None if bias is None else bias.to(dt), "cw": cw, "y": y}
    assert torch.equal(out["x"].double(), x.double()) and torch.equal(out["w"].double(), w.double())
    return out, dict(planted)


def _reference_tiles(inp, softcap, temperature):
    """float64: r, z, the tile maxima [n, T], m, zy (of y_safe), first argmax, s, q, pz, and e = exp(z - m_t)."""
    r = _exact_logits(inp["x"], inp["w"], inp["bias"])
    z = r if softcap is None else softcap * torch.tanh(r / softcap)
    z = z / temperature
    n, v = z.shape
    n_tiles = -(-v // TILE_N)
    padded = torch.full((n, n_tiles * TILE_N), -math.inf, dtype=F64)
    padded[:, :v] = z
    m_t = padded.view(n, n_tiles, TILE_N).max(dim=2).values
    m_col = m_t.repeat_interleave(TILE_N, dim=1)[:, :v]
    m = z.max(dim=1).values
    y_safe = torch.where((inp["y"] >= 0) & (inp["y"] < v), inp["y"], 0)
    zy = z.gather(1, y_safe[:, None])[:, 0]
    w_c = torch.ones(v, dtype=F64) if inp["cw"] is None else inp["cw"].double()
    p_m = torch.exp(z - m[:, None])
    return {"r": r, "z": z, "m_t": m_t, "m_col": m_col, "m": m, "zy": zy, "y_safe": y_safe,
            "amax": torch.from_numpy(np.argmax(z.numpy(), axis=1)), "s": p_m.sum(1), "e": torch.exp(z - m_col),
            "w": w_c, "q": (w_c * (z - zy[:, None])).sum(1), "pz": (p_m * (z - m[:, None])).sum(1), "p_m": p_m}


def _logit_error(ref, softcap, temperature):
    """A bound on |z_kernel - z| per element: 0 for the exact GEMM, else the tanh's and the division's
    float32 rounding."""
    if softcap is None and temperature == 1.0:
        return torch.zeros_like(ref["z"])
    return 4 * U32 * ((softcap or 0.0) / temperature + ref["z"].abs() + 1.0)


def _assert_within(got, want, bound, what):
    """|got - want| <= bound elementwise (float64 tensors; bound broadcast)."""
    ratio = (got - want).abs() / torch.as_tensor(bound).clamp(min=1e-300).expand_as(want)
    worst = np.unravel_index(int(ratio.argmax()), ratio.shape) if ratio.numel() else ()
    assert torch.all(ratio <= 1), f"{what}: {float(ratio.max()):.3g} x its bound at {worst}"


def _tile_case(name):
    dtype, n, h, v, scale, has_bias, has_cw, q, pz, cap, temp = TILE_CASES[name]
    inp, planted = _grid_inputs(dtype, n, h, v, scale, has_bias, has_cw, seed=200 + len(name) + n)
    return dtype, inp, planted, StatsSpec(q=q, pz=pz), Transform(softcap=cap, temperature=temp)


@each_kernel_twin
@pytest.mark.parametrize("name", list(TILE_CASES))
def test_logit_tiles_and_merge(k, name):
    """The [n, T] partials (T = ceil(V / 32)), the tile maxima (exact without a softcap), the stored
    e = exp(z - m_t) in the input dtype (1 exactly at each tile's max, else within its rounding), nothing
    written outside the given rows and columns, store=False giving the same partials, and the merged
    m, zy, first argmax (exactly), s, q, pz against float64. The targets go in as the engine gives them: an
    ignored row's and one past V read column 0."""
    dtype, inp, planted, spec, tr = _tile_case(name)
    n, v = inp["x"].shape[0], inp["w"].shape[0]
    if n > 4:
        inp["y"][4] = v + 3
    n_tiles = -(-v // TILE_N)
    ref = _reference_tiles(inp, tr.softcap, tr.temperature)
    dz_err = _logit_error(ref, tr.softcap, tr.temperature)
    delta = dz_err.max(dim=1).values                                      # per row
    y_safe = ref["y_safe"]
    e, buf, parts, stats, parts_ns = k.forward(k.arr(inp["x"]), k.arr(inp["w"]), k.arr(inp["bias"]),
                                               k.arr(inp["y"].to(torch.int32)), k.arr(inp["cw"]), spec, tr, 5)

    want = {"m", "s", "amax", "zy"} | ({"q"} if spec.q else set()) | ({"pz"} if spec.pz else set())
    assert set(parts) == want and set(parts_ns) == want and set(stats) == want
    for key, part in parts.items():
        assert tuple(part.shape) == (n, n_tiles), key
        assert str(part.dtype).endswith("int32" if key == "amax" else "float32"), key
        assert np.array_equal(as_float64(part), as_float64(parts_ns[key])), key

    # the tile maxima and the stored tile values
    m_t = torch.from_numpy(as_float64(parts["m"]))
    _assert_within(m_t, ref["m_t"], delta[:, None], "tile maxima")
    # each tile's target logit: the target's own tile holds it, every other tile -inf (the kernels skip the
    # target's column in tiles where no row of the block has its target)
    zy_t = torch.from_numpy(as_float64(parts["zy"]))
    own = (y_safe // TILE_N)[:, None] == torch.arange(n_tiles)[None, :]
    assert torch.all(zy_t[~own] == -math.inf)
    _assert_within(zy_t[own], ref["zy"], delta, "the target's tile's target logit")
    e64 = torch.from_numpy(as_float64(e))
    assert str(e.dtype).removeprefix("torch.") == dtype and tuple(e.shape) == (n, v)
    rtol = UNIT[dtype] + 4 * U32 * ((ref["z"] - ref["m_col"]).abs() + 2) + 2 * dz_err + 2 * delta[:, None]
    _assert_within(e64, ref["e"], rtol * ref["e"] + TINY[dtype], "tile values e")
    assert torch.all(e64 <= 1.0)
    padded = torch.zeros(n, n_tiles * TILE_N, dtype=F64)
    padded[:, :v] = e64
    assert torch.all(padded.view(n, n_tiles, TILE_N).max(dim=2).values == 1.0)
    buf = as_float64(buf)
    if k.name == "torch":
        assert np.all(buf[:, v:] == 3.0)                                      # columns past V untouched
    else:
        assert np.all(buf[:k.ROW0] == 3.0) and np.all(buf[k.ROW0 + n:] == 3.0)   # rows outside untouched

    # the merged row statistics
    got = {key: torch.from_numpy(as_float64(t)) for key, t in stats.items()}
    _assert_within(got["m"], ref["m"], delta, "m")
    _assert_within(got["zy"], ref["zy"], delta, "zy")
    amax = got["amax"].to(torch.int64)
    if tr.softcap is None and tr.temperature == 1.0:
        assert torch.equal(amax, ref["amax"]), (amax, ref["amax"])
    else:   # a float32 tie of the tanh
        assert torch.all((amax == ref["amax"]) | (ref["z"].gather(1, amax[:, None])[:, 0] >= ref["m"] - 2 * delta))
    for row, cols in planted.items():
        assert int(amax[row]) == cols[0] == int(ref["amax"][row]), (row, int(amax[row]))
    far = (ref["z"] - ref["m"][:, None]).abs()
    bound_s = (ref["p_m"] * (2 ** -21 * (far + 2) + 2 * dz_err + 2 * delta[:, None])).sum(1) + 1e-6 * ref["s"]
    _assert_within(got["s"], ref["s"], bound_s, "s")
    if spec.q:
        wa = ref["w"].abs()
        terms = wa * ((ref["z"] - ref["m_col"]).abs() + (ref["m_col"] - ref["zy"][:, None]).abs())
        bound_q = 64 * U32 * terms.sum(1) + (wa * (dz_err + delta[:, None])).sum(1)
        _assert_within(got["q"], ref["q"], bound_q, "q")
    if spec.pz:
        bound_pz = (ref["p_m"] * ((2 ** -18 + 4 * dz_err + 4 * delta[:, None]) * (far + 1))).sum(1)
        _assert_within(got["pz"], ref["pz"], bound_pz, "pz")


@each_kernel_twin
@pytest.mark.parametrize("n_tiles", [1, 3, 16, 17, 33, 64, 150])
def test_merge_sums_by_the_pairwise_tree(k, n_tiles):
    """`merge_tiles`' s, q and pz are the twin's `pairwise_sum` of the tiles' units, bit for bit, whatever the
    count of tiles against the merge's block of tiles (fce_torch sums in its merge kernel, block by block; the
    interpreter's block is 16 tiles). Every tile max equals the row max and zy, so each unit is its partial
    exactly; the partials have both signs and span 2^-8..2^8 (sums whose rounding depends on the order; s is
    not a sum of exponentials here: the merge does not care)."""
    g = torch.Generator().manual_seed(700 + n_tiles)
    n = 5
    m_t = torch.full((n, n_tiles), 1.5)
    parts = {key: torch.randn(n, n_tiles, generator=g) * torch.exp2(torch.randint(-8, 9, (n, n_tiles),
                                                                                 generator=g).float())
             for key in ("s", "q", "pz")}
    parts.update(m=m_t, zy=m_t.clone(), amax=torch.zeros(n, n_tiles, dtype=torch.int32))
    vocab = n_tiles * TILE_N
    if k.name == "torch":
        from fce_torch.kernels.logit_tiles import merge_tiles
        from fce_torch.sums import pairwise_sum
        stats = merge_tiles(parts, vocab)
        want = {key: pairwise_sum(parts[key]) for key in ("s", "q", "pz")}
    else:
        from fce_jax.kernels.logit_tiles import merge_tiles
        from fce_jax.sums import pairwise_sum
        jparts = {key: to_jax(v) for key, v in parts.items()}
        stats = merge_tiles(jparts, vocab)
        want = {key: pairwise_sum(jparts[key]) for key in ("s", "q", "pz")}
    for key, sums in want.items():
        got, ref = np.asarray(as_float64(stats[key])), np.asarray(as_float64(sums))
        assert np.array_equal(got.view(np.uint64), ref.view(np.uint64)), (key, got, ref)


LAUNCHES = [dict(tma=t, persistent=p) for t in (False, True) for p in (False, True)] + [
    dict(tile_m=32, tile_n=32, tma=True, persistent=True), dict(tma=True, persistent=True, flatten=True),
    dict(tile_m=32, tma=True, persistent=True, programs_per_sm=2)]


ON_LOAD_SHAPES = {  # rows, H, V: V a partial tile (pointer loads in fce_torch), V of whole 16-byte rows (TMA)
    "v203_pointer_loads": (37, 40, 203), "v256_tma": (64, 48, 256)}


def _tile_values(n, v, dtype, seed):
    """Tile values e in [0, 1] in `dtype` (some exactly 0 and 1), tile maxima, safe targets and head
    coefficients (row 2 without a gradient, smoothing's c nonzero) of n rows and V = v."""
    g = torch.Generator().manual_seed(seed)
    e = torch.rand(n, v, generator=g)
    e[e < 0.05] = 0.0
    e[:, ::TILE_N] = 1.0
    coef = {"lse": torch.rand(n, generator=g) * 4 + 6, "a": torch.randn(n, generator=g),
            "b": torch.randn(n, generator=g), "c": torch.randn(n, generator=g) * 1e-3}
    for key in ("a", "b", "c"):
        coef[key][2] = 0.0
    return (e.to(getattr(torch, dtype)), torch.randn(n, -(-v // TILE_N), generator=g) * 4 + 4,
            torch.randint(0, v, (n,), generator=g), coef)


def _grad_products(twin, dz, w, x, split):
    """dX (one slice and the planned slices), dW written, and the pair (or float32) accumulated over the rows
    [0, split) then [split, n) (its last product hi alone), of one twin: arrays in torch."""
    if twin == "torch":
        from fce_torch.kernels import grad_gemms as g
        dx = g.dx_gemm(dz, w, torch.empty(x.shape, dtype=x.dtype))
        part = [g.dw_first(_rows(dz, 0, split), x[:split], w.dtype)]
        part.append(g.dw_accumulate(_rows(dz, split, None), x[split:], part[0], last=True))
        return [dx, g.dw_gemm(dz, x, torch.float32), *part]
    from fce_jax.kernels import grad_gemms as g
    xj, wj = to_jax(x), to_jax(w)
    first = g.dw_first(_rows(dz, 0, split), xj[:split], wj.dtype)
    outs = [g.dx_gemm(dz, wj, xj.dtype), g.dw_gemm(dz, xj, np.float32), first,
            g.dw_accumulate(_rows(dz, split, None), xj[split:], first, last=True)]
    return [tuple(map(to_torch, o)) if isinstance(o, tuple) else to_torch(o) for o in outs]


def _rows(dz, r0, r1):
    """Rows [r0, r1) of dZ or of its tile values (TileValues)."""
    if hasattr(dz, "coef"):
        return dz._replace(e=dz.e[r0:r1], m_tiles=dz.m_tiles[r0:r1], y=dz.y[r0:r1],
                           coef={k: c[r0:r1] for k, c in dz.coef.items()})
    return dz[r0:r1]


def _flat_bits(outs):
    flat = [t for o in outs for t in (o if isinstance(o, tuple) else (o,))]
    return [np.asarray(as_float64(t)).view(np.uint64) for t in flat]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", list(ON_LOAD_SHAPES))
def test_grad_gemms_form_dz_on_load(name, dtype):
    """dX, dW written, and dW accumulated over two chunks (the (hi, lo) pair for bfloat16, float32 otherwise)
    from the tile values with dZ formed on the GEMMs' operand load (`TileValues`) give the bits of the same
    GEMMs over `tile_dlogits`' dZ, in each twin: tile values 0 and 1, a row without a gradient, smoothing's c,
    a partial last tile, the dX slices and dW's K split into chunks."""
    from fce_jax.kernels import grad_gemms as jg
    from fce_jax.kernels.tile_dlogits import tile_dlogits as jax_tile_dlogits
    from fce_torch.kernels import grad_gemms as tg
    from fce_torch.kernels.tile_dlogits import tile_dlogits

    n, h, v = ON_LOAD_SHAPES[name]
    dt = getattr(torch, dtype)
    e, m_tiles, y, coef = _tile_values(n, v, dtype, seed=len(name) + h)
    g = torch.Generator().manual_seed(n)
    w, x = (torch.randn(v, h, generator=g) / 4).to(dt), torch.randn(n, h, generator=g).to(dt)
    dz = e.clone()
    tile_dlogits(dz, m_tiles, y, torch.zeros(n), None, coef, transform=Transform())
    zj = jax_tile_dlogits(to_jax(e), to_jax(m_tiles), to_jax(y.to(torch.int32)), to_jax(torch.zeros(n)), None,
                          {k: to_jax(c) for k, c in coef.items()}, transform=Transform())
    assert (dz[:, :v].float().abs() > 0).sum() > dz.numel() // 2 and torch.all(dz[2] == 0)  # not vacuous
    split = n // 3 * 2
    runs = {"torch dZ": _grad_products("torch", dz, w, x, split),
            "torch on load": _grad_products("torch", tg.TileValues(e, m_tiles, y, coef, TILE_N), w, x, split),
            "jax dZ": _grad_products("jax", zj, w, x, split),
            "jax on load": _grad_products("jax", jg.TileValues(to_jax(e), to_jax(m_tiles), to_jax(y.to(torch.int32)),
                                                               {k: to_jax(c) for k, c in coef.items()}, TILE_N),
                                          w, x, split)}
    for twin in ("torch", "jax"):  # the twins' GEMMs agree where the sums are exact (the tests above)
        want, got = _flat_bits(runs[f"{twin} dZ"]), _flat_bits(runs[f"{twin} on load"])
        assert len(got) == len(want) == (5 if dtype == "bfloat16" else 4)  # the pair, or float32
        for i, (a, b) in enumerate(zip(got, want)):
            assert np.array_equal(a, b), (twin, i)


ON_LOAD_CASES = {  # id: (case, whether the GEMMs form its dZ on their load, whether its plan keeps dZ)
    "mean_ignored_rows": (Case("onload", (70,), 32, 203, "bfloat16", ignore_frac=0.3, seed=150), True, False),
    "sum_smoothing_z_loss": (Case("onloadls", (70,), 32, 256, "bfloat16", reduction="sum", label_smoothing=0.1,
                                  z_loss=1e-3, seed=151), True, False),
    # H = 48 keeps dZ (N * 2 <= 2 H + 2 * 32) at a sixth of H = 256's interpreted GEMM work
    "kept_dz_ignored_rows": (Case("onloadkept", (70,), 48, 203, "bfloat16", ignore_frac=0.3, seed=153), True,
                             True),
    "class_weights": (Case("onloadcw", (70,), 32, 203, "bfloat16", class_weights=True, seed=152), False, False),
    "bias_grad": (Case("onloadb", (70,), 32, 203, "bfloat16", bias=True, seed=154), False, False),
}


@each_twin
@pytest.mark.parametrize("name", list(ON_LOAD_CASES))
def test_fused_engine_forms_dz_on_load(twin, monkeypatch, name):
    """The fused engine with `GradGemmConfig.dz_on_load` gives the bits of the engine that writes dZ, over
    several chunks, per chunk and over a kept dZ with rows that did not run: the GEMMs take the tile values
    (no dZ pass) where `fce_core.heads.forms_dz_on_load` admits the head (not with class weights) and no db is
    asked for."""
    case, forms, kept = ON_LOAD_CASES[name]
    case = _fused(case)
    assert plan_rows(70, case.h, case.v, ITEMSIZE[case.dtype], need_grads=True, requested=32,
                     engine="fused").keep_dz == kept
    inp = make_inputs(case)
    runs = _with_and_without_on_load(twin, monkeypatch, forms,
                                      lambda: twin.run(inp, case.options(), chunk_rows=32, fresh=True))
    for key, v in runs[0].items():
        if v is not None:
            assert np.array_equal(twin.bits(v), twin.bits(runs[1][key])), key


def _with_and_without_on_load(twin, monkeypatch, forms, run):
    """run() with the twin's engine writing dZ, then forming it on the GEMMs' load; asserts that the second
    took the tile values exactly when `forms`."""
    import importlib
    engine = importlib.import_module(f"fce_{twin.name}.engine")
    runs, formed = [], []
    for on in (False, True):
        monkeypatch.setattr(engine, "dz_on_load_enabled", lambda on=on: on)
        monkeypatch.setattr(engine, "TileValues", functools.partial(_counted, formed, engine.TileValues))
        runs.append(run())
        monkeypatch.undo()
        assert bool(formed) == (on and forms)
    return runs


def _counted(calls, make, *args):
    calls.append(1)
    return make(*args)


def test_twins_share_the_grad_gemm_numerics():
    """fce_torch's dX/dW launch config may differ from the JAX twin's only in fields that cannot change bits:
    every NUMERICS field (those setting dX's slices of V) is the same, on the GPU and in the interpreters."""
    from fce_core import config

    for torch_cfg, jax_cfg in ((config.GRAD_GEMM_TORCH, config.GRAD_GEMM),
                               (config.GRAD_GEMM_TORCH_TALL, config.GRAD_GEMM),
                               (config.GRAD_GEMM_MOSAIC, config.GRAD_GEMM),
                               (config.GRAD_GEMM_MOSAIC_SHORT_K, config.GRAD_GEMM),
                               (config.GRAD_GEMM_INTERPRETER_TORCH, config.GRAD_GEMM_INTERPRETER),
                               (config.GRAD_GEMM_MOSAIC_INTERPRETER, config.GRAD_GEMM_INTERPRETER)):
        for field in config.GradGemmConfig.NUMERICS:
            assert getattr(torch_cfg, field) == getattr(jax_cfg, field), field
    assert config.GRAD_GEMM_INTERPRETER_TORCH.tile_n != config.GRAD_GEMM_INTERPRETER.tile_n


def test_launches_for_few_rows(monkeypatch):
    """On the GPU a chunk of at most SHORT_ROWS rows takes GEMM_SHORT's logits launch in both twins, and the JAX
    twin's dW of at most SHORT_ROWS rows (its K) GRAD_GEMM_MOSAIC_SHORT_K; longer ones the defaults; a given config
    is kept. Launch fields only: every NUMERICS field is the default's."""
    import jax.numpy as jnp

    from fce_core import config
    from fce_jax.kernels import grad_gemms as jg
    from fce_jax.kernels import logit_tiles as jt
    from fce_torch.kernels import logit_tiles as tt

    for short, default, cls in ((config.GEMM_SHORT, config.GEMM, config.GemmConfig),
                                (config.GRAD_GEMM_MOSAIC_SHORT_K, config.GRAD_GEMM_MOSAIC, config.GradGemmConfig)):
        assert short != default and all(getattr(short, f) == getattr(default, f) for f in cls.NUMERICS)
    monkeypatch.setattr(tfm, "ASM", True)
    monkeypatch.setattr(jt, "interpret_mode", lambda: False)
    monkeypatch.setattr(jg, "interpret_mode", lambda: False)
    n = config.SHORT_ROWS
    for gemm_config in (tt.gemm_config, jt.gemm_config):
        assert gemm_config(rows=1) == gemm_config(rows=n) == config.GEMM_SHORT
        assert gemm_config(rows=n + 1) == gemm_config() == config.GEMM
        assert gemm_config(config.GEMM, rows=1) == config.GEMM
    dz, x = jnp.zeros((2 * n, 64), jnp.bfloat16), jnp.zeros((2 * n, 32), jnp.bfloat16)
    assert jg._config(dz, x, k_rows=n) == config.GRAD_GEMM_MOSAIC_SHORT_K
    assert jg._config(dz, x, k_rows=2 * n) == jg._config(dz, x) == config.GRAD_GEMM_MOSAIC


def test_torch_dx_launch_takes_the_fewest_rounds(monkeypatch):
    """fce_torch's dX on the GPU: 256x128 tiles where they take fewer rounds of 132 multiprocessors than
    128x256 (H = 640: 144 items against 120), else 128x256 (also on a tie); the interpreter's tiles on the CPU;
    and tiles walking columns fastest exactly where the grid has fewer column blocks (`rows_fast`)."""
    from fce_core import config
    from fce_core.plan import dx_slices, rows_fast, waves
    from fce_torch.kernels import fastmath, grad_gemms

    cpu = torch.device("cpu")
    assert grad_gemms._dx_config(1024, 640, 6, cpu) == config.GRAD_GEMM_INTERPRETER_TORCH
    monkeypatch.setattr(fastmath, "ASM", True)
    monkeypatch.setattr(grad_gemms, "processors", lambda device: 132)
    picks = {}
    for n, h, v in ((1024, 640, 262144), (1024, 896, 151936), (1024, 4096, 128256), (256, 4096, 128256)):
        slices = dx_slices(n, h, v)
        picks[h, n] = grad_gemms._dx_config(n, h, slices, cpu)
        assert waves(n, h, slices, picks[h, n].tile_m, picks[h, n].tile_n, 132) == min(
            waves(n, h, slices, c.tile_m, c.tile_n, 132) for c in (config.GRAD_GEMM_TORCH, config.GRAD_GEMM_TORCH_TALL))
    assert picks == {(640, 1024): config.GRAD_GEMM_TORCH_TALL, (896, 1024): config.GRAD_GEMM_TORCH,
                     (4096, 1024): config.GRAD_GEMM_TORCH, (4096, 256): config.GRAD_GEMM_TORCH}
    assert waves(1024, 640, 6, 128, 256, 132) == 2 and waves(1024, 640, 6, 256, 128, 132) == 1
    assert not rows_fast(128256, 4096, 128, 256) and rows_fast(1024, 4096, 256, 128)
    assert rows_fast(256, 256, 128, 128)  # a tie walks rows fastest


@pytest.mark.parametrize("dtype, hidden", [("bfloat16", 48), ("float32", 20), ("bfloat16", 20)])
def test_torch_launch_variants_same_bits(dtype, hidden):
    """fce_torch's GEMMs with and without TMA operand loads, the persistent launch (two programs per
    multiprocessor too) and other tiles (the logits GEMM's rows, dX/dW): the same bits for the logits GEMM's
    tile values and partials, dX over several V slices, and dW written, accumulated in float32 and as the
    (hi, lo) pair. Rows of 40 bytes (bfloat16, H = 20) are not TMA-aligned: pointer loads there."""
    from fce_core.config import GRAD_GEMM_INTERPRETER
    from fce_core.plan import dx_slices
    from fce_torch.kernels import grad_gemms, logit_tiles
    from fce_torch.kernels.tma import programs, tma_ready

    two_per_sm = dataclasses.replace(GEMM_INTERPRETER, persistent=True, programs_per_sm=2)
    cpu = torch.device("cpu")  # two processors there
    assert programs(100, two_per_sm, cpu) == 4 and programs(3, two_per_sm, cpu) == 3
    n, v = 37, 304   # rows of V values are TMA-aligned, V is not a multiple of the tile width
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(n, hidden, generator=g).to(dt), torch.randn(v, hidden, generator=g).to(dt)
    dz = (torch.randn(n, v, generator=g) * 0.1).to(dt)
    y = torch.randint(0, v, (n,), generator=g)
    assert tma_ready(x, w, dz) == (hidden * dz.element_size() % 16 == 0)
    assert dx_slices(n, hidden, v, GRAD_GEMM_INTERPRETER) > 1
    precision = "ieee"
    runs = []
    for launch in LAUNCHES:
        cfg = dataclasses.replace(GEMM_INTERPRETER, **{k: v for k, v in launch.items() if k != "tile_n"})
        grad_cfg = dataclasses.replace(GRAD_GEMM_INTERPRETER, **launch)
        e, parts = logit_tiles.logit_tiles(x, w, None, y, None, spec=StatsSpec(q=True, pz=True),
                                           transform=Transform(), precision=precision, cfg=cfg)
        dx = grad_gemms.dx_gemm(dz, w, torch.empty_like(x), precision, cfg=grad_cfg)
        acc = grad_gemms.dw_first(dz[:20], x[:20], dt, precision, cfg=grad_cfg)
        acc = grad_gemms.dw_accumulate(dz[20:], x[20:], acc, precision, cfg=grad_cfg)
        written = grad_gemms.dw_gemm(dz, x, dt, precision, cfg=grad_cfg)
        runs.append([e, *parts.values(), dx, *(acc if isinstance(acc, tuple) else (acc,)), written])
    want = (dz.double() @ w.double(), dz.double().T @ x.double())
    assert float((runs[0][-1].double() - want[1]).abs().max()) <= 1e-2 * float(want[1].abs().max())
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)


@each_kernel_twin
@pytest.mark.parametrize("name", list(TILE_CASES))
def test_tile_dlogits(k, name):
    """dZ = (a p + b [c == y] + c w_c (+ d p (z - mu))) (1 - tanh²(r / cap)) / temperature from the stored
    tile values, given float32 coefficient rows (lse from float64), elementwise within the rounding of e and
    of dZ; a row whose coefficients are all 0 gives exact zeros, an ignored row (y = -100) no target term;
    nothing written outside the given rows and columns."""
    dtype, inp, _, spec, tr = _tile_case(name)
    n, v = inp["x"].shape[0], inp["w"].shape[0]
    entropy = spec.pz
    ref = _reference_tiles(inp, tr.softcap, tr.temperature)
    dz_err = _logit_error(ref, tr.softcap, tr.temperature)
    _, buf, parts, stats, _ = k.forward(k.arr(inp["x"]), k.arr(inp["w"]), k.arr(inp["bias"]),
                                        k.arr(ref["y_safe"].to(torch.int32)), k.arr(inp["cw"]), spec, tr, 5)
    if dtype == "float16" and (entropy or tr.softcap is not None):   # these inputs keep every e a normal float16,
        assert ref["e"].min() >= 2 ** -14                           # so that z = m_t + ln e holds to its rounding
    g = torch.Generator().manual_seed(300 + n)
    lse = torch.logsumexp(ref["z"], 1)
    coef = {"lse": lse.float(), "a": torch.randn(n, generator=g), "b": torch.randn(n, generator=g),
            "c": torch.randn(n, generator=g) * 0.05}
    if entropy:
        coef["d"] = torch.randn(n, generator=g)
        coef["mu"] = (torch.softmax(ref["z"], 1) * ref["z"]).sum(1).float()
    if n > 2:   # a dead row
        for key in ("a", "b", "c", "d"):
            if key in coef:
                coef[key][2] = 0.0
    y = inp["y"].to(torch.int32)
    out = k.dlogits(buf, v, parts["m"], k.arr(y), stats["zy"], k.arr(inp["cw"]),
                    {key: k.arr(c) for key, c in coef.items()}, tr)
    out = as_float64(out)
    if k.name == "torch":
        assert np.all(out[:, v:] == 3.0)
        dz = torch.from_numpy(out[:, :v].copy())
    else:
        assert np.all(out[:k.ROW0] == 3.0) and np.all(out[k.ROW0 + n:] == 3.0)
        dz = torch.from_numpy(out[k.ROW0:k.ROW0 + n].copy())

    c64 = {key: t.double()[:, None] for key, t in coef.items()}
    z, p = ref["z"], torch.exp(ref["z"] - c64["lse"])
    onehot = torch.zeros(n, v, dtype=F64)
    ok = y >= 0
    onehot[ok.nonzero()[:, 0], y[ok].long()] = 1.0
    cw = ref["w"][None, :]
    terms = c64["a"] * p + c64["b"] * onehot + c64["c"] * cw
    mag = (c64["a"] * p).abs() + (c64["b"] * onehot).abs() + (c64["c"] * cw).abs()
    # p = e exp(m_t - lse): e's rounding and the float32 exponentials
    pe = UNIT[dtype] + 4 * U32 * ((z - ref["m_col"]).abs() + (ref["m_col"] - c64["lse"]).abs() + 4) + 2 * dz_err
    p_abs = pe * p + TINY[dtype] * torch.exp(ref["m_col"] - c64["lse"])
    err = c64["a"].abs() * p_abs
    # z = m_t + ln e (the exact z_y in the target column)
    z_err = torch.where(onehot > 0, dz_err, 1.01 * UNIT[dtype] + 4 * U32 * (z.abs() + 1) + 2 * dz_err)
    if entropy:
        zm = z - c64["mu"]
        terms = terms + c64["d"] * p * zm
        mag = mag + (c64["d"] * p * zm).abs()
        err = err + c64["d"].abs() * (p_abs * zm.abs() + p * (z_err + 1e-6 * (c64["mu"].abs() + 1)))
    deriv, deriv_err = torch.ones_like(z), torch.zeros_like(z)
    if tr.softcap is not None:
        th = torch.tanh(ref["r"] / tr.softcap)
        deriv = 1 - th * th
        deriv_err = 2 * th.abs() * z_err * tr.temperature / tr.softcap + 4 * U32
    want = terms * deriv / tr.temperature
    bound = ((err + 4 * U32 * mag) * deriv + terms.abs() * deriv_err) / tr.temperature
    bound = bound + UNIT[dtype] * (want.abs() + bound) + TINY[dtype]     # dZ's own rounding
    _assert_within(dz, want, bound, "dZ")
    if n > 2:
        assert torch.all(dz[2] == 0)
    assert (dz.abs() > 0).sum() > dz.numel() // 2     # not vacuous


@each_twin
def test_fused_engine_runs_its_kernels(twin):
    """engine="fused" runs the tile kernels (the stages of `debug_intermediates`: the first chunk's tile values
    in the input dtype, equal to exp(z - m_t) of the float64 logits to bfloat16 rounding, instead of float32
    logits), engine="library" the library GEMM."""
    import importlib

    case = Case("stages", (21,), 32, 130, "bfloat16", bias=True, ignore_frac=0.0, seed=125)   # no reordering
    inp = make_inputs(case)
    debug = importlib.import_module(f"{twin.lib.__name__}.debug").debug_intermediates
    args = [twin.array(inp[k]) for k in ("x", "weight", "targets")]
    fused = debug(*args, bias=twin.array(inp["bias"]), engine="fused", chunk_rows=8)
    library = debug(*args, bias=twin.array(inp["bias"]), engine="library", chunk_rows=8)
    assert "logits" in library and "tiles" not in library
    assert "logits" not in fused and twin.dtype(fused["tiles"]) == "bfloat16"
    rows = layout(21, 8)[0]                                           # the first chunk takes the remainder
    assert tuple(fused["tiles"].shape) == (rows, 130)
    z = _exact_logits(inp["x"][:rows], inp["weight"], inp["bias"])
    m_col = torch.stack([z[:, i:i + TILE_N].max(dim=1).values for i in range(0, 130, TILE_N)], 1)
    e_ref = torch.exp(z - m_col.repeat_interleave(TILE_N, dim=1)[:, :130])
    _assert_within(torch.from_numpy(as_float64(fused["tiles"])), e_ref, (UNIT["bfloat16"] + 1e-4) * e_ref, "tiles")


# ============================================================================ 3. bad input
def _small_args(twin):
    g = torch.Generator().manual_seed(31)
    return (twin.array(torch.randn(6, 8, generator=g)), twin.array(torch.randn(13, 8, generator=g)),
            twin.array(torch.randint(0, 13, (6,), generator=g)))


@each_twin
@pytest.mark.parametrize("engine", ["bogus", "Fused", None])
def test_unknown_engine_raises(twin, engine):
    x, w, t = _small_args(twin)
    with pytest.raises(ValueError, match="engine"):
        twin.call(x, w, t, engine=engine)


@each_twin
@pytest.mark.parametrize("dtype,softcap", [("float32", 50.0), ("float16", 5.0)])
def test_fused_refuses_large_softcap_with_smoothing(twin, dtype, softcap):
    """engine="fused" with label smoothing under a softcap above the dtype's limit (43; float16 4.8, where
    float16 tile values underflow): ValueError naming the engine and the softcap."""
    x, w, t = _small_args(twin)
    cast = (lambda a: a.to(torch.float16)) if twin.name == "torch" else (lambda a: a.astype("float16"))
    if dtype == "float16":
        x, w = cast(x), cast(w)
    with pytest.raises(ValueError, match="softcap") as info:
        twin.call(x, w, t, engine="fused", softcap=softcap, label_smoothing=0.1)
    assert "engine" in str(info.value)


# ============================================================================ 4. determinism
@each_twin
@pytest.mark.parametrize("name", ["kept_bf16_rows12", "accumulated_f32_rows12"])
def test_fused_deterministic(twin, name):
    """Two runs (two compilations in JAX) give the same bits of every output, in both dZ plans."""
    _, dtype, h, chunk_rows, n = CHUNKING[name]
    case = _chunking_case(dtype, h, n)
    inp = make_inputs(case)
    first = twin.run(inp, case.options(), chunk_rows=chunk_rows)
    again = twin.run(inp, case.options(), chunk_rows=chunk_rows, fresh=True)
    assert set(first) == set(again)
    for key, v in first.items():
        if v is None:
            assert again[key] is None, key
            continue
        assert twin.dtype(v) == twin.dtype(again[key]), key
        assert np.array_equal(twin.bits(v), twin.bits(again[key])), key


def _exact_grad_operands(n, hidden, v, dt, seed):
    """dZ in 64ths of [-1, 1], w in 16ths of [-1, 1], x in quarters of [-2, 2]: every product and partial sum
    of dX and dW is exact in float32 (and every value exact in 16 bits), so every K order gives the same sums."""
    g = torch.Generator().manual_seed(seed)
    dz = torch.randint(-64, 65, (n, v), generator=g) / 64.0
    w = torch.randint(-16, 17, (v, hidden), generator=g) / 16.0
    x = torch.randint(-8, 9, (n, hidden), generator=g) / 4.0
    return dz.to(dt), w.to(dt), x.to(dt)


def _pair_after(chunk_sums):
    """The (hi bfloat16, lo int8) pair after each chunk's float32 sum s_c, by the rule fce_torch/kernels/
    grad_gemms.py states, here on int64 bit patterns: s = f(bits(hi) + 256 lo) + s_c in float32, hi = rne(s),
    lo = rne((bits(s) - bits(hi)) / 256) clipped to +-127."""
    hi = lo = None
    for s_c in chunk_sums:
        s = s_c.float() if hi is None else pair_value(hi, lo) + s_c.float()
        hi, lo = pair_split(s)
    return hi, lo


def _bits(f):
    return f.float().view(torch.int32).long()


def pair_split(s):
    """(hi, lo) of float32 s by NUMERICS' rule, computed apart from either twin's kernels."""
    hi = s.to(torch.bfloat16)
    d = (_bits(s) - _bits(hi)).double()
    return hi, torch.round(d / 256).clamp(-127, 127).to(torch.int8)


def pair_value(hi, lo):
    """The float32 whose bit pattern is hi's plus 256 lo."""
    return (_bits(hi) + 256 * lo.long()).to(torch.int32).view(torch.float32)


def _pair_edge_values():
    """float32 values where the pair's split is delicate: random magnitudes of both signs, values just below a
    power of two (hi rounds up across it), exact ties of lo's unit and of hi's, zeros, subnormals, the largest
    finite values, sums that overflow hi to infinity, infinities."""
    g = torch.Generator().manual_seed(7)
    rnd = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-140, 120, (4096,), generator=g).float())
    below = -torch.arange(1, 200).double()  # patterns just below 2**k: hi rounds up to 2**k
    pows = torch.tensor([1.0, 2.0 ** -100, 2.0 ** 100, 2.0 ** 127])
    near_pow = (pows[:, None].float().view(torch.int32).long() + below[None, :].long()).flatten()
    base = rnd[:512].view(torch.int32).long() & ~0xFFFF
    ties = torch.cat([base + 0x80, base + 0x180, base + 0x8000, base + 0x18000, base + 0x7F80, base + 0x8080])
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 3.0e38, -3.0e38, 3.3961e38, 3.4028235e38,
                            -3.4028235e38, float("inf"), float("-inf")])
    patterns = torch.cat([near_pow, -near_pow - 2 ** 31, ties]).to(torch.int32).view(torch.float32)
    return torch.cat([rnd, -rnd, patterns, special])


@triton.jit
def _pair_kernel(s_ptr, hi_ptr, lo_ptr, v_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(s_ptr + i, mask=i < n)
    hi, lo = tfm.pair_split(s, tl.bfloat16, tfm.ASM)
    tl.store(hi_ptr + i, hi, mask=i < n)
    tl.store(lo_ptr + i, lo, mask=i < n)
    tl.store(v_ptr + i, tfm.pair_value(hi, lo), mask=i < n)


def test_pair_split_and_value_edge_values():
    """Both twins' `pair_split` / `pair_value` (fce_torch's in the Triton interpreter, the JAX twin's as XLA CPU
    runs it) give the rule's bits on every value of `_pair_edge_values`, and the pair's value is s to 16
    significant bits: at most 2**-16 of |s| away (2**-15 where lo is clipped) with its low 8 pattern bits 0."""
    import jax
    import jax.numpy as jnp

    from fce_jax.kernels import fastmath as jfm

    s = _pair_edge_values()
    want_hi, want_lo = pair_split(s)
    want_v = pair_value(want_hi, want_lo)
    t_hi, t_lo, t_v = torch.empty_like(want_hi), torch.empty_like(want_lo), torch.empty_like(s)
    _pair_kernel[(triton.cdiv(s.numel(), 1024),)](s, t_hi, t_lo, t_v, s.numel(), BLOCK=1024)

    def jax_pair(s):
        hi, lo = jfm.pair_split(s, jnp.bfloat16)
        return hi, lo, jfm.pair_value(hi, lo)

    j_out = [to_torch(a) for a in jax.jit(jax_pair)(to_jax(s))]
    for impl, got in {"torch": (t_hi, t_lo, t_v), "jax": j_out}.items():
        for name, a, b in zip(("hi", "lo", "value"), got, (want_hi, want_lo, want_v)):
            assert _same_bits(a, b), (impl, name)
    finite = s.isfinite() & want_v.isfinite()
    assert (want_v.view(torch.int32)[finite] & 0xFF == 0).all()
    err = (want_v[finite].double() - s[finite].double()).abs()
    clipped = (_bits(s) - _bits(want_hi)).abs() >= 127 * 256 + 128  # lo would round to +-128
    bound = s[finite].double().abs() * torch.where(clipped[finite], 2.0 ** -15, 2.0 ** -16)
    assert (err <= torch.maximum(bound, torch.tensor(2.0 ** -141))).all()
    assert clipped.any() and (want_lo == -127).any() and (want_hi.float().isinf() & s.isfinite()).any()
    again = pair_split(want_v)  # the value rounds back to hi: a zero product leaves the pair's bits
    assert all(_same_bits(a[finite], b[finite]) for a, b in zip(again, (want_hi, want_lo)))
    assert (want_v[s.isinf()] == s[s.isinf()]).all()


def _same_bits(a, b):
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


@pytest.mark.parametrize("dtype, hidden", [("bfloat16", 144), ("float16", 64)])
def test_jax_mosaic_grad_gemms(dtype, hidden):
    """The JAX twin's Mosaic GPU dX and dW kernels (GradGemmConfig.mosaic, run in Mosaic GPU's interpret mode): dX over
    several V slices and in one, dW written, and dW accumulated over two chunks (the (hi, lo) pair for bfloat16,
    float32 for float16). On exact-sum operands each is bit for bit the exact result rounded as the contract says,
    as are the Pallas Triton kernels and fce_torch's; also with 256-wide tiles, whose loaded C blocks (ADD, PAIR)
    outnumber the two shared-memory slots, and with the compute warpgroups in turns (`pingpong`, dX of one slice and
    dW: 64-row tiles alternating between them, 2 to 13 K steps each off one ring of 2 stages that wraps, up to 13
    tiles per program). The last accumulation (`last=True`) gives the same dW, a pair's hi, without writing its lo
    (fce_torch's lo keeps dw_first's bits). Ragged everywhere: 37 rows, V = 296 (K not a multiple of tile_k; rows
    still of whole 16 bytes, as TMA needs, the int8 lo plane's too), H = 144 (not a multiple of tile_n), chunks of
    20 and 17 rows (dW's K)."""
    import jax.numpy as jnp

    from fce_core.config import GRAD_GEMM_INTERPRETER, GRAD_GEMM_MOSAIC_INTERPRETER
    from fce_core.plan import dx_slices
    from fce_jax.kernels import grad_gemms as jg
    from fce_torch.kernels import grad_gemms as tg

    n, v = 37, 296
    dt = getattr(torch, dtype)
    dz, w, x = _exact_grad_operands(n, hidden, v, dt, seed=hidden)
    assert dx_slices(n, hidden, v, GRAD_GEMM_MOSAIC_INTERPRETER) > 1
    assert dx_slices(n, hidden, 200, GRAD_GEMM_MOSAIC_INTERPRETER) == 1
    exact_dx = dz.double() @ w.double()
    sums = [dz[:20].double().T @ x[:20].double(), dz[20:].double().T @ x[20:].double()]
    want = {"dx": exact_dx.to(dt), "dx_one_slice": (dz[:, :200].double() @ w[:200].double()).to(dt),
            "dw": (sums[0] + sums[1]).to(dt),
            "acc": _pair_after(sums) if dt == torch.bfloat16 else ((sums[0] + sums[1]).float(),)}
    want["last"] = want["acc"][0]

    def jax_run(cfg, written=True):
        """`want`'s products by the JAX twin; without the WRITE ones (dx, dx_one_slice, dw) unless `written`."""
        jdt = getattr(jnp, dtype)

        def f(dz, w, x):
            first = jg.dw_first(dz[:20], x[:20], jdt, cfg=cfg)
            acc = jg.dw_accumulate(dz[20:], x[20:], first, cfg=cfg)
            last = jg.dw_accumulate(dz[20:], x[20:], first, cfg=cfg, last=True)
            out = {"last": last, "acc": acc if isinstance(acc, tuple) else (acc,)}
            if written:
                out.update(dx=jg.dx_gemm(dz, w, jdt, cfg=cfg), dw=jg.dw_gemm(dz, x, jdt, cfg=cfg),
                           dx_one_slice=jg.dx_gemm(dz[:, :200], w[:200], jdt, cfg=cfg))
            return out

        out = quick_jit(f)(to_jax(dz), to_jax(w), to_jax(x))
        return {k: tuple(map(to_torch, a)) if isinstance(a, tuple) else to_torch(a)
                for k, a in out.items()}

    acc = tg.dw_accumulate(dz[20:], x[20:], tg.dw_first(dz[:20], x[:20], dt))
    first = tg.dw_first(dz[:20], x[:20], dt)
    lo_before = first[1].clone() if isinstance(first, tuple) else None
    last = tg.dw_accumulate(dz[20:], x[20:], first, last=True)
    if lo_before is not None:
        assert torch.equal(first[1], lo_before)
    wide = dataclasses.replace(GRAD_GEMM_MOSAIC_INTERPRETER, tile_n=256)  # 4 loaded blocks: slots refilled
    pingpong = dataclasses.replace(GRAD_GEMM_MOSAIC_INTERPRETER, pingpong=True, num_stages=2)
    # the wide tiles matter where C is loaded (ADD, PAIR): their WRITE products are left out (seconds a kernel)
    runs = {"jax mosaic": jax_run(GRAD_GEMM_MOSAIC_INTERPRETER), "jax mosaic wide": jax_run(wide, written=False),
            "jax mosaic pingpong": jax_run(pingpong),
            "jax triton": jax_run(GRAD_GEMM_INTERPRETER),
            "torch": {"dx": tg.dx_gemm(dz, w, torch.empty(n, hidden, dtype=dt)),
                      "dx_one_slice": tg.dx_gemm(dz[:, :200].contiguous(), w[:200],
                                                 torch.empty(n, hidden, dtype=dt)),
                      "dw": tg.dw_gemm(dz, x, dt), "acc": acc if isinstance(acc, tuple) else (acc,),
                      "last": last}}
    for impl, got in runs.items():
        assert set(got) == (set(want) if impl != "jax mosaic wide" else {"acc", "last"}), impl
        for key, value in got.items():
            pairs = zip(value, want[key]) if key == "acc" else [(value, want[key])]
            assert all(_same_bits(a, b) for a, b in pairs), (impl, key)


# V and H multiples of 8 (rows of whole 16 bytes, as Mosaic GPU's TMA needs); H small against N, so that dW
# accumulates over the chunks (the plan keeps no dZ: test_fused_chunking_plans). Three chunks: chunks of 5 rows
# (8 and 6 chunks) traced the same launches, and each further chunk re-ran the loop's Mosaic GPU kernels in their
# interpret mode, at seconds a kernel
MOSAIC_ENGINE_CASES = {
    "bf16_pair_bias": (Case("mosaicbf", (37,), 16, 296, "bfloat16", bias=True, label_smoothing=0.1, seed=131), 13),
    "f16_f32_accumulator": (Case("mosaic16", (29,), 16, 200, "float16", z_loss=1e-3, seed=132), 10),
}


@pytest.mark.parametrize("name", list(MOSAIC_ENGINE_CASES))
def test_jax_fused_engine_on_mosaic_grads(monkeypatch, name):
    """The JAX fused engine with its GPU choice of gradient kernels, Mosaic GPU for 16-bit operands (here in
    Mosaic GPU's interpret mode, which the CPU default leaves out for speed): over several chunks, the bfloat16
    weight's (hi, lo) pair or float16's float32 accumulator, dX over V slices; loss, dx, dw, db and the stats
    within the SPEC bounds of float64, and the Mosaic kernels were the ones traced."""
    import jax.numpy as jnp

    from fce_core.config import GRAD_GEMM_INTERPRETER, GRAD_GEMM_MOSAIC_INTERPRETER
    from fce_jax.kernels import grad_gemms as jg
    from fce_jax.kernels import grad_gemms_mgpu
    from twins import JAX

    launches = []

    def counted(*args, mode, **kw):
        launches.append(mode)
        return mosaic_gemm(*args, mode=mode, **kw)

    mosaic_gemm = grad_gemms_mgpu.mosaic_gemm
    monkeypatch.setattr(grad_gemms_mgpu, "mosaic_gemm", counted)
    monkeypatch.setattr(jg, "_config", lambda a, b, outs=(), k_rows=None: (
        GRAD_GEMM_MOSAIC_INTERPRETER if jnp.dtype(a.dtype).itemsize == 2 else GRAD_GEMM_INTERPRETER))
    case, chunk_rows = MOSAIC_ENGINE_CASES[name]
    case = _fused(case)
    inp = make_inputs(case)
    out = JAX.run(inp, case.options(), chunk_rows=chunk_rows, fresh=True)
    _check(JAX, case, inp, out)
    assert {jg.WRITE, jg.ADD if case.dtype == "float16" else jg.PAIR} <= set(launches), launches


@pytest.mark.parametrize("k", [20, 32], ids=["mid_step", "whole_steps"])
def test_dw_over_the_first_rows_reads_no_row_past_them(k, monkeypatch):
    """dW over dZ's first k rows (`rows=k`: a kept dZ whose later chunks did not run, their rows unwritten) in
    each twin's launches, with NaN in every row past k of both operands: bit for bit the product of the first
    k rows alone, written, started and accumulated; k = 20 ends inside a K step of the interpreter's tiles
    (fce_torch cuts its TMA descriptors at K). The JAX twin's default launch takes the Triton lowering there
    (`_config`); Mosaic GPU, whose TMA loads whole steps, refuses that K and runs the one of whole steps."""
    import jax.numpy as jnp

    from fce_core.config import GRAD_GEMM_MOSAIC_INTERPRETER
    from fce_jax.kernels import grad_gemms as jg
    from fce_torch.kernels import grad_gemms as tg

    n, h, v = 48, 64, 304
    dz, _, x = _exact_grad_operands(n, h, v, torch.bfloat16, seed=k)
    ragged_dz, ragged_x = dz.clone(), x.clone()
    ragged_dz[k:], ragged_x[k:] = float("nan"), float("nan")
    bf = torch.bfloat16

    def torch_run(d, xx, rows):
        first = tg.dw_first(d, xx, bf, rows=rows)
        return [tg.dw_gemm(d, xx, bf, rows=rows), *first, *tg.dw_accumulate(d, xx, tuple(t.clone() for t in first),
                                                                            rows=rows)]

    def jax_run(d, xx, rows, cfg=None):
        def f(d, xx):
            first = jg.dw_first(d, xx, jnp.bfloat16, cfg=cfg, rows=rows)
            return [jg.dw_gemm(d, xx, jnp.bfloat16, cfg=cfg, rows=rows), *first,
                    *jg.dw_accumulate(d, xx, first, cfg=cfg, rows=rows)]
        return [to_torch(a) for a in quick_jit(f)(to_jax(d), to_jax(xx))]

    want = torch_run(dz[:k].contiguous(), x[:k].contiguous(), None)
    got = {"torch": torch_run(ragged_dz, ragged_x, k), "jax": jax_run(ragged_dz, ragged_x, k)}
    mosaic = GRAD_GEMM_MOSAIC_INTERPRETER
    if k % mosaic.tile_k:
        with pytest.raises(ValueError, match="whole K steps"):
            jax_run(ragged_dz, ragged_x, k, mosaic)
    else:
        got["jax mosaic"] = jax_run(ragged_dz, ragged_x, k, mosaic)
    for impl, outs in got.items():
        assert len(outs) == len(want) and all(_same_bits(a, b) for a, b in zip(outs, want)), impl
    # the GPU's choice: Mosaic GPU unless dW's K ends inside the operands off a whole step (64 rows there)
    monkeypatch.setattr(jg, "interpret_mode", lambda: False)
    a16 = jnp.zeros((160, 64), jnp.bfloat16)
    assert [jg._config(a16, a16, k_rows=r).mosaic for r in (None, 64, 100, 160)] == [True, True, False, True]


def test_jax_mosaic_grad_gemms_bad_input():
    """Mosaic GPU multiplies on wgmma only (float32 input: tf32): the IEEE float32 GEMM is refused, not
    rounded silently; and rows that TMA cannot move (not whole 16 bytes: H = 20 in bfloat16) are refused
    rather than faulting on the GPU."""
    import jax.numpy as jnp

    from fce_core.config import GRAD_GEMM_MOSAIC_INTERPRETER
    from fce_jax.kernels import grad_gemms as jg

    cfg = GRAD_GEMM_MOSAIC_INTERPRETER
    with pytest.raises(ValueError, match="16-bit operands"):
        jg.dx_gemm(jnp.ones((8, 16), jnp.float32), jnp.ones((16, 8), jnp.float32), jnp.float32, cfg=cfg)
    with pytest.raises(ValueError, match="multiples of 16 bytes: B has rows of 20 bfloat16"):
        jg.dx_gemm(jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 20), jnp.bfloat16), jnp.bfloat16, cfg=cfg)


def test_jax_mosaic_interpreter_refuses_a_small_pool(monkeypatch):
    """Mosaic GPU's interpret mode deadlocks when XLA CPU's thread pool is as small as the CI's 2 cores (its
    barrier waits hold pool threads): such a pool is refused with the setting that fixes it, not left to hang."""
    import jax.numpy as jnp

    from fce_core.config import GRAD_GEMM_MOSAIC_INTERPRETER
    from fce_jax.kernels import grad_gemms as jg

    monkeypatch.setenv("PJRT_NPROC", "2")
    with pytest.raises(RuntimeError, match="set PJRT_NPROC=8 or more before JAX starts"):
        a = jnp.ones((8, 16), jnp.bfloat16)
        jg.dx_gemm(a, jnp.ones((16, 8), jnp.bfloat16), jnp.bfloat16, cfg=GRAD_GEMM_MOSAIC_INTERPRETER)


def test_jax_mosaic_grad_gemms_lower_for_the_gpu(cuda_lowering):
    """The JAX twin's default gradient GEMMs as the GPU builds them (its launch tiles, 132 programs), lowered
    for CUDA on this CPU: 16-bit operands go to Mosaic GPU, whose Pallas lowering and layout inference accept
    every mode at the bench's shapes (dX with and without V slices, dW written, the (hi, lo) pair started and
    accumulated, float32 accumulation of float16), also under shard_map(check_vma=True); float32 operands and
    rows that TMA cannot move stay on the Triton lowering. What is left for the GPU is the compilation to PTX and
    the run itself."""
    import jax
    import jax.numpy as jnp

    from fce_core.config import GRAD_GEMM_MOSAIC as cfg
    from fce_core.plan import dx_slices
    from fce_jax.kernels import grad_gemms as jg

    s, bf, f16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float16, jnp.float32
    lowered = cuda_lowering

    # the default launch, then the compute warpgroups in turns (`pingpong`, which takes the unsliced GEMMs)
    for c, shapes in ((None, ((1024, 4096, 128256), (256, 4096, 128256), (1000, 640, 262144))),
                      (dataclasses.replace(cfg, pingpong=True), ((1024, 4096, 128256), (1000, 640, 262144)))):
        for n, h, v in shapes:
            dz, w, x, acc = s((n, v), bf), s((v, h), bf), s((n, h), bf), s((v, h), bf)
            calls = [(lambda a, b: jg.dx_gemm(a, b, bf, cfg=c), dz, w),
                     (lambda a, b: jg.dw_gemm(a, b, bf, cfg=c), dz, x),
                     (lambda a, b: jg.dw_first(a, b, bf, cfg=c), dz, x),
                     (lambda a, b, d, e: jg.dw_accumulate(a, b, (d, e), cfg=c), dz, x, acc, s((v, h), jnp.int8)),
                     (lambda a, b, d: jg.dw_accumulate(a, b, d, cfg=c), s((n, v), f16), s((n, h), f16),
                      s((v, h), f32))]
            for fn, *args in calls:
                assert "mosaic_gpu" in lowered(fn, *args)
    # under shard_map(check_vma=True), as the vocab-parallel engine runs them: outputs typed for it
    mesh, rep = jax.make_mesh((1,), ("model",)), jax.sharding.PartitionSpec()
    dz, w = s((256, 1024), bf), s((1024, 64), bf)
    for fn, *args in ((lambda a, b: jg.dx_gemm(a, b, bf), dz, w),
                      (lambda a, b, c, d: jg.dw_accumulate(a, b, (c, d)), dz, s((256, 64), bf), w,
                       s(w.shape, jnp.int8))):
        mapped = jax.shard_map(fn, mesh=mesh, in_specs=(rep,) * len(args), out_specs=rep, check_vma=True)
        assert "mosaic_gpu" in lowered(mapped, *args)
    # the Triton lowering where Mosaic GPU's TMA cannot go: float32 operands, rows not of whole 16 bytes
    for dt, v in ((f32, 1024), (bf, 1001)):
        text = lowered(lambda a, b: jg.dx_gemm(a, b, dt), s((256, v), dt), s((v, 64), dt))
        assert "mosaic_gpu" not in text and "xla.gpu.triton" in text
    # and dZ formed on the load (TileValues), at the bench's H = 640 chunk

    def on_load(e, m_tiles, y, lse, a, b, c, w, x):
        tv = jg.TileValues(e, m_tiles, y, {"lse": lse, "a": a, "b": b, "c": c}, 256)
        return jg.dx_gemm(tv, w, bf), jg.dw_first(tv, x, bf)

    text = lowered(on_load, s((512, 262144), bf), s((512, 1024), f32), s((512,), jnp.int32), *[s((512,), f32)] * 4,
                   s((262144, 640), bf), s((512, 640), bf))
    assert "mosaic_gpu" not in text and "xla.gpu.triton" in text
    assert dx_slices(256, 4096, 128256, cfg) > 1 and dx_slices(1024, 4096, 128256, cfg) == 1


def _mosaic_tile_inputs(n, v=320, scale=1.0, seed=17):
    """Exact operands (x in quarters times `scale`, a power of two; w in 16ths: every logit exact in float32,
    every K order the same sums): n rows, H = 48 (3 K steps of 16), V = v."""
    g = torch.Generator().manual_seed(seed + n)
    x = (torch.randint(-8, 9, (n, 48), generator=g) * (scale / 4.0)).to(torch.bfloat16)
    w = (torch.randint(-16, 17, (v, 48), generator=g) / 16.0).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), generator=g).to(torch.int32)
    return x, w, y


MOSAIC_TILE_CASES = {  # rows, V (tiles of 128 columns), logit scale, bias dtype, temperature, class weights
    "partial_blocks": (200, 320, 1.0, None, 1.0, False), "one_row_one_partial_tile": (1, 64, 1.0, None, 1.0, False),
    "huge_logits": (136, 192, 2.0 ** 10, None, 1.0, False), "bias_temperature": (72, 320, 1.0, "bfloat16", 0.7, False),
    "f32_bias_class_weights": (64, 192, 1.0, "float32", 1.0, True)}


@pytest.mark.parametrize("name", list(MOSAIC_TILE_CASES))
def test_jax_mosaic_logit_tiles(monkeypatch, name):
    """The JAX twin's logits GEMM on Mosaic GPU (GemmConfig.mosaic, in Mosaic GPU's interpret mode) against the
    Triton lowering's kernel and fce_torch's at the same tile width (128), on partial row blocks and tiles, one
    row, logits in the tens of thousands, a bias (16 or 32 bits), a temperature and class weights: the tile
    maxima, first argmax, target logit and q = Σ w_c (z - m_t) bit for bit (exact operands: every sum exact;
    past a temperature the maxima alone), s, pz and the stored e within their float32 and bfloat16 rounding of
    float64; the same partials without `store`."""
    import jax.numpy as jnp

    from fce_core.config import GEMM_MOSAIC_INTERPRETER
    from fce_jax.kernels import logit_tiles as jt
    from fce_jax.kernels import logit_tiles_mgpu as jm
    from fce_torch.kernels import logit_tiles as tt

    n, v, scale, bias_dtype, temperature, has_cw = MOSAIC_TILE_CASES[name]
    x, w, y = _mosaic_tile_inputs(n, v, scale)
    bias = None if bias_dtype is None else (torch.arange(v) % 17 / 8.0 - 1.0).to(getattr(torch, bias_dtype))
    cw = (torch.arange(v) % 5 / 4.0) if has_cw else None  # exact products with the exact logits
    xj, wj, yj = to_jax(x), to_jax(w), to_jax(y)
    bj, cj = (None if a is None else to_jax(a) for a in (bias, cw))
    mosaic, triton_cfg = (dataclasses.replace(c, tile_n=128) for c in (GEMM_MOSAIC_INTERPRETER, GEMM_INTERPRETER))
    spec, tr = StatsSpec(q=True, pz=True), Transform(temperature=temperature)
    assert jm.supports(xj, wj, bj, cj, tr, mosaic)
    calls = []
    monkeypatch.setattr(jt, "mosaic_logit_tiles", lambda *a, **kw: calls.append(kw["store"]) or
                        jm.mosaic_logit_tiles(*a, **kw))
    kw = dict(spec=spec, transform=tr, precision=None)
    e, parts = jt.logit_tiles(xj, wj, bj, yj, cj, cfg=mosaic, **kw)
    e_none, parts_none = jt.logit_tiles(xj, wj, bj, yj, cj, cfg=mosaic, store=False, **kw)
    _, parts_triton = jt.logit_tiles(xj, wj, bj, yj, cj, cfg=triton_cfg, **kw)
    _, parts_torch = tt.logit_tiles(x, w, bias, y.long(), cw, spec=spec, transform=tr, precision="ieee",
                                    cfg=triton_cfg)
    n_tiles = -(-v // 128)
    assert calls == [True, False] and e_none is None and set(parts) == {"m", "s", "amax", "zy", "q", "pz"}
    for key in parts:
        assert parts[key].shape == (n, n_tiles)
        assert np.array_equal(np.asarray(parts[key]), np.asarray(parts_none[key])), key
        # exact everywhere but past a temperature, where the interpreters' float32 division differs (XLA takes
        # x times 1 / T, and may contract it into the next subtraction): there the maxima alone
        if key in ("m", "amax", "zy") or key == "q" and temperature == 1.0:
            assert np.array_equal(as_float64(parts[key]), as_float64(parts_triton[key])), key
            if temperature == 1.0:
                assert np.array_equal(as_float64(parts[key]), as_float64(parts_torch[key])), key
    z = torch.full((n, n_tiles * 128), -math.inf, dtype=F64)
    r = x.double() @ w.double().T + (0.0 if bias is None else bias.double())  # exact
    z[:, :v] = r / temperature
    tiles = z.view(n, n_tiles, 128)
    m_t = tiles.max(dim=2).values
    z_err = 2 ** -23 * z.abs().nan_to_num(posinf=0.0, neginf=0.0) * (temperature != 1.0)  # the division's rounding
    _assert_within(torch.from_numpy(as_float64(parts["m"])), m_t, z_err.view(n, n_tiles, 128).amax(dim=2), "m")
    _assert_within(torch.from_numpy(as_float64(parts["zy"]).max(axis=1)), z.gather(1, y.long()[:, None])[:, 0],
                   z_err.amax(dim=1), "zy")
    d = (tiles - m_t[..., None]).nan_to_num(neginf=0.0)
    w_c = torch.ones(n_tiles * 128, dtype=F64) if cw is None else torch.cat([cw.double(), cw.new_zeros(
        n_tiles * 128 - v, dtype=F64)])
    d_w = d * w_c.view(n_tiles, 128)
    _assert_within(torch.from_numpy(as_float64(parts["q"])), d_w.sum(dim=2),
                   1e-5 * d_w.abs().sum(dim=2) + 256 * z_err.view(n, n_tiles, 128).amax(dim=2), "q")
    e64 = torch.exp(tiles - m_t[..., None])
    s64, pz64 = e64.sum(dim=2), (e64 * d).sum(dim=2)
    shift_err = 2 * z_err.view(n, n_tiles, 128).amax(dim=2, keepdim=True)  # of z - m_t
    _assert_within(torch.from_numpy(as_float64(parts["s"])), s64, 1e-5 * s64 + (e64 * shift_err).sum(dim=2), "s")
    _assert_within(torch.from_numpy(as_float64(parts["pz"])), pz64, 1e-5 * (e64 * d.abs()).sum(dim=2) + 1e-30
                   + (e64 * (1 + d.abs()) * shift_err).sum(dim=2), "pz")
    e_rtol = (2 ** -8 + shift_err).expand(n, n_tiles, 128).reshape(n, -1)[:, :v]
    e64 = e64.view(n, -1)[:, :v]
    _assert_within(torch.from_numpy(as_float64(e)), e64, e_rtol * e64 + 1e-6, "e")


def test_jax_mosaic_logit_tiles_leaves_to_the_triton_lowering():
    """What the Mosaic GPU logits GEMM leaves to the Triton lowering (`supports`): a softcap, class weights not
    in float32, V not a multiple of 64, float32 operands, a tile width below a leaf, and tile values into a larger
    array from a partial 64-row block or from a first row not known to be a multiple of 8. A bias, class weights
    and a temperature it takes."""
    import jax
    import jax.numpy as jnp

    from fce_core.config import GEMM_MOSAIC_INTERPRETER as mosaic
    from fce_jax.kernels import logit_tiles_mgpu as jm

    x, w = jnp.ones((200, 48), jnp.bfloat16), jnp.ones((320, 48), jnp.bfloat16)
    tr, f32 = Transform(), jnp.zeros((320,), jnp.float32)
    assert jm.supports(x, w, None, None, tr, mosaic) and jm.supports(x, w, f32, f32, Transform(temperature=2.0),
                                                                     mosaic)
    assert not jm.supports(x, w, None, f32.astype(jnp.bfloat16), tr, mosaic)
    assert not jm.supports(x, w, None, None, Transform(softcap=30.0), mosaic)
    assert not jm.supports(x, w[:312], None, None, tr, mosaic)
    assert not jm.supports(x[:130], w, None, None, tr, mosaic)  # x's TMA loads: rows a multiple of 8 past 8
    assert not jm.supports(x.astype(jnp.float32), w.astype(jnp.float32), None, None, tr, mosaic)
    assert not jm.supports(x, w, None, None, tr, dataclasses.replace(mosaic, tile_n=4))
    assert not jm.supports(x, w, None, None, tr, mosaic, out_rows=400)
    assert jm.supports(x[:192], w, None, None, tr, mosaic, out_rows=400, row0=8)
    assert not jm.supports(x[:192], w, None, None, tr, mosaic, out_rows=400, row0=4)
    traced = []
    jax.jit(lambda r: traced.extend(jm.supports(x[:192], w, None, None, tr, mosaic, into=f32, row0=r,
                                                row0_multiple=m) for m in (8, 4)))(0)
    assert traced == [True, False]


def test_jax_mosaic_logit_tiles_into_rows():
    """The Mosaic GPU logits GEMM writing its tile values into rows [row0, row0 + n) of a larger array, as the
    engine's kept dZ takes them (`into`, a traced row0), or of a new one (`out_rows`): 192 rows (the second
    tile's second warpgroup has none, and must not store), rows outside untouched, the same values as on their
    own."""
    import jax
    import jax.numpy as jnp

    from fce_core.config import GEMM_MOSAIC_INTERPRETER as mosaic
    from fce_jax.kernels import logit_tiles_mgpu as jm

    x, w, y = _mosaic_tile_inputs(192)
    xj, wj, yj = to_jax(x), to_jax(w), to_jax(y)
    kw = dict(has_q=False, has_pz=False, store=True, cfg=mosaic)
    alone, parts = jm.mosaic_logit_tiles(xj, wj, yj, **kw)
    into = jnp.full((448, 320), 3.0, jnp.bfloat16)
    got, parts_into = jax.jit(lambda i, r: jm.mosaic_logit_tiles(xj, wj, yj, into=i, row0=r, **kw))(into, 64)
    got = np.asarray(got.astype(jnp.float32))
    assert np.all(got[:64] == 3.0) and np.all(got[256:] == 3.0)
    assert np.array_equal(got[64:256], np.asarray(alone.astype(jnp.float32)))
    new, _ = jm.mosaic_logit_tiles(xj, wj, yj, row0=128, out_rows=448, **kw)
    assert new.shape == (448, 320) and np.array_equal(np.asarray(new[128:320]), np.asarray(alone))
    for key in parts:
        assert np.array_equal(np.asarray(parts[key]), np.asarray(parts_into[key])), key


def test_jax_mosaic_tree_sum_is_the_pairwise_tree():
    """`logit_tiles_mgpu.tree_sum` (its interpret branch) adds as fce_torch's `pairwise_sum` does, bit for bit,
    on values whose sum depends on the order."""
    import jax.numpy as jnp

    from fce_jax.kernels.logit_tiles_mgpu import tree_sum
    from fce_torch.sums import pairwise_sum

    g = torch.Generator().manual_seed(5)
    v = torch.randn(16, 256, generator=g) * torch.exp2(torch.randint(-20, 20, (16, 256), generator=g).float())
    got = np.asarray(tree_sum(jnp.asarray(v.numpy())))
    assert np.array_equal(got.view(np.uint32), pairwise_sum(v).numpy().view(np.uint32))
    assert not np.array_equal(got, v.sum(dim=1).numpy())  # the order matters for these values


def test_jax_mosaic_logit_tiles_lower_for_the_gpu(monkeypatch, cuda_lowering):
    """The Mosaic GPU logits GEMM as the GPU builds it (GEMM_MOSAIC, 132 programs), lowered for CUDA on this
    CPU at the bench's chunk shapes, with and without the tile values, and into a kept dZ from a traced row, also
    under shard_map(check_vma=True): Pallas' lowering and Mosaic GPU's layout inference accept it. And the tree's
    leaf: Mosaic GPU reduces 8 columns of its WGMMA layout as the pairwise
    tree adds them: a thread's two adjacent columns, then the lanes 1 apart, then 2 apart (read from the lowered
    module: a shuffle order that another jax version may change, so the GPU's twin check has the last word)."""
    import re

    import jax
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import jax.numpy as jnp
    from jax._src.pallas.mosaic_gpu import lowering as pallas_lowering

    from fce_core.config import GEMM, GEMM_MOSAIC
    from fce_jax.kernels import logit_tiles_mgpu as jm

    assert GEMM_MOSAIC.tile_n == GEMM.tile_n  # the partials' width: the same bits as the default's

    s, lowered = jax.ShapeDtypeStruct, cuda_lowering

    for n, h, v in ((1024, 4096, 128256), (512, 640, 262144), (768, 896, 151936), (200, 48, 320)):
        for store in (True, False):
            text = lowered(lambda x, w, y: jm.mosaic_logit_tiles(x, w, y, has_q=store, has_pz=store, store=store,
                                                                 cfg=GEMM_MOSAIC),
                           s((n, h), jnp.bfloat16), s((v, h), jnp.bfloat16), s((n,), jnp.int32))
            assert "mosaic_gpu" in text
    # into the kept dZ from a traced row, also under shard_map(check_vma=True) as the vocab-parallel engine runs it
    mesh, rep = jax.make_mesh((1,), ("model",)), jax.sharding.PartitionSpec()
    args = (s((512, 640), jnp.bfloat16), s((1024, 640), jnp.bfloat16), s((512,), jnp.int32),
            s((2048, 1024), jnp.bfloat16), s((), jnp.int32))

    def into(x, w, y, kept, r0):
        return jm.mosaic_logit_tiles(x, w, y, has_q=True, has_pz=False, store=True, cfg=GEMM_MOSAIC, into=kept, row0=r0)

    assert "mosaic_gpu" in lowered(into, *args)
    mapped = jax.shard_map(into, mesh=mesh, in_specs=(rep,) * 5, out_specs=rep, check_vma=True)
    assert "mosaic_gpu" in lowered(mapped, *args)

    modules, warpgroup_level = [], []
    lower_dialect = pallas_lowering.mgpu.lower_mgpu_dialect

    def keep(module, *args, **kw):
        warpgroup_level.append(str(module))
        out = lower_dialect(module, *args, **kw)
        modules.append(str(module))
        return out

    monkeypatch.setattr(pallas_lowering.mgpu, "lower_mgpu_dialect", keep)
    # No reduction of a warpgroup's rows to one value (`vector.reduction`; the row statistics are
    # multi_reductions): Mosaic GPU gives its cross-warp scratch one place per kernel, which both compute
    # warpgroups would write at once.
    for cw in (None, s((1024,), jnp.float32)):
        lowered(lambda x, w, y, *c: jm.mosaic_logit_tiles(x, w, y, has_q=True, has_pz=True, store=True,
                                                          cfg=GEMM_MOSAIC, class_weights=c[0] if c else None),
                s((256, 640), jnp.bfloat16), s((1024, 640), jnp.bfloat16), s((256,), jnp.int32),
                *([cw] if cw else []))
        assert "vector.multi_reduction" in warpgroup_level[-1]
        assert "vector.reduction " not in warpgroup_level[-1]

    def body(x_gmem, o_gmem):
        @functools.partial(pl.run_scoped, xs=plgpu.SMEM((64, 16), jnp.float32), os_=plgpu.SMEM((64,), jnp.float32))
        def _(xs, os_):
            os_[...] = jm.tree_sum(plgpu.layout_cast(xs[...], plgpu.Layout.WGMMA))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(os_, o_gmem)
            plgpu.wait_smem_to_gmem(0)

    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    kernel = pl.kernel(body, out_type=s((64,), jnp.float32), mesh=plgpu.Mesh(grid=(1,), grid_names=("sm",)),
                       compiler_params=params)
    lowered(kernel, s((64, 16), jnp.float32))
    steps = re.findall(r"vector\.extract %\S+\[(\d)\] : f32 from vector<2xf32>|shfl\.sync bfly %\S+, %\S+, %c(\d+)_i32",
                       modules[-1])
    # two leaves of 8 columns, two rows per thread: each column pair, then lanes 1 and 2 apart
    assert [a or b for a, b in steps] == ["0", "1", "1", "2"] * 4


MOSAIC_LOGITS_CASES = {  # V a multiple of 64 and no bias: the Mosaic GPU logits kernel's cases
    "chunks_smoothing": (Case("mosaiclt", (200,), 16, 320, "bfloat16", label_smoothing=0.1, seed=141), 64),
    "kept_dz_z_loss": (Case("mosaickept", (136,), 256, 320, "bfloat16", z_loss=1e-3, seed=142), 64),
}


@pytest.mark.parametrize("name", list(MOSAIC_LOGITS_CASES))
def test_jax_fused_engine_on_mosaic_logits(monkeypatch, name):
    """The JAX fused engine with its logits GEMM on Mosaic GPU (GEMM_MOSAIC_INTERPRETER in its interpret mode):
    chunks of 64 rows after a first of 8, their tile values written
    new (`chunks_smoothing`) or into the kept dZ from a traced row (`kept_dz_z_loss`, whose first chunk of 8
    rows takes the Triton lowering: not whole 64-row blocks); loss, dx, dw and the stats within the SPEC
    bounds of float64, and the Mosaic logits kernel ran on the later chunks."""
    from fce_core.config import GEMM_MOSAIC_INTERPRETER
    from fce_jax.kernels import logit_tiles as jt
    from twins import JAX

    launches = []
    mosaic_logit_tiles = jt.mosaic_logit_tiles
    monkeypatch.setattr(jt, "mosaic_logit_tiles", lambda x, *a, **kw: launches.append(x.shape[0]) or
                        mosaic_logit_tiles(x, *a, **kw))
    monkeypatch.setattr(jt, "gemm_config", lambda cfg=None, rows=None: cfg or GEMM_MOSAIC_INTERPRETER)
    case, chunk_rows = MOSAIC_LOGITS_CASES[name]
    case = _fused(case)
    inp = make_inputs(case)
    out = JAX.run(inp, case.options(), chunk_rows=chunk_rows, fresh=True)
    _check(JAX, case, inp, out)
    kept = name.startswith("kept")
    assert launches and set(launches) == ({64} if kept else {8, 64}), launches
    assert GEMM_MOSAIC_INTERPRETER.tile_n == GEMM_INTERPRETER.tile_n  # the same partials as the default's

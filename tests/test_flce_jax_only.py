"""fce_jax.fused_lce behaviour that only JAX has (SPEC §1): the transformations (the plain call, jax.jit,
jax.grad, jax.value_and_grad, jax.vjp called twice), argument errors raised while tracing, the loss-only primal
program, no [N, V] buffer in the compiled program, traced normalizer, and the JAX counterpart of autocast.
Everything else is checked for both twins in test_flce.py (whose JAX runs are jax.jit(jax.vjp) with traced
targets and class weights)."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fce_jax import fused_lce
from helpers import assert_close_to_reference, restrict_lse, tolerances, to_jax
from parity.cases import Case, make_inputs
from parity.reference import flce_reference, rel_err
from test_flce import BAD_INPUTS, VALUE_CHECKS, _bad_call, _names
from twins import JAX, check_flce, quick_jit


def _arrays(inp):
    return {k: to_jax(v) for k, v in inp.items()}


# Errors found from shapes, dtypes and static options are raised while tracing, under jit too.
JIT_BAD = [k for k in BAD_INPUTS if k not in VALUE_CHECKS and k != "x_float64"]


@pytest.mark.parametrize("bad", JIT_BAD)
def test_bad_input_raises_under_jit(bad):
    x, w, t, kw, name = _bad_call(JAX, bad)
    arrays = {k: v for k, v in kw.items() if k in ("bias", "class_weights")}
    static = {k: v for k, v in kw.items() if k not in arrays}
    f = jax.jit(lambda x, w, t, arrays: fused_lce(x, w, t, **arrays, **static))
    with pytest.raises(ValueError) as info:
        f(x, w, t, arrays)
    assert _names(str(info.value), name), f"message does not name {name!r}: {info.value}"


def test_jit_grad_value_and_grad():
    """The plain call, jax.jit, jax.grad and jax.value_and_grad (jitted, and value_and_grad also eagerly) all
    meet the SPEC bounds."""
    case = Case("transforms", (20,), 16, 130, "float32", bias=True, label_smoothing=0.1, z_loss=1e-4, seed=44)
    inp = make_inputs(case)
    a = _arrays(inp)
    t = a["targets"]

    def f(x, w, b):
        return fused_lce(x, w, t, bias=b, chunk_rows=8, **case.options())

    def f_eager(x, w, b):   # one chunk: eager dispatch in interpret mode is slow per operation
        return fused_lce(x, w, t, bias=b, **case.options())

    ref = flce_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"], **case.options())
    loss_tol, _ = tolerances("float32")
    xs = (a["x"], a["weight"], a["bias"])
    for loss in (f_eager(*xs), quick_jit(f)(*xs)):
        assert rel_err(loss, ref["loss"]) <= loss_tol
    dx, dw, db = quick_jit(jax.grad(f, argnums=(0, 1, 2)))(*xs)
    assert_close_to_reference({"loss": ref["loss"], "dx": dx, "dw": dw, "db": db}, ref, "float32")
    for vag in (quick_jit(jax.value_and_grad(f, argnums=(0, 1, 2))), jax.value_and_grad(f_eager, argnums=(0, 1, 2))):
        loss, (dx, dw, db) = vag(*xs)
        assert_close_to_reference({"loss": loss, "dx": dx, "dw": dw, "db": db}, ref, "float32")


def _dot_output_shapes(jaxpr_text):
    return [tuple(int(d) for d in m.split(",")) for m in re.findall(r"f32\[([\d,]+)\] = dot_general", jaxpr_text)]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_only_path(reduction):
    """The primal call without differentiation, under jit: the same loss and stats bits as the differentiated
    call, and only logits GEMMs ([rows, V]: no dX / dW GEMM) in its program."""
    case = Case("nograd", (37,), 32, 777, "float32", bias=True, reduction=reduction, label_smoothing=0.1,
                z_loss=1e-4, seed=35)
    inp = make_inputs(case)
    a = _arrays(inp)
    t = a["targets"]

    def f(x, w, b):
        return fused_lce(x, w, t, bias=b, return_stats=True, chunk_rows=8, **case.options())

    xs = (a["x"], a["weight"], a["bias"])
    loss_p, stats_p = quick_jit(f)(*xs)

    def total(x, w, b):
        loss, stats = f(x, w, b)
        return loss.sum(), (loss, stats)

    (_, (loss_g, stats_g)), _ = quick_jit(jax.value_and_grad(total, argnums=(0, 1, 2), has_aux=True))(*xs)
    assert np.array_equal(np.asarray(loss_p), np.asarray(loss_g))
    for k in ("lse", "z_loss", "accuracy", "argmax"):
        assert np.array_equal(np.asarray(stats_p[k]), np.asarray(stats_g[k])), k
    shapes = _dot_output_shapes(str(jax.make_jaxpr(f)(*xs)))
    assert shapes and all(s[-1] == 777 and s[0] <= 8 for s in shapes), shapes
    grad_shapes = _dot_output_shapes(str(jax.make_jaxpr(jax.grad(lambda *a: total(*a)[0], argnums=(0, 1, 2)))(*xs)))
    assert any(s[-1] == 32 for s in grad_shapes), grad_shapes     # the differentiated program does have them
    check_flce(case, inp, {"loss": loss_p, **stats_p})


@pytest.mark.parametrize("dtype,reduction", [("float32", "mean"), ("bfloat16", "none")])
def test_no_logits_buffer_materialized(dtype, reduction):
    """Compile (do not run) jit(value_and_grad) at N=2048, V=4096, chunk_rows=256: no [N, V] buffer (nor any
    buffer of >= N*V/2 elements) in the optimized HLO, and XLA's temporary memory < N*V*4 bytes."""
    n, h, v = 2048, 16, 4096
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]

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


@pytest.mark.parametrize("engine", ["library", "fused"])
def test_no_permuted_copy_of_x_or_dx(engine):
    """The valid-first order of the rows (traced: the ignored rows are not known while tracing) is applied per
    chunk: jit(value_and_grad) at N=2048, H=256, chunk_rows=256 has no gather of a whole [N, H] array (a
    permuted copy of x, or dX taken back to the caller's order), only the chunks' [256, H] ones; float32, so
    that XLA CPU's float normalization adds no buffers of its own. The values: test_flce.py's ignored rows."""
    n, h, v = 2048, 256, 512

    def f(x, w, t):
        return fused_lce(x, w, t, chunk_rows=256, engine=engine)

    text = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(
        jax.ShapeDtypeStruct((n, h), jnp.float32), jax.ShapeDtypeStruct((v, h), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.int32)).as_text()
    gathers = [line.split("->")[-1] for line in text.splitlines() if '"stablehlo.gather"' in line]
    assert any(f"tensor<256x{h}xf32>" in g for g in gathers), gathers
    assert not any(f"tensor<{n}x{h}xf32>" in g for g in gathers), gathers


@pytest.mark.parametrize("engine", ["library", "fused"])
def test_every_chunk_running_is_a_loop_of_known_length(engine):
    """XLA reads a traced loop bound on the host before every step, the device idling meanwhile. With the
    valid-first plan (N=2048, chunk_rows=256: 8 chunks) the sweep runs under a conditional on "every chunk
    runs" whose branch loops over the 7 later chunks with a known trip count, and the conditional takes no
    buffer that the chunks update in place (XLA would copy it): no copy of a [rows, V] dZ or a [V, H] dW."""
    n, h, v, rows = 2048, 256, 512, 256
    xs, ws, ts = (jax.ShapeDtypeStruct((n, h), jnp.bfloat16), jax.ShapeDtypeStruct((v, h), jnp.bfloat16),
                  jax.ShapeDtypeStruct((n,), jnp.int32))

    def f(x, w, t):
        return fused_lce(x, w, t, chunk_rows=rows, engine=engine)

    text = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(xs, ws, ts).compile().as_text()
    assert " conditional(" in text
    assert '"known_trip_count":{"n":"7"}' in text, re.findall(r'known_trip_count":\{"n":"\d+"', text)
    assert not re.search(rf"= bf16\[({n}|{rows}),{v}\]\{{[0-9,]*\}} copy\(", text)
    assert not re.search(rf"= (f32|bf16|s8)\[{v},{h}\]\{{[0-9,]*\}} copy\(", text)


@pytest.mark.parametrize("engine", ["library", "fused"])
def test_one_chunk_keeps_the_callers_row_order(engine):
    """With one chunk (`Plan.puts_valid_first` false) every row runs anyway, so the rows keep the caller's
    order: jit(value_and_grad) at N=256 in one chunk gathers and scatters no rows of x or dX (the valid-first
    permutation's copies were 3.5 MiB over the memory budget at N = 256, H = 4096 on the H200)."""
    n, h, v = 256, 64, 512

    def f(x, w, t):
        return fused_lce(x, w, t, engine=engine)

    text = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(
        jax.ShapeDtypeStruct((n, h), jnp.float32), jax.ShapeDtypeStruct((v, h), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.int32)).as_text()
    moves = [line.split("->")[-1] for line in text.splitlines()
             if '"stablehlo.gather"' in line or '"stablehlo.scatter"' in line]
    assert not any(f"x{h}xf32>" in m for m in moves), moves


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_repeated_backward_no_compounding(reduction):
    """The VJP function of one forward called twice with cotangent 2.5: identical results, equal to the
    reference with grad_output 2.5."""
    case = Case("retain", (2, 9), 32, 777, "bfloat16", bias=True, reduction=reduction, z_loss=1e-4, seed=38)
    inp = make_inputs(case)
    a = _arrays(inp)
    t = a["targets"]
    forward = quick_jit(lambda x, w, b: jax.vjp(
        lambda x, w, b: fused_lce(x, w, t, bias=b, chunk_rows=8, **case.options()), x, w, b))
    loss, vjp = forward(a["x"], a["weight"], a["bias"])       # vjp: a jax.tree_util.Partial (residuals inside)
    g = jnp.full(loss.shape, 2.5, jnp.float32)
    backward = quick_jit(lambda vjp, g: vjp(g))
    first, second = backward(vjp, g), backward(vjp, g)
    for p, q in zip(first, second):
        assert p.dtype == q.dtype and np.array_equal(np.asarray(p), np.asarray(q))
    check_flce(case, inp, {"loss": loss, "dx": first[0], "dw": first[1], "db": first[2]}, grad_output=2.5)


def test_traced_normalizer():
    """A normalizer pair passed through jax.jit (traced arrays) gives the reference's loss and gradients, as the
    same pair given as Python numbers does. (Not compared bit for bit: in interpret mode XLA compiles the
    kernels' arithmetic, and a constant denominator is folded differently from a traced one.)"""
    case = Case("norm", (29,), 32, 777, "float32", class_weights=True, z_loss=1e-2, label_smoothing=0.1,
                seed=51)
    inp = make_inputs(case)
    a = _arrays(inp)

    def f(x, w, cw, norm):
        return fused_lce(x, w, a["targets"], class_weights=cw, normalizer=(norm[0], norm[1]), **case.options())

    norm = jnp.asarray([37.5, 20.0], jnp.float32)
    loss, (dx, dw) = quick_jit(jax.value_and_grad(f, argnums=(0, 1)))(a["x"], a["weight"], a["class_weights"], norm)
    check_flce(case, inp, {"loss": loss, "dx": dx, "dw": dw}, normalizer=(37.5, 20.0))
    static = JAX.run(inp, {**case.options(), "normalizer": (37.5, 20.0)}, wrt=("x", "weight"))
    check_flce(case, inp, static, normalizer=(37.5, 20.0))
    assert rel_err(loss, static["loss"]) <= 1e-6 and rel_err(dx, static["dx"]) <= 1e-6


def test_autocast_bf16():
    """The JAX counterpart of autocast: float32 parameters cast to bfloat16 inside the differentiated function.
    Float32 loss and gradients, close to the reference of the bfloat16-cast inputs."""
    case = Case("autocast", (3, 7), 32, 777, "float32", bias=True, seed=39)
    inp = make_inputs(case)
    a = _arrays(inp)
    t = a["targets"]

    def f(x, w, b):
        bf = jnp.bfloat16
        return fused_lce(x.astype(bf), w.astype(bf), t, bias=b.astype(bf), return_stats=True, chunk_rows=8)

    (loss, stats), (dx, dw, db) = quick_jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
        a["x"], a["weight"], a["bias"])
    assert loss.dtype == jnp.float32
    assert dx.dtype == dw.dtype == db.dtype == jnp.float32
    bf = {k: inp[k].bfloat16() for k in ("x", "weight", "bias")}
    ref = flce_reference(bf["x"], bf["weight"], inp["targets"], bias=bf["bias"])
    out = {"loss": loss, "lse": stats["lse"], "dx": dx, "dw": dw, "db": db}
    out, ref = restrict_lse(out, ref, inp["targets"])
    assert_close_to_reference(out, ref, "bfloat16")

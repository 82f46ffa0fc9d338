"""The JAX twin's dZ pass on Mosaic GPU (fce_jax/kernels/tile_dlogits_mgpu.py, `DzPassConfig.mosaic`): dZ within
its rounding of a float64 reference, and every element bitwise the Triton lowering's pass (whose bits
tests/test_fused_engine.py ties to fce_torch's), on fresh random tile values over blocks that cross the last row
and column; which tile values it takes; and the kernel lowered for CUDA at a real chunk's shape (Mosaic GPU's
layout inference, which the interpreter does not run). On the CPU in the GPU interpret mode; with
FCE_TEST_DEVICE=cuda (`tools/gpu_run.sh gputests`) the same checks run the compiled kernels on the GPU."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fce_core.config import DZ_PASS, GEMM, GEMM_INTERPRETER
from fce_core.options import Transform
from fce_core.plan import cdiv
from fce_jax.kernels import tile_dlogits_mgpu
from fce_jax.kernels.tile_dlogits import tile_dlogits

MOSAIC = dataclasses.replace(DZ_PASS, mosaic=True)
S = jax.ShapeDtypeStruct
CASES = {  # id: (rows, V, dtype, class weights, entropy, softcap, temperature, logit scale)
    "bf16_two_row_blocks": (70, 136, jnp.bfloat16, False, False, None, 1.0, 3.0),
    "bf16_cw_entropy": (21, 128, jnp.bfloat16, True, True, None, 1.0, 3.0),
    "f16_cw_softcap_temperature": (17, 104, jnp.float16, True, False, 3.0, 0.7, 2.0),
    "bf16_one_row_huge": (1, 72, jnp.bfloat16, False, True, 10.0, 1.0, 60.0),
}


def _inputs(n, v, dtype, cw, entropy, scale, seed):
    """Tile values e = exp(z - m_t) of logits z [n, v] (tiles of the interpreter's tile_n), their maxima, targets,
    the exact target logits, and head coefficients (lse from float64; row 0 without a gradient)."""
    rng = np.random.default_rng(seed)
    tile_n = GEMM_INTERPRETER.tile_n
    z = rng.standard_normal((n, v)) * scale
    pad = -v % tile_n
    m_t = np.pad(z, ((0, 0), (0, pad)), constant_values=-np.inf).reshape(n, -1, tile_n).max(2)
    e = np.exp(z - np.repeat(m_t, tile_n, 1)[:, :v]).astype(dtype)
    y = rng.integers(0, v, n).astype(np.int32)
    coef = {"lse": np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1), "a": rng.standard_normal(n),
            "b": rng.standard_normal(n), "c": rng.standard_normal(n) * 0.05}
    if entropy:
        coef.update(d=rng.standard_normal(n), mu=rng.standard_normal(n))
    for k in ("a", "b", "c", "d"):
        if k in coef:
            coef[k][0] = 0.0
    return dict(e=e, m_t=m_t.astype(np.float32), y=y, zy=z[np.arange(n), y].astype(np.float32),
                cw=rng.uniform(0.5, 2.0, v).astype(np.float32) if cw else None,
                coef={k: c.astype(np.float32) for k, c in coef.items()})


def _reference(inp, tr):
    """dZ in float64 from the same float32 inputs, the tile values as stored (z: the logits after the softcap
    and the temperature, as the tile values hold them)."""
    e = np.asarray(inp["e"], np.float64)
    n, v = e.shape
    c = {k: np.asarray(a, np.float64)[:, None] for k, a in inp["coef"].items()}
    m_t = np.repeat(inp["m_t"].astype(np.float64), GEMM_INTERPRETER.tile_n, 1)[:, :v]
    p = e * np.exp(m_t - c["lse"])
    is_y = np.arange(v)[None, :] == inp["y"][:, None]
    cw = 1.0 if inp["cw"] is None else inp["cw"].astype(np.float64)[None, :]
    dz = c["a"] * p + c["b"] * is_y + c["c"] * cw
    z = np.where(is_y, inp["zy"].astype(np.float64)[:, None], m_t + np.log(np.where(e > 0, e, 1.0)))
    if "d" in c:
        dz = dz + c["d"] * p * (z - c["mu"])
    if tr.softcap is not None:
        dz = dz * (1.0 - (z * tr.temperature / tr.softcap) ** 2)  # z T = cap tanh(r / cap): the tanh is z T / cap
    dz = dz / tr.temperature
    live = (c["a"] != 0) | (c["b"] != 0) | (c["c"] != 0) | (c.get("d", 0.0) != 0)
    return np.where(live, dz, 0.0)


def _pass(inp, tr, cfg):
    args = [jnp.asarray(inp[k]) for k in ("e", "m_t", "y", "zy")]
    cw = None if inp["cw"] is None else jnp.asarray(inp["cw"])
    coef = {k: jnp.asarray(c) for k, c in inp["coef"].items()}
    return np.asarray(jax.jit(lambda e, m, y, zy, cw, coef: tile_dlogits(
        e, m, y, zy, cw, coef, transform=tr, cfg=GEMM_INTERPRETER, dz_cfg=cfg))(*args, cw, coef))


@pytest.fixture
def taken(monkeypatch):
    """The calls that took the Mosaic GPU pass (a list, one entry each)."""
    calls = []
    run = tile_dlogits_mgpu.mosaic_tile_dlogits
    monkeypatch.setattr(tile_dlogits_mgpu, "mosaic_tile_dlogits", lambda *a, **k: calls.append(1) or run(*a, **k))
    return calls


@pytest.mark.parametrize("name, wgs", [(name, 2) for name in CASES] + [("bf16_two_row_blocks", 1)])
def test_mosaic_dz_pass_bits_and_values(name, wgs, taken):
    """With two compute warpgroups (the default) and with one."""
    n, v, dtype, cw, entropy, softcap, temperature, scale = CASES[name]
    inp = _inputs(n, v, dtype, cw, entropy, scale, seed=len(name))
    tr = Transform(softcap=softcap, temperature=temperature)
    got = _pass(inp, tr, dataclasses.replace(MOSAIC, compute_wgs=wgs))
    assert taken, "the Mosaic GPU pass was not taken"
    lowering = _pass(inp, tr, DZ_PASS)
    assert np.array_equal(got.view(np.uint16), lowering.view(np.uint16))
    want = _reference(inp, tr)
    unit = 2.0 ** -8 if dtype == jnp.bfloat16 else 2.0 ** -11
    # dZ's rounding, e's rounding carried into z and through the softcap's derivative, and float32's
    tol = 4 * unit * (np.abs(want) + np.abs(want).max() * 1e-3) + 1e-30
    assert (np.abs(got.astype(np.float64) - want) <= tol).all()
    assert not got[0].any()  # the row without a gradient


def test_mosaic_dz_pass_takes_only_whole_16_bit_arrays():
    """The pass needs 16-bit tile values, rows of whole 16 bytes, and all of the array's rows or whole 128-row
    blocks from a multiple of 8; elsewhere the Triton lowering's kernel runs."""
    tile_n = GEMM_INTERPRETER.tile_n

    def ok(e_shape, dtype=jnp.bfloat16, n=None, row0=0, row0_multiple=1):
        n = e_shape[0] if n is None else n
        return tile_dlogits_mgpu.supports(S(e_shape, dtype), S((n, 5), jnp.float32), row0, MOSAIC, tile_n,
                                          row0_multiple)

    assert ok((70, 136))
    assert not ok((70, 136), jnp.float32)
    assert not ok((70, 130))
    assert not ok((72, 136), n=70)
    assert not ok((70, 136), row0=2)
    assert not ok((70, 136), row0=jnp.int32(0))
    assert ok((300, 136), n=128, row0=8) and ok((300, 136), n=256, row0=jnp.int32(0), row0_multiple=64)
    assert not ok((300, 136), n=128, row0=4) and not ok((300, 136), n=192, row0=8)


@pytest.mark.parametrize("cw, entropy, softcap, temperature, kept", [(False, False, None, 1.0, False),
                                                                     (True, True, 30.0, 0.7, False),
                                                                     (False, False, None, 1.0, True)])
def test_mosaic_dz_pass_lowers_for_cuda(cuda_lowering, cw, entropy, softcap, temperature, kept):
    """A chunk of the bench's H = 640 plan, and a kept group's chunk of 1024 rows at a traced row of 4096."""
    n, v = (1024, 128256) if kept else (768, 262144)
    tr = Transform(softcap=softcap, temperature=temperature)
    coef = {k: S((n,), jnp.float32) for k in ("lse", "a", "b", "c", *(("d", "mu") if entropy else ()))}
    text = cuda_lowering(lambda e, r0, m, y, zy, cw, coef: tile_dlogits(
        e, m, y, zy, cw, coef, transform=tr, row0=r0 if kept else 0, row0_multiple=n, cfg=GEMM, dz_cfg=MOSAIC),
        S((4096 if kept else n, v), jnp.bfloat16), S((), jnp.int32), S((n, cdiv(v, GEMM.tile_n)), jnp.float32),
        S((n,), jnp.int32), S((n,), jnp.float32), S((v,), jnp.float32) if cw else None, coef)
    assert "mosaic_gpu" in text and "triton_kernel_call" not in text


def test_engine_with_the_mosaic_dz_pass_gives_the_same_bits(monkeypatch, taken):
    """fce_jax's fused engine, gradients included, in chunks: the same loss, dX and dW with the pass on Mosaic GPU
    as on the Triton lowering."""
    import fce_jax
    from fce_jax.kernels import tile_dlogits as td

    rng = np.random.default_rng(7)
    n, h, v = 100, 32, 136
    x = jnp.asarray(rng.standard_normal((n, h)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((v, h)) / h ** 0.5, jnp.bfloat16)
    y = jnp.asarray(rng.integers(0, v, n).astype(np.int32)).at[3].set(-100)

    def grads():
        loss_fn = lambda x, w: fce_jax.fused_lce(x, w, y, engine="fused", label_smoothing=0.1, chunk_rows=48)
        return [np.asarray(a).view(np.uint16 if a.dtype == jnp.bfloat16 else np.uint32)
                for a in (loss_fn(x, w), *jax.grad(loss_fn, (0, 1))(x, w))]

    lowering = grads()
    assert not taken
    monkeypatch.setattr(td, "DZ_PASS", MOSAIC)
    mosaic = grads()
    assert taken, "the Mosaic GPU pass was not taken"
    for a, b in zip(lowering, mosaic):
        assert np.array_equal(a, b)


def test_mosaic_dz_pass_into_rows_of_a_larger_array(taken):
    """The kept dZ's group: whole 128-row blocks at a traced first row of a larger array, as the Triton lowering's
    pass writes them, every other row untouched."""
    n, v, extra, row0 = 256, 136, 40, 16
    inp = _inputs(n, v, jnp.bfloat16, True, False, 3.0, seed=11)
    rng = np.random.default_rng(12)
    big = rng.standard_normal((n + extra, v)).astype(jnp.bfloat16)
    big[row0:row0 + n] = inp["e"]
    args = [jnp.asarray(inp[k]) for k in ("m_t", "y", "zy")]
    coef = {k: jnp.asarray(c) for k, c in inp["coef"].items()}

    def run(cfg):
        return np.asarray(jax.jit(lambda e, r0, m, y, zy, cw, coef: tile_dlogits(
            e, m, y, zy, cw, coef, transform=Transform(), row0=r0, row0_multiple=16, cfg=GEMM_INTERPRETER,
            dz_cfg=cfg))(jnp.asarray(big), jnp.int32(row0), *args, jnp.asarray(inp["cw"]), coef))

    got = run(MOSAIC)
    assert taken, "the Mosaic GPU pass was not taken"
    assert np.array_equal(got.view(np.uint16), run(DZ_PASS).view(np.uint16))
    assert np.array_equal(np.delete(got, np.s_[row0:row0 + n], 0).view(np.uint16),
                          np.delete(big, np.s_[row0:row0 + n], 0).view(np.uint16))

"""The logits GEMM's ping-pong kernels, one warpgroup's statistics epilogue under the other's wgmma.

fce_torch's on sm_90 (fce_torch/kernels/logit_tiles_gluon.py) against the Triton kernel that it stands in for
(logit_tiles with cfg=GEMM): the same bits in e and in every partial, for the options it takes, on a GPU
(`tools/gpu_run.sh gputests`). Where it does not apply (the CPU's interpreter, a bias, a temperature, a softcap, a
chunk of few rows) `logit_tiles` runs the Triton kernel.

The JAX twin's on Mosaic GPU (fce_jax/kernels/logit_tiles_mgpu.py, `pingpong=`), here in Mosaic GPU's interpret
mode: against float64 and bit for bit against the Mosaic GPU kernel whose warpgroups split each tile (the same
interpreter's products and sums, so any difference is the schedule's or the column blocks'); which chunks the
engine gives it. On the GPU its bits against fce_torch's: tools/mosaic_logits.py and the parity run.
"""
import dataclasses
import math

import numpy as np
import pytest
import torch

from fce_core.config import (GEMM, GEMM_INTERPRETER, GEMM_MOSAIC_INTERPRETER, GEMM_SHORT, LOGITS_PINGPONG,
                             LOGITS_PINGPONG_MOSAIC, SHORT_ROWS)
from fce_core.heads import StatsSpec
from fce_core.options import Transform
from fce_torch.kernels import logit_tiles_gluon
from fce_torch.kernels.logit_tiles import logit_tiles


def _inputs(n, h, v, dtype, device):
    g = torch.Generator(device=device).manual_seed(n + v)
    x = torch.randn(n, h, device=device, generator=g).to(dtype)
    w = (torch.randn(v, h, device=device, generator=g) / h ** 0.5).to(dtype)
    x[5] *= 300.0  # huge logits in one row
    y = torch.randint(0, v, (n,), device=device, generator=g)
    y[::3] = -100  # ignored rows, and a target past V: both read as 0
    y[1] = v + 7
    cw = torch.rand(v, device=device, generator=g)
    return x, w, y, cw


def test_pingpong_does_not_apply_off_sm90():
    """Not on CPU tensors (the interpreter's machine): there the Triton kernel runs. (A bias, a softcap and a
    temperature are refused on the GPU, in `test_pingpong_bits_equal_triton`.)"""
    x, w, _, _ = _inputs(300, 64, 300, torch.bfloat16, "cpu")
    assert not logit_tiles_gluon.applies(x, w, None, None, Transform())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, h, v", [(SHORT_ROWS + 77, 320, 1000), (700, 640, 2 * GEMM.tile_n)])
@pytest.mark.parametrize("spec, with_cw, store", [
    (StatsSpec(), False, True), (StatsSpec(q=True, pz=True), False, True), (StatsSpec(q=True), True, True),
    (StatsSpec(), False, False)])
def test_pingpong_bits_equal_triton(n, h, v, dtype, spec, with_cw, store, device):
    if device != "cuda" or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the ping-pong kernel runs on sm_90 GPUs")
    x, w, y, cw = _inputs(n, h, v, dtype, device)
    cw = cw if with_cw else None
    e_ref = x.new_empty((n, v)) if store else None
    assert logit_tiles_gluon.applies(x, w, e_ref, None, Transform())
    assert not logit_tiles_gluon.applies(x, w, e_ref, w[:, 0], Transform())
    assert not logit_tiles_gluon.applies(x, w, e_ref, None, Transform(softcap=30.0))
    assert not logit_tiles_gluon.applies(x, w, e_ref, None, Transform(temperature=0.7))
    kw = dict(spec=spec, transform=Transform(), precision="ieee", store=store)
    e_t, p_t = logit_tiles(x, w, None, y, cw, cfg=GEMM, **kw)  # the Triton kernel
    e_p, p_p = logit_tiles(x, w, None, y, cw, **kw)  # the default: the ping-pong kernel
    assert p_p.keys() == p_t.keys()
    for k in p_t:
        bits = torch.int32 if p_t[k].dtype == torch.float32 else p_t[k].dtype
        assert torch.equal(p_p[k].view(bits), p_t[k].view(bits)), k
    if store:
        assert torch.equal(e_p.view(torch.int16), e_t.view(torch.int16))
    else:
        assert e_p is None and e_t is None


# The JAX twin's kernel in the interpreter: 64-row tiles of 128 columns (4 column blocks of q and pz: 32, at
# least a tree leaf), K steps of 16 over H = 48, 2 stages refilled across the tiles of each of the 2 programs.
PP_INTERPRETER = dataclasses.replace(LOGITS_PINGPONG, tile_k=16, num_stages=2)
PP_TILES = dataclasses.replace(GEMM_INTERPRETER, tile_n=128)
PP_CASES = {  # rows, V, StatsSpec, store, launch fields
    "partial_blocks_and_tile": (200, 320, StatsSpec(), True, {}),
    "one_row": (1, 64, StatsSpec(q=True), True, {}),
    "q_pz_four_blocks": (136, 256, StatsSpec(q=True, pz=True), True, {}),
    "no_store_one_block": (64, 192, StatsSpec(), False, dict(parts=1)),
    "three_stages_two_blocks": (104, 320, StatsSpec(q=True, pz=True), True, dict(num_stages=3, parts_q_pz=2)),
}


def _exact_inputs(n, v, seed):
    """x in quarters (one row times 2**10: logits in the tens of thousands), w in 16ths, H = 48: every logit
    exact in float32 in any K order; targets ignored (-100) in every third row and one past V."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(-8, 9, (n, 48), generator=g) / 4.0).to(torch.bfloat16)
    x[min(5, n - 1)] *= 2.0 ** 10
    w = (torch.randint(-16, 17, (v, 48), generator=g) / 16.0).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), generator=g)
    y[::3] = -100
    y[n // 2] = v + 7
    return x, w, y


@pytest.mark.parametrize("name", list(PP_CASES))
def test_jax_pingpong_kernel(name):
    """The JAX twin's ping-pong kernel: every output bit for bit the split-tile Mosaic GPU kernel's; the tile
    maxima, first argmax and target logit equal to float64's; s, pz and e within their rounding of it."""
    import jax.numpy as jnp

    from fce_jax.kernels import logit_tiles as jt
    from fce_jax.kernels import logit_tiles_mgpu as jm
    from helpers import as_float64, to_jax

    n, v, spec, store, launch = PP_CASES[name]
    pp = dataclasses.replace(PP_INTERPRETER, **launch)
    x, w, y = _exact_inputs(n, v, seed=n + v)
    xj, wj = to_jax(x), to_jax(w)
    y_safe = jt.safe_targets(jt.arrays, to_jax(y.to(torch.int32)), v)
    assert jm.pingpong_supports(xj, wj, None, None, Transform(), PP_TILES, pp)
    kw = dict(has_q=spec.q, has_pz=spec.pz, store=store)
    e, parts = jm.mosaic_logit_tiles(xj, wj, y_safe, cfg=PP_TILES, pingpong=pp, **kw)
    e_split, parts_split = jm.mosaic_logit_tiles(xj, wj, y_safe, cfg=dataclasses.replace(
        GEMM_MOSAIC_INTERPRETER, tile_n=PP_TILES.tile_n), **kw)
    n_tiles = -(-v // 128)
    assert set(parts) == set(parts_split) == {"m", "s", "amax", "zy"} | {k for k in ("q", "pz") if getattr(spec, k)}
    for k in parts:
        assert parts[k].shape == (n, n_tiles)
        assert np.array_equal(np.asarray(parts[k]), np.asarray(parts_split[k]), equal_nan=True), k
    if store:
        assert np.array_equal(np.asarray(e.astype(jnp.float32)), np.asarray(e_split.astype(jnp.float32)))
    else:
        assert e is None
    z = torch.full((n, n_tiles * 128), -math.inf, dtype=torch.float64)
    z[:, :v] = x.double() @ w.double().T  # exact
    tiles = z.view(n, n_tiles, 128)
    m_t, arg = tiles.max(dim=2)
    assert np.array_equal(as_float64(parts["m"]), m_t.numpy())
    assert np.array_equal(as_float64(parts["amax"]), (arg + 128 * torch.arange(n_tiles)).numpy())
    safe = torch.where((y >= 0) & (y < v), y, 0)
    assert np.array_equal(as_float64(parts["zy"]).max(axis=1), z.gather(1, safe[:, None])[:, 0].numpy())
    e64 = torch.exp(tiles - m_t[..., None])
    d = (tiles - m_t[..., None]).nan_to_num(neginf=0.0)
    assert np.allclose(as_float64(parts["s"]), e64.sum(dim=2).numpy(), rtol=1e-5, atol=0)
    if spec.q:
        assert np.allclose(as_float64(parts["q"]), d.sum(dim=2).numpy(), rtol=1e-5, atol=1e-3)
    if spec.pz:
        assert np.allclose(as_float64(parts["pz"]), (e64 * d).sum(dim=2).numpy(), rtol=1e-5, atol=1e-6)
    if store:
        assert np.allclose(as_float64(e), e64.view(n, -1)[:, :v].numpy(), rtol=2 ** -8, atol=1e-6)


def test_jax_pingpong_kernel_nan():
    """NaN in the logits, as Triton's `tl.max` takes them on the GPU (fce_torch's bits there: tools/mosaic_logits.py):
    a tile row's max and first argmax ignore NaN, a row of NaN alone has the max NaN and no argmax (I32_MAX); a
    NaN target logit is -inf; both kernels alike."""
    from fce_jax.kernels import logit_tiles as jt
    from fce_jax.kernels import logit_tiles_mgpu as jm
    from helpers import to_jax

    n, v = 72, 320
    x, w, y = _exact_inputs(n, v, seed=11)
    x[7], w[130], y[8], y[9] = math.nan, math.nan, 130, 131  # row 7 all NaN; column 130 NaN, row 8's target
    xj, wj = to_jax(x), to_jax(w)
    y_safe = jt.safe_targets(jt.arrays, to_jax(y.to(torch.int32)), v)
    parts = jm.mosaic_logit_tiles(xj, wj, y_safe, has_q=False, has_pz=False, store=True, cfg=PP_TILES,
                                  pingpong=PP_INTERPRETER)[1]
    split = jm.mosaic_logit_tiles(xj, wj, y_safe, has_q=False, has_pz=False, store=True,
                                  cfg=dataclasses.replace(GEMM_MOSAIC_INTERPRETER, tile_n=PP_TILES.tile_n))[1]
    n_tiles = -(-v // 128)
    z = torch.full((n, n_tiles * 128), -math.inf, dtype=torch.float64)
    z[:, :v] = x.double() @ w.double().T
    tiles = z.view(n, n_tiles, 128)
    nan_low = dict(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    m_t = torch.where(tiles.isnan().all(dim=2), math.nan, tiles.nan_to_num(**nan_low).amax(dim=2))
    at_max = tiles == m_t[..., None]  # the first such column: past V too, in a tile row of NaN and -inf past V
    arg = torch.where(at_max.any(dim=2), at_max.int().argmax(dim=2) + 128 * torch.arange(n_tiles), jm.I32_MAX)
    zy = z.gather(1, torch.where((y >= 0) & (y < v), y, 0)[:, None])[:, 0].nan_to_num(**nan_low)
    for got in (parts, split):
        assert np.array_equal(np.asarray(got["m"]), m_t.float().numpy(), equal_nan=True)
        assert np.array_equal(np.asarray(got["amax"]), arg.numpy())
        assert np.array_equal(np.asarray(got["zy"]).max(axis=1), zy.float().numpy())
    m = np.asarray(parts["m"])  # row 7's last tile: NaN in V, -inf past it
    assert np.isnan(m[7, :2]).all() and m[7, 2] == -math.inf and np.isfinite(m[8, 1])


def test_jax_pingpong_kernel_into_rows():
    """The ping-pong kernel's tile values into rows [row0, row0 + n) of a larger array from a traced row0, as
    the engine's kept dZ takes them: the rows outside untouched, the same values and partials as alone."""
    import jax
    import jax.numpy as jnp

    from fce_jax.kernels import logit_tiles_mgpu as jm
    from helpers import to_jax

    x, w, y = _exact_inputs(192, 320, seed=3)
    xj, wj, yj = to_jax(x), to_jax(w), to_jax(y.clamp(0, 319).to(torch.int32))
    kw = dict(has_q=False, has_pz=False, store=True, cfg=PP_TILES, pingpong=PP_INTERPRETER)
    alone, parts = jm.mosaic_logit_tiles(xj, wj, yj, **kw)
    into = jnp.full((448, 320), 3.0, jnp.bfloat16)
    assert jm.pingpong_supports(xj, wj, None, None, Transform(), PP_TILES, PP_INTERPRETER, into=into, row0=64)
    got, parts_into = jax.jit(lambda i, r: jm.mosaic_logit_tiles(xj, wj, yj, into=i, row0=r, **kw))(into, 64)
    got = np.asarray(got.astype(jnp.float32))
    assert np.all(got[:64] == 3.0) and np.all(got[256:] == 3.0)
    assert np.array_equal(got[64:256], np.asarray(alone.astype(jnp.float32)))
    for k in parts:
        assert np.array_equal(np.asarray(parts[k]), np.asarray(parts_into[k])), k


def test_jax_pingpong_kernel_scope():
    """What the JAX twin's ping-pong kernel leaves to other kernels (`pingpong_supports`): a bias, a
    temperature, class weights, pz, a softcap, float32 operands, V not a multiple of 64, one stage, column blocks
    narrower than 32 bytes, tile values into a larger array from a partial 64-row block, rows of x past 8 and not a
    multiple of 8 (which jax 0.11's lowering of its TMA loads refuses)."""
    import jax.numpy as jnp

    from fce_jax.kernels import logit_tiles_mgpu as jm

    x, w, f32 = jnp.ones((200, 48), jnp.bfloat16), jnp.ones((320, 48), jnp.bfloat16), jnp.zeros((320,), jnp.float32)
    tr, pp = Transform(), PP_INTERPRETER
    assert jm.pingpong_supports(x, w, None, None, tr, PP_TILES, pp)
    assert not jm.pingpong_supports(x, w, f32, None, tr, PP_TILES, pp)
    assert not jm.pingpong_supports(x, w, None, f32, tr, PP_TILES, pp)
    assert not jm.pingpong_supports(x, w, None, None, Transform(temperature=0.7), PP_TILES, pp)
    assert not jm.pingpong_supports(x, w, None, None, tr, PP_TILES, pp, has_pz=True)
    assert not jm.pingpong_supports(x, w, None, None, Transform(softcap=30.0), PP_TILES, pp)
    assert not jm.pingpong_supports(x.astype(jnp.float32), w.astype(jnp.float32), None, None, tr, PP_TILES, pp)
    assert not jm.pingpong_supports(x, w[:312], None, None, tr, PP_TILES, pp)
    assert not jm.pingpong_supports(x[:130], w, None, None, tr, PP_TILES, pp)
    assert jm.pingpong_supports(x[:7], w, None, None, tr, PP_TILES, pp)
    assert not jm.pingpong_supports(x, w, None, None, tr, PP_TILES, dataclasses.replace(pp, num_stages=1))
    with pytest.raises(ValueError, match="2 stages or more"):  # the ring's own check, for any caller
        jm.mosaic_logit_tiles(x, w, jnp.zeros((200,), jnp.int32), has_q=False, has_pz=False, store=True,
                              cfg=PP_TILES, pingpong=dataclasses.replace(pp, num_stages=1))
    assert not jm.pingpong_supports(x, w, None, None, tr, dataclasses.replace(PP_TILES, tile_n=32), pp)  # 16 bytes
    assert not jm.pingpong_supports(x, w, None, None, tr, PP_TILES, pp, out_rows=400)
    assert jm.pingpong_supports(x[:192], w, None, None, tr, PP_TILES, pp, out_rows=400, row0=8)


def test_jax_logit_tiles_chooses_the_pingpong_kernel(monkeypatch):
    """`logit_tiles` with a Mosaic GPU config (`GemmConfig.mosaic`, opt-in) runs raw logits on the ping-pong
    kernel with LOGITS_PINGPONG_MOSAIC, a bias on the split-tile kernel; a config without it on the Triton lowering
    (`pingpong_max_hidden=0`: GEMM itself takes the ping-pong kernel for these rows on the GPU)."""
    import jax.numpy as jnp

    from fce_core.config import GEMM_MOSAIC
    from fce_jax.kernels import logit_tiles as jt

    calls = []

    def record(*args, **kw):
        calls.append(kw.get("pingpong"))
        raise StopIteration

    monkeypatch.setattr(jt, "mosaic_logit_tiles", record)
    monkeypatch.setattr(jt, "call", lambda *a, **kw: lambda *args: record(pingpong="triton"))
    x, w, y = jnp.ones((304, 64), jnp.bfloat16), jnp.ones((512, 64), jnp.bfloat16), jnp.zeros((304,), jnp.int32)
    kw = dict(spec=StatsSpec(), transform=Transform(), precision=None)
    lowering = dataclasses.replace(GEMM, pingpong_max_hidden=0)
    for bias, cfg in ((None, GEMM_MOSAIC), (jnp.zeros((512,), jnp.float32), GEMM_MOSAIC), (None, lowering)):
        with pytest.raises(StopIteration):
            jt.logit_tiles(x, w, bias, y, None, cfg=cfg, **kw)
    assert calls == [LOGITS_PINGPONG_MOSAIC, None, "triton"]


def test_jax_pingpong_kernel_lowers_for_the_gpu(cuda_lowering):
    """The ping-pong kernel as the GPU builds it (LOGITS_PINGPONG_MOSAIC, 132 programs), lowered for CUDA on this CPU
    at the bench's chunk shapes: with and without the tile values, with q and pz, and into a kept dZ from a
    traced row."""
    import jax
    import jax.numpy as jnp

    from fce_jax.kernels import logit_tiles_mgpu as jm

    s, bf, lowered = jax.ShapeDtypeStruct, jnp.bfloat16, cuda_lowering
    for n, h, v in ((2048, 2048, 128256), (768, 640, 262144), (1280, 896, 151936)):
        for q_pz, store in ((False, True), (True, True), (False, False)):
            text = lowered(lambda x, w, y: jm.mosaic_logit_tiles(x, w, y, has_q=q_pz, has_pz=q_pz, store=store,
                                                                 cfg=GEMM, pingpong=LOGITS_PINGPONG_MOSAIC),
                           s((n, h), bf), s((v, h), bf), s((n,), jnp.int32))
            assert "mosaic_gpu" in text

    def into(x, w, y, kept, r0):
        return jm.mosaic_logit_tiles(x, w, y, has_q=False, has_pz=False, store=True, cfg=GEMM, into=kept, row0=r0,
                                     pingpong=LOGITS_PINGPONG_MOSAIC)

    assert "mosaic_gpu" in lowered(into, s((512, 640), bf), s((1024, 640), bf), s((512,), jnp.int32),
                                   s((2048, 1024), bf), s((), jnp.int32))


def test_jax_pingpong_loader_warps_lower_for_the_gpu(monkeypatch, cuda_lowering):
    """`mgpu.pingpong`'s loader in one warp of the memory warpgroup and in all four (`PingPongConfig.loader_warps`
    of the logits GEMM; the short-K dW takes 4), lowered for CUDA on this CPU: the interpreter cannot run the one-warp
    form (it runs no core_map inside a kernel). A warp's scope names no "sm" axis, so the loader's program index
    comes from outside it; the lowering fails where it does not."""
    import jax
    import jax.numpy as jnp

    from fce_core.config import GRAD_GEMM_MOSAIC
    from fce_jax.kernels import grad_gemms as jg
    from fce_jax.kernels import logit_tiles_mgpu as jm
    from fce_jax.kernels import mgpu

    s, bf, lowered = jax.ShapeDtypeStruct, jnp.bfloat16, cuda_lowering
    warps, schedule = [], mgpu.pingpong

    def recorded(*args, loader_warps=4, **kw):
        warps.append(loader_warps)
        return schedule(*args, loader_warps=loader_warps, **kw)

    monkeypatch.setattr(mgpu, "pingpong", recorded)
    for loader_warps in (1, 4):
        pp = dataclasses.replace(LOGITS_PINGPONG_MOSAIC, loader_warps=loader_warps)
        assert "mosaic_gpu" in lowered(lambda x, w, y: jm.mosaic_logit_tiles(
            x, w, y, has_q=False, has_pz=False, store=True, cfg=GEMM, pingpong=pp),
            s((2048, 2048), bf), s((128256, 2048), bf), s((2048,), jnp.int32))
    pingpong_dw = dataclasses.replace(GRAD_GEMM_MOSAIC, pingpong=True)
    assert "mosaic_gpu" in lowered(lambda a, b: jg.dw_gemm(a, b, bf, cfg=pingpong_dw), s((256, 128256), bf),
                                   s((256, 4096), bf))
    assert warps == [1, 4, 4]


def test_jax_default_takes_the_pingpong_kernel_where_the_config_says(cuda_lowering):
    """The JAX twin's logits GEMM lowered for CUDA on this CPU: with GEMM (no launch given), Mosaic GPU's ping-pong
    kernel for a chunk of more than SHORT_ROWS 16-bit rows of at most `pingpong_max_hidden` columns whose tile values
    it stores; the Triton lowering's kernel without the tile values, into a kept dZ, for few rows (GEMM_SHORT), for
    wider rows, for float32, for a bias (which `pingpong_supports` leaves out) and with `pingpong_max_hidden=0`
    (what `python -m bench op --logits-gemm pingpong_max_hidden=0` sets)."""
    import jax
    import jax.numpy as jnp

    from fce_jax.kernels import logit_tiles as jt

    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    wide = GEMM.pingpong_max_hidden
    assert wide >= 896 and GEMM_SHORT.pingpong_max_hidden == 0

    def kernel(n, h, v=4096, dtype=bf, store=True, bias=False, kept=False, cfg=None):
        def fn(x, w, y, b, into):
            return jt.logit_tiles(x, w, b, y, None, spec=StatsSpec(), transform=Transform(), precision=None,
                                  store=store, into=into, row0=0, cfg=cfg)

        args = (s((n, h), dtype), s((v, h), dtype), s((n,), jnp.int32), s((v,), jnp.float32) if bias else None,
                s((2 * n, v), dtype) if kept else None)
        text = cuda_lowering(fn, *args)
        return "mosaic_gpu" if "mosaic_gpu" in text else "triton" if "triton" in text else text[-2000:]

    assert kernel(768, 640) == kernel(SHORT_ROWS + 64, wide) == kernel(768, 640, cfg=GEMM) == "mosaic_gpu"
    assert kernel(768, 640, store=False) == "triton"
    assert kernel(768, 640, kept=True) == "triton"
    assert kernel(SHORT_ROWS, 640) == "triton"
    assert kernel(768, wide + 128) == "triton"
    assert kernel(768, 640, dtype=jnp.float32) == "triton"
    assert kernel(768, 640, bias=True) == "triton"
    assert kernel(768, 640, cfg=dataclasses.replace(GEMM, pingpong_max_hidden=0)) == "triton"

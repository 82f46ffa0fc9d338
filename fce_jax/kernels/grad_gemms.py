"""The fused engine's gradient GEMMs, JAX twin of fce_torch/kernels/grad_gemms.py: the same K-ascending
dX = dZ W and dW (+)= dZᵀ X, with the same epilogues (see its module for the (hi, lo) pair), so the same bits.

Two kernels, the same bits (K ascending, never split):
- Pallas Mosaic GPU (`grad_gemms_mgpu.py`; `GradGemmConfig.mosaic`): TMA loads, a warp-specialized wgmma
  pipeline, persistent programs. The default for 16-bit operands on the GPU (GRAD_GEMM_MOSAIC), where it is
  faster than the Triton lowering and bit for bit fce_torch's (bench/results/nvidia-h200/mosaic-grads/,
  tile-order/).
- the Pallas Triton lowering (`_triton_kernel`, pointer loads): float32 operands, whose IEEE products need
  FMA loops (`tl.dot`'s "ieee") where Mosaic GPU multiplies on wgmma only (float32 input: tf32); rows that
  TMA cannot move (V or H not a multiple of 8); and the CPU interpreters' default (Mosaic GPU's interpret
  mode is slower; tests/test_fused_engine.py runs the Mosaic kernels there).
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fce_core.config import GRAD_GEMM, GRAD_GEMM_INTERPRETER, GRAD_GEMM_MOSAIC, GRAD_GEMM_MOSAIC_SHORT_K, short
from fce_core.heads import TileValues
from fce_core.plan import ADD, PAIR, PAIR_LAST, WRITE, dx_slices, rows_fast

from . import fastmath as fm
from .launch import call, interpret_mode
from .tile_dlogits import dz_on_load, row_coefficients
from ..sums import pairwise_sum

F32 = jnp.float32


def _triton_kernel(a_ref, b_ref, *refs, m, n, k, slice_k, a_t, mode, first, precision, cfg, asm, on_load):
    # refs: with `on_load` (a TileValues' (tile_n, dz_rows, V)) its arrays (m_tiles, y, lse, a, b, c) first; then
    # the inputs after a, b (C's planes updated in place, then the planes only read), then the outputs
    if on_load:
        mt_ref, *coef_refs = refs[:6]
        refs = refs[6:]
        tile_n, dz_rows, vocab = on_load
    c_ref, lo_ref = (refs[-2], refs[-1]) if mode == PAIR else (refs[-1], refs[-2] if mode == PAIR_LAST else None)
    bm, bn, bk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    # program (tile, slice): the slice's K range [k_lo, k_hi) and its [m, n] plane of C
    k_lo = pl.program_id(1) * slice_k
    k_hi = jnp.minimum(k, k_lo + slice_k)
    pid = pl.program_id(0)
    n_m, n_n = pl.cdiv(m, bm), pl.cdiv(n, bn)
    r0, c0 = ((pid % n_m) * bm, (pid // n_m) * bn) if rows_fast(m, n, bm, bn) else \
        ((pid // n_n) * bm, (pid % n_n) * bn)
    row_ok = r0 + lax.iota(jnp.int32, bm) < m
    col_ok = c0 + lax.iota(jnp.int32, bn) < n
    rs, cs = pl.ds(r0, bm), pl.ds(c0, bn)
    if on_load and not a_t:  # dZ's rows are the tile's: their coefficients once per tile
        *coef, live = row_coefficients(coef_refs, rs, r0 + lax.iota(jnp.int32, bm) < dz_rows)

    def k_step(i, acc):
        k0 = k_lo + i * bk
        k_ok = (k0 + lax.iota(jnp.int32, bk) < k_hi) | (k % bk == 0)
        ks = pl.ds(k0, bk)
        if a_t:  # A = dZᵀ: a [bk, bm] block of dZ, contracted over its rows
            a = pltriton.load(a_ref.at[ks, rs], mask=k_ok[:, None] & row_ok[None, :], other=0.0)
            if on_load:  # dZ's rows are this step's K: their coefficients here
                *k_coef, k_live = row_coefficients(coef_refs, ks, k0 + lax.iota(jnp.int32, bk) < dz_rows)
                a = dz_on_load(a, mt_ref, ks, r0, k_coef, k_live, vocab, tile_n, asm)
            dims = (((0,), (0,)), ((), ()))
        else:
            a = pltriton.load(a_ref.at[rs, ks], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if on_load:
                a = dz_on_load(a, mt_ref, rs, k0, coef, live, vocab, tile_n, asm)
            dims = (((1,), (0,)), ((), ()))
        b = pltriton.load(b_ref.at[ks, cs], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        return acc + lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)

    acc = lax.fori_loop(0, pl.cdiv(k_hi - k_lo, bk), k_step, jnp.zeros((bm, bn), F32))
    block, mask = (rs, cs), row_ok[:, None] & col_ok[None, :]
    if c_ref.ndim == 3:  # the slice's plane
        pltriton.store(c_ref.at[pl.ds(pl.program_id(1), 1), rs, cs], acc[None], mask=mask[None])
    elif mode == WRITE:
        pltriton.store(c_ref.at[block], acc.astype(c_ref.dtype), mask=mask)
    elif mode == ADD:
        pltriton.store(c_ref.at[block], pltriton.load(c_ref.at[block], mask=mask, other=0.0) + acc, mask=mask)
    else:
        s = acc
        if not first:
            s = fm.pair_value(pltriton.load(c_ref.at[block], mask=mask, other=0.0),
                              pltriton.load(lo_ref.at[block], mask=mask, other=0)) + acc
        hi, lo = fm.pair_split(s, c_ref.dtype)
        pltriton.store(c_ref.at[block], hi, mask=mask)
        if mode == PAIR:
            pltriton.store(lo_ref.at[block], lo, mask=mask)


def tma_rows(arr):
    """Whether TMA can move the rows of `arr` (whole 16 bytes), as the Mosaic GPU kernels need."""
    return arr.shape[-1] * jnp.dtype(arr.dtype).itemsize % 16 == 0


def dz_on_load_enabled():
    """fce_torch's `dz_on_load_enabled` (the GPU's launch: GRAD_GEMM_MOSAIC's flag)."""
    return (GRAD_GEMM_INTERPRETER if interpret_mode() else GRAD_GEMM_MOSAIC).dz_on_load


def _config(a, b, outs=(), k_rows=None):
    """The default launch for the operands a, b and the outputs `outs`: Mosaic GPU for 16-bit operands where TMA
    can move every row (whole 16 bytes; an int8 lo plane's rows are H bytes); else the Triton lowering, as
    fce_torch takes pointer loads where TMA cannot (the same bits either way). `k_rows`: dW's K, the first rows
    of a and b; where it ends inside them and not on a whole K step, the Triton lowering too (its loads are
    masked at K, where TMA's last step would read the rows past it, which hold no values: a kept dZ's rows that
    did not run; fce_torch cuts its descriptors at K). dW of at most SHORT_ROWS rows: GRAD_GEMM_MOSAIC_SHORT_K."""
    if interpret_mode():
        return GRAD_GEMM_INTERPRETER
    if isinstance(a, TileValues):  # no Mosaic GPU kernel forms dZ on its load yet
        return GRAD_GEMM
    if jnp.dtype(a.dtype).itemsize != 2 or not all(o.size and tma_rows(o) for o in (a, b, *outs)):
        return GRAD_GEMM
    if k_rows is not None and k_rows < a.shape[0] and k_rows % GRAD_GEMM_MOSAIC.tile_k:
        return GRAD_GEMM
    return GRAD_GEMM_MOSAIC_SHORT_K if short(k_rows) else GRAD_GEMM_MOSAIC


def _run(a, b, m, n, k, *, a_t, mode, outs, reads=(), first=False, precision=None, slices=1, cfg=None):
    """The GEMM into `outs` (arrays to update in place, aliased) or new ones (ShapeDtypeStructs; with
    `slices`, one [slices, m, n] array of the K slices' planes), `reads` the planes of C that the epilogue
    only reads (PAIR_LAST's lo): on Mosaic GPU with `cfg.mosaic`."""
    cfg = cfg or _config(a, b, [*outs, *reads], k if a_t else None)
    slice_k = pl.cdiv(pl.cdiv(k, slices), cfg.tile_k) * cfg.tile_k
    on_load, formed = None, ()
    if isinstance(a, TileValues):
        if cfg.mosaic:
            raise ValueError("dZ formed on the load (TileValues) runs on the Triton lowering's GEMMs only")
        if a.tile_n % (cfg.tile_m if a_t else cfg.tile_k):
            raise ValueError(f"dZ formed on the load needs A's blocks inside the tiles of {a.tile_n} columns")
        on_load, formed, a = (a.tile_n, k if a_t else m, a.shape[1]), a.arrays(), a.e  # no dZ past A's cut rows
    if cfg.mosaic:
        if jnp.dtype(a.dtype).itemsize != 2:
            raise ValueError(f"the Mosaic GPU GEMMs (GradGemmConfig.mosaic) take 16-bit operands, got {a.dtype}: "
                             "wgmma has no IEEE float32 product")
        from .grad_gemms_mgpu import mosaic_gemm  # Mosaic GPU (and absl, which it imports) only when asked for

        res = mosaic_gemm(a, b, m, n, k, a_t=a_t, mode=mode, outs=outs, reads=reads, first=first, slices=slices,
                          slice_k=slice_k, cfg=cfg)
        return res if len(res) > 1 else res[0]
    given = [o for o in outs if not isinstance(o, jax.ShapeDtypeStruct)]
    shapes = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
    res = call(_triton_kernel, out_shape=shapes, grid=(pl.cdiv(m, cfg.tile_m) * pl.cdiv(n, cfg.tile_n), slices),
               num_warps=cfg.num_warps, num_stages=cfg.num_stages,
               input_output_aliases={2 + len(formed) + i: i for i in range(len(given))}, m=m, n=n, k=k,
               slice_k=slice_k, a_t=a_t, mode=mode, first=first, precision=precision, cfg=cfg,
               asm=not interpret_mode(), on_load=on_load)(a, b, *formed, *given, *reads)
    return res if len(res) > 1 else res[0]


def dx_gemm(dz, w, dtype, precision=None, cfg=None, rows=None):
    """dZ [n, V] @ w [V, H] rounded once to `dtype`; over `fce_core.plan.dx_slices` slices of V, their
    float32 planes summed by `pairwise_sum`, when that is more than one (as fce_torch). `rows`: only dZ's
    first `rows` rows count, so the product runs over those and the other rows are 0 (as fce_torch)."""
    (n, vocab), hidden = dz.shape, w.shape[1]
    cfg = cfg or _config(dz, w)
    slices = dx_slices(n, hidden, vocab, cfg)
    m = n if rows is None else rows
    shape = (m, hidden) if slices == 1 else (slices, m, hidden)
    planes = _run(dz, w, m, hidden, vocab, a_t=False, mode=WRITE,
                  outs=[jax.ShapeDtypeStruct(shape, dtype if slices == 1 else F32)], precision=precision,
                  slices=slices, cfg=cfg)
    dx = planes if slices == 1 else pairwise_sum(jnp.transpose(planes, (1, 2, 0))).astype(dtype)
    return dx if m == n else jnp.pad(dx, ((0, n - m), (0, 0)))


def _dz_t_x(dz, x, mode, outs, reads=(), first=False, precision=None, cfg=None, rows=None):
    """dZᵀ @ x (dZ [n, V] contracted over its first `rows` rows (default all), x [n, H]) with the epilogue
    `mode`, into `outs` (`reads`: as in `_run`)."""
    return _run(dz, x, dz.shape[1], x.shape[1], dz.shape[0] if rows is None else rows, a_t=True, mode=mode,
                outs=outs, reads=reads, first=first, precision=precision, cfg=cfg)


def dw_gemm(dz, x, dtype, precision=None, cfg=None, rows=None):
    """dZᵀ @ x (dZ [n, V], x [n, H]) rounded once to `dtype`; `rows` as in fce_torch's."""
    return _dz_t_x(dz, x, WRITE, [jax.ShapeDtypeStruct((dz.shape[1], x.shape[1]), dtype)], precision=precision,
                   cfg=cfg, rows=rows)


def accumulates_pair(dtype):
    """Whether dW of a weight of `dtype` is accumulated as a (hi, lo) pair (`dw_first`), which the fused plan
    budgets for (`fce_core.plan.fused_rows`, dw_pair)."""
    return dtype == jnp.bfloat16


def dw_first(dz, x, dtype, precision=None, cfg=None, rows=None):
    """The first chunk's accumulator: a (hi bfloat16, lo int8) pair for a bfloat16 weight, else float32;
    `rows` as in `dw_gemm`."""
    if not accumulates_pair(dtype):
        return dw_gemm(dz, x, F32, precision, cfg, rows)
    shape = (dz.shape[1], x.shape[1])
    return tuple(_dz_t_x(dz, x, PAIR, [jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct(shape, jnp.int8)],
                         first=True, precision=precision, cfg=cfg, rows=rows))


def dw_accumulate(dz, x, acc, precision=None, cfg=None, rows=None, last=False):
    """acc + dZᵀ @ x, acc being `dw_first`'s (float32, or a (hi, lo) pair), in its buffers; `rows` as in
    `dw_gemm`; with `last` (no product follows), a pair's hi alone, its lo only read (as fce_torch's). A lo
    updated in place but not used afterwards is copied by XLA first (0.5 GiB at V = 128256, H = 4096)."""
    if not isinstance(acc, tuple):
        return _dz_t_x(dz, x, ADD, [acc], precision=precision, cfg=cfg, rows=rows)
    if last:
        return _dz_t_x(dz, x, PAIR_LAST, [acc[0]], reads=[acc[1]], precision=precision, cfg=cfg, rows=rows)
    return tuple(_dz_t_x(dz, x, PAIR, list(acc), precision=precision, cfg=cfg, rows=rows))

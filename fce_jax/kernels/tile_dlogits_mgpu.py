"""The fused engine's dZ pass (tile_dlogits.py) on Pallas Mosaic GPU, for 16-bit tile values
(`DzPassConfig.mosaic`, opt-in until it is timed on the GPU): step 2 of the port plan off Pallas' Triton lowering
(docs/PERFORMANCE.md).

The same formulas as the Triton lowering's kernel (`dz_block`, shared) through the same instructions (fastmath's,
emitted by `plgpu.inline_mgpu`), so the same bits as it and as fce_torch's by construction (checked in the
interpret mode; the GPU has not run it yet). Persistent programs, one per
streaming multiprocessor, each over every that-many-th block of 64 rows per compute warpgroup x block_cols
columns (column blocks fastest). A memory warpgroup loads a block by TMA with its rows' coefficients, their tile
maxima and its columns' class weights, `num_stages` blocks in flight; each compute warpgroup rewrites its 64 rows
and stores them in place by TMA from two slots of its own, under the next block's arithmetic. TMA clips a store
that crosses the array's last row or column, so the tile values are all of the array's rows, or whole blocks of
rows (the kept dZ's group, whose chunks go into one array from a traced row; `supports`).
"""
import functools

import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import mgpu
from .mgpu import ROW0_MULTIPLE
from .launch import interpret_mode
from .tile_dlogits import dz_block

F32 = jnp.float32
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)
COL_LAYOUT = plgpu.Layout.WGMMA.reduce(0)
WG_ROWS = 64  # rows of a compute warpgroup's WGMMA-layout part of a block


def supports(e, m_tiles, row0, cfg, tile_n, row0_multiple=1):
    """Whether this kernel runs the pass over rows [row0, row0 + n) of `e` (n: the rows of `m_tiles`): 16-bit tile
    values, rows of whole 16 bytes (TMA), one or two compute warpgroups, blocks inside one logits tile, at least
    one row, and either all of the array's rows (TMA clips the loads and stores of a block that crosses its end)
    or whole blocks of rows from a multiple of 8 (the blocks' shared-memory tiles; traced, by the caller's word
    `row0_multiple`): the kept dZ's group, whose chunks go into one array."""
    n = m_tiles.shape[0]
    blocks = n % _rows(cfg) == 0 and mgpu.row0_aligned(row0, row0_multiple)
    return (jnp.dtype(e.dtype).itemsize == 2 and e.shape[1] % 8 == 0 and n > 0 and cfg.compute_wgs in (1, 2)
            and tile_n % _cols(cfg, tile_n) == 0 and (_whole(e, n, row0) or blocks))


def _whole(e, n, row0):
    return isinstance(row0, int) and row0 == 0 and e.shape[0] == n


def _cols(cfg, tile_n):
    return min(cfg.block_cols, tile_n)


def _rows(cfg):
    return WG_ROWS * cfg.compute_wgs


def _kernel(row0_gmem, mt_gmem, y_gmem, lse_gmem, a_gmem, b_gmem, c_gmem, cw_gmem, zy_gmem, d_gmem, mu_gmem,
            e_gmem, *, n_rows, vocab, tile_n, transform, has_cw, entropy, whole, cfg):
    br, bc = _rows(cfg), _cols(cfg, tile_n)
    n_cb = pl.cdiv(vocab, bc)
    program, programs = lax.axis_index("sm"), lax.axis_size("sm")
    count = lax.div(pl.cdiv(n_rows, br) * n_cb - program + programs - 1, programs)
    needs_zy = entropy or transform.softcap is not None

    def block(s):  # the program's s-th block: (row block, column block)
        item = program + s * programs
        return lax.div(item, n_cb), lax.rem(item, n_cb)

    tile = plgpu.BlockSpec((br, bc), block, transforms=mgpu.transforms(bc, e_gmem.dtype))
    rows = plgpu.BlockSpec((br,), lambda s: (block(s)[0],))
    maxima = plgpu.BlockSpec((1, br), lambda s: (lax.div(block(s)[1] * bc, tile_n), block(s)[0]))
    row0 = pl.multiple_of(row0_gmem[0], ROW0_MULTIPLE)
    tiles = e_gmem if whole else e_gmem.at[pl.ds(row0, n_rows)]  # whole blocks of the rows (`supports`)
    named = [(tiles, tile), (mt_gmem, maxima), *((g, rows) for g in (y_gmem, lse_gmem, a_gmem, b_gmem, c_gmem)),
             *[(cw_gmem, plgpu.BlockSpec((bc,), lambda s: (block(s)[1],)))] * has_cw,
             *[(zy_gmem, rows)] * needs_zy, *[(d_gmem, rows), (mu_gmem, rows)] * entropy]

    def body(idx, e_smem, mt_smem, y_smem, lse_smem, a_smem, b_smem, c_smem, *extra, out_smem):
        wg = lax.axis_index("wg")
        own = pl.ds(wg * WG_ROWS, WG_ROWS)  # this compute warpgroup's rows of the block

        def rows_of(ref):
            return _load(ref.at[own], ROW_LAYOUT)

        extra = list(extra)
        cw = _load(extra.pop(0), COL_LAYOUT) if has_cw else None
        zy = rows_of(extra.pop(0)) if needs_zy else None
        d, mu = (rows_of(r) for r in extra) if entropy else (None, None)
        y, lse, a, b, c = (rows_of(r) for r in (y_smem, lse_smem, a_smem, b_smem, c_smem))
        live = (a != 0.0) | (b != 0.0) | (c != 0.0)  # rows past the array: their zeros from TMA
        rb, cb = block(idx[0])
        cols = cb * bc + _iota((WG_ROWS, bc))
        e = _load(e_smem.at[own], plgpu.Layout.WGMMA).astype(F32)
        dz = dz_block(e, rows_of(mt_smem.at[0]), y, lse, a, b, c, live, cols, cw, zy, d, mu, transform,
                      mgpu.asm())
        slot = out_smem.at[wg, lax.rem(idx[0], 2)]
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store from this slot, two blocks ago, has read it
        slot[...] = dz.astype(slot.dtype)
        plgpu.commit_smem()
        first = rb * br + wg * WG_ROWS

        @pl.when(first < n_rows)  # rows past the array's end
        def _store():
            plgpu.copy_smem_to_gmem(slot, e_gmem.at[pl.ds(row0 + first, WG_ROWS), pl.ds(cb * bc, bc)])

    # each compute warpgroup stores its rows from two slots of its own (Mosaic GPU's interpret mode runs no
    # pipelined output), each block's store under the next block's arithmetic
    @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((cfg.compute_wgs, 2, WG_ROWS, bc), e_gmem.dtype,
                                                          transforms=mgpu.transforms(bc, e_gmem.dtype)),
                       collective_axes="wg")
    def _scope(out_smem):
        plgpu.emit_pipeline_warp_specialized(
            functools.partial(body, out_smem=out_smem), grid=(count,), memory_registers=mgpu.MEMORY_REGISTERS,
            in_specs=[sp for _, sp in named], max_concurrent_steps=cfg.num_stages, wg_axis="wg",
            num_compute_wgs=cfg.compute_wgs,
        )(*(g for g, _ in named))
        plgpu.wait_smem_to_gmem(0)


def _load(ref, layout):
    """A block in shared memory in registers, laid out as `layout` on the GPU (the interpreter: plain)."""
    return ref[...] if interpret_mode() else plgpu.load(ref, (), layout=layout)


def _iota(shape):
    """The column index within a block [rows, cols], laid out as a WGMMA tile on the GPU."""
    if interpret_mode():
        return lax.broadcasted_iota(jnp.int32, shape, 1)
    return plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)


def mosaic_tile_dlogits(e, m_tiles, y, zy, class_weights, coef, *, transform, tile_n, cfg, row0=0):
    """tile_dlogits' pass on Mosaic GPU, where `supports` holds: rows [row0, row0 + n) of `e` rewritten into dZ
    (the array returned)."""
    n, vocab = m_tiles.shape[0], e.shape[1]
    br, bc = _rows(cfg), _cols(cfg, tile_n)
    entropy = "d" in coef
    dummy = jnp.zeros((br,), F32)
    body = functools.partial(_kernel, n_rows=n, vocab=vocab, tile_n=tile_n, transform=transform,
                             has_cw=class_weights is not None, entropy=entropy, whole=_whole(e, n, row0), cfg=cfg)
    [e_ref] = mgpu.in_place([e])
    # the maxima [T, n]: each tile's column of them a row that TMA loads, n padded to whole 16-byte rows
    maxima = jnp.pad(m_tiles, ((0, -n % 4), (0, 0))).T
    mgpu.kernel(body, out_type=(), programs=mgpu.programs(pl.cdiv(n, br) * pl.cdiv(vocab, bc)),
                compute_threads=cfg.compute_wgs)(
        jnp.asarray(row0, jnp.int32).reshape(1), maxima, y, coef["lse"], coef["a"], coef["b"], coef["c"],
        dummy if class_weights is None else class_weights, dummy if zy is None else zy,
        coef["d"] if entropy else dummy, coef["mu"] if entropy else dummy, e_ref)
    return e_ref[...]

"""The fused engine's logits GEMM with its statistics epilogue (logit_tiles.py) on Pallas Mosaic GPU, for
16-bit operands: TMA loads, wgmma, persistent programs. Two kernels:

- `_pingpong_kernel` (raw logits, `pingpong_supports`): fce_torch's ping-pong schedule (logit_tiles_gluon.py) on
  `mgpu.pingpong`, so that one compute warpgroup's epilogue runs under the other's wgmma. fce_torch's bits in e
  and in every partial but pz on the H100; per chunk 0.493 against the Triton lowering's 0.639 ms at
  768x640x262144, 0.581 against 0.700 at 1280x896x151936, 3% slower at 2048x2048x128256
  (bench/results/nvidia-h100/mosaic-logits-epilogue/). The JAX twin's default where `logit_tiles.takes_pingpong`
  says so (GEMM's `pingpong_max_hidden`), else opt-in (`GemmConfig.mosaic`);
- `_kernel` (a bias, a temperature, class weights too): a warp-specialized pipeline whose two compute
  warpgroups split each 128-row tile and run its epilogue together. Slower than the Triton lowering's kernel on
  the H100, and its bits differ there with q and pz, a temperature with a bias, or class weights
  (bench/results/nvidia-h100/engine-v2-flags/; it hung on the H200 before a race in its epilogue was removed).
  Opt-in only.

The same bits as the Triton lowering's kernel and fce_torch's by construction, except where LLVM contracts a
product into a sum (NUMERICS):

- the products: K ascending in whole tile_k steps, as every tiling gives them (docs/NUMERICS.md);
- the max, the argmax (a min over column indices) and the target logit (a max over one column) are exact in
  any order;
- each row sum is fce_torch's adjacent-pairs tree (`row_sum`): halves of the columns added recursively down to
  blocks of 8, whose sum Mosaic GPU reduces as that tree does in its WGMMA layout (a thread's two adjacent
  columns, then the lanes 1 and 2 apart: `tree_sum`). Its interpret mode, whose reductions are XLA's, adds
  the 8 columns by `pairwise_sum` instead;
- e = 2^((z - m) log2 e) by `ex2.approx.ftz.f32` (`approx_math`), rounded to the input dtype once;
- the product e (z - m_t) of the entropy's sum is `fastmath.mul`'s `mul.rn.f32`, as in the Triton kernels: Mosaic
  GPU allows LLVM to contract a product and a sum into an FMA, and ptxas contracts a plain `mul.f32` into the
  add after it (an optimization barrier, used before, stopped LLVM only; the bits with pz differed on the H100).

The bias is added in float32 and the temperature divides (`fastmath.div`'s `div.rn.f32`). The
tile maxima ignore NaN as Triton's `tl.max` does, by `max.f32` (`_row_max`; Mosaic GPU's `jnp.max` propagates
NaN): a tile row of NaN alone gives NaN, as Triton's. The target logit ignores NaN too (-inf where it is NaN).
Smoothing's class-weighted products `w_c (z − m_t)` (float32 class weights) are `fastmath.mul`'s too. These
instructions have not run on a GPU in this kernel yet. A softcap stays on the Triton lowering (`supports`).
"""
import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxlib.mlir.dialects import arith

from . import fastmath as fm
from . import mgpu
from .mgpu import COMPUTE_WGS, MEMORY_REGISTERS, ROW0_MULTIPLE
from .fastmath import LOG2E
from .launch import interpret_mode, typed
from ..sums import pairwise_sum

F32 = jnp.float32
I32_MAX = jnp.iinfo(jnp.int32).max
LEAF = 8           # columns of a tree leaf: a thread's pair of columns and the 4 lanes holding the rest
X_ROW_TILING = 8   # the rows of x's TMA loads' shared-memory tiles


def tree_sum(v):
    """The sum over the columns (a power of two, at least LEAF) of v [rows, W] by the adjacent-pairs tree.
    On the GPU each leaf's reduction also adds its +0 start, which turns a leaf sum of -0 into +0: the same
    total wherever another leaf is not -0, as in every row of a logits tile (its max column adds +0 or 1)."""
    w = v.shape[1]
    if w > LEAF:
        return tree_sum(v[:, :w // 2]) + tree_sum(v[:, w // 2:])
    if not interpret_mode():
        return jnp.sum(v, axis=1)  # in WGMMA layout: (c0 + c1), lanes 1 apart, then 2 apart
    return pairwise_sum(v)


def supports(x, w, bias, class_weights, transform, cfg, *, into=None, out_rows=None, row0=0, row0_multiple=1):
    """Whether this kernel computes these statistics: 16-bit operands, H a multiple of 8 and V of 64 (TMA's
    rows of whole 16 bytes; the tile values' swizzled stores), at least one row, no softcap, a bias of 16 or 32
    bits, float32 class weights, tile_n at least LEAF columns and tile_m two 64-row blocks, one per compute
    warpgroup. Where the tile values go into other rows of a larger array (`into`, `out_rows`): whole
    64-row blocks (TMA stores a whole block, and a partial one would write rows past the chunk's) from a
    first row `row0` that is a multiple of ROW0_MULTIPLE (the stores' tiles), as an int or, traced, by the
    caller's word (`row0_multiple`)."""
    return (cfg.tile_m // COMPUTE_WGS == 64 and cfg.tile_n >= LEAF
            and _operands_fit(x, w, bias, class_weights, transform, into, out_rows, row0, row0_multiple))


def pingpong_supports(x, w, bias, class_weights, transform, cfg, pingpong, *, has_pz=False, into=None, out_rows=None,
                      row0=0, row0_multiple=1):
    """Whether the ping-pong kernel (`pingpong`, a PingPongConfig, on cfg.tile_n columns) computes these
    statistics with fce_torch's bits: as `supports` says, on tiles of 64 rows (one warpgroup's), column blocks
    of at least LEAF columns and 32 bytes (the e blocks' narrowest swizzle), at least two stages (a step's stage
    is released once the next step's wgmma is issued), raw logits (no bias, temperature or class weights:
    fce_torch's ping-pong kernel leaves a bias and a temperature to its Triton kernel too) and no pz (`has_pz`:
    its bits differed from fce_torch's on the H100, bench/results/nvidia-h100/mosaic-logits-pingpong/)."""
    width = cfg.tile_n // max(pingpong.parts, pingpong.parts_q_pz)
    return (pingpong.tile_m == 64 and width >= LEAF and width * jnp.dtype(x.dtype).itemsize >= 32
            and pingpong.num_stages >= 2 and bias is None and class_weights is None and not has_pz
            and not transform.has_temperature
            and _operands_fit(x, w, bias, class_weights, transform, into, out_rows, row0, row0_multiple))


def _operands_fit(x, w, bias, class_weights, transform, into, out_rows, row0, row0_multiple):
    """`supports`' rules on the operands and the rows of e, for both kernels' 64-row blocks. x's rows: fewer than
    X_ROW_TILING or a multiple of it (jax 0.11's lowering of x's TMA loads refuses other counts; its interpret
    mode takes them)."""
    aligned = mgpu.row0_aligned(row0, row0_multiple)
    rows = x.shape[0]
    return (jnp.dtype(x.dtype).itemsize == 2 and x.dtype == w.dtype and 0 < rows
            and (rows < X_ROW_TILING or rows % X_ROW_TILING == 0) and x.shape[1] % 8 == 0
            and w.shape[0] % 64 == 0 and (bias is None or jnp.dtype(bias.dtype).itemsize in (2, 4))
            and (class_weights is None or class_weights.dtype == F32) and transform.softcap is None
            and (into is None and out_rows is None and isinstance(row0, int) and row0 == 0
                 or x.shape[0] % 64 == 0 and aligned))


def _kernel(x_gmem, w_gmem, y_gmem, row0_gmem, *refs, n_rows, vocab, hidden, n_tiles, has_bias, has_cw,
            temperature, has_q, has_pz, store, cfg, stages_):
    """Output tiles of cfg.tile_m x cfg.tile_n, row blocks fastest (the programs that run together share a W
    tile), on a persistent loop. Per tile a memory warpgroup's TMA loads feed two compute warpgroups' wgmma
    (tile_m / 2 rows each), whose epilogue stores the tile values by TMA (`store`: rows from row0_gmem's of
    e) and its column of the [rows, T] partials."""
    columns = has_bias + has_cw  # the per-column vectors, bias then class weights: a block of each per tile
    col_gmem, out_gmem = refs[:columns], refs[columns:]
    e_gmem, *parts_gmem = out_gmem if store else (None, *out_gmem)
    bm, bn, bk = cfg.tile_m // COMPUTE_WGS, cfg.tile_n, cfg.tile_k
    n_m = pl.cdiv(n_rows, cfg.tile_m)
    dtype = x_gmem.dtype
    specs = [plgpu.BlockSpec((cfg.tile_m, bk), lambda s: (0, s), transforms=mgpu.transforms(bk, dtype)),
             plgpu.BlockSpec((bn, bk), lambda s: (0, s), transforms=mgpu.transforms(bk, dtype))]
    steps = pl.cdiv(hidden, bk)

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps,), memory_registers=MEMORY_REGISTERS, in_specs=specs, wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS, max_concurrent_steps=stages_, compute_context=context)

    allocs = pipeline(None, None).get_allocations(x_gmem, w_gmem)
    scratch = dict(
        e_smem=plgpu.SMEM((COMPUTE_WGS, bm, bn) if store else (1,), dtype, transforms=mgpu.transforms(bn, dtype)
                          if store else ()),
        y_smem=plgpu.SMEM((COMPUTE_WGS, bm), jnp.int32),
        c_smem=[plgpu.SMEM((COMPUTE_WGS, bn), g.dtype) for g in col_gmem],
        bars=plgpu.Barrier(num_barriers=COMPUTE_WGS * (1 + columns)))

    @functools.partial(pl.run_scoped, allocs=allocs, **scratch, collective_axes="wg")
    def _scope(allocs, e_smem, y_smem, c_smem, bars):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((n_m * n_tiles,), collective_axes="sm")
        def _item(info):
            (item,) = info.index
            t = lax.div(item, n_m)
            r0, c0 = lax.rem(item, n_m) * cfg.tile_m, t * bn

            def mma(_, x_smem, w_smem, acc):
                plgpu.wgmma(acc, x_smem.at[pl.ds(wg * bm, bm)], plgpu.transpose_ref(w_smem, (1, 0)))
                plgpu.wgmma_wait(0)
                return acc

            def context(run):
                first = r0 + wg * bm
                rows = pl.ds(first, bm)
                # the previous tile's stores have read the epilogue's buffers
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.copy_gmem_to_smem(y_gmem.at[rows], y_smem.at[wg], bars.at[wg])
                for i, (g, c_) in enumerate(zip(col_gmem, c_smem)):
                    plgpu.copy_gmem_to_smem(g.at[pl.ds(c0, bn)], c_.at[wg], bars.at[(1 + i) * COMPUTE_WGS + wg])

                @functools.partial(pl.run_scoped, acc=plgpu.ACC((bm, bn), F32))
                def _acc(acc):
                    run(acc)
                    total = acc[...]
                    col = []
                    for i, c_ in enumerate(c_smem):
                        plgpu.barrier_wait(bars.at[(1 + i) * COMPUTE_WGS + wg])
                        col.append(lax.broadcast_in_dim(c_.at[wg][...].astype(F32), total.shape, [1]))
                    if has_bias:
                        total = total + col[0]
                    if temperature != 1.0:
                        total = fm.div(total, temperature, mgpu.asm())
                    plgpu.barrier_wait(bars.at[wg])

                    def store_e(_, e):
                        e_smem.at[wg][...] = e.astype(dtype)
                        plgpu.commit_smem()

                        @pl.when(first < n_rows)  # a block past the chunk's rows: other rows of e
                        def _store():
                            out = pl.multiple_of(row0_gmem[...] + first, ROW0_MULTIPLE)
                            plgpu.copy_smem_to_gmem(e_smem.at[wg], e_gmem.at[pl.ds(out, bm), pl.ds(c0, bn)])

                    stats = _statistics(total, y_smem.at[wg][...], c0, vocab, has_q, has_pz,
                                        col[-1] if has_cw else None, store_e=store_e if store else None)
                    for p, v in zip(parts_gmem, stats):  # a column of [rows, T]: the rows' own stores
                        p.at[rows, t][...] = v

            pipeline(mma, context)(x_gmem.at[pl.ds(r0, cfg.tile_m)], w_gmem.at[pl.ds(c0, bn)],
                                   allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _pingpong_kernel(x_gmem, w_gmem, y_gmem, hits_gmem, row0_gmem, *out_gmem, n_rows, vocab, hidden, n_tiles, has_q,
                     has_pz, store, tile_n, parts, cfg, stages_):
    """fce_torch's ping-pong schedule (logit_tiles_gluon.py) on `mgpu.pingpong`: tiles of cfg.tile_m x tile_n,
    row blocks fastest, that the two compute warpgroups take in turns, so that one's epilogue runs under the
    other's wgmma. The epilogue (`_statistics`, in `parts` column blocks) stages each block's e in shared memory
    of its owner's for a TMA store, and stores the partials' column of [rows, T]. y comes padded to whole row
    blocks; hits_gmem [row blocks, T] says where a block's rows have targets (`_target_tiles`)."""
    bm, bn, bk = cfg.tile_m, tile_n, cfg.tile_k
    e_gmem, *parts_gmem = out_gmem if store else (None, *out_gmem)
    n_m, steps = pl.cdiv(n_rows, bm), pl.cdiv(hidden, bk)
    width = bn // parts
    dtype = x_gmem.dtype
    ring = dict(
        x_smem=plgpu.SMEM((stages_, bm, bk), dtype, transforms=mgpu.transforms(bk, dtype)),
        w_smem=plgpu.SMEM((stages_, bn, bk), dtype, transforms=mgpu.transforms(bk, dtype)),
        e_smem=plgpu.SMEM((COMPUTE_WGS, bm, width) if store else (1,), dtype,
                          transforms=mgpu.transforms(width, dtype) if store else ()),
        **mgpu.pingpong_barriers(stages_))

    @functools.partial(pl.run_scoped, **ring, collective_axes="wg")
    def _scope(x_smem, w_smem, e_smem, loaded, consumed):
        wg = lax.axis_index("wg")

        def origin(item):  # row blocks fastest, as the Triton kernels: the programs at work share a W tile
            t = lax.div(item, n_m)
            return lax.rem(item, n_m) * bm, t, t * bn

        def load(at, s, slot, arrived):
            r0, _, c0 = at
            ks = pl.ds(s * bk, bk)
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(r0, bm), ks], x_smem.at[slot], arrived)
            plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(c0, bn), ks], w_smem.at[slot], arrived)

        def mma(acc, slot):
            plgpu.wgmma(acc, x_smem.at[slot], plgpu.transpose_ref(w_smem.at[slot], (1, 0)))

        def epilogue(at, acc, _):
            r0, t, c0 = at

            def store_e(j, e):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last store has read the buffer
                e_smem.at[wg][...] = e.astype(dtype)
                plgpu.commit_smem()
                out = pl.multiple_of(row0_gmem[...] + r0, ROW0_MULTIPLE)
                plgpu.copy_smem_to_gmem(e_smem.at[wg], e_gmem.at[pl.ds(out, bm), pl.ds(c0 + j * width, width)])

            stats = _statistics(acc[...], _rows(y_gmem, r0, bm), c0, vocab, has_q, has_pz, None, parts=parts,
                                store_e=store_e if store else None, targets=hits_gmem[lax.div(r0, bm), t] != 0)
            for p, v in zip(parts_gmem, stats):  # a column of [rows, T]: the rows' own stores
                p.at[pl.ds(r0, bm), t][...] = v

        mgpu.pingpong(n_m * n_tiles, steps, stages_, loaded, consumed, origin=origin, load=load, mma=mma,
                      epilogue=epilogue, acc_shape=(bm, bn), loader_warps=cfg.loader_warps)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _target_tiles(y_safe, rows, tile_n, n_tiles):
    """[len(y_safe) / rows, n_tiles] int32: 1 where a block of `rows` rows has a row whose target (in [0, V)) is in
    the tile of tile_n columns, else 0."""
    blocks = jnp.arange(y_safe.shape[0]) // rows
    return jnp.zeros((y_safe.shape[0] // rows, n_tiles), jnp.int32).at[blocks, y_safe // tile_n].set(1)


def _rows(v_gmem, r0, rows):
    """v_gmem[r0 : r0 + rows] in registers, laid out as the rows of a WGMMA tile (the interpreter: plain)."""
    if interpret_mode():
        return v_gmem[pl.ds(r0, rows)]
    return plgpu.load(v_gmem, pl.ds(r0, rows), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)


def _row_max(v):
    """The max of each row of v [rows, W] (WGMMA layout) ignoring NaN, as Triton's `tl.max` (a row of NaN
    alone: NaN): on the GPU one `max.f32` a column (maxnum), where `jnp.max` takes `max.NaN.f32` and NaN would
    first be turned to -inf, a compare and a select a column more."""
    if interpret_mode():
        return jnp.nanmax(v, axis=1)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct((v.shape[0],), v.dtype, plgpu.Layout.WGMMA.reduce(1)))
    def row_max(_, fragments):
        return fragments.reduce(arith.maxnumf, 1)

    return row_max(v)


def _maxnum(a, b):
    """max(a, b) but for NaN, which only where both are gives NaN: `_row_max` over two blocks' columns."""
    return jnp.where(a != a, b, jnp.where(b != b, a, jnp.maximum(a, b)))


def _statistics(total, y, c0, vocab, has_q, has_pz, cw, *, parts=1, store_e=None, targets=None):
    """(m, s, amax, zy[, q][, pz]) of one warpgroup's rows of the tile, from its float32 logits `total` (`cw`:
    the columns' class weights, 0 past V, or None). Everything goes over the columns in `parts` blocks, left to
    right, so that no mask or column index of the whole tile's width sits in registers beside the accumulator:
    the max, the first column that holds it and the target's logit take their blocks' max / min / max (exact,
    so the bits of one pass over every column); e and the sums, after the max, each pair of blocks' sums added as
    `tree_sum` adds the halves of a width: the bits of one tree over every column (fce_torch's ping-pong kernel
    takes the same blocks). `store_e(j, e)`: block j's e, as it is formed. `targets` (a traced bool, or None
    for always): whether any row's target is in the tile; without one the target logits are -inf, as the max over
    no column gives them, and their compares and selects are skipped."""
    rows, width = total.shape[0], total.shape[1] // parts
    layout = None if interpret_mode() else plgpu.Layout.WGMMA
    local = (lax.broadcasted_iota(jnp.int32, (rows, width), 1) if layout is None else
             plgpu.broadcasted_iota(jnp.int32, (rows, width), 1, layout=layout))
    # The column mask is skipped in every tile but a partial last one (a predicate of scalars). Which tiles hold
    # targets comes from before the kernel (`targets`): found from the tile's own rows, it would need a reduction
    # over the warpgroup's rows to one scalar, whose cross-warp scratch Mosaic GPU places once per kernel, shared
    # by both compute warpgroups with only a warpgroup barrier around it (a race: a warp could read the other
    # warpgroup's partials and drop its rows' target logit).
    partial = c0 + total.shape[1] > vocab

    def block(j):  # block j's logits (-inf past V) and the columns of it inside V
        z = total[:, j * width:(j + 1) * width]
        in_v = vocab - c0 - j * width
        return lax.cond(partial, lambda: jnp.where(local < in_v, z, -jnp.inf), lambda: z), in_v

    m_t = None
    for j in range(parts):
        z, _ = block(j)
        m_j = _row_max(z)
        m_t = m_j if m_t is None else _maxnum(m_t, m_j)
    amax = zy = None
    sums = []
    for j in range(parts):
        z, in_v = block(j)  # again, not kept from the first pass: all blocks kept would be the tile's width again
        arg = jnp.min(jnp.where(z == lax.broadcast_in_dim(m_t, z.shape, [0]), local, I32_MAX), axis=1)
        arg = jnp.where(arg < width, arg + (c0 + j * width), I32_MAX)  # none equals a NaN max: I32_MAX, as Triton's
        amax = arg if amax is None else jnp.minimum(amax, arg)

        def target_logits(z=z, j=j):
            at_y = local == lax.broadcast_in_dim(y - (c0 + j * width), z.shape, [0])
            return jnp.max(jnp.where(at_y & (z == z), z, -jnp.inf), axis=1)

        zy_j = target_logits() if targets is None else lax.cond(
            targets, target_logits, lambda: jnp.full(m_t.shape, -jnp.inf, F32))
        zy = zy_j if zy is None else jnp.maximum(zy, zy_j)
        d = z - lax.broadcast_in_dim(m_t, z.shape, [0])
        e = jnp.exp2(d * LOG2E)
        if store_e is not None:
            store_e(j, e)
        sums_j = [tree_sum(e)]
        if has_q or has_pz:
            d = lax.cond(partial, lambda d=d, in_v=in_v: jnp.where(local < in_v, d, 0.0), lambda d=d: d)
        if has_q:  # a weighted product rounded, never an FMA with the tree's adds
            cols = slice(j * width, (j + 1) * width)
            sums_j.append(tree_sum(d if cw is None else fm.mul(cw[:, cols], d, mgpu.asm())))
        if has_pz:
            sums_j.append(tree_sum(fm.mul(e, d, mgpu.asm())))  # rounded, never an FMA with the tree's adds
        sums.append(sums_j)
    s, *q_pz = _halves_sum(sums)
    return [m_t, s, amax, zy, *q_pz]


def _halves_sum(blocks):
    """The column blocks' sums [[s, q, pz] of each block] added as `tree_sum` adds the halves of a width."""
    if len(blocks) == 1:
        return blocks[0]
    half = len(blocks) // 2
    return [a + b for a, b in zip(_halves_sum(blocks[:half]), _halves_sum(blocks[half:]))]


def mosaic_logit_tiles(x, w, y_safe, *, has_q, has_pz, store, cfg, bias=None, class_weights=None, temperature=1.0,
                       into=None, row0=0, out_rows=None, pingpong=None):
    """logit_tiles.py's `logit_tiles` on Mosaic GPU, where `supports` holds (`bias` and `class_weights` [V] or
    None, the transform's `temperature`): (the tile values, rows [row0, row0 + n) of `into` updated or of a new
    [out_rows or n, V] array, or None without `store`; {m, s, amax, zy[, q][, pz]} of [n, T]). With `pingpong`
    (a PingPongConfig, where `pingpong_supports` holds) the ping-pong kernel on its launch, cfg.tile_n wide."""
    columns = [c for c in (bias, class_weights if has_q else None) if c is not None]  # only q reads the weights
    n, hidden = x.shape
    vocab = w.shape[0]
    n_tiles = pl.cdiv(vocab, cfg.tile_n)
    names = ["m", "s", "amax", "zy"] + ["q"] * has_q + ["pz"] * has_pz
    tile_m = cfg.tile_m if pingpong is None else pingpong.tile_m
    padded = pl.cdiv(n, tile_m) * tile_m  # whole row blocks: the partials' stores stay inside
    parts = [jax.ShapeDtypeStruct((padded, n_tiles), jnp.int32 if k == "amax" else F32) for k in names]
    itemsize = jnp.dtype(x.dtype).itemsize
    flags = dict(n_rows=n, vocab=vocab, hidden=hidden, n_tiles=n_tiles, has_q=has_q, has_pz=has_pz, store=store)
    if pingpong is None:
        targets = [y_safe]
        fixed = cfg.tile_m * (cfg.tile_n * itemsize * store + 4) + COMPUTE_WGS * cfg.tile_n * sum(
            jnp.dtype(c.dtype).itemsize for c in columns)  # the tile values, targets and column blocks
        per_stage = (cfg.tile_m + cfg.tile_n) * cfg.tile_k * itemsize
        body = functools.partial(_kernel, has_bias=bias is not None, has_cw=has_q and class_weights is not None,
                                 temperature=float(temperature), cfg=cfg,
                                 stages_=mgpu.stages(cfg, per_stage, fixed), **flags)
    else:
        blocks = pingpong.parts_q_pz if has_q or has_pz else pingpong.parts  # column blocks of the epilogue
        per_stage = (pingpong.tile_m + cfg.tile_n) * pingpong.tile_k * itemsize
        e_blocks = COMPUTE_WGS * pingpong.tile_m * cfg.tile_n // blocks * itemsize * store  # one of each owner's
        body = functools.partial(_pingpong_kernel, tile_n=cfg.tile_n, parts=blocks, cfg=pingpong, **flags,
                                 stages_=mgpu.stages(pingpong, per_stage, e_blocks))
        y_safe = jnp.pad(y_safe, (0, padded - n))  # the targets of whole row blocks, read from global memory
        targets = [y_safe, _target_tiles(y_safe, tile_m, cfg.tile_n, n_tiles)]
    new = [] if not store or into is not None else [jax.ShapeDtypeStruct((out_rows or n, vocab), x.dtype)]
    launch = mgpu.kernel(body, programs=mgpu.programs(pl.cdiv(n, tile_m) * n_tiles), compute_threads=COMPUTE_WGS,
                         approx_math=not interpret_mode(),  # ex2.approx.ftz.f32 on the GPU; XLA's exp2 here
                         out_type=tuple(typed(new + parts, (x, w))))
    # a traced row0 passes a barrier: XLA's dynamic-slice fusion would take the chunk's offset, which the
    # operands' slices share, into the kernel's fusion, and then refuse it as the kernel's operand
    row0 = lax.optimization_barrier(jnp.asarray(row0, jnp.int32)) if isinstance(row0, jax.Array) else \
        jnp.asarray(row0, jnp.int32)
    args = [x, w, *targets, row0, *columns]
    if store and into is not None:
        (e_ref,) = mgpu.in_place([into])
        out = launch(*args, e_ref)
        e = e_ref[...]
    else:
        out = launch(*args)
        e, out = (out[0], out[1:]) if store else (None, out)
    return e, {k: p if n == padded else p[:n] for k, p in zip(names, out)}

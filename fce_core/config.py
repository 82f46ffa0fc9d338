"""Frozen kernel configurations shared by both twins, and the constants of the shared elementwise math.

A field whose value changes the bits of a result is listed in its class's ``NUMERICS`` (for instance the width
of the per-row partial accumulators, whose fixed pairwise sum gives a row's sum of exponentials); the other
fields only change speed. Both twins read the same instances, so their kernels agree by construction; the
exceptions, each twin's launches of the gradient GEMMs (GRAD_GEMM_TORCH, GRAD_GEMM_MOSAIC*), differ from
GRAD_GEMM in speed fields only (a test asserts it).
"""
import dataclasses
from dataclasses import dataclass

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# tanh(u) = u + u^3 (C3 + u^2 (C5 + u^2 C7)) below |u| = TANH_POLY_BELOW, else (1 - e) / (1 + e) with
# e = 2**(-2 |u| log2 e): the odd Taylor polynomial of degree 7 (coefficients -1/3, 2/15, -17/315).
TANH_POLY_BELOW = 0.125
TANH_C3 = -0.3333333333333333
TANH_C5 = 0.13333333333333333
TANH_C7 = -0.05396825396825397

# The fused engine's dW accumulator of a bfloat16 weight, a pair (hi, lo) (docs/NUMERICS.md, "dX and dW"): hi the
# bfloat16 sum rounded to nearest even, lo an int8 count of 2**PAIR_LO_BITS units of the float32 bit pattern, the
# rest of the sum: the pair's value is the float32 whose bit pattern is hi's plus lo * 2**PAIR_LO_BITS, the sum
# rounded to nearest even to 24 bits (16 significant ones), so that both halves come from integer adds and
# shifts, with no conversion between integers and floats. lo is clipped to +-PAIR_LO_MAX, short of hi's half
# ulp (128 units), so that the value rounds back to hi: adding an exact zero leaves the pair as it is.
PAIR_LO_BITS = 8
PAIR_LO_HALF = (1 << PAIR_LO_BITS - 1) - 1  # half a unit of lo less one: with the unit's low bit, ties to even
PAIR_LO_MAX = 127
PAIR_LO_BYTES = 1


@dataclass(frozen=True)
class RowPassConfig:
    """The passes over one chunk's float32 logits: row statistics, dlogits, row scaling, bias gradient."""
    NUMERICS = ("block_v",)
    block_rows: int = 2     # rows per program (each row's sums are its own: speed only)
    block_v: int = 1024     # columns per step = slots of the per-row partial sums (their pairwise sum: bits)
    num_warps: int = 4


@dataclass(frozen=True)
class BlockConfig:
    """An elementwise kernel (the heads and the vocab-parallel merge over rows, the gradient scaling over a
    flat array): elements per program and warps, speed only; `max_programs` > 0 caps the programs of a
    kernel that loops over its blocks."""
    NUMERICS = ()
    block: int
    num_warps: int = 4
    max_programs: int = 0


@dataclass(frozen=True)
class PairwiseConfig:
    """fce_torch's `pairwise_sum` kernel: columns per tree level (a power of two) and elements per program.
    The tree is the same for every value (aligned blocks of a pairwise tree are its subtrees): speed only."""
    NUMERICS = ()
    block_cols: int = 1024
    block: int = 4096
    num_warps: int = 4


@dataclass(frozen=True)
class PairConfig:
    """The CPO pair kernel: pairs per program and tokens per step (elementwise: speed only)."""
    NUMERICS = ()
    block_pairs: int = 16
    block_t: int = 256
    num_warps: int = 4


@dataclass(frozen=True)
class GemmConfig:
    """The logits GEMM of the fused engine (engine="fused"): one program per (tile_m rows, tile_n columns)
    output tile, K ascending in steps of tile_k. `tile_n` decides bits: it sets the per-(row, tile) partials
    that the merge then adds in a fixed order. The K order (ascending, never split) is the same for every
    tile_k, so tile_k, tile_m and the launch fields only change speed. `tma` (operands loaded by the tensor
    memory accelerator where their strides allow) and `persistent` (one program per multiprocessor, looping
    over the tiles) apply to fce_torch's Triton kernels: the Pallas Triton lowering has neither; speed only.
    `flatten` (fce_torch, persistent): the tile loop and its K loop pipelined as one (Triton's
    `tl.range(flatten=True)`), so that the next tile's loads overlap this tile's epilogue; speed only.
    `mosaic` (the JAX twin): the kernel on Pallas Mosaic GPU where it applies
    (fce_jax/kernels/logit_tiles_mgpu.py), with the same bits; speed only. `pingpong_max_hidden` (the JAX twin):
    below."""
    NUMERICS = ("tile_n",)
    tile_m: int = 128
    tile_n: int = 256   # a power of two (the partial sums' tree)
    tile_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = True
    persistent: bool = True
    flatten: bool = False
    programs_per_sm: int = 1  # persistent programs per multiprocessor: two overlap one's epilogue with the other's MMAs
    mosaic: bool = False
    # The JAX twin on the GPU without `mosaic`: Mosaic GPU's ping-pong kernel (LOGITS_PINGPONG) for 16-bit rows of at
    # most this many columns whose tile values are stored, not into a kept dZ, where `pingpong_supports` holds
    # (0: never); speed only
    pingpong_max_hidden: int = 0


@dataclass(frozen=True)
class PingPongConfig:
    """fce_torch's logits GEMM on sm_90 for 16-bit operands (fce_torch/kernels/logit_tiles_gluon.py, Gluon): two
    compute warpgroups taking [tile_m, GemmConfig.tile_n] tiles in turns, K in steps of tile_k through a ring of
    num_stages, a loader; the epilogue's e and sums in `parts` column blocks (a power of two; `parts_q_pz`
    where the head asks for q or pz: their terms beside e spilled at 2 blocks), each owner's e staged in
    `e_buffers` of them (dividing both); register counts of the partitions (setmaxnreg); the loader's warps.
    Speed only: the partials' width is GemmConfig.tile_n, as in the Triton kernel. The JAX twin's Mosaic GPU
    ping-pong kernel (fce_jax/kernels/logit_tiles_mgpu.py) takes tile_m, tile_k, num_stages, parts, parts_q_pz
    and loader_warps (1, or 4: its whole memory warpgroup) from it; its register split is
    `fce_jax.kernels.mgpu`'s, with one e buffer an owner."""
    NUMERICS = ()
    tile_m: int = 64
    tile_k: int = 64
    num_stages: int = 4
    parts: int = 2
    parts_q_pz: int = 4
    e_buffers: int = 1
    compute_regs: int = 240
    loader_regs: int = 24
    loader_warps: int = 1


@dataclass(frozen=True)
class GradGemmConfig:
    """The fused engine's dX = dZ W and dW (+)= dZᵀ X GEMMs: output tiles, K ascending in steps of tile_k.
    dX (K = V) of few output tiles is split over V into `fce_core.plan.dx_slices` slices of whole tile_k
    steps, float32 partials summed in a fixed pairwise order. The slice count comes from the tile grid
    `split_m` x `split_n`, not from the launch tiles, so the NUMERICS fields (which set the slices) are the
    twins' common ground while the launch fields (tile_m, tile_n, warps, stages, `tma`, `persistent`: as in
    GemmConfig) may differ per twin: with the same K order, every tiling gives the same bits."""
    NUMERICS = ("split_m", "split_n", "tile_k", "target_programs", "max_slices")
    split_m: int = 128
    split_n: int = 128
    tile_k: int = 64
    target_programs: int = 264   # split dX over V until about this many programs run
    # Each slice is a float32 [rows, H] plane next to the chunk's tile values. A 512-row chunk at H = 640 has
    # 20 tiles (13 slices by target_programs): 12 fill 120 of 132 multiprocessors on 256x128 launch tiles (8
    # filled 80), and its 12 planes of 1.25 MiB, summed straight into dX, fit (8192, 640, 262144)'s budget.
    max_slices: int = 12
    tile_m: int = 128
    tile_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False
    persistent: bool = False
    flatten: bool = False  # as GemmConfig's (fce_torch), where K is not sliced and C is not added to
    programs_per_sm: int = 1  # as GemmConfig's (fce_torch)
    mosaic: bool = False  # the JAX twin's GEMMs on Pallas Mosaic GPU (fce_jax/kernels/grad_gemms_mgpu.py)
    # With `mosaic`, where K is not sliced: the two compute warpgroups take tiles of tile_m / 2 x tile_n in turns
    # off one ring of stages, one's epilogue under the other's wgmma (grad_gemms_mgpu's `_pingpong_kernel`);
    # the default only for dW of at most SHORT_ROWS rows (GRAD_GEMM_MOSAIC_SHORT_K)
    pingpong: bool = False
    # dZ formed from the logits GEMM's tile values on the dX / dW GEMMs' operand load, where the head's dZ is
    # that `fce_core.heads.forms_dz_on_load` admits (no pass over the [rows, V] values): the same values, speed only
    dz_on_load: bool = False


@dataclass(frozen=True)
class SplitTileGradConfig:
    """fce_torch's gradient GEMMs on sm_90 for bfloat16 operands (fce_torch/kernels/grad_gemms_gluon.py, Gluon; the
    schedule of the JAX twin's GRAD_GEMM_MOSAIC kernel; GLUON_GRADS): [tile_m, tile_n] output tiles whose rows two
    compute warpgroups split, K in steps of tile_k through a ring of num_stages that a loader warp fills, each
    warpgroup's epilogue in column blocks of epilogue_cols through two shared-memory slots; register counts of the
    partitions (setmaxnreg). Speed only: the products and the epilogue are GradGemmConfig's, whatever the tiles."""
    NUMERICS = ()
    tile_m: int = 256
    tile_n: int = 128
    tile_k: int = 32
    num_stages: int = 6
    epilogue_cols: int = 32
    compute_regs: int = 240
    loader_regs: int = 24


@dataclass(frozen=True)
class DzPassConfig:
    """The JAX twin's dZ pass over the tile values (fce_jax/kernels/tile_dlogits.py): on Pallas' Triton lowering
    (TILE_ROWS' blocks), or with `mosaic` on Mosaic GPU (tile_dlogits_mgpu.py: persistent programs, blocks of
    64 rows per compute warpgroup x block_cols moved by TMA, `num_stages` of them in flight). Elementwise: speed
    only."""
    NUMERICS = ()
    mosaic: bool = False
    compute_wgs: int = 2    # each rewriting 64 rows of a block (1 or 2)
    block_cols: int = 64    # at most the logits GEMM's tile_n, so that a block lies in one tile
    num_stages: int = 6


@dataclass(frozen=True)
class BudgetConfig:
    """Memory budgets of the planner (bytes) and the row granule of a chunk."""
    NUMERICS = ("logits", "kept_logits", "grouped_logits", "tiles", "row_multiple")  # chunk shapes: GEMM bits
    logits: int = 1 << 30          # the float32 logits of one chunk
    kept_logits: int = 1 << 29     # the same when every chunk's dZ is kept (it shares the memory with them)
    grouped_logits: int = 1 << 28  # the same next to a group's kept dZ and a float32 dW accumulator
    tiles: int = 1 << 28           # engine="fused": a chunk's exp-scaled tile values in the input dtype (its
                                   # per-tile statistics without gradients, plan.STATS_BYTES)
    # engine="fused" without gradients: a chunk's rows of x, which stay in L2 while every W tile streams past
    # them (H200 loss only, 16384x2048: 14.2 ms at 16 MiB, 18.7 at 58; bench/results/nvidia-h200/jax-known-length/)
    resident_x: int = 1 << 24
    # engine="fused" where dZ is kept (every chunk's, or a CPO group's) and the budget's chunks would be fewer: a
    # group cut into at most this many chunks, each the fewest whole row granules that do it (plan.kept_chunk).
    # The tile values go into the kept rows, so a chunk only sets the logits GEMM's rows and how finely the
    # chunks past the last valid row are left out; the bits do not depend on it. Each chunk more costs launches,
    # a step of fce_jax's loop and a compiled branch of its kept GEMMs. H100, 4 chunks of 512 rows against 2 of
    # 1024 at (2048, 4096, 128256): 17-18% faster with a quarter of the rows ignored, 1% (torch) and 5% (JAX)
    # slower with none, JAX's first call 4.1-4.4 s against 2.8-2.9; 8 against 4 at 4096 rows gained 7-9% at a
    # quarter ignored but lost 12% in JAX at half ignored and doubled its compile (bench/results/nvidia-h100/
    # kept-chunk/), hence a count and not a fixed size
    kept_chunks: int = 4
    row_multiple: int = 128


ROW_PASS = RowPassConfig()
# The CPU interpreters pay per program: wider row blocks, the same bits (block_rows is not numerics-bearing).
ROW_PASS_INTERPRETER = RowPassConfig(block_rows=64)
# fce_torch's in the Triton interpreter: a whole small chunk per program (a CCE peer test's row passes 4 -> 1
# programs); the Pallas interpreter keeps 64, its buffers for 256 rows outgrew tests/test_flce_jax_only.py's
# memory bound.
ROW_PASS_INTERPRETER_TORCH = dataclasses.replace(ROW_PASS_INTERPRETER, block_rows=256)
HEAD = BlockConfig(block=1024)
PAIRS = PairConfig()
PAIRWISE = PairwiseConfig()
# The interpreter pays per program: one program per tree level at the CPU tests' sizes (the library engine's
# [rows, 1024] partials took 64 programs a call, 70% of a CCE test's time).
PAIRWISE_INTERPRETER = PairwiseConfig(block=1 << 20)
# In place, g = 1 skips the pass: a few programs then cost a launch, not one per block of dW.
GRAD_SCALE = BlockConfig(block=4096, num_warps=8, max_programs=1024)
# Not flattened: the flattened loop spilled 952 bytes per thread (sm_90a) until the row sums' pairs became
# warp shuffles (0 since), and was timed at H = 640 only (tools/fused_kernels.py --logits times it again).
# The JAX twin takes Mosaic GPU's ping-pong kernel for H <= 1024 (`pingpong_max_hidden`; fce_torch's bits). Per chunk
# on the H100, with the target logit only in tiles holding targets and the maxima by max.f32: 0.493 ms against the
# Triton lowering's 0.639 at (768, 640, 262144), 0.581 against 0.700 at (1280, 896, 151936), 1.862 against 1.800 at
# (2048, 2048, 128256); fce_jax fwd+bwd 19.79 ms at 8192x640 and 13.63 at 8192x896, 21.29 and 14.70 without it
# (bench/results/nvidia-h100/mosaic-logits-epilogue/). Without the tile values stored it was slower per chunk at
# (1280, 896, 151936) (0.625 against 0.604) and faster at (768, 640, 262144) (0.383 against 0.507); in the engine, whose
# loss-alone chunks are larger (7168 rows at 8192x640), the loss alone on it took 5.65-5.75 ms against 5.31-5.55 at
# 8192x640 and 4.48-4.61 against 3.79-3.95 at 8192x896 (bench/results/nvidia-h100/tables-f05429b/), so the loss alone
# keeps the Triton lowering; so do H = 2048 (on the H200 1.574 against 1.719 ms per chunk at (2048, 2048, 128256), but
# fce_jax fwd+bwd at 16384x2048 44.04 against 44.10 ms, bench/results/nvidia-h200/tables-180f068/) and a kept dZ
# (`into`: not timed since XLA's dynamic-slice fusion stopped failing on it). `python -m bench op --logits-gemm
# pingpong_max_hidden=0` runs without it.
GEMM = GemmConfig(pingpong_max_hidden=1024)
# The launches for a chunk of at most SHORT_ROWS rows (256 rows in one chunk: a memory-bound logits GEMM and dW
# of K = 256): the logits GEMM in 4 stages (both twins), the JAX twin's Mosaic GPU dW with its compute warpgroups
# in turns in 5 stages. H100 at (256, 4096, 128256), fwd+bwd: 4 stages 1.55 -> 1.52 ms (fce_torch) and 1.45 ->
# 1.41 (fce_jax); pingpong in 5 stages, fce_jax 1.45 -> 1.38 (bench/results/nvidia-h100/short-rows/). Speed only:
# 4 stages were slower at 1024x2048 and 4096x4096 (bench/results/nvidia-h200/n256-probes/), the pingpong 12% slower
# at 16384x2048 (bench/results/nvidia-h100/engine-v2-flags/), so longer chunks keep GEMM and GRAD_GEMM_MOSAIC.
SHORT_ROWS = 256
GEMM_SHORT = dataclasses.replace(GEMM, num_stages=4, pingpong_max_hidden=0)  # no faster on the ping-pong kernel


def short(rows):
    """Whether a chunk of `rows` rows (None: not known) takes the launches for few rows."""
    return rows is not None and rows <= SHORT_ROWS


# fce_torch's logits GEMM for chunks of more than SHORT_ROWS rows where `logit_tiles_gluon.applies` (sm_90, 16-bit
# operands, raw logits): the ping-pong kernel, one warpgroup's epilogue under the other's wgmma, the Triton kernel's
# bits. Per chunk on the H100, two calls: 1.50-1.53 ms against 1.60-1.61 at (2048, 2048, 128256), 0.47-0.48
# against 0.64-0.65 at (768, 640, 262144), 0.54-0.57 against 0.74-0.79 at (1280, 896, 151936), 1.48-1.58 against
# 1.74-1.76 at (1024, 4096, 128256); at 256 rows no faster, so short chunks keep GEMM_SHORT. In the engine,
# fwd+bwd 2.7% faster at 16384x2048 and 5.9% at 8192x640 (bench/results/nvidia-h100/logits-pingpong/).
LOGITS_PINGPONG = PingPongConfig()
# The JAX twin's launch of the ping-pong kernel (fce_jax/kernels/logit_tiles_mgpu.py): its loader in the memory
# warpgroup's 4 warps. Per chunk on an H100 with the tile values stored, one warp with 4 epilogue parts took 7-8% off
# at H = 2048 (1.680 against 1.928 ms, bench/results/nvidia-h100/loader-one-warp/), but in the engine, timed against
# this launch in one process (`tools/engine_ab.py`, bench/results/nvidia-h100/engine-loader-ab/), it gained nothing
# beyond the spread of identical programs (3% at 16384x2048, under the power cap): 0.96x and 1.01x at 16384x2048 with
# `pingpong_max_hidden=2048`, 1.01x at 8192x640 (twice), 0.98x at 8192x896; the same bits.
LOGITS_PINGPONG_MOSAIC = dataclasses.replace(LOGITS_PINGPONG, loader_warps=4)
# The interpreters' tiles: small shapes reach several tiles and K steps (tile_n differs: other partials).
GEMM_INTERPRETER = GemmConfig(tile_m=16, tile_n=32, tile_k=16, num_warps=4, num_stages=1)
# The JAX twin's logits GEMM on Pallas Mosaic GPU, opt-in. Raw logits without pz take the ping-pong kernel
# (LOGITS_PINGPONG's launch): fce_torch's bits but for pz; on the H100 faster than the Triton lowering's kernel at
# H = 640 per chunk, even at H = 2048 and slower at H = 4096 (below, and bench/results/nvidia-h100/
# mosaic-logits-pingpong/, where its accumulator still spilled 184-216 bytes a thread). The rest take the kernel
# whose two compute warpgroups split each 128-row tile: it hung on the H200 until a cross-warpgroup race in its
# epilogue was removed; since then it returns on the H100, slower than the Triton lowering's kernel and not bitwise
# with q / pz, a temperature with a bias, or class weights (bench/results/nvidia-h100/engine-v2-flags/): it is
# never a default.
GEMM_MOSAIC = dataclasses.replace(GEMM, tma=True, persistent=True, mosaic=True)
GEMM_MOSAIC_INTERPRETER = dataclasses.replace(GEMM_INTERPRETER, tile_m=128, num_stages=2, tma=True, persistent=True,
                                              mosaic=True)
GRAD_GEMM = GradGemmConfig()
# fce_torch's launch of the same GEMMs (NUMERICS as GRAD_GEMM): TMA loads and wider persistent tiles, faster in
# Triton (tools/fused_kernels.py); the JAX twin's fused engine was slower on 128x256 tiles at N >= 16384 and at
# H = 640 (bench/results/nvidia-h200/engine-tma/op-both-twins-128x256/), so it keeps GRAD_GEMM's. Flattened
# where K is not sliced: dW of 256 rows 0.71 -> 0.54 ms, of 1024 rows 1.81 -> 1.46, the (hi, lo) update 2-7%
# faster (bench/results/nvidia-h200/grad-flatten/).
GRAD_GEMM_TORCH = dataclasses.replace(GRAD_GEMM, tile_n=256, tma=True, persistent=True, flatten=True)
# fce_torch's dX on 256x128 tiles where they take fewer rounds of the multiprocessors than 128x256 (H = 640:
# 0.57 ms against 0.98 at 1024 rows; 6-8% slower on a tie at H = 2048 and 4096,
# bench/results/nvidia-h200/tile-order/). dW on them where their column tiles pad H less
# (grad_gemms._dw_config).
GRAD_GEMM_TORCH_TALL = dataclasses.replace(GRAD_GEMM_TORCH, tile_m=256, tile_n=128)
# fce_torch's launch where dZ is formed on the operand load: 128x256 tiles, not flattened, the ones that hold
# the tile values' transform without spilling (sm_90a: dX and dW written 0 bytes; the (hi, lo) accumulation 224).
# Measured on the H200 (bench/results/nvidia-h200/epilogue-shuffles/): 2.5x slower than the dZ pass and the
# GEMMs over dZ, and on 128x256 tiles not bitwise the dZ path's (256x128 is): dz_on_load stays off.
GRAD_GEMM_TORCH_ON_LOAD = dataclasses.replace(GRAD_GEMM_TORCH, flatten=False)
# The JAX twin's launch of the same GEMMs on Pallas Mosaic GPU, its default for 16-bit operands on the GPU
# (NUMERICS as GRAD_GEMM): two compute warpgroups on half a tile's rows each, TMA loads, persistent programs,
# 3 stages, 256x128 tiles: with dW's tiles walking H fastest (`fce_core.plan.rows_fast`), faster than 128x256
# in 7 of 8 measurements of dX (5 shapes, 3 runs), 8 of 8 of dW written and 6 of 8 of dW accumulated (behind by
# 6-10% at H = 896 and in one of two runs at H = 4096; bench/results/nvidia-h200/tile-order/). Bit for bit
# fce_torch's.
GRAD_GEMM_MOSAIC = dataclasses.replace(GRAD_GEMM, tile_m=256, tile_n=128, num_stages=3, tma=True, persistent=True,
                                       mosaic=True)
GRAD_GEMM_MOSAIC_SHORT_K = dataclasses.replace(GRAD_GEMM_MOSAIC, pingpong=True, num_stages=5)  # see GEMM_SHORT
# fce_torch's dW (hi, lo) update for a bfloat16 weight on sm_90 (grad_gemms_gluon.applies), in place of the Triton
# kernel: the same bits. Per chunk on the H100, against the Triton kernel: an accumulation 0.602 against 0.660 ms at
# (768, 640, 262144), 1.789 against 1.944 at (2048, 2048, 128256), 0.714 against 0.796 at (1280, 896, 151936),
# 2.304 against 2.441 at (1024, 4096, 128256); the first chunk 2-10% and the last 4-11% faster too. 256x128x64 in 3
# stages was 10-13% slower than this launch at H = 640 and up to 9% at H = 2048 and 4096, 1-4% faster on the first
# chunk and the accumulation at H = 896 and 6% on the last chunk at H = 4096. In the engine, alternating with the tree
# before: fce_torch fwd+bwd 43.0-44.3 -> 41.8-42.0 ms at 16384x2048, 21.1 -> 19.9 at 8192x640, 14.8-15.0 ->
# 14.1-14.4 at 8192x896 (bench/results/nvidia-h100/gluon-dw-pair/)
GRAD_GEMM_GLUON = SplitTileGradConfig()
# fce_torch's gradient GEMMs that the Gluon kernel computes: dW's (hi, lo) update, dW written once, dX (into its rows
# or its slices' float32 planes)
GLUON_GEMMS = ("pair", "dw", "dx")
# Those of GLUON_GEMMS that take GRAD_GEMM_GLUON where it applies and no launch is given; the others keep the Triton
# kernel (the same bits either way: bench/results/nvidia-h100/gluon-dx-dw/). dW written once (one chunk, a kept dZ's
# group) against the Triton kernel on the H100: 6.13 against 6.66 ms at (4096, 4096, 128256)'s kept group, 8-11%
# faster at H = 640 and 896, 4% slower at K = 1024-2048 with H >= 2048; fce_torch fwd+bwd at 4096x4096 medians 19.90
# against 20.16 ms over 7 alternating rounds. dX stays on the Triton kernel: 6% faster per chunk at H = 640, 1-3%
# slower at H >= 2048, and within the rounds' spread in the engine (medians 19.98 against 20.12 ms at 8192x640, 42.18
# against 42.04 at 16384x2048, 14.29 against 14.27 at 8192x896 over 15-16 alternating rounds)
GLUON_GRADS = ("pair", "dw")
GRAD_GEMM_INTERPRETER = GradGemmConfig(split_m=16, split_n=16, tile_k=16, tile_m=16, tile_n=16, num_warps=4,
                                       num_stages=1)
# Other launch tiles than the JAX twin's in the CPU tests too: the twins' bits must not depend on them.
GRAD_GEMM_INTERPRETER_TORCH = dataclasses.replace(GRAD_GEMM_INTERPRETER, tile_n=32, tma=True, persistent=True)
# Mosaic GPU's smallest wgmma tile has 64 rows per warpgroup.
GRAD_GEMM_MOSAIC_INTERPRETER = dataclasses.replace(GRAD_GEMM_INTERPRETER, tile_m=128, tile_n=32, tma=True,
                                                   persistent=True, mosaic=True)
TILE_ROWS = BlockConfig(block=16)  # rows per program of the tiled dlogits kernels and fce_jax's merge (speed only)
# Opt-in until timed on the GPU against the Triton lowering's 3.85 TB/s (docs/PERFORMANCE.md, the port plan).
DZ_PASS = DzPassConfig()
# Rows per program of fce_torch's merge of the logits GEMM's partials, each program through all its rows' tiles:
# at 16 a 768-row chunk (H = 640) ran on 48 programs of 132 multiprocessors; at 4, 0.141 ms a step against 0.326
# (H100, bench/results/nvidia-h100/merge-rows/). Rows are independent: speed only.
MERGE_ROWS = BlockConfig(block=4)
# fce_torch's host check of the values: one program over every target and class weight (speed only).
VALUE_FLAGS = BlockConfig(block=4096, num_warps=8)
BUDGET = BudgetConfig()

"""Frozen kernel configurations shared by both twins, and the constants of the shared elementwise math.

A field whose value changes the bits of a result is listed in its class's ``NUMERICS`` (for instance the width
of the per-row partial accumulators, whose fixed pairwise sum gives a row's sum of exponentials); the other
fields only change speed. Both twins read the same instances, so their kernels agree by construction.
"""
from dataclasses import dataclass

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# tanh(u) = u + u^3 (C3 + u^2 (C5 + u^2 C7)) below |u| = TANH_POLY_BELOW, else (1 - e) / (1 + e) with
# e = 2**(-2 |u| log2 e): the odd Taylor polynomial of degree 7 (coefficients -1/3, 2/15, -17/315).
TANH_POLY_BELOW = 0.125
TANH_C3 = -0.3333333333333333
TANH_C5 = 0.13333333333333333
TANH_C7 = -0.05396825396825397


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
    flat array): elements per program and warps, speed only."""
    NUMERICS = ()
    block: int
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
    """Tiles of the fused GEMMs of engine v2. Every field decides bits: the K order inside a tile and the
    fixed split of a long K (= V) into `v_slices` float32 partials summed in slice order."""
    NUMERICS = ("tile_m", "tile_n", "tile_k", "v_slices")
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    v_slices: int = 1


@dataclass(frozen=True)
class BudgetConfig:
    """Memory budgets of the planner (bytes) and the row granule of a chunk."""
    NUMERICS = ("logits", "kept_logits", "grouped_logits", "row_multiple")  # chunk shapes decide GEMM bits
    logits: int = 1 << 30          # the float32 logits of one chunk
    kept_logits: int = 1 << 29     # the same when every chunk's dZ is kept (it shares the memory with them)
    grouped_logits: int = 1 << 28  # the same next to a group's kept dZ and a float32 dW accumulator
    row_multiple: int = 128


ROW_PASS = RowPassConfig()
# The CPU interpreters pay per program: wider row blocks, the same bits (block_rows is not numerics-bearing).
ROW_PASS_INTERPRETER = RowPassConfig(block_rows=64)
HEAD = BlockConfig(block=1024)
PAIRS = PairConfig()
GRAD_SCALE = BlockConfig(block=4096, num_warps=8)
GEMM = GemmConfig()
BUDGET = BudgetConfig()

"""The one planner: how the rows are cut into chunks, where dZ lives, and which chunks run.

A `Plan` fixes, from shapes alone (so a traced JAX program and an eager torch call plan alike):
- ``rows``: rows per chunk (the first chunk of a group takes the remainder, so the chunks after it are full);
- ``keep_dz``: keep every chunk's dZ ([rows of the group, V] in the input dtype) for one dX and one dW GEMM
  after the group's last chunk, instead of a float32 [V, H] dW accumulator that every chunk reads and writes;
- ``group_rows``: groups of whole preference pairs (CPO whose dZ does not fit at once), or None for one group.
The chunks that hold only ignored rows (once the valid rows come first) need not run: `chunks_to_run`.
"""
from dataclasses import dataclass

from .config import BUDGET, GEMM, GRAD_GEMM, PAIR_LO_BYTES, BudgetConfig, GradGemmConfig

# The fused logits GEMM's float32 / int32 [rows, tiles] arrays without gradients, bytes per row and tile: its
# partials m, s, amax, zy, q, pz and the merge's rescaled s, q, pz.
STATS_BYTES = 9 * 4


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints. fce_torch's host code calls it where `triton.cdiv`, a Triton constexpr function,
    takes about 2 us a call: twenty calls a fused fwd+bwd."""
    return -(-a // b)


def chunk_rows(n_rows: int, vocab: int, requested: int | None = None, budget: int = BUDGET.logits,
               row_multiple: int = BUDGET.row_multiple, logit_bytes: int = 4) -> int:
    """Rows per chunk: `requested` if given, else the largest multiple of `row_multiple` whose logits
    (`logit_bytes` each: float32) fit in `budget` bytes (at least one multiple); never more than `n_rows`
    (and at least 1)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {requested}")
        rows = requested
    else:
        rows = max(row_multiple, budget // (logit_bytes * max(vocab, 1)) // row_multiple * row_multiple)
    return max(1, min(n_rows, rows))


def layout(n_rows: int, rows: int) -> tuple[int, int]:
    """(rows of the first piece, number of pieces) for pieces of `rows` rows, the first taking the remainder
    (1 to `rows` rows, 0 when there are none)."""
    n = max(1, cdiv(n_rows, rows))
    return n_rows - (n - 1) * rows, n


def bounds(n_rows: int, rows: int) -> list[tuple[int, int]]:
    """[(start, stop)] of the pieces of `layout`."""
    first, n = layout(n_rows, rows)
    return [(0, first)] + [(first + (i - 1) * rows, first + i * rows) for i in range(1, n)]


@dataclass(frozen=True)
class Plan:
    n_rows: int
    rows: int
    keep_dz: bool = False
    group_rows: int | None = None

    @property
    def groups(self) -> list[tuple[int, int]]:
        """[(start, stop)] of the groups (one group of all rows without `group_rows`)."""
        return [(0, self.n_rows)] if self.group_rows is None else bounds(self.n_rows, self.group_rows)

    def chunks(self, group_size: int) -> list[tuple[int, int]]:
        """[(start, stop)] of the chunks of a group of `group_size` rows, relative to the group."""
        return bounds(group_size, self.rows)

    def single_product(self, need_grads: bool) -> bool:
        """Whether one GEMM computes dW (one group, and its dZ kept or one chunk): dW is then written in the
        weight's dtype, else accumulated in float32."""
        keep = self.keep_dz and need_grads
        return self.group_rows is None and (keep or layout(self.n_rows, self.rows)[1] == 1)

    @property
    def puts_valid_first(self) -> bool:
        """Whether a sweep puts each group's valid rows first within the group, so that the chunks past them
        need not run: groups of several chunks. With one chunk every row runs anyway, and keeping the caller's
        order saves the permutation's copies (at N = 256, H = 4096 the JAX twin's gathered x and scattered dX,
        3.5 MiB over Liger + A)."""
        return layout(self.group_rows or self.n_rows, self.rows)[1] > 1

    def chunks_to_run(self, n_valid, clip=lambda v, lo, hi: min(hi, max(lo, v)), size=None):
        """The chunks of a group of `size` rows (default: the single group's) that hold any of its `n_valid`
        valid rows once those come first (the first chunk always runs); `clip(v, lo, hi)`: the framework's,
        for a traced count (``jnp.clip``)."""
        first, n_chunks = layout(self.n_rows if size is None else size, self.rows)
        return 1 + clip(-((first - n_valid) // self.rows), 0, n_chunks - 1)


def plan_rows(n_rows: int, hidden: int, vocab: int, itemsize: int, *, need_grads: bool,
              requested: int | None = None, budget: BudgetConfig = BUDGET, engine: str = "library",
              dw_pair: bool = False) -> Plan:
    """The plan of a row loss (FLCE, token log-probs): dZ is kept when gradients are asked, there are several
    chunks and all rows' dZ is no larger than the float32 dW accumulator it replaces (N * itemsize <= 4 H).
    Which gradients are asked does not enter (a frozen weight plans like a trained one), so that both twins
    (fce_jax always computes all three) run the same GEMM shapes. The fused engine plans by `fused_rows`
    (`dw_pair`: a bfloat16 weight, whose dW it accumulates as a (hi, lo) pair)."""
    if engine == "fused":
        return fused_rows(n_rows, hidden, vocab, itemsize, need_grads=need_grads, requested=requested,
                          budget=budget, dw_pair=dw_pair)
    rows = chunk_rows(n_rows, vocab, requested, budget.logits, budget.row_multiple)
    keep = need_grads and rows < n_rows and n_rows * itemsize <= 4 * hidden
    if keep and requested is None:
        rows = chunk_rows(n_rows, vocab, None, budget.kept_logits, budget.row_multiple)
    return Plan(n_rows, rows, keep)


def fused_rows(n_rows: int, hidden: int, vocab: int, itemsize: int, *, need_grads: bool,
               requested: int | None = None, budget: BudgetConfig = BUDGET, dw_pair: bool = False) -> Plan:
    """The fused engine's row plan. A chunk's tile values (itemsize bytes per logit) fit `budget.tiles`.
    With gradients and several chunks, dZ is kept (the tile values are then written into the kept rows, so
    no chunk buffer exists) when that costs no more than accumulating would: all rows' dZ against one chunk
    plus the float32 accumulator's excess over a dW in the weight's dtype,
    N * itemsize <= H * (4 - itemsize) + rows * itemsize; its chunks are then about `budget.kept_chunks` where
    the budget's would be fewer (`kept_chunk`). Otherwise, with `dw_pair` (a bfloat16 weight, its dW accumulated as a
    bfloat16 hi and an int8 lo: an excess of PAIR_LO_BYTES per element where float32's is 2), the chunk takes
    the bytes the pair saves, V * H * (2 - PAIR_LO_BYTES) more for its tile values: the same memory in fewer,
    larger chunks, so the accumulator is read and written fewer times.

    Without gradients no tile values are stored: the budget holds a chunk's per-tile statistics instead
    (STATS_BYTES per row and logits tile of GEMM.tile_n columns), and the chunk's rows of x fit
    `budget.resident_x` (in L2 while the W tiles stream past): fewer, larger chunks (2048 rows at H = 4096,
    7168 at H = 640, V = 262144), hence fewer launches, and a row's outputs do not depend on its chunk."""
    if not need_grads:
        tiles = cdiv(vocab, GEMM.tile_n)
        return Plan(n_rows, min(chunk_rows(n_rows, tiles, requested, budget.tiles, budget.row_multiple, STATS_BYTES),
                                chunk_rows(n_rows, hidden, requested, budget.resident_x, budget.row_multiple,
                                           itemsize)), False)
    rows = chunk_rows(n_rows, vocab, requested, budget.tiles, budget.row_multiple, itemsize)
    keep = rows < n_rows and n_rows <= fused_kept_rows(hidden, itemsize, rows)
    if keep:
        rows = kept_chunk(n_rows, rows, requested, budget)
    elif dw_pair and rows < n_rows and requested is None:
        rows = chunk_rows(n_rows, vocab, None, budget.tiles + vocab * hidden * (2 - PAIR_LO_BYTES),
                          budget.row_multiple, itemsize)
    return Plan(n_rows, rows, keep)


def kept_chunk(group_rows: int, rows: int, requested: int | None, budget: BudgetConfig = BUDGET) -> int:
    """The fused engine's chunk of a group of `group_rows` rows whose dZ is kept: `rows` or, where that makes
    fewer than `budget.kept_chunks` chunks, the fewest whole row granules that cut the group into at most that
    many (unless a size was requested). The tile values are written into the kept rows, so a smaller chunk costs
    no memory, and it leaves out more of the group's ignored rows: the chunks past the last valid row do not
    run, and the kept dZ's GEMMs take only the rows of those that ran. A row's results do not depend on its
    chunk, so neither do the bits."""
    if requested is not None:
        return rows
    return min(rows, cdiv(cdiv(group_rows, budget.kept_chunks), budget.row_multiple) * budget.row_multiple)


def plan_pairs(n_pairs: int, seq_len: int, hidden: int, vocab: int, itemsize: int, *, need_grads: bool,
               requested: int | None = None, budget: BudgetConfig = BUDGET, engine: str = "library") -> Plan:
    """The plan of a preference loss over 2 * n_pairs sequences of seq_len rows. Its dZ is always kept when
    gradients are asked (a pair's coefficients need all its rows): in one group when the row plan keeps it
    (or without gradients), else in groups of whole pairs, with chunks over each group (of the grouped float32
    logits budget; for the fused engine, whose tile values go into the kept rows, of its tiles budget, or about
    `budget.kept_chunks` where that makes fewer: `kept_chunk`) and dW accumulated over the groups. A group holds
    at most one chunk's rows, or on the fused engine as many rows as `fused_rows` keeps in one group
    (`fused_kept_rows`): more chunks per group, so that its valid-first order leaves out more of the prompts'
    ignored rows, and fewer accumulations of dW."""
    n_rows = 2 * n_pairs * seq_len
    base = plan_rows(n_rows, hidden, vocab, itemsize, need_grads=need_grads, requested=requested, budget=budget,
                     engine=engine)
    if not need_grads or base.keep_dz:
        return base
    cap = fused_kept_rows(hidden, itemsize, base.rows) if engine == "fused" else base.rows
    per_group = pairs_per_group(n_pairs, seq_len, cap)
    group_rows = 2 * per_group * seq_len
    if engine == "fused":
        rows = kept_chunk(group_rows, chunk_rows(group_rows, vocab, requested, budget.tiles, budget.row_multiple,
                                                 itemsize), requested, budget)
    else:
        rows = chunk_rows(group_rows, vocab, requested, budget.grouped_logits, budget.row_multiple)
    return Plan(n_rows, rows, True, None if per_group >= n_pairs else group_rows)


def fused_kept_rows(hidden: int, itemsize: int, rows: int) -> int:
    """The most rows whose dZ `fused_rows` keeps in one group with chunks of `rows` rows:
    N * itemsize <= H * (4 - itemsize) + rows * itemsize. A CPO group of that size costs the memory of one
    such dZ on top of the accumulated dW (at (4 pairs, T = 1024, H = 4096, V = 128256): groups of 2 pairs,
    1 GiB of dZ with the 1.5 GiB (hi, lo) pair, where Liger's CPO peaks at 3.0 GiB)."""
    return (hidden * (4 - itemsize)) // itemsize + rows


def pairs_per_group(n_pairs: int, seq_len: int, rows: int) -> int:
    """Whole pairs in a group of at most `rows` rows (at least one pair, at most all)."""
    return min(n_pairs, max(1, rows // (2 * seq_len)))


def pair_order(n_pairs: int, seq_len: int, plan: Plan) -> list[int] | None:
    """The sequence permutation that puts each group's sequences together (its chosen sequences, then its
    rejected ones), groups placed as `Plan.groups` places them; None with one group."""
    if plan.group_rows is None:
        return None
    order = []
    for g0, g1 in bounds(n_pairs, plan.group_rows // (2 * seq_len)):
        order += list(range(g0, g1)) + list(range(n_pairs + g0, n_pairs + g1))
    return order


def dx_slices(n_rows: int, hidden: int, vocab: int, cfg: GradGemmConfig = GRAD_GEMM) -> int:
    """Slices of V of the fused engine's dX = dZ W (K = V) for n_rows rows: 1 when the output tiles alone
    give about `cfg.target_programs` programs, else enough for that, at most `cfg.max_slices`, each slice
    at least 8 K steps long, counting output tiles on the `cfg.split_m` x `cfg.split_n` grid (not the launch
    tiles, which may differ between the twins). Both twins take it from here: it decides the bits of dX."""
    tiles = cdiv(n_rows, cfg.split_m) * cdiv(hidden, cfg.split_n)
    by_length = max(1, vocab // (8 * cfg.tile_k))
    return max(1, min(cfg.max_slices, by_length, cfg.target_programs // max(tiles, 1)))


# The gradient GEMMs' epilogues (both twins): C = the product in C's dtype; C (float32) += it; the (hi, lo) pair's
# update; its last update (lo read as an input, hi alone written: after the last product hi, the rounded sum, is dW).
WRITE, ADD, PAIR, PAIR_LAST = 0, 1, 2, 3


def reads_c(mode: int, first: bool) -> bool:
    """Whether the epilogue `mode` reads C: to add to it (ADD), or to the (hi, lo) pair after the first chunk's."""
    return mode in (ADD, PAIR_LAST) or (mode == PAIR and not first)


def rows_fast(m: int, n: int, tile_m: int, tile_n: int) -> bool:
    """Whether a gradient GEMM walks its [m, n] output tiles with the row blocks varying fastest: the grid
    dimension with fewer blocks varies fastest, so the programs that run at once share their blocks of the
    long dimension's operand (read from memory once) while the short dimension's stays in L2. dW [V, H] walks
    H fastest: row-blocks-first re-read all of a chunk's dZ from memory once per column block (16 times at
    H = 4096 on 256-wide tiles). Speed only: the order of the tiles does not touch a product's bits."""
    return cdiv(m, tile_m) <= cdiv(n, tile_n)


def gemm_items(m: int, n: int, slices: int, tile_m: int, tile_n: int) -> int:
    """The (tile, slice) work items of a gradient GEMM's [m, n] output on tile_m x tile_n tiles."""
    return cdiv(m, tile_m) * cdiv(n, tile_n) * slices


def waves(m: int, n: int, slices: int, tile_m: int, tile_n: int, processors: int) -> int:
    """Rounds of `processors` programs that the `gemm_items` of an [m, n] GEMM take."""
    return cdiv(gemm_items(m, n, slices, tile_m, tile_n), processors)

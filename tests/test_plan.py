"""The planner (fce_core.plan) and the skipping of ignored rows in both engines.

- `chunk_rows`, `layout`, `bounds`, `Plan` (groups, chunks, chunks_to_run, single_product), `plan_rows`,
  `plan_pairs`, `pair_order`: against rules re-derived here (brute force over small sizes, the documented
  budgets for the real shapes);
- the `valid_first` permutation (torch and JAX agree), and fce_torch's over groups (`valid_first_in_groups`);
- which chunks run: a marker head through each engine's `sweep` (which rows ran), and the logits GEMMs of a
  `fused_lce` call counted by monkeypatching `fce_torch.gemm.mm` / `fce_jax.gemm.mm` (JAX: a runtime callback
  per executed GEMM, since a chunk loop is traced once);
- runs that skip chunks give the reference's results (lse and dx 0 on ignored rows), and fce_torch's bits do
  not depend on ``validate`` (the host count that enables the skipping): FLCE with kept dZ and with the float32
  dW accumulator, "none", token log-probs and CPO.
"""

import itertools

import numpy as np
import pytest
import torch

from fce_core.config import BUDGET, BudgetConfig
from fce_core.heads import StatsSpec, forms_dz_on_load
from fce_core.options import Transform
from fce_core.plan import (STATS_BYTES, Plan, bounds, chunk_rows, layout, pair_order, pairs_per_group, plan_pairs,
                            plan_rows)
from helpers import to_jax
from parity.cases import IGNORE_INDEX, Case, make_inputs
from twins import TORCH, check_flce, each_twin, quick_jit

GiB = 1 << 30


def _expected_default_rows(n_rows, vocab, budget, multiple=BUDGET.row_multiple, logit_bytes=4):
    """The largest multiple of `multiple` whose logits (float32 unless said) fit in `budget` (at least one),
    capped at n_rows."""
    k = 1
    while (k + 1) * multiple * logit_bytes * vocab <= budget:
        k += 1
    return max(1, min(n_rows, k * multiple))


def _chunks_holding(n_rows, rows, n_valid):
    """Brute force: the chunks of `bounds(n_rows, rows)` (first = remainder) holding any row < n_valid, at least
    one."""
    first = n_rows - (-(-n_rows // rows) - 1) * rows if n_rows else 0
    starts = [0] + [first + i * rows for i in range(max(0, -(-n_rows // rows) - 1))]
    return max(1, sum(1 for s in starts if s < n_valid))


# ============================================================================ chunk_rows, layout, bounds
def test_chunk_rows_requested_and_default():
    assert chunk_rows(100, 1000, requested=7) == 7
    assert chunk_rows(5, 1000, requested=7) == 5           # never more than the rows
    assert chunk_rows(0, 1000, requested=7) == 1           # at least 1
    for n, v in [(4096, 128256), (100000, 128256), (100000, 256000), (1 << 20, 1000), (3, 50)]:
        for budget in (GiB, GiB // 2, GiB // 4):
            assert chunk_rows(n, v, budget=budget) == _expected_default_rows(n, v, budget), (n, v, budget)
    assert chunk_rows(100000, 128256) == 2048               # the 1 GiB default: 2093 rows fit, a multiple of 128
    assert chunk_rows(100000, 10 ** 9) == 128               # at least one row multiple, whatever the budget
    with pytest.raises(ValueError, match="chunk_rows"):
        chunk_rows(10, 10, requested=0)


@pytest.mark.parametrize("n_rows,rows", [(n, r) for n in (0, 1, 7, 8, 9, 37) for r in (1, 3, 8, 40)])
def test_layout_and_bounds(n_rows, rows):
    """Pieces cover [0, n_rows) in order; the first takes the remainder (1..rows rows, 0 without rows), the
    others are full."""
    first, n = layout(n_rows, rows)
    spans = bounds(n_rows, rows)
    assert len(spans) == n and spans[0] == (0, first)
    assert n == max(1, -(-n_rows // rows))
    assert (first == 0) if n_rows == 0 else (1 <= first <= rows)
    assert all(b - a == rows for a, b in spans[1:])
    assert all(spans[i][1] == spans[i + 1][0] for i in range(n - 1))
    assert spans[-1][1] == n_rows


# ============================================================================ Plan
@pytest.mark.parametrize("n_rows,rows", [(1, 1), (13, 4), (29, 4), (32, 8), (40, 2), (5, 8)])
def test_plan_chunks_to_run(n_rows, rows):
    plan = Plan(n_rows, rows)
    assert plan.groups == [(0, n_rows)]
    assert plan.chunks(n_rows) == bounds(n_rows, rows)
    for n_valid in range(n_rows + 1):
        assert plan.chunks_to_run(n_valid) == _chunks_holding(n_rows, rows, n_valid), n_valid


def test_plan_groups_and_single_product():
    grouped = Plan(30, 7, True, 10)
    assert grouped.groups == [(0, 10), (10, 20), (20, 30)]
    assert grouped.chunks(10) == [(0, 3), (3, 10)]
    assert Plan(50, 7, True, 20).groups == [(0, 10), (10, 30), (30, 50)]
    # one GEMM writes dW (in the weight's dtype) with one group and kept dZ (when gradients are asked) or one
    # chunk; never with groups
    assert Plan(30, 8, True).single_product(True) and not Plan(30, 8, True).single_product(False)
    assert Plan(8, 8).single_product(True) and Plan(8, 8).single_product(False)
    assert not Plan(30, 8).single_product(True)
    assert not grouped.single_product(True) and not grouped.single_product(False)
    assert not Plan(10, 10, True, 10).single_product(True)


# ============================================================================ plan_rows, plan_pairs, pair_order
@pytest.mark.parametrize("n,h,v,itemsize,requested", list(itertools.product(
    [1, 30, 4096, 16384], [16, 4096], [100, 128256], [2, 4], [None, 8])))
def test_plan_rows_rule(n, h, v, itemsize, requested):
    """dZ is kept only with gradients, several chunks, and all rows' dZ in the input dtype no larger than the
    float32 dW accumulator (N * itemsize <= 4 H); then a default chunk takes the kept budget."""
    for need_grads in (True, False):
        p = plan_rows(n, h, v, itemsize, need_grads=need_grads, requested=requested)
        rows = chunk_rows(n, v, requested)
        keep = need_grads and rows < n and n * itemsize <= 4 * h
        assert p.keep_dz == keep and p.group_rows is None and p.n_rows == n
        want = requested if requested is not None else _expected_default_rows(
            n, v, BUDGET.kept_logits if keep else BUDGET.logits)
        assert p.rows == max(1, min(n, want)), (need_grads, p)


def test_small_cases_run_both_dz_plans():
    """The small cases of test_flce.py, at their chunk_rows (helpers.CASE_CHUNK_ROWS), run with dZ kept and with
    the float32 dW accumulator, and with one chunk and several."""
    from helpers import case_chunk_rows
    from parity.cases import small_cases

    plans = [plan_rows(c.rows, c.h, c.v, 4 if c.dtype == "float32" else 2, need_grads=True,
                       requested=case_chunk_rows(c)) for c in small_cases()]
    assert {p.keep_dz for p in plans} == {True, False}
    assert {layout(p.n_rows, p.rows)[1] > 1 for p in plans} == {True, False}


def test_plan_rows_real_shapes():
    """The budgets at H=4096, V=128256 in bf16: 2 chunks of 1 GiB -> 4 of 512 MiB with dZ kept (N=4096; without
    gradients 2); dZ not kept when it outgrows the dW accumulator (N=16384) or with one chunk (N=2048)."""
    args = dict(need_grads=True)
    assert plan_rows(4096, 4096, 128256, 2, **args) == Plan(4096, 1024, True)
    assert plan_rows(4096, 4096, 128256, 2, need_grads=False) == Plan(4096, 2048, False)
    assert plan_rows(16384, 4096, 128256, 2, **args) == Plan(16384, 2048, False)
    assert plan_rows(2048, 4096, 128256, 2, **args) == Plan(2048, 2048, False)
    assert plan_rows(30, 16, 100, 2, requested=8, **args) == Plan(30, 8, True)
    assert plan_rows(30, 16, 100, 4, requested=8, **args) == Plan(30, 8, False)


@pytest.mark.parametrize("n,h,v", list(itertools.product([1, 30, 300, 4096, 16384], [16, 640, 4096],
                                                         [100, 151936, 262144])))
def test_fused_rows_pair_takes_the_bytes_it_saves(n, h, v):
    """The fused plan of a bfloat16 weight (`dw_pair`): where it accumulates dW over chunks (gradients, dZ not
    kept, several chunks, no requested size), its chunk's tile values take the byte per weight element that the
    (hi bfloat16, lo int8) pair saves against float32's excess: rows * V * 2 + V * H <= tiles + V * H * 2, so
    the same memory in fewer chunks; everywhere else the plan is float16's. Still several chunks, so still an
    accumulation (the budget it spends exists only there)."""
    small = BudgetConfig(tiles=1 << 16, row_multiple=8)
    for budget in (BUDGET, small):
        for need_grads, requested in itertools.product((True, False), (None, 8)):
            base = plan_rows(n, h, v, 2, need_grads=need_grads, requested=requested, budget=budget, engine="fused")
            pair = plan_rows(n, h, v, 2, need_grads=need_grads, requested=requested, budget=budget, engine="fused",
                             dw_pair=True)
            grows = need_grads and not base.keep_dz and base.rows < n and requested is None
            if not grows:
                assert pair == base
                continue
            assert pair.keep_dz is False and pair.rows >= base.rows and layout(n, pair.rows)[1] > 1
            assert pair.rows == _expected_default_rows(n, v, budget.tiles + v * h, budget.row_multiple, 2)
            if pair.rows > budget.row_multiple:  # not the one-granule floor
                assert pair.rows * v * 2 + v * h <= budget.tiles + v * h * 2


def test_fused_rows_pair_real_shapes():
    """The pair's chunks at the bench's accumulating shapes (bfloat16): 3 to 3.2x fewer accumulations at
    H >= 2048, 1.5x at H = 640 / 896."""
    rows = {shape: plan_rows(*shape, 2, need_grads=True, engine="fused", dw_pair=True).rows for shape in (
        (16384, 4096, 128256), (16384, 2048, 128256), (8192, 2304, 256000), (8192, 640, 262144), (8192, 896, 151936))}
    assert rows == {(16384, 4096, 128256): 3072, (16384, 2048, 128256): 2048, (8192, 2304, 256000): 1664,
                    (8192, 640, 262144): 768, (8192, 896, 151936): 1280}
    assert plan_rows(16384, 4096, 128256, 2, need_grads=True, engine="fused").rows == 1024
    assert plan_rows(4096, 4096, 128256, 2, need_grads=True, engine="fused", dw_pair=True) == \
        plan_rows(4096, 4096, 128256, 2, need_grads=True, engine="fused")  # dZ kept: one dW GEMM


@pytest.mark.parametrize("n,h", list(itertools.product([129, 1000, 1100, 2048, 3000, 4096, 5120, 5121], [640, 4096])))
def test_fused_kept_dz_chunk_rule(n, h):
    """Where the fused plan keeps dZ, its chunks are the tiles budget's or, where that makes fewer than
    BUDGET.kept_chunks (4), the fewest whole row granules that cut the rows into at most 4: the chunks past the
    last valid row are left out more finely at no memory cost. The keep decision itself is the budget chunk's;
    a requested size wins."""
    v = 128256
    p = plan_rows(n, h, v, 2, need_grads=True, engine="fused", dw_pair=True)
    budget_rows = _expected_default_rows(n, v, BUDGET.tiles, logit_bytes=2)
    assert p.keep_dz == (budget_rows < n and n * 2 <= h * 2 + budget_rows * 2)
    if not p.keep_dz:
        return
    assert p.rows % BUDGET.row_multiple == 0 and p.rows <= budget_rows
    if p.rows < budget_rows:
        assert layout(n, p.rows)[1] <= BUDGET.kept_chunks < layout(n, p.rows - BUDGET.row_multiple)[1]
    else:
        assert layout(n, p.rows)[1] >= BUDGET.kept_chunks
    assert plan_rows(n, h, v, 2, need_grads=True, engine="fused", requested=budget_rows).rows == budget_rows


def test_fused_kept_dz_chunks_real_shapes():
    """The kept chunks at H = 4096, V = 128256: 2048 rows in 4 chunks of 512 (CPO at one pair, a quarter of its
    rows ignored: 3 of 4 chunks run where 2 of 2 did), 4096 rows and more in the budget's 1024."""
    v = 128256
    assert {s: plan_rows(*s, 2, need_grads=True, engine="fused").rows for s in (
        (1100, 4096, v), (2048, 4096, v), (4096, 4096, v), (5120, 4096, v))} == {
        (1100, 4096, v): 384, (2048, 4096, v): 512, (4096, 4096, v): 1024, (5120, 4096, v): 1024}
    assert plan_pairs(1, 1024, 4096, v, 2, need_grads=True, engine="fused").rows == 512


def test_fused_rows_without_gradients_hold_statistics():
    """Without gradients the fused chunk stores no tile values: its budget holds the [rows, tiles] statistics
    (STATS_BYTES per row and 256-column tile), and its rows of x fit `resident_x` (16 MiB); the bench's shapes
    then run in 1-4 chunks where the tile values' budget made 8 to 16 (the sizes measured fastest, loss only
    on the H200: 4096 rows at H = 2048, 2048 at H = 4096, 3584 at H = 2304). A requested size still wins, and
    tiny budgets still give a granule."""
    def rows(n, h, v, **kw):
        return plan_rows(n, h, v, 2, need_grads=False, engine="fused", **kw).rows

    assert {s: rows(*s) for s in ((16384, 2048, 128256), (16384, 4096, 128256), (8192, 2304, 256000),
                                  (8192, 640, 262144), (8192, 896, 151936), (256, 4096, 128256))} == {
        (16384, 2048, 128256): 4096, (16384, 4096, 128256): 2048, (8192, 2304, 256000): 3584,
        (8192, 640, 262144): 7168, (8192, 896, 151936): 8192, (256, 4096, 128256): 256}
    assert 7168 * 1024 * STATS_BYTES <= BUDGET.tiles < 7296 * 1024 * STATS_BYTES  # H = 640: the statistics bound
    assert rows(16384, 4096, 128256, requested=100) == 100
    assert rows(16384, 4096, 128256, budget=BudgetConfig(tiles=1)) == BUDGET.row_multiple
    assert rows(16384, 4096, 128256, budget=BudgetConfig(resident_x=1)) == BUDGET.row_multiple
    assert not plan_rows(16384, 4096, 128256, 2, need_grads=False, engine="fused").keep_dz


@pytest.mark.parametrize("n_pairs,seq_len,h,itemsize,requested", list(itertools.product(
    [1, 3, 8], [5, 64], [16, 64, 4096], [2, 4], [None, 7, 20, 300])))
def test_plan_pairs_rule(n_pairs, seq_len, h, itemsize, requested):
    """CPO keeps dZ whenever gradients are asked: in one group when the row plan keeps it (or without
    gradients: the row plan), else in groups of whole pairs of at most one row-plan chunk (at least one pair),
    with chunks from the grouped budget."""
    v = 130
    n_rows = 2 * n_pairs * seq_len
    p = plan_pairs(n_pairs, seq_len, h, v, itemsize, need_grads=True, requested=requested)
    base = plan_rows(n_rows, h, v, itemsize, need_grads=True, requested=requested)
    assert p.keep_dz and p.n_rows == n_rows
    if base.keep_dz:
        assert p == base
    else:
        per_group = min(n_pairs, max(1, base.rows // (2 * seq_len)))
        assert per_group == pairs_per_group(n_pairs, seq_len, base.rows)
        group_rows = 2 * per_group * seq_len
        assert p.group_rows == (None if per_group == n_pairs else group_rows)
        assert p.rows == chunk_rows(group_rows, v, requested, BUDGET.grouped_logits)
        for g0, g1 in p.groups:                 # whole pairs in every group
            assert (g1 - g0) % (2 * seq_len) == 0
    assert plan_pairs(n_pairs, seq_len, h, v, itemsize, need_grads=False, requested=requested) == \
        plan_rows(n_rows, h, v, itemsize, need_grads=False, requested=requested)


@pytest.mark.parametrize("n_pairs,seq_len,h,itemsize,requested", list(itertools.product(
    [1, 3, 8], [5, 64], [16, 64, 4096], [2, 4], [None, 7, 300])))
def test_plan_pairs_fused_rule(n_pairs, seq_len, h, itemsize, requested):
    """The fused engine's CPO groups: whole pairs of at most as many rows as `fused_rows` keeps in one group,
    N * itemsize <= H * (4 - itemsize) + rows * itemsize (at least one pair), chunks from its tiles budget;
    every group of several chunks puts its valid rows first."""
    v = 130
    n_rows = 2 * n_pairs * seq_len
    p = plan_pairs(n_pairs, seq_len, h, v, itemsize, need_grads=True, requested=requested, engine="fused")
    base = plan_rows(n_rows, h, v, itemsize, need_grads=True, requested=requested, engine="fused")
    if base.keep_dz:
        assert p == base
        return
    cap = max(r for r in range(1, n_rows + 1) if r * itemsize <= h * (4 - itemsize) + base.rows * itemsize)
    per_group = min(n_pairs, max(1, cap // (2 * seq_len)))
    group_rows = 2 * per_group * seq_len
    assert p.group_rows == (None if per_group == n_pairs else group_rows) and p.keep_dz
    rows = chunk_rows(group_rows, v, requested, BUDGET.tiles, logit_bytes=itemsize)
    if requested is None:     # at most BUDGET.kept_chunks chunks of whole granules where the budget's are fewer
        rows = min(rows, -(-group_rows // (BUDGET.kept_chunks * BUDGET.row_multiple)) * BUDGET.row_multiple)
    assert p.rows == rows
    assert p.puts_valid_first == (layout(group_rows, p.rows)[1] > 1)


@pytest.mark.parametrize("n_pairs,per_group", [(3, 1), (3, 2), (5, 2), (8, 2), (7, 3)])
def test_torch_pair_order_on_the_device(n_pairs, per_group):
    """fce_torch's CPO makes `pair_order` on the device (no host copy that would wait for the device)."""
    from fce_torch.cpo import _pair_order

    plan = Plan(2 * n_pairs * 4, 7, True, 2 * per_group * 4)
    assert _pair_order(n_pairs, 4, plan, "cpu").tolist() == pair_order(n_pairs, 4, plan)


@pytest.mark.parametrize("n_pairs,per_group", [(3, 1), (3, 2), (5, 2), (4, 4)])
def test_pair_order(n_pairs, per_group):
    """The sequences of each group of whole pairs together (its chosen, then its rejected ones), the groups in
    Plan.groups' order (the first takes the remaining pairs); None with one group."""
    seq_len = 5
    plan = Plan(2 * n_pairs * seq_len, 7, True, None if per_group == n_pairs else 2 * per_group * seq_len)
    order = pair_order(n_pairs, seq_len, plan)
    if per_group == n_pairs:
        assert order is None
        return
    assert sorted(order) == list(range(2 * n_pairs))
    first = n_pairs - (-(-n_pairs // per_group) - 1) * per_group
    groups = [range(0, first)] + [range(first + i * per_group, first + (i + 1) * per_group)
                                  for i in range(-(-n_pairs // per_group) - 1)]
    expected = [k for g in groups for k in [*g, *(n_pairs + p for p in g)]]
    assert order == expected
    # the sequences of group i fill that group's rows of Plan.groups
    for (g0, g1), g in zip(plan.groups, groups):
        assert (g1 - g0) == 2 * len(g) * seq_len


# ============================================================================ valid_first
def _targets(n, v, n_valid, seed):
    """n targets, n_valid of them valid at random places, the others IGNORE_INDEX."""
    g = torch.Generator().manual_seed(seed)
    t = torch.full((n,), IGNORE_INDEX, dtype=torch.int64)
    t[torch.randperm(n, generator=g)[:n_valid]] = torch.randint(0, v, (n_valid,), generator=g)
    return t


@pytest.mark.parametrize("n,n_valid", [(1, 0), (1, 1), (13, 0), (13, 5), (13, 13)])
def test_valid_first(n, n_valid):
    """(pos, order, n_valid): a stable permutation, valid rows first, each group in its order (order[j] is the row
    at position j, pos its inverse), and the count; both twins give the same."""
    from fce_core.rows import valid_first
    from fce_jax import engine as jax_engine
    from fce_torch import arrays as torch_arrays

    y = _targets(n, 50, n_valid, seed=n + n_valid)
    valid = (y != IGNORE_INDEX).numpy()
    expected = np.concatenate([np.flatnonzero(valid), np.flatnonzero(~valid)])
    for pos, order, count in (valid_first(torch_arrays, y, IGNORE_INDEX),
                              jax_engine.valid_first(to_jax(y), IGNORE_INDEX)):
        pos, order = np.asarray(pos), np.asarray(order)
        assert np.array_equal(order, expected)
        assert np.array_equal(pos[order], np.arange(n)) and int(count) == n_valid


@pytest.mark.parametrize("n_rows,group_rows", [(13, 5), (12, 4), (7, 7), (1, 1)])
def test_valid_first_in_groups(n_rows, group_rows):
    """fce_torch's order over groups of rows (`Plan.groups`): each row stays in its group, the group's valid
    rows first, each kind in its order; the count of each group's valid rows."""
    from fce_torch import engine as torch_engine

    groups = bounds(n_rows, group_rows)
    y = _targets(n_rows, 50, n_rows // 2, seed=n_rows + group_rows)
    valid = (y != IGNORE_INDEX).numpy()
    order, counts = torch_engine.valid_first_in_groups(y, IGNORE_INDEX, groups)
    expected = np.concatenate([g0 + np.concatenate([np.flatnonzero(valid[g0:g1]), np.flatnonzero(~valid[g0:g1])])
                               for g0, g1 in groups])
    assert np.array_equal(order.numpy(), expected)
    assert counts.tolist() == [int(valid[g0:g1].sum()) for g0, g1 in groups]


@pytest.mark.parametrize("n,n_valid", [(1, 0), (13, 5), (13, 13)])
def test_reduction_scalars_take_the_value_checks(n, n_valid):
    """The scalars [D, n, W_sum] that fce_torch's value check writes on the device (kernels/value_flags.py)
    are what `reduction_scalars` returns without class weights and normalizer (the bits of its ops'
    count: test_kernels.py::test_value_flags); with either, it computes its own."""
    from fce_core.rows import reduction_scalars
    from fce_torch import arrays
    from fce_torch.kernels.value_flags import value_flags

    vocab = 50
    y = _targets(n, vocab, n_valid, seed=n)
    _, scalars = value_flags(y, vocab, IGNORE_INDEX)
    taken, w_y = reduction_scalars(arrays, y, None, IGNORE_INDEX, vocab, counts=scalars)
    assert taken is scalars and w_y is None
    cw, norm = torch.rand(vocab), torch.tensor([3.0, 2.0])
    for kw in (dict(class_weights=cw), dict(class_weights=None, normalizer=norm)):
        a = reduction_scalars(arrays, y, ignore_index=IGNORE_INDEX, vocab=vocab, counts=scalars, **kw)
        b = reduction_scalars(arrays, y, ignore_index=IGNORE_INDEX, vocab=vocab, **kw)
        assert torch.equal(a[0], b[0]) and a[0] is not scalars


# ============================================================================ which chunks run
def _marker_fn(stats, inputs):
    """1 on every row of a chunk that ran (skipped chunks leave 0), and the coefficients of a zero dZ."""
    m = stats["m"]
    one = torch.ones_like(m) if isinstance(m, torch.Tensor) else m * 0 + 1
    return {"ran": one, "lse": one, "a": 0 * one, "b": 0 * one, "c": 0 * one}


SWEEP_SHAPES = [(29, 4, [0, 1, 2, 10, 29]), (32, 8, [9]), (5, 8, [3]), (40, 2, [5, 39])]


@pytest.mark.parametrize("keep", [False, True], ids=["accumulated", "kept"])
@pytest.mark.parametrize("n,nc,valid_counts", SWEEP_SHAPES, ids=[f"{s[0]}rows_{s[1]}" for s in SWEEP_SHAPES])
def test_chunks_past_the_valid_rows_do_not_run(n, nc, valid_counts, keep):
    """Through each engine's sweep with a marker head: exactly the chunks holding valid rows (valid first) run,
    the same rows in both twins; fce_torch without its value check runs them all; dX of a zero dZ is 0."""
    from fce_jax import engine as jax_engine
    from fce_torch import engine as torch_engine
    from fce_torch.checks import ValueCheck

    h, v = 8, 40
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    plan = Plan(n, nc, keep)
    grads = (True, True, False)
    head_t = torch_engine.Head(_marker_fn, StatsSpec())
    head_j = jax_engine.Head(_marker_fn, StatsSpec())
    kw = dict(grads=grads, transform=Transform(), ignore_index=IGNORE_INDEX)
    j_sweep = quick_jit(lambda x, w, y: jax_engine.sweep(x, w, None, None, head_j, {"y": y}, plan, **kw)[:2])
    for n_valid in valid_counts:
        y = _targets(n, v, n_valid, seed=n_valid)
        pos = torch.from_numpy(np.argsort(np.concatenate([np.flatnonzero(y != IGNORE_INDEX),
                                                          np.flatnonzero(y == IGNORE_INDEX)])))
        n_run_rows = min(n, bounds(n, nc)[_chunks_holding(n, nc, n_valid) - 1][1])
        expected = (pos < n_run_rows).float().numpy()
        outs, dx, *_ = torch_engine.sweep(x, w, None, None, head_t, {"y": y}, plan,
                                          check=ValueCheck(y, v, IGNORE_INDEX), **kw)
        assert np.array_equal(outs["ran"].numpy(), expected), n_valid
        assert dx.shape == (n, h) and not dx.any()
        outs, *_ = torch_engine.sweep(x, w, None, None, head_t, {"y": y}, plan, **kw)
        assert np.all(outs["ran"].numpy() == 1)
        j_outs, j_dx = j_sweep(to_jax(x), to_jax(w), to_jax(y))
        assert np.array_equal(np.asarray(j_outs["ran"]), expected), n_valid
        assert j_dx.shape == (n, h) and not np.asarray(j_dx).any()
        # rows are really skipped exactly where a chunk after the first starts past the valid rows
        assert (expected.sum() < n) == any(start >= n_valid for start, _ in bounds(n, nc)[1:]), n_valid


def _ce_fn(stats, inputs):
    """Cross-entropy coefficients on the valid rows (a nonzero dZ), and each row's lse."""
    import jax.numpy as jnp

    m, s, y = stats["m"], stats["s"], inputs["y"]
    valid = (y != IGNORE_INDEX) * (0 * m + 1)
    log = torch.log if isinstance(m, torch.Tensor) else jnp.log
    return {"lse": m + log(s), "a": valid, "b": -valid, "c": 0 * valid}


PERM_PLANS = [Plan(48, 8, True, 16), Plan(48, 8, False, 16), Plan(48, 8, True), Plan(48, 48)]


@pytest.mark.parametrize("engine", ["library", "fused"])
@pytest.mark.parametrize("plan", PERM_PLANS, ids=["kept_groups", "accumulated_groups", "kept", "one_chunk"])
def test_sweep_takes_x_rows_by_perm(plan, engine):
    """A sweep given x and `perm` equals the sweep of the permuted copy x[perm], bit for bit, in both twins:
    the same outputs (in the sweep's order), dW and db, and dX in x's order (the copy's dX put back); with
    ignored rows, so that chunks are skipped and the valid-first order composes with perm."""
    from fce_jax import engine as jax_engine
    from fce_torch import engine as torch_engine
    from fce_torch.checks import ValueCheck

    n, h, v = plan.n_rows, 8, 40
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g), torch.randn(v, generator=g)
    y = _targets(n, v, 20, seed=5)
    perm = torch.randperm(n, generator=g)
    kw = dict(grads=(True, True, True), transform=Transform(), ignore_index=IGNORE_INDEX, engine=engine)
    head_t, head_j = torch_engine.Head(_ce_fn, StatsSpec()), jax_engine.Head(_ce_fn, StatsSpec())
    check = lambda: ValueCheck(y, v, IGNORE_INDEX)  # noqa: E731
    by_perm = torch_engine.sweep(x, w, b, None, head_t, {"y": y}, plan, check=check(), perm=perm, **kw)
    copied = torch_engine.sweep(x[perm], w, b, None, head_t, {"y": y}, plan, check=check(), **kw)
    def j_sweep(x_in, p):
        run = quick_jit(lambda x, w, b, y: jax_engine.sweep(x, w, b, None, head_j, {"y": y}, plan, perm=p, **kw))
        return run(to_jax(x_in), to_jax(w), to_jax(b), to_jax(y))

    j_by_perm, j_copied = j_sweep(x, perm.numpy()), j_sweep(x[perm], None)
    for got, ref in ((by_perm, copied), (j_by_perm, j_copied)):
        dx, dw, db = (_np(a) for a in got[1:])
        ref_dx, ref_dw, ref_db = (_np(a) for a in ref[1:])
        assert set(got[0]) == set(ref[0]) and all(np.array_equal(_np(got[0][k]), _np(ref[0][k])) for k in got[0])
        assert dx.any() and np.array_equal(dx[perm.numpy()], ref_dx)
        assert np.array_equal(dw, ref_dw) and np.array_equal(db, ref_db)


def _np(a):
    return a.detach().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def _count_logits_gemms(twin, monkeypatch, vocab):
    """Monkeypatch the twin's gemm.mm to count the executed logits GEMMs ([rows, H] x [V, H]^T, float32 out);
    returns the list of their row counts (JAX: one runtime callback per executed GEMM)."""
    calls = []
    if twin is TORCH:
        import fce_torch.gemm as g

        real = g.mm

        def mm(a, b, out_dtype, out=None):
            if out_dtype == torch.float32 and b.shape[-1] == vocab != a.shape[-1]:
                calls.append(a.shape[0])
            return real(a, b, out_dtype, out=out)
    else:
        import jax
        import jax.numpy as jnp

        import fce_jax.gemm as g

        real = g.mm

        def mm(a, b, out_dtype, *, a_t=False, b_t=False):
            out = real(a, b, out_dtype, a_t=a_t, b_t=b_t)
            if b_t and not a_t and out_dtype == jnp.float32:
                jax.debug.callback(lambda rows=a.shape[0]: calls.append(rows))
            return out
    monkeypatch.setattr(g, "mm", mm)
    return calls


@each_twin
@pytest.mark.parametrize("keep", [False, True], ids=["accumulated", "kept"])
def test_logits_gemms_of_skipped_chunks_do_not_run(twin, keep, monkeypatch):
    """fused_lce with 64 rows, 8 a chunk, 11 valid: 2 of 8 logits GEMMs run (torch with validate, JAX always);
    torch with validate=False runs all 8 (with the same bits: test_validate_does_not_change_bits)."""
    n, h = 64, (64 if keep else 16)
    case = Case("count", (n,), h, 130, "float32", seed=60)
    inp = make_inputs(case)
    inp["targets"] = _targets(n, 130, 11, seed=60)
    assert plan_rows(n, h, 130, 4, need_grads=True, requested=8).keep_dz == keep
    calls = _count_logits_gemms(twin, monkeypatch, 130)
    out = twin.run(inp, case.options(), chunk_rows=8, fresh=True)
    assert calls == [8, 8], calls
    check_flce(case, inp, out)
    if twin is TORCH:
        calls.clear()
        twin.run(inp, case.options(), chunk_rows=8, validate=False)
        assert calls == [8] * 8, calls


# ============================================================================ skipping gives the right results
# 64 rows, 16 of them valid: with 8 rows a chunk, only the first two of eight chunks run.
SKIP_CASES = [
    Case("skip_kept_f32", (64,), 64, 130, "float32", bias=True, seed=41),             # 64 * 4 <= 4 * 64
    Case("skip_accumulated_f32", (64,), 16, 130, "float32", bias=True, seed=42),      # dZ accumulated
    Case("skip_kept_bf16", (64,), 32, 300, "bfloat16", z_loss=1e-3, label_smoothing=0.1, seed=43),
    Case("skip_none_f32", (4, 16), 16, 130, "float32", reduction="none", class_weights=True, seed=44),
]


def _skip_inputs(case):
    inp = make_inputs(case)
    n = inp["targets"].numel()
    inp["targets"] = _targets(n, case.v, 16, seed=case.seed).view(inp["targets"].shape)
    return inp


@each_twin
@pytest.mark.parametrize("case", SKIP_CASES, ids=[c.name for c in SKIP_CASES])
def test_skipped_chunks_match_reference(twin, case):
    """Runs that skip 6 of 8 chunks give the reference's loss and gradients, lse 0 and dx 0 on ignored rows."""
    inp = _skip_inputs(case)
    n = inp["targets"].numel()
    kept = plan_rows(n, case.h, case.v, 4 if case.dtype == "float32" else 2, need_grads=True,
                     requested=8).keep_dz
    assert kept == ("kept" in case.name)
    out = twin.run(inp, case.options(), chunk_rows=8)
    check_flce(case, inp, out)
    ignored = (inp["targets"] == IGNORE_INDEX).numpy().reshape(-1)
    assert np.all(twin.np64(out["lse"]).reshape(-1)[ignored] == 0)
    assert np.all(twin.np64(out["dx"]).reshape(n, -1)[ignored] == 0)


def _torch_bits(out):
    return {k: None if v is None else TORCH.bits(v) for k, v in out.items()}


@pytest.mark.parametrize("case", SKIP_CASES, ids=[c.name for c in SKIP_CASES])
def test_validate_does_not_change_bits(case):
    """fce_torch: validate=True (host count: the rows are put valid-first and 6 of 8 chunks are skipped) and
    validate=False (valid-first too, every chunk runs) give the same bits of loss, stats, dx, dw and db, with
    dZ kept and with the float32 dW accumulator (and for "none", whose backward recomputes)."""
    inp = _skip_inputs(case)
    a = TORCH.run(inp, case.options(), chunk_rows=8)
    b = TORCH.run(inp, case.options(), chunk_rows=8, validate=False)
    a, b = _torch_bits(a), _torch_bits(b)
    for k in a:
        assert (a[k] is None) == (b[k] is None), k
        if a[k] is not None:
            assert np.array_equal(a[k], b[k]), k


def test_fused_kept_grads_run_over_the_chunks_that_ran(monkeypatch):
    """The fused engine's dX and dW over a kept dZ take only the rows of the chunks that ran (16 of 64 rows:
    2 of 8 chunks), in fce_torch with validate and in fce_jax (a branch per count of chunks, each traced with
    its rows); the bits of every output are those of the same twin's run whose GEMMs take all 64 rows
    (validate=False; in JAX every chunk made to run): the K steps left out would add exact zeros."""
    import fce_jax.engine as jax_engine
    import fce_torch.engine as torch_engine

    from twins import JAX

    case = Case("skip_kept_fused", (64,), 64, 300, "bfloat16", bias=True, z_loss=1e-3, label_smoothing=0.1,
                seed=45)
    assert plan_rows(64, 64, 300, 2, need_grads=True, requested=8, engine="fused").keep_dz  # 64 * 2 <= 64 * 2 + 8 * 2
    inp = _skip_inputs(case)
    rows = {"torch": [], "jax": []}
    for module, twin in ((torch_engine, "torch"), (jax_engine, "jax")):
        for name in ("dx_gemm", "dw_gemm"):
            def record(*args, _real=getattr(module, name), _name=name, _twin=twin, **kw):
                rows[_twin].append((_name, kw.get("rows")))
                return _real(*args, **kw)

            monkeypatch.setattr(module, name, record)
    a = _torch_bits(TORCH.run(inp, case.options(), chunk_rows=8, engine="fused"))
    assert rows["torch"] == [("dx_gemm", 16), ("dw_gemm", 16)], rows["torch"]
    rows["torch"].clear()
    b = _torch_bits(TORCH.run(inp, case.options(), chunk_rows=8, engine="fused", validate=False))
    assert rows["torch"] == [("dx_gemm", 64), ("dw_gemm", 64)], rows["torch"]
    for k in a:
        assert (a[k] is None) == (b[k] is None), k
        if a[k] is not None:
            assert np.array_equal(a[k], b[k]), k
    c = JAX.run(inp, case.options(), chunk_rows=8, engine="fused", fresh=True)
    assert sorted(set(rows["jax"])) == [(name, 8 * n) for name in ("dw_gemm", "dx_gemm") for n in range(1, 9)]
    rows["jax"].clear()
    monkeypatch.setattr(Plan, "chunks_to_run",
                        lambda self, n_valid, clip=None, size=None: layout(size or self.n_rows, self.rows)[1])
    d = JAX.run(inp, case.options(), chunk_rows=8, engine="fused", fresh=True)   # every chunk runs
    assert sorted(set(rows["jax"])) == [("dw_gemm", 64), ("dx_gemm", 64)], rows["jax"]
    for k in c:
        assert (c[k] is None) == (d[k] is None), k
        if c[k] is not None:
            assert np.array_equal(JAX.bits(c[k]), JAX.bits(d[k])), k


def test_fused_kept_chunk_size_leaves_the_bits():
    """With dZ kept the chunk only sets the logits GEMM's rows and which chunks run (`plan.kept_chunk` picks it
    for speed): chunks of 8 rows (2 of 8 run) and of 24 (a 16-row first chunk and 2 full ones; 1 runs) give the
    same bits of every output in each twin (the GPU parity cases hold the twins to each other's bits)."""
    from twins import JAX

    case = Case("kept_chunk_bits", (64,), 64, 300, "bfloat16", bias=True, z_loss=1e-3, label_smoothing=0.1,
                seed=47)
    inp = _skip_inputs(case)
    assert all(plan_rows(64, 64, 300, 2, need_grads=True, requested=r, engine="fused").keep_dz for r in (8, 24))
    runs = {(twin.name, rows): twin.run(inp, case.options(), chunk_rows=rows, engine="fused", fresh=True)
            for twin in (TORCH, JAX) for rows in (8, 24)}
    for twin in (TORCH, JAX):
        for k, v in runs[twin.name, 8].items():
            w = runs[twin.name, 24][k]
            assert (v is None) == (w is None), (twin.name, k)
            assert v is None or np.array_equal(twin.bits(v), twin.bits(w)), (twin.name, k)


def test_validate_does_not_change_bits_logprobs_and_cpo():
    """The same for fused_token_logprobs (whose backward also skips the rows of zero cotangent) and for
    fused_cpo_loss in one group (chunks cutting pairs, ignored prompt tokens skipped) and in groups of pairs."""
    inp = _skip_inputs(SKIP_CASES[0])
    g = torch.Generator().manual_seed(61)
    g_logp, g_ent = torch.randn(64, generator=g), torch.randn(64, generator=g)
    g_logp[40:] = 0.0
    g_ent[40:] = 0.0      # rows of zero cotangent: counted as ignored in the backward
    runs = [TORCH.logprobs(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"], g_logp=g_logp,
                           g_entropy=g_ent, softcap=20.0, temperature=0.8, chunk_rows=8, validate=validate)
            for validate in (True, False)]
    for k in runs[0]:
        assert np.array_equal(TORCH.bits(runs[0][k]), TORCH.bits(runs[1][k])), k
    x = inp["x"].view(4, 16, 64)
    y = inp["targets"].view(4, 16).clone()
    y[:, :6] = IGNORE_INDEX
    for chunk_rows, h in ((8, 64), (20, 16)):       # one group of all rows; groups of one pair
        xs = x[..., :h].contiguous()
        w = inp["weight"][:, :h].contiguous()
        runs = [TORCH.cpo(xs, w, y, chunk_rows=chunk_rows, validate=validate) for validate in (True, False)]
        for k in runs[0]:
            assert np.array_equal(runs[0][k], runs[1][k]), (chunk_rows, k)


@pytest.mark.parametrize("engine", ["library", "fused"])
@pytest.mark.parametrize("n_valid", [64, 13, 0])
def test_value_check_is_read_after_the_first_chunk(engine, n_valid, monkeypatch):
    """fce_torch reads its value check (checks.ValueCheck) once the first chunk is queued: that chunk runs
    valid-first; with every row valid the rest run in the caller's order, otherwise valid-first as far as
    the valid rows reach. Either way the bits equal validate=False's (every chunk runs valid-first), the
    library engine's logits GEMMs are the chunks that hold valid rows, and an out-of-range target in a later
    chunk still raises."""
    case = Case("late_check", (64,), 16, 130, "bfloat16", bias=True, z_loss=1e-3, seed=62)
    inp = make_inputs(case)
    inp["targets"] = _targets(64, 130, n_valid, seed=62)
    calls = _count_logits_gemms(TORCH, monkeypatch, 130)
    a = _torch_bits(TORCH.run(inp, case.options(), chunk_rows=8, engine=engine))
    if engine == "library":
        assert calls == [8] * max(1, -(-n_valid // 8)), calls
    b = _torch_bits(TORCH.run(inp, case.options(), chunk_rows=8, engine=engine, validate=False))
    for k in a:
        assert (a[k] is None) == (b[k] is None), k
        if a[k] is not None:
            assert np.array_equal(a[k], b[k]), k
    bad = dict(inp, targets=inp["targets"].clone())
    bad["targets"][50] = 130
    with pytest.raises(ValueError, match="targets must be in"):
        TORCH.run(bad, case.options(), chunk_rows=8, engine=engine)


def test_forms_dz_on_load_takes_only_the_loss_terms():
    """The twins' one rule for dZ on the GEMMs' load: the flag, and a head whose dZ is a p + b [c == y] + c
    (label smoothing's c included); every other term, a transform, db, a trace or vocab parallelism keeps the
    dZ pass."""
    loss = {"lse": 0, "a": 0, "b": 0, "c": 0}
    base = dict(db=False, traced=False, vocab_parallel=False)
    assert forms_dz_on_load(True, None, loss, Transform(), **base)
    assert not forms_dz_on_load(False, None, loss, Transform(), **base)
    assert not forms_dz_on_load(True, np.ones(3, np.float32), loss, Transform(), **base)  # class weights
    assert not forms_dz_on_load(True, None, {**loss, "d": 0, "mu": 0}, Transform(), **base)  # the entropy's term
    assert not forms_dz_on_load(True, None, loss, Transform(softcap=30.0), **base)
    assert not forms_dz_on_load(True, None, loss, Transform(temperature=0.7), **base)
    for name in base:
        assert not forms_dz_on_load(True, None, loss, Transform(), **{**base, name: True}), name

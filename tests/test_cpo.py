"""fused_cpo_loss in both twins against the float64 reference (SPEC §3), Liger, and bad input."""

import numpy as np
import pytest
import torch

import fce_jax
import fce_torch
from fce_core.plan import Plan, layout, pair_order, plan_pairs
from helpers import assert_close_to_reference
from parity.reference import cpo_reference, rel_err
from twins import JAX, TORCH

IGNORE = -100


def make(pairs=2, seq=5, hidden=16, vocab=130, dtype=torch.float32, seed=0, bias=False):
    """Random CPO inputs with prompt tokens ignored, unequal valid counts and a fully ignored rejected
    sequence (the last pair)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * pairs, seq, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(dtype)
    y = torch.randint(0, vocab, (2 * pairs, seq), generator=g)
    y[:, :2] = IGNORE  # the prompt
    y[0, 2] = IGNORE  # chosen sequences with different valid counts
    y[2 * pairs - 1] = IGNORE  # a rejected sequence with no valid token
    b = (torch.randn(vocab, generator=g) * 0.1).to(dtype) if bias else None
    return x, w, y, b


run_torch, run_jax = TORCH.cpo, JAX.cpo   # float64 numpy loss, gradients and stats (tests/twins.py)
TWINS = {"torch": run_torch, "jax": run_jax}


def _assert_twins_agree(a, j):
    """The twins' float32 loss, gradients and stats within 1e-6 of each other (the CPU interpreters are not
    bitwise twins)."""
    for k in ("loss", "dx", "dw", "db", "chosen_logps", "rejected_logps", "nll_loss"):
        assert rel_err(j[k], a[k]) < 1e-6, k


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "simpo"])
def test_loss_types_against_reference(twin, loss_type):
    x, w, y, b = make(pairs=3, seed=1)
    kw = dict(loss_type=loss_type, beta=0.5, chunk_rows=10)  # one pair per group: the rows are permuted
    out = TWINS[twin](x, w, y, b, **kw)
    ref = cpo_reference(x, w, y, loss_type=loss_type, beta=0.5)
    assert_close_to_reference(out, ref, "float32")


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("options", [
    dict(label_smoothing=0.2, alpha=0.5, bias=True),
    dict(average_log_prob=True, alpha=0.0),
    dict(loss_type="simpo", simpo_gamma=1.0, average_log_prob=False),
])
def test_options_against_reference(twin, options):
    options = dict(options)
    x, w, y, b = make(seed=2, bias=options.pop("bias", False))
    out = TWINS[twin](x, w, y, b, **options)
    ref = cpo_reference(x, w, y, bias=b, **options)
    assert_close_to_reference(out, ref, "float32")


@pytest.mark.parametrize("twin", TWINS)
def test_bfloat16(twin):
    x, w, y, b = make(pairs=2, seq=6, dtype=torch.bfloat16, seed=3)
    out = TWINS[twin](x, w, y, b, chunk_rows=12)
    assert_close_to_reference(out, cpo_reference(x, w, y), "bfloat16")


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("dtype, chunk_rows", [("float32", None), ("float32", 10), ("bfloat16", 10)])
def test_fused_engine_against_reference(twin, dtype, chunk_rows):
    """engine="fused": the same loss, gradients and stats within the bounds, in one group (every row's dZ
    kept) and in groups of one pair (chunk_rows=10: the rows permuted, each group's dZ kept and scaled, dW
    accumulated over the groups), with a bias and label smoothing."""
    x, w, y, b = make(pairs=3, seed=6, bias=True, dtype=getattr(torch, dtype))
    plan = plan_pairs(3, 5, 16, 130, 4 if dtype == "float32" else 2, need_grads=True, requested=chunk_rows,
                      engine="fused")
    assert plan.keep_dz and (plan.group_rows is None) == (chunk_rows is None)
    out = TWINS[twin](x, w, y, b, chunk_rows=chunk_rows, engine="fused", label_smoothing=0.1, alpha=0.5)
    assert_close_to_reference(out, cpo_reference(x, w, y, bias=b, label_smoothing=0.1, alpha=0.5), dtype)
    if dtype == "bfloat16":  # the option reaches the engine: its 16-bit tile values give other bits
        library = TWINS[twin](x, w, y, b, chunk_rows=chunk_rows, label_smoothing=0.1, alpha=0.5)
        assert not np.array_equal(out["dw"], library["dw"])


@pytest.mark.parametrize("twin", [TORCH, JAX], ids=["torch", "jax"])
@pytest.mark.parametrize("chunk_rows", [None, 10])
def test_fused_engine_forms_dz_on_load(twin, monkeypatch, chunk_rows):
    """engine="fused" with dZ formed on the GEMMs' load (`GradGemmConfig.dz_on_load`): the bits of the engine
    that writes dZ, over the kept dZ of one group and of groups of one pair (each scaled in the GEMMs)."""
    from test_fused_engine import _with_and_without_on_load

    x, w, y, _ = make(pairs=3, seed=7, dtype=torch.bfloat16)
    runs = _with_and_without_on_load(twin, monkeypatch, True, lambda: twin.cpo(
        x, w, y, fresh=True, chunk_rows=chunk_rows, engine="fused", label_smoothing=0.1, alpha=0.5))
    for key, v in runs[0].items():
        if v is not None:
            assert np.array_equal(np.asarray(v).view(np.uint64), np.asarray(runs[1][key]).view(np.uint64)), key


@pytest.mark.parametrize("twin", ["torch", "jax"])
def test_unknown_engine_raises(twin):
    mod, conv = (fce_torch, torch.as_tensor) if twin == "torch" else (fce_jax, JAX.array)
    x, w, y, _ = make()
    with pytest.raises(ValueError, match="engine must be one of"):
        mod.fused_cpo_loss(conv(x), conv(w), conv(y), engine="Fused")


def test_twins_agree():
    x, w, y, b = make(pairs=3, seed=4, bias=True)
    a, j = run_torch(x, w, y, b, chunk_rows=10), run_jax(x, w, y, b, chunk_rows=10)
    _assert_twins_agree(a, j)


def test_sigmoid_matches_liger():
    from liger_kernel.chunked_loss import LigerFusedLinearCPOLoss

    x, w, y, b = make(pairs=2, seed=5)
    ours = run_torch(x, w, y, b, beta=0.2, alpha=0.7, label_smoothing=0.1)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    liger = LigerFusedLinearCPOLoss(ignore_index=IGNORE, beta=0.2, alpha=0.7, label_smoothing=0.1, compiled=False)
    out = liger(ws, xs, y)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    assert rel_err(ours["loss"], loss.detach()) < 1e-5
    assert rel_err(ours["dx"], xs.grad) < 1e-4
    assert rel_err(ours["dw"], ws.grad) < 1e-4


@pytest.mark.parametrize("twin", ["torch", "jax"])
def test_bad_input(twin):
    import jax.numpy as jnp

    mod = fce_torch if twin == "torch" else fce_jax
    conv = (lambda t: t) if twin == "torch" else (lambda t: jnp.asarray(t.numpy()))
    x, w, y, _ = make()
    with pytest.raises(ValueError, match="even"):
        mod.fused_cpo_loss(conv(x[:3]), conv(w), conv(y[:3]))
    with pytest.raises(ValueError, match="weight"):
        mod.fused_cpo_loss(conv(x), conv(w[:, :8]), conv(y))
    with pytest.raises(ValueError, match="targets"):
        mod.fused_cpo_loss(conv(x), conv(w), conv(y[:, :3]))
    with pytest.raises(ValueError, match="loss_type"):
        mod.fused_cpo_loss(conv(x), conv(w), conv(y), loss_type="dpo")
    with pytest.raises(ValueError, match="beta"):
        mod.fused_cpo_loss(conv(x), conv(w), conv(y), beta=0.0)
    with pytest.raises(ValueError, match="x"):
        mod.fused_cpo_loss(conv(x[0]), conv(w), conv(y[0]))
    bad = y.clone()
    bad[0, 3] = 10_000
    with pytest.raises(ValueError, match="targets"):
        mod.fused_cpo_loss(conv(x), conv(w), conv(bad))


def test_torch_no_grad_matches_grad_path():
    x, w, y, _ = make(seed=6)
    with torch.no_grad():
        loss = fce_torch.fused_cpo_loss(x, w, y)
    assert loss.grad_fn is None
    assert loss.item() == run_torch(x, w, y, None)["loss"]


def test_plan_keeps_dz_and_cuts_pairs():
    """The shapes of the next tests: every chunk's dZ kept in one group (chunks of 7 rows cut the 5-token
    sequences) when all rows' dZ fits (H = 64); groups of one whole pair (10 rows, chunks of 7 over each) when
    dZ of all rows would outgrow the dW accumulator (H = 16)."""
    grads = dict(need_grads=True, requested=7)
    assert plan_pairs(3, 5, 64, 130, 4, **grads) == Plan(30, 7, True)
    assert plan_pairs(3, 5, 16, 130, 4, **grads) == Plan(30, 7, True, 10)
    assert pair_order(3, 5, Plan(30, 7, True)) is None
    assert pair_order(3, 5, Plan(30, 7, True, 10)) == [0, 3, 1, 4, 2, 5]


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_chunks_cutting_pairs(twin, loss_type):
    x, w, y, b = make(pairs=3, hidden=64, seed=7, bias=True)
    kw = dict(loss_type=loss_type, beta=0.5, label_smoothing=0.1 if loss_type == "sigmoid" else 0.0)
    out = TWINS[twin](x, w, y, b, chunk_rows=7, **kw)
    assert_close_to_reference(out, cpo_reference(x, w, y, bias=b, **kw), "float32")


def test_chunks_cutting_pairs_twins_agree_and_no_grad_matches():
    x, w, y, b = make(pairs=3, hidden=64, seed=8, bias=True)
    a, j = run_torch(x, w, y, b, chunk_rows=7), run_jax(x, w, y, b, chunk_rows=7)
    _assert_twins_agree(a, j)
    with torch.no_grad():  # one group here (no gradients), the ignored rows skipped: the same loss bits
        assert fce_torch.fused_cpo_loss(x, w, y, bias=b, chunk_rows=7).item() == a["loss"]


def _count_chunks(monkeypatch, engine):
    """Patch both twins' chunk logits GEMMs (the fused engine's `logit_tiles`, the library engine's float32
    [rows, V] `gemm.mm`) to record the rows of every one that runs (JAX: a runtime callback)."""
    import jax

    import fce_jax.engine as jax_engine
    import fce_torch.engine as torch_engine

    calls = {"torch": [], "jax": []}

    def torch_logits(a, bt, dtype, out=None, _real=torch_engine.gemm.mm):
        if dtype == torch.float32 and bt.shape[-1] == 130:
            calls["torch"].append(a.shape[0])
        return _real(a, bt, dtype, out=out)

    def jax_logits(a, b, dtype, *, a_t=False, b_t=False, _real=jax_engine.gemm.mm):
        if b_t and not a_t and dtype == np.float32:
            jax.debug.callback(lambda rows=a.shape[0]: calls["jax"].append(rows))
        return _real(a, b, dtype, a_t=a_t, b_t=b_t)

    def tiles(twin, real):
        def run(x_c, *a, **k):
            if twin == "torch":
                calls[twin].append(x_c.shape[0])
            else:
                jax.debug.callback(lambda rows=x_c.shape[0]: calls[twin].append(rows))
            return real(x_c, *a, **k)
        return run

    if engine == "library":
        monkeypatch.setattr(torch_engine.gemm, "mm", torch_logits)
        monkeypatch.setattr(jax_engine.gemm, "mm", jax_logits)
    else:
        monkeypatch.setattr(torch_engine, "logit_tiles", tiles("torch", torch_engine.logit_tiles))
        monkeypatch.setattr(jax_engine, "logit_tiles", tiles("jax", jax_engine.logit_tiles))
    return calls


@pytest.mark.parametrize("engine,hidden,groups,chunks_run", [("library", 16, [1, 1, 1], [2, 2, 1]),
                                                              ("fused", 32, [1, 2], [2, 3])])
def test_groups_of_pairs_skip_their_ignored_chunks(engine, hidden, groups, chunks_run, monkeypatch):
    """In groups of pairs, each group's rows go valid-first within it and its chunks past them never run:
    chunks of 4 rows over 8-token sequences whose first 5 tokens are ignored (the last rejected one wholly),
    so a pair's 6 valid rows fill 2 of its 4 chunks. On the fused engine (bfloat16, H = 32) a group holds as
    many rows as `fused_rows` would keep (36: 2 pairs), the library engine's one chunk's (1 pair).
    Only those chunks' logits GEMMs run (fce_torch with validate; fce_jax); the bits of every output are those
    of fce_torch's validate=False and of fce_jax's run with every chunk made to run; within the reference."""
    x, w, _, b = make(pairs=3, seq=8, hidden=hidden, dtype=torch.bfloat16, seed=11, bias=True)
    y = torch.randint(0, 130, (6, 8), generator=torch.Generator().manual_seed(11))
    y[:, :5] = IGNORE
    y[5] = IGNORE
    plan = plan_pairs(3, 8, hidden, 130, 2, need_grads=True, requested=4, engine=engine)
    assert [(g1 - g0) // 16 for g0, g1 in plan.groups] == groups and plan.rows == 4 and plan.puts_valid_first
    calls = _count_chunks(monkeypatch, engine)
    kw = dict(chunk_rows=4, engine=engine, beta=0.5, label_smoothing=0.1)
    ref = cpo_reference(x, w, y, bias=b, beta=0.5, label_smoothing=0.1)
    runs = {}
    for name, twin, extra in (("skipped", run_torch, {}), ("every", run_torch, dict(validate=False)),
                              ("jax_skipped", run_jax, dict(fresh=True))):
        calls["torch"].clear()
        calls["jax"].clear()
        runs[name] = twin(x, w, y, b, **kw, **extra)
        ran = calls["jax" if name.startswith("jax") else "torch"]
        assert ran == [4] * (4 * sum(groups) if name == "every" else sum(chunks_run)), (name, ran)
    monkeypatch.setattr(Plan, "chunks_to_run",
                        lambda self, n_valid, clip=None, size=None: layout(size or self.n_rows, self.rows)[1])
    runs["jax_every"] = run_jax(x, w, y, b, fresh=True, **kw)
    for a, e in (("skipped", "every"), ("jax_skipped", "jax_every")):
        for k in runs[a]:
            assert (runs[a][k] is None) == (runs[e][k] is None), k
            if runs[a][k] is not None:
                assert np.array_equal(runs[a][k], runs[e][k]), (a, k)
        assert_close_to_reference(runs[a], ref, "bfloat16")


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("chunk_rows,groups", [(7, [1, 1, 1]), (20, [1, 2])])
def test_groups_of_pairs(twin, chunk_rows, groups):
    """dZ of all rows would not fit: groups of whole pairs (the remainder first), each group's dZ kept while
    chunks of `chunk_rows` cut it (7 rows: two chunks per 10-row pair), dW accumulated over the groups."""
    x, w, y, b = make(pairs=3, seed=9, bias=True)
    plan = plan_pairs(3, 5, 16, 130, 4, need_grads=True, requested=chunk_rows)
    assert plan.keep_dz and plan.group_rows is not None
    per_group = plan.group_rows // 10
    first, n_groups = layout(3, per_group)
    assert [first] + [per_group] * (n_groups - 1) == groups
    assert [(g1 - g0) // 10 for g0, g1 in plan.groups] == groups
    assert sorted(pair_order(3, 5, plan)) == list(range(6))
    kw = dict(loss_type="sigmoid", beta=0.5, label_smoothing=0.1, alpha=0.7)
    out = TWINS[twin](x, w, y, b, chunk_rows=chunk_rows, **kw)
    assert_close_to_reference(out, cpo_reference(x, w, y, bias=b, **kw), "float32")


@pytest.mark.parametrize("engine,dtype,hidden,seq,groups", [("library", torch.float32, 16, 5, 3),
                                                             ("fused", torch.bfloat16, 32, 8, 2)])
def test_groups_free_their_kept_dz_before_the_next(engine, dtype, hidden, seq, groups, monkeypatch):
    """fce_torch's sweep over groups of pairs holds one group's kept dZ at a time: when a group's GEMMs take its
    dZ, every earlier group's is already freed (the next group allocates its own before its chunks, so a
    reference left to the previous one holds two at the peak: 1 GiB more at 8 pairs, H = 4096)."""
    import weakref

    import fce_torch.engine as torch_engine

    kept = []
    for runner in (torch_engine._ChunkRunner, torch_engine._FusedChunkRunner):
        def recording(self, dz_rows, pieces, y, _real=runner.kept_dz):
            assert all(ref() is None for ref in kept), "an earlier group's kept dZ is still alive"
            kept.append(weakref.ref(dz_rows))
            return _real(self, dz_rows, pieces, y)
        monkeypatch.setattr(runner, "kept_dz", recording)
    x, w, y, b = make(pairs=3, seq=seq, hidden=hidden, dtype=dtype, seed=5)
    plan = plan_pairs(3, seq, hidden, 130, x.element_size(), need_grads=True, requested=4, engine=engine)
    assert len(plan.groups) == groups
    out = run_torch(x, w, y, b, chunk_rows=4, engine=engine, beta=0.5)
    assert len(kept) == groups and out["dw"] is not None

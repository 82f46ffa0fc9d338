"""fce_torch beyond one process (docs/SPEC.md §5, §1 `normalizer`): gloo ranks on the CPU, each result against
the float64 reference of the global problem; vocab-parallel ranks agree bit for bit."""
import os

import numpy as np
import pytest

import dist_torch
from helpers import tolerances
from parity.ranks import torch_ranks
from parity.reference import flce_reference, logprobs_reference, cpo_reference, rel_err
from parity.verdicts import bound


def spawn(job, size, tmp_path):
    """The job on `size` gloo ranks (a file store in `tmp_path`, no port to race for): {rank: {name: array}}."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    torch_ranks(dist_torch.run, size, tmp_path, job)
    return {r: dict(np.load(os.path.join(tmp_path, f"{job}-{r}.npz"))) for r in range(size)}


# The jobs on two ranks, run one after the other by one spawn of the ranks (`two_ranks`); the refused one last.
TWO_RANK_JOBS = ("vocab_parallel", "vocab_parallel_fused", "normalizer", "fsdp_head_unit", "fsdp_root",
                 "fsdp_grouped_tied", "fsdp_tied_head_unit_refused")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """{job: {rank: {name: array}}} of every job of TWO_RANK_JOBS, spawned once for the module's tests (a
    spawn per job started torch on every rank anew: most of a small job's time)."""
    path = tmp_path_factory.mktemp("two_ranks")
    torch_ranks(dist_torch.run_jobs, 2, path, TWO_RANK_JOBS)
    return {job: {r: dict(np.load(os.path.join(path, f"{job}-{r}.npz"))) for r in range(2)} for job in TWO_RANK_JOBS}


@pytest.fixture(scope="module")
def vocab_parallel_run(tmp_path_factory, two_ranks):
    """The vocab_parallel job's results per rank count (and engine), each spawned once for the module's tests
    (on 2 ranks by `two_ranks`)."""
    runs = {}

    def get(size, engine="library"):
        job = "vocab_parallel" if engine == "library" else f"vocab_parallel_{engine}"
        if size == 2:
            return two_ranks[job]
        if (size, job) not in runs:
            runs[size, job] = spawn(job, size, tmp_path_factory.mktemp(f"{job}_{size}"))
        return runs[size, job]

    return get


def _check(name, got, ref, tol):
    err = rel_err(got, ref)
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("size, engine", [(2, "library"), (4, "library"), (2, "fused")])
def test_vocab_parallel_matches_reference(size, engine, vocab_parallel_run):
    """Every rank's results against the float64 reference of the whole problem, on both engines; the ranks'
    loss, stats and dX agree bit for bit."""
    res = vocab_parallel_run(size, engine)
    for r in range(1, size):  # every rank returns the same loss, stats and dx
        for k in ("loss", "lse", "argmax", "dx", "logp", "entropy", "lp_dx", "cpo", "cpo_dx"):
            assert np.array_equal(res[r][k], res[0][k]), f"rank {r} {k} differs from rank 0"
    inp = dist_torch.inputs()
    loss_tol, grad_tol = tolerances("float32")
    ref = flce_reference(inp["x"], inp["w"], inp["y"], bias=inp["b"], class_weights=inp["cw"], label_smoothing=0.1,
                         z_loss=1e-3, softcap=15.0)
    whole = lambda k: np.concatenate([res[r][k] for r in range(size)])  # noqa: E731
    _check("loss", res[0]["loss"], ref["loss"], loss_tol)
    valid = inp["y"].numpy() != -100
    _check("lse", res[0]["lse"][valid], ref["lse"][valid], loss_tol)
    assert np.array_equal(res[0]["argmax"][valid], ref["argmax"][valid])
    for k, tol in (("dx", grad_tol), ("dw", grad_tol), ("db", grad_tol)):
        _check(k, res[0][k] if k == "dx" else whole(k), ref[k], tol)
    g = np.linspace(-1.0, 1.0, dist_torch.N)
    lp = logprobs_reference(inp["x"], inp["w"], inp["y"], temperature=0.7, grad_logp=g, grad_entropy=np.ones_like(g))
    _check("logp", res[0]["logp"], lp["logp"], loss_tol)
    _check("entropy", res[0]["entropy"], lp["entropy"], bound("entropy", "float32"))
    _check("logprobs dx", res[0]["lp_dx"], lp["dx"], grad_tol)
    _check("logprobs dw", whole("lp_dw"), lp["dw"], grad_tol)
    H = dist_torch.H
    cpo = cpo_reference(inp["x"][:28].reshape(4, 7, H), inp["w"], inp["y"][:28].reshape(4, 7))
    _check("cpo", res[0]["cpo"], cpo["loss"], loss_tol)
    _check("cpo dx", res[0]["cpo_dx"], cpo["dx"].reshape(28, H), grad_tol)
    _check("cpo dw", whole("cpo_dw"), cpo["dw"], grad_tol)
    if engine != "library":  # the engine ran: its tile values give other bits than the library engine's
        assert not np.array_equal(res[0]["dw"], vocab_parallel_run(size)[0]["dw"])


def test_vocab_parallel_run_to_run(vocab_parallel_run, tmp_path):
    a = vocab_parallel_run(2)
    b = spawn("vocab_parallel", 2, tmp_path)
    for k in a[0]:
        assert np.array_equal(a[0][k], b[0][k]), k


def test_dtensor_weight_uneven_shards(tmp_path):
    res = spawn("dtensor", 3, tmp_path)
    inp = dist_torch.inputs(vocab=dist_torch.V - 1)
    ref = flce_reference(inp["x"], inp["w"], inp["y"])
    loss_tol, grad_tol = tolerances("float32")
    _check("loss", res[0]["loss"], ref["loss"], loss_tol)
    _check("dx", res[0]["dx"], ref["dx"], grad_tol)
    _check("dw", res[0]["dw"], ref["dw"], grad_tol)


def test_normalizer_gives_the_global_mean(two_ranks):
    res = two_ranks["normalizer"]
    inp = dist_torch.inputs()
    ref = flce_reference(inp["x"], inp["w"], inp["y"])
    loss_tol, grad_tol = tolerances("float32")
    _check("loss", res[0]["loss"], ref["loss"], loss_tol)
    _check("dw", res[0]["dw"], ref["dw"], grad_tol)


@pytest.mark.parametrize("job", ["fsdp_head_unit", "fsdp_root", "fsdp_grouped_tied"])
def test_fsdp2_with_the_hf_hook(job, two_ranks):
    """FSDP2 whatever the wrapping of lm_head: the patched model's loss and every parameter's gradient equal
    the plain unsharded model's (float32)."""
    res = two_ranks[job]
    for r in range(2):
        np.testing.assert_allclose(res[r]["loss"], res[r]["ref_loss"], rtol=1e-5)
        for name in (k for k in res[r] if k.startswith("ref.")):
            got = res[r]["fsdp." + name[4:]]
            assert rel_err(got, res[r][name]) <= 1e-4, name


def test_fsdp2_tied_head_as_its_own_unit_is_refused(two_ranks):
    res = two_ranks["fsdp_tied_head_unit_refused"]
    assert all(res[r]["refused"] == 1.0 for r in range(2))

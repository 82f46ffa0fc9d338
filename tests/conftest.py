"""pytest configuration for the fce tests.

The first statements run before any test module imports triton or jax: on a machine without an NVIDIA GPU
they select the Triton interpreter (``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` is defined)
and the JAX CPU backend (``JAX_PLATFORMS=cpu``, only if the caller has not set it) with a thread pool of at
least 8 (``PJRT_NPROC``, likewise), XLA's quick compile options in ``XLA_FLAGS`` (`quick_xla`) and the Triton
interpreter without its re-patching at each helper call and with its numpy dtypes cached (`triton_interpreter`).
``FCE_TEST_DEVICE=cpu`` or ``=cuda`` overrides the detection (which looks for ``nvidia-smi`` on the PATH).

Provided here: the ``device`` fixture ("cuda" or "cpu"), the ``cuda_lowering`` fixture (the JAX twin's kernels
lowered for CUDA on this CPU), the ``gpu`` marker (skipped without a GPU), and
automatic parametrization of any test that takes a ``case`` argument over ``parity.cases.small_cases()``
(unless the test parametrizes ``case`` itself), and the longest files first in the run's order. Assertion
helpers live in ``tests/helpers.py``.
"""

import os
import shutil
import sys

# `from helpers import ...` works whatever pytest's import mode is.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import quick_xla  # noqa: E402

_forced = os.environ.get("FCE_TEST_DEVICE", "").strip().lower()
HAS_GPU = _forced == "cuda" if _forced in ("cpu", "cuda") else shutil.which("nvidia-smi") is not None
if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # XLA CPU's thread pool, sized when JAX starts: Mosaic GPU's interpret mode blocks pool threads in its
    # barrier waits and deadlocks in a pool of the CI's 2 cores (fce_jax/kernels/mgpu.py refuses to run there).
    os.environ.setdefault("PJRT_NPROC", str(max(8, os.cpu_count() or 1)))
    os.environ["XLA_FLAGS"] = quick_xla.with_flags(os.environ.get("XLA_FLAGS", ""))
    import triton_interpreter  # noqa: E402

    triton_interpreter.install()

import pytest  # noqa: E402

from parity.cases import small_cases  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped on CPU-only machines)")


# The longest test files first, by their time in a CI run (`make test ARGS=--durations=0`, 180f068:
# test_fused_engine.py alone held a third of the suite's time), so that `make test`'s two xdist workers, which take
# whole files in this order (the Makefile turns off xdist's own reordering by test count, which put the few-test files
# with long subprocess fixtures last), do not start a long one last.
LONG_FILES = ("test_fused_engine.py", "test_peers.py", "test_plan.py", "test_flce.py", "test_bench.py",
              "test_vocab_parallel_tools.py", "test_distributed_jax.py", "test_cpo.py", "test_logprobs.py",
              "test_compile.py", "test_logits_pingpong.py", "test_distributed_torch.py", "test_flce_jax_only.py")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_generate_tests(metafunc):
    """Parametrize a bare ``case`` argument over ``small_cases()`` (ids: the case names)."""
    if "case" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", "")
        names = [s.strip() for s in names.split(",")] if isinstance(names, str) else list(names)
        if "case" in names:
            return
    cases = small_cases()
    metafunc.parametrize("case", cases, ids=[c.name for c in cases])


@pytest.fixture(scope="session")
def device() -> str:
    """"cuda" when the tests run on a GPU, else "cpu"."""
    if HAS_GPU:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    return "cpu"


@pytest.fixture
def cuda_lowering(monkeypatch):
    """The JAX twin's kernels built as on an H100 (no interpreter, 132 programs); returns `lowered(fn, *args)`:
    the text of fn's program lowered for CUDA on this CPU."""
    import jax

    from fce_jax.kernels import grad_gemms as jg
    from fce_jax.kernels import launch, mgpu
    from fce_jax.kernels import logit_tiles as jt
    from fce_jax.kernels import logit_tiles_mgpu as jm
    from fce_jax.kernels import tile_dlogits as jd
    from fce_jax.kernels import tile_dlogits_mgpu as jdm

    for module in (launch, mgpu, jm, jt, jg, jd, jdm):
        monkeypatch.setattr(module, "interpret_mode", lambda: False)
    monkeypatch.setattr(mgpu, "_cores", lambda: 132)
    return lambda fn, *args: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

"""The `engine` option's choice (docs/SPEC.md §1): `fce_core.contract.resolve_engine`'s rules, and what the default
("auto") runs in each twin on this machine: the library engine on the CPU, the fused engine for 16-bit inputs on
a GPU (run there by `tools/gpu_run.sh gputests`)."""
import numpy as np
import pytest
import torch

from fce_core.contract import FUSED_SOFTCAP_WITH_SMOOTHING, FUSED_SOFTCAP_WITH_SMOOTHING_F16, resolve_engine
from twins import each_twin


def test_resolve_engine():
    """The names as given, the fused engine's softcap limit with label smoothing (none without smoothing or
    without a softcap), and "auto": fused for 16-bit inputs on a GPU where it takes the options, else library."""
    for engine in ("library", "fused"):
        for ls, cap in ((0.0, None), (0.1, FUSED_SOFTCAP_WITH_SMOOTHING), (0.0, 1000.0), (1.0, None)):
            assert resolve_engine(engine, label_smoothing=ls, softcap=cap) == engine
    assert resolve_engine("library", label_smoothing=0.1, softcap=50.0) == "library"
    with pytest.raises(ValueError, match="softcap"):
        resolve_engine("fused", label_smoothing=0.1, softcap=FUSED_SOFTCAP_WITH_SMOOTHING * 1.0001)
    assert resolve_engine("fused", label_smoothing=0.1, softcap=FUSED_SOFTCAP_WITH_SMOOTHING_F16,
                          dtype="float16") == "fused"
    with pytest.raises(ValueError, match="softcap"):
        resolve_engine("fused", label_smoothing=0.1, softcap=FUSED_SOFTCAP_WITH_SMOOTHING_F16 * 1.0001,
                       dtype="float16")
    for bad in ("v2", "Fused", None):
        with pytest.raises(ValueError, match="engine"):
            resolve_engine(bad)
    for dtype in ("bfloat16", "float16"):
        assert resolve_engine("auto", dtype=dtype, gpu=True) == "fused"
        assert resolve_engine("auto", dtype=dtype, gpu=False) == "library"
        assert resolve_engine("auto", label_smoothing=0.1, softcap=4.0, dtype=dtype, gpu=True) == "fused"
        assert resolve_engine("auto", label_smoothing=0.0, softcap=50.0, dtype=dtype, gpu=True) == "fused"
    assert resolve_engine("auto", dtype="float32", gpu=True) == "library"
    assert resolve_engine("auto", label_smoothing=0.1, softcap=50.0, dtype="bfloat16", gpu=True) == "library"
    assert resolve_engine("auto", label_smoothing=0.1, softcap=5.0, dtype="float16", gpu=True) == "library"


@each_twin
def test_default_engine_on_this_device(twin, device):
    """The default's loss and dX are bitwise those of the engine it picks for bfloat16 inputs here (library on
    the CPU, fused on a GPU), and differ from the other engine's on these inputs."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(20, 16, generator=g) * 2, torch.randn(300, 16, generator=g)
    t = torch.randint(0, 300, (20,), generator=g)
    x, w, t = (twin.array(a.to(device)) for a in (x.to(torch.bfloat16), w.to(torch.bfloat16), t))
    default = twin.loss_and_dx(x, w, t)
    runs = {e: twin.loss_and_dx(x, w, t, engine=e) for e in ("library", "fused")}
    same = {e: all(np.array_equal(twin.bits(a), twin.bits(b)) for a, b in zip(default, r)) for e, r in runs.items()}
    picked = "fused" if device == "cuda" else "library"
    assert same == {"library": picked == "library", "fused": picked == "fused"}

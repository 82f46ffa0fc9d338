"""fce_torch's launch path (fce_torch/kernels/launch.py) with the interpreter off: the kernels compiled for sm_90
on this CPU and launched into tools/host_path.py's stand-in driver, whose launcher calls are recorded. A fused
fwd+bwd at two shapes (the second of odd sizes, so other alignment and integer specializations), launched through
`launch.Kernel` once every specialization is compiled, must hand Triton's launcher the same compiled kernels,
grids and arguments, in the same order, as Triton's own `kernel[grid](...)` does for the same calls; so must the
logits GEMM's Gluon kernel (logit_tiles_gluon.py), called directly. Run in a subprocess: the stand-in driver
replaces Triton's for the whole process."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, sys
sys.path.insert(0, "tools")
import host_path  # noqa: E402  (clears TRITON_INTERPRET before triton is imported)
host_path._clean_check()
host_path._stub_driver()
import torch
import triton.backends.nvidia.driver as nvd
from triton.tools.tensor_descriptor import TensorDescriptor
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
import fce_torch
from fce_core.config import GEMM
from fce_core.heads import StatsSpec
from fce_core.plan import cdiv
from fce_torch.kernels import logit_tiles, logit_tiles_gluon

calls = []


def described(a):
    if isinstance(a, torch.Tensor):
        return ["tensor", str(a.dtype), list(a.shape), list(a.stride()), a.data_ptr() % 16]
    if isinstance(a, (TensorDescriptor, GluonDescriptor)):
        return ["descriptor", str(a.base.dtype), list(a.shape), list(a.strides), list(a.block_shape)]
    return a if a is None or isinstance(a, (bool, int, float, str)) else repr(a)


def record(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_, *args):
    calls.append([id(self), gx, gy, gz, [described(a) for a in args]])


nvd.CudaLauncher.__call__ = record


def fwd_bwd(n, h, v):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, h, generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(v, h, generator=g) / h ** 0.5).bfloat16().requires_grad_(True)
    y = torch.randint(0, v, (n,), generator=g)
    fce_torch.fused_lce(x, w, y, engine="fused").backward()


def pingpong(n, h, v, spec):
    # the logits GEMM's Gluon kernel, which the engine takes on sm_90 GPUs only: called directly on these tensors
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, h, generator=g).bfloat16()
    w = torch.randn(v, h, generator=g).bfloat16()
    y = torch.randint(0, v, (n,), generator=g)
    parts = logit_tiles.partials(x, cdiv(v, GEMM.tile_n), spec)
    logit_tiles_gluon.logit_tiles_pp(x, w, y, None, x.new_empty(n, v), parts, spec=spec, tile_n=GEMM.tile_n)


shapes = [(256, 256, 1024), (255, 136, 1000)]
specs = [StatsSpec(), StatsSpec(q=True, pz=True)]
for s in shapes:  # every specialization's first launch: Triton compiles it
    fwd_bwd(*s)
for spec in specs:
    pingpong(300, 256, 1000, spec)
runs = {}
for path in ("lean", "triton"):
    if path == "triton":
        host_path._tritons_own_path()
    calls.clear()
    for s in shapes:
        fwd_bwd(*s)
    for spec in specs:
        pingpong(300, 256, 1000, spec)
    runs[path] = list(calls)
print(json.dumps(runs))
"""


def test_launches_match_tritons_own():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.splitlines()[-1])
    lean, triton_own = runs["lean"], runs["triton"]
    assert len(lean) >= 2 * 8 + 2  # each shape's fused fwd+bwd launches its logits, merge, head, dZ, dX and dW
    # kernels; then the Gluon logits GEMM twice
    assert len({c[0] for c in lean}) >= 12  # kernels and their specializations at the two shapes, the Gluon ones
    assert lean == triton_own


def test_every_kernel_takes_the_launch_path():
    """Every fce_torch kernel (a module-level `@triton.jit` function named `_..._kernel`) is a `launch.Kernel`,
    so that none is launched through Triton's slower per-call path by being left out."""
    import importlib
    import pkgutil

    import fce_torch
    from fce_torch.kernels import launch

    kernels = {}
    for package in (fce_torch, fce_torch.kernels):
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            kernels.update({f"{module.__name__}.{name}": value for name, value in vars(module).items()
                            if name.startswith("_") and name.endswith("_kernel") and not isinstance(value, type)})
    assert len(kernels) >= 17
    assert {name for name, k in kernels.items() if not isinstance(k, launch.Kernel)} == set()

"""fce_torch's host path without its kernels: the wall time per fused fwd+bwd on this machine's CPU with every
Triton launch replaced by a no-op (and the value check's flags by a clean count), so what remains is fce's own
Python, torch's ops and autograd; then, with --profile, cProfile's top functions by own time. Against the
GPU's wall time per call at a host-bound shape (N = 256) it tells how much of the host's share is Triton's
launch path (binding, specialization, the driver) rather than fce's code.

With --cuda (GPU machine) the tensors live on the GPU, so torch's CUDA-side ops count too, and the same calls are
first timed with their launches (best of 3 rounds of STEPS calls each), through fce_torch's launch path
(fce_torch/kernels/launch.py) and through Triton's own `kernel[grid](...)`, alternating three times after a
check that both give the same bits; then captured in one CUDA graph and replayed (the kernels' pace, no host).

With --stub-driver (no GPU needed; gcc) the same calls are first timed through both launch paths down to
Triton's C launcher, over a stand-in libcuda whose every call succeeds and does nothing (the kernels compiled for
sm_90 on this CPU, the flags still clean): the binding, specialization, TMA descriptors and launcher without the
driver's own time (best of 12 rounds).

Usage: python tools/host_path.py [--profile] [--cuda | --stub-driver] [N,H,V ...]   (256,4096,128256 by default;
without --cuda any machine, no GPU needed; PYTHONPATH=. for --cuda's graph, `bench.impls_torch.graphed`). A
development tool.
"""
import cProfile
import ctypes
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)

# The driver calls that Triton's CUDA utilities and launcher make, each succeeding without effect; device
# queries answer as an sm_90 GPU with 132 multiprocessors and 227 KiB of shared memory per block.
STUB_LIBCUDA = r"""
#include <stdint.h>
#include <string.h>
#include <stddef.h>
typedef int CUresult;
CUresult cuInit(unsigned f) { return 0; }
CUresult cuDeviceGet(int *d, int o) { *d = 0; return 0; }
CUresult cuDeviceGetAttribute(int *pi, int attr, int dev) {
  *pi = attr == 16 ? 132 : attr == 97 ? 232448 : attr == 8 ? 49152 : attr == 75 ? 9 : attr == 76 ? 0 : 1;
  return 0;
}
CUresult cuCtxGetCurrent(void **c) { *c = (void *)1; return 0; }
CUresult cuCtxSetCurrent(void *c) { return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { *c = (void *)1; return 0; }
CUresult cuModuleLoadData(void **m, const void *img) { *m = (void *)1; return 0; }
CUresult cuModuleGetFunction(void **f, void *m, const char *n) { *f = (void *)1; return 0; }
CUresult cuFuncGetAttribute(int *pi, int attr, void *f) { *pi = attr == 0 ? 1024 : 0; return 0; }
CUresult cuFuncSetAttribute(void *f, int attr, int v) { return 0; }
CUresult cuFuncSetCacheConfig(void *f, int c) { return 0; }
CUresult cuOccupancyMaxActiveClusters(int *n, void *f, const void *cfg) { *n = 1; return 0; }
CUresult cuTensorMapEncodeTiled(void *map) { memset(map, 0, 128); return 0; }
CUresult cuTensorMapEncodeIm2col(void *map) { memset(map, 0, 128); return 0; }
CUresult cuLaunchKernelEx(const void *cfg, void *f, void **params, void **extra) { return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return 0; }
CUresult cuGetErrorString(CUresult r, const char **s) { *s = "stub"; return 0; }
CUresult cuPointerGetAttribute(void *data, int attr, uint64_t ptr) { *(uint64_t *)data = ptr; return 0; }
CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, uint64_t ptr) { return 0; }
CUresult cuCtxGetLimit(size_t *v, int l) { *v = 0; return 0; }
CUresult cuCtxSetLimit(int l, size_t v) { return 0; }
"""

import torch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import fce_torch  # noqa: E402
from fce_torch import checks  # noqa: E402
from fce_torch.kernels import launch  # noqa: E402

STEPS = 20
ALTERNATIONS = 6  # of the two launch paths, each time best of `rounds` rounds of STEPS calls


def _stub_driver():
    """Triton's CUDA driver over STUB_LIBCUDA, built here and loaded under libcuda's soname before Triton's
    utilities link and load against it; torch's CUDA queries answered as device 0, stream 0, sm_90."""
    from fce_torch.kernels import tma

    folder = tempfile.mkdtemp(prefix="fce_stub_cuda_")
    with open(os.path.join(folder, "stub.c"), "w") as f:
        f.write(STUB_LIBCUDA)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", "-o",
                    os.path.join(folder, "libcuda.so.1"), os.path.join(folder, "stub.c")], check=True)
    os.symlink("libcuda.so.1", os.path.join(folder, "libcuda.so"))
    ctypes.CDLL(os.path.join(folder, "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
    os.environ["TRITON_LIBCUDA_PATH"] = folder
    import triton
    from triton.backends.nvidia.driver import CudaDriver

    driver = CudaDriver()
    driver.get_device_capability = lambda device=None: (9, 0)
    driver.get_current_stream = lambda device=None: 0
    driver.get_current_device = lambda: 0
    driver.set_current_device = lambda device: None
    triton.runtime.driver.set_active(driver)
    tma.processors = lambda device: 132  # the H200's launch grids


def _clean_check():
    """The value check's flags all clear, with every row counted valid (no kernel writes them here)."""
    flags_of = checks.value_flags

    def clean(targets, vocab, ignore_index, class_weights=None):
        flags, scalars = flags_of(targets, vocab, ignore_index, class_weights)
        flags = torch.zeros_like(flags)
        flags[1] = targets.numel()
        return flags, scalars

    checks.value_flags = clean


def _no_launches():
    """Every `kernel[grid](...)` a no-op (fce_torch's `launch.Kernel` does its own binding before launching)."""
    JITFunction.__getitem__ = launch.Kernel.__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)


def _inputs(n, h, v, device):
    x = torch.randn(n, h, device=device).bfloat16().requires_grad_(True)
    w = (torch.randn(v, h, device=device) / h ** 0.5).bfloat16().requires_grad_(True)
    return x, w, torch.randint(0, v, (n,), device=device)


def _fwd_bwd(x, w, y, validate=True):
    x.grad = w.grad = None
    loss = fce_torch.fused_lce(x, w, y, engine="fused", validate=validate)
    loss.backward()
    return loss


def host_ms(n, h, v, profile=False, device="cpu", rounds=1):
    x, w, y = _inputs(n, h, v, device)
    for _ in range(3):
        _fwd_bwd(x, w, y)
    ms = float("inf")
    for _ in range(rounds):
        _sync(device)
        start = time.perf_counter()
        for _ in range(STEPS):
            _fwd_bwd(x, w, y)
        _sync(device)
        ms = min(ms, (time.perf_counter() - start) / STEPS * 1e3)
    if profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [_fwd_bwd(x, w, y) for _ in range(STEPS)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return ms


def _tritons_own_path():
    """fce_torch's launches through Triton's `kernel[grid](...)` instead of `launch.Kernel`'s; returns the undo."""
    lean = launch.Kernel._launch
    launch.Kernel._launch = lambda self, grid, *args, **kwargs: self.fn[grid](*args, **kwargs)
    return lambda: setattr(launch.Kernel, "_launch", lean)


def _results(x, w, y):
    _fwd_bwd(x, w, y)
    return [_fwd_bwd(x, w, y).detach(), x.grad, w.grad]


def launch_paths(n, h, v, device, rounds):
    """fce_torch's launch path against Triton's own, alternating, best of `rounds` rounds each time, and the
    medians; on the GPU first whether both give the same bits."""
    if device == "cuda":
        x, w, y = _inputs(n, h, v, device)
        ours = _results(x, w, y)
        undo = _tritons_own_path()
        theirs = _results(x, w, y)
        undo()
        print(f"({n}, {h}, {v}) loss, dX and dW bitwise equal through both launch paths: "
              f"{all(torch.equal(a, b) for a, b in zip(ours, theirs))}", flush=True)
    where = "" if device == "cuda" else ", the driver a no-op"
    times = {"fce_torch's": [], "Triton's own": []}
    for _ in range(ALTERNATIONS):
        for path, ms in times.items():
            undo = _tritons_own_path() if path == "Triton's own" else (lambda: None)
            ms.append(host_ms(n, h, v, device=device, rounds=rounds))
            undo()
            print(f"({n}, {h}, {v}) fused fwd+bwd with its launches through {path} path{where}: {ms[-1]:.3f} ms "
                  f"per call", flush=True)
    print(f"({n}, {h}, {v}) medians of {ALTERNATIONS}: " +
          ", ".join(f"{path} path {statistics.median(ms):.3f} ms" for path, ms in times.items()), flush=True)


def graph_ms(n, h, v, rounds=3):
    """The fused fwd+bwd (validate=False) captured in one CUDA graph and replayed back to back (the op bench's
    `bench.impls_torch.graphed`): the kernels' pace without the host's; and whether a replay gives the eager
    call's bits."""
    from bench.impls_torch import graphed

    x, w, y = _inputs(n, h, v, "cuda")
    replay = graphed(lambda *args: _fwd_bwd(*args, validate=False))
    captured = [replay(x, w, y), x.grad, w.grad]
    ms = float("inf")
    for _ in range(rounds):
        _sync("cuda")
        start = time.perf_counter()
        for _ in range(STEPS):
            replay(x, w, y)
        _sync("cuda")
        ms = min(ms, (time.perf_counter() - start) / STEPS * 1e3)
    eager = [_fwd_bwd(x, w, y, validate=False).detach(), x.grad, w.grad]
    replay(x, w, y)
    same = all(torch.equal(a, b) for a, b in zip(eager, captured))
    print(f"({n}, {h}, {v}) fused fwd+bwd (validate=False) as a CUDA graph, replayed: {ms:.3f} ms per call; "
          f"bitwise equal to the eager call: {same}", flush=True)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    args = sys.argv[1:]
    profile, device, stub = "--profile" in args, "cuda" if "--cuda" in args else "cpu", "--stub-driver" in args
    shapes = [tuple(int(d) for d in a.split(",")) for a in args if not a.startswith("--")] or [(256, 4096, 128256)]
    rounds = 3 if device == "cuda" else 12 if stub else 1
    if stub:  # no kernel runs, none writes the flags
        _clean_check()
        _stub_driver()
    if device == "cuda" or stub:
        for n, h, v in shapes:
            launch_paths(n, h, v, device, rounds)
            if device == "cuda":
                graph_ms(n, h, v, rounds)
    if not stub:
        _clean_check()
    _no_launches()
    for n, h, v in shapes:
        print(f"({n}, {h}, {v}) fused fwd+bwd, kernels not launched ({device} tensors): "
              f"{host_ms(n, h, v, profile, device, rounds):.3f} ms of host per call ({STEPS} calls)", flush=True)


if __name__ == "__main__":
    main()

"""fce_torch's host path without its kernels: the wall time per fused fwd+bwd on this machine's CPU with every
Triton launch replaced by a no-op (and the value check's flags by a clean count), so what remains is fce's own
Python, torch's ops and autograd; then, with --profile, cProfile's top functions by own time. Against the
GPU's wall time per call at a host-bound shape (N = 256) it tells how much of the host's share is Triton's
launch path (binding, specialization, the driver) rather than fce's code.

With --cuda (GPU machine) the tensors live on the GPU, so torch's CUDA-side ops count too, and the same calls are
first timed with their launches: the difference is Triton's launch path (best of 3 rounds of STEPS calls each).

With --stub-driver (no GPU needed; gcc) the same calls are first timed through Triton's own launch path down to
its C launcher, over a stand-in libcuda whose every call succeeds and does nothing (the kernels compiled for
sm_90 on this CPU, the flags still clean): Triton's binding, specialization, TMA descriptors and launcher
without the driver's own time (best of 12 rounds).

Usage: python tools/host_path.py [--profile] [--cuda | --stub-driver] [N,H,V ...]   (256,4096,128256 by default;
without --cuda any machine, no GPU needed). A development tool.
"""
import cProfile
import ctypes
import os
import pstats
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

STEPS = 20


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
    """Every `kernel[grid](...)` a no-op."""
    JITFunction.__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)


def host_ms(n, h, v, profile=False, device="cpu", rounds=1):
    x = torch.randn(n, h, device=device).bfloat16().requires_grad_(True)
    w = (torch.randn(v, h, device=device) / h ** 0.5).bfloat16().requires_grad_(True)
    y = torch.randint(0, v, (n,), device=device)

    def step():
        x.grad = w.grad = None
        fce_torch.fused_lce(x, w, y, engine="fused").backward()

    for _ in range(3):
        step()
    ms = float("inf")
    for _ in range(rounds):
        _sync(device)
        start = time.perf_counter()
        for _ in range(STEPS):
            step()
        _sync(device)
        ms = min(ms, (time.perf_counter() - start) / STEPS * 1e3)
    if profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [step() for _ in range(STEPS)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return ms


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
        where = "" if device == "cuda" else ", the driver a no-op"
        for n, h, v in shapes:
            print(f"({n}, {h}, {v}) fused fwd+bwd with its launches{where}: "
                  f"{host_ms(n, h, v, device=device, rounds=rounds):.3f} ms per call", flush=True)
    if not stub:
        _clean_check()
    _no_launches()
    for n, h, v in shapes:
        print(f"({n}, {h}, {v}) fused fwd+bwd, kernels not launched ({device} tensors): "
              f"{host_ms(n, h, v, profile, device, rounds):.3f} ms of host per call ({STEPS} calls)", flush=True)


if __name__ == "__main__":
    main()

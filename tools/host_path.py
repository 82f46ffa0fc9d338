"""fce_torch's host path without its kernels: the wall time per fused fwd+bwd on this machine's CPU with every
Triton launch replaced by a no-op (and the value check's flags by a clean count), so what remains is fce's own
Python, torch's ops and autograd; then, with --profile, cProfile's top functions by own time. Against the
GPU's wall time per call at a host-bound shape (N = 256) it tells how much of the host's share is Triton's
launch path (binding, specialization, the driver) rather than fce's code.

With --cuda (GPU machine) the tensors live on the GPU, so torch's CUDA-side ops count too, and the same calls are
first timed with their launches: the difference is Triton's launch path (best of 3 rounds of STEPS calls each).

Usage: python tools/host_path.py [--profile] [--cuda] [N,H,V ...]   (256,4096,128256 by default; without --cuda
any machine, no GPU needed). A development tool.
"""
import cProfile
import os
import pstats
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import fce_torch  # noqa: E402
from fce_torch import checks  # noqa: E402

STEPS = 20


def _no_launches():
    """Every `kernel[grid](...)` a no-op; the value check's flags all clear, with every row counted valid."""
    JITFunction.__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)
    flags_of = checks.value_flags

    def clean(targets, vocab, ignore_index, class_weights=None):
        flags, scalars = flags_of(targets, vocab, ignore_index, class_weights)
        flags = torch.zeros_like(flags)
        flags[1] = targets.numel()
        return flags, scalars

    checks.value_flags = clean


def host_ms(n, h, v, profile=False, device="cpu"):
    x = torch.randn(n, h, device=device).bfloat16().requires_grad_(True)
    w = (torch.randn(v, h, device=device) / h ** 0.5).bfloat16().requires_grad_(True)
    y = torch.randint(0, v, (n,), device=device)

    def step():
        x.grad = w.grad = None
        fce_torch.fused_lce(x, w, y, engine="fused").backward()

    for _ in range(3):
        step()
    ms = float("inf")
    for _ in range(3 if device == "cuda" else 1):
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
    profile, device = "--profile" in args, "cuda" if "--cuda" in args else "cpu"
    shapes = [tuple(int(d) for d in a.split(",")) for a in args if not a.startswith("--")] or [(256, 4096, 128256)]
    if device == "cuda":
        for n, h, v in shapes:
            print(f"({n}, {h}, {v}) fused fwd+bwd with its launches: {host_ms(n, h, v, device=device):.3f} ms per "
                  f"call", flush=True)
    _no_launches()
    for n, h, v in shapes:
        print(f"({n}, {h}, {v}) fused fwd+bwd, kernels not launched ({device} tensors): "
              f"{host_ms(n, h, v, profile, device):.3f} ms of host per call ({STEPS} calls)", flush=True)


if __name__ == "__main__":
    main()

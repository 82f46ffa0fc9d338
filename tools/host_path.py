"""fce_torch's host path without its kernels: the wall time per fused fwd+bwd on this machine's CPU with every
Triton launch replaced by a no-op (and the value check's flags by a clean count), so what remains is fce's own
Python, torch's ops and autograd; then, with --profile, cProfile's top functions by own time. Against the
GPU's wall time per call at a host-bound shape (N = 256) it tells how much of the host's share is Triton's
launch path (binding, specialization, the driver) rather than fce's code.

Usage (any machine, no GPU needed): python tools/host_path.py [--profile] [N,H,V ...]   (256,4096,128256 by
default). A development tool.
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


def host_ms(n, h, v, profile=False):
    x = torch.randn(n, h).bfloat16().requires_grad_(True)
    w = (torch.randn(v, h) / h ** 0.5).bfloat16().requires_grad_(True)
    y = torch.randint(0, v, (n,))

    def step():
        x.grad = w.grad = None
        fce_torch.fused_lce(x, w, y, engine="fused").backward()

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    ms = (time.perf_counter() - start) / STEPS * 1e3
    if profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [step() for _ in range(STEPS)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return ms


def main():
    args = sys.argv[1:]
    profile = "--profile" in args
    shapes = [tuple(int(d) for d in a.split(",")) for a in args if a != "--profile"] or [(256, 4096, 128256)]
    _no_launches()
    for n, h, v in shapes:
        print(f"({n}, {h}, {v}) fused fwd+bwd, kernels not launched: {host_ms(n, h, v, profile):.2f} ms of host "
              f"per call ({STEPS} calls)", flush=True)


if __name__ == "__main__":
    main()

"""fce_torch's fused engine timed from one source tree, for A/B runs of two trees in separate processes: the
logits GEMM alone at chunk shapes, fused_lce's loss (wall, and its kernels' device time) and fwd+bwd (wall,
and the device time per kernel name, from torch.profiler, which host noise does not reach).

Usage (GPU, repo root): python tools/ab_torch.py LABEL [TREE] [--steps N,H,V ...]   (TREE: a directory holding
the fce_torch to time, e.g. a copy of another commit's; default the repo's. --steps: only the fwd+bwd of these
shapes). A development tool.
"""
import os
import sys


def _split(args):
    """(the positional arguments, the --steps shapes or None)."""
    if "--steps" not in args:
        return args, None
    i = args.index("--steps")
    return args[:i], [tuple(int(v) for v in s.split(",")) for s in args[i + 1:]]


_pos, STEPS = _split(sys.argv[1:])
which = _pos[0]
sys.path[0] = os.path.abspath(_pos[1]) if len(_pos) > 1 else os.getcwd()
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import fce_torch  # noqa: E402
from fce_core.heads import StatsSpec  # noqa: E402
from fce_core.options import Transform  # noqa: E402
from fce_torch.kernels import logit_tiles as lt  # noqa: E402


def timed(fn, reps=10):
    """The median of `reps` CUDA-event timings of fn, in ms, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def device_ms(fn):
    """Device time per kernel name of one call of fn (torch.profiler), in ms: {name: (ms, launches)}."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {ev.key: (ev.self_device_time_total / 1000, ev.count) for ev in prof.key_averages()}


def inputs(n, h, v):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
    return x, w, torch.randint(0, v, (n,), device="cuda", generator=g)


def main():
    print(which, fce_torch.__file__)
    out = {}
    if STEPS:
        for n, h, v in STEPS:
            step_times(out, *inputs(n, h, v), f"{n},{h},{v}")
        report(out)
        return
    for n, h, v in ((512, 640, 262144), (768, 896, 151936), (1024, 4096, 128256)):
        x, w, y = inputs(n, h, v)
        for store in (False, True):
            out[f"tiles {n},{h},{v} store={store}"] = timed(lambda: lt.logit_tiles(
                x, w, None, y, None, spec=StatsSpec(), transform=Transform(), precision="ieee", store=store))
    for n, h, v in ((8192, 640, 262144), (8192, 896, 151936)):
        x, w, y = inputs(n, h, v)
        with torch.no_grad():
            def loss():
                fce_torch.fused_lce(x, w, y, engine="fused")
            out[f"loss {n},{h},{v}"] = timed(loss)
            out[f"loss {n},{h},{v} kernels"] = sum(ms for ms, _ in device_ms(loss).values())
        step_times(out, x, w, y, f"{n},{h},{v}")
    report(out)


def step_times(out, x, w, y, shape):
    """fwd+bwd of fused_lce: wall (CUDA events) and device time per kernel name, into `out`."""
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def step():
        xg.grad = wg.grad = None
        fce_torch.fused_lce(xg, wg, y, engine="fused").backward()
    out[f"fwd+bwd {shape}"] = timed(step, 5)
    for name, (ms, count) in device_ms(step).items():
        if ms > 0.2:
            out[f"fwd+bwd {shape} kernel {name[:40]} x{count}"] = ms


def report(out):
    for key, ms in out.items():
        print(f"{which} | {key} | {ms:.3f} ms")


if __name__ == "__main__":
    main()

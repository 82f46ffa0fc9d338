"""Where fce_torch's time goes: the CUDA kernels of one fwd+bwd (torch.profiler), per shape and engine, and
the wall time of a call against its kernels' sum (the host's share: launches, checks).

With --host, the Python functions of the host path instead (cProfile over 50 fwd+bwd of each engine,
by own time): where the launches' host time goes when the host, not the GPU, sets the pace. With --trace DIR,
the fused engine's timeline with and without the host check of the values (`validate`): the wall time of 50
back-to-back fwd+bwd, and a chrome trace of 5 (DIR/trace_NxHxV_validate_{True,False}.json) whose GPU gaps show
where the device waits on the host.

With --logprobs, the kernel profile of `fused_token_logprobs` (entropy too, random cotangents on both outputs)
per engine instead of the loss: where the fused engine's time on the log-probs goes.

Usage (GPU): python tools/profile_torch.py [--host | --trace DIR | --logprobs] N,H,V [N,H,V ...]. A development
tool.
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fce_torch

REPS = 3


def _step(x, w, y, engine, validate=True):
    x.grad = w.grad = None
    fce_torch.fused_lce(x, w, y, engine=engine, validate=validate).backward()


def _logprobs_step(x, w, y, engine, cotangents):
    x.grad = w.grad = None
    torch.autograd.backward(fce_torch.fused_token_logprobs(x, w, y, return_entropy=True, engine=engine), cotangents)


def launch_costs(reps=2000):
    """Host microseconds per call of pairwise_sum (one Triton launch) against the slicing tree it replaced
    (log2(width) adds), on the GPU, the host running ahead of it."""
    from fce_torch.sums import pairwise_sum, sliced_sum as slicing

    for shape in ((256,), (256, 502), (4096, 4096, 3)):
        x = torch.randn(*shape, device="cuda")
        assert torch.equal(pairwise_sum(x), slicing(x))
        for name, fn in (("triton", pairwise_sum), ("slicing", slicing)):
            fn(x)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn(x)
            host = (time.perf_counter() - t0) / reps * 1e6
            torch.cuda.synchronize()
            print(f"pairwise_sum {shape} {name}: {host:.1f} us per call on the host")


def host_profile(x, w, y, engine, calls=50):
    import cProfile
    import pstats

    for _ in range(3):
        _step(x, w, y, engine)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        _step(x, w, y, engine)
    torch.cuda.synchronize()
    prof.disable()
    print(f"\n== host path, engine={engine}: {calls} fwd+bwd")
    pstats.Stats(prof).sort_stats("tottime").print_stats(35)


def timeline(x, w, y, out_dir, calls=50):
    import os

    os.makedirs(out_dir, exist_ok=True)
    for validate in (True, False):
        for _ in range(3):
            _step(x, w, y, "fused", validate)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            _step(x, w, y, "fused", validate)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / calls * 1e3
        print(f"== {tuple(x.shape)} fused validate={validate}: {wall:.3f} ms per fwd+bwd, {calls} back to back")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                _step(x, w, y, "fused", validate)
            torch.cuda.synchronize()
        n, h = x.shape
        prof.export_chrome_trace(os.path.join(out_dir, f"trace_{n}x{h}x{w.shape[0]}_validate_{validate}.json"))


def main():
    args = sys.argv[1:]
    host = "--host" in args
    trace = args[args.index("--trace") + 1] if "--trace" in args else None
    logprobs = "--logprobs" in args
    specs = [a for a in args if "," in a]
    for spec in specs or ["4096,4096,128256"]:
        n, h, v = (int(s) for s in spec.split(","))
        x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(v, h, device="cuda") / h ** 0.5).to(torch.bfloat16).requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda")
        if trace:
            timeline(x, w, y, trace)
            continue
        cotangents = (torch.randn(n, device="cuda"), torch.randn(n, device="cuda"))
        for engine in ("library", "fused"):
            if host:
                host_profile(x, w, y, engine)
                continue

            def step():
                if logprobs:
                    _logprobs_step(x, w, y, engine, cotangents)
                else:
                    _step(x, w, y, engine)

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(REPS):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / REPS * 1e3
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(REPS):
                    step()
                torch.cuda.synchronize()
            events = prof.key_averages()
            kernels = sum(e.device_time_total for e in prof.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA)
            print(f"\n== {n},{h},{v} engine={engine}: wall {wall:.3f} ms per fwd+bwd, kernels "
                  f"{kernels / REPS / 1e3:.3f} ms")
            print(events.table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    if not (host or trace or logprobs):
        launch_costs()


if __name__ == "__main__":
    main()

"""fce_torch's fused engine timed from one source tree, for A/B runs of two trees in separate processes: the
logits GEMM alone at chunk shapes, fused_lce's loss (wall, and its kernels' device time) and fwd+bwd (wall,
and the device time per kernel name, from torch.profiler, which host noise does not reach).

Usage (GPU, repo root): python tools/ab_torch.py LABEL [TREE]   (TREE: a directory holding the fce_torch to
time, e.g. a copy of another commit's; default the repo's). A development tool.
"""
import os
import sys

which = sys.argv[1]
sys.path[0] = os.path.abspath(sys.argv[2]) if len(sys.argv) > 2 else os.getcwd()
import torch  # noqa: E402
import fce_torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile
from fce_torch.kernels import logit_tiles as lt
from fce_core.heads import StatsSpec
from fce_core.options import Transform
print(which, fce_torch.__file__)

def timed(fn, reps=10):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]

out = {}
for n, h, v in ((512, 640, 262144), (768, 896, 151936), (1024, 4096, 128256)):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    for store in (False, True):
        f = lambda: lt.logit_tiles(x, w, None, y, None, spec=StatsSpec(), transform=Transform(), precision="ieee", store=store)
        out[f"tiles {n},{h},{v} store={store}"] = timed(f)
for n, h, v in ((8192, 640, 262144), (8192, 896, 151936)):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    with torch.no_grad():
        f = lambda: fce_torch.fused_lce(x, w, y, engine="fused")
        out[f"loss {n},{h},{v}"] = timed(f)
        f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            f(); torch.cuda.synchronize()
        out[f"loss {n},{h},{v} kernels"] = sum(ev.self_device_time_total for ev in prof.key_averages()) / 1000
    xg = x.clone().requires_grad_(); wg = w.clone().requires_grad_()
    def step():
        xg.grad = wg.grad = None
        fce_torch.fused_lce(xg, wg, y, engine="fused").backward()
    out[f"fwd+bwd {n},{h},{v}"] = timed(step, 5)
    step(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(); torch.cuda.synchronize()
    for ev in prof.key_averages():
        if ev.device_time_total > 200:
            out[f"fwd+bwd {n},{h},{v} kernel {ev.key[:40]} x{ev.count}"] = ev.device_time_total / 1000
for k, val in out.items():
    print(f"{which} | {k} | {val:.3f} ms")

"""Where fce_torch's time goes: the CUDA kernels of one fwd+bwd (torch.profiler), per shape.

Usage (GPU): python tools/profile_torch.py N,H,V [N,H,V ...]. A development tool.
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import fce_torch


def main():
    for spec in sys.argv[1:] or ["4096,4096,128256"]:
        n, h, v = (int(s) for s in spec.split(","))
        x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(v, h, device="cuda") / h ** 0.5).to(torch.bfloat16).requires_grad_()
        y = torch.randint(0, v, (n,), device="cuda")
        for _ in range(3):
            fce_torch.fused_lce(x, w, y).backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                x.grad = w.grad = None
                fce_torch.fused_lce(x, w, y).backward()
            torch.cuda.synchronize()
        print(f"\n== {n},{h},{v}: 3 fwd+bwd")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()

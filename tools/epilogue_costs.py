"""What each part of the logits GEMM's statistics epilogue costs: a reduced copy of fce_torch's kernel (TMA loads,
persistent, GemmConfig's tiles; no bias, softcap, class weights, q or pz) with parts switched off one at a time
(the column mask, the argmax, the target logit, the row sum or its pairwise tree, the tile values' store, the
exponential), timed against cuBLAS's logits GEMM into float32. Its values are not fce's (no parity): only
its times matter. A development tool: bench/results/nvidia-h200/dw-overlap/.

Usage (GPU, repo root, after `source .whl/install.sh`): python tools/epilogue_costs.py N,H,V ...; writes
$OUT/epilogue_costs.json (or ./).
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

from fce_core.config import GEMM
from fce_torch.kernels import fastmath as fm
from fce_torch.kernels.fastmath import LOG2E
from fce_torch.kernels.tma import column_halves, descriptors, programs, stages
from fce_torch.sums import row_sum

from fused_kernels import best_ms


@triton.jit
def _epilogue_parts_kernel(x_ptr, w_ptr, y_ptr, e_ptr, m_ptr, s_ptr, arg_ptr, zy_ptr, n_rows, V, H, n_tiles,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LOG2_BN: tl.constexpr,
                           MASK: tl.constexpr, ARG: tl.constexpr, ZY: tl.constexpr, SUM: tl.constexpr,
                           STORE: tl.constexpr, EXP: tl.constexpr, TREE: tl.constexpr):
    n_m = tl.cdiv(n_rows, BM)
    for pid in tl.range(tl.program_id(0), n_m * n_tiles, tl.num_programs(0)):
        t = pid // n_m
        r0 = (pid % n_m) * BM
        rows = r0 + tl.arange(0, BM)
        cols = t * BN + tl.arange(0, BN)
        row_ok = rows < n_rows
        rows64 = rows.to(tl.int64)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, H, BK):
            acc += tl.dot(x_ptr.load([r0, k0]), tl.trans(w_ptr.load([t * BN, k0])))
        z = acc
        if MASK:
            z = tl.where((cols < V)[None, :], z, float("-inf"))
        m_t = tl.max(z, axis=1)
        part = rows64 * n_tiles + t
        tl.store(m_ptr + part, m_t, mask=row_ok)
        if ARG:
            tl.store(arg_ptr + part, tl.min(tl.where(z == m_t[:, None], cols[None, :], 2147483647), axis=1),
                     mask=row_ok)
        if ZY:
            y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
            tl.store(zy_ptr + part, tl.max(tl.where(cols[None, :] == y[:, None], z, float("-inf")), axis=1),
                     mask=row_ok)
        if EXP:
            e = fm.ex2((z - m_t[:, None]) * LOG2E, True)
        else:
            e = z - m_t[:, None]
        if SUM:
            if TREE:
                tl.store(s_ptr + part, row_sum(e, BM, BN, LOG2_BN), mask=row_ok)
            else:
                tl.store(s_ptr + part, tl.sum(e, axis=1), mask=row_ok)
        if STORE:
            left, right = column_halves(e.to(tl.bfloat16))
            e_ptr.store([r0, t * BN], left)
            e_ptr.store([r0, t * BN + BN // 2], right)


FULL = dict(MASK=True, ARG=True, ZY=True, SUM=True, STORE=True, EXP=True, TREE=True)
VARIANTS = {"full": {}, "no mask": dict(MASK=False), "no argmax": dict(ARG=False), "no zy": dict(ZY=False),
            "no argmax/zy/mask": dict(ARG=False, ZY=False, MASK=False), "tl.sum": dict(TREE=False),
            "no sum": dict(SUM=False), "no store": dict(STORE=False), "no exp": dict(EXP=False),
            "max only": dict(MASK=False, ARG=False, ZY=False, SUM=False, STORE=False, EXP=False)}


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: python tools/epilogue_costs.py N,H,V [N,H,V ...]")
    cfg = GEMM
    rows = []
    for shape in sys.argv[1:]:
        n, h, v = (int(a) for a in shape.split(","))
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
        y = torch.randint(0, v, (n,), device="cuda", generator=g, dtype=torch.int32)
        n_tiles = triton.cdiv(v, cfg.tile_n)
        e = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
        parts = [torch.empty(n, n_tiles, device="cuda", dtype=dt)
                 for dt in (torch.float32, torch.float32, torch.int32, torch.float32)]
        (xa, wa), _ = descriptors([(x, (cfg.tile_m, cfg.tile_k)), (w, (cfg.tile_n, cfg.tile_k))], cfg)
        (ea,), _ = descriptors([(e, (cfg.tile_m, cfg.tile_n // 2))], cfg)
        grid = (programs(triton.cdiv(n, cfg.tile_m) * n_tiles, cfg, x.device),)
        rows.append(dict(shape=shape, variant="cublas f32 out",
                         ms=best_ms(lambda: torch.mm(x, w.t(), out_dtype=torch.float32))))
        print(rows[-1], flush=True)
        for name, switched in VARIANTS.items():
            def run(flags={**FULL, **switched}):
                _epilogue_parts_kernel[grid](xa, wa, y, ea, *parts, n, v, h, n_tiles, BM=cfg.tile_m, BN=cfg.tile_n,
                                             BK=cfg.tile_k, LOG2_BN=cfg.tile_n.bit_length() - 1, **flags,
                                             num_warps=cfg.num_warps, num_stages=stages(cfg, 2))
            rows.append(dict(shape=shape, variant=name, ms=best_ms(run)))
            print(rows[-1], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "epilogue_costs.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("| shape | variant | ms |")
    for r in rows:
        print(f"| {r['shape']} | {r['variant']} | {r['ms']:.3f} |")


if __name__ == "__main__":
    main()

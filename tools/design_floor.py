"""What the fused engine's layout costs beyond its three GEMMs, from its row plan alone: the bytes that only the
chunked design moves (the tile values' dZ pass, the (hi, lo) dW pair's re-reads and re-writes over writing dW
once, the per-tile statistics), and the time that traffic takes on top of a measured 3-GEMM time where it does not
overlap the tensor cores' work. A bound of the design, not of the problem: a kernel that formed dZ on its operand
load and hid the pair's traffic under its K loop would move these bytes while computing.

bf16 inputs and weight, every row valid (all chunks run), gradients of x and W, the plan of `fce_core.plan.fused_rows`.

Usage: python tools/design_floor.py --tbps B N,H,V,GEMM_MS [...]   (B: a measured bandwidth in TB/s, e.g. the dZ
pass's own; GEMM_MS: the measured cuBLAS 3-GEMM time of the shape). Runs anywhere; a development tool.
"""
import argparse

from fce_core.config import GEMM, PAIR_LO_BYTES
from fce_core.plan import STATS_BYTES, cdiv, fused_rows, layout

ITEM = 2  # bfloat16


def excess_bytes(n: int, h: int, v: int) -> dict:
    """The bytes per fwd+bwd that the chunked layout adds to the three GEMMs' own reads and writes, by cause."""
    plan = fused_rows(n, h, v, ITEM, need_grads=True, dw_pair=True)
    _, chunks = layout(n, plan.rows)
    pair = ITEM + PAIR_LO_BYTES
    if plan.single_product(True):
        dw = 0  # one GEMM writes dW in the weight's dtype, as cuBLAS's would
    else:
        # the first chunk writes the pair, the middle ones read and rewrite it, the last reads it and writes hi;
        # less the one write of dW that any backward makes
        first, middle, last = pair, 2 * pair, pair + ITEM
        dw = (first + middle * (chunks - 2) + last - ITEM) * v * h
    return {"plan": plan, "chunks": chunks, "dz_pass": 2 * n * v * ITEM, "dw_pair": dw,
            "stats": n * cdiv(v, GEMM.tile_n) * STATS_BYTES}  # each byte counted once


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tbps", type=float, required=True, help="bandwidth in TB/s that the traffic runs at")
    parser.add_argument("shapes", nargs="+", metavar="N,H,V,GEMM_MS")
    args = parser.parse_args()
    print("| N, H, V | chunks x rows | dZ pass GB | dW pair GB | statistics GB | 3 GEMMs ms | + traffic ms | floor |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.shapes:
        n, h, v, gemm_ms = spec.split(",")
        n, h, v, gemm_ms = int(n), int(h), int(v), float(gemm_ms)
        b = excess_bytes(n, h, v)
        total = b["dz_pass"] + b["dw_pair"] + b["stats"]
        extra = total / (args.tbps * 1e12) * 1e3
        print(f"| {n}, {h}, {v} | {b['chunks']} x {b['plan'].rows} | {b['dz_pass'] / 1e9:.2f} | "
              f"{b['dw_pair'] / 1e9:.2f} | {b['stats'] / 1e9:.2f} | {gemm_ms:.2f} | {extra:.2f} | "
              f"{(gemm_ms + extra) / gemm_ms:.2f}x |")


if __name__ == "__main__":
    main()

"""How fast could a backward swept over blocks of V be? The library GEMMs of that plan, timed against the
cuBLAS 3-GEMM line and fce's fused engine (a development probe for the engine's design, GPU only).

The fused engine sweeps rows: each chunk's dW is added to a (hi, lo) pair, whose epilogue costs as much as the
chunk's product at small H (bench/results/nvidia-h100/dw-epilogue/). Swept over V instead, after a forward pass
that keeps only each row's log-sum-exp, a block of Vb columns recomputes its logits (x @ W_bᵀ: the fourth GEMM;
its epilogue would form dZ from the kept statistics, so no dZ pass), writes dW_b = dZ_bᵀ x once with K = all N
rows (no accumulation, no pair), and adds dZ_b @ W_b into a float32 dX [N, H]. Vb is what fits dZ_b in the
engine's allowance for a chunk of 16-bit logits (N·Vb·2 bytes <= 256 MiB).

    python tools/vblock_probe.py OUT.json [N,H,V ...]

Per shape, ms (CUDA events, median of REPS after a warm-up):
- `three_gemm`: bench's cuBLAS line (logits with float32 out, dZ @ W, dZᵀ x);
- `fce_fused`: fce_torch's fused engine, forward and backward;
- `fce_loss_only`: its forward alone without gradients (the forward pass this plan needs);
- `vblock_gemms`: per block x @ W_bᵀ (bfloat16 out), dZ_bᵀ x into dW's rows, dZ_b @ W_b (float32 out) added
  into dX; with the logits' stand-in dZ_b = the block's logits, as the GEMMs' time does not depend on values;
- `vblock_estimate` = fce_loss_only + vblock_gemms (no epilogue, no dX rounding: a floor for the plan);
- `vblock_fce`: the same sweep on fce_torch's own kernels, the recomputing GEMM stood in for by the fused logits
  GEMM with its statistics epilogue storing its 16-bit tile values into dZ_b's buffer (`logit_tiles`: an exp
  per element and the row statistics, more than a dZ epilogue needs), then `dw_gemm` (its new block copied into
  dW's rows: a V·H·2-byte copy per sweep that the plan would not make) and `dx_gemm` (float32 out) added into
  dX; `vblock_fce_estimate` = fce_loss_only + vblock_fce;
- `vsweep_tiles`, `vsweep_dz`, `vsweep_dw`, `vsweep_dx`: the sweep on fce_torch's kernels stage by stage, each
  stage's launches over all blocks: `logit_tiles` into the block's buffer, `tile_dlogits` (the dZ pass over
  it), dZ_bᵀ x written straight into dW's rows (no copy), dZ_b W_b added into the float32 dX by the GEMM's
  epilogue (ADD); `vsweep_all` the four per block, `vsweep_estimate` = fce_loss_only + vsweep_all: the plan
  built from the engine's kernels as they are.
"""
import json
import statistics
import sys

import torch

SHAPES = [(8192, 640, 262144), (16384, 640, 262144), (8192, 896, 151936), (16384, 2048, 128256)]
REPS = 10
BLOCK_BYTES = 256 << 20


def _time(fn, reps=REPS):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def block_columns(n, v):
    """Vb: the most columns, a multiple of 256, whose bfloat16 [n, Vb] block fits BLOCK_BYTES (at most V)."""
    return min(v, max(256, BLOCK_BYTES // (2 * n) // 256 * 256))


def probe(n, h, v):
    import fce_torch
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, h, device="cuda", generator=g) / h ** 0.25).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.25).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    vb = block_columns(n, v)
    row = dict(N=n, H=h, V=v, Vb=vb, blocks=-(-v // vb))

    dz = torch.randn(n, v, device="cuda", generator=g).to(torch.bfloat16)

    def three_gemm():
        torch.mm(x, w.T, out_dtype=torch.float32)
        torch.mm(dz, w)
        torch.mm(dz.T, x)
    row["three_gemm"] = _time(three_gemm)
    del dz

    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def fused():
        xg.grad = wg.grad = None
        fce_torch.fused_lce(xg, wg, y, engine="fused").backward()
    row["fce_fused"] = _time(fused)
    del xg, wg

    def loss_only():
        with torch.no_grad():
            fce_torch.fused_lce(x, w, y, engine="fused")
    row["fce_loss_only"] = _time(loss_only)

    dw = torch.empty(v, h, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty(n, h, device="cuda", dtype=torch.float32)

    def vblock():
        dx.zero_()
        for v0 in range(0, v, vb):
            w_b = w[v0:v0 + vb]
            dz_b = torch.mm(x, w_b.T)
            torch.mm(dz_b.T, x, out=dw[v0:v0 + vb])
            dx.add_(torch.mm(dz_b, w_b, out_dtype=torch.float32))
    row["vblock_gemms"] = _time(vblock)
    row["vblock_estimate"] = row["fce_loss_only"] + row["vblock_gemms"]

    from fce_core.heads import StatsSpec
    from fce_core.options import Transform
    from fce_torch.kernels.grad_gemms import dw_gemm, dx_gemm
    from fce_torch.kernels.logit_tiles import logit_tiles
    dz_b = torch.empty(n, vb, device="cuda", dtype=torch.bfloat16)
    dx_b = torch.empty(n, h, device="cuda", dtype=torch.float32)
    y_safe = torch.zeros_like(y)

    def vblock_fce():
        dx.zero_()
        for v0 in range(0, v, vb):
            w_b = w[v0:v0 + vb]
            cols = w_b.shape[0]
            logit_tiles(x, w_b, None, y_safe, None, spec=StatsSpec(), transform=Transform(), precision="ieee",
                        out=dz_b[:, :cols])
            dw[v0:v0 + cols] = dw_gemm(dz_b[:, :cols], x, torch.bfloat16)
            dx.add_(dx_gemm(dz_b[:, :cols], w_b, dx_b))
    row["vblock_fce"] = _time(vblock_fce)
    row["vblock_fce_estimate"] = row["fce_loss_only"] + row["vblock_fce"]

    from fce_core.plan import ADD, WRITE, cdiv
    from fce_torch.kernels.grad_gemms import _dw_config, _run
    from fce_torch.kernels.logit_tiles import gemm_config
    from fce_torch.kernels.tile_dlogits import tile_dlogits
    ones = torch.ones(n, device="cuda")
    coef = dict(lse=ones * 30, a=ones / n, b=-ones / n, c=ones * 0)
    zy = torch.zeros(n, device="cuda")
    tile_n = gemm_config().tile_n

    def stage(k):
        def body():
            if k in ("dx", "all"):
                dx.zero_()
            for v0 in range(0, v, vb):
                w_b = w[v0:v0 + vb]
                cols = w_b.shape[0]
                e = dz_b[:, :cols]
                if k in ("tiles", "all"):
                    _, parts = logit_tiles(x, w_b, None, y_safe, None, spec=StatsSpec(), transform=Transform(),
                                           precision="ieee", out=e)
                if k in ("dz", "all"):
                    m = parts["m"] if k == "all" else m_fixed[:, :cdiv(cols, tile_n)]
                    tile_dlogits(e, m, y_safe, zy, None, coef, transform=Transform())
                if k in ("dw", "all"):
                    _run(e, True, x, dw[v0:v0 + cols], None, cols, h, n, WRITE, cfg=_dw_config(h))
                if k in ("dx", "all"):
                    _run(e, False, w_b, dx, None, n, h, cols, ADD)
        return body
    m_fixed = torch.zeros(n, cdiv(vb, tile_n), device="cuda")
    for k in ("tiles", "dz", "dw", "dx", "all"):
        row[f"vsweep_{k}"] = _time(stage(k))
    row["vsweep_estimate"] = row["fce_loss_only"] + row["vsweep_all"]
    return row


def main():
    out = sys.argv[1]
    shapes = [tuple(int(s) for s in a.split(",")) for a in sys.argv[2:]] or SHAPES
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for shape in shapes:
        r = probe(*shape)
        rows.append(r)
        base = r["three_gemm"]
        print(f"N={r['N']:6d} H={r['H']:5d} V={r['V']:6d} Vb={r['Vb']:6d}  3 GEMMs {base:7.2f}  "
              + "  ".join(f"{k} {r[k]:7.2f} ({r[k] / base:4.2f}x)" for k in
                          ("fce_fused", "fce_loss_only", "vblock_gemms", "vblock_estimate", "vblock_fce",
                           "vblock_fce_estimate", "vsweep_tiles", "vsweep_dz", "vsweep_dw", "vsweep_dx",
                           "vsweep_all", "vsweep_estimate")), flush=True)
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Can the gradient GEMMs take the logits GEMM's tile values with dZ's scale applied in registers, at the GEMM's
rate? A development probe for a layout without the dZ pass (docs/PERFORMANCE.md, "The floor of the chunked
layout").

The fused engine's tile values are e = exp(z - m_t) in 16 bits, m_t the (row, V-tile) maximum. For the heads
without a softcap, dZ's softmax term is e times a scale per (row, V-tile), s = a exp(m_t - lse). The engine
writes dZ in a pass over the [rows, V] values (4 bytes per logit of traffic), then runs its GEMMs over dZ. This
probe times GEMMs that read e and multiply their A operand by s in registers before the MMA:
- dX = (e ⊙ s) W, with A = a [rows, 64] block of e whose 64 columns lie in one tile;
- dW = (e ⊙ s)ᵀ X, with A = a transposed block of e, one tile's columns per output tile.

It does not form the one-hot and uniform terms of dZ, which a layout without the pass would add apart. Each
kernel runs in two modes of the same code: `plain` (the A block as loaded: the GEMM over a dZ that a pass
wrote) and `scaled` (A scaled and rounded back to 16 bits in registers). The dZ pass's traffic is stood in for
by an in-place multiply of the chunk's values. For calibration, the run also times fce_torch's own `dx_gemm` and
`dw_gemm` over the same array, and cuBLAS's.

    python tools/scaled_operand_probe.py OUT.json [N,H,V ...]   # GPU: times at the fused plan's chunk
    python tools/scaled_operand_probe.py --check                  # CPU (Triton interpreter): values vs float64

Per shape, ms (CUDA events, median of REPS after a warm-up); `scaled / plain` is the cost of the transform.
"""
import json
import os
import statistics
import sys

if "--check" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from fce_core.config import GEMM  # noqa: E402
from fce_torch.kernels import fastmath as fm  # noqa: E402

REPS = 20
SHAPES = [(8192, 640, 262144), (8192, 896, 151936), (16384, 2048, 128256), (4096, 4096, 128256),
          (256, 4096, 128256)]
TILE_N = GEMM.tile_n  # the V-tiles of the scale: the logits GEMM's


@triton.jit
def _probe_kernel(a_ptr, s_a, b_ptr, s_b, c_ptr, s_ptr, s_row, s_tile, M, N, K, SLICE_K,
                  SCALE: tl.constexpr, A_T: tl.constexpr, DESC: tl.constexpr, TILE: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr):
    # C [M, N] = A @ B, B [K, N]. A = e [M, K] (dX: rows x V) or, with A_T, eᵀ of e [K, M] (dW: V x rows). With
    # SCALE, A's element at (e's row r, e's column v) is multiplied by s[r, v // TILE] and rounded to e's dtype.
    # One program per (output tile, slice of K): K ascending over [slice * SLICE_K, (slice + 1) * SLICE_K) into
    # C's plane `slice` (C [slices, M, N]); A and B loaded by TMA descriptors (DESC) or masked pointers.
    n_n = tl.cdiv(N, BN)
    pid = tl.program_id(0) % (tl.cdiv(M, BM) * n_n)
    plane = tl.program_id(0) // (tl.cdiv(M, BM) * n_n)
    rows = (pid // n_n) * BM + tl.arange(0, BM)
    cols = (pid % n_n) * BN + tl.arange(0, BN)
    r64 = rows.to(tl.int64)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(plane * SLICE_K, tl.minimum(K, (plane + 1) * SLICE_K), BK):
        ks = k0 + tl.arange(0, BK)
        k64 = ks.to(tl.int64)
        if A_T:  # e's [BK, BM] block: rows ks of e, columns `rows` (one tile: BM divides TILE)
            if DESC:
                a = a_ptr.load([k0, (pid // n_n) * BM])
            else:
                a = tl.load(a_ptr + k64[:, None] * s_a + r64[None, :],
                            mask=(ks < K)[:, None] & (rows < M)[None, :], other=0.0)
            if SCALE:
                s = tl.load(s_ptr + k64 * s_row + ((pid // n_n) * BM // TILE) * s_tile, mask=ks < K, other=0.0)
                a = (a.to(tl.float32) * s[:, None]).to(a.dtype)
            a = tl.trans(a)
        else:  # e's [BM, BK] block: one tile's columns (BK divides TILE)
            if DESC:
                a = a_ptr.load([(pid // n_n) * BM, k0])
            else:
                a = tl.load(a_ptr + r64[:, None] * s_a + k64[None, :],
                            mask=(rows < M)[:, None] & (ks < K)[None, :], other=0.0)
            if SCALE:
                s = tl.load(s_ptr + r64 * s_row + (k0 // TILE) * s_tile, mask=rows < M, other=0.0)
                a = (a.to(tl.float32) * s[:, None]).to(a.dtype)
        if DESC:
            b = b_ptr.load([k0, (pid % n_n) * BN])
        else:
            b = tl.load(b_ptr + k64[:, None] * s_b + cols[None, :], mask=(ks < K)[:, None] & (cols < N)[None, :],
                        other=0.0)
        acc += fm.dot(a, b, "ieee", ASM)
    tl.store(c_ptr + plane.to(tl.int64) * M * N + r64[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


def probe_gemm(e, b, s, *, a_t, scale, desc=False, slices=1, tiles=(128, 256, 64), warps=8, stages=3):
    """dX-like (e [m, k] @ b [k, n], a_t False) or dW-like (eᵀ @ b, e [k, m]) into a new array of e's dtype; with
    `scale`, e's elements times s [e's rows, ceil(e's columns / TILE_N)] first (rounded to e's dtype); with
    `desc`, A and B loaded by TMA descriptors; with `slices` > 1, K cut into that many slices of whole BK steps,
    each into a float32 plane, the planes then summed (torch.sum, as the engine's pairwise_sum stands in)."""
    bm, bn, bk = tiles
    if TILE_N % (bm if a_t else bk):
        raise ValueError(f"A's blocks must lie in one tile of {TILE_N} columns: {tiles}")
    m, k = (e.shape[1], e.shape[0]) if a_t else e.shape
    n = b.shape[1]
    slice_k = triton.cdiv(triton.cdiv(k, slices), bk) * bk
    c = torch.empty((slices, m, n) if slices > 1 else (m, n), device=e.device,
                    dtype=torch.float32 if slices > 1 else e.dtype)
    a_op, b_op = e, b
    if desc:
        a_op = TensorDescriptor.from_tensor(e, [bk, bm] if a_t else [bm, bk])
        b_op = TensorDescriptor.from_tensor(b, [bk, bn])
    _probe_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn) * slices,)](
        a_op, e.stride(0), b_op, b.stride(0), c, s, s.stride(0), s.stride(1), m, n, k, slice_k, SCALE=scale,
        A_T=a_t, DESC=desc, TILE=TILE_N, BM=bm, BN=bn, BK=bk, ASM=fm.ASM, num_warps=warps, num_stages=stages)
    return c.sum(0).to(e.dtype) if slices > 1 else c


def scaled(e, s):
    """e's elements times s [e's rows, ceil(e's columns / TILE_N)], each rounded once to e's dtype: dZ as the pass
    would form it from the tile values."""
    return (e.float() * s.repeat_interleave(TILE_N, dim=1)[:, :e.shape[1]]).to(e.dtype)


def reference(e, b, s, *, a_t, scale):
    """float64 of what `probe_gemm` computes (A rounded to e's dtype after the scale, as the kernel does)."""
    a = (scaled(e, s) if scale else e).float()
    a = a.t() if a_t else a
    return a.double() @ b.double()


def check():
    """The kernel against float64 in the interpreter, rows, columns and K not multiples of the blocks: float32
    operands to float32's rounding, bfloat16 ones (A rounded after its scale, C rounded) to bfloat16's. Returns
    whether every launch is within its bound."""
    g = torch.Generator().manual_seed(0)
    rows, vocab, hidden = 37, 200, 48
    ok = True
    for dtype, bound in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        e = torch.rand(rows, vocab, generator=g).to(dtype)
        s = torch.rand(rows, triton.cdiv(vocab, TILE_N), generator=g) * 4
        w = torch.randn(vocab, hidden, generator=g).to(dtype)
        x = torch.randn(rows, hidden, generator=g).to(dtype)
        for a_t, b in ((False, w), (True, x)):
            for scale in (False, True):
                for desc, slices in ((False, 1), (True, 1), (True, 3)):
                    got = probe_gemm(e, b, s, a_t=a_t, scale=scale, desc=desc, slices=slices, tiles=(16, 32, 16),
                                     warps=4, stages=1).double()
                    want = reference(e, b, s, a_t=a_t, scale=scale)
                    err = float((got - want).norm() / want.norm())
                    ok &= err < bound
                    print(f"{dtype} {'dW' if a_t else 'dX'} {'scaled' if scale else 'plain'}{' tma' * desc} "
                          f"{slices} slice(s): "
                          f"relative error {err:.2e} (bound {bound:g})")
    return ok


def _ms(fn):
    """The median of REPS calls queued back to back, each between CUDA events: the host's launches run ahead of
    the device, so a call's time is its kernels' (tools/vblock_probe.py waits after each call instead)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times)


def gpu_main(out_path, shapes):
    from fce_core.config import GRAD_GEMM_TORCH
    from fce_core.plan import dx_slices, fused_rows
    from fce_torch.kernels.grad_gemms import dw_gemm, dx_gemm

    results = []
    for n, h, v in shapes:
        m = min(n, fused_rows(n, h, v, 2, need_grads=True, dw_pair=True).rows)
        slices = dx_slices(m, h, v, GRAD_GEMM_TORCH)
        g = torch.Generator(device="cuda").manual_seed(1)
        e = torch.rand(m, v, device="cuda", generator=g).bfloat16()
        s = torch.rand(m, triton.cdiv(v, TILE_N), device="cuda", generator=g)
        s_t = s.t().contiguous().t()  # tile-major: dW's K steps read s down a column
        w = (torch.randn(v, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
        x = torch.randn(m, h, device="cuda", generator=g).bfloat16()
        dx = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)
        row = dict(shape=(m, h, v), dx_slices=slices, pass_standin=_ms(lambda: torch.mul(e, 1.0, out=e)),
                   cublas_dx=_ms(lambda: torch.mm(e, w)), cublas_dw=_ms(lambda: torch.mm(e.t(), x)),
                   fce_dx=_ms(lambda: dx_gemm(e, w, dx)), fce_dw=_ms(lambda: dw_gemm(e, x, torch.bfloat16)))
        for name, a_t, b, sc, n_slices in (("dx", False, w, s, slices), ("dw", True, x, s_t, 1)):
            for stages in (3, 4):
                for scale in (False, True):
                    key = f"{name}_s{stages}_{'scaled' if scale else 'plain'}"
                    run = lambda: probe_gemm(e, b, sc, a_t=a_t, scale=scale, desc=True, slices=n_slices,  # noqa
                                             stages=stages)
                    try:
                        row[key] = _ms(run)
                        want = reference(e, b, sc, a_t=a_t, scale=scale)
                        row[key + "_err"] = float((run().double() - want).norm() / want.norm())
                    except Exception as exc:  # a launch that does not compile is a result too
                        row[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
        results.append(row)
        print(json.dumps(row), flush=True)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    print("\nchunk (rows, H, V) | pass stand-in | fce dX / dW | probe dX plain -> scaled | probe dW plain -> scaled")
    for r in results:
        def best(kind, mode):
            vals = [r[f"{kind}_s{st}_{mode}"] for st in (3, 4) if isinstance(r.get(f"{kind}_s{st}_{mode}"), float)]
            return min(vals) if vals else float("nan")
        print(f"{tuple(r['shape'])} | {r['pass_standin']:.3f} | {r['fce_dx']:.3f} / {r['fce_dw']:.3f} | "
              f"{best('dx', 'plain'):.3f} -> {best('dx', 'scaled'):.3f} | {best('dw', 'plain'):.3f} -> "
              f"{best('dw', 'scaled'):.3f}")


if __name__ == "__main__":
    if "--check" in sys.argv:
        sys.exit(0 if check() else 1)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    gpu_main(args[0], [tuple(int(d) for d in a.split(",")) for a in args[1:]] or SHAPES)

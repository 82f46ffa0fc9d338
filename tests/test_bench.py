"""The benchmarks' CPU smoke mode (``python -m bench ... --smoke``) runs and writes its reports.

Each benchmark runs in a subprocess (it sets TRITON_INTERPRET / JAX_PLATFORMS itself before importing triton
or jax) into a temporary folder; the three start together, so the module takes about as long as the slowest.
Implementations that cannot run here (no GPU, package missing, fce API not written yet) must be explained in
the result's notes, never dropped silently; those that run on every CPU (the plain losses, the reference GEMMs,
Liger in the Triton interpreter) must have positive times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = {  # the smoke runs, started together: each is mostly one busy thread; the first argument names the JSON
    "op": ["op", "--shape", "32,64,128"],  # 64,128,256: 3.6 s a call of fce_torch's fused engine in the interpreter
    "sft": ["sft", "--compile-body", "--impl", "hf_stock,fce_torch,jax_naive"],  # torch.compile'd decoders
    "sft_profile": ["sft", "--profile", "--impl", "hf_stock,jax_naive"],  # eager; + body_only in torch and JAX
    "cpo": ["cpo"],
    # one process per implementation; cce cannot run on a CPU, so its process reports why
    "op_isolated": ["op", "--shape", "32,64,128", "--impl", "fce_torch,torch_naive,jax_naive,cce", "--isolate"],
}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """Start every smoke run at once; ``bench(name)`` waits for one and returns (result dict, stdout, folder)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "JAX_PLATFORMS")}
    procs = {}
    for name, args in RUNS.items():
        out = tmp_path_factory.mktemp(name)
        cmd = [sys.executable, "-m", "bench", *args, "--smoke", "--reps", "1", "--out", str(out)]
        procs[name] = (out, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True))

    def wait(name: str) -> tuple[dict, str, Path]:
        out, proc = procs[name]
        # a hang guard: beside the other xdist worker on two cores the op run took 138 s and then over 170
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
        return json.loads((out / f"{RUNS[name][0]}.json").read_text()), stdout, out

    yield wait
    for _, proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _check_rows(result: dict, expected: set[str], always: set[str]) -> None:
    ran, notes = {r["impl"] for r in result["rows"]}, set(result["notes"])
    assert expected <= ran | notes, f"neither run nor explained: {expected - ran - notes}"
    for r in result["rows"]:
        time = r.get("ms", r.get("step_ms"))
        assert (time is not None and time > 0) or r["note"].startswith("error:"), r
        if r["impl"] in always:
            assert time is not None and time > 0, r
    assert always <= ran


def test_op_smoke(bench):
    from bench import impls_jax, impls_torch, op

    result, stdout, out = bench("op")
    always = {op.REFERENCE, "torch_naive", "jax_naive", "liger", "liger_fp32"}
    _check_rows(result, set(impls_torch.FLCE) | set(impls_jax.FLCE) | {op.REFERENCE}, always)
    rows = result["rows"]
    assert {r["mode"] for r in rows} == {"fwd+bwd", "loss"}
    assert all(r["extra_gib"] is None for r in rows)  # no memory figure on the CPU
    by = {(r["impl"], r["mode"]): r for r in rows}
    assert by[(op.REFERENCE, "fwd+bwd")]["x_ref"] == 1.0
    assert by[("liger", "fwd+bwd")]["dloss"] < 1e-3  # same inputs, same loss as the plain one
    md = (out / "op.md").read_text()
    for name in always:
        assert f"| {name} |" in md
    assert "n/a" in md
    assert (out / "op_time.png").stat().st_size > 0
    assert "torch_naive" in stdout and "cublas_3gemm" in stdout  # the final table
    repo = Path(__file__).resolve().parent.parent
    for pkg in ("fce_core", "fce_torch", "fce_jax"):  # the code that ran, recorded (A/B runs tell their halves)
        folder, digest = result["meta"]["fce_source"][pkg].split()
        assert Path(folder) == repo / pkg and len(digest) == 16, result["meta"]["fce_source"]


def test_op_isolated_smoke(bench):
    """--isolate: each implementation's rows come from its own process's report, the ratio to the reference from
    that process, the loss differences across processes; the reference rows once, every process's time in meta."""
    from bench import op

    result, stdout, out = bench("op_isolated")
    names = ["fce_torch", "cce", "torch_naive", "jax_naive"]  # the registries' order
    assert result["meta"]["isolated"] == names and "one process per implementation" in result["title"]
    assert "cce" in result["notes"] and "cce" not in {r["impl"] for r in result["rows"]}
    rows = {(r["impl"], r["mode"]): r for r in result["rows"]}
    assert len(rows) == len(result["rows"]) == 8  # the reference once, three implementations, two modes
    for mode in ("fwd+bwd", "loss"):
        assert len(result["meta"]["reference_ms"][f"32,64,128 {mode}"]) == len(names)
        for name in ("fce_torch", "torch_naive", "jax_naive"):
            own = json.loads((out / "processes" / name / "op.json").read_text())["rows"]
            ref = next(r for r in own if r["impl"] == op.REFERENCE and r["mode"] == mode)
            row = rows[(name, mode)]
            assert row["ms"] > 0 and row["x_ref"] == row["ms"] / ref["ms"]
    assert rows[("fce_torch", "fwd+bwd")]["dloss"] < 1e-3  # against torch_naive, from another process
    assert rows[("torch_naive", "fwd+bwd")]["dloss"] is None and "jax_naive" in stdout


def test_source_digest_tells_trees_apart(tmp_path):
    """The digest of a package's Python files changes with any file's content or name, not with other files."""
    from parity.environment import source_digest

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    first = source_digest(tmp_path)
    (tmp_path / "notes.txt").write_text("not code")
    assert source_digest(tmp_path) == first
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    changed = source_digest(tmp_path)
    (tmp_path / "sub" / "b.py").rename(tmp_path / "sub" / "c.py")
    assert len({first, changed, source_digest(tmp_path)}) == 3


def test_sft_smoke(bench):
    result, stdout, out = bench("sft")
    _check_rows(result, {"hf_stock", "fce_torch", "jax_naive"}, {"hf_stock", "jax_naive"})
    rows = result["rows"]
    assert {r["model"] for r in rows} == {"tiny-qwen2", "tiny-llama"}
    assert result["meta"]["torch_decoder"] == "torch.compile" and "decoder compiled" in result["title"]
    assert "body_only" not in {r["impl"] for r in rows} and "profile" not in result  # only with --profile
    for r in rows:
        if r["step_ms"] is not None:
            assert len(r["losses"]) == 3 and all(5.0 < x < 8.0 for x in r["losses"])  # ~ln(1000) at init
        if r["impl"] == "fce_torch" and r["step_ms"] is not None:
            assert r["agree"] == "yes", r
        if r["impl"] in ("hf_stock", "jax_naive") and r["step_ms"] is not None:  # ran twice: the noise
            assert len(r["rerun_losses"]) == 3 and r["noise"] is not None and r["noise"] < 1e-3, r
    assert "hf_stock" in (out / "sft.md").read_text()
    assert "tokens/s" in stdout


def test_sft_profile_smoke(bench):
    from bench import profiling

    result, _, out = bench("sft_profile")
    assert result["meta"]["torch_decoder"] == "eager"
    _check_rows(result, {"hf_stock", "jax_naive", "body_only"}, {"hf_stock", "jax_naive", "body_only"})
    rows = result["rows"]
    bodies = {(r["model"], r["framework"]): r for r in rows if r["impl"] == "body_only"}
    assert set(bodies) == {(m, fw) for m in ("tiny-qwen2", "tiny-llama") for fw in ("torch", "jax")}
    for r in bodies.values():
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["note"] == "ablation" and r["agree"] is None
    for r in rows:
        if r["impl"] != "body_only":
            assert r["body_ms"] == bodies[(r["model"], r["framework"])]["step_ms"]
            assert abs(r["head_loss_ms"] - (r["step_ms"] - r["body_ms"])) < 1e-9
    caps = {(c["model"], c["impl"]): c for c in result["profile"]}
    assert set(caps) == {(r["model"], r["impl"]) for r in rows if r["framework"] == "torch"}
    for c in caps.values():
        assert set(c["ms"]) == set(profiling.CATEGORIES) and all(v >= 0 for v in c["ms"].values())
        assert c["total_ms"] > 0 and abs(sum(c["ms"].values()) - c["total_ms"]) < 1e-6
        assert 0 < len(c["top"]) <= profiling.TOP and all(k["category"] in profiling.CATEGORIES for k in c["top"])
    assert caps[("tiny-qwen2", "hf_stock")]["ms"]["GEMM"] > 0  # aten::mm is found on the CPU too
    md = (out / "sft.md").read_text()
    assert "## Profile" in md and "### Top kernels: tiny-llama / body_only" in md and "head+loss ms" in md


def test_category():
    from bench.profiling import category

    cases = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "GEMM", "nvjet_tst_128x256_64x4_1x2_h_bz":
        "GEMM", "aten::addmm": "GEMM", "aten::mm": "GEMM", "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>": "attention",
        "multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor<float, 4>>": "optimizer",
        "_row_stats_kernel": "loss", "_dlogits_kernel": "loss", "liger_cross_entropy_kernel": "loss",
        "cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>": "loss",
        "nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>": "loss",
        "vectorized_elementwise_kernel<4, FillFunctor<float>>": None, "aten::addcmul_": None, "aten::summary": None,
    }
    assert {name: category(name) for name in cases} == cases


def test_cpo_smoke(bench):
    from bench import impls_jax, impls_torch

    result, _, out = bench("cpo")
    _check_rows(result, set(impls_torch.CPO) | set(impls_jax.CPO), {"liger", "trl_torch", "trl_jax"})
    by = {(r["B"], r["impl"]): r for r in result["rows"]}
    assert by[(1, "liger")]["dloss"] < 1e-3  # Liger's CPO equals TRL's on the same inputs
    assert (out / "cpo.md").exists() and (out / "cpo_time.png").exists()


def test_steady_rates_reads_the_smi_samples(tmp_path):
    """tools/steady_rates.py's nvidia-smi samples: parsed per line (a line that is not a sample left out) and
    attached to the phases they fall in (median clock and power, the set of reasons)."""
    import datetime

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import steady_rates
    finally:
        sys.path.remove(str(ROOT / "tools"))
    path = tmp_path / "smi.csv"
    path.write_text("2026/12/04 20:18:30.671, 1980 MHz, 122.05 W, 0x0000000000000000\n"
                    "Failed to read\n"
                    "2026/12/04 20:18:31.000, 1395 MHz, 694.31 W, 0x0000000000000004\n"
                    "2026/12/04 20:18:31.020, 1410 MHz, 690.00 W, 0x0000000000000004\n")
    samples = steady_rates.smi_rows(path)
    t0 = datetime.datetime(2026, 12, 4, 20, 18, 30, 671000).timestamp()
    assert [q[1:] for q in samples] == [(1980.0, 122.05, "0x0000000000000000"), (1395.0, 694.31, "0x0000000000000004"),
                                        (1410.0, 690.0, "0x0000000000000004")]
    assert abs(samples[0][0] - t0) < 1e-3
    rows = steady_rates.with_samples([dict(start=t0 + 0.2, stop=t0 + 0.4), dict(start=t0 + 5, stop=t0 + 6)],
                                     samples)
    assert rows[0] == dict(start=t0 + 0.2, stop=t0 + 0.4, sm_mhz_median=1410.0, watts_median=694.31,
                           reasons=["0x0000000000000004"])
    assert "reasons" not in rows[1]


def test_trace_gaps_sums_the_device_idle_time(tmp_path):
    """tools/trace_gaps.py on a made-up trace of one step: busy time, span, and the idle gaps by neighbours
    (gaps under MIN_GAP_US and host events left out)."""
    import gzip

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import trace_gaps
    finally:
        sys.path.remove(str(ROOT / "tools"))
    events = [dict(ph="X", cat="kernel", name="gemm", ts=0, dur=100),
              dict(ph="X", cat="cpu_op", name="aten::mm", ts=50, dur=500),  # host: not device time
              dict(ph="X", cat="gpu_memcpy", name="Memcpy DtoH", ts=103, dur=10),  # 3 us after: no gap
              dict(ph="X", cat="kernel", name="gemm", ts=313, dur=100)]  # 200 us idle after the copy
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    text = trace_gaps.report(str(path), steps=1)
    assert "busy 0.21 ms per step of a 0.41 ms span, idle 0.20 ms" in text, text
    assert "0.200  Memcpy DtoH -> gemm" in text and "0.003" not in text, text
    assert "0.200  gemm\n" in text, text
    # a JAX perfetto trace: the GPU process's stream threads only (its XLA op line spans the same kernels)
    meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
            dict(ph="M", name="process_name", pid=2, args=dict(name="/host:CPU")),
            dict(ph="M", name="thread_name", pid=1, tid=7, args=dict(name="Stream #13(Compute)")),
            dict(ph="M", name="thread_name", pid=1, tid=8, args=dict(name="XLA Ops")),
            dict(ph="M", name="thread_name", pid=2, tid=7, args=dict(name="Stream #13(Compute)"))]
    jax_events = meta + [dict(ph="X", pid=1, tid=7, name="gemm", ts=0, dur=100),
                         dict(ph="X", pid=1, tid=8, name="fusion.1", ts=0, dur=400),
                         dict(ph="X", pid=2, tid=7, name="host work", ts=0, dur=400),
                         dict(ph="X", pid=1, tid=7, name="gemm", ts=300, dur=100)]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": jax_events}, f)
    text = trace_gaps.report(str(path), steps=1)
    assert "2 device events, busy 0.20 ms per step of a 0.40 ms span, idle 0.20 ms" in text, text


def test_jax_calls_run_back_to_back_one_queued():
    """`timing._back_to_back` keeps exactly one call queued behind the running one: call i+1 is launched before
    call i is waited for, and never two ahead; every call gets a time, in the order of the argument sets."""
    from bench import timing

    log = []

    class Result:
        def __init__(self, i):
            self.i = i

        def block_until_ready(self):
            log.append(("wait", self.i))
            return self

    def compiled(i):
        log.append(("call", i))
        return Result(i)

    times = timing._back_to_back(compiled, [(1,), (2,), (3,)])
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert log == [("call", 1), ("call", 1), ("wait", 1), ("call", 2), ("wait", 1), ("call", 3), ("wait", 2),
                   ("wait", 3)]
    assert timing._back_to_back(compiled, []) == []


def test_cpo_pairs_option():
    """``python -m bench cpo --pairs 4,8`` runs those pair counts; anything but positive integers is refused."""
    from bench.__main__ import _parser

    assert _parser().parse_args(["cpo", "--pairs", "4,8"]).pairs == (4, 8)
    assert _parser().parse_args(["cpo"]).pairs is None
    for bad in ("0", "4,x", ""):
        with pytest.raises(SystemExit):
            _parser().parse_args(["cpo", "--pairs", bad])


def test_launch_options(monkeypatch):
    """``--logits-gemm mosaic=true --grad-gemms pingpong=true`` take launch fields of GemmConfig and
    GradGemmConfig only (a NUMERICS field would change the bits), and `with_launches` sets them in both twins'
    engine launches."""
    import fce_jax.kernels.grad_gemms as jax_grads
    import fce_jax.kernels.logit_tiles as jax_logits
    import fce_torch.kernels.grad_gemms as torch_grads
    import fce_torch.kernels.logit_tiles as torch_logits
    from bench.__main__ import _parser, with_launches

    args = _parser().parse_args(["op", "--grad-gemms", "pingpong=true", "--grad-gemms", "num_stages=4",
                                 "--logits-gemm", "mosaic=true"])
    assert dict(args.grad_gemms) == {"pingpong": True, "num_stages": 4}
    assert dict(args.logits_gemm) == {"mosaic": True}
    assert _parser().parse_args(["op"]).grad_gemms == []
    for option, bad in (("--grad-gemms", "tile_k=32"), ("--grad-gemms", "split_m=64"), ("--logits-gemm", "tile_n=128"),
                        ("--grad-gemms", "pingpong=yes"), ("--grad-gemms", "num_stages=x"),
                        ("--logits-gemm", "pingpong=true"), ("--grad-gemms", "pingpong")):
        with pytest.raises(SystemExit):
            _parser().parse_args(["op", option, bad])
    names = {torch_grads: ("GRAD_GEMM_TORCH", "GRAD_GEMM_TORCH_TALL", "GRAD_GEMM_TORCH_ON_LOAD"),
             jax_grads: ("GRAD_GEMM_MOSAIC", "GRAD_GEMM_MOSAIC_SHORT_K"), torch_logits: ("GEMM", "GEMM_SHORT"),
             jax_logits: ("GEMM", "GEMM_SHORT")}
    for module, module_names in names.items():
        for name in module_names:
            monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    with_launches({"mosaic": True}, {"num_stages": 2})
    assert all(getattr(m, n).num_stages == 2 for m in (torch_grads, jax_grads) for n in names[m])
    assert all(getattr(m, n).mosaic for m in (torch_logits, jax_logits) for n in names[m])


def test_gluon_grads_option(monkeypatch):
    """``--gluon-grads dx,pair`` names which of fce_torch's gradient GEMMs take the Gluon kernel ('none': none);
    unknown or repeated names are refused; `with_launches` sets them for the process."""
    import fce_torch.kernels.grad_gemms as torch_grads
    from bench.__main__ import _parser, with_launches

    assert _parser().parse_args(["op", "--gluon-grads", "dx,pair"]).gluon_grads == ("dx", "pair")
    assert _parser().parse_args(["op", "--gluon-grads", "none"]).gluon_grads == ()
    assert _parser().parse_args(["op"]).gluon_grads is None
    for bad in ("dX", "pair,pair", "", "dw,"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["op", "--gluon-grads", bad])
    monkeypatch.setattr(torch_grads, "GLUON_GRADS", torch_grads.GLUON_GRADS)  # restored after the test
    with_launches({}, {}, ("dw", "dx"))
    assert torch_grads.GLUON_GRADS == ("dw", "dx")


def test_design_floor_counts_the_layouts_bytes():
    """tools/design_floor.py: no pair traffic where one GEMM writes dW (one chunk, or dZ kept); with c chunks the
    pair is written once, read and rewritten c - 2 times, read once more as hi is written: 6 (c - 1) bytes per
    weight element beyond dW written once; the dZ pass reads and writes every tile value."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import design_floor
    finally:
        sys.path.remove(str(ROOT / "tools"))
    one = design_floor.excess_bytes(256, 4096, 128256)
    kept = design_floor.excess_bytes(4096, 4096, 128256)
    assert (one["chunks"], one["dw_pair"]) == (1, 0) and kept["plan"].keep_dz and kept["dw_pair"] == 0
    for n, h, v in ((16384, 2048, 128256), (8192, 640, 262144), (3000, 896, 151936)):
        b = design_floor.excess_bytes(n, h, v)
        assert b["chunks"] > 1 and not b["plan"].keep_dz
        assert b["dw_pair"] == 6 * (b["chunks"] - 1) * v * h, (n, h, v, b)
        assert b["dz_pass"] == 4 * n * v


def test_scaled_operand_probe_computes_its_gemms():
    """tools/scaled_operand_probe.py's kernel, in the interpreter, against float64: dX- and dW-shaped, A scaled per
    (row, V-tile) in registers or not, pointer or TMA loads, K sliced or not (shapes off the blocks)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import scaled_operand_probe
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert scaled_operand_probe.check()

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
RUNS = {  # the smoke runs, started together: each is mostly one busy thread
    "op": ["op", "--shape", "64,128,512"],
    "sft": ["sft", "--impl", "hf_stock,fce_torch,jax_naive"],
    "cpo": ["cpo"],
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
        stdout, stderr = proc.communicate(timeout=170)
        assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
        return json.loads((out / f"{name}.json").read_text()), stdout, out

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


def test_sft_smoke(bench):
    result, stdout, out = bench("sft")
    _check_rows(result, {"hf_stock", "fce_torch", "jax_naive"}, {"hf_stock", "jax_naive"})
    rows = result["rows"]
    assert {r["model"] for r in rows} == {"tiny-qwen2", "tiny-llama"}
    for r in rows:
        if r["step_ms"] is not None:
            assert len(r["losses"]) == 3 and all(5.0 < x < 8.0 for x in r["losses"])  # ~ln(1000) at init
        if r["impl"] == "fce_torch" and r["step_ms"] is not None:
            assert r["agree"] == "yes", r
    assert "hf_stock" in (out / "sft.md").read_text()
    assert "tokens/s" in stdout


def test_cpo_smoke(bench):
    from bench import impls_jax, impls_torch

    result, _, out = bench("cpo")
    _check_rows(result, set(impls_torch.CPO) | set(impls_jax.CPO), {"liger", "trl_torch", "trl_jax"})
    by = {(r["B"], r["impl"]): r for r in result["rows"]}
    assert by[(1, "liger")]["dloss"] < 1e-3  # Liger's CPO equals TRL's on the same inputs
    assert (out / "cpo.md").exists() and (out / "cpo_time.png").exists()

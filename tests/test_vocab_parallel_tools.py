"""The vocab-parallel modes of the tools on the CPU: ``python -m parity --vocab-parallel 2`` (both twins over 2
shards against float64, run to run) and ``python -m bench op --smoke --vocab-parallel 2``."""
import json
import os
import subprocess
import sys

from quick_xla import with_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    env = {**os.environ, "XLA_FLAGS": with_flags()}  # the caller's flags left out; the tools add their devices
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


def test_parity_vocab_parallel(tmp_path):
    done = _run("parity", "--vocab-parallel", "2", "--device", "cpu", "--case",
                "vp_logprobs_f32,vp_none_bf16,vp_fused_all_options_bf16", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "parity.json").read_text())
    assert [e["case"] for e in result["cases"]] == ["vp_none_bf16", "vp_fused_all_options_bf16", "vp_logprobs_f32"]
    for entry in result["cases"]:
        assert entry["violations"] == [] and entry["outputs"]
        for rec in entry["outputs"].values():
            assert rec["deterministic"]["torch"] and rec["deterministic"]["jax"]
            assert rec["err"]["torch"] <= rec["bound"] and rec["err"]["jax"] <= rec["bound"]
            assert rec["verdict"] == {"torch": "ok", "jax": "ok"}


def test_bench_vocab_parallel_smoke(tmp_path):
    done = _run("bench", "op", "--smoke", "--vocab-parallel", "2", "--shape", "64,128,512", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "op-vocab-parallel.json").read_text())["rows"]
    assert {(r["impl"], r["P"]) for r in rows} == {("fce_torch", 1), ("fce_torch", 2), ("fce_jax", 1), ("fce_jax", 2)}
    assert all(r["ms"] is not None and r["ms"] > 0 for r in rows), rows

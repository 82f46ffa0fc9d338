"""The peers' own tests against fce's drop-ins: Liger-Kernel 0.8.5's FLCE and CPO test files and Cut
Cross-Entropy 25.1.1's forward and backward test files (tests/peers, its README.md), in the driver's CPU
variant (small shapes, Triton interpreter, two peer files at a time: about 2.5 minutes on two cores).

One driver run (a subprocess) per session; one test here per peer file, which fails if any of that file's
tests fails or errors, if it collected nothing, or if a test was skipped for a reason the driver does not
document (`tests/peers/changes.py`). Without network and without the sdist cache (``.peers/``) the driver
cannot fetch the peers: the tests then skip, saying so.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peers import changes

REPO = Path(__file__).resolve().parents[1]
LABELS = [pf.label for pf in changes.PEER_FILES]


@pytest.fixture(scope="module")
def peers_summary(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers") / "summary.json"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "tests.peers", "--device", "cpu", "--jobs", "2", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode == 2 and "could not fetch" in proc.stderr:
        pytest.skip(f"the peers' sdists could not be fetched and are not cached: {proc.stderr.strip()[-500:]}")
    assert out.exists(), f"the driver wrote no summary (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    summary = json.loads(out.read_text())
    summary["_output"] = proc.stdout[-5000:] + proc.stderr[-3000:]
    return summary


@pytest.mark.parametrize("label", LABELS)
def test_peer_file(peers_summary, label):
    rows = {r["file"]: r for r in peers_summary["files"]}
    assert label in rows, f"{label} did not run:\n{peers_summary['_output']}"
    row = rows[label]
    assert row["collected"] > 0, f"{label} collected nothing: {row['failures']}"
    assert row["failed"] == 0 and row["error"] == 0, \
        f"{label}: {row['failed']} failed, {row['error']} errors:\n" + "\n".join(
            f"{f['outcome']} {f['test']}: {f['message'][:500]}" for f in row["failures"][:30])
    undocumented = set(row["skip_reasons"]) - changes.DOCUMENTED_REASONS
    assert not undocumented, f"{label}: skipped for undocumented reasons: {undocumented}"
    assert row["passed"] + row["skipped"] == row["collected"]


def test_every_change_documented(peers_summary):
    """Every edit the driver made carries its reason, and only the documented files were edited."""
    files = {f"{pf.tree}/{pf.path}" for pf in changes.PEER_FILES}
    assert peers_summary["changes"], "no edit was applied: the imports were not redirected"
    for change in peers_summary["changes"]:
        assert change["why"] and change["what"]
        assert change["file"] in files, change

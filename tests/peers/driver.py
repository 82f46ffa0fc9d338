"""The peer-test driver: the peers' own tests, pointed at fce's drop-ins (see README.md beside this file).

Steps: (1) fetch the pinned sdists with ``pip download --no-binary :all: --no-deps`` into the cache (reused
when present: the cache folder can be carried to a machine without network), and, for ``--cce-tests main``,
CCE's GitHub-main test files from a local git mirror; (2) prepare one tree per peer under
``<cache>/run/<device>/``: the peer's test files and what they import from the peer's test tree, with the
`changes.edits` applied, plus this driver's plugin as ``conftest.py``; (3) run pytest on each peer file in its
own process; (4) print the counts per file and write a JSON summary.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from . import changes
from .changes import CCE_VERSION, LIGER_VERSION

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = REPO / ".peers"
DEFAULT_MIRROR = Path("/work/.mirror/apple+ml-cross-entropy/repo")
SDISTS = {"liger": ("liger-kernel", LIGER_VERSION, f"liger_kernel-{LIGER_VERSION}"),
          "cce": ("cut-cross-entropy", CCE_VERSION, f"cut_cross_entropy-{CCE_VERSION}")}
CCE_MAIN_FILES = ("tests/test_cce_loss_forward.py", "tests/test_cce_loss_backward.py")


class DriverError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------- fetching

def sdist_path(cache, key):
    return cache / "sdist" / f"{SDISTS[key][2]}.tar.gz"


def fetch_sdists(cache, offline=False):
    """The two pinned sdists in <cache>/sdist (downloaded once), extracted under <cache>/src."""
    (cache / "sdist").mkdir(parents=True, exist_ok=True)
    for key, (name, version, stem) in SDISTS.items():
        path = sdist_path(cache, key)
        if not path.exists():
            if offline:
                raise DriverError(f"{path} is missing and --offline was given: run `python -m tests.peers "
                                  "--fetch-only` on a machine with network and carry the cache folder")
            cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--no-cache-dir",
                   "-d", str(cache / "sdist"), f"{name}=={version}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0 or not path.exists():
                raise DriverError(f"could not fetch {name}=={version} ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        target = cache / "src" / stem
        if not (target / "PKG-INFO").exists():
            shutil.rmtree(target, ignore_errors=True)
            with tarfile.open(path) as tar:
                kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                tar.extractall(cache / "src", **kwargs)
    return {key: cache / "src" / SDISTS[key][2] for key in SDISTS}


def fetch_cce_main(cache, mirror):
    """CCE's GitHub-main test files (and its package, whose helpers the tests import) from a git mirror, into
    <cache>/cce-main. Returns that folder."""
    target = cache / "cce-main"
    if (target / "SOURCE").exists():
        return target
    mirror = Path(mirror)
    if not mirror.exists():
        raise DriverError(f"no CCE mirror at {mirror} and no {target}: pass --cce-mirror or --cce-tests DIR")
    git = ["git", "-C", str(mirror)]
    commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    tmp = target.with_name("cce-main.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    archive = subprocess.run(git + ["archive", "--format=tar", commit, "cut_cross_entropy", *CCE_MAIN_FILES],
                             capture_output=True, check=True).stdout
    (tmp / "cce.tar").write_bytes(archive)
    with tarfile.open(tmp / "cce.tar") as tar:
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp, **kwargs)
    (tmp / "cce.tar").unlink()
    (tmp / "SOURCE").write_text(f"apple/ml-cross-entropy {commit} (git archive of {mirror})\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def resolve_cce_tests(spec, cache, mirror):
    """--cce-tests: "main" (the mirror's, cached) or a folder with the two test files (directly or in tests/)
    and, for their helpers, the cut_cross_entropy package (in that folder or its parent). Returns
    (tests folder, package root or None, description)."""
    folder = fetch_cce_main(cache, mirror) if spec == "main" else Path(spec).resolve()
    tests = folder / "tests" if (folder / "tests" / changes.CCE_FWD).exists() else folder
    for name in (changes.CCE_FWD, changes.CCE_BWD):
        if not (tests / name).exists():
            raise DriverError(f"--cce-tests {spec}: no {name} in {tests}")
    package = next((p for p in (folder, folder.parent, tests.parent) if (p / "cut_cross_entropy").is_dir()), None)
    source = (folder / "SOURCE").read_text().strip() if (folder / "SOURCE").exists() else str(folder)
    return tests, package, source


# ---------------------------------------------------------------------------------------------- preparing

def apply_edits(text, file, tree, device, edit_list, log):
    for e in edit_list:
        if e.file != file or (e.trees and tree not in e.trees) or e.device not in ("any", device):
            continue
        found = text.count(e.old)
        if found != e.count:
            raise DriverError(f"{tree}/{file}: expected {e.count} occurrence(s) of {e.old!r}, found {found} "
                              "(the peer file changed: review tests/peers/changes.py)")
        text = text.replace(e.old, e.new)
        log.append({"file": f"{tree}/{file}", "what": e.what(), "why": e.why, "device": e.device})
    return text


def write_tree(root, sources, files, tree, device, edit_list, skips, log):
    """Copy `files` (tree-relative paths, read from `sources`) to `root`, edited, plus the plugin."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for rel in files:
        src = sources / rel
        if not src.exists():
            raise DriverError(f"{src} is missing from the peer's sources")
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(apply_edits(src.read_text(), rel, tree, device, edit_list, log))
    shutil.copy(Path(__file__).with_name("plugin.py"), root / "conftest.py")
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    run = {"skips": [{"file": s.file, "test": s.test, "reason": s.reason, "params": s.params,
                      "raised_in": list(s.raised_in)}
                     for s in skips if s.device in ("any", device)],
           "results": str(root / "peers_results.json"),
           # the interpreter shortcuts of fce's own CPU tests (the same execution): the interpreter's re-patching
           # at every helper call took a sixth of the CPU run (CCE's backward file 86 -> 70 s)
           "interpreter_shortcuts": str(REPO / "tests" / "triton_interpreter.py") if device == "cpu" else None}
    (root / "peers_run.json").write_text(json.dumps(run, indent=1))


def prepare(cache, device, cce_main=None, apply_skips=True):
    """The run trees. Returns (list of (PeerFile, tree root, extra PYTHONPATH entries), change log, sources)."""
    src = fetch_sdists(cache)
    run_root = cache / "run" / device
    log = []
    trees = {"liger": (src["liger"], (changes.LIGER_FLCE, changes.LIGER_CPO, *changes.LIGER_SUPPORT),
                       [src["liger"] / "src"]),
             f"cce-{CCE_VERSION}": (src["cce"] / "tests", (changes.CCE_FWD, changes.CCE_BWD), [src["cce"]])}
    files = list(changes.PEER_FILES)
    sources = {"liger-kernel": f"{LIGER_VERSION} (PyPI sdist)", "cut-cross-entropy": f"{CCE_VERSION} (PyPI sdist)"}
    cce_main_tree = None
    if cce_main is not None:
        tests_dir, package, source = cce_main
        cce_main_tree = "cce-main"
        if package is None:
            raise DriverError(f"no cut_cross_entropy package beside {tests_dir}: the tests import its helpers "
                              "(compute_z_loss, softcapping)")
        trees[cce_main_tree] = (tests_dir, (changes.CCE_FWD, changes.CCE_BWD), [package])
        files += changes.cce_main_files(cce_main_tree)
        sources["cut-cross-entropy (main)"] = source
    edit_list = changes.edits(cce_main_tree)
    for tree, (sources_dir, rels, _) in trees.items():
        write_tree(run_root / tree, sources_dir, rels, tree, device, edit_list, changes.SKIPS if apply_skips else (),
                   log)
    plan = [(pf, run_root / pf.tree, [run_root / pf.tree, *trees[pf.tree][2]]) for pf in files]
    return plan, log, sources


# ---------------------------------------------------------------------------------------------- running

def run_file(pf, root, paths, device, pytest_args, timeout):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in paths] + [str(REPO)] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONHASHSEED", "0")
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    results = root / f"peers_results.{Path(pf.path).stem}.json"
    results.unlink(missing_ok=True)
    env["PEERS_RESULTS"] = str(results)
    cmd = [sys.executable, "-m", "pytest", pf.path, "-c", "pytest.ini", "--rootdir", ".", "-q", "--tb=line",
           "-W", "ignore::RuntimeWarning", *pytest_args]
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output, rc = f"timed out after {timeout} s\n{exc.stdout or ''}", -1
    seconds = time.time() - start
    data = json.loads(results.read_text()) if results.exists() else {"tests": {}, "collection_errors": []}
    return summarize(pf, data, rc, seconds, output)


def summarize(pf, data, rc, seconds, output):
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    reasons, failures = {}, []
    for nodeid, entry in data["tests"].items():
        outcome = entry.get("outcome") or "error"
        counts[outcome] += 1
        if outcome == "skipped":
            reasons[entry["reason"]] = reasons.get(entry["reason"], 0) + 1
        elif outcome in ("failed", "error"):
            failures.append({"test": nodeid, "outcome": outcome, "message": entry.get("message", "")})
    for err in data["collection_errors"]:
        counts["error"] += 1
        failures.append({"test": err["nodeid"], "outcome": "collection error", "message": err["message"]})
    if not data["tests"] and not data["collection_errors"]:
        counts["error"] += 1
        failures.append({"test": pf.path, "outcome": "no results",
                         "message": f"pytest exit {rc}: {output.strip()[-3000:]}"})
    return {"file": pf.label, "path": pf.path, "collected": len(data["tests"]), **counts,
            "skip_reasons": reasons, "failures": failures, "pytest_exit": rc, "seconds": round(seconds, 1)}


def versions():
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 (only reported)
            out[mod] = f"unavailable: {exc}"
    try:
        git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True,  # noqa: E731
                                        text=True).stdout.strip()
        dirty = git("status", "--porcelain", "--untracked-files=no")
        out["fce_commit"] = git("rev-parse", "HEAD") + (" plus uncommitted changes" if dirty else "")
    except OSError:
        out["fce_commit"] = None
    return out


def default_device():
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        return "cpu"


def print_table(rows):
    width = max(len(r["file"]) for r in rows)
    print(f"{'peer file':<{width}}  collected  passed  failed  skipped  errors  seconds")
    for r in rows:
        print(f"{r['file']:<{width}}  {r['collected']:>9}  {r['passed']:>6}  {r['failed']:>6}  {r['skipped']:>7}  "
              f"{r['error']:>6}  {r['seconds']:>7}")
    for r in rows:
        for reason, n in r["skip_reasons"].items():
            print(f"  {r['file']}: {n} skipped: {reason}")
        for f in r["failures"][:20]:
            print(f"  {r['file']}: {f['outcome']} {f['test']}: {f['message'][:300]}")
        if len(r["failures"]) > 20:
            print(f"  {r['file']}: ... and {len(r['failures']) - 20} more")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tests.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="cpu: small shapes in the Triton interpreter; cuda: the peers' shapes (default: cuda if "
                        "torch sees a GPU)")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="the sdist cache and run trees (default .peers)")
    p.add_argument("--offline", action="store_true", help="never download: use the cache only")
    p.add_argument("--fetch-only", action="store_true",
                   help="fetch the sdists (and with --cce-tests main, CCE main's tests) into the cache and stop")
    p.add_argument("--cce-tests", default=None, metavar="DIR|main",
                   help="also run CCE's test_cce_loss_{forward,backward}.py from DIR (their helpers come from the "
                        "cut_cross_entropy package in DIR or its parent); 'main': CCE's GitHub main from the mirror")
    p.add_argument("--cce-mirror", type=Path, default=DEFAULT_MIRROR, help="git mirror of apple/ml-cross-entropy")
    p.add_argument("--only", default=None, help="comma-separated substrings: run only the peer files matching one")
    p.add_argument("--json", type=Path, default=None, help="summary path (default <cache>/results/<device>.json)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per peer file")
    p.add_argument("--no-skips", action="store_true",
                   help="run the tests the driver skips too (to check that a documented skip is still needed)")
    p.add_argument("--jobs", type=int, default=1, help="peer files run at once (default 1)")
    p.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments (e.g. -k amp)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = args.device or default_device()
    cache = args.cache.resolve()
    try:
        if args.offline:
            fetch_sdists(cache, offline=True)
        cce_main = resolve_cce_tests(args.cce_tests, cache, args.cce_mirror) if args.cce_tests else None
        if args.fetch_only:
            fetch_sdists(cache)
            print(f"cache ready: {cache}")
            return 0
        plan, log, sources = prepare(cache, device, cce_main, apply_skips=not args.no_skips)
    except (DriverError, subprocess.CalledProcessError) as exc:
        print(f"peers: {exc}", file=sys.stderr)
        return 2
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        plan = [item for item in plan if any(k in item[0].label for k in keys)]
    start = time.time()
    if args.jobs > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(lambda it: run_file(*it, device, args.pytest_args, args.timeout), plan))
    else:
        rows = [run_file(*item, device, args.pytest_args, args.timeout) for item in plan]
    undocumented = sorted({reason for r in rows for reason in r["skip_reasons"]} - changes.DOCUMENTED_REASONS)
    ok = all(r["failed"] == 0 and r["error"] == 0 for r in rows) and not undocumented
    summary = {"device": device, "ok": ok, "seconds": round(time.time() - start, 1), "versions": versions(),
               "peers": sources, "files": rows, "changes": log,
               "skips": [{"file": s.file, "test": s.test, "params": s.params, "reason": s.reason, "device": s.device,
                          "only_if_raised_in": list(s.raised_in)} for s in changes.SKIPS],
               "documented_skip_reasons": sorted(changes.DOCUMENTED_REASONS),
               "undocumented_skip_reasons": undocumented,
               "cpu_shapes": device == "cpu"}
    out = args.json or cache / "results" / f"{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print_table(rows)
    verdict = "all passed or skipped with a documented reason" if ok else "FAILURES"
    if undocumented:
        verdict += f" (skipped for undocumented reasons: {undocumented})"
    print(f"peers on {device}: {verdict} ({summary['seconds']} s); summary: {out}")
    return 0 if ok else 1

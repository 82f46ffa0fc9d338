"""The driver's pytest plugin, copied as ``conftest.py`` into the root of each prepared peer tree.

It reads ``peers_run.json`` beside itself (written by the driver): the skips to apply (`changes.Skip`, matched
on the test file's name, the test function and its parameters compared as ``str()``; a skip with ``raised_in``
only turns that very failure, raised inside the peer's named reference function, into the skip) and the
default path of the results file (``$PEERS_RESULTS`` overrides it: one per peer file). Into that file it
writes every test's outcome (passed / failed / skipped / error, with the skip reason or the failure's first
line) and the collection errors when the session ends. On a CPU run it installs fce's Triton interpreter
shortcuts (``interpreter_shortcuts``: tests/triton_interpreter.py, the same execution) before any test runs.
"""
import json
import os

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_HERE, "peers_run.json")) as _f:
    _RUN = json.load(_f)


def _interpreter_shortcuts(path):
    """tests/triton_interpreter.py's shortcuts (as fce's conftest.py installs them): the same execution."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fce_triton_interpreter", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()


if _RUN.get("interpreter_shortcuts") and os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_shortcuts(_RUN["interpreter_shortcuts"])

_results = {}
_collection_errors = []


def _matches(item, skip):
    if os.path.basename(str(item.path)) != os.path.basename(skip["file"]):
        return False
    if getattr(item, "originalname", item.name) != skip["test"]:
        return False
    params = getattr(getattr(item, "callspec", None), "params", {})
    return all(k in params and str(params[k]) == v for k, v in skip["params"].items())


def pytest_collection_modifyitems(config, items):
    for item in items:
        for skip in _RUN["skips"]:
            if not skip.get("raised_in") and _matches(item, skip):
                item.add_marker(pytest.mark.skip(reason=skip["reason"]))
                break


def _raised_in(excinfo, qualname, message):
    """Whether the exception's message contains `message` and its traceback passes through `qualname`."""
    if message not in str(excinfo.value):
        return False
    return any(getattr(entry.frame.code.raw, "co_qualname", entry.frame.code.name) == qualname
               for entry in excinfo.traceback)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A conditional skip (`raised_in`): that failure, inside the peer's own reference, becomes the skip."""
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.failed or call.excinfo is None:
        return
    for skip in _RUN["skips"]:
        if skip.get("raised_in") and _matches(item, skip) and _raised_in(call.excinfo, *skip["raised_in"]):
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {skip['reason']}")
            return


def _message(report):
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return crash.message[:2000]
    text = getattr(report, "longreprtext", "") or str(report.longrepr)
    return text.strip().splitlines()[-1][:2000] if text.strip() else ""


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": None})
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        entry.update(outcome="skipped", reason=reason.removeprefix("Skipped: "))
    elif report.failed:
        entry.update(outcome="failed" if report.when == "call" else "error", message=_message(report),
                     phase=report.when)
    elif report.when == "call" and entry["outcome"] is None:
        entry["outcome"] = "passed"


def pytest_collectreport(report):
    if report.failed:
        _collection_errors.append({"nodeid": report.nodeid, "message": _message(report)})


def pytest_sessionfinish(session, exitstatus):
    with open(os.environ.get("PEERS_RESULTS") or _RUN["results"], "w") as f:
        json.dump({"tests": _results, "collection_errors": _collection_errors, "exitstatus": int(exitstatus)},
                  f, indent=1)

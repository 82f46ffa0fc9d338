"""Rendering the parity results: a progress bar (stderr), the terminal table (stdout), JSON and Markdown.

Everything here reads the dict returned by :func:`parity.runner.run_suite`; nothing here computes numbers.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Any

__all__ = ["Progress", "describe", "format_table", "format_summary", "to_markdown", "write_json",
           "write_markdown", "write_reports", "jsonable"]

_SHORT = {"ok": "", "missing": "miss", "n/a": "n/a", "error": "ERR"}


# ================================================================================================ progress
class Progress:
    """A plain-text progress bar on stderr: redrawn in place on a terminal, one line per step otherwise."""

    def __init__(self, stream: IO[str] | None = None, width: int = 28, enabled: bool = True):
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.enabled = enabled
        self.total = 0
        self.count = 0
        self.t0 = time.perf_counter()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_len = 0

    def start(self, total: int) -> None:
        self.total, self.count, self.t0 = max(1, total), 0, time.perf_counter()

    def _line(self, label: str) -> str:
        frac = min(1.0, self.count / self.total)
        filled = int(round(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        return f"[{bar}] {min(self.count, self.total):>3}/{self.total} {time.perf_counter() - self.t0:6.1f}s {label}"

    def step(self, label: str) -> None:
        """Announce the step that starts now (the bar shows the steps already done)."""
        if not self.enabled:
            return
        line = self._line(label)
        if self.tty:
            pad = max(0, self._last_len - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._last_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.count += 1

    def done(self) -> None:
        if not self.enabled:
            return
        self.count = self.total
        line = self._line("done")
        self.stream.write(("\r" + line + " " * max(0, self._last_len - len(line)) if self.tty else line) + "\n")
        self.stream.flush()


# ================================================================================================ cells
def _err(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else "nan"
    return f"{x:.1e}"


def _err_cell(entry: dict, rec: dict, impl: str) -> str:
    info = entry["impls"].get(impl)
    if info is None:
        return "-"
    if info["status"] != "ok":
        return _SHORT.get(info["status"], info["status"])
    return _err(rec["err"].get(impl))


def _pair_cell(p: dict | None, *, with_ulp: bool = True) -> str:
    if p is None:
        return "-"
    if p["bitwise"]:
        return "yes"
    if p.get("max_ulp") is None:
        return "no (" + (p.get("note") or "?") + ")"
    return f"no {p['max_ulp']}ulp/{p['n_diff']}" if with_ulp else "no"


def _det_cell(entry: dict, rec: dict) -> str:
    parts = []
    for impl in ("torch", "jax", "liger"):
        if impl not in entry["impls"]:
            continue
        d = rec["deterministic"].get(impl)
        parts.append("-" if d is None else ("y" if d else "N"))
    return "/".join(parts)


def _verdict_cell(rec: dict) -> str:
    """The twins' verdict on one output: a twin that failed, raised or is missing makes it FAIL."""
    fails = [impl for impl, v in rec["verdict"].items() if v == "FAIL"]
    if fails:
        return "FAIL " + ",".join(fails)
    vs = set(rec["verdict"].values())
    for status in ("error", "missing"):
        if status in vs:
            return f"FAIL {status}"
    if vs <= {"ok", "n/a"} and "ok" in vs:
        return "ok"
    if "unchecked" in vs:
        return "unchecked (no reference)"
    return "/".join(sorted(vs))


def _flags(meta: dict, names) -> list[str]:
    """``name`` for a set boolean, ``name=value`` for any other set value, of the fields ``names``."""
    return [k if meta[k] is True else f"{k}={meta[k]}" for k in names if meta.get(k) not in (None, False, 0, 0.0)]


def describe(meta: dict) -> str:
    """One line for a case (its :func:`parity.catalog.case_meta`): kind, dtype, shape and the options set."""
    shape = "x".join(str(s) for s in meta["shape"])
    bits = [meta["kind"], meta["dtype"], f"({shape})xH{meta['h']}", f"V={meta['v']}"]
    if meta["kind"] == "flce":
        bits.append(meta["reduction"])
        bits += _flags(meta, ("bias", "bias_dtype", "class_weights", "negative_class_weights", "label_smoothing",
                              "z_loss", "softcap", "token_scaling", "normalizer"))
    elif meta["kind"] == "cpo":
        bits.append(meta["loss_type"])
        bits += _flags(meta, ("bias", "label_smoothing"))
        bits.append(f"beta={meta['beta']} alpha={meta['alpha']}")
    else:
        bits += _flags(meta, ("bias", "softcap")) + [f"temperature={meta['temperature']}"]
    if meta.get("logit_scale", 1.0) != 1.0:
        bits.append(f"logit_scale={meta['logit_scale']}")
    return " ".join(bits)


# ================================================================================================ tables
_TERM_COLS = ("case", "out", "torch=jax", "err torch", "err jax", "err liger", "bound", "determ t/j/l", "verdict")
_MD_COLS = ("case", "out", "torch=jax", "torch=liger", "jax=liger", "err torch", "err jax", "err liger",
            "bound", "determ t/j/l", "verdict")


def _rows(results: dict, *, markdown: bool) -> list[tuple[str, ...]]:
    rows = []
    for entry in results["cases"]:
        first = True
        if not entry["outputs"]:
            rows.append((entry["case"], "-", *(["-"] * ((len(_MD_COLS) if markdown else len(_TERM_COLS)) - 3)),
                         "FAIL" if entry["violations"] else "-"))
            continue
        for out, rec in entry["outputs"].items():
            name = (f"`{entry['case']}`" if markdown else entry["case"]) if first else ""
            first = False
            pairs = rec["pairs"]
            cells = [name, out, _pair_cell(pairs.get("torch~jax"))]
            if markdown:
                cells += [_pair_cell(pairs.get("torch~liger")), _pair_cell(pairs.get("jax~liger"))]
            cells += [_err_cell(entry, rec, "torch"), _err_cell(entry, rec, "jax"), _err_cell(entry, rec, "liger"),
                      f"{rec['bound']:.0e}", _det_cell(entry, rec), _verdict_cell(rec)]
            rows.append(tuple(cells))
        if entry["violations"] and not any(r["verdict"] and "FAIL" in r["verdict"].values()
                                           for r in entry["outputs"].values()):
            n = len(_MD_COLS) if markdown else len(_TERM_COLS)
            rows.append(("", "(case)", *(["-"] * (n - 3)), "FAIL"))
    return rows


def _align(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]


def format_table(results: dict) -> str:
    """The terminal table: one row per (case, output)."""
    return "\n".join(_align(_TERM_COLS, _rows(results, markdown=False)))


def format_summary(results: dict, files: list[str] | None = None) -> str:
    s = results["summary"]
    lines = []
    status = ", ".join(f"{impl}: " + " ".join(f"{n} {k}" for k, n in sorted(c.items()))
                       for impl, c in s["impl_status"].items())
    lines.append(f"{s['cases']} case(s) in {s.get('seconds', 0):.1f}s on {results['environment']['device']}"
                 f" | {status}")
    b = s["torch_jax_outputs"]
    lines.append(f"torch vs jax bitwise: {b['equal']} output(s) equal, {b['different']} different, "
                 f"{b['n/a']} not compared")
    for impl, where in s.get("nondeterministic", {}).items():
        lines.append(f"run-to-run NOT bitwise deterministic: {impl} in {len(where)} case(s): "
                     + "; ".join(where[:6]) + (" ..." if len(where) > 6 else ""))
    for impl, why in s.get("missing", {}).items():
        for kind, w in why.items():
            lines.append(f"{'BROKEN' if w.startswith('ERROR') else 'missing'}: {impl} {kind}: {w}")
    if s.get("pending"):
        lines.append(f"UNFINISHED: {s['cases']} of {s['cases'] + len(s['pending'])} case(s) ran when this report was "
                     f"written; not run: {', '.join(s['pending'])}")
    if s["nothing_ran"]:
        lines.append("NOTHING RAN: no implementation produced a result (see the errors above).")
    if s["violations"]:
        lines.append(f"SPEC VIOLATIONS ({len(s['violations'])}):")
        lines += [f"  - {v}" for v in s["violations"]]
    else:
        lines.append("SPEC accuracy: no violation.")
    for f in files or []:
        lines.append(f"wrote {f}")
    lines.append(f"exit code {results['exit_code']}")
    return "\n".join(lines)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def to_markdown(results: dict) -> str:
    env = results["environment"]
    s = results["summary"]
    names = {"torch": "fce_torch", "jax": "fce_jax", "liger": "Liger"}
    present = [n for k, n in names.items() if any(k in e["impls"] for e in results["cases"])] or list(names.values())
    out = [f"# Parity report: {' vs '.join(present)} vs float64", ""]
    out.append("| | |\n|---|---|")
    for k, v in env.items():
        cell = ", ".join(f"{a}={b}" for a, b in v.items()) if isinstance(v, dict) else str(v)
        out.append(f"| {k} | {_md_escape(cell)} |")
    out += ["", "Terms (SPEC §6): `torch=jax` is *yes* when every bit is equal, else *no* with the max ULP distance "
            "(in the output dtype) / the number of differing elements; `err` is the relative norm error "
            "‖a − ref‖/‖ref‖ against the float64 evaluation; `determ` is run-to-run bitwise determinism "
            "(each implementation twice: y / N); `bound` is the SPEC accuracy bound of the twins "
            "(bf16/fp16 gradients: also ≤ 1.25× Liger's error; entropy: 1e-4). miss = missing or "
            "NotImplementedError (a failure for a twin), n/a = Liger lacks the op or option, ERR = raised.", ""]
    out.append("## Results")
    out.append("")
    header = _MD_COLS
    rows = [tuple(_md_escape(c) for c in r) for r in _rows(results, markdown=True)]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    out += ["| " + " | ".join(r) + " |" for r in rows]
    out += ["", "## Summary", "", "```", format_summary(results), "```", ""]
    out += ["## Cases", ""]
    for e in results["cases"]:
        out.append(f"- `{e['case']}`: {_md_escape(describe(e['meta']))}; reference: "
                   f"{e['reference'].get('impl') or e['reference']['status']}")
        for impl, info in e["impls"].items():
            if info["status"] != "ok":
                out.append(f"  - {impl}: {info['status']} ({_md_escape(info['reason'])[:300]})")
            for note in info.get("notes") or []:
                if info["status"] == "ok":
                    out.append(f"  - {impl}: {_md_escape(note)}")
    explained = [e for e in results["cases"] if e.get("explain")]
    if explained:
        from .explain import format_explain
        out += ["", "## Where the twins part (--explain)", ""]
        for e in explained:
            out += [f"### `{e['case']}`", "", "```", format_explain(e["explain"]), "```", ""]
    return "\n".join(out) + "\n"


# ================================================================================================ files
def jsonable(obj: Any) -> Any:
    """Strict-JSON version of ``obj``: non-finite floats become the strings "inf" / "-inf" / "nan"."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return str(obj)


def write_json(results: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(results), indent=1, allow_nan=False) + "\n")
    return path


def write_markdown(results: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_markdown(results))
    return path


def write_reports(results: dict, out_dir: str | Path) -> list[str]:
    """``parity.json`` and ``parity.md`` under ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    return [str(write_json(results, out_dir / "parity.json")), str(write_markdown(results, out_dir / "parity.md"))]

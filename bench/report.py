"""Writes one benchmark's result as ``<bench>.json``, ``<bench>.md`` and PNG plots, and renders the terminal table.

A result is a plain dict: ``bench``, ``title``, ``meta`` (device, versions, settings, date), ``notes``
(implementation -> why it did not run) and ``rows`` (one dict per cell; missing values are ``None``), and
optionally ``sections``: ``{"title", "markdown"}`` blocks that the Markdown report appends after its table
(e.g. ``sft --profile``). The benchmark modules say which row keys to show (``Column``) and what to plot
(``Plot``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: Callable[[Any], str] = str


@dataclasses.dataclass(frozen=True)
class Plot:
    """One PNG: ``y`` against ``x``, one series per implementation, one panel per value of ``panel`` keys.

    ``kind="line"`` for a numeric ``x`` (log2 axis), ``"bar"`` for a categorical one; ``where`` filters rows.
    """

    name: str
    x: str
    y: str
    ylabel: str
    title: str
    panel: tuple[str, ...] = ()
    where: tuple[tuple[str, Any], ...] = ()
    kind: str = "line"
    logy: bool = True


def ms(v: float) -> str:
    return f"{v:.2f}"


def ratio(v: float) -> str:
    return f"{v:.2f}x"


def gib(v: float) -> str:
    return f"{v:.2f}"


def rel(v: float) -> str:
    return f"{v:.1e}"


def count(v: float) -> str:
    return f"{v:,.0f}"


def _cell(row: dict, col: Column, width: int = 0) -> str:
    """A row's value as text ("n/a" when missing), clipped to ``width`` characters if given."""
    v = row.get(col.key)
    text = "n/a" if v is None else col.fmt(v)
    return text[: width - 3] + "..." if width and len(text) > width else text


def table(result: dict, columns: list[Column]) -> str:
    """The aligned plain-text table printed on stdout at the end of a run."""
    head = [c.header for c in columns]
    body = [[_cell(r, c, width=60) for c in columns] for r in result["rows"]]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = [result["title"], "  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in body]
    lines += [f"skipped {name}: {why}" for name, why in result["notes"].items()]
    return "\n".join(lines)


def _markdown(result: dict, columns: list[Column], pngs: list[Path]) -> str:
    out = [f"# {result['title']}", ""]
    out += [f"- {k}: {json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in result["meta"].items()]
    out += ["", "| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(_cell(r, c).replace("|", "\\|") for c in columns) + " |" for r in result["rows"]]
    for section in result.get("sections", []):
        out += ["", f"## {section['title']}", "", section["markdown"]]
    if result["notes"]:
        out += ["", "## Not run", ""] + [f"- `{name}`: {why}" for name, why in result["notes"].items()]
    if pngs:
        out += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pngs]
    return "\n".join(out) + "\n"


def _plot(rows: list[dict], spec: Plot, path: Path) -> bool:
    """Draw ``spec`` from ``rows`` into ``path``; False when no row has a value to draw."""
    rows = [r for r in rows if r.get(spec.y) is not None and all(r.get(k) == v for k, v in spec.where)]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(tuple(r[k] for k in spec.panel) for r in rows))  # in the order run
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4.0), squeeze=False)
    series = list(dict.fromkeys(r["impl"] for r in rows))
    for ax, key in zip(axes[0], panels):
        sub = [r for r in rows if tuple(r[k] for k in spec.panel) == key]
        if spec.kind == "bar":
            ax.bar([str(r[spec.x]) for r in sub], [r[spec.y] for r in sub])
            ax.tick_params(axis="x", labelrotation=30)
        else:
            for name in series:
                pts = sorted((r[spec.x], r[spec.y]) for r in sub if r["impl"] == name)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel(spec.x)
        if spec.logy:
            ax.set_yscale("log")
        ax.set_ylabel(spec.ylabel)
        ax.set_title(", ".join(f"{k}={v}" for k, v in zip(spec.panel, key)), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    if spec.kind != "bar":
        axes[0][-1].legend(fontsize=7)
    fig.suptitle(spec.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(result: dict, columns: list[Column], plots: list[Plot], out: Path) -> list[Path]:
    """Write the PNGs, ``<bench>.json`` and ``<bench>.md`` into ``out``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    pngs = []
    try:
        for spec in plots:
            if _plot(result["rows"], spec, out / f"{spec.name}.png"):
                pngs.append(out / f"{spec.name}.png")
    except ImportError as exc:  # matplotlib missing: JSON and Markdown still written
        result["notes"]["plots"] = f"not drawn ({exc})"
    js, md = out / f"{result['bench']}.json", out / f"{result['bench']}.md"
    js.write_text(json.dumps(result, indent=1, default=str) + "\n")
    md.write_text(_markdown(result, columns, pngs))
    return [js, md] + pngs

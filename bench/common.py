"""What every benchmark shares: the run settings, the 'cannot run here' signal, progress lines, versions."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import math
import sys
import time
from pathlib import Path

from parity.environment import fce_source

RESULTS = Path(__file__).resolve().parent / "results"


class Unavailable(Exception):
    """An implementation that cannot run here (package missing, needs a GPU); the message is the note."""


def guarded_import(module: str, name: str):
    """``module.name``, or ``Unavailable`` saying why not: the module is missing or broken, or lacks the name."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # not installed, or broken: skip with the reason
        raise Unavailable(f"{module} not importable ({type(exc).__name__}: {exc})") from None
    if not hasattr(mod, name):
        raise Unavailable(f"{module} has no {name}")
    return getattr(mod, name)


@dataclasses.dataclass
class Settings:
    """One invocation of ``python -m bench``."""

    device: str  # "cuda" or "cpu" (torch device; JAX uses its default backend)
    smoke: bool
    reps: int  # timed repetitions per cell (median reported)
    warmup: int  # untimed calls before timing (compilation, autotuning)
    impls: frozenset[str] | None  # --impl filter; None = all
    out: Path

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    def wanted(self, name: str) -> bool:
        return self.impls is None or name in self.impls


class Progress:
    """One line per finished cell on stderr, stamped with the seconds since the start."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def versions() -> dict[str, str]:
    """Installed versions of the packages that decide the numbers (absent ones left out)."""
    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "triton", "jax", "jaxlib", "liger-kernel", "cut-cross-entropy", "tokamax",
                 "transformers", "fce"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**30


def rel_diff(a: float | None, ref: float | None) -> float | None:
    """|a - ref| / |ref|, or None when either is missing or not finite."""
    if a is None or ref is None or not (math.isfinite(a) and math.isfinite(ref)) or ref == 0:
        return None
    return abs(a - ref) / abs(ref)


def short_error(exc: BaseException) -> str:
    """A one-line note for a cell that failed (OOM, compile error, ...)."""
    msg = str(exc).strip().splitlines()
    return f"error: {type(exc).__name__}: {msg[0][:200] if msg else ''}"


def available(registry: dict, settings: Settings, notes: dict[str, str], **kwargs) -> dict:
    """Build every implementation of ``registry`` that ``--impl`` selects; record why the others cannot run."""
    out = {}
    for name, build in registry.items():
        if not settings.wanted(name):
            continue
        try:
            out[name] = build(settings, **kwargs)
        except Unavailable as exc:
            notes[name] = str(exc)
    return out


def device_name(device: str) -> str:
    """The GPU's name ("NVIDIA H200") for "cuda", else "cpu"."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    return "cpu"


def meta(settings: Settings, **extra) -> dict:
    """The header of every result: where, when, with what, and how it was measured."""
    return {
        "device": device_name(settings.device),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "smoke": settings.smoke,
        "reps": settings.reps,
        "warmup": settings.warmup,
        **extra,
        "versions": versions(),
        "fce_source": fce_source(),
    }


def run_cell(rows: list[dict], progress: Progress, label: str, measure, **row) -> None:
    """Run ``measure()`` (a ``timing.Measurement``) into a new row of ``rows``: ``ms``, ``extra_gib``, ``loss``;
    an exception (OOM, compile error, ...) becomes the row's ``note`` and the run goes on."""
    row.update(ms=None, extra_gib=None, loss=None, note="")
    try:
        m = measure()
        row.update(ms=m.ms, extra_gib=gib(m.extra_bytes), loss=m.value)
        done = f"{m.ms:9.3f} ms" + ("" if m.extra_bytes is None else f"  +{gib(m.extra_bytes):.2f} GiB")
    except Exception as exc:
        row["note"] = done = short_error(exc)
    rows.append(row)
    progress.log(f"{label}  {done}")


def implementations(registry: str, settings: Settings, progress: Progress, **kwargs):
    """(torch implementations, the impls_jax module or None, JAX implementations, notes) of a registry name
    (``FLCE``, ``CPO``, ``LOGPROBS`` of bench/impls_torch.py and bench/impls_jax.py); what cannot run is in
    the notes, logged."""
    from bench import impls_torch

    notes: dict[str, str] = {}
    torch_impls = available(getattr(impls_torch, registry), settings, notes, **kwargs)
    try:
        from bench import impls_jax
    except Exception as exc:
        impls_jax, jax_impls = None, {}
        notes["jax"] = short_error(exc)
    else:
        jax_impls = available(getattr(impls_jax, registry), settings, notes, **kwargs)
    for name, why in notes.items():
        progress.log(f"{registry.lower()}: skipping {name}: {why}")
    return torch_impls, impls_jax, jax_impls, notes


def fce_logprobs(module: str, engine: str = "auto"):
    """A builder of ``rows(x, w, t) -> (logp, entropy)`` by ``module.fused_token_logprobs`` on `engine`."""
    def build(settings: Settings):
        fused_token_logprobs = guarded_import(module, "fused_token_logprobs")
        return lambda x, w, t: fused_token_logprobs(x, w, t, return_entropy=True, engine=engine)

    return build


def fce_none_rows(module: str):
    """A builder of ``rows(x, w, t) -> (-logp, None)`` by ``module.fused_lce(reduction="none")``."""
    def build(settings: Settings):
        fused_lce = guarded_import(module, "fused_lce")
        return lambda x, w, t: (fused_lce(x, w, t, reduction="none"), None)

    return build

"""The machine a parity run ran on (the report header), and the float32 matmul precision the suite sets.

SPEC §1: the twins run float32 GEMMs as the framework is set (IEEE by default, TF32 when the user enables it),
and the float32 accuracy bound is for IEEE runs. So the suite does not rely on the defaults: around each
float32 case it sets IEEE float32 explicitly in both frameworks (:data:`FLOAT32_IEEE`) and restores what it
found afterwards; the 16-bit cases run under whatever the process had. The report says both.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

__all__ = ["FLOAT32_IEEE", "float32_settings", "precision_for", "environment", "device_slug", "fce_source"]

#: What the suite sets for a float32 case (names as the user would write them).
FLOAT32_IEEE = {"torch.backends.cuda.matmul.allow_tf32": False, "torch.backends.cudnn.allow_tf32": False,
                "jax_default_matmul_precision": "highest"}


def _jax_config():
    try:
        import jax
    except ImportError:
        return None
    return jax.config


def float32_settings() -> dict:
    """The settings that decide float32 matmul precision, as they are now (torch's matmul one as
    ``torch.get_float32_matmul_precision()``, which ``allow_tf32`` maps onto; "missing" without JAX)."""
    cfg = _jax_config()
    return {"torch.float32_matmul_precision": torch.get_float32_matmul_precision(),
            "torch.backends.cuda.matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "torch.backends.cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "jax_default_matmul_precision": cfg.jax_default_matmul_precision if cfg is not None else "missing"}


@contextlib.contextmanager
def _float32_ieee():
    before = float32_settings()
    cfg = _jax_config()
    torch.backends.cuda.matmul.allow_tf32 = FLOAT32_IEEE["torch.backends.cuda.matmul.allow_tf32"]
    torch.backends.cudnn.allow_tf32 = FLOAT32_IEEE["torch.backends.cudnn.allow_tf32"]
    if cfg is not None:
        cfg.update("jax_default_matmul_precision", FLOAT32_IEEE["jax_default_matmul_precision"])
    try:
        yield
    finally:
        # the precision string, not allow_tf32, restores "medium" as well as "high"
        torch.set_float32_matmul_precision(before["torch.float32_matmul_precision"])
        torch.backends.cudnn.allow_tf32 = before["torch.backends.cudnn.allow_tf32"]
        if cfg is not None:
            cfg.update("jax_default_matmul_precision", before["jax_default_matmul_precision"])


def precision_for(case):
    """A context manager: IEEE float32 (:data:`FLOAT32_IEEE`) for a float32 case, nothing for the others."""
    return _float32_ieee() if case.dtype == "float32" else contextlib.nullcontext()


def device_slug(device: str) -> str:
    """"cpu", or the GPU's name in lower case with dashes (e.g. "nvidia-h200")."""
    if device == "cpu":
        return "cpu"
    try:
        name = torch.cuda.get_device_name(torch.device(device))
    except Exception:
        name = device
    slug = "".join(ch if ch.isalnum() else "-" for ch in name.lower())
    while "--" in slug:
        slug = slug.replace("--", "-")
    return slug.strip("-") or "gpu"


def _versions() -> dict:
    from importlib.metadata import version

    out = {}
    for mod in ("jax", "jaxlib", "triton", "liger_kernel", "numpy"):
        try:
            out[mod] = version(mod.replace("_", "-"))
        except Exception:  # no distribution metadata: a package on PYTHONPATH, or not there at all
            try:
                out[mod] = getattr(importlib.import_module(mod), "__version__", "importable, version unknown")
            except Exception:
                out[mod] = "missing"
    return out


def source_digest(folder: Path) -> str:
    """16 hex digits of SHA-256 over the Python files under `folder` (their relative paths and contents)."""
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*.py")):
        h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def fce_source() -> dict:
    """Which fce a run imports: per package, its folder and `source_digest`. The two halves of an A/B run
    must differ here; a tree put on PYTHONPATH does not win under ``python -m``, whose first path is the
    working directory (an earlier A/B ran the same code twice that way)."""
    out = {}
    for pkg in ("fce_core", "fce_torch", "fce_jax"):
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            out[pkg] = "missing"
            continue
        folder = Path(next(iter(spec.submodule_search_locations))).resolve()
        out[pkg] = f"{folder} {source_digest(folder)}"
    return out


def environment(device: str) -> dict:
    """Versions, the machine, and the float32 precision policy (what is set for the float32 cases, and
    what the process had at the start of the run), for the report header."""
    env = {"device": device, "torch": torch.__version__, "python": sys.version.split()[0]}
    if device != "cpu":
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    env.update(_versions())
    try:
        import jax
        env["jax_devices"] = [str(d) for d in jax.devices()]
        env["jax_x64"] = bool(jax.config.jax_enable_x64)
    except Exception as e:  # noqa: BLE001
        env["jax_devices"] = f"unavailable: {type(e).__name__}"
    env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "")
    env["float32_policy"] = "IEEE float32 set around each float32 case, restored after; 16-bit cases as found"
    env["float32_set"] = dict(FLOAT32_IEEE)
    env["float32_found"] = float32_settings()
    env["fce_source"] = fce_source()
    return env

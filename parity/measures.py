"""The parity measures of SPEC §6, one implementation each: bitwise equality, ULP distance, relative error.

Each accepts torch tensors (on any device: the work stays there, in chunks of :data:`CHUNK` elements so
that the temporaries stay bounded at the real shapes), numpy arrays (``ml_dtypes.bfloat16`` included) and
anything numpy can read (JAX arrays, lists, scalars).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .cases import DTYPES

__all__ = ["CHUNK", "INT_VIEW", "as_float64", "as_tensor", "bitwise_equal", "ulp_distance", "rel_err", "compare_pair",
           "dtype_name"]

#: Elements per chunk of the device-side measures.
CHUNK = 1 << 24

_F64 = torch.float64
#: The integer dtype of each float width: the view under which bits are compared.
INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dt) -> str:
    """"float32", "bfloat16", ... for a torch dtype."""
    return str(dt).removeprefix("torch.")


def as_float64(a) -> np.ndarray:
    """Return ``a`` (torch tensor, numpy array, JAX array, scalar) as a new float64 numpy array."""
    if isinstance(a, torch.Tensor):
        return np.array(a.detach().to("cpu", _F64).numpy(), dtype=np.float64, copy=True)
    return np.array(a, dtype=np.float64, copy=True)


def as_tensor(a) -> torch.Tensor:
    """``a`` as a torch tensor: a torch tensor as it is (detached), anything else as exact values on the CPU
    (float64, except ml_dtypes/integer arrays of at most 16 bits, which float32 holds exactly)."""
    if isinstance(a, torch.Tensor):
        return a.detach()
    arr = np.asarray(a)
    if arr.dtype.kind == "f" and arr.dtype.name in ("float16", "float32", "float64"):
        return torch.from_numpy(np.array(arr))   # a copy: numpy views of JAX arrays are read-only
    # ml_dtypes (bfloat16, ...) and integers: exact through float32 (<= 16 bits) or float64
    return torch.from_numpy(arr.astype(np.float32 if arr.dtype.itemsize <= 2 else np.float64))


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every bit equal (same shape and dtype required; -0 != +0; NaNs equal only with the same payload)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    if a.is_floating_point():
        iv = INT_VIEW[a.element_size()]
        return bool(torch.equal(_flat(a).view(iv), _flat(b).view(iv)))
    return bool(torch.equal(a, b))


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns of float tensor ``t`` as positions on a monotonic integer line (int64); +0 and -0 -> 0."""
    nbits = 8 * t.element_size()
    bits = t.view(INT_VIEW[t.element_size()]).to(torch.int64) & ((1 << nbits) - 1)   # unsigned pattern
    mag = bits & ((1 << (nbits - 1)) - 1)
    return torch.where((bits >> (nbits - 1)) == 1, -mag, mag)


def ulp_distance(a, b, dtype: str | None = None) -> tuple[int, int]:
    """``(max_ulp, n_diff)``: the largest per-element distance in units in the last place and the number of
    elements at a distance > 0.

    With ``dtype`` ("float32" | "bfloat16" | "float16") both are cast to it first (exact if they already are);
    without, both must be tensors of one float dtype, which is then the unit. +0 and -0 are equal; NaN vs
    NaN counts as equal; NaN vs a number counts as ``2**bits - 1`` (above any finite pair).
    """
    ta, tb = as_tensor(a), as_tensor(b)
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {tuple(DTYPES)}, got {dtype!r}")
        ta, tb = ta.to(DTYPES[dtype]), tb.to(DTYPES[dtype])
    elif ta.dtype != tb.dtype or not ta.is_floating_point():
        raise ValueError(f"ulp_distance: need one float dtype, got {ta.dtype} and {tb.dtype}")
    if ta.shape != tb.shape:
        raise ValueError(f"ulp_distance: shapes differ: {tuple(ta.shape)} vs {tuple(tb.shape)}")
    tb = tb.to(ta.device)
    worst = (1 << (8 * ta.element_size())) - 1
    fa, fb = _flat(ta), _flat(tb)
    max_ulp, n_diff = 0, 0
    for s in range(0, fa.numel(), CHUNK):
        ca, cb = fa[s:s + CHUNK], fb[s:s + CHUNK]
        d = (_ordered(ca) - _ordered(cb)).abs()
        na, nb = torch.isnan(ca), torch.isnan(cb)
        d = torch.where(na & nb, torch.zeros_like(d), d)
        d = torch.where(na ^ nb, torch.full_like(d, worst), d)
        max_ulp = max(max_ulp, int(d.max()))
        n_diff += int((d > 0).sum())
    return max_ulp, n_diff


def rel_err(a, ref) -> float:
    """Relative norm error ``‖a − ref‖ / ‖ref‖`` in float64 (``‖a − ref‖`` when ``‖ref‖ == 0``).

    ``inf`` when the difference is not finite (a NaN or an inf in ``a`` or ``ref``). Computed on ``a``'s
    device when ``a`` is a tensor there.
    """
    ta, tr = as_tensor(a), as_tensor(ref)
    if ta.shape != tr.shape:
        raise ValueError(f"rel_err: shapes differ: {tuple(ta.shape)} vs {tuple(tr.shape)}")
    tr = tr.to(ta.device)
    fa, fr = _flat(ta), _flat(tr)
    num2 = torch.zeros((), dtype=_F64, device=ta.device)
    den2 = torch.zeros((), dtype=_F64, device=ta.device)
    for s in range(0, fa.numel(), CHUNK):
        ca, cr = fa[s:s + CHUNK].to(_F64), fr[s:s + CHUNK].to(_F64)
        num2 += torch.square(ca - cr).sum()
        den2 += torch.square(cr).sum()
    num, den = math.sqrt(float(num2)), math.sqrt(float(den2))
    if not math.isfinite(num):   # NaN propagates through the sum; an inf gives inf or NaN (inf - inf)
        return float("inf")
    return num / den if den > 0 else num


def compare_pair(a: torch.Tensor | None, b: torch.Tensor | None) -> dict | None:
    """Bitwise equality and ULP distance of two outputs (None when either is missing)."""
    if a is None or b is None:
        return None
    out = {"bitwise": bitwise_equal(a, b), "max_ulp": None, "n_diff": None, "numel": int(a.numel()),
           "note": ""}
    if a.shape != b.shape:
        out["note"] = f"shapes differ: {list(a.shape)} vs {list(b.shape)}"
    elif a.dtype != b.dtype:
        out["note"] = f"dtypes differ: {dtype_name(a.dtype)} vs {dtype_name(b.dtype)}"
    elif out["bitwise"]:
        out["max_ulp"], out["n_diff"] = 0, 0
    else:
        out["max_ulp"], out["n_diff"] = ulp_distance(a, b)
    return out

"""Float64 evaluation of the contract (SPEC §1 ``fused_lce``, SPEC §3 ``fused_cpo_loss``) and error measures.

Inputs may be torch tensors of any float dtype and device, numpy arrays (``ml_dtypes.bfloat16`` included) or
anything numpy can read (JAX arrays). They are upcast to float64 CPU *copies* (never modified); the loss is
evaluated in float64 torch and the gradients come from ``torch.autograd``. Every result is a float64 numpy
array.

Choices where the SPEC is silent, written down here:
- Ignored rows take no part in the loss graph at all: their gradients are exactly 0 (even if the row of ``x``
  holds NaN) and they add nothing to ``dw`` / ``db``.
- ``accuracy`` uses the first argmax (lowest index among equal maxima) of the float64 logits ``z`` (after the
  softcap), like ``numpy.argmax``.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["flce_reference", "cpo_reference", "rel_err", "ulp_distance", "as_float64"]

_F64 = torch.float64
_REDUCTIONS = ("mean", "sum", "none")
_CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


# ----------------------------------------------------------------------------------------------- conversions
def as_float64(a) -> np.ndarray:
    """Return ``a`` (torch tensor, numpy array, JAX array, scalar) as a new float64 numpy array."""
    if isinstance(a, torch.Tensor):
        return np.array(a.detach().to("cpu", _F64).numpy(), dtype=np.float64, copy=True)
    return np.array(a, dtype=np.float64, copy=True)


def _f64(a, name: str) -> torch.Tensor:
    if isinstance(a, torch.Tensor) and a.is_complex():
        raise ValueError(f"{name}: expected a real tensor, got {a.dtype}")
    return torch.from_numpy(as_float64(a))


def _int64(a, name: str) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        if a.is_floating_point() or a.is_complex() or a.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor, got {a.dtype}")
        return a.detach().to("cpu", torch.int64).clone()
    arr = np.asarray(a)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected an integer array, got {arr.dtype}")
    return torch.from_numpy(np.array(arr, dtype=np.int64, copy=True))


def _softcap(r: torch.Tensor, softcap) -> torch.Tensor:
    return r if softcap is None else softcap * torch.tanh(r / softcap)


def _check_targets(t: torch.Tensor, valid: torch.Tensor, v: int) -> None:
    bad = valid & ((t < 0) | (t >= v))
    if bool(bad.any()):
        raise ValueError(
            f"targets: {int(bad.sum())} value(s) outside [0, {v}) that are not ignore_index, "
            f"e.g. {int(t[bad][0])}")


def _grads(total: torch.Tensor, leaves: list[torch.Tensor]) -> list[np.ndarray]:
    """d total / d leaf for each leaf as float64 numpy (zeros where the total does not depend on it)."""
    if total.requires_grad:
        gs = torch.autograd.grad(total, leaves, allow_unused=True)
    else:
        gs = [None] * len(leaves)
    return [(torch.zeros_like(l) if g is None else g).detach().numpy() for l, g in zip(leaves, gs)]


def _is_float(a) -> bool:
    if isinstance(a, torch.Tensor):
        return a.is_floating_point()
    dt = np.asarray(a).dtype
    return dt.kind == "f" or dt.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _linear_inputs(x, weight, bias):
    """float64 leaves (x, W, b) and the checks shared by both losses."""
    for name, a in (("x", x), ("weight", weight)):
        if not _is_float(a):
            raise ValueError(f"{name}: expected a floating-point array")
    x64, w64 = _f64(x, "x"), _f64(weight, "weight")
    if w64.ndim != 2:
        raise ValueError(f"weight: expected [V, H], got shape {tuple(w64.shape)}")
    v, h = w64.shape
    if x64.ndim < 1 or x64.shape[-1] != h:
        raise ValueError(f"x: last dimension {tuple(x64.shape)[-1:]} does not match weight [V, H] = {(v, h)}")
    b64 = None
    if bias is not None:
        b64 = _f64(bias, "bias")
        if tuple(b64.shape) != (v,):
            raise ValueError(f"bias: expected shape ({v},), got {tuple(b64.shape)}")
        b64.requires_grad_(True)
    return x64.requires_grad_(True), w64.requires_grad_(True), b64


def _logits(rows: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    r = rows @ w.T
    return r if b is None else r + b


# ----------------------------------------------------------------------------------------------- SPEC §1
def flce_reference(x, weight, targets, *, bias=None, ignore_index=-100, reduction="mean",
                   label_smoothing=0.0, z_loss=0.0, softcap=None, class_weights=None,
                   grad_output=None) -> dict:
    """Float64 fused linear cross-entropy (SPEC §1, every option).

    Returns a dict of float64 numpy arrays:
      ``loss``     0-d for "mean"/"sum", the shape of ``targets`` for "none" (ignored rows 0);
      ``lse``      logsumexp of the (softcapped) logits, shape of ``targets``, the true value for every row;
      ``z_loss``   the z-loss part of ``loss`` (``s·lse²``), reduced like the loss;
      ``accuracy`` "mean"/"sum": fraction of valid rows whose first argmax is the target (0 when none);
                   "none": per row 0/1 (ignored rows 0);
      ``dx``, ``dw``, ``db``  gradients of ``sum(loss * grad_output)`` (``db`` is None without bias).
    ``grad_output`` defaults to 1 (a scalar for "mean"/"sum"; for "none" anything that broadcasts to the
    shape of ``targets``). Raises ValueError for bad arguments and for targets outside [0, V) other than
    ``ignore_index``.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected one of {_REDUCTIONS}, got {reduction!r}")
    eps, s = float(label_smoothing), float(z_loss)
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"label_smoothing: expected a value in [0, 1], got {label_smoothing}")
    if s < 0:
        raise ValueError(f"z_loss: expected >= 0, got {z_loss}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: expected > 0 or None, got {softcap}")

    x_leaf, w_leaf, b_leaf = _linear_inputs(x, weight, bias)
    v, h = w_leaf.shape
    t = _int64(targets, "targets")
    lead = tuple(t.shape)
    if tuple(x_leaf.shape[:-1]) != lead:
        raise ValueError(f"targets: shape {lead} does not match the leading shape of x {tuple(x_leaf.shape)}")
    if class_weights is None:
        cw = torch.ones(v, dtype=_F64)
    else:
        cw = _f64(class_weights, "class_weights")
        if tuple(cw.shape) != (v,):
            raise ValueError(f"class_weights: expected shape ({v},), got {tuple(cw.shape)}")
        if bool((cw < 0).any()):
            raise ValueError("class_weights: negative weights are not allowed")

    tf = t.reshape(-1)
    valid = tf != ignore_index
    _check_targets(tf, valid, v)
    idx = valid.nonzero().squeeze(1)
    n = idx.numel()
    y = tf[idx]

    # The loss graph sees the valid rows only.
    zv = _softcap(_logits(x_leaf.reshape(-1, h)[idx], w_leaf, b_leaf), softcap)   # [n, V]
    lse = torch.logsumexp(zv, dim=1)
    zy = zv.gather(1, y[:, None]).squeeze(1)
    wy = cw[y]
    ce = (1.0 - eps) * wy * (lse - zy)
    if eps > 0:
        ce = ce + (eps / v) * ((lse[:, None] - zv) * cw).sum(dim=1)
    zl = s * lse * lse if s > 0 else torch.zeros_like(lse)
    zero = torch.zeros((), dtype=_F64)

    if reduction == "none":
        n_rows = tf.numel()
        loss = torch.zeros(n_rows, dtype=_F64).index_copy(0, idx, ce + zl).reshape(lead)
        zpart = torch.zeros(n_rows, dtype=_F64).index_copy(0, idx, zl.detach()).reshape(lead)
        g = torch.ones(lead, dtype=_F64) if grad_output is None else _f64(grad_output, "grad_output")
        total = (loss * g.expand(lead)).sum()
    else:
        if reduction == "sum":
            ce_part, z_part = ce.sum(), zl.sum()
        else:
            d = float(wy.sum())
            ce_part = ce.sum() / d if d > 0 else zero
            z_part = zl.sum() / n if n > 0 else zero
        loss = ce_part + z_part
        zpart = z_part.detach()
        g = 1.0 if grad_output is None else _f64(grad_output, "grad_output").reshape(())
        total = loss * g

    leaves = [x_leaf, w_leaf] + ([b_leaf] if b_leaf is not None else [])
    grads = _grads(total, leaves)

    with torch.no_grad():   # stats over every row
        z_all = _softcap(_logits(x_leaf.reshape(-1, h), w_leaf, b_leaf), softcap)
        lse_all = torch.logsumexp(z_all, dim=1).reshape(lead) if v > 0 else torch.full(lead, -np.inf, dtype=_F64)
        pred = np.argmax(z_all.numpy(), axis=1) if v > 0 else np.zeros(tf.numel(), np.int64)
        correct = (torch.from_numpy(pred) == tf) & valid
        if reduction == "none":
            acc = correct.to(_F64).reshape(lead).numpy()
        else:
            acc = np.array(float(correct.sum()) / n if n > 0 else 0.0)

    return {
        "loss": loss.detach().numpy().copy(),
        "lse": lse_all.numpy().copy(),
        "z_loss": zpart.numpy().copy(),
        "accuracy": np.asarray(acc, dtype=np.float64),
        "dx": grads[0],
        "dw": grads[1],
        "db": grads[2] if b_leaf is not None else None,
    }


# ----------------------------------------------------------------------------------------------- SPEC §3
def cpo_reference(x, weight, targets, *, bias=None, ignore_index=-100, beta=0.1, alpha=1.0,
                  label_smoothing=0.0, loss_type="sigmoid", simpo_gamma=0.5,
                  average_log_prob=None) -> dict:
    """Float64 fused linear CPO / SimPO / IPO / hinge loss (SPEC §3).

    ``x`` is [2B, T, H] (rows [0, B) chosen, [B, 2B) rejected), ``targets`` [2B, T].
    Returns a dict of float64 numpy arrays: ``loss`` (0-d), ``chosen_logps`` / ``rejected_logps`` ([B]; the
    mean over valid tokens when ``average_log_prob``, and 0 for a sequence without valid tokens),
    ``chosen_rewards`` / ``rejected_rewards`` (β·logp), ``nll_loss`` (0-d, 0 when no chosen token is valid),
    and the gradients of ``loss``: ``dx``, ``dw``, ``db`` (None without bias).
    """
    if loss_type not in _CPO_LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of {_CPO_LOSS_TYPES}, got {loss_type!r}")
    eps = float(label_smoothing)
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"label_smoothing: expected a value in [0, 1], got {label_smoothing}")
    if average_log_prob is None:
        average_log_prob = loss_type in ("ipo", "simpo")

    x_leaf, w_leaf, b_leaf = _linear_inputs(x, weight, bias)
    v, h = w_leaf.shape
    if x_leaf.ndim != 3 or x_leaf.shape[0] % 2 or x_leaf.shape[0] == 0:
        raise ValueError(f"x: expected [2B, T, H] with B >= 1, got shape {tuple(x_leaf.shape)}")
    two_b, seq_len = x_leaf.shape[:2]
    nb = two_b // 2
    t = _int64(targets, "targets")
    if tuple(t.shape) != (two_b, seq_len):
        raise ValueError(f"targets: expected shape {(two_b, seq_len)}, got {tuple(t.shape)}")

    tf = t.reshape(-1)
    valid = tf != ignore_index
    _check_targets(tf, valid, v)
    idx = valid.nonzero().squeeze(1)
    seq = idx // seq_len                                   # sequence of each valid token
    y = tf[idx]

    z = _logits(x_leaf.reshape(-1, h)[idx], w_leaf, b_leaf)  # [n_valid, V]
    tok = z.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(z, dim=1)  # log p(y) per valid token
    logp = torch.zeros(two_b, dtype=_F64).index_add(0, seq, tok)
    if average_log_prob:
        count = torch.bincount(seq, minlength=two_b).to(_F64)
        logp = logp / count.clamp(min=1.0)
    lc, lr = logp[:nb], logp[nb:]

    delta = lc - lr
    if loss_type == "simpo":
        delta = delta - simpo_gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        per_pair = (-(1.0 - eps) * torch.nn.functional.logsigmoid(beta * delta)
                    - eps * torch.nn.functional.logsigmoid(-beta * delta))
    elif loss_type == "hinge":
        per_pair = torch.relu(1.0 - beta * delta)
    else:  # ipo
        per_pair = (delta - 1.0 / (2.0 * beta)) ** 2

    chosen = seq < nb
    n_chosen = int(chosen.sum())
    nll = -tok[chosen].sum() / n_chosen if n_chosen > 0 else torch.zeros((), dtype=_F64)
    loss = per_pair.mean() + alpha * nll

    leaves = [x_leaf, w_leaf] + ([b_leaf] if b_leaf is not None else [])
    grads = _grads(loss, leaves)
    lc, lr = lc.detach(), lr.detach()
    return {
        "loss": loss.detach().numpy().copy(),
        "chosen_logps": lc.numpy().copy(),
        "rejected_logps": lr.numpy().copy(),
        "chosen_rewards": (beta * lc).numpy(),
        "rejected_rewards": (beta * lr).numpy(),
        "nll_loss": nll.detach().numpy().copy(),
        "dx": grads[0],
        "dw": grads[1],
        "db": grads[2] if b_leaf is not None else None,
    }


# ----------------------------------------------------------------------------------------------- measures
def rel_err(a, ref) -> float:
    """Relative norm error ``‖a − ref‖ / ‖ref‖`` in float64 (``‖a‖`` when ``‖ref‖ == 0``).

    Returns ``inf`` when the difference is not finite (e.g. a NaN or an inf in ``a``).
    """
    a64, r64 = as_float64(a), as_float64(ref)
    if a64.shape != r64.shape:
        raise ValueError(f"rel_err: shapes differ: {a64.shape} vs {r64.shape}")
    num = float(np.linalg.norm((a64 - r64).ravel()))
    if not np.isfinite(num):
        return float("inf")
    den = float(np.linalg.norm(r64.ravel()))
    return num / den if den > 0 else num


_ULP_DTYPES = {  # name: (torch dtype, integer view dtype, bits)
    "float32": (torch.float32, torch.int32, 32),
    "bfloat16": (torch.bfloat16, torch.int16, 16),
    "float16": (torch.float16, torch.int16, 16),
}


def _ordered_bits(a, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(position of each value on a monotonic integer line, NaN mask), after casting ``a`` to ``dtype``."""
    tdt, idt, nbits = _ULP_DTYPES[dtype]
    if isinstance(a, torch.Tensor):
        t = a.detach().to("cpu")
    else:
        arr = np.asarray(a)
        if arr.dtype.name == "bfloat16" or arr.dtype.kind != "f":   # ml_dtypes / ints: exact via float32/64
            arr = arr.astype(np.float32 if arr.dtype.itemsize <= 2 else np.float64)
        t = torch.from_numpy(np.ascontiguousarray(arr))
    t = t.to(tdt).contiguous()
    bits = t.view(idt).to(torch.int64) & ((1 << nbits) - 1)          # the raw bit pattern, unsigned
    sign = bits >> (nbits - 1)
    mag = bits & ((1 << (nbits - 1)) - 1)
    return torch.where(sign == 1, -mag, mag), torch.isnan(t)         # +0 and -0 both map to 0


def ulp_distance(a, b, dtype: str) -> tuple[int, int]:
    """ULP distance of ``a`` and ``b`` in ``dtype`` ("float32" | "bfloat16" | "float16").

    Returns ``(max_ulp, n_diff)``: the largest per-element distance in units in the last place and the number
    of elements at a distance > 0. Values are cast to ``dtype`` first (exact if they already are). +0 and −0
    are equal; NaN vs NaN counts as equal; NaN vs a number counts as ``2**bits − 1`` (above any finite pair).
    """
    if dtype not in _ULP_DTYPES:
        raise ValueError(f"dtype: expected one of {tuple(_ULP_DTYPES)}, got {dtype!r}")
    oa, na = _ordered_bits(a, dtype)
    ob, nb = _ordered_bits(b, dtype)
    if oa.shape != ob.shape:
        raise ValueError(f"ulp_distance: shapes differ: {tuple(oa.shape)} vs {tuple(ob.shape)}")
    worst = (1 << _ULP_DTYPES[dtype][2]) - 1
    dist = (oa - ob).abs()
    dist = torch.where(na & nb, torch.zeros_like(dist), dist)
    dist = torch.where(na ^ nb, torch.full_like(dist, worst), dist)
    if dist.numel() == 0:
        return 0, 0
    return int(dist.max()), int((dist > 0).sum())

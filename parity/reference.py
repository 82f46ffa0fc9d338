"""The float64 evaluation of the contract: SPEC §1 ``fused_lce``, §3 ``fused_cpo_loss``, §4 ``fused_token_logprobs``.

One set of formulas with two entry points per loss:

* ``flce_on_device`` / ``cpo_on_device`` / ``logprobs_on_device``: torch tensors of any float dtype, evaluated
  in float64 *on their device*, by chunks of rows (of whole pairs for CPO) with autograd per chunk, so that
  the real shapes (13-30 TFLOP per case, far too slow in float64 on a CPU) fit in memory: the parity suite's
  reference. Returns float64 tensors. The "mean" denominators are counted before the first chunk.
* ``flce_reference`` / ``cpo_reference`` / ``logprobs_reference``: anything (torch tensors of any dtype and
  device, numpy arrays with ``ml_dtypes.bfloat16``, JAX arrays) as float64 CPU *copies* (never modified),
  through the same function on the CPU; returns float64 numpy arrays, FLCE with its stats. The tests' reference.

Choices where the SPEC is silent, written down here:

* Ignored rows take no part in the loss graph at all: their gradients are exactly 0 (even if the row of ``x``
  holds NaN) and they add nothing to ``dw`` / ``db``.
* ``accuracy`` and ``argmax`` use the first argmax (lowest index among equal maxima) of the float64 logits
  ``z`` (after the softcap); ``argmax`` is -1 on ignored rows. ``lse`` is the true value on every row.
* Token scaling multiplies each valid row's CE and z-loss terms by the stop-gradient ``p(y) = exp(z_y - lse)``
  (Liger's ``use_token_scaling``); the "mean" denominators stay D and n; the ``z_loss`` stat is the scaled part.
* A CPO sequence without valid tokens has logp 0; the NLL is 0 without valid chosen tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from .measures import as_float64, rel_err, ulp_distance

__all__ = ["flce_reference", "cpo_reference", "logprobs_reference", "flce_on_device", "cpo_on_device",
           "logprobs_on_device", "as_float64", "rel_err", "ulp_distance"]

_F64 = torch.float64
_REDUCTIONS = ("mean", "sum", "none")
_CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
_CHUNK_BYTES = 1 << 30       # float64 logits per chunk on the device


# ----------------------------------------------------------------------------------------------- checks
def _is_float(a) -> bool:
    if isinstance(a, torch.Tensor):
        return a.is_floating_point()
    dt = np.asarray(a).dtype
    return dt.kind == "f" or dt.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _cpu64(a, name: str, *, must_be_float: bool = False) -> torch.Tensor | None:
    """A float64 CPU copy of ``a`` (None stays None)."""
    if a is None:
        return None
    if isinstance(a, torch.Tensor) and a.is_complex():
        raise ValueError(f"{name}: expected a real tensor, got {a.dtype}")
    if must_be_float and not _is_float(a):
        raise ValueError(f"{name}: expected a floating-point array")
    return torch.from_numpy(as_float64(a))


def _cpu_int64(a, name: str) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        if a.is_floating_point() or a.is_complex() or a.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor, got {a.dtype}")
        return a.detach().to("cpu", torch.int64).clone()
    arr = np.asarray(a)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected an integer array, got {arr.dtype}")
    return torch.from_numpy(np.array(arr, dtype=np.int64, copy=True))


def _check_common(label_smoothing=0.0, softcap=None) -> float:
    eps = float(label_smoothing)
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"label_smoothing: expected a value in [0, 1], got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: expected > 0 or None, got {softcap}")
    return eps


def _linear(x, weight, bias):
    """(rows of x as [N, H] or x itself for CPO, float64 leaves W and b, V, H) with the shape checks."""
    if not x.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"x, weight: expected floating-point tensors, got {x.dtype}, {weight.dtype}")
    if weight.ndim != 2:
        raise ValueError(f"weight: expected [V, H], got shape {tuple(weight.shape)}")
    v, h = weight.shape
    if x.ndim < 1 or x.shape[-1] != h:
        raise ValueError(f"x: last dimension {tuple(x.shape)[-1:]} does not match weight [V, H] = {(v, h)}")
    w64 = weight.detach().to(x.device, _F64).requires_grad_(True)
    b64 = None
    if bias is not None:
        if tuple(bias.shape) != (v,):
            raise ValueError(f"bias: expected shape ({v},), got {tuple(bias.shape)}")
        b64 = bias.detach().to(x.device, _F64).requires_grad_(True)
    return w64, b64, v, h


def _targets(targets, lead: tuple, v: int, ignore_index: int) -> torch.Tensor:
    """Flat int64 targets, checked: integer dtype, the leading shape of x, values in [0, V) or ignored."""
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets: expected an integer tensor, got {targets.dtype}")
    if tuple(targets.shape) != lead:
        raise ValueError(f"targets: shape {tuple(targets.shape)} does not match the leading shape {lead} of x")
    t = targets.detach().reshape(-1).to(torch.int64)
    bad = (t != ignore_index) & ((t < 0) | (t >= v))
    if bool(bad.any()):
        raise ValueError(f"targets: {int(bad.sum())} value(s) outside [0, {v}) that are not ignore_index, "
                         f"e.g. {int(t[bad][0])}")
    return t


def _per_row(g, lead: tuple, device) -> torch.Tensor | None:
    """A cotangent that broadcasts to the targets' shape, as flat float64 (None stays None)."""
    return None if g is None else g.detach().to(device, _F64).expand(lead).reshape(-1)


# ----------------------------------------------------------------------------------------------- shared math
def _transform(r: torch.Tensor, softcap=None, temperature: float = 1.0) -> torch.Tensor:
    """Raw logits -> z: ``c·tanh(r/c)`` with a softcap, then ``/ temperature`` (SPEC §1, §4)."""
    z = r if softcap is None else softcap * torch.tanh(r / softcap)
    return z if temperature == 1.0 else z / temperature


def _logits(rows: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    r = rows @ w.T
    return r if b is None else r + b


def _spans(n: int, step: int):
    return ((s, min(n, s + step)) for s in range(0, n, step))


class _Grads:
    """dx (written per chunk at the chunk's rows of x), dw and db (summed over the chunks), in float64."""

    def __init__(self, x_shape, w: torch.Tensor, b: torch.Tensor | None):
        self.w, self.b = w, b
        self.dx = torch.zeros(x_shape, dtype=_F64, device=w.device)
        self.dw = torch.zeros_like(w, requires_grad=False)
        self.db = None if b is None else torch.zeros_like(b, requires_grad=False)

    def add(self, total: torch.Tensor | None, xc: torch.Tensor, rows) -> None:
        """Backpropagate one chunk's ``total`` (None: nothing to differentiate) to ``xc`` = x[rows], W, b."""
        if total is None:
            return
        leaves = [xc, self.w] + ([self.b] if self.b is not None else [])
        grads = torch.autograd.grad(total, leaves, allow_unused=True)
        if grads[0] is not None:
            self.dx[rows] = grads[0]
        if grads[1] is not None:
            self.dw += grads[1]
        if self.b is not None and grads[2] is not None:
            self.db += grads[2]

    def result(self, x_shape) -> dict:
        """The gradients, dx in the shape of x."""
        return {"dx": self.dx.reshape(x_shape), "dw": self.dw, "db": self.db}


def _numpy(out: dict) -> dict:
    return {k: (None if v is None else v.detach().cpu().numpy().copy()) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------- SPEC §1
def _flce_weights(reduction, t, valid, cw, normalizer) -> tuple[float, float, float]:
    """(weight of each row's CE, weight of its z-loss, this call's n): 1/D and 1/n for "mean" (0 when D = 0
    or n = 0; the caller's D, n with a ``normalizer``), 1 otherwise."""
    n_local = float(valid.sum())
    if reduction != "mean":
        return 1.0, 1.0, n_local
    if normalizer is None:
        d, n = float(cw[t[valid]].sum()), n_local
    else:
        items = normalizer if isinstance(normalizer, (tuple, list)) else (normalizer,)
        if len(items) not in (1, 2):
            raise ValueError(f"normalizer: expected a scalar or a pair (D, n), got {len(items)} values")
        d, n = float(items[0]), float(items[-1])
    return (1.0 / d if d != 0 else 0.0), (1.0 / n if n > 0 else 0.0), n_local


def _flce_rows(z, y, cw, eps: float, s: float, token_scaling: bool):
    """Per valid row: (CE_i, Z_i) of SPEC §1, each times the stop-gradient p(y) with token scaling."""
    lse = torch.logsumexp(z, dim=1)
    zy = z.gather(1, y[:, None]).squeeze(1)
    ce = (1.0 - eps) * cw[y] * (lse - zy)
    if eps > 0:
        ce = ce + (eps / z.shape[1]) * ((lse[:, None] - z) * cw).sum(dim=1)
    zl = s * lse * lse if s > 0 else torch.zeros_like(lse)      # no graph through lse without a z-loss
    if token_scaling:
        p_y = torch.exp(zy - lse).detach()
        ce, zl = ce * p_y, zl * p_y
    return ce, zl


def _flce_stats(reduction, lead, valid, t, amax, lse_all, zrows, n_local) -> dict:
    correct = ((amax == t) & valid).to(_F64)
    if reduction == "none":
        return {"lse": lse_all.reshape(lead), "z_loss": zrows.reshape(lead), "accuracy": correct.reshape(lead),
                "argmax": amax.reshape(lead)}
    acc = correct.sum() / n_local if n_local > 0 else torch.zeros((), dtype=_F64)
    return {"lse": lse_all.reshape(lead), "z_loss": zrows.sum(), "accuracy": acc, "argmax": amax.reshape(lead)}


def flce_on_device(x, weight, targets, *, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                   z_loss=0.0, softcap=None, class_weights=None, normalizer=None, token_scaling=False,
                   grad_output=None, stats=False, chunk_bytes: int = _CHUNK_BYTES) -> dict:
    """SPEC §1 in float64 on the tensors' device: ``loss``, ``dx``, ``dw``, ``db`` (float64 tensors), and with
    ``stats`` also ``lse``, ``z_loss``, ``accuracy``, ``argmax`` (see :func:`flce_reference`)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected one of {_REDUCTIONS}, got {reduction!r}")
    eps, s = _check_common(label_smoothing, softcap), float(z_loss)
    if s < 0:
        raise ValueError(f"z_loss: expected >= 0, got {z_loss}")
    w64, b64, v, h = _linear(x, weight, bias)
    dev, lead = x.device, tuple(x.shape[:-1])
    xr, t = x.detach().reshape(-1, h), _targets(targets, lead, v, ignore_index)
    cw = torch.ones(v, dtype=_F64, device=dev) if class_weights is None else class_weights.detach().to(dev, _F64)
    if tuple(cw.shape) != (v,) or not bool(torch.isfinite(cw).all()):
        raise ValueError(f"class_weights: expected finite values of shape ({v},), got {tuple(cw.shape)}")
    valid = t != ignore_index
    w_ce, w_z, n_local = _flce_weights(reduction, t, valid, cw, normalizer)
    g = _per_row(grad_output if grad_output is not None else torch.ones((), dtype=_F64), lead, dev)
    grads = _Grads(xr.shape, w64, b64)
    rows, zrows = torch.zeros(t.numel(), dtype=_F64, device=dev), torch.zeros(t.numel(), dtype=_F64, device=dev)
    amax = torch.full((t.numel(),), -1, dtype=torch.int64, device=dev)
    lse_all = torch.zeros(t.numel(), dtype=_F64, device=dev)
    for s0, s1 in _spans(t.numel(), max(1, chunk_bytes // max(1, 8 * v))):
        if stats:
            with torch.no_grad():
                lse_all[s0:s1] = torch.logsumexp(_transform(_logits(xr[s0:s1].to(_F64), w64, b64), softcap), 1)
        gi = s0 + valid[s0:s1].nonzero().squeeze(1)
        if gi.numel() == 0:
            continue
        xc = xr[gi].to(_F64).requires_grad_(True)
        z = _transform(_logits(xc, w64, b64), softcap)
        ce, zl = _flce_rows(z, t[gi], cw, eps, s, token_scaling)
        r = w_ce * ce + w_z * zl
        grads.add((r * g[gi]).sum(), xc, gi)
        rows[gi], zrows[gi], amax[gi] = r.detach(), (w_z * zl).detach(), z.detach().argmax(dim=1)
    out = {"loss": rows.reshape(lead) if reduction == "none" else rows.sum(), **grads.result(x.shape)}
    if stats:
        out.update(_flce_stats(reduction, lead, valid, t, amax, lse_all, zrows, n_local))
    return out


def flce_reference(x, weight, targets, *, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                   z_loss=0.0, softcap=None, class_weights=None, normalizer=None, token_scaling=False,
                   grad_output=None) -> dict:
    """Float64 fused linear cross-entropy (SPEC §1, every option), on float64 CPU copies of the inputs.

    Returns a dict of float64 numpy arrays (``argmax``: int64):
      ``loss``     0-d for "mean"/"sum", the shape of ``targets`` for "none" (ignored rows 0);
      ``lse``      logsumexp of the (softcapped) logits, shape of ``targets``, the true value for every row;
      ``z_loss``   the z-loss part of ``loss``, reduced like the loss;
      ``accuracy`` "mean"/"sum": fraction of valid rows whose first argmax is the target (0 when none);
                   "none": per row 0/1 (ignored rows 0);
      ``argmax``   the first argmax of each row, -1 on ignored rows;
      ``dx``, ``dw``, ``db``  gradients of ``sum(loss * grad_output)`` (``db`` is None without bias).
    ``grad_output`` defaults to 1 (a scalar for "mean"/"sum"; for "none" anything that broadcasts to the
    shape of ``targets``). ``normalizer`` ("mean" only): the caller's D = n (a scalar) or (D, n). Class
    weights may have any finite value. Raises ValueError for bad arguments and for targets outside [0, V)
    other than ``ignore_index``.
    """
    return _numpy(flce_on_device(
        _cpu64(x, "x", must_be_float=True), _cpu64(weight, "weight", must_be_float=True),
        _cpu_int64(targets, "targets"), bias=_cpu64(bias, "bias"), ignore_index=ignore_index,
        reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
        class_weights=_cpu64(class_weights, "class_weights"), normalizer=normalizer, token_scaling=token_scaling,
        grad_output=_cpu64(grad_output, "grad_output"), stats=True))


# ----------------------------------------------------------------------------------------------- SPEC §3
def _pair_loss(delta, loss_type: str, beta: float, eps: float) -> torch.Tensor:
    """L_i of SPEC §3 from Δ_i (SimPO's margin already subtracted)."""
    if loss_type in ("sigmoid", "simpo"):
        logsig = torch.nn.functional.logsigmoid
        return -(1.0 - eps) * logsig(beta * delta) - eps * logsig(-beta * delta)
    if loss_type == "hinge":
        return torch.relu(1.0 - beta * delta)
    return (delta - 1.0 / (2.0 * beta)) ** 2     # ipo


def cpo_on_device(x, weight, targets, *, bias=None, ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0,
                  loss_type="sigmoid", simpo_gamma=0.5, average_log_prob=None,
                  chunk_bytes: int = _CHUNK_BYTES) -> dict:
    """SPEC §3 in float64 on the tensors' device, by chunks of whole pairs: ``loss``, ``dx``, ``dw``, ``db``,
    ``logps`` ([2B]: chosen then rejected) and ``nll_loss`` (float64 tensors)."""
    if loss_type not in _CPO_LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of {_CPO_LOSS_TYPES}, got {loss_type!r}")
    eps = _check_common(label_smoothing)
    avg = loss_type in ("ipo", "simpo") if average_log_prob is None else bool(average_log_prob)
    w64, b64, v, h = _linear(x, weight, bias)
    if x.ndim != 3 or x.shape[0] % 2 or x.shape[0] == 0:
        raise ValueError(f"x: expected [2B, T, H] with B >= 1, got shape {tuple(x.shape)}")
    dev, (b2, tlen) = x.device, x.shape[:2]
    nb = b2 // 2
    t = _targets(targets, (b2, tlen), v, ignore_index).reshape(b2, tlen)
    n_chosen = int((t[:nb] != ignore_index).sum())
    grads = _Grads(x.shape, w64, b64)
    logps = torch.zeros(b2, dtype=_F64, device=dev)
    loss, nll = torch.zeros((), dtype=_F64, device=dev), torch.zeros((), dtype=_F64, device=dev)
    for p0, p1 in _spans(nb, max(1, chunk_bytes // max(1, 2 * tlen * v * 8))):
        k = p1 - p0
        sel = torch.cat([torch.arange(p0, p1), torch.arange(nb + p0, nb + p1)]).to(dev)
        tc = t[sel].reshape(-1)
        idx = (tc != ignore_index).nonzero().squeeze(1)
        seq, y = idx // tlen, tc[idx]
        xc = x.detach()[sel].to(_F64).requires_grad_(True)
        z = _logits(xc.reshape(-1, h)[idx], w64, b64)
        tok = z.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(z, dim=1)     # log p(y) per valid token
        logp = torch.zeros(2 * k, dtype=_F64, device=dev).index_add(0, seq, tok)
        if avg:
            logp = logp / torch.bincount(seq, minlength=2 * k).to(_F64).clamp(min=1.0)
        delta = logp[:k] - logp[k:] - (simpo_gamma / beta if loss_type == "simpo" else 0.0)
        nll_part = -tok[seq < k].sum() / n_chosen if n_chosen > 0 else torch.zeros((), dtype=_F64, device=dev)
        total = _pair_loss(delta, loss_type, beta, eps).sum() / nb + alpha * nll_part
        grads.add(total, xc, sel)
        logps[sel], nll, loss = logp.detach(), nll + nll_part.detach(), loss + total.detach()
    return {"loss": loss, **grads.result(x.shape), "logps": logps, "nll_loss": nll}


def cpo_reference(x, weight, targets, *, bias=None, ignore_index=-100, beta=0.1, alpha=1.0, label_smoothing=0.0,
                  loss_type="sigmoid", simpo_gamma=0.5, average_log_prob=None) -> dict:
    """Float64 fused linear CPO / SimPO / IPO / hinge loss (SPEC §3), on float64 CPU copies of the inputs.

    ``x`` is [2B, T, H] (rows [0, B) chosen, [B, 2B) rejected), ``targets`` [2B, T]. Returns a dict of
    float64 numpy arrays: ``loss`` (0-d), ``chosen_logps`` / ``rejected_logps`` ([B]; the mean over valid
    tokens when ``average_log_prob``, and 0 for a sequence without valid tokens), ``chosen_rewards`` /
    ``rejected_rewards`` (β·logp), ``nll_loss`` (0-d, 0 when no chosen token is valid), and the gradients of
    ``loss``: ``dx``, ``dw``, ``db`` (None without bias).
    """
    r = _numpy(cpo_on_device(
        _cpu64(x, "x", must_be_float=True), _cpu64(weight, "weight", must_be_float=True),
        _cpu_int64(targets, "targets"), bias=_cpu64(bias, "bias"), ignore_index=ignore_index, beta=beta,
        alpha=alpha, label_smoothing=label_smoothing, loss_type=loss_type, simpo_gamma=simpo_gamma,
        average_log_prob=average_log_prob))
    logps = r.pop("logps")
    nb = logps.shape[0] // 2
    return {**r, "chosen_logps": logps[:nb], "rejected_logps": logps[nb:], "chosen_rewards": beta * logps[:nb],
            "rejected_rewards": beta * logps[nb:]}


# ----------------------------------------------------------------------------------------------- SPEC §4
def _logprob_rows(z, y):
    """Per valid row: (logp = z_y − lse, entropy = lse − Σ p z) of SPEC §4."""
    lse = torch.logsumexp(z, dim=1)
    p = torch.exp(z - lse[:, None])
    return z.gather(1, y[:, None]).squeeze(1) - lse, lse - (p * z).sum(dim=1)


def logprobs_on_device(x, weight, targets, *, bias=None, ignore_index=-100, softcap=None, temperature=1.0,
                       grad_logp=None, grad_entropy=None, chunk_bytes: int = _CHUNK_BYTES) -> dict:
    """SPEC §4 in float64 on the tensors' device: ``logp``, ``entropy`` (the shape of ``targets``, 0 on ignored
    rows), ``dx``, ``dw``, ``db`` (float64 tensors; see :func:`logprobs_reference`)."""
    _check_common(softcap=softcap)
    if not 0.0 < float(temperature) < float("inf"):
        raise ValueError(f"temperature: expected a finite value > 0, got {temperature}")
    w64, b64, v, h = _linear(x, weight, bias)
    dev, lead = x.device, tuple(x.shape[:-1])
    xr, t = x.detach().reshape(-1, h), _targets(targets, lead, v, ignore_index)
    gl, ge = _per_row(grad_logp, lead, dev), _per_row(grad_entropy, lead, dev)
    grads = _Grads(xr.shape, w64, b64)
    logp, entropy = torch.zeros(t.numel(), dtype=_F64, device=dev), torch.zeros(t.numel(), dtype=_F64, device=dev)
    for s0, s1 in _spans(t.numel(), max(1, chunk_bytes // max(1, 8 * v))):
        gi = s0 + (t[s0:s1] != ignore_index).nonzero().squeeze(1)
        if gi.numel() == 0:
            continue
        xc = xr[gi].to(_F64).requires_grad_(True)
        lp, ent = _logprob_rows(_transform(_logits(xc, w64, b64), softcap, float(temperature)), t[gi])
        terms = [(lp * gl[gi]).sum()] if gl is not None else []
        terms += [(ent * ge[gi]).sum()] if ge is not None else []
        grads.add(sum(terms) if terms else None, xc, gi)
        logp[gi], entropy[gi] = lp.detach(), ent.detach()
    return {"logp": logp.reshape(lead), "entropy": entropy.reshape(lead), **grads.result(x.shape)}


def logprobs_reference(x, weight, targets, *, bias=None, ignore_index=-100, softcap=None, temperature=1.0,
                       grad_logp=None, grad_entropy=None) -> dict:
    """Float64 per-token log-probabilities and entropies (SPEC §4), on float64 CPU copies of the inputs.

    ``z = softcap(x·Wᵀ + b) / temperature``; returns float64 numpy arrays ``logp = z_y − lse(z)`` and
    ``entropy = lse(z) − Σ_c p_c z_c`` (the shape of ``targets``, 0 on ignored rows) and ``dx``, ``dw``, ``db``
    (None without bias): the gradients of ``sum(logp·grad_logp + entropy·grad_entropy)``, where a cotangent
    that is None (the default) means no such term (all-zero gradients when both are None).
    """
    return _numpy(logprobs_on_device(
        _cpu64(x, "x", must_be_float=True), _cpu64(weight, "weight", must_be_float=True),
        _cpu_int64(targets, "targets"), bias=_cpu64(bias, "bias"), ignore_index=ignore_index, softcap=softcap,
        temperature=temperature, grad_logp=_cpu64(grad_logp, "grad_logp"),
        grad_entropy=_cpu64(grad_entropy, "grad_entropy")))

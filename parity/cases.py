"""What a case is and the tensors it makes: ``fused_lce`` (:class:`Case`), ``fused_cpo_loss`` (:class:`CpoCase`)
and ``fused_token_logprobs`` (:class:`LogprobCase`), deterministic from ``case.seed`` on any device.

Every case draws, in this order (so that adding a field never changes an existing case's numbers):

- ``x`` ~ N(0, 1) in the case dtype;
- ``weight`` ~ N(0, (logit_scale/√h)²), so the logits are ~ N(0, logit_scale²);
- ``targets`` (int64) uniform in [0, v), with ignored rows set to ``IGNORE_INDEX`` (a random share of
  the rows; CPO: a prompt prefix and a random padding suffix of each sequence);
- ``bias`` ~ N(0, (0.1·logit_scale)²) in ``bias_dtype`` (the case dtype by default), else None;
- FLCE ``class_weights`` (float32) uniform in [0.5, 2) (or in [-1, 2) with ``negative_class_weights``) with
  ``max(1, v // 100)`` exact zeros, else None.

:func:`small_cases` is the list of tiny FLCE cases that the twins' tests share; the suite's own tables are
in :mod:`parity.catalog`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = ["Case", "CpoCase", "LogprobCase", "IGNORE_INDEX", "make_inputs", "make_cpo_inputs",
           "make_logprob_inputs", "case_inputs", "small_cases", "torch_dtype"]

IGNORE_INDEX = -100

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` ("float32" | "bfloat16" | "float16")."""
    return DTYPES[name]


@dataclass(frozen=True)
class Case:
    """A ``fused_lce`` case (SPEC §1)."""

    kind: ClassVar[str] = "flce"
    values: ClassVar[tuple[str, ...]] = ("loss",)      # the differentiated outputs, in call order

    name: str
    shape: tuple[int, ...]          # leading shape of x, e.g. (37,) or (2, 5); x is (*shape, h)
    h: int
    v: int
    dtype: str                      # "float32" | "bfloat16" | "float16"
    bias: bool = False
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    class_weights: bool = False
    ignore_frac: float = 0.1
    logit_scale: float = 1.0
    seed: int = 0
    token_scaling: bool = False
    normalizer: float | tuple[float, float] | None = None   # "mean": the caller's D = n, or (D, n)
    negative_class_weights: bool = False                      # class weights drawn from [-1, 2)
    bias_dtype: str | None = None                             # None: the case dtype
    engine: str = "library"                                   # fused_lce's engine ("library" | "fused")

    @property
    def rows(self) -> int:
        """Number of rows N (the product of ``shape``)."""
        return math.prod(self.shape)

    def options(self) -> dict:
        """The keyword arguments of ``fused_lce`` for this case (``bias`` and ``class_weights`` excluded:
        those are tensors from :func:`make_inputs`; ``ignore_index`` is the default, ``IGNORE_INDEX``).
        ``token_scaling``, ``normalizer`` and ``engine`` are there only when the case sets them, so that the same dict
        also fits callees that predate them (``debug_intermediates``)."""
        out = {"reduction": self.reduction, "label_smoothing": self.label_smoothing, "z_loss": self.z_loss,
               "softcap": self.softcap}
        if self.token_scaling:
            out["token_scaling"] = True
        if self.normalizer is not None:
            out["normalizer"] = self.normalizer
        if self.engine != "library":
            out["engine"] = self.engine
        return out

    def math_options(self) -> dict:
        """`options` without the engine: what the reference evaluates (an engine changes bits, not math)."""
        return {k: v for k, v in self.options().items() if k != "engine"}

    def output_dtypes(self) -> dict[str, str | None]:
        """The dtype each output must have (None: no such output)."""
        return {"loss": "float32", "dx": self.dtype, "dw": self.dtype,
                "db": (self.bias_dtype or self.dtype) if self.bias else None}


@dataclass(frozen=True)
class CpoCase:
    """A ``fused_cpo_loss`` case (SPEC §3): ``x`` is ``[2*pairs, t, h]``, rows ``[0, pairs)`` chosen."""

    kind: ClassVar[str] = "cpo"
    values: ClassVar[tuple[str, ...]] = ("loss",)

    name: str
    pairs: int
    t: int
    h: int
    v: int
    dtype: str
    bias: bool = False
    loss_type: str = "sigmoid"
    beta: float = 0.1
    alpha: float = 1.0
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    average_log_prob: bool | None = None
    prompt_frac: float = 0.25     # leading tokens of each sequence set to ignore_index (the prompt)
    pad_frac: float = 0.1         # up to this fraction of trailing tokens set to ignore_index (padding)
    logit_scale: float = 1.0
    seed: int = 0
    engine: str = "library"       # fused_cpo_loss's engine

    @property
    def shape(self) -> tuple[int, int]:
        return (2 * self.pairs, self.t)

    @property
    def rows(self) -> int:
        return 2 * self.pairs * self.t

    def options(self) -> dict:
        """Keyword arguments of ``fused_cpo_loss`` (without ``bias``; ``engine`` only when the case sets it)."""
        out = {"beta": self.beta, "alpha": self.alpha, "label_smoothing": self.label_smoothing,
               "loss_type": self.loss_type, "simpo_gamma": self.simpo_gamma,
               "average_log_prob": self.average_log_prob}
        return out if self.engine == "library" else {**out, "engine": self.engine}

    def math_options(self) -> dict:
        """`options` without the engine: what the reference evaluates."""
        return {k: v for k, v in self.options().items() if k != "engine"}

    def resolved_average_log_prob(self) -> bool:
        if self.average_log_prob is not None:
            return bool(self.average_log_prob)
        return self.loss_type in ("ipo", "simpo")

    def output_dtypes(self) -> dict[str, str | None]:
        return {"loss": "float32", "dx": self.dtype, "dw": self.dtype, "db": self.dtype if self.bias else None}


@dataclass(frozen=True)
class LogprobCase:
    """A ``fused_token_logprobs`` case (SPEC §4); both outputs get a fixed random cotangent."""

    kind: ClassVar[str] = "logprobs"
    values: ClassVar[tuple[str, ...]] = ("logp", "entropy")

    name: str
    shape: tuple[int, ...]
    h: int
    v: int
    dtype: str
    bias: bool = False
    softcap: float | None = None
    temperature: float = 1.0
    ignore_frac: float = 0.1
    logit_scale: float = 1.0
    seed: int = 0
    engine: str = "library"       # fused_token_logprobs's engine

    @property
    def rows(self) -> int:
        return math.prod(self.shape)

    def options(self) -> dict:
        """Keyword arguments of ``fused_token_logprobs`` (without ``bias`` and ``return_entropy``; ``engine``
        only when the case sets it)."""
        out = {"ignore_index": IGNORE_INDEX, "softcap": self.softcap, "temperature": self.temperature}
        return out if self.engine == "library" else {**out, "engine": self.engine}

    def math_options(self) -> dict:
        """`options` without the engine: what the reference evaluates."""
        return {k: v for k, v in self.options().items() if k != "engine"}

    def output_dtypes(self) -> dict[str, str | None]:
        return {"logp": "float32", "entropy": "float32", "dx": self.dtype, "dw": self.dtype,
                "db": self.dtype if self.bias else None}


def call_options(case) -> dict:
    """A case's ``options()`` with its engine always named, for the twins' calls: their default ("auto") picks an
    engine by device and dtype, and a case runs the one it names."""
    return {**case.options(), "engine": case.engine}


def _head(g, shape, h, v, dtype, logit_scale):
    """x, weight and uniform targets (not yet ignored), drawn from generator ``g``."""
    x = torch.randn(*shape, h, generator=g).to(torch_dtype(dtype))
    weight = (torch.randn(v, h, generator=g) * (logit_scale / math.sqrt(h))).to(torch_dtype(dtype))
    return x, weight, torch.randint(0, v, (math.prod(shape),), generator=g)


def _bias(g, case, dtype: str):
    return (torch.randn(case.v, generator=g) * (0.1 * case.logit_scale)).to(torch_dtype(dtype)) if case.bias else None


def _ignore_some(g, targets: torch.Tensor, frac: float) -> None:
    n = targets.numel()
    targets[torch.randperm(n, generator=g)[:min(n, round(frac * n))]] = IGNORE_INDEX


def _on(device, out: dict) -> dict:
    return {k: (t.to(device) if t is not None else None) for k, t in out.items()}


def make_inputs(case: Case, device="cpu") -> dict:
    """Torch tensors for ``case`` on ``device``: ``x``, ``weight``, ``targets`` (int64), ``bias`` (or None),
    ``class_weights`` (float32, or None). The same case always gives the same values (on any device)."""
    g = torch.Generator().manual_seed(case.seed)
    x, weight, targets = _head(g, case.shape, case.h, case.v, case.dtype, case.logit_scale)
    _ignore_some(g, targets, case.ignore_frac)
    bias, cw = _bias(g, case, case.bias_dtype or case.dtype), None
    if case.class_weights:
        lo = -1.0 if case.negative_class_weights else 0.5
        cw = lo + (2.0 - lo) * torch.rand(case.v, generator=g)
        cw[torch.randperm(case.v, generator=g)[:max(1, case.v // 100)]] = 0.0
    return _on(device, {"x": x, "weight": weight, "targets": targets.reshape(case.shape), "bias": bias,
                        "class_weights": cw})


def make_cpo_inputs(case: CpoCase, device="cpu") -> dict:
    """Torch tensors for a CPO case: a prompt prefix and a random padding suffix of each sequence are ignored
    (at least one valid token per sequence); ``class_weights`` is None."""
    g = torch.Generator().manual_seed(case.seed)
    b2, t = case.shape
    x, weight, targets = _head(g, case.shape, case.h, case.v, case.dtype, case.logit_scale)
    targets = targets.reshape(b2, t)
    prompt = min(t - 1, round(case.prompt_frac * t))
    targets[:, :prompt] = IGNORE_INDEX
    max_pad = min(t - prompt - 1, round(case.pad_frac * t))
    if max_pad > 0:
        pads = torch.randint(0, max_pad + 1, (b2,), generator=g)
        for k in range(b2):
            if int(pads[k]):
                targets[k, t - int(pads[k]):] = IGNORE_INDEX
    return _on(device, {"x": x, "weight": weight, "targets": targets, "bias": _bias(g, case, case.dtype),
                        "class_weights": None})


def make_logprob_inputs(case: LogprobCase, device="cpu") -> dict:
    """Torch tensors for a log-prob case: ``x``, ``weight``, ``targets``, ``bias`` (or None)."""
    g = torch.Generator().manual_seed(case.seed)
    x, weight, targets = _head(g, case.shape, case.h, case.v, case.dtype, case.logit_scale)
    _ignore_some(g, targets, case.ignore_frac)
    return _on(device, {"x": x, "weight": weight, "targets": targets.reshape(case.shape),
                        "bias": _bias(g, case, case.dtype)})


def case_inputs(case, device="cpu") -> dict:
    """Everything one run of ``case`` reads, made once and handed to every implementation and the reference:
    the tensors of its ``make_*_inputs`` and the float32 cotangents of its outputs (``grad_<value>``; None
    means 1 for a scalar loss). FLCE "none": a fixed per-row cotangent in [0.5, 1.5), so that the backward's
    handling of a non-uniform cotangent is checked; log-probs: fixed N(0, 1) cotangents of ``logp`` and
    ``entropy`` (signed, as GRPO advantages are)."""
    if case.kind == "logprobs":
        g = torch.Generator().manual_seed(20_000 + case.seed)
        cot = {f"grad_{k}": torch.randn(case.shape, generator=g).to(device) for k in case.values}
        return {**make_logprob_inputs(case, device), **cot}
    if case.kind == "cpo":
        return {**make_cpo_inputs(case, device), "grad_loss": None}
    grad = None
    if case.reduction == "none":
        g = torch.Generator().manual_seed(10_000 + case.seed)
        grad = (0.5 + torch.rand(case.shape, generator=g)).to(device)
    return {**make_inputs(case, device), "grad_loss": grad}


def small_cases() -> list[Case]:
    """A compact list of tiny cases (small H, V not a multiple of a power-of-two block) for the CPU
    interpreters: each dtype, each reduction and each option of SPEC §1 at least once, a single row, all rows
    ignored, a 3-D ``x`` and large logits."""
    return [
        Case("f32_basic", (37,), 32, 1000, "float32"),
        Case("f16_basic", (15,), 32, 777, "float16", seed=2),
        Case("single_row", (1,), 16, 777, "float32", ignore_frac=0.0, seed=3),
        Case("all_ignored", (8,), 16, 130, "float32", ignore_frac=1.0, z_loss=1e-4, seed=4),
        Case("x3d_bf16", (2, 5), 24, 130, "bfloat16", seed=5),
        Case("large_logits_f32", (19,), 32, 777, "float32", logit_scale=50.0, seed=6),
        Case("large_logits_bf16", (13,), 64, 1000, "bfloat16", logit_scale=100.0, seed=7),
        Case("bias_bf16", (21,), 48, 1000, "bfloat16", bias=True, seed=8),
        Case("label_smoothing", (17,), 32, 777, "float32", label_smoothing=0.1, seed=9),
        Case("z_loss", (23,), 40, 130, "float32", z_loss=1e-4, seed=10),
        Case("softcap", (13,), 32, 1000, "float32", softcap=15.0, logit_scale=30.0, seed=11),
        Case("class_weights", (29,), 64, 777, "float32", class_weights=True, seed=12),
        Case("sum_bf16", (11,), 32, 130, "bfloat16", reduction="sum", seed=13),
        Case("none_3d", (2, 7), 32, 777, "float32", reduction="none", seed=14),
        Case("all_options_bf16", (9,), 64, 777, "bfloat16", bias=True, label_smoothing=0.1, z_loss=1e-4,
             softcap=30.0, class_weights=True, logit_scale=30.0, seed=15),
        Case("all_options_none_f16", (3, 2), 16, 130, "float16", bias=True, reduction="none",
             label_smoothing=0.2, z_loss=1e-3, softcap=20.0, class_weights=True, ignore_frac=0.3, seed=16),
    ]

"""Random test cases shared by the tests and the parity suite.

A :class:`Case` names a shape, a dtype and the options of ``fused_lce`` (SPEC §1); :func:`make_inputs` turns it
into torch tensors, deterministically from ``case.seed``:

- ``x`` ~ N(0, 1) in the case dtype, shape ``(*case.shape, h)``;
- ``weight`` ~ N(0, (logit_scale/√h)²), so the logits are ~ N(0, logit_scale²);
- ``targets`` (int64) uniform in [0, v), with ``round(ignore_frac · rows)`` rows set to ``IGNORE_INDEX``;
- ``bias`` ~ N(0, (0.1·logit_scale)²) in the case dtype (``case.bias``), else None;
- ``class_weights`` (float32) uniform in [0.5, 2] with ``max(1, v // 100)`` exact zeros (``case.class_weights``),
  else None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Case", "IGNORE_INDEX", "make_inputs", "small_cases", "torch_dtype"]

IGNORE_INDEX = -100

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` ("float32" | "bfloat16" | "float16")."""
    return _DTYPES[name]


@dataclass(frozen=True)
class Case:
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

    @property
    def rows(self) -> int:
        """Number of rows N (the product of ``shape``)."""
        return math.prod(self.shape)

    def options(self) -> dict:
        """The keyword arguments of ``fused_lce`` for this case (``bias`` and ``class_weights`` excluded:
        those are tensors from :func:`make_inputs`; ``ignore_index`` is the default, ``IGNORE_INDEX``)."""
        return {"reduction": self.reduction, "label_smoothing": self.label_smoothing,
                "z_loss": self.z_loss, "softcap": self.softcap}


def make_inputs(case: Case, device="cpu") -> dict:
    """Torch tensors for ``case`` on ``device``: ``x``, ``weight``, ``targets`` (int64), ``bias`` (or None),
    ``class_weights`` (float32, or None). The same case always gives the same values (on any device)."""
    g = torch.Generator().manual_seed(case.seed)
    dt = torch_dtype(case.dtype)
    n, h, v = case.rows, case.h, case.v
    x = torch.randn(*case.shape, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (case.logit_scale / math.sqrt(h))
    targets = torch.randint(0, v, (n,), generator=g)
    n_ignored = min(n, round(case.ignore_frac * n))
    targets[torch.randperm(n, generator=g)[:n_ignored]] = IGNORE_INDEX
    bias = cw = None
    if case.bias:
        bias = (torch.randn(v, generator=g) * (0.1 * case.logit_scale)).to(dt)
    if case.class_weights:
        cw = 0.5 + 1.5 * torch.rand(v, generator=g)
        cw[torch.randperm(v, generator=g)[:max(1, v // 100)]] = 0.0
    out = {"x": x.to(dt), "weight": weight.to(dt), "targets": targets.reshape(case.shape),
           "bias": bias, "class_weights": cw}
    return {k: (t.to(device) if t is not None else None) for k, t in out.items()}


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

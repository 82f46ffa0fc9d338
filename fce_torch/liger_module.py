"""`FusedLinearCrossEntropyLoss`: a drop-in for Liger's `LigerFusedLinearCrossEntropyLoss` (SPEC §2)."""
from typing import NamedTuple

import torch

from .api import fused_lce


class CrossEntropyOutput(NamedTuple):
    """What Liger's module returns when an extra output is asked for."""
    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """Liger's constructor and call, computed by `fce_torch.fused_lce`.

    ``forward(lin_weight, _input, target, bias=None)``. ``lse_square_scale`` is the z-loss coefficient,
    ``ce_weight`` the class weights. The weight gradient is always accumulated in float32, so
    ``accum_dtype`` may be None or torch.float32. Liger options without an equivalent
    (``use_token_scaling``, ``return_predicted_tokens``, another ``accum_dtype``) raise NotImplementedError.
    """

    def __init__(self, ce_weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
                 reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                 return_token_accuracy=False, return_predicted_tokens=False):
        super().__init__()
        if accum_dtype not in (None, torch.float32):
            raise NotImplementedError(f"accum_dtype={accum_dtype}: fce always accumulates the weight gradient "
                                      "in float32")
        if use_token_scaling:
            raise NotImplementedError("use_token_scaling is not supported by fce")
        if return_predicted_tokens:
            raise NotImplementedError("return_predicted_tokens is not supported by fce")
        self.ce_weight = ce_weight
        self.ignore_index = ignore_index
        self.lse_square_scale = lse_square_scale
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.return_token_accuracy = return_token_accuracy

    def forward(self, lin_weight, _input, target, bias=None):
        loss, stats = fused_lce(_input, lin_weight, target, bias=bias, ignore_index=self.ignore_index,
                                reduction=self.reduction, label_smoothing=self.label_smoothing,
                                z_loss=self.lse_square_scale, softcap=self.softcap, class_weights=self.ce_weight,
                                return_stats=True)
        if not (self.return_z_loss or self.return_token_accuracy):
            return loss
        return CrossEntropyOutput(loss=loss, z_loss=stats["z_loss"] if self.return_z_loss else None,
                                  token_accuracy=stats["accuracy"] if self.return_token_accuracy else None)

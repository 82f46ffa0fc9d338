"""fce_torch: fused linear cross-entropy (and CPO, token log-probs) for PyTorch on Triton kernels."""
from .api import fused_lce
from .cpo import fused_cpo_loss
from .liger_module import FusedLinearCrossEntropyLoss

__all__ = ["fused_lce", "fused_cpo_loss", "FusedLinearCrossEntropyLoss"]

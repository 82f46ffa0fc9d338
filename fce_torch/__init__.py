"""fce_torch: fused linear cross-entropy (and CPO, token log-probs) for PyTorch on Triton kernels."""
from .api import fused_lce
from .cpo import fused_cpo_loss
from .logprobs import fused_token_logprobs
from .liger import FusedLinearCrossEntropyLoss
from .vocab_parallel import VocabParallel

__all__ = ["fused_lce", "fused_cpo_loss", "fused_token_logprobs", "FusedLinearCrossEntropyLoss", "VocabParallel"]

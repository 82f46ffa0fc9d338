"""fce_jax: fused linear cross-entropy (and CPO, token log-probs) for JAX on Pallas kernels, with a custom VJP."""
from .api import fused_lce
from .cpo import fused_cpo_loss
from .logprobs import fused_token_logprobs
from .vocab_parallel import VocabParallel

__all__ = ["fused_lce", "fused_cpo_loss", "fused_token_logprobs", "VocabParallel"]

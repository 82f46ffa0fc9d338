"""fce_jax: fused linear cross-entropy (and CPO) for JAX on Pallas kernels, with a custom VJP."""
from .api import fused_lce
from .cpo import fused_cpo_loss

__all__ = ["fused_lce", "fused_cpo_loss"]

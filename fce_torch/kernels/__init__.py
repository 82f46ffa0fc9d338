"""The Triton kernels of fce_torch, one module per kernel family (twins: fce_jax/kernels/)."""

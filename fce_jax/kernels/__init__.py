"""The Pallas kernels of fce_jax, one module per kernel family (twins: fce_torch/kernels/)."""

"""fce_core: what the two twins share, with no framework inside (no torch, no jax).

- `contract`: the checks of the public arguments (the ValueErrors of docs/SPEC.md), on shapes, dtype names
  and Python values;
- `options`: the frozen option sets of each loss, as the engines read them;
- `plan`: the one planner of rows per chunk, kept dZ, groups of whole preference pairs and chunks to run;
- `config`: the frozen kernel configurations (block sizes, GEMM tiles), the fields that decide bits named
  as such, and the constants of the shared elementwise math;
- `heads`: which row statistics a loss head needs.

fce_torch and fce_jax import these; a value decided here is decided once for both.
"""

"""What a loss head asks of the engine: which row statistics beyond the always-computed ones.

Every head gets, per row of a chunk, the row max ``m``, the sum of exponentials ``s`` (so ``lse``), the exact
target logit ``zy`` and the first argmax ``amax``. A head may also need
- ``q`` = sum_c w_c (z_c - z_y), for label smoothing (w_c the class weights, 1 without);
- ``pz`` = sum_c exp(z_c - m) z_c, for the entropy (E[z] = pz / s).
The engine computes exactly what the spec asks, nothing else; the dlogits pass has the matching terms.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class StatsSpec:
    q: bool = False
    pz: bool = False


@dataclass(frozen=True)
class GradTerms:
    """Which per-row coefficients the dlogits pass reads: dZ = a p + b [c == y] (+ c w_c) (+ d p (z - mu))."""
    smoothing: bool = False  # the c w_c term (label smoothing)
    entropy: bool = False    # the d p (z - mu) term (entropy cotangent)

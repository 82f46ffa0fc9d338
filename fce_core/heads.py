"""What a loss head asks of the engine: which row statistics beyond the always-computed ones.

Every head gets, per row of a chunk, the row max ``m``, the sum of exponentials ``s`` (so ``lse``), the exact
target logit ``zy`` and the first argmax ``amax``. A head may also need
- ``q`` = sum_c w_c (z_c - z_y), for label smoothing (w_c the class weights, 1 without);
- ``pz`` = sum_c exp(z_c - m) (z_c - m), for the entropy (E[z] = m + pz / s).
The engine computes exactly what the spec asks, nothing else; the dlogits pass has the matching terms.
"""
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple


@dataclass(frozen=True)
class StatsSpec:
    q: bool = False
    pz: bool = False


@dataclass(frozen=True)
class GradTerms:
    """Which per-row coefficients the dlogits pass reads: dZ = a p + b [c == y] (+ c w_c) (+ d p (z - mu))."""
    smoothing: bool = False  # the c w_c term (label smoothing)
    entropy: bool = False    # the d p (z - mu) term (entropy cotangent)


@dataclass(frozen=True)
class Head:
    """A loss head: `fn(stats, inputs) -> outputs` per chunk, given the chunk's row statistics (m, s, zy,
    amax, and those `stats` names) and its rows of the per-row inputs. With gradients its outputs include the
    coefficients lse, a, b, c (and d, mu for an entropy term) of the dlogits kernels."""
    fn: Callable
    stats: StatsSpec = StatsSpec()


def flce_head(kernel, opt, scalars, vocab):
    """The FLCE `Head` of options `opt` on a twin's head `kernel` (kernels/flce_head.py): per-row inputs y,
    and w_y (class weights), g (loss cotangent), g_lse (lse cotangent) where given; amax passes through."""
    def fn(stats, inputs):
        out = kernel(stats, inputs["y"], inputs.get("w_y"), inputs.get("g"), inputs.get("g_lse"), scalars,
                     opt=opt, vocab=vocab)
        out["amax"] = stats["amax"]
        return out

    return Head(fn, StatsSpec(q=opt.label_smoothing > 0))


def forms_dz_on_load(enabled, class_weights, coef, transform, *, db, traced, vocab_parallel):
    """Whether the gradient GEMMs form a chunk's dZ on their operand load (`GradGemmConfig.dz_on_load`,
    `enabled`) instead of a dZ pass over its tile values. The load forms the loss terms and label smoothing's
    c only: not with class weights (a per-column c), an entropy term (`coef` has d) or a logit transform. And
    the engine needs dZ itself for db (its column sums), for a trace of the stages, and vocab-parallel."""
    return (enabled and not db and not traced and not vocab_parallel and class_weights is None and "d" not in coef
            and transform.softcap is None and not transform.has_temperature)


LOAD_COEF = ("lse", "a", "b", "c")  # the head's outputs that dZ formed on the GEMMs' load reads


class TileValues(NamedTuple):
    """dZ [n, V] as the logits GEMM's tile values `e` and what forms dZ from them on the gradient GEMMs' operand
    load (each twin's `tile_dlogits.dz_on_load`): the tile maxima `m_tiles` [n, T] of tiles `tile_n` wide, the
    safe targets `y` and the head's `coef` (LOAD_COEF; [n] each). The GEMMs then read no dZ array. Either twin's
    arrays."""
    e: Any
    m_tiles: Any
    y: Any
    coef: dict
    tile_n: int

    @property
    def shape(self):
        return self.e.shape

    @property
    def device(self):
        return self.e.device

    def arrays(self):
        """What the kernels read beside e: m_tiles, y, lse, a, b, c."""
        return self.m_tiles, self.y, *(self.coef[k] for k in LOAD_COEF)

"""The checks of the public arguments (docs/SPEC.md "Bad input"), once for both twins.

The twins describe each array as an `ArrayDesc` (shape, dtype name, kind) and call these; every failure is a
ValueError naming the argument. Value checks that need the data (targets in range, finite class weights) are
the twins' own: torch runs them in one host synchronization, JAX when the values are concrete.
"""
from dataclasses import dataclass

from .options import ENGINES

REDUCTIONS = ("mean", "sum", "none")
FLOAT_NAMES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ArrayDesc:
    """What the checks need of an array: shape, dtype name ("float32", "int64", ...) and kind: "float",
    "int", "bool", "complex" or "other"."""
    shape: tuple
    dtype: str
    kind: str


def check_options(reduction, label_smoothing, z_loss, softcap) -> None:
    """The FLCE options (shared by the drop-ins)."""
    check_reduction(reduction)
    check_smoothing(label_smoothing)
    if not z_loss >= 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    check_softcap(softcap)


def check_reduction(reduction) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_smoothing(label_smoothing) -> None:
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def check_softcap(softcap) -> None:
    if softcap is not None and not softcap > 0.0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")


# The largest softcap c under which the fused engine takes label smoothing: a logit at most 2 c below its tile's
# max keeps a normal tile value exp(z - m_t) (float32's and bfloat16's 2**-126; float16's 2**-14), from which
# the softcap's derivative at that logit is recovered.
FUSED_SOFTCAP_WITH_SMOOTHING = 43.0
FUSED_SOFTCAP_WITH_SMOOTHING_F16 = 4.8


def resolve_engine(engine, *, label_smoothing=0.0, softcap=None, dtype="float32", gpu=True) -> str:
    """The engine that runs a call: `engine` itself where it is "library" or "fused", and for "auto" the fused
    engine where it applies and is measured (16-bit inputs on a GPU, options it takes), else the library one.

    - The fused engine takes label smoothing only under a softcap of at most FUSED_SOFTCAP_WITH_SMOOTHING
      (float16 inputs, whose tile values are float16: FUSED_SOFTCAP_WITH_SMOOTHING_F16); asked for by name
      beyond it, it is a ValueError (docs/NUMERICS.md, "The fused engine").
    - "auto" keeps the library engine for float32 inputs, whose fused GEMMs (IEEE float32 in Triton and
      Pallas) took 24-46x the library's time on the H100 (bench/results/nvidia-h100/engine-auto/), and off the
      GPU (`gpu` False), where the interpreters would run the fused engine's GEMMs and the library's are the
      CPU's own."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    limit = FUSED_SOFTCAP_WITH_SMOOTHING_F16 if dtype == "float16" else FUSED_SOFTCAP_WITH_SMOOTHING
    fused_takes = not (label_smoothing > 0 and softcap is not None and softcap > limit)
    if engine == "auto":
        return "fused" if fused_takes and gpu and dtype in ("bfloat16", "float16") else "library"
    if engine == "fused" and not fused_takes:
        raise ValueError(f'engine="fused" takes label_smoothing with a softcap of at most {limit} for {dtype} '
                         f'inputs, got softcap={softcap}; use engine="library"')
    return engine


def check_cpo_options(loss_type, beta, alpha, label_smoothing, loss_types) -> None:
    if loss_type not in loss_types:
        raise ValueError(f"loss_type must be one of {tuple(loss_types)}, got {loss_type!r}")
    if not beta > 0.0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not alpha >= 0.0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    check_smoothing(label_smoothing)


def check_temperature(temperature) -> None:
    if not temperature > 0.0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")


def check_arrays(x: ArrayDesc | None, weight: ArrayDesc | None, targets: ArrayDesc | None,
                 bias: ArrayDesc | None = None, class_weights: ArrayDesc | None = None,
                 *, array: str = "tensor") -> tuple[int, int]:
    """Shapes and dtypes of the inputs (None: not an array of the framework). Returns (H, V)."""
    if x is None or x.dtype not in FLOAT_NAMES:
        raise ValueError(f"x must be a float32/bfloat16/float16 {array}, got {_name(x)}")
    if weight is None or weight.dtype not in FLOAT_NAMES:
        raise ValueError(f"weight must be a float32/bfloat16/float16 {array}, got {_name(weight)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if len(x.shape) < 1 or len(weight.shape) != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be [V, H] with H = x.shape[-1]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    vocab, hidden = weight.shape
    if vocab < 1 or hidden < 1:
        raise ValueError(f"weight must have at least one row and one column (V, H >= 1), got {tuple(weight.shape)}")
    if targets is None or targets.kind != "int":
        raise ValueError(f"targets must be an integer {array}, got {_name(targets)}")
    if tuple(targets.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal x's leading shape {tuple(x.shape[:-1])}")
    for name, a in (("bias", bias), ("class_weights", class_weights)):
        if a is not None and (a.kind != "float" or tuple(a.shape) != (vocab,)):
            raise ValueError(f"{name} must be a float {array} of shape ({vocab},), got "
                             f"{a.dtype} {tuple(a.shape)}")
    return hidden, vocab


def check_pair_batch(x: ArrayDesc | None) -> None:
    """x of a preference loss: [2B, T, H], B chosen sequences then B rejected ones."""
    if x is None or len(x.shape) != 3:
        raise ValueError(f"x must be [2B, T, H], got shape {None if x is None else tuple(x.shape)}")
    if x.shape[0] % 2:
        raise ValueError(f"x's batch must be even (B chosen, then B rejected), got {x.shape[0]}")


def check_normalizer(normalizer) -> None:
    """`normalizer`: None, a number or a 0-d array (D = n), or a pair (D, n)."""
    if normalizer is None:
        return
    items = normalizer if isinstance(normalizer, (tuple, list)) else (normalizer,)
    if len(items) not in (1, 2):
        raise ValueError(f"normalizer must be a scalar or a pair (D, n), got {len(items)} values")
    for item in items:
        shape = getattr(item, "shape", ())
        if tuple(shape) != () or isinstance(item, (bool, str)):
            raise ValueError(f"normalizer values must be scalars, got {item!r}")


def target_error(vocab: int, ignore_index: int) -> ValueError:
    return ValueError(f"targets must be in [0, {vocab}) or ignore_index={ignore_index}")


def class_weights_error() -> ValueError:
    return ValueError("class_weights must be finite")


def _name(a: ArrayDesc | None) -> str:
    return "a non-array" if a is None else f"{a.dtype} {tuple(a.shape)}"

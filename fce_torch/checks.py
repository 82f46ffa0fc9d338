"""The argument checks of the torch twin: `fce_core.contract` on torch tensors, and the one host check of the
values. Twin: fce_jax/checks.py."""
import torch

from fce_core.contract import ArrayDesc, check_arrays, class_weights_error, target_error

from .kernels.value_flags import value_flags


def describe(t):
    """The `ArrayDesc` of a tensor (None for anything else)."""
    if not isinstance(t, torch.Tensor):
        return None
    dt = t.dtype
    kind = ("float" if dt.is_floating_point else "complex" if dt.is_complex else "bool" if dt == torch.bool
            else "int")
    return ArrayDesc(tuple(t.shape), str(dt).removeprefix("torch."), kind)


def check_tensors(x, weight, targets, bias=None, class_weights=None):
    """Shapes, dtypes and devices of the inputs (ValueError naming the argument). Returns (H, V)."""
    hidden, vocab = check_arrays(describe(x), describe(weight), describe(targets), describe(bias),
                                 describe(class_weights))
    for name, t in (("weight", weight), ("targets", targets), ("bias", bias), ("class_weights", class_weights)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return hidden, vocab


def check_values(targets, vocab, ignore_index, class_weights=None):
    """The one host synchronization: targets outside [0, V) other than ignore_index, non-finite class weights
    (`kernels.value_flags`, one launch). Returns the number of valid targets (not ignore_index), which lets
    the engine skip the ignored rows."""
    flags = value_flags(targets, vocab, ignore_index, class_weights).tolist()
    if flags[0]:
        raise target_error(vocab, ignore_index)
    if len(flags) > 2 and flags[2]:
        raise class_weights_error()
    return flags[1]

"""The argument checks of the torch twin: `fce_core.contract` on torch tensors, and the one host check of the
values. Twin: fce_jax/checks.py."""
import torch

from fce_core.contract import ArrayDesc, check_arrays, class_weights_error, resolve_engine, target_error

from .kernels.value_flags import value_flags


def describe(t):
    """The `ArrayDesc` of a tensor (None for anything else)."""
    if not isinstance(t, torch.Tensor):
        return None
    dt = t.dtype
    kind = ("float" if dt.is_floating_point else "complex" if dt.is_complex else "bool" if dt == torch.bool
            else "int")
    return ArrayDesc(tuple(t.shape), str(dt).removeprefix("torch."), kind)


def engine_for(engine, x, **options):
    """`fce_core.contract.resolve_engine` for a call on x (its working dtype and device) with these options."""
    return resolve_engine(engine, dtype=describe(x).dtype, gpu=x.is_cuda, **options)


def check_tensors(x, weight, targets, bias=None, class_weights=None):
    """Shapes, dtypes and devices of the inputs (ValueError naming the argument). Returns (H, V)."""
    hidden, vocab = check_arrays(describe(x), describe(weight), describe(targets), describe(bias),
                                 describe(class_weights))
    for name, t in (("weight", weight), ("targets", targets), ("bias", bias), ("class_weights", class_weights)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return hidden, vocab


class HostRead:
    """A small device tensor's values for the host, copied to pinned memory behind the work queued so far: `get`
    waits for the device to reach the copy, not for the work queued after it."""

    def __init__(self, t):
        self._ready = None
        if t.is_cuda:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = t
        self._values = None

    def get(self):
        """The values as a list (the host waits here, the first time)."""
        if self._values is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._values = self._host.tolist()
        return self._values


class ValueCheck:
    """fce_torch's one host check of the values (targets outside [0, V) other than ignore_index, non-finite
    class weights: ValueError), started on the device and read by the host when the engine first needs the
    count of valid rows (`valid_rows`), at the latest at the end of its sweep. The flags reach the host through
    a `HostRead`, so the host waits for the device to reach the check, not for the work queued after it: a
    synchronization before the first chunk left the device idle while the host set that chunk up (about
    0.8 ms a step at (16384, 2048, 128256), bench/results/nvidia-h200/epilogue-overlap/).
    Every kernel reads targets outside [0, V) as 0, so work launched before the error is raised is harmless.

    `scalars`: the FLCE reduction scalars float32 [n, n, V] on the device (`kernels.value_flags`)."""

    def __init__(self, targets, vocab, ignore_index, class_weights=None):
        self.vocab, self.ignore_index = vocab, ignore_index
        flags, self.scalars = value_flags(targets, vocab, ignore_index, class_weights)
        self._flags = HostRead(flags)

    def valid_rows(self):
        """The number of targets that are not ignore_index (the host waits for the check here, once); raises
        ValueError for a target outside [0, V) or a non-finite class weight."""
        flags = self._flags.get()
        if flags[0]:
            raise target_error(self.vocab, self.ignore_index)
        if len(flags) > 2 and flags[2]:
            raise class_weights_error()
        return flags[1]

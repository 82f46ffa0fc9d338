"""Zero-copy torch <-> JAX through DLPack, with every copy explicit.

The parity suite hands *the same device memory* to both twins: the inputs are made once in torch and JAX
reads them through DLPack. This module is the only place where that happens, so that nothing converts
or copies silently on a hot path.

What DLPack does, measured (jax 0.10.2 / jaxlib CPU, torch 2.13 CPU; the same calls on CUDA):

* ``jax.dlpack.from_dlpack(t)`` of a contiguous float32 / bfloat16 / float16 / int32 tensor aliases it
  (``t.data_ptr() == a.unsafe_buffer_pointer()``), and ``torch.from_dlpack(a)`` aliases the JAX buffer.
  Writes through the torch tensor are visible in the JAX array (JAX assumes its arrays are immutable:
  never write to a tensor while a JAX array views it).
* **Alignment (CPU):** JAX's CPU client only aliases buffers whose address is a multiple of 64 bytes.
  A view that starts elsewhere (``buf[1:]`` of a float32 buffer) is *copied* by default and raises with
  ``copy=False``. Fresh torch CPU allocations are 64-byte aligned, so tensors made by ``make_inputs``
  alias. On CUDA, the caching allocator returns 256-byte aligned blocks.
* **Strides:** JAX accepts only compact layouts (any permutation of a row-major buffer, e.g. ``t.T``);
  slices such as ``t[:, 1:]`` raise ``JaxRuntimeError``. We require plain row-major contiguity
  (``t.is_contiguous()``), so both twins see the same layout; anything else is a ``ValueError``
  unless ``copy=True``.
* **int64:** with ``jax_enable_x64`` off, JAX converts an int64 tensor to int32 *silently, with a copy*,
  even when asked for ``copy=False``. :func:`to_jax` therefore refuses int64 when x64 is off and
  :func:`targets_to_jax` converts explicitly (after a range check).
* **requires_grad:** torch refuses to export such tensors (``BufferError``). We ``detach()`` explicitly:
  the detached tensor shares the memory (still zero-copy), and the JAX array is outside autograd.
* ``jax.dlpack.from_dlpack(t, copy=True)`` did *not* copy an aligned CPU tensor in jax 0.10.2; so when a
  copy is what we want, we make it in torch (``t.contiguous()`` / ``t.clone()``) and import that.

``copy`` arguments below mean "a copy is allowed when zero-copy is impossible", never "always copy".
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CPU_ALIGNMENT",
    "BridgeError",
    "x64_enabled",
    "to_jax",
    "targets_to_jax",
    "to_torch",
    "same_memory",
    "data_pointer",
]

#: JAX's CPU client aliases a DLPack buffer only when its address is a multiple of this (bytes).
CPU_ALIGNMENT = 64

_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1


class BridgeError(ValueError):
    """A tensor cannot cross the bridge without a copy (or at all); the message says why and what to do."""


def _jax():
    import jax
    import jax.dlpack  # noqa: F401  (submodule import)

    return jax


def x64_enabled() -> bool:
    """Whether JAX keeps 64-bit types (``jax_enable_x64``)."""
    jax = _jax()
    try:
        return bool(jax.config.read("jax_enable_x64"))
    except Exception:
        return bool(getattr(jax.config, "jax_enable_x64", False))


def _describe(t) -> str:
    return (f"tensor(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device}, "
            f"stride={tuple(t.stride())}, storage_offset={t.storage_offset()})")


def data_pointer(a) -> int | None:
    """Address of the first element of a single-device JAX array, or None when it has no single buffer."""
    try:
        return int(a.unsafe_buffer_pointer())
    except Exception:  # sharded, deleted, or a tracer
        return None


def same_memory(t, a) -> bool:
    """True when torch tensor ``t`` and JAX array ``a`` start at the same address on the same kind of device.

    An empty tensor has no meaningful address; two empty arrays compare False.
    """
    if t.numel() == 0 or a.size == 0:
        return False
    ptr = data_pointer(a)
    if ptr is None:
        return False
    try:
        (dev,) = a.devices()
        jax_kind = "cpu" if dev.platform == "cpu" else "cuda"
    except Exception:
        return False
    torch_kind = "cpu" if t.device.type == "cpu" else "cuda"
    return torch_kind == jax_kind and int(t.data_ptr()) == ptr


def _from_dlpack(t, *, must_alias: bool):
    """``jax.dlpack.from_dlpack`` asking JAX not to copy when ``must_alias`` (keyword exists in jax >= 0.4.3x)."""
    jax = _jax()
    try:
        if must_alias:
            try:
                return jax.dlpack.from_dlpack(t, copy=False)
            except TypeError:  # an old jax without the keyword
                return jax.dlpack.from_dlpack(t)
        return jax.dlpack.from_dlpack(t)
    except BridgeError:
        raise
    except ValueError as e:
        if "align" in str(e):
            raise BridgeError(
                f"to_jax: JAX would have to copy {_describe(t)}: its address {t.data_ptr():#x} is not "
                f"{CPU_ALIGNMENT}-byte aligned (JAX's CPU client copies such buffers). Pass copy=True to "
                f"allow the copy, or hand over an aligned tensor (t.clone())."
            ) from e
        raise BridgeError(f"to_jax: JAX cannot import {_describe(t)} through DLPack: {e}") from e
    except Exception as e:  # JaxRuntimeError (no backend for that device, unsupported layout, ...)
        raise BridgeError(
            f"to_jax: JAX cannot import {_describe(t)} through DLPack ({type(e).__name__}: {e}). "
            f"A CUDA tensor needs a JAX built with the CUDA backend; JAX devices: {_jax_devices()}."
        ) from e


def _jax_devices() -> str:
    try:
        return ", ".join(str(d) for d in _jax().devices())
    except Exception as e:  # pragma: no cover
        return f"<unavailable: {e}>"


def to_jax(t, *, copy: bool = False):
    """A JAX array viewing the memory of torch tensor ``t`` (zero-copy), or a ``BridgeError`` saying why not.

    * ``requires_grad`` tensors are detached explicitly (same memory; the JAX array is outside autograd).
    * Non-contiguous tensors raise, unless ``copy=True``: then ``t.contiguous()`` (a copy, in torch, on the
      same device) is imported instead.
    * A CPU tensor not aligned to :data:`CPU_ALIGNMENT` bytes raises, unless ``copy=True`` (JAX copies it).
    * int64 / uint64 with x64 off raise: use :func:`targets_to_jax` for integer targets. Other dtypes pass
      through unchanged (bool, int8..int32, float16/bfloat16/float32/float64 (float64 needs x64)).

    With ``copy=False`` (the default) the result is guaranteed to alias ``t``: this is verified after the
    import (:func:`same_memory`) and a ``BridgeError`` is raised if JAX copied anyway.
    """
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"to_jax expects a torch.Tensor, got {type(t).__name__}")
    if t.requires_grad:
        t = t.detach()  # explicit: shares the memory, leaves autograd
    if t.dtype in (torch.int64, torch.uint64, torch.float64, torch.complex128) and not x64_enabled():
        hint = ("use parity.bridge.targets_to_jax for integer targets (explicit int32 conversion after a "
                "range check)" if t.dtype in (torch.int64, torch.uint64)
                else "convert in torch first if a copy is intended")
        raise BridgeError(
            f"to_jax: {_describe(t)} has a 64-bit dtype but jax_enable_x64 is off; JAX would narrow it to "
            f"32 bits with a silent copy. {hint}, or enable x64."
        )
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg() if copy else _raise_lazy(t)
    if not t.is_contiguous():
        if not copy:
            raise BridgeError(
                f"to_jax: {_describe(t)} is not contiguous; zero-copy needs a row-major contiguous tensor. "
                f"Pass copy=True to import t.contiguous() (a copy), or call .contiguous() yourself."
            )
        t = t.contiguous()  # the documented copy
    if copy:
        a = _from_dlpack(t, must_alias=False)
        return a
    a = _from_dlpack(t, must_alias=True)
    if t.numel() > 0 and not same_memory(t, a):
        raise BridgeError(
            f"to_jax: JAX copied {_describe(t)} on import (address {t.data_ptr():#x}; JAX buffer "
            f"{data_pointer(a)}); pass copy=True if a copy is acceptable."
        )
    return a


def _raise_lazy(t):
    raise BridgeError(f"to_jax: {_describe(t)} has a lazy conj/neg bit; pass copy=True to materialize it.")


def targets_to_jax(t, *, check_range: bool = True):
    """Integer targets for JAX: zero-copy when JAX can hold the dtype, else an explicit int32 copy.

    * int8/int16/int32/uint8 (and int64 with x64 on): zero-copy through :func:`to_jax`.
    * int64 with x64 off: checks that every value fits in int32 (one host sync; skip with
      ``check_range=False`` when the caller knows), converts in torch on the same device
      (``t.to(torch.int32)``, a copy) and imports that. This is a setup-time conversion, not a hot path.

    Non-contiguous targets are made contiguous as part of that conversion only; otherwise they raise like
    :func:`to_jax`.
    """
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"targets_to_jax expects a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise BridgeError(f"targets_to_jax: targets must have an integer dtype, got {_describe(t)}")
    t = t.detach()
    if t.dtype in (torch.int64, torch.uint64, torch.uint32) and not (t.dtype == torch.int64 and x64_enabled()):
        if check_range and t.numel() > 0:
            lo, hi = int(t.min()), int(t.max())
            if lo < _INT32_MIN or hi > _INT32_MAX:
                raise BridgeError(
                    f"targets_to_jax: values in [{lo}, {hi}] do not fit in int32 (jax_enable_x64 is off); "
                    f"enable x64 or remap the targets."
                )
        t = t.to(dtype=torch.int32, memory_format=torch.contiguous_format)  # the documented copy
    return to_jax(t)


def to_torch(a: Any, *, copy: bool = False):
    """A torch tensor viewing the buffer of single-device JAX array ``a`` (zero-copy).

    The tensor aliases JAX memory: do not write to it (JAX arrays are immutable, and XLA may reuse or
    donate the buffer). ``copy=True`` returns ``clone()`` of the view instead, which is safe to mutate.
    Tracers (inside ``jit``/``grad``) and multi-device arrays raise ``BridgeError``.
    """
    import torch

    jax = _jax()
    tracer = getattr(getattr(jax, "core", None), "Tracer", None)
    if tracer is not None and isinstance(a, tracer):
        raise BridgeError("to_torch: got a JAX tracer; call it on concrete arrays, outside jit/grad.")
    if not isinstance(a, jax.Array):
        raise TypeError(f"to_torch expects a jax.Array, got {type(a).__name__}")
    if len(a.devices()) != 1:
        raise BridgeError(f"to_torch: array of shape {a.shape} spans {len(a.devices())} devices; "
                          f"DLPack needs a single-device array.")
    try:
        t = torch.from_dlpack(a)
    except Exception as e:
        raise BridgeError(f"to_torch: torch cannot import JAX array {a.shape} {a.dtype} "
                          f"on {a.devices()}: {type(e).__name__}: {e}") from e
    return t.clone() if copy else t

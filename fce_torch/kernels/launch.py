"""How fce_torch's Triton kernels are launched: `kernel[grid](*args, **constexprs)` as with Triton's own
`@triton.jit` functions, but once a specialization has been launched, later launches of it go straight to the
compiled kernel's launcher. Twin: fce_jax/kernels/launch.py.

Why: where the host sets the pace (a fused fwd+bwd of 256 rows makes ten launches against about 1.5 ms of
kernels), Triton's `JITFunction.run` spends more than the launch on each call: options and a cache key built
anew, hooks and knobs looked up, launch metadata, a check of the kernel's global variables. On a slow GPU host
(H100, bench/results/nvidia-h100/launch-path/probe/) `JITFunction.run` took 0.92 ms of a 2.78 ms fwd+bwd at
(256, 4096, 128256), of which the launcher itself 0.42; through this path the call took 2.38 ms. On a host fast
enough that the device sets the pace the two paths take the same time (`launch-path/fast-host/`).

The specialization still comes from Triton's own binder, so a launch takes the kernel that Triton would have
chosen (alignment, integer and constexpr specialization) and that Triton compiled on its first launch;
tests/test_launch.py checks, over a stand-in driver, that both paths hand the launcher the same kernels, grids
and arguments. Triton's path is kept where it does more than launch: under the interpreter (TRITON_INTERPRET=1,
whose functions are not compiled) and while a launch hook is set (a profiler's, which must see every launch).
"""
import functools

from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction


def _hooked():
    """Whether a launch hook is set (Triton gives None or a chain of calls, depending on its version)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


class Kernel:
    """A `@triton.jit` function (`fn`) launched as `kernel[grid](*args, **kwargs)`: Triton compiles and launches
    a specialization's first launch, whose compiled kernel is kept here (per device, specialization and launch
    options); the later ones call its launcher with the arguments that Triton's binder bound."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled = {}

    def __getitem__(self, grid):
        return functools.partial(self._launch, tuple(grid))

    def _launch(self, grid, *args, **kwargs):
        fn = self.fn
        if not isinstance(fn, JITFunction) or _hooked():
            fn[grid](*args, **kwargs)
            return
        device = driver.active.get_current_device()
        binder = fn.device_caches[device][-1]
        bound, specialization, options = binder(*args, **kwargs)
        key = (device, tuple(specialization), tuple(options.items()))
        compiled = self._compiled.get(key)
        if compiled is None:
            self._compiled[key] = fn[grid](*args, **kwargs)
            return
        x, y, z = grid + (1,) * (3 - len(grid))
        compiled.run(x, y, z, driver.active.get_current_stream(device), compiled.function, compiled.packed_metadata,
                     None, None, None, *bound.values())


def launched(fn):
    """`Kernel(fn)`, as a decorator over `@triton.jit`."""
    return Kernel(fn)

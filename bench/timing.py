"""Median time and peak extra device memory of one benchmark cell, for torch closures and JAX functions.

Both take several input sets and rotate through them, so that no repetition reuses the previous one's inputs
from cache, and both warm up first (compilation, autotuning) outside of what they report.

- torch on CUDA: each repetition is bracketed by CUDA events (device time, launch gaps included); gradients are
  dropped (``.grad = None``) before every call, so each call allocates fresh gradient buffers. Peak memory is
  ``max_memory_allocated()`` during one call minus what was allocated before it (the inputs): the gradients
  count, as everything else the call allocates does, for every implementation alike.
- torch on CPU: wall clock per call; no memory figure.
- JAX: ``jax.jit(f).lower(...).compile()`` once, warm-up, then the calls back to back, the next one always
  queued behind the running one: a call's time is the wall clock between its predecessor's end and its own
  (both seen by ``block_until_ready``), its device time with launch gaps included, as the torch events
  measure; the memory is the compiled program's temp buffers plus its outputs (the gradients)
  (``memory_analysis()``), its arguments excluded. No memory figure on the CPU backend.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

from bench.common import Settings


@dataclasses.dataclass
class Measurement:
    ms: float  # median over the repetitions
    extra_bytes: int | None  # peak extra device memory; None where not measured (CPU)
    value: float | None  # the loss of the first input set, to check that implementations agree


def _clear_grads(args: Sequence[Any]) -> None:
    for a in args:
        if getattr(a, "grad", None) is not None:
            a.grad = None


def _scalar(out: Any) -> float | None:
    """The loss from what a closure returned: a tensor/array, a tuple starting with one, or None."""
    while isinstance(out, (tuple, list)) and out:
        out = out[0]
    return None if out is None else float(out)


class Stopwatch:
    """Times consecutive torch steps: CUDA events on the GPU (read once at the end), wall clock on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> None:
        self.marks.append((self._start, self._now()))

    def times_ms(self) -> list[float]:
        if not self.cuda:
            return [(end - start) * 1e3 for start, end in self.marks]
        import torch

        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in self.marks]


def measure_torch(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], *, settings: Settings) -> Measurement:
    """Time ``fn(*args)`` over rotating ``arg_sets`` and measure its peak extra memory on the first set."""
    try:
        return _measure_torch(fn, arg_sets, settings=settings)
    finally:  # also after an OOM: leave no gradient behind for the next cell
        for args in arg_sets:
            _clear_grads(args)


def _measure_torch(fn, arg_sets, *, settings):
    import torch

    cuda = settings.gpu
    k = len(arg_sets)
    for i in range(settings.warmup):
        _clear_grads(arg_sets[i % k])
        fn(*arg_sets[i % k])

    args = arg_sets[0]
    _clear_grads(args)
    extra = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    value = _scalar(fn(*args))
    if cuda:
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base

    watch = Stopwatch(cuda)
    for r in range(settings.reps):
        args = arg_sets[r % k]
        _clear_grads(args)
        watch.start()
        fn(*args)
        watch.stop()
    return Measurement(statistics.median(watch.times_ms()), extra, value)


def measure_jax(fn: Callable[..., Any], arg_sets: Sequence[Sequence[Any]], *, settings: Settings) -> Measurement:
    """Compile ``fn`` for the shapes of ``arg_sets[0]``, then time it over rotating ``arg_sets``, back to back."""
    import jax

    compiled = jax.jit(fn).lower(*arg_sets[0]).compile()
    extra = None
    if jax.default_backend() != "cpu":
        stats = compiled.memory_analysis()
        extra = None if stats is None else int(stats.temp_size_in_bytes + stats.output_size_in_bytes)
    k = len(arg_sets)
    # the warm-up runs as the timed calls do, so that the allocator already holds what two calls in flight need
    _back_to_back(compiled, [arg_sets[i % k] for i in range(settings.warmup)])
    value = _scalar(jax.block_until_ready(compiled(*arg_sets[0])))
    times = _back_to_back(compiled, [arg_sets[r % k] for r in range(settings.reps)])
    return Measurement(statistics.median(times), extra, value)


def _back_to_back(compiled, calls: Sequence[Sequence[Any]]) -> list[float]:
    """Run ``compiled`` on each argument set with the next call always queued behind the running one (as a
    training loop's host runs ahead of the device, at most one call ahead here, so that no more than two
    calls' outputs are alive); call i's time is the wall clock between calls i-1 and i finishing, which is its
    device time while the host keeps the queue full. A first, untimed call fills the queue."""
    import jax

    if not calls:
        return []
    running = compiled(*calls[0])
    times, done = [], None
    for args in calls:
        queued = compiled(*args)
        jax.block_until_ready(running)
        now = time.perf_counter()
        if done is not None:
            times.append((now - done) * 1e3)
        done, running = now, queued
    jax.block_until_ready(running)
    times.append((time.perf_counter() - done) * 1e3)
    return times


def free_torch_cache(settings: Settings) -> None:
    """Give the torch allocator's cached blocks back (between cells, and before JAX takes the GPU)."""
    import gc

    gc.collect()
    if settings.gpu:
        import torch

        torch.cuda.empty_cache()

"""Pallas Mosaic GPU launches (TMA operand loads, warp-specialized wgmma pipelines, persistent programs) and
their CPU run in Mosaic GPU's interpret mode. The torch counterpart: fce_torch/kernels/tma.py (Triton's TMA).

The interpreter runs a block's warpgroups as threads whose barrier waits block XLA CPU's thread pool: with too
few pool threads (sized by PJRT_NPROC, else the core count, when JAX starts) a wait can hold the thread that
the arriving warpgroup needs, and the run deadlocks (seen with 2 cores), so a smaller pool is refused
(`INTERPRETER_POOL_THREADS`; tests/conftest.py sets PJRT_NPROC).

It also needs four things the GPU gives for free, set here once:
- a core count (the CPU device has none): two programs, so that the persistent loops loop;
- zeros for a TMA load past an array's end (`out_of_bounds_reads="uninitialized"`, zero-filled memory), as the
  tensor memory accelerator reads them;
- the in-bounds part of a TMA store that crosses an array's end, which the hardware writes and the
  interpreter (jax 0.10 and 0.11) drops whole (`_store_in_bounds_part`);
- wgmma of a transposed shared-memory operand (`plgpu.transpose_ref`, dW's dZᵀ), which its wgmma does not read
  (`_wgmma_reads_transposes`).
"""
import functools
import os

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from .fastmath import MOSAIC
from .launch import interpret_mode

SHARED_BYTES = 216 * 1024  # of the H200's 227 KiB per block: the pipeline's stages and the epilogue's tiles
INTERPRETER_PROGRAMS = 2
COMPUTE_WGS = 2  # compute warpgroups of a block, in every kernel here (the memory warpgroup after them)
# setmaxnreg of a block's warpgroups, per thread: the memory warpgroup's, and each compute warpgroup's
# share of the rest of the register file (as emit_pipeline_warp_specialized shares it)
MEMORY_REGISTERS = 40
COMPUTE_REGISTERS = (512 - MEMORY_REGISTERS) // COMPUTE_WGS // 8 * 8
INTERPRETER_POOL_THREADS = 8  # blocked at once at most: a launch's callback and 3 warpgroups, with room to spare
ROW0_MULTIPLE = 8  # a first row of tile values in whole 8-row tiles of the blocks' shared-memory layout


@functools.lru_cache(maxsize=None)
def _cores():
    return jax.devices()[0].core_count


def asm():
    """fastmath's `asm` in a Mosaic GPU kernel: its instructions on the GPU, plain operations in the interpreter."""
    return False if interpret_mode() else MOSAIC


def row0_aligned(row0, row0_multiple):
    """Whether tile values' first row `row0` (an int, or traced: a multiple of the caller's `row0_multiple`) is a
    multiple of ROW0_MULTIPLE."""
    return (row0 if isinstance(row0, int) else row0_multiple) % ROW0_MULTIPLE == 0


def programs(items):
    """Persistent programs for `items` work items: at most one per streaming multiprocessor."""
    return max(1, min(items, INTERPRETER_PROGRAMS if interpret_mode() else _cores()))


def transforms(block_minor, dtype):
    """The SMEM tiling and swizzle of a block whose minor dimension holds `block_minor` elements."""
    swizzle = plgpu.find_swizzle(block_minor * jax.numpy.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jax.numpy.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def stages(cfg, per_stage_bytes, fixed_bytes):
    """The pipeline depth: cfg.num_stages, fewer where that many stages would not fit next to `fixed_bytes`."""
    return max(1, min(cfg.num_stages, (SHARED_BYTES - fixed_bytes) // per_stage_bytes))


def pingpong_barriers(stages_):
    """The ring's barriers of `pingpong`: `loaded` (each compute warpgroup's per stage, two copies' arrivals)
    and `consumed` (per stage)."""
    return dict(loaded=plgpu.Barrier(num_arrivals=2, num_barriers=COMPUTE_WGS * stages_),
                consumed=plgpu.Barrier(num_barriers=stages_))


def pingpong(items, steps, stages_, loaded, consumed, *, origin, load, mma, epilogue, acc_shape, prologue=None,
             loader_warps=4):
    """The ping-pong schedule, inside a block's scope over its warpgroups ("wg"; the memory warpgroup last):
    the program's items (a persistent loop over `items`, collective over "sm") alternate between the two
    compute warpgroups, so that one's epilogue runs under the other's wgmma.

    The memory warpgroup fills one ring of `stages_` stages with the K steps of the program's items in order,
    `load(at, s, slot, barrier)` issuing step s's two copies of item `at = origin(item)`; each stage's arrival
    is signalled on a barrier of the item's owner's (`loaded`), so that a warpgroup waits on every phase of
    its own barriers and on no other's. The owner runs `prologue(at)` (its value: `state`), `mma(acc, slot)`
    per step with one wgmma group left in flight (the previous step's stage released on `consumed` once the
    next is issued), then `epilogue(at, acc, state)`. The loader runs in the memory warpgroup's `loader_warps`:
    4 (the warpgroup), or 1 on the GPU (a warp's scope, as fce_torch's loader warp; the interpreter runs no core_map
    inside a kernel, so it takes 4). Each warpgroup's loop sits in a branch of its own after
    its setmaxnreg: where the branches joined inside the loop, ptxas ignored both, and a 64x256 float32
    accumulator spilled under the 168 registers a thread left."""
    if stages_ < 2:
        raise ValueError(f"a ping-pong ring needs 2 stages or more (a step's stage is released once the next step's "
                         f"wgmma is issued), got {stages_}")
    wg = lax.axis_index("wg")

    def each_item(body):
        @plgpu.nd_loop((items,), collective_axes="sm")
        def _item(info):
            body(info.local_index, origin(info.index[0]))

    def stage(i, s):  # the ring's count of the program's i-th item's K step s, its slot, its arrival barrier
        ring_step = i * steps + s
        slot = lax.rem(ring_step, stages_)
        return ring_step, slot, loaded.at[lax.rem(i, COMPUTE_WGS) * stages_ + slot]

    def loader(count, loop):  # `count`: the program's items
        @loop
        def _load(i, at):
            @pl.loop(0, steps)
            def _step(s):
                ring_step, slot, arrived = stage(i, s)
                pl.when(ring_step >= stages_)(lambda: plgpu.barrier_wait(consumed.at[slot]))
                load(at, s, slot, arrived)

        # the releases that no later load waited for: the loader observes every phase too
        filled = count * steps
        for slot in range(stages_):
            pl.when(filled > slot)(lambda at=slot: plgpu.barrier_wait(consumed.at[at]))

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
        program, programs = lax.axis_index("sm"), lax.axis_size("sm")
        count = lax.div(items - program + programs - 1, programs)
        if loader_warps == 4 or interpret_mode():
            loader(count, each_item)
            return

        def warp_items(body):  # each_item in a warp's scope, where no axis but the warp's has a name
            @pl.loop(0, count)
            def _item(i):
                body(i, origin(program + i * programs))

        @pl.core_map(plgpu.WarpMesh(axis_name="warp"))
        def _one_warp():
            pl.when(lax.axis_index("warp") == 0)(lambda: loader(count, warp_items))

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

        @each_item
        def _owned(i, at):
            @pl.when(lax.rem(i, COMPUTE_WGS) == wg)
            def _():
                state = prologue(at) if prologue is not None else None

                @functools.partial(pl.run_scoped, acc=plgpu.ACC(acc_shape, jax.numpy.float32))
                def _acc(acc):
                    @pl.loop(0, steps)
                    def _step(s):
                        _, slot, arrived = stage(i, s)
                        plgpu.barrier_wait(arrived)
                        mma(acc, slot)
                        plgpu.wgmma_wait(1)
                        pl.when(s > 0)(lambda: plgpu.barrier_arrive(consumed.at[stage(i, s - 1)[1]]))

                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(consumed.at[stage(i, steps - 1)[1]])
                    epilogue(at, acc, state)


def kernel(body, *, out_type, programs, compute_threads, approx_math=False):
    """A Mosaic GPU kernel of `programs` blocks named "sm", each of `compute_threads` compute warpgroups and
    one memory warpgroup named "wg". Operands that are `jax.Ref`s are updated in place. `approx_math`: exp2
    as `ex2.approx.ftz.f32` (fastmath.ex2's instruction), the other transcendentals approximate too."""
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=approx_math)
    interpret = False
    if interpret_mode():
        _check_pool()
        _store_in_bounds_part()
        _wgmma_reads_transposes()
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret = InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")
    mesh = plgpu.Mesh(grid=(programs,), grid_names=("sm",), num_threads=compute_threads + 1, thread_name="wg")
    return pl.kernel(body, out_type=out_type, mesh=mesh, compiler_params=params, interpret=interpret)


def _check_pool():
    threads = int(os.environ.get("PJRT_NPROC") or os.environ.get("NPROC") or os.cpu_count() or 1)
    if threads < INTERPRETER_POOL_THREADS:
        raise RuntimeError(
            f"Mosaic GPU's interpret mode can deadlock in XLA CPU's thread pool of {threads} threads (its barrier "
            f"waits block pool threads): set PJRT_NPROC={INTERPRETER_POOL_THREADS} or more before JAX starts")


def in_place(ref_values):
    """`jax.Ref`s in global memory holding these arrays, for a kernel to update."""
    return [jax.new_ref(v, memory_space=plgpu.GMEM) for v in ref_values]


@functools.cache
def _store_in_bounds_part():
    """The interpreter's TMA store (`copy_smem_to_gmem`) writes the part of the block inside the array, as the
    hardware does, instead of skipping a block that crosses the array's end."""
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory

    store = shared_memory.GPUSharedMemory.store_buffer_content

    def store_in_bounds(self, key, rnge, value, global_core_id, increment_clock=True, logging_info=None):
        done = store(self, key, rnge, value, global_core_id, increment_clock, logging_info)
        if not done[0]:
            with self.lock:
                self.mem[key].set_in_bounds_portion(rnge, value)
        return done

    shared_memory.GPUSharedMemory.store_buffer_content = store_in_bounds


@functools.cache
def _wgmma_reads_transposes():
    """The interpreter's wgmma, acc += a @ b on its shared-memory operands, also for an operand read through
    `plgpu.transpose_ref` (jax 0.10 and 0.11 read only sliced operands)."""
    import numpy as np
    from jax._src.pallas.mosaic.interpret import utils
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb
    from jax._src.state.types import TransposeTransform

    wgmma = cb.wgmma

    def read(memory, key, transforms, thread):
        transforms = cb._remove_noop_transforms(transforms)
        perms = [t.permutation for t in transforms if isinstance(t, TransposeTransform)]
        rest = jax.tree.map(int, tuple(t for t in transforms if not isinstance(t, TransposeTransform)))
        value = memory.get_buffer_content(cb.HostAllocationKey.from_array(key), utils.to_range(rest), thread)[0]
        for perm in perms:
            value = np.transpose(value, perm)
        return value

    def wgmma_any(*, a_transforms, b_transforms, **kw):
        if not any(isinstance(t, TransposeTransform) for t in (*a_transforms, *b_transforms)):
            return wgmma(a_transforms=a_transforms, b_transforms=b_transforms, **kw)
        memory = cb._get_shared_memory()
        thread = memory.get_global_thread_id(int(kw["device_id"]), int(kw["thread_id"]))
        a = read(memory, kw["a_allocation_key_as_array"], a_transforms, thread)
        b = read(memory, kw["b_allocation_key_as_array"], b_transforms, thread)
        acc_key = cb.HostAllocationKey.from_array(kw["acc_allocation_key_as_array"])
        acc_range = utils.to_range(jax.tree.map(int, cb._remove_noop_transforms(kw["acc_transforms"])))
        acc = memory.get_buffer_content(acc_key, acc_range, thread)[0]
        memory.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=kw["acc_dtype"]), thread)
        return kw["token"]

    cb.wgmma = wgmma_any

"""Operands of the GEMM kernels loaded by the tensor memory accelerator (TMA; `GemmConfig.tma`), and the
persistent launch (`GemmConfig.persistent`). Speed only: a descriptor's load of a block past the array's end
reads zeros, the values of the masked pointer loads it replaces, so both give the same bits."""
import functools

import torch
import triton
import triton.language as tl
from triton.experimental.gluon import language as gl
from triton.tools.tensor_descriptor import TensorDescriptor

# The element types of arrays that a kernel stores into, passed as constexprs: its arguments may be descriptors.
ELEMENT_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def column_halves(t):
    """A [BM, BN] tile's left and right [BM, BN // 2] halves: the blocks that the kernels' epilogues store by
    descriptor (a whole float32 tile's staging would not fit in shared memory next to the pipeline)."""
    return t.reshape([t.shape[0], 2, t.shape[1] // 2]).permute(0, 2, 1).split()


@triton.jit
def tile_origin(tile, n_m, n_n, BM: tl.constexpr, BN: tl.constexpr, ROWS_FAST: tl.constexpr):
    """The first row and column of output tile `tile` on the n_m x n_n grid of BM x BN tiles: row blocks walked
    fastest where ROWS_FAST (`fce_core.plan.rows_fast`), else column blocks."""
    if ROWS_FAST:
        r0 = (tile % n_m) * BM
        c0 = (tile // n_m) * BN
    else:
        r0 = (tile // n_n) * BM
        c0 = (tile % n_n) * BN
    return r0, c0


def shared_layout(block, dtype):
    """The NVMMA shared layout of a Gluon kernel's TMA block (the widest swizzle that its rows allow)."""
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def tma_ready(*arrays):
    """Whether TMA can load or store every array of 2 or more dimensions: unit last stride, 16-byte aligned
    start and other strides."""
    return all(a.dim() >= 2 and a.stride(-1) == 1 and a.data_ptr() % 16 == 0
               and all(st * a.element_size() % 16 == 0 for st in a.stride()[:-1]) for a in arrays)


def descriptors(arrays_blocks, cfg):
    """A descriptor per (array, block shape) when the config asks for TMA and every array and block allows it
    (a block's rows of 16 bytes at least: an int8 lo plane's on the interpreter's narrow tiles are not), else
    the arrays themselves (the kernels then use masked pointer loads); and whether they are descriptors."""
    arrays = [a for a, _ in arrays_blocks]
    wide = all(block[-1] * a.element_size() >= 16 for a, block in arrays_blocks)
    if not (cfg.tma and wide and tma_ready(*arrays)):
        return arrays, False
    return [TensorDescriptor.from_tensor(a, list(block)) for a, block in arrays_blocks], True


SHARED_BYTES = 200 * 1024  # of the H200's 227 KiB per block, the rest for the epilogue's layout changes


def stages(cfg, itemsize):
    """The pipeline depth for operands of `itemsize` bytes: cfg.num_stages, fewer where that many stages of
    (tile_m + tile_n) x tile_k operands would not fit in shared memory (float32 at 128x256x64)."""
    per_stage = (cfg.tile_m + cfg.tile_n) * cfg.tile_k * itemsize
    return max(1, min(cfg.num_stages, SHARED_BYTES // per_stage))


@functools.lru_cache(maxsize=None)
def _processors(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def processors(device):
    """The streaming multiprocessors of `device`; two off the GPU, so that the interpreter's persistent
    programs loop too."""
    if device.type != "cuda":
        return 2
    return _processors(device.index if device.index is not None else torch.cuda.current_device())


def sm90(device):
    """Whether `device` is an sm_90 GPU (the Gluon kernels' wgmma and TMA)."""
    return device.type == "cuda" and _capability(device.index if device.index is not None
                                                 else torch.cuda.current_device()) == 9


@functools.lru_cache(maxsize=None)
def _capability(device_index):
    return torch.cuda.get_device_capability(device_index)[0]


def programs(n_tiles, cfg, device):
    """Programs to launch for `n_tiles` output tiles: one each, or with `cfg.persistent` at most
    `cfg.programs_per_sm` per `processors(device)`, each computing every that-many-th tile."""
    return min(n_tiles, processors(device) * cfg.programs_per_sm) if cfg.persistent else n_tiles

"""fce_torch's GEMM kernels compiled for the H200 (sm_90a) on this CPU, with the ptxas that the triton wheel
ships: their epilogues must not spill registers (a pointer tensor of a whole output tile beside the
accumulator spilled kilobytes per thread, bench/results/nvidia-h200/epilogue-registers/), and the tile merge
must compile where its launch specializes; so must the logits GEMM's Gluon ping-pong kernel
(fce_torch/kernels/logit_tiles_gluon.py), the Gluon kernel of dW's (hi, lo) accumulation
(fce_torch/kernels/grad_gemms_gluon.py) and the Gluon prototype of the (hi, lo) accumulation
(tools/gluon_dw.py). Compiled in a subprocess (one for all the cases): this process runs the kernels in the Triton
interpreter."""
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fce_core.config import MERGE_ROWS
from fce_torch.sums import row_sum

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from ptxas_usage import ptxas_usage  # noqa: E402  (tools/ is no package)


def _compiled(kernel, signature, constants, warps=8, stages=3, aligned=()):
    for name in constants:
        signature[name] = "constexpr"
    attrs = {(list(signature).index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(ASTSource(kernel, signature, constants, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def _spilled(kernel, signature, constants, warps=8, stages=3, aligned=()):
    """Bytes of spill stores per thread of the kernel compiled for sm_90a."""
    return ptxas_usage(_compiled(kernel, signature, constants, warps, stages, aligned).asm["ptx"])[1]


# The launches' own: FLATTEN as fce_torch's tiles set it (grad_gemms.flattened), unsliced K (dW, dX of one slice).
@pytest.mark.parametrize("mode, first, bm, bn, c_dt, a_t", [
    (2, False, 256, 128, "bf16", True), (2, False, 128, 256, "bf16", True), (2, True, 128, 256, "bf16", True),
    (0, False, 128, 256, "bf16", False),
    (0, False, 256, 128, "bf16", True), (1, False, 128, 256, "fp32", True)])
def test_grad_gemm_epilogue_does_not_spill(mode, first, bm, bn, c_dt, a_t, in_compiler):
    assert in_compiler("grad", mode, first, bm, bn, c_dt, a_t) == 0


@pytest.mark.parametrize("a_t", [False, True])
def test_grad_gemm_forming_dz_on_load_does_not_spill(a_t, in_compiler):
    """dX and dW written with dZ formed on the operand load, on their launch (GRAD_GEMM_TORCH_ON_LOAD: 128x256,
    not flattened): the tile values' transform fits in the registers beside the accumulator."""
    assert in_compiler("grad", 0, False, 128, 256, "bf16", a_t, False, False, True) == 0


@pytest.mark.parametrize("sliced", [False, True])
def test_grad_gemm_loops_flatten_where_k_is_unsliced(sliced, in_compiler):
    """FLATTEN pipelines the tile loop and its K loop as one (the next tile's loads overlap this tile's
    epilogue: dW of 256 rows 0.71 -> 0.54 ms on the H200) only where the K loop's bounds are the same for
    every item: with them taken from the item's slice, Triton left the loops nested and the flag did nothing."""
    assert in_compiler("grad_loop_depth", sliced) == (2 if sliced else 1)


def _grad_loop_depth(sliced):
    """The deepest nesting of scf.for loops in the sm_90a TTGIR of a flattened dW launch."""
    ir = _grad(0, False, 128, 256, "bf16", True, sliced=sliced, compiled=True).asm["ttgir"]
    stack, deepest = [], 0  # one entry per open region: whether an scf.for opened it
    for line in ir.splitlines():
        loop = line.lstrip().startswith("scf.for ") or " = scf.for " in line
        for ch in line:
            if ch == "{":
                stack.append(loop)
                loop = False
            elif ch == "}":
                stack.pop()
            deepest = max(deepest, sum(stack))
    return deepest


def _grad(mode, first, bm, bn, c_dt, a_t, sliced=False, compiled=False, on_load=False):
    from fce_core.config import GRAD_GEMM_TORCH, GRAD_GEMM_TORCH_ON_LOAD
    from fce_torch.kernels import grad_gemms
    c_block = f"[{bm},{bn // 2}]"
    sig = dict(a_ptr=f"tensordesc<bf16[64,{bm}]>" if a_t else f"tensordesc<bf16[{bm},64]>", s_am="i32",
               s_ak="i32", b_ptr=f"tensordesc<bf16[64,{bn}]>", s_bk="i32", s_bn="i32",
               c_ptr=f"tensordesc<{c_dt}{c_block}>", lo_ptr=f"tensordesc<{'i8' if mode == 2 else c_dt}{c_block}>",
               s_cm="i32", M="i32", N="i32", K="i32", SLICE_K="i32", n_slices="i32", mt_ptr="*fp32", y_ptr="*i64",
               lse_ptr="*fp32", ca_ptr="*fp32", cb_ptr="*fp32", cc_ptr="*fp32", dz_rows="i32", V="i32",
               n_tiles="i32")
    dt = tl.bfloat16 if c_dt == "bf16" else tl.float32
    consts = dict(MODE=mode, FIRST=first, PRECISION="ieee", BM=bm, BN=bn, BK=64, EVEN_K=True, TMA=True, A_T=a_t,
                  C_DESC=True, C_DT=dt, PLANES=False, ROWS_FAST=False,
                  FLATTEN=grad_gemms.flattened(GRAD_GEMM_TORCH_ON_LOAD if on_load else GRAD_GEMM_TORCH, mode),
                  SLICED=sliced, ON_LOAD=on_load, TILE_N=256,
                  ASM=True)
    return (_compiled if compiled else _spilled)(grad_gemms._gemm_kernel.fn, sig, consts)


@pytest.mark.parametrize("store, q, flatten", [(True, False, False), (False, False, False), (True, True, False),
                                               (True, False, True), (True, True, True)])
def test_logits_gemm_epilogue_does_not_spill(store, q, flatten, in_compiler):
    """The statistics epilogue, plain and with smoothing's q and the entropy's pz (taken a half tile at a time),
    in the default launch and flattened."""
    assert in_compiler("logits", store, q, False, flatten) == 0


def test_logits_gemm_epilogue_sums_rows_in_registers(in_compiler):
    """The row sums' pairwise tree in the wgmma layout: its pairs four and eight columns wide lie in other lanes
    of the warp, and warp shuffles add them. Added as splits, each sum's tile went through shared memory in 32
    rounds of two barriers (this kernel, with q and pz: 211 barriers and 96 vector loads from shared memory;
    27 and 0 now)."""
    barriers, shared_loads = in_compiler("logits_epilogue")
    assert shared_loads == 0 and barriers < 32


def test_row_sum_adds_each_pair_alone(in_compiler):
    """`sums.row_sum` on the GPU sums each pair as a reduction over an axis of two: its PTX adds two registers
    at each step and nothing else (no identity, which would turn a pair of -0 into +0, no constant)."""
    adds, constants = in_compiler("row_sum_adds")
    assert adds > 0 and constants == 0


@triton.jit
def _row_sums(x_ptr, out_ptr, ASM: tl.constexpr):
    rows = tl.arange(0, 16)
    v = tl.load(x_ptr + rows[:, None] * 8 + tl.arange(0, 8)[None, :])
    tl.store(out_ptr + rows, row_sum(v, 16, 8, 3, ASM))


def _row_sum_adds():
    """(adds of two registers, float immediates) in the PTX of row_sum over [16, 8], one warp."""
    ptx = _compiled(_row_sums, dict(x_ptr="*fp32", out_ptr="*fp32"), dict(ASM=True), warps=1).asm["ptx"]
    body = ptx[ptx.index("{"):]
    return len(re.findall(r"add\.f32\s+%r\d+, %r\d+, %r\d+;", body)), len(re.findall(r"\b0f[0-9A-F]{8}\b", body))


def _logits_epilogue():
    """(barriers, vector loads from shared memory) in the PTX of the logits GEMM with q and pz."""
    ptx = _logits(True, q=True, compiled=True).asm["ptx"]
    return ptx.count("bar.sync"), ptx.count("ld.shared.v4")


def _logits(store, q=False, compiled=False, flatten=False, stages=3):
    from fce_torch.kernels import logit_tiles
    sig = dict(x_ptr="tensordesc<bf16[128,64]>", w_ptr="tensordesc<bf16[256,64]>", bias_ptr="*bf16",
               y_ptr="*i32", cw_ptr="*fp32", e_ptr="tensordesc<bf16[128,128]>", stride_e="i32", m_ptr="*fp32",
               s_ptr="*fp32", arg_ptr="*i32", zy_ptr="*fp32", q_ptr="*fp32", pz_ptr="*fp32", n_rows="i32",
               V="i32", H="i32", n_tiles="i32", softcap="fp32", temperature="fp32")
    consts = dict(HAS_BIAS=False, HAS_SOFTCAP=False, HAS_TEMP=False, HAS_CW=False, HAS_Q=q, HAS_PZ=q,
                  STORE=store, PRECISION="ieee", BM=128, BN=256, BK=64, LOG2_BN=8, EVEN_K=True, TMA=True,
                  E_DESC=store, E_DT=tl.bfloat16, FLATTEN=flatten, ASM=True)
    return (_compiled if compiled else _spilled)(logit_tiles._logit_tiles_kernel.fn, sig, consts, stages=stages)


def test_logits_gemm_for_few_rows_fits(in_compiler):
    """GEMM_SHORT's launch (a chunk of at most SHORT_ROWS rows, 4 stages): no spills, and its shared memory within
    the 227 KiB of a block on sm_90."""
    spilled, shared = in_compiler("logits_short")
    assert spilled == 0 and 200 * 1024 < shared <= 227 * 1024


def _logits_short():
    from fce_core.config import GEMM_SHORT
    compiled = _logits(True, compiled=True, stages=GEMM_SHORT.num_stages)
    return ptxas_usage(compiled.asm["ptx"])[1], compiled.metadata.shared


@pytest.mark.parametrize("zy_tiles, q, pz", [(True, False, False), (False, True, True)])
def test_merge_tiles_compiles(zy_tiles, q, pz, in_compiler):
    """The tile merge with T = V / 256 a multiple of 16 (V = 262144), which the launch specializes on: a
    reduction accumulated in its loop failed Triton 3.6's thread-locality pass there (on the H200). No spills
    with its sums' block totals (sm_90a)."""
    assert in_compiler("merge", zy_tiles, q, pz) == 0


def _merge(zy_tiles, q, pz):
    from fce_torch.kernels import logit_tiles
    sig = {name: "*fp32" for name in ("m_ptr", "s_ptr", "q_ptr", "pz_ptr", "amax_ptr", "zyt_ptr", "wt_ptr", "big_ptr",
                                      "zy_ptr", "arg_ptr", "ss_ptr", "sq_ptr", "spz_ptr")}
    sig.update(amax_ptr="*i32", arg_ptr="*i32", n_rows="i32", n_tiles="i32", V="i32")
    consts = dict(ZY_TILES=zy_tiles, HAS_Q=q, HAS_PZ=pz, HAS_CW=False, TILE_N=256, BR=MERGE_ROWS.block, BT=128,
                  LOG2_BT=7, NB=8, LOG2_NB=3, ASM=True)  # T = 1024 tiles: 8 blocks of 128
    return _spilled(logit_tiles._merge_tiles_kernel.fn, sig, consts, warps=MERGE_ROWS.num_warps,
                    aligned=list(sig)[:16])


# The compiler process's loop: it answers each line of stdin, [kind, args], with a line of stdout that starts with
# _MARK (the compilers may print too), until stdin closes.
_MARK = "fce-sm90-case "
_SERVE = f"""import json, sys, traceback
from tests import test_sm90_registers as t
for line in sys.stdin:
    kind, args = json.loads(line)
    try:
        reply = {{"value": getattr(t, "_" + kind)(*args)}}
    except Exception:
        reply = {{"error": traceback.format_exc()}}
    print({_MARK!r} + json.dumps(reply), flush=True)
"""


class _Compiler:
    """What a case's function `_kind` returns (bytes spilled per thread, or counts in its PTX), compiled with the
    interpreter off, in one process for the module's cases, each case's error its own (a process per case spent
    most of its 5 s starting torch and triton). A process that ended in an earlier case is started anew."""

    def __init__(self):
        self.proc = self.stderr = None

    def __call__(self, kind, *args):
        if self.proc is not None and self.proc.poll() is not None:
            self.close()
        if self.proc is None:
            self.stderr = tempfile.TemporaryFile("w+")
            self.proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                         env={**os.environ, "TRITON_INTERPRET": "0"},
                                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        try:
            self.proc.stdin.write(json.dumps([kind, args]) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it ended: its stderr below
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                reply = json.loads(line[len(_MARK):])
                assert "error" not in reply, reply["error"][-3000:]
                return reply["value"]
        self.stderr.seek(0)
        raise AssertionError(f"the compiler process ended (exit {self.proc.wait()}):\n{self.stderr.read()[-3000:]}")

    def close(self):
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()
        self.proc = self.stderr = None


@pytest.fixture(scope="module")
def in_compiler():
    compiler = _Compiler()
    yield compiler
    compiler.close()


def _gluon_dw(schedule, first):
    """(shared bytes, registers, spilled bytes) of tools/gluon_dw.py's accumulation kernel (or its first chunk's):
    plain or warp-specialized on 256x128x32 tiles in 5 stages, ping-pong on 128x128x64 in 3, with an epilogue
    partition or the epilogue interleaved with the next tile's K loop on 128x256x32 in 4, with dZ's scale formed
    in a partition of its own on 256x128x32 in 3 (`tx`)."""
    import gluon_dw
    tiles = {"pingpong": (128, 128, 64, 3), "ep": (128, 256, 32, 4), "il": (128, 256, 32, 4),
             "tx": (256, 128, 32, 3)}.get(schedule, (256, 128, 32, 5))
    compiled = gluon_dw._compile(*tiles, first=first, last=False, ws=schedule == "ws",
                                 pingpong=schedule == "pingpong", ep=schedule == "ep", il=schedule == "il",
                                 tx=schedule == "tx")
    regs, spill_stores, spill_loads = ptxas_usage(compiled.asm["ptx"])
    return compiled.metadata.shared, regs, spill_stores + spill_loads


@pytest.mark.parametrize("schedule, first", [("plain", False), ("ws", False), ("ws", True), ("pingpong", False),
                                             ("pingpong", True), ("ep", False), ("ep", True), ("il", False),
                                             ("il", True), ("tx", False), ("tx", True)])
def test_gluon_dw_prototype_compiles_without_spills(schedule, first, in_compiler):
    """The Gluon prototype of the (hi, lo) accumulation (a development tool, bench/results/nvidia-h100/dw-epilogue/)
    compiles for sm_90a with this Triton, within the block's shared memory and without spilling."""
    shared, _, spilled = in_compiler("gluon_dw", schedule, first)
    assert shared <= 232448 and spilled == 0


def _gluon_logits(options):
    """(shared bytes, registers, spilled bytes) of the logits GEMM's ping-pong kernel on LOGITS_PINGPONG's
    launch with the named epilogue options (tools/gluon_logits.py's OPTIONS)."""
    import gluon_logits
    from fce_core.config import LOGITS_PINGPONG
    option = next(o for o in gluon_logits.OPTIONS if o[0] == options)
    shared, regs, spill_stores, spill_loads = gluon_logits.usage(LOGITS_PINGPONG, *option[1:])
    return shared, regs, spill_stores + spill_loads


@pytest.mark.parametrize("options", ["loss", "q pz", "no store"])
def test_logits_pingpong_compiles_without_spills(options, in_compiler):
    """fce_torch's logits GEMM on sm_90 (the ping-pong kernel) compiles within the block's shared memory and,
    for the loss's partials, smoothing's and entropy's, and without e stored, without spilling: ptxas holds each
    partition to 168 registers, and the epilogue's column blocks (LOGITS_PINGPONG.parts, parts_q_pz) are sized
    for that. With class weights it spills 32 bytes a thread (measured faster than the Triton kernel anyway)."""
    shared, regs, spilled = in_compiler("gluon_logits", options)
    assert shared <= 232448 and regs <= 168 and spilled == 0


def _gluon_grads(mode):
    """(shared bytes, registers, spilled bytes) of a gradient GEMM on its Gluon kernel, GRAD_GEMM_GLUON's launch,
    for the mode named in tools/gluon_grads.py's MODES."""
    import gluon_grads
    from fce_core.config import GRAD_GEMM_GLUON
    shared, regs, spill_stores, spill_loads = gluon_grads.usage(GRAD_GEMM_GLUON, mode)
    return shared, regs, spill_stores + spill_loads


@pytest.mark.parametrize("mode", ["dx", "dx planes", "dw", "first", "acc", "last"])
def test_gluon_grads_compile_without_spills(mode, in_compiler):
    """fce_torch's Gluon kernel of the gradient GEMMs (dX into its rows or float32 planes, dW written, the (hi, lo)
    accumulation's first chunk, an accumulation and the last one) compiles within the block's shared memory and
    without spilling under the 168 registers a thread that ptxas holds each partition to."""
    shared, regs, spilled = in_compiler("gluon_grads", mode)
    assert shared <= 232448 and regs <= 168 and spilled == 0

"""`fused_token_logprobs`: per-token log-probabilities and entropy (docs/SPEC.md §4) on the engine, for RL and
distillation losses written on the [N] vectors. The forward computes the rows; the backward sweeps again with
their cotangents (rows whose cotangents are all zero count as ignored there, so chunks of them are skipped).
Twin: fce_jax/logprobs.py."""
from typing import Optional

import torch

from fce_core import docs
from fce_core.docs import doc
from fce_core.contract import check_softcap, check_temperature
from fce_core.options import LogprobOptions
from fce_core.sweeps import logprob_setup

from .api import prepare
from .autodiff import absent, finish_grads, grads_fake, register_recompute
from .checks import check_tensors, engine_for, ValueCheck
from . import arrays
from .engine import sweep
from .kernels.grad_gemms import accumulates_pair
from .kernels.logprob_head import logprob_head
from .vocab_parallel import comm_for, resolve

F32 = torch.float32
Tensor = torch.Tensor


def logprobs_sweep(x, w, y, bias, opt, *, entropy, grads=(False, False, False), g=None, h=None, validate=True,
                   comm=None):
    """(rows {lse, logp, entropy, ...}, dx, dw, db); with cotangents g (logp) and h (entropy), the rows whose
    cotangents are all zero take no part (they count as ignored). `comm`: vocab parallel (w, bias: a shard)."""
    head, inputs, plan = logprob_setup(arrays, logprob_head, x.shape, x.element_size(), w.shape[0], y, opt,
                                       entropy=entropy, need_grads=any(grads),
                                       dw_pair=accumulates_pair(w.dtype), g=g, h=h, comm=comm)
    vocab = w.shape[0] if comm is None else comm.vocab
    check = ValueCheck(inputs["y"], vocab, opt.ignore_index) if validate else None
    return sweep(x, w, bias, None, head, inputs, plan, grads=grads, transform=opt.transform,
                 ignore_index=opt.ignore_index, check=check, comm=comm, engine=opt.engine)


def _options(ignore_index, softcap, temperature, chunk_rows, engine):
    return LogprobOptions(ignore_index=ignore_index, softcap=softcap, temperature=temperature, chunk_rows=chunk_rows,
                          engine=engine)


def _logprobs_body(x: Tensor, w: Tensor, bias: Optional[Tensor], y: Tensor, ignore_index: int,
                   softcap: Optional[float], temperature: float, chunk_rows: Optional[int], engine: str,
                   validate: bool, vp_group: Optional[str], vp_offsets: list[int],
                   entropy: bool) -> tuple[Tensor, Tensor]:
    """(logp, entropy or an empty stand-in) of every row."""
    opt = _options(ignore_index, softcap, temperature, chunk_rows, engine)
    with torch.autocast(x.device.type, enabled=False):
        rows, *_ = logprobs_sweep(x, w, y, bias, opt, entropy=entropy, validate=validate,
                                  comm=comm_for(vp_group, vp_offsets, w, validate))
    return rows["logp"], rows["entropy"] if entropy else absent(x)


logprobs_op = torch.library.custom_op("fce::token_logprobs", _logprobs_body, mutates_args=())


@logprobs_op.register_fake
def _(x, w, bias, y, ignore_index, softcap, temperature, chunk_rows, engine, validate, vp_group, vp_offsets,
      entropy):
    row = x.new_empty((x.shape[0],), dtype=F32)
    return row, torch.empty_like(row) if entropy else absent(x)


@torch.library.custom_op("fce::token_logprobs_grads", mutates_args=())
def logprobs_grads_op(x: Tensor, w: Tensor, bias: Optional[Tensor], y: Tensor, ignore_index: int,
                      softcap: Optional[float], temperature: float, chunk_rows: Optional[int], engine: str,
                      validate: bool, vp_group: Optional[str], vp_offsets: list[int], entropy: bool,
                      g_logp: Optional[Tensor], g_entropy: Optional[Tensor],
                      needs: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, db) in the parameters' dtypes for the cotangents of logp and of the entropy."""
    opt = _options(ignore_index, softcap, temperature, chunk_rows, engine)
    needs = [needs[0], needs[1], needs[2] and bias is not None]
    with torch.autocast(x.device.type, enabled=False):
        g = torch.zeros(x.shape[0], device=x.device, dtype=F32) if g_logp is None else g_logp
        _, dx, dw, db = logprobs_sweep(x, w, y, bias, opt, entropy=g_entropy is not None, grads=tuple(needs), g=g,
                                       h=g_entropy, validate=validate, comm=comm_for(vp_group, vp_offsets, w, validate))
    return finish_grads(dx, dw, db, x, w, bias, needs)


@logprobs_grads_op.register_fake
def _(x, w, bias, *rest):
    return grads_fake(x, w, bias, rest[-1])


logprobs = register_recompute(logprobs_op, _logprobs_body, lambda *inputs: (0, 1) if inputs[-1] else (0,),
                              lambda inputs, cot, needs: logprobs_grads_op(*inputs, cot[0], cot.get(1), needs))


@doc(docs.LOGPROBS_SUMMARY, docs.LOGPROBS_ARGS, framework_args="""\
    vocab_parallel: a `fce_torch.VocabParallel(group)` (or a DTensor weight sharded over V), as in `fused_lce`.
    validate: check that targets are in range (one host synchronization, which also lets the engine skip the
        chunks of ignored rows, and in the backward those whose cotangents are all zero). Pass False under
        CUDA-graph capture: every chunk then runs, with the same result bits.
""", returns=docs.LOGPROBS_RETURNS + """ Gradients flow to ``x``, ``weight`` and ``bias`` for any cotangents of
both; without gradients only the forward rows are computed (one GEMM per chunk). Works under ``torch.compile``
(``fullgraph=True`` too).""", raises="""ValueError: naming the argument, for shape/dtype mismatches, bad
    options or out-of-range targets (the last only when ``validate``).""")
def fused_token_logprobs(x, weight, targets, *, bias=None, ignore_index=-100, softcap=None, temperature=1.0,
                         return_entropy=False, vocab_parallel=None, validate=True, chunk_rows=None,
                         engine="auto"):
    check_softcap(softcap)
    check_temperature(temperature)
    weight, bias, _, vp_group, vp_offsets = resolve(weight, bias, None, vocab_parallel)
    check_tensors(x, weight, targets, bias)
    lead = tuple(targets.shape)
    x2, w, y, b, _ = prepare(x, weight, targets, bias)
    engine = engine_for(engine, x2)
    args = (x2, w, b, y, int(ignore_index), None if softcap is None else float(softcap), float(temperature),
            chunk_rows, engine, bool(validate), vp_group, vp_offsets, bool(return_entropy))
    logp, entropy = logprobs(*args)
    if not return_entropy:
        return logp.view(lead)
    return logp.view(lead), entropy.view(lead)

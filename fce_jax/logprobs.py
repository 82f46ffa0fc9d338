"""`fused_token_logprobs`: per-token log-probabilities and entropy (docs/SPEC.md §4) on the engine, for RL and
distillation losses written on the [N] vectors. The forward computes the rows; the backward sweeps again with
their cotangents (rows whose cotangents are all zero count as ignored there, so chunks of them are skipped).
Twin: fce_torch/logprobs.py."""
import jax.numpy as jnp

from fce_core import docs
from fce_core.docs import doc
from fce_core.contract import check_softcap, check_temperature
from fce_core.options import LogprobOptions
from fce_core.sweeps import logprob_setup

from .api import match_axes
from . import sharding
from .autodiff import recompute
from .checks import check_tensors, check_values, check_vocab_shard, engine_for
from . import arrays
from .engine import sweep
from .kernels.grad_gemms import accumulates_pair
from .kernels.grad_scale import as_grad
from .kernels.logprob_head import logprob_head
from .vocab_parallel import comm_for

F32 = jnp.float32


def logprobs_sweep(x, w, y, bias, opt, *, entropy, grads=(False, False, False), g=None, h=None, comm=None):
    """(rows {lse, logp, entropy, ...}, dx, dw, db); with cotangents g (logp) and h (entropy), the rows whose
    cotangents are all zero take no part (they count as ignored). `comm`: vocab parallel (w, bias: a shard)."""
    head, inputs, plan = logprob_setup(arrays, logprob_head, x.shape, x.dtype.itemsize, w.shape[0], y, opt,
                                       entropy=entropy, need_grads=any(grads),
                                       dw_pair=accumulates_pair(w.dtype), g=g, h=h, comm=comm)
    return sweep(x, w, bias, None, head, inputs, plan, grads=grads, transform=opt.transform,
                 ignore_index=opt.ignore_index, comm=comm, engine=opt.engine)


def _forward(static, x, w, bias, y):
    opt, entropy, vp = static
    rows, *_ = logprobs_sweep(x, w, y, bias, opt, entropy=entropy, comm=comm_for(vp, w.shape[0]))
    return rows["logp"], rows["entropy"] if entropy else jnp.zeros((0,), F32)


def _backward(static, x, w, bias, y, *, cotangents):
    opt, entropy, vp = static
    _, dx, dw, db = logprobs_sweep(x, w, y, bias, opt, entropy=entropy, grads=(True, True, bias is not None),
                                   g=cotangents[0], h=cotangents[1] if entropy else None,
                                   comm=comm_for(vp, w.shape[0]))
    return dx, as_grad(dw, w.dtype), None if db is None else as_grad(db, bias.dtype)


@doc(docs.LOGPROBS_SUMMARY, docs.LOGPROBS_ARGS, framework="""Works under ``jax.jit``, ``jax.grad``, ``jax.vjp`` (a
custom VJP whose backward sweeps again with the cotangents of both outputs).""", framework_args="""\
    vocab_parallel: a `fce_jax.VocabParallel(axis_name)`, as in `fused_lce` (or, under plain ``jax.jit``, a
        weight split over V by its sharding).
""", returns=docs.LOGPROBS_RETURNS, raises="""ValueError: naming the argument, for shape/dtype mismatches,
    bad options, and out-of-range targets when they are concrete.""")
def fused_token_logprobs(x, weight, targets, *, bias=None, ignore_index=-100, softcap=None, temperature=1.0,
                         return_entropy=False, vocab_parallel=None, chunk_rows=None, engine="auto"):
    check_softcap(softcap)
    check_temperature(temperature)
    mesh_layout = sharding.layout(x, weight, targets) if vocab_parallel is None else None
    if mesh_layout is not None:  # a weight split over V under plain jit: vocab-parallel in a shard_map
        (x_spec, t_spec, b_spec), rows = sharding.specs(mesh_layout, x, bias)
        call = lambda x, w, t, b, vp: fused_token_logprobs(  # noqa: E731
            x, w, t, bias=b, ignore_index=ignore_index, softcap=softcap, temperature=temperature,
            return_entropy=return_entropy, vocab_parallel=vp, chunk_rows=chunk_rows, engine=engine)
        return sharding.run(mesh_layout, call, (x, weight, targets, bias),
                            (x_spec, sharding.weight_spec(mesh_layout), t_spec, b_spec),
                            (rows, rows) if return_entropy else rows)
    engine = engine_for(engine, x)
    hidden, vocab = check_tensors(x, weight, targets, bias)
    check_vocab_shard(x, targets, weight, vocab_parallel)
    check_values(targets, vocab if vocab_parallel is None else None, ignore_index)
    static = (LogprobOptions(ignore_index=int(ignore_index), softcap=None if softcap is None else float(softcap),
                             temperature=float(temperature), chunk_rows=chunk_rows, engine=engine),
              bool(return_entropy),
              vocab_parallel)
    lead = tuple(targets.shape)
    x2 = jnp.reshape(x, (-1, hidden))
    y = jnp.reshape(targets, (-1,)).astype(jnp.int32)
    weight, bias = match_axes(x2, y, weight, bias)
    logp, entropy = recompute(_forward, _backward, static, x2, weight, bias, y)
    if not return_entropy:
        return logp.reshape(lead)
    return logp.reshape(lead), entropy.reshape(lead)

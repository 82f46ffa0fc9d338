"""The engine's sweeps as torch custom ops, each with its fake (meta) function and its autograd formula, so
that autograd, ``torch.compile`` (``fullgraph=True``, no graph break) and CUDA graphs treat them as opaque.

Two shapes of autograd, as in fce_jax/autodiff.py:
- *precomputed* (`register_precomputed`): the forward sweep of a scalar loss also computes dX, dW, db and the
  op returns them as its last outputs (empty when not asked for); the backward only scales them by the
  cotangent, one rounding (`backward_grads`): in place when no later backward can read them (autograd then
  takes the tensor as `.grad` itself, so no second dW-sized buffer exists), else into a new tensor
  (`scaled_grad`, so a second backward(retain_graph=True) starts from the same values);
- *recompute* (`register_recompute`): the forward computes the outputs only; the backward calls a gradient op
  that sweeps again with the cotangents of the outputs, row by row.

Each returns the callable the API uses: the op where it is traced, and in eager calls the op's own body with
the same autograd formula as a `torch.autograd.Function`. Through the dispatcher an eager call of a custom op
with autograd goes C++ -> Python -> C++ and rebuilds the schema's argument list once per argument
(`torch._library.utils.fill_defaults`, quadratic in the 18 arguments of `fce::flce`); at N = 256, where the
host sets the pace, skipping it took 50 fwd+bwd from 2.57-3.17 to 2.19-2.62 ms a step on the H200
(bench/results/nvidia-h200/host-dispatch/). The bits are the same: the same body runs.

Op bodies turn autocast off (the caller has already cast the operands: eager and compiled calls then run the
same kernels), and only op bodies synchronize with the host (the optional target check).
"""
import torch

from .kernels.grad_scale import as_grad, scale_in_place
from .sums import traced

F32 = torch.float32


@torch.library.custom_op("fce::scaled_grad", mutates_args=())
def scaled_grad(grad: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dtype(float32(grad) * g) as a new tensor."""
    with torch.autocast(grad.device.type, enabled=False):
        return as_grad(grad, dtype, g)


@scaled_grad.register_fake
def _(grad, g, dtype):
    return grad.new_empty(grad.shape, dtype=dtype)


def _graph_kept(grad):
    """Whether the running backward keeps its graph (retain_graph=True), so the saved tensors are read again.
    Under tracing (torch.compile) the answer is unknown and taken as yes."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return traced(grad) or keep is None or keep()


def backward_grads(grads, g, dtypes):
    """The gradients a precomputed op's backward hands to autograd (None where `grads` has None):
    dtype(float32(grad) * g), each saved grad scaled in place when it has the dtype and no later backward can
    read it (all of those in one launch), else a new tensor."""
    in_place = [t is not None and t.dtype == dt and t.is_contiguous() and not _graph_kept(t)
                for t, dt in zip(grads, dtypes)]
    scale_in_place([t for t, here in zip(grads, in_place) if here], g)
    return [t if here or t is None else scaled_grad(t, g, dt) for t, dt, here in zip(grads, dtypes, in_place)]


def absent(like):
    """The stand-in an op returns for a gradient nobody asked for (ops return tensors only)."""
    return like.new_empty((0,))


def _present(t, shape):
    return t is not None and shape is not None and tuple(t.shape) == tuple(shape)


def _routed(op, body, setup_context, backward):
    """`op` when its first input is traced (torch.compile, fake tensors), else `body` as an autograd.Function
    with `op`'s autograd formula."""
    def forward(ctx, *args):  # setup_context inside: as a separate method, apply binds the args by signature
        output = body(*args)
        setup_context(ctx, args, output)
        return output

    function = type(f"Eager{body.__name__}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def call(*args):
        return op(*args) if traced(args[0]) else function.apply(*args)

    return call


def register_precomputed(op, body, n_outputs):
    """Autograd of `op` (the custom op of `body`) whose inputs start with (x, w, bias) and whose outputs are
    (loss, n_outputs - 1 outputs without gradient, dx, dw, db): the gradients of the scalar loss, computed in
    the forward. Returns the op's caller (see the module's docstring)."""

    def setup_context(ctx, inputs, output):
        x, w, bias = inputs[:3]
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*output[n_outputs:])
        ctx.shapes = (x.shape, w.shape, None if bias is None else bias.shape)
        ctx.dtypes = (x.dtype, w.dtype, None if bias is None else bias.dtype)
        ctx.n_inputs = len(inputs)

    def backward(ctx, g_loss, *unused):
        saved = ctx.saved_tensors
        g = torch.zeros((), device=saved[0].device, dtype=F32) if g_loss is None else g_loss.to(F32)
        grads = backward_grads([t if _present(t, shape) else None for t, shape in zip(saved, ctx.shapes)], g,
                               ctx.dtypes)
        return (*grads, *([None] * (ctx.n_inputs - 3)))

    op.register_autograd(backward, setup_context=setup_context)
    return _routed(op, body, setup_context, backward)


def register_recompute(op, body, differentiable, grads):
    """Autograd of `op` (the custom op of `body`) whose inputs start with (x, w, bias): `differentiable(*inputs)`
    gives the indices of the outputs that carry a gradient (the others are marked non-differentiable), and the
    backward returns `grads(inputs, cotangents, needs)` for (x, w, bias): `cotangents` maps those indices to the
    outputs' cotangents (None when unused), `needs` says which of the three autograd asks for. Returns the op's
    caller (see the module's docstring)."""

    def setup_context(ctx, inputs, output):
        ctx.keep = differentiable(*inputs)
        ctx.mark_non_differentiable(*(o for i, o in enumerate(output) if i not in ctx.keep))
        ctx.set_materialize_grads(False)
        ctx.slots = [isinstance(a, torch.Tensor) for a in inputs]
        ctx.values = [None if slot else a for a, slot in zip(inputs, ctx.slots)]
        ctx.save_for_backward(*(a for a, slot in zip(inputs, ctx.slots) if slot))

    def backward(ctx, *cotangents):
        saved = iter(ctx.saved_tensors)
        inputs = [next(saved) if slot else a for a, slot in zip(ctx.values, ctx.slots)]
        needs = [bool(n) for n in ctx.needs_input_grad[:3]]
        dx, dw, db = grads(inputs, {i: cotangents[i] for i in ctx.keep}, needs)
        return (*(t if need else None for t, need in zip((dx, dw, db), needs)), *([None] * (len(inputs) - 3)))

    op.register_autograd(backward, setup_context=setup_context)
    return _routed(op, body, setup_context, backward)


def finish_grads(dx, dw, db, x, w, bias, needs):
    """The gradients of a recompute op in their parameters' dtypes, the unasked ones as `absent`."""
    return (as_grad(dx, x.dtype) if needs[0] else absent(x), as_grad(dw, w.dtype) if needs[1] else absent(x),
            as_grad(db, bias.dtype) if needs[2] and bias is not None else absent(x))


def grads_fake(x, w, bias, needs):
    """The fake outputs of a gradient op."""
    return (x.new_empty(x.shape) if needs[0] else absent(x), w.new_empty(w.shape) if needs[1] else absent(x),
            bias.new_empty(bias.shape) if needs[2] and bias is not None else absent(x))

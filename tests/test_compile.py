"""torch.compile (docs/SPEC.md §1): the three losses and the HF hook under ``fullgraph=True`` with no graph
break, bitwise equal to eager, forward and gradients. On the CPU with the aot_eager backend (and once with
inductor); on a GPU with inductor."""
import functools

import pytest
import torch

import fce_torch
from fce_torch import hf

transformers = pytest.importorskip("transformers")


# V: 7 tiles of the interpreter's 32 columns, the last one partial (a CPU runs the kernels in Triton's interpreter,
# whose time grows with the tiles; what is tested is the compiler's view of the ops, not the vocabulary)
V = 200


def _inputs(device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(36, 32, generator=g)
    w = torch.randn(V, 32, generator=g) * 0.3
    b = torch.randn(V, generator=g) * 0.1
    y = torch.randint(0, V, (36,), generator=g)
    y[:5] = -100
    return [t.to(device, dtype) for t in (x, w, b)] + [y.to(device)]


LOSSES = {
    "mean_stats": lambda x, w, b, y, **kw: fce_torch.fused_lce(x, w, y, bias=b, z_loss=1e-4, label_smoothing=0.1,
                                                               return_stats=True, chunk_rows=8, **kw),
    "none": lambda x, w, b, y, **kw: fce_torch.fused_lce(x, w, y, bias=b, reduction="none", softcap=20.0,
                                                         chunk_rows=8, **kw),
    "logprobs": lambda x, w, b, y, **kw: fce_torch.fused_token_logprobs(x, w, y, bias=b, temperature=0.8,
                                                                        return_entropy=True, chunk_rows=8, **kw),
    "cpo": lambda x, w, b, y, **kw: fce_torch.fused_cpo_loss(x.view(2, 18, -1), w, y.view(2, 18), bias=b,
                                                             chunk_rows=8, **kw),
}


def _all_losses(x, w, b, y):
    return [fn(x, w, b, y) for fn in LOSSES.values()]


def _run(fn, tensors):
    """The outputs, and the gradients of the first output for the cotangent 1 (no user arithmetic between
    the op and autograd, whose order a compiler could change)."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*leaves)
    first = out[0] if isinstance(out, tuple) else out
    first.backward(torch.ones_like(first))
    flat = [v for o in (out if isinstance(out, tuple) else (out,))
            for v in (o.values() if isinstance(o, dict) else (o,))]
    return [o.detach() for o in flat] + [t.grad for t in leaves if t.is_floating_point()]


def _backend(device):
    return "inductor" if device == "cuda" else "aot_eager"


def test_no_graph_break(device):
    explained = torch._dynamo.explain(_all_losses)(*_inputs(device))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("engine", ["default", "fused"])
def test_fullgraph_bitwise_equal_to_eager(device, loss, engine):
    """Each loss on its default engine (float32 inputs: the library one) and on the fused engine (bfloat16)."""
    fused = engine == "fused"
    tensors = _inputs(device, torch.bfloat16 if fused else torch.float32)
    fn = functools.partial(LOSSES[loss], engine="fused") if fused else LOSSES[loss]
    eager = _run(fn, tensors)
    torch._dynamo.reset()
    compiled = _run(torch.compile(fn, fullgraph=True, backend=_backend(device)), tensors)
    assert len(eager) == len(compiled)
    for a, b in zip(eager, compiled):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_inductor_bitwise_equal_to_eager():
    """Inductor on whatever device this is (the CPU too): the ops stay opaque."""
    tensors = _inputs("cuda" if torch.cuda.is_available() else "cpu")
    eager = _run(LOSSES["mean_stats"], tensors)
    torch._dynamo.reset()
    compiled = _run(torch.compile(LOSSES["mean_stats"], fullgraph=True, backend="inductor"), tensors)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_no_grad_and_autocast_under_compile(device):
    x, w, b, y = _inputs(device)
    fn = torch.compile(lambda x, w, y: fce_torch.fused_lce(x, w, y, chunk_rows=8), fullgraph=True,
                       backend=_backend(device))
    with torch.no_grad():
        assert torch.equal(fn(x, w, y), fce_torch.fused_lce(x, w, y, chunk_rows=8))
    dtype = torch.bfloat16
    with torch.autocast(device, dtype=dtype):
        eager = fce_torch.fused_lce(x, w, y, chunk_rows=8)
        compiled = fn(x, w, y)
    assert torch.equal(eager, compiled)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_hf_model_compiles_without_graph_break(device, backend):
    """A patched HF causal LM under torch.compile(fullgraph=True): one graph; with aot_eager the eager loss and
    gradients bit for bit; with inductor (which fuses the decoder's own arithmetic differently) within float32
    rounding of eager."""
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = hf.patch(transformers.LlamaForCausalLM(config).float().to(device), validate=False)
    ids = torch.randint(0, 300, (2, 8), device=device)
    labels = ids.clone()
    labels[0, :3] = -100

    def loss(ids, labels):
        return model(input_ids=ids, labels=labels).loss

    explained = torch._dynamo.explain(loss)(ids, labels)
    assert explained.graph_break_count == 0, explained.break_reasons
    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend=backend)):
        model.zero_grad(set_to_none=True)
        out = fn(ids, labels)
        out.backward()
        results.append([out.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        if backend == "aot_eager":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_cuda_graph_capture_gives_the_eager_bits():
    """validate=False: no host synchronization, so forward and backward capture in CUDA graphs; the replay gives
    the bits of the eager call with validate=True (which skips the ignored rows' chunks)."""
    x, w, b, y = _inputs("cuda", torch.bfloat16)
    eager = _run(lambda x, w, b, y: fce_torch.fused_lce(x, w, y, bias=b, chunk_rows=8), [x, w, b, y])
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
    graphed = torch.cuda.make_graphed_callables(
        lambda x, w, b: fce_torch.fused_lce(x, w, y, bias=b, chunk_rows=8, validate=False), tuple(leaves))
    for t in leaves:
        t.grad = None
    out = graphed(*leaves)
    out.backward()
    for a, c in zip(eager, [out.detach()] + [t.grad for t in leaves]):
        assert torch.equal(a, c)

"""fce_torch.hf: a patched transformers causal LM gives the unpatched model's loss and parameter gradients.

Tiny random float32 models (hidden 32, 2 layers, vocab 300, eager attention) of every verified model_type, tied
and untied heads, labels with ignored positions and a left-padded row, with and without ``num_items_in_batch``;
plus ``shift_labels`` / ``logits_to_keep`` / ``ignore_index`` keywords, a head bias, tuple outputs, the
no-labels fallback, unpatch, and the refusals.
"""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fce_torch import hf  # noqa: E402

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
VOCAB, BATCH, SEQ = 300, 2, 8

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "final_logit_softcapping": 2.0}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "final_logit_softcapping": 2.0}),
}


def build(arch, tied, device="cpu", seed=0, **overrides):
    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides}, tie_word_embeddings=tied)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().to(device).train()
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    return model


def batch(device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, :2] = 0                                   # left padding in row 1
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[0, :3] = -100                              # a "prompt" in row 0
    labels[1, 5] = -100
    return ids.to(device), mask.to(device), labels.to(device)


def loss_and_grads(model, *args, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(*args, **inputs)
    out.loss.backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    return out, grads


def assert_same(out_ref, grads_ref, out, grads):
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, out_ref.loss.detach(), rtol=LOSS_RTOL, atol=0.0)
    assert grads.keys() == grads_ref.keys()
    for name, ref in grads_ref.items():
        got = grads[name]
        assert (got is None) == (ref is None), name
        if ref is None:
            continue
        err = ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()
        assert err <= GRAD_RTOL, f"{name}: gradient relative-norm error {err:.2e}"


CASES = [(a, t) for a in ("llama", "qwen2", "gemma2") for t in (False, True)] + \
        [("mistral", False), ("qwen3", True), ("gemma", True), ("gemma3_text", False)]


@pytest.mark.parametrize("arch,tied", CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES])
def test_matches_unpatched(arch, tied, device):
    model = build(arch, tied, device)
    ids, mask, labels = batch(device)
    n_items = torch.tensor(int((labels[:, 1:] != -100).sum()) + 3, device=device)   # as if more micro-batches followed
    for extra in ({}, {"num_items_in_batch": n_items}):
        inputs = dict(input_ids=ids, attention_mask=mask, labels=labels, **extra)
        ref, ref_grads = loss_and_grads(model, **inputs)
        assert ref.logits is not None
        hf.patch(model)
        try:
            out, grads = loss_and_grads(model, **inputs)
        finally:
            hf.unpatch(model)
        assert out.logits is None and "logits" not in out.keys()
        assert_same(ref, ref_grads, out, grads)
    if arch == "gemma2":
        assert model.config.final_logit_softcapping == 2.0


def test_fused_engine_matches_unpatched(device):
    """patch(model, engine="fused"): the loss and gradients of the unpatched model through the fused engine;
    an unknown engine is refused when patching."""
    model = build("llama", True, device)
    ids, mask, labels = batch(device)
    ref, ref_grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    with pytest.raises(ValueError, match="engine"):
        hf.patch(model, engine="cublas")
    assert not hf.is_patched(model)
    hf.patch(model, engine="fused")
    try:
        out, grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    finally:
        hf.unpatch(model)
    assert_same(ref, ref_grads, out, grads)


def test_keywords_shift_labels_logits_to_keep_ignore_index(device):
    model = build("llama", False, device)
    ids, mask, labels = batch(device)
    keep = 5
    shift = labels[:, -keep:].clone()                 # already-shifted targets for the last `keep` positions
    shift[shift == -100] = -1
    shift[0, 0] = -1
    cases = [
        dict(input_ids=ids, labels=labels, shift_labels=shift, logits_to_keep=keep, ignore_index=-1),
        dict(input_ids=ids, labels=labels, logits_to_keep=torch.tensor([0, 2, 3, 4, 6], device=device),
             shift_labels=shift, ignore_index=-1),
        dict(input_ids=ids, attention_mask=mask, labels=torch.where(labels == -100, -1, labels), ignore_index=-1,
             num_items_in_batch=7),
    ]
    for inputs in cases:
        ref, ref_grads = loss_and_grads(model, **inputs)
        hf.patch(model)
        out, grads = loss_and_grads(model, **inputs)
        hf.unpatch(model)
        assert_same(ref, ref_grads, out, grads)


def test_head_bias_positional_ids_and_tuple_output(device):
    model = build("llama", False, device)
    with torch.no_grad():
        head = torch.nn.Linear(32, VOCAB, bias=True, device=device)
        head.weight.copy_(model.lm_head.weight)
        head.bias.normal_(0.0, 0.5)
    model.lm_head = head
    ids, mask, labels = batch(device)
    ref, ref_grads = loss_and_grads(model, input_ids=ids, labels=labels)
    hf.patch(model)
    out, grads = loss_and_grads(model, ids, labels=labels)           # input_ids positional
    assert grads["lm_head.bias"] is not None
    assert_same(ref, ref_grads, out, grads)
    as_tuple = model(ids, labels=labels, return_dict=False)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], ref.loss.detach(), rtol=LOSS_RTOL, atol=0.0)
    assert not any(isinstance(t, torch.Tensor) and t.shape[-1] == VOCAB for t in as_tuple[1:])


def test_no_labels_fallback_signature_and_unpatch(device):
    model = build("gemma2", True, device)
    ids, mask, labels = batch(device)
    class_forward = type(model).forward
    signature = inspect.signature(model.forward)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        assert hf.patch(model) is model and hf.is_patched(model)
        assert hf.patch(model) is model                              # idempotent
        assert inspect.signature(model.forward) == signature         # Trainer's column filter sees the same
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, logits, rtol=0, atol=0)
        patched = model(input_ids=ids, attention_mask=mask, labels=labels)
        assert patched.logits is None and patched.loss.ndim == 0
        assert hf.unpatch(model) is model and not hf.is_patched(model)
        assert "forward" not in model.__dict__ and model.forward.__func__ is class_forward
        restored = model(input_ids=ids, attention_mask=mask, labels=labels)
        assert restored.logits is not None
        torch.testing.assert_close(restored.loss, patched.loss, rtol=LOSS_RTOL, atol=0.0)
        assert hf.unpatch(model) is model                            # unpatching twice is a no-op


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the Triton interpreter's numpy, n = 0
def test_all_labels_ignored_gives_zero(device):
    model = hf.patch(build("qwen2", True, device))
    ids, _, _ = batch(device)
    out = model(input_ids=ids, labels=torch.full_like(ids, -100))
    assert out.loss.item() == 0.0


def test_refusals():
    model = build("llama", tied=False)
    with pytest.raises(TypeError):
        hf.patch(model.model)                                         # a decoder without a head
    model.config.model_type = "not_a_verified_type"
    with pytest.raises(ValueError, match="strict=False"):
        hf.patch(model)
    assert hf.is_patched(hf.patch(model, strict=False))
    hf.unpatch(model)
    model.config.logit_scale = 0.0625                                 # Cohere-style logit rescaling
    with pytest.raises(ValueError, match="logit_scale"):
        hf.patch(model, strict=False)
    assert not hf.is_patched(model)
    ids, _, labels = batch()
    model.config.model_type = "llama"
    del model.config.logit_scale
    hf.patch(model)
    with pytest.raises(ValueError, match="labels"):
        model(input_ids=ids, labels=labels[:, :4])                    # labels not matching the positions
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(TypeError, match="hooks"):
        model(input_ids=ids, labels=labels)                           # a hook the fused path would skip
    handle.remove()

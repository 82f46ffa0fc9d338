"""Hugging Face hook: a ``transformers`` causal LM computes its training loss with `fused_lce`.

``patch(model)`` replaces the forward of one model *instance* (no transformers class is touched, no global
state is kept) so that a call with ``labels`` runs the decoder, takes its last hidden states and computes the
loss with `fused_lce` on them and the LM head (``model.lm_head.weight``, tied to the embedding table or not, and
its bias if any): the ``[tokens, vocab]`` logits are never materialized, neither in the forward nor in the
backward. Calls without ``labels`` (generation, evaluation of logits) run the original forward unchanged.
``unpatch(model)`` restores the original forward.

Loss semantics (those of transformers' ``ForCausalLMLoss`` / ``fixed_cross_entropy``):
    - the labels are shifted left by one (position t predicts token t+1), the last position gets
      ``ignore_index``: ``shift_labels = pad(labels, (0, 1), value=ignore_index)[..., 1:]``; a ``shift_labels``
      keyword, when given, is used as is instead (already shifted, as HF does for sequence parallelism);
    - ``ignore_index`` is -100, or the ``ignore_index`` keyword when one is passed;
    - without ``num_items_in_batch``: the mean over the non-ignored tokens; with it (as the ``Trainer`` passes
      under gradient accumulation): the sum over the non-ignored tokens divided by ``num_items_in_batch``;
    - ``logits_to_keep`` (``num_logits_to_keep`` in older releases) slices the hidden states before the head as
      HF does (an int keeps the last positions, 0 keeps all; a 1-D tensor keeps these positions; a 2-D integer
      tensor per-sample positions; a 2-D boolean mask the True positions). The (shifted) labels must then have
      as many elements as the kept positions, as in HF;
    - Gemma-2/3's ``config.final_logit_softcapping`` is applied (``c * tanh(logits / c)``) before the softmax.
    Documented differences: the logits are accumulated in float32 and never rounded to the model dtype (HF
    rounds the head's bfloat16 output before upcasting), so bf16 losses agree to bf16 rounding, float32 ones to
    float32 rounding; a batch where every label is ignored gives a loss of 0 (and zero gradients) where HF gives
    NaN. A custom ``model.loss_function`` is bypassed while patched.

Outputs with ``labels``: a ``CausalLMOutputWithPast`` whose ``loss`` is set and whose ``logits`` is None; the
decoder's other outputs (cache, hidden_states, attentions) are passed through. With ``return_dict=False`` (or
``config.return_dict`` False) the tuple is ``output.to_tuple()``, i.e. ``(loss, *decoder outputs)`` with no
logits entry. The patched forward keeps the original signature (``inspect.signature(model.forward)``), so the
``Trainer``'s column filtering and its ``num_items_in_batch`` detection see the model as before.

Verified (tests/test_hf.py: loss and the gradient of every parameter equal to the unpatched model's, float32,
with and without ``num_items_in_batch``, tied and untied heads): ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Gemma2ForCausalLM`` (with its final-logit softcap). Other ``model_type`` values are refused unless
``strict=False``, because a model whose forward rescales the logits (Cohere's ``logit_scale``, Granite's
``logits_scaling``, ...) would otherwise train on a silently different loss; those known rescalings are refused
even then. Patch the transformers model itself (for PEFT: before wrapping, or ``peft_model.get_base_model()``).
The loss is computed inside a call of ``model.lm_head`` (`patch` gives the head an instance forward that takes a
``fce_loss=`` keyword; without it the head is the plain linear layer), so the hooks of a head that is its own
FSDP2 unit run as usual (unshard before, reshard after, the gradients' reduce-scatter): FSDP2 works whatever
the wrapping of the head (in the root unit, its own unit, or grouped with a tied embedding; a tied head that is
its own unit without the embedding is refused, since FSDP2 would untie it). The head must be a plain
``nn.Linear`` (no LoRA on the head; hooks other than FSDP2's are refused: TypeError). Under
``torch.compile(fullgraph=True)`` the patched forward traces in one graph.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
import torch.nn.functional as F

from fce_core.options import ENGINES

from .api import fused_lce

__all__ = ["patch", "unpatch", "is_patched", "VERIFIED_MODEL_TYPES"]

#: ``config.model_type`` values whose causal-LM forward is "decoder -> slice -> lm_head [-> softcap] ->
#: ForCausalLMLoss" and that tests/test_hf.py checks against the unpatched model.
VERIFIED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"})

# Config attributes of models whose forward transforms the logits in ways fused_lce does not reproduce.
_LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier_scale",
                     "mup_width_multiplier")

_MARK = "_fce_hf_original"  # attribute on our wrapper: (had an instance-level forward, that forward)


def is_patched(model) -> bool:
    """Whether ``model``'s forward is the one installed by `patch`."""
    return hasattr(model.__dict__.get("forward"), _MARK)


def patch(model, *, strict: bool = True, validate: bool = True, chunk_rows=None, engine: str = "auto"):
    """Make ``model`` compute its ``labels`` loss with `fused_lce` (in place); returns ``model``.

    Args:
        model: a transformers causal LM (``...ForCausalLM``) with an ``nn.Linear`` ``lm_head`` and a decoder
            at ``model.base_model``.
        strict: refuse a ``config.model_type`` outside `VERIFIED_MODEL_TYPES` (ValueError). With False any
            model of that structure is accepted, on the caller's word that its forward is the standard one.
        validate: passed to `fused_lce` (checks that labels are in ``[0, V)`` or ignored; one host sync).
        chunk_rows: passed to `fused_lce`.
        engine: passed to `fused_lce` ("auto", "library" or "fused"; ValueError for another).

    Patching twice is a no-op. The loss semantics are described in the module docstring.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if is_patched(model):
        return model
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    base = getattr(model, "base_model", None)
    if config is None or not isinstance(head, torch.nn.Linear) or not isinstance(base, torch.nn.Module) \
            or base is model:
        raise TypeError(f"{type(model).__name__} is not a transformers causal LM with a decoder at "
                        "`model.base_model` and an nn.Linear `lm_head`")
    model_type = getattr(config, "model_type", None)
    if strict and model_type not in VERIFIED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not verified for fce_torch.hf (verified: "
                         f"{sorted(VERIFIED_MODEL_TYPES)}); pass strict=False if its forward is "
                         "decoder -> lm_head [-> final_logit_softcapping] -> ForCausalLMLoss")
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            raise ValueError(f"{type(model).__name__} rescales its logits (config.{name}={value!r}); "
                             "fce_torch.hf does not support it")

    had_instance_forward = "forward" in model.__dict__
    original = model.forward
    signature = inspect.signature(type(model).forward)

    output = _causal_output()
    loss_options = dict(validate=validate, chunk_rows=chunk_rows, engine=engine)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        return _forward(model, original, signature, loss_options, output, args, kwargs)

    setattr(forward, _MARK, (had_instance_forward, model.__dict__.get("forward")))
    model.forward = forward
    _install_head_loss(head)
    return model


def _install_head_loss(head):
    """Give the head an instance forward that takes ``fce_loss=``: called through the module, so that the hooks
    of a head that is its own FSDP2 unit run (unshard before, reshard after, the gradients' reduce-scatter), it
    hands its full weight and bias to the loss; without the keyword it is the head as before."""
    if hasattr(head.__dict__.get("forward"), _MARK):
        return

    def forward(hidden, *args, fce_loss=None, **kwargs):
        if fce_loss is None:
            return type(head).forward(head, hidden, *args, **kwargs)
        return fce_loss(hidden, head.weight, head.bias)

    setattr(forward, _MARK, True)
    head.forward = forward


def _remove_head_loss(head):
    if hasattr(head.__dict__.get("forward"), _MARK):
        del head.forward


def unpatch(model):
    """Restore the forward `patch` replaced (in place); returns ``model``. A no-op on an unpatched model."""
    current = model.__dict__.get("forward")
    if current is None or not hasattr(current, _MARK):
        if any(hasattr(f, _MARK) for f in _wrapped_chain(current)):
            raise RuntimeError("model.forward was wrapped again after fce_torch.hf.patch; unwrap that first")
        return model
    had_instance_forward, previous = getattr(current, _MARK)
    if had_instance_forward:
        model.forward = previous
    else:
        del model.forward
    _remove_head_loss(model.lm_head)
    return model


def _wrapped_chain(fn):
    seen = 0
    while fn is not None and seen < 32:
        yield fn
        fn = getattr(fn, "__wrapped__", None) or getattr(getattr(fn, "func", None), "__wrapped__", None)
        seen += 1


def _forward(model, original, signature, loss_options, output, args, kwargs):
    try:
        bound = signature.bind(model, *args, **kwargs)
    except TypeError:
        return original(*args, **kwargs)  # let the original forward report the bad call
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(signature.parameters)))  # self
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
        elif param.kind is inspect.Parameter.VAR_POSITIONAL and arguments.pop(name, ()):
            return original(*args, **kwargs)
    labels = arguments.pop("labels", None)
    if labels is None:
        return original(*args, **kwargs)

    logits_to_keep = arguments.pop("logits_to_keep", 0)
    logits_to_keep = arguments.pop("num_logits_to_keep", logits_to_keep)
    return_dict = arguments.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    # Like HF, the loss keywords also travel to the decoder (which ignores them).
    num_items_in_batch = arguments.get("num_items_in_batch")
    shift_labels = arguments.get("shift_labels")
    ignore_index = arguments.get("ignore_index", -100)

    head = _checked_head(model)
    outputs = model.base_model(**arguments)
    hidden = outputs[0]
    hidden = _slice(hidden, logits_to_keep)

    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    device = head.weight.device  # a head on another device (device_map)
    x = hidden.reshape(-1, hidden.shape[-1]).to(device)
    targets = shift_labels.reshape(-1).to(device)
    if targets.numel() != x.shape[0]:
        raise ValueError(f"the shifted labels have {targets.numel()} elements but {x.shape[0]} positions are kept "
                         f"(hidden states {tuple(hidden.shape)}, logits_to_keep={logits_to_keep!r})")
    loss_fn = functools.partial(_head_loss, targets=targets, ignore_index=ignore_index,
                                reduction="mean" if num_items_in_batch is None else "sum",
                                softcap=getattr(model.config, "final_logit_softcapping", None), **loss_options)
    loss = head(x, fce_loss=loss_fn)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return _output(loss, outputs, return_dict, output)


def _checked_head(model):
    """model.lm_head, if the fused path computes what it would: a plain nn.Linear whose hooks (if any) are
    FSDP2's, tied to the embedding only within one FSDP2 group."""
    head = model.lm_head
    fsdp = _is_fsdp(head)
    if not isinstance(head, torch.nn.Linear) or (not fsdp and (head._forward_hooks or head._forward_pre_hooks)):
        hooked = " with hooks" if isinstance(head, torch.nn.Linear) else ""
        raise TypeError(f"model.lm_head is now {type(head).__name__}{hooked}; fce_torch.hf computes the loss from "
                        "its weight and needs a plain nn.Linear (unpatch first)")
    _install_head_loss(head)
    embed = model.get_input_embeddings()
    if fsdp and getattr(model.config, "tie_word_embeddings", False) and not _same_fsdp_group(head, embed):
        raise ValueError("lm_head is its own FSDP2 unit but its weight is tied to the input embedding: shard them "
                         "together (fully_shard([model.get_input_embeddings(), model.lm_head])) or keep lm_head "
                         "in the root unit")
    return head


def _is_fsdp(module):
    fsdp = getattr(torch.distributed, "fsdp", None)
    return fsdp is not None and isinstance(module, getattr(fsdp, "FSDPModule", ()))


def _same_fsdp_group(a, b):
    from torch.distributed.fsdp import fully_shard

    return _is_fsdp(b) and fully_shard.state(a) is fully_shard.state(b)


def _head_loss(x, weight, bias, *, targets, ignore_index, reduction, softcap, **loss_options):
    """The loss from the head's full weight (inside the head's call); `loss_options`: patch's validate,
    chunk_rows and engine."""
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        x = x.to(weight.dtype)
    return fused_lce(x, weight, targets, bias=bias, ignore_index=ignore_index, reduction=reduction, softcap=softcap,
                     **loss_options)


def _slice(hidden, logits_to_keep):
    """transformers' ``slice_logits_to_keep`` (int, 1-D positions, 2-D positions or 2-D boolean mask)."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]
        return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        return hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:, :]
    return hidden[:, logits_to_keep, :]


def _causal_output():
    """transformers' CausalLMOutputWithPast and the names of its fields, read at patch time (outside any
    trace: torch.compile cannot trace dataclasses.fields)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast, frozenset(f.name for f in dataclasses.fields(CausalLMOutputWithPast))


def _output(loss, outputs, return_dict, output):
    if isinstance(outputs, tuple):  # a decoder configured to return tuples
        return (loss, *outputs[1:])
    output_class, fields = output
    extra = {k: v for k, v in outputs.items() if k in fields and k not in ("loss", "logits")}
    result = output_class(loss=loss, logits=None, **extra)
    return result if return_dict else result.to_tuple()

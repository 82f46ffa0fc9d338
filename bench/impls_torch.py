"""The torch implementations under test, each behind a guarded import.

A builder returns ``loss(x, weight, targets) -> scalar tensor`` (``x: [..., H]`` bf16, ``weight: [V, H]``,
``targets: [...]``, mean reduction) or raises ``Unavailable`` with the reason; ``fwd_bwd`` and ``loss_only`` turn
such a loss into the two closures that ``timing.measure_torch`` times. ``three_gemm`` / ``logits_gemm`` are the
cuBLAS reference lines (no loss): the three GEMMs of forward+backward, and the logits GEMM alone.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from bench.common import Settings, Unavailable, fce_logprobs, fce_none_rows, guarded_import

IGNORE = -100
Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# --- fused linear cross-entropy -------------------------------------------------------------------------


def fce(settings: Settings, engine: str = "auto") -> Loss:
    fused_lce = guarded_import("fce_torch", "fused_lce")
    return lambda x, w, t: fused_lce(x, w, t, engine=engine)


class Graphed:
    """A loss whose timed closures run as CUDA graphs (``graphed``): what ``torch.compile(mode="reduce-overhead")``
    or a captured training step does, where the host, not the device, would set the pace (few rows)."""

    NOTE = "CUDA graph: memory held by its pool, not measured"

    def __init__(self, loss: Loss) -> None:
        self.loss = loss

    def __call__(self, x, w, t):
        return self.loss(x, w, t)


def fce_graph(settings: Settings, engine: str = "fused") -> Loss:
    """fce_torch with ``validate=False`` (no host synchronization, so that it can be captured), as ``Graphed``."""
    if not settings.gpu:
        raise Unavailable("CUDA graphs need a CUDA GPU")
    fused_lce = guarded_import("fce_torch", "fused_lce")
    return Graphed(lambda x, w, t: fused_lce(x, w, t, engine=engine, validate=False))


def liger(settings: Settings, accum_fp32: bool = False) -> Loss:
    LigerFusedLinearCrossEntropyLoss = guarded_import("liger_kernel.transformers",
                                                      "LigerFusedLinearCrossEntropyLoss")
    mod = LigerFusedLinearCrossEntropyLoss(accum_dtype=torch.float32 if accum_fp32 else None)
    return lambda x, w, t: mod(w, x, t)


def cce(settings: Settings, filter_eps: float | str | None = "auto") -> Loss:
    if not settings.gpu:
        raise Unavailable("Cut Cross-Entropy needs a CUDA GPU")
    linear_cross_entropy = guarded_import("cut_cross_entropy", "linear_cross_entropy")
    return lambda x, w, t: linear_cross_entropy(x, w, t, filter_eps=filter_eps)


def naive(settings: Settings) -> Loss:
    """What a plain model does: bf16 logits, upcast to float32, ``F.cross_entropy``."""
    return lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t, ignore_index=IGNORE)


FLCE = {
    "fce_torch": fce,
    "fce_torch_fused": functools.partial(fce, engine="fused"),
    "fce_torch_library": functools.partial(fce, engine="library"),
    "fce_torch_fused_graph": fce_graph,
    "liger": liger,
    "liger_fp32": functools.partial(liger, accum_fp32=True),
    "cce": cce,
    "cce_nofilter": functools.partial(cce, filter_eps=None),
    "torch_naive": naive,
}


def fwd_bwd(loss: Loss) -> Callable:
    """Forward and backward into ``x.grad`` and ``weight.grad``; returns the detached loss."""

    def run(x, w, t):
        out = loss(x, w, t)
        out.backward()
        return out.detach()

    return graphed(run) if isinstance(loss, Graphed) else run


def loss_only(loss: Loss) -> Callable:
    """The loss under ``torch.no_grad()`` on detached inputs (no gradient work at all)."""

    def run(x, w, t):
        with torch.no_grad():
            return loss(x.detach(), w.detach(), t)

    return graphed(run) if isinstance(loss, Graphed) else run


def graphed(run: Callable) -> Callable:
    """``run(x, w, t)`` captured in a CUDA graph on its first call with each argument set (after two calls on a
    side stream, as capture requires), then replayed; the gradients it left are the graph's own buffers, put
    back in ``.grad`` after each replay (the timing clears them before every call)."""
    graphs: dict = {}

    def capture(x, w, t):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                x.grad = w.grad = None
                run(x, w, t)
        torch.cuda.current_stream().wait_stream(side)
        x.grad = w.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(x, w, t)
        return graph, out, (x.grad, w.grad)

    def replay(x, w, t):
        key = (x.data_ptr(), w.data_ptr(), t.data_ptr())
        if key not in graphs:
            graphs[key] = capture(x, w, t)
        graph, out, (x.grad, w.grad) = graphs[key]
        graph.replay()
        return out

    return replay


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 operands, float32 result (cuBLAS ``out_dtype``; the CPU has no such kernel, so upcast there)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def three_gemm(x: torch.Tensor, w: torch.Tensor, dz: torch.Tensor) -> None:
    """The floor of forward+backward: ``Z = x Wᵀ`` (fp32 out), ``dX = dZ W``, ``dW = dZᵀ x`` (bf16 operands)."""
    _mm_f32(x, w.T)
    torch.mm(dz, w)
    torch.mm(dz.T, x)


def logits_gemm(x: torch.Tensor, w: torch.Tensor, dz: torch.Tensor) -> None:
    """The floor of the loss alone: the logits GEMM."""
    _mm_f32(x, w.T)


# --- per-token log-probabilities and entropy -------------------------------------------------------------
# A builder returns ``rows(x, weight, targets) -> (logp, entropy)`` ([N] float32 each); fce's "none" CE rows
# (-logp, no entropy) ride along as the time that fused_token_logprobs is compared with.


def naive_logprobs(settings: Settings):
    """The plain computation: bf16 logits, upcast, ``log_softmax``, gather, entropy."""
    def rows(x, w, t):
        logp = F.linear(x, w).float().log_softmax(-1)
        tok = logp.gather(-1, t.clamp_min(0)[..., None])[..., 0]
        return torch.where(t != IGNORE, tok, 0.0), -(logp.exp() * logp).sum(-1)

    return rows


LOGPROBS = {"fce_torch": fce_logprobs("fce_torch"), "fce_torch_fused": fce_logprobs("fce_torch", "fused"),
            "fce_torch_library": fce_logprobs("fce_torch", "library"),
            "fce_torch_none": fce_none_rows("fce_torch"),
            "torch_naive": naive_logprobs}


def fwd_bwd_rows(rows: Callable, g: torch.Tensor, h: torch.Tensor) -> Callable:
    """Forward, then backward of ``sum(logp * g + entropy * h)`` (random cotangents) into x and weight."""

    def run(x, w, t):
        logp, ent = rows(x, w, t)
        total = (logp * g).sum() if ent is None else (logp * g + ent * h).sum()
        total.backward()
        return total.detach()

    return run


# --- fused linear CPO -----------------------------------------------------------------------------------


def fce_cpo(settings: Settings, beta: float, alpha: float, engine: str = "auto") -> Loss:
    fused_cpo_loss = guarded_import("fce_torch", "fused_cpo_loss")
    return lambda x, w, t: fused_cpo_loss(x, w, t, beta=beta, alpha=alpha, engine=engine)


def liger_cpo(settings: Settings, beta: float, alpha: float) -> Loss:
    LigerFusedLinearCPOLoss = guarded_import("liger_kernel.chunked_loss", "LigerFusedLinearCPOLoss")
    # torch.compile'd chunks on the GPU (Liger's default); plain torch on the CPU.
    mod = LigerFusedLinearCPOLoss(beta=beta, alpha=alpha, compiled=settings.gpu)
    return lambda x, w, t: mod(w, x, t)[0]  # (loss, aux outputs)


def trl_cpo(settings: Settings, beta: float, alpha: float) -> Loss:
    """TRL's ``CPOTrainer`` (loss_type="sigmoid", cpo_alpha=alpha) on full logits (bf16, upcast to float32)."""

    def loss(x, w, t):
        logits = F.linear(x, w).float()  # [2B, T, V]
        b = x.shape[0] // 2
        mask = t != IGNORE
        tok = torch.gather(logits.log_softmax(-1), 2, t.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        logps = (tok * mask).sum(-1)  # get_batch_logps, average_log_prob=False
        pref = -F.logsigmoid(beta * (logps[:b] - logps[b:])).mean()
        nll = F.cross_entropy(logits[:b].flatten(0, 1), t[:b].flatten(), ignore_index=IGNORE)
        return pref + alpha * nll

    return loss


CPO = {"fce_torch": fce_cpo, "fce_torch_fused": functools.partial(fce_cpo, engine="fused"),
       "fce_torch_library": functools.partial(fce_cpo, engine="library"), "liger": liger_cpo,
       "trl_torch": trl_cpo}


# --- inputs ---------------------------------------------------------------------------------------------


def make_inputs(lead: tuple[int, ...], h: int, v: int, *, sets: int, settings: Settings, seed: int = 0,
                ignore_prefix: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``sets`` independent random ``(x [*lead, H], weight [V, H], targets [*lead])`` in bf16, needing grads.

    ``x ~ N(0, 1)`` and ``weight ~ N(0, 1/H)`` (logits of unit scale); targets uniform in ``[0, V)`` except
    the first ``ignore_prefix`` positions of the last axis (a prompt), which are ``IGNORE``.
    """
    dev = settings.device
    g = torch.Generator(device=dev).manual_seed(seed)
    out = []
    for _ in range(sets):
        x = torch.randn(*lead, h, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.randn(v, h, device=dev, dtype=torch.bfloat16, generator=g).mul_(h**-0.5)
        t = torch.randint(0, v, lead, device=dev, generator=g)
        if ignore_prefix:
            t[..., :ignore_prefix] = IGNORE
        out.append((x.requires_grad_(), w.requires_grad_(), t))
    return out


def grad_cotangent(n: int, v: int, settings: Settings, seed: int = 1) -> torch.Tensor:
    """A random bf16 ``dZ [N, V]`` for the reference GEMMs (random, never zeros: zeros run faster)."""
    g = torch.Generator(device=settings.device).manual_seed(seed)
    return torch.randn(n, v, device=settings.device, dtype=torch.bfloat16, generator=g).mul_(1e-4)

"""Where a torch training step's time goes (``python -m bench sft --profile``): kernel time by category.

``capture(step, gpu)`` runs ``step()`` ``PROFILE_STEPS`` times under ``torch.profiler`` and sums the recorded
time per step into ``CATEGORIES`` by name (first matching pattern of ``PATTERNS`` wins), plus the ``TOP``
kernels by time. On the GPU the times are the CUDA kernels' (and memcpy/memset) durations on the device; the
difference to the step time is launch gaps and host time. On the CPU (smoke) they are the CPU ops' self times;
an op whose own name matches no pattern takes the category of its nearest enclosing op or annotation that
does (so AdamW's ``aten::mul_`` under ``Optimizer.step#AdamW.step`` is optimizer time). Triton kernels run in
the interpreter there and are not ops, so the CPU split only exercises the code; the GPU split is the one to
read.

``markdown(rows, captures, ...)`` renders the ``Profile`` section of the sft report: head + loss time against
the ``body_only`` ablation, the category split per implementation and each one's top kernels.
"""

from __future__ import annotations

import re
from typing import Callable

PROFILE_STEPS = 2
TOP = 10
CATEGORIES = ("GEMM", "attention", "loss", "optimizer", "other")
# Matched against lower-cased names, in this order: the loss kernels first (ours: fce_torch's Triton kernels;
# Liger's; torch's log_softmax / nll_loss, whose CUDA kernels are cunn_SoftMax*<..LogSoftMax..Epilogue>),
# attention before GEMM because memory-efficient attention kernels are called fmha_cutlass*. A bare "mm"
# counts only as a word (aten::mm, aten::addmm, aten::bmm), not inside other names. precomputedgrad /
# fusedlce are fce_torch's autograd functions: CPU ranges only (on the CPU the interpreted Triton kernels'
# time is their self time); no GPU kernel has these names.
PATTERNS = (
    ("loss", r"_row_stats|_flce_head|_dlogits|_scale_cast|_scale_rows|_bias_grad|_cpo_|precomputedgrad|fusedlce"
             r"|liger|element_mul|cross_entropy|log_?softmax|nll"),
    ("optimizer", r"adam|foreach|multi_tensor"),
    ("attention", r"flash|fmha|sdpa|attention|cudnn"),
    ("GEMM", r"gemm|gemv|cutlass|xmma|nvjet|cublas|matmul|(?<![a-z0-9])(add|badd|b)?mm(?![a-z0-9])"),
)
_COMPILED = tuple((cat, re.compile(pattern)) for cat, pattern in PATTERNS)
NAME_WIDTH = 90  # kernel names in the Markdown tables (the JSON keeps them whole)


def category(name: str) -> str | None:
    """The category whose pattern ``name`` matches first, None when none does."""
    low = name.lower()
    return next((cat for cat, pattern in _COMPILED if pattern.search(low)), None)


def _classify(event) -> str:
    """The event's own category, else its nearest enclosing CPU event's (CPU ops only have parents)."""
    while event is not None:
        cat = category(event.name)
        if cat is not None:
            return cat
        event = event.cpu_parent
    return "other"


def _timed_events(events, gpu: bool):
    """(event, microseconds) for what a step spends: device kernels on the GPU, CPU self time on the CPU."""
    from torch.autograd import DeviceType

    for e in events:
        if gpu:
            # GPU-side copies of record_function ranges are annotations that span kernels: not counted twice.
            if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False):
                yield e, e.time_range.elapsed_us()
        elif e.device_type == DeviceType.CPU and not e.is_async:
            yield e, e.self_cpu_time_total


def summarize(events, gpu: bool, steps: int) -> dict:
    """Per-step milliseconds by category and the ``TOP`` kernels of a profiler's ``events()``."""
    per_cat = dict.fromkeys(CATEGORIES, 0.0)
    kernels: dict[tuple[str, str], dict] = {}  # by name and category: a CPU op's depends on where it ran
    for e, us in _timed_events(events, gpu):
        if us <= 0:
            continue
        cat = _classify(e)
        per_cat[cat] += us
        k = kernels.setdefault((e.name, cat), {"name": e.name, "category": cat, "us": 0.0, "calls": 0})
        k["us"] += us
        k["calls"] += 1
    top = sorted(kernels.values(), key=lambda k: -k["us"])[:TOP]
    return {
        "activity": "cuda" if gpu else "cpu",
        "steps": steps,
        "ms": {cat: us / steps / 1e3 for cat, us in per_cat.items()},
        "total_ms": sum(per_cat.values()) / steps / 1e3,
        "top": [{"name": k["name"], "category": k["category"], "ms": k["us"] / steps / 1e3,
                 "calls": k["calls"] / steps} for k in top],
    }


def capture(step: Callable[[], object], gpu: bool, steps: int = PROFILE_STEPS) -> dict:
    """Profile ``steps`` calls of ``step()`` (a whole training step) and summarize them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    # CPU activity on the GPU too: it costs host time only (kernel durations are unaffected), and the device
    # events come out of the same parse whichever torch version this is.
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if gpu:
            torch.cuda.synchronize()  # every kernel of the last step inside the capture
    return summarize(prof.events(), gpu, steps)


def one_line(cap: dict) -> str:
    """The category split on one progress line."""
    parts = "  ".join(f"{cat} {cap['ms'][cat]:.2f}" for cat in CATEGORIES)
    return f"{parts}  (sum {cap['total_ms']:.2f} ms/step, {cap['activity']})"


# --- the Markdown section ------------------------------------------------------------------------------


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def _kernel(name: str) -> str:
    """A kernel name as a Markdown table cell: clipped, in a code span (templates' <...> are not HTML)."""
    name = name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 3] + "..."
    return "`" + name.replace("`", "'").replace("|", "\\|") + "`"


def _head_loss_table(rows: list[dict]) -> list[str]:
    body = [[r["model"], r["framework"], r["impl"], _num(r["step_ms"]), _num(r["body_ms"]),
             _num(r["head_loss_ms"]), _num(r["head_loss_share"], "{:.0%}")]
            for r in rows if r.get("body_ms") is not None]
    return _table(["model", "fw", "impl", "step ms", "body_only ms", "head+loss ms", "share of step"], body)


def _category_table(captures: list[dict]) -> list[str]:
    body = [[c["model"], c["impl"], *(_num(c["ms"][cat]) for cat in CATEGORIES), _num(c["total_ms"]),
             _num(c.get("step_ms"))] for c in captures]
    return _table(["model", "impl", *CATEGORIES, "sum", "step ms"], body)


def _top_table(cap: dict) -> list[str]:
    total = cap["total_ms"] or 1.0
    body = [[_kernel(k["name"]), k["category"], _num(k["ms"], "{:.3f}"), _num(k["calls"], "{:g}"),
             _num(k["ms"] / total, "{:.1%}")] for k in cap["top"]]
    return _table(["kernel", "category", "ms/step", "calls/step", "share"], body)


def markdown(rows: list[dict], captures: list[dict], warm: int) -> str:
    """The ``Profile`` section: head + loss against ``body_only``, the category split, the top kernels."""
    what = ("CUDA kernel time on the device; the rest of `step ms` is launch gaps and host time"
            if any(c["activity"] == "cuda" for c in captures)
            else "CPU ops' self time, a smoke check only: Triton kernels run in the interpreter here")
    out = ["`head+loss` = step time - the `body_only` step time of the same model and framework "
           "(`body_only`: the same step with the loss replaced by `mean(h**2)` of the decoder's last hidden "
           "states, so no LM head and no logits but the decoder's whole backward and the optimizer).", ""]
    out += _head_loss_table(rows)
    if captures:
        steps = captures[0]["steps"]
        out += ["", f"Time per step by category (ms; torch.profiler over {steps} steps after {warm} warm-up "
                    f"step{'s' if warm != 1 else ''} on a fresh model; {what}). A kernel's category is the first "
                    "of `bench.profiling.PATTERNS` its name matches (loss, optimizer, attention, GEMM), else "
                    "`other`, so the LM head's GEMMs count as GEMM and its casts as other (`head+loss` above "
                    "has all of them); `sum` is all categories.", ""]
        out += _category_table(captures)
        for c in captures:
            out += ["", f"### Top kernels: {c['model']} / {c['impl']}", ""] + _top_table(c)
    return "\n".join(out)

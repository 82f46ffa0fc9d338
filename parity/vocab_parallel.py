"""``python -m parity --vocab-parallel P``: both twins with the weight split over V in P shards (docs/SPEC.md §5),
each against the float64 evaluation of the unsharded problem, against each other bit for bit, and run to run.

torch runs one process per shard, JAX one process with P devices and ``jax.shard_map`` over a ``"model"`` axis
(:mod:`parity.ranks`). Every process builds the case's inputs from its seed (:func:`parity.cases.case_inputs`),
so the shards agree, and runs the case twice; the outputs travel back as ``.npz`` files with their dtypes.
The reference (:func:`parity.runner.reference_for`, on this process's device), the verdicts
(:mod:`parity.verdicts`) and the report files (:mod:`parity.report`) are those of ``python -m parity``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .cases import Case, LogprobCase, call_options, case_inputs, torch_dtype
from .environment import precision_for
from .impls import ImplResult, set_runs
from .measures import dtype_name
from .ranks import jax_child, jax_process, torch_ranks

# Outputs replicated on every shard (the first shard's is taken) or split over V (concatenated in rank order).
WHOLE = ("loss", "logp", "entropy", "dx")
SPLIT = ("dw", "db")


def cases(device: str) -> list:
    """The vocab-parallel cases (V divisible by 2, 4 and 8)."""
    if device == "cpu":
        return [Case("vp_all_options_f32", (37,), 32, 1024, "float32", bias=True, label_smoothing=0.1,
                     z_loss=1e-4, softcap=30.0, class_weights=True, logit_scale=30.0, seed=41),
                Case("vp_none_bf16", (2, 9), 32, 512, "bfloat16", reduction="none", seed=42),
                Case("vp_fused_all_options_bf16", (37,), 32, 1024, "bfloat16", bias=True, label_smoothing=0.1,
                     z_loss=1e-4, softcap=30.0, class_weights=True, logit_scale=30.0, engine="fused", seed=47),
                LogprobCase("vp_logprobs_f32", (29,), 32, 1024, "float32", bias=True, softcap=20.0,
                            temperature=0.7, logit_scale=20.0, seed=43)]
    return [Case("vp_bf16_16k_4k_128k", (16384,), 4096, 128256, "bfloat16", seed=44),
            Case("vp_bf16_8k_2304_256k_all_options", (8192,), 2304, 256000, "bfloat16", bias=True,
                 label_smoothing=0.1, z_loss=1e-4, softcap=30.0, class_weights=True, logit_scale=30.0, seed=45),
            LogprobCase("vp_logprobs_bf16_8k_4k_152k", (8192,), 4096, 151936, "bfloat16", temperature=0.7, seed=46),
            Case("vp_fused_bf16_16k_4k_128k", (16384,), 4096, 128256, "bfloat16", engine="fused", seed=48),
            LogprobCase("vp_fused_logprobs_bf16_8k_4k_152k", (8192,), 4096, 151936, "bfloat16", temperature=0.7,
                        engine="fused", seed=49)]


def _case(name: str, device: str):
    return next(c for c in cases(device) if c.name == name)


def _shard(t, rank, size):
    if t is None:
        return None
    n = t.shape[0] // size
    return t[rank * n:(rank + 1) * n]


def _float32(v) -> np.ndarray:
    import torch

    return v.detach().float().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v.astype("float32"))


def _save(path, outputs: dict) -> None:
    """Outputs as float32 arrays (exact for 16-bit values; numpy has no bfloat16) and their dtype names."""
    present = {k: v for k, v in outputs.items() if v is not None}
    np.savez(path, **{k: _float32(v) for k, v in present.items()},
             **{f"{k}.dtype": np.array(dtype_name(v.dtype)) for k, v in present.items()})


def _load(path) -> dict:
    import torch

    data = np.load(path)
    return {k: torch.from_numpy(data[k]).to(torch_dtype(str(data[f"{k}.dtype"]))) for k in data.files
            if not k.endswith(".dtype")}


def _assemble(shards: list[dict]) -> dict:
    import torch

    out = {k: shards[0][k] for k in WHOLE if k in shards[0]}
    out.update({k: torch.cat([s[k] for s in shards]) for k in SPLIT if k in shards[0]})
    return out


# ------------------------------------------------------------------------------------------------ torch
def _torch_case(rank, size, case, inp) -> dict:
    import torch

    import fce_torch

    leaf = lambda t: None if t is None else t.detach().clone().requires_grad_(True)  # noqa: E731
    x, w, b = leaf(inp["x"]), leaf(_shard(inp["weight"], rank, size)), leaf(_shard(inp["bias"], rank, size))
    vp = fce_torch.VocabParallel()
    if case.kind == "logprobs":
        logp, ent = fce_torch.fused_token_logprobs(x, w, inp["targets"], bias=b, return_entropy=True,
                                                   vocab_parallel=vp, **call_options(case))
        (logp * inp["grad_logp"] + ent * inp["grad_entropy"]).sum().backward()
        out = {"logp": logp, "entropy": ent}
    else:
        loss = fce_torch.fused_lce(x, w, inp["targets"], bias=b, class_weights=_shard(inp["class_weights"], rank,
                                   size), vocab_parallel=vp, **call_options(case))
        loss.backward(torch.ones_like(loss) if inp["grad_loss"] is None else inp["grad_loss"])
        out = {"loss": loss}
    return {k: v.detach() for k, v in {**out, "dx": x.grad, "dw": w.grad, "db": None if b is None else b.grad}.items()
            if v is not None}


def torch_rank(rank, size, out_dir, name, device) -> None:
    """One rank of a case (a :func:`parity.ranks.torch_ranks` job): both runs to ``torch-<run>-<rank>.npz``."""
    case = _case(name, device)
    with precision_for(case):
        inp = case_inputs(case, f"cuda:{rank}" if device == "cuda" else "cpu")
        for run in (0, 1):
            _save(Path(out_dir) / f"torch-{run}-{rank}.npz", _torch_case(rank, size, case, inp))


def run_torch(case, size: int, device: str, out_dir: Path) -> list[dict]:
    """[run 0, run 1] of every output (whole ones from rank 0, split ones concatenated over the ranks)."""
    torch_ranks(torch_rank, size, out_dir, case.name, device, cuda=device == "cuda")
    return [_assemble([_load(out_dir / f"torch-{run}-{r}.npz") for r in range(size)]) for run in (0, 1)]


# -------------------------------------------------------------------------------------------------- JAX
def _jax_program(case, inp, size):
    """The jitted shard_map program of the case over P devices, and its sharded arguments."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import fce_jax

    from .bridge import targets_to_jax, to_jax

    arr = lambda t: None if t is None else to_jax(t, copy=True)  # noqa: E731
    mesh = jax.make_mesh((size,), ("model",), devices=jax.devices()[:size])
    vp, rep, shard = fce_jax.VocabParallel("model"), P(), P("model")
    x, w, b, y = arr(inp["x"]), arr(inp["weight"]), arr(inp["bias"]), targets_to_jax(inp["targets"])
    if case.kind == "logprobs":
        g, h = arr(inp["grad_logp"]), arr(inp["grad_entropy"])

        def objective(x, w, b):
            logp, ent = fce_jax.fused_token_logprobs(x, w, y, bias=b, return_entropy=True, vocab_parallel=vp,
                                                     **call_options(case))
            return jnp.sum(logp * g + ent * h), {"logp": logp, "entropy": ent}
    else:
        cw, cot = arr(inp["class_weights"]), arr(inp["grad_loss"])

        def objective(x, w, b):
            n = w.shape[0]  # this device's shard of the replicated class weights
            local = None if cw is None else jax.lax.dynamic_slice_in_dim(cw, jax.lax.axis_index("model") * n, n)
            out = fce_jax.fused_lce(x, w, y, bias=b, class_weights=local, vocab_parallel=vp, **call_options(case))
            return jnp.sum(out * (1.0 if cot is None else cot)), {"loss": out}

    def body(x, w, b):
        (_, rows), grads = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(x, w, b)
        return rows, grads

    rows_spec = {k: rep for k in case.values}
    put = lambda a, s: None if a is None else jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(rep, shard, None if b is None else shard),
                               out_specs=(rows_spec, (rep, shard, shard)), check_vma=True))
    return fn, (put(x, rep), put(w, shard), put(b, shard))


def jax_main(name: str, size: int, device: str, out_dir: str) -> None:
    """In a process whose JAX sees P devices: both runs of the case to ``jax-<run>.npz``."""
    case = _case(name, device)
    with precision_for(case):
        fn, args = _jax_program(case, case_inputs(case, "cpu"), size)
        for run in (0, 1):
            rows, (dx, dw, db) = fn(*args)
            _save(Path(out_dir) / f"jax-{run}.npz", {**rows, "dx": dx, "dw": dw, "db": db})


def run_jax(case, size: int, device: str, out_dir: Path) -> list[dict]:
    jax_process("parity.vocab_parallel", (case.name, size, device, out_dir), size, cpu=device == "cpu")
    return [_load(out_dir / f"jax-{run}.npz") for run in (0, 1)]


# ---------------------------------------------------------------------------------------------- the run
def _twin_results(case, size: int, device: str) -> dict:
    """{"torch": ImplResult, "jax": ImplResult} of the case on P shards (a failed run is an "error")."""
    if case.v % size:
        why = f"V={case.v} is not divisible by P={size}"
        return {twin: ImplResult("error", why) for twin in ("torch", "jax")}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for twin, run in (("torch", run_torch), ("jax", run_jax)):
            try:
                first, second = run(case, size, device, Path(tmp))
            except Exception as exc:  # noqa: BLE001  (reported: a failure of that twin)
                results[twin] = ImplResult("error", f"{type(exc).__name__}: {exc}")
                continue
            results[twin] = ImplResult("ok")
            set_runs(results[twin], {k: v.to(device) for k, v in first.items()}, second)
    return results


def run(size: int, device: str, patterns: list[str], out_dir: Path, log=print) -> int:
    """The vocab-parallel report, ``parity.json`` and ``parity.md`` in ``out_dir`` (the suite's format, Liger
    absent); returns the suite's exit code (1 on a violation or a failed run)."""
    from .catalog import case_meta, select_cases
    from .environment import environment
    from .report import format_summary, format_table, write_reports
    from .runner import reference_for
    from .verdicts import evaluate_case, exit_code, summarize

    entries, t0 = [], time.perf_counter()
    for case in select_cases(cases(device), patterns):
        log(f"vocab-parallel P={size}: {case.name}")
        results = _twin_results(case, size, device)
        ref, ref_impl, ref_status, ref_reason = None, "", "ok", ""
        try:
            with precision_for(case):
                ref, ref_impl = reference_for(case, case_inputs(case, device), device)
        except Exception as exc:  # noqa: BLE001  (reported: a failure, as in python -m parity)
            ref_status, ref_reason = "error", f"{type(exc).__name__}: {exc}"
        entry = evaluate_case(case_meta(case), results, ref, ref_status=ref_status, ref_reason=ref_reason)
        entry["reference"]["impl"] = ref_impl
        entries.append(entry)
    summary = {**summarize(entries), "seconds": round(time.perf_counter() - t0, 2)}
    env = {**environment(device), "vocab_parallel": size}
    report = {"environment": env, "cases": entries, "summary": summary, "exit_code": exit_code(summary)}
    files = write_reports(report, out_dir)
    print(format_table(report))
    print(format_summary(report, files))
    return report["exit_code"]


if __name__ == "__main__":
    jax_child(jax_main, sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])

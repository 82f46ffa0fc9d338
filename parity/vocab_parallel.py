"""``python -m parity --vocab-parallel P``: both twins with the weight split over V in P shards (docs/SPEC.md §5),
each against the float64 evaluation of the unsharded problem, against each other bit for bit, and run to run.

torch runs one process per shard (NCCL on the GPUs of this host, gloo on the CPU), JAX one process with P
devices (the GPUs, or P fake CPU devices) and ``jax.shard_map`` over a ``"model"`` axis. Every process builds
the case's inputs from its seed (:func:`parity.cases.case_inputs`), so the shards agree; results travel back as
``.npz`` files. The reference runs in this process, on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from .cases import Case, LogprobCase, case_inputs
from .verdicts import bound

# Outputs compared: replicated on every shard (the first shard's is taken) or split over V (concatenated).
WHOLE = ("loss", "logp", "entropy", "dx")
SPLIT = ("dw", "db")


def cases(device: str) -> list:
    """The vocab-parallel cases (V divisible by 2, 4 and 8)."""
    if device == "cpu":
        return [Case("vp_all_options_f32", (37,), 32, 1024, "float32", bias=True, label_smoothing=0.1,
                     z_loss=1e-4, softcap=30.0, class_weights=True, logit_scale=30.0, seed=41),
                Case("vp_none_bf16", (2, 9), 32, 512, "bfloat16", reduction="none", seed=42),
                LogprobCase("vp_logprobs_f32", (29,), 32, 1024, "float32", bias=True, softcap=20.0,
                            temperature=0.7, logit_scale=20.0, seed=43)]
    return [Case("vp_bf16_16k_4k_128k", (16384,), 4096, 128256 // 2 * 2, "bfloat16", seed=44),
            Case("vp_bf16_8k_2304_256k_all_options", (8192,), 2304, 256000, "bfloat16", bias=True,
                 label_smoothing=0.1, z_loss=1e-4, softcap=30.0, class_weights=True, logit_scale=30.0, seed=45),
            LogprobCase("vp_logprobs_bf16_8k_4k_152k", (8192,), 4096, 151936, "bfloat16", temperature=0.7, seed=46)]


def _shard(t, rank, size):
    if t is None:
        return None
    n = t.shape[0] // size
    return t[rank * n:(rank + 1) * n]


def _run_torch_shard(case, inp, rank, size, device):
    import torch

    import fce_torch

    leaves = {k: inp[k].detach().clone().requires_grad_(True) for k in ("x",)}
    leaves["weight"] = _shard(inp["weight"], rank, size).detach().clone().requires_grad_(True)
    bias = _shard(inp["bias"], rank, size)
    leaves["bias"] = None if bias is None else bias.detach().clone().requires_grad_(True)
    vp = fce_torch.VocabParallel()
    if case.kind == "logprobs":
        logp, ent = fce_torch.fused_token_logprobs(leaves["x"], leaves["weight"], inp["targets"], bias=leaves["bias"],
                                                   return_entropy=True, vocab_parallel=vp, **case.options())
        (logp * inp["grad_logp"] + ent * inp["grad_entropy"]).sum().backward()
        out = {"logp": logp, "entropy": ent}
    else:
        loss = fce_torch.fused_lce(leaves["x"], leaves["weight"], inp["targets"], bias=leaves["bias"],
                                   class_weights=_shard(inp["class_weights"], rank, size), vocab_parallel=vp,
                                   **case.options())
        loss.backward(torch.ones_like(loss) if inp["grad_loss"] is None else inp["grad_loss"])
        out = {"loss": loss}
    db = None if leaves["bias"] is None else leaves["bias"].grad
    out.update(dx=leaves["x"].grad, dw=leaves["weight"].grad, db=db)
    return {k: v.detach().float().cpu().numpy() for k, v in out.items() if v is not None}


def _torch_worker(rank, size, case, device, out_dir):
    import torch
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    # A file store in this case's fresh directory: no free-port probe that a concurrent job could race for.
    dist.init_process_group(backend, rank=rank, world_size=size, init_method=f"file://{out_dir}/store")
    try:
        for run in (0, 1):
            np.savez(Path(out_dir) / f"torch-{run}-{rank}.npz", **_run_torch_shard(case, case_inputs(case, dev),
                                                                                    rank, size, device))
    finally:
        dist.destroy_process_group()


def run_torch(case, size: int, device: str, out_dir: Path) -> list[dict]:
    """[run 0, run 1] of every output (whole ones from rank 0, split ones concatenated over the ranks)."""
    import torch.multiprocessing as mp

    mp.start_processes(_torch_worker, args=(size, case, device, str(out_dir)), nprocs=size,
                       start_method="spawn")
    return [_assemble([dict(np.load(out_dir / f"torch-{run}-{r}.npz")) for r in range(size)]) for run in (0, 1)]


def _assemble(shards: list[dict]) -> dict:
    out = {k: shards[0][k] for k in WHOLE if k in shards[0]}
    out.update({k: np.concatenate([s[k] for s in shards]) for k in SPLIT if k in shards[0]})
    return out


def _np(t):
    import torch

    return None if t is None else t.detach().to(torch.float32).numpy() if t.is_floating_point() else t.numpy()


def _jax_program(case, inp, size):
    """The jitted shard_map program of the case over P devices, and its sharded arguments."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import fce_jax

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[case.dtype]
    mesh = jax.make_mesh((size,), ("model",), devices=jax.devices()[:size])
    vp, rep, shard = fce_jax.VocabParallel("model"), P(), P("model")
    x, w = jnp.asarray(_np(inp["x"])).astype(dtype), jnp.asarray(_np(inp["weight"])).astype(dtype)
    b = None if inp["bias"] is None else jnp.asarray(_np(inp["bias"])).astype(dtype)
    y = jnp.asarray(_np(inp["targets"]).astype(np.int32))
    if case.kind == "logprobs":
        g, h = jnp.asarray(_np(inp["grad_logp"])), jnp.asarray(_np(inp["grad_entropy"]))

        def body(x, w, b):
            def total(x, w, b):
                logp, ent = fce_jax.fused_token_logprobs(x, w, y, bias=b, return_entropy=True, vocab_parallel=vp,
                                                         **case.options())
                return jnp.sum(logp * g + ent * h), {"logp": logp, "entropy": ent}
            (_, rows), grads = jax.value_and_grad(total, argnums=(0, 1, 2), has_aux=True)(x, w, b)
            return rows, grads
        out_specs = ({"logp": rep, "entropy": rep}, (rep, shard, shard))
    else:
        cw = None if inp["class_weights"] is None else jnp.asarray(_np(inp["class_weights"]))
        cot = None if inp["grad_loss"] is None else jnp.asarray(_np(inp["grad_loss"]))

        def body(x, w, b):
            def loss(x, w, b):
                out = fce_jax.fused_lce(x, w, y, bias=b, class_weights=None if cw is None else _local(cw),
                                        vocab_parallel=vp, **case.options())
                return jnp.sum(out * (1.0 if cot is None else cot)), out
            (_, value), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, b)
            return {"loss": value}, grads

        def _local(v):  # this device's shard of a replicated [V] vector
            n = v.shape[0] // size
            return jax.lax.dynamic_slice_in_dim(v, jax.lax.axis_index("model") * n, n)
        out_specs = ({"loss": rep}, (rep, shard, shard))
    put = lambda a, s: None if a is None else jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(rep, shard, None if b is None else shard),
                               out_specs=out_specs, check_vma=True))
    return fn, (put(x, rep), put(w, shard), put(b, shard))


def jax_worker(name: str, size: int, device: str, out_dir: str) -> None:
    """Run in a subprocess whose JAX sees P devices: both runs of the case to ``jax-<run>.npz``."""
    import jax

    case = next(c for c in cases(device) if c.name == name)
    fn, args = _jax_program(case, case_inputs(case, "cpu"), size)
    for run in (0, 1):
        rows, (dx, dw, db) = fn(*args)
        out = {k: np.asarray(v, np.float32) for k, v in rows.items()}
        out.update({k: np.asarray(v.astype("float32")) for k, v in (("dx", dx), ("dw", dw), ("db", db))
                    if v is not None})
        np.savez(Path(out_dir) / f"jax-{run}.npz", **out)
    jax.clear_caches()


def run_jax(case, size: int, device: str, out_dir: Path) -> list[dict]:
    env = dict(os.environ)
    if device == "cpu":
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={size}")
    done = subprocess.run([sys.executable, "-m", "parity.vocab_parallel", case.name, str(size), device,
                           str(out_dir)], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    if done.returncode:
        raise RuntimeError(f"the JAX run failed:\n{done.stderr[-3000:]}")
    return [dict(np.load(out_dir / f"jax-{run}.npz")) for run in (0, 1)]


def _reference(case, inp) -> dict:
    from . import reference

    if case.kind == "logprobs":
        return reference.logprobs_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"],
                                            grad_logp=inp["grad_logp"], grad_entropy=inp["grad_entropy"],
                                            **case.options())
    return reference.flce_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"],
                                    class_weights=inp["class_weights"], grad_output=inp["grad_loss"],
                                    **case.options())


def evaluate(case, runs: dict, ref: dict) -> dict:
    """One case's records: per output, each twin's error against float64 and its bound, the twins' bitwise
    equality, each twin's run-to-run equality; and the violations."""
    from .measures import rel_err

    records, violations = [], []
    for out in [k for k in (*WHOLE, *SPLIT) if k in ref and ref[k] is not None and k in runs["torch"][0]]:
        rec = {"output": out, "bound": bound(out, case.dtype),
               "torch=jax": bool(np.array_equal(runs["torch"][0][out], runs["jax"][0][out]))}
        for twin in ("torch", "jax"):
            got = runs[twin][0][out]
            rec[f"err {twin}"] = err = float(rel_err(got, np.asarray(ref[out]).reshape(got.shape)))
            rec[f"determ {twin}"] = bool(np.array_equal(got, runs[twin][1][out]))
            if not err <= rec["bound"]:
                violations.append(f"{case.name} {twin} {out}: relative error {err:.2e} > {rec['bound']:.0e}")
        records.append(rec)
    return {"case": case.name, "records": records, "violations": violations}


def run(size: int, device: str, patterns: list[str], out_dir: Path, log=print) -> int:
    """The vocab-parallel report: ``parity.json`` and ``parity.md`` in ``out_dir``; exit code 1 on a
    violation or a failed run."""
    from .catalog import select_cases

    selected = select_cases(cases(device), patterns) if patterns else cases(device)
    entries = []
    for case in selected:
        if case.v % size:
            entries.append({"case": case.name, "records": [], "violations": [f"V={case.v} is not divisible "
                                                                              f"by P={size}"]})
            continue
        log(f"vocab-parallel P={size}: {case.name}")
        with tempfile.TemporaryDirectory() as tmp:
            try:
                runs = {"torch": run_torch(case, size, device, Path(tmp)),
                        "jax": run_jax(case, size, device, Path(tmp))}
            except Exception as exc:  # noqa: BLE001  (reported as the case's failure)
                entries.append({"case": case.name, "records": [], "violations": [f"{type(exc).__name__}: {exc}"]})
                continue
        entries.append(evaluate(case, runs, _reference(case, case_inputs(case, "cpu"))))
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"vocab_parallel": size, "device": device, "cases": entries}
    (out_dir / "parity.json").write_text(json.dumps(result, indent=1))
    (out_dir / "parity.md").write_text(markdown(result))
    print(markdown(result))
    return 1 if any(e["violations"] for e in entries) or not entries else 0


def markdown(result: dict) -> str:
    lines = [f"# Vocab-parallel parity, P={result['vocab_parallel']} ({result['device']})", "",
             "| case | out | torch=jax | err torch | err jax | bound | run-to-run t/j |",
             "|---|---|---|---|---|---|---|"]
    for e in result["cases"]:
        for i, r in enumerate(e["records"]):
            lines.append(f"| {e['case'] if i == 0 else ''} | {r['output']} | {'yes' if r['torch=jax'] else 'no'} | "
                         f"{r['err torch']:.1e} | {r['err jax']:.1e} | {r['bound']:.0e} | "
                         f"{'y' if r['determ torch'] else 'N'}/{'y' if r['determ jax'] else 'N'} |")
        lines += [f"| {e['case']} | violation: {v} | | | | | |" for v in e["violations"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    jax_worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])

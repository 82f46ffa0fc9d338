"""Worker processes of tests/test_distributed_torch.py (spawned: one per gloo rank; tensors travel back as numpy).

Every worker builds the same global inputs from a seed, takes its rank's share, runs fce_torch and returns the
results of its rank; the test compares them with the float64 reference of the global problem.
"""
import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # the ranks' kernels: conftest.py's interpreter shortcuts, same bits
    import triton_interpreter  # noqa: E402

    triton_interpreter.install()

N, H, V = 29, 24, 520


def inputs(seed=0, vocab=V, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g)
    w = torch.randn(vocab, H, generator=g) / H ** 0.5 * 3
    b = torch.randn(vocab, generator=g) * 0.3
    cw = torch.rand(vocab, generator=g) + 0.5
    y = torch.randint(0, vocab, (N,), generator=g)
    y[torch.randperm(N, generator=g)[:6]] = -100
    return {"x": x.to(dtype), "w": w.to(dtype), "b": b.to(dtype), "cw": cw, "y": y}


def run(rank, size, out_dir, job):
    """One rank of `job` (a `parity.ranks.torch_ranks` job): its results to ``<job>-<rank>.npz``."""
    result = JOBS[job](rank, size)
    np.savez(os.path.join(out_dir, f"{job}-{rank}.npz"), **{k: v.detach().float().numpy() for k, v in
                                                             result.items()})


def run_jobs(rank, size, out_dir, jobs):
    """`run` of each of `jobs` in turn, in one process group: one start of the ranks (torch, fce_torch, and
    transformers for the FSDP2 jobs: seconds per rank) for them all."""
    for job in jobs:
        run(rank, size, out_dir, job)
        dist.barrier()


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def vocab_parallel(rank, size, engine="library"):
    """fused_lce (mean, every option), fused_token_logprobs and fused_cpo_loss on equal vocabulary shards, on
    `engine`."""
    import fce_torch

    inp = inputs()
    shard = slice(rank * V // size, (rank + 1) * V // size)
    vp = fce_torch.VocabParallel()
    x, w, b = _leaves(inp["x"], inp["w"][shard], inp["b"][shard])
    loss, stats = fce_torch.fused_lce(x, w, inp["y"], bias=b, class_weights=inp["cw"][shard], label_smoothing=0.1,
                                      z_loss=1e-3, softcap=15.0, vocab_parallel=vp, chunk_rows=8, return_stats=True,
                                      engine=engine)
    loss.backward()
    out = {"loss": loss, "lse": stats["lse"], "argmax": stats["argmax"], "dx": x.grad, "dw": w.grad, "db": b.grad}
    x, w = _leaves(inp["x"], inp["w"][shard])
    g = torch.linspace(-1.0, 1.0, N)
    logp, ent = fce_torch.fused_token_logprobs(x, w, inp["y"], temperature=0.7, return_entropy=True,
                                               vocab_parallel=vp, chunk_rows=8, engine=engine)
    (logp * g + ent).sum().backward()
    out.update(logp=logp, entropy=ent, lp_dx=x.grad, lp_dw=w.grad)
    x, w = _leaves(inp["x"][:28], inp["w"][shard])
    cpo = fce_torch.fused_cpo_loss(x.view(4, 7, H), w, inp["y"][:28].view(4, 7), vocab_parallel=vp, chunk_rows=8,
                                   engine=engine)
    cpo.backward()
    out.update(cpo=cpo, cpo_dx=x.grad, cpo_dw=w.grad)
    return out


def dtensor(rank, size):
    """A DTensor weight sharded over V with Shard(0), V not a multiple of the group (uneven shards)."""
    import fce_torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    inp = inputs(vocab=V - 1)
    mesh = init_device_mesh("cpu", (size,))
    w = distribute_tensor(inp["w"], mesh, [Shard(0)]).requires_grad_(True)
    x = inp["x"].clone().requires_grad_(True)
    loss = fce_torch.fused_lce(x, w, inp["y"], chunk_rows=8)
    loss.backward()
    return {"loss": loss, "dx": x.grad, "dw": w.grad.full_tensor()}


def normalizer(rank, size):
    """Data parallel: each rank has its own rows (unequal valid counts); the global mean through `normalizer`
    and an all-reduce of the gradients equals the loss of all rows at once."""
    import fce_torch

    inp = inputs()
    rows = slice(rank * N // size, (rank + 1) * N // size)
    n_valid = (inp["y"] != -100).sum().float()  # the global count (known to every rank in this test)
    x, w = _leaves(inp["x"][rows], inp["w"])
    loss = fce_torch.fused_lce(x, w, inp["y"][rows], normalizer=n_valid, chunk_rows=8)
    loss.backward()
    for t in (loss.detach(), w.grad):
        dist.all_reduce(t)
    return {"loss": loss.detach(), "dw": w.grad}


def _tiny_llama(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, tie_word_embeddings=tied, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _fsdp(wrapping, tied):
    """The loss and the (full) gradients of a tiny Llama patched by fce_torch.hf, sharded by FSDP2 as
    `wrapping` says ("head": lm_head is its own unit; "root": in the root unit; "grouped": with the embedding),
    each rank on its own batch; and of the unsharded plain model on the same batches, averaged over ranks."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fce_torch import hf

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plain = _tiny_llama(tied)
    model = hf.patch(copy.deepcopy(plain))
    if wrapping == "head":
        fully_shard(model.lm_head, mesh=mesh)
    elif wrapping == "grouped":
        fully_shard([model.get_input_embeddings(), model.lm_head], mesh=mesh)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    ids = torch.randint(0, 128, (2, 8), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    ref = plain(input_ids=ids, labels=labels).loss
    ref.backward()
    out = {"loss": loss.detach(), "ref_loss": ref.detach()}
    for name, p in plain.named_parameters():
        ref_grad = p.grad.clone()
        dist.all_reduce(ref_grad)
        out["ref." + name] = ref_grad / dist.get_world_size()
    for name, p in model.named_parameters():
        out["fsdp." + name] = p.grad.full_tensor()
    return out


def fsdp_head_unit(rank, size):
    return _fsdp("head", tied=False)


def fsdp_root(rank, size):
    return _fsdp("root", tied=True)


def fsdp_grouped_tied(rank, size):
    return _fsdp("grouped", tied=True)


def fsdp_tied_head_unit_refused(rank, size):
    try:
        _fsdp("head", tied=True)
    except ValueError as e:
        return {"refused": torch.tensor(float("tied" in str(e)))}
    return {"refused": torch.tensor(0.0)}


JOBS = {"vocab_parallel": vocab_parallel, "vocab_parallel_fused": functools.partial(vocab_parallel, engine="fused"),
        "dtensor": dtensor, "normalizer": normalizer,
        "fsdp_head_unit": fsdp_head_unit, "fsdp_root": fsdp_root, "fsdp_grouped_tied": fsdp_grouped_tied,
        "fsdp_tied_head_unit_refused": fsdp_tied_head_unit_refused}

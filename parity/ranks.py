"""The processes of the vocab-parallel tools and tests (``python -m parity --vocab-parallel``, ``python -m bench
op --vocab-parallel``, tests/test_distributed_torch.py): torch ranks, one process each in one process group
(NCCL on the GPUs of this host, gloo on the CPU), and a JAX process that sees P devices (the GPUs, or P fake
CPU devices), each started from a module of this repository.

The ranks meet through a file store in the caller's fresh directory: no free port is probed, so concurrent
jobs cannot race for one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def torch_ranks(job, size: int, out_dir, *args, cuda: bool = False) -> None:
    """``job(rank, size, out_dir, *args)`` in ``size`` spawned processes inside one process group (rank r on
    GPU r with ``cuda``); ``job`` must be a module-level function (it is pickled). Raises when a rank fails."""
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(size, cuda, str(out_dir), job, args), nprocs=size, start_method="spawn")


def _rank(rank, size, cuda, out_dir, job, args):
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a rank that aborts shows where
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size,
                            init_method=f"file://{out_dir}/store")
    try:
        job(rank, size, out_dir, *args)
        # a rank that tore its gloo group down while the other still finished its last collective aborted
        # ("terminate called without an active exception", about 1 run in 3 of the shortest job)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _leave_together(out_dir, rank, size)
    # The job's results are on disk and the group is gone: leave without the interpreter's and the libraries'
    # teardown, where a gloo rank still aborted in this way about once per full test run.
    _leave()


def _leave():
    """Exit 0 at once, the output flushed, without the interpreter's and the libraries' teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _leave_together(out_dir, rank, size, timeout_s=60.0):
    """Return once every rank has destroyed its group (or after `timeout_s`), so that no rank's exit closes
    sockets under a group still being torn down in another."""
    Path(out_dir, f"left.{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(Path(out_dir, f"left.{r}").exists() for r in range(size)):
        time.sleep(0.01)


def jax_child(main, *args) -> None:
    """The body of a JAX child process run as ``__main__`` (a `jax_process` module, tests/dist_jax.py):
    ``main(*args)``, then exit without the libraries' teardown. Its results are written (files, stdout) by
    then; the JAX process of the parity tool aborted once in CI ("terminate called without an active
    exception", as the gloo ranks did at teardown) and did not in seven runs alone, so where it aborted is not
    known: faulthandler shows it if it happens again."""
    import faulthandler

    faulthandler.enable()
    main(*args)
    _leave()


def jax_process(module: str, args, size: int, *, cpu: bool) -> str:
    """The stdout of ``python -m module *args`` whose JAX sees ``size`` devices (fake CPU devices with ``cpu``,
    added to the caller's ``XLA_FLAGS``); the module's ``__main__`` runs its job through `jax_child`.
    RuntimeError with the end of its stderr when it fails."""
    env = dict(os.environ)
    if cpu:
        flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={size}"
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
    done = subprocess.run([sys.executable, "-m", module, *map(str, args)], env=env, capture_output=True,
                          text=True, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"python -m {module} failed:\n{done.stderr[-3000:]}")
    return done.stdout

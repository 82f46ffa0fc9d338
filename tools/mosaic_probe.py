"""Which part of the JAX twin's Mosaic GPU logits GEMM (`GEMM_MOSAIC`) keeps its GPU call from returning: its
first call on the H200 did not return within 129 s (bench/results/nvidia-h200/op-after-shuffles/).

Each variant runs in a process of its own under a time limit, its compile and its first run timed apart and
printed as they start, so that a variant that hangs costs its limit and says which step hung, and the others
still run. A variant changes the kernel's epilogue by replacing a function of `logit_tiles_mgpu` in that process
(its bits are not the question here, only whether and how fast the call returns); the gradient GEMMs' Mosaic GPU
kernel, which runs on the H200 (bench/results/nvidia-h200/mosaic-grads/), is the control.

Usage: python tools/mosaic_probe.py OUT_DIR [--limit SECONDS] [--variants A,B,...] [N,H,V ...]
(GPU; on a CPU the kernels run in Mosaic GPU's interpret mode, at small shapes only). A development tool.
"""
import dataclasses
import json
import os
import subprocess
import sys
import time

VARIANTS = {
    "control-dx": "the gradient GEMMs' Mosaic GPU kernel, dX of a [N, V] dZ (grad GEMMs): known to run",
    "full": "the kernel as the engine would run it (the loss's statistics, tile values stored)",
    "no-store": "the same without the tile values' TMA stores (store=False)",
    "no-conds": "lax.cond's branches replaced by the first (the column mask in every tile)",
    "plain-sums": "the row sums by one jnp.sum instead of the adjacent-pairs tree's shuffles",
    "max-only": "an epilogue of the row max alone (every other statistic a copy of it, e = exp2 of z - m)",
    "tile-n-128": "the full kernel on 128-column tiles: a 64x128 accumulator per warpgroup (64 registers a thread "
                  "where 64x256 takes 128), as the gradient GEMMs' kernel has; whether register pressure sets the "
                  "compile's time or the run's",
}


def _child(variant, shape):
    """One variant at one shape, in this process: prints a JSON line as each step starts and ends."""
    import jax
    import jax.numpy as jnp

    from fce_core import config
    from fce_jax.kernels import grad_gemms, launch
    from fce_jax.kernels import logit_tiles_mgpu as jm

    def say(**kw):
        print(json.dumps(dict(kw, t=round(time.perf_counter() - t0, 2))), flush=True)

    t0 = time.perf_counter()
    n, h, v = shape
    kx, kw_, ky = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (n, h), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw_, (v, h), jnp.float32) / h ** 0.5).astype(jnp.bfloat16)
    y = jax.random.randint(ky, (n,), 0, v, jnp.int32)
    interpret = launch.interpret_mode()
    if variant == "control-dx":
        cfg = config.GRAD_GEMM_MOSAIC_INTERPRETER if interpret else config.GRAD_GEMM_MOSAIC
        dz = jax.random.normal(ky, (n, v), jnp.float32).astype(jnp.bfloat16)
        fn, args = jax.jit(lambda a, b: grad_gemms.dx_gemm(a, b, jnp.bfloat16, cfg=cfg)), (dz, w)
    else:
        _patch(jm, variant)
        cfg = config.GEMM_MOSAIC_INTERPRETER if interpret else config.GEMM_MOSAIC
        if variant == "tile-n-128":
            cfg = dataclasses.replace(cfg, tile_n=min(cfg.tile_n, 128))
        store = variant != "no-store"
        fn = jax.jit(lambda a, b, c: jm.mosaic_logit_tiles(a, b, c, has_q=False, has_pz=False, store=store, cfg=cfg))
        args = (x, w, y)
    jax.block_until_ready(args)
    say(step="compiling")
    t = time.perf_counter()
    compiled = fn.lower(*args).compile()
    say(step="compiled", compile_s=round(time.perf_counter() - t, 2))
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    say(step="ran", first_s=round(time.perf_counter() - t, 3))
    reps = 3 if interpret else 10
    t = time.perf_counter()
    for _ in range(reps):
        out = compiled(*args)
    jax.block_until_ready(out)
    say(step="timed", ms=round((time.perf_counter() - t) / reps * 1e3, 3))


def _patch(jm, variant):
    """Replace the part of the Mosaic GPU logits kernel's epilogue that `variant` leaves out."""
    import types

    import jax.numpy as jnp
    from jax import lax

    if variant == "no-conds":
        jm.lax = types.SimpleNamespace(**{k: getattr(lax, k) for k in dir(lax) if not k.startswith("__")})
        jm.lax.cond = lambda pred, first, second: first()
    elif variant == "plain-sums":
        jm.tree_sum = lambda v: jnp.sum(v, axis=1)
    elif variant == "max-only":
        def statistics(total, y, c0, vocab, has_q, has_pz, cw):
            m_t = jnp.max(total, axis=1)
            e = jnp.exp2((total - lax.broadcast_in_dim(m_t, total.shape, [0])) * jm.LOG2E)
            return [e, m_t, m_t, jnp.zeros(m_t.shape, jnp.int32), m_t]

        jm._statistics = statistics
    elif variant not in ("full", "no-store", "tile-n-128"):
        raise SystemExit(f"mosaic_probe.py: unknown variant {variant!r}; one of {', '.join(VARIANTS)}")


def main():
    args = sys.argv[1:]
    if args and args[0] == "--child":
        return _child(args[1], tuple(int(s) for s in args[2].split(",")))
    limit, names = 60.0, list(VARIANTS)
    for flag in ("--limit", "--variants"):
        if flag in args:
            at = args.index(flag)
            value = args[at + 1]
            del args[at:at + 2]
            if flag == "--limit":
                limit = float(value)
            else:
                names = value.split(",")
                unknown = [v for v in names if v not in VARIANTS]
                if unknown:
                    sys.exit(f"mosaic_probe.py: unknown variants {unknown}; known: {list(VARIANTS)}")
    if not args:
        sys.exit(__doc__)
    out_dir, *shapes = args
    os.makedirs(out_dir, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    for shape in shapes or ["256,4096,128256", "8192,640,262144"]:
        for name in names:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", name, shape]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
                out, err, status = done.stdout, done.stderr, "exit %d" % done.returncode
            except subprocess.TimeoutExpired as exc:
                out, err = (s.decode() if isinstance(s, bytes) else s or "" for s in (exc.stdout, exc.stderr))
                status = f"no return within {limit:.0f} s"
            steps = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            row = dict(shape=shape, variant=name, what=VARIANTS[name], status=status, steps=steps,
                       **({"stderr": err[-2000:]} if not status.startswith("exit 0") else {}))
            rows.append(row)
            with open(os.path.join(out_dir, "mosaic_probe.json"), "w") as f:
                json.dump(rows, f, indent=1)
            last = steps[-1] if steps else {}
            print(f"{time.perf_counter() - t0:7.1f} s | {shape} | {name} | {status} | last step: "
                  f"{last.get('step', 'none')} {json.dumps({k: x for k, x in last.items() if k != 'step'})}",
                  flush=True)


if __name__ == "__main__":
    main()

"""Run by tests/test_distributed_jax.py in a subprocess with 8 fake CPU devices: fce_jax vocab-parallel inside
``jax.shard_map(check_vma=True)``, under plain ``jax.jit`` with a weight split over V (an Explicit mesh), and
data-parallel rows with a replicated weight. Prints one JSON object: per case, the relative errors against the
float64 reference, the compiled program's large collectives, and run-to-run equality."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from quick_xla import with_flags  # noqa: E402

os.environ["XLA_FLAGS"] = with_flags("--xla_force_host_platform_device_count=8")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fce_jax  # noqa: E402
from parity.ranks import jax_child  # noqa: E402
from parity.reference import cpo_reference, flce_reference, logprobs_reference, rel_err  # noqa: E402
from hlo import large_collectives  # noqa: E402

N, H, V = 32, 24, 512
OPTS = dict(label_smoothing=0.1, z_loss=1e-3, softcap=15.0, chunk_rows=8)


def inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, H)).astype(np.float32)
    w = (rng.standard_normal((V, H)) * 3 / np.sqrt(H)).astype(np.float32)
    b = (rng.standard_normal(V) * 0.3).astype(np.float32)
    cw = (rng.random(V) + 0.5).astype(np.float32)
    y = rng.integers(0, V, N).astype(np.int32)
    y[rng.permutation(N)[:6]] = -100
    return x, w, b, cw, y


def errors(got, ref):
    return {k: rel_err(np.asarray(got[k]), ref[k]) for k in got}


def shard_map_case(size, engine="library"):
    """One program per loss: XLA's CPU runtime may start independent collectives of one program in different
    orders on different devices (seen: a stalled rendezvous), which the GPU runtime orders."""
    x, w, b, cw, y = inputs()
    mesh = jax.make_mesh((size,), ("model",))
    vp = fce_jax.VocabParallel("model")
    g = np.linspace(-1.0, 1.0, N).astype(np.float32)
    rep, shard = P(), P("model")
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731

    def run(fn, in_specs, out_specs, *args):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True))
        args = [put(a, s) for a, s in zip(args, in_specs)]
        out, again = (jax.tree.map(np.asarray, f(*args)) for _ in range(2))
        return out, all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(again)))

    def flce(x, w, b, cw):
        return jax.value_and_grad(lambda x, w, b: fce_jax.fused_lce(x, w, y, bias=b, class_weights=cw,
                                                                     vocab_parallel=vp, engine=engine, **OPTS),
                                  argnums=(0, 1, 2))(x, w, b)

    def logprobs(x, w):
        def total(x, w):
            logp, ent = fce_jax.fused_token_logprobs(x, w, y, temperature=0.7, return_entropy=True,
                                                     vocab_parallel=vp, chunk_rows=8, engine=engine)
            return jnp.sum(logp * g + ent), (logp, ent)
        (_, rows), grads = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(x, w)
        return rows, grads

    def cpo(x, w):
        return jax.value_and_grad(lambda x, w: fce_jax.fused_cpo_loss(x.reshape(4, 8, H), w, y.reshape(4, 8),
                                                                       vocab_parallel=vp, chunk_rows=8, engine=engine),
                                  argnums=(0, 1))(x, w)

    (loss, (dx, dw, db)), same_f = run(flce, (rep, shard, shard, shard), (rep, (rep, shard, shard)), x, w, b, cw)
    ((logp, ent), (lp_dx, lp_dw)), same_l = run(logprobs, (rep, shard), ((rep, rep), (rep, shard)), x, w)
    (c, (c_dx, c_dw)), same_c = run(cpo, (rep, shard), (rep, (rep, shard)), x, w)
    ref = flce_reference(x, w, y, bias=b, class_weights=cw, **{k: v for k, v in OPTS.items() if k != "chunk_rows"})
    lp = logprobs_reference(x, w, y, temperature=0.7, grad_logp=g, grad_entropy=np.ones(N))
    cp = cpo_reference(x.reshape(4, 8, H), w, y.reshape(4, 8))
    return {"flce": errors({"loss": loss, "dx": dx, "dw": dw, "db": db}, ref),
            "logprobs": errors({"logp": logp, "entropy": ent, "dx": lp_dx, "dw": lp_dw}, lp),
            "cpo": {"loss": rel_err(c, cp["loss"]), "dx": rel_err(c_dx, cp["dx"].reshape(N, H)),
                    "dw": rel_err(c_dw, cp["dw"])},
            "run_to_run_bitwise": same_f and same_l and same_c}


def jit_case(shape, names, row_spec):
    x, w, b, cw, y = inputs()
    mesh = jax.make_mesh(shape, names)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    out = {}
    for reduction in ("mean", "none"):
        def loss(x, w, cw):
            return jnp.sum(fce_jax.fused_lce(x, w, y_s, class_weights=cw, reduction=reduction, **OPTS))

        y_s = put(y, row_spec)
        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        args = (put(x, row_spec), put(w, P("model")), put(cw, P("model")))
        text = f.lower(*args).compile().as_text()
        value, (dx, dw) = f(*args)
        ref = flce_reference(x, w, y, class_weights=cw, reduction=reduction,
                             **{k: v for k, v in OPTS.items() if k != "chunk_rows"})
        out[reduction] = {"loss": rel_err(np.asarray(value), np.sum(ref["loss"])),
                          "dx": rel_err(np.asarray(dx), ref["dx"]),
                          "dw": rel_err(np.asarray(dw), ref["dw"]), "dw_sharded": dw.sharding.spec[0] == "model",
                          "large_collectives": large_collectives(text, min(N * V, V * H) // 2)}
    return out


def data_parallel_case():
    """Rows split over a data axis, the weight replicated, inside shard_map: the normalizer gives the global
    mean, and dW (a replicated parameter) is summed over the axis by JAX."""
    x, w, b, cw, y = inputs()
    mesh = jax.make_mesh((4,), ("data",))
    n_valid = float(np.sum(y != -100))

    def loss(x, w, y):
        part = fce_jax.fused_lce(x, w, y, normalizer=n_valid, chunk_rows=8)
        return jax.lax.psum(part, "data")

    f = jax.jit(jax.value_and_grad(jax.shard_map(loss, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                                                 out_specs=P(), check_vma=True), argnums=(0, 1)))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    value, (dx, dw) = f(put(x, P("data")), put(w, P()), put(y, P("data")))
    ref = flce_reference(x, w, y)
    return {"loss": rel_err(np.asarray(value), ref["loss"]), "dx": rel_err(np.asarray(dx), ref["dx"]),
            "dw": rel_err(np.asarray(dw), ref["dw"])}


def missing_vocab_parallel_case():
    """A weight shard inside shard_map without VocabParallel is refused with a clear error."""
    x, w, b, cw, y = inputs()
    mesh = jax.make_mesh((2,), ("model",))
    f = jax.shard_map(lambda x, w: fce_jax.fused_lce(x, w, y), mesh=mesh, in_specs=(P(), P("model")),
                      out_specs=P(), check_vma=True)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    try:
        f(put(x, P()), put(w, P("model")))
    except ValueError as e:
        return "VocabParallel" in str(e)
    return False


def main():
    result = {"shard_map_2": shard_map_case(2), "shard_map_4": shard_map_case(4),
              "shard_map_fused_2": shard_map_case(2, engine="fused"),
              "jit_model": jit_case((4,), ("model",), P()),
              "jit_data_model": jit_case((2, 4), ("data", "model"), P("data")),
              "data_parallel": data_parallel_case(), "missing_vocab_parallel_refused": missing_vocab_parallel_case()}
    print(json.dumps(result))


if __name__ == "__main__":  # the exit of the tools' JAX children: no teardown once the result is printed
    jax_child(main)

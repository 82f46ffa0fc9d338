"""The two twins behind one interface, so that one test body checks a behaviour of both.

``@each_twin`` parametrizes a test over ``TORCH`` and ``JAX`` (ids "torch", "jax"). A `Twin` converts the torch
tensors of ``parity.cases.make_inputs`` to its own arrays (`array`), runs ``fused_lce`` forward + backward with
the stats (`run`, `run_arrays`: a generalization of ``helpers.torch_run`` / ``helpers.jax_run`` with the
``argmax`` stat, any subset of differentiated arguments, class weights among them), the plain loss call
(`call`), ``fused_token_logprobs`` with cotangents on both outputs (`logprobs`) and ``fused_cpo_loss``
(`cpo`). Results come back as the twin's own arrays; `np64`, `bits` and `dtype` read them the same way for both.

JAX compiles: `JaxTwin` keeps one ``jax.jit`` function per static configuration (options, chunk_rows, which
arguments are differentiated, which are present), so tests that share a configuration and shapes share one
compilation; targets, class weights, bias and cotangents are traced arguments (so the value checks of
``fused_lce`` do not run under it: `call` with ``jit=False`` is the concrete call). ``fresh=True`` compiles
anew (determinism across compilations). The test programs are compiled with most of XLA's optimizations off
(`quick_jit`): on a CPU the kernels run in Pallas interpret mode, whose programs take far longer to optimize
than to run; the arithmetic is the same (tests that read XLA's optimized HLO or memory analysis compile
normally).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import case_chunk_rows, dtype_name_or_str, to_jax
from quick_xla import OPTIONS as QUICK_COMPILE
from parity.cases import make_inputs
from parity.reference import as_float64

GRAD_NAMES = {"x": "dx", "weight": "dw", "bias": "db", "class_weights": "dcw"}


def quick_jit(fn, **kw):
    """jax.jit(fn) compiled with `quick_xla.OPTIONS`."""
    import jax

    return jax.jit(fn, compiler_options=QUICK_COMPILE, **kw)


STAT_KEYS = ("lse", "z_loss", "accuracy", "argmax")


class Twin:
    name = ""
    # chunk_rows of the option tests: several chunks in torch (the Triton interpreter has no compile step), one in
    # JAX (a chunk loop compiles about twice as slowly in interpret mode; JAX's several-chunk paths are run by
    # the small cases, the chunking, skipping, logprob and CPO tests).
    option_chunk_rows = None

    def __repr__(self):
        return self.name

    # ------------------------------------------------------------------ reading results
    @staticmethod
    def np64(a):
        return None if a is None else as_float64(a)

    @staticmethod
    def dtype(a) -> str:
        return dtype_name_or_str(a.dtype)

    @staticmethod
    def bits(a) -> np.ndarray:
        """The raw bit patterns of a float array (so that -0.0 and 0.0 differ, and NaNs compare by payload)."""
        raise NotImplementedError

    def run(self, inp: dict, options: dict, *, chunk_rows=None, grad_output=None, wrt=("x", "weight", "bias"),
            fresh=False, **extra) -> dict:
        """`run_arrays` on ``make_inputs``' torch tensors (converted)."""
        return self.run_arrays(self.array(inp["x"]), self.array(inp["weight"]), self.array(inp["targets"]),
                               bias=self.array(inp.get("bias")), class_weights=self.array(inp.get("class_weights")),
                               chunk_rows=chunk_rows, grad_output=grad_output, wrt=wrt, fresh=fresh,
                               **options, **extra)


# ====================================================================================================== torch
def _copy(t):
    """A detached copy of t with its strides (a non-contiguous tensor stays non-contiguous)."""
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t.detach())


class TorchTwin(Twin):
    name = "torch"
    option_chunk_rows = 8

    @property
    def lib(self):
        import fce_torch

        return fce_torch

    @staticmethod
    def array(t):
        return t

    @staticmethod
    def strided(t):
        """The same values as a non-contiguous tensor (a transposed copy, transposed back)."""
        if t.dim() < 2:
            return torch.stack([t, t], dim=1)[:, 0]
        return t.transpose(0, 1).contiguous().transpose(0, 1)

    @staticmethod
    def bits(a):
        a = a.detach().cpu().contiguous()
        view = {torch.float32: (torch.int32, np.uint32), torch.bfloat16: (torch.int16, np.uint16),
                torch.float16: (torch.int16, np.uint16)}
        if a.dtype not in view:
            return a.numpy().copy()
        return a.view(view[a.dtype][0]).numpy().view(view[a.dtype][1]).copy()

    def call(self, x, w, t, jit=None, **kw):
        """The plain call (no gradient asked for)."""
        return self.lib.fused_lce(x, w, t, **kw)

    # How a call skips the value checks of the targets and class weights: validate=False.
    unchecked = {"validate": False}

    def loss_and_dx(self, x, w, t, **kw):
        """The loss and its gradient with respect to x (autograd; the value checks run)."""
        xs = _copy(x).requires_grad_(True)
        loss = self.lib.fused_lce(xs, w, t, **kw)
        loss.backward()
        return loss.detach(), xs.grad

    def tied(self, emb, a, ids, targets, **kw):
        """loss and (dE, dA) of hidden = tanh(embedding(ids) @ A) -> fused_lce with the embedding table as the
        head (one nn.Parameter, two uses)."""
        embedding = torch.nn.Embedding(*emb.shape)
        with torch.no_grad():
            embedding.weight.copy_(emb)
        a = torch.nn.Parameter(a.clone())
        hid = torch.tanh(embedding(ids) @ a)
        loss = self.lib.fused_lce(hid, embedding.weight, targets, **kw)
        loss.backward()
        return loss.detach(), embedding.weight.grad, a.grad

    def run_arrays(self, x, w, t, *, bias=None, class_weights=None, chunk_rows=None, grad_output=None,
                   wrt=("x", "weight", "bias"), fresh=False, **kw) -> dict:
        """fused_lce with return_stats, then backward(grad_output) (1 by default, broadcast for "none"), on
        copies of the arguments named in ``wrt`` that require grad. Returns {loss, lse, z_loss, accuracy, argmax,
        and d<arg> for each differentiated argument (None where absent or no gradient came)}."""
        args = {"x": x, "weight": w, "bias": bias, "class_weights": class_weights}
        leaves = {k: (_copy(v).requires_grad_(True) if k in wrt and v is not None else v) for k, v in args.items()}
        loss, stats = self.lib.fused_lce(leaves["x"], leaves["weight"], t, bias=leaves["bias"],
                                         class_weights=leaves["class_weights"], return_stats=True,
                                         chunk_rows=chunk_rows, **kw)
        g = torch.ones(()) if grad_output is None else torch.as_tensor(grad_output, dtype=torch.float32)
        loss.backward(g.expand_as(loss) if loss.dim() else g.reshape(()))
        out = {"loss": loss.detach(), **{k: stats[k] for k in STAT_KEYS}}
        for k in wrt:
            out[GRAD_NAMES[k]] = None if leaves[k] is None else leaves[k].grad
        return out

    def logprobs_call(self, x, w, t, **kw):
        """The plain call (no gradient asked for)."""
        return self.lib.fused_token_logprobs(x, w, t, **kw)

    def logprobs(self, x, w, t, *, bias=None, g_logp=None, g_entropy=None, return_entropy=True, grads=True,
                 fresh=False, **kw) -> dict:
        """fused_token_logprobs, then torch.autograd.grad with the cotangents of logp (and entropy) to x, weight
        and bias. Returns {logp, entropy (or None), dx, dw, db}."""
        leaves = [a.detach().clone().requires_grad_(grads) if a is not None else None for a in (x, w, bias)]
        out = self.lib.fused_token_logprobs(leaves[0], leaves[1], t, bias=leaves[2], return_entropy=return_entropy,
                                            **kw)
        logp, ent = out if return_entropy else (out, None)
        res = {"logp": logp.detach(), "entropy": None if ent is None else ent.detach(), "dx": None, "dw": None,
               "db": None}
        if grads:
            outs, cots = [logp], [torch.as_tensor(g_logp, dtype=torch.float32)]
            if return_entropy:
                outs.append(ent)
                cots.append(torch.as_tensor(g_entropy, dtype=torch.float32))
            inputs = [a for a in leaves if a is not None]
            gs = torch.autograd.grad(outs, inputs, cots)
            res["dx"], res["dw"] = gs[0], gs[1]
            res["db"] = gs[2] if bias is not None else None
        return res

    def cpo(self, x, w, y, b=None, fresh=False, **kw) -> dict:
        """fused_cpo_loss with its stats and backward; float64 numpy results (`fresh`: as JAX's, no effect)."""
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        bs = None if b is None else b.clone().requires_grad_()
        loss, stats = self.lib.fused_cpo_loss(xs, ws, y, bias=bs, return_stats=True, **kw)
        loss.backward()
        out = {"loss": loss.detach(), "dx": xs.grad, "dw": ws.grad, "db": None if bs is None else bs.grad,
               **{k: v.detach() for k, v in stats.items()}}
        return {k: None if v is None else as_float64(v) for k, v in out.items()}


# ====================================================================================================== JAX
class JaxTwin(Twin):
    name = "jax"

    def __init__(self):
        self._jitted = {}

    @property
    def lib(self):
        import fce_jax

        return fce_jax

    @staticmethod
    def array(t):
        """A JAX array with the values and dtype of the torch tensor ``t`` (None stays None); float64 becomes a
        numpy float64 array (JAX has no float64 without x64, and fused_lce must see the dtype to refuse it)."""
        if t is None:
            return None
        if t.dtype == torch.float64:
            return t.detach().cpu().numpy()
        return to_jax(t)

    @staticmethod
    def strided(a):
        """The same values through transposes (XLA picks the layout; JAX has no strided arrays)."""
        import jax.numpy as jnp

        return jnp.transpose(jnp.transpose(a)) if a.ndim < 3 else jnp.transpose(jnp.transpose(a, (1, 0, 2)),
                                                                                (1, 0, 2))

    @staticmethod
    def bits(a):
        a = np.asarray(a)
        if a.dtype.name not in ("float32", "bfloat16", "float16"):
            return a.copy()
        return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16).copy()

    def call(self, x, w, t, jit=False, **kw):
        """The plain call; under jax.jit (x, w, t, bias and class weights traced) when ``jit``; ``jit="concrete"``:
        under jax.jit with the targets closed over (concrete while tracing: the value check reads them)."""
        import jax

        if not jit:
            return self.lib.fused_lce(x, w, t, **kw)
        if jit == "concrete":
            return jax.block_until_ready(quick_jit(lambda x, w: self.lib.fused_lce(x, w, t, **kw))(x, w))
        arrays = {k: kw.pop(k) for k in ("bias", "class_weights") if k in kw}
        key = ("call", tuple(sorted((k, repr(v)) for k, v in kw.items())), tuple(sorted(arrays)))
        if key not in self._jitted:
            self._jitted[key] = quick_jit(lambda x, w, t, arrays: self.lib.fused_lce(x, w, t, **arrays, **kw))
        return jax.block_until_ready(self._jitted[key](x, w, t, arrays))

    # How a call skips the value checks of the targets and class weights: tracing them (jax.jit).
    unchecked = {"jit": True}

    def loss_and_dx(self, x, w, t, **kw):
        """The loss and its gradient with respect to x (jax.value_and_grad, eager: t is concrete)."""
        import jax

        return jax.value_and_grad(lambda x: self.lib.fused_lce(x, w, t, **kw))(x)

    def tied(self, emb, a, ids, targets, **kw):
        """loss and (dE, dA) of hidden = tanh(E[ids] @ A) -> fused_lce with E as the head (jax.value_and_grad
        under jit)."""
        import jax
        import jax.numpy as jnp

        emb, a, ids, targets = to_jax(emb), to_jax(a), to_jax(ids), to_jax(targets)
        hi = jax.lax.Precision.HIGHEST

        def fused(e, a):
            hid = jnp.tanh(jnp.matmul(e[ids], a, precision=hi))
            return self.lib.fused_lce(hid, e, targets, **kw)

        loss, (de, da) = quick_jit(jax.value_and_grad(fused, argnums=(0, 1)))(emb, a)
        return loss, de, da

    def _function(self, key, options, wrt, fresh):
        import jax
        import jax.numpy as jnp

        if not fresh and key in self._jitted:
            return self._jitted[key]
        fused_lce = self.lib.fused_lce

        def f(args, t, g):
            diff = {k: args[k] for k in wrt if args[k] is not None}
            fixed = {k: v for k, v in args.items() if k not in diff}

            def loss_fn(diff):
                a = {**fixed, **diff}
                return fused_lce(a["x"], a["weight"], t, bias=a["bias"], class_weights=a["class_weights"],
                                 return_stats=True, **options)

            loss, vjp, stats = jax.vjp(loss_fn, diff, has_aux=True)
            (grads,) = vjp(jnp.broadcast_to(g, loss.shape).astype(loss.dtype))
            out = {"loss": loss, **{k: stats[k] for k in STAT_KEYS}}
            for k in wrt:
                out[GRAD_NAMES[k]] = grads.get(k)
            return out

        fn = quick_jit(f)
        if not fresh:
            self._jitted[key] = fn
        return fn

    def run_arrays(self, x, w, t, *, bias=None, class_weights=None, chunk_rows=None, grad_output=None,
                   wrt=("x", "weight", "bias"), fresh=False, **kw) -> dict:
        """jax.jit(jax.vjp) of fused_lce with return_stats with respect to the arguments named in ``wrt``, with
        cotangent grad_output (1 by default, broadcast for "none"). Same dict as `TorchTwin.run_arrays`."""
        import jax
        import jax.numpy as jnp

        options = {**kw, "chunk_rows": chunk_rows}
        key = (tuple(sorted((k, repr(v)) for k, v in options.items())), tuple(wrt), bias is None,
               class_weights is None)
        fn = self._function(key, options, tuple(wrt), fresh)
        g_shape = tuple(t.shape) if kw.get("reduction") == "none" else ()    # one shape: one compilation
        g = jnp.asarray(1.0 if grad_output is None else np.asarray(as_float64(grad_output)), jnp.float32)
        args = {"x": x, "weight": w, "bias": bias, "class_weights": class_weights}
        return jax.block_until_ready(fn(args, t, jnp.broadcast_to(g, g_shape)))

    def logprobs(self, x, w, t, *, bias=None, g_logp=None, g_entropy=None, return_entropy=True, grads=True,
                 fresh=False, **kw) -> dict:
        """fused_token_logprobs and jax.vjp with the cotangents of logp (and entropy), under jax.jit (one
        function per static configuration, as `run_arrays`). Returns {logp, entropy (or None), dx, dw, db}."""
        import jax
        import jax.numpy as jnp

        key = ("logprobs", tuple(sorted((k, repr(v)) for k, v in kw.items())), return_entropy, grads,
               bias is None)
        fn = None if fresh else self._jitted.get(key)
        if fn is None:
            lib = self.lib

            def f(x, w, b, t, g, h):
                def fwd(x, w, b):
                    return lib.fused_token_logprobs(x, w, t, bias=b, return_entropy=return_entropy, **kw)

                if not grads:
                    out = fwd(x, w, b)
                    logp, ent = out if return_entropy else (out, None)
                    return {"logp": logp, "entropy": ent, "dx": None, "dw": None, "db": None}
                out, vjp = jax.vjp(fwd, x, w, b)
                logp, ent = out if return_entropy else (out, None)
                dx, dw, db = vjp((g, h) if return_entropy else g)
                return {"logp": logp, "entropy": ent, "dx": dx, "dw": dw, "db": db}

            fn = quick_jit(f)
            if not fresh:
                self._jitted[key] = fn
        shape = tuple(t.shape)
        g = jnp.zeros(shape, jnp.float32) if g_logp is None else jnp.asarray(as_float64(g_logp), jnp.float32)
        h = jnp.zeros(shape, jnp.float32) if g_entropy is None else jnp.asarray(as_float64(g_entropy), jnp.float32)
        return jax.block_until_ready(fn(x, w, bias, t, g, h))

    def logprobs_call(self, x, w, t, **kw):
        """The plain (eager) call: concrete targets, so the value check runs."""
        return self.lib.fused_token_logprobs(x, w, t, **kw)

    def cpo(self, x, w, y, b=None, fresh=False, **kw) -> dict:
        """jax.jit(jax.value_and_grad) of fused_cpo_loss with its stats (one function per static
        configuration, traced again with `fresh`); float64 numpy results."""
        import jax

        key = ("cpo", tuple(sorted((k, repr(v)) for k, v in kw.items())), b is None)
        if fresh or key not in self._jitted:
            lib = self.lib

            def f(x, w, b, t):
                return lib.fused_cpo_loss(x, w, t, bias=b, return_stats=True, **kw)

            argnums = (0, 1) if b is None else (0, 1, 2)
            self._jitted[key] = quick_jit(jax.value_and_grad(f, argnums=argnums, has_aux=True))
        (loss, stats), grads = self._jitted[key](to_jax(x), to_jax(w), None if b is None else to_jax(b),
                                                 to_jax(y.to(torch.int32)))
        out = {"loss": loss, "dx": grads[0], "dw": grads[1], "db": grads[2] if b is not None else None}
        return {k: None if v is None else np.asarray(v, np.float64) for k, v in {**out, **stats}.items()}


TORCH, JAX = TorchTwin(), JaxTwin()
each_twin = pytest.mark.parametrize("twin", [TORCH, JAX], ids=["torch", "jax"])


# ================================================================================ the small cases, run once
_CASE_RESULTS: dict = {}


def case_result(twin: Twin, case, fresh=False) -> dict:
    """float64 numpy outputs of ``twin`` on ``make_inputs(case)`` with the case's options and
    ``case_chunk_rows(case)``, plus "dtypes"; cached per process (the reference, cross-twin and determinism
    tests share one run per twin and case). ``fresh``: a new run (a new compilation in JAX), not cached."""
    key = (twin.name, case)
    if fresh or key not in _CASE_RESULTS:
        raw = twin.run(make_inputs(case), case.options(), chunk_rows=case_chunk_rows(case), fresh=fresh)
        res = {k: None if v is None else as_float64(v) for k, v in raw.items()}
        res["dtypes"] = {k: None if v is None else dtype_name_or_str(v.dtype) for k, v in raw.items()}
        res["bits"] = {k: None if v is None else twin.bits(v) for k, v in raw.items()}
        if fresh:
            return res
        _CASE_RESULTS[key] = res
    return _CASE_RESULTS[key]


# ================================================================================ the FLCE check
_REFERENCES: dict = {}


def _digest(t):
    """What identifies an input's values (None, a number, or a tensor's dtype, shape and bytes)."""
    if t is None or isinstance(t, (int, float)):
        return t
    t = torch.as_tensor(t).detach().cpu()
    return (str(t.dtype), tuple(t.shape), hash(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()))


def check_flce(case, inp: dict, out: dict, *, ignore_index=None, grad_output=None, **ref_kw) -> dict:
    """A twin's `run` on ``inp`` against ``flce_reference`` of the same inputs and the case's options
    (``ref_kw`` overrides them; the engine is not one: it changes bits, not the math): loss, dx, dw, db,
    z_loss, accuracy within SPEC bounds, lse on the valid rows,
    lse exactly 0 on the ignored rows, and argmax equal to the reference's first argmax (-1 on ignored rows).
    Returns the reference."""
    from helpers import assert_close_to_reference, restrict_lse
    from parity.cases import IGNORE_INDEX
    from parity.reference import flce_reference

    ignore_index = IGNORE_INDEX if ignore_index is None else ignore_index
    options = {**case.math_options(), **ref_kw}
    key = (repr(sorted(options.items())), ignore_index, _digest(grad_output),
           *(_digest(inp[k]) for k in ("x", "weight", "targets", "bias", "class_weights")))
    if key not in _REFERENCES:     # the twins' runs of one test (and repeated checks) share it
        if len(_REFERENCES) > 256:
            _REFERENCES.clear()
        _REFERENCES[key] = flce_reference(inp["x"], inp["weight"], inp["targets"], bias=inp["bias"],
                                          class_weights=inp["class_weights"], ignore_index=ignore_index,
                                          grad_output=grad_output, **options)
    ref = _REFERENCES[key]
    got, want = restrict_lse(out, ref, inp["targets"], ignore_index)
    assert_close_to_reference(got, want, case.dtype)
    ignored = as_float64(inp["targets"]) == ignore_index
    if out.get("lse") is not None:
        assert np.all(as_float64(out["lse"])[ignored] == 0), "lse of ignored rows is not 0"
    if out.get("argmax") is not None:
        check_argmax(out["argmax"], ref["argmax"], inp, softcap=case.options().get("softcap"))
    return ref


def check_argmax(got, want, inp, softcap=None):
    """argmax: -1 exactly where the reference has -1 (ignored rows); elsewhere the reference's first argmax,
    or a class whose float64 logit is within 1e-5 (relative) of the row's max (a tie in float32, e.g. logits
    saturated by a softcap)."""
    got = as_float64(got).astype(np.int64)
    assert got.shape == want.shape, (got.shape, want.shape)
    got, want = got.reshape(-1), want.reshape(-1)
    assert np.array_equal(got == -1, want == -1), (got, want)
    differ = np.flatnonzero((got != want) & (want != -1))
    if differ.size == 0:
        return
    x = torch.from_numpy(as_float64(inp["x"])).reshape(-1, inp["x"].shape[-1])[differ]
    z = x @ torch.from_numpy(as_float64(inp["weight"])).T
    if inp.get("bias") is not None:
        z = z + torch.from_numpy(as_float64(inp["bias"]))
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    top = z.max(dim=1).values
    at = z.gather(1, torch.from_numpy(got[differ])[:, None])[:, 0]
    assert torch.all(top - at <= 1e-5 * top.abs().clamp(min=1.0)), (differ, got[differ], want[differ], top - at)

"""XLA's options for the CPU test programs: on a CPU the kernels run in Pallas interpret mode, whose programs
take far longer to optimize and compile than to run (about 3x faster to build with these); the arithmetic is the
same. `twins.quick_jit` passes them to the test programs it compiles; conftest.py also sets them in XLA_FLAGS on
a machine without a GPU, because Mosaic GPU's interpret mode compiles each simulated thread's program again at
every kernel call through its own ``jax.jit``, out of reach of a caller's compiler options (half of its time
per call at default optimization); the tests that start JAX in a subprocess (tests/dist_jax.py, the tools' vocab
parallel runs) pass them on."""

OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
           "xla_cpu_use_fusion_emitters": False}


def with_flags(xla_flags: str = "") -> str:
    """``xla_flags`` (an XLA_FLAGS value) with OPTIONS appended."""
    own = " ".join(f"--{k}={str(v).lower()}" for k, v in OPTIONS.items())
    return f"{xla_flags} {own}".strip()

"""Cross-framework parity: fce_torch vs fce_jax vs Liger vs float64 on the same tensors (``python -m parity``).

Modules, in the order a run uses them:

* :mod:`parity.cases`: the case types (FLCE, CPO, log-probs) and the tensors each makes; the shared tiny
  FLCE cases of the twins' tests;
* :mod:`parity.catalog`: the suite's case tables (CPU, GPU, ``--quick``, ``--case``);
* :mod:`parity.environment`: the machine, and the IEEE float32 setting around the float32 cases;
* :mod:`parity.bridge`: zero-copy torch <-> JAX through DLPack;
* :mod:`parity.impls`: the implementations under test, run twice on the same tensors;
* :mod:`parity.reference`: the float64 evaluation of the SPEC (on the device, by chunks; or on CPU copies);
* :mod:`parity.measures`: bitwise equality, ULP distance, relative error;
* :mod:`parity.verdicts`: the SPEC bounds, the verdicts, the summary and the exit code;
* :mod:`parity.runner`: one case, and a whole run;
* :mod:`parity.explain`: where the twins part (``--explain``);
* :mod:`parity.report`: progress, the terminal table, JSON and Markdown.
"""

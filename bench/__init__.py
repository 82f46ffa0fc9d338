"""Benchmarks of fused linear cross-entropy against its peers: ``python -m bench {op,sft,cpo}``.

- ``op``:  the loss alone (forward+backward and loss-only) at the anchor shapes of DESIGN.md;
- ``sft``: one training step of a Hugging Face causal LM (and a JAX twin) with each loss;
- ``cpo``: the fused CPO preference loss.

Results go to ``bench/results/<gpu-name>/`` as JSON, Markdown and PNG; ``--smoke`` runs tiny shapes on the CPU
(Triton interpreter, Pallas interpret mode) for CI.
"""

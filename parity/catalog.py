"""The parity suite's case tables: tiny cases for the CPU interpreters, the real shapes for a GPU, ``--quick``
and ``--case`` selection, and the JSON description of a case."""

from __future__ import annotations

import dataclasses
import fnmatch

from .cases import Case, CpoCase, LogprobCase, small_cases

__all__ = ["small_option_cases", "small_cpo_cases", "small_logprob_cases", "gpu_cases", "gpu_cpo_cases",
           "gpu_logprob_cases", "default_cases", "quick_cases", "select_cases", "case_meta"]


def small_option_cases() -> list[Case]:
    """Tiny FLCE cases for the options beyond :func:`parity.cases.small_cases`: token scaling, a (D, n)
    normalizer, class weights of both signs, a float32 bias with bfloat16 ``x``."""
    return [
        Case("token_scaling_f32", (19,), 32, 777, "float32", token_scaling=True, z_loss=1e-4, seed=41),
        Case("token_scaling_none_bf16", (3, 5), 32, 130, "bfloat16", reduction="none", token_scaling=True,
             seed=42),
        Case("normalizer_pair_bf16", (17,), 32, 777, "bfloat16", normalizer=(52.5, 64.0), z_loss=1e-4,
             class_weights=True, seed=43),
        Case("negative_class_weights_f32", (29,), 32, 777, "float32", class_weights=True,
             negative_class_weights=True, label_smoothing=0.1, seed=44),
        Case("bias_f32_x_bf16", (21,), 48, 1000, "bfloat16", bias=True, bias_dtype="float32", seed=45),
        Case("fused_all_options_bf16", (2, 11), 48, 1000, "bfloat16", bias=True, label_smoothing=0.1, z_loss=1e-4,
             softcap=30.0, class_weights=True, logit_scale=30.0, engine="fused", seed=46),
        Case("fused_f32", (23,), 32, 777, "float32", ignore_frac=0.3, engine="fused", seed=47),
    ]


def small_cpo_cases() -> list[CpoCase]:
    """Tiny CPO cases for the CPU interpreters: each loss type, both dtypes, bias, label smoothing."""
    return [
        CpoCase("cpo_sigmoid_f32", 2, 8, 32, 130, "float32", seed=21),
        CpoCase("cpo_sigmoid_ls_bias_bf16", 2, 8, 32, 130, "bfloat16", bias=True, label_smoothing=0.1, seed=22),
        CpoCase("simpo_bf16", 2, 8, 32, 130, "bfloat16", loss_type="simpo", seed=23),
        CpoCase("ipo_f32", 1, 12, 16, 130, "float32", loss_type="ipo", seed=24),
        CpoCase("hinge_f32", 2, 6, 16, 130, "float32", loss_type="hinge", beta=0.5, seed=25),
        CpoCase("fused_cpo_ls_bias_bf16", 2, 8, 32, 130, "bfloat16", bias=True, label_smoothing=0.1,
                engine="fused", seed=26),
    ]


def small_logprob_cases() -> list[LogprobCase]:
    """Tiny log-prob cases: both dtypes, bias, softcap with temperature, many ignored rows in a 3-D ``x``,
    all rows ignored."""
    return [
        LogprobCase("logprobs_f32", (29,), 32, 777, "float32", seed=31),
        LogprobCase("logprobs_bias_bf16", (21,), 48, 1000, "bfloat16", bias=True, seed=32),
        LogprobCase("logprobs_softcap_temp_f32", (13,), 32, 1000, "float32", softcap=15.0, temperature=0.7,
                    logit_scale=30.0, seed=33),
        LogprobCase("logprobs_ignored_3d_bf16", (2, 7), 32, 130, "bfloat16", ignore_frac=0.5, temperature=1.3,
                    seed=34),
        LogprobCase("logprobs_all_ignored_f32", (8,), 16, 130, "float32", ignore_frac=1.0, seed=35),
        LogprobCase("fused_logprobs_ignored_3d_bf16", (2, 7), 32, 130, "bfloat16", ignore_frac=0.5,
                    temperature=1.3, engine="fused", seed=36),
    ]


def gpu_cases() -> list[Case]:
    """The real shapes (SPEC anchors): bf16 at (N, H, V) = (4096, 4096, 128256) over the option grid
    (each option, three reductions, all options at once, token scaling, a normalizer pair, negative class
    weights, a float32 bias), (8192, 2304, 256000) over the reductions and all options, both with half the
    rows ignored, and float32 at (1024, 1024, 32000); and the fused engine (``engine="fused"``) at those
    shapes, (8192, 896, 151936) with half the rows ignored, (16384, 2048, 128256), (256, 4096, 128256),
    (8192, 640, 262144) and float16 at (8192, 2304, 256000)."""
    a = dict(shape=(4096,), h=4096, v=128256, dtype="bfloat16")
    b = dict(shape=(8192,), h=2304, v=256000, dtype="bfloat16")
    f = dict(shape=(1024,), h=1024, v=32000, dtype="float32")
    all_opts = dict(bias=True, label_smoothing=0.1, z_loss=1e-4, softcap=30.0, class_weights=True,
                    logit_scale=30.0)
    out = []
    for tag, shp, seed in (("4k_4k_128k", a, 100), ("8k_2304_256k", b, 200)):
        out += [Case(f"bf16_{tag}_mean", **shp, seed=seed),
                Case(f"bf16_{tag}_sum", **shp, reduction="sum", seed=seed + 1),
                Case(f"bf16_{tag}_none", **shp, reduction="none", seed=seed + 2)]
        if tag == "4k_4k_128k":
            out += [Case(f"bf16_{tag}_bias", **shp, bias=True, seed=seed + 3),
                    Case(f"bf16_{tag}_label_smoothing", **shp, label_smoothing=0.1, seed=seed + 4),
                    Case(f"bf16_{tag}_z_loss", **shp, z_loss=1e-4, seed=seed + 5),
                    Case(f"bf16_{tag}_softcap", **shp, softcap=30.0, logit_scale=30.0, seed=seed + 6),
                    Case(f"bf16_{tag}_class_weights", **shp, class_weights=True, seed=seed + 7)]
        out.append(Case(f"bf16_{tag}_all_options", **shp, **all_opts, seed=seed + 8))
        # Half the rows ignored: the chunks past the valid rows are skipped (kept dZ at 4k, accumulated at 8k).
        out.append(Case(f"bf16_{tag}_half_ignored", **shp, ignore_frac=0.5, seed=seed + 9))
    out += [Case("bf16_4k_4k_128k_token_scaling", **a, token_scaling=True, z_loss=1e-4, seed=110),
            # e.g. the global counts of two data-parallel ranks: (D, n) differ with class weights
            Case("bf16_4k_4k_128k_normalizer_pair", **a, normalizer=(9000.0, 7400.0), z_loss=1e-4,
                 class_weights=True, seed=111),
            Case("bf16_4k_4k_128k_negative_class_weights", **a, class_weights=True, negative_class_weights=True,
                 seed=112),
            Case("bf16_4k_4k_128k_bias_f32", **a, bias=True, bias_dtype="float32", seed=113)]
    fused = dict(engine="fused")
    out += [Case("fused_bf16_4k_4k_128k_mean", **a, **fused, seed=100),
            Case("fused_bf16_4k_4k_128k_all_options", **a, **all_opts, **fused, seed=108),
            Case("fused_bf16_4k_4k_128k_half_ignored", **a, ignore_frac=0.5, **fused, seed=109),
            Case("fused_bf16_8k_2304_256k_mean", **b, **fused, seed=200),
            Case("fused_bf16_8k_2304_256k_half_ignored", **b, ignore_frac=0.5, **fused, seed=209),
            Case("fused_bf16_8k_896_152k_half_ignored", (8192,), 896, 151936, "bfloat16", ignore_frac=0.5,
                 **fused, seed=210),
            Case("fused_bf16_16k_2048_128k_mean", (16384,), 2048, 128256, "bfloat16", **fused, seed=211),
            # one chunk of 256 rows: the launches for few rows (fce_core.config.SHORT_ROWS)
            Case("fused_bf16_256_4k_128k_mean", (256,), 4096, 128256, "bfloat16", **fused, seed=214),
            # Gemma-3-270M's head: dX over V in the most slices (few output tiles at H=640)
            Case("fused_bf16_8k_640_262k_mean", (8192,), 640, 262144, "bfloat16", **fused, seed=212),
            Case("fused_f32_1k_1k_32k_mean", **f, **fused, seed=300),
            # float16, dW accumulated in float32 over chunks (Mosaic GPU's ADD in JAX); "sum", as a "mean" dZ
            # = p / n falls below float16's subnormals at such N (parity/results/nvidia-h200/engine-fused-f16-probe/)
            Case("fused_f16_8k_2304_256k_sum", (8192,), 2304, 256000, "float16", reduction="sum", **fused,
                 seed=213)]
    out += [Case("f32_1k_1k_32k_mean", **f, seed=300),
            Case("f32_1k_1k_32k_large_logits", **f, logit_scale=50.0, seed=301),
            Case("f32_1k_1k_32k_none", **f, reduction="none", seed=302),
            Case("f32_1k_1k_32k_all_options", **f, **all_opts, seed=303)]
    return out


def gpu_cpo_cases() -> list[CpoCase]:
    """CPO at the anchor shape of DESIGN.md (B=2 pairs, T=1024, H=4096, V=128256, bf16), each loss type, and
    at B=8 pairs."""
    s = dict(pairs=2, t=1024, h=4096, v=128256, dtype="bfloat16")
    return [CpoCase("cpo_sigmoid_bf16_2x1024_4k_128k", **s, seed=400),
            CpoCase("cpo_sigmoid_ls_bias_bf16_2x1024_4k_128k", **s, bias=True, label_smoothing=0.1, seed=401),
            CpoCase("simpo_bf16_2x1024_4k_128k", **s, loss_type="simpo", seed=402),
            CpoCase("ipo_bf16_2x1024_4k_128k", **s, loss_type="ipo", seed=403),
            CpoCase("hinge_bf16_2x1024_4k_128k", **s, loss_type="hinge", seed=404),
            # 8 pairs: all rows' dZ would outgrow the dW accumulator, so groups of whole pairs run.
            CpoCase("cpo_sigmoid_bf16_8x1024_4k_128k", **{**s, "pairs": 8}, seed=405),
            CpoCase("fused_cpo_sigmoid_bf16_2x1024_4k_128k", **s, engine="fused", seed=406),
            # 4 pairs: two groups of two pairs, the second one the last accumulation of the dW pair (PAIR_LAST)
            # with no group between them; at 8 pairs the middle groups run in fce_jax's loop
            CpoCase("fused_cpo_sigmoid_bf16_4x1024_4k_128k", **{**s, "pairs": 4}, engine="fused", seed=408),
            CpoCase("fused_cpo_sigmoid_bf16_8x1024_4k_128k", **{**s, "pairs": 8}, engine="fused", seed=407)]


def gpu_logprob_cases() -> list[LogprobCase]:
    """Log-probs at the Llama-3 head (4096, 4096, 128256) and the Qwen2.5 head (8192, 2048, 151936) with the
    RL sampling temperature 0.7, both bf16, one with softcap and bias, and float32 at (1024, 1024, 32000)."""
    a = dict(shape=(4096,), h=4096, v=128256, dtype="bfloat16")
    return [LogprobCase("logprobs_bf16_4k_4k_128k", **a, seed=500),
            LogprobCase("logprobs_bf16_8k_2048_152k_temp07", (8192,), 2048, 151936, "bfloat16", temperature=0.7,
                        seed=501),
            LogprobCase("logprobs_bf16_4k_4k_128k_softcap_bias", **a, softcap=30.0, logit_scale=30.0, bias=True,
                        seed=502),
            LogprobCase("logprobs_f32_1k_1k_32k_temp07", (1024,), 1024, 32000, "float32", temperature=0.7,
                        seed=503),
            LogprobCase("fused_logprobs_bf16_4k_4k_128k", **a, engine="fused", seed=504),
            LogprobCase("fused_logprobs_bf16_8k_2048_152k_temp07", (8192,), 2048, 151936, "bfloat16",
                        temperature=0.7, engine="fused", seed=505)]


def default_cases(device: str, *, cpo: bool = True, logprobs: bool = True) -> list:
    """The default table: small cases in the interpreters on a CPU, the real shapes on a GPU."""
    if device == "cpu":
        return (small_cases() + small_option_cases() + (small_cpo_cases() if cpo else [])
                + (small_logprob_cases() if logprobs else []))
    return gpu_cases() + (gpu_cpo_cases() if cpo else []) + (gpu_logprob_cases() if logprobs else [])


_QUICK_CPU = ("f32_basic", "bias_bf16", "none_3d", "all_options_bf16", "cpo_sigmoid_f32", "logprobs_bias_bf16")
_QUICK_GPU = ("bf16_4k_4k_128k_mean", "bf16_8k_2304_256k_mean", "f32_1k_1k_32k_all_options",
              "cpo_sigmoid_bf16_2x1024_4k_128k", "logprobs_bf16_8k_2048_152k_temp07")


def quick_cases(cases: list, device: str) -> list:
    """``--quick``: a few representative cases of ``cases`` (the first four when none of the usual ones exist)."""
    wanted = _QUICK_CPU if device == "cpu" else _QUICK_GPU
    picked = [c for c in cases if c.name in wanted]
    return picked or cases[:4]


def select_cases(cases: list, patterns: list[str] | None) -> list:
    """Cases whose name matches any pattern (``fnmatch`` wildcards; a plain word matches as a substring)."""
    if not patterns:
        return list(cases)
    pats = [p if any(ch in p for ch in "*?[") else f"*{p}*" for p in patterns]
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in pats)]


def case_meta(case) -> dict:
    """A JSON-friendly description of a case: its fields, ``kind``, ``rows`` and the expected ``outputs``
    (output -> dtype; the outputs this case has)."""
    d = dataclasses.asdict(case)
    d.update(kind=case.kind, shape=list(case.shape), rows=case.rows,
             outputs={o: dt for o, dt in case.output_dtypes().items() if dt is not None})
    return d

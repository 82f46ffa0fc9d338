#!/usr/bin/env bash
# One GPU session in one call: the jobs asked for, in order; every report goes into $OUT/results.tgz (packed
# again after each job, so that a call stopped at its time limit still returns what finished), and a short
# summary is printed last.
#
# Usage (on the GPU machine, from the repo root):
#   source .whl/install.sh && bash tools/gpu_run.sh gputests peers parity op logprobs cpo sft profile
# Jobs:
#   gputests  pytest on the GPU: torch.compile (inductor), the float32 policy, the default engine's choice,
#             the logits GEMM's ping-pong kernel and the gradient GEMMs' Gluon kernel against the Triton kernels,
#             the JAX twin's Mosaic GPU dZ pass against the Triton lowering's
#   peers     the peers' own test files against the drop-ins (needs .peers/sdist and .peers/cce-main carried)
#   parity    python -m parity          op, logprobs, cpo, sft, profile: python -m bench <job>
#   kernels   python tools/fused_kernels.py, the fused GEMMs one by one (KERNELS_ARGS="--grads 4096,4096,128256")
#   mosaic    python tools/mosaic_probe.py, the Mosaic GPU logits GEMM's variants, each in a process under a limit
#   host      python tools/host_path.py --cuda, fce_torch's host time per fused fwd+bwd with and without its
#             launches (HOST_ARGS: shapes N,H,V; 256,4096,128256 by default)
#   engine    python tools/engine_ab.py, fce_jax's fused fwd+bwd under launch variants, bits against the defaults'
#             (ENGINE_ARGS: shapes and --variant ...; the three shapes of the loader A/B by default)
# Extra arguments for a job go in env vars: PARITY_ARGS, OP_ARGS, LOGPROBS_ARGS, CPO_ARGS, SFT_ARGS, KERNELS_ARGS,
# MOSAIC_ARGS, HOST_ARGS, ENGINE_ARGS;
# JOB_TIMEOUT (seconds, default 1800) bounds each job, <JOB>_TIMEOUT (e.g. PARITY_TIMEOUT) one of them.
set -u
out=${OUT:-out}
mkdir -p "$out"
results=$(mktemp -d)
status=0
for job in "$@"; do
  bound="${job^^}_TIMEOUT"
  limit=${!bound:-${JOB_TIMEOUT:-1800}}
  echo "=== $job ($(date +%T), at most ${limit} s)"
  mkdir -p "$results/$job"
  case $job in
    gputests) FCE_TEST_DEVICE=cuda timeout "$limit" python -m pytest -q -p no:warnings -o addopts="" \
                tests/test_compile.py tests/test_float32_policy.py tests/test_engine_choice.py \
                tests/test_logits_pingpong.py tests/test_grad_gemms_gluon.py tests/test_tile_dlogits_mgpu.py \
                -m "gpu or not gpu" \
                --junitxml "$results/$job/junit.xml" 2>&1 |
                tail -25 ;;
    peers)    timeout "$limit" python -m tests.peers --device cuda --offline --json "$results/$job/peers.json" &&
              timeout "$limit" python -m tests.peers --device cuda --offline --cce-tests main --only cce-main \
                --json "$results/$job/peers-cce-main.json" ;;
    parity)   timeout "$limit" python -m parity --no-progress --out "$results/$job" ${PARITY_ARGS:-} ;;
    kernels)  timeout "$limit" python tools/fused_kernels.py "$results/$job" ${KERNELS_ARGS:-} 2>&1 |
                tee "$results/$job/log.txt" ;;
    mosaic)   timeout "$limit" python tools/mosaic_probe.py "$results/$job" ${MOSAIC_ARGS:-} ;;
    host)     timeout "$limit" python tools/host_path.py --cuda ${HOST_ARGS:-} 2>&1 | tee "$results/$job/host.txt" ;;
    engine)   timeout "$limit" python tools/engine_ab.py --out "$results/$job/engine_ab.json" \
                ${ENGINE_ARGS:-16384,2048,128256 8192,640,262144 8192,896,151936} | tee "$results/$job/engine_ab.md" ;;
    op)       timeout "$limit" python -m bench op --out "$results/$job" ${OP_ARGS:-} ;;
    logprobs) timeout "$limit" python -m bench logprobs --out "$results/$job" ${LOGPROBS_ARGS:-} ;;
    cpo)      timeout "$limit" python -m bench cpo --out "$results/$job" ${CPO_ARGS:-} ;;
    sft)      timeout "$limit" python -m bench sft --out "$results/$job" ${SFT_ARGS:-} ;;
    profile)  timeout "$limit" python -m bench sft --profile --out "$results/$job" ${SFT_ARGS:-} ;;
    *)        echo "unknown job $job"; false ;;
  esac
  rc=${PIPESTATUS[0]}
  echo "=== $job exit $rc ($(date +%T))"
  [ "$rc" -eq 0 ] || status=$rc
  tar czf "$out/results.tgz" -C "$results" .
done
echo "=== summary"
for md in "$results"/*/*.md; do
  [ -f "$md" ] && { echo "--- $md"; grep -E '^\|' "$md" | head -60; }
done
exit $status

#!/usr/bin/env bash
# One GPU session in one call: correctness first (python -m parity), then the benchmarks asked for; every
# report goes into $OUT/results.tgz (the device tool returns few files), a short summary is printed last.
#
# Usage (on the GPU machine, from the repo root):
#   source .whl/install.sh && bash tools/gpu_run.sh parity op cpo        # any of: parity op cpo sft profile
# Extra arguments for a job go in env vars: PARITY_ARGS, OP_ARGS, CPO_ARGS, SFT_ARGS.
set -u
out=${OUT:-out}
mkdir -p "$out"
results=$(mktemp -d)
status=0
for job in "$@"; do
  echo "=== $job ($(date +%T))"
  case $job in
    parity)  python -m parity --no-progress --out "$results/parity" ${PARITY_ARGS:-} ;;
    op)      python -m bench op --out "$results/bench" ${OP_ARGS:-} ;;
    cpo)     python -m bench cpo --out "$results/bench" ${CPO_ARGS:-} ;;
    sft)     python -m bench sft --out "$results/bench" ${SFT_ARGS:-} ;;
    profile) python -m bench sft --profile --out "$results/bench" ${SFT_ARGS:-} ;;
    *)       echo "unknown job $job (parity op cpo sft profile)"; false ;;
  esac
  rc=$?
  echo "=== $job exit $rc ($(date +%T))"
  [ $rc -eq 0 ] || status=$rc
done
tar czf "$out/results.tgz" -C "$results" .
echo "=== summary"
for md in "$results"/parity/*.md "$results"/bench/*.md; do
  [ -f "$md" ] && { echo "--- $(basename "$md")"; grep -E '^\|' "$md" | head -40; }
done
exit $status

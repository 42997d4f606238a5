#!/usr/bin/env bash
# Device calls for the models of issue 5 (and the GPU suite after kernel changes).
#   tools/gpu_models.sh tests   the whole GPU test suite, then the convolution benchmark
#   tools/gpu_models.sh lstm    the small-world LSTM experiment (budget $LSTM_BUDGET s), workload I
# Logs and JSON under $OUT; short summaries printed last.
set -uo pipefail
OUT=${OUT:-/tmp/bsmm-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BSMM_CACHE_DIR=${BSMM_CACHE_DIR:-/tmp/bsmm-cache}
status=0
if [[ ${1:-tests} == tests ]]; then
  t0=$(date +%s)
  python3 -m pytest -q -m gpu tests -p no:cacheprovider >"$OUT/pytest_gpu.log" 2>&1 || status=1
  echo "gpu tests: $(tail -1 "$OUT/pytest_gpu.log") [$(( $(date +%s) - t0 ))s]"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.log" | head -30
  t0=$(date +%s)
  python3 tools/bench_conv.py --json "$OUT/conv_h100.json" >"$OUT/conv_h100.md" 2>&1 || status=1
  echo "conv bench [$(( $(date +%s) - t0 ))s]:"
  grep -E "^\|" "$OUT/conv_h100.md" | head -40
  tail -3 "$OUT/conv_h100.md"
else
  t0=$(date +%s)
  python3 tools/lstm_experiment.py --budget "${LSTM_BUDGET:-240}" --json "$OUT/lstm_h100.json" \
    --markdown "$OUT/lstm_h100.md" >"$OUT/lstm.log" 2>&1 || status=1
  echo "lstm [$(( $(date +%s) - t0 ))s]:"
  cat "$OUT/lstm_h100.md" 2>/dev/null || tail -20 "$OUT/lstm.log"
  python3 -m bsmm bench --backend gpu --workloads I --dtype float16,bfloat16 --json "$OUT/I.json" >"$OUT/I.md" 2>&1 \
    || status=1
  grep -E "^\| I" "$OUT/I.md" | awk -F'|' '{print $3, $6, $7, $8, $9, $11, $12, $13}'
fi
exit $status

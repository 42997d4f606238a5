#!/usr/bin/env bash
# One device call for the sm_90a wgmma path: its GPU tests, memcheck of them, and workload T
# with wgmma on and off (BSMM_WGMMA=0) side by side. Logs under $OUT; a short table last.
set -uo pipefail
OUT=${OUT:-/tmp/bsmm-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BSMM_CACHE_DIR=${BSMM_CACHE_DIR:-/tmp/bsmm-cache}
t0=$(date +%s)
python3 -m pytest -q -m gpu tests/test_passes.py -k "${TESTS:-wgmma or accumulate or long_block}" -x \
  -p no:cacheprovider >"$OUT/pytest.log" 2>&1
rc=$?
echo "gpu tests rc=$rc: $(tail -1 "$OUT/pytest.log") [$(( $(date +%s) - t0 ))s]"
grep -E "^(FAILED|E )" "$OUT/pytest.log" | head -20
if [[ $rc != 0 ]]; then exit 1; fi
t0=$(date +%s)
compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu tests/test_passes.py -k wgmma \
  -p no:cacheprovider >"$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?: $(grep -m1 'ERROR SUMMARY' "$OUT/memcheck.log") [$(( $(date +%s) - t0 ))s]"
for bs in ${BLOCKS:-64 128}; do
  for flag in ${FLAGS:-1 0}; do
    BSMM_WGMMA=$flag python3 -m bsmm bench --backend gpu --workloads T --block-size "$bs" \
      --dtype "${DTYPES:-float16}" --json "$OUT/T_bs${bs}_wgmma${flag}.json" >"$OUT/T_bs${bs}_wgmma${flag}.md" 2>&1
    echo "== T block $bs, BSMM_WGMMA=$flag"
    grep -E "^\|" "$OUT/T_bs${bs}_wgmma${flag}.md" | head -20
  done
done

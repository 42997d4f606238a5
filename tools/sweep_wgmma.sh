#!/usr/bin/env bash
# Device call: which N-major descriptor convention is right (both built, GPU tests on each),
# then workload T (fp16) for candidate wgmma tiles given as "block:BM,BN,BK,WM,WN,STAGES" words
# in $TILES, each through a BSMM_CONFIG override. Logs under $OUT; table last.
set -uo pipefail
OUT=${OUT:-/tmp/bsmm-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BSMM_CACHE_DIR=${BSMM_CACHE_DIR:-/tmp/bsmm-cache}
good=""
for m in 0 1; do
  BSMM_NVRTC_OPTIONS="-DBSMM_MN_LBO_IS_K=$m" python3 -m pytest -q -m gpu tests/test_passes.py -k wgmma \
    -p no:cacheprovider >"$OUT/wgmma_tests_$m.log" 2>&1
  rc=$?
  echo "BSMM_MN_LBO_IS_K=$m: rc=$rc $(tail -1 "$OUT/wgmma_tests_$m.log")"
  [[ $rc == 0 && -z $good ]] && good=$m
done
[[ -z $good ]] && { grep -m 10 -E "^E " "$OUT/wgmma_tests_0.log"; exit 1; }
export BSMM_NVRTC_OPTIONS="-DBSMM_MN_LBO_IS_K=$good"
for word in ${TILES:-}; do
  bs=${word%%:*}; tile=${word#*:}
  cfg="$OUT/tile_${bs}_${tile//,/_}.toml"
  printf '[kernels.sm90.wgmma16.sparse]\n"%s" = { large = [%s] }\n' "$bs" "$tile" >"$cfg"
  BSMM_CONFIG=$cfg python3 -m bsmm bench --backend gpu --workloads T --block-size "$bs" --dtype float16 \
    --json "${cfg%.toml}.json" >"${cfg%.toml}.md" 2>&1
  echo "== block $bs tile [$tile]"
  grep -E "^\| T" "${cfg%.toml}.md" | grep -v updat | awk -F'|' '{print $7, $8, $9, $11, $14}'
done

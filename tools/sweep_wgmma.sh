#!/usr/bin/env bash
# Device call: workload T (fp16) for candidate wgmma tiles given as "block:BM,BN,BK,WM,WN,STAGES"
# words in $TILES, each through a BSMM_CONFIG override. Logs under $OUT; table last.
set -uo pipefail
OUT=${OUT:-/tmp/bsmm-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BSMM_CACHE_DIR=${BSMM_CACHE_DIR:-/tmp/bsmm-cache}
for word in ${TILES:-}; do
  bs=${word%%:*}; tile=${word#*:}
  cfg="$OUT/tile_${bs}_${tile//,/_}.toml"
  printf '[kernels.sm90.wgmma16.sparse]\n"%s" = { large = [%s] }\n' "$bs" "$tile" >"$cfg"
  BSMM_CONFIG=$cfg python3 -m bsmm bench --backend gpu --workloads T --block-size "$bs" --dtype float16 \
    --json "${cfg%.toml}.json" >"${cfg%.toml}.md" 2>&1
  echo "== block $bs tile [$tile]"
  grep -E "^\| T" "${cfg%.toml}.md" | grep -v updat | awk -F'|' '{print $7, $8, $9, $11, $14}'
done

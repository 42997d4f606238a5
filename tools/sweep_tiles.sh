#!/usr/bin/env bash
# Device call: workload T ($DTYPE, default float16) for candidate tiles given as "block:TILE" words in $TILES
# (TILE = the comma-separated entry of the launch table), each through a BSMM_CONFIG override
# of one table: $SECTION (default kernels.sm90.wgmma16.sparse), batch class $CLASS (default
# large). Prints the rows of the passes matching $PASSES (default fprop|bprop). Logs under $OUT.
#   TILES="16:16,128,64,1,8,4,8" SECTION=kernels.default.tensor16.updat_rows CLASS=any PASSES=updat \
#     tools/sweep_tiles.sh
set -uo pipefail
OUT=${OUT:-/tmp/bsmm-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BSMM_CACHE_DIR=${BSMM_CACHE_DIR:-/tmp/bsmm-cache}
section=${SECTION:-kernels.sm90.wgmma16.sparse}
for word in ${TILES:-}; do
  bs=${word%%:*}; tile=${word#*:}
  cfg="$OUT/tile_${section##*.}_${bs}_${tile//,/_}.toml"
  printf '[%s]\n"%s" = { %s = [%s] }\n' "$section" "$bs" "${CLASS:-large}" "$tile" >"$cfg"
  BSMM_CONFIG=$cfg python3 -m bsmm bench --backend gpu --workloads T --block-size "$bs" --dtype "${DTYPE:-float16}" \
    --json "${cfg%.toml}.json" >"${cfg%.toml}.md" 2>&1
  echo "== block $bs [$section] [$tile]"
  grep -E "^\| T" "${cfg%.toml}.md" | grep -E "${PASSES:-fprop|bprop}" | awk -F'|' '{print $7, $8, $9, $11, $14}'
done

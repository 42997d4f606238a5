#!/usr/bin/env bash
# Device call: `bsmm bench` once per configuration override, each a BSMM_CONFIG file of one key.
#   tools/gpu/sweep_config.sh kernels.updat_cut_gain=0.25 kernels.updat_cut_gain=0 -- --workloads T --block-size 128
#   tools/gpu/sweep_config.sh "kernels.default.tf32.sparse.64={large=[128,64,32,4,2,3]}" -- --workloads T \
#     --block-size 64 --dtype tf32      (a launch-table tile: the whole entry of that block size)
# "default" runs without an override. Prints the rows of the passes matching $PASSES (default
# all); full tables and JSON under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/bsmm-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BSMM_CACHE_DIR=${BSMM_CACHE_DIR:-/tmp/bsmm-cache}
settings=()
while [[ $# -gt 0 && $1 != -- ]]; do settings+=("$1"); shift; done
shift || true
for word in "${settings[@]}"; do
  name=$(printf '%s' "$word" | tr -c 'A-Za-z0-9_.-' '_')
  cfg="$OUT/config_${name}.toml"
  if [[ $word == default ]]; then : >"$cfg"; else
    key=${word%%=*}; printf '[%s]\n%s = %s\n' "${key%.*}" "${key##*.}" "${word#*=}" >"$cfg"; fi
  BSMM_CONFIG=$cfg python3 -m bsmm bench --backend gpu --json "${cfg%.toml}.json" "$@" >"${cfg%.toml}.md" 2>&1
  echo "== $word"
  grep -E "^\| [STIF] " "${cfg%.toml}.md" | grep -E "${PASSES:-.}" | awk -F'|' '{print $3, $5, $6, $7, $8, $9, $12, $15}'
done

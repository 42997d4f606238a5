#!/usr/bin/env bash
# Profiling probe on the lent GPU (not part of the regular check): host costs of CuPy
# primitives, a launch-table sweep for workload S, and Nsight Compute on S passes.
#   tools/gpu/gpu_probe.sh [dtype]
set -uo pipefail
OUT=${OUT:-/tmp/bsmm-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BSMM_CACHE_DIR=${BSMM_CACHE_DIR:-/tmp/bsmm-cache}
dtype=${1:-float16}
python3 tools/probes/host_costs.py 2>&1 | tee "$OUT/host_costs.txt"
python3 tools/probes/profile_host.py >"$OUT/profile_host.txt" 2>&1; head -3 "$OUT/profile_host.txt"
for d in 0.5 0.02; do
  for p in fprop updat; do
    ncu --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section LaunchStats -k regex:bsmm -s 3 -c 1 python3 tools/probes/ncu_probe.py S "$dtype" 32 $d $p \
        >"$OUT/ncu_S_${dtype}_${d}_${p}.txt" 2>&1
    grep -E "Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Memory Throughput|Grid Size|Stall|Warp Cycles Per Issued" "$OUT/ncu_S_${dtype}_${d}_${p}.txt" | head -24 | sed "s/^/[$d $p] /"
  done
done
python3 tools/probes/sweep_s.py "$dtype" 0.5 0.1 0.02 2>"$OUT/sweep.log" | tee "$OUT/sweep.md"

#!/usr/bin/env bash
# Device call for a kernel study (issue 24): launch-table sweeps, Nsight Compute on chosen rows and
# the copy-only / math-only bounds, each step optional, in that order, logs under $OUT.
#   SWEEP="default kernels.updat_cut_gain=0" SWEEP_ARGS="--workloads F --block-size 128 --densities 10 --dtype bfloat16" \
#   NCU_ROWS="F:bfloat16:128:0.1:fprop F.1:bfloat16:128:0.1:updat" \
#   BOUNDS_ARGS="--workloads F --dtype bfloat16" tools/gpu/kernel_study.sh
# SWEEP: tools/gpu/sweep_config.sh settings (each a bench run with one override; SWEEP_ARGS its bench
# arguments). NCU_ROWS: WORKLOAD:DTYPE:BLOCK:DENSITY:PASS rows of tools/probes/ncu_probe.py, PASS
# "dense" for cuBLAS; a summary of each (time, tensor pipe, DRAM and L2 bytes and throughput) is
# printed. BOUNDS_ARGS: tools/probes/probe_bounds.py's bench arguments; its tables are printed.
set -uo pipefail
set -f  # the settings hold brackets: no globbing
OUT=${OUT:-/tmp/bsmm-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BSMM_CACHE_DIR=${BSMM_CACHE_DIR:-/tmp/bsmm-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
if [[ -n ${SWEEP:-} ]]; then
  t0=$(date +%s)
  # shellcheck disable=SC2086
  OUT="$OUT/sweep" bash tools/gpu/sweep_config.sh $SWEEP -- $SWEEP_ARGS | tee "$OUT/sweep.txt"
  echo "sweep [$(( $(date +%s) - t0 ))s]"
fi
metrics=gpu__time_duration.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,\
dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,\
lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active
for row in ${NCU_ROWS:-}; do
  IFS=: read -r workload dtype bs density pass <<<"$row"
  log="$OUT/ncu_${workload}_${dtype}_${bs}_${density}_${pass}.txt"
  # (dense: cuBLAS's kernels, not the random inputs' generators)
  kernel=$([[ $pass == dense ]] && echo "regex:nvjet|gemm|xmma|cutlass" || echo "regex:bsmm_matmul")
  timeout 120 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
    --metrics "$metrics" -k "$kernel" -s 3 -c 1 \
    python3 tools/probes/ncu_probe.py "$workload" "$dtype" "$bs" "$density" "$pass" >"$log" 2>&1
  echo "ncu $row: $(grep -E "^  [a-z_]+.*\(" "$log" | head -1 | cut -c1-60)"
  grep -E "gpu__time_duration.sum|sm__pipe_tensor_cycles|dram__bytes_(read|write).sum|dram__throughput|lts__t_bytes.sum|lts__throughput|hit_rate|warps_active" "$log" \
    | awk '{printf "    %s %s %s\n", $1, $2, $3}'
done
if [[ -n ${BOUNDS_ARGS:-} ]]; then
  t0=$(date +%s)
  # shellcheck disable=SC2086
  python3 tools/probes/probe_bounds.py --out "$OUT/bounds" $BOUNDS_ARGS >"$OUT/bounds.md" 2>"$OUT/bounds.log"
  cat "$OUT/bounds.md"; tail -3 "$OUT/bounds.log"
  echo "bounds [$(( $(date +%s) - t0 ))s]"
fi

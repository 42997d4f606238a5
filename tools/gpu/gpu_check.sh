#!/usr/bin/env bash
# One call on the lent GPU: compile every kernel variant into the cache, the path census, the GPU
# test suite (each census path among them), the randomized sweep at users' shapes, the checks past
# 2**31 elements, memcheck and initcheck over a sample of the census, and the benchmark. Full logs
# go to $OUT; a short table is printed last.
#   tools/gpu/gpu_check.sh [check|smoke|tests|bench|all|note|conv|race|models|tune|framework|multi|callpath|lstm|transformer|
#   learned]
#   [bench args...]
# check (the default): correctness, then sweep. correctness: compile, census, GPU tests, edges.
# sweep: compile, the randomized sweep (SWEEP_CASES cases, default 2000, within SWEEP_BUDGET s, default 180), sanitizers (every
# CENSUS_STRIDE-th census shape, default 25), the framework bench (torch, jax and cupy, S, D, F). (The device tool runs
# 10 minutes a call: there, run correctness and sweep as two calls.)
# framework: no compile step; tools/gpu/host_floor.py (host time per call against the frameworks' own floors, with a
# cProfile of the PyTorch step), then the framework bench ($FRAMEWORKS, default torch,jax,cupy; $FRAMEWORK_WORKLOADS).
# note: compile, GPU tests, memcheck of the column-group, row-group, transposed-updat, part-reduction,
# wgmma, shifted-pass, row-gather and convolution tests, bench, then the convolution benchmark against cuDNN.
# conv: compile, the convolution, row-gather and strided GPU tests, their memcheck, the conv bench.
# race: compile, compute-sanitizer racecheck over one GPU test of each kernel kind.
# models: the small-world LSTM experiment ($LSTM_BUDGET s, default 240); its table.
# multi: no compile step; the several-device tests (PyTorch DDP, FSDP2 and ShardedBlockSparseLinear over NCCL, one process
# a GPU; JAX sharding) on the GPUs present, then tools/gpu/multi_gpu.py (data- and model-parallel steps on 1 and all
# GPUs, beside dense), then tools/gpu/fsdp_transformer.py (the benchmark's decoder, dense and MLP-sparse, trained under
# FSDP2 on 1 and all GPUs: losses and tokens/s). NCCL's NVLink multicast stays off (the lent machines require it).
# callpath: tools/probes/probe_call_path.py (eager against compiled, host times, fused epilogues); with
# BEFORE=<tree of another commit>, that tree's run first, side by side. check and sweep run it last.
# lstm: the LSTM's GPU tests, `bsmm bench --model lstm` ($LSTM_BENCH_ARGS), tools/probes/profile_lstm.py, the LSTM
# sweep (tools/gpu/lstm_sweep.py, $LSTM_SWEEP_BUDGET s; check and sweep run it too), with LSTM_SANITIZE=1 memcheck and
# racecheck of the fused-cell and graph tests, and tools/probes/probe_streaming.py (NO_STREAM_PROBE=1 skips it).
# transformer: the MLP block's and decoder's GPU tests, `bsmm bench --model transformer` ($TRANSFORMER_BENCH_ARGS),
# tools/probes/profile_transformer.py, the decode passes' probe (tools/probes/probe_streaming.py --decode) and
# the eager decode step's host time (tools/probes/probe_decode_host.py); NO_TRANSFORMER_PROFILE=1 skips the three.
# learned: the GPU tests of per-block gates and changing layouts, tools/probes/probe_layout_change.py,
# tools/probes/probe_growth_signal.py, tools/probes/probe_gates.py, and the experiment's halves ($LEARNED_EXPERIMENTS, default
# transformer,lstm): examples/learned_structure/experiment_torch.py ($LEARNED_ARGS) and experiment_lstm.py
# ($LEARNED_LSTM_ARGS).
# tune: `python -m bsmm tune` with the remaining arguments (e.g. --workload T --block-size 64
# --dtype float16 --dry-run); its report, and the kept tiles in $BSMM_CACHE_DIR/tuned.toml.
set -uo pipefail
OUT=${OUT:-/tmp/bsmm-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BSMM_CACHE_DIR=${BSMM_CACHE_DIR:-/tmp/bsmm-cache}
# Wheels the lent machine lacks (tomli-w, which writing tuned files needs), carried in .whl/ (ignored by git).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
stage=${1:-check}; shift || true
status=0
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
python3 -c "import cupy, numpy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion())" | tee -a "$OUT/gpu.txt"

if [[ $stage != framework && $stage != lstm && $stage != transformer && $stage != learned ]]; then  # (these stages compile the few kernels they run on first use)
  t0=$(date +%s)
  python3 tools/ci/compile_kernels.py --arch sm_90a --jobs 16 --populate-cache --quiet >"$OUT/compile.log" 2>&1 || status=1
  echo "compile: $(tail -1 "$OUT/compile.log") [$(( $(date +%s) - t0 ))s]"
fi

if [[ $stage == smoke || $stage == all ]]; then
  t0=$(date +%s)
  python3 tools/gpu/gpu_smoke.py ${SMOKE_ARGS:-} >"$OUT/smoke.log" 2>&1 || status=1
  grep -m 20 FAIL "$OUT/smoke.log"
  echo "smoke: $(grep checked "$OUT/smoke.log") [$(( $(date +%s) - t0 ))s]"
  grep worst "$OUT/smoke.log"
fi
if [[ $stage == check || $stage == correctness ]]; then
  python3 tests/path_census.py --markdown >"$OUT/census.md" 2>&1 || status=1
  summary+=("census: $(tail -1 "$OUT/census.md")")
  t0=$(date +%s)
  # PYTEST_WORKERS > 1: the suite over that many processes sharing the GPU (pytest-xdist).
  # (the workers share the GPU: XLA must not take 75 % of its memory at start-up in each)
  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -m gpu tests -p no:cacheprovider ${PYTEST_WORKERS:+-n $PYTEST_WORKERS} >"$OUT/pytest_gpu.log" 2>&1 || status=1
  summary+=("gpu tests: $(tail -1 "$OUT/pytest_gpu.log") [$(( $(date +%s) - t0 ))s]")
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.log" | head -20
  t0=$(date +%s)
  python3 tools/gpu/gpu_edges.py --json "$OUT/edges.json" >"$OUT/edges.log" 2>&1 || status=1
  summary+=("edges past 2**31: $(tail -1 "$OUT/edges.log") [$(( $(date +%s) - t0 ))s]")
fi
if [[ $stage == check || $stage == sweep ]]; then
  t0=$(date +%s)
  python3 tools/gpu/gpu_sweep.py --cases "${SWEEP_CASES:-2000}" --budget "${SWEEP_BUDGET:-180}" --json "$OUT/sweep.json" >"$OUT/sweep.log" 2>&1 || status=1
  grep -m 20 -E "FAIL" "$OUT/sweep.log"
  summary+=("sweep: $(head -1 "$OUT/sweep.log"); $(grep -m1 -E "^cases|checks" "$OUT/sweep.log") [$(( $(date +%s) - t0 ))s]")
  t0=$(date +%s)
  python3 tools/gpu/lstm_sweep.py --budget "${LSTM_SWEEP_BUDGET:-60}" >"$OUT/lstm_sweep.log" 2>&1 || status=1
  grep -m 10 FAIL "$OUT/lstm_sweep.log"
  summary+=("$(tail -1 "$OUT/lstm_sweep.log") [$(( $(date +%s) - t0 ))s]")
  for tool in memcheck initcheck; do
    t0=$(date +%s)
    BSMM_CENSUS_STRIDE=${CENSUS_STRIDE:-25} compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -m gpu \
      tests/backends/cuda/test_census.py -k "census_path" -p no:cacheprovider >"$OUT/$tool.log" 2>&1 || status=1
    summary+=("$tool (census sample): $(grep -E "ERROR SUMMARY" "$OUT/$tool.log" | sort | uniq -c | tr -s ' ') $(tail -1 "$OUT/$tool.log") [$(( $(date +%s) - t0 ))s]")
  done
fi
if [[ $stage == check || $stage == sweep || $stage == framework ]]; then
  if [[ $stage == framework ]]; then
    t0=$(date +%s)
    python3 tools/gpu/host_floor.py --json "$OUT/host_floor.json" >"$OUT/host_floor.md" 2>"$OUT/host_floor.log" || status=1
    summary+=("host floors [$(( $(date +%s) - t0 ))s]: host_floor.md, cProfile in host_floor.log")
  fi
  t0=$(date +%s)
  # XLA would take 75 % of the GPU's memory at start-up; CuPy and PyTorch share the GPU with it here.
  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m bsmm bench --framework ${FRAMEWORKS:-torch,jax,cupy} \
    --workloads ${FRAMEWORK_WORKLOADS:-S,D,F} --json "$OUT/framework.json" -v >"$OUT/framework.md" \
    2>"$OUT/framework.log" || status=1
  # One layer is too small a program for XLA to put in a CUDA graph by default; a model is not.
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_graph_min_graph_size=1" XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m bsmm bench \
    --framework jax --workloads S --json "$OUT/framework_jax_graphs.json" >"$OUT/framework_jax_graphs.md" \
    2>>"$OUT/framework.log" || status=1
  summary+=("framework bench [$(( $(date +%s) - t0 ))s]: framework.md, framework_jax_graphs.md")
  cat "$OUT/framework.md"
  tail -n +3 "$OUT/framework_jax_graphs.md"
  [[ $stage == framework ]] && cat "$OUT/host_floor.md"
fi
if (( ${#summary[@]} )); then
  echo
  printf '%s\n' "${summary[@]}"
fi
if [[ $stage == tests || $stage == all || $stage == note ]]; then
  t0=$(date +%s)
  python3 -m pytest -q -m gpu tests -x -p no:cacheprovider >"$OUT/pytest_gpu.log" 2>&1 || status=1
  echo "gpu tests: $(tail -1 "$OUT/pytest_gpu.log") [$(( $(date +%s) - t0 ))s]"
fi
if [[ $stage == conv ]]; then
  t0=$(date +%s)
  python3 -m pytest -q -m gpu tests/nn/test_conv.py tests/nn/test_row_maps.py tests/backends/test_strided.py tests/frameworks/torch/test_conv_torch.py \
    -p no:cacheprovider >"$OUT/pytest_gpu.log" 2>&1 || status=1
  echo "gpu tests (conv): $(tail -1 "$OUT/pytest_gpu.log") [$(( $(date +%s) - t0 ))s]"
fi
if [[ $stage == note || $stage == conv ]]; then
  t0=$(date +%s)
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu tests/test_passes.py \
    tests/backends/test_strided.py tests/nn/test_row_maps.py tests/nn/test_conv.py tests/test_repeat_calls.py \
    -k "column_groups or row_groups or transposed or long_block or wgmma or shifted or gather or 3x3-p1 or 3x3-valid or 3x3-s2-p1 or whole_columns or back_to_back or kept_parameter" \
    -p no:cacheprovider >"$OUT/memcheck.log" 2>&1 || status=1
  echo "memcheck: $(grep -E "ERROR SUMMARY" "$OUT/memcheck.log" | sort | uniq -c | tr -s ' ') $(tail -1 "$OUT/memcheck.log") [$(( $(date +%s) - t0 ))s]"
fi
if [[ $stage == race ]]; then
  # Shared-memory hazards: one kernel of each kind (cp.async mma.sync and SIMT, TMA mma.sync,
  # wgmma column and row groups, transposed updat, parts with their reduction) on small shapes.
  t0=$(date +%s)
  compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -m gpu tests/test_passes.py \
    tests/test_repeat_calls.py -k "back_to_back or (kept_parameter and tall) or (column_groups and listed-float16) \
    or (updat_row_groups and 1-False-float16) or (whole_columns and fprop) or (transposed and float16) \
    or (long_block and float16)" -p no:cacheprovider >"$OUT/racecheck.log" 2>&1 || status=1
  echo "racecheck: $(grep -E "RACECHECK SUMMARY|ERROR SUMMARY" "$OUT/racecheck.log" | sort | uniq -c | tr -s ' ') $(tail -1 "$OUT/racecheck.log") [$(( $(date +%s) - t0 ))s]"
fi
if [[ $stage == bench || $stage == all || $stage == note ]]; then
  t0=$(date +%s)
  python3 -m bsmm bench --backend gpu --json "$OUT/bench.json" -v "$@" >"$OUT/bench.md" 2>"$OUT/bench.log" || status=1
  echo "bench [$(( $(date +%s) - t0 ))s]:"
  cat "$OUT/bench.md"
  tail -3 "$OUT/bench.log"
fi
if [[ $stage == note || $stage == conv ]]; then
  t0=$(date +%s)
  python3 tools/gpu/bench_conv.py --json "$OUT/conv.json" ${CONV_ARGS:-} >"$OUT/conv.md" 2>&1 || status=1
  python3 tools/probes/profile_conv.py >"$OUT/profile_conv.txt" 2>&1 || status=1
  echo "conv bench [$(( $(date +%s) - t0 ))s]:"
  grep -E "^\|" "$OUT/conv.md" | awk '!seen[$0]++'
  echo "conv profile (wide32, block 32, 50 %):"
  cat "$OUT/profile_conv.txt"
fi
if [[ $stage == lstm ]]; then
  # The sparse-wide LSTM (issue 36): its GPU tests (fused cell, layers), the streaming probe, the
  # model bench ($LSTM_BENCH_ARGS, default the seed's shape) and the profile of one step.
  t0=$(date +%s)
  python3 -m pytest -q -m gpu tests/frameworks/torch/test_lstm_torch.py tests/nn/test_lstm.py -p no:cacheprovider \
    >"$OUT/pytest_lstm.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_lstm.log" | head -20
  echo "lstm gpu tests: $(tail -1 "$OUT/pytest_lstm.log") [$(( $(date +%s) - t0 ))s]"
  t0=$(date +%s)
  python3 -m bsmm bench --model lstm ${LSTM_BENCH_ARGS:---hidden 12288 --densities 10 --batch 32 --dtype bfloat16} \
    --json "$OUT/lstm_bench.json" >"$OUT/lstm_bench.md" 2>"$OUT/lstm_bench.log" || status=1
  echo "lstm bench [$(( $(date +%s) - t0 ))s]:"; cat "$OUT/lstm_bench.md"; tail -3 "$OUT/lstm_bench.log"
  t0=$(date +%s)
  python3 tools/probes/profile_lstm.py >"$OUT/profile_lstm.md" 2>&1 || status=1
  echo "lstm profile [$(( $(date +%s) - t0 ))s]:"; cat "$OUT/profile_lstm.md"
  t0=$(date +%s)
  python3 tools/gpu/lstm_sweep.py --budget "${LSTM_SWEEP_BUDGET:-60}" >"$OUT/lstm_sweep.log" 2>&1 || status=1
  grep -m 10 FAIL "$OUT/lstm_sweep.log"; echo "$(tail -1 "$OUT/lstm_sweep.log") [$(( $(date +%s) - t0 ))s]"
  if [[ -n ${LSTM_SANITIZE:-} ]]; then  # the fused cell and the captured loops under memcheck and racecheck
    # (not the launch-count test: its profiler cannot subscribe to CUPTI beside a sanitizer)
    for tool in memcheck racecheck; do
      t0=$(date +%s)
      compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -m gpu tests/frameworks/torch/test_lstm_torch.py \
        -k "(fused or graph) and not one_launch" -p no:cacheprovider >"$OUT/lstm_$tool.log" 2>&1 || status=1
      echo "lstm $tool: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/lstm_$tool.log" | sort | uniq -c | tr -s ' ') $(tail -1 "$OUT/lstm_$tool.log") [$(( $(date +%s) - t0 ))s]"
    done
  fi
  if [[ -z ${NO_STREAM_PROBE:-} ]]; then
    t0=$(date +%s)
    python3 tools/probes/probe_streaming.py --json "$OUT/streaming.json" >"$OUT/streaming.md" 2>&1 || status=1
    echo "streaming probe [$(( $(date +%s) - t0 ))s]:"; cat "$OUT/streaming.md"
  fi
fi
if [[ $stage == learned ]]; then
  # Learned structure (issue 38): the gates' and dynamic layouts' GPU tests (DDP ranks among them), what a layout
  # change costs (tools/probes/probe_layout_change.py), the growth signal's two routes, the experiment's halves.
  t0=$(date +%s)
  # (LEARNED_PYTEST: other pytest arguments, e.g. "tests/frameworks/torch -n 6")
  python3 -m pytest -q -m gpu ${LEARNED_PYTEST:-tests/frameworks/torch/test_dynamic.py \
    tests/frameworks/torch/test_dynamic_lstm.py tests/frameworks/torch/test_gates.py \
    tests/frameworks/torch/test_distributed.py -k "dynamic or gate or Gate"} -p no:cacheprovider \
    >"$OUT/pytest_learned.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_learned.log" | head -20
  echo "learned-structure gpu tests: $(tail -1 "$OUT/pytest_learned.log") [$(( $(date +%s) - t0 ))s]"
  if [[ -z ${NO_LEARNED_PROBES:-} ]]; then
    t0=$(date +%s)
    python3 tools/probes/probe_layout_change.py --profile >"$OUT/layout_change.md" 2>&1 || status=1
    echo "layout change [$(( $(date +%s) - t0 ))s]:"; cat "$OUT/layout_change.md"
    t0=$(date +%s)
    python3 tools/probes/probe_growth_signal.py >"$OUT/growth_signal.md" 2>&1 || status=1
    echo "growth signal, dense against Gram route [$(( $(date +%s) - t0 ))s]:"; cat "$OUT/growth_signal.md"
    t0=$(date +%s)
    python3 tools/probes/probe_gates.py >"$OUT/gates.md" 2>&1 || status=1
    echo "gates in the kernels, closed blocks skipped [$(( $(date +%s) - t0 ))s]:"; cat "$OUT/gates.md"
  fi
  # LEARNED_EXPERIMENTS: which halves of the experiment run (default both; "none" skips them).
  for half in transformer lstm; do
    [[ ${LEARNED_EXPERIMENTS:-transformer,lstm} == *$half* ]] || continue
    if [[ $half == transformer ]]; then script=experiment_torch.py name=learned args=${LEARNED_ARGS:-}
    else script=experiment_lstm.py name=learned_lstm args=${LEARNED_LSTM_ARGS:-}; fi
    t0=$(date +%s)
    # (its log ends with the table printed below: only a failed run's tail is shown)
    python3 examples/learned_structure/$script $args --json "$OUT/$name.json" --markdown "$OUT/$name.md" \
      --plot "$OUT/$name.png" >"$OUT/$name.log" 2>&1 || { status=1; tail -5 "$OUT/$name.log"; }
    echo "learned-structure experiment, $half [$(( $(date +%s) - t0 ))s]:"; cat "$OUT/$name.md"
  done
fi
if [[ $stage == transformer ]]; then
  # Transformers (issue 37): the MLP block's and the decoder's GPU tests, the decoder bench, where its time goes.
  t0=$(date +%s)
  python3 -m pytest -q -m gpu tests/frameworks/torch/test_glu.py tests/frameworks/torch/test_mlp_torch.py \
    tests/cli/test_transformer_bench.py -p no:cacheprovider >"$OUT/pytest_transformer.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_transformer.log" | head -20
  echo "transformer gpu tests: $(tail -1 "$OUT/pytest_transformer.log") [$(( $(date +%s) - t0 ))s]"
  t0=$(date +%s)
  python3 -m bsmm bench --model transformer ${TRANSFORMER_BENCH_ARGS:---densities 10,25 --block-size 128,64} \
    --json "$OUT/transformer.json" >"$OUT/transformer.md" 2>"$OUT/transformer.log" || status=1
  echo "transformer bench [$(( $(date +%s) - t0 ))s]:"; cat "$OUT/transformer.md"; tail -3 "$OUT/transformer.log"
  if [[ -z ${NO_TRANSFORMER_PROFILE:-} ]]; then
    t0=$(date +%s)
    python3 tools/probes/profile_transformer.py >"$OUT/profile_transformer.md" 2>"$OUT/profile_transformer.log" || status=1
    echo "transformer profile [$(( $(date +%s) - t0 ))s]: profile_transformer.md"
    python3 tools/probes/probe_streaming.py --decode --json "$OUT/decode_streaming.json" >"$OUT/decode_streaming.md" \
      2>&1 || status=1
    echo "decode passes: decode_streaming.md"
    python3 tools/probes/probe_decode_host.py >"$OUT/decode_host.md" 2>&1 || status=1
    echo "eager decode, host time a step:"; grep "a step" "$OUT/decode_host.md"
  fi
fi
if [[ $stage == callpath || $stage == check || $stage == sweep ]]; then
  # The call path, eager against compiled, host times and the fused epilogues
  # (tools/probes/probe_call_path.py); with BEFORE=<a tree of an earlier commit>, that tree first, in the same call.
  t0=$(date +%s)
  if [[ -n ${BEFORE:-} && -d ${BEFORE:-} ]]; then
    (cd "$BEFORE" && PYTHONPATH=$PWD BSMM_CACHE_DIR=$BSMM_CACHE_DIR.before python3 tools/probes/probe_call_path.py \
      --json "$OUT/callpath_before.json" >"$OUT/callpath_before.md" 2>"$OUT/callpath_before.log") || status=1
    echo "call path, before ($BEFORE):"; cat "$OUT/callpath_before.md"
  fi
  python3 tools/probes/probe_call_path.py --json "$OUT/callpath.json" >"$OUT/callpath.md" 2>"$OUT/callpath.log" || status=1
  echo "call path [$(( $(date +%s) - t0 ))s]:"; cat "$OUT/callpath.md"
fi
if [[ $stage == tune ]]; then
  t0=$(date +%s)
  python3 -m bsmm tune "$@" >"$OUT/tune.md" 2>"$OUT/tune.log" || status=1
  echo "tune [$(( $(date +%s) - t0 ))s]:"
  cat "$OUT/tune.md"
  tail -3 "$OUT/tune.log"
  cp "$BSMM_CACHE_DIR/tuned.toml" "$OUT/tuned.toml" 2>/dev/null
fi
if [[ $stage == multi ]]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  gpus=$(nvidia-smi -L | wc -l)
  t0=$(date +%s)
  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -m gpu tests/frameworks/torch/test_distributed.py \
    tests/frameworks/jax/test_jax_sharding.py tests/test_sharding.py -p no:cacheprovider >"$OUT/pytest_multi.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_multi.log" | head -20
  echo "several-device tests on $gpus GPU(s): $(tail -1 "$OUT/pytest_multi.log") [$(( $(date +%s) - t0 ))s]"
  t0=$(date +%s)
  python3 tools/gpu/multi_gpu.py --world "1,$gpus" --json "$OUT/multi_gpu.json" >"$OUT/multi_gpu.md" 2>"$OUT/multi_gpu.log" || status=1
  echo "multi_gpu [$(( $(date +%s) - t0 ))s]:"
  cat "$OUT/multi_gpu.md"
  t0=$(date +%s)
  python3 tools/gpu/fsdp_transformer.py --world "1,$gpus" --json "$OUT/fsdp_transformer.json" >"$OUT/fsdp_transformer.md" \
    2>"$OUT/fsdp_transformer.log" || status=1
  echo "the decoder under FSDP2 [$(( $(date +%s) - t0 ))s]:"
  cat "$OUT/fsdp_transformer.md"; tail -3 "$OUT/fsdp_transformer.log"
fi
if [[ $stage == models ]]; then
  t0=$(date +%s)
  python3 examples/char_lstm/experiment.py --budget "${LSTM_BUDGET:-240}" --json "$OUT/lstm_h100.json" \
    --markdown "$OUT/lstm_h100.md" >"$OUT/lstm.log" 2>&1 || status=1
  echo "lstm [$(( $(date +%s) - t0 ))s]:"
  cat "$OUT/lstm_h100.md" 2>/dev/null || tail -20 "$OUT/lstm.log"
fi
exit $status

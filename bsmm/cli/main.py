"""Command line: ``python -m bsmm demo``, ``python -m bsmm bench`` and ``python -m bsmm tune``.

The arguments, their checks and the help are in :mod:`bsmm.cli.arguments`; here, what each command runs.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

from bsmm.cli import arguments
from bsmm.cli.framework_bench import SHAPES


def _say(line: str) -> None:
    """One line on stderr, above the progress bar where one is drawn."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)


def _bar_wanted(args) -> bool:
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


def _demo(args) -> int:
    import numpy as np

    import bsmm
    from bsmm.cli.bench import bench_cpu, format_table
    from bsmm.cli.bench_gpu import bench_gpu, format_gpu_table

    # The seed's example, line by line, with arrays in place of TensorFlow placeholders.
    hidden_size, block_size, minibatch_size = 4096, 32, 64
    sparsity = np.random.randint(2, size=(hidden_size // block_size, hidden_size // block_size))
    bsmm_op = bsmm.BlocksparseMatMul(sparsity, block_size=block_size)
    w = np.random.randn(*bsmm_op.w_shape).astype(np.float32)
    x = np.ones((minibatch_size, hidden_size), dtype=np.float32)
    y = bsmm_op(x, w)

    reference = x.astype(np.float64) @ bsmm_op.to_dense(w).astype(np.float64)
    error = np.linalg.norm(y - reference) / np.linalg.norm(reference)
    print(f"seed example: {bsmm_op}")
    print(f"  y = bsmm_op(x, w) on the CPU: shape {y.shape}, relative error vs float64 dense {error:.2e}")
    problem = arguments.gpu_problem()
    if problem is None:
        import cupy

        y_gpu = bsmm_op(cupy.asarray(x), cupy.asarray(w))
        gpu_error = np.linalg.norm(y_gpu.get() - reference) / np.linalg.norm(reference)
        print(f"  the same on the GPU: relative error {gpu_error:.2e}")
        print("\nspeed, GPU kernels vs dense cuBLAS (workload S: N=32, C=K=12288, block 32):")
        print(format_gpu_table(bench_gpu(workloads=("S",), bar=_bar_wanted(args))))
        print(_torch_step())
    else:
        if not _nvidia_driver_loaded():
            # No driver, no GPU: a CUDA extra (what the problem may name) cannot help here.
            problem = "no NVIDIA driver is loaded on this machine (no GPU, or a container started without one)"
        print(f"\nno GPU here: {problem}; the demo runs on the CPU backend.\nspeed, CPU backend vs dense NumPy "
              "(workload S: N=32, C=K=12288, block 32, float32):")
        print(format_table(bench_cpu(densities=(0.25, 0.1, 0.02), repeats=3, bar=_bar_wanted(args))))
    return 0


def _nvidia_driver_loaded() -> bool:
    """Whether an NVIDIA driver is here, without CuPy: Linux's kernel module, or the driver's library."""
    if os.path.exists("/proc/driver/nvidia/version"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _torch_step() -> str:
    """The demo's PyTorch training step at workload S beside nn.Linear's, or how to get it."""
    try:
        import torch
    except ImportError:
        return "\nPyTorch is not installed: pip install 'bsmm[torch]' to see a BlockSparseLinear training step here"
    if not torch.cuda.is_available():
        return (f"\nPyTorch {torch.__version__} finds no CUDA GPU (a CPU-only build?): install a CUDA build of "
                "PyTorch to see a BlockSparseLinear training step here")
    from bsmm.cli.framework_bench import bench_torch, format_rows

    n, c, k, bs = SHAPES["S"][:4]
    rows = bench_torch(("S",), host=False, graphs=False, dtypes=("bfloat16",), densities=(0.1,), optimizer=True)
    return (f"\nPyTorch, bsmm.torch.BlockSparseLinear against nn.Linear (N={n}, {c} → {k}, block {bs}, 10 %, bfloat16, "
            "eager; step + SGD: forward, backward, SGD update):\n" + format_rows(rows))


def _bench(args) -> int:
    from bsmm.cli.bench import bench_cpu, format_table, write_json
    from bsmm.cli.bench_gpu import bench_gpu, format_gpu_table

    log = _say if args.verbose else None
    meta = {"machine": platform.platform(), "processor": platform.processor()}
    if args.model:
        return _bench_model(args, log, meta)
    if args.framework:
        return _bench_framework(args, log, meta)
    if args.backend == "gpu":
        import cupy

        from bsmm.cli.tuned_file import in_effect

        meta["gpu"] = device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
        # Tiles `bsmm tune` kept on this machine change what is measured: say so in the results.
        meta["tuned_entries"] = in_effect()
        if meta["tuned_entries"]:
            _say(f"note: {meta['tuned_entries']} launch tiles tuned on this machine are in effect "
                 "(BSMM_TUNED=0 measures bsmm.toml's)")
        rows = bench_gpu(workloads=args.workloads, progress=log, quick=args.quick, only_dtypes=args.dtype,
                         only_block_sizes=args.block_size, only_densities=args.densities, bar=_bar_wanted(args))
        print(format_gpu_table(rows))
    else:
        device = f"CPU: {_cpu_name()}"
        rows = bench_cpu(N=args.N, C=args.C, K=args.K, block_size=args.block_size, densities=args.densities,
                         dtype=args.dtype, repeats=args.repeats, progress=log, bar=_bar_wanted(args))
        print(format_table(rows))
    if args.json:
        write_json(rows, args.json, meta=meta)
    if args.plot:
        from bsmm.cli.plot import plot_speedup

        plot_speedup(rows, args.plot, device)
    return 0


def _cpu_name() -> str:
    """The CPU's model name where Linux gives it, else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _bench_framework(args, log, meta) -> int:
    """``bench --framework``: what users run, beside the framework's dense layer (bsmm.cli.framework_bench)."""
    import json

    from bsmm.cli.framework_bench import bench_cupy, bench_jax, bench_torch, format_rows

    rows = []
    for framework in args.framework:
        if framework == "torch":
            rows += bench_torch(args.workloads, progress=log)
        elif framework == "cupy":
            rows += bench_cupy(args.workloads, progress=log)
        else:
            rows += bench_jax(args.workloads, progress=log)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"meta": meta, "rows": [r.as_dict() for r in rows]}, file, indent=1)
    return 0


def _bench_model(args, log, meta) -> int:
    """``bench --model lstm``: BlockSparseLSTM against cuDNN, then the streaming rows (bsmm.cli.model_bench);
    ``--model transformer``: the decoder's rows (bsmm.cli.transformer_bench)."""
    import json

    import torch

    if args.model == "transformer":
        from bsmm.cli.transformer_bench import (  # lazily: the command's modules load when it runs
            bench_transformer, format_transformer_rows)

        meta["gpu"] = torch.cuda.get_device_name()
        rows = bench_transformer(densities=args.densities, block_sizes=args.block_size, dtype=args.dtype[0],
                                 progress=log)
        print(format_transformer_rows(rows))
        if args.json:
            with open(args.json, "w") as file:
                json.dump({"meta": meta, "rows": [r.as_dict() for r in rows]}, file, indent=1)
        return 0

    from bsmm.cli.model_bench import (  # lazily: the command's modules load when it runs
        bench_lstm, bench_streaming, format_lstm_rows, format_stream_rows)

    meta["gpu"] = torch.cuda.get_device_name()
    rows = bench_lstm(hidden=args.hidden, densities=args.densities, batch=args.batch, dtypes=args.dtype,
                      steps=args.steps, progress=log)
    print(format_lstm_rows(rows))
    streams = bench_streaming(hidden=max(args.hidden), density=max(args.densities),
                              dtype=next((d for d in args.dtype if d != "float32"), args.dtype[0]))
    print()
    print(format_stream_rows(streams))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"meta": meta, "rows": [r.as_dict() for r in rows],
                       "streaming": [r.as_dict() for r in streams]}, file, indent=1)
    return 0


def _tune(args) -> int:
    from bsmm.cli import tune, tuned_file

    if args.reset:
        path = tuned_file.tuned_path()
        print(f"removed {path}: bsmm.toml's launch tiles are in effect" if path.is_file() else f"no {path} to remove")
        path.unlink(missing_ok=True)
        return 0
    if args.show:
        print(tuned_file.current_tuned_table())
        return 0
    results = tune.tune(args.cases, rounds=args.rounds, margin=args.margin / 100,
                        runner=tune.Runner(calls=args.calls, batches=args.batches), write=not args.dry_run,
                        progress=None if args.quiet else _say, bar=_bar_wanted(args))
    print(tuned_file.format_report(results))
    kept = sum(r.kept is not None for r in results)
    if args.dry_run:
        print(f"\n--dry-run: {kept} kept tiles not written")
    else:
        print(f"\n{kept} kept tiles written to {tuned_file.tuned_path()}" if kept else "\nno tile beat the current ones")
    return 0


def main(argv=None) -> int:
    """Runs the command line on ``argv`` (default: ``sys.argv[1:]``); returns the exit status:
    2, with one line on stderr, for any argument refused."""
    try:
        args = arguments.build_parser({"demo": _demo, "bench": _bench, "tune": _tune}).parse_args(argv)
        try:
            args.check(args)
        except arguments.Refused as refused:
            args.parser.error(str(refused))
    except SystemExit as stop:  # a refused argument, or --help
        return stop.code
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

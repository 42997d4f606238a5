"""Command line: ``python -m bsmm demo`` and ``python -m bsmm bench``."""

from __future__ import annotations

import argparse
import platform
import sys

import numpy as np


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.is_available()
    except Exception:  # noqa: BLE001 - no CuPy, no driver: the CPU backend runs
        return False


def _demo(args) -> int:
    import bsmm

    from .bench import bench_cpu, bench_gpu, format_gpu_table, format_table

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
    if gpu_available():
        import cupy

        y_gpu = bsmm_op(cupy.asarray(x), cupy.asarray(w))
        gpu_error = np.linalg.norm(y_gpu.get() - reference) / np.linalg.norm(reference)
        print(f"  the same on the GPU: relative error {gpu_error:.2e}")
        print("\nspeed, GPU kernels vs dense cuBLAS (workload S: N=32, C=K=12288, block 32):")
        print(format_gpu_table(bench_gpu(workloads=("S",))))
    else:
        print("\nno GPU here; speed, CPU backend vs dense NumPy (workload S: N=32, C=K=12288, block 32, float32):")
        print(format_table(bench_cpu(densities=(0.25, 0.1, 0.02), repeats=3)))
    return 0


def _bench(args) -> int:
    from .bench import bench_cpu, bench_gpu, format_gpu_table, format_table, write_json

    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
    meta = {"machine": platform.platform(), "processor": platform.processor()}
    if args.backend == "gpu" or (args.backend == "auto" and gpu_available()):
        import cupy

        meta["gpu"] = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
        rows = bench_gpu(workloads=tuple(args.workloads.split(",")), progress=log, quick=args.quick,
                         only_dtypes=args.dtype and tuple(args.dtype.split(",")),
                         only_block_sizes=args.block_size and tuple(int(b) for b in args.block_size.split(",")))
        print(format_gpu_table(rows))
    else:
        densities = tuple(float(d) / 100 for d in args.densities.split(","))
        rows = bench_cpu(N=args.N, C=args.C, K=args.K, block_size=int(args.block_size or 32), densities=densities,
                         dtype=args.dtype or "float32", repeats=args.repeats, progress=log)
        print(format_table(rows))
    if args.json:
        write_json(rows, args.json, meta=meta)
    if args.plot:
        from .plot import plot_speedup

        plot_speedup(rows, args.plot)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bsmm", description="block-sparse matrix multiplication")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="run the seed's example and a short speed table").set_defaults(run=_demo)
    bench = commands.add_parser("bench", help="each pass side by side with the dense product")
    bench.add_argument("--backend", choices=("auto", "cpu", "gpu"), default="auto")
    bench.add_argument("--workloads", default="S,T,I", help="GPU: workloads of BENCHMARKS.md, comma-separated")
    bench.add_argument("--quick", action="store_true", help="GPU: fewer block sizes and densities")
    bench.add_argument("--N", type=int, default=32, help="CPU: batch rows")
    bench.add_argument("--C", type=int, default=12288, help="CPU: input features")
    bench.add_argument("--K", type=int, default=12288, help="CPU: output features")
    bench.add_argument("--block-size", help="block size (CPU: one, default 32; GPU: only these, comma-separated)")
    bench.add_argument("--densities", default="50,25,10,5,2", help="CPU: percentages, comma-separated")
    bench.add_argument("--dtype", help="element type (CPU: default float32; GPU: only these, comma-separated, "
                                       "tf32 included)")
    bench.add_argument("--repeats", type=int, default=5, help="CPU: timed calls per row")
    bench.add_argument("--json", help="also write the rows to this JSON file")
    bench.add_argument("--plot", help="draw speed-up over dense vs sparsity to this image (needs matplotlib)")
    bench.add_argument("-v", "--verbose", action="store_true", help="print each row as it is measured")
    bench.set_defaults(run=_bench)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

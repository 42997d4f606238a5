"""Command line: ``python -m bsmm demo``, ``python -m bsmm bench`` and ``python -m bsmm tune``."""

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

    from bsmm.cli.bench import bench_cpu, bench_gpu, format_gpu_table, format_table

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
    from bsmm.cli.bench import bench_cpu, bench_gpu, format_gpu_table, format_table, write_json

    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
    meta = {"machine": platform.platform(), "processor": platform.processor()}
    if args.framework:
        return _bench_framework(args, log, meta)
    if args.backend == "gpu" or (args.backend == "auto" and gpu_available()):
        import cupy

        from bsmm.cli.tuned_file import in_effect

        meta["gpu"] = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
        # Tiles `bsmm tune` kept on this machine change what is measured: say so in the results.
        meta["tuned_entries"] = in_effect()
        if meta["tuned_entries"]:
            print(f"note: {meta['tuned_entries']} launch tiles tuned on this machine are in effect "
                  "(BSMM_TUNED=0 measures bsmm.toml's)", file=sys.stderr)
        rows = bench_gpu(workloads=tuple((args.workloads or "S,T,I").split(",")), progress=log, quick=args.quick,
                         only_dtypes=args.dtype and tuple(args.dtype.split(",")),
                         only_block_sizes=args.block_size and tuple(int(b) for b in args.block_size.split(",")),
                         only_densities=args.densities and tuple(float(d) / 100 for d in args.densities.split(",")))
        print(format_gpu_table(rows))
    else:
        densities = tuple(float(d) / 100 for d in (args.densities or "50,25,10,5,2").split(","))
        rows = bench_cpu(N=args.N, C=args.C, K=args.K, block_size=int(args.block_size or 32), densities=densities,
                         dtype=args.dtype or "float32", repeats=args.repeats, progress=log)
        print(format_table(rows))
    if args.json:
        write_json(rows, args.json, meta=meta)
    if args.plot:
        from bsmm.cli.plot import plot_speedup

        plot_speedup(rows, args.plot)
    return 0


def _bench_framework(args, log, meta) -> int:
    """``bench --framework``: what users run, beside the framework's dense layer (bsmm.cli.framework_bench)."""
    import json

    from bsmm.cli.framework_bench import SHAPES, bench_cupy, bench_jax, bench_torch, format_rows

    if not gpu_available():
        print("bench --framework needs a CUDA GPU and CuPy", file=sys.stderr)
        return 2
    workloads = tuple((args.workloads or "S,D,F").split(","))
    unknown = [w for w in workloads if w not in SHAPES]
    if unknown:
        print(f"bench --framework times workloads {', '.join(SHAPES)}; got {', '.join(unknown)}", file=sys.stderr)
        return 2
    frameworks = args.framework.split(",")
    unknown = [f for f in frameworks if f not in ("torch", "jax", "cupy")]
    if unknown:
        print(f"--framework takes torch, jax and cupy; got {', '.join(map(repr, unknown))}", file=sys.stderr)
        return 2
    rows = []
    for framework in frameworks:
        if framework == "torch":
            rows += bench_torch(workloads, progress=log)
        elif framework == "cupy":
            rows += bench_cupy(workloads, progress=log)
        else:
            rows += bench_jax(workloads, progress=log)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"meta": meta, "rows": [r.as_dict() for r in rows]}, file, indent=1)
    return 0


def _tune_cases(args) -> list:
    from bsmm.cli.bench import WORKLOADS
    from bsmm.cli.tune import Case
    from bsmm.passes import PASS_NAMES

    spec = dict(WORKLOADS[args.workload]) if args.workload else dict(
        N=4096, layers=((8192, 8192),), block_sizes=(32,), densities=(0.1,), dtypes=("float16",))
    N = args.N or spec["N"]
    # --C / --K replace every layer's input / output features (--C alone: a square layer).
    layers = list(dict.fromkeys((args.C or c, args.K or args.C or k) for c, k in spec["layers"]))
    block_sizes = [int(b) for b in args.block_size.split(",")] if args.block_size else spec["block_sizes"]
    densities = [float(d) / 100 for d in args.densities.split(",")] if args.densities else spec["densities"]
    dtypes = args.dtype.split(",") if args.dtype else spec["dtypes"]
    passes = args.passes.split(",") if args.passes else PASS_NAMES
    kinds = ("float32", "tf32", "float16", "bfloat16")
    for name, given, allowed in (("--passes", passes, PASS_NAMES), ("--dtype", dtypes, kinds)):
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            raise ValueError(f"{name} {','.join(unknown)}: expected some of {','.join(allowed)}")
    return [Case(p, N, C, K, bs, d, dtype, args.feature_axis)
            for dtype in dtypes for C, K in layers for bs in block_sizes for d in densities for p in passes]


class _Progress:
    """Prints tune's lines to stderr; on a terminal, a round's progress bar rewrites one line."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.open = False

    def __call__(self, line: str) -> None:
        bar = " round " in line and self.tty
        if self.open and not bar:
            sys.stderr.write("\n")
        sys.stderr.write(("\r\033[K" if bar else "") + line + ("" if bar else "\n"))
        sys.stderr.flush()
        self.open = bar


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
    try:
        cases = _tune_cases(args)
    except ValueError as error:
        print(f"bsmm tune: {error}", file=sys.stderr)
        return 2
    if not gpu_available():
        print("bsmm tune: it measures kernels on a CUDA GPU, and CuPy finds none here", file=sys.stderr)
        return 2
    results = tune.tune(cases, rounds=args.rounds, margin=args.margin / 100,
                        runner=tune.Runner(calls=args.calls, batches=args.batches), write=not args.dry_run,
                        progress=_Progress())
    print(tuned_file.format_report(results))
    kept = sum(r.kept is not None for r in results)
    if args.dry_run:
        print(f"\n--dry-run: {kept} kept tiles not written")
    else:
        print(f"\n{kept} kept tiles written to {tuned_file.tuned_path()}" if kept else "\nno tile beat the current ones")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bsmm", description="block-sparse matrix multiplication")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="run the seed's example and a short speed table").set_defaults(run=_demo)
    bench = commands.add_parser("bench", help="each pass side by side with the dense product")
    bench.add_argument("--backend", choices=("auto", "cpu", "gpu"), default="auto")
    bench.add_argument("--workloads", help="GPU: workloads of BENCHMARKS.md, comma-separated (default S,T,I; "
                       "with --framework S,D,F)")
    bench.add_argument("--quick", action="store_true", help="GPU: fewer block sizes and densities")
    bench.add_argument("--framework", help="torch, jax and/or cupy, comma-separated: time what users run (the layer's "
                       "training step, forward and allocating calls, and host time per call) beside the dense layer, "
                       "on workloads S, D, F")
    bench.add_argument("--N", type=int, default=32, help="CPU: batch rows")
    bench.add_argument("--C", type=int, default=12288, help="CPU: input features")
    bench.add_argument("--K", type=int, default=12288, help="CPU: output features")
    bench.add_argument("--block-size", help="block size (CPU: one, default 32; GPU: only these, comma-separated)")
    bench.add_argument("--densities", help="percentages, comma-separated (CPU: default 50,25,10,5,2; GPU: only "
                                           "these of each workload's)")
    bench.add_argument("--dtype", help="element type (CPU: default float32; GPU: only these, comma-separated, "
                                       "tf32 included)")
    bench.add_argument("--repeats", type=int, default=5, help="CPU: timed calls per row")
    bench.add_argument("--json", help="also write the rows to this JSON file")
    bench.add_argument("--plot", help="draw speed-up over dense vs sparsity to this image (needs matplotlib)")
    bench.add_argument("-v", "--verbose", action="store_true", help="print each row as it is measured")
    bench.set_defaults(run=_bench)
    tune = commands.add_parser("tune", help="refine bsmm.toml's launch tiles for this GPU and these shapes (GPU)",
                               description="Times launch tiles near bsmm.toml's on the given passes and shapes and "
                                           "keeps the faster ones for this machine (bsmm.cli.tune).")
    tune.add_argument("--workload", choices=("S", "T", "I", "F"), help="shapes of a benchmark workload (BENCHMARKS.md)")
    tune.add_argument("--N", type=int, help="batch rows (default 4096)")
    tune.add_argument("--C", type=int, help="input features (default 8192)")
    tune.add_argument("--K", type=int, help="output features (default C)")
    tune.add_argument("--block-size", help="block sizes, comma-separated (default 32)")
    tune.add_argument("--densities", help="percentages, comma-separated (default 10)")
    tune.add_argument("--dtype", help="float32, tf32, float16, bfloat16; comma-separated (default float16)")
    tune.add_argument("--passes", help="fprop, bprop, updat; comma-separated (default all three)")
    tune.add_argument("--feature-axis", type=int, choices=(0, 1), default=1)
    tune.add_argument("--rounds", type=int, default=2, help="moves from the best tile so far (default 2)")
    tune.add_argument("--margin", type=float, default=3.0, help="percent faster a tile must be to be kept (default 3)")
    tune.add_argument("--calls", type=int, default=20, help="back-to-back calls a timing batch")
    tune.add_argument("--batches", type=int, default=7, help="timing batches a median")
    tune.add_argument("--dry-run", action="store_true", help="measure and report, write nothing")
    tune.add_argument("--show", action="store_true", help="print the tiles tuned on this machine")
    tune.add_argument("--reset", action="store_true", help="remove the tiles tuned on this machine")
    tune.set_defaults(run=_tune)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

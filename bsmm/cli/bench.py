"""Benchmarks: each pass of bsmm side by side with the dense product, in one run.

``python -m bsmm bench`` times the three passes on the seed's workload
(N = 32, C = K = 12288, block 32) at several densities against the dense
matrix product of the same shape and dtype: NumPy's BLAS on the CPU. Every
input is fresh random data; the dense weight of the same size as the sparse
one is random too. Times are medians over repeated calls after a warm-up.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import time
from typing import Callable

import numpy as np

from bsmm.dtypes import canonical_dtype
from bsmm.layouts import random_layout
from bsmm.matmul import BlocksparseMatMul
from bsmm.passes import PASS_NAMES

__all__ = ["BenchRow", "bench_cpu", "format_table"]



@dataclasses.dataclass
class BenchRow:
    """One pass at one density: bsmm's and dense's median seconds per call."""

    backend: str
    dtype: str
    N: int
    C: int
    K: int
    block_size: int
    density: float
    pass_name: str
    sparse_s: float
    dense_s: float

    @property
    def speedup(self) -> float:
        return self.dense_s / self.sparse_s

    @property
    def efficiency(self) -> float:
        """Dense time × density / sparse time: 1.0 is cuBLAS/BLAS efficiency per useful FLOP."""
        return self.dense_s * self.density / self.sparse_s

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"speedup": self.speedup, "efficiency": self.efficiency}


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_cpu(N=32, C=12288, K=12288, block_size=32, densities=(0.5, 0.25, 0.1, 0.05, 0.02),
              dtype="float32", repeats=5, seed=0, progress: Callable[[str], None] | None = None) -> list[BenchRow]:
    """Time the three passes of the CPU backend against dense NumPy products.

    Examples
    --------
    >>> rows = bench_cpu(N=4, C=256, K=256, densities=(0.5,), repeats=1)
    >>> [row.pass_name for row in rows]
    ['fprop', 'bprop', 'updat']
    """
    dtype = canonical_dtype(dtype, "dtype")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, C), dtype=np.float32).astype(dtype)
    dy = rng.standard_normal((N, K), dtype=np.float32).astype(dtype)
    dense_w = rng.standard_normal((C, K), dtype=np.float32).astype(dtype)
    dense = {
        "fprop": _median_seconds(lambda: x @ dense_w, repeats),
        "bprop": _median_seconds(lambda: dy @ dense_w.T, repeats),
        "updat": _median_seconds(lambda: x.T @ dy, repeats),
    }
    del dense_w
    rows = []
    for density in densities:
        layout = random_layout(C // block_size, K // block_size, density=density, seed=seed)
        op = BlocksparseMatMul(layout, block_size=block_size)
        w = rng.standard_normal(op.w_shape, dtype=np.float32).astype(dtype)
        runs = {"fprop": lambda: op.fprop(x, w), "bprop": lambda: op.bprop(dy, w), "updat": lambda: op.updat(x, dy)}
        for pass_name in PASS_NAMES:
            sparse = _median_seconds(runs[pass_name], repeats)
            rows.append(BenchRow("cpu", str(dtype), N, C, K, block_size, op.density, pass_name, sparse, dense[pass_name]))
            if progress:
                progress(format_table(rows[-1:], header=False))
    return rows


def format_table(rows: list[BenchRow], header: bool = True) -> str:
    """Markdown table: one line per (density, pass)."""
    lines = []
    if header:
        lines += [
            "| backend | dtype | N | C=K | block | density | pass | bsmm | dense | speed-up | eff./useful FLOP |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
    for r in rows:
        lines.append(
            f"| {r.backend} | {r.dtype} | {r.N} | {r.C} | {r.block_size} | {r.density:.0%} | {r.pass_name} | "
            f"{_fmt_time(r.sparse_s)} | {_fmt_time(r.dense_s)} | {r.speedup:.2f}x | {r.efficiency:.0%} |"
        )
    return "\n".join(lines)


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def write_json(rows: list[BenchRow], path: str, meta: dict | None = None) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta or {}, "rows": [r.as_dict() for r in rows]}, f, indent=1)


# ---- GPU -------------------------------------------------------------------------------------
#: The workloads of shared/BENCHMARKS.md: N, the layers (C input, K output features), block sizes,
#: densities, dtypes ("tf32" = float32 on tensor cores). F is a transformer's feed-forward pair.
WORKLOADS = {
    "S": dict(N=32, layers=((12288, 12288),), block_sizes=(32,), densities=(0.5, 0.25, 0.1, 0.05, 0.02),
              dtypes=("float32", "float16", "bfloat16")),
    "T": dict(N=4096, layers=((8192, 8192),), block_sizes=(16, 32, 64, 128), densities=(0.5, 0.25, 0.1),
              dtypes=("float16", "bfloat16", "float32", "tf32")),
    "I": dict(N=256, layers=((8192, 8192),), block_sizes=(32, 64), densities=(0.25, 0.1, 0.05),
              dtypes=("float16", "bfloat16")),
    "F": dict(N=8192, layers=((4096, 16384), (16384, 4096)), block_sizes=(64, 128), densities=(0.5, 0.25, 0.1),
              dtypes=("float16", "bfloat16")),
}
#: float32 rows of T are measured at the block sizes the targets name, to keep a run short.
_T_FLOAT32_BLOCKS = {"float32": (32, 64), "tf32": (64,)}
_L2_BYTES = 50 * 2**20


def weight_sets(op: BlocksparseMatMul, dtype, rng) -> list:
    """Random weight arrays for ``op`` on the GPU, as many as it takes (up to 8) for two sets to
    outgrow the L2, so that calls rotating through them do not time small weights out of L2."""
    w_bytes = op.blocks * op.block_size ** 2 * np.dtype(dtype).itemsize
    n_sets = max(1, min(8, math.ceil(2 * _L2_BYTES / max(w_bytes, 1))))
    return [rng.standard_normal(op.w_shape, dtype=np.float32).astype(dtype) for _ in range(n_sets)]


def pass_calls(op: BlocksparseMatMul, x, dy, ws: list, outputs: dict | None) -> dict[str, Callable[[], object]]:
    """The three passes of ``op`` as argument-less calls into ``outputs[pass]`` (``None``: the
    allocating calls a user's loop makes), fprop and bprop taking the next of the weight sets
    ``ws`` at each call."""
    turn = itertools.count()
    out = outputs or {}
    return {
        "fprop": lambda: op.fprop(x, ws[next(turn) % len(ws)], out=out.get("fprop")),
        "bprop": lambda: op.bprop(dy, ws[next(turn) % len(ws)], out=out.get("bprop")),
        "updat": lambda: op.updat(x, dy, out=out.get("updat")),
    }


#: Seconds of calls before a pass is timed (at least three calls).
WARM_UP_SECONDS = 0.05


def _warm_up(fn, seconds: float = WARM_UP_SECONDS) -> None:
    """Calls ``fn`` until ``seconds`` have passed, three times at least, never more than four
    calls ahead of the GPU. Three calls alone were not enough for the first pass timed after a
    new operator: T block 128 fprop at 10 % read 150.7 µs a call eager and 135.0 µs in the graph
    replay timed right after it, run after run (v13, v14), while its bprop read 135.4/134.1 µs.
    The host's set-up (layout, plans) leaves the GPU idle before it, as the steady state of an
    eager loop does not."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    start, calls = time.perf_counter(), 0
    while calls < 3 or time.perf_counter() - start < seconds:
        fn()
        calls += 1
        if calls % 4 == 0:
            stream.synchronize()
    stream.synchronize()


def _gpu_seconds(fn, calls: int, batches: int) -> float:
    """Median per-call time of back-to-back calls from Python, by CUDA events, warm-up excluded."""
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    _warm_up(fn)
    samples = []
    for _ in range(batches):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, end) * 1e-3 / calls)
    return statistics.median(samples)


def _graph_seconds(fn, calls: int, batches: int) -> float | None:
    """Median per-call time when ``calls`` calls are replayed from one CUDA graph."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(2):
            fn()  # plans, scratch and output buffers exist before capture
        stream.synchronize()
        try:
            stream.begin_capture()
            for _ in range(calls):
                fn()
            graph = stream.end_capture()
        except Exception:  # noqa: BLE001 - a pass that cannot be captured simply has no graph figure
            return None
        graph.launch(stream)
        stream.synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        samples = []
        for _ in range(batches):
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, end) * 1e-3 / calls)
    return statistics.median(samples)


def _dense_matmul(tf32: bool):
    """Dense cuBLAS: through PyTorch where it is installed (every dtype, an explicit TF32 switch,
    zero-copy through DLPack), else through CuPy."""
    import cupy

    try:
        import torch
    except ImportError:
        return cupy.matmul
    torch.backends.cuda.matmul.allow_tf32 = tf32
    return lambda a, b: torch.matmul(torch.from_dlpack(a), torch.from_dlpack(b))


@dataclasses.dataclass
class GpuRow(BenchRow):
    """A GPU row: ``sparse_s`` is the call into a kept output (``out=``); adds the allocating
    call's time and the CUDA-graph replay time of bsmm's pass."""

    graph_s: float | None = None
    workload: str = ""
    alloc_s: float | None = None


def bench_gpu(workloads=("S", "T", "I"), calls: int = 20, batches: int = 11, seed: int = 0,
              progress: Callable[[str], None] | None = None, quick: bool = False,
              only_dtypes=None, only_block_sizes=None, only_densities=None) -> list[GpuRow]:
    """Each pass of bsmm beside dense cuBLAS on the workloads of BENCHMARKS.md (needs a GPU).

    ``only_dtypes`` ("float16", "tf32", ...), ``only_block_sizes`` and ``only_densities`` (fractions)
    restrict the rows run.
    """
    import cupy

    rng = cupy.random.default_rng(seed)
    rows: list[GpuRow] = []
    for name in workloads:
        spec = WORKLOADS[name]
        N = spec["N"]
        for kind in spec["dtypes"]:
            if only_dtypes and kind not in only_dtypes:
                continue
            block_sizes = _T_FLOAT32_BLOCKS.get(kind, spec["block_sizes"]) if name == "T" else spec["block_sizes"]
            if quick:
                block_sizes = block_sizes[:1]
            if only_block_sizes:
                block_sizes = tuple(bs for bs in block_sizes if bs in only_block_sizes)
            densities = spec["densities"][:2] if quick else spec["densities"]
            if only_densities:
                densities = tuple(d for d in densities if any(abs(d - o) < 1e-9 for o in only_densities))
            for C, K in spec["layers"]:
                rows += _bench_layer(name, kind, N, C, K, block_sizes, densities, rng, calls, batches, seed, progress)
    return rows


def _bench_layer(name: str, kind: str, N: int, C: int, K: int, block_sizes, densities, rng, calls: int, batches: int,
                 seed: int, progress) -> list[GpuRow]:
    """The rows of one layer (C -> K features) of a workload: dense cuBLAS once, then each block
    size and density, each pass into a kept output, allocating, and replayed from a CUDA graph."""
    import cupy

    tf32 = kind == "tf32"
    np_dtype = canonical_dtype("float32" if tf32 else kind, "dtype")
    x = rng.standard_normal((N, C), dtype=np.float32).astype(np_dtype)
    dy = rng.standard_normal((N, K), dtype=np.float32).astype(np_dtype)
    dense_w = rng.standard_normal((C, K), dtype=np.float32).astype(np_dtype)
    matmul = _dense_matmul(tf32)
    dense_calls = {"fprop": lambda: matmul(x, dense_w), "bprop": lambda: matmul(dy, dense_w.T),
                   "updat": lambda: matmul(x.T, dy)}
    dense = {p: _gpu_seconds(f, calls, batches) for p, f in dense_calls.items()}
    del dense_w
    rows = []
    for bs in block_sizes:
        for density in densities:
            op = BlocksparseMatMul(random_layout(C // bs, K // bs, density=density, seed=seed), block_size=bs,
                                   tf32=tf32)
            ws = weight_sets(op, np_dtype, rng)
            outputs = {"fprop": cupy.empty((N, K), dtype=np_dtype), "bprop": cupy.empty((N, C), dtype=np_dtype),
                       "updat": cupy.empty(op.w_shape, dtype=np_dtype)}
            kept, allocating = pass_calls(op, x, dy, ws, outputs), pass_calls(op, x, dy, ws, None)
            for pass_name, run in kept.items():
                row = GpuRow("cuda", kind, N, C, K, bs, op.density, pass_name, _gpu_seconds(run, calls, batches),
                             dense[pass_name], _graph_seconds(run, calls, batches), name,
                             _gpu_seconds(allocating[pass_name], calls, batches))
                rows.append(row)
                if progress:
                    progress(format_gpu_table([row], header=False))
            del ws, outputs
    return rows


def format_gpu_table(rows: list, header: bool = True) -> str:
    lines = []
    if header:
        lines += [
            "| load | dtype | N | C → K | block | density | pass | bsmm | allocating | graph | dense | speed-up | "
            "graph speed-up | eff. |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
    for r in rows:
        graph = _fmt_time(r.graph_s) if r.graph_s else "-"
        graph_speedup = f"{r.dense_s / r.graph_s:.2f}x" if r.graph_s else "-"
        allocating = _fmt_time(r.alloc_s) if getattr(r, "alloc_s", None) else "-"
        lines.append(
            f"| {r.workload} | {r.dtype} | {r.N} | {r.C} → {r.K} | {r.block_size} | {r.density:.0%} | {r.pass_name} | "
            f"{_fmt_time(r.sparse_s)} | {allocating} | {graph} | {_fmt_time(r.dense_s)} | {r.speedup:.2f}x | "
            f"{graph_speedup} | "
            f"{r.efficiency:.0%} |"
        )
    return "\n".join(lines)

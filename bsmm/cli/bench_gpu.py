"""The GPU benchmark: each pass of bsmm beside dense cuBLAS on the workloads of :data:`WORKLOADS`.

``python -m bsmm bench --backend gpu`` (:func:`bench_gpu`) times each pass into a kept output
(``out=``), allocating its output, and replayed from a CUDA graph: medians of CUDA-event times
around batches of calls, after a warm-up. :func:`gpu_plan` says which layers a run measures,
:func:`format_gpu_table` prints the rows with :data:`GPU_LEGEND` under them. The rows, the weight
sets, the passes as calls and the formats are :mod:`bsmm.cli.bench`'s. CuPy is imported only
where a GPU is timed: the plan and the table run anywhere.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import numpy as np

from bsmm.cli.bench import (_EFFICIENCY_WORDS, BenchRow, _fmt_efficiency, _fmt_time, pass_calls, progress_bar,
                            weight_sets)
from bsmm.dtypes import canonical_dtype
from bsmm.layouts import random_layout
from bsmm.matmul import BlocksparseMatMul
from bsmm.passes import PASS_NAMES

__all__ = ["GpuRow", "GpuLayer", "WORKLOADS", "GPU_LEGEND", "bench_gpu", "gpu_plan", "format_gpu_table"]

#: The lines printed under a GPU table (:func:`format_gpu_table`).
GPU_LEGEND = "\n".join((
    "bsmm: median time a call into a kept output (out=), by CUDA events around batches of calls; allocating:",
    "  the same call allocating its output, as y = op(x, w) does; graph: replayed from a CUDA graph;",
    "  dense: cuBLAS (through PyTorch where installed), same shape and dtype; load: the workload (bench --help).",
    "speed-up: dense / bsmm; graph speed-up: dense / graph.",
    _EFFICIENCY_WORDS,
    "  † over 100 %: faster per useful FLOP than cuBLAS is per FLOP at this shape.",
))

#: The GPU workloads (``--workloads``): N, the layers (C input, K output features), block sizes,
#: densities, dtypes ("tf32" = float32 on tensor cores). S is the seed's shape, T a training batch,
#: I an inference batch, F a transformer's feed-forward pair (C -> 4C, 4C -> C).
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


@dataclasses.dataclass(frozen=True)
class GpuLayer:
    """One layer of a workload in one dtype, as :func:`bench_gpu` measures it: a row per pass,
    block size and density."""

    workload: str
    kind: str  # a dtype, or "tf32"
    N: int
    C: int
    K: int
    block_sizes: tuple
    densities: tuple

    @property
    def rows(self) -> int:
        return len(PASS_NAMES) * len(self.block_sizes) * len(self.densities)


def gpu_plan(workloads=("S", "T", "I"), quick: bool = False, only_dtypes=None, only_block_sizes=None,
             only_densities=None) -> list[GpuLayer]:
    """The layers :func:`bench_gpu` measures for these arguments (none of them left without a row).

    Examples
    --------
    >>> plan = gpu_plan(("S",), only_dtypes=("float16",), only_densities=(0.1, 0.02))
    >>> [(layer.N, layer.C, layer.K, layer.densities, layer.rows) for layer in plan]
    [(32, 12288, 12288, (0.1, 0.02), 6)]
    """
    plan = []
    for name in workloads:
        spec = WORKLOADS[name]
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
            if block_sizes and densities:
                plan += [GpuLayer(name, kind, spec["N"], C, K, tuple(block_sizes), tuple(densities))
                         for C, K in spec["layers"]]
    return plan


def bench_gpu(workloads=("S", "T", "I"), calls: int = 20, batches: int = 11, seed: int = 0,
              progress: Callable[[str], None] | None = None, quick: bool = False,
              only_dtypes=None, only_block_sizes=None, only_densities=None, bar: bool = False) -> list[GpuRow]:
    """Each pass of bsmm beside dense cuBLAS on the workloads of :data:`WORKLOADS` (needs a GPU).

    ``only_dtypes`` ("float16", "tf32", ...), ``only_block_sizes`` and ``only_densities`` (fractions)
    restrict the rows run (:func:`gpu_plan`); ``progress`` is called with each row's table line as
    it is measured; ``bar`` shows a progress bar on stderr (:func:`progress_bar`).
    """
    import cupy

    plan = gpu_plan(workloads, quick, only_dtypes, only_block_sizes, only_densities)
    rng = cupy.random.default_rng(seed)
    rows: list[GpuRow] = []
    with progress_bar(sum(layer.rows for layer in plan), "bench gpu", bar) as shown:
        for layer in plan:
            shown.set_description(f"bench gpu {layer.workload} {layer.kind} {layer.C} → {layer.K}")
            rows += _bench_layer(layer, rng, calls, batches, seed, progress, shown)
    return rows


def _dense_gpu_seconds(matmul, x, dy, rng, calls: int, batches: int) -> dict[str, float]:
    """Median seconds of each dense product of ``x``'s and ``dy``'s shape, with a random weight
    that is freed on return."""
    weight = rng.standard_normal((x.shape[1], dy.shape[1]), dtype=np.float32).astype(x.dtype)
    runs = {"fprop": lambda: matmul(x, weight), "bprop": lambda: matmul(dy, weight.T),
            "updat": lambda: matmul(x.T, dy)}
    return {pass_name: _gpu_seconds(run, calls, batches) for pass_name, run in runs.items()}


def _bench_layer(layer: GpuLayer, rng, calls: int, batches: int, seed: int, progress, shown) -> list[GpuRow]:
    """The rows of one layer (C -> K features) of a workload: dense cuBLAS once, then each block
    size and density, each pass into a kept output, allocating, and replayed from a CUDA graph;
    ``shown`` (a progress bar) advances a step a row."""
    import cupy

    N, C, K = layer.N, layer.C, layer.K
    tf32 = layer.kind == "tf32"
    np_dtype = canonical_dtype("float32" if tf32 else layer.kind, "dtype")
    x = rng.standard_normal((N, C), dtype=np.float32).astype(np_dtype)
    dy = rng.standard_normal((N, K), dtype=np.float32).astype(np_dtype)
    dense = _dense_gpu_seconds(_dense_matmul(tf32), x, dy, rng, calls, batches)
    rows = []
    for bs in layer.block_sizes:
        for density in layer.densities:
            op = BlocksparseMatMul(random_layout(C // bs, K // bs, density=density, seed=seed), block_size=bs,
                                   tf32=tf32)
            ws = weight_sets(op, np_dtype, rng)
            outputs = {"fprop": cupy.empty((N, K), dtype=np_dtype), "bprop": cupy.empty((N, C), dtype=np_dtype),
                       "updat": cupy.empty(op.w_shape, dtype=np_dtype)}
            kept, allocating = pass_calls(op, x, dy, ws, outputs), pass_calls(op, x, dy, ws, None)
            for pass_name, run in kept.items():
                row = GpuRow("cuda", layer.kind, N, C, K, bs, op.density, pass_name, _gpu_seconds(run, calls, batches),
                             dense[pass_name], _graph_seconds(run, calls, batches), layer.workload,
                             _gpu_seconds(allocating[pass_name], calls, batches))
                rows.append(row)
                shown.update(1)
                if progress:
                    progress(format_gpu_table([row], header=False))
            del ws, outputs
    return rows


def format_gpu_table(rows: list, header: bool = True) -> str:
    """Markdown table: one line per (workload, dtype, layer, block size, density, pass); with
    ``header``, :data:`GPU_LEGEND` under it.

    Examples
    --------
    >>> row = GpuRow("cuda", "float16", 32, 12288, 12288, 32, 0.1, "fprop", 1e-5, 2e-4, 9e-6, "S", 2e-5)
    >>> print(format_gpu_table([row], header=False))  # doctest: +NORMALIZE_WHITESPACE
    | S | float16 | 32 | 12288 → 12288 | 32 | 10% | fprop | 10.0 us | 20.0 us | 9.0 us | 200.0 us |
      20.00x | 22.22x | 200% † |
    """
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
            f"{graph_speedup} | {_fmt_efficiency(r.efficiency)} |"
        )
    if header:
        lines += ["", GPU_LEGEND]
    return "\n".join(lines)

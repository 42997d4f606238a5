"""Benchmarks: each pass of bsmm side by side with the dense product, in one run; here the CPU's,
and what the GPU's (:mod:`bsmm.cli.bench_gpu`) shares with it.

``python -m bsmm bench`` times the three passes at several densities against the dense matrix
product of the same shape and dtype: NumPy's BLAS on the CPU (:func:`bench_cpu`; by default the
seed's shape, N = 32, C = K = 12288, block 32), cuBLAS on the GPU
(:func:`bsmm.cli.bench_gpu.bench_gpu`). Every input is fresh random data; the dense weight of the
same size as the sparse one is random too, and calls rotate through as many weights as it takes to
outgrow the caches (:func:`weight_sets`), so that neither side times a weight kept in cache.
Times are medians over repeated calls after a warm-up; on the CPU the dense product is timed
between bsmm's calls, so that both are measured at the same moments.

The columns of the tables are explained under them (:data:`CPU_LEGEND`,
:data:`bsmm.cli.bench_gpu.GPU_LEGEND`): *speed-up* is dense time over bsmm time; *eff.*, the
efficiency per useful FLOP, is speed-up × density: bsmm's rate of useful FLOPs (2·N·blocks·block²
a pass, the products of present blocks only; = 2·N·C·K·density) as a fraction of the dense
product's FLOP rate (2·N·C·K a pass).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from bsmm.dtypes import canonical_dtype
from bsmm.layouts import random_layout
from bsmm.matmul import BlocksparseMatMul
from bsmm.passes import PASS_NAMES

__all__ = ["BenchRow", "CpuRow", "CPU_LEGEND", "SPREAD_LIMIT", "bench_cpu", "format_table", "pass_calls",
           "progress_bar", "relative_spread", "weight_sets", "write_json"]

#: A CPU row whose times spread more than this (:func:`relative_spread`) is flagged: the machine was busy.
SPREAD_LIMIT = 0.25
#: The L2 of the GPUs measured (an H100's 50 MiB): the weights of GPU rows rotate to outgrow it.
_L2_BYTES = 50 * 2**20

# Under both tables: CPU_LEGEND here, GPU_LEGEND in bsmm.cli.bench_gpu.
_EFFICIENCY_WORDS = ("eff.: speed-up × density, the efficiency per useful FLOP: bsmm's rate of useful FLOPs\n"
                     "  (2·N·C·K·density a pass: present blocks only) as a fraction of the dense product's FLOP "
                     "rate (2·N·C·K a pass);")

#: The lines printed under a CPU table (:func:`format_table`).
CPU_LEGEND = "\n".join((
    "bsmm, dense: median time a call of bsmm's pass and of NumPy's dense product of the same shape and dtype,",
    "  timed in turns. speed-up: dense time / bsmm time.",
    _EFFICIENCY_WORDS,
    "  † over 100 %: dense ran below its own best rate here (a skinny product, or its BLAS threads held up by",
    "  other programs on the cores: re-run with OPENBLAS_NUM_THREADS=1 to tell).",
    "spread: interquartile range / median of the repeated times, the larger of bsmm's and dense's;",
    f"  * over {SPREAD_LIMIT * 100:g} %: the machine was busy, re-run.",
))


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
        """Dense time × density / sparse time: bsmm's useful FLOPs (2·N·C·K·density) a second over
        dense's FLOPs (2·N·C·K) a second; 1.0 is as efficient per useful FLOP as the dense product."""
        return self.dense_s * self.density / self.sparse_s

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"speedup": self.speedup, "efficiency": self.efficiency}


@dataclasses.dataclass
class CpuRow(BenchRow):
    """A CPU row: adds the spread (:func:`relative_spread`) of bsmm's and of dense's times."""

    sparse_spread: float | None = None
    dense_spread: float | None = None

    @property
    def spread(self) -> float | None:
        """The larger of the two spreads (None where one call was timed)."""
        known = [s for s in (self.sparse_spread, self.dense_spread) if s is not None]
        return max(known) if known else None

    @property
    def busy(self) -> bool:
        """Whether the spread is over :data:`SPREAD_LIMIT`: the times are not to be trusted."""
        return self.spread is not None and self.spread > SPREAD_LIMIT

    def as_dict(self) -> dict:
        return super().as_dict() | {"spread": self.spread}


def relative_spread(samples) -> float | None:
    """Interquartile range over median of ``samples`` (None for fewer than two): how far apart
    repeated times of one call lie, the extremes of five left out.

    Examples
    --------
    >>> round(relative_spread([1.0, 1.0, 1.1, 1.0, 3.0]), 3)  # one outlier: a steady call
    0.1
    >>> round(relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]), 3)
    0.667
    """
    if len(samples) < 2:
        return None
    low, _, high = statistics.quantiles(samples, n=4, method="inclusive")
    return (high - low) / statistics.median(samples)


def progress_bar(total: int, description: str, show: bool, unit: str = "row"):
    """A ``tqdm.auto`` bar of ``total`` steps (``unit``) on stderr (a terminal's line, or a widget
    in Jupyter), drawn where ``show`` is true; with ``update`` and ``set_description`` either way.

    Examples
    --------
    >>> with progress_bar(3, "rows", show=False) as bar:
    ...     bar.update(3)
    """
    from tqdm.auto import tqdm  # here, not at the top: `import bsmm` imports no tqdm

    return tqdm(total=total, desc=description, unit=unit, file=sys.stderr, disable=not show, leave=False,
                dynamic_ncols=True)


def _interleaved_seconds(dense: Callable[[], object], sparse: Callable[[], object], repeats: int,
                         warmup: int = 1) -> tuple[list[float], list[float]]:
    """Seconds of ``repeats`` calls of ``dense`` and of ``sparse`` taken in turns (dense, sparse,
    dense, ...), after ``warmup`` calls of each: a busy moment of the machine slows calls of
    both, where timing one and then the other put it on one side only (the same command gave
    0.59x and then 2.01x)."""
    for _ in range(warmup):
        dense()
        sparse()
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, times in zip((dense, sparse), samples):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return samples


@functools.cache
def _cpu_cache_bytes() -> int:
    """The largest CPU cache in bytes, as Linux lists it (64 MiB where it cannot be read)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip()  # "32768K"
            sizes.append(int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1))
        except (OSError, ValueError):
            continue
    return max(sizes, default=64 * 2**20)


def _copies_to_outgrow(nbytes: int, cache_bytes: int) -> int:
    """How many arrays of ``nbytes`` (1 to 8) hold twice ``cache_bytes``: calls rotating through
    them find the array they take evicted from the cache since its last use."""
    return max(1, min(8, math.ceil(2 * cache_bytes / max(nbytes, 1))))


def weight_sets(op: BlocksparseMatMul, dtype, rng, cache_bytes: int = _L2_BYTES) -> list:
    """Random weight arrays for ``op`` (made where ``rng``, NumPy's or CuPy's, makes arrays), as
    many as it takes (up to 8) to hold twice ``cache_bytes`` (by default the GPU's L2), so that
    calls rotating through them do not time small weights kept in the cache.

    Examples
    --------
    >>> op = BlocksparseMatMul(np.ones((2, 2), dtype=bool), block_size=32)  # 4 blocks: 16 KiB in float32
    >>> ws = weight_sets(op, "float32", np.random.default_rng(0), cache_bytes=2**14)
    >>> len(ws), ws[0].shape  # two sets hold twice the 16 KiB
    (2, (4, 32, 32))
    """
    w_bytes = op.blocks * op.block_size ** 2 * np.dtype(dtype).itemsize
    return [rng.standard_normal(op.w_shape, dtype=np.float32).astype(dtype)
            for _ in range(_copies_to_outgrow(w_bytes, cache_bytes))]


def pass_calls(op: BlocksparseMatMul, x, dy, ws: list, outputs: dict | None) -> dict[str, Callable[[], object]]:
    """The three passes of ``op`` as argument-less calls into ``outputs[pass]`` (``None``: the
    allocating calls a user's loop makes), fprop and bprop taking the next of the weight sets
    ``ws`` at each call.

    Examples
    --------
    >>> op = BlocksparseMatMul(np.ones((2, 2), dtype=bool), block_size=32)
    >>> x = dy = np.ones((4, 64), dtype=np.float32)
    >>> ws = weight_sets(op, "float32", np.random.default_rng(0), cache_bytes=2**14)
    >>> calls = pass_calls(op, x, dy, ws, None)
    >>> [calls[p]().shape for p in ("fprop", "bprop", "updat")]
    [(4, 64), (4, 64), (4, 32, 32)]
    >>> bool(np.array_equal(calls["fprop"](), calls["fprop"]()))  # the next weight set at each call
    False
    """
    turn = itertools.count()
    out = outputs or {}
    return {
        "fprop": lambda: op.fprop(x, ws[next(turn) % len(ws)], out=out.get("fprop")),
        "bprop": lambda: op.bprop(dy, ws[next(turn) % len(ws)], out=out.get("bprop")),
        "updat": lambda: op.updat(x, dy, out=out.get("updat")),
    }


def _dense_calls(x, dy, weights: list) -> dict[str, Callable[[], object]]:
    """The three dense products, fprop and bprop taking the next of ``weights`` at each call."""
    turn = itertools.count()
    return {"fprop": lambda: x @ weights[next(turn) % len(weights)],
            "bprop": lambda: dy @ weights[next(turn) % len(weights)].T,
            "updat": lambda: x.T @ dy}


def bench_cpu(N=32, C=12288, K=12288, block_size=32, densities=(0.5, 0.25, 0.1, 0.05, 0.02),
              dtype="float32", repeats=5, seed=0, progress: Callable[[str], None] | None = None,
              bar: bool = False) -> list[CpuRow]:
    """Time the three passes of the CPU backend against dense NumPy products, in turns.

    Each row's dense product is timed between bsmm's calls of that row (:func:`_interleaved_seconds`),
    so that the speed-up compares times taken at the same moments, and the row keeps the spread of
    both (:attr:`CpuRow.busy` where it is too large to trust).

    Parameters
    ----------
    N, C, K : batch rows, input and output features (C and K multiples of ``block_size``)
    densities : fractions of present blocks, one row per pass each
    dtype : "float32" or "float64" (NumPy's dense product of float16 and bfloat16 has no BLAS:
        no baseline to compare with)
    repeats : timed calls of each side per row
    progress : called with each row's table line as it is measured
    bar : show a progress bar on stderr (:func:`progress_bar`)

    Raises
    ------
    TypeError
        If ``dtype`` is not float32 or float64.

    Examples
    --------
    >>> rows = bench_cpu(N=4, C=256, K=256, densities=(0.5,), repeats=3)
    >>> [row.pass_name for row in rows], rows[0].density, rows[0].spread is not None
    (['fprop', 'bprop', 'updat'], 0.5, True)
    """
    dtype = canonical_dtype(dtype, "dtype", backend="cpu")
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"dtype must be float32 or float64 (NumPy's dense product of other types has no BLAS "
                        f"to compare with); got {dtype}")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, C), dtype=np.float32).astype(dtype)
    dy = rng.standard_normal((N, K), dtype=np.float32).astype(dtype)
    cache = _cpu_cache_bytes()
    dense_ws = [rng.standard_normal((C, K), dtype=np.float32).astype(dtype)
                for _ in range(_copies_to_outgrow(C * K * dtype.itemsize, cache))]
    dense = _dense_calls(x, dy, dense_ws)
    rows = []
    with progress_bar(len(densities) * len(PASS_NAMES), "bench cpu", bar) as shown:
        for density in densities:
            op = BlocksparseMatMul(random_layout(C // block_size, K // block_size, density=density, seed=seed),
                                   block_size=block_size)
            sparse = pass_calls(op, x, dy, weight_sets(op, dtype, rng, cache), None)
            for pass_name in PASS_NAMES:
                shown.set_description(f"bench cpu {op.density:.0%} {pass_name}")
                dense_s, sparse_s = _interleaved_seconds(dense[pass_name], sparse[pass_name], repeats)
                row = CpuRow("cpu", str(dtype), N, C, K, block_size, op.density, pass_name,
                             statistics.median(sparse_s), statistics.median(dense_s),
                             relative_spread(sparse_s), relative_spread(dense_s))
                rows.append(row)
                shown.update(1)
                if progress:
                    progress(format_table([row], header=False))
    return rows


def format_table(rows: list[CpuRow], header: bool = True) -> str:
    """Markdown table: one line per (density, pass); with ``header``, :data:`CPU_LEGEND` under it.

    Examples
    --------
    >>> row = CpuRow("cpu", "float32", 32, 2048, 2048, 32, 0.5, "fprop", 0.001, 0.004, 0.05, 0.4)
    >>> print(format_table([row], header=False))
    | cpu | float32 | 32 | 2048 → 2048 | 32 | 50% | fprop | 1.00 ms | 4.00 ms | 4.00x* | 200% † | 40% |
    """
    lines = []
    if header:
        lines += ["| backend | dtype | N | C → K | block | density | pass | bsmm | dense | speed-up | eff. | spread |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        spread = "-" if r.spread is None else f"{r.spread:.0%}"
        lines.append(
            f"| {r.backend} | {r.dtype} | {r.N} | {r.C} → {r.K} | {r.block_size} | {r.density:.0%} | {r.pass_name} | "
            f"{_fmt_time(r.sparse_s)} | {_fmt_time(r.dense_s)} | {r.speedup:.2f}x{'*' if r.busy else ''} | "
            f"{_fmt_efficiency(r.efficiency)} | {spread} |")
    if header:
        lines += ["", CPU_LEGEND]  # a blank line ends the table in Markdown
    return "\n".join(lines)


def _fmt_efficiency(efficiency: float) -> str:
    return f"{efficiency:.0%}" + (" †" if efficiency > 1 else "")


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def write_json(rows: list[BenchRow], path: str, meta: dict | None = None) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta or {}, "rows": [r.as_dict() for r in rows]}, f, indent=1)

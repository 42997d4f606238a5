"""The CPU bench times dense beside each row, in turns with bsmm's calls, and flags rows whose
times spread too far to trust; the tables say what their columns mean; the plot's title."""

from __future__ import annotations

import datetime

import pytest

from bsmm.cli import bench, bench_gpu
from bsmm.cli.bench import CpuRow, bench_cpu, format_table
from bsmm.cli.bench_gpu import GpuRow, format_gpu_table
from bsmm.passes import PASS_NAMES


class ScriptedClock:
    """A stand-in for the time module whose timed intervals last as scripted: reads come in
    pairs around a call, and the second of a pair is the first plus the next duration."""

    def __init__(self, durations):
        self.durations = iter(durations)
        self.now, self.reads = 0.0, 0

    def perf_counter(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:
            self.now += next(self.durations)
        return self.now


def test_dense_and_sparse_calls_are_timed_in_turns(monkeypatch):
    calls = []
    durations = {"dense": 1.0, "sparse": 0.25}

    class Clock:
        now = 0.0

        def perf_counter(self):
            return self.now

    clock = Clock()

    def call(name):
        def run():
            calls.append(name)
            clock.now += durations[name]
        return run

    monkeypatch.setattr(bench, "time", clock)
    dense_s, sparse_s = bench._interleaved_seconds(call("dense"), call("sparse"), repeats=4, warmup=2)
    assert calls == ["dense", "sparse"] * (2 + 4)
    assert dense_s == [1.0] * 4 and sparse_s == [0.25] * 4


def script(rows: int, repeats: int, busy_row: int, pair_load: dict):
    """Interval durations of ``rows`` rows, dense and sparse in turns: dense 1.0 + 0.1·i at the
    i-th repeat and sparse half of it, but for ``busy_row``, whose sparse calls vary widely;
    ``pair_load[(row, i)]`` multiplies both calls of a pair (the machine busy at that moment)."""
    durations = []
    for row in range(rows):
        for i in range(repeats):
            load, dense = pair_load.get((row, i), 1.0), 1.0 + 0.1 * i
            sparse = [0.5, 0.5, 2.0, 0.5][i] if row == busy_row else dense / 2
            durations += [load * dense, load * sparse]
    return durations


def test_bench_cpu_takes_dense_beside_each_row_and_flags_a_busy_row(monkeypatch):
    densities, repeats = (0.5, 0.25), 4
    rows_count = len(densities) * len(PASS_NAMES)
    clock = ScriptedClock(script(rows_count, repeats, busy_row=4, pair_load={(1, 2): 3.0}))
    monkeypatch.setattr(bench, "time", clock)
    rows = bench_cpu(N=4, C=256, K=256, densities=densities, repeats=repeats)
    assert clock.reads == 2 * 2 * repeats * rows_count  # two reads a call, dense and sparse, every row
    assert [(r.density, r.pass_name) for r in rows] == [(d, p) for d in densities for p in PASS_NAMES]
    # Medians of the intervals taken in turns: dense the first of each pair, sparse the second.
    steady = rows[0]
    assert steady.dense_s == pytest.approx(1.15) and steady.sparse_s == pytest.approx(0.575)
    assert steady.spread == pytest.approx(bench.relative_spread([1.0, 1.1, 1.2, 1.3])) and not steady.busy
    # A busy moment slows both calls of its pair: the row keeps the steady rows' speed-up, and
    # its spread flags it all the same.
    assert rows[1].speedup == pytest.approx(2.0) and rows[1].busy
    busy = rows[4]
    assert busy.sparse_spread == pytest.approx(0.75) and busy.busy
    assert [r.busy for r in rows] == [False, True, False, False, True, False]
    line = format_table([busy], header=False)
    assert f"| {busy.speedup:.2f}x* |" in line and "| 75% |" in line


def test_a_single_timed_call_has_no_spread():
    assert bench.relative_spread([1.0]) is None
    row = CpuRow("cpu", "float32", 4, 256, 256, 32, 0.5, "fprop", 1.0, 2.0)
    assert row.spread is None and not row.busy
    assert format_table([row], header=False).endswith("| 2.00x | 100% | - |")
    assert row.as_dict()["spread"] is None and row.as_dict()["efficiency"] == 1.0


def test_efficiency_is_speed_up_times_density_and_marked_over_100_percent():
    fast = CpuRow("cpu", "float32", 4, 256, 256, 32, 0.25, "fprop", 1.0, 5.0, 0.01, 0.02)
    assert fast.speedup == 5.0 and fast.efficiency == 1.25
    assert "| 5.00x | 125% † | 2% |" in format_table([fast], header=False)
    slow = CpuRow("cpu", "float32", 4, 256, 256, 32, 0.25, "fprop", 1.0, 2.0, 0.01, 0.02)
    assert "| 2.00x | 50% | 2% |" in format_table([slow], header=False)


def test_tables_end_with_a_legend_of_their_columns():
    cpu = format_table([CpuRow("cpu", "float32", 4, 256, 128, 32, 0.5, "fprop", 1.0, 2.0, 0.3, 0.1)])
    header, rule, row, blank, *legend = cpu.splitlines()
    assert header.split("|")[1:-1] == [f" {c} " for c in ("backend", "dtype", "N", "C → K", "block", "density",
                                                         "pass", "bsmm", "dense", "speed-up", "eff.", "spread")]
    assert "| 256 → 128 |" in row and "| 2.00x* |" in row and blank == ""
    text = "\n".join(legend)
    for words in ("speed-up: dense time / bsmm time", "eff.: speed-up × density", "2·N·C·K·density a pass",
                  "† over 100 %", "spread: interquartile range / median", "* over 25 %: the machine was busy"):
        assert words in text, words
    gpu_row = GpuRow("cuda", "float16", 32, 12288, 12288, 32, 0.1, "fprop", 1e-5, 2e-4, 9e-6, "S", 2e-5)
    gpu = format_gpu_table([gpu_row])
    assert "| S | float16 | 32 | 12288 → 12288 | 32 | 10% | fprop |" in gpu and "| 20.00x | 22.22x | 200% † |" in gpu
    assert gpu.splitlines()[3] == "" and "allocating:" in gpu and "graph speed-up: dense / graph" in gpu
    assert "eff.: speed-up × density" in gpu


def test_bench_cpu_draws_a_bar_of_its_rows_on_stderr_where_asked(tqdm_bars):
    lines = []
    bench_cpu(N=4, C=256, K=256, densities=(0.5, 0.25), repeats=1, bar=True, progress=lines.append)
    (bar,) = tqdm_bars
    assert (bar.total, bar.steps, bar.disable, bar.file) == (6, 6, False, bench.sys.stderr)
    assert bar.descriptions[:2] == ["bench cpu 50% fprop", "bench cpu 50% bprop"]
    assert len(lines) == 6 and all(line.startswith("| cpu | float32 | 4 | 256 → 256 |") for line in lines)
    bench_cpu(N=4, C=256, K=256, densities=(0.5,), repeats=1)
    assert tqdm_bars[1].disable


def test_weights_rotate_until_they_outgrow_the_cache():
    assert bench._copies_to_outgrow(16 * 2**20, 32 * 2**20) == 4
    assert bench._copies_to_outgrow(600 * 2**20, 32 * 2**20) == 1
    assert bench._copies_to_outgrow(1, 32 * 2**20) == 8
    assert bench._cpu_cache_bytes() >= 2**20


def test_the_plot_is_titled_with_shape_device_dtype_and_date(tmp_path):
    pytest.importorskip("matplotlib")
    from bsmm.cli.plot import plot_speedup, plot_title

    rows = [GpuRow("cuda", dtype, 8192, c, k, bs, d, "fprop", 1.0, 2.0, None, "F", None)
            for dtype in ("float16", "bfloat16") for c, k in ((4096, 16384), (16384, 4096)) for bs in (64, 128)
            for d in (0.5, 0.1)]
    title = plot_title(rows, "NVIDIA H100 80GB HBM3", datetime.date(2026, 11, 25))
    assert title == ("F N=8192, C=4096 → K=16384; F N=8192, C=16384 → K=4096, blocks 64, 128, float16, bfloat16\n"
                     "NVIDIA H100 80GB HBM3, 2026-11-25")
    image = tmp_path / "speedup.png"
    plot_speedup(rows, str(image), "NVIDIA H100 80GB HBM3")
    assert image.read_bytes()[:4] == b"\x89PNG"


def test_gpu_plan_counts_the_rows_bench_gpu_runs():
    plan = bench_gpu.gpu_plan(("T",), only_dtypes=("float32", "tf32"))
    assert [(layer.kind, layer.block_sizes) for layer in plan] == [("float32", (32, 64)), ("tf32", (64,))]
    assert sum(layer.rows for layer in plan) == 3 * 3 * (2 + 1)
    assert bench_gpu.gpu_plan(("F",), quick=True, only_dtypes=("float16",)) == [
        bench_gpu.GpuLayer("F", "float16", 8192, 4096, 16384, (64,), (0.5, 0.25)),
        bench_gpu.GpuLayer("F", "float16", 8192, 16384, 4096, (64,), (0.5, 0.25))]
    assert bench_gpu.gpu_plan(("I",), only_block_sizes=(128,)) == []


def test_the_cpu_bench_refuses_dtypes_without_a_blas_baseline():
    with pytest.raises(TypeError, match="dtype must be float32 or float64 .*; got float16"):
        bench_cpu(N=4, C=256, K=256, densities=(0.5,), repeats=1, dtype="float16")

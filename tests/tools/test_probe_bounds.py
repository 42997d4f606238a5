"""``tools/probes/probe_bounds.py`` and the kernels' probe switches (CPU; NVRTC where installed): every kind
of kernel compiles copy-only and math-only, the two switches refuse each other, the probe cubins
never share a cache key with the real ones, and the bounds table computes what it says."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest

from bsmm.backends.cuda.kernels import Variant, compile_options, compile_variant
from conftest import REPO_ROOT, compile_or_skip

TOOL = REPO_ROOT / "tools" / "probes" / "probe_bounds.py"
COPY_ONLY, MATH_ONLY = "-DBSMM_PROBE_COPY_ONLY", "-DBSMM_PROBE_MATH_ONLY"

# One variant of each main loop the switches touch: the TMA copy warp with wgmma (plain, column
# groups, transposed row groups) and with mma.sync, the cp.async wgmma loop, the cp.async loop
# with mma.sync (on transposed activations), with SIMT and with grouped updat.
KINDS = [
    (Variant("float16", 128, (256, 128, 64, 16, 1, 4), "wgmma16", "fprop", 1, True, tma=True), "sm_90a"),
    (Variant("float16", 32, (128, 128, 64, 8, 1, 3), "wgmma16", "bprop", 1, True, cols=4, tma=True), "sm_90a"),
    (Variant("bfloat16", 32, (128, 32, 64, 8, 1, 3), "wgmma16", "updat", 1, True, cols=4, tma=True), "sm_90a"),
    (Variant("float16", 32, (32, 32, 32, 2, 2, 8), "tensor16", "fprop", 1, True, tma=True), "sm_90a"),
    (Variant("float16", 64, (128, 64, 64, 8, 1, 4), "wgmma16", "fprop", 1, True), "sm_90a"),
    (Variant("float16", 16, (256, 16, 16, 8, 1, 6), "tensor16", "fprop", 0, True, act_transposed=True), "sm_80"),
    (Variant("float32", 32, (64, 32, 32, 4, 1, 2), "simt", "updat", 1, True), "sm_80"),
    (Variant("float16", 32, (32, 32, 64, 2, 2, 3), "tensor16", "updat", 1, True, grouped=True), "sm_80"),
]


def load_tool():
    spec = importlib.util.spec_from_file_location("probe_bounds", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("option", [COPY_ONLY, MATH_ONLY], ids=["copy_only", "math_only"])
def test_every_kind_of_kernel_compiles_under_each_switch(option, monkeypatch, tmp_path):
    monkeypatch.setenv("BSMM_CACHE_DIR", str(tmp_path))  # compiled, not found in a warm cache
    monkeypatch.setenv("BSMM_NVRTC_OPTIONS", option)
    compile_or_skip(*KINDS[0])
    for variant, arch in KINDS[1:]:
        compile_variant(variant, arch)


def test_the_switches_refuse_each_other(monkeypatch, tmp_path):
    monkeypatch.setenv("BSMM_CACHE_DIR", str(tmp_path))
    compile_or_skip(*KINDS[0])
    monkeypatch.setenv("BSMM_NVRTC_OPTIONS", f"{COPY_ONLY} {MATH_ONLY}")
    with pytest.raises(Exception, match="exclude each other"):
        compile_variant(*KINDS[0])


def test_probe_options_are_part_of_the_compile_options(monkeypatch):
    """The kernel cache keys on the options: a probe cubin is never loaded for a real call."""
    monkeypatch.delenv("BSMM_NVRTC_OPTIONS", raising=False)
    plain = compile_options("sm_90a")
    monkeypatch.setenv("BSMM_NVRTC_OPTIONS", COPY_ONLY)
    assert compile_options("sm_90a") == (*plain, COPY_ONLY)


def row(pass_name, density, sparse_s, dense_s, block_size=64):
    return dict(workload="T", dtype="float16", block_size=block_size, density=density, pass_name=pass_name,
                sparse_s=sparse_s, dense_s=dense_s, N=4096, C=8192, K=8192)


def test_bounds_table():
    tool = load_tool()
    runs = {
        "full": [row("fprop", 0.1, 200e-6, 800e-6), row("bprop", 0.1, 100e-6, 800e-6)],
        "copy only": [row("fprop", 0.1, 160e-6, 800e-6), row("bprop", 0.1, 50e-6, 800e-6)],
        # Each run's own dense time: 400 us here.
        "math only": [row("fprop", 0.1, 100e-6, 400e-6)],
    }
    lines = tool.table(runs).splitlines()
    assert len(lines) == 3, "a row missing from a run is left out"
    assert lines[2] == "| T 8192->8192 | float16 | 64 | 10% | fprop | 200.0 | 160.0 | 100.0 | 40% | 50% | 40% |"
    assert set(tool.MODES) == {"full", "copy only", "math only"}
    assert tool.MODES["copy only"] == COPY_ONLY and tool.MODES["math only"] == MATH_ONLY


# ---- the roofline: bytes a plan moves --------------------------------------------------------

def fake_plan(variant, segments, grid, table=None, workspace_floats=0):
    return SimpleNamespace(variant=variant, segments=np.asarray(segments),
                           table=np.asarray(table if table is not None else []),
                           launcher=SimpleNamespace(grid=grid), workspace_floats=workspace_floats)


def copied_tile_by_tile(variant, segments, grid, table, n):
    """Elements the copies bring in, counted tile by tile and step by step as the kernel walks them."""
    bm, bn, bk = variant.tile.bm, variant.tile.bn, variant.tile.bk
    bs, total = variant.block_size, 0
    for unit, begin, end, _ in segments:
        for y in range(grid[1]):
            rows = min(bm, n - y * bm)  # rows past N are zero-filled, not read
            for _z in range(grid[2]):
                if variant.pass_name == "updat":
                    for r0 in range(begin, end, bk):
                        depth = min(bk, end - r0)
                        if variant.cols > 1:
                            present = sum(1 for j in table[unit][1:1 + variant.cols] if j >= 0)
                            total += depth * bs * (1 + present)
                        else:
                            total += depth * (bm + bn)
                elif variant.cols > 1:
                    for entry in table[begin:end]:
                        total += rows * bs + sum(bs * bs for j in entry[1:] if j >= 0)
                else:
                    for _block in range(begin, end):
                        for _step in range(bs // bk):
                            total += rows * bk + bk * bn
    return total


def random_segments(rng, units, longest):
    return [(u, b, b + int(rng.integers(1, longest)), 0) for u, b in zip(range(units), rng.integers(0, 50, units))]


@pytest.mark.parametrize("n", [4096, 1000, 7])
def test_moved_bytes_counts_what_the_kernels_copy(n):
    tool = load_tool()
    rng = np.random.default_rng(0)
    plain = Variant("float16", 128, (256, 128, 64, 16, 1, 4), "wgmma16", "fprop", 1, True, tma=True)
    split_n = Variant("float32", 64, (128, 32, 32, 4, 1, 2), "tensor16", "bprop", 1, True)  # BN < block
    updat = Variant("bfloat16", 64, (64, 64, 64, 4, 1, 4), "wgmma16", "updat", 1, True, tma=True)
    cases = []
    for variant in (plain, split_n):
        bm, bn = variant.tile.bm, variant.tile.bn
        cases.append((variant, random_segments(rng, 9, 12), (9, -(-n // bm), variant.block_size // bn), None))
    cases.append((updat, [(u, b, b + int(rng.integers(1, n + 1)), 0) for u, b in enumerate(rng.integers(0, n, 6))],
                  (6, 1, 1), None))
    groups = Variant("float16", 32, (128, 128, 64, 8, 1, 3), "wgmma16", "fprop", 1, True, cols=4, tma=True)
    table = np.where(rng.random((60, 5)) < 0.4, rng.integers(0, 99, (60, 5)), -1)
    table[:, 0] = rng.integers(0, 50, 60)
    cases.append((groups, random_segments(rng, 5, 10), (5, -(-n // 128), 1), table))
    rows = Variant("float16", 32, (128, 32, 64, 8, 1, 3), "wgmma16", "updat", 1, True, cols=4, tma=True)
    row_table = np.where(rng.random((8, 9)) < 0.6, rng.integers(0, 99, (8, 9)), -1)
    cases.append((rows, [(u, 0, n, 0) for u in range(8)], (8, 1, 1), row_table))
    for variant, segments, grid, table in cases:
        item = 4 if variant.dtype == "float32" else 2
        got = tool.moved_bytes(fake_plan(variant, segments, grid, table, workspace_floats=10), n)
        assert got == {"staged": copied_tile_by_tile(variant, segments, grid, table, n) * item, "partials": 80}, variant


def test_moved_bytes_adds_the_transposed_copies():
    tool = load_tool()
    inner = fake_plan(Variant("float16", 16, (256, 16, 16, 8, 1, 6), "tensor16", "fprop", 0, True, act_transposed=True),
                      [(0, 0, 3, 0)], (1, 2, 1))
    fprop = SimpleNamespace(plan=inner, features=512, ld=104, item=2)
    got = tool.moved_bytes(fprop, 100)
    assert got["transposed"] == 512 * (100 + 104) * 2  # x read, its copy written
    assert got["staged"] == tool.moved_bytes(inner, 100)["staged"] == 3 * (100 * 16 + 2 * 16 * 16) * 2
    updat = SimpleNamespace(plan=inner, transpose_x=None, C=512, K=256, ld=104, item=2)
    assert tool.moved_bytes(updat, 100)["transposed"] == (512 + 256) * (100 + 104) * 2
    weights = SimpleNamespace(plan=inner, weight_count=5 * 64 * 64)
    assert tool.moved_bytes(weights, 100)["transposed"] == 2 * 5 * 64 * 64 * 4


def test_roofline_table():
    tool = load_tool()
    full = row("fprop", 0.1, 200e-6, 800e-6)
    runs = {"full": [full], "copy only": [dict(full, sparse_s=100e-6)], "math only": [dict(full, sparse_s=50e-6)]}
    lines = tool.roofline_table(runs, lambda r: 500_000_000).splitlines()
    # 4096 x 8192 x 8192 x 2 x 10 % = 55.0 GFLOP; dense: 549.8 GFLOP in 800 us = 687 TFLOP/s. DRAM at
    # least: x and y, 4096 x 8192 x 2 bytes each, and 10 % of the 8192² weights, 2 bytes each.
    assert lines[2] == ("| T 8192->8192 | float16 | 64 | 10% | fprop | 65% | 40 / 80 / 160 | 500 | 5.0 / 2.5 | 148 | "
                        "55.0 | 687 |")
    runs["math only"] = []
    assert len(tool.roofline_table(runs, lambda r: 1).splitlines()) == 2, "a row missing from a run is left out"

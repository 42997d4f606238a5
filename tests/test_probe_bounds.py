"""``tools/probe_bounds.py`` and the kernels' probe switches (CPU; NVRTC where installed): every kind
of kernel compiles copy-only and math-only, the two switches refuse each other, the probe cubins
never share a cache key with the real ones, and the bounds table computes what it says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from bsmm.kernels import Variant, compile_options, compile_variant
from conftest import compile_or_skip

TOOL = Path(__file__).resolve().parents[1] / "tools" / "probe_bounds.py"
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
                sparse_s=sparse_s, dense_s=dense_s)


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
    assert lines[2] == "| T | float16 | 64 | 10% | fprop | 200.0 | 160.0 | 100.0 | 40% | 50% | 40% |"
    assert set(tool.MODES) == {"full", "copy only", "math only"}
    assert tool.MODES["copy only"] == COPY_ONLY and tool.MODES["math only"] == MATH_ONLY

"""``tools/gpu/gpu_sweep.py`` and ``tools/gpu/gpu_edges.py`` on the CPU: the sweep's draws cover what it
promises within its caps and reproduce from the seed; its checks pass on the CPU backend and catch
broken passes; the edge script's default sizes cross 2**31 elements and its chunked references
agree with bsmm's CPU backend at a lowered boundary. Needs no GPU and no CuPy."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

import bsmm
from conftest import REPO_ROOT

REPO = REPO_ROOT
TOOLS = REPO / "tools" / "gpu"
SEEDS = (0, 1, 20240601, 2**32 - 1)


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up; gpu_edges imports gpu_sweep by name
    spec.loader.exec_module(module)
    return module


sweep = load_tool("gpu_sweep")


@pytest.fixture(scope="module", params=SEEDS)
def cases(request):
    return sweep.draw_cases(request.param, 240)


def test_a_draw_covers_every_parameter(cases):
    assert {case.block_size for case in cases} == {8, 16, 32, 64, 128}
    assert {case.kind for case in cases} == {"float32", "tf32", "float16", "bfloat16"}
    assert {case.feature_axis for case in cases} == {0, 1}
    assert {case.layout_kind for case in cases} == {"random", "skewed", "holes", "barabasi_albert"}
    count = lambda keep: sum(1 for case in cases if keep(case))  # noqa: E731
    assert count(lambda case: case.N == 1) >= 3
    assert count(lambda case: case.N <= 16) >= 40
    assert count(lambda case: 17 <= case.N <= 64) >= 20
    assert count(lambda case: case.N > 1024) >= 10
    assert count(lambda case: case.C != case.K) >= 120
    assert count(lambda case: max(case.C, case.K) >= 8192) >= 20
    assert count(lambda case: case.N > 1024 and max(case.C, case.K) >= 4096) >= 3  # large batches on wide layers
    assert count(lambda case: case.C & (case.C - 1)) >= 60  # widths that are no power of two
    assert len({case.N for case in cases} & {16, 17, 31, 33, 63, 65, 1023, 1024, 1025}) >= 5
    assert count(lambda case: case.density < 0.05) >= 20 and count(lambda case: case.density > 0.3) >= 20


def test_every_case_respects_the_caps(cases):
    for case in cases:
        bs = case.block_size
        assert 1 <= case.N <= 8192, case.describe()
        assert bs <= case.C <= 16384 and bs <= case.K <= 16384, case.describe()
        assert case.C % bs == 0 and case.K % bs == 0, case.describe()
        assert case.N * case.C <= 2**26 and case.N * case.K <= 2**26, case.describe()
        assert case.N * case.C * case.K <= 2**37, case.describe()  # 2**38 flop a float64 reference GEMM
        assert 0.01 <= case.density <= 0.6, case.describe()
        assert sweep.fits_caps(case.N, case.C, case.K)
        if case.layout_kind == "barabasi_albert":
            assert case.C == case.K >= 4 * bs, case.describe()


def test_the_caps_reject_what_they_should():
    assert sweep.fits_caps(8192, 8192, 2048) and sweep.fits_caps(512, 16384, 16384)
    assert not sweep.fits_caps(513, 16384, 16384)  # N*C*K
    assert not sweep.fits_caps(8192, 8192 + 32, 32)  # N*C
    assert not sweep.fits_caps(1, 32, 16384 + 32)
    assert not sweep.fits_caps(0, 32, 32) and not sweep.fits_caps(8193, 32, 32)


def test_a_seed_reproduces_its_cases_and_seeds_differ():
    first = sweep.draw_cases(1234, 240)
    assert first == sweep.draw_cases(1234, 240)
    assert first[:10] == sweep.draw_cases(1234, 10)  # case i does not depend on the count
    assert sweep.draw_case(1234, 117) == first[117]  # what --case 117 runs
    other = sweep.draw_cases(1235, 240)
    assert sum(a == b for a, b in zip(first, other)) == 0
    shapes = lambda draw: [(c.block_size, c.kind, c.N, c.C, c.K, c.layout_kind) for c in draw]  # noqa: E731
    assert shapes(first) != shapes(other)
    assert first[3].describe() != other[3].describe()
    assert len({case.data_seed for case in first + other}) == 480


def test_describe_names_every_parameter():
    case = sweep.draw_case(5, 3)
    text = case.describe()
    for part in (f"case {case.index}", case.kind, f"bs={case.block_size}", f"axis={case.feature_axis}",
                 f"N={case.N}", f"C={case.C}", f"K={case.K}", case.layout_kind):
        assert part in text


def small_cases(seed: int, count: int, volume: int = 2**22):
    return [case for case in sweep.draw_cases(seed, 240) if case.N * case.C * case.K <= volume][:count]


def test_layouts_are_what_their_kind_says():
    seen = set()
    for case in [case for case in sweep.draw_cases(11, 240) if case.C * case.K <= 2**22 * case.block_size**2]:
        layout = case.layout()
        cb, kb = case.C // case.block_size, case.K // case.block_size
        assert layout.shape == (cb, kb) and layout.dtype == np.uint8 and set(np.unique(layout)) <= {0, 1}
        assert np.array_equal(layout, case.layout()), "the layout must follow from the case alone"
        if case.layout_kind == "random":
            assert layout.any()
            assert abs(layout.sum() - case.density * cb * kb) <= 1
        elif case.layout_kind == "skewed":
            assert layout.all(axis=0).any() and layout.all(axis=1).any(), case.describe()
        elif case.layout_kind == "holes":
            assert cb < 2 or not layout.any(axis=1).all(), case.describe()
            assert kb < 2 or not layout.any(axis=0).all(), case.describe()
        else:
            assert np.array_equal(layout, layout.T) and layout.diagonal().all(), case.describe()
        seen.add(case.layout_kind)
    assert seen == set(sweep.LAYOUT_KINDS)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_array_helpers_round_and_poison(dtype):
    np_dtype = bsmm.SUPPORTED_DTYPES[dtype]
    data = np.random.default_rng(0).standard_normal(4096, dtype=np.float32) * np.float32(300)
    data[:4] = [0.0, -0.0, 1.00390625, 1.01171875]  # halfway cases of bfloat16: to even
    rounded = sweep.from_float32(data, dtype)
    assert rounded.dtype == np_dtype
    bits = sweep._BITS[np_dtype.itemsize]
    assert np.array_equal(rounded.view(bits), data.astype(np_dtype).view(bits))  # ml_dtypes rounds to even
    assert np.array_equal(sweep.as_float64(rounded), rounded.astype(np.float64))
    assert np.isnan(sweep.poisoned(np, (3, 5), dtype).astype(np.float64)).all()
    assert sweep.poisoned(np, (3, 5), dtype).dtype == np_dtype


def test_rel_error_flags_nan_shape_and_dtype():
    expected = np.ones((2, 3))
    assert sweep.rel_error(np, np.ones((2, 3), np.float32), expected, "float32") == (0.0, "")
    got = np.ones((2, 3), np.float32)
    got[1, 2] = np.nan
    assert sweep.rel_error(np, got, expected, "float32")[0] == np.inf
    assert "shape" in sweep.rel_error(np, np.ones((3, 2), np.float32), expected, "float32")[1]
    assert "dtype" in sweep.rel_error(np, np.ones((2, 3), np.float16), expected, "float32")[1]
    error, note = sweep.rel_error(np, np.full((2, 3), 1.01, np.float32), expected, "float32")
    assert note == "" and error == pytest.approx(0.01, rel=1e-5)


def test_the_checks_pass_on_the_cpu_backend():
    cases = small_cases(3, 24)
    result = sweep.run_sweep(cases, np, budget=120, out=lambda *args, **kwargs: None)
    assert len(result["results"]) == len(cases) and not result["stopped"]
    failed = [(case["index"], check) for case in result["results"] for check in case["checks"] if not check["ok"]]
    assert result["failures"] == 0, failed
    checks = [check for case in result["results"] for check in case["checks"]]
    assert len(checks) == 12 * len(cases)
    assert {(check["pass"], check["way"]) for check in checks} == {
        (p, w) for p in sweep.PASSES for w in sweep.WAYS}
    lines = sweep.summary_lines(result, len(cases))
    assert lines[0].startswith(f"ran {len(cases)} of {len(cases)} cases, {12 * len(cases)} checks, 0 failures")


def _broken(pass_name: str, how: str):
    """A BlocksparseMatMul whose ``pass_name`` misbehaves ``how``."""
    real = getattr(bsmm.BlocksparseMatMul, pass_name)
    calls = [0]

    def method(self, a, b, out=None, accumulate=False):
        if how == "ignores accumulate":
            return real(self, a, b, out=out, accumulate=False)
        if how == "leaves out's last row":
            if out is None or accumulate:
                return real(self, a, b, out=out, accumulate=accumulate)
            last = out[-1].copy()
            real(self, a, b, out=out)
            out[-1] = last
            return out
        if how == "differs on a repeat":
            result = real(self, a, b, out=out, accumulate=accumulate)
            calls[0] += 1
            if calls[0] % 4 == 2 and result.size:  # the second call of a case
                flat = result.reshape(-1)
                flat[0] = -flat[0] if flat[0] else 1
            return result
        if how == "reads the wrong blocks" and pass_name != "updat":
            return real(self, a, b[::-1].copy(), out=out, accumulate=accumulate)
        raise AssertionError(how)

    return type("Broken", (bsmm.BlocksparseMatMul,), {pass_name: method})


@pytest.mark.parametrize("pass_name, how, way", [
    ("fprop", "ignores accumulate", "accumulate"),
    ("bprop", "leaves out's last row", "out"),
    ("updat", "differs on a repeat", "repeat"),
    ("fprop", "reads the wrong blocks", "alloc"),
])
def test_the_checks_catch_a_broken_pass(monkeypatch, pass_name, how, way):
    monkeypatch.setattr(bsmm, "BlocksparseMatMul", _broken(pass_name, how))
    lines = []
    cases = [case for case in small_cases(3, 24) if case.layout().sum() >= 2 and case.N >= 2][:6]
    result = sweep.run_sweep(cases, np, budget=120, out=lambda line, **kwargs: lines.append(line))
    failed = {(check["pass"], check["way"]) for case in result["results"] for check in case["checks"]
              if not check["ok"]}
    assert (pass_name, way) in failed and {p for p, _ in failed} == {pass_name}
    assert result["failures"] == len(lines) >= 3
    assert all(line.startswith("FAIL case ") and f" {pass_name} " in line for line in lines)


def run_script(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_dry_run_prints_the_seed_first_and_imports_no_cupy():
    probe = ("import runpy, sys; sys.argv = ['gpu_sweep.py', '--dry-run', '--seed', '77', '--cases', '5']\n"
             "try:\n    runpy.run_path('tools/gpu/gpu_sweep.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print('cupy imported' if 'cupy' in sys.modules else 'no cupy')")
    done = run_script("-c", probe)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr
    assert lines[0] == "seed 77"
    assert lines[1:6] == [case.describe() for case in sweep.draw_cases(77, 5)]
    assert lines[-1] == "no cupy"
    fresh = [run_script("tools/gpu/gpu_sweep.py", "--dry-run", "--cases", "1").stdout.splitlines()[0] for _ in range(2)]
    assert all(line.startswith("seed ") for line in fresh) and fresh[0] != fresh[1]


@pytest.mark.parametrize("script", ["gpu_sweep", "gpu_edges"])
def test_help_works_without_a_gpu(script):
    done = run_script(f"tools/gpu/{script}.py", "--help")
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr


def test_the_edge_defaults_cross_2_31_elements_within_memory():
    edges = load_tool("gpu_edges")
    for quick in (False, True):
        checks = edges.plan_checks(edges.parse_args(["--quick"] if quick else []))
        assert checks and all(check.N * check.C > 2**31 for check in checks)
        assert {check.pass_name for check in checks} == {"fprop", "bprop", "updat"}
        assert max(edges.peak_bytes(check) for check in checks) <= 40 * 2**30
    checks = edges.plan_checks(edges.parse_args([]))
    assert {check.dtype for check in checks} >= {"float16", "bfloat16"}
    assert {check.block_size for check in checks} >= {32, 64}
    assert {(check.pass_name, check.feature_axis) for check in checks} >= {(p, 1) for p in sweep.PASSES} | {
        ("updat", 0)}


def test_the_edge_checks_pass_on_the_cpu_backend_at_a_lowered_boundary():
    edges = load_tool("gpu_edges")
    args = edges.parse_args(["--rows", "200", "--features", "256", "--outputs", "64", "--chunk-rows", "48",
                             "--boundary", str(2**15)])
    rows = edges.run_checks(edges.plan_checks(args), np, args, out=lambda *a, **k: None)
    assert rows and all(row["ok"] for row in rows), rows
    assert {row["pass"] for row in rows} == {"fprop", "bprop", "updat"}
    assert any(row["tail error"] is not None for row in rows)

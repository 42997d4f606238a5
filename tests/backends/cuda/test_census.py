"""The path census (``tests/path_census.py``): on the CPU, that it reaches every decision of the
selection code and every launch-table entry; on a GPU, that each of its shapes takes the path
the census says, with all three passes (plain, ``out=``, ``accumulate=True``) matching float64.
"""

from __future__ import annotations

import ast
import inspect
import os
import sys
import zlib

import numpy as np
import pytest

import bsmm
from bsmm.backends.cuda import planner, selection, step_tables
from bsmm.backends.cuda.policy import planning, recording_table_lookups
from bsmm.config import settings
from reference import TOLERANCE
from conftest import REPO_ROOT

import path_census

#: Statements of the selection code the census need not reach, as (function, start of the line): the reason.
UNREACHED = {
    ("tma_tile", "return None  # a pass this short is bound by the host"): "tma_min_macs is 0 in bsmm.toml",
    ("select", 'raise ValueError(f"the launch tables give'):
        "every tile of bsmm.toml builds (tools/ci/compile_kernels.py checks each with tiling_problem)",
    **{("launch_layout", line): "shifted passes (convolutions)" for line in (
        "column = 0 if (the_pass.updates_weights or groups) else 1", "table = np.array(table, dtype=np.int64)",
        "table[:, column] = np.asarray(act_blocks, dtype=np.int64)[table[:, column]]", "if the_pass.updates_weights:",
        'raise NotImplementedError("weight_blocks reorders', "weights = table[:, 1:] if groups else table[:, :1]",
        "weights[weights >= 0] = weight_blocks.positions[weights[weights >= 0]]")},
}


@pytest.fixture(scope="module")
def entries():
    return path_census.census()


#: Functions of the selection code that are no part of choosing a path.
NOT_SELECTION = {"describe", "device_model"}


def _statement_lines(module) -> dict[int, str]:
    """The first line of every statement inside the module's functions (those of NOT_SELECTION
    aside), with the name of the function holding it."""
    lines: dict[int, str] = {}

    def walk(statements, function):
        for node in statements:
            if isinstance(node, ast.ClassDef):
                walk(node.body, function)
            elif isinstance(node, ast.FunctionDef):
                if node.name not in NOT_SELECTION:
                    walk(node.body, node.name)
            elif function is not None:
                if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):  # docstrings
                    lines[node.lineno] = function
                for field in ("body", "orelse", "finalbody", "handlers"):
                    walk(getattr(node, field, []) or [], function)

    walk(ast.parse(inspect.getsource(module)).body, None)
    return lines


def test_census_reaches_every_line_of_the_selection_code():
    """A branch added to the planner (or to the step tables it builds) that no census shape takes
    fails here: add a shape to the census."""
    modules = {module.__file__: module for module in (selection, planner, step_tables)}
    reached: dict[str, set[int]] = {source: set() for source in modules}

    def trace(frame, event, arg):
        lines = reached.get(frame.f_code.co_filename)
        if lines is None:
            return None
        lines.add(frame.f_lineno)

        def local(frame, event, arg):
            lines.add(frame.f_lineno)
            return local

        return local

    sys.settrace(trace)
    try:
        found = path_census.census()
    finally:
        sys.settrace(None)
    assert found
    missed = {}
    for source, module in modules.items():
        text = open(source).read().splitlines()
        statements = _statement_lines(module)
        missed.update({(module.__name__, i): (statements[i], text[i - 1].strip())
                       for i in sorted(set(statements) - reached[source])})

    def explained(function, line, key):
        return function == key[0] and line.startswith(key[1])

    unexplained = {where: f"{f}: {line}" for where, (f, line) in missed.items() if not any(
        explained(f, line, key) for key in UNREACHED)}
    assert not unexplained, "planner lines no census shape reaches:\n" + "\n".join(
        f"  {module}:{i}: {line}" for (module, i), line in unexplained.items())
    stale = [key for key in UNREACHED if not any(explained(f, line, key) for f, line in missed.values())]
    assert not stale, f"UNREACHED lists lines the census now reaches or that no longer exist: {stale}"


def _table_entries(tables: dict, prefix=()):
    """Every launch-table entry of ``[kernels]`` as (section, math, group, block size, batch class)."""
    for key, value in tables.items():
        if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()) and \
                len(prefix) == 3:
            for batch in value:
                yield (*prefix, key, batch)
        elif isinstance(value, dict):
            yield from _table_entries(value, (*prefix, key))


def test_census_reads_every_launch_table_entry():
    """Each tile bsmm.toml lists serves some census shape, so each is run on a GPU."""
    sections = {name: value for name, value in settings()["kernels"].items()
                if isinstance(value, dict) and name in ("default", "sm90")}
    listed = set(_table_entries(sections))
    assert len(listed) > 50
    with recording_table_lookups() as lookups:
        path_census.census()
    read = {entry for entry, _ in lookups}
    unread = sorted(listed - read)
    assert not unread, f"launch-table entries no census shape reads: {unread}"


def test_census_covers_every_dtype_block_pass_and_axis(entries):
    covered = {(e.shape.kind, e.shape.block_size, e.path.pass_name, e.shape.feature_axis) for e in entries}
    for key in ((k, b, p, a) for k in path_census.KINDS for b in path_census.BLOCK_SIZES
                for p in path_census.PASSES for a in (0, 1)):
        assert key in covered, f"no census path for {key}"
    # The decisions of the kernels behind one pass each appear (the planner's vocabulary).
    seen = {(e.path.variant.math, e.path.copies, e.path.streaming, e.path.parts, e.path.banded,
             e.path.variant.tma, e.path.variant.cols > 1) for e in entries}
    for math in ("simt", "tensor16", "tf32", "wgmma16", "wgmma_tf32"):
        assert any(s[0] == math for s in seen), math
    for copies in ("", "x+dy", "x", "dy", "w"):
        assert any(s[1] == copies for s in seen), copies
    for streaming in ("one", "several"):
        assert any(s[0] == "tensor16" and s[2] == streaming for s in seen), streaming
    assert any(s[3] for s in seen) and any(s[4] for s in seen) and any(s[5] for s in seen) and any(s[6] for s in seen)


def test_ci_compiles_the_kernel_of_every_census_path(entries):
    """tools/ci/compile_kernels.py (run by make test without a GPU) builds each census path's kernel."""
    sys.path.insert(0, str(REPO_ROOT / "tools" / "ci"))
    from compile_kernels import all_variants

    missing = {e.path.variant for e in entries} - set(all_variants())
    assert not missing, f"census kernels CI does not compile: {sorted(map(repr, missing))[:5]}"


def test_census_holds_the_shapes_of_the_half_precision_updat_that_returned_nan(entries):
    """16-deep steps with several streamed blocks per thread block (the path of NaN dW at N <= 16)."""
    for kind in ("float16", "bfloat16"):
        for bs in (16, 32):
            assert any(e.path.pass_name == "updat" and e.shape.kind == kind and e.shape.block_size == bs
                       and e.path.streaming == "several" and e.path.variant.tile.bk == 16 for e in entries), (kind, bs)


# -- on a GPU ---------------------------------------------------------------------------------------------
def _device_case(cupy, shape: path_census.Shape, seed: int):
    """(op, x, dy, w) on the GPU for a census shape, with fresh random data."""
    index = shape.index()
    op = bsmm.BlocksparseMatMul.from_index(index, feature_axis=shape.feature_axis, tf32=shape.tf32)
    rng = np.random.default_rng(seed)
    dtype = bsmm.SUPPORTED_DTYPES[shape.dtype]
    act = (lambda f: (shape.n, f)) if shape.feature_axis == 1 else (lambda f: (f, shape.n))
    arrays = [rng.standard_normal(s).astype(dtype) for s in (act(index.C), act(index.K), index.w_shape)]
    x, dy, w = (cupy.asarray(a) for a in arrays)
    if not shape.aligned:  # the same values at an address 2 elements past a 16-byte boundary
        x, dy, w = (_misaligned(cupy, a) for a in (x, dy, w))
    return op, x, dy, w


def _misaligned(cupy, array):
    base = cupy.empty(array.size + 8, dtype=array.dtype)
    view = base[2:2 + array.size].reshape(array.shape)
    view[...] = array
    return view


def _references(cupy, op, x, dy, w):
    """float64 fprop, bprop and updat on the GPU (cupy.matmul in float64)."""
    W = op.to_dense(w).astype(np.float64)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    if op.feature_axis == 0:
        x64, dy64 = x64.T, dy64.T
    y, dx, dW = x64 @ W, dy64 @ W.T, x64.T @ dy64
    t = (lambda a: a) if op.feature_axis == 1 else (lambda a: a.T)
    return {"fprop": t(y), "bprop": t(dx), "updat": op.from_dense(dW)}


def _error(cupy, got, expected) -> float:
    got = got.astype(np.float64)
    if got.size == 0:
        return 0.0 if got.shape == expected.shape else float("inf")
    if not bool(cupy.isfinite(got).all()):
        return float("inf")
    norm = float(cupy.linalg.norm(expected))
    return float(cupy.linalg.norm(got - expected)) / max(norm, 1e-300) if norm else float(cupy.abs(got).max())


def run_all_ways(cupy, op, x, dy, w, seed: int = 0, gate=None) -> dict:
    """Each pass plain, into a NaN-poisoned ``out=``, and accumulated onto random data: the worst
    relative error of each pass against float64 (with ``gate``: the gated passes, against the
    products of the gated weights, dW scaled by the gates)."""
    if gate is None:
        refs = _references(cupy, op, x, dy, w)
    else:
        refs = _references(cupy, op, x, dy, op.gated_weights(w, gate))
        refs["updat"] = refs["updat"] * gate.astype(np.float64)[:, None, None]
    calls = {"fprop": lambda **k: op.fprop(x, w, gate=gate, **k), "bprop": lambda **k: op.bprop(dy, w, gate=gate, **k),
             "updat": lambda **k: op.updat(x, dy, gate=gate, **k)}
    rng = cupy.random.default_rng(seed)
    worst = {}
    for pass_name, call in calls.items():
        ref = refs[pass_name]
        errors = [_error(cupy, call(), ref)]
        out = cupy.full(ref.shape, np.nan, dtype=x.dtype)
        errors.append(_error(cupy, call(out=out), ref))
        start = rng.standard_normal(ref.shape, dtype=np.float32).astype(x.dtype)
        out = start.copy()
        call(out=out, accumulate=True)
        errors.append(_error(cupy, out, ref + start.astype(np.float64)))
        worst[pass_name] = max(errors)
    return worst


def pytest_generate_tests(metafunc):
    if "census_entry" in metafunc.fixturenames:
        # BSMM_CENSUS_STRIDE=k keeps every k-th entry (compute-sanitizer runs take a sample).
        found = path_census.census()[::int(os.environ.get("BSMM_CENSUS_STRIDE", "1"))]
        metafunc.parametrize("census_entry", found, ids=[
            f"{i}-{e.path.pass_name}-{e.shape.kind}-bs{e.shape.block_size}" for i, e in enumerate(found)])


@pytest.mark.gpu
def test_census_path_on_the_gpu(cupy, census_entry, monkeypatch):
    """The shape takes the census's path on this GPU, and every pass is right all three ways."""
    entry = census_entry
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the census models an sm_90 device")
    from bsmm.backends.cuda import backend as cuda_backend
    from bsmm.backends.cuda import plan_cache
    from bsmm.backends.cuda import plans as cuda_plans

    # The planner assumes the census's occupancy (planner.estimated_occupancy), so that the path the
    # census recorded is the one this GPU runs (updat's cut of the batch follows occupancy).
    monkeypatch.setattr(cuda_plans, "occupancy", lambda kernel, variant: planner.estimated_occupancy(variant))
    plan_cache.forget_plans()
    op, x, dy, w = _device_case(cupy, entry.shape, seed=zlib.crc32(entry.shape.describe().encode()))
    with cuda_backend.recording_paths() as taken, planning(path_census.policy(entry.shape.mode)):
        worst = run_all_ways(cupy, op, x, dy, w)
    kind = entry.shape.kind
    bad = {p: e for p, e in worst.items() if not e <= TOLERANCE[kind]}
    assert not bad, f"{entry.shape.describe()}: relative errors {bad} over {TOLERANCE[kind]}"
    mine = [p for p in taken if p.pass_name == entry.path.pass_name]
    assert mine and all(p == entry.path for p in mine), (
        f"{entry.shape.describe()}: took {[p.describe() for p in mine]}, census says {entry.path.describe()}")


def _gates(cupy, nnzb: int, dtype, seed: int):
    """Gates of ``dtype``: about half of them 0, the others in [0.25, 1.5)."""
    rng = np.random.default_rng(seed)
    values = np.where(rng.random(nnzb) < 0.5, 0.0, rng.uniform(0.25, 1.5, nnzb))
    return cupy.asarray(values.astype(dtype))


@pytest.mark.gpu
def test_census_path_with_gates_on_the_gpu(cupy, census_entry, monkeypatch):
    """The census shape with half its blocks gated off takes the census's path, its gated passes are
    right all three ways, and the kernels skip the closed blocks: NaN weights there change no product
    (except where the path passes no gates on: TF32 fprop through transposed weights), and updat
    leaves 0 there (except streamed updat, which computes them; bsmm_gates.cuh)."""
    entry = census_entry
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the census models an sm_90 device")
    from bsmm.backends.cuda import backend as cuda_backend
    from bsmm.backends.cuda import plan_cache
    from bsmm.backends.cuda import plans as cuda_plans

    monkeypatch.setattr(cuda_plans, "occupancy", lambda kernel, variant: planner.estimated_occupancy(variant))
    plan_cache.forget_plans()
    seed = zlib.crc32(entry.shape.describe().encode())
    op, x, dy, w = _device_case(cupy, entry.shape, seed=seed)
    gate = _gates(cupy, op.blocks, w.dtype, seed + 1)
    closed = gate == 0
    poisoned = op.gated_weights(w, gate)
    poisoned[closed] = np.nan
    kind, pass_name = entry.shape.kind, entry.path.pass_name
    with cuda_backend.recording_paths() as taken, planning(path_census.policy(entry.shape.mode)):
        worst = run_all_ways(cupy, op, x, dy, w, gate=gate)
        if pass_name == "updat":
            skipped = op.updat(x, dy, out=cupy.full(op.w_shape, np.nan, dtype=x.dtype), _skip=gate)
        else:
            operand = x if pass_name == "fprop" else dy
            skipped = getattr(op, pass_name)(operand, poisoned, _skip=gate)
    bad = {p: e for p, e in worst.items() if not e <= TOLERANCE[kind]}
    assert not bad, f"{entry.shape.describe()} gated: relative errors {bad} over {TOLERANCE[kind]}"
    mine = [p for p in taken if p.pass_name == pass_name]
    assert mine and all(p == entry.path for p in mine), (
        f"{entry.shape.describe()} gated: took {[p.describe() for p in mine]}, census says {entry.path.describe()}")
    if pass_name == "updat":
        if not entry.path.streaming:
            assert not bool(skipped[closed].any()), f"{entry.shape.describe()}: closed blocks' dW not left at 0"
            assert bool(cupy.isfinite(skipped).all()), f"{entry.shape.describe()}: dW of open blocks not written"
    elif entry.path.copies != "w":
        ref = _references(cupy, op, x, dy, op.gated_weights(w, gate))[pass_name]
        error = _error(cupy, skipped, ref)
        assert error <= TOLERANCE[kind], f"{entry.shape.describe()}: NaN in closed blocks reached {pass_name} ({error})"


#: The shapes of the half-precision updat that returned NaN or garbage (kind, block, C, K, N, axis,
#: density): 16-deep steps streaming several blocks per thread block read a stale A stage.
NAN_SHAPES = [
    *[("float16", 32, 8192, 8192, n, 1, 0.1) for n in (1, 2, 8, 16)],
    ("float16", 32, 12288, 12288, 8, 1, 0.1),
    ("float16", 32, 4096, 4096, 8, 1, 0.1),
    *[("bfloat16", 32, 8192, 8192, n, 1, 0.1) for n in (1, 8, 16)],
    *[("bfloat16", 32, 8192, 8192, n, 0, 0.1) for n in (8, 16)],
    ("float16", 16, 1184, 3552, 1, 1, 0.1),
    ("bfloat16", 16, 4320, 6784, 16, 1, 0.25),
    ("bfloat16", 16, 2048, 4096, 8, 0, 0.1),
    ("float16", 16, 3072, 6784, 12, 1, 0.05),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kind, bs, C, K, n, axis, density", NAN_SHAPES)
def test_half_precision_updat_at_small_batches_on_wide_layers(cupy, kind, bs, C, K, n, axis, density):
    layout = (np.random.default_rng([C, K, n]).random((C // bs, K // bs)) < density).astype(np.uint8)
    index = bsmm.block_index(layout, bs)
    op = bsmm.BlocksparseMatMul.from_index(index, feature_axis=axis)
    rng = np.random.default_rng(n)
    dtype = bsmm.SUPPORTED_DTYPES[kind]
    act = (lambda f: (n, f)) if axis == 1 else (lambda f: (f, n))
    x, dy, w = (cupy.asarray(rng.standard_normal(s).astype(dtype)) for s in (act(C), act(K), index.w_shape))
    worst = run_all_ways(cupy, op, x, dy, w)
    assert all(e <= TOLERANCE[kind] for e in worst.values()), f"{kind} bs{bs} {C}x{K} N={n}: {worst}"


@pytest.mark.parametrize("kind, bs, C, K, n, axis, density", NAN_SHAPES)
def test_the_nan_shapes_take_the_path_that_returned_nan(kind, bs, C, K, n, axis, density):
    """On an H100 each of NAN_SHAPES streams several blocks a thread block in 16-deep steps."""
    layout = (np.random.default_rng([C, K, n]).random((C // bs, K // bs)) < density).astype(np.uint8)
    found = planner.path(bsmm.block_index(layout, bs), "updat", n, kind, axis, False, True, planner.device_model())
    assert found.streaming == "several" and found.variant.tile.bk == 16, found.describe()

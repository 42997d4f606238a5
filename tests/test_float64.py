"""float64, a CPU-only dtype: every pass computed in float64, and refused on the GPU.

References come from ``reference.py`` (float64 dense products built without bsmm).
The tolerance is 1e-12 norm-wise relative: float64 arithmetic over a few hundred
terms, where any float32 step on the way would show as ~1e-7.
"""

from __future__ import annotations

import numpy as np
import pytest

import bsmm
from conftest import poisoned, snapshot, to_xp
from reference import Producer, random_layout, ref_bprop, ref_fprop, ref_updat, rel_error

F64 = np.float64
TOLERANCE = 1e-12


def make_layout(kind: str, rng, cb: int, kb: int) -> np.ndarray:
    if kind == "empty":
        return np.zeros((cb, kb), np.uint8)
    return random_layout(rng, cb, kb, 0.5)


def activation(n: int, features: int, axis: int) -> tuple:
    return (n, features) if axis == 1 else (features, n)


def assert_exact(actual, expected, what: str) -> None:
    assert actual.dtype == F64, f"{what}: dtype {actual.dtype}"
    error = rel_error(actual, expected)
    assert error <= TOLERANCE, f"{what}: relative error {error:.3g} > {TOLERANCE:g}"


@pytest.mark.parametrize("block_size,shape", [(8, (7, 5)), (32, (3, 4)), (128, (2, 1))])
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("kind", ["random", "empty"])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_passes_in_float64_match_reference(block_size, shape, axis, kind, n):
    """fprop, bprop and updat of float64 NumPy arrays, with out=None and with a NaN-filled out."""
    rng = np.random.default_rng([block_size, axis, n])
    layout = make_layout(kind, rng, *shape)
    op = bsmm.BlocksparseMatMul(layout, block_size=block_size, feature_axis=axis)
    x = rng.standard_normal(activation(n, op.C, axis))
    dy = rng.standard_normal(activation(n, op.K, axis))
    w = rng.standard_normal(op.w_shape)
    expected = {
        "fprop": ref_fprop(layout, w, block_size, x, axis),
        "bprop": ref_bprop(layout, w, block_size, dy, axis),
        "updat": ref_updat(layout, block_size, x, dy, axis),
    }
    calls = {
        "fprop": lambda **out: op.fprop(x, w, **out),
        "bprop": lambda **out: op.bprop(dy, w, **out),
        "updat": lambda **out: op.updat(x, dy, **out),
    }
    for name, call in calls.items():
        assert_exact(call(), expected[name], name)
        out = poisoned(np, expected[name].shape, F64)
        assert call(out=out) is out
        assert_exact(out, expected[name], f"{name} into out")


def test_float64_is_not_rounded_through_float32():
    """Values float32 cannot hold survive: 1 + 2**-40 times 1 is not 1."""
    op = bsmm.BlocksparseMatMul(np.ones((1, 1)), block_size=8)
    w = np.zeros(op.w_shape)
    w[0] = np.eye(8) * (1 + 2.0**-40)
    x = np.ones((3, 8))
    assert (op(x, w) == 1 + 2.0**-40).all()
    assert (op.bprop(x, w) == 1 + 2.0**-40).all()
    assert (op.updat(x * (1 + 2.0**-40), x) == 3 * (1 + 2.0**-40)).all()


def test_updat_accumulates_in_float64():
    rng = np.random.default_rng(2)
    layout = random_layout(rng, 4, 3, 0.6)
    op = bsmm.BlocksparseMatMul(layout, block_size=8)
    x, dy = rng.standard_normal((5, op.C)), rng.standard_normal((5, op.K))
    start = rng.standard_normal(op.w_shape)
    buffer = start.copy()
    op.updat(x, dy, out=buffer, accumulate=True)
    assert_exact(buffer, start + ref_updat(layout, 8, x, dy, 1), "accumulated updat")


def test_empty_batch_in_float64():
    op = bsmm.BlocksparseMatMul(np.ones((2, 2)), block_size=8)
    x, w = np.zeros((0, op.C)), np.ones(op.w_shape)
    assert op(x, w).shape == (0, op.K) and op(x, w).dtype == F64
    assert not op.updat(x, np.zeros((0, op.K))).any()


def test_dlpack_producer_and_conversions_in_float64():
    """A foreign CPU DLPack producer of float64 runs too; to_dense and from_dense keep float64."""
    rng = np.random.default_rng(3)
    layout = random_layout(rng, 3, 4, 0.5)
    op = bsmm.BlocksparseMatMul(layout, block_size=8)
    x, w = rng.standard_normal((5, op.C)), rng.standard_normal(op.w_shape)
    assert_exact(op(Producer(x), Producer(w)), ref_fprop(layout, w, 8, x, 1), "fprop of a producer")
    dense = op.to_dense(w)
    assert dense.dtype == F64 and np.array_equal(op.from_dense(dense), w)


@pytest.mark.parametrize("pass_name", ["fprop", "bprop"])
def test_float64_does_not_mix_with_other_dtypes(pass_name):
    op = bsmm.BlocksparseMatMul(np.ones((2, 2)), block_size=8)
    run = getattr(op, pass_name)
    a = np.ones((3, 16))
    with pytest.raises(TypeError, match="w has dtype float32 but the activations have float64"):
        run(a, np.ones(op.w_shape, np.float32))
    with pytest.raises(TypeError, match="out has dtype float32 but the inputs have float64"):
        run(a, np.ones(op.w_shape), out=np.empty((3, 16), np.float32))
    with pytest.raises(TypeError, match="dy has dtype float32 but x has float64"):
        op.updat(a, np.ones((3, 16), np.float32))


def test_stored_block_data_keeps_float64_on_the_cpu():
    """BlockSparseMatrix takes NumPy float64 block data (the CPU backend), as BlocksparseMatMul does."""
    assert bsmm.BlockSparseMatrix(np.ones((1, 1)), np.ones((1, 8, 8))).dtype == np.float64
    assert "float64" not in bsmm.SUPPORTED_DTYPES


@pytest.mark.gpu
@pytest.mark.parametrize("axis", [1, 0])
def test_float64_is_refused_on_the_gpu(axis):
    """CuPy float64 arrays: a TypeError naming the argument, saying float64 runs on the CPU only."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed: GPU tests skipped")
    if not cupy.cuda.is_available():
        pytest.skip("CuPy sees no CUDA device: GPU tests skipped")
    op = bsmm.BlocksparseMatMul(np.ones((2, 3)), block_size=8, feature_axis=axis)
    x = to_xp(cupy, np.ones(activation(3, op.C, axis)))
    dy = to_xp(cupy, np.ones(activation(3, op.K, axis)))
    w = to_xp(cupy, np.ones(op.w_shape))
    out = poisoned(cupy, activation(3, op.K, axis), F64)
    before = snapshot(x, dy, w, out)
    message = "{} has dtype float64, which runs only on the CPU backend .*; on the GPU supported dtypes are " \
              "float32, float16, bfloat16"
    with pytest.raises(TypeError, match=message.format("x")):
        op(x, w, out=out)
    with pytest.raises(TypeError, match=message.format("dy")):
        op.bprop(dy, w)
    with pytest.raises(TypeError, match=message.format("x")):
        op.updat(x, dy)
    with pytest.raises(TypeError, match=message.format("w")):
        op.to_dense(w)
    assert snapshot(x, dy, w, out) == before

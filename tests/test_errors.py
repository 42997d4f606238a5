"""Every validation branch raises the documented error type with a useful message,
and a refused call leaves its inputs and ``out`` untouched.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
import scipy.sparse

import bsmm
from conftest import poisoned, snapshot, to_numpy, to_xp
from reference import Producer, random_data

BS = 8
LAYOUT = np.array([[1, 0, 1], [0, 1, 1]], dtype=np.uint8)  # C = 16, K = 24, 4 blocks
N = 5


class ElsewhereProducer(Producer):
    """Claims its memory is on a DLPack device bsmm does not run on (4 = OpenCL)."""

    def __dlpack_device__(self):
        return (4, 0)


def activation(features, axis, n=N):
    return (n, features) if axis == 1 else (features, n)


@pytest.fixture(params=[1, 0], ids=["axis1", "axis0"])
def case(request, xp):
    """An operator plus valid xp inputs for every pass, and a NaN-filled out for each."""
    axis = request.param
    rng = np.random.default_rng(axis)
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS, feature_axis=axis)
    data = {
        "x": random_data(rng, activation(op.C, axis), "float32"),
        "dy": random_data(rng, activation(op.K, axis), "float32"),
        "w": random_data(rng, op.w_shape, "float32"),
    }
    arrays = {name: to_xp(xp, value) for name, value in data.items()}
    outs = {
        "fprop": poisoned(xp, activation(op.K, axis), np.float32),
        "bprop": poisoned(xp, activation(op.C, axis), np.float32),
        "updat": poisoned(xp, op.w_shape, np.float32),
    }
    return op, axis, arrays, outs


def run(op, pass_name, arrays, **kwargs):
    if pass_name == "fprop":
        return op(arrays["x"], arrays["w"], **kwargs)
    if pass_name == "bprop":
        return op.bprop(arrays["dy"], arrays["w"], **kwargs)
    return op.updat(arrays["x"], arrays["dy"], **kwargs)


def assert_refused(call, error, match, *arrays):
    """``call()`` raises ``error`` matching ``match`` and changes none of ``arrays``."""
    before = snapshot(*arrays)
    with pytest.raises(error, match=match):
        call()
    assert snapshot(*arrays) == before, "a refused call modified its arguments"


def strided(xp, shape, dtype=np.float32):
    """A non-contiguous view of the given shape (every other element of the last axis)."""
    wide = xp.ones(tuple(shape[:-1]) + (2 * shape[-1],), dtype=dtype)
    view = wide[..., ::2]
    assert not view.flags.c_contiguous
    return view


# -- layouts, block sizes, feature axes ------------------------------------------------------------
@pytest.mark.parametrize("layout", [np.ones(4), np.ones((2, 2, 2)), np.array(1)], ids=["1d", "3d", "0d"])
def test_layout_must_be_2d(layout):
    assert_refused(lambda: bsmm.BlocksparseMatMul(layout, block_size=BS), ValueError, "layout must be 2-D", layout)


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0, 0)])
def test_layout_must_not_be_empty(shape):
    layout = np.ones(shape)
    assert_refused(lambda: bsmm.BlocksparseMatMul(layout, block_size=BS), ValueError, "at least one block row", layout)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_layout_must_be_finite(bad):
    layout = np.array([[1.0, 0.0], [0.0, bad]])
    assert_refused(lambda: bsmm.BlocksparseMatMul(layout, block_size=BS), ValueError,
                   rf"layout must hold finite numbers \(non-zero: present, 0: absent\); found {bad}", layout)


@pytest.mark.parametrize("layout", [np.array([[2, 0, -1], [0, 7, 1]]),
                                    np.array([[0.5, -0.0, -3.0], [0.0, 1e-30, 1.0]]),
                                    np.array([[True, False, True], [False, True, True]])],
                         ids=["int", "float", "bool"])
def test_any_finite_non_zero_layout_value_is_present(layout):
    """README: layout[c, k] != 0 means present, for bool, int and float layouts alike (-0.0 is zero)."""
    before = layout.copy()
    op = bsmm.BlocksparseMatMul(layout, block_size=BS)
    assert op.layout.dtype == np.uint8 and op.layout.tolist() == [[1, 0, 1], [0, 1, 1]]
    assert op.blocks == 4 and np.array_equal(layout, before)


@pytest.mark.parametrize("layout", [np.array([["1", "0"]]), np.array([[1, 0]], dtype=object),
                                    np.array([[1 + 0j, 0j]])], ids=["str", "object", "complex"])
def test_layout_must_be_numeric(layout):
    assert_refused(lambda: bsmm.BlocksparseMatMul(layout, block_size=BS), ValueError,
                   r"layout must hold numbers \(bool, int or float\); got dtype", layout)


@pytest.mark.parametrize("layout", [[[1, 0], [1]], [[1, 0], 1], ([1, 0, 1], [0, 1])],
                         ids=["short-row", "scalar-row", "tuple"])
def test_ragged_layout(layout):
    """NumPy's own "inhomogeneous shape" error becomes one that names layout."""
    kind = type(layout).__name__
    with pytest.raises(ValueError, match=rf"layout must be a 2-D array .* whose rows all have the same length; "
                                         rf"got a ragged {kind} \(setting an array element"):
        bsmm.BlocksparseMatMul(layout, block_size=BS)


def test_layout_with_more_blocks_than_int32_indices_can_address():
    """2**32 present blocks (the issue's np.ones((2**16, 2**16)), as a broadcast view, not 4 GiB): the
    block count is checked first, so nothing of the layout's size is allocated (no MemoryError)."""
    import tracemalloc

    layout = np.broadcast_to(np.uint8(1), (2**16, 2**16))
    tracemalloc.start()  # NumPy reports its data buffers to tracemalloc
    try:
        with pytest.raises(ValueError, match=r"layout may have at most 2147483647 present blocks \(the block "
                                             r"index is int32\); got shape \(65536, 65536\) with at least"):
            bsmm.BlocksparseMatMul(layout, block_size=128)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**28, f"the refusal allocated {peak} bytes"


def test_layout_describing_too_many_elements():
    layout = np.broadcast_to(np.uint8(0), (2**24, 2**24))  # 2**48 blocks of 128 x 128: C * K = 2**62
    with pytest.raises(ValueError, match=r"layout of shape \(16777216, 16777216\) with block_size 128 describes "
                                         r"a W of 4611686018427387904 elements; at most 4611686018427387903"):
        bsmm.BlocksparseMatMul(layout, block_size=128)


def test_layout_with_more_block_columns_than_int32_can_hold():
    layout = np.broadcast_to(np.uint8(0), (1, 2**31))
    with pytest.raises(ValueError, match=r"layout may have at most 2147483647 block rows and columns; "
                                         r"got shape \(1, 2147483648\)"):
        bsmm.BlocksparseMatMul(layout, block_size=8)


def test_broadcast_layout_is_read_in_place():
    """A broadcast view is a valid layout; the index keeps its own 0/1 copy."""
    layout = np.broadcast_to(np.array([1, 0, 2]), (2, 3))
    op = bsmm.BlocksparseMatMul(layout, block_size=BS)
    assert op.layout.tolist() == [[1, 0, 1], [1, 0, 1]] and not np.shares_memory(op.layout, layout)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("make", [np.asmatrix, np.ma.masked_array], ids=["matrix", "masked"])
def test_layout_subclasses_are_refused(make):
    layout = make(LAYOUT.copy())
    message = "layout is a numpy.matrix" if make is np.asmatrix else "layout is a numpy masked array"
    assert_refused(lambda: bsmm.BlocksparseMatMul(layout, block_size=BS), TypeError, message, layout)


@pytest.mark.parametrize("block_size", [12, 4, 256, 0, -32])
def test_unsupported_block_size(block_size):
    layout = LAYOUT.copy()
    assert_refused(lambda: bsmm.BlocksparseMatMul(layout, block_size=block_size), ValueError,
                   r"block_size must be one of \(8, 16, 32, 64, 128\)", layout)


@pytest.mark.parametrize("block_size", [32.0, "32", True, [32]])
def test_block_size_must_be_an_int(block_size):
    layout = LAYOUT.copy()
    assert_refused(lambda: bsmm.BlocksparseMatMul(layout, block_size=block_size), TypeError,
                   "block_size must be an int", layout)


def test_numpy_integer_block_size_is_accepted():
    """np.int64 counts as an int (the error path must not catch it)."""
    assert bsmm.BlocksparseMatMul(LAYOUT, block_size=np.int64(16)).block_size == 16


@pytest.mark.parametrize("feature_axis", [2, -1, np.int64(3)])
def test_feature_axis_must_be_0_or_1(feature_axis):
    layout = LAYOUT.copy()
    assert_refused(lambda: bsmm.BlocksparseMatMul(layout, block_size=BS, feature_axis=feature_axis), ValueError,
                   re.escape(f"feature_axis must be 0 or 1; got {feature_axis!r}"), layout)


@pytest.mark.parametrize("option, value, expected", [
    *[("feature_axis", v, "an int, 0 or 1") for v in ("1", True, np.bool_(False), 0.5, 1.0, [1])],
    *[("tf32", v, "a bool or None") for v in ("no", "False", 0, 1, 0.0, [True])],
])
def test_operator_options_must_have_their_types(option, value, expected):
    """feature_axis 1.0 or True is no axis, though each compares equal to 1; tf32="no" used to be
    taken as True (a non-empty string is truthy)."""
    layout = LAYOUT.copy()
    kind = type(value).__name__
    assert_refused(lambda: bsmm.BlocksparseMatMul(layout, block_size=BS, **{option: value}), TypeError,
                   rf"{option} must be {expected}; got .* \({kind}\)", layout)
    index = bsmm.block_index(layout, BS)
    assert_refused(lambda: bsmm.BlocksparseMatMul.from_index(index, **{option: value}), TypeError,
                   f"{option} must be {expected}", layout)


def test_numpy_integer_feature_axis_is_accepted():
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS, feature_axis=np.int8(0))
    assert op.feature_axis == 0 and type(op.feature_axis) is int


def test_tf32_is_checked_by_the_convolution_too():
    """The convolution builds its operator through the same check (so do the framework adapters)."""
    layout = LAYOUT.copy()
    assert_refused(lambda: bsmm.BlocksparseConv(layout, BS, 3, tf32="yes"), TypeError,
                   "tf32 must be a bool or None", layout)
    index = bsmm.block_index(layout, BS)
    assert_refused(lambda: bsmm.BlocksparseConv.from_index(index, 3, tf32=1), TypeError,
                   "tf32 must be a bool or None", layout)


@pytest.mark.parametrize("tf32", [True, False, np.bool_(True), None])
def test_tf32_bools_are_accepted(tf32):
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS, tf32=tf32)
    default = bool(bsmm.config.settings()["defaults"]["tf32"])
    assert type(op.tf32) is bool and op.tf32 == (bool(tf32) if tf32 is not None else default)


# -- activations --------------------------------------------------------------------------------------
@pytest.mark.parametrize("pass_name", ["fprop", "updat"])
def test_x_with_wrong_feature_size(case, xp, pass_name):
    op, axis, arrays, outs = case
    arrays["x"] = to_xp(xp, np.ones(activation(op.C + BS, axis), np.float32))
    expected = r"x must have shape \(N, 16\)" if axis == 1 else r"x must have shape \(16, N\)"
    assert_refused(lambda: run(op, pass_name, arrays, out=outs[pass_name]), ValueError, expected,
                   *arrays.values(), outs[pass_name])


@pytest.mark.parametrize("pass_name", ["bprop", "updat"])
def test_dy_with_wrong_feature_size(case, xp, pass_name):
    op, axis, arrays, outs = case
    arrays["dy"] = to_xp(xp, np.ones(activation(op.C, axis), np.float32))  # C = 16 instead of K = 24
    assert_refused(lambda: run(op, pass_name, arrays, out=outs[pass_name]), ValueError, "dy must have shape",
                   *arrays.values(), outs[pass_name])


@pytest.mark.parametrize("shape", [(16,), (1, 5, 16), ()], ids=["1d", "3d", "0d"])
def test_x_with_wrong_ndim(case, xp, shape):
    op, axis, arrays, outs = case
    arrays["x"] = to_xp(xp, np.ones(shape, np.float32))
    assert_refused(lambda: op(arrays["x"], arrays["w"], out=outs["fprop"]), ValueError, "x must have shape",
                   *arrays.values(), outs["fprop"])


def test_w_not_of_w_shape(case, xp):
    op, axis, arrays, outs = case
    for shape in [(3, BS, BS), (4, BS, 2 * BS), (4, BS * BS), (4 * BS, BS)]:
        arrays["w"] = to_xp(xp, np.ones(shape, np.float32))
        for pass_name in ("fprop", "bprop"):
            assert_refused(lambda: run(op, pass_name, arrays, out=outs[pass_name]), ValueError,
                           r"w must have shape w_shape \(4, 8, 8\)", *arrays.values(), outs[pass_name])


def test_to_dense_checks_w(case, xp):
    op, axis, arrays, outs = case
    assert_refused(lambda: op.to_dense(to_xp(xp, np.ones((3, BS, BS), np.float32))), ValueError, "w_shape")
    assert_refused(lambda: op.to_dense(to_xp(xp, np.ones(op.w_shape, np.int32))), TypeError, "w has dtype int32")


def test_op_from_dense_checks_shape(case, xp):
    op, axis, arrays, outs = case
    dense = to_xp(xp, np.ones((op.K, op.C), np.float32))
    assert_refused(lambda: op.from_dense(dense), ValueError, r"dense must have shape \(16, 24\)", dense)


# -- dtypes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pass_name", ["fprop", "bprop"])
def test_w_dtype_must_match_activations(case, xp, pass_name):
    op, axis, arrays, outs = case
    arrays["w"] = to_xp(xp, np.ones(op.w_shape, np.float16))
    assert_refused(lambda: run(op, pass_name, arrays, out=outs[pass_name]), TypeError,
                   "w has dtype float16 but the activations have float32", *arrays.values(), outs[pass_name])


def test_dy_dtype_must_match_x_in_updat(case, xp):
    op, axis, arrays, outs = case
    arrays["dy"] = to_xp(xp, np.ones(activation(op.K, axis), np.float16))
    assert_refused(lambda: op.updat(arrays["x"], arrays["dy"], out=outs["updat"]), TypeError,
                   "dy has dtype float16 but x has float32", *arrays.values(), outs["updat"])


@pytest.mark.parametrize("dtype", [np.int32, np.complex64, np.bool_])
@pytest.mark.parametrize("pass_name", ["fprop", "bprop", "updat"])
def test_unsupported_dtype(case, xp, pass_name, dtype):
    """Activations and weights alike: only float32, float16 and bfloat16 (and float64 on the CPU,
    tested with its refusal on the GPU in test_float64.py)."""
    op, axis, arrays, outs = case
    converted = {name: to_xp(xp, to_numpy(value).astype(dtype)) for name, value in arrays.items()}
    argument = "dy" if pass_name == "bprop" else "x"
    assert_refused(lambda: run(op, pass_name, converted), TypeError,
                   f"{argument} has dtype {np.dtype(dtype).name}; supported dtypes are float32, float16, bfloat16, "
                   f"and float64 on the CPU backend",
                   *converted.values())


# -- memory layout -----------------------------------------------------------------------------------
@pytest.mark.parametrize("pass_name", ["fprop", "bprop", "updat"])
def test_non_contiguous_activation(case, xp, pass_name):
    op, axis, arrays, outs = case
    name = "dy" if pass_name == "bprop" else "x"
    arrays[name] = strided(xp, arrays[name].shape)
    assert_refused(lambda: run(op, pass_name, arrays, out=outs[pass_name]), ValueError,
                   rf"{name} must be C-contiguous; got strides .*; pass {xp.__name__}\.ascontiguousarray\({name}\)",
                   *arrays.values(), outs[pass_name])


def test_fortran_ordered_activation(case, xp):
    """An F-ordered x is refused too (BlockSparseMatrix handles F order; the op does not)."""
    op, axis, arrays, outs = case
    arrays["x"] = xp.asfortranarray(arrays["x"])
    if arrays["x"].flags.c_contiguous:
        pytest.skip("this shape is both C- and F-contiguous")
    assert_refused(lambda: op(arrays["x"], arrays["w"]), ValueError,
                   rf"x must be C-contiguous; .*; pass {xp.__name__}\.ascontiguousarray\(x\)", *arrays.values())


@pytest.mark.parametrize("pass_name", ["fprop", "bprop"])
def test_non_contiguous_w(case, xp, pass_name):
    op, axis, arrays, outs = case
    arrays["w"] = strided(xp, op.w_shape)
    assert_refused(lambda: run(op, pass_name, arrays, out=outs[pass_name]), ValueError,
                   rf"w must be C-contiguous; .*; pass {xp.__name__}\.ascontiguousarray\(w\)", *arrays.values(),
                   outs[pass_name])


@pytest.mark.parametrize("pass_name", ["fprop", "bprop", "updat"])
def test_non_contiguous_out(case, xp, pass_name):
    op, axis, arrays, outs = case
    out = strided(xp, outs[pass_name].shape)
    assert_refused(lambda: run(op, pass_name, arrays, out=out), ValueError,
                   r"out must be C-contiguous; got strides .*; pass a C-contiguous array, or out=None",
                   *arrays.values(), out)


# -- out ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pass_name", ["fprop", "bprop", "updat"])
def test_out_of_wrong_shape(case, xp, pass_name):
    op, axis, arrays, outs = case
    shape = outs[pass_name].shape
    out = poisoned(xp, (shape[0] + 1,) + tuple(shape[1:]), np.float32)
    assert_refused(lambda: run(op, pass_name, arrays, out=out), ValueError,
                   rf"out must have shape \({', '.join(map(str, shape))}\)", *arrays.values(), out)


@pytest.mark.parametrize("dtype", [np.float16, np.float64, ml_dtypes.bfloat16])
@pytest.mark.parametrize("pass_name", ["fprop", "bprop", "updat"])
def test_out_of_wrong_dtype(case, xp, pass_name, dtype):
    op, axis, arrays, outs = case
    out = poisoned(xp, outs[pass_name].shape, dtype)
    assert_refused(lambda: run(op, pass_name, arrays, out=out), TypeError,
                   f"out has dtype {np.dtype(dtype).name} but the inputs have float32", *arrays.values(), out)


@pytest.mark.parametrize("pass_name", ["fprop", "bprop", "updat"])
def test_read_only_out(case, xp, pass_name):
    op, axis, arrays, outs = case
    if xp is not np:
        pytest.skip("only NumPy arrays can be read-only")
    out = outs[pass_name]
    out.flags.writeable = False
    assert_refused(lambda: run(op, pass_name, arrays, out=out), ValueError, "out is read-only", *arrays.values(), out)


@pytest.mark.parametrize("pass_name", ["fprop", "bprop", "updat"])
def test_out_overlapping_an_input(xp, pass_name):
    """out sharing memory with an input is refused (the passes read inputs while writing out)."""
    rng = np.random.default_rng(4)
    layout = np.array([[1, 1], [0, 1]], dtype=np.uint8)  # square: C = K = 16, w_shape (3, 8, 8)
    op = bsmm.BlocksparseMatMul(layout, block_size=BS)
    x, dy = to_xp(xp, random_data(rng, (N, 16), "float32")), to_xp(xp, random_data(rng, (N, 16), "float32"))
    w = to_xp(xp, random_data(rng, op.w_shape, "float32"))
    if pass_name == "updat":  # a gradient buffer carved out of x's memory
        backing = to_xp(xp, random_data(rng, (3 * 64 + 16,), "float32"))
        x = backing[:N * 16].reshape(N, 16)
        out = backing[16:16 + 3 * 64].reshape(op.w_shape)
        arguments = (x, dy)
    else:
        out = x if pass_name == "fprop" else dy
        arguments = (x, w) if pass_name == "fprop" else (dy, w)
    run_pass = {"fprop": op, "bprop": op.bprop, "updat": op.updat}[pass_name]
    assert_refused(lambda: run_pass(*arguments, out=out), ValueError, "out overlaps an input", x, dy, w, out)


def test_accumulate_needs_out(case):
    op, axis, arrays, outs = case
    assert_refused(lambda: op.updat(arrays["x"], arrays["dy"], accumulate=True), ValueError,
                   "accumulate=True needs out=", *arrays.values())


def test_updat_dy_rows_must_match_x(case, xp):
    op, axis, arrays, outs = case
    arrays["dy"] = to_xp(xp, np.ones(activation(op.K, axis, n=N + 2), np.float32))
    assert_refused(lambda: op.updat(arrays["x"], arrays["dy"], out=outs["updat"], accumulate=True), ValueError,
                   rf"dy has {N + 2} rows \(N\) but x has {N}", *arrays.values(), outs["updat"])


# -- what counts as an array ----------------------------------------------------------------------
@pytest.mark.parametrize("argument", ["x", "w"])
def test_lists_are_not_arrays(case, argument):
    op, axis, arrays, outs = case
    converted = dict(arrays)
    converted[argument] = to_numpy(arrays[argument]).tolist()
    assert_refused(lambda: op(converted["x"], converted["w"], out=outs["fprop"]), TypeError,
                   f"{argument} must be an array", outs["fprop"])


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("argument", ["x", "out"])
def test_numpy_matrix_is_refused(argument):
    """np.matrix used to fail deep in the CPU backend; now it is refused by name, nothing written."""
    rng = np.random.default_rng(5)
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    arrays = {"x": random_data(rng, (N, op.C), "float32"), "w": random_data(rng, op.w_shape, "float32"),
              "out": np.full((N, op.K), np.nan, np.float32)}
    arrays[argument] = np.asmatrix(arrays[argument])
    assert_refused(lambda: op(arrays["x"], arrays["w"], out=arrays["out"]), TypeError,
                   rf"{argument} is a numpy.matrix; pass a plain numpy.ndarray \(np.asarray\({argument}\)\)",
                   *arrays.values())


@pytest.mark.parametrize("argument", ["x", "w", "out", "dy"])
def test_masked_array_is_refused(argument):
    """A masked array used to lose its mask silently (bsmm computed through the masked values)."""
    rng = np.random.default_rng(6)
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    arrays = {"x": random_data(rng, (N, op.C), "float32"), "w": random_data(rng, op.w_shape, "float32"),
              "dy": random_data(rng, (N, op.K), "float32"), "out": np.full((N, op.K), np.nan, np.float32)}
    mask = np.zeros(arrays[argument].shape, bool)
    mask.flat[0] = True
    arrays[argument] = np.ma.masked_array(arrays[argument], mask=mask)
    if argument == "dy":
        call = lambda: op.bprop(arrays["dy"], arrays["w"])  # noqa: E731
    else:
        call = lambda: op(arrays["x"], arrays["w"], out=arrays["out"])  # noqa: E731
    assert_refused(call, TypeError, rf"{argument} is a numpy masked array, whose mask bsmm cannot honour; "
                                    rf"pass a plain numpy.ndarray", *arrays.values(), mask)
    assert arrays[argument].mask.flat[0] and arrays[argument].mask.sum() == 1


@pytest.mark.parametrize("argument", ["x", "w"])
def test_torch_tensor_that_requires_grad_points_to_bsmm_torch(argument):
    """PyTorch's own advice, detach(), would drop the gradients silently: point to the autograd adapter."""
    torch = pytest.importorskip("torch")
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    tensors = {"x": torch.ones(N, op.C), "w": torch.ones(op.w_shape)}
    tensors[argument].requires_grad_(True)
    before = [t.detach().clone() for t in tensors.values()]
    with pytest.raises(TypeError, match=rf"{argument} requires grad, so it cannot be shared through DLPack, and the "
                                        rf"plain operator has no autograd: use bsmm.torch \(blocksparse_matmul, "
                                        rf"BlockSparseLinear, .*\)") as caught:
        op(tensors["x"], tensors["w"])
    assert "detach" not in str(caught.value)
    assert all(torch.equal(t, b) for t, b in zip(tensors.values(), before))
    assert tensors["x"].grad is None and tensors["w"].grad is None


def test_other_ndarray_subclasses_are_plain_arrays(tmp_path):
    """A memmap is an ordinary array to bsmm (only matrix and masked arrays change meaning)."""
    rng = np.random.default_rng(7)
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    x = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=(N, op.C))
    x[:] = random_data(rng, (N, op.C), "float32")
    w = random_data(rng, op.w_shape, "float32")
    assert np.array_equal(op(x, w), op(np.array(x), w))


def test_list_out_is_not_an_array(case):
    op, axis, arrays, outs = case
    out = to_numpy(outs["fprop"]).tolist()
    assert_refused(lambda: op(arrays["x"], arrays["w"], out=out), TypeError, "out must be an array", *arrays.values())


def test_scalars_are_not_arrays():
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    w = np.ones(op.w_shape, np.float32)
    assert_refused(lambda: op(np.float32(1), w), TypeError, "x must be an array", w)


def test_inputs_of_different_libraries():
    """A foreign DLPack producer next to a NumPy array: refused, naming both libraries."""
    rng = np.random.default_rng(0)
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    x = random_data(rng, (N, op.C), "float32")
    w = random_data(rng, op.w_shape, "float32")
    library = Producer.__module__.split(".", 1)[0]
    assert_refused(lambda: op(Producer(x), w), ValueError,
                   f"w is a numpy array but x is a {library} array; pass arrays of one library", x, w)
    assert_refused(lambda: op.updat(x, Producer(np.ones((N, op.K), np.float32))), ValueError,
                   "pass arrays of one library", x)


def test_out_of_a_different_library():
    rng = np.random.default_rng(1)
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    x, w = random_data(rng, (N, op.C), "float32"), random_data(rng, op.w_shape, "float32")
    buffer = np.full((N, op.K), np.nan, np.float32)
    assert_refused(lambda: op(x, w, out=Producer(buffer)), ValueError, "out is a .* array but inputs is a numpy",
                   x, w, buffer)


def test_read_only_out_through_dlpack():
    """A read-only buffer shared through DLPack is still refused as out."""
    rng = np.random.default_rng(2)
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    x, w = random_data(rng, (N, op.C), "float32"), random_data(rng, op.w_shape, "float32")
    buffer = np.full((N, op.K), np.nan, np.float32)
    buffer.flags.writeable = False
    assert_refused(lambda: op(Producer(x), Producer(w), out=Producer(buffer)), ValueError, "out is read-only", buffer)


def test_dlpack_device_bsmm_does_not_run_on():
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    x = np.ones((N, op.C), np.float32)
    assert_refused(lambda: op(ElsewhereProducer(x), ElsewhereProducer(np.ones(op.w_shape, np.float32))), TypeError,
                   "lives on DLPack device type 4", x)


def test_dtype_dlpack_cannot_carry():
    """bfloat16 has no DLPack code NumPy accepts: a clear TypeError, not a BufferError."""
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    x = np.ones((N, op.C), ml_dtypes.bfloat16)
    assert_refused(lambda: op(Producer(x), Producer(np.ones(op.w_shape, ml_dtypes.bfloat16))), TypeError,
                   "cannot be shared through DLPack", x)


# -- BlockSparseMatrix --------------------------------------------------------------------------------
def test_matrix_data_must_be_blocks():
    for data in [np.ones((4, 8), np.float32), np.ones((4, 8, 16), np.float32), [[[1.0]]]]:
        assert_refused(lambda: bsmm.BlockSparseMatrix(LAYOUT, data), ValueError,
                       r"data must have shape \(nnzb, bs, bs\)", np.asarray(data))


def test_matrix_data_must_fit_layout():
    data = np.ones((3, 8, 8), np.float32)
    assert_refused(lambda: bsmm.BlockSparseMatrix(LAYOUT, data), ValueError,
                   r"data must have shape \(4, 8, 8\) for this layout", data)


def test_matrix_data_block_size_and_dtype():
    data = np.ones((4, 12, 12), np.float32)
    assert_refused(lambda: bsmm.BlockSparseMatrix(LAYOUT, data), ValueError, "block_size must be one of", data)
    data = np.ones((4, 8, 8), np.int32)
    assert_refused(lambda: bsmm.BlockSparseMatrix(LAYOUT, data), TypeError,
                   "data has dtype int32; supported dtypes are float32, float16, bfloat16, and float64 on the CPU",
                   data)
    matrix = bsmm.BlockSparseMatrix(LAYOUT, np.ones((4, 8, 8), np.float32))
    # the message shows "<class 'numpy.int8'>", hence the loose pattern
    assert_refused(lambda: matrix.astype(np.int8), TypeError, "dtype has dtype .*int8", matrix.data)


def test_matrix_float64_data_is_refused_on_the_gpu(xp):
    """float64 block data is NumPy only (the CPU backend); CuPy float64 data is refused at construction."""
    if xp is np:
        pytest.skip("float64 NumPy data is accepted (tests/test_matrix.py)")
    data = to_xp(xp, np.ones((4, BS, BS)))
    assert_refused(lambda: bsmm.BlockSparseMatrix(LAYOUT, data), TypeError,
                   "data has dtype float64, which runs only on the CPU backend", data)
    dense = to_xp(xp, np.ones((16, 24)))
    assert_refused(lambda: bsmm.BlockSparseMatrix.from_dense(dense, block_size=BS), TypeError,
                   "dense has dtype float64, which runs only on the CPU backend", dense)
    matrix = bsmm.BlockSparseMatrix(LAYOUT, to_xp(xp, np.ones((4, BS, BS), np.float32)))
    assert_refused(lambda: matrix.astype(np.float64), TypeError,
                   "dtype has dtype float64, which runs only on the CPU", matrix.data)


def test_matrix_data_must_be_contiguous(xp):
    """Decided at construction (it used to pass here and fail at the first product), as the operator does for w."""
    for data in (strided(xp, (4, BS, BS)), xp.ones((4, BS, BS), np.float32).transpose(0, 2, 1)):
        assert_refused(lambda: bsmm.BlockSparseMatrix(LAYOUT, data), ValueError,
                       r"data must be C-contiguous; got strides \(.*\) \(pass np.ascontiguousarray\(data\)\)", data)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_matrix_refuses_numpy_subclasses():
    data = np.ma.masked_array(np.ones((4, BS, BS), np.float32))
    assert_refused(lambda: bsmm.BlockSparseMatrix(LAYOUT, data), TypeError, "data is a numpy masked array", data)
    assert_refused(lambda: bsmm.BlockSparseMatrix(np.ma.masked_array(LAYOUT), np.ones((4, BS, BS), np.float32)),
                   TypeError, "layout is a numpy masked array")
    dense = np.asmatrix(np.ones((16, 24), np.float32))
    assert_refused(lambda: bsmm.BlockSparseMatrix.from_dense(dense, block_size=BS), TypeError,
                   "dense is a numpy.matrix", dense)
    matrix = bsmm.BlockSparseMatrix(LAYOUT, np.ones((4, BS, BS), np.float32))
    for X in (np.asmatrix(np.ones((3, 16), np.float32)), np.ma.masked_array(np.ones((3, 16), np.float32))):
        assert_refused(lambda: X @ matrix, TypeError, r"other is a numpy(\.matrix| masked array)", X, matrix.data)
        assert_refused(lambda: matrix.T @ X.T, TypeError, r"other is a numpy(\.matrix| masked array)", X, matrix.data)


def test_matrix_data_of_another_library():
    data = np.ones((4, BS, BS), np.float32)

    class Blocks(Producer):
        """A foreign DLPack producer with the shape of block data."""
        shape, dtype = data.shape, data.dtype

    library = Blocks.__module__.split(".", 1)[0]
    assert_refused(lambda: bsmm.BlockSparseMatrix(LAYOUT, Blocks(data)), TypeError,
                   f"data must be a NumPy or CuPy array; got a {library} Blocks", data)


@pytest.fixture
def matrix(xp):
    rng = np.random.default_rng(3)
    return bsmm.BlockSparseMatrix(LAYOUT, to_xp(xp, random_data(rng, (4, BS, BS), "float32")))  # (16, 24)


def test_matmul_shapes_must_align(matrix, xp):
    operands = {
        "W @ X": (lambda X: matrix @ X, (16, 3)),  # needs (24, n)
        "X @ W": (lambda X: X @ matrix, (3, 24)),  # needs (n, 16)
        "W.T @ X": (lambda X: matrix.T @ X, (24, 3)),  # needs (16, n)
        "X @ W.T": (lambda X: X @ matrix.T, (3, 16)),  # needs (n, 24)
    }
    for product, (call, shape) in operands.items():
        X = to_xp(xp, np.ones(shape, np.float32))
        assert_refused(lambda: call(X), ValueError, "do not align for @", X, matrix.data)
    v = to_xp(xp, np.ones(16, np.float32))
    assert_refused(lambda: matrix @ v, ValueError, "do not align", v)


def test_matmul_stack_on_the_right_is_refused(matrix, xp):
    stack = to_xp(xp, np.ones((2, 24, 3), np.float32))
    assert_refused(lambda: matrix @ stack, ValueError, r"W @ other needs other 1-D or 2-D; got 3-D", stack)


def test_matmul_with_a_list(matrix):
    assert_refused(lambda: matrix @ [[1.0] * 24], TypeError, "other must be an array", matrix.data)


def test_matmul_dtype_mismatch(matrix, xp):
    X = to_xp(xp, np.ones((3, 16), np.float16))
    assert_refused(lambda: X @ matrix, TypeError, "has dtype float32 but the activations have float16", X)


def test_from_dense_shape_must_be_multiple_of_block_size():
    for shape in [(20, 16), (16, 20), (16,), (2, 16, 16)]:
        dense = np.ones(shape, np.float32)
        assert_refused(lambda: bsmm.BlockSparseMatrix.from_dense(dense, block_size=8), ValueError,
                       "dense must be 2-D with both sides multiples of block_size 8", dense)


def test_from_dense_accepts_at_most_one_selector():
    dense = np.ones((16, 16), np.float32)
    assert_refused(lambda: bsmm.BlockSparseMatrix.from_dense(dense, block_size=8, threshold=0.5, top_k=2),
                   ValueError, "give at most one of threshold, top_k, density; got threshold, top_k", dense)
    assert_refused(lambda: bsmm.BlockSparseMatrix.from_dense(dense, block_size=8, top_k=1, density=0.5),
                   ValueError, "got top_k, density", dense)


def test_from_dense_selector_ranges():
    dense = np.ones((16, 16), np.float32)  # 4 blocks
    for density in (-0.1, 1.5):
        assert_refused(lambda: bsmm.BlockSparseMatrix.from_dense(dense, block_size=8, density=density),
                       ValueError, "density must be in", dense)
    for top_k in (-1, 5):
        assert_refused(lambda: bsmm.BlockSparseMatrix.from_dense(dense, block_size=8, top_k=top_k),
                       ValueError, r"top_k must be in \[0, 4\]", dense)


def test_from_dense_dtype_and_block_size():
    dense = np.ones((16, 16), np.int64)
    assert_refused(lambda: bsmm.BlockSparseMatrix.from_dense(dense, block_size=8), TypeError,
                   "dense has dtype int64", dense)
    dense = np.ones((24, 24), np.float32)
    assert_refused(lambda: bsmm.BlockSparseMatrix.from_dense(dense, block_size=12), ValueError,
                   "block_size must be one of", dense)


def sparse_parts(matrix) -> tuple:
    """The arrays a scipy.sparse matrix is made of, to check they stay unchanged."""
    return tuple(getattr(matrix, name) for name in ("data", "indices", "indptr") if hasattr(matrix, name))


def test_from_scipy_csr_needs_block_size():
    csr = scipy.sparse.csr_array(np.eye(16, dtype=np.float32))
    assert_refused(lambda: bsmm.BlockSparseMatrix.from_scipy(csr), ValueError,
                   "block_size is needed for a csr matrix", *sparse_parts(csr))


def test_from_scipy_bsr_with_rectangular_blocks_needs_block_size():
    bsr = scipy.sparse.bsr_array(np.eye(16, dtype=np.float32), blocksize=(8, 16))
    assert_refused(lambda: bsmm.BlockSparseMatrix.from_scipy(bsr), ValueError,
                   "block_size is needed for a bsr matrix without square blocks", *sparse_parts(bsr))


def test_from_scipy_shape_must_be_multiple_of_block_size():
    csr = scipy.sparse.csr_array(np.eye(20, 16, dtype=np.float32))
    assert_refused(lambda: bsmm.BlockSparseMatrix.from_scipy(csr, block_size=8), ValueError,
                   r"matrix shape \(20, 16\) is not a multiple of block_size 8", *sparse_parts(csr))


def test_from_scipy_block_size_and_dtype_checked():
    csr = scipy.sparse.csr_array(np.eye(24, dtype=np.float32))
    assert_refused(lambda: bsmm.BlockSparseMatrix.from_scipy(csr, block_size=12), ValueError,
                   "block_size must be one of", *sparse_parts(csr))
    # the message shows "<class 'numpy.int16'>", hence the loose pattern
    assert_refused(lambda: bsmm.BlockSparseMatrix.from_scipy(csr, block_size=8, dtype=np.int16), TypeError,
                   "dtype has dtype .*int16", *sparse_parts(csr))


@pytest.mark.parametrize("value", [np.eye(16, dtype=np.float32), [[1.0]], None], ids=["ndarray", "list", "None"])
def test_from_scipy_of_non_sparse(value):
    kept = [value] if isinstance(value, np.ndarray) else []
    assert_refused(lambda: bsmm.BlockSparseMatrix.from_scipy(value, block_size=8), TypeError,
                   "matrix must be a scipy.sparse matrix or array", *kept)

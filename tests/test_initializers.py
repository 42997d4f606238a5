"""Initializers against their definitions, in the library's block order."""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bsmm.initializers import identity, normal, orthogonal
from bsmm.layouts import random_layout, skewed_layout

DTYPES = [
    (np.float32, np.float32),
    ("float32", np.float32),
    (np.dtype(np.float16), np.float16),
    ("float16", np.float16),
    (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
    ("bfloat16", ml_dtypes.bfloat16),
]
# M.T @ M = I up to rounding each entry to the dtype: about sqrt(rows) * eps.
ORTHONORMAL_ATOL = {np.float32: 1e-5, np.float16: 1e-2, ml_dtypes.bfloat16: 6e-2}
INITIALIZERS = [normal, identity, orthogonal]


def _column_stacks(layout, data):
    """Block column k -> its present blocks stacked top to bottom, via np.nonzero order."""
    rows, cols = np.nonzero(layout)
    return {k: np.concatenate(list(data[cols == k].astype(np.float64))) for k in np.unique(cols)}


@pytest.mark.parametrize("initializer", INITIALIZERS)
@pytest.mark.parametrize("dtype, expected", DTYPES)
def test_shape_and_dtype(initializer, dtype, expected):
    layout = random_layout(12, density=0.3, seed=0)
    data = initializer(layout, 16, dtype=dtype, seed=1)
    assert data.shape == (layout.sum(), 16, 16)
    assert data.dtype == np.dtype(expected)
    assert data.flags.c_contiguous


@pytest.mark.parametrize("initializer", INITIALIZERS)
def test_empty_layout_gives_no_blocks(initializer):
    assert initializer(np.zeros((3, 3)), 8, seed=0).shape == (0, 8, 8)


@pytest.mark.parametrize("initializer", [normal, orthogonal])
def test_reproducible(initializer):
    layout = random_layout(10, 14, density=0.4, seed=0)
    first = initializer(layout, 8, seed=5)
    assert (first == initializer(layout, 8, seed=5)).all()
    assert (first != initializer(layout, 8, seed=6)).any()
    rng = np.random.default_rng(5)
    assert (initializer(layout, 8, seed=rng) != initializer(layout, 8, seed=rng)).any()


@pytest.mark.parametrize("initializer", [normal, orthogonal])
def test_low_precision_is_the_float64_draw_rounded(initializer):
    layout = random_layout(6, density=0.5, seed=0)
    reference = initializer(layout, 8, dtype="float32", seed=2).astype(np.float64)
    for dtype, rtol in (("float16", 2**-11), ("bfloat16", 2**-8)):
        rounded = initializer(layout, 8, dtype=dtype, seed=2).astype(np.float64)
        assert np.allclose(rounded, reference, rtol=rtol, atol=1e-6)


# -- normal ------------------------------------------------------------------------


def test_normal_std_follows_the_fan_in_of_each_output_column():
    layout = skewed_layout(64, 64, density=0.2, dense_cols=4, seed=0)
    block_size, scale = 16, 2.0
    data = normal(layout, block_size, scale=scale, seed=1).astype(np.float64)
    _, cols = np.nonzero(layout)
    fan_in = layout.sum(axis=0)
    expected_std = scale / np.sqrt(fan_in[cols] * block_size)
    z = data / expected_std[:, None, None]
    dense = fan_in[cols] == 64
    # 819 blocks of 256 entries: the std of z is 1 to about 0.2 % (dense columns: 0.4 %).
    for part in (z, z[dense], z[~dense]):
        assert part.std() == pytest.approx(1.0, rel=0.02)
        assert abs(part.mean()) < 0.02
    column_std = np.array([z[cols == k].std() for k in np.unique(cols)])
    assert np.abs(column_std - 1).max() < 0.25  # >= 256 entries per column


def test_normal_with_zero_scale_is_zero():
    assert (normal(np.ones((2, 2)), 8, scale=0, seed=0) == 0).all()


# -- identity ----------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 12), st.floats(0, 1), st.sampled_from([8, 16]), st.integers(0, 2**32 - 1))
def test_identity_blocks_exactly_on_the_diagonal(n, density, block_size, seed):
    layout = random_layout(n, density=density, seed=seed)
    data = identity(layout, block_size)
    rows, cols = np.nonzero(layout)
    eye = np.eye(block_size)
    for block, row, col in zip(data, rows, cols, strict=True):
        assert (block == (eye if row == col else 0)).all()


def test_identity_with_full_diagonal_is_the_identity_matrix():
    layout = random_layout(6, density=0.3, seed=1) | np.eye(6, dtype=np.uint8)
    data = identity(layout, 8, dtype="bfloat16")
    dense = np.zeros((6, 8, 6, 8))
    rows, cols = np.nonzero(layout)
    dense[rows, :, cols, :] = data.astype(np.float64)
    assert (dense.reshape(48, 48) == np.eye(48)).all()


def _tiled_identity(n_rows: int, n_cols: int) -> np.ndarray:
    """The seed's identity as a dense (n_rows, n_cols) matrix: the identity of the shorter side
    repeated along the longer one (np.tile, then cut), without any block arithmetic."""
    side = min(n_rows, n_cols)
    return np.tile(np.eye(side), (-(-n_rows // side), -(-n_cols // side)))[:n_rows, :n_cols]


def _dense(layout, data, block_size):
    dense = np.zeros((layout.shape[0], block_size, layout.shape[1], block_size))
    rows, cols = np.nonzero(layout)
    dense[rows, :, cols, :] = data.astype(np.float64)
    return dense.reshape(layout.shape[0] * block_size, layout.shape[1] * block_size)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.floats(0, 1), st.sampled_from([8, 16]), st.integers(0, 2**32 - 1))
def test_identity_is_the_tiled_identity_on_present_blocks(n_rows, n_cols, density, block_size, seed):
    layout = random_layout(n_rows, n_cols, density=density, seed=seed)
    dense = _dense(layout, identity(layout, block_size), block_size)
    mask = np.kron(layout, np.ones((block_size, block_size)))
    assert (dense == _tiled_identity(n_rows * block_size, n_cols * block_size) * mask).all()


@pytest.mark.parametrize("shape", [(2, 6), (6, 2), (2, 5), (5, 3), (1, 4), (4, 1)])
def test_identity_on_full_non_square_layouts(shape):
    """Wide: x·W copies each input feature to every output feature congruent to it mod C;
    tall: it sums the input features congruent mod K."""
    layout = np.ones(shape, np.uint8)
    w = _dense(layout, identity(layout, 8, dtype="float16"), 8)
    x = np.random.default_rng(0).standard_normal((3, shape[0] * 8))
    features_in, features_out = shape[0] * 8, shape[1] * 8
    expected = np.zeros((3, features_out))
    for i in range(features_in):
        for j in range(features_out):
            if i % min(features_in, features_out) == j % min(features_in, features_out):
                expected[:, j] += x[:, i]
    assert np.allclose(x @ w, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("scale", [2.5, -1.0, 0.0])
def test_identity_scale(scale):
    layout = random_layout(4, 7, density=0.6, seed=2)
    scaled = identity(layout, 8, scale=scale)
    assert (scaled == scale * identity(layout, 8)).all()
    assert (identity(layout, 8, scale=1) == identity(layout, 8)).all()


@pytest.mark.parametrize(
    "value, error, message",
    [
        (math.nan, ValueError, r"scale must be finite; got nan"),
        (-math.inf, ValueError, r"scale must be finite; got -inf"),
        ("1", TypeError, r"scale must be a real number; got str"),
        (True, TypeError, r"scale must be a real number; got bool"),
    ],
)
def test_identity_scale_validation(value, error, message):
    with pytest.raises(error, match=message):
        identity(np.eye(3), 8, scale=value)


# -- orthogonal --------------------------------------------------------------------


@pytest.mark.parametrize("dtype, expected", DTYPES)
def test_orthogonal_columns_are_orthonormal(dtype, expected):
    layout = random_layout(16, 24, density=0.3, seed=3)
    layout[:, 0] = 1  # a full column: a 256 x 16 stack
    gain = 1.5
    data = orthogonal(layout, 16, gain=gain, dtype=dtype, seed=4)
    stacks = _column_stacks(layout, data)
    assert len(stacks) > 1
    for stack in stacks.values():
        assert np.allclose(stack.T @ stack / gain**2, np.eye(16), atol=ORTHONORMAL_ATOL[expected])


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 10), st.integers(1, 10), st.floats(0, 1), st.integers(0, 2**32 - 1))
def test_orthogonal_any_layout(n_rows, n_cols, density, seed):
    layout = random_layout(n_rows, n_cols, density=density, seed=seed)
    data = orthogonal(layout, 8, seed=seed)
    assert data.shape == (layout.sum(), 8, 8)
    for stack in _column_stacks(layout, data).values():
        assert np.allclose(stack.T @ stack, np.eye(8), atol=1e-5)


@pytest.mark.parametrize("n_rows", [1, 3])
def test_orthogonal_is_haar_signed(n_rows):
    # Haar matrices are invariant under flipping any row's sign, so each entry is
    # positive half the time. Unnormalized QR is not: LAPACK makes Q[0, 0] < 0 always.
    layout = np.ones((n_rows, 2000))
    stacks = np.stack(list(_column_stacks(layout, orthogonal(layout, 8, seed=0)).values()))
    positive = (stacks > 0).mean(axis=0)
    # Binomial(2000, 1/2) / 2000 has sd 0.011.
    assert np.abs(positive - 0.5).max() < 0.06


def test_orthogonal_with_zero_gain_is_zero():
    assert (orthogonal(np.ones((2, 2)), 8, gain=0.0, seed=0) == 0).all()


# -- validation --------------------------------------------------------------------


@pytest.mark.parametrize("initializer", INITIALIZERS)
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"layout": np.ones(4)}, ValueError, r"layout must be 2-D"),
        ({"layout": np.ones((2, 2, 2))}, ValueError, r"layout must be 2-D"),
        ({"layout": np.array([[1, np.nan], [0, 1]])}, ValueError, r"layout must hold finite numbers"),
        ({"layout": np.array([[1, -np.inf], [0, 1]])}, ValueError, r"layout must hold finite numbers"),
        ({"layout": [[1, 0], [1]]}, ValueError, r"layout must be a 2-D array .* same length"),
        ({"block_size": 12}, ValueError, r"block_size must be one of \(8, 16, 32, 64, 128\); got 12"),
        ({"block_size": 8.0}, TypeError, r"block_size must be an int"),
        ({"dtype": np.float64}, TypeError, r"supported dtypes are float32, float16, bfloat16"),
        ({"dtype": "float64"}, TypeError, r"supported dtypes are float32, float16, bfloat16"),
        ({"dtype": "int8"}, TypeError, r"supported dtypes are float32, float16, bfloat16"),
        ({"dtype": None}, TypeError, r"supported dtypes are float32, float16, bfloat16"),
        ({"seed": "1"}, TypeError, r"seed must be an int, None or numpy.random.Generator; got str"),
        ({"seed": -1}, ValueError, r"seed must be >= 0; got -1"),
    ],
)
def test_common_validation(initializer, kwargs, error, message):
    arguments = {"layout": np.eye(3), "block_size": 8, **kwargs}
    with pytest.raises(error, match=message):
        initializer(**arguments)


@pytest.mark.parametrize("initializer, name", [(normal, "scale"), (orthogonal, "gain")])
@pytest.mark.parametrize(
    "value, error, message",
    [
        (-1.0, ValueError, r"must be finite and >= 0; got -1.0"),
        (math.nan, ValueError, r"must be finite and >= 0; got nan"),
        (math.inf, ValueError, r"must be finite and >= 0; got inf"),
        ("1", TypeError, r"must be a real number; got str"),
        (True, TypeError, r"must be a real number; got bool"),
    ],
)
def test_factor_validation(initializer, name, value, error, message):
    with pytest.raises(error, match=f"{name} {message}"):
        initializer(np.eye(3), 8, **{name: value})

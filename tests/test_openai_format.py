"""bsmm.openai_format against independent implementations of the seed's block orders.

The seed (OpenAI's blocksparse) stores block (c, k) at the rank of its Morton key, c's bits on
the even bit positions and k's on the odd ones. Two references here derive that order without
bsmm's code, each differently from bsmm's (which spreads bits by masks):

- ``looped_key``: the key of one block built bit by bit with Python integers, blocks sorted by it;
- ``quadrant_walk``: the z-curve as a recursion, each square split into its four quadrants visited
  top-left, bottom-left, top-right, bottom-right.

The end-to-end tests build weights in the seed's storage from those references, convert them with
``from_openai`` and check all three passes against float64 dense products.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bsmm
from bsmm.openai_format import from_openai, openai_block_order, to_openai
from conftest import to_numpy, to_xp
from reference import random_layout, rel_error, skewed_layout


# -- independent references -----------------------------------------------------------------------
def looped_key(c: int, k: int) -> int:
    """Morton key of block (c, k), one bit at a time: bit i of c to bit 2i, bit i of k to bit 2i + 1."""
    key, bit = 0, 0
    while (c >> bit) or (k >> bit):
        key |= ((c >> bit) & 1) << (2 * bit)
        key |= ((k >> bit) & 1) << (2 * bit + 1)
        bit += 1
    return key


def present(layout) -> list[tuple[int, int]]:
    """(c, k) of the present blocks, by a double loop in row-major order (bsmm's storage order)."""
    layout = np.asarray(layout)
    return [(c, k) for c in range(layout.shape[0]) for k in range(layout.shape[1]) if layout[c, k]]


def coordinates_by_loop(layout) -> list[tuple[int, int]]:
    """The seed's storage order: present blocks sorted by ``looped_key``."""
    return sorted(present(layout), key=lambda ck: looped_key(*ck))


def coordinates_by_quadrants(layout) -> list[tuple[int, int]]:
    """The seed's storage order as a z-curve: split the smallest enclosing 2^m square into
    quadrants, visited (top, left), (bottom, left), (top, right), (bottom, right), recursively."""
    blocks = present(layout)
    side = 1
    while side < max(np.shape(layout)):
        side *= 2
    order: list[tuple[int, int]] = []

    def visit(members, top, left, size):
        if not members:
            return
        if size == 1:
            order.extend(members)
            return
        half = size // 2
        for row_offset, col_offset in ((0, 0), (half, 0), (0, half), (half, half)):
            r0, c0 = top + row_offset, left + col_offset
            visit([(c, k) for c, k in members if r0 <= c < r0 + half and c0 <= k < c0 + half], r0, c0, half)

    visit(blocks, 0, 0, side)
    return order


def coordinates_by_columns(layout) -> list[tuple[int, int]]:
    """The seed's order with ``z_order=False``: block column by block column, each from the top."""
    layout = np.asarray(layout)
    return [(c, k) for k in range(layout.shape[1]) for c in range(layout.shape[0]) if layout[c, k]]


def bsmm_ids(layout, coordinates) -> list[int]:
    """Row-major positions (bsmm's block ids) of the given coordinates."""
    position = {ck: b for b, ck in enumerate(present(layout))}
    return [position[ck] for ck in coordinates]


def _layouts():
    rng = np.random.default_rng(2017)
    sparse_far = np.zeros((3, 70_001), np.uint8)
    sparse_far[[0, 2, 1, 2, 0], [0, 5, 65_536, 65_537, 70_000]] = 1  # keys above 2**32
    return {
        "square": random_layout(rng, 8, 8, 0.5),
        "wide": random_layout(rng, 3, 7, 0.6),
        "tall": random_layout(rng, 7, 3, 0.6),
        "odd wide": random_layout(rng, 5, 13, 0.4),
        "odd tall": random_layout(rng, 13, 5, 0.4),
        "skewed": skewed_layout(rng, 12, 10),
        "full": np.ones((6, 6), np.uint8),
        "full odd": np.ones((5, 3), np.uint8),
        "one block": np.ones((1, 1), np.uint8),
        "one row": np.ones((1, 9), np.uint8),
        "one column": np.ones((9, 1), np.uint8),
        "empty": np.zeros((4, 4), np.uint8),
        "far apart": sparse_far,
    }


LAYOUTS = _layouts()
SMALL = [name for name in LAYOUTS if name != "far apart"]


# -- the order ------------------------------------------------------------------------------------
def test_the_two_references_agree():
    for name, layout in LAYOUTS.items():
        if name != "far apart":  # the quadrant walk's lists are long there; the loop alone checks it
            assert coordinates_by_loop(layout) == coordinates_by_quadrants(layout), name


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_z_order_matches_the_references(name):
    layout = LAYOUTS[name]
    order = openai_block_order(layout)
    assert order.dtype == np.int64
    assert order.tolist() == bsmm_ids(layout, coordinates_by_loop(layout))
    if name != "far apart":
        assert order.tolist() == bsmm_ids(layout, coordinates_by_quadrants(layout))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_column_order_matches_the_reference(name):
    layout = LAYOUTS[name]
    order = openai_block_order(layout, z_order=False)
    assert order.tolist() == bsmm_ids(layout, coordinates_by_columns(layout))


def test_first_blocks_of_a_full_layout_follow_the_z_curve():
    # Written out by hand: the first two 2 x 2 squares go down before right, then the square to the right.
    layout = np.ones((4, 4), np.uint8)
    seed_coordinates = [present(layout)[b] for b in openai_block_order(layout)]
    assert seed_coordinates[:8] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.floats(0, 1), st.integers(0, 2**32 - 1))
def test_z_order_any_layout(n_rows, n_cols, density, seed):
    layout = random_layout(np.random.default_rng(seed), n_rows, n_cols, density)
    order = openai_block_order(layout)
    assert order.tolist() == bsmm_ids(layout, coordinates_by_quadrants(layout))
    assert sorted(order.tolist()) == list(range(int(layout.sum())))


def test_any_nonzero_value_is_a_present_block():
    layout = np.array([[0.5, 0], [-2, 3]])
    assert openai_block_order(layout).tolist() == bsmm_ids(layout != 0, coordinates_by_loop(layout != 0))


# -- converting block data ------------------------------------------------------------------------
def _tagged(coordinates, bs: int) -> np.ndarray:
    """Blocks whose every entry is 1000 * c + k + 1 for their coordinates (c, k)."""
    tags = np.array([1000 * c + k + 1 for c, k in coordinates], dtype=np.float64)
    return tags[:, None, None] * np.ones((len(coordinates), bs, bs))


@pytest.mark.parametrize("z_order", [True, False])
@pytest.mark.parametrize("name", SMALL)
def test_from_openai_puts_each_block_at_its_coordinates(name, z_order):
    layout = LAYOUTS[name]
    seed_coordinates = coordinates_by_quadrants(layout) if z_order else coordinates_by_columns(layout)
    w_openai = _tagged(seed_coordinates, 8)
    w = from_openai(layout, w_openai, z_order=z_order)
    assert (w == _tagged(present(layout), 8)).all()
    assert (to_openai(layout, w, z_order=z_order) == w_openai).all()


def test_conversion_returns_a_new_array_and_keeps_the_input():
    layout = LAYOUTS["square"]
    w_openai = np.random.default_rng(0).standard_normal((int(layout.sum()), 8, 8)).astype(np.float16)
    before = w_openai.copy()
    w = from_openai(layout, w_openai)
    assert w.dtype == np.float16 and w.shape == w_openai.shape
    assert not np.shares_memory(w, w_openai)
    assert (w_openai == before).all()


def test_per_block_arrays_such_as_the_seeds_gates():
    layout = LAYOUTS["odd wide"]
    seed_coordinates = coordinates_by_loop(layout)
    gates = np.array([c + 0.5 * k for c, k in seed_coordinates])
    assert from_openai(layout, gates).tolist() == [c + 0.5 * k for c, k in present(layout)]


def test_torch_and_jax_arrays_stay_in_their_library():
    layout = LAYOUTS["tall"]
    w_openai = _tagged(coordinates_by_loop(layout), 8)
    expected = _tagged(present(layout), 8)
    torch = pytest.importorskip("torch")
    result = from_openai(layout, torch.from_numpy(w_openai))
    assert isinstance(result, torch.Tensor) and (result.numpy() == expected).all()
    jnp = pytest.importorskip("jax.numpy")
    result = from_openai(layout, jnp.asarray(w_openai, dtype=jnp.float32))
    assert type(result).__module__.startswith("jax") and (np.asarray(result) == expected).all()


# -- end to end: a weight saved in the seed's format, through the converter, in all three passes -----
@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("name", ["square", "wide", "odd tall", "skewed", "full odd", "one row", "empty"])
def test_seed_format_weights_give_the_dense_products(xp, name, n, feature_axis):
    """Done-when of issue 26: a weight set in the seed's storage, built from the independent
    ordering, gives through ``from_openai`` the outputs of the dense product it represents
    (fprop, bprop, and updat converted back with ``to_openai``): float64 on the CPU
    (relative error <= 1e-12), float32 on the GPU (<= 1e-5)."""
    layout, bs = LAYOUTS[name], 8
    dtype, tolerance = (np.float64, 1e-12) if xp is np else (np.float32, 1e-5)
    rng = np.random.default_rng(26)
    c_features, k_features = layout.shape[0] * bs, layout.shape[1] * bs
    dense = rng.standard_normal((c_features, k_features)) * np.kron(layout, np.ones((bs, bs)))
    dense = dense.astype(dtype).astype(np.float64)  # the reference multiplies exactly what bsmm gets
    seed_coordinates = coordinates_by_quadrants(layout)
    w_openai = np.array([dense[c * bs:(c + 1) * bs, k * bs:(k + 1) * bs] for c, k in seed_coordinates])
    w_openai = w_openai.reshape(len(seed_coordinates), bs, bs).astype(dtype)
    x = rng.standard_normal((n, c_features)).astype(dtype)
    dy = rng.standard_normal((n, k_features)).astype(dtype)
    if feature_axis == 0:
        x, dy = np.ascontiguousarray(x.T), np.ascontiguousarray(dy.T)

    op = bsmm.BlocksparseMatMul(layout, block_size=bs, feature_axis=feature_axis)
    w = from_openai(layout, to_xp(xp, w_openai))
    y = to_numpy(op.fprop(to_xp(xp, x), w))
    dx = to_numpy(op.bprop(to_xp(xp, dy), w))
    dw_openai = to_numpy(to_openai(layout, op.updat(to_xp(xp, x), to_xp(xp, dy))))

    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    rows_x, rows_dy = (x64, dy64) if feature_axis == 1 else (x64.T, dy64.T)  # (N, C), (N, K)
    expected_y, expected_dx, dw_dense = rows_x @ dense, rows_dy @ dense.T, rows_x.T @ rows_dy
    if feature_axis == 0:
        expected_y, expected_dx = expected_y.T, expected_dx.T
    expected_dw = np.array([dw_dense[c * bs:(c + 1) * bs, k * bs:(k + 1) * bs] for c, k in seed_coordinates])
    expected_dw = expected_dw.reshape(len(seed_coordinates), bs, bs)
    for what, actual, expected in (("y", y, expected_y), ("dx", dx, expected_dx), ("dw", dw_openai, expected_dw)):
        assert actual.shape == expected.shape, what
        assert rel_error(actual, expected) <= tolerance, f"{what}: relative error {rel_error(actual, expected):.3g}"


# -- validation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("convert", [from_openai, to_openai])
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"w": np.zeros((3, 8, 8))}, ValueError, r"w must have one entry per present block .* \(4, \.\.\.\) .* got shape \(3, 8, 8\)"),
        ({"w": np.float32(1)}, ValueError, r"w must have one entry per present block .* got shape \(\)"),
        ({"w": [[1.0]] * 4}, TypeError, r"w must be an array \(NumPy, CuPy, PyTorch or JAX\); got list"),
        ({"z_order": 1}, TypeError, r"z_order must be a bool; got 1 \(int\)"),
        ({"layout": np.ones(4)}, ValueError, r"layout must be 2-D"),
        ({"layout": [[1, np.nan]]}, ValueError, r"layout must hold finite numbers"),
    ],
)
def test_validation(convert, kwargs, error, message):
    arguments = {"layout": np.eye(4), "w": np.zeros((4, 8, 8)), **kwargs}
    with pytest.raises(error, match=message):
        convert(**arguments)


def test_order_validation():
    with pytest.raises(TypeError, match=r"z_order must be a bool; got 'yes' \(str\)"):
        openai_block_order(np.eye(2), z_order="yes")
    with pytest.raises(ValueError, match=r"layout must have at least one block row and column"):
        openai_block_order(np.zeros((0, 3)))

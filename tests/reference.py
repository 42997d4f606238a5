"""Float64 dense references for the three passes, built without bsmm.

Everything here works on NumPy arrays only (tests move data back with
``conftest.to_numpy`` first) and never calls into bsmm, so a bug in bsmm's own
``to_dense``/block order cannot hide in the reference.

Block order (the contract under test): block ``b`` of the block data is the
``b``-th pair of ``np.nonzero(layout)``, i.e. row-major over the layout.

The dtype facts (names, NumPy dtypes, tolerances) come from bsmm's one table of them,
:data:`bsmm.dtypes.ELEMENT_TYPES`: data only, no computation of bsmm's.
"""

from __future__ import annotations

import numpy as np

from bsmm.dtypes import KIND_DTYPES, SUPPORTED_DTYPES, TOLERANCES

#: The dtypes bsmm supports on every backend, by name (float64, CPU only, has its own tests).
DTYPES: dict[str, np.dtype] = dict(SUPPORTED_DTYPES)

#: Norm-wise relative error allowed per kind of arithmetic (a dtype's name, or "tf32": float32
#: data multiplied on TF32 tensor cores): :data:`bsmm.dtypes.TOLERANCES`, which says why.
TOLERANCE: dict[str, float] = dict(TOLERANCES)

_TINY = np.finfo(np.float64).tiny


def kind_dtype(kind: str) -> str:
    """The array dtype of a kind of TOLERANCE (TF32 runs on float32 data)."""
    return KIND_DTYPES[kind]


def tolerance(dtype) -> float:
    """Tolerance for ``dtype`` (a name, NumPy dtype or type)."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    return TOLERANCE[name]


def as_float64(array) -> np.ndarray:
    """A float64 copy of a NumPy array of any supported dtype (bfloat16 included)."""
    return np.asarray(array).astype(np.float64)


def rel_error(actual, expected) -> float:
    """||actual - expected|| / max(||expected||, tiny), in float64 (Frobenius norm).

    An all-zero ``expected`` therefore demands an (almost) exactly zero ``actual``.
    """
    a, e = as_float64(actual), as_float64(expected)
    assert a.shape == e.shape, f"shape {a.shape} != expected {e.shape}"
    return float(np.linalg.norm((a - e).ravel()) / max(np.linalg.norm(e.ravel()), _TINY))


def assert_close(actual, expected, dtype, what: str = "result") -> None:
    """Norm-wise relative comparison at ``dtype``'s tolerance."""
    error = rel_error(actual, expected)
    assert error <= tolerance(dtype), f"{what}: relative error {error:.3g} > {tolerance(dtype):g} ({dtype})"


# -- layouts and data -----------------------------------------------------------------------
def random_layout(rng: np.random.Generator, cb: int, kb: int, density: float) -> np.ndarray:
    """A (cb, kb) uint8 layout with each block present with probability ``density``."""
    return (rng.random((cb, kb)) < density).astype(np.uint8)


def skewed_layout(rng: np.random.Generator, cb: int, kb: int, density: float = 0.15) -> np.ndarray:
    """Load-imbalanced layout: two dense block columns and two dense block rows, the
    rest sparse, plus one entirely empty block row and one entirely empty block column.

    The empty row/column win where they cross the dense ones (a "dense" column is
    therefore dense except in the empty row). Needs ``cb, kb >= 4``.
    """
    assert cb >= 4 and kb >= 4, "skewed_layout needs at least 4 block rows and columns"
    layout = random_layout(rng, cb, kb, density)
    layout[:, [0, kb - 2]] = 1  # dense block columns
    layout[[1, cb - 1], :] = 1  # dense block rows
    layout[cb // 2, :] = 0  # empty block row
    layout[:, kb // 2] = 0  # empty block column
    return layout


def random_data(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Standard-normal values rounded to ``dtype``: no zeros, no ones-only data."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    return rng.standard_normal(shape).astype(dtype)


# -- references -------------------------------------------------------------------------------
def block_coordinates(layout) -> list[tuple[int, int]]:
    """(block row, block column) of every present block, in storage order."""
    rows, cols = np.nonzero(np.asarray(layout))
    return list(zip(rows.tolist(), cols.tolist()))


def dense_weight(layout, blocks, bs: int) -> np.ndarray:
    """Dense float64 W (C, K): block ``b`` placed at the ``b``-th nonzero of ``layout``."""
    layout = np.asarray(layout)
    blocks = as_float64(blocks)
    coordinates = block_coordinates(layout)
    assert blocks.shape == (len(coordinates), bs, bs), f"blocks {blocks.shape} do not fit the layout"
    dense = np.zeros((layout.shape[0] * bs, layout.shape[1] * bs))
    for b, (r, c) in enumerate(coordinates):
        dense[r * bs:(r + 1) * bs, c * bs:(c + 1) * bs] = blocks[b]
    return dense


def dense_to_present_blocks(layout, dense, bs: int) -> np.ndarray:
    """Cut the present blocks (storage order) out of a dense (C, K) float64 matrix."""
    coordinates = block_coordinates(layout)
    blocks = np.empty((len(coordinates), bs, bs))
    for b, (r, c) in enumerate(coordinates):
        blocks[b] = dense[r * bs:(r + 1) * bs, c * bs:(c + 1) * bs]
    return blocks


def ref_fprop(layout, blocks, bs: int, x, feature_axis: int) -> np.ndarray:
    """y = x·W: (N, K) for feature_axis 1, (K, N) = Wᵀ·x for feature_axis 0."""
    w = dense_weight(layout, blocks, bs)
    x = as_float64(x)
    return x @ w if feature_axis == 1 else w.T @ x


def ref_bprop(layout, blocks, bs: int, dy, feature_axis: int) -> np.ndarray:
    """dx = dy·Wᵀ: (N, C) for feature_axis 1, (C, N) = W·dy for feature_axis 0."""
    w = dense_weight(layout, blocks, bs)
    dy = as_float64(dy)
    return dy @ w.T if feature_axis == 1 else w @ dy


def ref_updat(layout, bs: int, x, dy, feature_axis: int) -> np.ndarray:
    """dW = xᵀ·dy in float64, cut into the present blocks: (nnzb, bs, bs)."""
    x, dy = as_float64(x), as_float64(dy)
    full = x.T @ dy if feature_axis == 1 else x @ dy.T
    return dense_to_present_blocks(layout, full, bs)


class Producer:
    """A minimal foreign DLPack producer on the CPU: wraps a NumPy array and forwards DLPack.

    Its type's top-level module is this test helper module, so bsmm sees a library other
    than NumPy, and one without ``from_dlpack`` (results then come back as NumPy arrays).
    """

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

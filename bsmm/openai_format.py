"""Block data in the storage order of OpenAI's ``blocksparse``, converted to and from bsmm's.

Both libraries store a block-sparse ``W`` (C, K) as its present blocks, one
``(nnzb, bs, bs)`` array in which each block is the same piece of ``W``: block
``(c, k)`` of the layout is ``W[c*bs:(c+1)*bs, k*bs:(k+1)*bs]``, rows of ``C`` by
columns of ``K``. Only the order of the blocks differs:

- bsmm: row-major over the layout, the order of ``np.nonzero(layout)``
  (:mod:`bsmm.block_index`);
- ``blocksparse.matmul.BlocksparseMatMul(layout, ..., z_order=True)``, the
  default: Morton order (z-order) over the layout's (block row, block column)
  coordinates, defined in :func:`openai_block_order`;
- the same with ``z_order=False``: column-major, block column by block column,
  each from the top (bsmm's :attr:`~bsmm.BlockIndex.col_order`).

The seed's ``feature_axis`` does not enter: with activations (N, C) or (C, N)
its blocks hold the same ``C × K`` pieces (its reference passes ``fprop_test``,
``bprop_test`` and ``updat_test`` read ``W[b]`` the same way on both axes), as
bsmm's do. Its ``block_coord(b)`` is the (block row, block column) of its
``b``-th block, which :func:`openai_block_order` computes without the seed.

Examples
--------
>>> import numpy as np, bsmm
>>> layout = np.array([[1, 1], [1, 0]])
>>> w_openai = np.arange(3.0)[:, None, None] * np.ones((3, 8, 8))   # blocks (0,0), (1,0), (0,1)
>>> w = bsmm.openai_format.from_openai(layout, w_openai)              # blocks (0,0), (0,1), (1,0)
>>> w[:, 0, 0].tolist()
[0.0, 2.0, 1.0]
>>> bool((bsmm.openai_format.to_openai(layout, w) == w_openai).all())
True
"""

from __future__ import annotations

import numpy as np

from bsmm.arrays import array_module
from bsmm.block_index import check_layout

__all__ = ["from_openai", "openai_block_order", "to_openai"]

# Spreading the bits of a 32-bit integer to the even bits of a 64-bit one: after step (s, m), every
# group of s bits stands apart from the next by s zero bits (the masks keep only the moved groups).
_SPREAD_STEPS = tuple(
    (np.uint64(shift), np.uint64(mask))
    for shift, mask in ((16, 0x0000FFFF0000FFFF), (8, 0x00FF00FF00FF00FF), (4, 0x0F0F0F0F0F0F0F0F),
                        (2, 0x3333333333333333), (1, 0x5555555555555555))
)


def _spread_bits(values: np.ndarray) -> np.ndarray:
    """Bit ``i`` of each value moved to bit ``2i`` (values below 2**32), as uint64."""
    spread = values.astype(np.uint64)
    for shift, mask in _SPREAD_STEPS:
        spread = (spread | (spread << shift)) & mask
    return spread


def _check_z_order(z_order) -> bool:
    if not isinstance(z_order, (bool, np.bool_)):
        raise TypeError(f"z_order must be a bool; got {z_order!r} ({type(z_order).__name__})")
    return bool(z_order)


def openai_block_order(layout, z_order: bool = True) -> np.ndarray:
    """Where each block the seed stores sits in bsmm's order: ``w_openai = w_bsmm[order]``.

    With ``z_order=True`` (the seed's default) the seed stores its present blocks
    by increasing Morton key

    ``z(c, k) = sum over bits i of  c_i * 2**(2*i) + k_i * 2**(2*i + 1)``

    where ``c_i`` and ``k_i`` are bit ``i`` of the block row ``c`` and block column
    ``k``: the row's bits on the even bit positions, the column's on the odd ones.
    Within each aligned 2 × 2 square of blocks the order is therefore (0, 0),
    (1, 0), (0, 1), (1, 1) (down before right), and the squares themselves follow
    the same pattern at every scale. Keys are distinct, so the order is total.

    With ``z_order=False`` the seed stores the blocks column by column, each
    column from the top: sorted by ``(k, c)``.

    Parameters
    ----------
    layout : (C // bs, K // bs) array
        Non-zero (finite) entries are present blocks, as for
        :func:`bsmm.block_index.check_layout`.
    z_order : bool
        The seed's ``BlocksparseMatMul(..., z_order=)``.

    Returns
    -------
    order : (nnzb,) int64 array
        ``order[j]`` is the bsmm block id (row-major position) of the seed's
        ``j``-th block; a permutation of ``range(nnzb)``.

    Raises
    ------
    TypeError
        If ``z_order`` is not a bool, or ``layout`` is a ``numpy.matrix`` or a
        masked array.
    ValueError
        If ``layout`` is not a valid layout.

    Examples
    --------
    >>> import numpy as np
    >>> openai_block_order(np.ones((2, 2))).tolist()       # bsmm ids: (0,0)=0 (0,1)=1 (1,0)=2 (1,1)=3
    [0, 2, 1, 3]
    >>> openai_block_order(np.ones((2, 3)), z_order=False).tolist()
    [0, 3, 1, 4, 2, 5]
    """
    z_order = _check_z_order(z_order)
    rows, cols = np.nonzero(check_layout(layout))
    if z_order:
        # Layout sides are below 2**31 (check_layout): keys fit in 63 bits.
        keys = _spread_bits(rows) | (_spread_bits(cols) << np.uint64(1))
        return np.argsort(keys, kind="stable").astype(np.int64)
    return np.lexsort((rows, cols)).astype(np.int64)


def _check_blocks(w, layout_blocks: int, argument: str) -> None:
    shape = getattr(w, "shape", None)
    if shape is None or not hasattr(w, "__getitem__"):
        raise TypeError(f"{argument} must be an array (NumPy, CuPy, PyTorch or JAX); got {type(w).__name__}")
    if len(shape) == 0 or shape[0] != layout_blocks:
        raise ValueError(
            f"{argument} must have one entry per present block along its first axis, (nnzb, ...) = "
            f"({layout_blocks}, ...) for this layout; got shape {tuple(shape)}"
        )


def _take(w, positions: np.ndarray):
    """``w[positions]`` along the first axis, the index moved to ``w``'s device for CuPy."""
    xp = array_module(w)
    return w[positions if xp is np else xp.asarray(positions)]


def from_openai(layout, w, z_order: bool = True):
    """Blocks stored in the seed's order, in bsmm's row-major order.

    Parameters
    ----------
    layout : (C // bs, K // bs) array
        The layout the seed's ``BlocksparseMatMul`` was built with.
    w : (nnzb, bs, bs) array
        Block data in the seed's order: a weight of the seed's ``w_shape``, its
        gradient, or any per-block array (the seed's gates ``(nnzb,)`` too). A
        NumPy, CuPy, PyTorch or JAX array.
    z_order : bool
        The seed's ``z_order`` (its default True).

    Returns
    -------
    array of ``w``'s library, shape and dtype
        ``w`` in bsmm's block order, a new array (``w`` is not changed), ready
        for :class:`bsmm.BlocksparseMatMul` over the same layout.

    Raises
    ------
    TypeError
        If ``w`` is not an array or ``z_order`` not a bool.
    ValueError
        If ``layout`` is invalid or ``w``'s first axis is not its number of
        present blocks.

    Examples
    --------
    >>> import numpy as np, bsmm
    >>> layout = np.array([[1, 0, 1], [1, 1, 0]])
    >>> op = bsmm.BlocksparseMatMul(layout, block_size=8)
    >>> w_openai = np.random.default_rng(0).standard_normal(op.w_shape)
    >>> w = from_openai(layout, w_openai)
    >>> bool((to_openai(layout, w) == w_openai).all())
    True
    """
    order = openai_block_order(layout, z_order)
    _check_blocks(w, order.size, "w")
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return _take(w, inverse)


def to_openai(layout, w, z_order: bool = True):
    """bsmm's block data in the seed's order, for the seed or a checkpoint of its format.

    Parameters
    ----------
    layout : (C // bs, K // bs) array
    w : (nnzb, bs, bs) array
        Block data in bsmm's (row-major) order, or any per-block array. A NumPy,
        CuPy, PyTorch or JAX array.
    z_order : bool
        The seed's ``z_order`` (its default True).

    Returns
    -------
    array of ``w``'s library, shape and dtype
        ``w`` in the seed's order, a new array; ``from_openai`` undoes it.

    Raises
    ------
    TypeError
        If ``w`` is not an array or ``z_order`` not a bool.
    ValueError
        If ``layout`` is invalid or ``w``'s first axis is not its number of
        present blocks.

    Examples
    --------
    >>> import numpy as np
    >>> w = np.arange(4.0)                                   # one number per block, bsmm's order
    >>> to_openai(np.ones((2, 2)), w).tolist()
    [0.0, 2.0, 1.0, 3.0]
    """
    order = openai_block_order(layout, z_order)
    _check_blocks(w, order.size, "w")
    return _take(w, order)

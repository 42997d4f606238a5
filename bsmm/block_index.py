"""The block index: which blocks of a weight are present, and in what order.

A *layout* is a 2-D array of 0/1 of shape ``(C // bs, K // bs)``; ``layout[c, k]``
says whether block ``(c, k)`` of the weight ``W`` (``C`` input features by ``K``
output features) is stored.

**Block order.** Block data is an array of shape ``(nnzb, bs, bs)`` in row-major
order over the layout, the order of ``np.nonzero(layout)`` and of
``scipy.sparse.bsr_array``: block ``b`` is
``W[rows[b]*bs:(rows[b]+1)*bs, indices[b]*bs:(indices[b]+1)*bs]``. Row-major
order makes ``to_scipy`` and ``from_scipy`` copy-free and puts the blocks each
``bprop`` output reads next to each other; ``fprop`` walks the same blocks in
column order through :attr:`BlockIndex.col_order`, a table built once.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np

from .config import settings

__all__ = ["BlockIndex", "block_index", "check_layout", "check_block_size"]


def check_block_size(block_size) -> int:
    """Return ``block_size`` as an int, or raise if bsmm has no kernels for it."""
    allowed = tuple(settings()["limits"]["block_sizes"])
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"block_size must be an int, one of {allowed}; got {block_size!r}")
    if int(block_size) not in allowed:
        raise ValueError(f"block_size must be one of {allowed}; got {block_size}")
    return int(block_size)


def check_layout(layout) -> np.ndarray:
    """Return ``layout`` as a read-only C-contiguous uint8 array of 0/1, or raise.

    Raises
    ------
    ValueError
        If ``layout`` is not 2-D, has an empty dimension, or holds values other than 0 and 1.
    """
    if hasattr(layout, "__cuda_array_interface__") and hasattr(layout, "get"):
        layout = layout.get()  # a CuPy layout: tables are built on the host anyway
    array = np.asarray(layout)
    if array.ndim != 2:
        raise ValueError(f"layout must be 2-D (C // block_size, K // block_size); got shape {array.shape}")
    if 0 in array.shape:
        raise ValueError(f"layout must have at least one block row and column; got shape {array.shape}")
    if array.dtype.kind not in "biuf":
        raise ValueError(f"layout must hold 0/1 numbers; got dtype {array.dtype}")
    if not np.isin(array, (0, 1)).all():
        bad = array[~np.isin(array, (0, 1))].flat[0].item()
        raise ValueError(f"layout must hold only 0 and 1; found {bad!r}")
    checked = np.ascontiguousarray(array, dtype=np.uint8)
    if checked is array:
        checked = checked.copy()  # never alias the caller's array: the index is cached
    checked.flags.writeable = False
    return checked


@dataclasses.dataclass(frozen=True, eq=False)
class BlockIndex:
    """The host-side index of a layout; built by :func:`block_index`, cached per layout.

    Attributes
    ----------
    layout : (CB, KB) uint8, read-only
        The layout, ``CB = C // block_size`` block rows, ``KB = K // block_size`` block columns.
    block_size : int
    indptr : (CB + 1,) int32
        Blocks of block row ``c`` are ``indptr[c]:indptr[c + 1]`` (scipy BSR convention).
    indices : (nnzb,) int32
        Block column of each block.
    rows : (nnzb,) int32
        Block row of each block (``indptr`` expanded).
    col_order : (nnzb,) int32
        Block ids sorted by block column, then row: the order in which ``fprop``
        and ``.T`` visit blocks.
    colptr : (KB + 1,) int32
        Blocks of block column ``k`` are ``col_order[colptr[k]:colptr[k + 1]]``.
    """

    layout: np.ndarray
    block_size: int
    indptr: np.ndarray
    indices: np.ndarray
    rows: np.ndarray
    col_order: np.ndarray
    colptr: np.ndarray

    @property
    def n_block_rows(self) -> int:
        return self.layout.shape[0]

    @property
    def n_block_cols(self) -> int:
        return self.layout.shape[1]

    @property
    def nnzb(self) -> int:
        return len(self.indices)

    @property
    def C(self) -> int:
        return self.layout.shape[0] * self.block_size

    @property
    def K(self) -> int:
        return self.layout.shape[1] * self.block_size

    @property
    def density(self) -> float:
        return self.nnzb / self.layout.size

    @property
    def w_shape(self) -> tuple[int, int, int]:
        return (self.nnzb, self.block_size, self.block_size)


def _build(layout: np.ndarray, block_size: int) -> BlockIndex:
    rows, cols = np.nonzero(layout)
    indptr = np.zeros(layout.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=layout.shape[0]), out=indptr[1:])
    col_order = np.lexsort((rows, cols))
    colptr = np.zeros(layout.shape[1] + 1, dtype=np.int64)
    np.cumsum(np.bincount(cols, minlength=layout.shape[1]), out=colptr[1:])
    tables = [a.astype(np.int32) for a in (indptr, cols, rows, col_order, colptr)]
    for table in tables:
        table.flags.writeable = False
    return BlockIndex(layout, block_size, *tables)


_CACHE: collections.OrderedDict = collections.OrderedDict()
_CACHE_SIZE = 64
_CACHE_LOCK = threading.Lock()


def block_index(layout, block_size: int = 32) -> BlockIndex:
    """Validate ``layout`` and return its :class:`BlockIndex`, built once per layout.

    Parameters
    ----------
    layout : (C // block_size, K // block_size) array of 0/1
    block_size : int
        One of ``bsmm.toml``'s ``limits.block_sizes`` (8, 16, 32, 64, 128).

    Examples
    --------
    >>> import numpy as np
    >>> index = block_index(np.array([[1, 0], [1, 1]]), block_size=8)
    >>> index.indptr.tolist(), index.indices.tolist(), index.col_order.tolist()
    ([0, 1, 3], [0, 0, 1], [0, 1, 2])
    """
    block_size = check_block_size(block_size)
    checked = check_layout(layout)
    if checked.size * block_size * block_size >= 2**62:
        raise ValueError(f"layout {checked.shape} with block_size {block_size} is too large")
    key = (checked.shape, block_size, np.packbits(checked).tobytes())
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
        if cached is not None:
            _CACHE.move_to_end(key)
            return cached
    built = _build(checked, block_size)
    with _CACHE_LOCK:
        _CACHE[key] = built
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return built

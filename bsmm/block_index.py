"""The block index: which blocks of a weight are present, and in what order.

A *layout* is a 2-D array of shape ``(C // bs, K // bs)``; ``layout[c, k] != 0``
says that block ``(c, k)`` of the weight ``W`` (``C`` input features by ``K``
output features) is stored. Any finite non-zero number means present; NaN and
infinities are refused. Checked layouts are kept as uint8 0/1.

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

from bsmm.arrays import check_plain_ndarray
from bsmm.config import settings

__all__ = ["BlockIndex", "block_index", "check_layout", "check_block_size", "present_blocks", "stable_order",
           "MAX_BLOCKS"]


def check_block_size(block_size) -> int:
    """Return ``block_size`` as an int, or raise if bsmm has no kernels for it."""
    allowed = tuple(settings()["limits"]["block_sizes"])
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"block_size must be an int, one of {allowed}; got {block_size!r}")
    if int(block_size) not in allowed:
        raise ValueError(f"block_size must be one of {allowed}; got {block_size}")
    return int(block_size)


#: Most present blocks a layout may have: the index tables are int32.
MAX_BLOCKS = 2**31 - 1
#: Most elements ``C * K`` of the ``W`` a layout describes.
MAX_ELEMENTS = 2**62 - 1
# Cells scanned at a time when a layout is checked: bounds the temporaries of huge layouts.
_SCAN_CELLS = 2**24


def _layout_array(layout) -> np.ndarray:
    """``layout`` as a NumPy array, checked by shape and dtype only: nothing of its size is allocated.

    A NumPy array (a broadcast view too) is used as it is, not copied.
    """
    check_plain_ndarray(layout, "layout")
    if hasattr(layout, "__cuda_array_interface__") and hasattr(layout, "get"):
        layout = layout.get()  # a CuPy layout: tables are built on the host anyway
    try:
        array = np.asarray(layout)
    except ValueError as error:  # e.g. [[1, 0], [1]]: NumPy's "inhomogeneous shape" message
        raise ValueError(
            f"layout must be a 2-D array (C // block_size, K // block_size) whose rows all have the same "
            f"length; got a ragged {type(layout).__name__} ({error})"
        ) from error
    if array.ndim != 2:
        raise ValueError(f"layout must be 2-D (C // block_size, K // block_size); got shape {array.shape}")
    if 0 in array.shape:
        raise ValueError(f"layout must have at least one block row and column; got shape {array.shape}")
    if array.dtype.kind not in "biuf":
        raise ValueError(f"layout must hold numbers (bool, int or float); got dtype {array.dtype}")
    if max(array.shape) > MAX_BLOCKS:
        raise ValueError(f"layout may have at most {MAX_BLOCKS} block rows and columns; got shape {array.shape}")
    return array


def _row_chunks(array: np.ndarray):
    """Views of consecutive rows of ``array``, about ``_SCAN_CELLS`` cells each."""
    rows = max(1, _SCAN_CELLS // array.shape[1])
    for start in range(0, array.shape[0], rows):
        yield array[start:start + rows]


def _checked_values(array: np.ndarray) -> np.ndarray:
    """The read-only uint8 0/1 copy of a layout from :func:`_layout_array`, after its values are checked.

    Sizes are checked before anything of the layout's size is allocated.
    """
    if array.size > MAX_BLOCKS:  # else nnzb <= size fits: no count needed
        present = 0
        for chunk in _row_chunks(array):
            present += np.count_nonzero(chunk)
            if present > MAX_BLOCKS:
                raise ValueError(
                    f"layout may have at most {MAX_BLOCKS} present blocks (the block index is int32); "
                    f"got shape {array.shape} with at least {present} non-zeros"
                )
    if array.dtype.kind == "f":
        for chunk in _row_chunks(array):
            if not np.isfinite(chunk).all():
                bad = chunk[~np.isfinite(chunk)].flat[0].item()
                raise ValueError(f"layout must hold finite numbers (non-zero: present, 0: absent); found {bad!r}")
    checked = np.not_equal(array, 0).view(np.uint8)  # a new array: never aliases the caller's (the index is cached)
    checked.flags.writeable = False
    return checked


def check_layout(layout) -> np.ndarray:
    """Return ``layout`` as a new read-only C-contiguous uint8 array of 0/1, or raise.

    Any finite non-zero value (bool, int or float) means a present block.

    Raises
    ------
    TypeError
        If ``layout`` is a ``numpy.matrix`` or a masked array.
    ValueError
        If ``layout`` is ragged, not 2-D, has an empty dimension, holds something
        other than numbers, holds NaN or an infinity, or has more than
        :data:`MAX_BLOCKS` present blocks.

    Examples
    --------
    >>> check_layout([[2, 0], [0.5, -1]]).tolist()
    [[1, 0], [1, 1]]
    """
    return _checked_values(_layout_array(layout))


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


def present_blocks(layout: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, columns) of the non-zero entries of a 2-D ``layout``, row-major: ``np.nonzero(layout)``,
    several times faster (one pass over the flat layout; planning a changed layout runs this often).

    Examples
    --------
    >>> rows, columns = present_blocks(np.array([[0, 1], [1, 1]]))
    >>> rows.tolist(), columns.tolist()
    ([0, 1, 1], [1, 0, 1])
    """
    flat = np.flatnonzero(layout)  # (fastest on a bool array)
    rows = flat // max(1, layout.shape[1])
    return rows, flat - rows * layout.shape[1]


def stable_order(keys: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` of non-negative int ``keys`` below ``bound``: a radix sort where
    they fit in 16 bits, which NumPy sorts in linear time.

    Examples
    --------
    >>> stable_order(np.array([2, 0, 2, 1]), 3).tolist()
    [1, 3, 0, 2]
    """
    return np.argsort(keys.astype(np.uint16) if bound <= 2**16 else keys, kind="stable")


def _build(layout: np.ndarray, block_size: int) -> BlockIndex:
    rows, cols = present_blocks(layout.view(bool))  # (the checked layout holds 0 and 1 only)
    indptr = np.zeros(layout.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=layout.shape[0]), out=indptr[1:])
    col_order = stable_order(cols, layout.shape[1])  # (rows already ascend: by column, then row)
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
    layout : (C // block_size, K // block_size) array
        Non-zero (finite) entries are present blocks; see :func:`check_layout`.
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
    array = _layout_array(layout)
    elements = array.size * block_size * block_size
    if elements > MAX_ELEMENTS:  # before the values are scanned: a broadcast view may be this large
        raise ValueError(
            f"layout of shape {array.shape} with block_size {block_size} describes a W of {elements} elements; "
            f"at most {MAX_ELEMENTS} are supported"
        )
    checked = _checked_values(array)
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

"""``BlockSparseMatrix``: a block index plus block data, usable with ``@``."""

from __future__ import annotations

import numbers

import numpy as np
import scipy.sparse

from bsmm.arrays import array_module, as_operand, check_plain_ndarray
from bsmm.block_index import BlockIndex, block_index, check_block_size
from bsmm.dtypes import canonical_dtype
from bsmm.matmul import BlocksparseMatMul, blocks_to_dense

__all__ = ["BlockSparseMatrix"]


def _check_data(data) -> None:
    """Raise unless ``data`` is block data a product can use as it is.

    Contiguity is decided here, once, as the operator's passes decide it for ``w``:
    a strided ``data`` is refused rather than copied behind the caller's back.
    """
    operand = as_operand(data, "data")
    if operand.library not in ("numpy", "cupy"):
        raise TypeError(f"data must be a NumPy or CuPy array; got a {operand.library} {type(data).__name__}")
    canonical_dtype(data.dtype, "data", operand.backend)
    if not data.flags.c_contiguous:
        raise ValueError(
            f"data must be C-contiguous; got strides {data.strides} (pass np.ascontiguousarray(data))"
        )


def _real_scalar(value, expression: str):
    """``value`` as a scalar NumPy arithmetic keeps real, or raise naming ``other`` in ``expression``."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value
    if isinstance(value, (int, float)):  # bool too
        return value
    if isinstance(value, numbers.Real):  # e.g. fractions.Fraction, which NumPy would take as an object
        return float(value)
    raise TypeError(
        f"{expression} needs other a real scalar (int, float, a NumPy real scalar or 0-d array); "
        f"got {type(value).__name__}"
    )


def _check_zero_shift(other, expression: str) -> None:
    """Raise unless ``other`` is a zero scalar: any other shift makes the absent blocks non-zero."""
    if _real_scalar(other, expression) != 0:
        raise NotImplementedError(
            f"{expression} with a non-zero scalar makes the absent blocks non-zero (a dense result), so it is "
            f"not supported, as in scipy.sparse; got other={other!r} (compute it on W.toarray())"
        )


class BlockSparseMatrix:
    """A block-sparse matrix ``W`` (C, K): its layout and its present blocks.

    Parameters
    ----------
    layout : (C // block_size, K // block_size) array
        Non-zero (finite) entries are present blocks.
    data : (nnzb, bs, bs) C-contiguous NumPy or CuPy array
        The present blocks in row-major order over the layout; ``block_size`` is
        ``data.shape[1]``. Held, not copied. float32, float16 or bfloat16;
        float64 as a NumPy array (the CPU backend only).

    Raises
    ------
    TypeError
        If ``data`` is not a NumPy or CuPy array (``numpy.matrix`` and masked
        arrays included) or its dtype is not supported where it lives.
    ValueError
        If ``layout`` is invalid (see :func:`bsmm.block_index.check_layout`), or
        ``data`` is not of shape ``(nnzb, bs, bs)`` for it or not C-contiguous.

    ``W @ X``, ``X @ W``, ``W.T @ X`` and ``X @ W.T`` run the block-sparse
    passes; ``X`` may be 1-D or 2-D (a leading stack of rows on the left, too).
    ``.T`` is a view: it shares ``data`` and flips how the passes read it.

    SciPy's BSR names are here too: ``toarray()``, ``nnz``, ``blocksize``,
    ``data``, ``indices``, ``indptr`` and ``copy()``, so that
    ``scipy.sparse.bsr_array((W.data, W.indices, W.indptr), shape=W.shape)`` is
    ``W`` for NumPy data (see :attr:`indptr` for ``.T`` views). ``W * s``, ``s * W``, ``W / s``
    and ``-W`` scale the present blocks into a new matrix of the same layout and
    dtype; ``W + s`` and ``W - s`` are refused for ``s != 0``, as SciPy refuses
    them, since the absent blocks would stop being zero.

    Examples
    --------
    >>> import numpy as np, bsmm
    >>> rng = np.random.default_rng(0)
    >>> dense = rng.standard_normal((32, 48)).astype(np.float32)
    >>> dense[:16, 16:] = 0
    >>> W = bsmm.BlockSparseMatrix.from_dense(dense, block_size=16)
    >>> W.nnzb, W.shape
    (4, (32, 48))
    >>> x = rng.standard_normal((5, 32)).astype(np.float32)
    >>> bool(np.allclose(x @ W, x @ dense, atol=1e-4)), bool(np.allclose(W.T @ x.T, dense.T @ x.T, atol=1e-4))
    (True, True)
    >>> W.blocksize, W.nnz, W.indptr.tolist(), W.indices.tolist()
    ((16, 16), 1024, [0, 1, 4], [0, 0, 1, 2])
    >>> bool(np.array_equal((-2 * W / 4).toarray(), dense * -0.5))
    True
    """

    # NumPy and CuPy arrays return NotImplemented from ``array @ W`` so Python calls __rmatmul__.
    __array_ufunc__ = None

    def __init__(self, layout, data, *, _index: BlockIndex | None = None, _transposed: bool = False):
        if _index is None:
            shape = getattr(data, "shape", None)
            if shape is None or len(shape) != 3 or shape[1] != shape[2]:
                raise ValueError(f"data must have shape (nnzb, bs, bs); got {shape}")
            _index = block_index(layout, shape[1])
            if tuple(shape) != _index.w_shape:
                raise ValueError(f"data must have shape {_index.w_shape} for this layout; got {tuple(shape)}")
            _check_data(data)
        self.index = _index
        self.data = data
        self.transposed = _transposed

    # -- description -----------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return (self.index.K, self.index.C) if self.transposed else (self.index.C, self.index.K)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def block_size(self) -> int:
        return self.index.block_size

    @property
    def layout(self) -> np.ndarray:
        """The layout of this matrix (the transpose of the stored one for a ``.T`` view)."""
        return self.index.layout.T if self.transposed else self.index.layout

    @property
    def nnzb(self) -> int:
        return self.index.nnzb

    @property
    def density(self) -> float:
        return self.index.density

    @property
    def blocksize(self) -> tuple[int, int]:
        """``(block_size, block_size)``, SciPy's name for the shape of a block."""
        return (self.index.block_size, self.index.block_size)

    @property
    def nnz(self) -> int:
        """Stored elements, ``nnzb * block_size ** 2`` (SciPy's ``nnz`` of a BSR matrix: zeros in blocks count)."""
        return self.index.nnzb * self.index.block_size ** 2

    @property
    def indptr(self) -> np.ndarray:
        """(C // block_size + 1,) int32, read-only: block row ``r``'s blocks are ``data[indptr[r]:indptr[r + 1]]``.

        With :attr:`indices` and ``data`` this is SciPy's BSR triple, shared with
        the block index (not copied). A ``.T`` view has none: it shares ``data``
        in the stored matrix's order, which no index of the view's rows describes.

        Raises
        ------
        ValueError
            On a ``.T`` view; ``view.to_scipy()`` is a BSR copy in the view's
            order, ``view.T.indptr`` the index of the shared ``data``.
        """
        return self._stored_table("indptr")

    @property
    def indices(self) -> np.ndarray:
        """(nnzb,) int32, read-only: the block column of each block of ``data``; see :attr:`indptr`."""
        return self._stored_table("indices")

    def _stored_table(self, name: str) -> np.ndarray:
        if self.transposed:
            raise ValueError(
                f"{name} of a .T view is not defined: the view shares data in the stored matrix's block order; "
                f"use view.to_scipy() for a BSR copy of the view, or view.T.{name} for the order of data"
            )
        return getattr(self.index, name)

    @property
    def T(self) -> "BlockSparseMatrix":
        """The transpose, sharing ``data`` (no copy)."""
        return BlockSparseMatrix(None, self.data, _index=self.index, _transposed=not self.transposed)

    def __repr__(self) -> str:
        return (
            f"BlockSparseMatrix(shape={self.shape}, block_size={self.block_size}, nnzb={self.nnzb}, "
            f"density={self.density:.3g}, dtype={self.dtype}{', transposed view' if self.transposed else ''})"
        )

    # -- conversions -----------------------------------------------------------------------
    def to_dense(self):
        """The dense matrix, of ``data``'s library and dtype; absent blocks are zero."""
        dense = blocks_to_dense(self.index, self.data)
        return dense.T if self.transposed else dense

    def toarray(self):
        """The dense matrix, as :meth:`to_dense` (SciPy's name)."""
        return self.to_dense()

    def copy(self) -> "BlockSparseMatrix":
        """A matrix of the same layout, orientation and dtype holding a copy of ``data``."""
        return self._with_data(self.data.copy())

    def _with_data(self, data) -> "BlockSparseMatrix":
        """A matrix of this layout and orientation over ``data``, cast back to this matrix's dtype."""
        if data.dtype != self.data.dtype:
            data = data.astype(self.data.dtype)
        return BlockSparseMatrix(None, data, _index=self.index, _transposed=self.transposed)

    def astype(self, dtype) -> "BlockSparseMatrix":
        """A copy with block data cast to ``dtype`` (float32, float16 or bfloat16; float64 for NumPy data)."""
        backend = "cpu" if array_module(self.data) is np else "cuda"
        data = self.data.astype(canonical_dtype(dtype, "dtype", backend), order="C")
        return BlockSparseMatrix(None, data, _index=self.index, _transposed=self.transposed)

    @classmethod
    def from_dense(cls, dense, block_size: int = 32, *, threshold: float | None = None,
                   top_k: int | None = None, density: float | None = None) -> "BlockSparseMatrix":
        """Keep the blocks of ``dense`` (C, K) that matter, dropping the rest.

        With no selector, every block holding a non-zero is kept. ``threshold``
        keeps blocks whose Frobenius norm exceeds it; ``top_k`` keeps the k
        blocks of largest norm; ``density`` is ``top_k`` given as a fraction of
        all blocks (magnitude pruning). Ties keep the earlier block in row-major order.

        Raises
        ------
        ValueError
            If ``dense`` is not 2-D with both sides multiples of ``block_size``,
            or more than one selector is given, or a selector is out of range.
        """
        block_size = check_block_size(block_size)
        shape = tuple(getattr(dense, "shape", ()))
        if len(shape) != 2 or shape[0] % block_size or shape[1] % block_size:
            raise ValueError(f"dense must be 2-D with both sides multiples of block_size {block_size}; got shape {shape}")
        check_plain_ndarray(dense, "dense")
        canonical_dtype(dense.dtype, "dense", "cpu" if array_module(dense) is np else "cuda")
        xp = array_module(dense)
        blocked = dense.reshape(shape[0] // block_size, block_size, shape[1] // block_size, block_size)
        # float64 norms: float32 squares of tiny or huge entries underflow or overflow.
        norms = xp.sqrt((blocked.astype(np.float64) ** 2).sum(axis=(1, 3)))
        norms = norms.get() if xp is not np else norms
        selectors = {"threshold": threshold, "top_k": top_k, "density": density}
        chosen = [name for name, value in selectors.items() if value is not None]
        if len(chosen) > 1:
            raise ValueError(f"give at most one of threshold, top_k, density; got {', '.join(chosen)}")
        if density is not None:
            if not 0 <= density <= 1:
                raise ValueError(f"density must be in [0, 1]; got {density}")
            top_k = int(round(density * norms.size))
        if threshold is not None:
            layout = norms > threshold
        elif top_k is not None:
            if not 0 <= top_k <= norms.size:
                raise ValueError(f"top_k must be in [0, {norms.size}]; got {top_k}")
            keep = np.argsort(-norms, axis=None, kind="stable")[:top_k]
            layout = np.zeros(norms.size, dtype=np.uint8)
            layout[keep] = 1
            layout = layout.reshape(norms.shape)
        else:
            nonzero = (blocked != 0).any(axis=(1, 3))  # NaN != 0, so NaN blocks stay too
            layout = nonzero.get() if xp is not np else nonzero
        index = block_index(layout.astype(np.uint8), block_size)
        data = xp.ascontiguousarray(blocked[xp.asarray(index.rows), :, xp.asarray(index.indices), :])
        return cls(None, data, _index=index)

    def to_scipy(self) -> scipy.sparse.bsr_array:
        """This matrix as ``scipy.sparse.bsr_array`` (float32 for float16/bfloat16, which SciPy lacks).

        The float32 or float64 block data of an untransposed matrix is shared, not copied.
        """
        data = self.data.get() if array_module(self.data) is not np else self.data
        if data.dtype not in (np.float32, np.float64):
            data = data.astype(np.float32)
        index = self.index
        if not self.transposed:
            return scipy.sparse.bsr_array((data, index.indices, index.indptr), shape=self.shape)
        order = index.col_order
        return scipy.sparse.bsr_array(
            (data[order].transpose(0, 2, 1), index.rows[order], index.colptr), shape=self.shape
        )

    @classmethod
    def from_scipy(cls, matrix, block_size: int | None = None, dtype=None) -> "BlockSparseMatrix":
        """From any ``scipy.sparse`` matrix or array; blocks come from its BSR form.

        ``block_size`` defaults to the matrix's own for a square-blocked BSR
        input. Explicitly stored zero blocks stay present. ``dtype`` defaults to
        the matrix's if float32 or float64 (the result is NumPy data), else float32.
        """
        if not scipy.sparse.issparse(matrix):
            raise TypeError(f"matrix must be a scipy.sparse matrix or array; got {type(matrix).__name__}")
        if block_size is None:
            blocksize = getattr(matrix, "blocksize", None)
            if blocksize is None or blocksize[0] != blocksize[1]:
                raise ValueError(f"block_size is needed for a {matrix.format} matrix without square blocks")
            block_size = blocksize[0]
        block_size = check_block_size(block_size)
        rows, cols = matrix.shape
        if rows % block_size or cols % block_size:
            raise ValueError(f"matrix shape {matrix.shape} is not a multiple of block_size {block_size}")
        if matrix.format == "bsr" and tuple(matrix.blocksize) == (block_size, block_size):
            bsr = scipy.sparse.bsr_array(matrix, copy=True)
        else:  # re-block through CSR; BSR of another block size does not re-block directly
            bsr = scipy.sparse.bsr_array(matrix.tocsr(), blocksize=(block_size, block_size))
        bsr.sum_duplicates()
        bsr.sort_indices()
        layout = np.zeros((rows // block_size, cols // block_size), dtype=np.uint8)
        layout[np.repeat(np.arange(layout.shape[0]), np.diff(bsr.indptr)), bsr.indices] = 1
        if dtype is None:
            dtype = bsr.dtype if bsr.dtype in (np.float32, np.float64) else np.float32
        data = np.ascontiguousarray(bsr.data, dtype=canonical_dtype(dtype, "dtype", "cpu"))
        return cls(layout, data)

    # -- arithmetic with scalars -----------------------------------------------------------------
    # Results keep this matrix's dtype (the kernels' dtypes), where SciPy would promote as NumPy
    # does (float32 * np.float64(2) is float64 there; W / 2 too). Only the present blocks change:
    # W * nan leaves absent blocks zero, as in SciPy.
    def __mul__(self, other) -> "BlockSparseMatrix":
        return self._with_data(self.data * _real_scalar(other, "W * other"))

    def __rmul__(self, other) -> "BlockSparseMatrix":
        return self._with_data(_real_scalar(other, "other * W") * self.data)

    def __truediv__(self, other) -> "BlockSparseMatrix":
        divisor = _real_scalar(other, "W / other")
        if divisor == 0:  # the absent blocks would be 0 / 0 = nan: not block-sparse (SciPy raises for a 0 too)
            raise ZeroDivisionError(f"W / other needs other != 0; got {other!r}")
        return self._with_data(self.data / divisor)

    def __rtruediv__(self, other):
        raise TypeError(
            f"other / W is not supported: dividing by a block-sparse matrix divides by its absent zeros "
            f"(SciPy refuses it too); got other of type {type(other).__name__}"
        )

    def __neg__(self) -> "BlockSparseMatrix":
        return self._with_data(-self.data)

    def __add__(self, other) -> "BlockSparseMatrix":
        _check_zero_shift(other, "W + other")
        return self.copy()

    def __radd__(self, other) -> "BlockSparseMatrix":
        _check_zero_shift(other, "other + W")
        return self.copy()

    def __sub__(self, other) -> "BlockSparseMatrix":
        _check_zero_shift(other, "W - other")
        return self.copy()

    def __rsub__(self, other) -> "BlockSparseMatrix":
        _check_zero_shift(other, "other - W")
        return -self

    # -- products ----------------------------------------------------------------------------
    def _op(self, feature_axis: int) -> BlocksparseMatMul:
        return BlocksparseMatMul.from_index(self.index, feature_axis)

    def __matmul__(self, other):
        return self._product(other, matrix_on_left=True)

    def __rmatmul__(self, other):
        return self._product(other, matrix_on_left=False)

    def _product(self, other, matrix_on_left: bool):
        operand = as_operand(other, "other")
        array = operand.array
        if array.ndim == 1:
            column = other.reshape(-1, 1) if matrix_on_left else other.reshape(1, -1)
            result = self._product(column, matrix_on_left)
            return result.reshape(-1)
        if array.ndim > 2:
            if matrix_on_left:
                raise ValueError(f"W @ other needs other 1-D or 2-D; got {array.ndim}-D")
            flat = self._product(other.reshape(-1, array.shape[-1]), matrix_on_left)
            return flat.reshape(tuple(array.shape[:-1]) + (self.shape[1],))
        # W @ X is bprop with X's rows as W's columns; X @ W is fprop. A transposed view swaps the two.
        use_fprop = matrix_on_left == self.transposed
        inner = self.shape[1] if matrix_on_left else self.shape[0]
        if array.shape[0 if matrix_on_left else 1] != inner:
            raise ValueError(
                f"shapes {self.shape if matrix_on_left else tuple(array.shape)} and "
                f"{tuple(array.shape) if matrix_on_left else self.shape} do not align for @ (inner {inner})"
            )
        # Features run along axis 0 of X when W is on the left. An F-ordered X is used
        # through its C-ordered transpose with the other feature axis, so nothing is copied.
        feature_axis = 0 if matrix_on_left else 1
        if not array.flags.c_contiguous and array.flags.f_contiguous:
            run = self._op(1 - feature_axis).fprop if use_fprop else self._op(1 - feature_axis).bprop
            return run(other.T, self.data).T
        if not array.flags.c_contiguous:
            other = array_module(array).ascontiguousarray(array)  # strided views: one copy
        run = self._op(feature_axis).fprop if use_fprop else self._op(feature_axis).bprop
        return run(other, self.data)

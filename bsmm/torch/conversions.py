"""``BlockSparseMatrix`` to and from PyTorch's block-sparse tensors (``layout=torch.sparse_bsr``);
a ``BlockSparseLinear``'s weight to one.

The two formats store the same thing: bsmm's ``data`` (nnzb, bs, bs), blocks in row-major
order over the layout with sorted block columns, is exactly a BSR tensor's ``values()``
beside its ``crow_indices()`` (bsmm's ``indptr``) and ``col_indices()`` (``indices``). So
the block values cross without a copy, through DLPack, on the CPU and on CUDA; the two
index vectors (``nnzb + C // bs + 1`` integers) are always copied, into int64 as
``Tensor.to_sparse_bsr`` makes them, so that neither side can change the other's index.

Where the layouts differ the values are copied, or, with ``copy=False``, refused:

- a ``.T`` view of a matrix stores its blocks in the other order and transposed;
- BSR values that are not contiguous (bsmm reads dense memory).

Refused always: a tensor of another layout, batched or hybrid BSR, blocks that are not
square or not of one of bsmm's block sizes, column indices not sorted and distinct
within each block row (an invariant ``torch.sparse_bsr_tensor`` does not check unless
asked), dtypes bsmm does not run where the tensor lives (float64 on CUDA, integers).
"""

from __future__ import annotations

import numpy as np
import torch

from bsmm.arrays import array_module
from bsmm.block_index import block_index
from bsmm.config import settings
from bsmm.matrix import BlockSparseMatrix
from bsmm.torch.checks import check_dtype
from bsmm.torch.passes import _shared_as

__all__ = ["from_sparse_bsr", "to_sparse_bsr"]


def _tensor_of(array) -> torch.Tensor:
    """A NumPy or CuPy array as a tensor over the same memory (bfloat16 through an int16 view)."""
    if array.dtype.name == "bfloat16":  # DLPack's bfloat16 code is unknown to NumPy: share the bits
        return torch.from_dlpack(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_dlpack(array)


def to_sparse_bsr(matrix, *, copy: bool | None = None) -> torch.Tensor:
    """``matrix`` as a ``torch.sparse_bsr`` tensor of its shape, blocksize and dtype.

    Parameters
    ----------
    matrix : BlockSparseMatrix (C, K), or BlockSparseLinear
        NumPy data gives a CPU tensor, CuPy data a tensor on the same CUDA device.
        A :class:`~bsmm.torch.BlockSparseLinear` gives its weight ``W`` in bsmm's
        orientation, (in_features, out_features), on the weight's device
        (:meth:`BlockSparseLinear.to_sparse_bsr`). ``nn.Linear`` stores the
        transpose, (out_features, in_features): ``bsr.t()`` is that as a
        ``torch.sparse_bsc`` view (PyTorch transposes a BSR tensor into BSC, not
        BSR), and ``bsr.t().to_sparse_bsr((bs, bs))`` or
        ``layer.to_linear().weight.to_sparse_bsr((bs, bs))`` a BSR copy.
    copy : bool or None
        None: share the block values where the layouts allow (an untransposed
        matrix, a layer's weight), copy them otherwise (a ``.T`` view). True:
        always copy. False: share or raise.

    Returns
    -------
    torch.Tensor (C, K), layout ``torch.sparse_bsr``
        ``values()`` (nnzb, bs, bs) is ``matrix.data`` itself unless copied (for a
        layer: its ``weight``, differentiable, as :meth:`BlockSparseLinear.to_dense_weight`);
        ``crow_indices()`` and ``col_indices()`` are new int64 tensors.

    Raises
    ------
    TypeError
        If ``matrix`` is not a ``BlockSparseMatrix`` or a ``BlockSparseLinear``.
    ValueError
        If ``copy=False`` and ``matrix`` is a ``.T`` view.

    Examples
    --------
    >>> import numpy as np, torch, bsmm, bsmm.torch
    >>> dense = np.kron([[1, 0], [2, 3]], np.ones((8, 8))).astype(np.float32)
    >>> W = bsmm.BlockSparseMatrix.from_dense(dense, block_size=8)
    >>> bsr = bsmm.torch.to_sparse_bsr(W)
    >>> bsr.layout, bsr.crow_indices().tolist(), bsr.col_indices().tolist()
    (torch.sparse_bsr, [0, 1, 3], [0, 0, 1])
    >>> bsr.values().data_ptr() == W.data.ctypes.data  # shared, not copied
    True
    >>> bool(torch.equal(bsr.to_dense(), torch.from_numpy(dense)))
    True
    """
    if isinstance(matrix, torch.nn.Module) and hasattr(matrix, "to_sparse_bsr"):  # a BlockSparseLinear
        return matrix.to_sparse_bsr(copy=copy)
    if not isinstance(matrix, BlockSparseMatrix):
        raise TypeError(
            f"matrix must be a bsmm.BlockSparseMatrix or a bsmm.torch.BlockSparseLinear; got {type(matrix).__name__}"
        )
    index = matrix.index
    if matrix.transposed:
        if copy is False:
            raise ValueError(
                "matrix is a .T view, whose blocks are stored transposed and in the other order: its values cannot "
                "be shared with a BSR tensor; pass copy=None or copy=True for a copy"
            )
        xp = array_module(matrix.data)
        order = xp.asarray(index.col_order)
        values = xp.ascontiguousarray(matrix.data[order].transpose(0, 2, 1))
        crow, col = index.colptr, index.rows[index.col_order]
    else:
        values = matrix.data.copy() if copy else matrix.data
        crow, col = index.indptr, index.indices
    return _bsr(crow, col, _tensor_of(values), matrix.shape)


def weight_bsr(index, weight: torch.Tensor, copy: bool | None = None) -> torch.Tensor:
    """A layer's weight blocks (nnzb, bs, bs), in ``index``'s row-major order, as the BSR tensor of
    ``W`` (C, K): the values are ``weight`` itself (differentiable), or a clone with ``copy``."""
    return _bsr(index.indptr, index.indices, weight.clone() if copy else weight, (index.C, index.K))


def _bsr(crow: np.ndarray, col: np.ndarray, values: torch.Tensor, shape: tuple) -> torch.Tensor:
    """The BSR tensor of bsmm's index (``indptr`` and ``indices``, copied into int64) and ``values``."""
    return torch.sparse_bsr_tensor(
        torch.from_numpy(crow.astype(np.int64)).to(values.device),
        torch.from_numpy(col.astype(np.int64)).to(values.device),
        values, size=shape, check_invariants=False,  # bsmm's index is sorted and distinct by construction
    )


def from_sparse_bsr(tensor: torch.Tensor, *, copy: bool | None = None) -> BlockSparseMatrix:
    """A ``torch.sparse_bsr`` tensor as a :class:`~bsmm.BlockSparseMatrix`.

    Parameters
    ----------
    tensor : torch.Tensor (C, K), layout ``torch.sparse_bsr``
        Square blocks of one of bsmm's block sizes; on the CPU (the matrix
        holds NumPy data) or CUDA (CuPy data). Stored blocks stay present even
        when all zero. A tensor that requires grad is read through ``detach()``.
    copy : bool or None
        None: share ``values()`` when contiguous, copy them otherwise.
        True: always copy. False: share or raise.

    Raises
    ------
    TypeError
        If ``tensor`` is not a BSR tensor, or its dtype is not one bsmm runs on its device.
    ValueError
        If it is batched or hybrid, its blocks are not square or of a size bsmm
        has, its block columns are not sorted and distinct within each block
        row, it is on a device other than the CPU or CUDA, or ``copy=False``
        and its values are not contiguous.

    Examples
    --------
    >>> import torch, bsmm.torch
    >>> dense = torch.zeros(16, 32)
    >>> dense[8:, :8] = 1.5
    >>> W = bsmm.torch.from_sparse_bsr(dense.to_sparse_bsr((8, 8)))
    >>> W.layout.tolist(), W.shape
    ([[0, 0, 0, 0], [1, 0, 0, 0]], (16, 32))
    >>> bool((W.toarray() == dense.numpy()).all())
    True
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_bsr:
        got = tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(
            f"tensor must be a torch.Tensor of layout torch.sparse_bsr (make one with "
            f"tensor.to_sparse_bsr((block_size, block_size))); got {got}"
        )
    values = tensor.values().detach()
    if tensor.dim() != 2 or values.dim() != 3:
        raise ValueError(
            f"tensor must be a 2-D BSR tensor without batch or dense dimensions; got shape {tuple(tensor.shape)} "
            f"with values of shape {tuple(values.shape)}"
        )
    rows, cols = values.shape[1:]
    allowed = tuple(settings()["limits"]["block_sizes"])
    if rows != cols or rows not in allowed:
        raise ValueError(
            f"tensor must have square blocks of one of bsmm's block sizes {allowed}; got blocksize {(rows, cols)} "
            f"(re-block it with tensor.to_dense().to_sparse_bsr((block_size, block_size)))"
        )
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensor is on {tensor.device}; bsmm runs on the CPU and on CUDA GPUs")
    check_dtype(values.dtype, values.device, "tensor")
    crow = tensor.crow_indices().cpu().numpy()
    col = tensor.col_indices().cpu().numpy()
    layout = np.zeros((tensor.shape[0] // rows, tensor.shape[1] // rows), np.uint8)
    counts = np.diff(crow)
    if crow[0] != 0 or crow[-1] != col.size or (counts < 0).any() or (col.size and not
                                                                        0 <= col.min() <= col.max() < layout.shape[1]):
        raise ValueError(
            f"tensor's crow_indices {np.array2string(crow, threshold=16)} and col_indices "
            f"{np.array2string(col, threshold=16)} do not describe a BSR index of {layout.shape} blocks"
        )
    layout[np.repeat(np.arange(layout.shape[0]), counts), col] = 1
    index = block_index(layout, rows)
    # bsmm's block order is row-major with sorted columns: torch's BSR invariant, unchecked by default.
    if index.nnzb != col.size or not np.array_equal(index.indices, col):
        raise ValueError(
            f"tensor's col_indices must be sorted and distinct within each block row (torch's BSR invariants; "
            f"check them with torch.sparse.check_sparse_tensor_invariants); got col_indices "
            f"{np.array2string(col, threshold=16)} for crow_indices {np.array2string(crow, threshold=16)}"
        )
    if not values.is_contiguous():
        if copy is False:
            raise ValueError(
                f"tensor's values are not contiguous (strides {values.stride()}), so they cannot be shared; "
                f"pass copy=None or copy=True for a copy"
            )
        values = values.contiguous()
    elif copy:
        values = values.clone()
    if values.is_cuda:
        import cupy

        with cupy.cuda.Device(values.device.index):
            data = _shared_as(cupy, values)
    else:
        data = _shared_as(np, values)
    return BlockSparseMatrix(index.layout, data)

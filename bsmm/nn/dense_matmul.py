"""``DenseMatMul``: a dense matrix with the passes of :class:`~bsmm.BlocksparseMatMul`, for the
dense matrices of :class:`~bsmm.nn.lstm.BlocksparseLSTM` (an ordinary matrix product of the
array library: BLAS or cuBLAS)."""

from __future__ import annotations

import numpy as np

__all__ = ["DenseMatMul"]

_F64 = np.dtype(np.float64)
_F32 = np.dtype(np.float32)


class DenseMatMul:
    """A dense ``W`` (C, K) with the passes and signatures of :class:`~bsmm.BlocksparseMatMul`.

    Half-precision operands are multiplied in float32 and rounded once (also
    after ``accumulate``), as the block-sparse passes do.

    Examples
    --------
    >>> import numpy as np
    >>> op = DenseMatMul(3, 2)
    >>> out = np.ones((1, 2))
    >>> op.fprop(np.ones((1, 3)), np.ones(op.w_shape), out=out, accumulate=True).tolist()
    [[4.0, 4.0]]
    """

    density = 1.0

    def __init__(self, C: int, K: int):
        self.C, self.K = int(C), int(K)
        self.w_shape = (self.C, self.K)

    def fprop(self, x, w, out=None, accumulate: bool = False):
        """y = x·W, x (N, C) -> (N, K)."""
        return _gemm(x, w, out, accumulate)

    def bprop(self, dy, w, out=None, accumulate: bool = False):
        """dx = dy·Wᵀ, dy (N, K) -> (N, C)."""
        return _gemm(dy, w.T, out, accumulate)

    def updat(self, x, dy, out=None, accumulate: bool = False):
        """dW = xᵀ·dy, (C, K)."""
        return _gemm(x.T, dy, out, accumulate)

    def __repr__(self) -> str:
        return f"DenseMatMul(C={self.C}, K={self.K})"


def _gemm(a, b, out, accumulate: bool):
    dtype = a.dtype
    if dtype not in (_F32, _F64):
        a, b = a.astype(_F32), b.astype(_F32)
    product = a @ b
    if accumulate:
        if out is None:
            raise ValueError("accumulate=True needs out=, the buffer to add the product to")
        product += out
    if out is None:
        return product.astype(dtype, copy=False)
    out[...] = product
    return out

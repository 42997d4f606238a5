"""bsmm: block-sparse matrix multiplication whose zero blocks cost nothing.

>>> import numpy as np, bsmm
>>> op = bsmm.BlocksparseMatMul(np.eye(4, dtype=np.uint8), block_size=8)
>>> op.w_shape
(4, 8, 8)
"""

from . import initializers, layouts
from .block_index import BlockIndex, block_index
from .conv import BlocksparseConv
from .dtypes import SUPPORTED_DTYPES
from .lstm import BlocksparseLSTM
from .matmul import BlocksparseMatMul, blocks_to_dense, dense_to_blocks
from .matrix import BlockSparseMatrix

__all__ = [
    "BlockIndex",
    "BlockSparseMatrix",
    "BlocksparseConv",
    "BlocksparseLSTM",
    "BlocksparseMatMul",
    "SUPPORTED_DTYPES",
    "block_index",
    "blocks_to_dense",
    "dense_to_blocks",
    "initializers",
    "layouts",
]
__version__ = "0.1.0"

"""bsmm: block-sparse matrix multiplication whose zero blocks cost nothing.

>>> import numpy as np, bsmm
>>> op = bsmm.BlocksparseMatMul(np.eye(4, dtype=np.uint8), block_size=8)
>>> op.w_shape
(4, 8, 8)
"""

from .block_index import BlockIndex, block_index
from .dtypes import SUPPORTED_DTYPES
from .matmul import BlocksparseMatMul, blocks_to_dense, dense_to_blocks

__all__ = [
    "BlockIndex",
    "BlocksparseMatMul",
    "SUPPORTED_DTYPES",
    "block_index",
    "blocks_to_dense",
    "dense_to_blocks",
]
__version__ = "0.1.0"

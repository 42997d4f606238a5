"""bsmm: block-sparse matrix multiplication whose zero blocks cost nothing.

>>> import numpy as np, bsmm
>>> op = bsmm.BlocksparseMatMul(np.eye(4, dtype=np.uint8), block_size=8)
>>> op.w_shape
(4, 8, 8)
"""

import logging

from bsmm import initializers, layouts
from bsmm.backends.cuda.environment import check_gpu
from bsmm.block_index import BlockIndex, block_index
from bsmm.config import BsmmWarning
from bsmm.nn.conv import BlocksparseConv
from bsmm.dtypes import SUPPORTED_DTYPES
from bsmm.nn.lstm import BlocksparseLSTM
from bsmm.matmul import BlocksparseMatMul, blocks_to_dense, dense_to_blocks
from bsmm.matrix import BlockSparseMatrix
from bsmm import openai_format
from bsmm.normalization import l2_normalize, l2_normalize_grad
from bsmm.sharding import LayoutSplit, split_layout

__all__ = [
    "BlockIndex",
    "BlockSparseMatrix",
    "BlocksparseConv",
    "BlocksparseLSTM",
    "BlocksparseMatMul",
    "BsmmWarning",
    "LayoutSplit",
    "SUPPORTED_DTYPES",
    "block_index",
    "check_gpu",
    "blocks_to_dense",
    "dense_to_blocks",
    "initializers",
    "l2_normalize",
    "l2_normalize_grad",
    "layouts",
    "openai_format",
    "split_layout",
]
__version__ = "0.1.0"

#: Names a user may type for a class bsmm spells otherwise -> bsmm's name. The operators keep the
#: seed's spelling (BlocksparseMatMul); the matrix and the framework layers are BlockSparse*.
_SPELLINGS = {"BlockSparseMatMul": "BlocksparseMatMul", "BlockSparseConv": "BlocksparseConv",
              "BlockSparseLSTM": "BlocksparseLSTM", "BlocksparseMatrix": "BlockSparseMatrix"}


def __getattr__(name: str):
    """A missing attribute's error, naming the class meant where the name is another spelling of one."""
    hint = f"; the class is bsmm.{_SPELLINGS[name]}" if name in _SPELLINGS else ""
    raise AttributeError(f"module 'bsmm' has no attribute {name!r}{hint}")


# A library logs and leaves handlers to the application: records of the "bsmm" logger are shown
# only where the application configures logging (logging.basicConfig(level=logging.INFO)).
logging.getLogger(__name__).addHandler(logging.NullHandler())

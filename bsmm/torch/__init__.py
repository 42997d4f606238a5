"""PyTorch adapter: block-sparse ``x·W`` and convolutions as compilable operators and ``nn.Module`` layers.

>>> import numpy as np, torch, bsmm.torch
>>> layer = bsmm.torch.BlockSparseLinear(64, 64, np.array([[1, 0], [1, 1]]), block_size=32)
>>> layer.weight.shape, layer(torch.ones(5, 64)).shape
(torch.Size([3, 32, 32]), torch.Size([5, 64]))

- :mod:`~bsmm.torch.functional`: :func:`blocksparse_matmul` and :func:`blocksparse_conv`, under autocast.
- :mod:`~bsmm.torch.layers`: :class:`BlockSparseLinear`, :class:`BlockSparseConv1d`, ``2d`` and ``3d``;
  :func:`load_layouts` rebuilds a model's layers to the layouts of a checkpoint.
- :mod:`~bsmm.torch.mlp`: :class:`BlockSparseMLP`, a transformer's feed-forward block (GLU or not), its
  gate and up projections one product.
- :mod:`~bsmm.torch.sparsify`: :func:`sparsify`, a model's ``nn.Linear`` layers (and, with ``fuse_mlp``,
  its GLU MLP blocks) made block-sparse in one call.
- :mod:`~bsmm.torch.dynamic`: :class:`DynamicSparsity`, layouts that change while a model trains (RigL, SET),
  the number of blocks fixed and the optimizer's state moved with them; the growth signal
  (:func:`~bsmm.torch.dynamic.gradient_block_norms`).
- :mod:`~bsmm.torch.gates`: :class:`BlockGates`, learnable per-block gates with an L0 (hard-concrete)
  penalty; :func:`gate_layer` gives a layer gates, :func:`prune_by_gates` keeps the blocks whose gates are open.
- :mod:`~bsmm.torch.pruning`: :class:`GradualPruning`, magnitude pruning on a cubic schedule while a model
  trains (pruned blocks closed by a :class:`BlockMask`, which the kernels skip), then compacted.
- :mod:`~bsmm.torch.lstm`: :class:`BlockSparseLSTM`, one ``nn.LSTM`` layer on block-sparse (small-world) layouts.
- :mod:`~bsmm.torch.distributed`: :class:`ShardedBlockSparseLinear`, one layer's blocks spread over a
  process group (model parallelism); data parallelism is ``DistributedDataParallel`` or ``fully_shard``.
- :mod:`~bsmm.torch.conversions`: :func:`to_sparse_bsr` and :func:`from_sparse_bsr`, between
  :class:`bsmm.BlockSparseMatrix` (or a layer's weight) and ``torch.sparse_bsr`` tensors, the block values shared.
- :mod:`~bsmm.torch.ops` and :mod:`~bsmm.torch.conv_ops`: the ``torch.library`` operators both run, one per
  entry of the pass table and the fused bias + activation (``torch.compile(fullgraph=True)`` traces through
  them); their differentiation (:mod:`~bsmm.torch.eager`: autograd functions from the table's cotangents,
  gradients of any order stay block-sparse; :mod:`~bsmm.torch.autograd` for the convolutions), the passes on
  CPU and CUDA tensors, shared without copies (:mod:`~bsmm.torch.passes`), and the layouts by key
  (:mod:`~bsmm.torch.registry`: :func:`register`, :func:`lookup`).
"""

# First, for its clear ImportError when PyTorch is missing (the modules below import torch).
from bsmm.torch.ops import lookup, register
from bsmm.torch.functional import blocksparse_conv, blocksparse_matmul  # noqa: I001  (after ops: see above)
from bsmm.torch.conversions import from_sparse_bsr, to_sparse_bsr
from bsmm.torch.layers import BlockSparseConv1d, BlockSparseConv2d, BlockSparseConv3d, BlockSparseLinear, load_layouts
from bsmm.torch.lstm import BlockSparseLSTM
from bsmm.torch.glu import gated_unit
from bsmm.torch.mlp import BlockSparseMLP
from bsmm.torch.distributed import ShardedBlockSparseLinear
from bsmm.torch.normalization import l2_normalize
from bsmm.torch.sparsify import SparsifyReport, sparsify
from bsmm.torch.dynamic import DynamicSparsity
from bsmm.torch.gates import BlockGates, gate_layer, prune_by_gates
from bsmm.torch.pruning import BlockMask, GradualPruning

__all__ = ["BlockSparseConv1d", "BlockSparseConv2d", "BlockSparseConv3d", "BlockSparseLinear", "BlockSparseLSTM",
           "BlockSparseMLP", "ShardedBlockSparseLinear",
           "blocksparse_conv", "blocksparse_matmul", "register", "lookup",
           "from_sparse_bsr", "to_sparse_bsr", "l2_normalize", "load_layouts", "sparsify", "SparsifyReport",
           "gated_unit", "DynamicSparsity", "BlockGates", "gate_layer", "prune_by_gates", "BlockMask", "GradualPruning"]

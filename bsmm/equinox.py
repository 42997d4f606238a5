"""Equinox: :class:`BlockSparseLinear`, an ``eqx.Module`` over :mod:`bsmm.jax`.

``import bsmm.equinox`` imports Equinox and JAX (``import bsmm`` alone imports neither). The block
data and the bias are the module's array leaves, so ``eqx.filter_jit``, ``eqx.filter_grad``,
``eqx.apply_updates`` and ``eqx.tree_serialise_leaves`` see them as they see ``eqx.nn.Linear``'s;
the layout is a static field (part of the tree's structure), so ``jax.jit`` of the module works too.
"""

from __future__ import annotations

try:
    import equinox as eqx
except ImportError as error:
    raise ImportError("bsmm.equinox needs Equinox: pip install equinox") from error

import jax
import jax.numpy as jnp

from bsmm.dtypes import canonical_dtype
from bsmm.jax import BlockSparseDense
from bsmm.jax.layers import _linear
from bsmm.matmul import BlocksparseMatMul

__all__ = ["BlockSparseLinear"]


class BlockSparseLinear(eqx.Module):
    """A linear layer ``y = x·W + b`` whose ``W`` (in_features, out_features) is block-sparse.

    The counterpart of ``eqx.nn.Linear``; ``weight`` holds the present blocks only. Unlike
    ``eqx.nn.Linear`` it takes any leading axes (``x`` (..., C)), and under ``jax.vmap`` the
    batch folds into one pass.

    Parameters
    ----------
    in_features, out_features : int
        C and K; must equal ``layout.shape[0] * block_size`` and ``layout.shape[1] * block_size``.
    layout : (C // block_size, K // block_size) array of 0/1
        Present blocks of ``W``.
    block_size : int, default 32
        8, 16, 32, 64 or 128.
    use_bias : bool, default True
    feature_axis : {1, 0}, default 1
        1: ``x`` (..., C) to ``y`` (..., K); 0: ``x`` (C, N) or (C,) to (K, N) or (K,).
    dtype : dtype, default float32
        Dtype of ``weight`` and ``bias`` (float32, float16, bfloat16; float64 on the CPU with
        ``jax_enable_x64``).
    tf32 : bool, optional
        TF32 tensor cores for float32 on the GPU (see :class:`bsmm.BlocksparseMatMul`).
    key : jax.random key
        For the initial ``weight``: each block column drawn from N(0, 1 / fan-in), counting only
        present blocks (:meth:`bsmm.jax.BlockSparseDense.init`). ``bias`` starts at zero.

    Attributes
    ----------
    weight : (nnzb, bs, bs) array
        Block data in the layout's row-major block order (``op.w_shape``).
    bias : (out_features,) array, or None
    op : bsmm.BlocksparseMatMul
        The layout, a static field.

    Raises
    ------
    ValueError
        If ``in_features`` or ``out_features`` does not match the layout.

    Examples
    --------
    >>> import numpy as np, jax, jax.numpy as jnp, equinox as eqx, bsmm.equinox
    >>> layer = bsmm.equinox.BlockSparseLinear(32, 16, np.array([[1, 0], [1, 1], [0, 1], [1, 0]]), block_size=8,
    ...                                        key=jax.random.key(0))
    >>> x = jnp.ones((5, 32))
    >>> grads = eqx.filter_jit(eqx.filter_grad(lambda layer: (layer(x) ** 2).mean()))(layer)
    >>> layer = eqx.apply_updates(layer, jax.tree.map(lambda g: -0.1 * g, grads))   # one SGD step
    >>> layer(x).shape, jax.vmap(layer)(x).shape, layer.weight.shape
    ((5, 16), (5, 16), (5, 8, 8))
    """

    weight: jax.Array
    bias: jax.Array | None
    op: BlocksparseMatMul = eqx.field(static=True)
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)

    def __init__(self, in_features: int, out_features: int, layout, block_size: int = 32, use_bias: bool = True,
                 feature_axis: int = 1, dtype=jnp.float32, tf32: bool | None = None, *, key):
        # bsmm.jax's layer checks the features against the layout and draws the initial weight.
        dense = BlockSparseDense(in_features, out_features, layout, block_size=block_size, bias=use_bias,
                                 feature_axis=feature_axis, tf32=tf32)
        dtype = canonical_dtype(jnp.dtype(dtype), "dtype", "cpu")
        # (Drawn in float32, as bsmm.jax's init draws every dtype, so float64 parameters start the same.)
        params = jax.tree.map(lambda p: p.astype(dtype), dense.init(key))
        self.weight = params["w"]
        self.bias = params.get("b")
        self.op = dense.op
        self.in_features, self.out_features = self.op.C, self.op.K
        self.use_bias = bool(use_bias)

    def __call__(self, x, *, key=None):
        """``x·W + b``: (..., C) -> (..., K), or (C, N) -> (K, N) with ``feature_axis=0``.

        ``x`` and the parameters are promoted to one dtype; ``key`` is ignored (Equinox's convention).
        """
        return _linear(self.op, x, self.weight, self.bias, jnp.result_type(x, self.weight))

"""Flax NNX: :class:`BlockSparseLinear`, a ``flax.nnx.Module`` over :mod:`bsmm.jax`.

``import bsmm.flax`` imports Flax and JAX (``import bsmm`` alone imports neither). The block data
and the bias are ``nnx.Param`` variables, so ``nnx.state``, ``nnx.Optimizer``, ``nnx.jit`` and
``nnx.grad`` treat them as any other parameters; the layout is static (part of the graph
definition), so transforms never trace it.
"""

from __future__ import annotations

try:
    from flax import nnx
except ImportError as error:
    raise ImportError("bsmm.flax needs Flax (with its NNX API): pip install flax") from error

import jax.numpy as jnp

from bsmm.dtypes import canonical_dtype
from bsmm.jax import BlockSparseDense
from bsmm.jax.layers import _linear

__all__ = ["BlockSparseLinear"]


class BlockSparseLinear(nnx.Module):
    """A linear layer ``y = x·W + b`` whose ``W`` (in_features, out_features) is block-sparse.

    The NNX counterpart of ``nnx.Linear``: ``kernel`` holds the present blocks only.

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
    dtype : dtype, optional
        Dtype of the computation (float32, float16, bfloat16; float64 on the CPU with
        ``jax_enable_x64``); by default the promoted dtype of ``x`` and the parameters.
    param_dtype : dtype, default float32
        Dtype of ``kernel`` and ``bias``.
    kernel_init : initializer ``(key, shape, dtype) -> array``, optional
        Called with ``shape = (nnzb, bs, bs)``. The default draws each block column from
        N(0, 1 / fan-in), counting only present blocks (:meth:`bsmm.jax.BlockSparseDense.init`);
        Flax's own variance-scaling initializers would read the fans off the block data's shape.
    bias_init : initializer, default zeros
    tf32 : bool, optional
        TF32 tensor cores for float32 on the GPU (see :class:`bsmm.BlocksparseMatMul`).
    rngs : nnx.Rngs
        Keys for the initializers (its ``params`` stream).

    Attributes
    ----------
    kernel : nnx.Param (nnzb, bs, bs)
        Block data in the layout's row-major block order (``op.w_shape``).
    bias : nnx.Param (out_features,), or None
    op : bsmm.BlocksparseMatMul
        The layout, static.

    Raises
    ------
    ValueError
        If ``in_features`` or ``out_features`` does not match the layout.

    Examples
    --------
    >>> import numpy as np, jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import bsmm.flax
    >>> layer = bsmm.flax.BlockSparseLinear(32, 16, np.array([[1, 0], [1, 1], [0, 1], [1, 0]]), block_size=8,
    ...                                     rngs=nnx.Rngs(0))
    >>> x = jnp.ones((5, 32))
    >>> optimizer = nnx.Optimizer(layer, optax.sgd(0.1), wrt=nnx.Param)
    >>> @nnx.jit
    ... def step(layer, optimizer, x):
    ...     grads = nnx.grad(lambda layer: (layer(x) ** 2).mean())(layer)
    ...     optimizer.update(layer, grads)
    >>> step(layer, optimizer, x)
    >>> layer(x).shape, layer.kernel.shape
    ((5, 16), (5, 8, 8))
    """

    def __init__(self, in_features: int, out_features: int, layout, *, block_size: int = 32, use_bias: bool = True,
                 feature_axis: int = 1, dtype=None, param_dtype=jnp.float32, kernel_init=None,
                 bias_init=nnx.initializers.zeros_init(), tf32: bool | None = None, rngs: nnx.Rngs):
        # bsmm.jax's layer checks the features against the layout and draws the default kernel.
        dense = BlockSparseDense(in_features, out_features, layout, block_size=block_size, bias=False,
                                 feature_axis=feature_axis, tf32=tf32)
        self.op = dense.op
        param_dtype = canonical_dtype(jnp.dtype(param_dtype), "param_dtype", "cpu")
        dtype = None if dtype is None else canonical_dtype(jnp.dtype(dtype), "dtype", "cpu")
        key = rngs.params()
        # (Drawn in float32, as bsmm.jax's init draws every dtype, so float64 parameters start the same.)
        kernel = (dense.init(key)["w"].astype(param_dtype) if kernel_init is None
                  else kernel_init(key, self.op.w_shape, param_dtype))
        self.kernel = nnx.Param(kernel)
        self.bias = nnx.Param(bias_init(rngs.params(), (self.op.K,), param_dtype)) if use_bias else None
        self.in_features, self.out_features = self.op.C, self.op.K
        self.use_bias = bool(use_bias)
        self.dtype, self.param_dtype = dtype, param_dtype

    def __call__(self, x):
        """``x·W + b``: (..., C) -> (..., K), or (C, N) -> (K, N) with ``feature_axis=0``."""
        kernel = self.kernel[...]
        dtype = jnp.result_type(x, kernel) if self.dtype is None else self.dtype
        return _linear(self.op, x, kernel, None if self.bias is None else self.bias[...], dtype)

"""Layers over a params pytree: :class:`BlockSparseDense` and :class:`BlockSparseConv`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from bsmm.dtypes import canonical_dtype
from bsmm.jax.functional import blocksparse_conv, blocksparse_matmul
from bsmm.matmul import BlocksparseMatMul
from bsmm.nn.conv import BlocksparseConv

__all__ = ["BlockSparseConv", "BlockSparseDense"]


def _init_params(op, key, dtype, bias: bool) -> dict:
    """``w`` of ``op.w_shape``, Gaussian with std 1/sqrt(fan-in) (present blocks × block size × kernel taps
    of each output feature), and ``b`` zeros."""
    dtype = canonical_dtype(dtype, "dtype")
    layout = op.layout
    taps = math.prod(getattr(op, "kernel_size", ()))  # 1 for a product
    fan_in = np.count_nonzero(layout, axis=0)[np.nonzero(layout)[1]] * op.block_size * taps
    std = (1.0 / np.sqrt(fan_in)).astype(np.float32)
    w = jax.random.normal(key, op.w_shape, jnp.float32) * std[:, None, None]
    params = {"w": w.astype(dtype)}
    if bias:
        params["b"] = jnp.zeros((op.K,), dtype)
    return params


def _add_bias(params: dict, y, features: int, axis: int):
    """``y + params["b"]``, the bias (features,) running along ``axis`` of ``y``."""
    b = params["b"]
    if tuple(b.shape) != (features,):
        raise ValueError(f"params['b'] must have shape ({features},); got {tuple(b.shape)}")
    return y + b.reshape((-1,) + (1,) * (y.ndim - axis - 1)).astype(y.dtype)


def _linear(op: BlocksparseMatMul, x, weight, bias, dtype):
    """``x·W + b`` in ``dtype`` (``x``, ``weight`` and ``bias`` cast to it), ``bias`` (K,) or None: the forward
    of the Equinox and Flax layers, which keep their parameters in their own ways."""
    y = blocksparse_matmul(jnp.asarray(x, dtype), weight.astype(dtype), op)
    if bias is None:
        return y
    bias = bias.astype(dtype)
    return y + (bias if op.feature_axis == 1 else bias.reshape((-1,) + (1,) * (y.ndim - 1)))


class BlockSparseDense:
    """A dense layer ``y = x·W + b`` whose ``W`` (in_features, out_features) is block-sparse.

    Parameters live in a pytree (``{"w": (nnzb, bs, bs), "b": (out_features,)}``)
    that :meth:`init` creates and :meth:`apply` reads, so they combine with any
    JAX optimizer; the layer object itself holds only the static operator.

    Parameters
    ----------
    in_features, out_features : int
        C and K; must equal ``layout.shape[0] * block_size`` and ``layout.shape[1] * block_size``.
    layout : (C // block_size, K // block_size) array of 0/1
    block_size : int, default 32
    bias : bool, default True
    feature_axis : {1, 0}, default 1
        1: ``x`` is (..., C); 0: (C, N).
    tf32 : bool, optional
        Passed to :class:`bsmm.BlocksparseMatMul`.

    Raises
    ------
    ValueError
        If ``in_features``/``out_features`` do not match the layout.

    Examples
    --------
    >>> import numpy as np, jax, jax.numpy as jnp, bsmm.jax
    >>> layer = bsmm.jax.BlockSparseDense(32, 16, np.array([[1, 0], [1, 1], [0, 1], [1, 0]]), block_size=8)
    >>> params = layer.init(jax.random.key(0))
    >>> x = jnp.ones((5, 32))
    >>> loss = lambda params: (layer.apply(params, x) ** 2).mean()
    >>> grads = jax.jit(jax.grad(loss))(params)
    >>> params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)   # one SGD step
    >>> layer.apply(params, x).shape, params["w"].shape
    ((5, 16), (5, 8, 8))
    """

    def __init__(self, in_features: int, out_features: int, layout, block_size: int = 32, bias: bool = True,
                 feature_axis: int = 1, tf32: bool | None = None):
        self.op = BlocksparseMatMul(layout, block_size=block_size, feature_axis=feature_axis, tf32=tf32)
        for name, value, expected, axis in (("in_features", in_features, self.op.C, 0),
                                            ("out_features", out_features, self.op.K, 1)):
            if value != expected:
                raise ValueError(
                    f"{name} must be layout.shape[{axis}] * block_size = {expected}; got {value}"
                )
        self.bias = bool(bias)

    def init(self, key, dtype=jnp.float32) -> dict:
        """Initial parameters: ``w`` Gaussian with std 1/sqrt(fan-in), ``b`` zeros.

        The fan-in of an output feature counts only present blocks (as
        :func:`bsmm.initializers.normal`), so outputs start at unit variance for
        unit-variance inputs whatever the density.

        Parameters
        ----------
        key : jax.random key
        dtype : float32, float16 or bfloat16

        Returns
        -------
        dict with ``"w"`` (nnzb, bs, bs) and, with bias, ``"b"`` (out_features,)
        """
        return _init_params(self.op, key, dtype, self.bias)

    def apply(self, params: dict, x):
        """``x·W + b``: (..., C) -> (..., K) (feature_axis 1) or (C, N) -> (K, N) (feature_axis 0)."""
        y = blocksparse_matmul(x, params["w"], self.op)
        return _add_bias(params, y, self.op.K, y.ndim - 1 if self.op.feature_axis == 1 else 0) if self.bias else y

    __call__ = apply

    def __repr__(self) -> str:
        return (f"BlockSparseDense(in_features={self.op.C}, out_features={self.op.K}, "
                f"block_size={self.op.block_size}, blocks={self.op.blocks}, bias={self.bias}, "
                f"feature_axis={self.op.feature_axis})")


class BlockSparseConv:
    """A convolution layer ``y = conv(x, W) + b`` whose channel connectivity is block-sparse.

    Parameters live in a pytree ``{"w": (*kernel_size, nnzb, bs, bs), "b": (out_channels,)}``
    made by :meth:`init` and read by :meth:`apply`; the layer holds only the static
    :class:`bsmm.nn.conv.BlocksparseConv` (``self.conv``).

    Parameters
    ----------
    in_channels, out_channels : int
        C and K; ``layout.shape[0] * block_size`` and ``layout.shape[1] * block_size``.
    kernel_size : int or tuple of 1 to 3 ints
        An int is a square 2-D kernel; a tuple's length is the spatial rank.
    layout : (C // block_size, K // block_size) array of 0/1
    block_size : int, default 32
    stride, padding, dilation, channels_last, tf32
        As :class:`bsmm.nn.conv.BlocksparseConv`: channels last (N, *spatial, C) by default, JAX's usual layout.
    bias : bool, default True

    Examples
    --------
    >>> import numpy as np, jax, jax.numpy as jnp, bsmm.jax
    >>> layer = bsmm.jax.BlockSparseConv(16, 16, 3, np.array([[1, 0], [1, 1]]), block_size=8, stride=2, padding=1)
    >>> params = layer.init(jax.random.key(0))
    >>> x = jnp.ones((2, 9, 9, 16))
    >>> grads = jax.jit(jax.grad(lambda p: (layer.apply(p, x) ** 2).mean()))(params)
    >>> layer.apply(params, x).shape, grads["w"].shape
    ((2, 5, 5, 16), (3, 3, 3, 8, 8))
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, layout, block_size: int = 32, stride=1,
                 padding=0, dilation=1, bias: bool = True, channels_last: bool = True, tf32: bool | None = None):
        self.conv = BlocksparseConv(layout, block_size, kernel_size, stride, padding, dilation, channels_last, tf32)
        for name, value, expected, axis in (("in_channels", in_channels, self.conv.C, 0),
                                            ("out_channels", out_channels, self.conv.K, 1)):
            if value != expected:
                raise ValueError(f"{name} must be layout.shape[{axis}] * block_size = {expected}; got {value}")
        self.bias = bool(bias)

    def init(self, key, dtype=jnp.float32) -> dict:
        """Initial parameters: ``w`` Gaussian with std 1/sqrt(fan-in), fan-in counting the present
        blocks of an output channel's block column times the kernel volume; ``b`` zeros."""
        return _init_params(self.conv, key, dtype, self.bias)

    def apply(self, params: dict, x):
        """(N, *spatial, C) -> (N, *out, K), or channels first with ``channels_last=False``."""
        y = blocksparse_conv(x, params["w"], self.conv)
        return _add_bias(params, y, self.conv.K, y.ndim - 1 if self.conv.channels_last else 1) if self.bias else y

    __call__ = apply

    def __repr__(self) -> str:
        return f"BlockSparseConv({self.conv!r}, bias={self.bias})"

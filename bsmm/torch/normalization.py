"""The seed's weight normalization (:func:`bsmm.normalization.l2_normalize`) in PyTorch operations.

Written in differentiable torch operations, so autograd gives the gradients of ``w`` and ``gain``
(the clamp at ``epsilon`` passes the gradient where the squared norm is at least ``epsilon``, as
the seed's kernel does). Nothing waits for the device: the block columns come from a tensor made
once per layout and device.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from bsmm.block_index import BlockIndex
from bsmm.normalization import DEFAULT_EPSILON, block_index_of, check_epsilon, check_gain_shape, check_w_shape

__all__ = ["l2_normalize"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# BlockIndex -> {device: its block columns as an int64 tensor there}; gone with the index.
_COLUMNS: "weakref.WeakKeyDictionary[BlockIndex, dict]" = weakref.WeakKeyDictionary()
_COLUMNS_LOCK = threading.Lock()


def _columns(index: BlockIndex, device: torch.device) -> torch.Tensor:
    with _COLUMNS_LOCK:
        by_device = _COLUMNS.setdefault(index, {})
        columns = by_device.get(device)
        if columns is None:
            columns = by_device[device] = torch.from_numpy(index.indices.astype(np.int64)).to(device)
        return columns


def _check_tensor(value, argument: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor; got {type(value).__name__}")
    if value.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{argument} has dtype {value.dtype}; supported dtypes are float16, bfloat16, float32, float64")


def l2_normalize(w: torch.Tensor, op, gain: torch.Tensor | None = None,
                 epsilon: float = DEFAULT_EPSILON) -> torch.Tensor:
    """Block data with each output feature scaled to norm ``gain`` over its present blocks.

    ``y[b, i, j] = gain[f] * w[b, i, j] / sqrt(max(s[f], epsilon))``, ``s[f]`` the
    squared norm of output feature ``f = indices[b] * bs + j`` over the present
    blocks of its block column (see :mod:`bsmm.normalization`). Differentiable in
    ``w`` and ``gain``; sums in float32 (float64 for float64 ``w``).

    Parameters
    ----------
    w : (nnzb, bs, bs) tensor
        Block data (``op.w_shape``): float16, bfloat16, float32 or float64.
    op : bsmm.BlocksparseMatMul or bsmm.BlockIndex
        The layout (a ``BlockSparseLinear``'s is ``layer.op``).
    gain : (K,) tensor on w's device, optional
        Norm of each output feature after scaling; any float dtype.
    epsilon : float
        Lower bound of the squared norm (finite, > 0).

    Returns
    -------
    (nnzb, bs, bs) tensor of w's dtype and device

    Raises
    ------
    TypeError
        If ``w`` or ``gain`` is not a float tensor, ``op`` is of another type, or
        ``epsilon`` is not a real number.
    ValueError
        If a shape does not fit ``op``, ``gain`` is on another device, or
        ``epsilon`` is not finite and > 0.

    Examples
    --------
    >>> import numpy as np, torch, bsmm.torch
    >>> from bsmm.torch.normalization import l2_normalize
    >>> layer = bsmm.torch.BlockSparseLinear(16, 16, np.array([[1, 0], [1, 1]]), block_size=8)
    >>> gain = torch.full((16,), 2.0, requires_grad=True)
    >>> y = l2_normalize(layer.weight, layer.op, gain)
    >>> dense = torch.from_numpy(layer.op.to_dense(y.detach().numpy()))
    >>> torch.allclose(dense.norm(dim=0), torch.full((16,), 2.0))
    True
    >>> y.sum().backward()
    >>> layer.weight.grad.shape, gain.grad.shape
    (torch.Size([3, 8, 8]), torch.Size([16]))
    """
    index = block_index_of(op)
    _check_tensor(w, "w")
    check_w_shape(w, index)
    epsilon = check_epsilon(epsilon)
    blocks_shape = (index.n_block_cols, index.block_size)
    if gain is not None:
        _check_tensor(gain, "gain")
        check_gain_shape(gain, index)
        if gain.device != w.device:
            raise ValueError(f"gain is on {gain.device} but w is on {w.device}; move them to one device")
    compute = torch.float64 if w.dtype == torch.float64 else torch.float32
    columns = _columns(index, w.device)
    wc = w.to(compute)
    squares = wc.new_zeros(blocks_shape).index_add(0, columns, wc.square().sum(dim=1))
    scales = squares.clamp(min=epsilon).rsqrt()
    if gain is not None:
        scales = scales * gain.to(compute).reshape(blocks_shape)
    return (wc * scales[columns].unsqueeze(1)).to(w.dtype)

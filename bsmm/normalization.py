"""Weight normalization of block data: each output feature scaled to unit norm over its present blocks.

This is the seed's ``BlocksparseMatMul.l2_normalize``: for block data ``w``
(nnzb, bs, bs) of a layout, output feature ``f = k*bs + j`` (column ``j`` of
block column ``k`` of ``W``) has the squared norm

``s[f] = sum of w[b, i, j]**2 over the present blocks b of block column k and i < bs``

and every entry of that column becomes

``y[b, i, j] = gain[f] * w[b, i, j] / sqrt(max(s[f], epsilon))``

(``gain`` all ones when omitted): the columns of the dense ``W`` normalized over
their present entries. Sums run in float32 (float64 for float64 data), as the
seed's kernels summed in float32. Block columns without a present block have no
entries to scale, so nothing can become NaN there; their gain gets gradient 0.

:func:`l2_normalize` and its vector-Jacobian product :func:`l2_normalize_grad`
take NumPy or CuPy arrays; ``bsmm.torch.l2_normalize`` and
``bsmm.jax.l2_normalize`` are the same function written in the framework's own
operations, differentiated by its autograd.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from bsmm.arrays import array_module, as_operand, check_same_place
from bsmm.block_index import BlockIndex
from bsmm.matmul import BlocksparseMatMul

__all__ = ["l2_normalize", "l2_normalize_grad"]

#: The seed's default ``epsilon`` (its code's; its README says 1e-6).
DEFAULT_EPSILON = 1e-12

_FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64))


def block_index_of(op) -> BlockIndex:
    """The :class:`~bsmm.BlockIndex` of ``op``, a ``BlocksparseMatMul`` or a ``BlockIndex`` (else TypeError)."""
    if isinstance(op, BlocksparseMatMul):
        return op.index
    if isinstance(op, BlockIndex):
        return op
    raise TypeError(f"op must be a bsmm.BlocksparseMatMul or a bsmm.BlockIndex; got {type(op).__name__}")


def check_epsilon(epsilon) -> float:
    """Return ``epsilon`` as a float, or raise: it must be finite and > 0 (0 would divide zero columns by 0)."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float, np.integer, np.floating)):
        raise TypeError(f"epsilon must be a real number; got {type(epsilon).__name__}")
    if not 0.0 < epsilon < math.inf:  # also rejects NaN
        raise ValueError(f"epsilon must be finite and > 0; got {epsilon}")
    return float(epsilon)


def check_w_shape(w, index: BlockIndex) -> None:
    """Raise ValueError unless ``w`` (any framework's array) has the block data's shape (nnzb, bs, bs)."""
    if tuple(w.shape) != index.w_shape:
        raise ValueError(f"w must have shape (nnzb, bs, bs) = {index.w_shape} for this layout; got {tuple(w.shape)}")


def check_gain_shape(gain, index: BlockIndex) -> None:
    """Raise ValueError unless ``gain`` (any framework's array) has one entry per output feature, (K,)."""
    if tuple(gain.shape) != (index.K,):
        raise ValueError(f"gain must have shape (K,) = ({index.K},); got {tuple(gain.shape)}")


def _operand(value, argument: str):
    """``value`` as an :class:`~bsmm.arrays.Operand`, once it is a NumPy or CuPy array of a float dtype."""
    operand = as_operand(value, argument)
    if operand.library not in ("numpy", "cupy"):
        raise TypeError(
            f"{argument} must be a NumPy or CuPy array; got a {operand.library} {type(value).__name__} "
            f"(use bsmm.torch.l2_normalize or bsmm.jax.l2_normalize, which their autograd differentiates)"
        )
    if value.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{argument} has dtype {value.dtype}; supported dtypes are float16, bfloat16, float32, float64")
    return operand


def _check_inputs(w, index: BlockIndex, gain, others: dict) -> None:
    """Raise unless ``w``, ``gain`` and the ``others`` (of w's shape) fit ``index`` and share a library and device."""
    operands = {"w": _operand(w, "w")}
    check_w_shape(w, index)
    for name, value in others.items():
        operands[name] = _operand(value, name)
        if tuple(value.shape) != index.w_shape:
            raise ValueError(f"{name} must have w's shape {index.w_shape}; got {tuple(value.shape)}")
    if gain is not None:
        operands["gain"] = _operand(gain, "gain")
        check_gain_shape(gain, index)
    check_same_place(operands)


def _column_sums(xp, per_block, columns, n_columns: int):
    """(n_columns, bs): the rows of ``per_block`` (nnzb, bs) added up by block column."""
    sums = xp.zeros((n_columns, per_block.shape[1]), dtype=per_block.dtype)
    xp.add.at(sums, columns, per_block)
    return sums


def _prepared(w, index: BlockIndex, gain, epsilon: float):
    """Shared start of both functions: the module, the block columns, ``w`` in the compute dtype,
    and per feature (KB, bs): the squared norms, whether each is at least ``epsilon``, the clamped
    norms and the gains."""
    xp = array_module(w)
    compute = np.float64 if w.dtype == np.float64 else np.float32
    columns = index.indices if xp is np else xp.asarray(index.indices)
    wc = w.astype(compute)
    squares = _column_sums(xp, (wc * wc).sum(axis=1), columns, index.n_block_cols)
    unclamped = squares >= compute(epsilon)
    clamped = xp.where(unclamped, squares, compute(epsilon))
    gains = (xp.ones_like(squares) if gain is None
             else gain.astype(compute).reshape(index.n_block_cols, index.block_size))
    return xp, columns, wc, unclamped, clamped, gains


def l2_normalize(w, op, gain=None, epsilon: float = DEFAULT_EPSILON):
    """Block data with each output feature scaled to norm ``gain`` over its present blocks.

    ``y[b, i, j] = gain[f] * w[b, i, j] / sqrt(max(s[f], epsilon))`` for feature
    ``f = indices[b] * bs + j`` with squared norm ``s[f]`` over the present blocks
    of its block column (module docstring).

    Parameters
    ----------
    w : (nnzb, bs, bs) NumPy or CuPy array
        Block data in bsmm's order (``op.w_shape``): float16, bfloat16, float32 or float64.
    op : bsmm.BlocksparseMatMul or bsmm.BlockIndex
        The layout.
    gain : (K,) array of w's library, optional
        Norm of each output feature after scaling; any float dtype.
    epsilon : float
        Lower bound of the squared norm (finite, > 0): features with a smaller
        norm are divided by ``sqrt(epsilon)`` instead.

    Returns
    -------
    (nnzb, bs, bs) array of w's library and dtype

    Raises
    ------
    TypeError
        If ``w`` or ``gain`` is not a NumPy or CuPy array of a float dtype,
        ``op`` is neither a BlocksparseMatMul nor a BlockIndex, or ``epsilon``
        is not a real number.
    ValueError
        If a shape does not fit ``op``, ``w`` and ``gain`` are of different
        libraries or devices, or ``epsilon`` is not finite and > 0.

    Examples
    --------
    >>> import numpy as np, bsmm
    >>> op = bsmm.BlocksparseMatMul(np.array([[1, 0], [1, 1]]), block_size=8)
    >>> w = np.random.default_rng(0).standard_normal(op.w_shape).astype(np.float32)
    >>> y = l2_normalize(w, op)
    >>> norms = np.linalg.norm(op.to_dense(y), axis=0)   # every output feature has norm 1
    >>> bool(np.allclose(norms, 1, atol=1e-6))
    True
    """
    index = block_index_of(op)
    _check_inputs(w, index, gain, {})
    xp, columns, wc, _, clamped, gains = _prepared(w, index, gain, check_epsilon(epsilon))
    scales = gains / xp.sqrt(clamped)
    return (wc * scales[columns][:, None, :]).astype(w.dtype)


def l2_normalize_grad(dy, w, op, gain=None, epsilon: float = DEFAULT_EPSILON):
    """The vector-Jacobian product of :func:`l2_normalize`: gradients for ``w`` and ``gain``.

    With ``r = 1 / sqrt(max(s, epsilon))`` per output feature,

    - ``dw = r * (gain * dy - w * [s >= epsilon] * t / max(s, epsilon))``,
      ``t`` the sum of ``gain * dy * w`` over the feature's present entries
      (features below ``epsilon`` are scaled by a constant, hence the mask; at
      ``s == epsilon`` the seed's convention, the unclamped branch, is taken);
    - ``dgain = r * (sum of dy * w over the feature's present entries)``: 0 for
      features without a present block.

    Parameters
    ----------
    dy : (nnzb, bs, bs) array of w's library
        Gradient of the loss with respect to the result of :func:`l2_normalize`.
    w, op, gain, epsilon
        As given to :func:`l2_normalize`.

    Returns
    -------
    dw : (nnzb, bs, bs) array of w's dtype
    dgain : (K,) array of gain's dtype, or None when ``gain`` is None

    Raises
    ------
    TypeError, ValueError
        As :func:`l2_normalize`, for ``dy`` too.

    Examples
    --------
    >>> import numpy as np, bsmm
    >>> op = bsmm.BlocksparseMatMul(np.array([[1, 1]]), block_size=8)
    >>> rng = np.random.default_rng(0)
    >>> w, dy = rng.standard_normal(op.w_shape), rng.standard_normal(op.w_shape)
    >>> dw, _ = l2_normalize_grad(dy, w, op)
    >>> step = 1e-6 * rng.standard_normal(op.w_shape)    # <dw, step> is the change of <dy, y>
    >>> change = (dy * (l2_normalize(w + step, op) - l2_normalize(w - step, op))).sum() / 2
    >>> bool(np.isclose(change, (dw * step).sum(), rtol=1e-6))
    True
    """
    index = block_index_of(op)
    _check_inputs(w, index, gain, {"dy": dy})
    xp, columns, wc, unclamped, clamped, gains = _prepared(w, index, gain, check_epsilon(epsilon))
    dyc = dy.astype(wc.dtype)
    rsqrt = 1 / xp.sqrt(clamped)
    projection = _column_sums(xp, (dyc * wc).sum(axis=1), columns, index.n_block_cols)  # sum of dy * w
    through_norm = xp.where(unclamped, gains * projection / clamped, 0)
    dw = (rsqrt * gains)[columns][:, None, :] * dyc - (rsqrt * through_norm)[columns][:, None, :] * wc
    dgain = None if gain is None else (rsqrt * projection).reshape(index.K).astype(gain.dtype)
    return dw.astype(w.dtype), dgain

"""The seed's weight normalization (:func:`bsmm.normalization.l2_normalize`) in ``jax.numpy``.

Plain ``jnp`` operations, so JAX differentiates it (any order, forward and reverse mode) and
``jax.jit`` traces it; the clamp at ``epsilon`` passes the gradient where the squared norm is at
least ``epsilon``, as the seed's kernel does. The layout's block columns enter as a constant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from bsmm.normalization import DEFAULT_EPSILON, block_index_of, check_epsilon, check_gain_shape, check_w_shape

__all__ = ["l2_normalize"]

_FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64))


def _check_array(value, argument: str) -> None:
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise TypeError(f"{argument} must be a JAX or NumPy array; got {type(value).__name__}")
    dtype = np.dtype(value.dtype)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{argument} has dtype {value.dtype}; supported dtypes are float16, bfloat16, float32, float64")
    if dtype == np.float64 and jax.dtypes.canonicalize_dtype(np.float64) != np.float64:
        raise TypeError(
            f"{argument} has dtype float64, which JAX turns into float32 unless 64-bit types are on: "
            f"jax.config.update('jax_enable_x64', True), or pass float32"
        )


def l2_normalize(w, op, gain=None, epsilon: float = DEFAULT_EPSILON):
    """Block data with each output feature scaled to norm ``gain`` over its present blocks.

    ``y[b, i, j] = gain[f] * w[b, i, j] / sqrt(max(s[f], epsilon))``, ``s[f]`` the
    squared norm of output feature ``f = indices[b] * bs + j`` over the present
    blocks of its block column (see :mod:`bsmm.normalization`). Sums in float32
    (float64 for float64 ``w``, which needs ``jax_enable_x64``).

    Parameters
    ----------
    w : (nnzb, bs, bs) array
        Block data (``op.w_shape``): float16, bfloat16, float32 or float64.
    op : bsmm.BlocksparseMatMul or bsmm.BlockIndex
        The layout (static: pass it by closure or as a static argument under ``jax.jit``).
    gain : (K,) array, optional
        Norm of each output feature after scaling; any float dtype.
    epsilon : float
        Lower bound of the squared norm (finite, > 0).

    Returns
    -------
    (nnzb, bs, bs) array of w's dtype

    Raises
    ------
    TypeError
        If ``w`` or ``gain`` is not a float array (float64 without
        ``jax_enable_x64`` included), ``op`` is of another type, or ``epsilon``
        is not a real number.
    ValueError
        If a shape does not fit ``op``, or ``epsilon`` is not finite and > 0.

    Examples
    --------
    >>> import numpy as np, jax, jax.numpy as jnp, bsmm
    >>> from bsmm.jax.normalization import l2_normalize
    >>> op = bsmm.BlocksparseMatMul(np.array([[1, 0], [1, 1]]), block_size=8)
    >>> w = jnp.asarray(op.normal_init(seed=0))
    >>> y = jax.jit(l2_normalize, static_argnums=1)(w, op)
    >>> bool(jnp.allclose(jnp.linalg.norm(op.to_dense(np.asarray(y)), axis=0), 1))
    True
    >>> jax.grad(lambda w: l2_normalize(w, op)[0, 0, 0])(w).shape
    (3, 8, 8)
    """
    index = block_index_of(op)
    _check_array(w, "w")
    check_w_shape(w, index)
    epsilon = check_epsilon(epsilon)
    blocks_shape = (index.n_block_cols, index.block_size)
    if gain is not None:
        _check_array(gain, "gain")
        check_gain_shape(gain, index)
    compute = jnp.float64 if np.dtype(w.dtype) == np.float64 else jnp.float32
    columns = jnp.asarray(index.indices)
    wc = jnp.asarray(w).astype(compute)
    squares = jnp.zeros(blocks_shape, compute).at[columns].add(jnp.sum(wc * wc, axis=1))
    # where, not maximum: at s == epsilon maximum would send half the gradient each way.
    scales = jax.lax.rsqrt(jnp.where(squares >= epsilon, squares, jnp.asarray(epsilon, compute)))
    if gain is not None:
        scales = scales * jnp.asarray(gain).astype(compute).reshape(blocks_shape)
    return (wc * scales[columns][:, None, :]).astype(w.dtype)

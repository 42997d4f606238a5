"""Initial values for block-sparse weights, as block data in storage order.

Every initializer returns an array of shape ``(nnzb, bs, bs)`` whose blocks
follow the layout in row-major order, the order of ``np.nonzero(layout)``
(see :mod:`bsmm.block_index`). Values are drawn and computed in float64 and
rounded once to ``dtype`` (float32, float16 or bfloat16, as a dtype or its
name). ``seed`` is an int, None or ``numpy.random.Generator``; the same int
gives the same data.
"""

from __future__ import annotations

import numpy as np

from bsmm.block_index import check_block_size, check_layout
from bsmm.dtypes import canonical_dtype
from bsmm.layouts.checks import as_generator

__all__ = ["normal", "identity", "orthogonal"]


def _check_factor(value, name: str, signed: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__}")
    if signed and not -np.inf < value < np.inf:  # also rejects NaN
        raise ValueError(f"{name} must be finite; got {value}")
    if not signed and not 0.0 <= value < np.inf:
        raise ValueError(f"{name} must be finite and >= 0; got {value}")
    return float(value)


def normal(layout, block_size, scale=1.0, dtype=np.float32, seed=None) -> np.ndarray:
    """Gaussian blocks scaled by the fan-in of their output block column.

    Block ``(c, k)`` gets i.i.d. ``N(0, std_k^2)`` entries with
    ``std_k = scale / sqrt(fan_in_k * block_size)``, ``fan_in_k`` the number
    of present blocks in block column ``k``: each output feature then sums
    ``fan_in_k * block_size`` terms of variance ``scale^2 / (fan_in_k *
    block_size)``. Only columns holding a block get data, so ``fan_in_k >= 1``.

    Parameters
    ----------
    layout : (C // block_size, K // block_size) array of 0/1
    block_size : int
        8, 16, 32, 64 or 128 (``bsmm.toml``'s ``limits.block_sizes``).
    scale : float
        Finite, >= 0.
    dtype : float32, float16 or bfloat16, or its name
    seed : int, None or numpy.random.Generator

    Returns
    -------
    (nnzb, block_size, block_size) array of ``dtype``

    Raises
    ------
    TypeError
        If ``block_size`` is not an int, ``scale`` is not a real, ``dtype`` is
        not supported or ``seed`` is of another type.
    ValueError
        If ``layout`` is not a 2-D array of 0/1, ``block_size`` is not
        supported, ``scale`` is negative or not finite, or ``seed`` < 0.

    Examples
    --------
    >>> import numpy as np
    >>> w = normal(np.array([[1, 1], [0, 1]]), 8, seed=0)
    >>> w.shape, w.dtype
    ((3, 8, 8), dtype('float32'))
    """
    checked = check_layout(layout)
    block_size = check_block_size(block_size)
    scale = _check_factor(scale, "scale")
    dtype = canonical_dtype(dtype, "dtype")
    rng = as_generator(seed)
    _, cols = np.nonzero(checked)
    fan_in = np.count_nonzero(checked, axis=0)
    std = scale / np.sqrt(fan_in[cols] * block_size)
    data = rng.standard_normal((cols.size, block_size, block_size)) * std[:, None, None]
    return data.astype(dtype)


def identity(layout, block_size, dtype=np.float32, seed=None, scale=1.0) -> np.ndarray:
    """The identity, repeated along the longer side of a non-square layout, times ``scale``.

    Block ``(c, k)`` of a ``(CB, KB)`` layout is ``scale * I`` if
    ``c % KB == k % CB`` and 0 otherwise, the rule of the seed's
    ``identity_init``. On a square layout that is the diagonal; on a wide one
    (``CB < KB``) the ``C × C`` identity repeated to the right (``W[i, j] = scale``
    where ``i == j % C``), on a tall one the ``K × K`` identity repeated
    downwards (``i % K == j``); absent blocks drop out. With every such block
    present, ``x·W`` copies (sums, on a tall layout) feature ``i`` of ``x`` into
    every output feature ``j`` congruent to it.

    Parameters
    ----------
    layout : (C // block_size, K // block_size) array of 0/1
    block_size : int
        8, 16, 32, 64 or 128.
    dtype : float32, float16 or bfloat16, or its name
    seed : int, None or numpy.random.Generator
        Unused, as the result is deterministic; accepted (and checked) so that
        every initializer takes the same arguments.
    scale : float
        The diagonal's value (the seed's ``scale``), finite; negative allowed.

    Returns
    -------
    (nnzb, block_size, block_size) array of ``dtype``

    Raises
    ------
    TypeError
        If ``block_size`` is not an int, ``dtype`` is not supported,
        ``seed`` is of another type or ``scale`` is not a real number.
    ValueError
        If ``layout`` is not a 2-D array of 0/1, ``block_size`` is not
        supported, ``seed`` < 0 or ``scale`` is not finite.

    Examples
    --------
    >>> import numpy as np
    >>> w = identity(np.array([[1, 1], [0, 1]]), 8)
    >>> [bool((block == np.eye(8)).all()) for block in w], float(w[1].max())
    ([True, False, True], 0.0)
    >>> wide = identity(np.ones((1, 3)), 8, scale=0.5)      # one block row: I I I
    >>> [bool((block == 0.5 * np.eye(8)).all()) for block in wide]
    [True, True, True]
    """
    checked = check_layout(layout)
    block_size = check_block_size(block_size)
    dtype = canonical_dtype(dtype, "dtype")
    as_generator(seed)  # for the same seed errors as the random initializers
    scale = _check_factor(scale, "scale", signed=True)
    n_rows, n_cols = checked.shape
    rows, cols = np.nonzero(checked)
    data = np.zeros((rows.size, block_size, block_size))
    data[rows % n_cols == cols % n_rows] = scale * np.eye(block_size)
    return data.astype(dtype)


def orthogonal(layout, block_size, gain=1.0, dtype=np.float32, seed=None) -> np.ndarray:
    """Blocks whose stack in each output block column has orthonormal columns, times ``gain``.

    The ``n_k`` present blocks of block column ``k``, stacked top to bottom,
    form an ``(n_k * block_size, block_size)`` matrix ``M_k`` with
    ``M_k.T @ M_k = gain^2 I``. ``M_k / gain`` is Haar-distributed: the Q
    factor of a Gaussian matrix with ``diag(R) > 0`` (Mezzadri 2007), drawn
    independently for each column.

    Parameters
    ----------
    layout : (C // block_size, K // block_size) array of 0/1
    block_size : int
        8, 16, 32, 64 or 128.
    gain : float
        Finite, >= 0.
    dtype : float32, float16 or bfloat16, or its name
    seed : int, None or numpy.random.Generator

    Returns
    -------
    (nnzb, block_size, block_size) array of ``dtype``

    Raises
    ------
    TypeError
        If ``block_size`` is not an int, ``gain`` is not a real, ``dtype`` is
        not supported or ``seed`` is of another type.
    ValueError
        If ``layout`` is not a 2-D array of 0/1, ``block_size`` is not
        supported, ``gain`` is negative or not finite, or ``seed`` < 0.

    Examples
    --------
    >>> import numpy as np
    >>> w = orthogonal(np.array([[1, 1], [0, 1]]), 8, seed=0)
    >>> column_1 = np.concatenate([w[1], w[2]])  # blocks (0, 1) and (1, 1)
    >>> bool(np.allclose(column_1.T @ column_1, np.eye(8), atol=1e-6))
    True
    """
    checked = check_layout(layout)
    block_size = check_block_size(block_size)
    gain = _check_factor(gain, "gain")
    dtype = canonical_dtype(dtype, "dtype")
    rng = as_generator(seed)
    _, cols = np.nonzero(checked)
    counts = np.count_nonzero(checked, axis=0)
    # A stable sort of the row-major order by column lists each column's blocks top to bottom.
    by_column = np.argsort(cols, kind="stable")
    starts = np.cumsum(counts) - counts
    data = np.empty((cols.size, block_size, block_size))
    # Columns with equal block counts share a shape, so one batched QR serves them all.
    for count in np.unique(counts[counts > 0]):
        group = np.flatnonzero(counts == count)
        q, r = np.linalg.qr(rng.standard_normal((group.size, count * block_size, block_size)))
        q *= np.where(np.diagonal(r, axis1=1, axis2=2) < 0, -1.0, 1.0)[:, None, :]
        blocks = by_column[starts[group, None] + np.arange(count)]
        data[blocks.ravel()] = gain * q.reshape(group.size * count, block_size, block_size)
    return data.astype(dtype)

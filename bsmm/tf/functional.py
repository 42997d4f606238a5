"""The differentiable op: :func:`blocksparse_matmul`."""

from __future__ import annotations

try:
    import tensorflow as tf
except ImportError as error:
    raise ImportError(
        "bsmm.tf needs TensorFlow: pip install tensorflow-cpu (or tensorflow for GPUs)"
    ) from error

from bsmm.matmul import BlocksparseMatMul
from bsmm.tf.checks import as_tensor, check_activation, check_same_device, shape_text
from bsmm.tf.passes import run_pass

__all__ = ["blocksparse_matmul"]


def blocksparse_matmul(x, w, op: BlocksparseMatMul, name: str | None = None) -> tf.Tensor:
    """y = x·W for a block-sparse ``W``, differentiable in ``x`` and ``w``.

    Parameters
    ----------
    x : (N, C) tensor, or (C, N) with ``op.feature_axis == 0``
        float32, float16 or bfloat16, or float64 on the CPU (computed in float64);
        anything ``tf.convert_to_tensor`` takes.
    w : (nnzb, bs, bs) tensor (or variable) of x's dtype
        Block data in the layout's row-major block order (``op.w_shape``).
    op : bsmm.BlocksparseMatMul
        The layout, block size and feature axis.
    name : str, optional
        Name scope of the op.

    Returns
    -------
    y : (N, K) tensor, or (K, N) with ``feature_axis == 0``, of x's dtype and device

    Notes
    -----
    Gradients: ``dx = op.bprop(dy, w)`` and ``dw = op.updat(x, dy)``, first order only.
    Eager and inside ``tf.function`` (not under XLA: see :mod:`bsmm.tf`).

    Raises
    ------
    TypeError
        If ``op`` is not a BlocksparseMatMul, an input cannot become a tensor,
        a dtype is not supported (float64: eagerly, on a GPU), or ``x`` and ``w`` differ in dtype.
    ValueError
        If a static shape does not fit the layout, or (eagerly) ``x`` and ``w``
        lie on different devices. Shapes only known when the graph runs are
        checked by bsmm then, and a mismatch fails the ``tf.py_function`` node.

    Examples
    --------
    >>> import numpy as np, tensorflow as tf, bsmm, bsmm.tf
    >>> op = bsmm.BlocksparseMatMul(np.array([[1, 0], [1, 1]]), block_size=8)
    >>> w = tf.Variable(op.normal_init(seed=0))
    >>> x = tf.ones((4, op.C))
    >>> with tf.GradientTape() as tape:
    ...     y = bsmm.tf.blocksparse_matmul(x, w, op)
    >>> tuple(y.shape), tuple(tape.gradient(y, w).shape)
    ((4, 16), (3, 8, 8))
    >>> bool(np.allclose(y, x.numpy() @ op.to_dense(w.numpy()), atol=1e-5))
    True
    """
    if not isinstance(op, BlocksparseMatMul):
        raise TypeError(f"op must be a bsmm.BlocksparseMatMul; got {type(op).__name__}")
    x, w = as_tensor(x, "x"), as_tensor(w, "w")
    check_activation(x, "x", op.C, op.feature_axis)
    if w.dtype != x.dtype:
        raise TypeError(f"w has dtype {w.dtype.name} but x has {x.dtype.name}; pass one dtype")
    if not w.shape.is_compatible_with(op.w_shape):
        raise ValueError(f"w must have shape w_shape {op.w_shape}; got {shape_text(w.shape)}")
    check_same_device(x, w)
    with tf.name_scope(name or "blocksparse_matmul"):
        return _differentiable(op)(x, w)


def _differentiable(op: BlocksparseMatMul):
    """The three passes of ``op`` joined into one ``tf.custom_gradient`` function of (x, w)."""

    @tf.custom_gradient
    def matmul(x, w):
        def grad(dy):
            return run_pass(op, "bprop", dy, w), run_pass(op, "updat", x, dy)

        return run_pass(op, "fprop", x, w), grad

    return matmul

"""The functional API: :func:`blocksparse_matmul` and :func:`blocksparse_conv`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bsmm.epilogues import check_activation
from bsmm.jax.autodiff import differentiable_pass
from bsmm.jax.checks import check_arrays, check_matmul_inputs, check_weights
from bsmm.jax.passes import ConvPasses
from bsmm.matmul import BlocksparseMatMul
from bsmm.nn.conv import BlocksparseConv

__all__ = ["blocksparse_conv", "blocksparse_matmul"]

#: bsmm.epilogues' activations as JAX functions.
_ACTIVATIONS = {"none": lambda y: y, "relu": jax.nn.relu, "gelu": lambda y: jax.nn.gelu(y, approximate=False),
                "gelu_tanh": lambda y: jax.nn.gelu(y, approximate=True), "silu": jax.nn.silu}


def blocksparse_matmul(x, w, op: BlocksparseMatMul, bias=None, activation: str | None = None, *, gate=None):
    """y = x·W with block-sparse ``W``: differentiable, jit-able and vmap-able; with ``bias`` or
    ``activation``, y = A(x·W + bias).

    Parameters
    ----------
    x : (..., C) array with ``op.feature_axis == 1``; (C, N) or (C,) with ``feature_axis == 0``
        float32, float16 or bfloat16; float64 on the CPU (with ``jax_enable_x64``).
        Leading axes (feature_axis 1) are rows.
    w : (nnzb, bs, bs) array of x's dtype
        Block data in the layout's storage order (``op.w_shape``).
    op : bsmm.BlocksparseMatMul
        The layout, block size and feature axis; static (hashed by identity), so
        reuse one operator to reuse compiled code.
    bias : (K,) array, optional
        Added along the features (cast to x's dtype).
    activation : {None, "none", "relu", "gelu", "gelu_tanh", "silu"}
        As :mod:`bsmm.epilogues` names them (``"gelu"``: the erf form). Applied by XLA
        after the pass, which fuses the bias and the activation into one element-wise
        kernel; the PyTorch and CuPy paths apply them inside bsmm's kernel.
    gate : (nnzb,) array, optional
        One scale a block: y = x·(g ⊙ W), differentiable in ``g`` too (cast to w's dtype).

    Returns
    -------
    y : (..., K), or (K, N) / (K,), x's dtype
        Accumulated in float32 (float64 for float64), rounded once to the dtype.

    Raises
    ------
    TypeError
        If ``op`` is not a BlocksparseMatMul, ``x`` has an unsupported dtype (float64
        on a GPU, or without ``jax_enable_x64``), or ``w``'s dtype differs from ``x``'s.
    ValueError
        If ``x`` or ``w`` has the wrong shape.

    Notes
    -----
    Reverse mode of any order (``jax.grad``, ``jax.vjp``, ``jax.jacrev``, grad of
    grad); no forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``), as for
    any ``jax.custom_vjp``. The backward pass skips ``bprop`` when ``x`` is not
    differentiated and ``updat`` when ``w`` is not. float64 runs on the CPU backend
    only, computed in float64 (for ``jax.test_util.check_grads``).

    Each pass is one XLA custom call on XLA's own buffers (:mod:`bsmm.jax.passes`). On a
    GPU, bsmm's own device memory (kernel tables, a per-stream workspace, allocated at a
    pass's first use) comes from CuPy's pool, outside the share of GPU memory that XLA
    preallocates: lower ``XLA_PYTHON_CLIENT_MEM_FRACTION`` if CuPy runs out. XLA may record
    a pass into its command buffers (CUDA graphs) after its first call and replay it without
    calling Python at all, for programs of enough operations
    (``--xla_gpu_graph_min_graph_size``), as a model's training step is; ``[jax]
    command_buffers = false`` in the configuration turns the recording off for the passes
    of operators and shapes traced afterwards (JAX caches a pass's trace per operator and
    shape). ``jax.export`` with more than one platform is not supported:
    ``buffer_callback`` cannot be lowered for several platforms at once.

    Under ``jax.vmap`` the batch of activations is folded into N when ``feature_axis=1``
    and the weights are shared: one pass over ``B*N`` rows. Otherwise (``feature_axis=0``,
    per-example weights, or the per-example weight gradients that ``vmap`` of a gradient
    needs) one custom call loops over the batch on views of the buffers, still without
    copies. For training, pass the batch as leading axes of ``x`` rather than ``vmap``-ing
    the loss: the weight gradient is then one pass over all rows, where
    ``jax.grad(jax.vmap(...))`` computes one weight gradient per example and sums them.

    On several devices: under ``jax.jit`` with ``x`` sharded along its rows (the batch) and ``w``
    replicated, each device runs fprop and bprop on its own rows, with no collective, and the weight
    gradient is each device's rows' gradient summed over the batch's mesh axes (one all-reduce):
    :mod:`bsmm.jax.partitioning`. Features or ``w`` sharded otherwise are gathered first; a pass under
    ``jax.vmap`` runs whole on every device. Inside ``jax.shard_map`` (under ``jax.jit``) every device
    runs the pass on its local arrays. Layers too large for one device: :func:`~bsmm.jax.sharded_matmul`.

    Examples
    --------
    >>> import numpy as np, jax, jax.numpy as jnp, bsmm, bsmm.jax
    >>> op = bsmm.BlocksparseMatMul(np.eye(2), block_size=8)
    >>> w = jnp.asarray(op.identity_init())
    >>> x = jnp.arange(2 * 3 * 16, dtype=jnp.float32).reshape(2, 3, 16)
    >>> bool(jnp.array_equal(bsmm.jax.blocksparse_matmul(x, w, op), x))   # W = I
    True
    >>> jax.vmap(bsmm.jax.blocksparse_matmul, in_axes=(0, None, None))(x, w, op).shape
    (2, 3, 16)
    """
    check_matmul_inputs(x, w, op)
    activation = check_activation(activation)
    if gate is not None:
        if tuple(jnp.shape(gate)) != (op.blocks,):
            raise ValueError(f"gate must have shape ({op.blocks},), one value a block; got {tuple(jnp.shape(gate))}")
        w = w * jnp.asarray(gate, w.dtype).reshape(-1, 1, 1)
    if op.feature_axis == 1:
        y = differentiable_pass(x.reshape(-1, op.C), w, op, "fprop").reshape(x.shape[:-1] + (op.K,))
    else:
        y = differentiable_pass(x.reshape(op.C, -1), w, op, "fprop").reshape((op.K,) + x.shape[1:])
    if bias is not None:
        if tuple(jnp.shape(bias)) != (op.K,):
            raise ValueError(f"bias must have shape ({op.K},); got {tuple(jnp.shape(bias))}")
        bias = jnp.asarray(bias, y.dtype)
        y = y + (bias if op.feature_axis == 1 else bias.reshape((op.K,) + (1,) * (y.ndim - 1)))
    return y if activation is None else _ACTIVATIONS[activation](y)


def blocksparse_conv(x, w, conv: BlocksparseConv):
    """y = conv(x, W) for a :class:`bsmm.nn.conv.BlocksparseConv`: differentiable and jit-able.

    Parameters
    ----------
    x : (N, *spatial, C) array, or (N, C, *spatial) with ``conv.channels_last == False``
        float32, float16 or bfloat16; float64 on the CPU (with ``jax_enable_x64``).
    w : ``conv.w_shape`` = (*kernel_size, nnzb, bs, bs) array of x's dtype
    conv : bsmm.nn.conv.BlocksparseConv
        Static (hashed by identity): reuse one object to reuse compiled code.

    Returns
    -------
    y : ``conv.output_shape(x.shape)``, x's dtype

    Notes
    -----
    Each pass is one XLA custom call (as for :func:`blocksparse_matmul`) running
    :class:`bsmm.nn.conv.BlocksparseConv` on XLA's buffers; its canvas and grid temporaries
    come from NumPy on the CPU and CuPy's pool on a GPU, outside XLA's memory (so, unlike a
    product's, its passes are never recorded into XLA's command buffers). Reverse mode
    of any order through ``jax.custom_vjp``; no ``jax.vmap`` (the batch is N).

    Examples
    --------
    >>> import numpy as np, jax, jax.numpy as jnp, bsmm.jax
    >>> from bsmm.nn.conv import BlocksparseConv
    >>> conv = BlocksparseConv(np.array([[1, 0], [1, 1]]), 8, (3, 3), padding=1)
    >>> w = jnp.asarray(conv.normal_init(seed=0))
    >>> x = jnp.ones((2, 5, 5, conv.C))
    >>> y = jax.jit(bsmm.jax.blocksparse_conv, static_argnums=2)(x, w, conv)
    >>> dense = jnp.asarray(conv.to_dense(np.asarray(w)))  # (3, 3, C, K): HWIO
    >>> ref = jax.lax.conv_general_dilated(x, dense, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
    ...                                    precision="highest")
    >>> bool(jnp.allclose(y, ref, atol=1e-4))
    True
    >>> jax.grad(lambda w: bsmm.jax.blocksparse_conv(x, w, conv).sum())(w).shape
    (3, 3, 3, 8, 8)
    """
    if not isinstance(conv, BlocksparseConv):
        raise TypeError(f"conv must be a bsmm.nn.conv.BlocksparseConv; got {type(conv).__name__}")
    dtype = check_arrays(x, w)
    conv.geometry(tuple(x.shape), "x")  # raises naming x unless the shape fits
    check_weights(x, w, conv.w_shape, dtype)
    return differentiable_pass(x, w, ConvPasses(conv, x.shape), "fprop")

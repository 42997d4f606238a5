"""JAX adapter: block-sparse ``x·W`` as a differentiable JAX function.

:func:`blocksparse_matmul` works under ``jax.jit``, ``jax.grad`` (reverse mode
of any order, through ``jax.custom_vjp``), ``jax.vmap``, ``lax.scan`` and
``jax.checkpoint``; :class:`BlockSparseDense` is a
small layer over a params pytree. Import it explicitly (``import bsmm.jax``);
``import bsmm`` alone does not import JAX.

How the passes run
------------------
Each pass is one ``jax.experimental.buffer_callback`` (JAX >= 0.7), an XLA
custom call that hands Python the operands' and the result's own buffers and,
on a GPU, XLA's stream:

- CPU: the buffers are wrapped as NumPy arrays (no copy in, and the CPU backend
  writes the result straight into XLA's output buffer, no copy out). The
  ``jax.pure_callback`` alternative copies the returned result into XLA's
  buffer and, measured with JAX 0.10, hands the callback copies of the inputs.
- CUDA: the buffers are wrapped as CuPy arrays by pointer (no copy), XLA's
  stream becomes CuPy's current stream and the kernels are launched on it, so
  the pass is ordered with the rest of the XLA program and never leaves jit.
  bsmm's own device memory (kernel tables, a per-stream workspace, allocated at
  a pass's first use) comes from CuPy's pool, outside the share of GPU memory
  that XLA preallocates; lower ``XLA_PYTHON_CLIENT_MEM_FRACTION`` if CuPy runs
  out.
- Repeats: a CUDA pass of a shape seen before launches on the buffers' raw pointers through the
  call the operator kept (no CuPy arrays, no stream objects), and XLA may record it into its
  command buffers (CUDA graphs) after its first call and replay it without calling Python at
  all: XLA does so for programs of enough operations (``--xla_gpu_graph_min_graph_size``), as
  a model's training step is. ``[jax] command_buffers = false`` in the configuration turns the
  recording off for the passes of operators and shapes traced afterwards (JAX caches a pass's
  trace per operator and shape); convolution passes are never recorded.

Which backend runs is decided per call from the DLPack device type of the
buffers XLA passes (``__dlpack_device__``), i.e. where XLA actually placed the
computation, rather than from ``jax.default_backend()``, which is wrong for
arrays placed on a non-default device. ``buffer_callback`` cannot be lowered
for several platforms at once, so ``jax.export`` with more than one platform is
not supported.

Batching
--------
Under ``jax.vmap`` (``jax.custom_batching.custom_vmap`` on each pass) the batch
of activations is folded into N when ``feature_axis=1`` and the weights are
shared: one pass over ``B*N`` rows, a free reshape. Otherwise (``feature_axis=0``,
per-example weights, or the per-example weight gradients that ``vmap`` of a
gradient needs) one custom call loops over the batch on views of the buffers,
still without copies. For training, pass the batch as leading axes of ``x``
(``(..., C)`` with ``feature_axis=1``) rather than ``vmap``-ing the loss: the
weight gradient is then one pass over all rows, where ``jax.grad(jax.vmap(...))``
computes one weight gradient per example and sums them.

Examples
--------
>>> import numpy as np, jax, jax.numpy as jnp, bsmm, bsmm.jax
>>> op = bsmm.BlocksparseMatMul(np.array([[1, 0], [1, 1]]), block_size=8)
>>> w = jnp.asarray(op.normal_init(seed=0))
>>> x = jnp.ones((4, op.C))
>>> y = jax.jit(bsmm.jax.blocksparse_matmul, static_argnums=2)(x, w, op)
>>> dw = jax.grad(lambda w: bsmm.jax.blocksparse_matmul(x, w, op).sum())(w)
>>> y.shape, dw.shape
((4, 16), (3, 8, 8))
"""

from __future__ import annotations

import functools
import math

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("bsmm.jax needs JAX: pip install jax") from error
try:
    from jax.experimental import buffer_callback  # noqa: F401 (used by bsmm.jax.passes)
except ImportError as error:  # pragma: no cover
    raise ImportError(
        f"bsmm.jax needs JAX >= 0.7 (jax.experimental.buffer_callback); found JAX {jax.__version__}: "
        f"pip install -U jax"
    ) from error
from jax.custom_derivatives import SymbolicZero

from bsmm.dtypes import canonical_dtype
from bsmm.nn.conv import BlocksparseConv
from bsmm.jax.passes import ConvPasses, run_pass
from bsmm.matmul import BlocksparseMatMul

__all__ = ["BlockSparseConv", "BlockSparseDense", "blocksparse_conv", "blocksparse_matmul"]


# -- the passes as differentiable functions -----------------------------------------------------------
# Every pass is bilinear in its operands (a, b) and the cotangents of each are again
# passes: with g the cotangent of the result,
#   fprop(x, w):   dx = bprop(g, w)    dw = updat(x, g)
#   bprop(dy, w):  ddy = fprop(g, w)   dw = updat(g, dy)
#   updat(x, dy):  dx = bprop(dy, g)   ddy = fprop(x, g)   (g is block data)
# (for both feature axes), so defining each pass's VJP through the others gives
# reverse mode of any order: gradient penalties, Hessian-vector products by grad of grad.
_COTANGENTS = {  # pass -> (pass, operands) for the cotangent of a, then of b
    "fprop": (("bprop", lambda a, b, g: (g, b)), ("updat", lambda a, b, g: (a, g))),
    "bprop": (("fprop", lambda a, b, g: (g, b)), ("updat", lambda a, b, g: (g, a))),
    "updat": (("bprop", lambda a, b, g: (b, g)), ("fprop", lambda a, b, g: (a, g))),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _differentiable_pass(a, b, op, pass_name):
    return run_pass(op, pass_name, a, b)


def _pass_fwd(a, b, op, pass_name):
    # Through the differentiable function itself: under grad of grad the operands are
    # tracers of the outer differentiation, which must see a custom_vjp here too.
    out = _differentiable_pass(a.value, b.value, op, pass_name)
    # The cotangent of a needs b and that of b needs a: keep only what will be used, so
    # a data input (no gradient) skips its pass and frozen weights skip updat.
    return out, (b.value if a.perturbed else None, a.value if b.perturbed else None)


def _pass_bwd(op, pass_name, residuals, g):
    b, a = residuals
    if isinstance(g, SymbolicZero):
        return None, None
    return tuple(
        None if kept is None else _differentiable_pass(*operands(a, b, g), op, name)
        for kept, (name, operands) in zip((b, a), _COTANGENTS[pass_name])
    )


_differentiable_pass.defvjp(_pass_fwd, _pass_bwd, symbolic_zeros=True)


def _check_inputs(x, w, op) -> None:
    if not isinstance(op, BlocksparseMatMul):
        raise TypeError(f"op must be a bsmm.BlocksparseMatMul; got {type(op).__name__}")
    dtype = _check_arrays(x, w)
    if op.feature_axis == 1 and (x.ndim < 1 or x.shape[-1] != op.C):
        raise ValueError(f"x must have shape (..., {op.C}) (features last, feature_axis=1); got {tuple(x.shape)}")
    if op.feature_axis == 0 and (x.ndim not in (1, 2) or x.shape[0] != op.C):
        raise ValueError(
            f"x must have shape ({op.C}, N) or ({op.C},) (features first, feature_axis=0; batch with "
            f"jax.vmap); got {tuple(x.shape)}"
        )
    _check_weights(x, w, op.w_shape, dtype)


def _check_arrays(x, w) -> np.dtype:
    """x's dtype, once x and w are arrays and bsmm (and JAX) can run it."""
    for name, value in (("x", x), ("w", w)):
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            raise TypeError(f"{name} must be a JAX or NumPy array; got {type(value).__name__}")
    dtype = canonical_dtype(x.dtype, "x", _backend(x))
    if dtype == np.float64 and jax.dtypes.canonicalize_dtype(np.float64) != np.float64:
        raise TypeError(
            "x has dtype float64, which JAX turns into float32 unless 64-bit types are on: "
            "jax.config.update('jax_enable_x64', True), or pass float32"
        )
    return dtype


def _check_weights(x, w, w_shape: tuple, dtype) -> None:
    """w's shape and dtype, and that x and w are not placed on different devices."""
    if tuple(w.shape) != w_shape:
        raise ValueError(f"w must have shape w_shape {w_shape}; got {tuple(w.shape)}")
    if w.dtype != dtype:
        raise TypeError(f"w has dtype {w.dtype} but x has {dtype}; pass one dtype")
    places = [_committed_devices(value) for value in (x, w)]
    if None not in places and places[0] != places[1]:
        raise ValueError(
            f"w is on {sorted(map(str, places[1]))} but x is on {sorted(map(str, places[0]))}; "
            f"move them to one device (jax.device_put)"
        )


def _backend(value) -> str:
    """Where a pass on ``value`` runs, as far as known before XLA places it.

    A concrete JAX array tells; a tracer or a NumPy array does not, so it counts as
    "cpu" (float64 accepted), and a float64 pass XLA places on a GPU is refused when
    it runs, by the pass itself.
    """
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
        if any(device.platform != "cpu" for device in value.devices()):
            return "cuda"
    return "cpu"


def _committed_devices(value):
    """The devices of a concrete JAX array that was explicitly placed (JAX moves the others)."""
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) and value.committed:
        return value.devices()
    return None


def blocksparse_matmul(x, w, op: BlocksparseMatMul):
    """y = x·W with block-sparse ``W``: differentiable, jit-able and vmap-able.

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
    _check_inputs(x, w, op)
    if op.feature_axis == 1:
        return _differentiable_pass(x.reshape(-1, op.C), w, op, "fprop").reshape(x.shape[:-1] + (op.K,))
    return _differentiable_pass(x.reshape(op.C, -1), w, op, "fprop").reshape((op.K,) + x.shape[1:])


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


# -- a layer over a params pytree -------------------------------------------------------------------
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


# -- convolutions -----------------------------------------------------------------------------------------
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
    come from NumPy on the CPU and CuPy's pool on a GPU, outside XLA's memory. Reverse mode
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
    dtype = _check_arrays(x, w)
    conv._geometry(tuple(x.shape), "x")  # raises naming x unless the shape fits
    _check_weights(x, w, conv.w_shape, dtype)
    return _differentiable_pass(x, w, ConvPasses(conv, x.shape), "fprop")


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

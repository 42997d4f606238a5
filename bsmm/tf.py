"""TensorFlow adapter: bsmm's passes as a differentiable op, and a Keras layer.

``import bsmm.tf`` imports TensorFlow and Keras 3 (``import bsmm`` alone imports
neither). It offers

- :func:`blocksparse_matmul` ``(x, w, op)``: ``y = x·W`` as a ``tf.custom_gradient``
  op, ``dx`` from ``op.bprop`` and ``dw`` from ``op.updat``; eager and inside
  ``tf.function``;
- :class:`BlockSparseDense`: a Keras layer whose kernel holds the block data,
  shape ``op.w_shape`` = (nnzb, bs, bs).

How tensors reach bsmm
----------------------
Eagerly, each pass reads its input tensors' memory through DLPack, without a
copy. Inside ``tf.function`` each pass is one ``tf.py_function`` node whose body
does the same on the eager tensors it receives; its output gets the static
shape the pass implies, so shapes stay known in the graph.

- CPU: the CPU backend writes into a NumPy buffer aligned to 64 bytes, which
  TensorFlow then adopts through DLPack (no copy). The alignment is needed:
  TensorFlow adopts unaligned memory too, and its kernels then abort the
  process on their first read of it.
- GPU (untested: written from documentation, as no TensorFlow was installed
  on the GPU machine): TensorFlow allocates the output on the inputs' device
  (so ``tf.config.experimental.get_memory_info`` counts it, and it is the only
  allocation of a pass), CuPy shares it and the kernel writes it in place.
  TensorFlow exposes no CUDA stream to Python and refuses a stream in DLPack
  export, so the adapter cannot launch on TensorFlow's stream: it waits for
  the device (``SyncDevice``) before the launch on CuPy's current stream and
  for that stream after it. Each pass therefore synchronizes the host twice.
- bfloat16: NumPy's DLPack import knows no bfloat16, so tensors travel
  bitcast to int16 (a view in TensorFlow) and are viewed as
  ``ml_dtypes.bfloat16`` on the other side.

Limits: no XLA (``jit_compile=True``), as ``tf.py_function`` cannot be compiled
(``BlockSparseDense`` sets ``supports_jit = False``, so Keras' ``jit_compile="auto"``
picks plain graphs); graphs holding the op cannot be exported as SavedModels
for use without Python; gradients are first order only.
"""

from __future__ import annotations

import functools

import numpy as np

try:
    import tensorflow as tf
except ImportError as error:
    raise ImportError(
        "bsmm.tf needs TensorFlow: pip install tensorflow-cpu (or tensorflow for GPUs)"
    ) from error
try:
    import keras
except ImportError as error:
    raise ImportError("bsmm.tf needs Keras 3, which TensorFlow >= 2.16 installs: pip install keras") from error

from bsmm import initializers
from bsmm.arrays import empty_aligned
from bsmm.dtypes import CPU_ONLY_DTYPES, SUPPORTED_DTYPES
from bsmm.matmul import BlocksparseMatMul

if int(keras.__version__.split(".", 1)[0]) < 3:
    raise ImportError(f"bsmm.tf needs Keras 3 (TensorFlow >= 2.16); found Keras {keras.__version__}")

__all__ = ["BlockSparseDense", "blocksparse_matmul"]

#: TensorFlow dtype -> the NumPy dtype bsmm uses for it.
_NUMPY_DTYPES: dict[tf.DType, np.dtype] = {
    tf.float32: SUPPORTED_DTYPES["float32"],
    tf.float16: SUPPORTED_DTYPES["float16"],
    tf.bfloat16: SUPPORTED_DTYPES["bfloat16"],
    tf.float64: CPU_ONLY_DTYPES["float64"],  # CPU tensors only
}
_BFLOAT16 = SUPPORTED_DTYPES["bfloat16"]  # ml_dtypes.bfloat16

# DLPack device types (dlpack.h) of GPU memory.
_DLPACK_CUDA_TYPES = (2, 13)


# -- the public op ------------------------------------------------------------------------------
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

    Gradients: ``dx = op.bprop(dy, w)`` and ``dw = op.updat(x, dy)``, first order only.
    Eager and inside ``tf.function`` (not under XLA: see the module notes).

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
    x, w = _as_tensor(x, "x"), _as_tensor(w, "w")
    _check_activation(x, "x", op.C, op.feature_axis)
    if w.dtype != x.dtype:
        raise TypeError(f"w has dtype {w.dtype.name} but x has {x.dtype.name}; pass one dtype")
    if not w.shape.is_compatible_with(op.w_shape):
        raise ValueError(f"w must have shape w_shape {op.w_shape}; got {_shape_text(w.shape)}")
    _check_same_device(x, w)
    with tf.name_scope(name or "blocksparse_matmul"):
        return _differentiable(op)(x, w)


def _differentiable(op: BlocksparseMatMul):
    """The three passes of ``op`` joined into one ``tf.custom_gradient`` function of (x, w)."""

    @tf.custom_gradient
    def matmul(x, w):
        def grad(dy):
            return _pass(op, "bprop", dy, w), _pass(op, "updat", x, dy)

        return _pass(op, "fprop", x, w), grad

    return matmul


# -- checks -------------------------------------------------------------------------------------
def _shape_text(shape: tf.TensorShape) -> str:
    return "unknown rank" if shape.rank is None else str(tuple(shape.as_list()))


def _as_tensor(value, argument: str) -> tf.Tensor:
    try:
        tensor = tf.convert_to_tensor(value)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{argument} must be a tf.Tensor or convertible to one; got {type(value).__name__} ({error})"
        ) from error
    if tensor.dtype not in _NUMPY_DTYPES:
        raise TypeError(
            f"{argument} has dtype {tensor.dtype.name}; supported dtypes are {', '.join(SUPPORTED_DTYPES)}, "
            f"and {', '.join(CPU_ONLY_DTYPES)} on the CPU"
        )
    return tensor


def _check_activation(tensor: tf.Tensor, argument: str, features: int, feature_axis: int) -> None:
    """Check the static shape, as far as it is known (bsmm checks the rest at run time)."""
    shape = tensor.shape
    if shape.rank is None:
        return
    if shape.rank != 2 or shape[feature_axis] not in (None, features):
        expected = f"(N, {features})" if feature_axis == 1 else f"({features}, N)"
        raise ValueError(
            f"{argument} must have shape {expected} with feature_axis={feature_axis}; got {_shape_text(shape)}"
        )


def _check_same_device(x: tf.Tensor, w: tf.Tensor) -> None:
    # In graphs TensorFlow places the op and copies inputs itself; eagerly the memory is read where it is
    # (and a float64 pass placed on a GPU in a graph is refused by bsmm when it runs).
    if not tf.executing_eagerly():
        return
    if tuple(w.__dlpack_device__()) != tuple(x.__dlpack_device__()):
        raise ValueError(f"w is on {w.device} but x is on {x.device}; move them to one device (tf.device)")
    if x.dtype == tf.float64 and int(x.__dlpack_device__()[0]) in _DLPACK_CUDA_TYPES:
        raise TypeError(
            f"x has dtype float64, which bsmm runs only on the CPU; on {x.device} supported dtypes are "
            f"{', '.join(SUPPORTED_DTYPES)}"
        )


# -- one pass ------------------------------------------------------------------------------------
def _output_shape(op: BlocksparseMatMul, pass_name: str, n) -> tuple:
    """Shape of a pass's result; ``n`` is N (None when unknown)."""
    if pass_name == "updat":
        return op.w_shape
    features = op.K if pass_name == "fprop" else op.C
    return (n, features) if op.feature_axis == 1 else (features, n)


def _rows(op: BlocksparseMatMul, tensor: tf.Tensor):
    """N of an activation tensor, None if not known; 0 for a wrong rank (bsmm then refuses the tensor)."""
    shape = tensor.shape
    if shape.rank is None:
        return None
    return shape[1 - op.feature_axis] if shape.rank == 2 else 0


def _pass(op: BlocksparseMatMul, pass_name: str, a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """``op.<pass_name>(a, b)`` on tensors: directly when eager, as a py_function node in graphs."""
    if tf.executing_eagerly():
        return _run(op, pass_name, a, b)
    result = tf.py_function(
        functools.partial(_run, op, pass_name), [a, b], Tout=a.dtype, name=f"bsmm_{pass_name}"
    )
    result.set_shape(_output_shape(op, pass_name, _rows(op, a)))
    return result


def _run(op: BlocksparseMatMul, pass_name: str, a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """Run one pass on eager tensors ``a``, ``b`` of one device; no copies in or out."""
    shape = _output_shape(op, pass_name, _rows(op, a))
    device_type, device_id = (int(v) for v in a.__dlpack_device__())
    run = getattr(op, pass_name)
    if device_type in _DLPACK_CUDA_TYPES:
        return _run_cuda(run, a, b, shape, device_id)
    out = empty_aligned(shape, _NUMPY_DTYPES[a.dtype])  # Eigen kernels assume 64 bytes
    run(_shared(a, np.from_dlpack), _shared(b, np.from_dlpack), out=out)
    return _adopt(out, a.dtype)


def _run_cuda(run, a: tf.Tensor, b: tf.Tensor, shape: tuple, device_id: int) -> tf.Tensor:
    import cupy

    def as_cupy(tensor):
        # TensorFlow's __dlpack__ refuses the stream CuPy passes; its capsule carries none.
        return cupy.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))

    with tf.device(a.device):
        out = tf.raw_ops.Empty(shape=shape, dtype=a.dtype, init=False)
        with cupy.cuda.Device(device_id):
            # The inputs may still be in flight on TensorFlow's stream, and `out` may reuse
            # memory that its pending kernels read: wait for them all.
            tf.raw_ops.SyncDevice()
            run(_shared(a, as_cupy), _shared(b, as_cupy), out=_shared(out, as_cupy))
            # TensorFlow reads `out` on its own stream, which does not wait for CuPy's.
            cupy.cuda.get_current_stream().synchronize()
    return out


def _shared(tensor: tf.Tensor, from_dlpack):
    """``tensor``'s memory as a NumPy or CuPy array (``from_dlpack`` picks which), no copy."""
    if tensor.dtype == tf.bfloat16:
        return from_dlpack(tf.bitcast(tensor, tf.int16)).view(_BFLOAT16)
    return from_dlpack(tensor)


def _adopt(array: np.ndarray, dtype: tf.DType) -> tf.Tensor:
    """A CPU tensor sharing ``array``'s memory (it keeps ``array`` alive)."""
    if dtype == tf.bfloat16:
        return tf.bitcast(tf.experimental.dlpack.from_dlpack(array.view(np.int16).__dlpack__()), tf.bfloat16)
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())


# -- the Keras layer -------------------------------------------------------------------------------
class _LayoutNormal(keras.initializers.Initializer):
    """:func:`bsmm.initializers.normal` as a Keras initializer (std = 1 / sqrt(fan-in) per block column).

    Without a seed, each call draws one from NumPy's global generator, which
    ``keras.utils.set_random_seed`` seeds: runs are then reproducible.
    """

    def __init__(self, op: BlocksparseMatMul, seed=None):
        self.op, self.seed = op, seed

    def __call__(self, shape, dtype=None):
        if tuple(shape) != self.op.w_shape:
            raise ValueError(f"shape must be w_shape {self.op.w_shape}; got {tuple(shape)}")
        seed = np.random.randint(2**31 - 1) if self.seed is None else self.seed
        data = initializers.normal(self.op.layout, self.op.block_size, dtype=np.float32, seed=seed)
        return tf.cast(data, dtype or "float32")


@keras.saving.register_keras_serializable(package="bsmm")
class BlockSparseDense(keras.layers.Layer):
    """A dense layer whose kernel is block-sparse: ``y = activation(x·W + bias)``.

    Parameters
    ----------
    units : int
        Output features ``K``; must equal ``layout.shape[1] * block_size``.
    layout : (C // block_size, K // block_size) array or nested list of 0/1
        Present blocks of ``W``; ``C`` is the number of input features.
    block_size : int
        8, 16, 32, 64 or 128.
    use_bias : bool
        Add a bias vector of shape (K,).
    feature_axis : {1, 0}
        1: inputs (..., C) to outputs (..., K), leading axes flattened into N;
        0: inputs (C, N) to outputs (K, N).
    activation, kernel_regularizer, bias_regularizer, kernel_constraint, bias_constraint
        As in ``keras.layers.Dense``.
    kernel_initializer : Keras initializer, optional
        Called with shape (nnzb, bs, bs). The default draws each block column
        from N(0, 1 / fan-in) (:func:`bsmm.initializers.normal`); Keras'
        own initializers would read the fans off the block data's shape instead.
    bias_initializer : Keras initializer
    tf32 : bool, optional
        TF32 tensor cores for float32 on the GPU (see :class:`bsmm.BlocksparseMatMul`).
    **kwargs
        Keras layer arguments (``name``, ``dtype``, ``trainable``, ...).

    Attributes
    ----------
    op : bsmm.BlocksparseMatMul
    kernel : Keras variable (nnzb, bs, bs)
    bias : Keras variable (K,), or None

    Works with mixed-precision policies (float16 and bfloat16 compute dtypes),
    ``model.fit`` (eager or in graphs; not under XLA) and ``.keras`` saving, the
    layout travelling in ``get_config`` as a nested list.

    Examples
    --------
    >>> import numpy as np, keras, bsmm.tf
    >>> layer = bsmm.tf.BlockSparseDense(16, np.array([[1, 0], [1, 1]]), block_size=8)
    >>> y = layer(np.ones((4, 16), np.float32))
    >>> tuple(y.shape), tuple(layer.kernel.shape)
    ((4, 16), (3, 8, 8))
    """

    def __init__(
        self,
        units: int,
        layout,
        block_size: int = 32,
        use_bias: bool = True,
        feature_axis: int = 1,
        activation=None,
        kernel_initializer=None,
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        tf32: bool | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if keras.backend.backend() != "tensorflow":
            raise RuntimeError(
                f"BlockSparseDense needs Keras' TensorFlow backend; KERAS_BACKEND is {keras.backend.backend()!r}"
            )
        self.op = BlocksparseMatMul(layout, block_size=block_size, feature_axis=feature_axis, tf32=tf32)
        if isinstance(units, bool) or not isinstance(units, (int, np.integer)) or units != self.op.K:
            raise ValueError(
                f"units must be layout.shape[1] * block_size = {self.op.K} for a layout of shape "
                f"{self.op.layout.shape} and block_size {self.op.block_size}; got {units!r}"
            )
        self.units = int(units)
        self.use_bias = bool(use_bias)
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = None if kernel_initializer is None else keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.supports_jit = False  # tf.py_function has no XLA lowering
        self.bias = None

    @property
    def feature_axis(self) -> int:
        return self.op.feature_axis

    def _check_input_shape(self, input_shape) -> None:
        input_shape = tuple(input_shape)
        if self.feature_axis == 1:
            ok = len(input_shape) >= 2 and input_shape[-1] in (None, self.op.C)
            expected = f"(..., {self.op.C})"
        else:
            ok = len(input_shape) == 2 and input_shape[0] in (None, self.op.C)
            expected = f"({self.op.C}, N)"
        if not ok:
            raise ValueError(
                f"inputs of {self.name} must have shape {expected} with feature_axis={self.feature_axis}; "
                f"got {input_shape}"
            )

    def build(self, input_shape):
        self._check_input_shape(input_shape)
        self.kernel = self.add_weight(
            name="kernel",
            shape=self.op.w_shape,
            initializer=self.kernel_initializer or _LayoutNormal(self.op),
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias",
                shape=(self.units,),
                initializer=self.bias_initializer,
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint,
            )

    def call(self, inputs):
        x = tf.convert_to_tensor(inputs)
        self._check_input_shape(x.shape)
        leading = None
        if self.feature_axis == 1 and x.shape.rank != 2:
            leading = tf.shape(x)[:-1]
            x = tf.reshape(x, (-1, self.op.C))  # a view: the tensor is contiguous
        y = blocksparse_matmul(x, self.kernel, self.op)
        if self.bias is not None:
            bias = tf.cast(self.bias, y.dtype)
            y = y + (bias if self.feature_axis == 1 else bias[:, None])
        if leading is not None:
            y = tf.reshape(y, tf.concat([leading, [self.units]], axis=0))
        return self.activation(y)

    def compute_output_shape(self, input_shape):
        input_shape = tuple(input_shape)
        if self.feature_axis == 1:
            return input_shape[:-1] + (self.units,)
        return (self.units,) + input_shape[1:]

    def get_config(self):
        config = super().get_config()
        config.update(
            units=self.units,
            layout=self.op.layout.tolist(),
            block_size=self.op.block_size,
            use_bias=self.use_bias,
            feature_axis=self.feature_axis,
            activation=keras.activations.serialize(self.activation),
            kernel_initializer=(
                None if self.kernel_initializer is None else keras.initializers.serialize(self.kernel_initializer)
            ),
            bias_initializer=keras.initializers.serialize(self.bias_initializer),
            kernel_regularizer=keras.regularizers.serialize(self.kernel_regularizer),
            bias_regularizer=keras.regularizers.serialize(self.bias_regularizer),
            kernel_constraint=keras.constraints.serialize(self.kernel_constraint),
            bias_constraint=keras.constraints.serialize(self.bias_constraint),
            tf32=self.op.tf32,
        )
        return config

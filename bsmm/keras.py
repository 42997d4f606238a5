"""Keras 3: :class:`BlockSparseDense`, one layer for Keras' TensorFlow, JAX and PyTorch backends.

``import bsmm.keras`` imports Keras, which imports the backend ``KERAS_BACKEND`` names (``import bsmm``
alone imports neither). The layer runs bsmm's adapter for that backend, imported at the first
layer made: :func:`bsmm.tf.blocksparse_matmul`, :func:`bsmm.jax.blocksparse_matmul` or
:func:`bsmm.torch.blocksparse_matmul`; so ``model.fit`` trains it as the backend's trainer trains any
layer (under ``jax.jit`` on JAX; in plain graphs on TensorFlow, whose op has no XLA lowering).
``bsmm.tf.BlockSparseDense`` is this class.
"""

from __future__ import annotations

import functools

import numpy as np

try:
    import keras
except ImportError as error:
    raise ImportError("bsmm.keras needs Keras 3: pip install keras") from error

from bsmm import initializers
from bsmm.matmul import BlocksparseMatMul

if int(keras.__version__.split(".", 1)[0]) < 3:
    raise ImportError(f"bsmm.keras needs Keras 3; found Keras {keras.__version__}: pip install -U keras")

__all__ = ["BlockSparseDense"]

#: The Keras backends the layer runs on, and bsmm's adapter for each.
BACKENDS = {"tensorflow": "bsmm.tf", "jax": "bsmm.jax", "torch": "bsmm.torch"}


@functools.cache
def _backend_matmul(backend: str):
    """``blocksparse_matmul(x, w, op)`` of bsmm's adapter for a Keras backend, imported on first use."""
    if backend == "tensorflow":
        from bsmm.tf.functional import blocksparse_matmul  # optional: only the backend in use is imported

        return blocksparse_matmul
    if backend == "jax":
        from bsmm.jax.functional import blocksparse_matmul  # optional: only the backend in use is imported

        return blocksparse_matmul
    if backend == "torch":
        from bsmm.torch.functional import blocksparse_matmul  # optional: only the backend in use is imported

        # (bsmm.torch copies strided inputs itself, as F.linear does)
        return blocksparse_matmul
    raise NotImplementedError(
        f"BlockSparseDense runs on Keras' {', '.join(BACKENDS)} backends; KERAS_BACKEND is {backend!r}"
    )


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
        return keras.ops.cast(data, dtype or "float32")


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
        Block data in the layout's row-major block order (``op.w_shape``).
    bias : Keras variable (K,), or None

    Raises
    ------
    ValueError
        If ``units`` does not match the layout, or an input's shape does not fit it.
    NotImplementedError
        If Keras' backend is not TensorFlow, JAX or PyTorch.

    Notes
    -----
    Works with mixed-precision policies (float16 and bfloat16 compute dtypes),
    ``model.fit`` and ``.keras`` saving, the layout travelling in ``get_config`` as a
    nested list; a file saved on one backend loads on the others. On TensorFlow, Keras'
    ``jit_compile="auto"`` picks plain graphs, as the op cannot run under XLA
    (``supports_jit`` is False there); on JAX the trainer's ``jax.jit`` runs it.

    Examples
    --------
    >>> import numpy as np, keras, bsmm.keras
    >>> layer = bsmm.keras.BlockSparseDense(16, np.array([[1, 0], [1, 1]]), block_size=8)
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
        backend = keras.config.backend()
        _backend_matmul(backend)  # raises on a backend bsmm has no adapter for
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
        self.supports_jit = backend != "tensorflow"  # bsmm.tf's tf.py_function has no XLA lowering
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
        x = keras.ops.convert_to_tensor(inputs)
        self._check_input_shape(x.shape)
        leading = None
        if self.feature_axis == 1 and len(x.shape) != 2:
            # bsmm.tf takes (N, C) only; a dimension unknown until a TensorFlow graph runs stays a tensor here.
            leading = keras.ops.shape(x)[:-1]
            x = keras.ops.reshape(x, (-1, self.op.C))
        # .value: the autocast value under a mixed policy, and the traced one inside stateless_call.
        y = _backend_matmul(keras.config.backend())(x, self.kernel.value, self.op)
        if self.bias is not None:
            bias = keras.ops.cast(self.bias.value, y.dtype)
            y = y + (bias if self.feature_axis == 1 else keras.ops.expand_dims(bias, 1))
        if leading is not None:
            y = keras.ops.reshape(y, (*leading, self.units))
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

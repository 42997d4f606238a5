"""The Keras layer :class:`BlockSparseDense`: :class:`bsmm.keras.BlockSparseDense`, which on Keras'
TensorFlow backend runs :func:`bsmm.tf.blocksparse_matmul` (and on the JAX and PyTorch backends, those
adapters' products)."""

from __future__ import annotations

try:
    import keras
except ImportError as error:
    raise ImportError("bsmm.tf needs Keras 3, which TensorFlow >= 2.16 installs: pip install keras") from error

if int(keras.__version__.split(".", 1)[0]) < 3:
    raise ImportError(f"bsmm.tf needs Keras 3 (TensorFlow >= 2.16); found Keras {keras.__version__}")

from bsmm.keras import BlockSparseDense  # noqa: E402  (after the checks above, for their messages)

__all__ = ["BlockSparseDense"]

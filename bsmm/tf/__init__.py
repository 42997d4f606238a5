"""TensorFlow adapter: bsmm's passes as a differentiable op, and a Keras layer.

``import bsmm.tf`` imports TensorFlow and Keras 3 (``import bsmm`` alone imports neither). It offers
:func:`blocksparse_matmul` (:mod:`~bsmm.tf.functional`), ``y = x·W`` as a ``tf.custom_gradient`` op,
eager and inside ``tf.function``, and :class:`BlockSparseDense` (:mod:`~bsmm.tf.layers`), a Keras
layer whose kernel holds the block data; each pass shares the tensors' memory without copies
(:mod:`~bsmm.tf.passes`).

Limits: no XLA (``jit_compile=True``), as ``tf.py_function`` cannot be compiled
(``BlockSparseDense`` sets ``supports_jit = False``, so Keras' ``jit_compile="auto"`` picks plain
graphs); graphs holding the op cannot be exported as SavedModels for use without Python;
gradients are first order only.
"""

# First: bsmm.tf.functional names the package to install where TensorFlow is missing, and
# bsmm.tf.layers where Keras 3 is.
from bsmm.tf.functional import blocksparse_matmul
from bsmm.tf.layers import BlockSparseDense

__all__ = ["BlockSparseDense", "blocksparse_matmul"]

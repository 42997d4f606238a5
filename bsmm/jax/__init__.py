"""JAX adapter: block-sparse ``x·W`` and convolutions as differentiable JAX functions, and layers over params.

:func:`blocksparse_matmul` works under ``jax.jit``, ``jax.grad`` (reverse mode of any order,
through ``jax.custom_vjp``), ``jax.vmap``, ``lax.scan`` and ``jax.checkpoint``;
:class:`BlockSparseDense` and :class:`BlockSparseConv` are small layers over a params pytree.
Import it explicitly (``import bsmm.jax``); ``import bsmm`` alone does not import JAX. Modules:
:mod:`~bsmm.jax.functional`, :mod:`~bsmm.jax.layers`, :mod:`~bsmm.jax.autodiff` (the VJPs),
:mod:`~bsmm.jax.passes` (each pass an XLA custom call on XLA's own buffers), :mod:`~bsmm.jax.checks`.
:func:`l2_normalize` (:mod:`~bsmm.jax.normalization`) is the seed's weight normalization in ``jnp``.
On several devices: a batch-sharded ``x`` under ``jax.jit`` runs shard by shard
(:mod:`~bsmm.jax.partitioning`), and :class:`ShardedMatMul` with :func:`sharded_matmul` spread one
layer's blocks over a mesh axis (:mod:`~bsmm.jax.sharded`).

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

# First, for clear ImportErrors where JAX is missing or too old (the modules below import it).
try:
    import jax
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("bsmm.jax needs JAX: pip install jax") from error
try:
    import jax.experimental.buffer_callback  # (what bsmm.jax.passes runs each pass through)
except ImportError as error:  # pragma: no cover
    raise ImportError(
        f"bsmm.jax needs JAX >= 0.7 (jax.experimental.buffer_callback); found JAX {jax.__version__}: "
        f"pip install -U jax"
    ) from error

from bsmm.jax.functional import blocksparse_conv, blocksparse_matmul  # noqa: E402
from bsmm.jax.layers import BlockSparseConv, BlockSparseDense  # noqa: E402
from bsmm.jax.normalization import l2_normalize  # noqa: E402
from bsmm.jax.sharded import ShardedMatMul, sharded_matmul  # noqa: E402

__all__ = ["BlockSparseConv", "BlockSparseDense", "ShardedMatMul", "blocksparse_conv", "blocksparse_matmul",
           "l2_normalize", "sharded_matmul"]

"""Model parallelism for JAX: one layer's blocks spread over a mesh axis, :class:`ShardedMatMul` and :func:`sharded_matmul`.

The layout is cut with :func:`bsmm.split_layout` into one contiguous part per device along a mesh
axis; each device multiplies with its part and JAX's collectives join the parts. SPMD code is one
program for every device while the parts differ in blocks and features, so each part's weight is
padded to the largest part's block count and the parts are stacked, ``(parts, nnzb, bs, bs)``,
sharded along the mesh axis; ``lax.switch`` on the device's index along the axis picks its part's
operator; features are padded to the widest part where parts meet. Gradients are ``shard_map``'s:
those of one device computing the whole layer with the same loss.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bsmm.jax.functional import blocksparse_matmul
from bsmm.jax.passes import vary_alike
from bsmm.matmul import BlocksparseMatMul
from bsmm.block_index import check_block_size
from bsmm.config import settings
from bsmm.sharding import LayoutSplit, split_layer

__all__ = ["ShardedMatMul", "sharded_matmul"]

class ShardedMatMul:
    """The static description of a block-sparse ``x·W`` whose blocks are spread over a mesh axis.

    ``layout`` is cut into ``parts`` contiguous parts, one per device along the mesh axis that
    :func:`sharded_matmul` is given, balanced by block count (:func:`bsmm.split_layout`):

    - ``by="columns"``: part p holds W's block columns ``bounds[p]:bounds[p+1]`` (output features
      ``split.features(p, block_size)``) and multiplies the whole ``x``. ``output="replicated"``
      all-gathers the whole ``y`` on every device; ``output="sharded"`` leaves each device its own
      output features.
    - ``by="rows"``: part p holds W's block rows (input features ``split.features(p, block_size)``).
      ``input="replicated"``: ``x`` is whole on every device and each takes its features;
      ``input="sharded"``: ``x`` holds only this part's features (the sharded output of a
      ``by="columns"`` layer cut at the same bounds). The partial sums are all-reduced
      (``output="replicated"``) or reduce-scattered (``output="sharded"``: device p gets output
      features ``p*K/P`` to ``(p+1)*K/P``).

    Features split by parts are held padded to the widest part, ``width`` features per device
    (its own first, then zeros): the "parts form", ``(..., parts * width)`` as a global array.
    :meth:`to_parts` and :meth:`from_parts` convert between it and the whole features; when
    the parts are equally wide it is the whole array itself.

    Parameters
    ----------
    layout : (CB, KB) array of 0/1
        The whole layer's layout.
    parts : int
        Devices along the mesh axis.
    block_size : int, optional
        Default: the configuration's (``[defaults] block_size``).
    by : {"columns", "rows"}
    input, output : {"replicated", "sharded"}
    bounds : sequence of parts + 1 ints, optional
        Cut points instead of balanced ones (:func:`bsmm.split_layout`).
    feature_axis, tf32
        As :class:`bsmm.BlocksparseMatMul`.

    Attributes
    ----------
    split : bsmm.LayoutSplit
    ops : tuple of bsmm.BlocksparseMatMul
        Each part's operator, over its own layout.
    C, K, block_size, feature_axis, parts
        Of the whole layer.
    counts : tuple of ints
        Each part's features along the cut (outputs for ``"columns"``, inputs for ``"rows"``).
    width : int
        The widest part's features.
    w_shape : (parts, nnzb, block_size, block_size)
        The stacked weight, ``nnzb`` the largest part's block count.

    Raises
    ------
    ValueError
        ``by``, ``input`` or ``output`` unknown, ``input="sharded"`` with ``by="columns"``, or
        ``output="sharded"`` with ``by="rows"`` and K (out_features) not divisible by ``parts``.

    Examples
    --------
    >>> import numpy as np, jax.numpy as jnp, bsmm, bsmm.jax
    >>> layer = bsmm.jax.ShardedMatMul(np.ones((2, 4)), parts=2, block_size=8, by="columns")
    >>> layer.split.bounds, layer.w_shape
    ((0, 2, 4), (2, 4, 8, 8))
    >>> w = jnp.asarray(bsmm.BlocksparseMatMul(np.ones((2, 4)), block_size=8).normal_init(seed=0))
    >>> bool((layer.gather_weight(layer.shard_weight(w)) == w).all())
    True
    """

    def __init__(self, layout, parts: int, block_size: int | None = None, *, by: str = "columns",
                 input: str = "replicated", output: str = "replicated", bounds=None, feature_axis: int | None = None,
                 tf32: bool | None = None):
        block_size = check_block_size(settings()["defaults"]["block_size"] if block_size is None else block_size)
        self.split: LayoutSplit = split_layer(layout, parts, block_size, by, input, output, bounds,
                                              "devices along the mesh axis")
        self.ops = tuple(BlocksparseMatMul(self.split.part_layout(p), block_size, feature_axis, tf32)
                         for p in range(self.split.parts))
        first = self.ops[0]
        self.by, self.input, self.output = by, input, output
        self.parts, self.block_size, self.feature_axis = self.split.parts, first.block_size, first.feature_axis
        self.C, self.K = (dim * self.block_size for dim in self.split.layout.shape)
        self.counts = self.split.feature_counts(self.block_size)
        self.width = max(self.counts)
        self.w_shape = (self.parts, max(self.split.blocks), self.block_size, self.block_size)

    def __repr__(self) -> str:
        return (f"ShardedMatMul(C={self.C}, K={self.K}, block_size={self.block_size}, by={self.by!r}, "
                f"input={self.input!r}, output={self.output!r}, parts={self.parts}, blocks={list(self.split.blocks)})")

    # -- weights ------------------------------------------------------------------------------------
    def shard_weight(self, w):
        """The whole layer's weight (nnzb, bs, bs), in its layout's storage order, as the stacked
        ``w_shape``: part p's blocks (``split.weight_index(p)``) first in row p, then zeros."""
        w = _replicated(jnp.asarray(w))
        whole = (int(np.count_nonzero(self.split.layout)), self.block_size, self.block_size)
        if tuple(w.shape) != whole:
            raise ValueError(f"w must have the whole layer's shape {whole}; got {tuple(w.shape)}")
        rows = []
        for p in range(self.parts):
            mine = w[self.split.weight_index(p)]
            rows.append(jnp.pad(mine, ((0, self.w_shape[1] - mine.shape[0]), (0, 0), (0, 0))))
        return jnp.stack(rows)

    def gather_weight(self, stacked):
        """The inverse of :meth:`shard_weight`: the whole layer's weight (nnzb, bs, bs) from the stacked one."""
        stacked = _replicated(jnp.asarray(stacked))
        if tuple(stacked.shape) != self.w_shape:
            raise ValueError(f"stacked must have shape w_shape {self.w_shape}; got {tuple(stacked.shape)}")
        mine = jnp.concatenate([stacked[p, :count] for p, count in enumerate(self.split.blocks)])
        return mine[self.split.gather_index()]

    # -- features -----------------------------------------------------------------------------------
    def _feature_dim(self, a) -> int:
        return a.ndim - 1 if self.feature_axis == 1 else 0

    def to_parts(self, a):
        """Whole features along the cut, ``(..., C)`` for ``"rows"`` or ``(..., K)`` for ``"columns"``
        (features first with ``feature_axis=0``), to the parts form ``(..., parts * width)``."""
        dim = self._feature_dim(a)
        expected = self.C if self.by == "rows" else self.K
        if a.ndim == 0 or a.shape[dim] != expected:
            raise ValueError(f"a must have {expected} features along axis {dim}; got shape {tuple(a.shape)}")
        if all(count == self.width for count in self.counts):
            return a
        pieces = []
        for p, count in enumerate(self.counts):
            piece = lax.slice_in_dim(a, self.split.features(p, self.block_size).start, self.split.features(
                p, self.block_size).stop, axis=dim)
            pieces.append(_pad_features(piece, self.width, dim))
        return jnp.concatenate(pieces, axis=dim)

    def from_parts(self, a):
        """The parts form ``(..., parts * width)`` back to the whole features (padding dropped)."""
        dim = self._feature_dim(a)
        if a.ndim == 0 or a.shape[dim] != self.parts * self.width:
            raise ValueError(f"a must have parts * width = {self.parts * self.width} features along axis {dim}; "
                             f"got shape {tuple(a.shape)}")
        if all(count == self.width for count in self.counts):
            return a
        return jnp.concatenate([lax.slice_in_dim(a, p * self.width, p * self.width + count, axis=dim)
                                for p, count in enumerate(self.counts)], axis=dim)

    # -- the local computation ----------------------------------------------------------------------------
    def _local(self, x, w, bias, axis_name):
        """This device's part, inside ``shard_map``: x, w (1, nnzb, bs, bs) and bias (K,) local."""
        dim = self._feature_dim(x)
        # Cast to vary alike before the switch, not inside it: the cast's transpose is a psum, and a
        # collective in a branch that only some devices take would wait forever for the others.
        x, w = vary_alike(x, w[0])
        inner_bias = None if bias is None or self.by == "rows" else vary_alike(bias, w)[0]  # (rows: added after)

        def branch(p):
            op, blocks = self.ops[p], self.split.blocks[p]
            features = self.split.features(p, self.block_size)

            def run(x, w, bias):
                if self.by == "rows":
                    if self.input == "replicated":
                        x = lax.slice_in_dim(x, features.start, features.stop, axis=dim)
                    else:
                        x = lax.slice_in_dim(x, 0, self.counts[p], axis=dim)
                y = blocksparse_matmul(x, w[:blocks], op)
                if self.by == "columns":
                    if bias is not None:
                        y = _add_bias(y, bias[features], dim)
                    y = _pad_features(y, self.width, dim)
                return y

            return run

        y = lax.switch(lax.axis_index(axis_name), [branch(p) for p in range(self.parts)], x, w, inner_bias)
        if self.by == "columns":
            if self.output == "replicated":
                y = self.from_parts(lax.all_gather(y, axis_name, axis=dim, tiled=True, to="invarying"))
            return y
        if self.output == "replicated":
            y = lax.psum(y, axis_name)
            return y if bias is None else _add_bias(y, bias, dim)
        y = lax.psum_scatter(y, axis_name, scatter_dimension=dim, tiled=True)
        if bias is None:
            return y
        share = self.K // self.parts
        return _add_bias(y, lax.dynamic_slice_in_dim(bias, lax.axis_index(axis_name) * share, share), dim)


def _replicated(a):
    """``a`` whole on every device where its type says it is sharded along explicit mesh axes (JAX
    refuses to index such an array without being told the result's sharding); else ``a`` itself."""
    sharding = getattr(jax.typeof(a), "sharding", None)
    if sharding is None or all(entry is None for entry in sharding.spec):
        return a
    return jax.sharding.reshard(a, NamedSharding(sharding.mesh, PartitionSpec()))


def _pad_features(a, width: int, dim: int):
    if a.shape[dim] == width:
        return a
    padding = [(0, 0)] * a.ndim
    padding[dim] = (0, width - a.shape[dim])
    return jnp.pad(a, padding)


def _add_bias(y, bias, dim: int):
    return y + bias.astype(y.dtype).reshape((-1,) + (1,) * (y.ndim - dim - 1))


def sharded_matmul(x, w, layer: ShardedMatMul, axis_name: str, *, bias=None, mesh: Mesh | None = None,
                   batch_axis=None):
    """y = x·W (+ bias) with W's blocks spread along the mesh axis ``axis_name`` as ``layer`` cuts them.

    Two ways to call it:

    - Inside your own ``jax.shard_map`` (``mesh=None``): ``x``, ``w`` and ``bias`` are this device's
      local arrays and ``axis_name`` is a mesh axis of the shard_map, of ``layer.parts`` devices;
      other mesh axes (a batch axis) are yours.
    - With ``mesh``: ``x``, ``w`` and ``bias`` are global arrays and this function runs the
      ``shard_map`` over ``axis_name`` and, if given, ``batch_axis``.

    Parameters
    ----------
    x : activations, (..., C) with ``feature_axis=1``, (C, N) with ``feature_axis=0``
        The whole input (``input="replicated"``) or its parts form (``input="sharded"``: globally
        ``(..., parts * width)``, locally ``(..., width)``). With ``mesh``, the batch may be sharded
        along ``batch_axis``.
    w : the stacked weight, ``layer.w_shape`` globally (:meth:`ShardedMatMul.shard_weight`);
        locally ``(1, nnzb, bs, bs)``, as ``shard_map`` hands out ``w`` with ``in_specs=P(axis_name)``.
    layer : ShardedMatMul
    axis_name : str
        The mesh axis the parts are spread over.
    bias : (K,) array, optional
        The whole bias, the same on every device.
    mesh : jax.sharding.Mesh, optional
    batch_axis : str or tuple of str, optional
        With ``mesh``: the mesh axes that shard the batch (rows) of ``x`` and ``y`` (data parallel
        beside the model parallel axis); weight gradients are summed over them by ``shard_map``.

    Returns
    -------
    y : (..., K) (``output="replicated"``, or ``"sharded"`` with ``by="rows"``: globally the whole
        (..., K), locally K / parts features), or the parts form of the outputs (``"sharded"`` with
        ``by="columns"``); features first with ``feature_axis=0``.

    Raises
    ------
    TypeError
        ``layer`` is not a ShardedMatMul, or the dtypes of ``x``, ``w`` and ``bias`` differ.
    ValueError
        ``axis_name`` (or ``batch_axis``) is not an axis of ``mesh`` (or of the enclosing
        ``shard_map``), the axis does not have ``layer.parts`` devices, an array has the wrong shape, or
        the batch of ``x`` is not divisible by the devices of ``batch_axis``.

    Notes
    -----
    Gradients through ``jax.grad`` are those of one device running the whole layer with the same
    loss: ``shard_map``'s autodiff transposes the collectives (its default ``check_vma=True`` is what
    sums the gradients of inputs replicated along ``axis_name``; keep it on in your own ``shard_map``).

    Examples
    --------
    On as many devices as the mesh has (here the one CPU device; the same code runs on several):

    >>> import numpy as np, jax, jax.numpy as jnp, bsmm, bsmm.jax
    >>> layout = np.array([[1, 1, 0], [0, 1, 1]])
    >>> mesh = jax.make_mesh((1,), ("model",))
    >>> layer = bsmm.jax.ShardedMatMul(layout, parts=1, block_size=8, by="columns")
    >>> whole = bsmm.BlocksparseMatMul(layout, block_size=8)
    >>> w = jnp.asarray(whole.normal_init(seed=0))
    >>> x = jnp.ones((4, 16))
    >>> y = bsmm.jax.sharded_matmul(x, layer.shard_weight(w), layer, "model", mesh=mesh)
    >>> bool(jnp.allclose(y, bsmm.jax.blocksparse_matmul(x, w, whole), atol=1e-5))
    True
    """
    if not isinstance(layer, ShardedMatMul):
        raise TypeError(f"layer must be a bsmm.jax.ShardedMatMul; got {type(layer).__name__}")
    for name, value in (("x", x), ("w", w), ("bias", bias)):
        if value is not None and not (hasattr(value, "shape") and hasattr(value, "dtype")):
            raise TypeError(f"{name} must be a JAX or NumPy array; got {type(value).__name__}")
    for name, value in (("w", w), ("bias", bias)):
        if value is not None and value.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {value.dtype} but x has {x.dtype}; pass one dtype")
    if bias is not None and tuple(bias.shape) != (layer.K,):
        raise ValueError(f"bias must have shape ({layer.K},) (the whole layer's out_features); got {tuple(bias.shape)}")
    if mesh is None:
        _check_enclosing_axis(axis_name, layer, batch_axis)
        _check_local_shapes(x, w, layer)
        return layer._local(x, w, bias, axis_name)
    batch = _check_mesh(mesh, axis_name, batch_axis, layer)
    _check_global_shapes(x, w, layer)
    rows_dim, features_dim = (0, x.ndim - 1) if layer.feature_axis == 1 else (1, 0)
    if batch:
        devices = int(np.prod([mesh.shape[axis] for axis in batch]))
        if x.shape[rows_dim] % devices:
            raise ValueError(f"x's batch ({x.shape[rows_dim]} rows along axis {rows_dim}) must be divisible by the "
                             f"{devices} devices of batch_axis {batch_axis!r}")

    def spec(features_sharded: bool, ndim: int) -> PartitionSpec:
        entries = [None] * ndim
        if batch:
            entries[rows_dim] = batch
        if features_sharded:
            entries[features_dim] = axis_name
        return PartitionSpec(*entries)

    x_spec = spec(layer.input == "sharded", x.ndim)
    y_spec = spec(layer.output == "sharded", x.ndim)
    return _placed(x, w, bias, layer, axis_name, mesh, x_spec, y_spec)


# Under jit even when called eagerly: an eager shard_map cannot run bsmm's custom_vjp (JAX 0.10 raises
# NotImplementedError for a custom_vjp with symbolic zeros there). One jitted function for all calls, the
# static arguments its cache key, so that an eager call of the same layer reuses the compiled program.
@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7))
def _placed(x, w, bias, layer, axis_name, mesh, x_spec, y_spec):
    in_specs = (x_spec, PartitionSpec(axis_name), PartitionSpec())
    # On a mesh of explicit axes shard_map refuses arrays placed otherwise than its specs say, so they
    # are resharded first; with automatic axes shard_map moves them itself.
    if jax.sharding.AxisType.Explicit in tuple(getattr(mesh, "axis_types", ())):
        x, w, bias = (None if value is None else jax.sharding.reshard(value, NamedSharding(mesh, spec))
                      for value, spec in zip((x, w, bias), in_specs))
    body = jax.shard_map(lambda x, w, bias: layer._local(x, w, bias, axis_name), mesh=mesh, in_specs=in_specs,
                         out_specs=y_spec)
    return body(x, w, bias)


def _check_mesh(mesh, axis_name, batch_axis, layer) -> tuple | None:
    """The batch axes as a tuple (None for none), once ``mesh`` has ``axis_name`` of ``layer.parts`` devices."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of mesh (its axes: {list(mesh.axis_names)})")
    if mesh.shape[axis_name] != layer.parts:
        raise ValueError(f"mesh axis {axis_name!r} has {mesh.shape[axis_name]} devices but layer has "
                         f"{layer.parts} parts: one part per device along axis_name")
    if batch_axis is None:
        return None
    batch = (batch_axis,) if isinstance(batch_axis, str) else tuple(batch_axis)
    for axis in batch:
        if axis not in mesh.axis_names or axis == axis_name:
            raise ValueError(f"batch_axis must name axes of mesh other than axis_name {axis_name!r} "
                             f"(mesh axes: {list(mesh.axis_names)}); got {batch_axis!r}")
    return batch


def _check_enclosing_axis(axis_name, layer, batch_axis) -> None:
    if batch_axis is not None:
        raise ValueError("batch_axis is for mesh=...: inside your own shard_map, the batch axes are yours")
    try:
        size = lax.axis_size(axis_name)
    except NameError as error:
        raise ValueError(f"axis_name {axis_name!r} is not a mesh axis of the enclosing shard_map (call "
                         f"sharded_matmul inside jax.shard_map, or pass mesh=...)") from error
    if size != layer.parts:
        raise ValueError(f"mesh axis {axis_name!r} has {size} devices but layer has {layer.parts} parts: "
                         f"one part per device along axis_name")


def _features_in(layer, local: bool) -> int:
    if layer.input == "replicated":
        return layer.C
    return layer.width if local else layer.parts * layer.width


def _check_x(x, layer, expected_features: int, form: str) -> None:
    dim = x.ndim - 1 if layer.feature_axis == 1 else 0
    if x.ndim < 1 or (layer.feature_axis == 0 and x.ndim != 2) or x.shape[dim] != expected_features:
        where = "(..., F)" if layer.feature_axis == 1 else "(F, N)"
        raise ValueError(f"x must have shape {where} with F = {expected_features} ({form}, input={layer.input!r}); "
                         f"got {tuple(x.shape)}")


def _check_local_shapes(x, w, layer) -> None:
    _check_x(x, layer, _features_in(layer, True), "this device's x")
    local = (1,) + layer.w_shape[1:]
    if tuple(w.shape) != local:
        raise ValueError(f"w must be this device's row of the stacked weight, shape {local} (shard_map in_specs "
                         f"P(axis_name) of layer.w_shape {layer.w_shape}); got {tuple(w.shape)}")


def _check_global_shapes(x, w, layer) -> None:
    _check_x(x, layer, _features_in(layer, False), "the global x")
    if tuple(w.shape) != layer.w_shape:
        raise ValueError(f"w must be the stacked weight of shape layer.w_shape {layer.w_shape} "
                         f"(layer.shard_weight(whole_w)); got {tuple(w.shape)}")

"""Data parallelism under ``jax.jit``: a pass on a batch-sharded operand runs shard by shard.

XLA's SPMD partitioner knows nothing of a custom call and replicates it: with ``x`` sharded
along its batch it would all-gather ``x`` and run the whole pass on every device. The rule here
(a ``jax.experimental.custom_partitioning``, with a sharding rule for Shardy and the callbacks of
the older GSPMD propagation) says what a pass is: ``fprop`` and ``bprop`` are row by row (each
device runs the pass on its rows of the activations, no collective), and ``updat`` is a sum over
rows (each device computes the weight gradient of its rows, then a ``psum`` over the batch's mesh
axes leaves the whole gradient on every device). Features and weights sharded otherwise are
gathered first, as XLA does for any operand it must replicate (FSDP-style weight sharding).

Why a primitive (:data:`pass_p`) that builds the ``custom_partitioning`` when it is lowered, rather
than a ``custom_partitioning`` around the buffer callback: a Python callback lowered inside a
``partition`` function lands in a throwaway module, not in the executable's table of host
callbacks, and XLA would then call a callback that does not exist (a crash; jax-ml/jax#23620,
still so in JAX 0.11). So the lowering registers the pass's callback in the program's own module
and the per-shard program calls it by its index there, through ``jax.ffi.ffi_call`` on the XLA
target that ``buffer_callback`` itself uses. A program on one device, one inside ``shard_map``
(where the pass already runs per shard), and batched passes (under ``jax.vmap``) lower the plain
buffer callback as before.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from bsmm.matmul import BlocksparseMatMul
from bsmm.passes import PASSES

__all__ = ["partitionable_pass", "pass_p"]

# XLA's FFI targets for jax.experimental.buffer_callback (jaxlib registers them), by platform.
_TARGETS = {"cpu": "xla_buffer_python_cpu_callback", "cuda": "xla_buffer_python_gpu_callback",
            "rocm": "xla_buffer_python_gpu_callback"}

pass_p = Primitive("bsmm_pass")
pass_p.def_impl(lambda a, b, *, call, callback, command_buffer: jaxpr_as_fun(call)(a, b)[0])


@pass_p.def_abstract_eval
def _abstract_eval(a, b, *, call, callback, command_buffer):
    """The pass's result type, with two things the buffer callback's own type leaves out: under
    ``shard_map``, the manual mesh axes it varies along (its operands'); with explicit mesh axes, that
    fprop and bprop keep the rows' sharding (else JAX would type the result replicated and gather it)."""
    out = call.out_avals[0]
    manual = [getattr(v, "manual_axis_type", None) for v in (a, b)]
    if None not in manual and (manual[0].varying or manual[1].varying):
        # The operands vary alike (bsmm.jax.autodiff casts them so); else like the wider one. (A manual
        # axis type needs the mesh, which a sharding carries.)
        wide = 0 if manual[0].varying >= manual[1].varying else 1
        mesh = (a, b)[wide].sharding.mesh
        out = out.update(sharding=NamedSharding(mesh, PartitionSpec()), manual_axis_type=manual[wide])
    if _row_wise(callback) and callback.pass_name != "updat":
        rows_dim = 0 if callback.op.feature_axis == 1 else 1
        spec = getattr(getattr(a, "sharding", None), "spec", ())
        if len(spec) > rows_dim and spec[rows_dim] is not None:
            entries = [None, None]
            entries[rows_dim] = spec[rows_dim]
            out = out.update(sharding=NamedSharding(a.sharding.mesh, PartitionSpec(*entries)))
    return out


def _row_wise(callback) -> bool:
    """Whether the pass is one :class:`_RowRule` describes: a product's, on unbatched operands."""
    return isinstance(callback.op, BlocksparseMatMul) and not callback.batch_shape


def partitionable_pass(call, callback, command_buffer: bool, a, b):
    """``call(a, b)``, a buffer callback running ``callback`` (a ``PassCallback``), as one :data:`pass_p`:
    the same program on one device; shard by shard under SPMD partitioning where :class:`_RowRule` applies."""
    jaxpr = jax.make_jaxpr(call)(jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(b.shape, b.dtype))
    return pass_p.bind(a, b, call=jaxpr, callback=callback, command_buffer=command_buffer)


def _lowering(ctx, a, b, *, call, callback, command_buffer):
    context = ctx.module_context.axis_context
    platforms = ctx.module_context.platforms
    partitioned = (_row_wise(callback) and isinstance(context, mlir.ShardingContext) and context.num_devices > 1
                   and context.device_assignment is not None and getattr(context, "abstract_mesh", None) is not None
                   and len(platforms) == 1 and platforms[0] in _TARGETS)
    if not partitioned:
        return mlir.lower_fun(jaxpr_as_fun(call), multiple_results=True)(ctx, a, b)

    def host_callback(execution_context, a, b, out):  # the calling convention of buffer_callback's targets
        callback(execution_context, out, a, b)
        return ()

    ctx.module_context.add_host_callback(host_callback)
    index = len(ctx.module_context.host_callbacks) - 1
    target = _TARGETS[platforms[0]] + ("_cmd_buffer" if command_buffer and platforms[0] != "cpu" else "")
    rule = _RowRule(callback.op, callback.pass_name, target, index)
    return [mlir.lower_fun(rule.custom_partitioning(), multiple_results=False)(ctx, a, b)]


mlir.register_lowering(pass_p, _lowering)
try:
    # Lowering needs the program's devices (custom_partitioning's own primitive is in this set).
    from jax._src import dispatch as _dispatch

    _dispatch.prim_requires_devices_during_lowering.add(pass_p)
except (ImportError, AttributeError):  # pragma: no cover - then no device assignment: the pass is replicated
    pass


class _RowRule:
    """How XLA partitions one pass of ``op`` whose activations are sharded along their rows (N)."""

    def __init__(self, op, pass_name: str, target: str, index: int):
        self.op, self.pass_name, self.target, self.index = op, pass_name, target, np.uint64(index)
        self.rows_dim = 0 if op.feature_axis == 1 else 1  # of the activations: (N, F) or (F, N)

    def custom_partitioning(self):
        rows = (lambda f: f"n {f}") if self.op.feature_axis == 1 else (lambda f: f"{f} n")
        rule = {"fprop": f"{rows('c')}, z i j -> {rows('k')}",
                "bprop": f"{rows('k')}, z i j -> {rows('c')}",
                "updat": f"{rows('c')}, {rows('k')} -> z i j"}[self.pass_name]
        # Only the rows may stay sharded: features and blocks are gathered (need replication); Shardy
        # wants those factors in their order of appearance.
        replicated = tuple(dict.fromkeys(f for f in rule.replace(",", " ").split() if f not in ("n", "->")))
        partitioned = custom_partitioning(self.local)
        partitioned.def_partition(self.partition, infer_sharding_from_operands=self.infer, sharding_rule=rule,
                                  need_replication_factors=replicated)
        return partitioned

    def local(self, a, b):
        """The pass on this device's buffers, through the callback the module registered."""
        shape = PASSES[self.pass_name].output_shape(self.op.C, self.op.K, self.op.w_shape, a.shape[self.rows_dim],
                                                    self.op.feature_axis)
        return jax.ffi.ffi_call(self.target, jax.ShapeDtypeStruct(shape, a.dtype))(a, b, index=self.index)

    def batch_axes(self, mesh, arg_shapes) -> tuple:
        """The mesh axes the activations' rows are sharded along, where they split N evenly (a pass on
        XLA's padding of uneven shards would add its garbage into updat's sum); () for none."""
        operands = arg_shapes if self.pass_name == "updat" else arg_shapes[:1]
        for operand in operands:
            sharding = operand.sharding
            if not isinstance(sharding, NamedSharding) or len(sharding.spec) <= self.rows_dim:
                continue
            entry = sharding.spec[self.rows_dim]
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            if axes and operand.shape[self.rows_dim] % math.prod(mesh.shape[axis] for axis in axes) == 0:
                return axes
        return ()

    def rows_sharding(self, mesh, axes: tuple) -> NamedSharding:
        spec = [None, None]
        spec[self.rows_dim] = axes or None
        return NamedSharding(mesh, PartitionSpec(*spec))

    def partition(self, mesh, arg_shapes, result_shape):
        axes = self.batch_axes(mesh, arg_shapes)
        rows, whole = self.rows_sharding(mesh, axes), NamedSharding(mesh, PartitionSpec())
        if self.pass_name != "updat":
            return mesh, self.local, rows, (rows, whole)

        def summed(a, b):
            partial = self.local(a, b)
            return jax.lax.psum(partial, axes) if axes else partial

        return mesh, summed, whole, (rows, rows)

    def infer(self, mesh, arg_shapes, result_shape):
        """The result's sharding, for GSPMD's propagation (Shardy reads the sharding rule instead)."""
        if self.pass_name == "updat":
            return NamedSharding(mesh, PartitionSpec())
        return self.rows_sharding(mesh, self.batch_axes(mesh, arg_shapes))

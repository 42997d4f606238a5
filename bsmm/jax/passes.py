"""One bsmm pass as an XLA custom call, for :mod:`bsmm.jax`.

:func:`run_pass` runs ``fprop``, ``bprop`` or ``updat`` of a :class:`~bsmm.BlocksparseMatMul`
(or of a convolution, :class:`ConvPasses`) through ``jax.experimental.buffer_callback``: XLA
hands the callback its own operand and result buffers and, on a GPU, its stream. They are
wrapped without copies as NumPy arrays, the CPU backend writing the result in place (the
``jax.pure_callback`` alternative copies the result into XLA's buffer and, measured with JAX
0.10, hands the callback copies of the inputs), or as CuPy arrays, the kernels launching on
XLA's stream (so a pass is ordered with the rest of the XLA program and never leaves jit).
Where it runs follows the DLPack device of the buffers, i.e. where XLA placed the computation
(``jax.default_backend()`` is wrong for arrays placed on a non-default device). A
``custom_vmap`` rule batches a pass by folding the batch into N where the layout of the
activations allows it and otherwise by looping over views of the batched buffers inside one call.
Each buffer callback is wrapped in :data:`bsmm.jax.partitioning.pass_p`, which lowers it unchanged
on one device and lets XLA run a product's pass shard by shard on a batch-sharded operand.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.buffer_callback import buffer_callback

from bsmm.backends.cuda import launches
from bsmm.arrays import _DLPACK_CPU, _DLPACK_CUDA
from bsmm.config import once, settings, warn
from bsmm.jax.partitioning import partitionable_pass
from bsmm.matmul import BlocksparseMatMul
from bsmm.passes import PASSES

__all__ = ["ConvPasses", "PassCallback", "run_pass", "vary_alike"]


# -- the host side of a pass ------------------------------------------------------------------
def _cupy_view(cupy, buffer, device_id: int):
    """A CuPy array over an XLA device buffer (no copy).

    Only the pointer is taken from ``__cuda_array_interface__``: its typestr for
    bfloat16 is a raw 2-byte void type, while ``buffer.dtype`` is the real dtype.
    """
    dtype = np.dtype(buffer.dtype)
    shape = tuple(buffer.shape)
    pointer = buffer.__cuda_array_interface__["data"][0]
    memory = cupy.cuda.UnownedMemory(pointer, math.prod(shape) * dtype.itemsize, buffer, device_id)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))


def _numpy_view(buffer, writeable: bool) -> np.ndarray:
    array = np.asarray(buffer)  # a view of XLA's host buffer
    if not writeable:
        array.flags.writeable = False  # inputs are XLA's: make any write fail loudly
    return array


def _pick(array, index: tuple):
    """``array[index]`` over the leading batch axes, where an axis of length 1 broadcasts."""
    return array[tuple(i if array.shape[axis] != 1 else 0 for axis, i in enumerate(index))]


class PassCallback:
    """What XLA calls for one pass: ``out[i] = pass(a[i], b[i])`` over the batch shape.

    Compared by value so that equal passes are equal custom calls to JAX's caches.
    """

    __slots__ = ("__weakref__", "batch_shape", "op", "pass_name")  # JAX keys caches on weak references

    def __init__(self, op: BlocksparseMatMul, pass_name: str, batch_shape: tuple):
        self.op, self.pass_name, self.batch_shape = op, pass_name, batch_shape

    def _key(self):
        return (id(self.op), self.pass_name, self.batch_shape)

    def __eq__(self, other):
        return type(other) is PassCallback and other.op is self.op and other._key() == self._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self) -> str:  # shown in jaxprs
        return f"bsmm.{self.pass_name}(batch_shape={self.batch_shape})"

    def __call__(self, context, out, a, b) -> None:
        device_type, device_id = (int(v) for v in out.__dlpack_device__())
        if device_type == _DLPACK_CUDA and not self.batch_shape and _repeat_on_cuda(
                self.op, self.pass_name, context.stream, device_id, out, a, b):
            return
        if device_type == _DLPACK_CPU:
            self._run(_numpy_view(out, True), _numpy_view(a, False), _numpy_view(b, False))
        elif device_type == _DLPACK_CUDA:
            import cupy

            # The kernels launch on CuPy's current stream: make it XLA's (on XLA's device,
            # entered first: the stream is pushed onto the current device's stack).
            with cupy.cuda.Device(device_id):
                with cupy.cuda.Stream.from_external(launches.StreamHandle(int(context.stream))):
                    self._run(*(_cupy_view(cupy, buffer, device_id) for buffer in (out, a, b)))
        else:
            raise NotImplementedError(
                f"bsmm runs on the CPU and on CUDA GPUs; XLA placed this pass on DLPack device type {device_type}"
            )

    def _run(self, out, a, b) -> None:
        run = getattr(self.op, self.pass_name)
        for index in np.ndindex(*self.batch_shape):
            run(_pick(a, index), _pick(b, index), out=out[index])


def _repeat_on_cuda(op, pass_name: str, stream: int, device_id: int, out, a, b) -> bool:
    """Launch the pass through the call ``op`` kept from an earlier checked call of this shape
    (``bsmm.backends.cuda.backend.FastCall``) on the buffers' raw pointers: no CuPy views, no stream or device
    objects. False where there is none or anything differs from it (the checked path then runs).

    XLA's buffers are dense row-major, and their shapes and dtypes are fixed by the custom call.
    """
    calls = getattr(op, "kept_calls", None)  # (a ConvPasses has none)
    if not calls:
        return False
    call = calls.get((pass_name, a.shape, a.dtype, op.feature_axis, op.tf32, "store"))
    if (call is None or b.dtype != call.dtype or b.shape != call.other_shape or device_id != call.device
            or launches.current_device() != device_id):
        return False
    a_ptr = a.__cuda_array_interface__["data"][0]
    b_ptr = b.__cuda_array_interface__["data"][0]
    out_ptr = out.__cuda_array_interface__["data"][0]
    if call.aligned and (a_ptr | b_ptr | out_ptr) & 15:
        return False
    call.launch(int(stream), a_ptr, b_ptr, out_ptr)
    return True


# -- one pass as a batchable JAX function ----------------------------------------------------------
def _out_core_shape(op: BlocksparseMatMul, pass_name: str, a) -> tuple:
    return PASSES[pass_name].output_shape(op.C, op.K, op.w_shape, a.shape[-2 + (1 - op.feature_axis)],
                                          op.feature_axis)


def _bind(op: BlocksparseMatMul, pass_name: str, a, b):
    """Run a pass on operands with equal numbers of leading batch axes (each of size B or 1)."""
    batch_rank = a.ndim - 2
    a_batch, b_batch = a.shape[:batch_rank], b.shape[:batch_rank]
    if pass_name != "updat" and op.feature_axis == 1 and math.prod(b_batch) == 1 and batch_rank:
        # Shared weights, rows last but one: the batch folds into N with a free reshape.
        folded = _bind(op, pass_name, a.reshape(-1, a.shape[-1]), b.reshape(b.shape[batch_rank:]))
        return folded.reshape(a_batch + a.shape[-2:-1] + folded.shape[-1:])
    batch_shape = tuple(max(i, j) for i, j in zip(a_batch, b_batch))
    return _call(op, pass_name, batch_shape, batch_shape + _out_core_shape(op, pass_name, a), a, b)


def _warn_if_a_gpu_sits_idle() -> None:
    """Warn once when JAX runs on the CPU beside a GPU bsmm could use: a JAX installed without its
    CUDA plugin (``pip install jax`` alone) places every array on the CPU, and the passes follow."""
    if not once("jax on the cpu beside a gpu") or jax.default_backend() != "cpu":
        return
    try:
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy or no driver: no GPU bsmm could use
        return
    if gpus:
        jax_dirs = (os.path.dirname(jax.__file__) + os.sep,)  # tracing calls bsmm from inside JAX
        warn(f"JAX runs on the CPU ({jax.__version__} without a CUDA plugin?) while {gpus} GPU(s) are "
             "visible: bsmm's passes run on the CPU backend. Install JAX with its plugin, "
             "pip install 'bsmm[jax-cuda12]' or 'bsmm[jax-cuda13]', to run them on the GPU.", also_skip=jax_dirs)


def _varying(x) -> frozenset:
    """The manual mesh axes along which ``x`` varies (empty outside ``shard_map`` or with check_vma off)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()))


def vary_alike(*arrays) -> tuple:
    """``arrays`` each cast to vary along all the manual mesh axes any of them varies along, as JAX
    casts the operands of its own primitives inside ``shard_map`` (the cast's transpose sums the
    cotangent over the axes it added)."""
    axes = [_varying(x) for x in arrays]
    union = frozenset().union(*axes)
    return tuple(jax.lax.pcast(x, tuple(sorted(union - mine, key=str)), to="varying") if union - mine else x
                 for x, mine in zip(arrays, axes))


def _call(op, pass_name: str, batch_shape: tuple, out_shape: tuple, a, b):
    """The pass as an XLA buffer callback into a new array of ``out_shape``."""
    _warn_if_a_gpu_sits_idle()  # at trace time: once per jit compile, never per call
    if 0 in out_shape or 0 in a.shape or 0 in b.shape:
        # Nothing to compute (an empty layout or N = 0): a sum over nothing is 0.
        # XLA may hand out null pointers for empty buffers, so no callback is made.
        return vary_alike(jnp.zeros(out_shape, a.dtype), a, b)[0]
    # A matmul pass launches on XLA's stream with no host synchronisation and no allocation past its
    # first call (workspaces are per stream and kept), so XLA may capture it into a CUDA graph and
    # replay it; a convolution's pass may allocate temporaries every call, so it may not.
    replayable = isinstance(op, BlocksparseMatMul) and settings()["jax"]["command_buffers"]
    callback = PassCallback(op, pass_name, batch_shape)
    call = buffer_callback(callback, jax.ShapeDtypeStruct(out_shape, a.dtype), command_buffer_compatible=replayable)
    # A product's pass on a batch-sharded operand runs shard by shard under jax.jit (XLA replicates the others).
    return partitionable_pass(call, callback, replayable, a, b)


def _pass(op: BlocksparseMatMul, pass_name: str, a, b):
    """``pass_name`` of ``op`` on ``a`` and ``b``, with a vmap rule that batches without copies."""
    run = custom_vmap(functools.partial(_bind, op, pass_name))

    @run.def_vmap
    def _rule(axis_size, in_batched, a, b):
        # An unbatched operand gets a batch axis of length 1 (a free reshape) so both keep
        # the same number of batch axes, whichever levels of vmap batched which operand.
        a, b = (v if batched else v[None] for v, batched in zip((a, b), in_batched))
        return _pass(op, pass_name, a, b), True

    return run(a, b)


@functools.partial(jax.jit, static_argnums=(0, 1))
def run_pass(op: BlocksparseMatMul, pass_name: str, a, b):
    """``out = op.<pass_name>(a, b)`` as a jit-compiled, vmap-able JAX function.

    Parameters
    ----------
    op : BlocksparseMatMul
        Static: compiled once per (op, pass, shapes and dtypes).
    pass_name : {"fprop", "bprop", "updat"}
    a : (N, C) / (N, K) activations, or (C, N) / (K, N) with ``feature_axis=0``
        ``x`` for fprop and updat, ``dy`` for bprop.
    b : (nnzb, bs, bs) block data for fprop and bprop; ``dy`` for updat

    Returns
    -------
    The pass's result in ``a``'s dtype: (N, K), (N, C) or (nnzb, bs, bs) (transposed
    activations with ``feature_axis=0``). ``op`` may also be a :class:`ConvPasses`: a convolution's pass.
    """
    if isinstance(op, ConvPasses):
        return _bind_conv(op, pass_name, a, b)
    return _pass(op, pass_name, a, b)


# -- convolutions ------------------------------------------------------------------------------------
class ConvPasses:
    """The passes of a :class:`~bsmm.nn.conv.BlocksparseConv` on inputs of one shape, as :func:`run_pass`'s ``op``.

    ``fprop(x, w)``, ``bprop(dy, w)`` and ``updat(x, dy)`` take the two operands and
    ``out=``, as :class:`~bsmm.BlocksparseMatMul`'s do (``bprop`` knows the input shape).
    Equal (and hashed) by the convolution's identity and the input shape: a static argument.
    No vmap rule: the batch of a convolution is its N.
    """

    __slots__ = ("__weakref__", "conv", "x_shape")

    def __init__(self, conv, x_shape: tuple):
        self.conv, self.x_shape = conv, tuple(int(v) for v in x_shape)

    def __eq__(self, other):
        return type(other) is ConvPasses and other.conv is self.conv and other.x_shape == self.x_shape

    def __hash__(self):
        return hash((id(self.conv), self.x_shape))

    def __repr__(self) -> str:  # shown in jaxprs
        return f"ConvPasses({self.conv!r}, x_shape={self.x_shape})"

    def fprop(self, x, w, out):
        return self.conv.fprop(x, w, out=out)

    def bprop(self, dy, w, out):
        return self.conv.bprop(dy, w, self.x_shape, out=out)

    def updat(self, x, dy, out):
        return self.conv.updat(x, dy, out=out)

    def out_shape(self, pass_name: str) -> tuple:
        results = {"fprop": self.conv.output_shape(self.x_shape), "bprop": self.x_shape, "updat": self.conv.w_shape}
        return results[pass_name]


def _bind_conv(passes: ConvPasses, pass_name: str, a, b):
    return _call(passes, pass_name, (), passes.out_shape(pass_name), a, b)

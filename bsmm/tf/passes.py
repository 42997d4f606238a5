"""One pass on TensorFlow tensors: :func:`run_pass`, eagerly or as a ``tf.py_function`` node, without copies.

Eagerly, a pass reads its input tensors' memory through DLPack. Inside ``tf.function`` each pass
is one ``tf.py_function`` node whose body does the same on the eager tensors it receives; its
output gets the static shape the pass implies, so shapes stay known in the graph.

- CPU: the CPU backend writes into a NumPy buffer aligned to 64 bytes, which TensorFlow then
  adopts through DLPack (no copy). The alignment is needed: TensorFlow adopts unaligned memory
  too, and its kernels then abort the process on their first read of it.
- GPU (untested: written from documentation, as no TensorFlow was installed on the GPU machine):
  TensorFlow allocates the output on the inputs' device (so ``tf.config.experimental.get_memory_info``
  counts it, and it is the only allocation of a pass), CuPy shares it and the kernel writes it in
  place. TensorFlow exposes no CUDA stream to Python and refuses a stream in DLPack export, so
  the pass cannot launch on TensorFlow's stream: it waits for the device (``SyncDevice``) before
  the launch on CuPy's current stream and for that stream after it, two host synchronizations a pass.
- bfloat16: NumPy's DLPack import knows no bfloat16, so tensors travel bitcast to int16 (a view
  in TensorFlow) and are viewed as ``ml_dtypes.bfloat16`` on the other side.
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from bsmm.arrays import _DLPACK_CUDA, _DLPACK_CUDA_MANAGED, empty_aligned
from bsmm.dtypes import ELEMENT_TYPES
from bsmm.matmul import BlocksparseMatMul
from bsmm.passes import PASSES

__all__ = ["CUDA_DEVICE_TYPES", "NUMPY_DTYPES", "run_pass"]

#: TensorFlow dtype -> the NumPy dtype bsmm uses for it (float64: CPU tensors only).
NUMPY_DTYPES: dict[tf.DType, np.dtype] = {getattr(tf, name): element.numpy for name, element in ELEMENT_TYPES.items()}
_BFLOAT16 = ELEMENT_TYPES["bfloat16"].numpy  # ml_dtypes.bfloat16

#: DLPack device types of GPU memory.
CUDA_DEVICE_TYPES = (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED)


def _output_shape(op: BlocksparseMatMul, pass_name: str, n) -> tuple:
    """Shape of a pass's result (:data:`bsmm.passes.PASSES`); ``n`` is N (None when unknown)."""
    return PASSES[pass_name].output_shape(op.C, op.K, op.w_shape, n, op.feature_axis)


def _rows(op: BlocksparseMatMul, tensor: tf.Tensor):
    """N of an activation tensor, None if not known; 0 for a wrong rank (bsmm then refuses the tensor)."""
    shape = tensor.shape
    if shape.rank is None:
        return None
    return shape[1 - op.feature_axis] if shape.rank == 2 else 0


def run_pass(op: BlocksparseMatMul, pass_name: str, a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
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
    if device_type in CUDA_DEVICE_TYPES:
        return _run_cuda(run, a, b, shape, device_id)
    out = empty_aligned(shape, NUMPY_DTYPES[a.dtype])  # Eigen kernels assume 64 bytes
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

"""Which library an array comes from, and moving foreign arrays in and out without copies.

NumPy arrays run on the CPU backend and CuPy arrays on the GPU backend. Any
other array that speaks DLPack (PyTorch, JAX, TensorFlow, ...) is wrapped
without a copy as a NumPy array (CPU memory) or a CuPy array (GPU memory), and
the result is handed back through the caller's own library's ``from_dlpack``.
No framework is imported here unless the caller already passed one of its
arrays, which means it is imported already.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

import numpy as np

from bsmm.backends.cuda.environment import check_environment

__all__ = ["Operand", "array_module", "as_operand", "check_plain_ndarray", "check_same_place", "empty_aligned",
           "output_array", "overlaps"]

#: Byte alignment of CPU results: TensorFlow (and Eigen) kernels abort on less when a
#: result reaches them through DLPack; NumPy only promises 16.
CPU_ALIGNMENT = 64

# DLPack device types (dlpack.h): where the memory lives.
_DLPACK_CPU, _DLPACK_CUDA, _DLPACK_CUDA_HOST, _DLPACK_CUDA_MANAGED = 1, 2, 3, 13


class Operand:
    """An input array as the backends see it.

    Attributes
    ----------
    array : numpy.ndarray or cupy.ndarray
        The data, never copied from what the caller passed.
    backend : str
        ``"cpu"`` or ``"cuda"``.
    library : str
        Top-level module of the caller's array type (``"numpy"``, ``"torch"``, ...).
    device : int or None
        CUDA device ordinal, None on the CPU.
    """

    __slots__ = ("array", "backend", "library", "device")

    def __init__(self, array: Any, backend: str, library: str, device: int | None):
        # A plain slotted class: built on every call of a pass, so it must be cheap.
        self.array, self.backend, self.library, self.device = array, backend, library, device

    def wrap(self, result):
        """Return ``result`` (NumPy/CuPy) as an array of the caller's library, without a copy."""
        return _REWRAP.get(self.library, _generic_rewrap(self.library))(result)


def _top_module(obj) -> str:
    return type(obj).__module__.split(".", 1)[0]


def _torch_from(result):
    return sys.modules["torch"].from_dlpack(result)


def _jax_from(result):
    return importlib.import_module("jax.numpy").from_dlpack(result)


def _tf_from(result):
    return sys.modules["tensorflow"].experimental.dlpack.from_dlpack(result.__dlpack__())


def _generic_rewrap(library: str) -> Callable:
    def rewrap(result):
        module = sys.modules.get(library)
        from_dlpack = getattr(module, "from_dlpack", None)
        if from_dlpack is None:
            return result  # the library gave us DLPack but takes none back: hand over NumPy/CuPy
        return from_dlpack(result)

    return rewrap


_REWRAP: dict[str, Callable] = {
    "numpy": lambda result: result,
    "cupy": lambda result: result,
    "torch": _torch_from,
    "jax": _jax_from,
    "jaxlib": _jax_from,
    "tensorflow": _tf_from,
}


def _cupy_ndarray():
    """cupy.ndarray if CuPy is imported already (else None: then no array can be one)."""
    cupy = sys.modules.get("cupy")
    return getattr(cupy, "ndarray", None)


def empty_aligned(shape: tuple, dtype) -> np.ndarray:
    """An uninitialized C-contiguous NumPy array whose data starts on a CPU_ALIGNMENT boundary.

    Examples
    --------
    >>> empty_aligned((3, 5), np.float16).ctypes.data % CPU_ALIGNMENT
    0
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + CPU_ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % CPU_ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def overlaps(a, b) -> bool:
    """Whether two C-contiguous arrays of one library share any byte (exact for contiguous arrays)."""
    if isinstance(a, np.ndarray):
        return bool(np.may_share_memory(a, b))
    start_a, start_b = a.data.ptr, b.data.ptr
    return start_a < start_b + b.nbytes and start_b < start_a + a.nbytes and a.nbytes > 0 and b.nbytes > 0


def check_plain_ndarray(array, argument: str) -> None:
    """Raise TypeError if ``array`` is a NumPy subclass whose meaning bsmm would lose.

    ``numpy.matrix`` (always 2-D, ``*`` is a product) and masked arrays (bsmm
    would compute through the masked values and drop the mask) are refused;
    other subclasses, such as ``numpy.memmap``, are plain arrays to bsmm.
    """
    if type(array) is np.ndarray or not isinstance(array, np.ndarray):
        return
    if isinstance(array, np.matrix):
        raise TypeError(f"{argument} is a numpy.matrix; pass a plain numpy.ndarray (np.asarray({argument}))")
    if isinstance(array, np.ma.MaskedArray):
        raise TypeError(
            f"{argument} is a numpy masked array, whose mask bsmm cannot honour; pass a plain numpy.ndarray "
            f"with the masked entries filled as you mean them ({argument}.filled(0))"
        )


def as_operand(array, argument: str) -> Operand:
    """Classify ``array`` and expose its memory as NumPy or CuPy, without copying.

    Raises
    ------
    TypeError
        If ``array`` is not an array (NumPy, CuPy, or a DLPack producer), is a
        ``numpy.matrix`` or masked array, is a PyTorch tensor that requires grad,
        or DLPack cannot express its dtype for NumPy/CuPy.
    """
    if type(array) is np.ndarray:  # the common case first: no cost added to it
        return Operand(array, "cpu", "numpy", None)
    if isinstance(array, np.ndarray):
        check_plain_ndarray(array, argument)
        return Operand(array, "cpu", "numpy", None)
    cupy_ndarray = _cupy_ndarray()
    if cupy_ndarray is not None and isinstance(array, cupy_ndarray):
        return Operand(array, "cuda", "cupy", array.device.id)
    library = _top_module(array)
    if not (hasattr(array, "__dlpack__") and hasattr(array, "__dlpack_device__")):
        raise TypeError(
            f"{argument} must be an array (NumPy, CuPy, or any DLPack producer such as a "
            f"PyTorch, JAX or TensorFlow tensor); got {type(array).__name__}"
        )
    device_type, device_id = (int(v) for v in array.__dlpack_device__())
    if device_type in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
        check_environment()  # before CuPy's first driver call, whose error would read as a DLPack one below
    try:
        if device_type in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
            return Operand(np.from_dlpack(array), "cpu", library, None)
        if device_type in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
            import cupy

            return Operand(cupy.from_dlpack(array), "cuda", library, device_id)
    except (BufferError, TypeError, ValueError, RuntimeError) as error:
        if getattr(array, "requires_grad", False) is True:  # PyTorch refuses to export it; detach() drops gradients
            raise TypeError(
                f"{argument} requires grad, so it cannot be shared through DLPack, and the plain operator has "
                f"no autograd: use bsmm.torch (blocksparse_matmul, BlockSparseLinear, blocksparse_conv, "
                f"BlockSparseConv1d/2d/3d), which pass gradients on"
            ) from error
        # e.g. bfloat16, which NumPy's DLPack import does not know (the framework adapters handle it)
        raise TypeError(f"{argument} ({library} array) cannot be shared through DLPack: {error}") from error
    raise TypeError(f"{argument} lives on DLPack device type {device_type}; bsmm runs on the CPU and on CUDA GPUs")


def check_same_place(operands: dict[str, Operand]) -> None:
    """Raise ValueError unless all operands share one library, backend and device."""
    (first_name, first), *rest = operands.items()
    for name, operand in rest:
        if operand.library != first.library:
            raise ValueError(
                f"{name} is a {operand.library} array but {first_name} is a {first.library} array; "
                f"pass arrays of one library"
            )
        if (operand.backend, operand.device) != (first.backend, first.device):
            raise ValueError(
                f"{name} is on {_place(operand)} but {first_name} is on {_place(first)}; "
                f"move them to one device"
            )


def _place(operand: Operand) -> str:
    return "the CPU" if operand.backend == "cpu" else f"CUDA device {operand.device}"


def array_module(array):
    """``cupy`` for a CuPy array, else ``numpy``: the library whose functions apply to ``array``."""
    if type(array).__module__.split(".", 1)[0] == "cupy":
        import cupy

        return cupy
    return np


def output_array(out, like: Operand, shape: tuple, dtype, inputs: tuple = ()):
    """The array a pass writes: a new one beside ``like`` (same library and device), or ``out``
    once checked: its shape, dtype, place and layout, writable, and overlapping none of ``inputs``."""
    if out is None:
        if like.backend == "cpu":
            return empty_aligned(shape, dtype)  # safe to hand to any framework through DLPack
        return array_module(like.array).empty(shape, dtype=dtype)
    out_op = as_operand(out, "out")
    check_same_place({"inputs": like, "out": out_op})
    array = out_op.array
    if tuple(array.shape) != shape:
        raise ValueError(f"out must have shape {shape}; got {tuple(array.shape)}")
    if array.dtype != dtype:
        raise TypeError(f"out has dtype {array.dtype} but the inputs have {dtype}")
    if not array.flags.c_contiguous:
        raise ValueError(  # a copy would not do: the result is written into out itself
            f"out must be C-contiguous; got strides {array.strides}; pass a C-contiguous array, or out=None for a "
            f"new one"
        )
    if like.backend == "cpu" and not array.flags.writeable:
        raise ValueError("out is read-only")
    for operand in inputs:
        if overlaps(array, operand.array):
            raise ValueError("out overlaps an input; pass a separate output buffer")
    return array

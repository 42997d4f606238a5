"""Kernel launches with programmatic stream serialization (programmatic dependent launch, sm_90+).

A kernel launched this way may be scheduled while the grid before it on the stream is still
running: its thread blocks start on the SMs that grid frees, and wait at their first
instruction until it has finished (``wait_for_prior_grid`` in ``cuda/bsmm_common.cuh``), so
only the launch and start-up overlap it; results are those of an ordinary launch. CuPy wraps
``cuLaunchKernel`` only, so ``cuLaunchKernelEx`` is reached through ctypes. A
:class:`SerializedLaunch` holds one ready configuration (kernel, grid, block, shared bytes,
stream), kept per kernel and stream by its launcher (``bsmm.backends.cuda.plans.Launcher``), and makes the
call's arguments as ctypes objects, so a repeated launch converts nothing.
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["SerializedLaunch", "StreamHandle", "current_device"]

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _Attribute(ctypes.Structure):
    # CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union.
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attributes", ctypes.POINTER(_Attribute)), ("attribute_count", ctypes.c_uint)]


@functools.cache
def _launch_ex():
    launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    launch.restype = ctypes.c_int  # arguments are passed as ready ctypes objects: no argtypes
    return launch


class SerializedLaunch:
    """One launch configuration with programmatic stream serialization, ready to launch any
    parameter block: ``launch(parameters_address)``, or ``driver(*arguments(address))`` with
    the arguments made once (a nonzero result is the CUresult of a failed launch)."""

    __slots__ = ("attribute", "config", "function")

    def __init__(self, function: int, grid: tuple, block: tuple, shared_bytes: int, stream: int):
        self.attribute = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        self.attribute.value[0] = 1  # programmaticStreamSerializationAllowed
        self.config = _Config(*grid, *block, shared_bytes, stream, ctypes.pointer(self.attribute), 1)
        self.function = ctypes.c_void_p(function)

    @property
    def driver(self):
        """``cuLaunchKernelEx`` (the driver library is loaded on the first launch, not when a
        configuration is made)."""
        return _launch_ex()

    def arguments(self, parameters_address: int) -> tuple:
        """``cuLaunchKernelEx``'s arguments for the parameter block at that address, as ctypes objects."""
        return ctypes.byref(self.config), self.function, ctypes.c_void_p(parameters_address), None

    def launch(self, parameters_address: int) -> None:
        result = self.driver(*self.arguments(parameters_address))
        if result:
            raise RuntimeError(f"cuLaunchKernelEx failed (CUresult {result})")


def current_device() -> int:
    """CUDA's current device, whose context a launch goes to: CuPy's ``getDevice``.

    CuPy is imported lazily, on the first call (this module is imported where CuPy may be
    missing), which rebinds this name to ``cupy.cuda.runtime.getDevice`` itself, so later calls
    go straight to it: call it as ``launches.current_device()``, never bind it elsewhere."""
    global current_device
    import cupy  # lazily: this module loads without CuPy

    current_device = cupy.cuda.runtime.getDevice
    return current_device()


class StreamHandle:
    """A framework's raw ``cudaStream_t`` through the CUDA stream protocol, which CuPy 14's
    ``cupy.cuda.Stream.from_external`` reads (PyTorch's current stream, XLA's stream)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)

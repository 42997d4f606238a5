"""TMA tensor maps for the Hopper kernels (``bsmm_matmul_tma`` in ``cuda/bsmm_matmul.cu``).

A tensor map describes a 2-D array in GPU memory (address, sizes, row pitch) and the box one
TMA copy moves, with the swizzle the kernels read (the bytes of a box row: 128, 64 or 32). The CUDA driver encodes it
(``cuTensorMapEncodeTiled``, reached through ctypes: CuPy does not wrap it); the 128 bytes are
then passed by value as a kernel parameter. Encoding costs a few microseconds, so maps are
kept per (address, shape, box): CuPy's memory pool hands the same addresses back, and an
eager training loop finds its maps again on every step.
"""

from __future__ import annotations

import ctypes
import functools
import threading

__all__ = ["MAP_BYTES", "encode_2d", "tensor_map"]

MAP_BYTES = 128
# CUtensorMapDataType by element bytes: elements move as bit patterns, float16 and bfloat16 as
# 16 bits, float32 (TF32 passes) as 32; maps of type TFLOAT32 gave the same results (relative
# error 2.9e-4 on a TF32 bprop of 1024 rows, results/archive/v12/tf32_wgmma_bprop.md).
_DATA_TYPES = {2: 1, 4: 2}  # CU_TENSOR_MAP_DATA_TYPE_UINT16, _UINT32
_INTERLEAVE_NONE = 0
_SWIZZLES = {128: 3, 64: 2, 32: 1}  # CU_TENSOR_MAP_SWIZZLE_128B / _64B / _32B, by the bytes of a box row
_L2_PROMOTION_256B = 3
_OOB_FILL_ZEROS = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-bounds elements arrive as zeros
_CACHE_LIMIT = 4096


@functools.cache
def _encoder():
    driver = ctypes.CDLL("libcuda.so.1")
    encode = driver.cuTensorMapEncodeTiled
    encode.restype = ctypes.c_int
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                       ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return encode


def encode_2d(address: int, inner: int, outer: int, row_bytes: int, box_inner: int, box_outer: int,
              element_bytes: int = 2) -> bytes:
    """The map of ``outer`` rows of ``inner`` elements of ``element_bytes`` (2 or 4), rows
    ``row_bytes`` apart, copied in boxes of ``box_outer`` rows x ``box_inner`` elements, a box row
    (128, 64 or 32 bytes) being the span of the swizzle the kernels read. Raises ValueError naming
    what the hardware refuses."""
    if address % 16 or row_bytes % 16:
        raise ValueError(f"TMA needs 16-byte aligned rows: address {address:#x}, row pitch {row_bytes} bytes")
    if box_inner * element_bytes not in _SWIZZLES or not 0 < box_outer <= 256:
        raise ValueError(f"TMA box {box_inner} x {box_outer} of {element_bytes}-byte elements: rows of 128, 64 or 32 "
                         "bytes, at most 256 of them")
    storage = (ctypes.c_uint64 * (MAP_BYTES // 8))()
    dims = (ctypes.c_uint64 * 2)(inner, outer)
    strides = (ctypes.c_uint64 * 1)(row_bytes)
    box = (ctypes.c_uint32 * 2)(box_inner, box_outer)
    element_strides = (ctypes.c_uint32 * 2)(1, 1)
    result = _encoder()(ctypes.addressof(storage), _DATA_TYPES[element_bytes], 2, address, dims, strides, box,
                        element_strides, _INTERLEAVE_NONE, _SWIZZLES[box_inner * element_bytes], _L2_PROMOTION_256B,
                        _OOB_FILL_ZEROS)
    if result != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {result}) for {outer} x {inner} elements, "
                           f"pitch {row_bytes} bytes, box {box_outer} x {box_inner}")
    return bytes(storage)


_MAPS: dict = {}
_MAPS_LOCK = threading.Lock()


def tensor_map(address: int, inner: int, outer: int, row_bytes: int, box_inner: int, box_outer: int,
               element_bytes: int = 2) -> bytes:
    """:func:`encode_2d`, kept per arguments (a map holds nothing but them)."""
    key = (address, inner, outer, row_bytes, box_inner, box_outer, element_bytes)
    found = _MAPS.get(key)
    if found is None:
        found = encode_2d(*key)
        with _MAPS_LOCK:
            if len(_MAPS) >= _CACHE_LIMIT:
                _MAPS.clear()
            _MAPS[key] = found
    return found

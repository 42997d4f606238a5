"""What the pieces of an eager call cost on the host: CuPy primitives, timed in a loop."""
import timeit

import cupy
import numpy as np
from cupy.cuda import driver, runtime

x = cupy.ones((32, 12288), dtype=np.float16)
stream = cupy.cuda.get_current_stream()
cases = {
    "type(x) is cupy.ndarray": lambda: type(x) is cupy.ndarray,
    "x.shape": lambda: x.shape,
    "x.dtype": lambda: x.dtype,
    "x.strides": lambda: x.strides,
    "x.flags.c_contiguous": lambda: x.flags.c_contiguous,
    "x.data.ptr": lambda: x.data.ptr,
    "x.data.device_id": lambda: x.data.device_id,
    "x.device.id": lambda: x.device.id,
    "runtime.getDevice()": runtime.getDevice,
    "get_current_stream().ptr": lambda: cupy.cuda.get_current_stream().ptr,
    "cupy.empty((32,12288),f16)": lambda: cupy.empty((32, 12288), dtype=np.float16),
    "cupy.ndarray((32,12288),f16)": lambda: cupy.ndarray((32, 12288), dtype=np.float16),
}
for name, fn in cases.items():
    n = 20000
    seconds = min(timeit.repeat(fn, number=n, repeat=3)) / n
    print(f"{name:36s} {seconds * 1e9:8.0f} ns")

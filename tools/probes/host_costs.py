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

# The fast path of one pass, split into Python and cuLaunchKernel (host time only: 200 calls
# are fewer than the launch queue holds, so no call waits for the GPU).
import time

import bsmm
from bsmm.backends.cuda import plans as cuda_plans

layout = bsmm.layouts.random_layout(384, 384, density=0.02, seed=0)
op = bsmm.BlocksparseMatMul(layout, block_size=32)
w = cupy.ones(op.w_shape, dtype=np.float16)
y = cupy.empty((32, op.K), dtype=np.float16)
op.fprop(x, w, out=y)
cupy.cuda.Device().synchronize()


def host_time(fn, calls=200, rounds=20):
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
        cupy.cuda.Device().synchronize()
    return best


real_launch = cuda_plans.launch_kernel
print(f"{'op.fprop(x, w, out=y)':36s} {host_time(lambda: op.fprop(x, w, out=y)) * 1e9:8.0f} ns")
print(f"{'op.fprop(x, w)':36s} {host_time(lambda: op.fprop(x, w)) * 1e9:8.0f} ns")
# The repeated call's kept parameter block: launched by cuLaunchKernel (CuPy), or by
# cuLaunchKernelEx through ctypes where launches are serialized (programmatic, sm_90+).
call = next(iter(op.kept_calls.values()))
for _ in range(2):  # seen, then kept (op.fprop(x, w) may have filled and cleared the kept blocks)
    op.fprop(x, w, out=y)
block = call.blocks[(cupy.cuda.get_current_stream().ptr, x.data.ptr, w.data.ptr, y.data.ptr, False)]
serialized = block.arguments is not None
if serialized:
    driver = block.driver
    print(f"{'cuLaunchKernelEx alone (ctypes)':36s} {host_time(lambda: driver(*block.arguments)) * 1e9:8.0f} ns")
    block.driver = lambda *args: 0
else:
    cuda_plans.launch_kernel = lambda *args: None
print(f"{'op.fprop(x, w, out=y), no launch':36s} {host_time(lambda: op.fprop(x, w, out=y)) * 1e9:8.0f} ns")
if serialized:
    block.driver = driver
cuda_plans.launch_kernel = real_launch
launcher, stream = call.plan.launcher, cupy.cuda.get_current_stream().ptr
args = (launcher.function, *launcher.grid, launcher.threads, 1, 1, launcher.shared_bytes, stream,
        launcher.pointers_address, 0)
print(f"{'launchKernel alone (CuPy)':36s} {host_time(lambda: real_launch(*args)) * 1e9:8.0f} ns")
print(f"grid {launcher.grid} threads {launcher.threads} shared {launcher.shared_bytes} serialized {serialized}")

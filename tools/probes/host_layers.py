"""Where the host time of an eager S call goes, layer by layer (needs a GPU).

For each case (workload S passes at block 32), host seconds per call of: the bench's call as
it is; the same with the kernel launch replaced by nothing; the launcher alone; CuPy's
``launchKernel`` alone; and the per-call time CUDA events see for the bench's eager batch.
"""
import statistics
import sys
import time

import cupy
import numpy as np

import bsmm
from bsmm.backends.cuda import plans as cuda_plans
from bsmm.cli.bench_gpu import _gpu_seconds


def host_time(fn, calls=200, rounds=30):
    """Best host seconds per call over ``rounds`` batches (the queue never fills: 200 calls)."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
        cupy.cuda.Device().synchronize()
    return min(samples), statistics.median(samples)


def report(label, seconds):
    best, median = seconds if isinstance(seconds, tuple) else (seconds, seconds)
    print(f"  {label:44s} best {best * 1e6:6.2f} us  median {median * 1e6:6.2f} us", flush=True)


rng = cupy.random.default_rng(0)
dtype = np.float16
x = rng.standard_normal((32, 12288), dtype=np.float32).astype(dtype)
dy = rng.standard_normal((32, 12288), dtype=np.float32).astype(dtype)
y = cupy.empty((32, 12288), dtype=dtype)
report("empty python loop", host_time(lambda: None))
report("cupy.ndarray((32,12288))", host_time(lambda: cupy.ndarray((32, 12288), dtype)))
report("cupy.cuda.get_current_stream().ptr", host_time(lambda: cupy.cuda.get_current_stream().ptr))
for density in [float(d) for d in (sys.argv[1:] or ("0.02", "0.1"))]:
    layout = bsmm.layouts.random_layout(384, 384, density=density, seed=0)
    op = bsmm.BlocksparseMatMul(layout, block_size=32)
    ws = [rng.standard_normal(op.w_shape, dtype=np.float32).astype(dtype) for _ in range(8)]
    dw = cupy.empty(op.w_shape, dtype=dtype)
    turn = iter(range(1 << 62))
    cases = {
        "fprop rotating w": lambda: op.fprop(x, ws[next(turn) % 8], out=y),
        "fprop same w": lambda: op.fprop(x, ws[0], out=y),
        "fprop same w, new out": lambda: op.fprop(x, ws[0]),
        "updat": lambda: op.updat(x, dy, out=dw),
    }
    for fn in cases.values():
        fn(), fn()
    cupy.cuda.Device().synchronize()
    for label, fn in cases.items():
        pass_name = label.split()[0]
        call = op.kept_calls[(pass_name, x.shape, x.dtype, op.feature_axis, op.tf32, "store")]
        plan = call.plan
        launcher = plan.launcher
        print(f"S fp16 {density:.0%} {label}: {type(plan).__name__} {plan.variant}", flush=True)
        report("events, eager batch of 20", _gpu_seconds(fn, 20, 31))
        report("host, call as the bench makes it", host_time(fn))
        real = cuda_plans.launch_kernel
        cuda_plans.launch_kernel = lambda *args: None
        try:
            report("host, launchKernel stubbed", host_time(fn))
        finally:
            cuda_plans.launch_kernel = real
        stream = cupy.cuda.get_current_stream().ptr
        args = (*launcher.head, stream, launcher.pointers_address, 0)
        report("host, launchKernel alone", host_time(lambda: real(*args)))
        report("events, launchKernel alone x20", _gpu_seconds(lambda: real(*args), 20, 31))

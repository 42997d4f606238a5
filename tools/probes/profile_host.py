"""Where does the host time of one eager pass go? cProfile over many back-to-back allocating calls."""
import cProfile
import pstats
import time

import cupy
import numpy as np

import bsmm

layout = bsmm.layouts.random_layout(384, 384, density=0.02, seed=0)
op = bsmm.BlocksparseMatMul(layout, block_size=32)
x = cupy.random.standard_normal((32, op.C), dtype=np.float32).astype(np.float16)
w = cupy.random.standard_normal(op.w_shape, dtype=np.float32).astype(np.float16)
y = cupy.empty((32, op.K), dtype=np.float16)
for _ in range(10):
    op.fprop(x, w, out=y)
cupy.cuda.Device().synchronize()
for label, fn in (("op.fprop(out=y)", lambda: op.fprop(x, w, out=y)), ("op(x, w)", lambda: op(x, w))):
    start = time.perf_counter()
    for _ in range(2000):
        fn()
    cupy.cuda.Device().synchronize()
    print(f"{label}: {(time.perf_counter() - start) / 2000 * 1e6:.1f} us per call, host + device")
profile = cProfile.Profile()
profile.enable()
for _ in range(2000):
    op(x, w)
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(18)

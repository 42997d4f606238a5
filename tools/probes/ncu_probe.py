"""One pass, a few times, for Nsight Compute: python tools/probes/ncu_probe.py WORKLOAD DTYPE BLOCK DENSITY PASS.

PASS "dense" runs cupy.matmul on the workload's fprop shape instead, the reference the rows are measured against."""
import sys

import cupy
import numpy as np

import bsmm

workload, dtype, bs, density, pass_name = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
n, c = {"S": (32, 12288), "T": (4096, 8192), "I": (256, 8192)}[workload]
layout = bsmm.layouts.random_layout(c // bs, c // bs, density=density, seed=0)
op = bsmm.BlocksparseMatMul(layout, block_size=bs)
np_dtype = bsmm.SUPPORTED_DTYPES[dtype]
x = cupy.random.standard_normal((n, c), dtype=np.float32).astype(np_dtype)
w = cupy.random.standard_normal(op.w_shape, dtype=np.float32).astype(np_dtype)
dense_w = cupy.random.standard_normal((c, c), dtype=np.float32).astype(np_dtype) if pass_name == "dense" else None
run = {"dense": lambda: cupy.matmul(x, dense_w), "fprop": lambda: op.fprop(x, w), "bprop": lambda: op.bprop(x, w), "updat": lambda: op.updat(x, x)}[pass_name]
for _ in range(5):
    run()
cupy.cuda.Device().synchronize()

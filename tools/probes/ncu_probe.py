"""One pass, a few times, for Nsight Compute: python tools/probes/ncu_probe.py WORKLOAD DTYPE BLOCK DENSITY PASS.

WORKLOAD is a workload of ``bsmm bench`` (S, T, I, F), with ``.1`` for its second layer (F.1: the
down projection 16384 -> 4096). PASS "dense" runs cupy.matmul on the layer's fprop shape instead,
the reference the rows are measured against."""
import sys

import cupy
import numpy as np

import bsmm
from bsmm.cli.bench_gpu import WORKLOADS

workload, dtype, bs, density, pass_name = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
name, _, layer = workload.partition(".")
n = WORKLOADS[name]["N"]
c, k = WORKLOADS[name]["layers"][int(layer or 0)]
layout = bsmm.layouts.random_layout(c // bs, k // bs, density=density, seed=0)
op = bsmm.BlocksparseMatMul(layout, block_size=bs)
np_dtype = bsmm.SUPPORTED_DTYPES[dtype]
x = cupy.random.standard_normal((n, c), dtype=np.float32).astype(np_dtype)
dy = cupy.random.standard_normal((n, k), dtype=np.float32).astype(np_dtype)
w = cupy.random.standard_normal(op.w_shape, dtype=np.float32).astype(np_dtype)
dense_w = cupy.random.standard_normal((c, k), dtype=np.float32).astype(np_dtype) if pass_name == "dense" else None
run = {"dense": lambda: cupy.matmul(x, dense_w), "fprop": lambda: op.fprop(x, w), "bprop": lambda: op.bprop(dy, w),
       "updat": lambda: op.updat(x, dy)}[pass_name]
for _ in range(5):
    run()
cupy.cuda.Device().synchronize()

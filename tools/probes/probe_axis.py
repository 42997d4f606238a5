"""Workload T per pass with features along axis 1 and along axis 0, and the cost of a transpose.

    python tools/probes/probe_axis.py [--blocks 16,32] [--densities 0.5,0.1] [--dtype float16]

Efficiency per useful FLOP = dense cuBLAS time x density / bsmm time (as in ``bsmm bench``).
"""
import argparse

import cupy
import numpy as np

import bsmm
from bsmm.cli.bench_gpu import _dense_matmul, _gpu_seconds
from bsmm.layouts import random_layout

parser = argparse.ArgumentParser()
parser.add_argument("--blocks", default="16,32")
parser.add_argument("--densities", default="0.5,0.1")
parser.add_argument("--dtype", default="float16")
parser.add_argument("--N", type=int, default=4096)
parser.add_argument("--C", type=int, default=8192)
args = parser.parse_args()

N, C = args.N, args.C
dtype = bsmm.SUPPORTED_DTYPES[args.dtype]
rng = cupy.random.default_rng(0)
x = rng.standard_normal((N, C), dtype=np.float32).astype(dtype)
dy = rng.standard_normal((N, C), dtype=np.float32).astype(dtype)
xt, dyt = cupy.ascontiguousarray(x.T), cupy.ascontiguousarray(dy.T)
dense_w = rng.standard_normal((C, C), dtype=np.float32).astype(dtype)
matmul = _dense_matmul(False)
dense = {"fprop": _gpu_seconds(lambda: matmul(x, dense_w), 10, 7),
         "bprop": _gpu_seconds(lambda: matmul(dy, dense_w.T), 10, 7),
         "updat": _gpu_seconds(lambda: matmul(x.T, dy), 10, 7)}
scratch = cupy.empty_like(xt)
transpose = _gpu_seconds(lambda: cupy.copyto(scratch, x.T), 10, 7)
print(f"dense us: " + ", ".join(f"{p} {t * 1e6:.1f}" for p, t in dense.items()))
print(f"transpose ({N}, {C}) {args.dtype}: {transpose * 1e6:.1f} us")
print("| block | density | pass | axis 1 us | eff % | axis 0 us | eff % |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for bs in (int(b) for b in args.blocks.split(",")):
    for density in (float(d) for d in args.densities.split(",")):
        layout = random_layout(C // bs, C // bs, density=density, seed=0)
        ops = {axis: bsmm.BlocksparseMatMul(layout, block_size=bs, feature_axis=axis) for axis in (1, 0)}
        w = rng.standard_normal(ops[1].w_shape, dtype=np.float32).astype(dtype)
        for pass_name in ("fprop", "bprop", "updat"):
            cells = []
            for axis, (a, b) in ((1, (x, dy)), (0, (xt, dyt))):
                op = ops[axis]
                run = {"fprop": lambda: op.fprop(a, w), "bprop": lambda: op.bprop(b, w),
                       "updat": lambda: op.updat(a, b)}[pass_name]
                t = _gpu_seconds(run, 10, 7)
                cells += [f"{t * 1e6:.1f}", f"{100 * dense[pass_name] * op.density / t:.1f}"]
            print(f"| {bs} | {ops[1].density:.3f} | {pass_name} | " + " | ".join(cells) + " |", flush=True)

"""Where a BlocksparseConv pass spends its time on a GPU: the canvas copy, each kernel offset's
strided pass, the crop, against one BlocksparseMatMul pass of the same rows (CUDA events).

    python tools/profile_conv.py [--density 0.5] [--shape N,H,W,C]
"""

from __future__ import annotations

import argparse

import cupy
import numpy as np

import bsmm
from bsmm import cuda_backend


def _time(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--density", type=float, default=0.5)
    parser.add_argument("--shape", default="32,32,32,512")
    parser.add_argument("--block-size", type=int, default=32)
    args = parser.parse_args()
    n, h, w, c = (int(v) for v in args.shape.split(","))
    bs = args.block_size
    rng = np.random.default_rng(0)
    layout = (rng.random((c // bs, c // bs)) < args.density).astype(np.uint8)
    conv = bsmm.BlocksparseConv(layout, bs, 3, padding=1)
    x = cupy.asarray(rng.standard_normal((n, h, w, c)), dtype=cupy.float16)
    wts = cupy.asarray(rng.standard_normal(conv.w_shape) * 0.05, dtype=cupy.float16)
    geometry = conv._geometry(x.shape, "x")
    canvas = conv._canvas(cupy, x, geometry)
    grid = cupy.empty((n, *geometry.grid, c), cupy.float16).reshape(-1)
    per_offset = list(conv._per_offset(wts))

    def offsets(count):
        for k in range(count):
            cuda_backend.strided_pass("fprop", conv.index, canvas[geometry.shifts[k]:], per_offset[k], grid,
                                      geometry.rows, (geometry.row_stride, conv.K), accumulate=k > 0)

    rows = cupy.asarray(rng.standard_normal((geometry.rows, c)), dtype=cupy.float16)
    op = conv.matmul
    report = {
        "whole fprop": _time(lambda: conv(x, wts)),
        "canvas": _time(lambda: conv._canvas(cupy, x, geometry)),
        "1 offset (overwrite)": _time(lambda: offsets(1)),
        "9 offsets": _time(lambda: offsets(len(geometry.shifts))),
        "matmul fprop, same rows": _time(lambda: op(rows, per_offset[0].reshape(op.w_shape))),
        "matmul fprop, same rows, accumulate": _time(
            lambda: op(rows, per_offset[0].reshape(op.w_shape), out=grid.reshape(-1, c)[: geometry.rows],
                       accumulate=True)),
    }
    plan = cuda_backend.plan_for(conv.index, "fprop", geometry.rows, "float16", 1, False, True)
    print(f"shape {args.shape}, density {args.density}, rows {geometry.rows}, row stride {geometry.row_stride}, "
          f"variant {plan.variant}, grid {plan.launcher.grid}")
    for name, us in report.items():
        print(f"{name:40s} {us:9.1f} us")


if __name__ == "__main__":
    main()

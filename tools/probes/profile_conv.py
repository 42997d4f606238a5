"""Where a BlocksparseConv pass spends its time on a GPU: the row gathers around the kernel
(input canvas, output crop, dy on the grid), the one-launch fprop kernel alone, and each whole
pass (CUDA-event medians of back-to-back calls, as ``tools/gpu/bench_conv.py`` times them).

    python tools/probes/profile_conv.py [--density 0.5] [--shape N,H,W,C] [--block-size 32]
"""

from __future__ import annotations

import argparse

import cupy
import numpy as np

import bsmm
from bsmm.backends.cuda import backend as cuda_backend
from bsmm.nn import row_maps
from bsmm.cli.bench_gpu import _gpu_seconds


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
    y = conv(x, wts)
    dy = cupy.asarray(rng.standard_normal(y.shape), dtype=cupy.float16)
    geometry = conv.geometry(x.shape, "x")
    canvas = conv.passes.canvas(cuda_backend, x, geometry)
    grid = cupy.empty((n, *geometry.grid, c), cupy.float16)
    crop = conv.passes.row_map("crop", geometry, row_maps.crop_rows)

    def fprop_kernel():
        cuda_backend.shifted_pass("fprop", conv.passes.stacked_index, canvas, wts.reshape(-1), grid.reshape(-1),
                                  geometry.rows, (geometry.row_stride, conv.K), conv.passes.shifted_blocks(geometry))

    report = {
        "fprop": lambda: conv(x, wts),
        "  canvas gather": lambda: conv.passes.canvas(cuda_backend, x, geometry),
        "  kernel (every offset, one launch)": fprop_kernel,
        "  crop gather": lambda: cuda_backend.gather_rows(y.reshape(-1, c), grid.reshape(-1, c), crop),
        "bprop": lambda: conv.bprop(dy, wts, x.shape),
        "  dy on the grid": lambda: conv.passes.on_grid(cuda_backend, dy, geometry),
        "updat": lambda: conv.updat(x, dy),
    }
    print(f"shape {args.shape}, block {bs}, density {args.density}, rows {geometry.rows}, "
          f"row stride {geometry.row_stride}")
    for name, fn in report.items():
        print(f"{name:40s} {_gpu_seconds(fn, 5, 10) * 1e6:9.1f} us")


if __name__ == "__main__":
    main()

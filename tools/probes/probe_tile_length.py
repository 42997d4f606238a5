"""Does a pass pay per output tile? The same blocks (hence FLOPs and bytes) laid out in every
block column, or packed into every 2nd / 4th column: half / a quarter as many output tiles, each
two / four times as long. Device call, T shape (N 4096, C = K 8192), fprop and bprop.
    python tools/probes/probe_tile_length.py [float16] [0.1]"""
import sys

import cupy
import numpy as np

import bsmm
import bsmm.cli.bench_gpu as bench
from bsmm.backends.cuda import plan_cache
from bsmm.backends.cuda.policy import current_policy, planning
from bsmm.cli.tune import Entry

dtype = bsmm.SUPPORTED_DTYPES[sys.argv[1] if len(sys.argv) > 1 else "float16"]
density = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
n, c = 4096, 8192
tiles = {64: [None, [256, 64, 64, 16, 1, 4], [128, 64, 64, 8, 1, 2]], 128: [None, [128, 128, 64, 8, 1, 4], [128, 128, 64, 8, 1, 3]]}
rng = np.random.default_rng(0)
x = cupy.asarray(rng.standard_normal((n, c), dtype=np.float32)).astype(dtype)
dense_w = cupy.asarray(rng.standard_normal((c, c), dtype=np.float32)).astype(dtype)
dense = bench._gpu_seconds(lambda: cupy.matmul(x, dense_w), 20, 7)
print(f"dense {dense * 1e6:.1f} us; density {density}")
print("| block | tile | spread | blocks/column | fprop us | bprop us | fprop eff | bprop eff |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for bs, options in tiles.items():
    cols = c // bs
    for tile in options:
        base = current_policy()
        policy = base if tile is None else Entry("sm90", "tma16", "sparse", str(bs), "large").policy(base, tile)
        with planning(policy):
            for spread in (1, 2, 4):
                layout = np.zeros((cols, cols), dtype=bool)
                kept = np.arange(0, cols, spread)
                layout[:, kept] = bsmm.layouts.random_layout(cols, len(kept), density=density * spread, seed=1)
                op = bsmm.BlocksparseMatMul(layout, block_size=bs)
                w = cupy.asarray(rng.standard_normal(op.w_shape, dtype=np.float32)).astype(dtype)
                y = cupy.empty((n, c), dtype=dtype)
                f = bench._gpu_seconds(lambda: op.fprop(x, w, out=y), 20, 7)
                b = bench._gpu_seconds(lambda: op.bprop(x, w, out=y), 20, 7)
                real = layout.sum() / layout.size
                print(f"| {bs} | {tile or 'shipped'} | {spread} | {layout.sum() / len(kept):.1f} | {f * 1e6:.1f} | "
                      f"{b * 1e6:.1f} | {dense * real / f:.0%} | {dense * real / b:.0%} |", flush=True)
        plan_cache.forget_plans()

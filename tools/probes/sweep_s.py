"""Launch-table sweep for workload S (N = 32, C = K = 12288, block 32) on the GPU.

Each configuration edits the in-process launch table (bsmm.toml is not touched), drops the
cached plans, and times every pass by CUDA-graph replay (the kernel, without host overhead)
and eagerly. Usage: [SWEEP_ONLY=base,minpart16] python tools/probes/sweep_s.py [dtype] [densities...]
"""
import os
import sys

import cupy
import numpy as np

import bsmm
from bsmm.cli import bench_gpu as bench
from bsmm.backends.cuda import plan_cache
from bsmm.config import settings

dtype = sys.argv[1] if len(sys.argv) > 1 else "float16"
densities = [float(d) for d in sys.argv[2:]] or [0.5, 0.1, 0.02]
np_dtype = bsmm.SUPPORTED_DTYPES[dtype]
mode = "simt" if dtype == "float32" else "tensor16"
N, C, BS = 32, 12288, 32
tables = settings()["kernels"]
base_sparse = list(tables["default"][mode]["sparse"]["32"]["n32"])
base_updat = list(tables["default"][mode]["updat"]["32"].get("n32", tables["default"][mode]["updat"]["32"]["any"]))
base_waves = tables["waves"]

base_min_part = tables["min_part_blocks"]
# name -> (sparse tile, updat tile, waves, shortest part)
configs = {"base": (base_sparse, base_updat, base_waves, base_min_part)}
for min_part in (8, 16, 32):
    configs[f"minpart{min_part}"] = (base_sparse, base_updat, base_waves, min_part)
for stages in (3, 6, 8):
    configs[f"stages{stages}"] = (base_sparse[:5] + [stages], base_updat[:5] + [stages], base_waves, base_min_part)
for waves in (4, 16):
    configs[f"waves{waves}"] = (base_sparse, base_updat, waves, base_min_part)
if mode == "tensor16":
    configs["warps1x2"] = (base_sparse[:3] + [1, 2, base_sparse[5]], base_updat[:3] + [1, 2, base_updat[5]], base_waves, base_min_part)
    configs["warps1x1"] = (base_sparse[:3] + [1, 1, base_sparse[5]], base_updat[:3] + [1, 1, base_updat[5]], base_waves, base_min_part)
    configs["warps1x2s8"] = (base_sparse[:3] + [1, 2, 8], base_updat[:3] + [1, 2, 8], base_waves, base_min_part)

rng = cupy.random.default_rng(0)
x = rng.standard_normal((N, C), dtype=np.float32).astype(np_dtype)
dy = rng.standard_normal((N, C), dtype=np.float32).astype(np_dtype)
y = cupy.empty((N, C), dtype=np_dtype)
print(f"| config | density | fprop graph | bprop graph | updat graph | fprop eager | bprop eager | updat eager |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
only = set(os.environ.get("SWEEP_ONLY", "").split(",")) - {""}
for name, (sparse, updat, waves, min_part) in configs.items():
    if only and name not in only:
        continue
    tables["min_part_blocks"] = min_part
    tables["default"][mode]["sparse"]["32"]["n32"] = sparse
    tables["default"][mode]["updat"]["32"]["n32"] = updat
    tables["waves"] = waves
    for density in densities:
        layout = bsmm.layouts.random_layout(C // BS, C // BS, density=density, seed=0)
        op = bsmm.BlocksparseMatMul(layout, block_size=BS)
        plan_cache.forget_plans()
        n_sets = max(1, min(8, int(np.ceil(100e6 / (op.blocks * BS * BS * np_dtype.itemsize)))))
        ws = [rng.standard_normal(op.w_shape, dtype=np.float32).astype(np_dtype) for _ in range(n_sets)]
        dw = cupy.empty(op.w_shape, dtype=np_dtype)
        turn = iter(range(1 << 62))
        runs = {"fprop": lambda: op.fprop(x, ws[next(turn) % n_sets], out=y),
                "bprop": lambda: op.bprop(dy, ws[next(turn) % n_sets], out=y),
                "updat": lambda: op.updat(x, dy, out=dw)}
        graph = {p: bench._graph_seconds(f, 20, 11) for p, f in runs.items()}
        eager = {p: bench._gpu_seconds(f, 20, 11) for p, f in runs.items()}
        us = lambda s: f"{s * 1e6:.1f}" if s else "-"
        print(f"| {name} | {density:.0%} | " + " | ".join(us(graph[p]) for p in runs) + " | "
              + " | ".join(us(eager[p]) for p in runs) + " |", flush=True)
        del ws

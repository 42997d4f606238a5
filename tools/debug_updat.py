"""Which batch rows does updat (feature_axis=0) lose? One batch row at a time."""
import cupy
import numpy as np
import bsmm

rng = np.random.default_rng(0)
for bs, n in ((16, 40), (16, 96), (64, 40), (16, 8)):
    layout = np.ones((1, 1), np.uint8)
    op = bsmm.BlocksparseMatMul(layout, block_size=bs, feature_axis=0)
    lost = []
    for k0 in range(n):
        x = np.zeros((op.C, n), np.float16)
        dy = np.zeros((op.K, n), np.float16)
        x[:, k0] = rng.standard_normal(op.C)
        dy[:, k0] = rng.standard_normal(op.K)
        out = cupy.full(op.w_shape, np.nan, dtype=np.float16)
        op.updat(cupy.asarray(x), cupy.asarray(dy), out=out)
        ref = np.outer(x[:, k0].astype(np.float64), dy[:, k0].astype(np.float64))
        got = out.get()[0].astype(np.float64)
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        if not err < 1e-2:
            lost.append((k0, round(float(err), 2)))
    print(f"bs={bs} N={n}: wrong batch rows {lost}")

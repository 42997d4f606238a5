"""Where does updat go wrong? Error per N and the pattern of wrong entries in one block."""
import sys
import cupy
import numpy as np
import bsmm

rng = np.random.default_rng(0)
for dtype in ("float16",):
    for bs in (16, 32):
        for axis in (0, 1):
            for n in (8, 16, 24, 32, 40, 64, 96, 128, 136):
                layout = np.ones((2, 2), np.uint8)
                op = bsmm.BlocksparseMatMul(layout, block_size=bs, feature_axis=axis)
                x = rng.standard_normal((n, op.C)).astype(dtype)
                dy = rng.standard_normal((n, op.K)).astype(dtype)
                ref = op.from_dense(x.astype(np.float64).T @ dy.astype(np.float64))
                t = (lambda a: np.ascontiguousarray(a.T)) if axis == 0 else (lambda a: a)
                out = cupy.full(op.w_shape, np.nan, dtype=dtype)
                op.updat(cupy.asarray(t(x)), cupy.asarray(t(dy)), out=out)
                got = out.get().astype(np.float64)
                bad = ~np.isclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
                err = np.linalg.norm(np.nan_to_num(got - ref, nan=1e9)) / np.linalg.norm(ref)
                rows = np.nonzero(bad[0].any(axis=1))[0]
                cols = np.nonzero(bad[0].any(axis=0))[0]
                print(f"bs={bs} axis={axis} N={n}: err {err:.1e}; bad in block 0: rows {rows.tolist()[:12]} cols {cols.tolist()[:12]}")

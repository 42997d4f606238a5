"""Fast GPU correctness sweep: every pass x block size x dtype x feature axis x a few N and
layouts against a float64 reference, outputs poisoned with NaN, plus a determinism check.
Prints one line per failure and a summary; exit status 1 on any failure.

    python tools/gpu/gpu_smoke.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import cupy
import numpy as np

import bsmm
from bsmm.backends.cuda.policy import current_policy, planning
from bsmm.dtypes import ELEMENT_TYPES, GPU_KINDS, KIND_DTYPES, TOLERANCES


def layouts(rng, cb, kb):
    random = (rng.random((cb, kb)) < 0.3).astype(np.uint8)
    skewed = (rng.random((cb, kb)) < 0.05).astype(np.uint8)
    skewed[:, kb // 2] = 1  # one dense block column, cut into parts
    skewed[cb // 3, :] = 1  # one dense block row
    skewed[:, 0] = 0
    skewed[0, :] = 0  # an empty block row and column
    return {"random": random, "skewed": skewed, "empty": np.zeros((cb, kb), np.uint8)}


def rel_error(actual, expected):
    actual = np.asarray(actual, dtype=np.float64)
    if actual.size == 0:
        return 0.0 if actual.shape == expected.shape else float("inf")
    denom = max(np.linalg.norm(expected), 1e-30)
    if not np.isfinite(actual).all():
        return float("inf")
    return float(np.linalg.norm(actual - expected) / denom) if np.linalg.norm(expected) else float(np.abs(actual).max())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    # Cut block columns as short as the plans allow, so that the sweep's small layouts exercise
    # the ordered reduction of parts (the default only cuts columns of 32+ blocks), and use column
    # groups wherever the table has a tile for them, whatever the density.
    with planning(current_policy().replace(min_part_blocks=1, group_min_blocks_per_step=0)):
        return _smoke(args, rng)


def _smoke(args, rng) -> int:
    failures = checked = 0
    worst = {}
    start = time.perf_counter()
    block_sizes = (8, 16, 32, 64, 128)
    kinds = GPU_KINDS  # float32, tf32, float16, bfloat16
    ns = (1, 7, 32, 129) if args.quick else (1, 7, 32, 129, 4096)
    for bs, kind in itertools.product(block_sizes, kinds):
        element = ELEMENT_TYPES[KIND_DTYPES[kind]]
        np_dtype = element.numpy
        cb, kb = (6, 5) if bs == 128 else (9, 7)
        if bs <= 16:
            cb, kb = 24, 20
        for (lname, layout), axis, n in itertools.product(layouts(rng, cb, kb).items(), (1, 0), ns):
            if n == 4096 and (lname != "random" or bs < 32):
                continue
            op = bsmm.BlocksparseMatMul(layout, block_size=bs, feature_axis=axis, tf32=kind == "tf32")
            W64 = np.zeros((op.C, op.K))
            w = rng.standard_normal(op.w_shape).astype(np_dtype)
            W64[:] = op.to_dense(w.astype(np.float32)).astype(np.float64)
            x = rng.standard_normal((n, op.C)).astype(np_dtype)
            dy = rng.standard_normal((n, op.K)).astype(np_dtype)
            x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
            refs = {"fprop": x64 @ W64, "bprop": dy64 @ W64.T,
                    "updat": op.from_dense(x64.T @ dy64)}
            t = (lambda a: np.ascontiguousarray(a.T)) if axis == 0 else (lambda a: a)
            gx, gdy, gw = cupy.asarray(t(x)), cupy.asarray(t(dy)), cupy.asarray(w)
            for pass_name in ("fprop", "bprop", "updat"):
                ref = refs[pass_name]
                shape = ref.shape if pass_name == "updat" else t(ref).shape
                outs = []
                for _ in range(2):
                    out = cupy.full(shape, element.nan_bits, dtype=element.uint).view(np_dtype)
                    if pass_name == "fprop":
                        op.fprop(gx, gw, out=out)
                    elif pass_name == "bprop":
                        op.bprop(gdy, gw, out=out)
                    else:
                        op.updat(gx, gdy, out=out)
                    outs.append(out.get())
                got = outs[0] if pass_name == "updat" else t(outs[0])
                err = rel_error(got.astype(np.float64), ref)
                same = np.array_equal(outs[0].view(np.uint8), outs[1].view(np.uint8))
                checked += 1
                key = (kind, pass_name)
                worst[key] = max(worst.get(key, 0.0), err)
                if not (err <= TOLERANCES[kind]) or not same:
                    failures += 1
                    print(f"FAIL {kind} bs={bs} {pass_name} axis={axis} N={n} layout={lname}: "
                          f"rel err {err:.2e}{'' if same else ', not deterministic'}", flush=True)
    print(f"checked {checked} cases in {time.perf_counter() - start:.0f}s: {failures} failures")
    for (kind, pass_name), err in sorted(worst.items()):
        print(f"  worst {kind:9s} {pass_name}: {err:.1e} (tolerance {TOLERANCES[kind]:.0e})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

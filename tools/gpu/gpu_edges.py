"""Edge checks past 2**31 elements: passes whose big operand or output holds N*C > 2**31 elements.

- updat (dW = xᵀ·dy) with x of N*C > 2**31 elements, feature axes 1 and 0;
- bprop (dx = dy·Wᵀ) whose output dx has N*C > 2**31 elements, every row of it checked,
  the rows at and past element 2**31 on their own ("tail"), the output poisoned with NaN first;
- fprop (y = x·W) with x of N*C > 2**31 elements: a control (seen correct before).

Default: float16 and bfloat16, blocks 32 and 64, feature axes 1 and 0, C = 16384, K = 512,
N = 139264 (N*C = 2.28e9 elements: an fp16 x is 4.6 GB), a random 10 % layout with blocks in the
last block row and column and one empty block row and column next to them. Peak GPU memory
about 21 GiB (x, dy, the output, the library's workspace, float64 chunks; 34 GiB with
``--dtypes float32 tf32``), estimated and printed before the run. The 24 default checks took
4 s on an H100 (kernels already in the cache).

The float64 reference is computed on the GPU in chunks of rows of about 2**27 elements (a
float64 copy of a whole x would be 18 GB): updat sums xᵀ·dy over chunks of batch rows (feature
axis 1) or stacks x·dyᵀ over chunks of feature rows (axis 0); fprop and bprop compare each
chunk of output rows with its own product. One table row per check; exit status 1 on failure.

    PYTHONPATH=$PWD python tools/gpu/gpu_edges.py [--quick] [--dtypes float16 bfloat16 float32 tf32]
        [--block-sizes 32 64] [--axes 1 0] [--passes fprop bprop updat] [--json PATH]

``--quick``: float16, block 32, feature axis 1 only (still past 2**31). ``--rows/--features/
--outputs/--boundary`` change the sizes (``--cpu --boundary 32768 --rows 200 --features 256``
runs the same checks, small, on the NumPy CPU backend).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from bsmm.dtypes import ELEMENT_TYPES, KIND_DTYPES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_sweep import KINDS, TOLERANCE, as_float32, as_float64, normal  # noqa: E402

PASSES = ("fprop", "bprop", "updat")
BOUNDARY = 2**31
CHUNK_ELEMENTS = 2**27  # float64 chunk: 1 GiB


@dataclasses.dataclass(frozen=True)
class EdgeCheck:
    pass_name: str
    kind: str  # float32, tf32, float16 or bfloat16
    block_size: int
    feature_axis: int
    N: int
    C: int
    K: int
    density: float

    @property
    def dtype(self) -> str:
        return KIND_DTYPES[self.kind]


def default_rows(features: int, boundary: int) -> int:
    """A batch of 1/16 more rows than it takes to reach ``boundary`` elements, a multiple of 128."""
    return -(-(boundary // features * 17 // 16) // 128) * 128


def plan_checks(args: argparse.Namespace) -> list[EdgeCheck]:
    n = args.rows or default_rows(args.features, args.boundary)
    kinds, block_sizes, axes = args.dtypes, args.block_sizes, args.axes
    if args.quick:
        kinds, block_sizes, axes = ["float16"], [32], [1]
    return [EdgeCheck(p, kind, bs, axis, n, args.features, args.outputs, args.density)
            for kind, axis, bs, p in itertools.product(kinds, axes, block_sizes, args.passes)]


def peak_bytes(check: EdgeCheck, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Estimated GPU memory of one check: x and dy, the output, the library's workspace (one
    more activation at most), dense float64 W and dW, float64 chunks."""
    n, c, k = check.N, check.C, check.K
    item = ELEMENT_TYPES[check.dtype].element_bytes
    output = {"fprop": n * k, "bprop": n * c, "updat": c * k}[check.pass_name]
    temporaries = 6 * min(chunk_elements, n * max(c, k)) * 8 + (3 * n * k * 8 if check.feature_axis == 0 else 0)
    return (2 * n * c + n * k + output) * item + 3 * c * k * 8 + temporaries


def edge_layout(cb: int, kb: int, density: float, rng: np.random.Generator) -> np.ndarray:
    """Random blocks, blocks in the last block row and column, an empty block row and column
    beside them (their outputs must be written as zeros)."""
    from bsmm import layouts

    layout = layouts.random_layout(cb, kb, density=density, seed=rng)
    layout[-1, rng.integers(kb)] = layout[rng.integers(cb), -1] = layout[-1, -1] = layout[0, 0] = 1
    if cb >= 3:
        layout[-2, :] = 0
    if kb >= 3:
        layout[:, -2] = 0
    return layout


def filled(xp, rng, shape, dtype: str, chunk_rows: int):
    """Normal random data of ``shape``, made ``chunk_rows`` rows at a time."""
    element = ELEMENT_TYPES[dtype]
    bits = xp.empty(shape, dtype=element.uint)  # filled through the bits: no bfloat16 kernel
    for r0 in range(0, shape[0], chunk_rows):
        r1 = min(shape[0], r0 + chunk_rows)
        bits[r0:r1] = normal(rng, (r1 - r0, shape[1]), dtype).view(bits.dtype)
    return bits.view(element.numpy)


def poisoned_rows(xp, shape, dtype: str, chunk_rows: int):
    """NaN everywhere, written ``chunk_rows`` rows at a time (no kernel over 2**31 elements)."""
    element = ELEMENT_TYPES[dtype]
    bits = xp.empty(shape, dtype=element.uint)
    for r0 in range(0, shape[0], chunk_rows):
        bits[r0:r0 + chunk_rows].fill(element.nan_bits)
    return bits.view(element.numpy)


def compare_rows(xp, got, reference_rows, tail_start, chunk_rows: int) -> dict:
    """Compare ``got`` (R, L) with ``reference_rows(r0, r1)`` (float64) chunk by chunk.

    Returns the norm-wise relative error over all rows and over rows >= ``tail_start`` (None:
    no tail), and the NaN/Inf counts of both; an error is inf where ``got`` has NaN/Inf.
    """
    if tail_start is not None and tail_start >= got.shape[0]:
        tail_start = None  # nothing past the boundary
    sums = {"diff": 0.0, "ref": 0.0, "tail diff": 0.0, "tail ref": 0.0, "nonfinite": 0, "tail nonfinite": 0}
    for r0 in range(0, got.shape[0], chunk_rows):
        r1 = min(got.shape[0], r0 + chunk_rows)
        ref = reference_rows(r0, r1)
        chunk = as_float64(got[r0:r1])
        finite = xp.isfinite(chunk)
        diff = xp.where(finite, chunk - ref, 0.0)
        per_row = {"diff": (diff * diff).sum(axis=1), "ref": (ref * ref).sum(axis=1),
                   "nonfinite": (~finite).sum(axis=1)}
        local = None if tail_start is None else max(0, tail_start - r0)
        for name, values in per_row.items():
            sums[name] += values.sum().item()
            if local is not None and local < r1 - r0:
                sums[f"tail {name}"] += values[local:].sum().item()
        del ref, chunk, finite, diff, per_row

    def error(prefix):
        if sums[f"{prefix}nonfinite"]:
            return math.inf
        return math.sqrt(sums[f"{prefix}diff"]) / max(math.sqrt(sums[f"{prefix}ref"]), np.finfo(np.float64).tiny)

    return {"error": error(""), "tail error": None if tail_start is None else error("tail "),
            "nonfinite": int(sums["nonfinite"]),
            "tail nonfinite": None if tail_start is None else int(sums["tail nonfinite"])}


def run_pass(xp, op, check: EdgeCheck, x, dy, w, args) -> dict:
    """Run one pass into a NaN-poisoned ``out`` and compare it with the chunked float64 reference."""
    axis, boundary, dtype = check.feature_axis, args.boundary, check.dtype
    dense = op.to_dense(as_float32(w)).astype(np.float64)
    if check.pass_name == "updat":
        out = poisoned_rows(xp, op.w_shape, dtype, max(1, op.blocks))
        returned = op.updat(x, dy, out=out)
        product = xp.zeros((check.C, check.K))
        rows = chunk_rows(args, x.shape[1])
        if axis == 1:
            for r0 in range(0, check.N, rows):
                product += as_float64(x[r0:r0 + rows]).T @ as_float64(dy[r0:r0 + rows])
        else:
            dy64 = as_float64(dy)
            for r0 in range(0, check.C, rows):
                product[r0:r0 + rows] = as_float64(x[r0:r0 + rows]) @ dy64.T
            del dy64
        expected = op.from_dense(product).reshape(op.blocks, -1)
        result = compare_rows(xp, out.reshape(op.blocks, -1), lambda r0, r1: expected[r0:r1], None,
                              max(1, op.blocks))
        del product, expected
    elif axis == 1:
        act = x if check.pass_name == "fprop" else dy
        weight = dense if check.pass_name == "fprop" else dense.T
        out = poisoned_rows(xp, (check.N, weight.shape[1]), dtype, chunk_rows(args, weight.shape[1]))
        returned = op.fprop(x, w, out=out) if check.pass_name == "fprop" else op.bprop(dy, w, out=out)
        tail = boundary // check.C  # rows of x (fprop) or dx (bprop) holding elements >= boundary
        result = compare_rows(xp, out, lambda r0, r1: as_float64(act[r0:r1]) @ weight, tail,
                              chunk_rows(args, max(check.C, weight.shape[1])))
    elif check.pass_name == "bprop":
        out = poisoned_rows(xp, (check.C, check.N), dtype, chunk_rows(args, check.N))
        returned = op.bprop(dy, w, out=out)
        dy64 = as_float64(dy)
        result = compare_rows(xp, out, lambda r0, r1: dense[r0:r1] @ dy64, boundary // check.N,
                              chunk_rows(args, check.N))
        del dy64
    else:  # fprop, feature axis 0: y (K, N) = Wᵀ·x, summed over chunks of x's feature rows
        out = poisoned_rows(xp, (check.K, check.N), dtype, chunk_rows(args, check.N))
        returned = op.fprop(x, w, out=out)
        expected = xp.zeros((check.K, check.N))
        rows = chunk_rows(args, check.N)
        for r0 in range(0, check.C, rows):
            expected += dense[r0:r0 + rows].T @ as_float64(x[r0:r0 + rows])
        result = compare_rows(xp, out, lambda r0, r1: expected[r0:r1], None, rows)
        del expected
    result["note"] = "" if returned is out else "the call did not return out"
    if check.pass_name == "bprop":  # the exact tail: elements at flat index >= boundary, poison left or not
        flat = out.reshape(-1)[boundary:].view(ELEMENT_TYPES[dtype].uint)
        mask = ELEMENT_TYPES[dtype].exponent_mask  # all exponent bits set: NaN or Inf
        result["past boundary nonfinite"] = past = int(xp.count_nonzero((flat & mask) == mask))
        if past:
            result["note"] = f"{result['note']} {past} NaN/Inf at or past element {boundary}".strip()
    return result


def chunk_rows(args, row_length: int) -> int:
    return args.chunk_rows or max(1, CHUNK_ELEMENTS // row_length)


HEADER = (f"{'pass':6s} {'dtype':9s} {'block':>5s} {'axis':>4s} {'N':>7s} {'C':>6s} {'K':>5s} {'rel err':>9s} "
          f"{'tail err':>9s} {'NaN/Inf':>9s} {'ok':>4s} {'seconds':>8s}  note")


def format_row(row: dict) -> str:
    def number(value):
        return "-" if value is None else f"{value:.2e}"

    nonfinite = "-" if row["nonfinite"] is None else row["nonfinite"]
    return (f"{row['pass']:6s} {row['dtype']:9s} {row['block']:5d} {row['axis']:4d} {row['N']:7d} {row['C']:6d} "
            f"{row['K']:5d} {number(row['error']):>9s} {number(row['tail error']):>9s} {nonfinite!s:>9s} "
            f"{'ok' if row['ok'] else 'FAIL':>4s} {row['seconds']:8.2f}  {row['note']}").rstrip()


def _context_lost(xp) -> bool:
    if xp is np:
        return False
    try:
        xp.cuda.runtime.deviceSynchronize()
    except Exception:
        return True
    return False


def run_checks(checks: list[EdgeCheck], xp, args, out=print) -> list[dict]:
    """Run ``checks``, sharing x and dy among those of one dtype, axis and size; one row each."""
    import bsmm

    rows = []
    out(HEADER, flush=True)
    groups = itertools.groupby(checks, key=lambda c: (c.dtype, c.feature_axis, c.N, c.C, c.K))
    for (dtype, axis, n, c, k), group in groups:
        group = list(group)
        rng = xp.random.default_rng([args.seed, axis, n, c, k, KINDS.index(dtype)])
        shape = (lambda features: (n, features)) if axis == 1 else (lambda features: (features, n))
        x = filled(xp, rng, shape(c), dtype, chunk_rows(args, shape(c)[1]))
        dy = filled(xp, rng, shape(k), dtype, chunk_rows(args, shape(k)[1]))
        for check in group:
            began = time.perf_counter()
            layout_rng = np.random.default_rng([args.seed, check.block_size])
            try:
                op = bsmm.BlocksparseMatMul(edge_layout(c // check.block_size, k // check.block_size, check.density,
                                                        layout_rng),
                                            block_size=check.block_size, feature_axis=axis, tf32=check.kind == "tf32")
                w = normal(xp.random.default_rng([args.seed, check.block_size, 1]), op.w_shape, dtype)
                result = run_pass(xp, op, check, x, dy, w, args)
                del op, w
            except Exception as error:
                result = {"error": math.inf, "tail error": None, "nonfinite": None,
                          "note": f"{type(error).__name__}: {error}"[:300]}
            tolerance = TOLERANCE[check.kind]
            ok = (result["error"] <= tolerance and not result["note"]
                  and (result["tail error"] is None or result["tail error"] <= tolerance)
                  and not result.get("past boundary nonfinite"))
            row = {"pass": check.pass_name, "dtype": check.kind, "block": check.block_size, "axis": axis,
                   "N": n, "C": c, "K": k, **result, "tolerance": tolerance, "ok": bool(ok),
                   "seconds": time.perf_counter() - began}
            rows.append(row)
            out(format_row(row), flush=True)
            if xp is not np:
                xp.get_default_memory_pool().free_all_blocks()
            if result["note"] and _context_lost(xp):
                out("the CUDA context is lost: the remaining checks are not run", flush=True)
                return rows
        del x, dy
        if xp is not np:
            xp.get_default_memory_pool().free_all_blocks()
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="float16, block 32, feature axis 1 only")
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=KINDS)
    parser.add_argument("--block-sizes", nargs="+", type=int, default=[32, 64], choices=[8, 16, 32, 64, 128])
    parser.add_argument("--axes", nargs="+", type=int, default=[1, 0], choices=[0, 1])
    parser.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    parser.add_argument("--rows", type=int, help="N (default: 1/16 past the boundary, a multiple of 128)")
    parser.add_argument("--features", type=int, default=16384, help="C (default 16384)")
    parser.add_argument("--outputs", type=int, default=512, help="K (default 512)")
    parser.add_argument("--density", type=float, default=0.1, help="layout density (default 0.1)")
    parser.add_argument("--boundary", type=int, default=BOUNDARY, help="the element index checked past (2**31)")
    parser.add_argument("--chunk-rows", type=int, help="rows of a float64 reference chunk (default ~2**27 elements)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--cpu", action="store_true", help="run on the NumPy CPU backend (small sizes only)")
    args = parser.parse_args(argv)
    for size in (args.features, args.outputs):
        if any(size % bs for bs in args.block_sizes):
            parser.error(f"--features and --outputs must be multiples of every block size; got {size}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    checks = plan_checks(args)
    n, c = checks[0].N, checks[0].C
    print(f"N*C = {n} * {c} = {n * c} elements ({'past' if n * c > args.boundary else 'NOT past'} the "
          f"boundary {args.boundary}); peak GPU memory ~{max(map(peak_bytes, checks)) / 2**30:.1f} GiB; "
          f"{len(checks)} checks", flush=True)
    if args.cpu:
        xp = np
    else:
        import cupy as xp
    start = time.perf_counter()
    rows = run_checks(checks, xp, args)
    failures = sum(not row["ok"] for row in rows)
    print(f"{len(rows)} of {len(checks)} checks run, {failures} failed, {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as file:
            json.dump([{key: (value if not isinstance(value, float) or math.isfinite(value) else str(value))
                        for key, value in row.items()} for row in rows], file, indent=1)
    return 1 if failures or len(rows) < len(checks) else 0


if __name__ == "__main__":
    sys.exit(main())

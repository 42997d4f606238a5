"""What bounds each benchmark row: the bench run three times, with the kernels as they are, with
only their data movement (-DBSMM_PROBE_COPY_ONLY: every copy into shared memory and every store of
the output, no multiplication) and with only their math (-DBSMM_PROBE_MATH_ONLY: the
multiplications on whatever the stages hold, no copy in). Device call; the arguments go to
`python -m bsmm bench` (default: --workloads T --dtype float16).

    python tools/probes/probe_bounds.py --workloads T --block-size 32,64,128 --dtype float16,bfloat16

Prints one Markdown table: each row's time three ways, and the efficiency per useful FLOP each
would give (dense time x density / time). A row whose full time sits near its copy-only time is
bound by moving its bytes, whatever the tensor cores could do; near its math-only time, by the
math. The copy-only and math-only cubins carry their own options, so the kernel cache keeps them
apart from the real ones. Full JSON of the three runs next to --out (default /tmp/bsmm-bounds).

Then the roofline of each row: the bytes its launches move (:func:`moved_bytes`, counted from the
launch plans the pass really used: what the copies bring into shared memory, the output, the
partial tiles of split parts and any transposed copy), so the copy-only time gives the measured
copy bandwidth, beside the useful FLOPs and the dense rate of the same run.

    python tools/probes/probe_bounds.py --from results/archive/v16 results/archive/v17   # roofline of runs already made
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from bsmm.backends.cuda.kernels import ELEMENT_BYTES

MODES = {"full": "", "copy only": "-DBSMM_PROBE_COPY_ONLY", "math only": "-DBSMM_PROBE_MATH_ONLY"}
#: Efficiency per useful FLOP asked of workloads T and F (issue 24's half-precision targets; issue 3's
#: for float32 and TF32), by (workload, dtype, block size).
TARGETS = {**{("T", half, bs): t for half in ("float16", "bfloat16")
              for bs, t in ((16, .15), (32, .40), (64, .65), (128, .85))},
           **{("F", half, bs): t for half in ("float16", "bfloat16") for bs, t in ((64, .55), (128, .70))},
           ("T", "float32", 32): .50, ("T", "float32", 64): .75, ("T", "tf32", 64): .40}


def _host(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") else np.asarray(array)


def moved_bytes(plan, n: int) -> dict[str, int]:
    """Bytes one call of ``plan`` moves for a batch of ``n`` rows, by kind: "staged", what its
    copies bring into shared memory (TMA or cp.async; rows past N are zero-filled, not read, and
    absent blocks of a group are not copied); "partials", the float tiles of parts written and
    read back; "transposed", the transposed copies read and written first (``plan.plan`` is then
    the pass itself). The output (N x features, or the blocks of dW) is the caller's to add."""
    extra = {}
    if hasattr(plan, "transpose_x"):  # TransposedUpdat: x and dy, read and written transposed
        extra["transposed"] = (plan.C + plan.K) * (n + plan.ld) * plan.item
    elif hasattr(plan, "features"):  # TransposedActivations
        extra["transposed"] = plan.features * (n + plan.ld) * plan.item
    elif hasattr(plan, "weight_count"):  # TransposedWeightsFprop: W read, W' written, floats
        extra["transposed"] = 2 * plan.weight_count * 4
    if extra:
        plan = plan.plan
    v = plan.variant
    bm, bn, bk = v.tile.bm, v.tile.bn, v.tile.bk
    bs, item = v.block_size, ELEMENT_BYTES[v.dtype]
    segments, table = _host(plan.segments).astype(np.int64), _host(plan.table)
    _, tiles_y, tiles_z = plan.launcher.grid
    if v.grouped:  # small-batch updat: segments are runs of blocks, each tile the whole batch deep
        blocks = int((segments[:, 1] - segments[:, 0]).sum())
        staged = blocks * tiles_y * tiles_z * n * (bm + bn)
    else:
        length = segments[:, 2] - segments[:, 1]  # entries (fprop/bprop) or batch rows (updat)
        if v.pass_name == "updat":
            if v.cols > 1:  # row groups: the x panel once, a dy panel per present block
                present = (table[segments[:, 0], 1:1 + v.cols] >= 0).sum(axis=1)
                staged = int((length * (1 + present)).sum()) * bs
            else:
                staged = int(length.sum()) * tiles_y * tiles_z * (bm + bn)
        elif v.cols > 1:  # column groups: per entry an activation panel and its present blocks
            entries = np.concatenate([np.arange(b, e) for b, e in segments[:, 1:3]] or [np.zeros(0, int)])
            present = int((table[entries, 1:] >= 0).sum())
            staged = len(entries) * n * bs + present * tiles_y * bs * bs
        else:  # one block a step (or BS / BK steps): its activation rows and its weight tile
            blocks = int(length.sum())
            staged = blocks * (tiles_z * n * bs + tiles_y * bs * bs)
    return {"staged": int(staged) * item, "partials": 2 * 4 * plan.workspace_floats, **extra}


def run_bench(mode: str, options: str, bench_args: list[str], out: Path) -> list[dict]:
    path = out / f"bench_{mode.replace(' ', '_')}.json"
    env = dict(os.environ, BSMM_NVRTC_OPTIONS=(os.environ.get("BSMM_NVRTC_OPTIONS", "") + " " + options).strip())
    subprocess.run([sys.executable, "-m", "bsmm", "bench", "--backend", "gpu", "--json", str(path), *bench_args],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())["rows"]


def row_key(row: dict) -> tuple:
    return (row["workload"], row["dtype"], row["block_size"], row["density"], row["pass_name"],
            f"{row['C']}->{row['K']}")


def table(runs: dict[str, list[dict]]) -> str:
    by_mode = {mode: {row_key(r): r for r in rows} for mode, rows in runs.items()}
    lines = ["| load | dtype | block | density | pass | full us | copy only us | math only us "
             "| eff. | copy-only eff. | math-only eff. |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, full in by_mode["full"].items():
        others = [by_mode[m].get(key) for m in ("copy only", "math only")]
        if any(o is None for o in others):
            continue
        # Each run's own dense time: the efficiencies compare like with like within a run.
        times = [full] + others
        us = " | ".join(f"{r['sparse_s'] * 1e6:.1f}" for r in times)
        eff = " | ".join(f"{r['dense_s'] * r['density'] / r['sparse_s']:.0%}" for r in times)
        lines.append(f"| {key[0]} {key[5]} | {key[1]} | {key[2]} | {key[3]:.0%} | {key[4]} | {us} | {eff} |")
    return "\n".join(lines)


def pass_bytes(row: dict) -> int:
    """Bytes moved by one call of the bench row's pass (GPU): the pass runs once on the layout and
    shapes ``bsmm bench`` timed (its seed, 0), and :func:`moved_bytes` reads the plan it used."""
    import cupy

    from bsmm import BlocksparseMatMul
    from bsmm.backends.cuda import plan_cache
    from bsmm.cli.bench import pass_calls
    from bsmm.layouts import random_layout

    bs, n, c, k = row["block_size"], row["N"], row["C"], row["K"]
    tf32 = row["dtype"] == "tf32"
    dtype = "float32" if tf32 else row["dtype"]
    op = BlocksparseMatMul(random_layout(c // bs, k // bs, density=row["density"], seed=0), block_size=bs, tf32=tf32)
    rng = cupy.random.default_rng(1)
    x, dy = (rng.standard_normal((n, features), dtype=np.float32).astype(dtype) for features in (c, k))
    w = rng.standard_normal(op.w_shape, dtype=np.float32).astype(dtype)
    outputs = {"fprop": cupy.empty((n, k), dtype=dtype), "bprop": cupy.empty((n, c), dtype=dtype),
               "updat": cupy.empty(op.w_shape, dtype=dtype)}
    pass_calls(op, x, dy, [w], outputs)[row["pass_name"]]()
    # (The index may be shared with other rows' operators of the same layout: their plans differ in dtype.)
    plans = [plan for key, plan in plan_cache.plans_of(op.index).items()
             if key[:3] == (row["pass_name"], n, dtype) and key[4] == tf32]
    assert len(plans) == 1, f"{row_key(row)}: {len(plans)} plans"
    out = {"fprop": n * k, "bprop": n * c, "updat": op.blocks * bs * bs}[row["pass_name"]]
    return sum(moved_bytes(plans[0], n).values()) + out * ELEMENT_BYTES[dtype]


def compulsory_bytes(row: dict) -> int:
    """Bytes a bench row's pass must move to or from DRAM at least: its two inputs read and its
    output written once each (the weights at the row's density)."""
    item = ELEMENT_BYTES["float32" if row["dtype"] == "tf32" else row["dtype"]]
    n, c, k = row["N"], row["C"], row["K"]
    weights = round(c * k * row["density"])
    return (n * c + n * k + weights) * item


def roofline_table(runs: dict[str, list[dict]], bytes_of) -> str:
    """Per row of the full run: its target and efficiency three ways, the bytes a call moves
    (``bytes_of(row)``), the bandwidth at which the copy-only and the full kernels move them, the
    useful FLOPs and the dense rate of the same run."""
    by_mode = {mode: {row_key(r): r for r in rows} for mode, rows in runs.items()}
    lines = ["| load | dtype | block | density | pass | target | eff. full / copy only / math only | MB moved "
             "| TB/s copy only / full | DRAM MB at least | useful GFLOP | dense TFLOP/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, full in by_mode["full"].items():
        copy, math = (by_mode[m].get(key) for m in ("copy only", "math only"))
        if copy is None or math is None:
            continue
        moved = bytes_of(full)
        useful = 2 * full["N"] * full["C"] * full["K"] * full["density"]
        target = TARGETS.get((full["workload"], full["dtype"], full["block_size"]))
        eff = " / ".join(f"{r['dense_s'] * r['density'] / r['sparse_s'] * 100:.0f}" for r in (full, copy, math))
        lines.append(
            f"| {key[0]} {key[5]} | {key[1]} | {key[2]} | {key[3]:.0%} | {key[4]} | "
            f"{f'{target:.0%}' if target else '-'} | {eff} | "
            f"{moved / 1e6:.0f} | {moved / copy['sparse_s'] / 1e12:.1f} / {moved / full['sparse_s'] / 1e12:.1f} | "
            f"{compulsory_bytes(full) / 1e6:.0f} | {useful / 1e9:.1f} | {useful / full['density'] / full['dense_s'] / 1e12:.0f} |")
    return "\n".join(lines)


def read_runs(full_path: Path) -> dict[str, list[dict]]:
    """The three runs saved as ``<name>full.json``, ``<name>copy_only.json``, ``<name>math_only.json``."""
    name = full_path.name.removesuffix("full.json")
    return {mode: json.loads((full_path.parent / f"{name}{mode.replace(' ', '_')}.json").read_text())["rows"]
            for mode in MODES}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/bsmm-bounds", help="folder for the three runs' JSON")
    parser.add_argument("--from", dest="saved", nargs="+", type=Path, metavar="FULL_JSON",
                        help="no new runs: the roofline of runs saved before (their *full.json files)")
    args, bench_args = parser.parse_known_args()
    if args.saved:
        for path in args.saved:
            print(roofline_table(read_runs(path), pass_bytes), end="\n\n")
        return 0
    bench_args = bench_args or ["--workloads", "T", "--dtype", "float16"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {mode: run_bench(mode, options, bench_args, out) for mode, options in MODES.items()}
    print(table(runs), end="\n\n")
    print(roofline_table(runs, pass_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())

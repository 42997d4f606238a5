"""Small-batch passes as weight streams: each policy candidate's fprop and bprop time beside a copy of
the weight bytes and the dense product, in one run (issue 36, item 1).

Shapes: the sparse-wide LSTM's recurrent matrix (H 12288 -> 4H, block 32, a small-world layout tiled
over the four gates, 10 %, bfloat16) and workload D's forward (8192², block 32, random 10 %, float16).
Each candidate is a planner policy (``bsmm.backends.cuda.policy.planning``): today's, TMA mma.sync
whatever the weights' size (before ``tma_mma_max_stream_bytes``), columns cut into parts of 64 blocks,
TMA off. The first run (results/v24/) also tried 4 and 6 stages and parts of 16 and 32. Prints a Markdown table; ``--json`` writes the rows.

    python tools/probes/probe_streaming.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import cupy

import bsmm
from bsmm.backends.cuda.plan_cache import plans_of
from bsmm.backends.cuda.policy import current_policy, planning
from bsmm.layouts import random_layout
from bsmm.layouts.small_world import small_world_layout
from bsmm.nn.lstm_gates import gate_layout


def timed(run, calls: int = 20, batches: int = 9) -> float:
    for _ in range(3):
        run()
    cupy.cuda.Device().synchronize()
    samples = []
    for _ in range(batches):
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record()
        for _ in range(calls):
            run()
        end.record()
        end.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(begin, end) / 1e3 / calls)
    return statistics.median(samples)


def candidates():
    base = current_policy()
    yield "today", base
    yield "TMA at any size", base.replace(tma_mma_max_stream_bytes=1 << 50)
    yield "parts of 64", base.replace(tma_mma_min_part_blocks=64, min_part_blocks=64)
    yield "no TMA", base.replace(tma=False)


def shapes():
    blocks = 12288 // 32
    lstm = gate_layout(small_world_layout(blocks, round(0.1 * blocks * blocks), "barabasi_albert", 0), blocks)
    yield "LSTM Wh 12288 x 49152", lstm, "bfloat16", (8, 32, 64), ("fprop", "bprop")
    yield "D 8192²", random_layout(256, 256, 0.1, seed=0), "float16", (8,), ("fprop",)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    rng = cupy.random.default_rng(0)
    rows = []
    print("| shape | dtype | pass | N | policy | µs | TB/s on weights | % of copy | dense µs | speed-up | path |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, layout, dtype, batches, passes in shapes():
        op = bsmm.BlocksparseMatMul(layout, block_size=32)
        w = rng.standard_normal(op.w_shape, dtype=cupy.float32).astype(dtype)
        dense = rng.standard_normal((op.C, op.K), dtype=cupy.float32).astype(dtype)
        source, target = cupy.empty(w.nbytes, cupy.uint8), cupy.empty(w.nbytes, cupy.uint8)
        copy_rate = 2 * w.nbytes / timed(lambda: target.__setitem__(Ellipsis, source))
        for n in batches:
            x = rng.standard_normal((n, op.C), dtype=cupy.float32).astype(dtype)
            dy = rng.standard_normal((n, op.K), dtype=cupy.float32).astype(dtype)
            for pass_name in passes:
                a, out = (x, cupy.empty((n, op.K), dtype)) if pass_name == "fprop" else (dy, cupy.empty((n, op.C), dtype))
                dense_s = timed(lambda: cupy.matmul(a, dense if pass_name == "fprop" else dense.T, out=out))
                for label, policy in candidates():
                    # A new operator a candidate: an operator repeats the call it kept, whatever the policy.
                    fresh = bsmm.BlocksparseMatMul(layout, block_size=32)
                    with planning(policy):
                        method = getattr(fresh, pass_name)
                        seconds = timed(lambda: method(a, w, out=out))
                    plans = [plan for key, plan in plans_of(fresh.index).items()
                             if key[0] == pass_name and key[1] == n and policy in key]
                    described = plans[0].path.describe() if plans else "?"
                    rate = w.nbytes / seconds
                    row = dict(shape=name, dtype=dtype, pass_name=pass_name, n=n, policy=label, us=seconds * 1e6,
                               tb_per_s=rate / 1e12, copy_fraction=rate / copy_rate, dense_us=dense_s * 1e6,
                               speedup=dense_s / seconds, path=described)
                    rows.append(row)
                    print(f"| {name} | {dtype} | {pass_name} | {n} | {label} | {seconds * 1e6:.1f} | {rate / 1e12:.2f} | "
                          f"{rate / copy_rate:.0%} | {dense_s * 1e6:.1f} | {dense_s / seconds:.2f}× | {described} |",
                          flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()

"""Small-batch passes as weight streams: each policy candidate's fprop and bprop time beside a copy of
the weight bytes and the dense product, in one run (issue 36, item 1).

Shapes: the sparse-wide LSTM's recurrent matrix (H 12288 -> 4H, block 32, a small-world layout tiled
over the four gates, 10 %, bfloat16) and workload D's forward (8192², block 32, random 10 %, float16).
Each candidate is a planner policy (``bsmm.backends.cuda.policy.planning``): today's, TMA mma.sync
whatever the weights' size (before ``tma_mma_max_stream_bytes``), columns cut into parts of 64 blocks,
TMA off. The first run (results/v24/) also tried 4 and 6 stages and parts of 16 and 32. Prints a Markdown table; ``--json`` writes the rows.

``--decode`` (issue 37): the benchmark decoder's MLP passes at decode (gate|up 2048 -> 16384 and down
8192 -> 2048, blocks 128 and 64, 10 % and 25 %, N 8, bfloat16), each call on the next of enough weight
copies to pass the L2 (a decoder reads each layer's weights from memory once a token), against
columns left whole (as before ``few_rows``) and cut into parts of 1, 2, 4 and 8 blocks.

    python tools/probes/probe_streaming.py [--decode] [--json out.json]
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


def graph_timed(runs, batches: int = 9) -> float:
    """Seconds a call of ``runs`` (called in turn), replayed from one CUDA graph: a decode pass takes
    less GPU time than CuPy's host takes to launch it, which back-to-back calls would time instead."""
    for run in runs:
        run()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for run in runs:
            run()
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    samples = []
    for _ in range(batches):
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(begin, end) / 1e3 / len(runs))
    return statistics.median(samples)


def torch_graph_timed(a, matrices, out, batches: int = 9) -> float:
    """Seconds of a @ matrix (each in turn) by PyTorch's cuBLAS, replayed from one CUDA graph (CuPy's
    cuBLAS calls cannot be captured)."""
    import torch  # lazily: only the decode rows' dense side needs it

    a, out = torch.from_dlpack(a), torch.from_dlpack(out)
    matrices = [torch.from_dlpack(m) for m in matrices]
    for m in matrices:
        torch.matmul(a, m, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for m in matrices:
            torch.matmul(a, m, out=out)
    graph.replay()
    samples = []
    for _ in range(batches):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) / 1e3 / len(matrices))
    return statistics.median(samples)


def decode_candidates():
    base = current_policy()
    yield "today", base
    yield "uncut (before few_rows)", base.replace(few_rows=0)
    for blocks in (1, 2, 4, 8):
        yield f"parts of {blocks}", base.replace(min_part_blocks=blocks, min_part_blocks_few_rows=blocks)


def decode_shapes():
    for block_size in (128, 64):
        for density in (0.1, 0.25):
            for name, c, k in (("gate|up 2048 -> 16384", 2048, 16384), ("down 8192 -> 2048", 8192, 2048)):
                yield (f"{name}, block {block_size}, {density:.0%}", random_layout(c // block_size, k // block_size,
                                                                                    density, seed=0),
                       "bfloat16", (8,), ("fprop",), block_size)


def shapes():
    blocks = 12288 // 32
    lstm = gate_layout(small_world_layout(blocks, round(0.1 * blocks * blocks), "barabasi_albert", 0), blocks)
    yield "LSTM Wh 12288 x 49152", lstm, "bfloat16", (8, 32, 64), ("fprop", "bprop"), 32
    yield "D 8192²", random_layout(256, 256, 0.1, seed=0), "float16", (8,), ("fprop",), 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--decode", action="store_true", help="the decoder's MLP passes at decode (issue 37)")
    args = parser.parse_args()
    # (at decode a layer's weights come from memory: enough copies, called in turn, to pass the L2's 60 MB)
    all_shapes, all_candidates, past_l2 = ((decode_shapes, decode_candidates, 160 << 20) if args.decode
                                           else (shapes, candidates, 0))
    rng = cupy.random.default_rng(0)
    rows = []
    print("| shape | dtype | pass | N | policy | µs | TB/s on weights | % of copy | dense µs | speed-up | path | "
          "max difference from today's, relative |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, layout, dtype, batches, passes, block_size in all_shapes():
        op = bsmm.BlocksparseMatMul(layout, block_size=block_size)
        w = rng.standard_normal(op.w_shape, dtype=cupy.float32).astype(dtype)
        weights = [w] + [w.copy() for _ in range(past_l2 // w.nbytes)]
        dense = rng.standard_normal((op.C, op.K), dtype=cupy.float32).astype(dtype)
        denses = [dense] + [dense.copy() for _ in range(past_l2 // dense.nbytes)]
        copied = max(w.nbytes, 4 * past_l2)
        source, target = cupy.empty(copied, cupy.uint8), cupy.empty(copied, cupy.uint8)
        copy_rate = 2 * copied / timed(lambda: target.__setitem__(Ellipsis, source))
        for n in batches:
            x = rng.standard_normal((n, op.C), dtype=cupy.float32).astype(dtype)
            dy = rng.standard_normal((n, op.K), dtype=cupy.float32).astype(dtype)
            for pass_name in passes:
                a, out = (x, cupy.empty((n, op.K), dtype)) if pass_name == "fprop" else (dy, cupy.empty((n, op.C), dtype))
                if args.decode:
                    dense_s = torch_graph_timed(a, denses, out)
                else:
                    dense_s = timed(lambda: cupy.matmul(a, dense if pass_name == "fprop" else dense.T, out=out))
                for label, policy in all_candidates():
                    # A new operator a candidate: an operator repeats the call it kept, whatever the policy.
                    fresh = bsmm.BlocksparseMatMul(layout, block_size=block_size)
                    with planning(policy):
                        method = getattr(fresh, pass_name)
                        if args.decode:
                            seconds = graph_timed([lambda v=v: method(a, v, out=out) for v in weights])
                        else:
                            seconds = timed(lambda: method(a, w, out=out))
                        result = method(a, w).astype(cupy.float32)
                    if label == "today":
                        expected = result
                    difference = float(cupy.abs(result - expected).max() / cupy.abs(expected).max())
                    plans = [plan for key, plan in plans_of(fresh.index).items()
                             if key[0] == pass_name and key[1] == n and policy in key]
                    described = plans[0].path.describe() if plans else "?"
                    rate = w.nbytes / seconds
                    row = dict(shape=name, dtype=dtype, pass_name=pass_name, n=n, policy=label, us=seconds * 1e6,
                               tb_per_s=rate / 1e12, copy_fraction=rate / copy_rate, dense_us=dense_s * 1e6,
                               speedup=dense_s / seconds, path=described, difference=difference)
                    rows.append(row)
                    print(f"| {name} | {dtype} | {pass_name} | {n} | {label} | {seconds * 1e6:.1f} | {rate / 1e12:.2f} | "
                          f"{rate / copy_rate:.0%} | {dense_s * 1e6:.1f} | {dense_s / seconds:.2f}× | {described} | "
                          f"{difference:.1e} |",
                          flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()

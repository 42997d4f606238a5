"""What a layout change costs (issue 38's cost target): ``bsmm.torch.dynamic.change_layout`` of a layer against
one training step of that layer, and whether a compiled step compiles again after the change.

    python3 tools/probes/probe_layout_change.py [--features 12288] [--density 0.1] [--block-size 32]
        [--rows 32,1024] [--moved 0.3]

For each ``--rows`` N, the layer's training step is a forward, a mean-square loss, a backward and an
Adam step (bf16 weights). It is timed by CUDA events, as a median after warm-up. A change moves
``--moved`` of the blocks to absent places:
- it is timed on the host clock around the call and the synchronize after it;
- so is the first step after it, which plans the new layout's passes (reported as what it adds to a step);
- the probe counts the graphs Dynamo makes for a ``torch.compile``'d step before and after two changes
  (the layer already computes under its moving key, as under ``DynamicSparsity``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np
import torch

import bsmm.torch
from bsmm.cli.framework_bench import gpu_time
from bsmm.layouts import random_layout
from bsmm.torch import dynamic


def moved_layout(layout: np.ndarray, fraction: float, rng) -> np.ndarray:
    moved = layout.copy()
    present, absent = np.argwhere(layout != 0), np.argwhere(layout == 0)
    count = min(round(fraction * len(present)), len(absent))
    moved[tuple(present[rng.choice(len(present), count, replace=False)].T)] = 0
    moved[tuple(absent[rng.choice(len(absent), count, replace=False)].T)] = 1
    return moved


def step_function(layer, optimizer, x):
    def step():
        optimizer.zero_grad(set_to_none=True)
        layer(x).float().square().mean().backward()
        optimizer.step()
    return step


def gpu_ms(run) -> float:
    """Median milliseconds of one ``run()`` (:func:`bsmm.cli.framework_bench.gpu_time`: CUDA events, warm-up
    first)."""
    return 1e3 * gpu_time(run, torch.cuda.synchronize, lambda: torch.cuda.Event(enable_timing=True),
                          lambda begin, end: begin.elapsed_time(end), calls=1, batches=20)


def wall_ms(run) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=12288)
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--rows", default="32,1024")
    parser.add_argument("--moved", type=float, default=0.3, help="fraction of the blocks a change moves")
    parser.add_argument("--profile", action="store_true", help="also a host profile of a change and the next step")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    blocks = args.features // args.block_size
    print(f"layer {args.features}², {args.density:.0%}, block {args.block_size}, bf16; a change moves "
          f"{args.moved:.0%} of the blocks\n")
    print("| N | training step ms | change_layout ms | the first step after it, more than a step, ms | "
          "(change + more) / step | compiled graphs before / after two changes |")
    print("| --- | --- | --- | --- | --- | --- |")
    profiles = []
    for n in (int(r) for r in args.rows.split(",")):
        torch.manual_seed(0)
        layer = bsmm.torch.BlockSparseLinear(args.features, args.features,
                                             random_layout(blocks, blocks, args.density, seed=0), args.block_size,
                                             device="cuda", dtype=torch.bfloat16)
        optimizer = torch.optim.Adam(layer.parameters(), lr=1e-4)
        x = torch.randn(n, args.features, device="cuda", dtype=torch.bfloat16)
        step = step_function(layer, optimizer, x)
        step_ms = gpu_ms(step)
        changes, firsts = [], []
        for _ in range(3):
            layout = moved_layout(layer.op.layout, args.moved, rng)  # (drawn outside the timed call)
            changes.append(wall_ms(lambda: dynamic.change_layout(layer, layout, optimizer)))
            firsts.append(wall_ms(step) - step_ms)  # what planning the new layout's passes adds to a step
        first = statistics.median(firsts)
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        compiled = torch.compile(layer)

        def compiled_step():
            optimizer.zero_grad(set_to_none=True)
            compiled(x).float().square().mean().backward()
            optimizer.step()

        compiled_step()
        before = counters["stats"]["unique_graphs"]
        for _ in range(2):
            dynamic.change_layout(layer, moved_layout(layer.op.layout, args.moved, rng), optimizer)
            compiled_step()
        after = counters["stats"]["unique_graphs"]
        change_ms = statistics.median(changes)
        if args.profile:
            profiles.append((n, host_profile(lambda: dynamic.change_layout(
                layer, moved_layout(layer.op.layout, args.moved, rng), optimizer), step)))
        print(f"| {n} | {step_ms:.3f} | {change_ms:.2f} | {first:.2f} | {(change_ms + first) / step_ms:.1f}× | "
              f"{before} / {after} |", flush=True)
    for n, text in profiles:
        print(f"\nHost profile at N {n}: one change (its layout drawn inside) and the first step after it, "
              f"by own time\n\n```\n{text}```")
    return 0


def host_profile(change, step, lines: int = 14) -> str:
    """cProfile of ``change()`` then ``step()``, synchronized, the functions of most own time."""
    profile = cProfile.Profile()
    torch.cuda.synchronize()
    profile.enable()
    change()
    step()
    torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(lines)
    return text.getvalue().split("\n", 4)[-1]


if __name__ == "__main__":
    raise SystemExit(main())

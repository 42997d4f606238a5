"""One training step (and one forward under no_grad) of bsmm.torch.BlockSparseLSTM under the torch
profiler: kernels by GPU time, how many, and the step's GPU time (issue 36's profile).

    python tools/probes/profile_lstm.py [--hidden 12288] [--density 0.1] [--batch 32] [--steps 32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import collections

import torch

import bsmm.torch


def cuda_kernels(run) -> list[tuple[str, float]]:
    """(kernel name, µs) of each CUDA kernel of one ``run`` after three warm-up runs (also
    tools/probes/profile_transformer.py's)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        run()
        torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def short_name(name: str) -> str:
    """A kernel's name without its template arguments past the first."""
    return name.split("<")[0][:60] + (" " + name.split("<")[1].split(",")[0] if "<" in name else "")


def tally(kernels: list[tuple[str, float]], key=short_name) -> dict[str, list]:
    """key(kernel name) -> [count, total µs]."""
    table = collections.defaultdict(lambda: [0, 0.0])
    for name, time in kernels:
        table[key(name)][0] += 1
        table[key(name)][1] += time
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=12288)
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    lstm = bsmm.torch.BlockSparseLSTM(args.hidden, args.hidden, block_size=32, density=args.density, seed=0,
                                      input_layout="recurrent", device="cuda", dtype=dtype)
    x = torch.randn(args.steps, args.batch, args.hidden, device="cuda", dtype=dtype, requires_grad=True)
    d_out = torch.randn(args.steps, args.batch, args.hidden, device="cuda", dtype=dtype)

    def train():
        for p in lstm.parameters():
            p.grad = None
        lstm(x)[0].backward(d_out)

    def forward():
        with torch.no_grad():
            lstm(x)

    for name, run in (("train", train), ("forward", forward)):
        kernels = cuda_kernels(run)
        table = tally(kernels)
        total = sum(t for _, t in table.values())
        print(f"\n{name}: H {args.hidden}, {args.density:.0%}, N {args.batch}, T {args.steps}, {args.dtype}: "
              f"{len(kernels)} kernels, {total / 1e3:.3f} ms of kernel time")
        print("| kernel | count | total µs | µs each |")
        print("| --- | --- | --- | --- |")
        for short, (count, time) in sorted(table.items(), key=lambda item: -item[1][1])[:14]:
            print(f"| {short} | {count} | {time:.0f} | {time / count:.1f} |")


if __name__ == "__main__":
    main()

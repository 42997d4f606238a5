"""Randomized sweep of ``bsmm.torch.BlockSparseLSTM`` on CUDA against the same layer in float64 on the CPU.

Each case draws a block size (8 to 64), hidden and input sizes (the input on the recurrent layout, a
layout of its own or dense), a layout (small-world, random, skewed with empty and full block columns),
N (1 to 70), T (1 to 9), a dtype (float32, float16, bfloat16), batch_first, the biases and which inputs
need gradients. The CUDA layer runs the case three times: launched (call 1, which keeps the passes'
calls), captured into the layer's CUDA graphs (call 2) and replayed (call 3). Checked: call 3's outputs
and gradients equal call 1's bit for bit, and call 1's are within ``bsmm.dtypes.TOLERANCES`` (norm-wise
relative error) of the float64 CPU layer's, fed the same rounded weights and inputs (the CPU backend
is itself checked against independent float64 references in the test suite).

    PYTHONPATH=$PWD python tools/gpu/lstm_sweep.py [--seed S] [--cases 60] [--budget 120]
"""

from __future__ import annotations

import argparse
import copy
import secrets
import time

import numpy as np
import torch

import bsmm.torch as bt
from bsmm.dtypes import TOLERANCES
from bsmm.layouts import random_layout
from bsmm.layouts.small_world import small_world_layout

DEVICE = "cuda"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def draw(rng: np.random.Generator) -> dict:
    bs = int(rng.choice([8, 16, 32, 64]))
    hidden_blocks = int(rng.integers(1, 9))
    input_kind = str(rng.choice(["recurrent", "own", "dense"]))
    input_blocks = hidden_blocks if input_kind == "recurrent" else int(rng.integers(1, 6))
    layout_kind = str(rng.choice(["small_world", "random", "skewed"]))
    density = float(rng.uniform(0.15, 0.9))
    layout = None
    if layout_kind == "small_world" and hidden_blocks >= 3:
        try:
            layout = small_world_layout(hidden_blocks, max(hidden_blocks, round(density * hidden_blocks ** 2)),
                                        seed=int(rng.integers(1 << 30)))
        except ValueError:  # too few blocks for the graph: a random layout instead
            layout_kind = "random"
    if layout is None:
        layout = random_layout(hidden_blocks, hidden_blocks, density, seed=int(rng.integers(1 << 30)))
        if layout_kind == "skewed":
            layout[:, rng.integers(hidden_blocks)] = 1
            layout[:, rng.integers(hidden_blocks)] = 0
    own = random_layout(input_blocks, 4 * hidden_blocks, density, seed=int(rng.integers(1 << 30)))
    return dict(bs=bs, hidden=hidden_blocks * bs, input=input_blocks * bs if input_kind != "dense" else int(rng.integers(1, 70)),
                input_kind=input_kind, layout=layout, input_layout={"recurrent": "recurrent", "own": own, "dense": None}[input_kind],
                n=int(rng.integers(1, 71)), steps=int(rng.integers(1, 10)), dtype=str(rng.choice(list(DTYPES))),
                batch_first=bool(rng.integers(2)), bias=bool(rng.integers(4)), needs_x=bool(rng.integers(2)),
                needs_state=bool(rng.integers(2)), layout_kind=layout_kind, seed=int(rng.integers(1 << 30)))


def describe(case: dict) -> str:
    return (f"bs {case['bs']} H {case['hidden']} I {case['input']} ({case['input_kind']}) {case['layout_kind']} "
            f"N {case['n']} T {case['steps']} {case['dtype']} batch_first={case['batch_first']} bias={case['bias']} "
            f"dx={case['needs_x']} dstate={case['needs_state']}")


def run(lstm, x, h0, c0, d_out, d_h, d_c, case) -> list[torch.Tensor]:
    for p in lstm.parameters():
        p.grad = None
    x = x.clone().requires_grad_(case["needs_x"])
    h0, c0 = (s.clone().requires_grad_(case["needs_state"]) for s in (h0, c0))
    output, (h_n, c_n) = lstm(x, (h0, c0))
    torch.autograd.backward([output, h_n, c_n], [d_out, d_h, d_c])
    grads = [t.grad for t in (x, h0, c0) if t.requires_grad] + [p.grad for p in lstm.parameters()]
    return [output.detach(), h_n.detach(), c_n.detach(), *grads]


def check(case: dict) -> tuple[float, str]:
    """(worst relative error against float64, "" or what failed)."""
    dtype = DTYPES[case["dtype"]]
    torch.manual_seed(case["seed"])
    cpu = bt.BlockSparseLSTM(case["input"], case["hidden"], case["layout"], case["bs"], bias=case["bias"],
                             batch_first=case["batch_first"], input_layout=case["input_layout"], dtype=torch.float64)
    with torch.no_grad():
        for p in cpu.parameters():
            p.copy_(p.to(dtype).double())  # the weights both sides multiply with
    gpu = copy.deepcopy(cpu).to(DEVICE, dtype)
    t, n = case["steps"], case["n"]
    shape = (n, t, case["input"]) if case["batch_first"] else (t, n, case["input"])
    out_shape = (n, t, case["hidden"]) if case["batch_first"] else (t, n, case["hidden"])
    data = [torch.randn(shape, dtype=torch.float64).to(dtype).double(),
            *(torch.randn(1, n, case["hidden"], dtype=torch.float64).to(dtype).double() for _ in range(2)),
            torch.randn(out_shape, dtype=torch.float64), *(torch.randn(1, n, case["hidden"], dtype=torch.float64)
                                                             for _ in range(2))]
    expected = run(cpu, *data, case)
    on_gpu = [d.to(DEVICE, dtype) for d in data]
    calls = [run(gpu, *on_gpu, case) for _ in range(3)]
    for index, (a, b) in enumerate(zip(calls[0], calls[2])):
        if not torch.equal(a, b):
            return float("nan"), f"replayed call differs from the launched one in result {index}"
    worst = 0.0
    for index, (actual, reference) in enumerate(zip(calls[0], expected)):
        error = float((actual.double().cpu() - reference).norm() / max(reference.norm(), 1e-300))
        worst = max(worst, error)
        if not error <= TOLERANCES[case["dtype"]]:
            return error, f"result {index} off by {error:.3g}"
    return worst, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--cases", type=int, default=60)
    parser.add_argument("--budget", type=float, default=120.0)
    args = parser.parse_args()
    seed = secrets.randbits(32) if args.seed is None else args.seed
    rng = np.random.default_rng(seed)
    start, failures, worst, ran = time.perf_counter(), 0, {}, 0
    for number in range(args.cases):
        if time.perf_counter() - start > args.budget:
            break
        case = draw(rng)
        error, problem = check(case)
        ran += 1
        worst[case["dtype"]] = max(worst.get(case["dtype"], 0.0), error if error == error else float("inf"))
        if problem:
            failures += 1
            print(f"FAIL case {number}: {describe(case)}: {problem}", flush=True)
    summary = ", ".join(f"{name} {value:.2g}" for name, value in sorted(worst.items()))
    print(f"lstm sweep, seed {seed}: {ran} cases, {failures} failures, {time.perf_counter() - start:.0f} s; "
          f"worst relative error {summary}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

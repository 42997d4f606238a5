"""Gates in the kernels (issue 38, item 1): what skipping closed blocks saves, pass by pass and for a
gated layer's training step, at the issue's layer (12288², 10 % of blocks of 32, bf16) and a decoder MLP
projection, with a fraction of the gates closed.

    python3 tools/probes/probe_gates.py [--rows 32 4096] [--profile]

Pass rows: each of fprop, bprop and updat on weights already scaled by the gates, with the gates passed
to the kernel (``skip``: bsmm/matmul.py's private ``_skip``, the path every gated call takes) and without
(``all``: every block multiplied, as before the kernels read gates), and the elementwise scale g ⊙ W that
a gated call adds. Step rows: a ``BlockSparseLinear`` with gates (forward, backward; the gates clamped
from a fixed raw tensor, whose closed gates take no gradient, as hard-concrete ones) against the same
layer without gates, eagerly and, at the smallest batch, compiled (``--profile``: a host profile of 200 gated steps of the first layer at the first
batch, half its gates closed). CUDA events on PyTorch's default stream, which CuPy's calls share (the legacy default stream), median of
20 after a warm-up (:func:`probe_layout_change.gpu_ms`).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import bsmm
import bsmm.torch as bt
from bsmm.layouts import random_layout
from probe_layout_change import gpu_ms  # (this directory: run as a script)

# (what, C, K, block size, density)
LAYERS = [("wide layer 12288², 10 %", 12288, 12288, 32, 0.1), ("decoder MLP 4096→16384, 10 %", 4096, 16384, 128, 0.1)]
CLOSED = (0.0, 0.5, 0.9)


class _Clamped(torch.nn.Module):
    """Gates clamped to [0, 1] from a fixed raw tensor (a hard-concrete gate's shape, without the noise)."""

    closed_gradient_is_zero = True

    def __init__(self, raw: torch.Tensor):
        super().__init__()
        self.raw = torch.nn.Parameter(raw)

    def forward(self) -> torch.Tensor:
        return self.raw.clamp(0, 1)


def _gates(blocks: int, closed: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.where(rng.random(blocks) < closed, 0.0, rng.uniform(0.5, 1.0, blocks))


def pass_rows(what: str, c: int, k: int, bs: int, density: float, n: int) -> None:
    import cupy

    op = bsmm.BlocksparseMatMul(random_layout(c // bs, k // bs, density, seed=1), block_size=bs)
    dtype = bsmm.SUPPORTED_DTYPES["bfloat16"]
    rng = np.random.default_rng(n)
    x = cupy.asarray(rng.standard_normal((n, c)).astype(dtype))
    dy = cupy.asarray(rng.standard_normal((n, k)).astype(dtype))
    w = cupy.asarray(rng.standard_normal(op.w_shape).astype(dtype))
    for closed in CLOSED:
        gate = cupy.asarray(_gates(op.blocks, closed, 2).astype(dtype))
        gated = op.gated_weights(w, gate)
        times = {}
        for name, call in (("fprop", lambda s: op.fprop(x, gated, _skip=s)), ("bprop", lambda s: op.bprop(dy, gated, _skip=s)),
                           ("updat", lambda s: op.updat(x, dy, _skip=s))):
            times[name] = (gpu_ms(lambda: call(gate)), gpu_ms(lambda: call(None)))
        scale = gpu_ms(lambda: op.gated_weights(w, gate))
        cells = " | ".join(f"{skip:.3f} / {every:.3f}" for skip, every in times.values())
        print(f"| {what} | {n} | {closed:.0%} | {cells} | {scale:.3f} |", flush=True)


def step_rows(what: str, c: int, k: int, bs: int, density: float, n: int, compiled: bool = False) -> None:
    """The table's rows of one layer and batch; ``compiled``: the steps of ``torch.compile``'d layers
    (a fresh compile for the gated layer, at 90 % closed only)."""
    torch.manual_seed(0)
    layer = bt.BlockSparseLinear(c, k, density=density, block_size=bs, seed=1, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(n, c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    run = torch.compile(layer) if compiled else layer

    def step():
        layer.weight.grad = None
        run(x).backward(dy)

    plain = gpu_ms(step)
    for closed in CLOSED[-1:] if compiled else CLOSED:
        raw = torch.tensor(_gates(layer.op.blocks, closed, 2), device="cuda", dtype=torch.float32)
        raw[raw == 0] = -1.0  # closed: clamped to 0
        layer.gates = _Clamped(raw)
        if compiled:
            torch._dynamo.reset()
            run = torch.compile(layer)
        gated = gpu_ms(step)
        how = ", compiled" if compiled else ""
        print(f"| {what}{how} | {n} | {closed:.0%} | {gated:.3f} | {plain:.3f} | {plain / gated:.2f}× |", flush=True)
    layer.gates = None


def profile(what: str, c: int, k: int, bs: int, density: float, n: int) -> int:
    import cProfile
    import pstats

    layer = bt.BlockSparseLinear(c, k, density=density, block_size=bs, seed=1, device="cuda", dtype=torch.bfloat16)
    raw = torch.tensor(_gates(layer.op.blocks, 0.5, 2), device="cuda", dtype=torch.float32)
    raw[raw == 0] = -1.0
    layer.gates = _Clamped(raw)
    x = torch.randn(n, c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        layer(x).backward(dy)
    torch.cuda.synchronize()
    with cProfile.Profile() as profiler:
        for _ in range(200):
            layer(x).backward(dy)
        torch.cuda.synchronize()
    print(f"{what}, N {n}, half the gates closed: 200 eager steps")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 4096])
    parser.add_argument("--profile", action="store_true", help="a host profile of gated steps")
    args = parser.parse_args(argv)
    if args.profile:
        return profile(*LAYERS[0], args.rows[0])
    tables = [("Passes, ms, with the gates passed (skip) / every block multiplied (all); scale: g ⊙ W",
               ("layer", "N", "closed", "fprop", "bprop", "updat", "scale"), pass_rows),
              ("A gated layer's forward + backward, ms, against the same layer without gates",
               ("layer", "N", "closed", "gated step", "ungated step", "ungated / gated"), step_rows)]
    for number, (title, columns, rows) in enumerate(tables):
        print(("\n" if number else "") + title)
        print("| " + " | ".join(columns) + " |")
        print("|" + " --- |" * len(columns))
        for shape in LAYERS:
            for n in args.rows:
                rows(*shape, n)
    for shape in LAYERS:  # (host-bound eagerly: what torch.compile makes of the gates' element-wise work)
        step_rows(*shape, min(args.rows), compiled=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

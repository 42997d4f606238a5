"""Where does the host time of a PyTorch BlockSparseLinear call go? cProfile over back-to-back
forward calls and training steps at the seed's shape (N 32, 12288 features, block 32, bf16, 10 %).

    python tools/profile_torch_host.py [--steps]
"""
import cProfile
import pstats
import sys
import time

import torch

import bsmm.torch
from bsmm import torch_ops

layout = bsmm.layouts.random_layout(384, 384, density=0.1, seed=0)
layer = bsmm.torch.BlockSparseLinear(12288, 12288, layout, block_size=32, bias=False, device="cuda",
                                     dtype=torch.bfloat16)
x = torch.randn(32, 12288, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(32, 12288, device="cuda", dtype=torch.bfloat16)


def step():
    layer.weight.grad = x.grad = None
    layer(x).backward(g)


for _ in range(5):
    step()
torch.cuda.synchronize()
op = layer.op if hasattr(layer, "op") else None
kept = torch_ops._matmul_operator(layer._key, 1, False)._gpu_calls
print("kept calls:", [k[:2] for k in kept])
fast = {"hit": 0, "miss": 0}
original = torch_ops._repeat_on_cuda


def counted(*args):
    out = original(*args)
    fast["hit" if out is not None else "miss"] += 1
    return out


torch_ops._repeat_on_cuda = counted
for label, fn in (("forward", lambda: layer(x)), ("step", step)):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(300):
        fn()
    host = (time.perf_counter() - start) / 300
    torch.cuda.synchronize()
    print(f"{label}: {host * 1e6:.1f} us host per call; repeat path {fast}")
profile = cProfile.Profile()
profile.enable()
for _ in range(300):
    step() if "--steps" in sys.argv else layer(x)
profile.disable()
torch.cuda.synchronize()
pstats.Stats(profile).sort_stats("tottime").print_stats(25)

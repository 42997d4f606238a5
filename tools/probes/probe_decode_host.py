"""Host time of one eager decode step of the benchmark decoder (``bsmm bench --model transformer``'s
"decode eager" row), dense against MLP-sparse, and the sparse one with its gated unit as PyTorch's
operators or with long parts only, to find what an eager step pays; a cProfile of the sparse step.

    python tools/probes/probe_decode_host.py
"""

from __future__ import annotations

import copy
import cProfile
import pstats
import time

import torch

import bsmm.torch
from bsmm.backends.cuda.policy import current_policy, planning
from bsmm.cli.transformer_bench import Decoder, DecoderConfig
from bsmm.torch.eager import TORCH_ACTIVATIONS
from bsmm.torch.mlp import BlockSparseMLP


def step_time(model, config, steps: int = 30) -> float:
    caches = model.caches(config.batch, config.prompt + steps + 8)
    token = torch.zeros(config.batch, 1, dtype=torch.long, device="cuda")
    position = torch.zeros(1, dtype=torch.long, device="cuda")
    with torch.no_grad():
        for p in range(5):
            position.fill_(p)
            model.step(token, position, caches)
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for p in range(steps):
            position.fill_(p)
            model.step(token, position, caches)
        torch.cuda.synchronize()
    return (time.perf_counter() - begin) / steps


def main() -> None:
    config = DecoderConfig()
    torch.manual_seed(0)
    dense = Decoder(config).to(device="cuda", dtype=torch.bfloat16)
    sparse = bsmm.torch.sparsify(copy.deepcopy(dense), 0.1, 128, include="*mlp*", fuse_mlp=True)
    print(f"dense: {step_time(dense, config) * 1e3:.2f} ms a step")
    print(f"sparse: {step_time(sparse, config) * 1e3:.2f} ms a step")
    fused = BlockSparseMLP.forward

    def unfused(self, x):
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(TORCH_ACTIVATIONS[self.activation](gate) * up)

    BlockSparseMLP.forward = unfused
    print(f"sparse, gated unit as PyTorch's operators: {step_time(sparse, config) * 1e3:.2f} ms a step")
    BlockSparseMLP.forward = fused
    long_parts = copy.deepcopy(dense)
    with planning(current_policy().replace(min_part_blocks_few_rows=32)):
        long_parts = bsmm.torch.sparsify(long_parts, 0.1, 128, include="*mlp*", fuse_mlp=True)
        print(f"sparse, long parts only: {step_time(long_parts, config) * 1e3:.2f} ms a step")
    profile = cProfile.Profile()
    profile.enable()
    step_time(sparse, config, steps=10)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()

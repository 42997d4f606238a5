"""Where the benchmark decoder's time goes, kernel by kernel (issue 37's profile): the dense decoder of
``bsmm bench --model transformer`` and its copy with block-sparse MLPs, each measure under the torch
profiler, kernels grouped (bsmm passes, dense GEMMs, attention, Inductor's fused kernels, element-wise,
reductions, the optimizer), with the bsmm passes' rate against the MLPs' useful multiply-adds.

    python tools/probes/profile_transformer.py [--density 0.1] [--block-size 128] [--no-compiled] [--json F]
"""

from __future__ import annotations

import argparse
import copy
import json
import re

import torch
import torch.nn.functional as F

import bsmm.torch
from bsmm.cli.transformer_bench import Decoder, DecoderConfig
from profile_lstm import cuda_kernels, tally  # (this directory: run as a script)

#: Kernel groups, the first whose pattern the kernel's name matches (case-insensitive).
GROUPS = (("bsmm passes", r"bsmm_matmul"), ("bsmm gated unit", r"gated_unit"),
          ("dense GEMM", r"gemm|nvjet|xmma|cutlass|sm90_|sm80_"), ("attention", r"flash|fmha|attention|sdpa|efficient"), ("Inductor (fused)", r"triton"),
          ("optimizer", r"multi_tensor|foreach|adam"), ("reductions", r"reduce|softmax|nll|argmax"),
          ("element-wise and copies", r"elementwise|copy|cat|index|fill|memset|memcpy"))


def group_of(name: str) -> str:
    return next((group for group, pattern in GROUPS if re.search(pattern, name, re.I)), "other")


def mlp_flops(config: DecoderConfig, tokens: int, density: float) -> float:
    """The MLPs' useful floating-point operations of one forward over ``tokens`` tokens at ``density``."""
    return 2.0 * tokens * 3 * config.d_model * config.d_hidden * config.layers * density


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--no-compiled", action="store_true", help="leave out the compiled training step")
    parser.add_argument("--json", help="also write the kernels of each measure here")
    args = parser.parse_args()
    config = DecoderConfig()
    torch.manual_seed(0)
    dense = Decoder(config).to(device="cuda", dtype=torch.bfloat16)
    sparse = bsmm.torch.sparsify(copy.deepcopy(dense), args.density, args.block_size, include="*mlp*", fuse_mlp=True)
    tokens = torch.randint(config.vocab, (config.batch, config.sequence + 1), device="cuda")
    n_tokens = config.batch * config.sequence
    found = {}
    for model_name, model in (("dense", dense), (f"bsmm {args.density:.0%}, block {args.block_size}", sparse)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def train(forward=model):
            loss = F.cross_entropy(forward(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def prefill():
            with torch.no_grad():
                model(tokens[:, :-1])

        caches = model.caches(config.batch, config.prompt + 1)
        position = torch.full((1,), config.prompt, dtype=torch.long, device="cuda")

        def decode_step():
            with torch.no_grad():
                model.step(tokens[:, :1], position, caches)

        measures = {"train eager": (train, 3 * n_tokens), "prefill": (prefill, n_tokens),
                    "decode step (one token)": (decode_step, config.batch)}
        if not args.no_compiled:
            torch._dynamo.reset()
            compiled = torch.compile(model)
            measures["train compiled"] = (lambda: train(compiled), 3 * n_tokens)
        for measure, (run, flop_tokens) in measures.items():
            kernels = cuda_kernels(run)
            found[f"{model_name} | {measure}"] = kernels
            total = sum(t for _, t in kernels)
            by_group = tally(kernels, group_of)
            print(f"\n### {model_name}, {measure}: {len(kernels)} kernels, {total / 1e3:.3f} ms of kernel time")
            print("| group | kernels | ms | share |\n| --- | --- | --- | --- |")
            for group, (count, time) in sorted(by_group.items(), key=lambda item: -item[1][1]):
                print(f"| {group} | {count} | {time / 1e3:.3f} | {time / total:.0%} |")
            if "bsmm passes" in by_group:
                seconds = by_group["bsmm passes"][1] / 1e6
                rate = mlp_flops(config, flop_tokens, args.density) / seconds / 1e12
                print(f"bsmm passes: {rate:.0f} TFLOP/s of useful MLP work ({rate / 790:.0%} of dense bf16 peak, "
                      f"~790)")
            print("\n| kernel | count | ms | µs each |\n| --- | --- | --- | --- |")
            for name, (count, time) in sorted(tally(kernels).items(), key=lambda item: -item[1][1])[:10]:
                print(f"| {name} | {count} | {time / 1e3:.3f} | {time / count:.1f} |")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(found, file)


if __name__ == "__main__":
    main()

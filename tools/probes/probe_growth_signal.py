"""The growth signal's two routes (issue 38, item 2): ``bsmm.torch.dynamic.gradient_block_norms`` by dense
products a few block rows at a time (``route="dense"``) against the Gram route (``"gram"``: each block's
squared norm from the N × N Gram matrices of its columns of x and dy, no block of dW formed), at the shapes
RigL meets: a wide layer at small and large batches, the decoder's MLP projections, the LSTM's recurrent
weights over a sequence's rows.

    python3 tools/probes/probe_growth_signal.py [--gram-max-gib 8]

Each route is timed by CUDA events (median of 20 after a warm-up) on bf16 rows (the product runs in
float32, as RigL's capture holds them). The table gives both times, the faster, what ``route="auto"`` picks
and the largest relative difference between the two routes' norms.
"""

from __future__ import annotations

import argparse

import torch

from bsmm.torch import dynamic
from probe_layout_change import gpu_ms  # (this directory: run as a script)

# (what, C, K, block size, rows)
SHAPES = [("wide layer 12288²", 12288, 12288, 32, n) for n in (32, 256, 1024, 4096)]
SHAPES += [("wide layer 12288², block 128", 12288, 12288, 128, n) for n in (1024, 8192)]
SHAPES += [("decoder MLP 512→2048", 512, 2048, bs, 8192) for bs in (32, 128)]
SHAPES += [("decoder MLP 2048→512", 2048, 512, 128, 8192)]
SHAPES += [("LSTM Wh 2048→8192, T·N rows", 2048, 8192, 32, 2048)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gram-max-gib", type=float, default=8.0, help="skip the Gram route above this memory")
    args = parser.parse_args(argv)
    print("| shape | bs | N | dense ms | gram ms | faster | auto picks | largest relative difference |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for what, c, k, bs, n in SHAPES:
        generator = torch.Generator("cuda").manual_seed(n)
        x = torch.randn(n, c, device="cuda", generator=generator).to(torch.bfloat16)
        dy = torch.randn(n, k, device="cuda", generator=generator).to(torch.bfloat16)
        dense_ms = gpu_ms(lambda: dynamic.gradient_block_norms(x, dy, bs, route="dense"))
        auto = "gram" if dynamic._gram_is_cheaper(n, c, k, bs, "l2", None) else "dense"
        gram_gib = 8 * n * n * (c + k) / bs / 2**30  # (float64 Gram matrices)
        if gram_gib > args.gram_max_gib:
            print(f"| {what} | {bs} | {n} | {dense_ms:.3f} | (needs {gram_gib:.0f} GiB) | dense | {auto} | |",
                  flush=True)
            continue
        gram_ms = gpu_ms(lambda: dynamic.gradient_block_norms(x, dy, bs, route="gram"))
        dense = dynamic.gradient_block_norms(x, dy, bs, route="dense")
        gram = dynamic.gradient_block_norms(x, dy, bs, route="gram")
        difference = float(((gram - dense).abs() / dense.clamp(min=1e-30)).max())
        faster = "gram" if gram_ms < dense_ms else "dense"
        print(f"| {what} | {bs} | {n} | {dense_ms:.3f} | {gram_ms:.3f} | {faster} | {auto} | {difference:.1e} |",
              flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

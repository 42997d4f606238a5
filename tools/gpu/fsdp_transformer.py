"""The benchmark's decoder, dense and with its MLPs sparsified, trained under FSDP2 on 1 and 2 GPUs.

    python3 tools/gpu/fsdp_transformer.py [--world 1,2] [--steps 12] [--layers 8] [--json rows.json] [--profile PREFIX]
    python3 tools/gpu/fsdp_transformer.py --device cpu --small --steps 4    # processes on the CPU, gloo (a test)

The decoder is ``bsmm bench --model transformer``'s (d 2048, MLP 8192 SwiGLU, 8 layers, vocab
32000). The sparse copy is made by ``bsmm.torch.sparsify(..., include="*mlp*", fuse_mlp=True)`` at
10 %, block 128 (each MLP a ``BlockSparseMLP``). Each transformer block and then the model are wrapped in
``fully_shard`` with float32 masters, bf16 parameters in the step and float32 gradient
reduction. The run is AdamW on a global batch of 8 × 1024 tokens, split over the ranks, cycling
through four fixed batches.

Each world size reports:
- the loss of every step, the mean over the whole global batch;
- the median step time, the slowest rank's, with CUDA events, the first two steps excluded;
- tokens a second.

Every world size starts from the same weights and sees the same tokens, so the loss curves of
1 and 2 GPUs should agree within bf16 rounding (the gradients are summed in another order). NCCL's
NVLink multicast stays off, as the lent machines require.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import bsmm.torch  # noqa: E402
from bsmm.cli.transformer_bench import Decoder, DecoderConfig, _WallEvent  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from multi_gpu import run_worlds  # noqa: E402  (the spawning of one process a rank, world by world)

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
DENSITY, BLOCK, GLOBAL_BATCH, BATCHES = 0.10, 128, 8, 4
MODELS = ("dense", "bsmm")
#: ``--small``: a decoder the CPU trains in seconds (the test's), at 25 %, block 64.
SMALL = dict(d_model=256, d_hidden=1024, layers=2, heads=4, vocab=512, sequence=64, prompt=8, new_tokens=4)


def _model(kind: str, config: DecoderConfig, device: str) -> tuple[torch.nn.Module, str]:
    """The decoder in float32 on this rank's device, the same weights on every rank (seeded), and its name."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Decoder(config)
    if kind == "dense":
        return model, kind
    density, block = (0.25, 64) if config.d_model == SMALL["d_model"] else (DENSITY, BLOCK)
    model = bsmm.torch.sparsify(model, density, block, include="*mlp*", fuse_mlp=True)
    fused = sum(isinstance(m, bsmm.torch.BlockSparseMLP) for m in model.modules())
    if fused != config.layers:
        raise RuntimeError(f"sparsify fused {fused} MLPs of {config.layers}")
    return model, f"bsmm {density:.0%}, block {block}"


def _train(kind: str, config: DecoderConfig, rank: int, world: int, steps: int, device: str,
           profile: str | None = None) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cuda = device == "cuda"
    model, name = _model(kind, config, device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    generator = torch.Generator(device).manual_seed(1)
    data = torch.randint(config.vocab, (BATCHES, GLOBAL_BATCH, config.sequence + 1), device=device,
                         generator=generator)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    losses, times = [], []
    profiler = None
    for step in range(steps):
        if profile and step == steps - 2:  # the last two steps, on rank 0
            activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * cuda
            profiler = torch.profiler.profile(activities=activities)
            profiler.__enter__()
        tokens = data[step % BATCHES, rows]
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else \
            (_WallEvent(), _WallEvent())
        dist.barrier()
        start.record()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        total = loss.detach().clone()
        dist.all_reduce(total)  # each rank's mean over an equal share of the tokens
        losses.append(float(total) / world)
    if profiler is not None:
        profiler.__exit__(None, None, None)
        averages = profiler.key_averages()
        with open(profile, "w") as file:
            file.write(f"{name}, {world} GPU(s), rank {rank}: the last two steps "
                       f"({times[-2]:.1f}, {times[-1]:.1f} ms)\n\n")
            if cuda:
                file.write(averages.table(sort_by="self_cuda_time_total", row_limit=30) + "\n\n")
            file.write(averages.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
    median = torch.tensor(statistics.median(times[2:]), device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    ms = float(median)
    memory = torch.tensor(torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"), device=device)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return {"model": name, "kind": kind, "world": world, "ms": ms,
            "tokens_per_s": GLOBAL_BATCH * config.sequence / ms * 1e3,
            "losses": losses, "peak_gib": float(memory)}


def _rank_main(rank: int, world: int, port: int, out: str, steps: int, layers: int, profile: str | None,
               device: str, small: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        torch.set_num_threads(1)  # the ranks share the CPU's cores
        dist.init_process_group("gloo", rank=rank, world_size=world)
    config = DecoderConfig(**(SMALL | {"layers": layers} if small else {"layers": layers}))
    rows = [_train(kind, config, rank, world, steps, device,
                   f"{profile}_{MODELS.index(kind)}_{world}.txt" if profile and rank == 0 else None) for kind in MODELS]
    if rank == 0:
        with open(out, "w") as file:
            json.dump(rows, file)
    dist.destroy_process_group()


def table(rows: list) -> str:
    """Markdown: a row per model and world size, its speed, its scaling, and its losses against 1 GPU."""
    one = {r["model"]: r for r in rows if r["world"] == 1}
    lines = ["| model | GPUs | ms a step | tokens/s | scaling | first loss | last loss | largest loss difference "
             "from 1 GPU, relative | peak GiB a GPU |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        base = one.get(r["model"])
        scaling = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}×" if base else "—"
        difference = (f"{max(abs(a - b) / abs(b) for a, b in zip(r['losses'], base['losses'])):.1e}"
                      if base and r is not base else "—")
        lines.append(f"| {r['model']} | {r['world']} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {scaling} | "
                     f"{r['losses'][0]:.4f} | {r['losses'][-1]:.4f} | {difference} | {r['peak_gib']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", default="1,2", help="GPU counts to run, comma-separated (default 1,2)")
    parser.add_argument("--steps", type=int, default=12, help="training steps a run (default 12; the first 2 untimed)")
    parser.add_argument("--layers", type=int, default=None, help="decoder blocks (default 8; --small 2)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: a process a GPU over NCCL; cpu: processes over gloo")
    parser.add_argument("--small", action="store_true", help="a d 256 decoder at 25 %%, block 64 (the CPU test's)")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--profile", metavar="PREFIX",
                        help="torch.profiler tables of rank 0's last two steps, to PREFIX_<model>_<world>.txt")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps must be at least 3 (two are warm-up); got {args.steps}")
    layers = args.layers or (SMALL["layers"] if args.small else 8)
    worlds = [int(w) for w in args.world.split(",")]
    gpus = torch.cuda.device_count() if args.device == "cuda" else max(worlds)
    rows = run_worlds(_rank_main, args.world, gpus, (args.steps, layers, args.profile, args.device, args.small))
    rows.sort(key=lambda r: (MODELS.index(r["kind"]), r["world"]))
    if args.json:
        with open(args.json, "w") as file:
            device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
            json.dump({"gpu": device, "gpus": gpus, "torch": torch.__version__, "rows": rows},
                      file, indent=1)
    print(table(rows))
    for r in rows:
        print(f"{r['model']}, {r['world']} GPU(s), losses: " + " ".join(f"{x:.4f}" for x in r["losses"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training steps on 1, 2, ... GPUs (one process a GPU, NCCL): data parallel and model parallel, beside dense.

    python3 tools/gpu/multi_gpu.py [--world 1,2] [--json results.json] [--quick] [--model-features F]
        [--model-density D] [--profile]

- **Data parallel** (DistributedDataParallel, a fixed batch per GPU): the training step of one
  ``BlockSparseLinear`` and of ``nn.Linear`` of the same shape (forward, backward with the gradient
  all-reduce, SGD), on workloads S (N = 32, 12288 features) and T (N = 4096, 8192), bf16, 10 %,
  block 32. Throughput in rows per second and its scaling against one GPU.
- **Model parallel** (``ShardedBlockSparseLinear``): a 65536 -> 65536 layer (``--model-features``,
  ``--model-density``), bf16, block 32, 10 %, split by
  block columns (all-gather of y) and by block rows (all-reduce of partial sums), its forward and
  backward at N = 32 and N = 4096, with each GPU's share of the weight.

Times are medians over batches of back-to-back steps between CUDA events (warm-up excluded), the
slowest rank's. A world size larger than the GPUs present is skipped and said so. NCCL's NVLink
multicast stays off (NCCL_NVLS_ENABLE=0), as the lent machines require.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import bsmm  # noqa: E402
import bsmm.torch  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
DATA_PARALLEL = {"S": (32, 12288), "T": (4096, 8192)}
MODEL_FEATURES, DENSITY, BLOCK = 65536, 0.10, 32


def _time(step, batches: int, calls: int) -> float:
    """Median ms per call over ``batches`` of ``calls`` back-to-back calls, the slowest rank's."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    median = torch.tensor(statistics.median(times), device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def _layout(features_in: int, features_out: int, seed: int, density: float = DENSITY) -> np.ndarray:
    return bsmm.layouts.random_layout(features_in // BLOCK, features_out // BLOCK, density, seed=seed)


def _training_step(kind: str, features: int, layout, x, world: int):
    """One layer's training step (forward, a mean-square loss, backward, SGD), bsmm's or ``nn.Linear``'s, under
    DDP on several GPUs."""
    torch.manual_seed(0)
    if kind == "bsmm":
        layer = bsmm.torch.BlockSparseLinear(features, features, layout, BLOCK, device="cuda", dtype=torch.bfloat16)
    else:
        layer = torch.nn.Linear(features, features, device="cuda", dtype=torch.bfloat16)
    model = torch.nn.parallel.DistributedDataParallel(layer) if world > 1 else layer
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        optimizer.step()

    return step


def data_parallel(world: int, rank: int, batches: int, calls: int) -> list:
    rows = []
    for workload, (n, features) in DATA_PARALLEL.items():
        layout = _layout(features, features, seed=0)
        x = torch.randn(n, features, device="cuda", dtype=torch.bfloat16)
        for kind in ("bsmm", "dense"):
            ms = _time(_training_step(kind, features, layout, x, world), batches, calls)
            rows.append({"test": "data parallel", "workload": workload, "kind": kind, "world": world, "n_per_gpu": n,
                         "features": features, "ms": ms, "rows_per_s": world * n / ms * 1e3})
        torch.cuda.empty_cache()
    return rows


def model_parallel(world: int, rank: int, batches: int, calls: int, features: int, density: float, sizes) -> list:
    rows = []
    layout = _layout(features, features, seed=1, density=density)
    for by in ("columns", "rows"):
        torch.manual_seed(0)
        torch.cuda.reset_peak_memory_stats()
        try:
            layer = bsmm.torch.ShardedBlockSparseLinear(features, features, layout, BLOCK, by=by, device="cuda",
                                                        dtype=torch.bfloat16)
        except torch.cuda.OutOfMemoryError:
            if world > 1:
                raise  # (the other ranks would wait in a collective: let the run fail)
            rows += [{"test": "model parallel", "by": by, "world": world, "n": n, "features": features, "ms": None,
                      "oom": True} for n in sizes]
            continue
        weight_bytes = layer.weight.numel() * layer.weight.element_size()
        for n in sizes:
            x = torch.randn(n, features, device="cuda", dtype=torch.bfloat16, requires_grad=True)

            def step():
                layer.weight.grad = x.grad = None
                layer(x).float().square().mean().backward()

            try:
                ms = _time(step, batches, calls)
            except torch.cuda.OutOfMemoryError:
                if world > 1:
                    raise
                rows.append({"test": "model parallel", "by": by, "world": world, "n": n, "features": features,
                             "ms": None, "oom": True})
                continue
            blocks = torch.tensor([layer.weight.shape[0]], device="cuda")
            dist.all_reduce(blocks, op=dist.ReduceOp.MAX)
            rows.append({"test": "model parallel", "by": by, "world": world, "n": n, "features": features,
                         "ms": ms, "largest_part_blocks": int(blocks), "all_blocks": int(np.count_nonzero(layout)),
                         "weight_mib_per_gpu": weight_bytes / 2**20,
                         "peak_mib": torch.cuda.max_memory_allocated() / 2**20})
        torch.cuda.empty_cache()
    return rows


def _rank_main(rank: int, world: int, port: int, out: str, quick: bool, features: int, density: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    batches, calls = (3, 5) if quick else (7, 10)
    rows = data_parallel(world, rank, batches, calls)
    rows += model_parallel(world, rank, batches, calls, features, density, (32, 4096))
    if rank == 0:
        with open(out, "w") as file:
            json.dump(rows, file)
    dist.destroy_process_group()


def _profile() -> int:
    """torch.profiler's table of 20 training steps of workload S, bsmm then dense, in one process."""
    from torch.profiler import ProfilerActivity, profile

    n, features = DATA_PARALLEL["S"]
    x = torch.randn(n, features, device="cuda", dtype=torch.bfloat16)
    layout = _layout(features, features, seed=0)
    for kind in ("bsmm", "dense"):
        step = _training_step(kind, features, layout, x, world=1)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        print(f"== {kind}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
    return 0


def _table(rows: list) -> str:
    lines = ["| test | shape | bsmm or dense | GPUs | ms per step | rows/s | scaling vs 1 GPU |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    base = {}
    for row in rows:
        if row["test"] == "data parallel":
            key = ("dp", row["workload"], row["kind"])
            shape = f"{row['workload']}: N={row['n_per_gpu']}/GPU, {row['features']}²"
            kind = row["kind"]
        elif row.get("oom"):
            base[("mp", row["by"], row["n"])] = None  # no one-GPU time to scale from
            lines.append(f"| {row['test']} | {row['features']}², N={row['n']}, by {row['by']} | bsmm | {row['world']} "
                         "| does not fit one GPU | | |")
            continue
        else:
            key = ("mp", row["by"], row["n"])
            shape = f"{row['features']}², N={row['n']}, by {row['by']}"
            kind = f"bsmm ({row['largest_part_blocks']}/{row['all_blocks']} blocks, {row['weight_mib_per_gpu']:.0f} MiB)"
        base.setdefault(key, row["rows_per_s"] if "rows_per_s" in row else row["ms"])
        if "rows_per_s" in row:
            scaling = f"{row['rows_per_s'] / (row['world'] * base[key]):.2f}"
            rate = f"{row['rows_per_s']:.3g}"
        else:  # the same problem on more GPUs: speed-up
            scaling = "one GPU: does not fit" if base[key] is None else f"{base[key] / row['ms']:.2f}"
            rate = f"{row['n'] / row['ms'] * 1e3:.3g}"
        lines.append(f"| {row['test']} | {shape} | {kind} | {row['world']} | {row['ms']:.3f} | {rate} | {scaling} |")
    return "\n".join(lines)


def run_worlds(rank_main, worlds: str, devices: int, arguments: tuple) -> list:
    """The rows of ``rank_main(rank, world, port, out, *arguments)`` run in ``world`` processes for each
    world size in ``worlds`` ("1,2"), rank 0 writing its rows to ``out`` as JSON; a world larger than
    ``devices`` is skipped and said so."""
    rows = []
    for world in sorted({int(w) for w in worlds.split(",")}):
        if world > devices:
            print(f"world {world}: skipped, {devices} GPU(s) present")
            continue
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        out = f"/tmp/{rank_main.__module__}_{os.getpid()}_{world}.json"
        mp.spawn(rank_main, args=(world, port, out, *arguments), nprocs=world)
        with open(out) as file:
            rows += json.load(file)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", default="1,2", help="GPU counts to run, comma-separated (default 1,2)")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--quick", action="store_true", help="fewer batches")
    parser.add_argument("--model-features", type=int, default=MODEL_FEATURES,
                        help=f"features (in and out) of the model-parallel layer (default {MODEL_FEATURES})")
    parser.add_argument("--model-density", type=float, default=DENSITY,
                        help=f"its density (default {DENSITY}); e.g. 1.0 for a layer whose weights, gradients "
                             "and optimizer state outgrow one GPU")
    parser.add_argument("--profile", action="store_true",
                        help="one GPU: torch.profiler's table of the data-parallel steps of workload S, then stop")
    args = parser.parse_args(argv)
    if args.profile:
        return _profile()
    gpus = torch.cuda.device_count()
    rows = run_worlds(_rank_main, args.world, gpus, (args.quick, args.model_features, args.model_density))
    rows.sort(key=lambda r: (r["test"], r.get("workload", r.get("by")), r.get("kind", r.get("n")), r["world"]))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"gpu": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__, "rows": rows},
                      file, indent=1)
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Runs bsmm.torch's multi-process checks on ``--world`` ranks and writes what each rank measured as JSON.

    python tests/frameworks/torch/distributed_child.py --out results.json [--world 2] [--backend gloo|nccl|gloo-cuda]
        [--checks all|sharded]

test_distributed.py runs it (gloo on the CPU); tools/gpu runs it with NCCL, one GPU a rank. Every
check compares with one process computing the whole problem from the same seed, in float64 on the
CPU (float32 on GPUs), and records the largest relative error of each output and gradient:

- ``ddp/...``: DistributedDataParallel over BlockSparseLinear layers, each rank a share of the batch;
  ``ddp/mlp/...`` and ``fsdp/mlp/...``: a GLU BlockSparseMLP behind a layer.
- ``fsdp/...``: fully_shard (FSDP2) over the same model, with and without bf16 parameters; any warning
  FSDP2 gives is recorded.
- ``dynamic/{ddp,fsdp}/...``: DynamicSparsity (RigL) under DDP and FSDP2, each rank's batch its own: the
  layouts and weights of every rank against rank 0's, and FSDP2's against DDP's.
- ``pruning/...``: GradualPruning with each rank's weights scaled its own way: every rank's masks (rank 0's,
  broadcast), each rank's own choice of the smallest norms, and whether the closed blocks' weights are 0.
- ``sharded/...``: ShardedBlockSparseLinear, every split, input and output mode, feature axis, a
  layout whose cut leaves a part without blocks, cuts of unequal widths, an empty batch, no_grad,
  double backward (a gradient penalty), bf16 autocast, and a column-split layer feeding a
  row-split one. The features each rank should hold are worked out here from the layout, not read
  from the layer.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import bsmm
import bsmm.torch

C, H, K = 48, 40, 32  # block size 8: 6 x 5 and 5 x 4 block layouts


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if actual.shape != expected.shape:
        return float("inf")
    if not expected.numel():
        return 0.0
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


class Recorder:
    def __init__(self, rank: int):
        self.rank, self.results = rank, {}

    def close(self, name: str, actual, expected, tolerance: float) -> None:
        self.results[name] = {"error": _relative(actual, expected), "tolerance": tolerance}

    def fact(self, name: str, value) -> None:
        self.results[name] = {"value": value}


def _layouts(seed: int):
    rng = np.random.default_rng(seed)
    first = rng.random((C // 8, H // 8)) < 0.6
    second = rng.random((H // 8, K // 8)) < 0.6
    first[0, 0] = second[0, 0] = True
    return first, second


def _model(dtype, device, seed: int):
    torch.manual_seed(seed)
    first, second = _layouts(seed)
    return torch.nn.Sequential(bsmm.torch.BlockSparseLinear(C, H, first, block_size=8, device=device, dtype=dtype),
                               torch.nn.GELU(),
                               bsmm.torch.BlockSparseLinear(H, K, second, block_size=8, device=device, dtype=dtype))


def _mlp_model(dtype, device, seed: int):
    """A BlockSparseLinear (C -> K) and a GLU BlockSparseMLP (K, hidden H), as sparsify(fuse_mlp=True) makes
    a model's: four parameters, as ``_model``'s."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    layouts = [rng.random(shape) < 0.6 for shape in ((C // 8, K // 8), (K // 8, H // 8), (K // 8, H // 8),
                                                     (H // 8, K // 8))]
    for layout in layouts:
        layout[0, 0] = True
    return torch.nn.Sequential(
        bsmm.torch.BlockSparseLinear(C, K, layouts[0], block_size=8, device=device, dtype=dtype),
        bsmm.torch.BlockSparseMLP(K, H, block_size=8, layouts=layouts[1:], device=device, dtype=dtype))


def _batch(shape, dtype, device, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator, dtype=torch.float64).to(device, dtype),
            torch.randn(*shape[:-1], K, generator=generator, dtype=torch.float64).to(device, dtype))


def _train(model, x, r, steps: int, scale: float):
    """Losses and gradients of ``steps`` SGD steps on loss = sum(model(x) * r) * scale."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], None
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (model(x).to(r.dtype) * r).sum() * scale  # (bf16 parameters give a bf16 y)
        loss.backward()
        if grads is None:
            grads = [p.grad.detach().clone() for p in model.parameters()]
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), grads


def check_dynamic_sparsity(record: Recorder, world: int, device, dtype, tolerance: float, backend: str) -> None:
    """DynamicSparsity (RigL, new blocks fan-in drawn) under DDP and under FSDP2, each rank growing from its own
    share of the batch: rank 0's layouts are broadcast and the draws seeded alike, so every rank's layouts and
    weights equal rank 0's; FSDP2's (gathered, moved, re-sharded) equal DDP's."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    rank = record.rank
    finals = {}
    # (FSDP2 gathering CUDA tensors through gloo crashes torch 2.11: results/v22; NCCL runs it)
    wrappers = ("ddp",) if backend == "gloo-cuda" else ("ddp", "fsdp")
    record.fact("dynamic/wrappers", list(wrappers))
    for wrapper in wrappers:
        model = _model(dtype, device, seed=5)
        if wrapper == "ddp":
            wrapped = DistributedDataParallel(model)
        else:
            for layer in list(model.modules())[1:]:
                if isinstance(layer, bsmm.torch.BlockSparseLinear):
                    fully_shard(layer)
            wrapped = fully_shard(model)
        optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-2)
        sparsity = bsmm.torch.DynamicSparsity(model, optimizer, criterion="rigl", drop_fraction=0.3, every=2,
                                              schedule="constant", init="fan_in", seed=4)
        torch.manual_seed(1000 + rank)  # the ranks' own random streams differ (dropout, data order, ...)
        start = [layer.op.layout.copy() for layer in sparsity.layers.values()]
        for step in range(4):
            if step == 1:  # a step GradScaler would skip: rank 0 overflows, no rank steps, its captures must go
                x, r = _batch((3, C), dtype, device, seed=999 + rank)
                ((wrapped(x) * r).sum() * (float("inf") if rank == 0 else 1.0)).backward()
                optimizer.zero_grad(set_to_none=True)
            x, r = _batch((3, C), dtype, device, seed=100 * step + rank)  # each rank's own rows
            optimizer.zero_grad()
            (wrapped(x) * r).sum().backward()
            optimizer.step()
        layers = list(sparsity.layers.values())
        mine = {"layouts": [np.array(layer.op.layout).tolist() for layer in layers],
                "weights": [_full(layer.weight).detach().cpu() for layer in layers]}
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        prefix = f"dynamic/{wrapper}/"
        record.fact(prefix + "updates", len(sparsity.history))
        record.fact(prefix + "moved", sum(int((a != layer.op.layout).sum()) for a, layer in zip(start, layers)))
        record.fact(prefix + "layouts-equal", all(other["layouts"] == everyone[0]["layouts"] for other in everyone))
        for index, weight in enumerate(mine["weights"]):
            record.close(f"{prefix}weight{index}", weight, everyone[0]["weights"][index], 0.0)
        finals[wrapper] = mine
    # One process on the whole batch (a group of this rank alone: no collectives), the loss scaled as DDP's mean:
    # RigL's growth from the summed xᵀ·dy of all ranks equals growing from the whole batch.
    alone = [dist.new_group([r]) for r in range(world)][rank]  # (every rank makes every group, in order)
    model = _model(dtype, device, seed=5)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    sparsity = bsmm.torch.DynamicSparsity(model, optimizer, criterion="rigl", drop_fraction=0.3, every=2,
                                          schedule="constant", init="fan_in", seed=4, process_group=alone)
    for step in range(4):
        optimizer.zero_grad()
        batches = [_batch((3, C), dtype, device, seed=100 * step + r) for r in range(world)]
        (sum((model(x) * r).sum() for x, r in batches) / world).backward()
        optimizer.step()
    layers = list(sparsity.layers.values())
    record.fact("dynamic/ddp-layouts-as-one", [np.array(layer.op.layout).tolist() for layer in layers]
                == finals["ddp"]["layouts"])
    for index, layer in enumerate(layers):
        record.close(f"dynamic/ddp-as-one/weight{index}", finals["ddp"]["weights"][index], layer.weight.detach().cpu(),
                     tolerance)
    if "fsdp" in finals:
        record.fact("dynamic/fsdp-layouts-as-ddp", finals["fsdp"]["layouts"] == finals["ddp"]["layouts"])
        for index, (a, b) in enumerate(zip(finals["fsdp"]["weights"], finals["ddp"]["weights"])):
            record.close(f"dynamic/fsdp-as-ddp/weight{index}", a, b, tolerance)
    # A layout changed on rank 1 only, then DDP (which copies rank 0's weights and layout buffer): the next
    # update raises on every rank, rather than hang or train on layers that compute other layouts.
    model = _model(dtype, device, seed=5)
    first = next(m for m in model.modules() if isinstance(m, bsmm.torch.BlockSparseLinear))
    if rank == 1:
        moved = first.op.layout.copy()
        present, absent = np.argwhere(moved != 0), np.argwhere(moved == 0)
        moved[tuple(present[0])], moved[tuple(absent[0])] = 0, 1
        bsmm.torch.dynamic.change_layout(first, moved)
    wrapped = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    bsmm.torch.DynamicSparsity(model, optimizer, criterion="set", every=1, schedule="constant")
    x, r = _batch((3, C), dtype, device, seed=7)
    (wrapped(x) * r).sum().backward()
    try:
        optimizer.step()
        record.fact("dynamic/stale-rank-refused", "no error")
    except RuntimeError as error:
        record.fact("dynamic/stale-rank-refused", "layouts of layers ['0'] differ" in str(error))


def check_gradual_pruning(record: Recorder, device, dtype) -> None:
    """GradualPruning once to half the blocks, each rank's weights scaled block by block from a seed of its own,
    so each rank's smallest norms differ: what every rank closes, and what it would have closed alone."""
    model = _model(dtype, device, seed=11)
    layers = [m for m in model.modules() if isinstance(m, bsmm.torch.BlockSparseLinear)]
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    own = []
    with torch.no_grad():
        for layer in layers:
            scale = torch.rand(layer.op.blocks, generator=generator, dtype=torch.float64) * 1.5 + 0.5
            layer.weight.mul_(scale.to(device, dtype).view(-1, 1, 1))
            norms = layer.weight.double().flatten(1).norm(dim=1).cpu()
            kept = torch.zeros(layer.op.blocks, dtype=torch.bool)
            kept[norms.argsort(descending=True)[:max(1, round(0.5 * layer.op.blocks))]] = True
            own.append(kept.tolist())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # (no gradients: the step only runs the pruning)
    bsmm.torch.GradualPruning(model, optimizer, density=0.5, end=1, every=1)
    optimizer.step()
    record.fact("pruning/masks", [layer.gates.kept().cpu().tolist() for layer in layers])
    record.fact("pruning/own-choice", own)
    record.fact("pruning/closed-weights-zero",
                all(not bool(layer.weight[~layer.gates.kept()].any()) for layer in layers))


def _full(tensor):
    """The whole tensor of an FSDP2 parameter or gradient (a DTensor sharded along dim 0), on the host: the
    ranks' local chunks gathered as objects (DTensor.full_tensor on CUDA tensors through gloo crashes in
    torch 2.11)."""
    if not hasattr(tensor, "to_local"):
        return tensor
    chunks = [None] * dist.get_world_size()
    dist.all_gather_object(chunks, tensor.to_local().detach().cpu())
    return torch.cat(chunks)


def check_data_parallel(record: Recorder, world: int, device, dtype, tolerance: float) -> None:
    """DDP and FSDP2 against one process on the whole batch: losses, first gradients, trained weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    rank = record.rank
    for shape_name, shape, make in (("2d", (4 * world, C), _model), ("3d", (2 * world, 3, C), _model),
                                    ("mlp", (2 * world, 3, C), _mlp_model)):
        x, r = _batch(shape, dtype, device, seed=11)
        rows = slice(rank * shape[0] // world, (rank + 1) * shape[0] // world)
        whole = make(dtype, device, seed=5)
        losses, grads = _train(whole, x, r, 3, 1.0 / shape[0])
        # Each rank's share of the loss: DDP and FSDP average the gradients over ranks.
        local_scale = world / shape[0]
        ddp = DistributedDataParallel(make(dtype, device, seed=5))
        ddp_losses, ddp_grads = _train(ddp, x[rows], r[rows], 3, local_scale)
        dist.all_reduce(ddp_losses)
        record.close(f"ddp/{shape_name}/losses", ddp_losses / world, losses, tolerance)
        for (name, _), grad, expected in zip(whole.named_parameters(), ddp_grads, grads):
            record.close(f"ddp/{shape_name}/grad/{name}", grad, expected, tolerance)
        for (name, p), q in zip(whole.named_parameters(), ddp.module.parameters()):
            record.close(f"ddp/{shape_name}/trained/{name}", q, p, tolerance)

        policies = {"full": None, "bf16-params": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                     reduce_dtype=torch.float32)}
        for policy_name, policy in policies.items():
            # bf16 parameters gathered from float32 masters (FSDP2 casts from the masters' dtype)
            masters = dtype if policy is None else torch.float32
            sharded = make(dtype, device, seed=5).to(masters)  # the same initial values as ``whole``
            options = {} if policy is None else {"mp_policy": policy}
            for layer in list(sharded.modules())[1:]:
                if isinstance(layer, bsmm.torch.BlockSparseLinear):
                    fully_shard(layer, **options)
            fully_shard(sharded, **options)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fsdp_losses, fsdp_grads = _train(sharded, x[rows].to(masters), r[rows].to(masters), 3, local_scale)
            record.fact(f"fsdp/{shape_name}/{policy_name}/warnings",
                        [str(w.message)[:200] for w in caught if "FSDP" in str(w.message)])
            dist.all_reduce(fsdp_losses)
            # bf16 rounds y and the gradients: their error against float64 is bf16's, about 2^-8
            bound = tolerance if policy is None else 2e-2
            record.close(f"fsdp/{shape_name}/{policy_name}/losses", fsdp_losses / world, losses, bound)
            for (name, _), grad, expected in zip(whole.named_parameters(), fsdp_grads, grads):
                record.close(f"fsdp/{shape_name}/{policy_name}/grad/{name}", _full(grad), expected, bound)
            for (name, p), q in zip(whole.named_parameters(), sharded.parameters()):
                record.close(f"fsdp/{shape_name}/{policy_name}/trained/{name}", _full(q), p, bound)


def _sharded_case(record: Recorder, name: str, layout, by: str, input: str, output: str, feature_axis: int,
                  bias: bool, x_shape, device, dtype, tolerance: float) -> None:
    """One ShardedBlockSparseLinear against the whole layer: y, dx, dW, db and full_weight()."""
    rank = record.rank
    c, k = layout.shape[0] * 8, layout.shape[1] * 8
    torch.manual_seed(3)
    whole = bsmm.torch.BlockSparseLinear(c, k, layout, block_size=8, bias=bias, feature_axis=feature_axis,
                                         device=device, dtype=dtype)
    with torch.no_grad():
        if bias:
            whole.bias.normal_()
    part = bsmm.torch.ShardedBlockSparseLinear.from_layer(whole, by=by, input=input, output=output)
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(*x_shape, generator=generator, dtype=torch.float64).to(device, dtype)
    axis = -1 if feature_axis == 1 else 0
    x_whole = x.clone().requires_grad_()
    y_whole = whole(x_whole)
    r = torch.randn(y_whole.shape, generator=generator, dtype=torch.float64).to(device, dtype)
    (y_whole * r).sum().backward()

    mine, outputs = _mine(layout, by, rank), _output_features(layout, by, output, rank, k)
    if input == "sharded":
        x_mine = x.narrow(axis, mine.start, mine.stop - mine.start).contiguous().requires_grad_()
    else:
        x_mine = x.clone().requires_grad_()
    y = part(x_mine)
    y_expected = y_whole.narrow(axis, outputs.start, outputs.stop - outputs.start)
    r_mine = r.narrow(axis, outputs.start, outputs.stop - outputs.start)
    record.close(f"sharded/{name}/y", y, y_expected, tolerance)
    with torch.no_grad():
        record.close(f"sharded/{name}/y_no_grad", part(x_mine), y_expected, tolerance)
    (y * r_mine).sum().backward()
    if input == "sharded":
        dx_expected = x_whole.grad.narrow(axis, mine.start, mine.stop - mine.start)
    else:
        dx_expected = x_whole.grad
    record.close(f"sharded/{name}/dx", x_mine.grad, dx_expected, tolerance)
    index = torch.as_tensor(part.split.weight_index(rank), device=device)
    if part.weight.numel():
        record.close(f"sharded/{name}/dw", part.weight.grad, whole.weight.grad[index], tolerance)
    else:
        record.fact(f"sharded/{name}/empty_part", True)
    if bias:
        held = mine if by == "columns" else outputs  # (by columns, each rank adds its features' bias before the gather)
        record.close(f"sharded/{name}/db", part.bias.grad, whole.bias.grad[held], tolerance)
    record.close(f"sharded/{name}/full_weight", part.full_weight(), whole.weight, 0.0)


def _mine(layout, by: str, rank: int) -> slice:
    """The features of ``rank``'s part along the cut axis, worked out here rather than read from the layer."""
    cut = bsmm.split_layout(np.asarray(layout), dist.get_world_size(), by).bounds
    return slice(cut[rank] * 8, cut[rank + 1] * 8)


def _output_features(layout, by: str, output: str, rank: int, k: int) -> slice:
    """The output features ``rank`` holds: all, its block columns', or its equal share of a reduce-scatter."""
    world = dist.get_world_size()
    if output == "replicated":
        return slice(0, k)
    return _mine(layout, by, rank) if by == "columns" else slice(rank * k // world, (rank + 1) * k // world)


def _pair(layout, by, input, output, device, dtype, seed: int):
    """A whole 48 -> 48 layer and this rank's part of it, with an input and a cotangent of fixed seeds."""
    torch.manual_seed(3)
    whole = bsmm.torch.BlockSparseLinear(48, 48, layout, block_size=8, device=device, dtype=dtype)
    part = bsmm.torch.ShardedBlockSparseLinear.from_layer(whole, by=by, input=input, output=output)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 48, generator=generator, dtype=torch.float64).to(device, dtype)
    r = torch.randn(5, 48, generator=generator, dtype=torch.float64).to(device, dtype)
    inputs = slice(0, 48) if input == "replicated" else _mine(layout, by, dist.get_rank())
    return whole, part, x, r, inputs, _output_features(layout, by, output, dist.get_rank(), 48)


def _double_backward_case(record: Recorder, layout, by, input, output, device, dtype, tolerance) -> None:
    """A gradient penalty, sum(y*r) + sum(dx**2) with dx from create_graph=True: its gradients of x and W
    (with a sharded input each rank's dx is its share of the penalty's sum)."""
    name = f"sharded/double-backward/{by}/{input}-{output}"
    whole, part, x, r, inputs, outputs = _pair(layout, by, input, output, device, dtype, seed=5)

    def penalised(layer, x_in, r_in):
        x_in = x_in.clone().requires_grad_()
        first = (layer(x_in) * r_in).sum()
        (dx,) = torch.autograd.grad(first, x_in, create_graph=True)
        (first + dx.square().sum()).backward()
        return x_in.grad

    dx_whole = penalised(whole, x, r)
    dx = penalised(part, x[:, inputs].contiguous(), r[:, outputs].contiguous())
    record.close(f"{name}/dx", dx, dx_whole[:, inputs], tolerance)
    index = torch.as_tensor(part.split.weight_index(record.rank), device=device)
    record.close(f"{name}/dw", part.weight.grad, whole.weight.grad[index], tolerance)


def _autocast_case(record: Recorder, layout, by, input, output, device) -> None:
    """float32 layers under bf16 autocast: y, dx and dW within bf16's tolerance of the whole layer's."""
    name = f"sharded/autocast/{by}/{input}-{output}"
    whole, part, x, r, inputs, outputs = _pair(layout, by, input, output, device, torch.float32, seed=6)
    x_whole, x_mine = x.clone().requires_grad_(), x[:, inputs].contiguous().requires_grad_()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y_whole, y = whole(x_whole), part(x_mine)
    record.fact(f"{name}/dtype", str(y.dtype).replace("torch.", ""))
    # Row splits add bf16 partial sums: one more bf16 rounding than the whole layer's.
    record.close(f"{name}/y", y, y_whole[:, outputs], 2e-2)
    (y_whole.float() * r).sum().backward()
    (y.float() * r[:, outputs]).sum().backward()
    record.close(f"{name}/dx", x_mine.grad, x_whole.grad[:, inputs], 2e-2)
    index = torch.as_tensor(part.split.weight_index(record.rank), device=device)
    record.close(f"{name}/dw", part.weight.grad, whole.weight.grad[index], 2e-2)


def check_sharded(record: Recorder, device, dtype, tolerance: float) -> None:
    rng = np.random.default_rng(7)
    square = rng.random((6, 6)) < 0.5
    square[:, 0] = square[0, :] = True
    wide = rng.random((4, 10)) < 0.4
    wide[0, :] = True
    skewed = np.zeros((6, 4), bool)  # every block in block column 0 and block row 0
    skewed[:, 0] = skewed[0, :] = True
    one_block = np.zeros((6, 6), bool)  # any cut leaves a part without blocks
    one_block[0, 0] = True
    uneven = np.zeros((6, 6), bool)  # block columns of 5, 1, 5, 1, 1 and 2 blocks: cuts of unequal widths
    for column, count in enumerate((5, 1, 5, 1, 1, 2)):
        uneven[:count, column] = True
    cases = []
    for by, modes in (("columns", (("replicated", "replicated"), ("replicated", "sharded"))),
                      ("rows", (("replicated", "replicated"), ("replicated", "sharded"),
                                ("sharded", "replicated"), ("sharded", "sharded")))):
        for input, output in modes:
            for feature_axis in (1, 0):
                cases.append((f"{by}/{input}-{output}/axis{feature_axis}", square, by, input, output,
                              feature_axis, True, (5, 48) if feature_axis == 1 else (48, 5)))
        cases.append((f"{by}/wide-3d-nobias", wide, by, "replicated", "replicated", 1, False, (2, 3, 32)))
        cases.append((f"{by}/skewed", skewed, by, "replicated", "replicated", 1, True, (1, 48)))
        cases.append((f"{by}/one-block", one_block, by, "replicated", "sharded", 0, True, (48, 3)))
        cases.append((f"{by}/uneven", uneven if by == "columns" else uneven.T, by, "replicated", "sharded", 1, True,
                      (4, 48)))
        cases.append((f"{by}/uneven-axis0", uneven if by == "columns" else uneven.T, by, "replicated", "replicated",
                      0, True, (48, 4)))
        cases.append((f"{by}/empty-batch", square, by, "replicated", "sharded" if by == "rows" else "replicated", 1,
                      True, (0, 48)))
    for case in cases:
        _sharded_case(record, *case, device=device, dtype=dtype, tolerance=tolerance)

    for by, input, output in (("columns", "replicated", "replicated"), ("columns", "replicated", "sharded"),
                              ("rows", "replicated", "replicated"), ("rows", "sharded", "sharded")):
        _double_backward_case(record, square, by, input, output, device, dtype, tolerance)
        _autocast_case(record, square, by, input, output, device)

    # A column split feeding a row split with the same cut: no collective between them.
    torch.manual_seed(9)
    first_layout, second_layout = _layouts(9)
    first = bsmm.torch.BlockSparseLinear(C, H, first_layout, block_size=8, device=device, dtype=dtype)
    second = bsmm.torch.BlockSparseLinear(H, K, second_layout, block_size=8, device=device, dtype=dtype)
    column = bsmm.torch.ShardedBlockSparseLinear.from_layer(first, by="columns", output="sharded")
    row = bsmm.torch.ShardedBlockSparseLinear.from_layer(second, by="rows", input="sharded",
                                                          bounds=column.split.bounds)
    x = torch.randn(6, C, generator=torch.Generator().manual_seed(10), dtype=torch.float64).to(device, dtype)
    x_whole, x_mine = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_whole = second(torch.relu(first(x_whole)))
    y = row(torch.relu(column(x_mine)))
    record.close("sharded/chain/y", y, y_whole, tolerance)
    y_whole.square().sum().backward()
    y.square().sum().backward()
    record.close("sharded/chain/dx", x_mine.grad, x_whole.grad, tolerance)
    record.close("sharded/chain/dw1", column.weight.grad,
                 first.weight.grad[torch.as_tensor(column.split.weight_index(record.rank), device=device)], tolerance)
    record.close("sharded/chain/dw2", row.weight.grad,
                 second.weight.grad[torch.as_tensor(row.split.weight_index(record.rank), device=device)], tolerance)


def _rank_main(rank: int, world: int, backend: str, checks: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    record = Recorder(rank)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            dist.init_process_group(backend, rank=rank, world_size=world, device_id=device)
            dtype, tolerance = torch.float32, 2e-5
        elif backend == "gloo-cuda":
            # CUDA tensors through gloo (staged through the host): several ranks may share one GPU, which
            # NCCL refuses, so bsmm's kernels run in a multi-rank job on a machine of one GPU.
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            dist.init_process_group("gloo", rank=rank, world_size=world)
            dtype, tolerance = torch.float32, 2e-5
        else:
            device = torch.device("cpu")
            dist.init_process_group(backend, rank=rank, world_size=world)
            dtype, tolerance = torch.float64, 1e-12
        if checks in ("all", "data"):
            check_data_parallel(record, world, device, dtype, tolerance)
            check_dynamic_sparsity(record, world, device, dtype, tolerance, backend)
            check_gradual_pruning(record, device, dtype)
        if checks in ("all", "sharded"):
            check_sharded(record, device, dtype, tolerance)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the test with its traceback
        record.fact("crash", traceback.format_exc())
    with open(f"{out}.rank{rank}", "w") as file:
        json.dump(record.results, file)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--backend", choices=("gloo", "nccl", "gloo-cuda"), default="gloo",
                        help="gloo: CPU tensors; nccl: one GPU a rank; gloo-cuda: CUDA tensors through gloo, ranks "
                             "sharing GPUs")
    parser.add_argument("--checks", choices=("all", "sharded", "data"), default="all",
                        help="sharded: ShardedBlockSparseLinear's checks only; data: DDP's and FSDP2's only")
    args = parser.parse_args(argv)
    # NVLink multicast off: the lent GPU machines require it (and the children inherit it).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank_main, args=(args.world, args.backend, args.checks, port, args.out), nprocs=args.world)
    merged = {}
    for rank in range(args.world):
        with open(f"{args.out}.rank{rank}") as file:
            merged[str(rank)] = json.load(file)
    with open(args.out, "w") as file:
        json.dump({"world": args.world, "backend": args.backend, "torch": torch.__version__, "ranks": merged}, file)
    return 0


if __name__ == "__main__":
    sys.exit(main())

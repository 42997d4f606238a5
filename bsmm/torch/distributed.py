"""Model parallelism for PyTorch: :class:`ShardedBlockSparseLinear`, one layer's blocks spread over a process group.

Each rank holds one part of :func:`bsmm.split_layout`'s cut of the layout and multiplies with it;
``torch.distributed`` (NCCL on GPUs, gloo on the CPU) joins the parts. The collectives are
autograd functions with the conventions of tensor-parallel training: every rank computes the same
loss from a replicated tensor, so the backward of an all-gather keeps this rank's slice, that of
a replicated input sums the ranks' gradients, and the weight gradients equal those of one process
running the whole layer. Data parallelism needs nothing of bsmm: ``DistributedDataParallel`` and
``fully_shard`` (FSDP2) take a :class:`~bsmm.torch.BlockSparseLinear` as any module.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
import torch.distributed as dist

from bsmm.block_index import block_index, check_block_size
from bsmm.sharding import LayoutSplit, split_layer
from bsmm.torch.checks import check_dtype
from bsmm.torch.functional import matmul_by_key
from bsmm.torch.layers import BlockSparseLinear, bias_along, fan_in_bounds
from bsmm.torch.registry import register

__all__ = ["ShardedBlockSparseLinear"]

# torch 2.13 renames the tensor collectives; earlier versions have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_stack(part: torch.Tensor, parts: int, group) -> torch.Tensor:
    """(parts, *part.shape): every rank's ``part`` (one shape on all ranks), in rank order."""
    part = part.contiguous()
    # Gathered along the first dimension: gloo takes that form only, not a stacked output.
    stacked = part.new_empty((parts * part.shape[0], *part.shape[1:]))
    _all_gather_single(stacked, part, group=group)
    return stacked.view(parts, *part.shape)


def _gather_features(part: torch.Tensor, counts: tuple, axis: int, group) -> torch.Tensor:
    """The parts' tensors joined along ``axis`` (0 or -1) in rank order; part r has ``counts[r]`` entries
    there (features, or a weight's blocks)."""
    widest = max(max(counts), 1)  # (never an empty collective: a weight of no blocks anywhere)
    if part.shape[axis] < widest:  # the collective needs one size on every rank
        pad = [0, 0] * (part.dim() - 1 if axis == 0 else 0) + [0, widest - part.shape[axis]]
        part = torch.nn.functional.pad(part, pad)
    stacked = _gather_stack(part, len(counts), group)
    if all(count == widest for count in counts):
        # (sizes spelled out: -1 is ambiguous for an empty batch)
        joined = len(counts) * widest
        return (stacked.view(joined, *part.shape[1:]) if axis == 0
                else stacked.movedim(0, -2).reshape(*part.shape[:-1], joined))
    return torch.cat([stacked[r].narrow(axis, 0, count) for r, count in enumerate(counts)], dim=axis)


# Each collective's backward applies its conjugate (all-reduce <-> identity, gather <-> slice,
# reduce-scatter <-> all-gather) as an autograd function, so create_graph=True differentiates it again.
class _Replicate(torch.autograd.Function):
    """Identity forward; backward sums the ranks' gradients (every rank used the whole tensor)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _SumParts.apply(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _SumParts(torch.autograd.Function):
    """Forward: all-reduce of the ranks' partial sums; backward: identity (the sum is replicated)."""

    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        # In place: a fresh product of this layer's that nothing else holds.
        ctx.mark_dirty(partial)
        dist.all_reduce(partial, group=group)
        return partial

    @staticmethod
    def backward(ctx, grad):
        return _Replicate.apply(grad, ctx.group), None


class _GatherFeatures(torch.autograd.Function):
    """Forward: all-gather of the ranks' features; backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, part, counts, rank, axis, group):
        ctx.args = (counts, rank, axis, group)
        return _gather_features(part, counts, axis, group)

    @staticmethod
    def backward(ctx, grad):
        return _SliceFeatures.apply(grad, *ctx.args), None, None, None, None


class _SliceFeatures(torch.autograd.Function):
    """Forward: this rank's features of a replicated tensor; backward: all-gather of the ranks' gradients."""

    @staticmethod
    def forward(ctx, x, counts, rank, axis, group):
        ctx.args = (counts, rank, axis, group)
        return x.narrow(axis, sum(counts[:rank]), counts[rank]).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _GatherFeatures.apply(grad, *ctx.args), None, None, None, None


def _feature_chunks(tensor: torch.Tensor, parts: int, axis: int) -> torch.Tensor:
    """(parts, ...) with chunk p the p-th equal range of features along ``axis`` (a copy for ``axis`` -1)."""
    if axis == 0:
        return tensor.contiguous().view(parts, tensor.shape[0] // parts, *tensor.shape[1:])
    rows = math.prod(tensor.shape[:-1])
    return tensor.reshape(rows, parts, tensor.shape[-1] // parts).transpose(0, 1).contiguous()


class _ScatterSum(torch.autograd.Function):
    """Forward: reduce-scatter of the ranks' partial sums, rank p keeping the p-th equal range of
    features; backward: all-gather of the gradients (each rank's part fed every rank's sum)."""

    @staticmethod
    def forward(ctx, partial, parts, axis, group):
        ctx.args = (parts, axis, group)
        chunks = _feature_chunks(partial, parts, axis)
        mine = chunks.new_empty(chunks.shape[1:])
        _reduce_scatter_single(mine, chunks.flatten(0, 1), group=group)  # (gloo: no stacked form)
        return mine if axis == 0 else mine.view(*partial.shape[:-1], partial.shape[-1] // parts)

    @staticmethod
    def backward(ctx, grad):
        return _GatherChunks.apply(grad, *ctx.args), None, None, None


class _GatherChunks(torch.autograd.Function):
    """Forward: all-gather of equal feature ranges (rank p's the p-th); backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, part, parts, axis, group):
        ctx.args = (parts, axis, group)
        stacked = _gather_stack(part, parts, group)
        if axis == 0:
            return stacked.view(parts * part.shape[0], *part.shape[1:])
        return stacked.movedim(0, -2).reshape(*part.shape[:-1], parts * part.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        return _ScatterSum.apply(grad, *ctx.args), None, None, None


class ShardedBlockSparseLinear(torch.nn.Module):
    """y = x·W + b for a ``W`` too large for one device: each rank of ``group`` holds a part of its blocks.

    The layout is cut with :func:`bsmm.split_layout` into one contiguous part per rank,
    balanced by block count, and each rank multiplies with its part only:

    - ``by="columns"``: rank r holds the block columns of its output features
      (``split.features(r, block_size)``). It needs the whole input (``input="replicated"``);
      ``output="replicated"`` all-gathers the whole ``y`` on every rank, ``output="sharded"``
      returns this rank's output features only.
    - ``by="rows"``: rank r holds the block rows of its input features. ``input="replicated"``:
      ``x`` is whole and the rank takes its features; ``input="sharded"``: ``x`` holds only
      them (the sharded output of a ``by="columns"`` layer whose split has the same bounds).
      The ranks' partial sums are all-reduced (``output="replicated"``) or reduce-scattered
      (``output="sharded"``: rank r gets output features ``r*K/P`` to ``(r+1)*K/P``).

    Gradients follow tensor-parallel training's convention: every rank computes the same loss
    from replicated tensors (from sharded ones, each rank its share of a sum), and the
    gradients of each rank's weight and bias equal those of one process running the whole layer.

    Parameters
    ----------
    in_features, out_features : int
        Of the whole layer: ``layout.shape[0] * block_size`` and ``layout.shape[1] * block_size``.
    layout : (C // block_size, K // block_size) array or tensor of 0/1
        The whole layout, the same on every rank.
    block_size : int
    by : {"columns", "rows"}
    bias : bool
        A bias over this rank's output features (``by="rows"`` with a replicated output:
        the whole bias on every rank, added once after the sum).
    input, output : {"replicated", "sharded"}
    bounds : sequence of ints, optional
        Cut points for :func:`bsmm.split_layout` instead of balanced ones.
    group : ProcessGroup, optional
        The ranks that share the layer (default: the whole world); initialised beforehand.
    feature_axis, tf32, device, dtype
        As :class:`bsmm.torch.BlockSparseLinear`.

    Attributes
    ----------
    split : bsmm.LayoutSplit
        The cut; ``split.weight_index(rank)`` places this rank's blocks in the whole weight.
    weight : Parameter (blocks of this rank's part, block_size, block_size)
    bias : Parameter or None
    rank, parts : int

    Notes
    -----
    Initialization draws this rank's blocks from the distribution of the whole
    :class:`~bsmm.torch.BlockSparseLinear` (the fan-in of each output feature over the whole
    layout). Seed every rank of the group alike (``torch.manual_seed``), as data parallelism
    needs anyway: each part then draws from a stream of its own derived from that seed, and a
    replicated bias (``by="rows"``, ``output="replicated"``) is the same on every rank.
    :meth:`from_layer` copies a whole layer's values instead.

    Copies around the collectives: with ``feature_axis=1`` the features are the last axis, so
    gathering, scattering or slicing them copies the activations once; with ``feature_axis=0``
    only uneven parts are (padded and) copied. ``state_dict`` holds this rank's part and the cut
    (buffers ``bounds`` and ``part``), and loading another rank's or another cut's is refused;
    ``copy.deepcopy`` shares the process group; ``torch.save`` of the module itself cannot
    pickle a process group: save the ``state_dict``, or :meth:`full_weight`.

    Examples
    --------
    >>> import numpy as np, torch, torch.distributed as dist, bsmm.torch
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process, no port
    >>> layout = np.ones((4, 6))
    >>> whole = bsmm.torch.BlockSparseLinear(32, 48, layout, block_size=8)
    >>> layer = bsmm.torch.ShardedBlockSparseLinear.from_layer(whole, by="columns")
    >>> x = torch.randn(5, 32)
    >>> torch.allclose(layer(x), whole(x))
    True
    >>> dist.destroy_process_group()
    """

    def __init__(self, in_features: int, out_features: int, layout, block_size: int = 32, *, by: str = "columns",
                 bias: bool = True, input: str = "replicated", output: str = "replicated", bounds=None,
                 group=None, feature_axis: int = 1, tf32: bool = False, device=None, dtype=None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardedBlockSparseLinear needs torch.distributed initialised first: "
                               "torch.distributed.init_process_group(...)")
        if feature_axis not in (0, 1):
            raise ValueError(f"feature_axis must be 0 or 1; got {feature_axis!r}")
        block_size = check_block_size(block_size)
        layout = layout.detach().cpu().numpy() if isinstance(layout, torch.Tensor) else np.asarray(layout)
        self.group = group
        self.rank, self.parts = dist.get_rank(group), dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("group must contain this process: it is not one of the group's ranks")
        self.split: LayoutSplit = split_layer(layout, self.parts, block_size, by, input, output, bounds, "ranks")
        whole = self.split.layout
        for argument, value, expected in (("in_features", in_features, whole.shape[0] * block_size),
                                          ("out_features", out_features, whole.shape[1] * block_size)):
            if value != expected:
                raise ValueError(f"{argument} must be {expected} for a layout of shape {whole.shape} and "
                                 f"block_size {block_size}; got {value}")
        self.in_features, self.out_features, self.block_size = in_features, out_features, block_size
        self.by, self.input, self.output = by, input, output
        self.feature_axis, self.tf32 = feature_axis, tf32
        self._counts = self.split.feature_counts(block_size)

        index = block_index(self.split.part_layout(self.rank), block_size)
        self._registration = register(index)
        self._key = self._registration.key
        self._part_c, self._part_k = index.C, index.K

        dtype = torch.get_default_dtype() if dtype is None else dtype
        check_dtype(dtype, torch.empty(0, device=device).device, "dtype")
        # Saved with the weight, so a state_dict of another rank or cut is refused on load.
        self.register_buffer("bounds", torch.tensor(self.split.bounds, dtype=torch.int64, device=device))
        self.register_buffer("part", torch.tensor(self.rank, dtype=torch.int64, device=device))
        self.weight = torch.nn.Parameter(torch.empty(index.w_shape, device=device, dtype=dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(len(range(*self._bias_features().indices(out_features))),
                                                       device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def _bias_features(self) -> slice:
        """The whole layer's output features this rank's bias holds."""
        if self.by == "columns":
            return self.split.features(self.rank, self.block_size)
        if self.output == "sharded":
            share = self.out_features // self.parts
            return slice(self.rank * share, (self.rank + 1) * share)
        return slice(0, self.out_features)

    def reset_parameters(self) -> None:
        """Draw this rank's weight and bias as :class:`~bsmm.torch.BlockSparseLinear` draws the whole layer's."""
        bounds = fan_in_bounds(self.split.layout, self.block_size)
        columns = np.nonzero(self.split.layout)[1][self.split.weight_index(self.rank)]
        # Ranks seeded alike (as data parallelism needs) draw a replicated bias alike from PyTorch's
        # generator, and their parts from a stream each: one stream would give every part equal blocks.
        part_seed = int(torch.randint(2**62, (), dtype=torch.int64)) + 1 + self.rank
        generator = torch.Generator(device=self.weight.device).manual_seed(part_seed)
        with torch.no_grad():
            scale = torch.tensor(bounds[columns], dtype=self.weight.dtype, device=self.weight.device)
            self.weight.uniform_(-1.0, 1.0, generator=generator).mul_(scale.view(-1, 1, 1))
            if self.bias is not None:
                replicated = self.by == "rows" and self.output == "replicated"
                features = np.repeat(bounds, self.block_size)[self._bias_features()]
                self.bias.uniform_(-1.0, 1.0, generator=None if replicated else generator).mul_(
                    torch.tensor(features, dtype=self.bias.dtype, device=self.bias.device))

    @classmethod
    def from_layer(cls, layer, *, by: str = "columns", input: str = "replicated", output: str = "replicated",
                   bounds=None, group=None) -> "ShardedBlockSparseLinear":
        """This rank's part of a whole :class:`~bsmm.torch.BlockSparseLinear` (values copied; the
        layer's dtype, device, feature axis, TF32 choice and bias kept)."""
        if not isinstance(layer, BlockSparseLinear):
            raise TypeError(f"layer must be a bsmm.torch.BlockSparseLinear; got {type(layer).__name__}")
        sharded = cls(layer.in_features, layer.out_features, layer.op.layout, layer.op.block_size, by=by,
                      bias=layer.bias is not None, input=input, output=output, bounds=bounds, group=group,
                      feature_axis=layer.feature_axis, tf32=layer.tf32, device=layer.weight.device,
                      dtype=layer.weight.dtype)
        with torch.no_grad():
            index = torch.as_tensor(sharded.split.weight_index(sharded.rank), device=layer.weight.device)
            sharded.weight.copy_(layer.weight[index])
            if layer.bias is not None:
                sharded.bias.copy_(layer.bias[sharded._bias_features()])
        return sharded

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        bounds, part = state_dict.get(prefix + "bounds"), state_dict.get(prefix + "part")
        if bounds is not None and part is not None and (
                bounds.tolist() != list(self.split.bounds) or int(part) != self.rank):
            error_msgs.append(f"{prefix}weight: the state_dict holds part {int(part)} of a cut at {bounds.tolist()}, "
                              f"this layer is part {self.rank} of a cut at {list(self.split.bounds)}; load the "
                              f"state_dict this rank saved, or a whole layer's with from_layer")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def __deepcopy__(self, memo):
        # A process group cannot be copied (nor pickled): the copy shares this layer's.
        twin = self.__class__.__new__(self.__class__)
        memo[id(self)] = twin
        memo[id(self.group)] = self.group
        twin.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return twin

    def full_weight(self) -> torch.Tensor:
        """The whole layer's weight (nnzb, bs, bs) on every rank, gathered from the parts (a collective:
        every rank calls it). For checkpoints and checks; not differentiable."""
        parts = _gather_features(self.weight.detach(), self.split.blocks, 0, self.group)  # (in part order)
        return parts[torch.as_tensor(self.split.gather_index(), device=parts.device)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., C) -> y (..., K) (the features of ``input`` and ``output``), or features first with feature_axis=0."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
        axis = -1 if self.feature_axis == 1 else 0
        if self.by == "columns":
            y = matmul_by_key(_Replicate.apply(x, self.group), self.weight, self._key, self._part_c, self._part_k,
                              self.feature_axis, self.tf32)
            y = self._add_bias(y)
            if self.output == "replicated":
                y = _GatherFeatures.apply(y, self._counts, self.rank, axis, self.group)
            return y
        if self.input == "replicated":
            if x.dim() == 0 or x.shape[axis] != self.in_features:
                raise ValueError(f"x must have {self.in_features} features along axis {axis} (input='replicated'); "
                                 f"got shape {tuple(x.shape)}")
            x = _SliceFeatures.apply(x, self._counts, self.rank, axis, self.group)
        partial = matmul_by_key(x, self.weight, self._key, self._part_c, self._part_k, self.feature_axis, self.tf32)
        if self.output == "replicated":
            return self._add_bias(_SumParts.apply(partial, self.group))
        return self._add_bias(_ScatterSum.apply(partial, self.parts, axis, self.group))

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        # Out of place: after a collective, y may be a view made inside an autograd function.
        return y if self.bias is None else y + bias_along(self.bias, y, self.feature_axis)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block_size={self.block_size}, "
                f"by={self.by!r}, input={self.input!r}, output={self.output!r}, rank={self.rank}/{self.parts}, "
                f"blocks={self.split.blocks[self.rank]} of {sum(self.split.blocks)}, bias={self.bias is not None}")

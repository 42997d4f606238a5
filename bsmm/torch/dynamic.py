"""Layouts that change while a model trains: which blocks a :class:`~bsmm.torch.BlockSparseLinear` keeps is
decided again every few steps, with its number of blocks fixed.

- :func:`block_norms`: the L2 or max norm of each block of a layer's weight (zero where absent).
- :func:`gradient_block_norms`: the norms of every block of the dense gradient ``dW = xᵀ·dy``, absent
  blocks included (the growth signal), by dense products over a few block rows at a time, so the whole
  ``dW`` is never held.
- :func:`change_layout`: a layer moved to another layout of as many blocks. The weight's slots are
  reused: a kept block's values (its gradient, and the optimizer's state shaped like the weight, such as
  Adam's moments or SGD's momentum) move to its new slot, and a new block starts at zero or at the
  layer's initial distribution with zero state. The weight stays the same ``Parameter``, so an
  optimizer holding it needs nothing else.
- :class:`DynamicSparsity`: drop and regrow every ``every`` optimizer steps, hooked to the optimizer.
  RigL (Evci et al., 2020) grows the absent blocks of largest dense-gradient norm; SET (Mocanu et al.,
  2018) grows absent blocks at random. Both drop the present blocks of smallest weight norm.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import zlib

import numpy as np
import torch

from bsmm.block_index import BlockIndex, present_blocks
from bsmm.torch.layers import BlockSparseLinear, fan_in_bounds
from bsmm.torch.lstm import BlockSparseLSTM

__all__ = ["DynamicSparsity", "LayoutChange", "block_norms", "change_layout", "gradient_block_norms"]

NORMS = ("l2", "max")
ROUTES = ("auto", "dense", "gram")
CRITERIA = ("rigl", "set")
#: The layers whose layouts change: a linear layer's, an LSTM's recurrent (and shared input) layout.
DYNAMIC_LAYERS = (BlockSparseLinear, BlockSparseLSTM)
SCHEDULES = ("cosine", "constant")
INITS = ("zero", "fan_in")
#: Updates :attr:`DynamicSparsity.history` keeps.
HISTORY = 100
#: Bytes of one block row chunk of the dense gradient in :func:`gradient_block_norms`.
GRADIENT_CHUNK_BYTES = 256 * 2**20
#: Bytes of the float64 Gram matrices above which ``route="auto"`` takes the dense route.
GRAM_BYTES = 2**30


def layers_of(model_or_layers, optimizer: torch.optim.Optimizer, kinds: tuple, what: str) -> dict:
    """The layers of ``kinds`` (``what`` names them) by name: a model's modules, or the given layers by
    position (each checked); refused where there are none or ``optimizer`` does not hold a weight."""
    if isinstance(model_or_layers, torch.nn.Module):
        layers = {name: m for name, m in model_or_layers.named_modules() if isinstance(m, kinds)}
    else:
        layers = {str(i): layer for i, layer in enumerate(model_or_layers)}
        for name, layer in layers.items():
            if not isinstance(layer, kinds):
                raise TypeError(f"model_or_layers[{name}] must be a {what}; got {type(layer).__name__}")
    if not layers:
        raise ValueError(f"model_or_layers holds no {what}")
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name, layer in layers.items():
        if id(_weight_of(layer)) not in held:
            raise ValueError(f"optimizer does not hold the weight of layer {name!r}")
    return layers


def several_ranks(process_group) -> bool:
    """Whether ranks must change alike: ``torch.distributed`` initialised, more than one rank in
    ``process_group`` (None: the default group)."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size(process_group) > 1)


def broadcast_from_first(tensor: torch.Tensor, process_group) -> None:
    """``tensor`` overwritten in place by its value on ``process_group``'s rank 0 (None: the default group)."""
    first = torch.distributed.get_global_rank(process_group or torch.distributed.group.WORLD, 0)
    torch.distributed.broadcast(tensor, src=first, group=process_group)


def _check_choice(value, choices, argument: str) -> None:
    if value not in choices:
        raise ValueError(f"{argument} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _reduce_blocks(blocks: torch.Tensor, ord: str) -> torch.Tensor:
    """Norms over the last two axes of ``blocks`` (..., bs, bs), in float32."""
    blocks = blocks.float()
    if ord == "l2":
        return torch.linalg.vector_norm(blocks, dim=(-2, -1))
    return blocks.abs().amax(dim=(-2, -1))


def block_norms(layer: BlockSparseLinear | BlockSparseLSTM, ord: str = "l2") -> torch.Tensor:
    """(CB, KB) float32: the norm of each block of ``layer``'s weight in place, zero where a block is absent
    (a ``BlockSparseLSTM``: over its (H/bs, 4H/bs) recurrent layout, with ``Wx``'s blocks where it shares it,
    as :class:`DynamicSparsity` drops them).

    Examples
    --------
    >>> import numpy as np, torch, bsmm.torch
    >>> layer = bsmm.torch.BlockSparseLinear(64, 64, np.array([[1, 0], [0, 1]]), block_size=32, bias=False)
    >>> with torch.no_grad():
    ...     _ = layer.weight.fill_(0.5)
    >>> bsmm.torch.dynamic.block_norms(layer, "max").tolist()
    [[0.5, 0.0], [0.0, 0.5]]
    """
    _check_choice(ord, NORMS, "ord")
    if not isinstance(layer, DYNAMIC_LAYERS):
        raise TypeError(f"layer must be a bsmm.torch.BlockSparseLinear or BlockSparseLSTM; got {type(layer).__name__}")
    index = _index_of(layer)
    norms = torch.zeros(index.layout.shape, dtype=torch.float32, device=_weight_of(layer).device)
    rows = torch.tensor(index.rows, dtype=torch.long, device=norms.device)
    cols = torch.tensor(index.indices, dtype=torch.long, device=norms.device)
    norms[rows, cols] = _slot_norms(layer, ord).to(norms.device)
    return norms


def gradient_block_norms(x: torch.Tensor, dy: torch.Tensor, block_size: int, ord: str = "l2",
                         feature_axis: int = 1, group=None, route: str = "auto") -> torch.Tensor:
    """(C // block_size, K // block_size) float32: the norm of every block of ``dW = xᵀ·dy``.

    Parameters
    ----------
    x : (..., C) tensor, or (C, ...) with ``feature_axis=0``
        A layer's input.
    dy : (..., K) tensor, or (K, ...)
        The gradient of the loss with respect to the layer's output before any activation, of the same
        rows as ``x``.
    block_size : int
    ord : "l2" or "max"
    group : torch.distributed process group, optional
        Sum ``xᵀ·dy`` over its ranks (each holding its own rows) before taking norms: the norms of the
        whole batch's gradient. Every rank of the group must call this alike.
    route : "auto", "dense" or "gram"
        How the norms are computed (see Notes); "auto" takes the one of fewer operations.

    Notes
    -----
    ``"dense"``: the product runs in float32 over as many block rows of ``C`` at a time as fit in
    ``GRADIENT_CHUNK_BYTES`` (each chunk all-reduced in turn with ``group``), ``2·N·C·K`` operations
    for N rows. ``"gram"`` (L2 only, one process): the squared norm of block (c, k) is the sum of
    ``(X_c·X_cᵀ) ∘ (dY_k·dY_kᵀ)``, the N × N Gram matrices of the block's columns of ``x`` and ``dy``:
    ``2·N²·(C + K + C·K/bs²)`` operations, fewer where N is small beside ``bs²``, and no block of ``dW``
    is ever formed. Its sum of products of signed Gram entries cancels (the more so the more alike the rows
    are), so it runs in float64, where TF32 never applies and the cancellation costs digits float32 does not
    have. "auto" takes "gram" where it needs under half the operations and its float64 Gram matrices fit in
    ``GRAM_BYTES``.

    Examples
    --------
    >>> import torch, bsmm.torch
    >>> x, dy = torch.ones(3, 64), torch.ones(3, 32)
    >>> bsmm.torch.dynamic.gradient_block_norms(x, dy, 32).tolist()   # each block: 32 × 32 entries of 3
    [[96.0], [96.0]]
    """
    _check_choice(ord, NORMS, "ord")
    if feature_axis not in (0, 1):
        raise ValueError(f"feature_axis must be 0 or 1; got {feature_axis!r}")
    if feature_axis == 0:
        x, dy = x.movedim(0, -1), dy.movedim(0, -1)
    x, dy = x.reshape(-1, x.shape[-1]).float(), dy.reshape(-1, dy.shape[-1]).float()
    if x.shape[0] != dy.shape[0]:
        raise ValueError(f"x and dy must hold the same rows; got {x.shape[0]} and {dy.shape[0]}")
    c, k = x.shape[1], dy.shape[1]
    for argument, size in (("x's features", c), ("dy's features", k)):
        if size % block_size:
            raise ValueError(f"{argument} ({size}) must be a multiple of block_size {block_size}")
    _check_choice(route, ROUTES, "route")
    if route == "auto":
        route = "gram" if _gram_is_cheaper(x.shape[0], c, k, block_size, ord, group) else "dense"
    if route == "gram":
        if ord != "l2" or group is not None:
            raise ValueError("route='gram' takes L2 norms of one process's rows: ord='l2' and no group")
        return _gram_block_norms(x, dy, block_size)
    block_rows = max(1, GRADIENT_CHUNK_BYTES // (4 * block_size * k))
    norms = []
    for start in range(0, c // block_size, block_rows):
        stop = min(c // block_size, start + block_rows)
        part = x[:, start * block_size:stop * block_size].T @ dy  # ((stop - start)·bs, K)
        if group is not None:
            torch.distributed.all_reduce(part, group=group)
        part = part.reshape(stop - start, block_size, k // block_size, block_size).transpose(1, 2)
        norms.append(_reduce_blocks(part, ord))
    return torch.cat(norms)


def _gram_is_cheaper(n: int, c: int, k: int, block_size: int, ord: str, group) -> bool:
    """Whether the Gram route needs under half the dense route's operations, and fits its memory."""
    if ord != "l2" or group is not None or n == 0:
        return False
    gram_bytes = 8 * n * n * (c + k) // block_size
    gram_operations = 2 * n * n * (c + k + c * k // block_size ** 2)
    return gram_bytes <= GRAM_BYTES and 2 * gram_operations < 2 * n * c * k


def _gram_block_norms(x: torch.Tensor, dy: torch.Tensor, block_size: int) -> torch.Tensor:
    """The Gram route of :func:`gradient_block_norms` on (N, C) and (N, K) rows, in float64 (see its Notes)."""
    n = x.shape[0]
    x, dy = x.double(), dy.double()

    def grams(rows):  # (features / bs, N·N): each block column's N × N Gram matrix, flattened
        blocks = rows.reshape(n, -1, block_size).transpose(0, 1)  # (blocks, N, bs)
        return (blocks @ blocks.transpose(1, 2)).reshape(blocks.shape[0], n * n)

    squares = grams(x) @ grams(dy).T
    return squares.clamp_(min=0).sqrt_().float()


@dataclasses.dataclass(frozen=True)
class LayoutChange:
    """What :func:`change_layout` did to one layer.

    Attributes
    ----------
    dropped, grown : (n, 2) int arrays
        Block coordinates (block row, block column) removed and added.
    source : (nnzb,) int64 array
        For each slot of the new layout (row-major), the slot of the old layout its values came from,
        or -1 for a grown block.
    """

    dropped: np.ndarray
    grown: np.ndarray
    source: np.ndarray


def _moved(tensor: torch.Tensor, gather: torch.Tensor, grown: torch.Tensor,
           fresh: torch.Tensor | None = None) -> torch.Tensor:
    """``tensor``'s slots in the order ``gather`` gives, then the ``grown`` slots set to ``fresh`` (one
    entry a grown slot) or zeros: one gather of the whole tensor and a write of the grown slots alone."""
    moved = tensor.index_select(0, gather)
    return moved.index_fill_(0, grown, 0) if fresh is None else moved.index_copy_(0, grown, fresh)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded one (FSDP2's DTensor parameters and optimizer state; a collective:
    every rank calls it), else the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _write(target: torch.Tensor, whole: torch.Tensor) -> None:
    """``target`` (a tensor, or this rank's shard of a DTensor) set from the whole new value."""
    if hasattr(target, "to_local"):
        from torch.distributed.tensor import distribute_tensor

        # (every rank holds the same whole: each slices its own shard, nothing is sent)
        target.to_local().copy_(distribute_tensor(whole, target.device_mesh, target.placements,
                                                  src_data_rank=None).to_local())
    else:
        target.copy_(whole)


def change_layout(layer: BlockSparseLinear, layout, optimizer: torch.optim.Optimizer | None = None,
                  init: str = "zero", generator: torch.Generator | None = None) -> LayoutChange:
    """Move ``layer`` to ``layout``, a layout of the same shape and number of blocks, in place.

    Blocks present in both keep their values, gradient and optimizer state (moved to their new
    slots). A new block starts at zero (``init="zero"``) or drawn as the layer draws its weights at
    construction (``"fan_in"``, drawn with ``generator``: give every rank of a data-parallel run one
    seeded alike), with a zero gradient and zero optimizer state. The weight stays the same
    ``Parameter``. The optimizer's state tensors of one entry a block (Adam's moments, SGD's momentum,
    Adafactor's factors) are moved; scalars (step counts) are left as they are, and any other tensor
    state is refused before anything changes. A weight sharded by FSDP2 (``fully_shard``) is gathered, moved and
    re-sharded: every rank must call this alike. From its first change on, the layer computes under a
    moving layout key (:func:`bsmm.torch.registry.moving`): a model compiled after that needs no
    recompilation for later changes (see :class:`DynamicSparsity` for CUDA graphs). Change layouts between
    training steps: under a moving key, an eager backward pending across a change raises (a compiled one,
    where the weight was saved for it, meets PyTorch's own check of in-place changes).

    Examples
    --------
    >>> import numpy as np, torch, bsmm.torch
    >>> layer = bsmm.torch.BlockSparseLinear(64, 64, np.array([[1, 0], [0, 1]]), block_size=32, bias=False)
    >>> change = bsmm.torch.dynamic.change_layout(layer, np.array([[1, 1], [0, 0]]))
    >>> change.dropped.tolist(), change.grown.tolist(), change.source.tolist()
    ([[1, 1]], [[0, 1]], [0, -1])
    >>> float(layer.weight.detach()[1].abs().sum())
    0.0
    """
    if isinstance(layer, BlockSparseLSTM):  # its recurrent layout (bsmm.torch.dynamic_lstm)
        return _lstm().change_lstm_layout(layer, layout, optimizer, init, generator)
    if not isinstance(layer, BlockSparseLinear):
        raise TypeError(f"layer must be a bsmm.torch.BlockSparseLinear or BlockSparseLSTM; got {type(layer).__name__}")
    _check_choice(init, INITS, "init")
    if layer.gates is not None:
        raise ValueError("layer has gates (bsmm.torch.gate_layer): prune it by them first "
                         "(bsmm.torch.prune_by_gates), then change its layout")
    old = layer.op.index
    new_layout = np.asarray(layout.detach().cpu() if isinstance(layout, torch.Tensor) else layout) != 0
    if new_layout.shape != old.layout.shape:
        raise ValueError(f"layout must have the layer's layout shape {old.layout.shape}; got {new_layout.shape}")
    if int(new_layout.sum()) != old.nnzb:
        raise ValueError(f"layout must hold {old.nnzb} blocks, as the layer's does; got {int(new_layout.sum())}")
    change, cols = _slot_change(old, new_layout)
    if not len(change.dropped):  # the same layout: nothing moves, nothing is planned again
        return change
    slot_bounds = fan_in_bounds(new_layout.astype(np.uint8), layer.op.block_size)[cols] if init == "fan_in" else None
    _move_slots({"the weight": layer.weight}, optimizer, change, slot_bounds, generator)
    layer._adopt_layout(new_layout.astype(np.uint8), moving=True)
    return change


def _move_slots(weights: dict, optimizer, change: LayoutChange, slot_bounds: np.ndarray | None,
                generator) -> None:
    """Move each of ``weights`` (name -> the Parameter), its gradient and its per-slot optimizer state to the
    new slots ``change.source`` gives; a grown slot gets zeros, or, given each new slot's bound
    ``slot_bounds`` (``init="fan_in"``), a weight's grown slot is drawn from U(±bound) with ``generator``.
    The optimizer's per-block state (the weight's shape, or per-slot factors such as Adafactor's) moves
    with the blocks; state of any other shape cannot be followed, so it is refused before anything
    changes."""
    nnzb = len(change.source)
    per_slot = []
    for name, weight in weights.items():
        for key, value in (optimizer.state.get(weight, {}).items() if optimizer is not None else ()):
            if isinstance(value, torch.Tensor) and value.dim() >= 1:
                if value.shape[0] != nnzb:
                    raise ValueError(f"the optimizer's state {key!r} of {name} has shape {tuple(value.shape)}, not "
                                     f"one entry a block ({nnzb}, ...): change_layout cannot move it with the blocks")
                per_slot.append(value)
    grown_slots = np.flatnonzero(change.source < 0)
    host = torch.as_tensor(np.concatenate([np.maximum(change.source, 0), grown_slots]))
    uploaded = {}

    def tables(device):  # (gather, grown) on ``device``: one upload a device
        if device not in uploaded:
            on = host.to(device)
            uploaded[device] = (on[:nnzb], on[nnzb:])
        return uploaded[device]

    with torch.no_grad():
        for weight in weights.values():
            whole = _whole(weight)
            fresh = None
            if slot_bounds is not None:  # drawn for the grown blocks only
                fresh = torch.empty((len(grown_slots), *whole.shape[1:]), dtype=whole.dtype, device=whole.device)
                fresh.uniform_(-1.0, 1.0, generator=generator).mul_(
                    torch.as_tensor(slot_bounds[grown_slots], dtype=whole.dtype).to(whole.device).view(-1, 1, 1))
            _write(weight, _moved(whole, *tables(whole.device), fresh))
            if weight.grad is not None:
                gradient = _whole(weight.grad)
                _write(weight.grad, _moved(gradient, *tables(gradient.device)))
        for value in per_slot:
            value_whole = _whole(value)
            _write(value, _moved(value_whole, *tables(value_whole.device)))


def _coordinates(mask: np.ndarray) -> np.ndarray:
    """(n, 2) int64 (block row, block column) of ``mask``'s true entries, row-major: ``np.argwhere``."""
    return np.stack(present_blocks(mask), axis=1)


def _slot_change(old: BlockIndex, new_layout: np.ndarray) -> tuple[LayoutChange, np.ndarray]:
    """The :class:`LayoutChange` from ``old`` to ``new_layout`` (bool, as many blocks), and the block column of
    each new slot. (From the two indices' lists: the grid is scanned once, for the new one.)"""
    rows, cols = present_blocks(new_layout)  # row-major: the new index's slot order
    slots = np.full(old.layout.shape, -1, dtype=np.int64)
    slots[old.rows, old.indices] = np.arange(old.nnzb)
    source = slots[rows, cols]
    gone = ~new_layout[old.rows, old.indices]  # (storage order is row-major, as np.argwhere's)
    grown = source < 0
    change = LayoutChange(dropped=np.stack([old.rows[gone], old.indices[gone]], axis=1).astype(np.int64),
                          grown=np.stack([rows[grown], cols[grown]], axis=1), source=source)
    return change, cols


def _smallest(scores: np.ndarray, count: int) -> np.ndarray:
    """Indices of the ``count`` smallest ``scores``; ties to the earlier index."""
    return np.argsort(scores, kind="stable")[:count]


class DynamicSparsity:
    """Prune and regrow the blocks of a model's :class:`~bsmm.torch.BlockSparseLinear` layers (and
    :class:`~bsmm.torch.BlockSparseLSTM` recurrent layouts, :mod:`bsmm.torch.dynamic_lstm`) while it trains.

    After every ``every``-th step of ``optimizer`` (until ``end`` steps, if given), each layer drops
    ``round(f · nnzb)`` of its present blocks, those of smallest weight norm, and grows as many of its
    absent blocks. Blocks dropped in that update are not regrown in it. ``f`` is ``drop_fraction``
    (``schedule="constant"``) or decays from it to 0 at ``end`` as ``f/2 · (1 + cos(π t / end))``
    (``"cosine"``, RigL's). Each layer keeps its number of blocks: see :func:`change_layout` for how
    values and optimizer state move.

    Parameters
    ----------
    model_or_layers : torch.nn.Module or iterable of BlockSparseLinear and BlockSparseLSTM
        A model (its ``BlockSparseLinear`` and ``BlockSparseLSTM`` modules, by name) or the layers themselves.
    optimizer : torch.optim.Optimizer
        Holding the layers' weights; the update runs in its step post-hook.
    criterion : "rigl" or "set"
        How blocks grow: the largest norms of the dense gradient ``xᵀ·dy`` of the step's batch
        (captured by hooks on the layers during the step before an update; a layer with a fused
        activation is refused), or uniformly at random.
    drop_fraction : float in (0, 1)
    every : int
        Optimizer steps between updates.
    end : int, optional
        The step after which the layouts stay fixed; required by ``schedule="cosine"``.
    init : "zero" or "fan_in"
        A grown block's values (:func:`change_layout`).
    ord : "l2" or "max"
        The block norm of both choices.
    seed : int
        SET's generator, and the fan-in draws of grown blocks.
    grace : int
        Updates after its growth during which a block is not dropped. 0 (RigL's and SET's rule): any present
        block may go. Then the drop by weight norm takes the blocks the last update grew, which start small
        (at zero with ``init="zero"``), before any block of the starting layout: after the first update, the
        updates only trade the grown slots among themselves (``results/v27/learned_structure_cpu_study.md``,
        where ``grace=1`` held more of the dense gradient and trained to a worse loss).
    process_group : torch.distributed process group, optional
        The ranks that change alike (default: every rank, where ``torch.distributed`` is initialised).

    Notes
    -----
    Under ``torch.distributed`` with more than one process, rank 0's new layouts are broadcast, so that
    every rank changes alike (DDP, and FSDP2's sharded weights, which are gathered and re-sharded). RigL
    grows by the norms of the whole batch's gradient: each rank's ``xᵀ·dy`` is summed over the ranks, a
    block row at a time, before the norms are taken. To resume such a run, load the checkpoint on every rank:
    ``load_state_dict`` adopts the saved layouts, but DDP's broadcast of buffers writes the ``layout``
    buffer without changing the layer. Every rank of the group must take the same optimizer steps: the
    update's collectives run inside ``optimizer.step()`` (under FSDP2 use ``ShardedGradScaler``, which skips
    a step on every rank alike). With pipeline parallelism, pass each stage's data-parallel group as
    ``process_group``.

    Under ``torch.compile``, the layers compute under moving layout keys, which this constructor
    gives them (:func:`bsmm.torch.registry.moving`; a model compiled before compiles once more;
    :meth:`remove` gives the content keys back): the compiled code holds the key and computes with each new
    layout, with no recompilation. Under CUDA graphs that ``torch.compile`` recorded in this thread
    (``mode="reduce-overhead"``; :func:`bsmm.torch.registry.cuda_graphs_recorded`) a change gives the
    layer a new key instead, so that no replay launches with the old layout: the model then compiles again
    after every update, and after ``torch._dynamo.config.recompile_limit`` updates (8 by default) Dynamo
    runs it eagerly, or raises under ``fullgraph=True``. Graphs recorded in another thread, by the older
    ``cudagraph_trees=False`` path, or captured by the caller (``torch.cuda.graph``) are not seen: capture
    them again after an update. A ``BlockSparseLSTM`` refuses to change under recorded CUDA graphs, and
    takes RigL eagerly only (its capture raises under ``torch.compile``: use ``criterion="set"`` there).
    RigL's capture breaks the graph in the step before an update. Optimizer state moves with its blocks
    (:func:`change_layout`); a grown block starts with zero moments while Adam's step count goes on, so
    its first steps are about ``lr`` in size. Each change builds the layer's block index on the host, and
    its passes are planned again on first use.

    Examples
    --------
    >>> import torch, bsmm.torch
    >>> model = torch.nn.Sequential(bsmm.torch.BlockSparseLinear(64, 64, density=0.5, block_size=32, seed=0))
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> sparsity = bsmm.torch.DynamicSparsity(model, optimizer, criterion="set", drop_fraction=0.5, every=2,
    ...                                       schedule="constant")
    >>> for _ in range(2):
    ...     model(torch.randn(8, 64)).square().sum().backward()
    ...     optimizer.step()
    >>> sparsity.steps, len(sparsity.history), int(model[0].layout.sum())
    (2, 1, 2)
    """

    def __init__(self, model_or_layers, optimizer: torch.optim.Optimizer, *, criterion: str = "rigl",
                 drop_fraction: float = 0.3, every: int = 100, end: int | None = None, schedule: str = "cosine",
                 init: str = "zero", ord: str = "l2", seed: int = 0, grace: int = 0, process_group=None):
        if criterion == "magnitude":
            raise ValueError("criterion='magnitude' prunes without regrowing, so the number of blocks falls: use "
                             "bsmm.torch.GradualPruning (DynamicSparsity keeps each layer's number of blocks)")
        _check_choice(criterion, CRITERIA, "criterion")
        _check_choice(schedule, SCHEDULES, "schedule")
        _check_choice(init, INITS, "init")
        _check_choice(ord, NORMS, "ord")
        if isinstance(drop_fraction, bool) or not isinstance(drop_fraction, (int, float)) or not 0 < drop_fraction < 1:
            raise ValueError(f"drop_fraction must be a number in (0, 1); got {drop_fraction!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int; got {every!r}")
        if end is not None and (isinstance(end, bool) or not isinstance(end, int) or end < 1):
            raise ValueError(f"end must be a positive int or None; got {end!r}")
        if schedule == "cosine" and end is None:
            raise ValueError("schedule='cosine' decays to 0 at end: pass end=, or schedule='constant'")
        self.layers = layers_of(model_or_layers, optimizer, DYNAMIC_LAYERS,
                                "bsmm.torch.BlockSparseLinear or BlockSparseLSTM")
        for name, layer in self.layers.items():
            if criterion == "rigl" and getattr(layer, "activation", None) is not None:
                raise ValueError(f"criterion='rigl' needs the gradient before the activation; layer {name!r} fuses "
                                 f"activation {layer.activation!r}: use criterion='set' or an unfused activation")
            if getattr(layer, "gates", None) is not None:
                raise ValueError(f"layer {name!r} has gates (bsmm.torch.gate_layer): gates and DynamicSparsity are "
                                 "two ways of choosing blocks; prune the layer by its gates first")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int; got {seed!r}")
        if isinstance(grace, bool) or not isinstance(grace, int) or grace < 0:
            raise ValueError(f"grace must be a non-negative int; got {grace!r}")
        self.optimizer, self.criterion, self.drop_fraction, self.every, self.end = (
            optimizer, criterion, float(drop_fraction), every, end)
        self.schedule, self.init, self.ord = schedule, init, ord
        self.seed, self.generator = seed, np.random.default_rng(seed)
        self.process_group = process_group
        self.steps, self.grace, self.updates = 0, grace, 0
        #: Per layer, the update (1, 2, ...) that last grew each block of its layout grid; 0 where none did.
        self.grown_at = {name: np.zeros(_index_of(layer).layout.shape, dtype=np.int64)
                         for name, layer in self.layers.items()}
        #: The last :data:`HISTORY` updates' changes, by layer name.
        self.history: collections.deque[dict[str, LayoutChange]] = collections.deque(maxlen=HISTORY)
        self._captured: dict[str, list] = {}
        # The weights the optimizer holds (under FSDP2 the sharded parameters, whose .grad outlives a backward)
        self._held = {name: _weight_of(layer) for name, layer in self.layers.items()}
        self._capturing = False  # read by the hooks: one flag (set by _arm)
        for layer in self.layers.values():
            layer._moving_registration()
        self._arm()
        self._handles = [optimizer.register_step_post_hook(self._after_step)]
        if criterion == "rigl":
            self._handles += [layer.register_gradient_capture(_lstm().gradient_capture(self, name))
                              if isinstance(layer, BlockSparseLSTM)
                              else layer.register_forward_hook(self._capture_hook(name))
                              for name, layer in self.layers.items()]

    def fraction(self, step: int) -> float:
        """The fraction of each layer's blocks replaced at the update after optimizer step ``step``."""
        if self.end is not None and step > self.end:
            return 0.0
        if self.schedule == "constant":
            return self.drop_fraction
        return self.drop_fraction / 2 * (1 + math.cos(math.pi * step / self.end))

    def _updates_after(self, step: int) -> bool:
        return step % self.every == 0 and (self.end is None or step <= self.end) and self.fraction(step) > 0

    def _arm(self) -> None:
        """Capture in the coming step exactly when RigL updates after it."""
        self._capturing = self.criterion == "rigl" and self._updates_after(self.steps + 1)

    def _capture_hook(self, name: str):
        def hook(module, inputs, output):
            if not (self._capturing and torch.is_grad_enabled() and output.requires_grad):
                return
            if self._held[name].grad is None:
                # Gradients thrown away since the captured forwards' backward (zero_grad after a step GradScaler
                # skipped): those entries are stale. Forwards not yet backpropagated (dy None) stay.
                self._captured[name] = [e for e in self._captured.get(name, []) if e[1] is None]
            entry = [inputs[0].detach(), None]
            self._captured.setdefault(name, []).append(entry)

            def keep_gradient(grad):  # summed over backward passes through this forward, as weight.grad is
                entry[1] = grad.detach() if entry[1] is None else entry[1] + grad.detach()
            output.register_hook(keep_gradient)
        return hook

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        try:
            if self._updates_after(self.steps):
                self.update()
        finally:
            self._captured.clear()
            self._arm()

    def state_dict(self) -> dict:
        """The steps taken and SET's generator, to resume with :meth:`load_state_dict` (the layouts
        themselves travel in the model's ``state_dict``: rebuild with :func:`bsmm.torch.load_layouts`)."""
        return {"steps": self.steps, "seed": self.seed, "generator": self.generator.bit_generator.state,
                "updates": self.updates, "grown_at": {name: a.copy() for name, a in self.grown_at.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.seed = int(state["steps"]), int(state["seed"])
        self.generator.bit_generator.state = state["generator"]
        self.updates = int(state.get("updates", 0))  # (saved before grace existed: no block is protected)
        for name, grown in state.get("grown_at", {}).items():
            if name in self.grown_at:
                self.grown_at[name] = np.array(grown, dtype=np.int64)
        self._arm()

    def remove(self) -> None:
        """Detach from the optimizer and the layers (captured activations freed): the layouts stay as they are,
        and the layers go back to their layouts' content keys (a compiled model compiles once more; caches and
        exported programs then name layouts any process can resolve)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._captured.clear()
        self._capturing = False
        for layer in self.layers.values():
            layer._content_registration()

    def _growth_scores(self, name: str, layer: BlockSparseLinear) -> np.ndarray:
        if self.criterion == "set":
            return self.generator.random(_index_of(layer).layout.shape)
        # Forwards whose output reached no loss (dy None) and overflowed ones (a step GradScaler skipped) are left out.
        entries = [(x, dy) for x, dy in self._captured.get(name, []) if dy is not None and bool(dy.isfinite().all())]
        captured = len(entries) > 0
        if several_ranks(self.process_group):  # every rank raises alike, rather than some wait in a collective
            flag = torch.tensor(int(captured), device=_weight_of(layer).device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self.process_group)
            captured = bool(flag.item())
        if not captured:
            raise RuntimeError(f"criterion='rigl': no gradient of the output of layer {name!r} was captured in step "
                               f"{self.steps} (on some rank); each update needs a forward and backward through every "
                               f"layer")
        # Several ranks: the norms of the whole batch's xᵀ·dy, each rank's rows summed (RigL's dense gradient).
        group = (self.process_group or torch.distributed.group.WORLD) if several_ranks(self.process_group) else None
        if isinstance(layer, BlockSparseLSTM):  # entries of (h_in, x) and dz rows: dWh (and dWx)
            return _lstm().growth_scores(entries, layer, self.ord, group)

        def rows(tensor):  # (rows, features), whichever axis the layer takes its features on
            features = tensor if layer.feature_axis else tensor.movedim(0, -1)
            return features.reshape(-1, features.shape[-1])

        x = torch.cat([rows(x) for x, _ in entries])
        dy = torch.cat([rows(dy) for _, dy in entries])
        return gradient_block_norms(x, dy, layer.op.block_size, self.ord, group=group).cpu().numpy()

    def _check_ranks_agree(self) -> None:
        """Raise alike on every rank unless every rank holds the same layouts, each layer's buffer as it
        computes (a checkpoint loaded on one rank only, under DDP, would leave the others' layers behind)."""
        device = _weight_of(next(iter(self.layers.values()))).device
        digests = []
        for layer in self.layers.values():
            computed = _index_of(layer).layout != 0
            same = np.array_equal(_layout_buffer_of(layer).detach().cpu().numpy() != 0, computed)
            digests.append(zlib.crc32(np.packbits(computed).tobytes()) if same else -1)
        low = torch.tensor(digests, dtype=torch.int64, device=device)
        high = low.clone()
        torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN, group=self.process_group)
        torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX, group=self.process_group)
        differ = [name for name, a, b in zip(self.layers, low.tolist(), high.tolist()) if a != b or a < 0]
        if differ:
            raise RuntimeError(f"the ranks' layouts of layers {differ} differ, or a layer's layout buffer no longer "
                               f"equals the layout it computes with: load a checkpoint of changed layouts on every "
                               f"rank (load_state_dict adopts them) before training on")

    def decide(self, name: str, layer: BlockSparseLinear, fraction: float) -> np.ndarray:
        """The layout ``layer`` moves to at this update (see the class notes)."""
        index = _index_of(layer)
        present = index.layout != 0
        absent = _coordinates(~present)
        count = min(round(fraction * index.nnzb), len(absent))
        if count == 0:
            return present.astype(np.uint8)
        norms = _slot_norms(layer, self.ord).cpu().numpy()
        if self.grace:  # blocks grown in the last `grace` updates stay
            kept = self.grown_at[name][index.rows, index.indices] > self.updates - self.grace
            count = min(count, int((~kept).sum()))
            norms = np.where(kept, np.inf, norms)
        dropped = _smallest(norms, count)  # by slot
        scores = self._growth_scores(name, layer)
        grown = absent[_smallest(-scores[absent[:, 0], absent[:, 1]], count)]
        layout = present.copy()
        layout[index.rows[dropped], index.indices[dropped]] = False
        layout[grown[:, 0], grown[:, 1]] = True
        return layout.astype(np.uint8)

    def update(self) -> dict[str, LayoutChange]:
        """Drop and regrow every layer now (the post-step hook calls it every ``every`` steps). Every layer's
        new layout is decided before any layer changes."""
        fraction = self.fraction(self.steps)
        if several_ranks(self.process_group):
            self._check_ranks_agree()
        layouts = {name: self.decide(name, layer, fraction) for name, layer in self.layers.items()}
        if several_ranks(self.process_group):
            for name, layer in self.layers.items():
                shared = torch.as_tensor(layouts[name], device=_weight_of(layer).device)
                broadcast_from_first(shared, self.process_group)
                layouts[name] = shared.cpu().numpy()
        changes = {}
        for number, (name, layer) in enumerate(self.layers.items()):
            # (fan-in draws seeded by the run's seed, the step and the layer: alike on every rank)
            seed = np.random.SeedSequence([self.seed, self.steps, number]).generate_state(1, np.uint64)[0]
            generator = torch.Generator(_weight_of(layer).device).manual_seed(int(seed) % 2**63)
            changes[name] = change_layout(layer, layouts[name], self.optimizer, self.init, generator)
        self.updates += 1
        for name, change in changes.items():
            self.grown_at[name][change.grown[:, 0], change.grown[:, 1]] = self.updates
        self.history.append(changes)
        return changes


# -- a linear layer or an LSTM (bsmm.torch.dynamic_lstm): what an update reads of each ---------------------------
def _lstm():
    """:mod:`bsmm.torch.dynamic_lstm`, imported on first use (it imports this module)."""
    from bsmm.torch import dynamic_lstm  # (lazily: it imports this module)

    return dynamic_lstm


def _weight_of(layer) -> torch.nn.Parameter:
    """The weight whose blocks the layout places: an LSTM's ``Wh``."""
    return layer.weight_hh if isinstance(layer, BlockSparseLSTM) else layer.weight


def _index_of(layer):
    """The block index of the changing layout."""
    return layer._recurrent.index if isinstance(layer, BlockSparseLSTM) else layer.op.index


def _layout_buffer_of(layer) -> torch.Tensor:
    return layer.recurrent_layout if isinstance(layer, BlockSparseLSTM) else layer.layout


def _slot_norms(layer, ord: str) -> torch.Tensor:
    """(nnzb,) each present block's norm: the drop criterion."""
    if isinstance(layer, BlockSparseLSTM):
        return _lstm().slot_norms(layer, ord)
    return _reduce_blocks(_whole(layer.weight.detach()), ord)

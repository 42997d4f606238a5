"""Gradual magnitude pruning while a model trains (Zhu and Gupta, 2017, "To prune, or not to prune"): the
fraction of each layer's blocks kept falls from 1 to a final density on a cubic schedule, the blocks of
smallest weight norm going first, and stays there.

A pruned block is closed by a fixed 0/1 gate (:class:`BlockMask`, the layer's ``gates``): on CUDA the kernels
skip it in the forward, dx and dW with the plan they have, so the work falls as blocks close, with no
re-planning and no recompilation. Its weight and its optimizer state are set to zero when it closes.
:meth:`GradualPruning.compact` then gives layers of the kept blocks only (a smaller layout, planned anew).
:class:`bsmm.torch.DynamicSparsity` differs: it keeps each layer's number of blocks and moves them.
"""

from __future__ import annotations

import numpy as np
import torch

from bsmm.torch.dynamic import (NORMS, _check_choice, _slot_norms, _smallest, _whole, _write, broadcast_from_first,
                                layers_of, several_ranks)
from bsmm.torch.gates import layer_of_blocks
from bsmm.torch.layers import BlockSparseLinear

__all__ = ["BlockMask", "GradualPruning"]


class BlockMask(torch.nn.Module):
    """Fixed per-block gates of 1 (kept) and 0 (pruned), as a layer's ``gates``: the layer computes
    ``x·(m ⊙ W) + b``. A closed gate takes no gradient, so the weight gradient's pass skips those blocks too.

    Attributes
    ----------
    mask : buffer (blocks,), float32

    Examples
    --------
    >>> import bsmm.torch
    >>> bsmm.torch.BlockMask(3)().tolist()
    [1.0, 1.0, 1.0]
    """

    closed_gradient_is_zero = True  # (read by BlockSparseLinear.forward: a constant has no gradient at all)

    def __init__(self, blocks: int, device=None):
        super().__init__()
        self.register_buffer("mask", torch.ones(blocks, device=device, dtype=torch.float32))

    def forward(self) -> torch.Tensor:
        return self.mask

    def kept(self) -> torch.Tensor:
        """(blocks,) bool: the blocks not pruned."""
        return self.mask > 0


class GradualPruning:
    """Prune the blocks of a model's :class:`~bsmm.torch.BlockSparseLinear` layers by weight norm while it
    trains, down to ``density`` of each layer's blocks.

    After every ``every``-th step of ``optimizer`` from ``start`` to ``end``, each layer keeps
    ``round(d_t · nnzb)`` of its blocks, ``d_t = density + (1 − density)(1 − (t − start)/(end − start))³``,
    closing the open blocks of smallest norm (their weights and per-block optimizer state set to 0). Under
    ``torch.distributed``, rank 0's masks are broadcast, so that every rank prunes alike.

    Parameters
    ----------
    model_or_layers : torch.nn.Module or iterable of BlockSparseLinear
    optimizer : torch.optim.Optimizer
        Holding the layers' weights; the pruning runs in its step post-hook.
    density : float in (0, 1)
        The fraction of each layer's blocks kept at ``end``.
    end : int
        The step of the last pruning.
    start : int
        The step before the first pruning (0: prune from the first ``every`` steps on).
    every : int
        Optimizer steps between prunings.
    ord : "l2" or "max"
        The block norm.
    process_group : torch.distributed process group, optional

    Examples
    --------
    >>> import torch, bsmm.torch
    >>> model = torch.nn.Sequential(bsmm.torch.BlockSparseLinear(64, 64, density=1.0, block_size=16, seed=0))
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> pruning = bsmm.torch.GradualPruning(model, optimizer, density=0.25, end=4, every=2)
    >>> for _ in range(4):
    ...     model(torch.randn(8, 64)).square().sum().backward()
    ...     optimizer.step()
    >>> int(model[0].gates.kept().sum()), pruning.compact(model)["0"].op.blocks
    (4, 4)
    """

    def __init__(self, model_or_layers, optimizer: torch.optim.Optimizer, *, density: float, end: int,
                 start: int = 0, every: int = 100, ord: str = "l2", process_group=None):
        _check_choice(ord, NORMS, "ord")
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density < 1:
            raise ValueError(f"density must be a number in (0, 1); got {density!r}")
        for name, value, low in (("start", start, 0), ("every", every, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}; got {value!r}")
        if isinstance(end, bool) or not isinstance(end, int) or end <= start:
            raise ValueError(f"end must be an int > start ({start}); got {end!r}")
        self.layers = layers_of(model_or_layers, optimizer, (BlockSparseLinear,), "bsmm.torch.BlockSparseLinear")
        for name, layer in self.layers.items():
            if getattr(layer, "gates", None) is not None and not isinstance(layer.gates, BlockMask):
                raise ValueError(f"layer {name!r} has gates (bsmm.torch.gate_layer): prune it by them, or remove them")
        self.optimizer, self.density, self.end, self.start, self.every, self.ord = (
            optimizer, float(density), end, start, every, ord)
        self.process_group, self.steps = process_group, 0
        for layer in self.layers.values():
            if getattr(layer, "gates", None) is None:  # (a mask already there: a resumed run's, kept)
                layer.gates = BlockMask(layer.op.blocks, device=layer.weight.device)
        self._handle = optimizer.register_step_post_hook(self._after_step)

    def density_at(self, step: int) -> float:
        """The fraction of each layer's blocks kept after the pruning at optimizer step ``step``."""
        if step <= self.start:
            return 1.0
        progress = min(1.0, (step - self.start) / (self.end - self.start))
        return self.density + (1 - self.density) * (1 - progress) ** 3

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        if (self.start < self.steps <= self.end and (self.steps - self.start) % self.every == 0) or self.steps == self.end:
            self.update()

    def update(self) -> dict[str, int]:
        """Prune every layer to :meth:`density_at` the current step now; returns the blocks each closed."""
        kept = self.density_at(self.steps)
        closed = {}
        for name, layer in self.layers.items():
            mask = layer.gates.mask
            open_now = mask.detach().cpu().numpy() > 0
            target = max(1, round(kept * layer.op.blocks)) if layer.op.blocks else 0
            count = int(open_now.sum()) - target
            new = open_now.copy()
            if count > 0:
                norms = np.where(open_now, _slot_norms(layer, self.ord).cpu().numpy(), np.inf)
                new[_smallest(norms, count)] = False
            shared = torch.as_tensor(new, dtype=torch.float32, device=mask.device)
            if several_ranks(self.process_group):
                broadcast_from_first(shared, self.process_group)
            closing = (mask > 0) & (shared == 0)
            closed[name] = int(closing.sum())
            if closed[name]:
                self._zero(layer, closing)
            with torch.no_grad():
                mask.copy_(shared)
        return closed

    def _zero(self, layer: BlockSparseLinear, closing: torch.Tensor) -> None:
        """The closing blocks' weights and per-block optimizer state (Adam's moments, ...) set to 0: a pruned
        block neither computes nor keeps moving under momentum."""
        tensors = [layer.weight] + [value for value in self.optimizer.state.get(layer.weight, {}).values()
                                    if isinstance(value, torch.Tensor) and value.dim() >= 1
                                    and value.shape[0] == layer.op.blocks]
        with torch.no_grad():
            for tensor in tensors:
                whole = _whole(tensor)
                _write(tensor, whole.masked_fill(closing.to(whole.device).view(-1, *[1] * (whole.dim() - 1)), 0))

    def compact(self, model: torch.nn.Module | None = None) -> dict[str, BlockSparseLinear]:
        """New layers of each layer's kept blocks (no gates; the same outputs), by layer name; with ``model``
        (the one the layers were found in), they also replace the pruned layers in it. Pass the new
        parameters to a new optimizer."""
        compacted = {name: layer_of_blocks(layer, layer.gates.kept().cpu().numpy()) for name, layer in self.layers.items()}
        if model is not None:
            for name, layer in compacted.items():
                parent_name, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        return compacted

    def state_dict(self) -> dict:
        """The steps taken (the masks travel in the model's ``state_dict``, as ``gates.mask``)."""
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])

    def remove(self) -> None:
        """Detach from the optimizer; the masks stay on the layers."""
        self._handle.remove()

"""Per-block gates: a learnable scale on each block of a :class:`~bsmm.torch.BlockSparseLinear`, with an L0
penalty that drives a fraction of the gates to exactly zero (Louizos, Welling and Kingma, 2018, "Learning
Sparse Neural Networks through L0 Regularization": hard-concrete gates).

The gated layer computes ``y = x·(g ⊙ W) + b``, where ``g`` holds one gate per present block. Its
gradients are ``dx = dy·(g ⊙ W)ᵀ``, ``dW = g ⊙ (xᵀ·dy)`` and ``dg_j = ⟨W_j, (xᵀ·dy)_j⟩``: the seed's
semantics. The gate scales the weight's blocks before the product, and on CUDA the kernels then skip
the blocks whose gate is 0: in the forward, in dx and, as a closed hard-concrete gate's derivative is
0, in dW (``cuda/bsmm_gates.cuh``), with the same plan. :func:`prune_by_gates` builds a layer of only
the blocks whose gates are not zero.

- :class:`BlockGates`: the gates of one layer. Training samples them, evaluation takes their
  deterministic value, and :meth:`~BlockGates.penalty` gives the expected number of non-zero gates or
  the distance of their expected fraction from a target density.
- :func:`gate_layer` attaches gates to a layer, which then uses them in every forward.
- :func:`prune_by_gates`: a new layer of the kept blocks, their weights scaled by their gates.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from bsmm.torch.layers import BlockSparseLinear

__all__ = ["BlockGates", "gate_layer", "layer_of_blocks", "prune_by_gates"]


class BlockGates(torch.nn.Module):
    """Hard-concrete gates, one per block: ``z = min(1, max(0, s·(ζ − γ) + γ))``.

    In training, ``s = sigmoid((log u − log(1 − u) + log_alpha) / β)`` with ``u ~ U(0, 1)``, a draw each
    call. In evaluation, ``s = sigmoid(log_alpha)``.

    Parameters
    ----------
    blocks : int
        The number of gates (a layer's ``op.blocks``).
    density : float in (0, 1]
        The probability that a gate is non-zero at the start; it sets ``log_alpha``.
    beta, gamma, zeta : float
        The temperature and the stretch of the hard concrete (the paper's 2/3, -0.1, 1.1).

    Attributes
    ----------
    log_alpha : Parameter (blocks,)

    Examples
    --------
    >>> import torch, bsmm.torch
    >>> gates = bsmm.torch.BlockGates(4, density=0.9).eval()
    >>> gates().shape, round(gates.expected_density().item(), 2)
    (torch.Size([4]), 0.9)
    """

    #: A closed gate (0) is clamped there, so its derivative is 0: a gated layer's weight-gradient
    #: pass may skip the closed blocks too (:func:`bsmm.torch.functional.matmul_by_key`).
    closed_gradient_is_zero = True

    def __init__(self, blocks: int, density: float = 0.9, *, beta: float = 2 / 3, gamma: float = -0.1,
                 zeta: float = 1.1, device=None, dtype=None):
        super().__init__()
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
            raise ValueError(f"blocks must be a positive int; got {blocks!r}")
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ValueError(f"density must be a number in (0, 1]; got {density!r}")
        if not (beta > 0 and gamma < 0 and zeta > 1):
            raise ValueError(f"beta must be > 0, gamma < 0 and zeta > 1; got {beta}, {gamma}, {zeta}")
        self.beta, self.gamma, self.zeta, self.density = float(beta), float(gamma), float(zeta), float(density)
        self.log_alpha = torch.nn.Parameter(torch.empty((blocks,), device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``log_alpha`` for the starting density (after ``to_empty`` too, as for deferred initialisation)."""
        # P(z != 0) = sigmoid(log_alpha - β·log(-γ/ζ)): solved for the starting density (capped below 1)
        density = min(self.density, 1 - 1e-4)
        with torch.no_grad():
            self.log_alpha.fill_(math.log(density / (1 - density)) + self._shift)

    @property
    def _shift(self) -> float:
        return self.beta * math.log(-self.gamma / self.zeta)

    def _alpha(self) -> torch.Tensor:
        """``log_alpha`` whole (gathered where FSDP2 shards it) in float32, differentiable."""
        alpha = self.log_alpha
        if hasattr(alpha, "full_tensor"):
            alpha = alpha.full_tensor()
        return alpha.float()

    def _stretched(self, s: torch.Tensor) -> torch.Tensor:
        return (s * (self.zeta - self.gamma) + self.gamma).clamp(0, 1)

    def forward(self) -> torch.Tensor:
        """The gates (blocks,) in float32: a draw in training, their deterministic value in evaluation."""
        alpha = self._alpha()
        if not self.training:
            return self._stretched(torch.sigmoid(alpha))
        u = torch.rand_like(alpha).clamp(1e-6, 1 - 1e-6)
        return self._stretched(torch.sigmoid((torch.log(u) - torch.log1p(-u) + alpha) / self.beta))

    def nonzero_probability(self) -> torch.Tensor:
        """(blocks,): the probability that each gate is not zero in training, differentiable."""
        return torch.sigmoid(self._alpha() - self._shift)

    def expected_density(self) -> torch.Tensor:
        """The expected fraction of non-zero gates, differentiable."""
        return self.nonzero_probability().mean()

    def penalty(self, target: float | None = None) -> torch.Tensor:
        """The L0 penalty: without ``target``, the expected number of non-zero gates (the paper's);
        with it, ``(expected_density − target)²``, which holds the density near the target."""
        if target is None:
            return self.nonzero_probability().sum()
        if not 0 <= target <= 1:
            raise ValueError(f"target must be in [0, 1]; got {target!r}")
        return (self.expected_density() - target) ** 2

    def kept(self) -> torch.Tensor:
        """(blocks,) bool: the gates that are not zero in evaluation."""
        with torch.no_grad():
            return self._stretched(torch.sigmoid(self._alpha())) > 0

    def extra_repr(self) -> str:
        return f"blocks={self.log_alpha.numel()}, beta={self.beta:.3g}, gamma={self.gamma}, zeta={self.zeta}"


def gate_layer(layer: BlockSparseLinear, density: float = 0.9, **options) -> BlockGates:
    """Give ``layer`` gates (``layer.gates``, one per block), which it applies in every forward from now on;
    returns them. ``options``: those of :class:`BlockGates`.

    Examples
    --------
    >>> import torch, bsmm.torch
    >>> layer = bsmm.torch.BlockSparseLinear(64, 64, density=0.5, block_size=32, seed=0)
    >>> gates = bsmm.torch.gate_layer(layer)
    >>> layer(torch.ones(3, 64)).shape, gates.log_alpha.shape
    (torch.Size([3, 64]), torch.Size([2]))
    """
    if not isinstance(layer, BlockSparseLinear):
        raise TypeError(f"layer must be a bsmm.torch.BlockSparseLinear; got {type(layer).__name__}")
    if getattr(layer, "gates", None) is not None:
        raise ValueError("layer already has gates (layer.gates)")
    layer.gates = BlockGates(layer.op.blocks, density, device=layer.weight.device, dtype=torch.float32, **options)
    layer.gates.train(layer.training)
    return layer.gates


def prune_by_gates(layer: BlockSparseLinear, blocks: int | None = None) -> BlockSparseLinear:
    """A new layer (without gates) of the blocks of ``layer`` whose gates are not zero in evaluation, each
    block's weight multiplied by its gate: it computes what the gated layer computes in evaluation.

    With ``blocks``, the ``blocks`` gates of largest ``log_alpha`` are kept instead (ties to the earlier
    slot), open or not, so that layers pruned by gates can be given an exact density.

    Examples
    --------
    >>> import torch, bsmm.torch
    >>> layer = bsmm.torch.BlockSparseLinear(64, 64, density=1.0, block_size=32, seed=0)
    >>> gates = bsmm.torch.gate_layer(layer)
    >>> with torch.no_grad():
    ...     gates.log_alpha[:2] = -10.0   # two gates closed
    >>> bsmm.torch.prune_by_gates(layer).op.blocks
    2
    """
    gates = getattr(layer, "gates", None)
    if gates is None:
        raise ValueError("layer has no gates: give it some with bsmm.torch.gate_layer")
    index = layer.op.index
    if blocks is None:
        kept = gates.kept().cpu().numpy()
    else:
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 0 <= blocks <= index.nnzb:
            raise ValueError(f"blocks must be an int in [0, {index.nnzb}] (the layer's blocks); got {blocks!r}")
        order = np.argsort(-gates._alpha().detach().cpu().numpy(), kind="stable")
        kept = np.zeros(index.nnzb, dtype=bool)
        kept[order[:blocks]] = True
    with torch.no_grad():
        scale = gates._stretched(torch.sigmoid(gates._alpha()))  # the gates' values in evaluation
    return layer_of_blocks(layer, kept, scale)


def layer_of_blocks(layer: BlockSparseLinear, kept: np.ndarray, scale: torch.Tensor | None = None) -> BlockSparseLinear:
    """A new layer (without gates) of the blocks of ``layer`` where ``kept`` (nnzb,) bool is set, each block's
    weight multiplied by its ``scale`` (nnzb,) where given; the bias, activation and options as ``layer``'s."""
    index = layer.op.index
    layout = np.zeros(index.layout.shape, dtype=np.uint8)
    layout[index.rows[kept], index.indices[kept]] = 1
    pruned = BlockSparseLinear(layer.in_features, layer.out_features, layout, layer.op.block_size,
                               bias=layer.bias is not None, feature_axis=layer.feature_axis, tf32=layer.tf32,
                               device=layer.weight.device, dtype=layer.weight.dtype, activation=layer.activation)
    with torch.no_grad():
        weight = layer.weight[torch.as_tensor(kept, device=layer.weight.device)]
        if scale is not None:
            weight = weight * scale.to(weight.device, weight.dtype)[torch.as_tensor(kept, device=weight.device)].view(
                -1, 1, 1)
        pruned.weight.copy_(weight)
        if layer.bias is not None:
            pruned.bias.copy_(layer.bias)
    return pruned

"""``BlockSparseMLP``: a transformer's feed-forward block with block-sparse weights, its gate and up
projections one product.

A GLU-family block (SwiGLU, GeGLU: Llama, Mistral, Qwen) computes ``down(A(gate(x)) * up(x))``. Here
``gate`` and ``up`` are one :class:`~bsmm.torch.BlockSparseLinear` whose layout is the two side by
side, ``[gate | up]`` along its output features: one pass over ``x`` gives both halves, and the
backward's two products of the pair are one bprop and one updat over that layout (autograd joins the
halves' gradients). ``A(gate) * up`` is :func:`~bsmm.torch.gated_unit`: one kernel forward, and one
backward that writes the ``[gate | up]`` gradient whole (no concatenation). An
ungated block (GELU MLPs) is ``down(A(up(x)))`` with ``A`` and the bias in the up projection's kernel
(:mod:`bsmm.epilogues`).
"""

from __future__ import annotations

import numpy as np
import torch

from bsmm.block_index import check_block_size
from bsmm.epilogues import ACTIVATIONS, check_activation
from bsmm.layouts import random_layout
from bsmm.torch.eager import TORCH_ACTIVATIONS
from bsmm.torch.glu import gated_unit
from bsmm.torch.layers import BlockSparseLinear, largest_blocks, present_blocks

__all__ = ["BlockSparseMLP", "activation_of"]

def activation_of(module_or_function) -> str | None:
    """The name of :data:`bsmm.epilogues.ACTIVATIONS` that ``module_or_function`` computes (``nn.SiLU``,
    ``F.gelu``, a model library's activation module), found by evaluating it on probe values in
    float64; None where it is none of them.

    Examples
    --------
    >>> import torch
    >>> activation_of(torch.nn.SiLU()), activation_of(torch.nn.GELU(approximate="tanh")), activation_of(torch.tanh)
    ('silu', 'gelu_tanh', None)
    """
    probe = torch.linspace(-6.0, 6.0, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            value = module_or_function(probe)
    except Exception:  # noqa: BLE001 - anything that cannot take a tensor is no activation of ours
        return None
    if not isinstance(value, torch.Tensor) or value.shape != probe.shape:
        return None
    values = value.double().numpy()
    for name in TORCH_ACTIVATIONS:
        if np.allclose(values, ACTIVATIONS[name].forward(np, probe.numpy()), rtol=1e-6, atol=1e-9):
            return name
    return None


def _gate_up_layout(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The up projection's layout: the gate's and the up's side by side."""
    return np.concatenate([np.asarray(gate) != 0, np.asarray(up) != 0], axis=1).astype(np.uint8)


class BlockSparseMLP(torch.nn.Module):
    """``down(A(gate(x)) * up(x))`` (``gated``), or ``down(A(up(x)))``, with block-sparse projections.

    Parameters
    ----------
    d_model, d_hidden : int
        The block's input and output size, and its inner size; multiples of ``block_size``.
    density : float in [0, 1], optional
        Random layouts keeping this fraction of each projection's blocks (``seed``); or give ``layouts``.
    block_size : int
        8, 16, 32, 64 or 128.
    activation : {"silu", "gelu", "gelu_tanh", "relu"}
        ``A``. SwiGLU is ``"silu"`` with ``gated``; GeGLU ``"gelu"`` or ``"gelu_tanh"``.
    gated : bool
        A GLU-family block (a gate and an up projection), or an ungated one (``A`` inside the up
        projection's kernel, with its bias).
    bias : bool
        Biases on the projections (Llama's have none).
    layouts : (gate, up, down) or (up, down), optional
        Each in bsmm's ``W`` (in × out) orientation: gate and up (d_model/bs, d_hidden/bs), down
        (d_hidden/bs, d_model/bs). In place of ``density``.
    seed, tf32, device, dtype
        As for :class:`~bsmm.torch.BlockSparseLinear`.

    Attributes
    ----------
    up : BlockSparseLinear (d_model → 2·d_hidden gated, [gate | up]; else d_model → d_hidden)
    down : BlockSparseLinear (d_hidden → d_model)

    Examples
    --------
    >>> import torch, bsmm.torch
    >>> mlp = bsmm.torch.BlockSparseMLP(64, 128, density=0.5, block_size=16, seed=0)
    >>> mlp.extra_repr()
    "d_model=64, d_hidden=128, activation='silu', gated=True, density=0.5, bias=False"
    >>> mlp.up.out_features, mlp.up.op.blocks  # gate and up side by side: 4 × 16 blocks, half kept
    (256, 32)
    >>> mlp(torch.randn(3, 5, 64)).shape
    torch.Size([3, 5, 64])
    """

    def __init__(self, d_model: int, d_hidden: int, *, density: float | None = None, block_size: int = 32,
                 activation: str = "silu", gated: bool = True, bias: bool = False, layouts=None, seed=None,
                 tf32: bool = False, device=None, dtype=None):
        super().__init__()
        activation = check_activation(activation)
        if activation == "none":
            raise ValueError("activation must be one of 'silu', 'gelu', 'gelu_tanh', 'relu'; got 'none'")
        block_size = check_block_size(block_size)
        if (layouts is None) == (density is None):
            raise ValueError("pass layouts or a density (random layouts of that fraction of blocks), not "
                             f"{'both' if layouts is not None else 'neither'}")
        self.d_model, self.d_hidden, self.activation, self.gated = int(d_model), int(d_hidden), activation, bool(gated)
        shapes = {"gate": (d_model, d_hidden), "up": (d_model, d_hidden), "down": (d_hidden, d_model)}
        names = ("gate", "up", "down") if gated else ("up", "down")
        if layouts is None:
            rng = np.random.default_rng(seed)
            for name in names:
                for argument, size in zip(("d_model", "d_hidden"), shapes[name]):
                    if size % block_size:
                        raise ValueError(f"{argument} ({size}) must be a multiple of block_size ({block_size})")
            layouts = [random_layout(c // block_size, k // block_size, density, rng) for c, k in
                       (shapes[name] for name in names)]
        elif len(layouts) != len(names):
            raise ValueError(f"layouts must be ({', '.join(names)}) for gated={gated}; got {len(layouts)} layouts")
        else:
            for name, layout in zip(names, layouts):
                blocks = tuple(size // block_size for size in shapes[name])
                if np.shape(layout) != blocks:
                    raise ValueError(f"the {name} layout must have shape {blocks} (in × out blocks); "
                                     f"got {np.shape(layout)}")
        up_layout = _gate_up_layout(layouts[0], layouts[1]) if gated else layouts[0]
        common = dict(block_size=block_size, bias=bias, tf32=tf32, device=device, dtype=dtype)
        self.up = BlockSparseLinear(d_model, (2 if gated else 1) * d_hidden, up_layout,
                                    activation=None if gated else activation, **common)
        self.down = BlockSparseLinear(d_hidden, d_model, layouts[-1], **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., d_model) -> (..., d_model)."""
        if not self.gated:
            return self.down(self.up(x))
        return self.down(gated_unit(self.up(x), self.activation))

    @classmethod
    def from_modules(cls, gate_proj: torch.nn.Linear | None, up_proj: torch.nn.Linear, down_proj: torch.nn.Linear,
                     activation, *, density: float | None = None, block_size: int = 32, layouts=None,
                     tf32: bool = False) -> "BlockSparseMLP":
        """The block of dense ``nn.Linear`` projections (gate_proj None: ungated), with the blocks of
        largest norm of each kept at ``density`` (or ``layouts``), their values copied.

        ``activation``: a name of :data:`bsmm.torch.eager.TORCH_ACTIVATIONS` or a module or function
        computing one (:func:`activation_of`). At density 1 the block computes what the modules compute,
        up to the rounding of another order of summation.

        Examples
        --------
        >>> import torch
        >>> gate, up, down = torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(32, 64, bias=False), \\
        ...     torch.nn.Linear(64, 32, bias=False)
        >>> mlp = BlockSparseMLP.from_modules(gate, up, down, torch.nn.SiLU(), density=1.0, block_size=16)
        >>> x = torch.randn(4, 32)
        >>> torch.allclose(mlp(x), down(torch.nn.functional.silu(gate(x)) * up(x)), atol=1e-5)
        True
        """
        name = activation if isinstance(activation, str) else activation_of(activation)
        if name not in TORCH_ACTIVATIONS:
            raise ValueError(f"activation must compute one of {', '.join(TORCH_ACTIVATIONS)}; got {activation!r}")
        if layouts is not None and density is not None:
            raise ValueError("give layouts or density, not both")
        labels = ("gate_proj", "up_proj", "down_proj") if gate_proj is not None else ("up_proj", "down_proj")
        projections = [p for p in (gate_proj, up_proj, down_proj) if p is not None]
        for label, p in zip(labels, projections):
            if type(p) is not torch.nn.Linear:
                raise TypeError(f"{label} must be a torch.nn.Linear; got {type(p).__name__}")
        d_model, d_hidden = up_proj.in_features, up_proj.out_features
        expected = {"gate_proj": (d_model, d_hidden), "up_proj": (d_model, d_hidden), "down_proj": (d_hidden, d_model)}
        for label, p in zip(labels, projections):
            if (p.in_features, p.out_features) != expected[label]:
                raise ValueError(f"{label} must map {expected[label][0]} to {expected[label][1]} features (up_proj's "
                                 f"sizes); got {p.in_features} to {p.out_features}")
        biased = {p.bias is not None for p in projections}
        if len(biased) != 1:
            raise ValueError("the projections must all have a bias or all have none")
        if layouts is None:
            if density is None:
                raise ValueError("pass layouts or a density")
            for p in projections:
                for argument, size in (("in_features", p.in_features), ("out_features", p.out_features)):
                    if size % block_size:
                        raise ValueError(f"{argument} ({size}) must be a multiple of block_size ({block_size})")
            layouts = [largest_blocks(p.weight, block_size, density) for p in projections]
        weight = projections[0].weight
        devices = [weight.device] if weight.device.type != "cpu" else []
        with torch.random.fork_rng(devices, device_type=weight.device.type):  # (initial draws, then overwritten)
            mlp = cls(d_model, d_hidden, block_size=block_size, activation=name, gated=gate_proj is not None,
                      bias=biased.pop(), layouts=layouts, tf32=tf32, device=weight.device, dtype=weight.dtype)
        ups = (gate_proj, up_proj) if gate_proj is not None else (up_proj,)
        with torch.no_grad():
            mlp.up.weight.copy_(present_blocks(torch.cat([p.weight for p in ups], dim=0), mlp.up.op.index))
            mlp.down.weight.copy_(present_blocks(down_proj.weight, mlp.down.op.index))
            if mlp.up.bias is not None:
                mlp.up.bias.copy_(torch.cat([p.bias for p in ups]))
                mlp.down.bias.copy_(down_proj.bias)
        return mlp

    def extra_repr(self) -> str:
        blocks = self.up.op.blocks + self.down.op.blocks
        total = sum(layer.op.layout.size for layer in (self.up, self.down))
        return (f"d_model={self.d_model}, d_hidden={self.d_hidden}, activation={self.activation!r}, "
                f"gated={self.gated}, density={blocks / total:.3g}, bias={self.up.bias is not None}")

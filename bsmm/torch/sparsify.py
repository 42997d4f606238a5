"""One call that makes a model's linear layers block-sparse: :func:`sparsify`.

Every ``torch.nn.Linear`` of the model (plain PyTorch, or a model library's: their layers are
``nn.Linear`` modules) that the name filters admit becomes a :class:`~bsmm.torch.BlockSparseLinear`
of the same sizes, dtype, device and bias, its kept blocks copied from the dense weight. A layer
whose sizes are not multiples of the block size (a 10-class head, 784 pixel inputs) stays dense
and is reported, as is every layer a filter left out.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from typing import Callable

import numpy as np
import torch

from bsmm.config import warn
from bsmm.layouts import random_layout
from bsmm.torch.layers import BlockSparseLinear, replace_modules
from bsmm.torch.mlp import BlockSparseMLP, activation_of

__all__ = ["SparsifyReport", "sparsify"]

_log = logging.getLogger(__name__)

#: ``layout=`` names: blocks of largest norm in the dense weight, or a uniform random draw.
LAYOUT_RULES = ("magnitude", "random")


@dataclasses.dataclass
class SparsifyReport:
    """What :func:`sparsify` did: the names of the layers it replaced, and of those it kept dense
    with the reason (sizes, or the filter that left them out)."""

    replaced: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    #: GLU MLP blocks made one :class:`~bsmm.torch.BlockSparseMLP` each (``fuse_mlp``); their
    #: projections are not listed in ``replaced``.
    fused: list[str] = dataclasses.field(default_factory=list)
    #: Modules with a GLU block's projections left unfused, and why (their ``nn.Linear`` layers then
    #: take the per-layer path).
    not_fused: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"sparsify: {len(self.replaced)} nn.Linear layer(s) made block-sparse, {len(self.fused)} MLP "
                 f"block(s) fused, {len(self.skipped)} kept dense"]
        lines += [f"  kept dense: {name or '(the model itself)'}: {why}" for name, why in self.skipped.items()]
        lines += [f"  MLP block not fused: {name or '(the model itself)'}: {why}" for name, why in self.not_fused.items()]
        return "\n".join(lines)


def _matches(patterns, name: str, module) -> bool:
    """Whether ``name`` (or the module) passes a filter: a callable(name, module), one fnmatch
    pattern or a list of them."""
    if callable(patterns):
        return bool(patterns(name, module))
    if isinstance(patterns, str):
        patterns = [patterns]
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _check_filter(value, argument: str) -> None:
    if value is None or callable(value) or isinstance(value, str):
        return
    if isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        return
    raise TypeError(f"{argument} must be None, a name pattern, a list of them or a callable(name, module); "
                    f"got {type(value).__name__}")


def _layout_for(rule, name: str, linear: torch.nn.Linear, density: float, block_size: int, rng):
    """The kept blocks of ``linear`` (in × out blocks, bsmm's orientation), or None for magnitude
    pruning (:meth:`BlockSparseLinear.from_linear` picks the blocks of largest norm)."""
    if rule == "magnitude":
        return None
    if rule == "random":
        return random_layout(linear.in_features // block_size, linear.out_features // block_size, density, rng)
    layout = np.asarray(rule(name, linear))
    expected = (linear.in_features // block_size, linear.out_features // block_size)
    if layout.shape != expected:
        raise ValueError(f"layout({name!r}, linear) must return a layout of shape {expected} (in × out blocks, "
                         f"the transpose of nn.Linear.weight's orientation); got {layout.shape}")
    return layout


#: The projections of a GLU MLP block as model libraries name them (Llama, Mistral, Qwen2, Gemma, ...).
GLU_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _glu_block(name: str, module, block_size: int, include, exclude) -> tuple[str | None, str]:
    """(activation, "") where ``module`` is a GLU block ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
    that :class:`BlockSparseMLP` can replace, else (None, why not; "" for no GLU block at all)."""
    projections = [getattr(module, p, None) for p in GLU_PROJECTIONS]
    if not all(type(p) is torch.nn.Linear for p in projections) or not hasattr(module, "act_fn"):
        return None, ""
    names = [f"{name}.{p}" if name else p for p in GLU_PROJECTIONS]
    if any((include is not None and not _matches(include, n, p)) or (exclude is not None and _matches(exclude, n, p))
           for n, p in zip(names, projections)):
        return None, "a projection is left out by include/exclude"
    if any(size % block_size for p in projections for size in (p.in_features, p.out_features)):
        return None, f"a projection's sizes are not multiples of block_size {block_size}"
    activation = activation_of(module.act_fn)
    if activation is None:
        return None, f"act_fn {type(module.act_fn).__name__} is none of bsmm's activations"
    if not _computes_glu(module):
        return None, "its forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))"
    return activation, ""


def _computes_glu(module) -> bool:
    """Whether ``module(x)`` is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, on a probe input in eval
    mode: what reaches ``down_proj`` (caught by a hook) must be that product, computed by the module's own
    operators (equal whatever down_proj's weights), and the module's output ``down_proj``'s, unchanged."""
    gate, up, down = (getattr(module, p) for p in GLU_PROJECTIONS)
    weight = gate.weight
    seen = []
    hook = down.register_forward_hook(lambda layer, inputs, output: seen.append((inputs, output)))
    training = module.training
    try:
        module.eval()
        with torch.no_grad():
            generator = torch.Generator(weight.device).manual_seed(0)  # (the model's random streams left alone)
            x = torch.randn(2, gate.in_features, generator=generator, device=weight.device).to(weight.dtype)
            own = module(x)
            product = module.act_fn(gate(x)) * up(x)
    except Exception:  # noqa: BLE001 - a forward that takes more than one tensor is not a plain MLP block
        return False
    finally:
        hook.remove()
        module.train(training)
    if len(seen) != 1 or len(seen[0][0]) != 1:
        return False
    (reached,), output = seen[0]
    return (isinstance(own, torch.Tensor) and own.shape == output.shape and torch.equal(own, output)
            and reached.shape == product.shape and torch.allclose(reached, product, rtol=1e-6, atol=0))


def sparsify(model: torch.nn.Module, density: float, block_size: int = 32, *, include=None, exclude=None,
             layout: str | Callable = "magnitude", seed=None, feature_axis: int = 1, tf32: bool = False,
             fuse_mlp: bool = False, return_report: bool = False):
    """Replace the ``nn.Linear`` layers of ``model`` by :class:`~bsmm.torch.BlockSparseLinear` ones.

    Parameters
    ----------
    model : torch.nn.Module
        Changed in place (its submodules are replaced) and returned; a model that is itself an
        ``nn.Linear`` is returned replaced.
    density : float in [0, 1]
        Fraction of each layer's blocks kept.
    block_size : int
        8, 16, 32, 64 or 128.
    include, exclude : None, a name pattern, a list of them, or callable(name, module) -> bool
        Which layers to consider, by their names in ``model.named_modules()`` (``fnmatch``
        patterns: ``"*mlp*"``, ``"layers.*.fc1"``); ``exclude`` wins. Default: every ``nn.Linear``.
    layout : "magnitude", "random" or callable(name, linear) -> (in/bs, out/bs) array
        ``"magnitude"`` keeps the blocks of largest Frobenius norm of the dense weight (values
        kept exactly); ``"random"`` draws them uniformly (``seed``); a callable returns each
        layer's layout in bsmm's ``W`` (in × out) orientation.
    seed : int, numpy.random.Generator or None
        For ``layout="random"``: one generator draws every layout, the fused MLP blocks' first (module
        order each).
    feature_axis, tf32
        As for :class:`~bsmm.torch.BlockSparseLinear`.
    fuse_mlp : bool
        Replace each GLU MLP block, a module with ``nn.Linear`` ``gate_proj``, ``up_proj`` and
        ``down_proj`` and an ``act_fn`` whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``
        (checked on a probe input), by one :class:`~bsmm.torch.BlockSparseMLP` (gate and up one
        product); each projection keeps ``density`` of its blocks by ``layout``'s rule. Feature axis 1.
    return_report : bool
        Return ``(model, SparsifyReport)``. Without it, layers kept dense for their sizes are
        named in one ``BsmmWarning``; the full report goes to the ``"bsmm"`` logger (INFO).

    Returns
    -------
    model, or (model, SparsifyReport)

    Examples
    --------
    >>> import torch, bsmm.torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    >>> model, report = bsmm.torch.sparsify(model, density=0.5, block_size=32, return_report=True)
    >>> type(model[0]).__name__, model[0].op.density, type(model[2]).__name__
    ('BlockSparseLinear', 0.5, 'Linear')
    >>> report.skipped
    {'2': 'out_features 10 is not a multiple of block_size 32'}
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 <= density <= 1:
        raise ValueError(f"density must be a number in [0, 1]; got {density!r}")
    _check_filter(include, "include")
    _check_filter(exclude, "exclude")
    if not (callable(layout) or layout in LAYOUT_RULES):
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUT_RULES))} or a callable(name, linear); "
                         f"got {layout!r}")
    if fuse_mlp and feature_axis != 1:
        raise ValueError("fuse_mlp makes BlockSparseMLP blocks, which take features on axis 1; got feature_axis=0")
    rng = np.random.default_rng(seed)
    report = SparsifyReport()
    replacements = {}
    fused_prefixes = []
    for name, module in model.named_modules() if fuse_mlp else ():
        if any(name.startswith(prefix) for prefix in fused_prefixes):
            continue
        activation, why = _glu_block(name, module, block_size, include, exclude)
        if activation is None:
            if why:
                report.not_fused[name] = why
            continue
        projections = [getattr(module, p) for p in GLU_PROJECTIONS]
        layouts = None if layout == "magnitude" else [
            _layout_for(layout, f"{name}.{p}" if name else p, linear, density, block_size, rng)
            for p, linear in zip(GLU_PROJECTIONS, projections)]
        replacements[name] = BlockSparseMLP.from_modules(*projections, activation, layouts=layouts,
                                                         density=density if layouts is None else None,
                                                         block_size=block_size, tf32=tf32)
        replacements[name].train(module.training)
        report.fused.append(name)
        fused_prefixes.append(f"{name}." if name else "")
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear:  # (a subclass may compute more than x·Wᵀ + b)
            continue
        if any(name.startswith(prefix) for prefix in fused_prefixes):
            continue
        if include is not None and not _matches(include, name, module):
            report.skipped[name] = "not matched by include"
            continue
        if exclude is not None and _matches(exclude, name, module):
            report.skipped[name] = "matched by exclude"
            continue
        sizes = [f"{arg} {value}" for arg, value in (("in_features", module.in_features),
                                                       ("out_features", module.out_features)) if value % block_size]
        if sizes:
            report.skipped[name] = f"{' and '.join(sizes)} {'is' if len(sizes) == 1 else 'are'} not " \
                                   f"{'a multiple' if len(sizes) == 1 else 'multiples'} of block_size {block_size}"
            continue
        kept = _layout_for(layout, name, module, density, block_size, rng)
        replacements[name] = BlockSparseLinear.from_linear(
            module, kept, density=density if kept is None else None, block_size=block_size,
            feature_axis=feature_axis, tf32=tf32)
        replacements[name].train(module.training)
        report.replaced.append(name)
    model = replace_modules(model, replacements.items())
    _log.info("%s", report)
    sized = {name: why for name, why in report.skipped.items() if "block_size" in why}
    if sized and not return_report:
        warn(f"sparsify kept {len(sized)} nn.Linear layer(s) dense, their sizes not block multiples: "
             + "; ".join(f"{name or '(the model itself)'} ({why})" for name, why in sized.items()))
    return (model, report) if return_report else model

"""Fused epilogues: a bias and an activation applied to a pass's output tiles in the kernel.

An epilogue is what the fprop (or bprop) kernel does with each finished output element. The
kernels name it as a type (``cuda/bsmm_epilogue_types.cuh``): ``bsmm::Store`` writes the sums
(today's behaviour, with ``accumulate``); ``bsmm::BiasAct<A>`` writes ``A(z)`` with
``z = sums (+ out where accumulate) + bias``, in float32 and rounded once, and where asked also
the pre-activation ``z``. :data:`EPILOGUES` maps the names a variant carries to those types;
:data:`ACTIVATIONS` holds each activation's math for the CPU backend and for the backward.

What a backward reads: ``A'`` of ``"relu"`` and ``"none"`` is known from the output itself
(``y > 0``; 1), so those keep nothing more; ``"gelu"``, ``"gelu_tanh"`` and ``"silu"`` need the
pre-activation ``z``, which the forward writes beside ``y`` (one more store, no more launches)
when a gradient will be taken. :func:`activation_grad` turns ``dy`` and what was kept into
``dz``; ``dbias`` is ``dz`` summed over the batch, ``dx`` and ``dW`` the bprop and updat of ``dz``.

Examples
--------
>>> import numpy as np
>>> z = np.array([-1.0, 0.0, 2.0])
>>> ACTIVATIONS["relu"].forward(np, z)
array([0., 0., 2.])
>>> EPILOGUES["gelu_tanh"], EPILOGUES["store"]
('bsmm::BiasAct<bsmm::Act::GeluTanh>', 'bsmm::Store')
>>> activation_grad(np.ones(3), z, "relu")  # relu reads the output; it is 0 exactly where z is
array([0., 0., 1.])
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from bsmm.arrays import array_module

__all__ = ["ACTIVATIONS", "EPILOGUES", "Activation", "EpilogueCall", "activation_grad", "apply_epilogue",
           "check_activation", "epilogue_name"]

_SQRT1_2 = 1.0 / math.sqrt(2.0)
_GELU_TANH_C = math.sqrt(2.0 / math.pi)
_GELU_TANH_A = 0.044715


def _erf(xp):
    """erf for NumPy (SciPy's) or CuPy (cupyx's) arrays."""
    if xp.__name__ == "numpy":
        from scipy.special import erf
    else:
        from cupyx.scipy.special import erf
    return erf


def _gelu(xp, z):
    return 0.5 * z * (1.0 + _erf(xp)(z * _SQRT1_2))


def _gelu_grad(xp, z):
    return 0.5 * (1.0 + _erf(xp)(z * _SQRT1_2)) + z * xp.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def _gelu_tanh(xp, z):
    return 0.5 * z * (1.0 + xp.tanh(_GELU_TANH_C * (z + _GELU_TANH_A * z ** 3)))


def _gelu_tanh_grad(xp, z):
    t = xp.tanh(_GELU_TANH_C * (z + _GELU_TANH_A * z ** 3))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _GELU_TANH_C * (1.0 + 3.0 * _GELU_TANH_A * z * z)


def _sigmoid(xp, z):
    return 1.0 / (1.0 + xp.exp(-z))


@dataclasses.dataclass(frozen=True)
class Activation:
    """One activation of ``BiasAct``: its ``bsmm::Act`` enumerator, its value and derivative on
    NumPy or CuPy arrays (``f(xp, array)``), and what its backward reads: ``"output"`` (the
    derivative is a function of ``y``, given ``y``) or ``"pre"`` (of ``z``, kept by the forward)."""

    name: str
    cuda: str
    forward: Callable
    derivative: Callable
    reads: str


ACTIVATIONS: dict[str, Activation] = {
    "none": Activation("none", "None", lambda xp, z: z, lambda xp, y: xp.ones_like(y), "output"),
    "relu": Activation("relu", "Relu", lambda xp, z: xp.maximum(z, 0), lambda xp, y: (y > 0).astype(y.dtype),
                       "output"),
    "gelu": Activation("gelu", "Gelu", _gelu, _gelu_grad, "pre"),
    "gelu_tanh": Activation("gelu_tanh", "GeluTanh", _gelu_tanh, _gelu_tanh_grad, "pre"),
    "silu": Activation("silu", "Silu", lambda xp, z: z * _sigmoid(xp, z),
                       lambda xp, z: _sigmoid(xp, z) * (1.0 + z * (1.0 - _sigmoid(xp, z))), "pre"),
}

#: Epilogue names (a kernel variant's ``epilogue``) -> the kernel template's epilogue type.
EPILOGUES: dict[str, str] = {"store": "bsmm::Store",
                             **{name: f"bsmm::BiasAct<bsmm::Act::{a.cuda}>" for name, a in ACTIVATIONS.items()}}


def check_activation(activation) -> str | None:
    """``activation`` as a name of :data:`ACTIVATIONS`, or None; raises naming the argument."""
    if activation is None:
        return None
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {', '.join(map(repr, ACTIVATIONS))}; got {activation!r}")
    return activation


def epilogue_name(bias, activation: str | None) -> str:
    """The epilogue a call takes: ``"store"`` without bias or activation, else BiasAct of the
    activation (``"none"``: the bias alone). Any other string is returned as it is, so that the
    repeat path's lookup of an unchecked name (``""`` included) finds no call and the checked path refuses it."""
    if activation is None:
        return "store" if bias is None else "none"
    return activation


@dataclasses.dataclass(frozen=True)
class EpilogueCall:
    """What one call asks of the epilogue, as the backends receive it: the epilogue's name (a key
    of :data:`EPILOGUES` other than ``"store"``), the bias (features_out,) or None, and the array
    the pre-activation goes to (the output's shape) or None. Arrays of the backend's library."""

    name: str
    bias: object = None
    pre: object = None

    def pointers(self) -> tuple[int, int]:
        """(bias, pre) device pointers of CuPy arrays, 0 for those not given."""
        return (0 if self.bias is None else self.bias.data.ptr, 0 if self.pre is None else self.pre.data.ptr)


def apply_epilogue(xp, sums, out, bias, activation: str | None, pre, feature_axis: int, accumulate: bool) -> None:
    """What ``BiasAct`` does, on host or CuPy arrays (the CPU backend, and the reference): ``sums``
    in the compute dtype; ``z = sums (+ out) (+ bias along the features)`` is written to ``pre``
    where given, ``A(z)`` to ``out``, each rounded once."""
    z = sums + out.astype(sums.dtype) if accumulate else sums
    if bias is not None:
        b = bias.astype(sums.dtype)
        z = z + (b if feature_axis == 1 else b[:, None])
    if pre is not None:
        pre[...] = z
    out[...] = ACTIVATIONS[activation or "none"].forward(xp, z)


def activation_grad(dy, saved, activation: str | None):
    """``dz = dy · A'(z)`` from what the forward kept for ``activation``: ``y`` where
    :attr:`Activation.reads` is ``"output"``, ``z`` where it is ``"pre"`` (NumPy or CuPy arrays;
    computed in float32 at least, returned in ``dy``'s dtype)."""
    if activation is None or activation == "none":
        return dy
    xp = array_module(dy)
    compute = np.promote_types(dy.dtype, np.float32) if dy.dtype.kind == "f" and dy.dtype.itemsize >= 4 \
        else np.dtype(np.float32)
    d = ACTIVATIONS[activation].derivative(xp, saved.astype(compute))
    return (dy.astype(compute) * d).astype(dy.dtype)

"""Checks of the arrays and operators passed to :mod:`bsmm.jax`'s functions, before XLA places them."""

from __future__ import annotations

import jax
import numpy as np

from bsmm.dtypes import canonical_dtype
from bsmm.matmul import BlocksparseMatMul

__all__ = ["check_arrays", "check_matmul_inputs", "check_weights"]


def check_matmul_inputs(x, w, op) -> None:
    """Raise naming the argument unless ``op`` is a BlocksparseMatMul and ``x`` and ``w`` fit it."""
    if not isinstance(op, BlocksparseMatMul):
        raise TypeError(f"op must be a bsmm.BlocksparseMatMul; got {type(op).__name__}")
    dtype = check_arrays(x, w)
    if op.feature_axis == 1 and (x.ndim < 1 or x.shape[-1] != op.C):
        raise ValueError(f"x must have shape (..., {op.C}) (features last, feature_axis=1); got {tuple(x.shape)}")
    if op.feature_axis == 0 and (x.ndim not in (1, 2) or x.shape[0] != op.C):
        raise ValueError(
            f"x must have shape ({op.C}, N) or ({op.C},) (features first, feature_axis=0; batch with "
            f"jax.vmap); got {tuple(x.shape)}"
        )
    check_weights(x, w, op.w_shape, dtype)


def check_arrays(x, w) -> np.dtype:
    """x's dtype, once x and w are arrays and bsmm (and JAX) can run it."""
    for name, value in (("x", x), ("w", w)):
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            raise TypeError(f"{name} must be a JAX or NumPy array; got {type(value).__name__}")
    dtype = canonical_dtype(x.dtype, "x", _backend(x))
    if dtype == np.float64 and jax.dtypes.canonicalize_dtype(np.float64) != np.float64:
        raise TypeError(
            "x has dtype float64, which JAX turns into float32 unless 64-bit types are on: "
            "jax.config.update('jax_enable_x64', True), or pass float32"
        )
    return dtype


def check_weights(x, w, w_shape: tuple, dtype) -> None:
    """w's shape and dtype, and that x and w are not placed on different devices."""
    if tuple(w.shape) != w_shape:
        raise ValueError(f"w must have shape w_shape {w_shape}; got {tuple(w.shape)}")
    if w.dtype != dtype:
        raise TypeError(f"w has dtype {w.dtype} but x has {dtype}; pass one dtype")
    places = [_committed_devices(value) for value in (x, w)]
    if None not in places and places[0] != places[1]:
        raise ValueError(
            f"w is on {sorted(map(str, places[1]))} but x is on {sorted(map(str, places[0]))}; "
            f"move them to one device (jax.device_put)"
        )


def _backend(value) -> str:
    """Where a pass on ``value`` runs, as far as known before XLA places it.

    A concrete JAX array tells; a tracer or a NumPy array does not, so it counts as
    "cpu" (float64 accepted), and a float64 pass XLA places on a GPU is refused when
    it runs, by the pass itself.
    """
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
        if any(device.platform != "cpu" for device in value.devices()):
            return "cuda"
    return "cpu"


def _committed_devices(value):
    """The devices of a concrete JAX array that was explicitly placed (JAX moves the others)."""
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) and value.committed:
        return value.devices()
    return None

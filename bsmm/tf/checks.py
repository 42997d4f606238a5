"""Checks of :func:`bsmm.tf.blocksparse_matmul`'s arguments, as far as they are known before a pass runs."""

from __future__ import annotations

import tensorflow as tf

from bsmm.dtypes import CPU_ONLY_DTYPES, SUPPORTED_DTYPES
from bsmm.tf.passes import CUDA_DEVICE_TYPES, NUMPY_DTYPES

__all__ = ["as_tensor", "check_activation", "check_same_device", "shape_text"]


def shape_text(shape: tf.TensorShape) -> str:
    """``shape`` as the error messages give it."""
    return "unknown rank" if shape.rank is None else str(tuple(shape.as_list()))


def as_tensor(value, argument: str) -> tf.Tensor:
    """``value`` as a tensor of a dtype bsmm runs, or a TypeError naming ``argument``."""
    try:
        tensor = tf.convert_to_tensor(value)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{argument} must be a tf.Tensor or convertible to one; got {type(value).__name__} ({error})"
        ) from error
    if tensor.dtype not in NUMPY_DTYPES:
        raise TypeError(
            f"{argument} has dtype {tensor.dtype.name}; supported dtypes are {', '.join(SUPPORTED_DTYPES)}, "
            f"and {', '.join(CPU_ONLY_DTYPES)} on the CPU"
        )
    return tensor


def check_activation(tensor: tf.Tensor, argument: str, features: int, feature_axis: int) -> None:
    """Check the static shape, as far as it is known (bsmm checks the rest at run time)."""
    shape = tensor.shape
    if shape.rank is None:
        return
    if shape.rank != 2 or shape[feature_axis] not in (None, features):
        expected = f"(N, {features})" if feature_axis == 1 else f"({features}, N)"
        raise ValueError(
            f"{argument} must have shape {expected} with feature_axis={feature_axis}; got {shape_text(shape)}"
        )


def check_same_device(x: tf.Tensor, w: tf.Tensor) -> None:
    """Eagerly, raise unless ``x`` and ``w`` lie on one device, and float64 ones on the CPU."""
    # In graphs TensorFlow places the op and copies inputs itself; eagerly the memory is read where it is
    # (and a float64 pass placed on a GPU in a graph is refused by bsmm when it runs).
    if not tf.executing_eagerly():
        return
    if tuple(w.__dlpack_device__()) != tuple(x.__dlpack_device__()):
        raise ValueError(f"w is on {w.device} but x is on {x.device}; move them to one device (tf.device)")
    if x.dtype == tf.float64 and int(x.__dlpack_device__()[0]) in CUDA_DEVICE_TYPES:
        raise TypeError(
            f"x has dtype float64, which bsmm runs only on the CPU; on {x.device} supported dtypes are "
            f"{', '.join(SUPPORTED_DTYPES)}"
        )

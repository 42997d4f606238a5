"""The torch dtypes bsmm runs, and the checks of the operators' arguments, on real and on fake tensors."""

from __future__ import annotations

import torch

from bsmm import dtypes
from bsmm.block_index import BlockIndex
from bsmm.epilogues import check_activation
from bsmm.passes import PASSES
from bsmm.torch.registry import lookup

__all__ = ["ARRAY_DTYPES", "CPU_ONLY_DTYPES", "SUPPORTED_DTYPES", "check_contiguous", "check_dtype", "check_like",
           "epilogue_shapes", "pass_shape"]

#: torch dtypes bsmm runs on every device, by the names bsmm.dtypes uses.
SUPPORTED_DTYPES = {getattr(torch, name): name for name in dtypes.SUPPORTED_DTYPES}
#: torch dtypes bsmm runs on the CPU only (float64: for gradcheck).
CPU_ONLY_DTYPES = {getattr(torch, name): name for name in dtypes.CPU_ONLY_DTYPES}
#: torch dtype -> the NumPy dtype of the CuPy arrays the checked path shares (repeat calls' keys).
ARRAY_DTYPES = {getattr(torch, name): dtype for name, dtype in dtypes.SUPPORTED_DTYPES.items()}


def check_dtype(dtype: torch.dtype, device: torch.device, argument: str) -> None:
    """Raise naming ``argument`` unless bsmm runs ``dtype`` on ``device`` (float64: the CPU only)."""
    if dtype in SUPPORTED_DTYPES or (dtype in CPU_ONLY_DTYPES and device.type == "cpu"):
        return
    supported = ", ".join(SUPPORTED_DTYPES.values())
    if dtype in CPU_ONLY_DTYPES:
        raise TypeError(
            f"{argument} has dtype {dtype}, which bsmm runs only on the CPU; on {device} supported dtypes are "
            f"{supported}"
        )
    raise TypeError(
        f"{argument} has dtype {dtype}; supported dtypes are {supported}, and "
        f"{', '.join(CPU_ONLY_DTYPES.values())} on the CPU"
    )


def check_like(tensor: torch.Tensor, argument: str, reference: torch.Tensor, reference_name: str) -> None:
    """Raise naming ``argument`` unless ``tensor`` has the device and dtype of ``reference``."""
    if tensor.device != reference.device:
        raise ValueError(
            f"{argument} is on {tensor.device} but {reference_name} is on {reference.device}; move them to one device"
        )
    if tensor.dtype != reference.dtype:
        raise TypeError(
            f"{argument} has dtype {tensor.dtype} but {reference_name} has {reference.dtype}; pass one dtype"
        )


def check_contiguous(tensor: torch.Tensor, argument: str) -> None:
    """Raise naming ``argument`` unless ``tensor`` is contiguous (the kernels read dense memory)."""
    if not tensor.is_contiguous():
        raise ValueError(f"{argument} must be contiguous; got shape {tuple(tensor.shape)}, strides {tensor.stride()}")


def _check_activation(tensor: torch.Tensor, argument: str, features: int, feature_axis: int):
    """Return N, or raise naming ``argument``."""
    if tensor.dim() != 2 or tensor.shape[feature_axis] != features:
        expected = f"(N, {features})" if feature_axis == 1 else f"({features}, N)"
        raise ValueError(
            f"{argument} must have shape {expected} with feature_axis={feature_axis}; got {tuple(tensor.shape)}"
        )
    check_contiguous(tensor, argument)
    return tensor.shape[1 - feature_axis]


def _check_weights(tensor: torch.Tensor, argument: str, index: BlockIndex) -> None:
    if tuple(tensor.shape) != index.w_shape:
        raise ValueError(f"{argument} must have shape w_shape {index.w_shape}; got {tuple(tensor.shape)}")
    check_contiguous(tensor, argument)


def _check_feature_axis(feature_axis: int) -> None:
    if feature_axis not in (0, 1):
        raise ValueError(f"feature_axis must be 0 or 1; got {feature_axis!r}")


def pass_shape(pass_name: str, a, b, key, feature_axis) -> tuple:
    """The output shape of ``pass_name`` on ``a`` and ``b`` (:data:`bsmm.passes.PASSES`: fprop x, w;
    bprop dy, w; updat x, dy), or raise naming the argument."""
    index = lookup(key)
    spec = PASSES[pass_name]
    _check_feature_axis(feature_axis)
    first, second = spec.operands
    features_in = spec.features(index.C, index.K)[0]
    check_dtype(a.dtype, a.device, first)
    check_like(b, second, a, first)
    n = _check_activation(a, first, features_in, feature_axis)
    if spec.updates_weights:  # the second operand is dy
        n_dy = _check_activation(b, second, index.K, feature_axis)
        if n_dy != n:
            raise ValueError(f"{second} has N = {n_dy} but {first} has N = {n}; they must match")
    else:
        _check_weights(b, second, index)
    return spec.output_shape(index.C, index.K, index.w_shape, n, feature_axis)


def epilogue_shapes(x, w, bias, key, feature_axis, activation: str, keep_pre: bool) -> tuple[tuple, tuple]:
    """The shapes of ``bsmm::fprop_epilogue``'s outputs (y, and pre or an empty one), or raise."""
    y_shape = pass_shape("fprop", x, w, key, feature_axis)
    check_activation(activation)
    if bias is not None:
        features = y_shape[1 if feature_axis == 1 else 0]
        check_like(bias, "bias", x, "x")
        if tuple(bias.shape) != (features,):
            raise ValueError(f"bias must have shape ({features},); got {tuple(bias.shape)}")
        check_contiguous(bias, "bias")
    return y_shape, (y_shape if keep_pre else (0,))

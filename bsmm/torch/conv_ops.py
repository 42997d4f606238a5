"""The convolutions of :class:`bsmm.nn.conv.BlocksparseConv` as PyTorch custom operators:
``bsmm::conv_fprop``, ``bsmm::conv_bprop`` and ``bsmm::conv_updat``.

``torch.library.custom_op`` operators with a layout key, fake implementations and an autograd
formula through the other two (:mod:`bsmm.torch.autograd`, the pass table's cotangents), taking
``key, spec, tf32``, ``spec`` being the geometry and the input's spatial shape as ints
(:func:`conv_spec`).
"""

from __future__ import annotations

import torch

from bsmm.nn.conv import BlocksparseConv
from bsmm.torch.autograd import register_bilinear
from bsmm.torch.checks import check_contiguous, check_dtype, check_like
from bsmm.torch.passes import into_new
from bsmm.torch.registry import registration

__all__ = ["conv_spec", "conv_fprop", "conv_bprop", "conv_updat"]


# ``spec`` carries a BlocksparseConv's geometry and the input's spatial shape as ints (what an
# operator argument can be): [rank, *kernel_size, *stride, *padding, *dilation, channels_last, *spatial].
def conv_spec(conv: BlocksparseConv, spatial) -> list[int]:
    """The ``spec`` argument of the convolution operators for ``conv`` on inputs of ``spatial`` size."""
    return [conv.ndim, *conv.kernel_size, *conv.stride, *conv.padding, *conv.dilation, int(conv.channels_last),
            *(int(v) for v in spatial)]


def _conv_of(key: str, spec: list[int], tf32: bool) -> tuple[BlocksparseConv, tuple]:
    rank = spec[0] if spec else 0
    if rank not in (1, 2, 3) or len(spec) != 2 + 5 * rank:
        raise ValueError(f"spec must be [rank, *kernel_size, *stride, *padding, *dilation, channels_last, *spatial] "
                         f"for rank 1, 2 or 3; got {list(spec)}")
    kernel, stride, padding, dilation = (tuple(spec[1 + i * rank:1 + (i + 1) * rank]) for i in range(4))
    channels_last = bool(spec[1 + 4 * rank])
    conv = registration(key).operator(
        ("conv", kernel, stride, padding, dilation, channels_last, tf32),
        lambda index: BlocksparseConv.from_index(index, kernel, stride, padding, dilation, channels_last, tf32))
    return conv, tuple(spec[2 + 4 * rank:])


def _conv_shapes(pass_name: str, a, b, key: str, spec: list[int], tf32: bool):
    """(conv, result shape, input shape) of a convolution pass, or raise naming the argument."""
    conv, spatial = _conv_of(key, spec, tf32)
    names = {"fprop": ("x", "w"), "bprop": ("dy", "w"), "updat": ("x", "dy")}[pass_name]
    check_dtype(a.dtype, a.device, names[0])
    check_like(b, names[1], a, names[0])
    x_shape = conv.array_shape(a.shape[0] if a.dim() else 0, spatial, conv.C)
    y_shape = conv.output_shape(x_shape)
    expected = {"fprop": (x_shape, conv.w_shape), "bprop": (y_shape, conv.w_shape), "updat": (x_shape, y_shape)}
    for tensor, name, shape in zip((a, b), names, expected[pass_name]):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}; got {tuple(tensor.shape)}")
        check_contiguous(tensor, name)
    return conv, {"fprop": y_shape, "bprop": x_shape, "updat": conv.w_shape}[pass_name], x_shape


def _run_conv(pass_name: str, a, b, key: str, spec: list[int], tf32: bool) -> torch.Tensor:
    conv, shape, x_shape = _conv_shapes(pass_name, a, b, key, spec, tf32)
    options = {"x_shape": x_shape} if pass_name == "bprop" else {}
    return into_new(getattr(conv, pass_name), a, b, shape, **options)


@torch.library.custom_op("bsmm::conv_fprop", mutates_args=())
def conv_fprop(x: torch.Tensor, w: torch.Tensor, key: str, spec: list[int], tf32: bool) -> torch.Tensor:
    """y = conv(x, W): x (N, *spatial, C) or (N, C, *spatial) -> y; w (*kernel_size, nnzb, bs, bs)."""
    return _run_conv("fprop", x, w, key, spec, tf32)


@torch.library.custom_op("bsmm::conv_bprop", mutates_args=())
def conv_bprop(dy: torch.Tensor, w: torch.Tensor, key: str, spec: list[int], tf32: bool) -> torch.Tensor:
    """dx: the gradient of conv_fprop with respect to x, for the input shape in ``spec``."""
    return _run_conv("bprop", dy, w, key, spec, tf32)


@torch.library.custom_op("bsmm::conv_updat", mutates_args=())
def conv_updat(x: torch.Tensor, dy: torch.Tensor, key: str, spec: list[int], tf32: bool) -> torch.Tensor:
    """dW on the present blocks: the gradient of conv_fprop with respect to w."""
    return _run_conv("updat", x, dy, key, spec, tf32)


def _conv_fake(pass_name: str):
    def fake(a, b, key, spec, tf32):
        return a.new_empty(_conv_shapes(pass_name, a, b, key, spec, tf32)[1])

    return fake


for _pass_name, _operator in (("fprop", conv_fprop), ("bprop", conv_bprop), ("updat", conv_updat)):
    _operator.register_fake(_conv_fake(_pass_name))
register_bilinear(conv_fprop, conv_bprop, conv_updat)

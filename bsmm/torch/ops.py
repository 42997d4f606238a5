"""The three passes as PyTorch custom operators: ``bsmm::matmul``, ``bsmm::matmul_bprop``, ``bsmm::matmul_updat``.

Operators of tensors and plain values only (``x or dy, w or dy, key, feature_axis, tf32``), each
with a fake (shape-only) implementation for ``torch.compile`` and an autograd formula made of the
other two (:mod:`bsmm.torch.autograd`). ``key`` names a layout in :mod:`bsmm.torch.registry`;
:mod:`bsmm.torch.passes` runs them, :func:`product` calls them (:mod:`bsmm.torch.eager`), and the
convolutions are built the same way in :mod:`bsmm.torch.conv_ops`. Imported first by
:mod:`bsmm.torch`: it names the package to install where PyTorch is missing.
"""

from __future__ import annotations

try:
    import torch
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("bsmm.torch needs PyTorch: pip install torch") from error

from bsmm.torch import registry as _registry
from bsmm.torch.autograd import register_bilinear
from bsmm.torch.checks import (CPU_ONLY_DTYPES, SUPPORTED_DTYPES, check_contiguous, check_dtype, check_like,
                               product_shape, updat_shape)
from bsmm.torch.passes import into_new, run_pass
from bsmm.torch.registry import Registration, layout_key, lookup, register, registration

__all__ = ["Registration", "register", "lookup", "registration", "layout_key", "matmul", "matmul_bprop",
           "matmul_updat", "product", "run_pass", "check_dtype", "check_like", "check_contiguous", "into_new",
           "register_bilinear", "SUPPORTED_DTYPES", "CPU_ONLY_DTYPES"]

#: Layers pickled before the registry had a module of its own name their layout's reconstructor here.
_register_layout = _registry._register_layout


@torch.library.custom_op("bsmm::matmul", mutates_args=())
def matmul(x: torch.Tensor, w: torch.Tensor, key: str, feature_axis: int, tf32: bool) -> torch.Tensor:
    """y = x·W: x (N, C) or (C, N) -> y (N, K) or (K, N); w (nnzb, bs, bs) of x's dtype and device."""
    return run_pass("fprop", x, w, key, feature_axis, tf32)


@torch.library.custom_op("bsmm::matmul_bprop", mutates_args=())
def matmul_bprop(dy: torch.Tensor, w: torch.Tensor, key: str, feature_axis: int, tf32: bool) -> torch.Tensor:
    """dx = dy·Wᵀ: dy (N, K) or (K, N) -> dx (N, C) or (C, N)."""
    return run_pass("bprop", dy, w, key, feature_axis, tf32)


@torch.library.custom_op("bsmm::matmul_updat", mutates_args=())
def matmul_updat(x: torch.Tensor, dy: torch.Tensor, key: str, feature_axis: int, tf32: bool) -> torch.Tensor:
    """dW = xᵀ·dy on the present blocks: x (N, C), dy (N, K) (or transposed) -> (nnzb, bs, bs)."""
    return run_pass("updat", x, dy, key, feature_axis, tf32)


@matmul.register_fake
def _matmul_fake(x, w, key, feature_axis, tf32):
    return x.new_empty(product_shape(x, w, key, feature_axis, "fprop"))


@matmul_bprop.register_fake
def _bprop_fake(dy, w, key, feature_axis, tf32):
    return dy.new_empty(product_shape(dy, w, key, feature_axis, "bprop"))


@matmul_updat.register_fake
def _updat_fake(x, dy, key, feature_axis, tf32):
    return x.new_empty(updat_shape(x, dy, key, feature_axis))


register_bilinear(matmul, matmul_bprop, matmul_updat)

# Last: the eager path calls the operators defined above.
from bsmm.torch.eager import product  # noqa: E402

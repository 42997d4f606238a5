"""The passes as PyTorch operators, one per entry of the pass table, and the fused forward.

``bsmm::fprop``, ``bsmm::bprop`` and ``bsmm::updat`` (:data:`bsmm.passes.PASSES`: operands,
output shape) and ``bsmm::fprop_epilogue`` (bias and activation in the kernel,
:mod:`bsmm.epilogues`) are defined with ``torch.library`` from the table: operators of tensors
and plain values (``a, b, key, feature_axis, tf32``) with a CPU and a CUDA kernel
(:func:`bsmm.torch.passes.run_pass`) and a fake one (:mod:`bsmm.torch.checks`). They carry no
autograd formula of their own: differentiation is :mod:`bsmm.torch.eager`'s autograd functions,
which call these, so a ``torch.compile``'d graph calls them with nothing but the dispatcher
between it and the kernel (a formula registered on the operator runs a Python layer on every
call, under ``no_grad`` too). ``key`` names a layout in :mod:`bsmm.torch.registry`. Imported
first by :mod:`bsmm.torch`: it names the package to install where PyTorch is missing.
"""

from __future__ import annotations

try:
    import torch
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("bsmm.torch needs PyTorch: pip install torch") from error

import functools

from bsmm.passes import PASSES
from bsmm.torch import registry as _registry
from bsmm.torch.checks import (CPU_ONLY_DTYPES, SUPPORTED_DTYPES, check_contiguous, check_dtype, check_like,
                               epilogue_shapes, pass_shape)
from bsmm.torch.passes import into_new, run_epilogue, run_pass
from bsmm.torch.registry import Registration, layout_key, lookup, register, registration

__all__ = ["Registration", "register", "lookup", "registration", "layout_key", "PASS_OPS", "fprop_epilogue",
           "run_pass", "check_dtype", "check_like", "check_contiguous", "into_new", "SUPPORTED_DTYPES",
           "CPU_ONLY_DTYPES"]

#: Layers pickled before the registry had a module of its own name their layout's reconstructor here.
_register_layout = _registry._register_layout

_LIBRARY = torch.library.Library("bsmm", "FRAGMENT")


def _define(name: str, schema: str, kernel, fake) -> object:
    _LIBRARY.define(f"{name}{schema}")
    for dispatch_key in ("CPU", "CUDA"):
        _LIBRARY.impl(name, kernel, dispatch_key)
    torch.library.register_fake(f"bsmm::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.bsmm, name).default


def _pass_fake(pass_name: str, a, b, key, feature_axis, tf32, gate=None):
    return a.new_empty(pass_shape(pass_name, a, b, key, feature_axis))


def _pass_kernel(pass_name: str, a, b, key, feature_axis, tf32, gate=None):
    return run_pass(pass_name, a, b, key, feature_axis, tf32, None, gate)


#: Pass name -> its operator (the OpOverload), e.g. ``PASS_OPS["fprop"](x, w, key, 1, False)``; ``gate``:
#: the per-block gates the weights are scaled by, whose closed blocks the kernels skip (:func:`run_pass`).
PASS_OPS = {
    name: _define(name, f"(Tensor {spec.operands[0]}, Tensor {spec.operands[1]}, str key, int feature_axis, "
                        "bool tf32, Tensor? gate=None) -> Tensor",
                  functools.partial(_pass_kernel, name), functools.partial(_pass_fake, name))
    for name, spec in PASSES.items()
}


def _epilogue_fake(x, w, bias, key, feature_axis, tf32, activation, keep_pre, gate=None):
    y_shape, pre_shape = epilogue_shapes(x, w, bias, key, feature_axis, activation, keep_pre)
    return x.new_empty(y_shape), x.new_empty(pre_shape)


def _epilogue_kernel(x, w, bias, key, feature_axis, tf32, activation, keep_pre, gate=None):
    return run_epilogue(x, w, bias, key, feature_axis, tf32, activation, keep_pre, None, gate)


#: y = A(x·W + bias) and, where ``keep_pre``, z = x·W + bias (else an empty tensor):
#: ``fprop_epilogue(x, w, bias or None, key, feature_axis, tf32, activation, keep_pre, gate=None) -> (y, pre)``.
fprop_epilogue = _define(
    "fprop_epilogue", "(Tensor x, Tensor w, Tensor? bias, str key, int feature_axis, bool tf32, str activation, "
                      "bool keep_pre, Tensor? gate=None) -> (Tensor, Tensor)", _epilogue_kernel, _epilogue_fake)

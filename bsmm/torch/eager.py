"""The eager fast path of ``bsmm::matmul``: :func:`product` and its autograd function :class:`_EagerProduct`."""

from __future__ import annotations

import torch

from bsmm.torch.ops import matmul, matmul_bprop, matmul_updat
from bsmm.torch.passes import matmul_operator, run_on, run_pass
from bsmm.torch.registry import live_registration

__all__ = ["product"]


class _EagerProduct(torch.autograd.Function):
    """``bsmm::matmul`` with its autograd formula, for eager calls: ``torch.autograd.Function``
    dispatches in a fraction of a custom operator's host time, and the passes run through
    :func:`bsmm.torch.passes.run_on` directly. A backward that builds a graph (``create_graph=True``)
    calls the differentiable operators, so gradients of any order stay available; ``torch.compile``
    traces the operators themselves (:func:`product`)."""

    @staticmethod
    def forward(ctx, x, w, key, feature_axis, tf32, out_shape):
        ctx.options = (key, feature_axis, tf32)
        ctx.registration = live_registration(key)  # the key stays resolvable until backward
        needs_x, needs_w = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if needs_w else None, w if needs_x else None)
        ctx.op = matmul_operator(key, feature_axis, tf32)
        y = run_on(ctx.op, "fprop", x, w, key, out_shape)
        ctx.rows_shape = (x.shape[0], ctx.op.K) if feature_axis == 1 else (ctx.op.K, x.shape[1])  # y as the pass saw it
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        # (an expanded or transposed view, from sum() or .T; of y's leading dimensions where it had some)
        grad = grad.reshape(ctx.rows_shape).contiguous()
        needs_x, needs_w = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():  # create_graph: differentiable operators
            dx = matmul_bprop(grad, w, *ctx.options) if needs_x else None
            dw = matmul_updat(x, grad, *ctx.options) if needs_w else None
        else:
            key = ctx.options[0]
            dx = run_on(ctx.op, "bprop", grad, w, key) if needs_x else None
            dw = run_on(ctx.op, "updat", x, grad, key) if needs_w else None
        return dx, dw, None, None, None, None


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors of no subclass (a layer's weight is a Parameter)
_EAGER_DEVICES = ("cpu", "cuda")  # (meta tensors take the operator's fake implementation)
# A TorchDispatchMode (make_fx tracing, FlopCounterMode, ...) sees the operators, not the kernels.
_dispatch_mode = torch.utils._python_dispatch._get_current_dispatch_mode
_functorch_level = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", lambda: None)


def product(x: torch.Tensor, w: torch.Tensor, key: str, feature_axis: int, tf32: bool,
            out_shape: tuple | None = None) -> torch.Tensor:
    """``bsmm::matmul`` (y = x·W, differentiable in both), through :class:`_EagerProduct` in eager
    mode on plain CPU and CUDA tensors, else the custom operator (``torch.compile``, ``make_fx``
    and other dispatch modes, ``torch.jit.trace``, fake, meta and functorch tensors, tensor
    subclasses). ``x`` is 2-D; ``out_shape``, where given, is y's shape with the leading
    dimensions the caller flattened out of ``x`` (in eager mode y is then a tensor of that
    shape, not a view)."""
    if (x.__class__ in _PLAIN and w.__class__ in _PLAIN and x.device.type in _EAGER_DEVICES
            and not torch.compiler.is_compiling() and _functorch_level() is None and _dispatch_mode() is None
            and not torch.jit.is_tracing()):
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return _EagerProduct.apply(x, w, key, feature_axis, tf32, out_shape)
        return run_pass("fprop", x, w, key, feature_axis, tf32, out_shape)  # inference: no graph to record
    y = matmul(x, w, key, feature_axis, tf32)
    return y if out_shape is None else y.reshape(out_shape)

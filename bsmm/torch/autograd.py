"""Autograd formulas of the custom operators: three passes whose gradients are the other two.

The products (:mod:`bsmm.torch.ops`) and the convolutions (:mod:`bsmm.torch.conv_ops`) both have
the cotangent structure of a product, with ``g`` the upstream gradient:

- ``fprop(x, w)``: dx = bprop(g, w), dw = updat(x, g).
- ``bprop(dy, w)``: d(dy) = fprop(g, w), dw = updat(g, dy).
- ``updat(x, dy)``: dx = bprop(dy, g), d(dy) = fprop(x, g).

As each backward calls the differentiable operators themselves, gradients of any order stay block-sparse.
"""

from __future__ import annotations

from bsmm.torch.registry import live_registration

__all__ = ["register_bilinear"]


def _setup_context(ctx, inputs, output) -> None:
    # The options are (key, feature_axis, tf32) for the products and (key, spec, tf32) for the convolutions.
    first, second, *options = inputs
    ctx.options = tuple(options)
    # Holding the registration keeps the key resolvable until backward, whatever the caller drops meanwhile.
    ctx.registration = live_registration(options[0])
    needs_first, needs_second = ctx.needs_input_grad[:2]
    # In all three operators the gradient of one operand is a product with the other one only.
    ctx.save_for_backward(first if needs_second else None, second if needs_first else None)


def _autograd(first_gradient, second_gradient):
    """A backward from two formulas ``(g, first, second, *options) -> gradient``."""

    def backward(ctx, grad):
        first, second = ctx.saved_tensors
        # Upstream gradients are often expanded or transposed views (sum(), .T): the kernels need them dense.
        grad = grad.contiguous()
        needs_first, needs_second = ctx.needs_input_grad[:2]
        d_first = first_gradient(grad, first, second, *ctx.options) if needs_first else None
        d_second = second_gradient(grad, first, second, *ctx.options) if needs_second else None
        return d_first, d_second, None, None, None

    return backward


def register_bilinear(fprop, bprop, updat) -> None:
    """Register the autograd formulas of three custom operators with the cotangent structure of a product."""
    fprop.register_autograd(
        _autograd(lambda g, x, w, *o: bprop(g, w, *o), lambda g, x, w, *o: updat(x, g, *o)),
        setup_context=_setup_context,
    )
    bprop.register_autograd(
        _autograd(lambda g, dy, w, *o: fprop(g, w, *o), lambda g, dy, w, *o: updat(g, dy, *o)),
        setup_context=_setup_context,
    )
    updat.register_autograd(
        _autograd(lambda g, x, dy, *o: bprop(dy, g, *o), lambda g, x, dy, *o: fprop(x, g, *o)),
        setup_context=_setup_context,
    )

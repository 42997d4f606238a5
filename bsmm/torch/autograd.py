"""Autograd formulas of the convolutions' custom operators (:mod:`bsmm.torch.conv_ops`): three passes
whose gradients are the other two, by the pass table's cotangents (:attr:`bsmm.passes.BlockPass.cotangents`,
the same as a product's). As each backward calls the differentiable operators themselves, gradients of
any order stay block-sparse. (The products are differentiated by :mod:`bsmm.torch.eager`'s autograd
functions, from the same table.)
"""

from __future__ import annotations

from bsmm.passes import PASSES, cotangent_operands
from bsmm.torch.registry import live_registration

__all__ = ["register_bilinear"]


def _setup_context(ctx, inputs, output) -> None:
    # The options are (key, spec, tf32) for the convolutions.
    first, second, *options = inputs
    ctx.options = tuple(options)
    # Holding the registration keeps the key resolvable until backward, whatever the caller drops meanwhile.
    ctx.registration = live_registration(options[0])
    needs_first, needs_second = ctx.needs_input_grad[:2]
    # In all three operators the gradient of one operand is a pass with the other one only.
    ctx.save_for_backward(first if needs_second else None, second if needs_first else None)


def _autograd(pass_name: str, operators: dict):
    """The backward of ``pass_name``: its cotangents through ``operators`` (pass name -> operator)."""

    def backward(ctx, grad):
        # Upstream gradients are often expanded or transposed views (sum(), .T): the kernels need them dense.
        grad = grad.contiguous()
        found = []
        for needed, rule in zip(ctx.needs_input_grad[:2], PASSES[pass_name].cotangents):
            found.append(operators[rule[0]](*cotangent_operands(rule, ctx.saved_tensors, grad), *ctx.options)
                         if needed else None)
        return (*found, None, None, None)

    return backward


def register_bilinear(fprop, bprop, updat) -> None:
    """Register the autograd formulas of three custom operators with the cotangent structure of a product."""
    operators = {"fprop": fprop, "bprop": bprop, "updat": updat}
    for name, operator in operators.items():
        operator.register_autograd(_autograd(name, operators), setup_context=_setup_context)

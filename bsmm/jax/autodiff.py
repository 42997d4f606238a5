"""The passes as differentiable JAX functions: :func:`differentiable_pass`, a ``jax.custom_vjp``.

Every pass is bilinear in its operands (a, b) and the cotangents of each are again passes; with
g the cotangent of the result, for both feature axes:

- ``fprop(x, w)``: dx = bprop(g, w), dw = updat(x, g).
- ``bprop(dy, w)``: ddy = fprop(g, w), dw = updat(g, dy).
- ``updat(x, dy)``: dx = bprop(dy, g), ddy = fprop(x, g) (g is block data).

So defining each pass's VJP through the others gives reverse mode of any order: gradient
penalties, Hessian-vector products by grad of grad.
"""

from __future__ import annotations

import functools

import jax
from jax.custom_derivatives import SymbolicZero

from bsmm.jax.passes import run_pass

__all__ = ["differentiable_pass"]

_COTANGENTS = {  # pass -> (pass, operands) for the cotangent of a, then of b
    "fprop": (("bprop", lambda a, b, g: (g, b)), ("updat", lambda a, b, g: (a, g))),
    "bprop": (("fprop", lambda a, b, g: (g, b)), ("updat", lambda a, b, g: (g, a))),
    "updat": (("bprop", lambda a, b, g: (b, g)), ("fprop", lambda a, b, g: (a, g))),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def differentiable_pass(a, b, op, pass_name):
    """``run_pass(op, pass_name, a, b)``, differentiable in ``a`` and ``b`` to any order."""
    return run_pass(op, pass_name, a, b)


def _pass_fwd(a, b, op, pass_name):
    # Through the differentiable function itself: under grad of grad the operands are
    # tracers of the outer differentiation, which must see a custom_vjp here too.
    out = differentiable_pass(a.value, b.value, op, pass_name)
    # The cotangent of a needs b and that of b needs a: keep only what will be used, so
    # a data input (no gradient) skips its pass and frozen weights skip updat.
    return out, (b.value if a.perturbed else None, a.value if b.perturbed else None)


def _pass_bwd(op, pass_name, residuals, g):
    b, a = residuals
    if isinstance(g, SymbolicZero):
        return None, None
    return tuple(
        None if kept is None else differentiable_pass(*operands(a, b, g), op, name)
        for kept, (name, operands) in zip((b, a), _COTANGENTS[pass_name])
    )


differentiable_pass.defvjp(_pass_fwd, _pass_bwd, symbolic_zeros=True)

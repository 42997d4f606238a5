"""The passes as differentiable JAX functions: :func:`differentiable_pass`, a ``jax.custom_vjp``.

Every pass is bilinear in its operands (a, b) and the cotangents of each are again passes
(:attr:`bsmm.passes.BlockPass.cotangents`, for both feature axes), so defining each pass's VJP through the others gives reverse mode of any order: gradient
penalties, Hessian-vector products by grad of grad.

Inside ``jax.shard_map`` (with its default ``check_vma=True``) an operand that does not vary along
a manual mesh axis while the other does (replicated weights, sharded activations) is first cast to
varying, as JAX does for its own primitives: the transpose of that cast sums the operand's
cotangent over the axis, so the gradient of replicated weights is the sum over the devices' data,
as for a dense ``x @ w`` in the same ``shard_map``.
"""

from __future__ import annotations

import functools

import jax
from jax.custom_derivatives import SymbolicZero

from bsmm.jax.passes import run_pass, vary_alike
from bsmm.passes import PASSES, cotangent_operands

__all__ = ["differentiable_pass"]


def differentiable_pass(a, b, op, pass_name):
    """``run_pass(op, pass_name, a, b)``, differentiable in ``a`` and ``b`` to any order."""
    a, b = vary_alike(a, b)
    return _pass(a, b, op, pass_name, _explicit_sharding(a), _explicit_sharding(b))


def _explicit_sharding(x):
    """``x``'s sharding where its type shards it along explicit mesh axes (``jax.set_mesh``), else None:
    a cotangent must then have its primal's type, which a pass's result need not have."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if sharding is None or all(entry is None for entry in sharding.spec):
        return None
    return sharding


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _pass(a, b, op, pass_name, a_sharding, b_sharding):
    return run_pass(op, pass_name, a, b)


def _pass_fwd(a, b, op, pass_name, a_sharding, b_sharding):
    # Through the differentiable function itself: under grad of grad the operands are
    # tracers of the outer differentiation, which must see a custom_vjp here too.
    out = differentiable_pass(a.value, b.value, op, pass_name)
    # The cotangent of a needs b and that of b needs a: keep only what will be used, so
    # a data input (no gradient) skips its pass and frozen weights skip updat.
    return out, (b.value if a.perturbed else None, a.value if b.perturbed else None)


def _pass_bwd(op, pass_name, a_sharding, b_sharding, residuals, g):
    b, a = residuals
    if isinstance(g, SymbolicZero):
        return None, None
    return tuple(
        None if kept is None else _typed_like(differentiable_pass(*cotangent_operands(rule, (a, b), g), op, rule[0]),
                                              sharding)
        for kept, rule, sharding in zip((b, a), PASSES[pass_name].cotangents, (a_sharding, b_sharding))
    )


def _typed_like(cotangent, sharding):
    if sharding is None or jax.typeof(cotangent).sharding.spec == sharding.spec:
        return cotangent
    return jax.sharding.reshard(cotangent, sharding.spec)


_pass.defvjp(_pass_fwd, _pass_bwd, symbolic_zeros=True)

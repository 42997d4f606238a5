"""Cases and references shared by the Flax and Equinox layer tests (test_flax.py, test_equinox.py).

References are float64 NumPy products (``reference.py``, no bsmm); the training twin is a dense
JAX model whose weight is masked by the layout, trained with the same optax optimizer.
"""

from __future__ import annotations

import numpy as np
import pytest

# (Skips, rather than fails, pytest --doctest-modules' import of this file where they are missing.)
jax = pytest.importorskip("jax", reason="JAX is not installed")
optax = pytest.importorskip("optax", reason="optax is not installed")
import jax.numpy as jnp  # noqa: E402
from reference import (  # noqa: E402
    assert_close, dense_weight, random_data, random_layout, ref_bprop, ref_fprop, ref_updat, skewed_layout,
)

BS = 8
HIGHEST = jax.lax.Precision.HIGHEST  # dense twins in exact float32 (no TF32 on a GPU)


def _layout(kind: str, rng) -> np.ndarray:
    if kind == "random":
        return random_layout(rng, 4, 3, 0.5)  # C = 32, K = 24
    if kind == "skewed":
        return skewed_layout(rng, 5, 4)  # C = 40, K = 32: dense, sparse and empty block rows and columns
    return np.zeros((3, 2), np.uint8)  # C = 24, K = 16, no block


# name: (layout kind, feature_axis, x's shape from C)
CASES = {
    "random-N7": ("random", 1, lambda c: (7, c)),
    "skewed-rectangular-N5": ("skewed", 1, lambda c: (5, c)),
    "N1": ("random", 1, lambda c: (1, c)),
    "one-vector": ("skewed", 1, lambda c: (c,)),
    "leading-axes": ("skewed", 1, lambda c: (2, 3, c)),
    "axis0-N6": ("random", 0, lambda c: (c, 6)),
    "axis0-vector": ("skewed", 0, lambda c: (c,)),
    "empty-layout-N4": ("empty", 1, lambda c: (4, c)),
}
CASE_IDS = list(CASES)


def make_case(name: str, seed: int, dtype="float32"):
    """(layout, feature_axis, x, dy): fresh normal data; dy is the cotangent of y."""
    kind, axis, shape = CASES[name]
    rng = np.random.default_rng(seed)
    layout = _layout(kind, rng)
    c, k = layout.shape[0] * BS, layout.shape[1] * BS
    x_shape = shape(c)
    y_shape = x_shape[:-1] + (k,) if axis == 1 else (k,) + x_shape[1:]
    return layout, axis, random_data(rng, x_shape, dtype), random_data(rng, y_shape, dtype)


def reference(layout, blocks, bias, x, dy, axis: int):
    """float64 y = x·W + b and the gradients of sum(y * dy): (y, dx, dW blocks, db)."""
    blocks, bias, x, dy = (np.asarray(a, np.float64) for a in (blocks, bias, x, dy))
    c, k = x.shape[-1] if axis == 1 else x.shape[0], bias.shape[0]
    x2, dy2 = (x.reshape(-1, c), dy.reshape(-1, k)) if axis == 1 else (x.reshape(c, -1), dy.reshape(k, -1))
    y = ref_fprop(layout, blocks, BS, x2, axis) + (bias if axis == 1 else bias[:, None])
    dx = ref_bprop(layout, blocks, BS, dy2, axis)
    dw = ref_updat(layout, BS, x2, dy2, axis)
    db = dy2.sum(axis=0 if axis == 1 else 1)
    return y.reshape(dy.shape), dx.reshape(x.shape), dw, db


def training_data(seed: int, c: int, k: int):
    """(x (22, C), target (22, 1), head (K, 1)): a tanh layer and a fixed linear head to regress through."""
    rng = np.random.default_rng(seed)
    return (random_data(rng, (22, c), "float32"), random_data(rng, (22, 1), "float32"),
            random_data(rng, (k, 1), "float32") / 4)


def head_loss(y, head, target):
    """Mean squared error of tanh(y)·head against target."""
    return jnp.mean((jnp.matmul(jnp.tanh(y), head, precision=HIGHEST) - target) ** 2)


def train_masked_dense_twin(layout, blocks, bias, x, target, head, steps: int):
    """The dense model ``x·(W ⊙ mask) + b`` from the same start, trained by optax.adam(0.01):
    (losses, trained W ⊙ mask, trained b) as NumPy arrays."""
    mask = jnp.asarray(np.kron(layout, np.ones((BS, BS))), jnp.float32)
    params = {"w": jnp.asarray(dense_weight(layout, np.asarray(blocks), BS), jnp.float32), "b": jnp.asarray(bias)}
    optimizer = optax.adam(0.01)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(
            lambda p: head_loss(jnp.matmul(x, p["w"] * mask, precision=HIGHEST) + p["b"], head, target))(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    return np.array(losses), np.asarray(params["w"] * mask), np.asarray(params["b"])


def assert_trains_like_twin(losses, twin_losses, dense_kernel, twin_kernel, bias, twin_bias) -> None:
    """Same losses (rtol 1e-5), a falling loss, and the same trained weights (float32 tolerance)."""
    assert losses[-1] < 0.9 * losses[0], f"the model did not learn: {losses}"
    np.testing.assert_allclose(losses, twin_losses, rtol=1e-5)
    assert_close(dense_kernel, twin_kernel, "float32", "trained kernel")
    assert_close(bias, twin_bias, "float32", "trained bias")


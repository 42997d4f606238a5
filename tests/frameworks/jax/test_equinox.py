"""bsmm.equinox: BlockSparseLinear as an eqx.Module, on the CPU and (marker gpu) a GPU.

Outputs and gradients are compared with float64 NumPy references (``layer_cases.reference``);
training with optax against a dense model whose weight is masked by the layout.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

eqx = pytest.importorskip("equinox", reason="Equinox is not installed: bsmm.equinox tests skipped")
optax = pytest.importorskip("optax", reason="optax is not installed: bsmm.equinox tests skipped")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from layer_cases import (  # noqa: E402
    BS, CASE_IDS, assert_trains_like_twin, head_loss, make_case, reference, train_masked_dense_twin,
    training_data,
)
from reference import assert_close, random_data, random_layout  # noqa: E402
import jax_cases  # noqa: E402
from jax_cases import host  # noqa: E402

import bsmm.equinox  # noqa: E402
from conftest import REPO_ROOT  # noqa: E402

device = jax_cases.device  # the fixture (tests take it by name; x64 is in tests/conftest.py)


def linear(layout, axis=1, seed=0, **kwargs):
    return bsmm.equinox.BlockSparseLinear(layout.shape[0] * BS, layout.shape[1] * BS, layout, block_size=BS,
                                          feature_axis=axis, key=jax.random.key(seed), **kwargs)


def with_random_bias(layer, seed: int):
    """The layer with a N(0, 1) bias, so a bias added on the wrong axis shows."""
    bias = jnp.asarray(random_data(np.random.default_rng(seed), layer.bias.shape, "float32"), layer.bias.dtype)
    return eqx.tree_at(lambda layer: layer.bias, layer, bias)


def test_import_bsmm_imports_no_equinox_and_a_missing_equinox_is_named():
    script = (
        "import sys, bsmm\n"
        "print(sorted(m for m in ('equinox', 'jax') if m in sys.modules))\n"
        "sys.modules['equinox'] = None\n"
        "try:\n    import bsmm.equinox\nexcept ImportError as error:\n    print(error)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "bsmm.equinox needs Equinox: pip install equinox"]


@pytest.mark.parametrize("case", CASE_IDS)
def test_output_and_gradients_match_float64_reference(device, case):
    """y, and the gradients of sum(y * dy) for the weight, the bias and x (eqx.filter_grad under
    eqx.filter_jit), at float32's tolerance."""
    layout, axis, x, dy = make_case(case, seed=CASE_IDS.index(case))
    layer = with_random_bias(linear(layout, axis, seed=3), seed=4)
    x_, dy_ = jnp.asarray(x), jnp.asarray(dy)

    @eqx.filter_jit
    def forward_and_gradients(layer, x):
        grads = eqx.filter_grad(lambda both: jnp.sum(both[0](both[1]) * dy_))((layer, x))
        return layer(x), *grads

    y, grads, dx = forward_and_gradients(layer, x_)
    expected = reference(layout, host(layer.weight), host(layer.bias), x, dy, axis)
    assert y.shape == dy.shape and y.dtype == jnp.float32 and y.devices() == {device}
    assert grads.weight.shape == layer.op.w_shape and grads.op is layer.op
    for name, actual, wanted in zip(("y", "dx", "dweight", "dbias"), (y, dx, grads.weight, grads.bias), expected):
        assert_close(host(actual), wanted, "float32", name)
    np.testing.assert_array_equal(host(layer(x_)), host(y))  # eager as jitted


def test_float64_on_the_cpu(x64):
    """dtype float64 (with jax_enable_x64): computed in float64, within 1e-12 of the reference."""
    layout, axis, x, dy = make_case("axis0-N6", seed=20, dtype=np.float64)
    layer = with_random_bias(linear(layout, axis, seed=5, dtype=jnp.float64), seed=6)
    y, vjp = jax.vjp(lambda layer, x: layer(x), layer, jnp.asarray(x))
    grads, dx = vjp(jnp.asarray(dy))
    expected = reference(layout, host(layer.weight), host(layer.bias), x, dy, axis)
    for name, actual, wanted in zip(("y", "dx", "dweight", "dbias"), (y, dx, grads.weight, grads.bias), expected):
        assert actual.dtype == jnp.float64, name
        error = np.linalg.norm(host(actual) - wanted) / np.linalg.norm(wanted)
        assert error <= 1e-12, f"{name}: relative error {error:.3g}"


def test_half_precision_parameters_and_promotion(device):
    """bfloat16 parameters compute in bfloat16; float32 x promotes them to float32."""
    layout, axis, x, dy = make_case("random-N7", seed=21, dtype="bfloat16")
    layer = with_random_bias(linear(layout, seed=7, dtype=jnp.bfloat16), seed=8)
    assert layer.weight.dtype == layer.bias.dtype == jnp.bfloat16
    y = layer(jnp.asarray(x))
    expected = reference(layout, host(layer.weight), host(layer.bias), x, dy, axis)
    assert y.dtype == jnp.bfloat16
    assert_close(host(y), expected[0], "bfloat16", "y")
    promoted = layer(jnp.asarray(x, jnp.float32))
    assert promoted.dtype == jnp.float32
    assert_close(host(promoted), expected[0], "float32", "promoted y")


def test_initial_parameters():
    """weight: std 1/sqrt(fan-in) per block column, counting present blocks only; bias: zeros,
    or None without one (then it is no leaf)."""
    layout = np.ones((16, 2), np.uint8)
    layout[8:, 1] = 0  # block column 0 has 16 blocks of fan-in, column 1 has 8
    layer = linear(layout, seed=9)
    weight = host(layer.weight)
    _, columns = np.nonzero(layout)
    for column, fan_in in ((0, 16), (1, 8)):
        assert abs(weight[columns == column].std() * np.sqrt(fan_in * BS) - 1) < 0.1, column
    assert layer.bias.shape == (layer.out_features,) and not host(layer.bias).any()
    unbiased = linear(layout, seed=9, use_bias=False)
    assert unbiased.bias is None and len(jax.tree.leaves(unbiased)) == 1
    np.testing.assert_array_equal(host(unbiased.weight), weight)  # the same key draws the same weight


def test_trains_like_a_masked_dense_model(device):
    """optax.adam through eqx.filter_value_and_grad under eqx.filter_jit, 6 steps: the same losses and
    trained weights as the dense model x·(W ⊙ mask) + b from the same start; traced once."""
    layout = random_layout(np.random.default_rng(10), 3, 4, 0.5)
    layer = with_random_bias(linear(layout, seed=11), seed=12)
    x, target, head = (jnp.asarray(a) for a in training_data(13, layer.in_features, layer.out_features))
    twin = train_masked_dense_twin(layout, host(layer.weight), host(layer.bias), x, target, head, 6)
    optimizer = optax.adam(0.01)
    state = optimizer.init(eqx.filter(layer, eqx.is_array))
    traces = []

    @eqx.filter_jit
    def step(layer, state):
        traces.append(1)
        loss, grads = eqx.filter_value_and_grad(lambda layer: head_loss(layer(x), head, target))(layer)
        updates, state = optimizer.update(grads, state, layer)
        return eqx.apply_updates(layer, updates), state, loss

    losses = []
    for _ in range(6):
        layer, state, loss = step(layer, state)
        losses.append(float(loss))
    assert len(traces) == 1, "the static layout must not make filter_jit retrace"
    dense_weight = layer.op.to_dense(host(layer.weight))
    assert_trains_like_twin(np.array(losses), twin[0], dense_weight, twin[1], host(layer.bias), twin[2])


@pytest.mark.parametrize("axis", [1, 0], ids=["axis1", "axis0"])
def test_jax_jit_and_vmap(device, axis):
    """jax.jit takes the module itself (the layout is static); jax.vmap of the layer over single
    examples (Equinox's convention) matches the batched call."""
    layout, _, x, _ = make_case("random-N7" if axis == 1 else "axis0-N6", seed=14)
    layer = with_random_bias(linear(layout, axis, seed=15), seed=16)
    x_ = jnp.asarray(x)
    jitted = jax.jit(lambda layer, x: layer(x))(layer, x_)
    examples = x_ if axis == 1 else x_.T
    vmapped = jax.vmap(layer)(examples)
    np.testing.assert_array_equal(host(jitted), host(layer(x_)))
    batched = host(layer(x_)) if axis == 1 else host(layer(x_)).T
    assert_close(host(vmapped), batched, "float32", "vmap")


def test_serialise_leaves_and_pickle(tmp_path):
    """eqx.tree_serialise_leaves into a fresh layer, and pickle, give layers computing the same."""
    layout, _, x, _ = make_case("skewed-rectangular-N5", seed=17)
    layer = with_random_bias(linear(layout, seed=18), seed=19)
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, layer)
    buffer.seek(0)
    restored = eqx.tree_deserialise_leaves(buffer, linear(layout, seed=20))
    clone = pickle.loads(pickle.dumps(layer))
    assert np.array_equal(clone.op.layout, layout) and clone.op is not layer.op
    for other in (restored, clone):
        np.testing.assert_array_equal(host(other(x)), host(layer(x)))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"in_features": 24}, ValueError, r"in_features must be layout.shape\[0\] \* block_size = 32; got 24"),
        ({"out_features": 32}, ValueError, r"out_features must be layout.shape\[1\] \* block_size = 24; got 32"),
        ({"dtype": jnp.int32}, TypeError, "dtype has dtype int32; supported dtypes are float32"),
        ({"block_size": 12}, ValueError, "block_size must be one of"),
    ],
    ids=["in-features", "out-features", "dtype", "block-size"],
)
def test_bad_arguments_name_the_argument(kwargs, error, match):
    layout = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 0], [0, 0, 1]], np.uint8)  # C = 32, K = 24
    arguments = {"in_features": 32, "out_features": 24, "layout": layout, "block_size": BS} | kwargs
    with pytest.raises(error, match=match):
        bsmm.equinox.BlockSparseLinear(**arguments, key=jax.random.key(0))


def test_bad_input_names_x():
    layer = linear(np.ones((4, 3), np.uint8), axis=0)
    with pytest.raises(ValueError, match=r"x must have shape \(32, N\) or \(32,\) \(features first"):
        layer(jnp.ones((2, 32, 5)))

"""bsmm.flax: BlockSparseLinear as a flax.nnx.Module, on the CPU and (marker gpu) a GPU.

Outputs and gradients are compared with float64 NumPy references (``layer_cases.reference``);
training with optax against a dense model whose weight is masked by the layout.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flax.nnx", reason="Flax is not installed: bsmm.flax tests skipped")
optax = pytest.importorskip("optax", reason="optax is not installed: bsmm.flax tests skipped")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from layer_cases import (  # noqa: E402
    BS, CASE_IDS, assert_trains_like_twin, head_loss, make_case, reference, train_masked_dense_twin,
    training_data,
)
from reference import assert_close, random_data, random_layout  # noqa: E402
import jax_cases  # noqa: E402
from jax_cases import host  # noqa: E402

import bsmm.flax  # noqa: E402
from conftest import REPO_ROOT  # noqa: E402

device = jax_cases.device  # the fixture (tests take it by name; x64 is in tests/conftest.py)


def linear(layout, axis=1, **kwargs):
    return bsmm.flax.BlockSparseLinear(layout.shape[0] * BS, layout.shape[1] * BS, layout, block_size=BS,
                                       feature_axis=axis, **kwargs)


def test_import_bsmm_imports_no_flax_and_a_missing_flax_is_named():
    script = (
        "import sys, bsmm\n"
        "print(sorted(m for m in ('flax', 'jax', 'optax') if m in sys.modules))\n"
        "sys.modules['flax'] = None\n"
        "try:\n    import bsmm.flax\nexcept ImportError as error:\n    print(error)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "bsmm.flax needs Flax (with its NNX API): pip install flax"]


@pytest.mark.parametrize("case", CASE_IDS)
def test_output_and_gradients_match_float64_reference(device, case):
    """y, and the gradients of sum(y * dy) for the kernel, the bias and x (nnx.grad under nnx.jit),
    at float32's tolerance; a random bias shows it is added on the feature axis."""
    layout, axis, x, dy = make_case(case, seed=CASE_IDS.index(case))
    layer = linear(layout, axis, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(3))
    x_, dy_ = jnp.asarray(x), jnp.asarray(dy)

    @nnx.jit
    def forward_and_gradients(layer, x):
        return layer(x), *nnx.grad(lambda layer, x: jnp.sum(layer(x) * dy_), argnums=(0, 1))(layer, x)

    y, grads, dx = forward_and_gradients(layer, x_)
    expected = reference(layout, host(layer.kernel[...]), host(layer.bias[...]), x, dy, axis)
    assert y.shape == dy.shape and y.dtype == jnp.float32 and y.devices() == {device}
    assert grads["kernel"][...].shape == layer.op.w_shape == layer.kernel.shape
    for name, actual, wanted in zip(("y", "dx", "dkernel", "dbias"),
                                    (y, dx, grads["kernel"][...], grads["bias"][...]), expected):
        assert_close(host(actual), wanted, "float32", name)
    np.testing.assert_array_equal(host(layer(x_)), host(y))  # eager as jitted


def test_float64_on_the_cpu(x64):
    """param_dtype float64 (with jax_enable_x64): computed in float64, within 1e-12 of the reference."""
    layout, axis, x, dy = make_case("skewed-rectangular-N5", seed=20, dtype=np.float64)
    layer = linear(layout, param_dtype=jnp.float64, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(4))
    y = layer(x)
    grads, dx = nnx.grad(lambda layer, x: jnp.sum(layer(x) * dy), argnums=(0, 1))(layer, jnp.asarray(x))
    expected = reference(layout, host(layer.kernel[...]), host(layer.bias[...]), x, dy, axis)
    for name, actual, wanted in zip(("y", "dx", "dkernel", "dbias"),
                                    (y, dx, grads["kernel"][...], grads["bias"][...]), expected):
        assert actual.dtype == jnp.float64, name
        error = np.linalg.norm(host(actual) - wanted) / np.linalg.norm(wanted)
        assert error <= 1e-12, f"{name}: relative error {error:.3g}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compute_dtype(device, dtype):
    """dtype: computed in bfloat16/float16 from float32 parameters, whose gradients stay float32;
    without it, bfloat16 x and float32 parameters promote to float32."""
    layout, axis, x, dy = make_case("random-N7", seed=21, dtype=dtype)
    layer = linear(layout, dtype=dtype, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(5))
    y = layer(jnp.asarray(x))
    grads = nnx.grad(lambda layer: jnp.sum(layer(x).astype(jnp.float32) * dy))(layer)
    assert y.dtype == jnp.dtype(dtype) and layer.kernel[...].dtype == grads["kernel"][...].dtype == jnp.float32
    kernel, bias = (host(v[...].astype(dtype)) for v in (layer.kernel, layer.bias))  # what the pass multiplies
    expected = reference(layout, kernel, bias, x, dy, axis)
    assert_close(host(y), expected[0], dtype, "y")
    assert_close(host(grads["kernel"][...]), expected[2], dtype, "dkernel")
    promoted = linear(layout, rngs=nnx.Rngs(5))(jnp.asarray(x, jnp.bfloat16))
    assert promoted.dtype == jnp.float32


def test_default_kernel_is_scaled_by_fan_in_and_initializers_are_used():
    """The default kernel: std 1/sqrt(fan-in) per block column, counting present blocks only;
    kernel_init gets (nnzb, bs, bs) and param_dtype; without a bias, the state holds the kernel only."""
    layout = np.ones((16, 2), np.uint8)
    layout[8:, 1] = 0  # block column 0 has 16 blocks of fan-in, column 1 has 8
    kernel = host(linear(layout, rngs=nnx.Rngs(6)).kernel[...])
    _, columns = np.nonzero(layout)
    for column, fan_in in ((0, 16), (1, 8)):
        assert abs(kernel[columns == column].std() * np.sqrt(fan_in * BS) - 1) < 0.1, column
    seen = []

    def ones(key, shape, dtype):
        seen.append((tuple(shape), jnp.dtype(dtype)))
        return jnp.ones(shape, dtype)

    layer = linear(layout, use_bias=False, kernel_init=ones, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(7))
    assert seen == [(layer.op.w_shape, jnp.dtype(jnp.bfloat16))] and layer.bias is None
    assert set(nnx.to_pure_dict(nnx.state(layer))) == {"kernel"}
    x = random_data(np.random.default_rng(8), (3, layer.in_features), "float32")
    expected = reference(layout, np.ones(layer.op.w_shape), np.zeros(layer.out_features), x,
                         np.zeros((3, layer.out_features)), 1)[0]
    assert_close(host(layer(x)), expected, "bfloat16")


def test_trains_like_a_masked_dense_model(device):
    """nnx.Optimizer with optax.adam under nnx.jit, 6 steps: the same losses and trained weights as
    the dense model x·(W ⊙ mask) + b from the same start; the step is traced once."""
    layout = random_layout(np.random.default_rng(9), 3, 4, 0.5)
    layer = linear(layout, bias_init=nnx.initializers.normal(0.1), rngs=nnx.Rngs(10))
    x, target, head = (jnp.asarray(a) for a in training_data(11, layer.in_features, layer.out_features))
    twin = train_masked_dense_twin(layout, host(layer.kernel[...]), host(layer.bias[...]), x, target, head, 6)
    optimizer = nnx.Optimizer(layer, optax.adam(0.01), wrt=nnx.Param)
    traces = []

    @nnx.jit
    def step(layer, optimizer):
        traces.append(1)
        loss, grads = nnx.value_and_grad(lambda layer: head_loss(layer(x), head, target))(layer)
        optimizer.update(layer, grads)
        return loss

    losses = np.array([float(step(layer, optimizer)) for _ in range(6)])
    assert len(traces) == 1, "the static layout must not make nnx.jit retrace"
    dense_kernel = host(jnp.asarray(layer.op.to_dense(host(layer.kernel[...]))))
    assert_trains_like_twin(losses, twin[0], dense_kernel, twin[1], host(layer.bias[...]), twin[2])


def test_split_merge_under_jax_jit_and_vmap(device):
    """The layer as plain JAX pytrees: jax.jit of nnx.merge over nnx.split's state, and jax.vmap over
    a batch of inputs (folded into one pass), give the layer's own output."""
    layout, axis, x, _ = make_case("leading-axes", seed=12)
    layer = linear(layout, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(13))
    graphdef, state = nnx.split(layer)
    x_ = jnp.asarray(x)
    jitted = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, x_)
    vmapped = jax.vmap(layer)(x_)
    expected = reference(layout, host(layer.kernel[...]), host(layer.bias[...]), x, np.zeros(vmapped.shape), axis)
    np.testing.assert_array_equal(host(jitted), host(layer(x_)))
    assert_close(host(vmapped), expected[0], "float32", "vmap")


def test_state_round_trip_and_pickle():
    """nnx.state as a pure dict restores into a fresh layer; a pickled layer computes the same."""
    layout, _, x, _ = make_case("skewed-rectangular-N5", seed=14)
    layer = linear(layout, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(15))
    pure = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(layer)))
    fresh = linear(layout, rngs=nnx.Rngs(16))
    state = nnx.state(fresh)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(fresh, state)
    clone = pickle.loads(pickle.dumps(layer))
    assert np.array_equal(clone.op.layout, layout) and clone.op is not layer.op
    for other in (fresh, clone):
        np.testing.assert_array_equal(host(other(x)), host(layer(x)))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"in_features": 24}, ValueError, r"in_features must be layout.shape\[0\] \* block_size = 32; got 24"),
        ({"out_features": 32}, ValueError, r"out_features must be layout.shape\[1\] \* block_size = 24; got 32"),
        ({"param_dtype": jnp.int32}, TypeError, "param_dtype has dtype int32; supported dtypes are float32"),
        ({"dtype": "float8_e4m3fn"}, TypeError, "dtype has dtype float8_e4m3fn; supported dtypes are float32"),
        ({"feature_axis": 2}, ValueError, "feature_axis must be 0 or 1; got 2"),
    ],
    ids=["in-features", "out-features", "param-dtype", "dtype", "feature-axis"],
)
def test_bad_arguments_name_the_argument(kwargs, error, match):
    layout = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 0], [0, 0, 1]], np.uint8)  # C = 32, K = 24
    arguments = {"in_features": 32, "out_features": 24, "layout": layout, "block_size": BS} | kwargs
    with pytest.raises(error, match=match):
        bsmm.flax.BlockSparseLinear(**arguments, rngs=nnx.Rngs(0))


def test_bad_input_names_x():
    layer = linear(np.ones((4, 3), np.uint8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 32\) \(features last, feature_axis=1\); "
                                         r"got \(2, 24\)"):
        layer(jnp.ones((2, 24)))

"""bsmm.jax's convolutions: blocksparse_conv and the BlockSparseConv layer.

Compared with JAX's own dense convolution (``lax.conv_general_dilated``, precision
"highest") on the layout-masked weight, built with JAX ops from the blocks (no bsmm
code), so its gradients with respect to the blocks come from JAX's autodiff too. CPU cases
always run; GPU cases carry the ``gpu`` marker.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax", reason="JAX is not installed: bsmm.jax tests skipped")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import bsmm.jax as bjax  # noqa: E402
import bsmm.jax.passes  # noqa: E402
from bsmm.nn.conv import BlocksparseConv  # noqa: E402
from reference import assert_close, random_data, random_layout  # noqa: E402
from test_jax import passes_in, put  # noqa: E402
import jax_cases  # noqa: E402
from jax_cases import host  # noqa: E402

device = jax_cases.device  # the fixture (tests take it by name; x64 is in tests/conftest.py)

BS = 8
SPATIAL = {1: "W", 2: "HW", 3: "DHW"}


def dense_kernel(conv: BlocksparseConv, w):
    """(*kernel_size, C, K) masked dense weight from the blocks, with JAX ops (differentiable)."""
    rows, cols = np.nonzero(conv.layout)
    cb, kb = conv.layout.shape
    bs, taps = conv.block_size, len(conv.kernel_size)
    blocks = w.reshape((-1,) + w.shape[taps:])  # (V, nnzb, bs, bs)
    dense = jnp.zeros((blocks.shape[0], cb, bs, kb, bs), w.dtype).at[:, rows, :, cols, :].set(
        jnp.moveaxis(blocks, 1, 0))
    return dense.reshape(conv.kernel_size + (conv.C, conv.K))


def dense_conv(x, w, conv: BlocksparseConv):
    """The dense JAX twin of blocksparse_conv."""
    spatial = SPATIAL[conv.ndim]
    layout = "N" + spatial + "C" if conv.channels_last else "NC" + spatial
    return jax.lax.conv_general_dilated(
        x, dense_kernel(conv, w), conv.stride, [(p, p) for p in conv.padding], rhs_dilation=conv.dilation,
        dimension_numbers=(layout, spatial + "IO", layout), precision="highest",
        preferred_element_type=jnp.float32 if x.dtype != jnp.float64 else None).astype(x.dtype)


GEOMETRIES = {  # kernel_size, stride, padding, dilation, input spatial shape, channels_last
    "1d-5-s3-p2-first": ((5,), 3, 2, 1, (13,), False),
    "2d-3x3-p1": ((3, 3), 1, 1, 1, (5, 6), True),
    "2d-3x2-s(2,1)-d2-first": ((3, 2), (2, 1), (2, 0), 2, (9, 7), False),
    "3d-2-s2": ((2, 2, 2), 2, 0, 1, (4, 5, 4), True),
}


def make_case(name, dtype="float32", seed=0, layout=None):
    kernel, stride, padding, dilation, spatial, channels_last = GEOMETRIES[name]
    rng = np.random.default_rng([seed, len(name)])
    layout = random_layout(rng, 3, 2, 0.6) if layout is None else layout
    conv = BlocksparseConv(layout, BS, kernel, stride, padding, dilation, channels_last)
    shape = (2, *spatial, conv.C) if channels_last else (2, conv.C, *spatial)
    x, w = random_data(rng, shape, dtype), random_data(rng, conv.w_shape, dtype)
    dy = random_data(rng, conv.output_shape(shape), dtype)
    return conv, x, w, dy


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_forward_and_gradients_match_dense_jax(device, name, dtype):
    conv, x, w, dy = make_case(name, dtype)
    x, w, dy = (put(a, device) for a in (x, w, dy))

    def loss(function, x, w):
        return jnp.vdot(function(x, w, conv).astype(jnp.float32), dy.astype(jnp.float32))

    y = jax.jit(bjax.blocksparse_conv, static_argnums=2)(x, w, conv)
    assert y.dtype == x.dtype and y.shape == conv.output_shape(x.shape)
    grads = jax.jit(jax.grad(lambda x, w: loss(bjax.blocksparse_conv, x, w), argnums=(0, 1)))(x, w)
    f32 = [a.astype(jnp.float32) for a in (x, w)]
    expected = jax.jit(jax.grad(lambda x, w: loss(dense_conv, x, w), argnums=(0, 1)))(*f32)
    assert_close(host(y), host(jax.jit(dense_conv, static_argnums=2)(*f32, conv)), dtype, "y")
    assert_close(host(grads[0]), host(expected[0]), dtype, "dx")
    assert_close(host(grads[1]), host(expected[1]), dtype, "dw")


def test_check_grads_float64(x64):
    """Finite differences of first and second order (reverse mode) in float64 on the CPU backend."""
    conv, x, w, _ = make_case("2d-3x2-s(2,1)-d2-first", np.float64)
    check_grads(lambda x, w: bjax.blocksparse_conv(x, w, conv), (jnp.asarray(x), jnp.asarray(w)), order=2,
                modes=["rev"])


def test_second_order_gradients_match_dense(device):
    """A gradient penalty through conv_bprop and conv_updat (grad of grad) against dense JAX."""
    conv, x, w, _ = make_case("2d-3x3-p1")
    x, w = put(x, device), put(w, device)

    def penalty(function, x, w):
        dx = jax.grad(lambda x: jnp.sum(function(x, w, conv) ** 2))(x)
        return jnp.sum(dx ** 2) + jnp.sum(function(x, w, conv))

    got = jax.jit(jax.grad(lambda x, w: penalty(bjax.blocksparse_conv, x, w), argnums=(0, 1)))(x, w)
    expected = jax.jit(jax.grad(lambda x, w: penalty(dense_conv, x, w), argnums=(0, 1)))(x, w)
    for a, b, what in zip(got, expected, ("dx", "dw")):
        assert_close(host(a), host(b), "float32", what)


def test_backward_runs_only_the_passes_it_needs():
    conv, x, w, _ = make_case("1d-5-s3-p2-first")
    x, w = jnp.asarray(x), jnp.asarray(w)
    only_w = jax.make_jaxpr(jax.grad(lambda w: bjax.blocksparse_conv(x, w, conv).sum()))(w)
    only_x = jax.make_jaxpr(jax.grad(lambda x: bjax.blocksparse_conv(x, w, conv).sum()))(x)
    assert [p.split("(")[0] for p in passes_in(only_w)] == ["bsmm.fprop", "bsmm.updat"]
    assert [p.split("(")[0] for p in passes_in(only_x)] == ["bsmm.fprop", "bsmm.bprop"]


def test_jit_traces_once_per_shape(monkeypatch):
    """bsmm's conv passes are traced once per input shape, for eager calls (a new ConvPasses
    each call, equal by value) as under an outer jit."""
    conv, x, w, _ = make_case("2d-3x3-p1")
    traced = []  # each trace of a pass makes its XLA callback once
    original = bsmm.jax.passes.buffer_callback
    monkeypatch.setattr(bsmm.jax.passes, "buffer_callback", lambda callback, *args, **kwargs: traced.append(
        (callback.pass_name, callback.op.x_shape)) or original(callback, *args, **kwargs))
    jitted = jax.jit(lambda x, w: bjax.blocksparse_conv(x, w, conv) * 2)
    for _ in range(3):
        eager = bjax.blocksparse_conv(jnp.asarray(x), jnp.asarray(w), conv)
        twice = jitted(jnp.asarray(x), jnp.asarray(w))
    assert traced == [("fprop", x.shape)], traced
    bjax.blocksparse_conv(jnp.asarray(x[:1]), jnp.asarray(w), conv).block_until_ready()
    assert traced == [("fprop", x.shape), ("fprop", x[:1].shape)], traced
    np.testing.assert_allclose(np.asarray(twice), 2 * np.asarray(eager), rtol=1e-6)


def test_empty_layout_and_empty_batch(device):
    conv, x, w, dy = make_case("2d-3x3-p1", layout=np.zeros((3, 2), np.uint8))
    assert conv.w_shape == (3, 3, 0, BS, BS)
    y, grad = jax.value_and_grad(lambda x: bjax.blocksparse_conv(x, put(w, device), conv).sum())(put(x, device))
    assert float(y) == 0 and not host(grad).any()
    conv, x, w, _ = make_case("2d-3x3-p1")
    y = bjax.blocksparse_conv(put(x[:0], device), put(w, device), conv)
    assert y.shape == (0, 5, 6, conv.K)


def test_layer_trains_like_a_masked_dense_model(device):
    """Two SGD steps of a strided, channels-first layer against the same steps on dense JAX."""
    layer = bjax.BlockSparseConv(24, 16, (3, 3), random_layout(np.random.default_rng(3), 3, 2, 0.6), block_size=BS,
                                 stride=2, padding=1, channels_last=False)
    params = jax.device_put(layer.init(jax.random.key(1)), device)
    params["b"] = params["b"] + 0.5
    x = put(np.random.default_rng(4).standard_normal((2, 24, 7, 8)).astype(np.float32), device)

    def dense_apply(params, x):
        return dense_conv(x, params["w"], layer.conv) + params["b"][:, None, None]

    results = []
    for apply in (layer.apply, dense_apply):
        step = jax.jit(lambda p: jax.tree.map(lambda a, g: a - 0.5 * g, p,
                                              jax.grad(lambda p: jnp.mean(apply(p, x) ** 2))(p)))
        results.append(step(step(params)))
    for key in ("w", "b"):
        assert_close(host(results[0][key]), host(results[1][key]), "float32", key)


def test_layer_init_and_repr():
    layout = np.array([[1, 1], [1, 0], [1, 0], [1, 0]])
    layer = bjax.BlockSparseConv(128, 64, 3, layout, block_size=32)
    params = layer.init(jax.random.key(0), dtype="bfloat16")
    assert params["w"].shape == (3, 3, 5, 32, 32) and params["w"].dtype == jnp.bfloat16
    assert not host(params["b"]).any()
    columns = layer.conv.index.indices
    w = host(params["w"]).astype(np.float64)
    assert np.std(w[:, :, columns == 0]) == pytest.approx(1 / np.sqrt(4 * 32 * 9), rel=0.05)
    assert np.std(w[:, :, columns == 1]) == pytest.approx(1 / np.sqrt(32 * 9), rel=0.05)
    assert repr(layer).startswith("BlockSparseConv(BlocksparseConv(C=128, K=64, block_size=32, blocks=5")


def test_errors_name_the_argument():
    conv, x, w, _ = make_case("2d-3x3-p1")
    x, w = jnp.asarray(x), jnp.asarray(w)
    valid = BlocksparseConv(conv.layout, BS, (3, 3))
    cases = [
        (lambda: bjax.blocksparse_conv(x, w, "conv"), TypeError, "conv must be a bsmm.nn.conv.BlocksparseConv"),
        (lambda: bjax.blocksparse_conv([1.0], w, conv), TypeError, "x must be a JAX or NumPy array"),
        (lambda: bjax.blocksparse_conv(x[0], w, conv), ValueError, r"x must have shape \(N, H, W, 24\)"),
        (lambda: bjax.blocksparse_conv(x[:, :1, :1], w, valid), ValueError, "smaller than the dilated kernel"),
        (lambda: bjax.blocksparse_conv(x, w[:1], conv), ValueError, "w must have shape w_shape"),
        (lambda: bjax.blocksparse_conv(x, w.astype(jnp.float16), conv), TypeError, "w has dtype float16"),
        (lambda: bjax.blocksparse_conv(x.astype(jnp.int32), w, conv), TypeError, "x has dtype int32"),
        (lambda: bjax.blocksparse_conv(np.ones(x.shape), np.ones(w.shape), conv), TypeError, "jax_enable_x64"),
        (lambda: bjax.BlockSparseConv(24, 8, 3, conv.layout, BS), ValueError, "out_channels must be"),
        (lambda: bjax.BlockSparseConv(24, 16, 3, conv.layout, BS).apply({"w": w, "b": jnp.ones(3)}, x),
         ValueError, r"params\['b'\] must have shape \(16,\)"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()

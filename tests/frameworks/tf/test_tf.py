"""bsmm.tf: the differentiable TensorFlow op and the BlockSparseDense Keras layer.

Forward results and gradients are compared with float64 NumPy references
(``reference.py``) at each dtype's tolerance, and with TensorFlow's own dense
``tf.matmul`` over a ``W`` assembled from the blocks with TensorFlow ops. Every
case runs eagerly and inside ``tf.function``. GPU cases need TensorFlow with a
GPU and CuPy; they carry the ``gpu`` marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed: bsmm.tf tests skipped")
keras = pytest.importorskip("keras", reason="Keras is not installed: bsmm.tf tests skipped")

import bsmm  # noqa: E402
import bsmm.tf as btf  # noqa: E402
from conftest import REPO_ROOT  # noqa: E402
from reference import (  # noqa: E402
    DTYPES, assert_close, random_data, random_layout, ref_bprop, ref_fprop, ref_updat,
)

BS = 8
LAYOUT = np.array([[1, 0, 1, 1], [0, 0, 1, 0], [1, 1, 0, 1]], dtype=np.uint8)  # C = 24, K = 32, 7 blocks
TF_DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16}
MODES = ["eager", "function"]


def shape_of(features: int, n: int, axis: int) -> tuple:
    return (n, features) if axis == 1 else (features, n)


def in_mode(mode: str, function):
    """``function`` as is (eager) or wrapped in a fresh ``tf.function``."""
    return function if mode == "eager" else tf.function(function)


def dense_weight_tf(op: bsmm.BlocksparseMatMul, w: tf.Tensor) -> tf.Tensor:
    """Dense W (C, K) assembled from block data with TensorFlow ops (differentiable in ``w``):
    block ``b`` goes to the ``b``-th nonzero of the layout in row-major order."""
    rows, cols = np.nonzero(op.layout)
    cb, kb = op.layout.shape
    grid = tf.scatter_nd(np.stack([rows, cols], axis=1), w, (cb, kb, op.block_size, op.block_size))
    return tf.reshape(tf.transpose(grid, (0, 2, 1, 3)), (op.C, op.K))


def dense_matmul_tf(op: bsmm.BlocksparseMatMul, x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    weight = dense_weight_tf(op, w)
    return tf.matmul(x, weight) if op.feature_axis == 1 else tf.matmul(weight, x, transpose_a=True)


def forward_and_gradients(op, x, w, dy, matmul=btf.blocksparse_matmul):
    """y = matmul(x, w, op) and the gradients of sum(y * dy): (y, dx, dw), dx = dy·Wᵀ, dw = xᵀ·dy."""
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = matmul(x, w, op)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.cast(dy, tf.float32))
    dx, dw = tape.gradient(loss, [x, w])
    return y, dx, dw


# -- import -------------------------------------------------------------------------------------
def test_import_without_tensorflow_says_what_to_install():
    """``import bsmm`` imports no TensorFlow; ``import bsmm.tf`` without it names the package to install."""
    script = (
        "import sys\n"
        "import bsmm\n"
        "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules, 'import bsmm imported TF'\n"
        "sys.modules['tensorflow'] = None\n"
        "try:\n"
        "    import bsmm.tf\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    root = str(REPO_ROOT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "bsmm.tf needs TensorFlow: pip install tensorflow-cpu" in done.stdout


# -- forward and gradients against float64 references ---------------------------------------------
CASES = {
    "random-N7": (LAYOUT, 7),
    "random-N1": (LAYOUT, 1),
    "empty-N5": (np.zeros((2, 3), np.uint8), 5),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("axis", [1, 0], ids=["axis1", "axis0"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_passes_match_float64_reference(case, dtype, axis, mode):
    """y, dx and dw of one op in every dtype, feature axis and mode, at the dtype's tolerance;
    the input tensors' memory (shared with bsmm) is left unchanged."""
    layout, n = CASES[case]
    rng = np.random.default_rng(n + 10 * axis)
    op = bsmm.BlocksparseMatMul(layout, block_size=BS, feature_axis=axis)
    x_np = random_data(rng, shape_of(op.C, n, axis), dtype)
    dy_np = random_data(rng, shape_of(op.K, n, axis), dtype)
    w_np = random_data(rng, op.w_shape, dtype)
    x, dy, w = (tf.constant(a, dtype=TF_DTYPES[dtype]) for a in (x_np, dy_np, w_np))
    before = [t.numpy().tobytes() for t in (x, dy, w)]

    y, dx, dw = in_mode(mode, forward_and_gradients)(op, x, w, dy)

    assert (y.dtype, dx.dtype, dw.dtype) == (x.dtype,) * 3
    assert tuple(y.shape) == shape_of(op.K, n, axis) and tuple(dw.shape) == op.w_shape
    assert_close(y.numpy(), ref_fprop(layout, w_np, BS, x_np, axis), dtype, "y")
    assert_close(dx.numpy(), ref_bprop(layout, w_np, BS, dy_np, axis), dtype, "dx")
    assert_close(dw.numpy(), ref_updat(layout, BS, x_np, dy_np, axis), dtype, "dw")
    assert [t.numpy().tobytes() for t in (x, dy, w)] == before


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("axis", [1, 0], ids=["axis1", "axis0"])
def test_gradients_match_dense_tf_matmul(axis, mode):
    """float32 analytic gradients equal those TensorFlow derives for its own dense matmul over
    W assembled from the same blocks (norm-wise relative error <= 1e-5)."""
    rng = np.random.default_rng(3 + axis)
    layout = random_layout(rng, 5, 4, 0.5)
    op = bsmm.BlocksparseMatMul(layout, block_size=BS, feature_axis=axis)
    x = tf.constant(random_data(rng, shape_of(op.C, 9, axis), "float32"))
    dy = tf.constant(random_data(rng, shape_of(op.K, 9, axis), "float32"))
    w = tf.constant(random_data(rng, op.w_shape, "float32"))
    ours = in_mode(mode, forward_and_gradients)(op, x, w, dy)
    dense = forward_and_gradients(op, x, w, dy, matmul=lambda x, w, op: dense_matmul_tf(op, x, w))
    for name, a, b in zip(("y", "dx", "dw"), ours, dense):
        assert_close(a.numpy(), b.numpy(), "float32", name)


@pytest.mark.parametrize("axis", [1, 0], ids=["axis1", "axis0"])
def test_compute_gradient(axis):
    """tf.test.compute_gradient in float32 (float64: test_compute_gradient_float64): the Jacobians built from our
    gradient agree with central differences to 2e-3 of the largest entry (float32 differences
    of step 1e-3 are good to ~1e-4 here), and with the dense model's Jacobians to 1e-5."""
    rng = np.random.default_rng(30 + axis)
    op = bsmm.BlocksparseMatMul(random_layout(rng, 2, 3, 0.6), block_size=BS, feature_axis=axis)
    x = tf.constant(random_data(rng, shape_of(op.C, 3, axis), "float32"))
    w = tf.constant(random_data(rng, op.w_shape, "float32"))
    theoretical, numerical = tf.test.compute_gradient(lambda x, w: btf.blocksparse_matmul(x, w, op), [x, w])
    dense, _ = tf.test.compute_gradient(lambda x, w: dense_matmul_tf(op, x, w), [x, w])
    for ours, finite_difference, reference in zip(theoretical, numerical, dense):
        assert np.abs(ours - finite_difference).max() <= 2e-3 * np.abs(finite_difference).max()
        assert_close(ours, reference, "float32", "Jacobian")


@pytest.mark.parametrize("axis", [1, 0], ids=["axis1", "axis0"])
@pytest.mark.parametrize("mode", MODES)
def test_float64_matches_reference(axis, mode):
    """float64 CPU tensors are computed in float64: y, dx, dw within 1e-12 of the float64 reference."""
    rng = np.random.default_rng(32 + axis)
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS, feature_axis=axis)
    x, dy, w = (rng.standard_normal(shape) for shape in (shape_of(op.C, 7, axis), shape_of(op.K, 7, axis),
                                                          op.w_shape))

    def forward_and_backward(x, w, dy):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = btf.blocksparse_matmul(x, w, op)
        return (y, *tape.gradient(y, [x, w], output_gradients=dy))

    results = in_mode(mode, forward_and_backward)(*(tf.constant(a) for a in (x, w, dy)))
    expected = (ref_fprop(LAYOUT, w, BS, x, axis), ref_bprop(LAYOUT, w, BS, dy, axis),
                ref_updat(LAYOUT, BS, x, dy, axis))
    for name, result, reference in zip(("y", "dx", "dw"), results, expected):
        assert result.dtype == tf.float64, name
        error = np.linalg.norm(result.numpy() - reference) / np.linalg.norm(reference)
        assert error <= 1e-12, f"{name}: relative error {error:.3g}"


@pytest.mark.parametrize("axis", [1, 0], ids=["axis1", "axis0"])
def test_compute_gradient_float64(axis):
    """tf.test.compute_gradient in float64 over x and w of blocksparse_matmul, and over x, kernel and
    bias of a float64 BlockSparseDense: our Jacobians equal the central differences to 1e-8 (the op is
    bilinear, so float64 differences are exact up to ~1e-12)."""
    rng = np.random.default_rng(34 + axis)
    op = bsmm.BlocksparseMatMul(random_layout(rng, 3, 2, 0.7), block_size=BS, feature_axis=axis)
    x = tf.constant(rng.standard_normal(shape_of(op.C, 3, axis)))
    w = tf.constant(rng.standard_normal(op.w_shape))
    layer = btf.BlockSparseDense(op.K, op.layout, block_size=BS, feature_axis=axis, dtype="float64",
                                 bias_initializer="random_normal")
    layer.build(x.shape)
    assert layer.kernel.dtype == layer.bias.dtype == "float64"

    def through_layer(x, kernel, bias):
        # The layer's call with tensors in place of its variables, so gradients reach them.
        return layer.stateless_call([kernel, bias], [], x)[0]

    parameters = [tf.constant(layer.kernel.numpy()), tf.constant(layer.bias.numpy())]
    for function, arguments in ((lambda x, w: btf.blocksparse_matmul(x, w, op), [x, w]),
                                (through_layer, [x, *parameters])):
        theoretical, numerical = tf.test.compute_gradient(function, arguments)
        for ours, finite_difference in zip(theoretical, numerical):
            assert ours.dtype == np.float64 and np.abs(ours).max() > 0
            assert np.abs(ours - finite_difference).max() <= 1e-8


# -- zero copy and graphs --------------------------------------------------------------------------
class RecordingMatMul(bsmm.BlocksparseMatMul):
    """Records the arrays each pass receives, to check what bsmm saw was the tensors' own memory."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def fprop(self, x, w, out=None):
        self.calls.append((x, w, out))
        return super().fprop(x, w, out=out)


def data_address(tensor) -> int:
    """Address of a CPU tensor's buffer (bfloat16 read through an int16 view)."""
    if tensor.dtype == tf.bfloat16:
        tensor = tf.bitcast(tensor, tf.int16)
    return np.from_dlpack(tensor).ctypes.data


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_cpu_passes_share_memory_with_tensorflow(mode, dtype):
    """bsmm reads the input tensors' buffers and writes a 64-byte-aligned buffer that becomes the
    result tensor: no copy on either side, eagerly and through tf.function (inputs are only
    compared eagerly, as a graph may hand its nodes copies of function arguments)."""
    op = RecordingMatMul(LAYOUT, block_size=BS)
    rng = np.random.default_rng(4)
    x = tf.constant(random_data(rng, (6, op.C), dtype), dtype=TF_DTYPES[dtype])
    w = tf.constant(random_data(rng, op.w_shape, dtype), dtype=TF_DTYPES[dtype])
    y = in_mode(mode, lambda x, w: btf.blocksparse_matmul(x, w, op))(x, w)
    (seen_x, seen_w, out), = op.calls
    assert out.ctypes.data % 64 == 0
    assert data_address(y) == out.ctypes.data, "the result tensor must be bsmm's output buffer"
    if mode == "eager":
        assert (seen_x.ctypes.data, seen_w.ctypes.data) == (data_address(x), data_address(w))
    assert_close(y.numpy(), ref_fprop(LAYOUT, w.numpy(), BS, x.numpy(), 1), dtype)


def test_operator_called_on_tf_tensors_returns_tensors_tensorflow_can_use():
    """BlocksparseMatMul itself (not bsmm.tf) on CPU tensors: the result goes back through DLPack
    and must be safe for TensorFlow's kernels. Run in a child process, as the failure is an abort."""
    script = (
        "import numpy as np, tensorflow as tf, bsmm\n"
        "op = bsmm.BlocksparseMatMul(np.ones((2, 2)), block_size=8)\n"
        "for n in (3, 5, 7, 1000):\n"
        "    y = op(tf.ones((n, 16)), tf.ones(op.w_shape))\n"
        "    assert float(y[0, 1]) == 16.0\n"
    )
    root = str(REPO_ROOT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
               TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("axis", [1, 0], ids=["axis1", "axis0"])
def test_graph_shapes_are_static(axis):
    """Inside tf.function with N unknown, every pass's output has the static shape it implies."""
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS, feature_axis=axis)
    spec = tf.TensorSpec(shape_of(op.C, None, axis), tf.float32)
    shapes = {}

    @tf.function(input_signature=[spec, tf.TensorSpec(op.w_shape, tf.float32)])
    def step(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = btf.blocksparse_matmul(x, w, op)
        dx, dw = tape.gradient(y, [x, w])
        shapes.update(y=tuple(y.shape), dx=tuple(dx.shape), dw=tuple(dw.shape))
        return y

    y = step(tf.ones(shape_of(op.C, 3, axis)), tf.ones(op.w_shape))
    assert shapes == {"y": shape_of(op.K, None, axis), "dx": shape_of(op.C, None, axis), "dw": op.w_shape}
    assert tuple(y.shape) == shape_of(op.K, 3, axis)


def test_variable_weights_get_gradients():
    """A tf.Variable passed as w is read once; its gradient is dw."""
    rng = np.random.default_rng(5)
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    x_np, w_np = random_data(rng, (4, op.C), "float32"), random_data(rng, op.w_shape, "float32")
    w = tf.Variable(w_np)
    with tf.GradientTape() as tape:
        y = btf.blocksparse_matmul(tf.constant(x_np), w, op)
    dw = tape.gradient(y, w)
    assert_close(dw.numpy(), ref_updat(LAYOUT, BS, x_np, np.ones((4, op.K)), 1), "float32")


# -- bad inputs -------------------------------------------------------------------------------------
@pytest.fixture
def good():
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    return op, tf.ones((5, op.C)), tf.ones(op.w_shape)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda op, x, w: (x, w, LAYOUT), TypeError, "op must be a bsmm.BlocksparseMatMul; got ndarray"),
        (lambda op, x, w: (tf.cast(x, tf.int32), w, op), TypeError,
         "x has dtype int32; supported dtypes are float32, float16, bfloat16, and float64 on the CPU"),
        (lambda op, x, w: (x, tf.cast(w, tf.int32), op), TypeError,
         "w has dtype int32; supported dtypes are float32, float16, bfloat16"),
        (lambda op, x, w: (tf.cast(x, tf.float64), w, op), TypeError,
         "w has dtype float32 but x has float64; pass one dtype"),
        (lambda op, x, w: (x, tf.cast(w, tf.float16), op), TypeError,
         "w has dtype float16 but x has float32; pass one dtype"),
        (lambda op, x, w: (object(), w, op), TypeError, "x must be a tf.Tensor or convertible to one; got object"),
        (lambda op, x, w: (x[:, :16], w, op), ValueError,
         r"x must have shape \(N, 24\) with feature_axis=1; got \(5, 16\)"),
        (lambda op, x, w: (tf.ones((2, 5, 24)), w, op), ValueError,
         r"x must have shape \(N, 24\) with feature_axis=1; got \(2, 5, 24\)"),
        (lambda op, x, w: (x, w[1:], op), ValueError, r"w must have shape w_shape \(7, 8, 8\); got \(6, 8, 8\)"),
    ],
    ids=["op", "x-int32", "w-int32", "x-float64-w-float32", "mixed-dtypes", "x-object", "x-features", "x-rank",
         "w-shape"],
)
@pytest.mark.parametrize("mode", MODES)
def test_bad_inputs_are_refused_naming_the_argument(good, change, error, match, mode):
    """Eagerly and when a tf.function traces: the static checks raise before anything runs."""
    op, x, w = good
    args = change(op, x, w)
    call = btf.blocksparse_matmul if mode == "eager" else tf.function(lambda: btf.blocksparse_matmul(*args))
    with pytest.raises(error, match=match):
        call(*args) if mode == "eager" else call()


def test_shapes_known_only_when_the_graph_runs_are_checked_by_bsmm(good):
    """With no static feature size, bsmm's own check fails the graph at run time, naming x."""
    op, x, w = good

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32), tf.TensorSpec(op.w_shape, tf.float32)])
    def call(x, w):
        return btf.blocksparse_matmul(x, w, op)

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"x must have shape \(N, 24\)"):
        call(x[:, :16], w)


# -- the Keras layer --------------------------------------------------------------------------------
def dense_reference(layer, x: np.ndarray) -> np.ndarray:
    """float64 activation(x·W + b) from the layer's weights (feature_axis 1 or 0, any leading axes)."""
    weight = layer.op.to_dense(layer.kernel.numpy()).astype(np.float64)
    bias = layer.bias.numpy().astype(np.float64) if layer.use_bias else 0.0
    if layer.feature_axis == 1:
        return x.astype(np.float64) @ weight + bias
    return weight.T @ x.astype(np.float64) + (bias[:, None] if layer.use_bias else 0.0)


@pytest.mark.parametrize(
    "feature_axis, input_shape",
    [(1, (5, 24)), (1, (1, 24)), (1, (2, 3, 24)), (0, (24, 5))],
    ids=["axis1", "N1", "leading-axes", "axis0"],
)
def test_layer_output_and_weights(feature_axis, input_shape):
    layer = btf.BlockSparseDense(32, LAYOUT, block_size=BS, feature_axis=feature_axis)
    x = random_data(np.random.default_rng(6), input_shape, "float32")
    layer.build(input_shape)
    layer.bias.assign(np.linspace(-1, 1, 32, dtype=np.float32))  # a bias added on the right axis shows
    y = layer(x)
    expected_shape = input_shape[:-1] + (32,) if feature_axis == 1 else (32, input_shape[1])
    assert tuple(layer.kernel.shape) == layer.op.w_shape == (7, BS, BS)
    assert tuple(y.shape) == expected_shape == layer.compute_output_shape(input_shape)
    assert_close(y.numpy(), dense_reference(layer, x), "float32")


def test_layer_default_kernel_is_scaled_by_fan_in_and_seedable():
    """Default kernel: N(0, 1 / (fan-in of its block column · bs)); keras.utils.set_random_seed
    makes it reproducible."""
    layout = np.ones((16, 2), np.uint8)
    layout[8:, 1] = 0  # block column 0 has 16 blocks of fan-in, column 1 has 8
    kernels = []
    for _ in range(2):
        keras.utils.set_random_seed(7)
        layer = btf.BlockSparseDense(16, layout, block_size=BS)
        layer.build((None, layer.op.C))
        kernels.append(layer.kernel.numpy())
    np.testing.assert_array_equal(kernels[0], kernels[1])
    _, cols = np.nonzero(layout)
    for column, fan_in in ((0, 16), (1, 8)):
        std = kernels[0][cols == column].std()
        assert abs(std * np.sqrt(fan_in * BS) - 1) < 0.1, (column, std)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_layer_mixed_precision(policy):
    """Under a mixed policy the layer computes in float16/bfloat16 from a float32 kernel,
    and the kernel's gradient comes back in float32."""
    layer = btf.BlockSparseDense(32, LAYOUT, block_size=BS, dtype=keras.DTypePolicy(policy))
    x = random_data(np.random.default_rng(8), (6, 24), "float32")
    with tf.GradientTape() as tape:
        y = layer(x)
    gradient = tape.gradient(y, layer.kernel)
    compute = policy.split("_")[1]
    assert y.dtype.name == compute and layer.kernel.dtype == "float32" and gradient.dtype == tf.float32
    assert_close(y.numpy(), dense_reference(layer, x), compute)
    assert_close(gradient.numpy(), ref_updat(LAYOUT, BS, x, np.ones((6, 32)), 1), compute)


def test_layer_config_round_trip_and_keras_file(tmp_path):
    """get_config is JSON with the layout as a nested list; from_config and a .keras file
    rebuild a layer computing the same function."""
    layer = btf.BlockSparseDense(32, LAYOUT, block_size=BS, activation="tanh", use_bias=False,
                                 kernel_regularizer="l2", name="sparse")
    model = keras.Sequential([keras.Input((24,)), layer])
    config = json.loads(json.dumps(layer.get_config()))
    assert config["layout"] == LAYOUT.tolist() and config["units"] == 32 and config["block_size"] == BS

    clone = btf.BlockSparseDense.from_config(config)
    clone.build((None, 24))
    clone.set_weights(layer.get_weights())
    x = random_data(np.random.default_rng(9), (4, 24), "float32")
    np.testing.assert_array_equal(clone(x).numpy(), layer(x).numpy())
    assert clone.bias is None and np.array_equal(clone.op.layout, LAYOUT)

    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.layers[0], btf.BlockSparseDense)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


@pytest.mark.parametrize(
    "kwargs, input_shape, match",
    [
        ({"units": 24}, (4, 24), r"units must be layout.shape\[1\] \* block_size = 32 .* got 24"),
        ({"units": 32.0}, (4, 24), r"units must be layout.shape\[1\] \* block_size = 32 .* got 32.0"),
        ({"units": 32, "feature_axis": 2}, (4, 24), "feature_axis must be 0 or 1; got 2"),
        ({"units": 32}, (4, 16), r"inputs of .* must have shape \(\.\.\., 24\) with feature_axis=1; got \(4, 16\)"),
        ({"units": 32}, (24,), r"inputs of .* must have shape \(\.\.\., 24\) with feature_axis=1; got \(24,\)"),
        ({"units": 32, "feature_axis": 0}, (2, 24, 5), r"must have shape \(24, N\) with feature_axis=0"),
    ],
    ids=["units", "units-float", "feature-axis", "input-features", "input-rank", "axis0-rank"],
)
def test_layer_bad_arguments(kwargs, input_shape, match):
    with pytest.raises(ValueError, match=match):
        btf.BlockSparseDense(layout=LAYOUT, block_size=BS, **kwargs)(np.ones(input_shape, np.float32))


class MaskedDense(keras.layers.Layer):
    """A dense layer whose kernel is multiplied by the layout's mask: the dense twin of BlockSparseDense."""

    def __init__(self, layout, block_size, **kwargs):
        super().__init__(**kwargs)
        self.mask = np.kron(layout, np.ones((block_size, block_size))).astype(np.float32)

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=self.mask.shape, name="kernel")
        self.bias = self.add_weight(shape=(self.mask.shape[1],), initializer="zeros", name="bias")

    def call(self, x):
        return tf.matmul(x, self.kernel * self.mask) + self.bias


def small_model(first_layer, head_kernel, run_eagerly=False):
    model = keras.Sequential([
        keras.Input((24,)),
        first_layer,
        keras.layers.Activation("tanh"),
        keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(head_kernel)),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", run_eagerly=run_eagerly)
    return model


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["graph", "eager"])
def test_training_matches_a_masked_dense_layer(run_eagerly):
    """model.fit, 3 epochs of 3 steps (the last batch odd-sized), Adam: the same losses and
    the same trained weights as the dense layer with a masked kernel, to float32 tolerance."""
    rng = np.random.default_rng(10)
    x, target = random_data(rng, (22, 24), "float32"), random_data(rng, (22, 1), "float32")
    head = random_data(rng, (32, 1), "float32") / 4

    sparse = btf.BlockSparseDense(32, LAYOUT, block_size=BS)
    sparse_model = small_model(sparse, head, run_eagerly)
    masked = MaskedDense(LAYOUT, BS)
    masked_model = small_model(masked, head, run_eagerly)
    masked.kernel.assign(sparse.op.to_dense(sparse.kernel.numpy()))
    assert sparse.supports_jit is False, "Keras' jit_compile='auto' must not pick XLA for a py_function"

    histories = [
        model.fit(x, target, batch_size=8, epochs=3, shuffle=False, verbose=0).history["loss"]
        for model in (sparse_model, masked_model)
    ]
    np.testing.assert_allclose(histories[0], histories[1], rtol=1e-5)
    assert histories[0][-1] < histories[0][0], "the model must have trained"
    np.testing.assert_allclose(sparse.op.to_dense(sparse.kernel.numpy()), masked.kernel.numpy() * masked.mask,
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(sparse.bias.numpy(), masked.bias.numpy(), rtol=1e-4, atol=1e-6)


# -- GPU (TensorFlow with a GPU and CuPy) ------------------------------------------------------------
@pytest.fixture
def gpu():
    """The first GPU as TensorFlow names it; skips without one (TensorFlow CPU builds have none)."""
    pytest.importorskip("cupy", reason="CuPy is not installed: TensorFlow GPU tests skipped")
    devices = tf.config.list_logical_devices("GPU")
    if not devices:
        pytest.skip("TensorFlow sees no GPU: TensorFlow GPU tests skipped")
    return devices[0].name


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("axis", [1, 0], ids=["axis1", "axis0"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_passes_match_float64_reference(gpu, dtype, axis, mode):
    rng = np.random.default_rng(11)
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS, feature_axis=axis)
    x_np = random_data(rng, shape_of(op.C, 7, axis), dtype)
    dy_np = random_data(rng, shape_of(op.K, 7, axis), dtype)
    w_np = random_data(rng, op.w_shape, dtype)
    with tf.device(gpu):
        x, dy, w = (tf.constant(a, dtype=TF_DTYPES[dtype]) for a in (x_np, dy_np, w_np))
        y, dx, dw = in_mode(mode, forward_and_gradients)(op, x, w, dy)
    assert all("GPU" in t.device for t in (y, dx, dw))
    assert_close(y.numpy(), ref_fprop(LAYOUT, w_np, BS, x_np, axis), dtype, "y")
    assert_close(dx.numpy(), ref_bprop(LAYOUT, w_np, BS, dy_np, axis), dtype, "dx")
    assert_close(dw.numpy(), ref_updat(LAYOUT, BS, x_np, dy_np, axis), dtype, "dw")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_pass_allocates_only_its_output(gpu, dtype):
    """TensorFlow's allocator sees one allocation per pass, the result (rounded to 256 bytes)."""
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    with tf.device(gpu):
        x = tf.ones((512, op.C), TF_DTYPES[dtype])
        w = tf.ones(op.w_shape, TF_DTYPES[dtype])
        btf.blocksparse_matmul(x, w, op)  # compiles the kernel, warms the allocator
        tf.test.experimental.sync_devices()
        device = gpu.split("device:")[-1]
        tf.config.experimental.reset_memory_stats(device)
        before = tf.config.experimental.get_memory_info(device)["current"]
        y = btf.blocksparse_matmul(x, w, op)
        info = tf.config.experimental.get_memory_info(device)
    expected = -(-y.shape.num_elements() * y.dtype.size // 256) * 256
    assert info["current"] - before == expected
    assert info["peak"] - before == expected


@pytest.mark.gpu
def test_gpu_mixed_devices_are_refused(gpu):
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    with tf.device(gpu):
        x = tf.ones((4, op.C))
    with tf.device("/CPU:0"):
        w = tf.ones(op.w_shape)
    with pytest.raises(ValueError, match="w is on .*CPU.* but x is on .*GPU.*; move them to one device"):
        btf.blocksparse_matmul(x, w, op)


@pytest.mark.gpu
def test_gpu_training_matches_cpu(gpu):
    rng = np.random.default_rng(12)
    x, target = random_data(rng, (16, 24), "float32"), random_data(rng, (16, 1), "float32")
    head = random_data(rng, (32, 1), "float32") / 4
    histories = []
    for device in (gpu, "/CPU:0"):
        with tf.device(device):
            keras.utils.set_random_seed(13)
            model = small_model(btf.BlockSparseDense(32, LAYOUT, block_size=BS), head)
            assert model.jit_compile is False, "with a GPU, jit_compile='auto' would otherwise pick XLA"
            histories.append(model.fit(x, target, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"])
    np.testing.assert_allclose(histories[0], histories[1], rtol=1e-4)

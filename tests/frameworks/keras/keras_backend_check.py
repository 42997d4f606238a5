"""Exercises bsmm.keras.BlockSparseDense on the Keras backend KERAS_BACKEND names; prints one JSON line.

Run by test_keras_backends.py in a child process per backend (Keras picks its backend once, at
import). It measures, and the test asserts on:

- ``errors``: norm-wise relative errors against float64 NumPy references (``tests/reference.py``) of
  y, and of the gradients of sum(y * dy) for x, the kernel and the bias (each backend's own autodiff),
  for features last with leading axes, features first, and under a mixed_bfloat16 policy;
- ``losses`` and ``twin_losses``: ``model.fit`` histories of a small model and of its twin whose
  first layer is a dense layer with a masked kernel, and the trained weights' errors;
- ``round_trip_*``: a .keras round trip on this backend; ``loaded_error`` (``--load PATH``): the
  predictions of a model the parent saved on its own backend against those it saved beside it;
- ``device`` of each case's output: ``cpu``, or ``gpu`` with ``--gpu``.

    KERAS_BACKEND=jax python tests/frameworks/keras/keras_backend_check.py [--load model.keras] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

if __name__ != "__main__":  # pytest --doctest-modules imports every file; this one only runs as a child
    import pytest

    pytest.skip("a script that test_keras_backends.py runs in a child process", allow_module_level=True)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for reference.py
if os.environ.get("KERAS_BACKEND") in ("jax", "torch"):
    # As where TensorFlow is not installed: the layer must not need it there, and Keras would
    # otherwise import it to save a file (seconds of the child's time).
    sys.modules["tensorflow"] = None
import keras  # noqa: E402
from reference import (  # noqa: E402
    random_data, random_layout, ref_bprop, ref_fprop, ref_updat, rel_error, skewed_layout,
)

import bsmm.keras  # noqa: E402

BS = 8


def gpu_missing(backend: str) -> str | None:
    """Why this backend cannot run on a GPU here, or None when it can; turns TF32 off for the twin's
    dense products (bsmm's own float32 passes are exact)."""
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(False)
        return None if tf.config.list_logical_devices("GPU") else "TensorFlow sees no GPU"
    if backend == "jax":
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")
        try:
            jax.devices("gpu")
        except RuntimeError as error:
            return f"JAX has no GPU backend ({error})"
        return None
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    return None if torch.cuda.is_available() else "PyTorch sees no CUDA device"


def device_of(tensor) -> str:
    """Where a backend tensor lives: "gpu" or "cpu"."""
    backend = keras.config.backend()
    if backend == "tensorflow":
        name = tensor.device
    elif backend == "jax":
        name = next(iter(tensor.devices())).platform
    else:
        name = tensor.device.type
    return "gpu" if any(word in name.lower() for word in ("gpu", "cuda")) else "cpu"


def to_numpy(tensor) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(tensor, "float32")))


def forward_and_gradients(layer, x: np.ndarray, dy: np.ndarray):
    """y = layer(x) and the gradients of sum(y * dy) for x, the kernel and the bias, by the backend's autodiff."""
    backend = keras.config.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * dy)
        return (y, *tape.gradient(loss, [x, layer.kernel.value, layer.bias.value]))
    if backend == "jax":
        import jax

        def loss(x, kernel, bias):
            # Through __call__ in a stateless scope (stateless_call would skip the policy's autocast).
            with keras.StatelessScope(state_mapping=[(layer.kernel, kernel), (layer.bias, bias)]):
                y = layer(x)
            return (y.astype("float32") * dy).sum(), y

        grads, y = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(x, layer.kernel.value, layer.bias.value)
        return (y, *grads)
    import torch

    x = torch.tensor(x, requires_grad=True)
    y = layer(x)
    (y.float() * torch.from_numpy(dy)).sum().backward()
    return y, x.grad, layer.kernel.value.grad, layer.bias.value.grad


def reference_errors(name: str, layout, axis: int, x_shape, policy: str = "float32") -> dict:
    """Errors of y, dx, dkernel and dbias of a fresh layer against float64 references."""
    rng = np.random.default_rng(len(name))
    op_c, op_k = layout.shape[0] * BS, layout.shape[1] * BS
    layer = bsmm.keras.BlockSparseDense(op_k, layout, block_size=BS, feature_axis=axis, dtype=policy,
                                        bias_initializer=keras.initializers.RandomNormal(seed=1))
    x = random_data(rng, x_shape, "float32")
    y_shape = x_shape[:-1] + (op_k,) if axis == 1 else (op_k,) + x_shape[1:]
    dy = random_data(rng, y_shape, "float32")
    layer.build(x_shape)
    y, dx, dkernel, dbias = forward_and_gradients(layer, x, dy)
    kernel, bias = to_numpy(layer.kernel.value), to_numpy(layer.bias.value)
    if policy == "mixed_bfloat16":  # the pass multiplies bfloat16 roundings of x and the kernel
        x, kernel, bias = (a.astype("bfloat16").astype(np.float64) for a in (x, kernel, bias))
    x2, dy2 = (x.reshape(-1, op_c), dy.reshape(-1, op_k)) if axis == 1 else (x, dy)
    expected = {
        "y": ref_fprop(layout, kernel, BS, x2, axis) + (bias if axis == 1 else bias[:, None]),
        "dx": ref_bprop(layout, kernel, BS, dy2, axis),
        "dkernel": ref_updat(layout, BS, x2, dy2, axis),
        "dbias": dy2.sum(axis=0 if axis == 1 else 1),
    }
    actual = {"y": y, "dx": dx, "dkernel": dkernel, "dbias": dbias}
    errors = {f"{name}/{key}": rel_error(to_numpy(actual[key]).reshape(expected[key].shape), expected[key])
              for key in expected}
    errors[f"{name}/dtype"] = keras.backend.standardize_dtype(y.dtype)
    errors[f"{name}/device"] = device_of(y)
    return errors


class MaskedDense(keras.layers.Layer):
    """A dense layer whose kernel is multiplied by the layout's mask: the dense twin of BlockSparseDense."""

    def __init__(self, layout, **kwargs):
        super().__init__(**kwargs)
        self.mask = np.kron(layout, np.ones((BS, BS))).astype(np.float32)

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=self.mask.shape, name="kernel")
        self.bias = self.add_weight(shape=(self.mask.shape[1],), initializer="zeros", name="bias")

    def call(self, x):
        return keras.ops.matmul(x, self.kernel * keras.ops.convert_to_tensor(self.mask)) + self.bias


def small_model(first_layer, head: np.ndarray):
    model = keras.Sequential([
        keras.Input((24,)),
        first_layer,
        keras.layers.Activation("tanh"),
        keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(head)),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def training() -> dict:
    """model.fit, 3 epochs of 3 steps (the last batch odd-sized), against the masked dense twin."""
    rng = np.random.default_rng(10)
    layout = random_layout(rng, 3, 4, 0.6)  # C = 24, K = 32
    x, target = random_data(rng, (22, 24), "float32"), random_data(rng, (22, 1), "float32")
    head = random_data(rng, (32, 1), "float32") / 4
    sparse = bsmm.keras.BlockSparseDense(32, layout, block_size=BS)
    sparse_model = small_model(sparse, head)
    masked = MaskedDense(layout)
    masked_model = small_model(masked, head)
    masked.kernel.assign(sparse.op.to_dense(to_numpy(sparse.kernel.value)))
    histories = [model.fit(x, target, batch_size=8, epochs=3, shuffle=False, verbose=0).history["loss"]
                 for model in (sparse_model, masked_model)]
    return {
        "losses": histories[0],
        "twin_losses": histories[1],
        "kernel_error": rel_error(sparse.op.to_dense(to_numpy(sparse.kernel.value)),
                                  to_numpy(masked.kernel.value) * masked.mask),
        "bias_error": rel_error(to_numpy(sparse.bias.value), to_numpy(masked.bias.value)),
        "jit_compile": bool(sparse_model.jit_compile),
    }


def keras_file(load: str | None) -> dict:
    """A .keras round trip here; with ``load``, a model saved on another backend, and its predictions."""
    layout = skewed_layout(np.random.default_rng(20), 4, 5)  # C = 32, K = 40
    layer = bsmm.keras.BlockSparseDense(40, layout, block_size=BS, activation="tanh", name="sparse",
                                        bias_initializer="random_normal")
    model = keras.Sequential([keras.Input((32,)), layer])
    x = random_data(np.random.default_rng(21), (6, 32), "float32")
    with tempfile.TemporaryDirectory() as folder:
        model.save(f"{folder}/model.keras")
        loaded = keras.models.load_model(f"{folder}/model.keras")
    result = {
        "round_trip_equal": bool(np.array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))),
        "round_trip_class": type(loaded.layers[0]).__qualname__,
        "round_trip_layout": np.array_equal(loaded.layers[0].op.layout, layout),
    }
    if load:
        other = keras.models.load_model(load)
        saved = np.load(load + ".npz")
        result["loaded_error"] = rel_error(other.predict(saved["x"], verbose=0), saved["y"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", help="a .keras file saved on another backend, with PATH.npz holding x and y")
    parser.add_argument("--gpu", action="store_true",
                        help="run on the backend's GPU (the parent hides GPUs from CPU runs)")
    arguments = parser.parse_args()
    if arguments.gpu and (reason := gpu_missing(keras.config.backend())):
        print(json.dumps({"skip": reason}))
        return
    keras.utils.set_random_seed(0)
    skewed = skewed_layout(np.random.default_rng(1), 5, 4)  # C = 40, K = 32
    errors = {}
    errors.update(reference_errors("leading-axes", skewed, 1, (2, 3, 40)))
    errors.update(reference_errors("N1", random_layout(np.random.default_rng(2), 3, 2, 0.5), 1, (1, 24)))
    errors.update(reference_errors("axis0", skewed, 0, (40, 5)))
    errors.update(reference_errors("mixed_bfloat16", skewed, 1, (7, 40), "mixed_bfloat16"))
    print(json.dumps({"backend": keras.config.backend(), "errors": errors, **training(), **keras_file(arguments.load)}))


if __name__ == "__main__":
    main()

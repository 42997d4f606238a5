"""bsmm.keras: BlockSparseDense on Keras' TensorFlow, JAX and PyTorch backends.

Keras picks its backend once, at import, so each backend runs keras_backend_check.py in a child
process (KERAS_BACKEND set) that prints its measurements as JSON: errors against float64 NumPy
references, model.fit against a masked dense twin, .keras files (its own, and one this process
saved on Keras' default backend). The TensorFlow backend's in-process tests are in
tests/frameworks/tf/test_tf.py (bsmm.tf.BlockSparseDense is this layer).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras", reason="Keras is not installed: bsmm.keras tests skipped")

import bsmm.keras  # noqa: E402
from conftest import REPO_ROOT  # noqa: E402
from reference import random_data, random_layout, tolerance  # noqa: E402

SCRIPT = REPO_ROOT / "tests" / "frameworks" / "keras" / "keras_backend_check.py"
BACKEND_MODULES = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}


def run(script_arguments, backend: str, gpu: bool = False) -> subprocess.CompletedProcess:
    """Python with ``script_arguments`` under KERAS_BACKEND=backend; GPUs hidden unless ``gpu``."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, *script_arguments], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def saved_here(tmp_path_factory):
    """A .keras file of a BlockSparseDense model saved on this process's Keras backend, and beside it
    (PATH.npz) an input and the model's predictions for it."""
    layout = random_layout(np.random.default_rng(30), 3, 2, 0.7)  # C = 24, K = 16
    model = keras.Sequential([keras.Input((24,)), bsmm.keras.BlockSparseDense(
        16, layout, block_size=8, activation="relu", bias_initializer="random_normal")])
    x = random_data(np.random.default_rng(31), (5, 24), "float32")
    path = str(tmp_path_factory.mktemp("keras") / "model.keras")
    model.save(path)
    np.savez(path + ".npz", x=x, y=model.predict(x, verbose=0))
    return path


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("backend", list(BACKEND_MODULES))
def test_layer_on_each_backend(backend, device, saved_here, request):
    """On each backend: y and the gradients (of x, the kernel and the bias) within their dtype's
    tolerance of float64 references (float32; bfloat16 under mixed_bfloat16), model.fit losses and
    trained weights as the masked dense twin's (rtol 1e-5), the trainer's jit on JAX only, a .keras
    round trip, and a model saved on Keras' default backend predicting the same there."""
    if importlib.util.find_spec(BACKEND_MODULES[backend]) is None:
        pytest.skip(f"{BACKEND_MODULES[backend]} is not installed: Keras' {backend} backend skipped")
    if device == "gpu":
        request.getfixturevalue("cupy")  # skips without CuPy and a CUDA device
    done = run([str(SCRIPT), "--load", saved_here, *(["--gpu"] if device == "gpu" else [])], backend, device == "gpu")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(f"{backend}: {result['skip']}")
    assert result["backend"] == backend

    errors = result["errors"]
    for case in ("leading-axes", "N1", "axis0", "mixed_bfloat16"):
        dtype = "bfloat16" if case == "mixed_bfloat16" else "float32"
        assert errors.pop(f"{case}/dtype") == dtype, case
        assert errors.pop(f"{case}/device") == device, case
        for name in ("y", "dx", "dkernel", "dbias"):
            error = errors.pop(f"{case}/{name}")
            assert error <= tolerance(dtype), f"{backend} {case} {name}: relative error {error:.3g}"
    assert not errors, f"unchecked measurements: {sorted(errors)}"

    losses = result["losses"]
    assert losses[-1] < 0.5 * losses[0], f"the model did not learn: {losses}"
    np.testing.assert_allclose(losses, result["twin_losses"], rtol=1e-5)
    assert result["kernel_error"] <= 1e-5 and result["bias_error"] <= 1e-5, result
    assert result["jit_compile"] is (backend == "jax"), "jit_compile='auto' must pick XLA on JAX only"

    assert result["round_trip_equal"] and result["round_trip_layout"], result
    assert result["round_trip_class"] == "BlockSparseDense"
    assert result["loaded_error"] <= tolerance("float32"), result["loaded_error"]


def test_import_and_unsupported_backend():
    """``import bsmm`` imports no Keras; without Keras, ``import bsmm.keras`` names the package; on a
    backend bsmm has no adapter for (numpy), making a layer names the backends it runs on."""
    script = (
        "import sys, bsmm\n"
        "print('keras' in sys.modules)\n"
        "sys.modules['keras'] = None\n"
        "try:\n    import bsmm.keras\nexcept ImportError as error:\n    print(error)\n"
        "del sys.modules['keras']\n"
        "import bsmm.keras\n"
        "try:\n    bsmm.keras.BlockSparseDense(16, [[1, 0], [1, 1]], block_size=8)\n"
        "except NotImplementedError as error:\n    print(error)\n"
    )
    done = run(["-c", script], "numpy")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "False",
        "bsmm.keras needs Keras 3: pip install keras",
        "BlockSparseDense runs on Keras' tensorflow, jax, torch backends; KERAS_BACKEND is 'numpy'",
    ]


def test_registered_name_and_the_tf_alias():
    """One registered class, under the name files saved by earlier versions of bsmm.tf carry."""
    assert keras.saving.get_registered_name(bsmm.keras.BlockSparseDense) == "bsmm>BlockSparseDense"
    assert keras.saving.get_registered_object("bsmm>BlockSparseDense") is bsmm.keras.BlockSparseDense
    if keras.config.backend() == "tensorflow":
        from bsmm.tf import BlockSparseDense

        assert BlockSparseDense is bsmm.keras.BlockSparseDense

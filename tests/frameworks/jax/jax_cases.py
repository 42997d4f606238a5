"""Devices and settings shared by the bsmm JAX tests (test_jax.py, test_conv_jax.py, test_flax.py, test_equinox.py).

Fixtures are bound by name in each test module (``device = jax_cases.device``), as pytest finds them there.
"""

from __future__ import annotations

import numpy as np
import pytest

# (Skips, rather than fails, pytest --doctest-modules' import of this file where JAX is missing.)
jax = pytest.importorskip("jax", reason="JAX is not installed")


def gpu_or_skip():
    """JAX's first GPU; skips without one or without CuPy (bsmm's GPU backend)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as error:
        pytest.skip(f"JAX has no GPU backend ({error}): GPU tests skipped")
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed: GPU tests skipped")
    try:
        if not cupy.cuda.is_available():
            pytest.skip("CuPy sees no CUDA device: GPU tests skipped")
    except Exception as error:  # noqa: BLE001 - a broken driver/runtime counts as "no GPU"
        pytest.skip(f"CuPy cannot query CUDA ({type(error).__name__}: {error}): GPU tests skipped")
    return gpus[0]


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def device(request):
    """The device a test's arrays (and a layer's parameters) are created on, and jit runs on: the CPU,
    then (marker ``gpu``) the first GPU."""
    dev = jax.devices("cpu")[0] if request.param == "cpu" else gpu_or_skip()
    with jax.default_device(dev):
        yield dev


def host(array) -> np.ndarray:
    """A NumPy copy of a JAX array, from whichever device holds it."""
    return np.asarray(jax.device_get(array))

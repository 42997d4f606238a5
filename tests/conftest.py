"""Shared fixtures: the array library under test (``xp``) and moving data to and from it.

Tests build inputs on the host with NumPy, move them with :func:`to_xp`, and
bring results back with :func:`to_numpy` before comparing against the float64
references in ``reference.py``. The same test bodies then cover the CPU backend
(NumPy) and the GPU backend (CuPy); GPU cases carry the ``gpu`` marker.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

#: The repository's root (the tools/ the tests run live there).
REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CuPy and a CUDA device (select with -m gpu, drop with -m 'not gpu')")


def _cupy_or_skip():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed: GPU backend tests skipped")
    try:
        available = bool(cupy.cuda.is_available())
    except Exception as error:  # a broken driver/runtime counts as "no GPU"
        pytest.skip(f"CuPy cannot query CUDA ({type(error).__name__}: {error}): GPU backend tests skipped")
    if not available:
        pytest.skip("CuPy is installed but no CUDA device is available: GPU backend tests skipped")
    return cupy


@pytest.fixture(scope="session")
def cupy():
    """CuPy, for tests of the GPU backend alone (mark them ``gpu``); skips without a device."""
    return _cupy_or_skip()


@pytest.fixture(scope="session", params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    """The array module whose arrays are passed to bsmm: numpy (CPU backend) or cupy (GPU)."""
    if request.param == "numpy":
        return np
    return _cupy_or_skip()


def require_dtype(xp, dtype) -> None:
    """Skip unless ``xp`` can hold ``dtype`` (CuPy may lack ml_dtypes' bfloat16)."""
    if xp is np:
        return
    try:
        xp.zeros(1, dtype=dtype)
    except Exception as error:
        pytest.skip(f"{xp.__name__} cannot create {np.dtype(dtype).name} arrays: {error}")


def to_xp(xp, array):
    """A copy of host ``array`` as an ``xp`` array (keeps C/F order and dtype)."""
    require_dtype(xp, np.asarray(array).dtype)
    return xp.array(array)


def to_numpy(array) -> np.ndarray:
    """``array`` (NumPy or CuPy) as a NumPy array on the host."""
    if isinstance(array, np.ndarray):
        return array
    if hasattr(array, "get"):
        return array.get()
    return np.asarray(array)


def poisoned(xp, shape, dtype):
    """An ``out=`` buffer full of NaN, so any element a pass forgets to write shows up.

    Filled through the bits (:attr:`bsmm.dtypes.ElementType.nan_bits`), the pattern the GPU tools
    poison with too: no fill kernel of ``dtype`` is needed."""
    from bsmm.dtypes import ELEMENT_TYPES

    require_dtype(xp, dtype)
    element = ELEMENT_TYPES[np.dtype(dtype).name]
    return xp.full(shape, element.nan_bits, dtype=element.uint).view(element.numpy)


def compile_or_skip(variant, arch: str) -> None:
    """Compiles ``variant`` for ``arch`` through NVRTC (as at run time); skips the test where no
    NVRTC library is installed, and raises any other error (a compile error fails the test)."""
    from bsmm.backends.cuda.kernels import compile_variant

    try:
        compile_variant(variant, arch)
    except Exception as error:  # noqa: BLE001 - no NVRTC library: nothing to check with
        if "nvrtc" not in str(error).lower():
            raise
        pytest.skip(f"NVRTC is not available: {error}")


def snapshot(*arrays) -> list[bytes]:
    """Bitwise copies of arrays (host or device), to check later that nothing changed."""
    return [np.ascontiguousarray(to_numpy(a)).tobytes() for a in arrays]


@pytest.fixture(autouse=True)
def _fresh_torch_compiler():
    """Each test starts from an empty torch.compile cache.

    The layers share their forward code, so the recompiles of earlier tests (other layouts,
    shapes, devices) would otherwise count against dynamo's per-function recompile limit
    and fail a later ``fullgraph=True`` test that is fine on its own.
    """
    import sys

    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
    yield


@pytest.fixture
def tqdm_bars(monkeypatch) -> list:
    """The progress bars the test makes through ``tqdm.auto.tqdm``, in order, each keeping what
    it was made with (``total``, ``desc``, ``disable``, ``file``) and told (``steps``, ``descriptions``)."""
    import tqdm.auto

    bars = []

    class Recorder:
        def __init__(self, total, desc, disable, file=None, **kwargs):
            self.total, self.desc, self.disable, self.file = total, desc, disable, file
            self.steps, self.descriptions = 0, []
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, steps):
            self.steps += steps

        def set_description(self, text):
            self.descriptions.append(text)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    return bars


@pytest.fixture
def x64():
    """JAX's 64-bit types on for one test (float64 arrays stay float64), restored after it."""
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    previous = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)

"""The CuPy/driver check (``bsmm.backends.cuda.environment``) on faked versions and distributions:
needs no GPU and no CuPy."""

from __future__ import annotations

import importlib.metadata
import sys

import numpy as np
import pytest

from bsmm.arrays import as_operand
from bsmm.backends.cuda import environment
from bsmm.config import BsmmWarning
from reference import Producer


class _Distribution:
    def __init__(self, name):
        self.metadata = {"Name": name}


@pytest.fixture
def fake(monkeypatch):
    """Set the CUDA versions CuPy reports and the installed distributions; counts version reads."""
    state = {"versions": (12090, 12080), "names": ["numpy", "cupy-cuda12x"], "reads": 0}

    def versions():
        state["reads"] += 1
        return state["versions"]

    monkeypatch.setattr(environment, "_cuda_versions", versions)
    monkeypatch.setattr(importlib.metadata, "distributions",
                        lambda: [_Distribution(name) for name in state["names"]])
    environment.check_environment.cache_clear()
    yield state
    environment.check_environment.cache_clear()


@pytest.mark.parametrize("runtime, driver", [(12090, 12020), (12000, 13000), (13000, 13020), (13020, 0)])
def test_no_problem_when_the_driver_runs_cupys_cuda(runtime, driver):
    """Same major (minor-version compatibility), an older major, or no driver at all (no GPU)."""
    assert environment.driver_problem(runtime, driver) == ""


def test_cuda13_cupy_on_a_cuda12_driver_names_versions_and_extra():
    message = environment.driver_problem(13000, 12080)
    for part in ("CUDA 13.0", "CUDA up to 12.8", "nvidia-smi", "pip uninstall cupy-cuda13x",
                 "'bsmm[cuda12]'", "580 or newer"):
        assert part in message, (part, message)


def test_cuda12_cupy_on_a_cuda11_driver_asks_for_a_newer_driver():
    message = environment.driver_problem(12090, 11080)
    assert "CUDA 12.9" in message and "CUDA up to 11.8" in message
    assert "upgrade the NVIDIA driver to 525 or newer (bsmm's GPU backend needs CUDA 12 or newer)" in message
    assert "bsmm[" not in message  # no extra fits a CUDA 11 driver


def test_missing_cupy_names_the_extras(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)
    environment.check_environment.cache_clear()
    with pytest.raises(RuntimeError, match=r"through CuPy, which cannot be imported .*bsmm\[cuda12\].*bsmm\[cuda13\]"):
        environment.check_environment()
    environment.check_environment.cache_clear()


def test_check_raises_once_per_failure_and_passes_after_the_fix(fake):
    fake["versions"] = (13000, 12020)
    with pytest.raises(RuntimeError, match=r"CuPy is built for CUDA 13\.0 .* CUDA up to 12\.2 .*bsmm\[cuda12\]"):
        environment.check_environment()
    with pytest.raises(RuntimeError):  # a failure is not remembered as a pass
        environment.check_environment()
    fake["versions"] = (12090, 12020)
    environment.check_environment()
    assert fake["reads"] == 3


def test_check_runs_once_per_process(fake):
    for _ in range(3):
        environment.check_environment()
    assert fake["reads"] == 1


def test_cupy_distributions_normalizes_names_and_ignores_others(fake):
    fake["names"] = ["cupy_cuda13x", "CuPy-CUDA12x", "cupy", "cupy-rocm-6-0", "cuda-pathfinder", "cupyx-extra", "numpy"]
    assert environment.cupy_distributions() == ["cupy", "cupy-cuda12x", "cupy-cuda13x", "cupy-rocm-6-0"]


def test_two_cupy_wheels_are_warned_about(fake):
    fake["names"] = ["cupy-cuda12x", "cupy-cuda13x"]
    with pytest.warns(BsmmWarning, match=r"several CuPy distributions .*cupy-cuda12x, cupy-cuda13x"):
        environment.check_environment()


def test_one_cupy_wheel_is_not_warned_about(fake, recwarn):
    environment.check_environment()
    assert not [w for w in recwarn if issubclass(w.category, BsmmWarning)]


class _CudaTensor:
    """A DLPack producer on CUDA device 0 (what a PyTorch or JAX GPU tensor shows bsmm)."""

    def __dlpack__(self, stream=None):
        raise AssertionError("the environment check must run before the tensor is exported")

    def __dlpack_device__(self):
        return (2, 0)


def test_a_gpu_tensor_meets_the_check_before_cupy(fake):
    """The call site in bsmm.arrays: the driver error, not a DLPack TypeError wrapping CuPy's."""
    fake["versions"] = (13000, 12080)
    with pytest.raises(RuntimeError, match="bsmm\\[cuda12\\]"):
        as_operand(_CudaTensor(), "x")
    assert fake["reads"] == 1


def test_cpu_arrays_never_reach_the_check(fake):
    fake["versions"] = (13000, 12080)
    assert as_operand(np.zeros(3), "x").backend == "cpu"
    assert as_operand(Producer(np.arange(3.0)), "x").backend == "cpu"  # through the DLPack branch
    assert fake["reads"] == 0

"""Device selection shared by the bsmm.torch tests (test_torch.py, test_conversions.py, test_lstm_torch.py, ...).

Import the ``device`` fixture by name (``from torch_cases import device``) to run a test on the CPU and,
with the ``gpu`` marker, on CUDA.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bsmm.torch tests skipped")


def cuda_or_skip() -> str:
    """``"cuda"``, or skip the test unless both PyTorch and CuPy (bsmm's GPU backend) see a CUDA device."""
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device: GPU tests skipped")
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed: GPU tests skipped")
    if not cupy.cuda.is_available():
        pytest.skip("CuPy sees no CUDA device: GPU tests skipped")
    return "cuda"


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """The torch device a test runs on: ``"cpu"``, then ``"cuda"`` (marker ``gpu``)."""
    return "cpu" if request.param == "cpu" else cuda_or_skip()


def eager_and_compiled(function, inputs, step) -> tuple[list, int]:
    """``step(run, x)`` (a training step's results: losses, gradients) for each input, run eagerly and
    through ``torch.compile(function, fullgraph=True)``; returns the pairs [eager, compiled] and the graphs
    Dynamo made (1: no graph break and no recompile over the inputs)."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(function, fullgraph=True)
    pairs = [[step(run, x) for run in (function, compiled)] for x in inputs]
    return pairs, counters["stats"]["unique_graphs"]

"""What users run, timed: a framework's training step and forward with bsmm's layer beside the
framework's dense layer, and the host time of each call (``python -m bsmm bench --framework``).

- ``torch``: ``bsmm.torch.BlockSparseLinear`` against ``nn.Linear`` of the same shape and dtype
  (no bias on either). The *training step* is a forward, then a backward producing dx and dW,
  gradients set to None each step (``optimizer=True``: then an SGD update of W, "step + SGD",
  as ``python -m bsmm demo`` shows it); the *forward* is the layer's call alone (recording autograd's
  graph, and under ``torch.no_grad()`` as inference runs it). Each is timed eager
  and as a replay of a CUDA graph (``torch.cuda.CUDAGraph``) it was captured into.
- ``jax``: ``bsmm.jax.blocksparse_matmul`` against ``x @ W`` of the same shape and dtype, each
  jit-compiled: the forward, and the training step ``jax.vjp`` of the product applied to a
  cotangent (dx and dW), as one jitted function. Timed by the wall clock around batches of
  calls ending in ``block_until_ready`` (JAX has no CUDA events), which is GPU time wherever
  the host keeps ahead. With ``XLA_FLAGS=--xla_gpu_graph_min_graph_size=1`` XLA replays even a
  one-layer program from a CUDA graph, as it does a whole model's by default; the rows say so.
- ``cupy``: the plain allocating call ``y = op(x, w)`` (and ``op.bprop``, ``op.updat``) against
  ``cupy.matmul`` of the dense shape.

GPU time: CUDA events around batches of back-to-back calls from Python (per-call time =
batch time / calls), warm-up first, the median of the batches. Host time: bursts of calls
with a wall clock, the GPU idle at the start of each burst and no synchronisation inside it,
so that the host never waits for the GPU (:func:`_host_time`).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Callable

import numpy as np

from bsmm.layouts import random_layout

__all__ = ["FrameworkRow", "bench_torch", "bench_cupy", "bench_jax", "capture_graph", "format_rows", "gpu_time", "SHAPES"]

#: (name, N, C, K, block size, densities, dtypes): the seed's shape (S), decode (D), the F up layer.
SHAPES = {
    "S": (32, 12288, 12288, 32, (0.1, 0.02), ("bfloat16", "float32")),
    "D": (8, 8192, 8192, 32, (0.1,), ("float16",)),
    "F": (8192, 4096, 16384, 128, (0.1,), ("bfloat16",)),
}


@dataclasses.dataclass
class FrameworkRow:
    """One measure of one shape: bsmm's and the dense layer's median seconds (GPU time, or host
    time per call where ``measure`` starts with ``host``)."""

    framework: str
    workload: str
    dtype: str
    density: float
    measure: str  # forward (no_grad), step, forward/step graph, host forward (no_grad), host step; cupy: the pass
    sparse_s: float
    dense_s: float

    @property
    def speedup(self) -> float:
        return self.dense_s / self.sparse_s

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"speedup": self.speedup}


def gpu_time(run: Callable[[], object], synchronize, event, elapsed_ms, calls: int = 20, batches: int = 15,
              warmup_s: float = 0.05) -> float:
    """Median seconds per call over ``batches`` CUDA-event-timed batches of ``calls`` calls."""
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        run()
        synchronize()
    samples = []
    for _ in range(batches):
        begin, end = event(), event()
        begin.record()
        for _ in range(calls):
            run()
        end.record()
        end.synchronize()
        samples.append(elapsed_ms(begin, end) / 1e3 / calls)
    return statistics.median(samples)


def _host_time(run: Callable[[], object], synchronize, calls: int = 20, rounds: int = 25) -> float:
    """Median wall-clock seconds per call of bursts of ``calls`` calls with no synchronisation
    inside, the GPU idle at the start of each: a burst queues far fewer launches than CUDA's
    queue holds, so the GPU never makes the host wait and the time is the host's alone (a long
    loop measures the GPU instead wherever it is the slower of the two, as for a dense layer)."""
    samples = []
    for _ in range(rounds):
        synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            run()
        samples.append((time.perf_counter() - start) / calls)
    synchronize()
    return statistics.median(samples)


def _torch_steps(torch, layer, x, optimizer: bool = False):
    """The layer's forward, its forward under ``torch.no_grad()``, and its training step: a forward
    and a backward producing dx and dW, followed with ``optimizer`` by an SGD update of W."""
    sgd = torch.optim.SGD(layer.parameters(), lr=1e-4) if optimizer else None

    def forward():
        return layer(x)

    def inference():
        with torch.no_grad():
            return layer(x)

    def step():
        layer.weight.grad = None
        x.grad = None
        layer(x).backward(gradient)
        if sgd is not None:
            sgd.step()

    with torch.no_grad():
        gradient = torch.randn_like(layer(x))
    return forward, inference, step


def capture_graph(torch, run):
    """``run`` captured into a CUDA graph after three warm-up calls on a side stream (the
    warm-up builds bsmm's plans, which capture cannot); returns (the graph's replay, what the
    captured call returned)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    return graph.replay, captured


def bench_torch(workloads=("S",), host: bool = True, graphs: bool = True,
                progress: Callable[[str], None] | None = None, dtypes=None, densities=None,
                optimizer: bool = False) -> list[FrameworkRow]:
    """Rows of :class:`FrameworkRow` for ``bsmm.torch.BlockSparseLinear`` against ``nn.Linear``.

    ``dtypes`` and ``densities`` keep only these of each workload's (:data:`SHAPES`); ``optimizer``
    ends each training step with an SGD update of the weight (the measure "step + SGD").
    ``python -m bsmm demo`` times ``bench_torch(("S",), host=False, graphs=False,
    dtypes=("bfloat16",), densities=(0.1,), optimizer=True)`` (needs a GPU).
    """
    import torch

    import bsmm.torch

    rows = []
    sync, event = torch.cuda.synchronize, lambda: torch.cuda.Event(enable_timing=True)
    elapsed = lambda begin, end: begin.elapsed_time(end)  # noqa: E731
    for workload in workloads:
        n, c, k, bs, shape_densities, shape_dtypes = SHAPES[workload]
        kept = ((d, p) for d in shape_dtypes for p in shape_densities
                if (not dtypes or d in dtypes) and (not densities or p in densities))
        for dtype_name, density in kept:
            dtype = getattr(torch, dtype_name)
            layout = random_layout(c // bs, k // bs, density, seed=0)
            sparse = bsmm.torch.BlockSparseLinear(c, k, layout, block_size=bs, bias=False, device="cuda", dtype=dtype)
            dense = torch.nn.Linear(c, k, bias=False, device="cuda", dtype=dtype)
            x = torch.randn(n, c, device="cuda", dtype=dtype, requires_grad=True)
            measured = {}
            for name, layer in (("sparse", sparse), ("dense", dense)):
                forward, inference, step = _torch_steps(torch, layer, x, optimizer)
                step_name = "step + SGD" if optimizer else "step"
                times = {"forward": gpu_time(forward, sync, event, elapsed),
                         "forward no_grad": gpu_time(inference, sync, event, elapsed),
                         step_name: gpu_time(step, sync, event, elapsed)}
                if host:
                    times["host forward"] = _host_time(forward, sync)
                    times["host forward no_grad"] = _host_time(inference, sync)
                    times[f"host {step_name}"] = _host_time(step, sync)
                if graphs:
                    times["forward graph"] = gpu_time(capture_graph(torch, forward)[0], sync, event, elapsed)
                    times[f"{step_name} graph"] = gpu_time(capture_graph(torch, step)[0], sync, event, elapsed)
                measured[name] = times
            if workload == "D":  # the inference shape: PyTorch's own block-sparse product too
                measured["dense"]["forward no_grad, PyTorch BSR F.linear as dense"] = _bsr_linear_time(
                    torch, sparse, x, bs, sync, event, elapsed)
                measured["sparse"]["forward no_grad, PyTorch BSR F.linear as dense"] = \
                    measured["sparse"]["forward no_grad"]
            for measure in measured["sparse"]:
                row = FrameworkRow("torch", workload, dtype_name, density, measure, measured["sparse"][measure],
                                   measured["dense"][measure])
                rows.append(row)
                if progress:
                    progress(format_rows([row], header=False))
    return rows


def _bsr_linear_time(torch, sparse, x, block_size: int, sync, event, elapsed) -> float:
    """GPU time of ``F.linear(x, W)`` under ``torch.no_grad()`` with ``W`` the layer's weight as
    PyTorch's BSR tensor (``to_sparse_bsr``, blocks of the layer's block size)."""
    weight = sparse.to_dense_weight().detach().t().contiguous().to_sparse_bsr((block_size, block_size))
    inputs = x.detach()

    def run():
        with torch.no_grad():
            return torch.nn.functional.linear(inputs, weight)

    return gpu_time(run, sync, event, elapsed)


def bench_cupy(workloads=("S",), progress: Callable[[str], None] | None = None) -> list[FrameworkRow]:
    """The plain allocating calls of :class:`bsmm.BlocksparseMatMul` against ``cupy.matmul``."""
    import cupy

    import bsmm

    rows = []
    sync, event, elapsed = cupy.cuda.Device().synchronize, cupy.cuda.Event, cupy.cuda.get_elapsed_time

    for workload in workloads:
        n, c, k, bs, densities, dtypes = SHAPES[workload]
        for dtype_name, density in ((d, p) for d in dtypes for p in densities):
            dtype = bsmm.SUPPORTED_DTYPES[dtype_name]
            rng = np.random.default_rng(0)
            op = bsmm.BlocksparseMatMul(random_layout(c // bs, k // bs, density, seed=0), block_size=bs)
            x, dy = (cupy.asarray(rng.standard_normal(s).astype(dtype)) for s in ((n, c), (n, k)))
            w = cupy.asarray(rng.standard_normal(op.w_shape).astype(dtype))
            W = cupy.asarray(rng.standard_normal((c, k)).astype(dtype))
            calls = {"fprop": (lambda: op(x, w), lambda: x @ W), "bprop": (lambda: op.bprop(dy, w), lambda: dy @ W.T),
                     "updat": (lambda: op.updat(x, dy), lambda: x.T @ dy)}
            for pass_name, (sparse, dense) in calls.items():
                for measure, timer in ((pass_name, lambda f: gpu_time(f, sync, event, elapsed)),
                                       (f"host {pass_name}", lambda f: _host_time(f, sync))):
                    row = FrameworkRow("cupy", workload, dtype_name, density, measure, timer(sparse), timer(dense))
                    rows.append(row)
                    if progress:
                        progress(format_rows([row], header=False))
    return rows


def bench_jax(workloads=("S",), progress: Callable[[str], None] | None = None) -> list[FrameworkRow]:
    """``bsmm.jax.blocksparse_matmul`` against ``x @ W`` under ``jax.jit``: forward, training step
    (``jax.vjp`` applied to a cotangent: dx and dW) and the host time of each call."""
    import jax
    import jax.numpy as jnp

    import bsmm
    import bsmm.jax

    # XLA records a program into a command buffer (CUDA graph) only past a number of ops that one
    # layer does not reach, unless told otherwise: say so in the rows.
    graphs = "--xla_gpu_graph_min_graph_size=1" in os.environ.get("XLA_FLAGS", "")
    framework = "jax (XLA graphs from 1 op)" if graphs else "jax"
    rows = []
    for workload in workloads:
        n, c, k, bs, densities, dtypes = SHAPES[workload]
        for dtype_name, density in ((d, p) for d in dtypes for p in densities):
            dtype = jnp.dtype(dtype_name)
            rng = np.random.default_rng(0)
            op = bsmm.BlocksparseMatMul(random_layout(c // bs, k // bs, density, seed=0), block_size=bs)
            x, g = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((n, c), (n, k)))
            w = jnp.asarray(rng.standard_normal(op.w_shape), dtype)
            W = jnp.asarray(rng.standard_normal((c, k)), dtype)
            products = {"sparse": (lambda x, w: bsmm.jax.blocksparse_matmul(x, w, op), w),
                        "dense": (lambda x, W: x @ W, W)}
            measured = {}
            for name, (product, weights) in products.items():
                forward = jax.jit(product)
                step = jax.jit(lambda x, w, product=product: jax.vjp(product, x, w)[1](g))
                calls = {"forward": lambda: _jax_ready.keep(forward(x, weights)),
                         "step": lambda: _jax_ready.keep(step(x, weights))}
                times = {}
                for measure, run in calls.items():
                    times[measure] = gpu_time(run, _jax_ready.wait, _JaxEvent, _JaxEvent.elapsed_ms)
                    times[f"host {measure}"] = _host_time(run, _jax_ready.wait)
                measured[name] = times
            for measure in measured["sparse"]:
                row = FrameworkRow(framework, workload, dtype_name, density, measure, measured["sparse"][measure],
                                   measured["dense"][measure])
                rows.append(row)
                if progress:
                    progress(format_rows([row], header=False))
    return rows


class _JaxReady:
    """What JAX launched last, to wait for: JAX has no events, so a timed batch ends by blocking
    on the last call's result (calls on one device run in order)."""

    def __init__(self):
        self.last = None

    def keep(self, result):
        self.last = result

    def wait(self):
        import jax

        if self.last is not None:
            jax.block_until_ready(self.last)


_jax_ready = _JaxReady()


class _JaxEvent:
    """A wall-clock stand-in for a CUDA event in :func:`gpu_time`: ``record`` marks the time after
    waiting for what was launched before, as an event completing would."""

    def record(self):
        _jax_ready.wait()
        self.time = time.perf_counter()

    def synchronize(self):
        pass

    @staticmethod
    def elapsed_ms(begin, end) -> float:
        return (end.time - begin.time) * 1e3


def format_rows(rows: list[FrameworkRow], header: bool = True) -> str:
    """A Markdown table: µs of bsmm and of the dense layer, and the speed-up."""
    lines = ["| framework | workload | dtype | density | measure | bsmm µs | dense µs | speed-up |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"] if header else []
    for r in rows:
        lines.append(f"| {r.framework} | {r.workload} | {r.dtype} | {r.density:.0%} | {r.measure} | "
                     f"{r.sparse_s * 1e6:.1f} | {r.dense_s * 1e6:.1f} | {r.speedup:.2f}x |")
    return "\n".join(lines)

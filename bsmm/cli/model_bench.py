"""Models users train, timed beside the framework's dense model (``python -m bsmm bench --model lstm``).

The LSTM rows: ``bsmm.torch.BlockSparseLSTM`` (a small-world layout of ``density``, block 32, the
input matrix on the recurrent layout, as the seed's sparse-wide LSTMs) against cuDNN's ``nn.LSTM``
of the **same width** and of **equal parameters** (the width whose dense layer holds as many
parameters as the sparse one), over ``T`` steps of ``N`` sequences. Measures: ``forward`` under
``torch.no_grad()`` and ``train`` (forward, then backward producing dx and every parameter's
gradient, gradients set to None each step); eager, and ``train graph``, the training step replayed
from a CUDA graph it was captured into. GPU time: CUDA events around batches of back-to-back
calls, warm-up first, the median of the batches.

The streaming rows time the recurrent matrix's per-step passes alone (fprop ``h·Wh`` and bprop
``dz·Whᵀ`` over ``N`` rows), from CuPy into kept outputs, beside a device-to-device copy of the weight
bytes in the same run. At small ``N`` a pass reads each present block once: its bound is those bytes
at the copy's rate, the bytes the copy reads and writes over its time (``% of copy``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from bsmm.cli.framework_bench import capture_graph, gpu_time
from bsmm.layouts.small_world import small_world_layout
from bsmm.matmul import BlocksparseMatMul
from bsmm.nn.lstm_gates import gate_layout

__all__ = ["LstmRow", "StreamRow", "LSTM_GRID", "bench_lstm", "bench_streaming", "equal_parameter_width",
           "format_lstm_rows", "format_stream_rows"]

#: The issue's grid: hidden sizes, densities, batch rows N, dtypes; T = 32 steps, block 32.
LSTM_GRID = {"hidden": (4096, 12288, 16384), "densities": (0.1, 0.05), "batch": (8, 32, 128),
             "dtypes": ("bfloat16", "float32"), "steps": 32, "block_size": 32}


@dataclasses.dataclass
class LstmRow:
    """One shape and measure: median seconds of bsmm's layer and of cuDNN's at the same width and at
    equal parameters (``equal_hidden`` units); None where a side was not run or failed (``note``)."""

    hidden: int
    density: float
    batch: int
    steps: int
    dtype: str
    measure: str  # "forward", "train", "train graph"
    sparse_s: float | None
    same_width_s: float | None
    equal_params_s: float | None
    equal_hidden: int
    parameters: int
    note: str = ""

    def ratio(self, dense_s: float | None) -> float | None:
        """Speed-up of bsmm over a dense side (dense time / bsmm time)."""
        return None if dense_s is None or self.sparse_s is None else dense_s / self.sparse_s

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"vs_same_width": self.ratio(self.same_width_s),
                                           "vs_equal_params": self.ratio(self.equal_params_s)}


@dataclasses.dataclass
class StreamRow:
    """A per-step pass of the recurrent matrix at ``batch`` rows: median seconds, the weight bytes it
    streams and the copy of as many bytes in the same run."""

    pass_name: str
    hidden: int
    density: float
    batch: int
    dtype: str
    seconds: float
    weight_bytes: int
    copy_s: float

    @property
    def copy_rate(self) -> float:
        """Bytes a second the copy moves, read and written."""
        return 2 * self.weight_bytes / self.copy_s

    @property
    def copy_fraction(self) -> float:
        """The pass's weight bytes a second over the copy's rate."""
        return self.weight_bytes / self.seconds / self.copy_rate

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"copy_fraction": self.copy_fraction,
                                           "tb_per_s": self.weight_bytes / self.seconds / 1e12}


def equal_parameter_width(parameters: int) -> int:
    """The hidden size H of a dense one-layer ``nn.LSTM`` (input size H, two biases) whose parameter
    count, 8H² + 8H, is nearest ``parameters``; a multiple of 8 (what cuDNN's tensor cores take).

    >>> equal_parameter_width(8 * 1024 * 1024 + 8 * 1024)
    1024
    """
    hidden = (-1 + math.sqrt(1 + 4 * parameters / 8)) / 2
    return max(8, 8 * round(hidden / 8))


def _runs(torch, layer, x, parameters):
    """The layer's forward under no_grad and its training step (dx and every parameter's gradient)."""
    d_out = torch.randn(x.shape[0], x.shape[1], layer.hidden_size, dtype=x.dtype, device=x.device)

    def forward():
        with torch.no_grad():
            return layer(x)[0]

    def train():
        for p in parameters:
            p.grad = None
        x.grad = None
        layer(x)[0].backward(d_out)

    return forward, train


def bench_lstm(hidden=LSTM_GRID["hidden"], densities=LSTM_GRID["densities"], batch=LSTM_GRID["batch"],
               dtypes=LSTM_GRID["dtypes"], steps: int = LSTM_GRID["steps"], block_size: int = LSTM_GRID["block_size"],
               graphs: bool = True, same_width: bool = True, calls: int = 3, batches: int = 7,
               progress: Callable[[str], None] | None = None) -> list[LstmRow]:
    """:class:`LstmRow` s over the grid (see the module docstring); needs a CUDA GPU and PyTorch."""
    import torch

    import bsmm.torch  # lazily: PyTorch is optional

    def timed(run, calls, batches):
        return gpu_time(run, torch.cuda.synchronize, lambda: torch.cuda.Event(enable_timing=True),
                        lambda begin, end: begin.elapsed_time(end), calls, batches)

    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for h in hidden:
            for density in densities:
                torch.manual_seed(0)
                sparse = bsmm.torch.BlockSparseLSTM(h, h, block_size=block_size, density=density, seed=0,
                                                    input_layout="recurrent", device="cuda", dtype=dtype)
                count = sum(p.numel() for p in sparse.parameters())
                equal = equal_parameter_width(count)
                dense_layers = {"equal": torch.nn.LSTM(equal, equal, device="cuda", dtype=dtype)}
                if same_width:
                    dense_layers["same"] = torch.nn.LSTM(h, h, device="cuda", dtype=dtype)
                for layer in dense_layers.values():
                    layer.flatten_parameters()  # cuDNN's weights in one buffer, as a model moved to the GPU has them
                for n in batch:
                    times: dict = {}
                    notes = []
                    for side, layer in (("sparse", sparse), *dense_layers.items()):
                        width = h if side != "equal" else equal
                        x = torch.randn(steps, n, width, dtype=dtype, device="cuda", requires_grad=True)
                        forward, train = _runs(torch, layer, x, list(layer.parameters()))
                        times[side, "forward"] = timed(forward, calls, batches)
                        times[side, "train"] = timed(train, calls, batches)
                        if graphs:
                            try:
                                times[side, "train graph"] = timed(capture_graph(torch, train)[0], calls, batches)
                            except Exception as error:  # noqa: BLE001 - a side that cannot be captured is reported
                                notes.append(f"{side}: graph capture failed ({type(error).__name__}: {error})"[:160])
                                torch.cuda.synchronize()
                        del x
                    for measure in ("forward", "train", *(("train graph",) if graphs else ())):
                        row = LstmRow(h, density, n, steps, dtype_name, measure, times.get(("sparse", measure)),
                                      times.get(("same", measure)), times.get(("equal", measure)), equal, count,
                                      "; ".join(notes))
                        rows.append(row)
                        if progress:
                            progress(format_lstm_rows([row], header=False))
                del sparse, dense_layers
                torch.cuda.empty_cache()
    return rows


def bench_streaming(hidden: int = 12288, density: float = 0.1, batch=(1, 8, 16, 32, 64), dtype: str = "bfloat16",
                    block_size: int = 32, calls: int = 20, batches: int = 9) -> list[StreamRow]:
    """:class:`StreamRow` s: the recurrent matrix of ``BlockSparseLSTM(hidden, ...)``'s per-step fprop and
    bprop at each ``batch`` (from CuPy into kept outputs) beside a copy of the weight bytes."""
    import cupy

    blocks = hidden // block_size
    layout = gate_layout(small_world_layout(blocks, round(density * blocks * blocks), "barabasi_albert", 0), blocks)
    op = BlocksparseMatMul(layout, block_size=block_size)
    rng = cupy.random.default_rng(0)
    w = rng.standard_normal(op.w_shape, dtype=cupy.float32).astype(dtype)
    weight_bytes = w.nbytes
    source, target = cupy.empty(weight_bytes, cupy.uint8), cupy.empty(weight_bytes, cupy.uint8)

    def timed(run):
        return gpu_time(run, cupy.cuda.Device().synchronize, cupy.cuda.Event, cupy.cuda.get_elapsed_time, calls, batches)

    copy_s = timed(lambda: target.__setitem__(Ellipsis, source))
    rows = []
    for n in batch:
        h = rng.standard_normal((n, op.C), dtype=cupy.float32).astype(dtype)
        dz = rng.standard_normal((n, op.K), dtype=cupy.float32).astype(dtype)
        y, dh = cupy.empty((n, op.K), dtype), cupy.empty((n, op.C), dtype)
        for pass_name, run in (("fprop", lambda: op.fprop(h, w, out=y)), ("bprop", lambda: op.bprop(dz, w, out=dh))):
            rows.append(StreamRow(pass_name, hidden, density, n, dtype, timed(run), weight_bytes, copy_s))
    return rows


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}×"


def format_lstm_rows(rows: list[LstmRow], header: bool = True) -> str:
    """A Markdown table: bsmm's ms beside cuDNN's at the same width and at equal parameters, and the speed-ups."""
    lines = ["| H | density | N | T | dtype | measure | bsmm ms | cuDNN same width ms | bsmm vs same width "
             "| cuDNN equal params (H) ms | bsmm vs equal params |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"] if header else []
    for r in rows:
        lines.append(f"| {r.hidden} | {r.density:.0%} | {r.batch} | {r.steps} | {r.dtype} | {r.measure} | "
                     f"{_ms(r.sparse_s)} | {_ms(r.same_width_s)} | {_times(r.ratio(r.same_width_s))} | "
                     f"{_ms(r.equal_params_s)} ({r.equal_hidden}) | {_times(r.ratio(r.equal_params_s))} |"
                     + (f" {r.note}" if r.note else ""))
    return "\n".join(lines)


def format_stream_rows(rows: list[StreamRow]) -> str:
    """A Markdown table of the streaming rows: µs, TB/s on the weight bytes, and the copy's fraction."""
    lines = ["| pass | H (Wh: H x 4H) | density | N | dtype | µs | weight MB | TB/s | copy TB/s | % of copy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.pass_name} | {r.hidden} | {r.density:.0%} | {r.batch} | {r.dtype} | {r.seconds * 1e6:.1f} | "
                     f"{r.weight_bytes / 1e6:.1f} | {r.weight_bytes / r.seconds / 1e12:.2f} | {r.copy_rate / 1e12:.2f} | "
                     f"{r.copy_fraction:.0%} |")
    return "\n".join(lines)

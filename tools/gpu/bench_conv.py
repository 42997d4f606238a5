"""Benchmark BlocksparseConv's three passes against the framework's dense convolution.

    python tools/gpu/bench_conv.py [--json conv.json] [--dtype float16 bfloat16] [--shape wide32 late14]
    python tools/gpu/bench_conv.py --cpu [--json conv-cpu.json]    # small NumPy run, no GPU needed

GPU: bsmm on CuPy arrays against PyTorch's cuDNN convolution (``F.conv2d`` on
channels_last tensors, input gradient by ``torch.nn.grad.conv2d_input``, weight
gradient by ``conv2d_weight``, ``cudnn.benchmark`` on), same dtype, same data shared
through DLPack. Times are medians of CUDA-event timed batches of back-to-back calls
after a warm-up; inputs are fresh random data per shape and dtype, each density has its
own random layout (exactly that fraction of blocks) and weights. Before timing, every
(shape, dtype, density) is checked against cuDNN on the layout-masked dense weight in
float32 (TF32 off): a mismatch exits with status 1 before any table is printed.

Shapes: ``wide32`` (N=32, 32×32, C=K=512, 3×3, padding 1) is a mid-network stage of
a wide ResNet/UNet: 155 GFLOP per dense pass, enough to run cuDNN at its peak, and an
extended grid only 13 % larger than the output. ``late14`` (N=32, 14×14, C=K=1024)
is a late stage, where the grid is 31 % larger than the output (the over-computed border
rows of the implicit GEMM) and the per-offset launches are shorter. ``stride2`` (56→28,
C=K=256, stride 2) exercises the phase-split canvas.

Efficiency = dense time × density / bsmm time: 100 % is cuDNN's speed per useful FLOP.

CPU (``--cpu``): a small shape, bsmm's CPU backend against a dense NumPy convolution
(one matrix product per kernel offset), with the same correctness check. The two are
timed in turns (as ``bsmm bench`` does), and the table adds their spread: a * after the
speed-up marks a row whose repeated times spread over 25 %, taken on a busy machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys

import numpy as np

from bsmm.passes import PASS_NAMES as PASSES
from bsmm.cli.bench import SPREAD_LIMIT, BenchRow, _fmt_time, _interleaved_seconds, relative_spread, write_json
from bsmm.cli.bench_gpu import _gpu_seconds
from bsmm.nn.conv import BlocksparseConv
from bsmm.layouts import random_layout

SHAPES = {
    "wide32": dict(N=32, H=32, W=32, C=512, K=512, kernel=3, stride=1, padding=1),
    "late14": dict(N=32, H=14, W=14, C=1024, K=1024, kernel=3, stride=1, padding=1),
    "stride2": dict(N=32, H=56, W=56, C=256, K=256, kernel=3, stride=2, padding=1),
}
CPU_SHAPE = dict(N=4, H=12, W=12, C=128, K=128, kernel=3, stride=1, padding=1)
# float32 on the GPU: loose enough for cuDNN's own float32 algorithms (Winograd, FFT) in the reference.
TOLERANCE = {"float32": 1e-4, "tf32": 3e-3, "float16": 1e-2, "bfloat16": 2e-2}


@dataclasses.dataclass
class ConvRow(BenchRow):
    """A :class:`bsmm.cli.bench.BenchRow` (N, C, K describe the convolution's tensors) with its shape,
    the pass's relative error against the dense reference and, on the CPU, the spread of its times
    (the larger :func:`bsmm.cli.bench.relative_spread` of bsmm's and dense's; None on the GPU)."""

    shape: str
    error: float
    spread: float | None = None


def format_table(rows: list[ConvRow]) -> str:
    """Markdown table, a line per row; a spread column where the rows have one (the CPU's)."""
    spreads = any(r.spread is not None for r in rows)
    lines = ["| shape | dtype | block | density | pass | bsmm | dense | speed-up | efficiency | rel. error |"
             + (" spread |" if spreads else ""),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if spreads else "")]
    for r in rows:
        busy = "*" if r.spread is not None and r.spread > SPREAD_LIMIT else ""
        lines.append(f"| {r.shape} | {r.dtype} | {r.block_size} | {r.density:.0%} | {r.pass_name} | "
                     f"{_fmt_time(r.sparse_s)} | {_fmt_time(r.dense_s)} | {r.speedup:.2f}x{busy} | "
                     f"{r.efficiency:.0%} | {r.error:.1e} |"
                     + ("" if not spreads else " - |" if r.spread is None else f" {r.spread:.0%} |"))
    return "\n".join(lines)


def _describe(spec: dict) -> str:
    return (f"N={spec['N']} {spec['H']}x{spec['W']} C={spec['C']} K={spec['K']} {spec['kernel']}x{spec['kernel']} "
            f"s{spec['stride']} p{spec['padding']}")


def _conv(spec: dict, density: float, block_size: int, seed: int, tf32: bool = False) -> BlocksparseConv:
    layout = random_layout(spec["C"] // block_size, spec["K"] // block_size, density=density, seed=seed)
    return BlocksparseConv(layout, block_size, (spec["kernel"],) * 2, spec["stride"], spec["padding"], tf32=tf32)


def _rel_error(actual, expected) -> float:
    """Norm-wise relative error in float64 on the host; inf when ``actual`` holds NaN or Inf."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if not np.isfinite(actual).all():
        return float("inf")
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def _check(errors: dict, label: str, tolerance: float) -> None:
    bad = {name: error for name, error in errors.items() if not error <= tolerance}
    if bad:
        print(f"FAILED correctness check {label}: relative errors {bad} > {tolerance:g}", file=sys.stderr)
        raise SystemExit(1)


# ---- CPU ---------------------------------------------------------------------------------
def _dense_numpy(conv: BlocksparseConv, spec: dict, x, dy, dense):
    """The three dense passes in NumPy, channels last: one product per kernel offset of a padded input."""
    k, s, p = spec["kernel"], spec["stride"], spec["padding"]
    out_h, out_w = dy.shape[1:3]
    windows = [(i, j, (slice(None), slice(i, i + s * (out_h - 1) + 1, s), slice(j, j + s * (out_w - 1) + 1, s)))
               for i in range(k) for j in range(k)]

    def pad(a):
        return np.pad(a, ((0, 0), (p, p), (p, p), (0, 0)))

    def fprop():
        x_pad = pad(x)
        return sum(x_pad[index] @ dense[i, j] for i, j, index in windows)

    def bprop():
        dx = pad(np.zeros_like(x))
        for i, j, index in windows:
            dx[index] += dy @ dense[i, j].T
        return dx[:, p:p + x.shape[1], p:p + x.shape[2]]

    def updat():
        x_pad = pad(x)
        return np.stack([x_pad[index].reshape(-1, conv.C).T @ dy.reshape(-1, conv.K) for _, _, index in windows])

    return {"fprop": fprop, "bprop": bprop, "updat": updat}


def bench_cpu(densities, block_size: int, repeats: int, seed: int) -> list[ConvRow]:
    spec, rng, rows = CPU_SHAPE, np.random.default_rng(seed), []
    x = rng.standard_normal((spec["N"], spec["H"], spec["W"], spec["C"]), dtype=np.float32)
    for density in densities:
        conv = _conv(spec, density, block_size, seed)
        dy = rng.standard_normal(conv.output_shape(x.shape), dtype=np.float32)
        w = conv.normal_init(seed=rng)
        dense_runs = _dense_numpy(conv, spec, x, dy, conv.to_dense(w))
        runs = {"fprop": lambda: conv(x, w), "bprop": lambda: conv.bprop(dy, w, x.shape),
                "updat": lambda: conv.updat(x, dy)}
        dense_w = rng.standard_normal(conv.kernel_size + (conv.C, conv.K), dtype=np.float32)  # timed dense weight
        timed_dense = _dense_numpy(conv, spec, x, dy, dense_w)
        errors = {}
        for name in PASSES:
            expected = dense_runs[name]()
            if name == "updat":
                expected = conv.from_dense(expected.reshape(conv.kernel_size + (conv.C, conv.K)))
            errors[name] = _rel_error(runs[name](), expected)
        _check(errors, f"cpu float32 density {density}", TOLERANCE["float32"])
        for name in PASSES:
            # In turns, so that a busy moment of the machine slows both sides (bsmm.cli.bench.bench_cpu).
            dense_s, sparse_s = _interleaved_seconds(timed_dense[name], runs[name], repeats)
            spreads = [s for s in (relative_spread(sparse_s), relative_spread(dense_s)) if s is not None]
            rows.append(ConvRow("cpu", "float32", spec["N"], spec["C"], spec["K"], block_size, conv.density, name,
                                statistics.median(sparse_s), statistics.median(dense_s), _describe(spec),
                                errors[name], max(spreads, default=None)))
    return rows


# ---- GPU (PyTorch's cuDNN) -------------------------------------------------------------
def bench_torch(shapes: dict, dtypes, densities, block_size: int, seed: int, tf32: bool, timer,
                device: str = "cuda") -> list[ConvRow]:
    """bsmm against ``torch.nn.functional.conv2d`` and its two gradients on ``device``.

    ``shapes``: name -> spec (as :data:`SHAPES`); ``timer(fn)``: seconds per call. On
    ``device="cpu"`` the same code runs bsmm on NumPy against PyTorch's CPU convolution
    (how the tests check this function without a GPU).
    """
    import torch
    import torch.nn.functional as F

    from bsmm.torch.passes import _shared_as

    if device == "cuda":
        import cupy as xp
    else:
        xp = np
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    rows = []
    for shape_name, spec in shapes.items():
        geometry = dict(stride=spec["stride"], padding=spec["padding"])
        for dtype in dtypes:
            label = "tf32" if dtype == "float32" and tf32 else dtype
            tdtype = getattr(torch, dtype)
            generator = torch.Generator(device).manual_seed(seed)

            def randn(*shape, scale=1.0):
                draw = torch.randn(*shape, device=device, dtype=torch.float32, generator=generator)
                return (draw * scale).to(tdtype)

            x = randn(spec["N"], spec["H"], spec["W"], spec["C"])  # NHWC, i.e. NCHW channels_last below
            x_nchw = x.permute(0, 3, 1, 2)
            dense_w = randn(spec["K"], spec["C"], spec["kernel"], spec["kernel"]).to(
                memory_format=torch.channels_last)
            dy = randn(*_conv(spec, 1.0, block_size, seed).output_shape(tuple(x.shape)))
            dy_nchw = dy.permute(0, 3, 1, 2)
            dense = {
                "fprop": lambda: F.conv2d(x_nchw, dense_w, **geometry),
                "bprop": lambda: torch.nn.grad.conv2d_input(x_nchw.shape, dense_w, dy_nchw, **geometry),
                "updat": lambda: torch.nn.grad.conv2d_weight(x_nchw, dense_w.shape, dy_nchw, **geometry),
            }
            dense_s = {name: timer(run) for name, run in dense.items()}
            x_b, dy_b = _shared_as(xp, x), _shared_as(xp, dy)
            for density in densities:
                conv = _conv(spec, density, block_size, seed, tf32)
                w = randn(*conv.w_shape, scale=1.0 / np.sqrt(spec["kernel"] ** 2 * spec["C"] * density))
                w_b = _shared_as(xp, w)
                runs = {"fprop": lambda: conv(x_b, w_b), "bprop": lambda: conv.bprop(dy_b, w_b, x_b.shape),
                        "updat": lambda: conv.updat(x_b, dy_b)}
                errors = _torch_errors(xp, conv, runs, x_nchw, dy_nchw, w, geometry)
                _check(errors, f"{shape_name} {label} density {density}", TOLERANCE[label])
                for name in PASSES:
                    rows.append(ConvRow(device, label, spec["N"], spec["C"], spec["K"], block_size, conv.density,
                                        name, timer(runs[name]), dense_s[name], shape_name, errors[name]))
                    print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


def _host(array) -> np.ndarray:
    """A NumPy or CuPy array on the host, through its bits (CuPy need not know bfloat16)."""
    bits = array.view({2: np.uint16, 4: np.uint32}[array.dtype.itemsize])
    return (bits.get() if hasattr(bits, "get") else bits).view(array.dtype)


def _torch_errors(xp, conv, runs, x_nchw, dy_nchw, w, geometry) -> dict:
    """bsmm against PyTorch's convolution in float32 (TF32 off) on the layout-masked dense weight."""
    import torch
    import torch.nn.functional as F

    from bsmm.torch.passes import _shared_as

    allow = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        masked = torch.from_dlpack(conv.to_dense(_shared_as(xp, w.float()))).permute(3, 2, 0, 1)  # (K, C, kh, kw)
        x32, dy32 = x_nchw.float(), dy_nchw.float()
        expected = {
            "fprop": F.conv2d(x32, masked, **geometry).permute(0, 2, 3, 1),
            "bprop": torch.nn.grad.conv2d_input(x32.shape, masked, dy32, **geometry).permute(0, 2, 3, 1),
            "updat": torch.nn.grad.conv2d_weight(x32, masked.shape, dy32, **geometry).permute(2, 3, 1, 0),
        }
    finally:
        torch.backends.cudnn.allow_tf32 = allow
    errors = {}
    for name in PASSES:
        reference = xp.from_dlpack(expected[name].contiguous())
        if name == "updat":
            reference = conv.from_dense(reference)
        errors[name] = _rel_error(_host(runs[name]()), _host(reference))
    return errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="small NumPy run against a dense NumPy convolution")
    parser.add_argument("--json", help="write the rows and the run's metadata to this path")
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["wide32", "late14"])
    parser.add_argument("--dtype", nargs="+", choices=["float16", "bfloat16", "float32"],
                        default=["float16", "bfloat16"])
    parser.add_argument("--densities", nargs="+", type=float, default=[0.5, 0.25, 0.1])
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--tf32", action="store_true", help="float32 on TF32 tensor cores, in bsmm and in cuDNN")
    parser.add_argument("--calls", type=int, default=5, help="back-to-back calls per timed batch (GPU)")
    parser.add_argument("--batches", type=int, default=10, help="timed batches; the median is reported")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per pass (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    meta = {"python": platform.python_version(), "argv": sys.argv[1:] if argv is None else list(argv)}
    if args.cpu:
        meta |= {"device": "cpu", "shape": _describe(CPU_SHAPE)}
        rows = bench_cpu(args.densities, args.block_size, args.repeats, args.seed)
    else:
        import cupy
        import torch

        if not cupy.cuda.is_available() or not torch.cuda.is_available():
            print("no CUDA device visible to CuPy and PyTorch; use --cpu for the NumPy run", file=sys.stderr)
            return 2
        meta |= {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "cudnn": torch.backends.cudnn.version(), "cupy": cupy.__version__,
                 "shapes": {name: _describe(SHAPES[name]) for name in args.shape}}
        for name in args.shape:
            print(f"{name}: {_describe(SHAPES[name])}", flush=True)
        shapes = {name: SHAPES[name] for name in args.shape}
        rows = bench_torch(shapes, args.dtype, args.densities, args.block_size, args.seed, args.tf32,
                           lambda fn: _gpu_seconds(fn, args.calls, args.batches))
    print(format_table(rows))
    if args.json:
        write_json(rows, args.json, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())

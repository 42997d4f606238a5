"""Where a layer's call goes, eager against compiled, and what a fused epilogue saves (GPU).

The measurements behind the one-call-path issue, runnable on any checkout (the fused rows only
where the layer takes ``activation=``), so that two trees can be measured in one device call:

- a block-sparse MLP (two ``BlockSparseLinear`` with a GELU between) training step, eager and
  ``torch.compile(fullgraph=True)``: GPU ms per step (CUDA events over back-to-back steps) and
  host µs per step, and the profiler's host µs per bsmm operator;
- host µs per call: the plain CuPy call, the PyTorch forward and step beside ``nn.Linear``'s,
  2-D and the decode shape (8, 1, C) with bias under ``no_grad``;
- bias + GELU: the fused layer against the layer plus ``F.gelu`` at workloads F and S (kernels
  a step, ms).

    python tools/probes/probe_call_path.py [--json FILE] [--quick]
"""
import argparse
import cProfile
import io
import json
import pstats
import statistics
import struct
import sys
import time


# Its own timing loops, not bsmm.cli.framework_bench's: the probe runs on the trees of earlier commits too
# (gpu_check.sh callpath with BEFORE=), whose benches name and shape them otherwise.
def _events_ms(fn, steps, rounds, sync):
    import torch

    for _ in range(3):
        fn()
    sync()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / steps)
    return statistics.median(samples)


def _host_us(fn, calls, rounds, sync):
    """Median host µs a call over bursts of ``calls`` that start on an idle GPU (no sync inside)."""
    for _ in range(3):
        fn()
    sync()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    return statistics.median(samples)


def _kernels(fn, sync):
    """CUDA kernels one call launches, and the profiler's host µs per bsmm operator call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        sync()
    kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
                  and not e.key.startswith(("Memcpy", "Memset")))
    bsmm_ops = {e.key: round(e.cpu_time_total / e.count, 1) for e in prof.key_averages()
                if e.key.startswith("bsmm::")}
    return kernels / 5, bsmm_ops


def _layer(bsmm_torch, c, k, bs, density, dtype, bias, activation=None):
    from bsmm.layouts import random_layout

    options = {}
    if activation is not None:
        options["activation"] = activation
    return bsmm_torch.BlockSparseLinear(c, k, random_layout(c // bs, k // bs, density, seed=c + k), block_size=bs,
                                        bias=bias, device="cuda", dtype=dtype, **options)


def _kernel_table(fn, sync, title):
    """The profiler's CUDA kernels of five calls of ``fn``, by total GPU time, to stderr."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70)
    print(f"== kernels of 5 calls: {title}\n{table}", file=sys.stderr)


def takes_activation(bsmm_torch):
    import inspect

    return "activation" in inspect.signature(bsmm_torch.BlockSparseLinear.__init__).parameters


def mlp_rows(quick):
    """The MLP training step eager and compiled (the issue's shape and workload F)."""
    import torch

    import bsmm.torch as bsmm_torch

    sync = torch.cuda.synchronize
    rows = []
    shapes = [("MLP 4096², block 64, 20 %, N 2048", 2048, 4096, 4096, 64, 0.2)]
    if not quick:
        shapes.append(("F 4096→16384→4096, block 128, 10 %, N 8192", 8192, 4096, 16384, 128, 0.1))
    for name, n, d, hidden, bs, density in shapes:
        dtype = torch.bfloat16
        up = _layer(bsmm_torch, d, hidden, bs, density, dtype, True)
        down = _layer(bsmm_torch, hidden, d, bs, density, dtype, True)
        x = torch.randn(n, d, device="cuda", dtype=dtype, requires_grad=True)
        g = torch.randn(n, d, device="cuda", dtype=dtype)

        def model(inputs):
            return down(torch.nn.functional.gelu(up(inputs)))

        compiled = torch.compile(model, fullgraph=True)

        def step(fn):
            def run():
                up.weight.grad = down.weight.grad = up.bias.grad = down.bias.grad = x.grad = None
                fn(x).backward(g)
            return run

        for mode, fn in (("eager", model), ("compiled", compiled)):
            run = step(fn)
            gpu = _events_ms(run, 10, 15, sync)
            host = _host_us(run, 10, 15, sync)
            kernels, ops = _kernels(run, sync)
            rows.append({"row": name, "mode": mode, "gpu_ms": round(gpu, 3), "host_us": round(host, 1),
                         "kernels": kernels, "bsmm_op_host_us": ops})
        # Where a compiled step's host time goes (cProfile's top entries, cumulative).
        run = step(compiled)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20):
            run()
        profiler.disable()
        sync()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(f"== cProfile, compiled step, {name}, 20 steps (tottime)\n{text.getvalue()}", file=sys.stderr)
    return rows


def host_rows():
    """Host µs per call: the CuPy allocating call; PyTorch forward and step beside nn.Linear."""
    import cupy
    import torch

    import bsmm
    import bsmm.torch as bsmm_torch
    from bsmm.layouts import random_layout

    rows = []
    op = bsmm.BlocksparseMatMul(random_layout(32, 32, 0.1, seed=1), block_size=32)
    x = cupy.random.standard_normal((32, op.C), dtype=cupy.float32).astype(cupy.float16)
    w = cupy.random.standard_normal(op.w_shape, dtype=cupy.float32).astype(cupy.float16)
    sync = cupy.cuda.Device().synchronize
    rows.append({"row": "cupy op(x, w), N 32, 1024², fp16", "bsmm_us": round(_host_us(lambda: op(x, w), 200, 30, sync), 1),
                 "dense_us": round(_host_us(lambda: cupy.matmul(x, x[:, :1024].T), 200, 30, sync), 1)})

    tsync = torch.cuda.synchronize
    dtype = torch.bfloat16
    for name, shape, c, k, bias, train in (
            ("torch forward (32, 2048) -> 8192", (32, 2048), 2048, 8192, False, False),
            ("torch forward (32, 2048) -> 8192, bias", (32, 2048), 2048, 8192, True, False),
            ("torch forward (8, 1, 2048) -> 8192, bias (decode)", (8, 1, 2048), 2048, 8192, True, False),
            ("torch step (32, 2048) -> 8192, bias", (32, 2048), 2048, 8192, True, True)):
        layer = _layer(bsmm_torch, c, k, 32, 0.1, dtype, bias)
        dense = torch.nn.Linear(c, k, bias=bias, device="cuda", dtype=dtype)
        x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=train)
        g = torch.randn(*shape[:-1], k, device="cuda", dtype=dtype)

        def call(module):
            if train:
                def run():
                    module.weight.grad = x.grad = None
                    if bias:
                        module.bias.grad = None
                    module(x).backward(g)
                return run

            def forward():
                with torch.no_grad():
                    module(x)
            return forward

        rows.append({"row": name, "bsmm_us": round(_host_us(call(layer), 200, 30, tsync), 1),
                     "dense_us": round(_host_us(call(dense), 200, 30, tsync), 1)})
    return rows


def launch_rows():
    """Host µs of one launch of a kept matmul call (N 32, 1024², fp16) through each binding:
    ctypes (cuLaunchKernelEx with programmatic serialization, bsmm's; and plain cuLaunchKernel),
    CuPy's Cython ``launchKernel``, and NVIDIA's ``cuda.bindings`` (where installed). Where the
    kernel's parameters come from a ctypes struct packed per call, that packing is timed too."""
    import ctypes

    import cupy

    import bsmm
    from bsmm.backends.cuda.params import PACK, MatmulParams
    from bsmm.layouts import random_layout

    op = bsmm.BlocksparseMatMul(random_layout(32, 32, 0.1, seed=1), block_size=32)
    x = cupy.random.standard_normal((32, op.C), dtype=cupy.float32).astype(cupy.float16)
    w = cupy.random.standard_normal(op.w_shape, dtype=cupy.float32).astype(cupy.float16)
    out = cupy.empty((32, op.K), cupy.float16)
    op(x, w, out=out)
    call = next(iter(op.kept_calls.values()))
    stream = cupy.cuda.get_current_stream().ptr
    for _ in range(3):
        call.launch(stream, x.data.ptr, w.data.ptr, out.data.ptr)
    block = next(iter(call.blocks.values()))
    sync = cupy.cuda.Device().synchronize
    head = call.plan.launcher.head
    rows = [{"row": "bsmm kept launch (FastCall.launch, ctypes cuLaunchKernelEx)",
             "us": round(_host_us(lambda: call.launch(stream, x.data.ptr, w.data.ptr, out.data.ptr), 200, 30, sync), 2)}]
    if block.arguments is not None:
        rows.append({"row": "ctypes cuLaunchKernelEx alone", "us": round(_host_us(lambda: block.driver(*block.arguments),
                                                                                 200, 30, sync), 2)})
    launch_kernel = cupy.cuda.driver.launchKernel
    rows.append({"row": "CuPy launchKernel (Cython, no serialization)",
                 "us": round(_host_us(lambda: launch_kernel(*head, stream, block.address, 0), 200, 30, sync), 2)})
    cu_launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    args = [ctypes.c_void_p(head[0]), *map(ctypes.c_uint, head[1:8]), ctypes.c_void_p(stream),
            ctypes.c_void_p(block.address), None]
    rows.append({"row": "ctypes cuLaunchKernel", "us": round(_host_us(lambda: cu_launch(*args), 200, 30, sync), 2)})
    try:
        from cuda.bindings import driver

        function = driver.CUfunction(head[0])
        handle = driver.CUstream(stream)
        rows.append({"row": "cuda.bindings cuLaunchKernel", "us": round(_host_us(
            lambda: driver.cuLaunchKernel(function, *head[1:8], handle, block.address, 0), 200, 30, sync), 2)})
    except Exception as error:  # noqa: BLE001 - not installed, or another API: say so in the table
        rows.append({"row": f"cuda.bindings: {type(error).__name__}: {error}"[:120], "us": float("nan")})
    params, values = MatmulParams(), struct.unpack(f"<{len(MatmulParams._fields_)}Q", bytes(block.values))
    rows.append({"row": "pack MatmulParams with struct.pack_into", "us": round(_host_us(
        lambda: PACK(params, 0, *values), 2000, 30, sync), 3)})
    names = [name for name, _ in MatmulParams._fields_]

    def by_field():
        for name, value in zip(names, values):
            setattr(params, name, value)
    rows.append({"row": "fill MatmulParams field by field (ctypes)", "us": round(_host_us(by_field, 2000, 30, sync), 3)})
    return rows


def fused_rows(quick):
    """The layer with bias, then F.gelu, against the fused layer (where there is one): kernels, ms."""
    import torch

    import bsmm.torch as bsmm_torch

    if not takes_activation(bsmm_torch):
        return []
    sync = torch.cuda.synchronize
    dtype = torch.bfloat16
    rows = []
    shapes = [("S N 32, 12288², block 32, 10 %", 32, 12288, 12288, 32, 0.1)]
    if not quick:
        shapes.insert(0, ("F up N 8192, 4096→16384, block 128, 10 %", 8192, 4096, 16384, 128, 0.1))
    for name, n, c, k, bs, density in shapes:
        plain = _layer(bsmm_torch, c, k, bs, density, dtype, True)
        fused = _layer(bsmm_torch, c, k, bs, density, dtype, True, activation="gelu_tanh")
        with torch.no_grad():
            fused.weight.copy_(plain.weight)
            fused.bias.copy_(plain.bias)
        x = torch.randn(n, c, device="cuda", dtype=dtype, requires_grad=True)
        g = torch.randn(n, k, device="cuda", dtype=dtype)
        gelu = torch.nn.functional.gelu
        with torch.no_grad():
            error = (fused(x).float() - gelu(plain(x), approximate="tanh").float()).abs().max().item()
        for mode, fn in (("unfused", lambda: gelu(plain(x), approximate="tanh")), ("fused", lambda: fused(x))):
            def forward(fn=fn):
                with torch.no_grad():
                    fn()

            def step(fn=fn, layer=plain if mode == "unfused" else fused):
                layer.weight.grad = layer.bias.grad = x.grad = None
                fn().backward(g)

            _kernel_table(step, sync, f"{name}, {mode} step")
            rows.append({"row": name, "mode": mode,
                         "forward_ms": round(_events_ms(forward, 10, 15, sync), 4),
                         "forward_kernels": _kernels(forward, sync)[0],
                         "step_ms": round(_events_ms(step, 10, 15, sync), 4),
                         "step_kernels": _kernels(step, sync)[0], "max_abs_diff": error})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true", help="the issue's MLP and S only")
    args = parser.parse_args()
    import torch

    print(f"# call path probe: torch {torch.__version__}, {torch.cuda.get_device_name()}")
    result = {"mlp": mlp_rows(args.quick), "host": host_rows(), "fused": fused_rows(args.quick)}
    try:  # (trees from before the parameter struct have no bsmm.backends.cuda.params)
        result["launch"] = launch_rows()
    except ImportError as error:
        print(f"launch rows skipped: {error}", file=sys.stderr)
    print("\n| MLP step | mode | GPU ms | host µs | kernels | host µs per bsmm op |\n| --- | --- | --- | --- | --- | --- |")
    for r in result["mlp"]:
        print(f"| {r['row']} | {r['mode']} | {r['gpu_ms']} | {r['host_us']} | {r['kernels']:.0f} | {r['bsmm_op_host_us']} |")
    print("\n| host per call | bsmm µs | dense µs | ratio |\n| --- | --- | --- | --- |")
    for r in result["host"]:
        print(f"| {r['row']} | {r['bsmm_us']} | {r['dense_us']} | {r['bsmm_us'] / r['dense_us']:.2f} |")
    if result["fused"]:
        print("\n| bias + GELU | mode | forward ms | kernels | step ms | kernels | max abs diff |\n"
              "| --- | --- | --- | --- | --- | --- | --- |")
        for r in result["fused"]:
            print(f"| {r['row']} | {r['mode']} | {r['forward_ms']} | {r['forward_kernels']:.0f} | {r['step_ms']} | "
                  f"{r['step_kernels']:.0f} | {r['max_abs_diff']:.3g} |")
    if result.get("launch"):
        print("\n| one launch, host | µs |\n| --- | --- |")
        for r in result["launch"]:
            print(f"| {r['row']} | {r['us']} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()

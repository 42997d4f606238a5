"""Where a call's host time goes, against the floors the frameworks themselves set (GPU).

Host time per call of bursts of calls, the GPU idle at each burst's start
(``bsmm.cli.framework_bench._host_time``), at the seed's shape (N 32, 12288², block 32, bf16, 10 %)
beside what any layer pays in the same framework: an allocation, a tiny ``nn.Linear``, an
``autograd.Function`` that does nothing, a jitted JAX function of one addition. Then cProfile's
table of the PyTorch training step, per step.

    python tools/gpu/host_floor.py [--json FILE] [--frameworks torch,cupy,jax]
"""
import argparse
import cProfile
import io
import json
import pstats
import sys

import numpy as np

import bsmm
from bsmm.cli.framework_bench import _host_time
from bsmm.layouts import random_layout

N, C, BS, DENSITY = 32, 12288, 32, 0.1


def torch_rows():
    import torch

    import bsmm.torch
    from bsmm.torch import passes as torch_passes

    sync = torch.cuda.synchronize
    dtype = torch.bfloat16
    layer = bsmm.torch.BlockSparseLinear(C, C, random_layout(C // BS, C // BS, DENSITY, seed=0), block_size=BS,
                                         bias=False, device="cuda", dtype=dtype)
    x = torch.randn(N, C, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(N, C, device="cuda", dtype=dtype)
    tiny = torch.nn.Linear(64, 64, bias=False, device="cuda", dtype=dtype)
    x_tiny = torch.randn(N, 64, device="cuda", dtype=dtype, requires_grad=True)
    g_tiny = torch.randn(N, 64, device="cuda", dtype=dtype)

    class Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, grad):
            return grad

    def step(module, inputs, gradient):
        module.weight.grad = inputs.grad = None
        module(inputs).backward(gradient)

    def nothing_step():
        x_tiny.grad = None
        Nothing.apply(x_tiny).backward(g_tiny)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    key, w = layer._key, layer.weight.detach()
    xd = x.detach()
    for _ in range(3):
        step(layer, x, g)
    op = torch_passes.matmul_operator(key, 1, False)
    fprop_call = op.kept_calls[("fprop", xd.shape, np.dtype(bsmm.SUPPORTED_DTYPES["bfloat16"]), 1, False, "store")]
    out = torch.empty(N, C, device="cuda", dtype=dtype)
    stream = torch.cuda.current_stream().cuda_stream
    cases = {
        "torch.empty (32, 12288)": lambda: torch.empty(N, C, device="cuda", dtype=dtype),
        "nn.Linear 64->64 forward": lambda: tiny(x_tiny),
        "nn.Linear 64->64 forward no_grad": no_grad(lambda: tiny(x_tiny)),
        "nn.Linear 64->64 step": lambda: step(tiny, x_tiny, g_tiny),
        "autograd.Function (identity) step": nothing_step,
        "bsmm FastCall.launch (fprop, raw pointers)": lambda: fprop_call.launch(stream, xd.data_ptr(),
                                                                                 w.data_ptr(), out.data_ptr()),
        "bsmm run_pass fprop": lambda: torch_passes.run_pass("fprop", xd, w, key, 1, False),
        "bsmm run_pass bprop": lambda: torch_passes.run_pass("bprop", g, w, key, 1, False),
        "bsmm run_pass updat": lambda: torch_passes.run_pass("updat", xd, g, key, 1, False),
        "bsmm BlockSparseLinear forward": lambda: layer(x),
        "bsmm BlockSparseLinear forward no_grad": no_grad(lambda: layer(x)),
        "bsmm BlockSparseLinear step": lambda: step(layer, x, g),
    }
    rows = [("torch", name, _host_time(run, sync)) for name, run in cases.items()]
    profile = cProfile.Profile()
    steps = 500
    profile.enable()
    for _ in range(steps):
        step(layer, x, g)
    profile.disable()
    sync()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).sort_stats("tottime")
    stats.print_stats(20)
    return rows, f"cProfile, {steps} training steps of BlockSparseLinear (times are totals; divide by {steps}):\n" \
                 + text.getvalue()


def cupy_rows():
    import cupy

    sync = cupy.cuda.Device().synchronize
    dtype = bsmm.SUPPORTED_DTYPES["bfloat16"]
    op = bsmm.BlocksparseMatMul(random_layout(C // BS, C // BS, DENSITY, seed=0), block_size=BS)
    rng = np.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((N, C)).astype(dtype))
    w = cupy.asarray(rng.standard_normal(op.w_shape).astype(dtype))
    out = cupy.empty((N, C), dtype)
    op(x, w, out=out)
    cases = {"cupy.empty (32, 12288)": lambda: cupy.empty((N, C), dtype),
             "bsmm op(x, w) allocating": lambda: op(x, w),
             "bsmm op(x, w, out=)": lambda: op(x, w, out=out)}
    return [("cupy", name, _host_time(run, sync)) for name, run in cases.items()]


def jax_rows():
    import jax
    import jax.numpy as jnp

    import bsmm.jax

    op = bsmm.BlocksparseMatMul(random_layout(C // BS, C // BS, DENSITY, seed=0), block_size=BS)
    rng = np.random.default_rng(0)
    x, g = (jnp.asarray(rng.standard_normal((N, C)), jnp.bfloat16) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(op.w_shape), jnp.bfloat16)
    last = []

    def keep(fn):
        def run():
            last[:] = [fn()]
        return run

    def sync():
        if last:
            jax.block_until_ready(last[0])

    from jax.experimental.buffer_callback import buffer_callback

    plus_one = jax.jit(lambda x: x + 1)
    nothing = jax.jit(buffer_callback(lambda context, out, x: None, jax.ShapeDtypeStruct(x.shape, x.dtype)))
    forward = jax.jit(lambda x, w: bsmm.jax.blocksparse_matmul(x, w, op))
    step = jax.jit(lambda x, w: jax.vjp(lambda x, w: bsmm.jax.blocksparse_matmul(x, w, op), x, w)[1](g))
    cases = {"jit(x + 1)": keep(lambda: plus_one(x)),
             "jit(a buffer_callback that does nothing)": keep(lambda: nothing(x)),
             "bsmm jit forward": keep(lambda: forward(x, w)),
             "bsmm jit step (vjp: dx, dW)": keep(lambda: step(x, w))}
    for run in cases.values():
        run()
        sync()
    return [("jax", name, _host_time(run, sync)) for name, run in cases.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--frameworks", default="torch,cupy,jax")
    args = parser.parse_args()
    rows, profile = [], ""
    for framework in args.frameworks.split(","):
        if framework == "torch":
            torch_part, profile = torch_rows()
            rows += torch_part
        else:
            rows += {"cupy": cupy_rows, "jax": jax_rows}[framework]()
    print("| framework | call | host µs |\n| --- | --- | --- |")
    for framework, name, seconds in rows:
        print(f"| {framework} | {name} | {seconds * 1e6:.1f} |")
    print(profile, file=sys.stderr)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"rows": rows, "profile": profile}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does XLA replay bsmm's passes from a command buffer (CUDA graph) without calling Python? (GPU)

Runs a jitted program of dense products around a bsmm product, ten times on fresh inputs,
counting the Python callbacks (and whether XLA was capturing its stream), and checks every
result against the densified product. With ``XLA_FLAGS=--xla_gpu_graph_min_graph_size=1`` XLA
records even this small program into a graph and later calls replay it without Python; with
``[jax] command_buffers = false`` (``$BSMM_CONFIG``) every call runs the callback.

    python tools/probes/probe_jax_graphs.py
"""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import bsmm
import bsmm.config
import bsmm.jax
from bsmm.jax import passes as jax_passes
from bsmm.layouts import random_layout

calls = {"count": 0}
original = jax_passes.PassCallback.__call__


def counted(self, context, *args):
    calls["count"] += 1
    if int(args[0].__dlpack_device__()[0]) == 2:  # CUDA: was XLA capturing the stream into a graph?
        import cupy

        capturing = cupy.cuda.runtime.streamIsCapturing(int(context.stream))
        calls.setdefault("capturing", []).append((self.pass_name, bool(capturing)))
    return original(self, context, *args)


jax_passes.PassCallback.__call__ = counted
op = bsmm.BlocksparseMatMul(random_layout(24, 24, 0.2, seed=1), block_size=32)
rng = np.random.default_rng(0)
w = jnp.asarray(rng.standard_normal(op.w_shape), jnp.float32)
W = jnp.asarray(op.to_dense(np.asarray(w)))
dense = [jnp.asarray(rng.standard_normal((op.C, op.C)) / np.sqrt(op.C), jnp.float32) for _ in range(4)]


def program(x, w, product):
    h = x
    for d in dense:
        h = jnp.tanh(h @ d)
    return product(h, w)


sparse = jax.jit(lambda x, w: program(x, w, lambda h, w: bsmm.jax.blocksparse_matmul(h, w, op)))
step = jax.jit(lambda x, w: jax.grad(lambda x, w: program(x, w, lambda h, w: bsmm.jax.blocksparse_matmul(
    h, w, op)).sum(), argnums=(0, 1))(x, w))
reference = jax.jit(lambda x: program(x, W, lambda h, W: h @ W))
print("XLA_FLAGS:", os.environ.get("XLA_FLAGS"), "command buffers:", bsmm.config.settings()["jax"]["command_buffers"])
worst = 0.0
for i in range(10):
    x = jnp.asarray(rng.standard_normal((64, op.C)), jnp.float32)
    y, expected = sparse(x, w), reference(x)
    worst = max(worst, float(jnp.abs(y - expected).max() / jnp.abs(expected).max()))
    print(f"call {i}: callbacks so far {calls['count']}, max relative error so far {worst:.2e}")
before = calls["count"]
for i in range(10):
    dx, dw = step(jnp.asarray(rng.standard_normal((64, op.C)), jnp.float32), w)
jax.block_until_ready(dw)
print(f"10 gradient steps: {calls['count'] - before} callbacks; dw finite: {bool(jnp.isfinite(dw).all())}")
x = jnp.asarray(rng.standard_normal((64, op.C)), jnp.float32)
for name, fn in (("forward", lambda: sparse(x, w)), ("grad", lambda: step(x, w))):
    jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(200):
        out = fn()
    jax.block_until_ready(out)
    print(f"{name}: {(time.perf_counter() - start) / 200 * 1e6:.1f} us a call, 200 back to back")
print("callbacks (pass, stream capturing):", calls.get("capturing"))

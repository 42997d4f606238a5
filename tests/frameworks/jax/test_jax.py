"""bsmm.jax: the differentiable JAX function and layer, on the CPU backend and (marker gpu) the CUDA kernels.

Every test body runs on the ``device`` fixture's device: inputs are created
there and jit runs there, so the same checks cover the host callback to the CPU
backend and the kernels launched on XLA's stream. References are float64 dense
products built without bsmm (``reference.py``) or JAX's own dense ``x @ W``
with ``W`` scattered from the block data by :func:`dense_w` (independent of bsmm).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

pytest.importorskip("jax", reason="JAX is not installed: bsmm.jax tests skipped")
import jax

# Dense references must be exact float32: XLA would otherwise run float32 dots on TF32 tensor
# cores on the GPU (~1e-3 relative error), while bsmm's float32 passes are exact.
jax.config.update("jax_default_matmul_precision", "highest")
import jax.extend.core
import jax.numpy as jnp
from jax.test_util import check_grads
from reference import (
    assert_close,
    random_data,
    random_layout,
    ref_bprop,
    ref_fprop,
    ref_updat,
)

import bsmm
import bsmm.jax as bjax
from conftest import REPO_ROOT
import bsmm.jax.passes
import jax_cases
from jax_cases import gpu_or_skip, host

try:
    # Two host devices for the mixed-device test; only possible before JAX starts its backends.
    jax.config.update("jax_num_cpu_devices", 2)
except RuntimeError:
    pass

BS = 8
REPO = str(REPO_ROOT)


# -- fixtures and helpers -----------------------------------------------------------------------------
device = jax_cases.device  # the fixture (tests take it by name; x64 is in tests/conftest.py)


def put(array, dev):
    return jax.device_put(jnp.asarray(array), dev)


def dense_w(op, w):
    """Dense (C, K) ``W`` from block data with JAX ops (differentiable, no bsmm code)."""
    rows, cols = np.nonzero(op.layout)
    cb, kb = op.layout.shape
    bs = op.block_size
    blocked = jnp.zeros((cb, bs, kb, bs), w.dtype).at[rows, :, cols, :].set(w)
    return blocked.reshape(op.C, op.K)


def dense_matmul(x, w, op):
    """The dense JAX twin of blocksparse_matmul."""
    weight = dense_w(op, w)
    return x @ weight if op.feature_axis == 1 else weight.T @ x


def activation_shape(op, n, features):
    return (n, features) if op.feature_axis == 1 else (features, n)


def make_case(seed, axis, n, dtype="float32", cb=4, kb=3, density=0.5, layout=None):
    rng = np.random.default_rng(seed)
    layout = random_layout(rng, cb, kb, density) if layout is None else layout
    op = bsmm.BlocksparseMatMul(layout, block_size=BS, feature_axis=axis)
    x = random_data(rng, activation_shape(op, n, op.C), dtype)
    dy = random_data(rng, activation_shape(op, n, op.K), dtype)
    w = random_data(rng, op.w_shape, dtype)
    return op, x, dy, w


def passes_in(jaxpr) -> list[str]:
    """The bsmm passes (with batch shapes) that a jaxpr runs, in order, nested jaxprs included."""
    found = []

    def visit(closed_or_open):
        jaxpr_ = getattr(closed_or_open, "jaxpr", closed_or_open)
        for eqn in jaxpr_.eqns:
            if eqn.primitive.name == "buffer_callback":
                found.append(repr(eqn.params["callback"]))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jaxpr)
    return found


AXES = pytest.mark.parametrize("axis", [1, 0], ids=["axis1", "axis0"])


# -- import behaviour ---------------------------------------------------------------------------------
def _run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=120)


def test_import_bsmm_does_not_import_jax():
    result = _run_python("import sys, bsmm; print('jax' in sys.modules, 'jaxlib' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_missing_jax_gives_a_clear_import_error():
    result = _run_python(
        "import sys; sys.modules['jax'] = None\n"
        "try:\n    import bsmm.jax\nexcept ImportError as e:\n    print('ImportError:', e)\n"
    )
    assert result.returncode == 0, result.stderr
    assert "ImportError: bsmm.jax needs JAX: pip install jax" in result.stdout


# -- forward ------------------------------------------------------------------------------------------
@AXES
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 7, 32])
def test_forward_matches_float64_reference(device, axis, dtype, n):
    op, x, _, w = make_case(10 + n, axis, n, dtype)
    y = bjax.blocksparse_matmul(put(x, device), put(w, device), op)
    assert y.dtype == jnp.dtype(dtype) and y.shape == activation_shape(op, n, op.K)
    assert y.devices() == {device}
    assert_close(host(y), ref_fprop(op.layout, w, BS, x, axis), dtype, "y")


@AXES
def test_empty_layout_gives_zeros_and_zero_gradients(device, axis):
    op, x, dy, w = make_case(3, axis, 5, layout=np.zeros((4, 3), np.uint8))
    assert op.w_shape == (0, BS, BS)
    x_, w_ = put(x, device), put(w, device)
    y, vjp = jax.vjp(lambda x, w: bjax.blocksparse_matmul(x, w, op), x_, w_)
    dx, dw = vjp(put(dy, device))
    assert host(y).shape == dy.shape and not host(y).any()
    assert host(dx).shape == x.shape and not host(dx).any()
    assert dw.shape == (0, BS, BS)


@AXES
def test_zero_rows(device, axis):
    op, x, dy, w = make_case(4, axis, 0)
    y, vjp = jax.vjp(lambda x, w: bjax.blocksparse_matmul(x, w, op), put(x, device), put(w, device))
    dx, dw = vjp(put(dy, device))
    assert y.shape == dy.shape and dx.shape == x.shape
    assert not host(dw).any() and dw.shape == op.w_shape


def test_leading_axes_are_rows(device):
    """feature_axis=1: x (..., C) is the batch of rows x.reshape(-1, C)."""
    op, x, _, w = make_case(5, 1, 12)
    x3 = x.reshape(2, 2, 3, op.C)
    y = bjax.blocksparse_matmul(put(x3, device), put(w, device), op)
    assert y.shape == (2, 2, 3, op.K)
    assert_close(host(y).reshape(12, op.K), ref_fprop(op.layout, w, BS, x, 1), "float32")
    vector = bjax.blocksparse_matmul(put(x[0], device), put(w, device), op)
    assert vector.shape == (op.K,)
    assert_close(host(vector), ref_fprop(op.layout, w, BS, x[:1], 1)[0], "float32")


# -- gradients ----------------------------------------------------------------------------------------
@AXES
@pytest.mark.parametrize("n", [1, 9])
def test_gradients_match_dense_jax_autodiff(device, axis, n):
    """Analytic gradients (bprop for x, updat for w) against JAX's autodiff of the dense
    twin ``x @ W`` in float32, and against float64 references; norm-wise rtol 1e-5."""
    op, x, dy, w = make_case(20 + n, axis, n)
    x_, w_, dy_ = put(x, device), put(w, device), put(dy, device)

    def loss(f):
        return lambda x, w: jnp.vdot(f(x, w, op), dy_)

    dx, dw = jax.grad(loss(bjax.blocksparse_matmul), argnums=(0, 1))(x_, w_)
    dense_dx, dense_dw = jax.grad(loss(dense_matmul), argnums=(0, 1))(x_, w_)
    assert_close(host(dx), host(dense_dx), "float32", "dx vs dense autodiff")
    assert_close(host(dw), host(dense_dw), "float32", "dw vs dense autodiff")
    assert_close(host(dx), ref_bprop(op.layout, w, BS, dy, axis), "float32", "dx vs float64")
    assert_close(host(dw), ref_updat(op.layout, BS, x, dy, axis), "float32", "dw vs float64")


@AXES
def test_check_grads_reverse_mode(device, axis):
    """jax.test_util.check_grads (order 1, reverse mode) in float32, on every device (float64
    runs on the CPU only: test_check_grads_float64).

    The product is bilinear, so central differences are exact up to rounding for any
    step; eps=0.5 keeps float32 rounding (~1e-6 relative) far below atol=rtol=1e-3,
    while a wrong gradient is off by O(1).
    """
    op, x, _, w = make_case(30, axis, 6)
    check_grads(lambda x, w: bjax.blocksparse_matmul(x, w, op), (put(x, device), put(w, device)),
                order=1, modes=["rev"], eps=0.5, atol=1e-3, rtol=1e-3)


@AXES
@pytest.mark.parametrize("n", [1, 7])
@pytest.mark.parametrize("kind", ["random", "empty"])
def test_float64_passes_match_reference(x64, axis, n, kind):
    """float64 on the CPU is computed in float64: y, dx and dw within 1e-12 of the float64 reference."""
    layout = np.zeros((4, 3), np.uint8) if kind == "empty" else None
    op, x, dy, w = make_case(36 + n, axis, n, np.float64, layout=layout)
    cpu = jax.devices("cpu")[0]
    y, vjp = jax.vjp(lambda x, w: bjax.blocksparse_matmul(x, w, op), put(x, cpu), put(w, cpu))
    dx, dw = vjp(put(dy, cpu))
    for name, actual, expected in (("y", y, ref_fprop(op.layout, w, BS, x, axis)),
                                   ("dx", dx, ref_bprop(op.layout, w, BS, dy, axis)),
                                   ("dw", dw, ref_updat(op.layout, BS, x, dy, axis))):
        assert actual.dtype == jnp.float64, name
        error = np.linalg.norm(host(actual) - expected) / max(np.linalg.norm(expected), 1e-300)
        assert error <= 1e-12, f"{name}: relative error {error:.3g}"


@AXES
def test_check_grads_float64(x64, axis):
    """jax.test_util.check_grads in float64 at its default tolerances, reverse mode to order 2,
    over x and w of blocksparse_matmul and over x, w and b of BlockSparseDense."""
    op, x, _, w = make_case(37, axis, 3, np.float64, cb=3, kb=2, density=0.7)
    cpu = jax.devices("cpu")[0]
    check_grads(lambda x, w: bjax.blocksparse_matmul(x, w, op), (put(x, cpu), put(w, cpu)),
                order=2, modes=["rev"])
    layer = bjax.BlockSparseDense(op.C, op.K, op.layout, block_size=BS, feature_axis=axis)
    rng = np.random.default_rng(38)
    params = {"w": put(rng.standard_normal(op.w_shape), cpu), "b": put(rng.standard_normal(op.K), cpu)}
    check_grads(lambda x, params: layer.apply(params, x), (put(x, cpu), params), order=2, modes=["rev"])


def test_float64_needs_x64():
    """Without jax_enable_x64, JAX would silently run float64 NumPy input in float32: refused."""
    op, x, _, w = make_case(39, 1, 3, np.float64)
    with pytest.raises(TypeError, match=r"x has dtype float64, which JAX turns into float32 unless 64-bit"):
        bjax.blocksparse_matmul(x, w, op)


@pytest.mark.gpu
def test_float64_is_refused_on_the_gpu(x64):
    gpu = gpu_or_skip()
    op, x, _, w = make_case(40, 1, 3, np.float64)
    with pytest.raises(TypeError, match="x has dtype float64, which runs only on the CPU backend"):
        bjax.blocksparse_matmul(put(x, gpu), put(w, gpu), op)


@AXES
def test_second_order_gradients_match_dense(device, axis):
    """Reverse over reverse: a gradient penalty ||d(loss)/dx||² differentiated w.r.t. w, and a
    Hessian-vector product by grad of grad, against the dense twin (float32, rtol 1e-5)."""
    op, x, dy, w = make_case(34, axis, 5)
    x_, w_, dy_ = put(x, device), put(w, device), put(dy, device)
    v = put(random_data(np.random.default_rng(35), op.w_shape, "float32"), device)

    def penalty(matmul, w):
        grad_x = jax.grad(lambda x: jnp.sum(jnp.tanh(matmul(x, w, op)) * dy_))(x_)
        return jnp.sum(grad_x**2)

    def loss(matmul, w):
        return jnp.sum(jnp.tanh(matmul(x_, w, op)) ** 2)

    def hvp(matmul, w):
        return jax.grad(lambda w: jnp.vdot(jax.grad(functools.partial(loss, matmul))(w), v))(w)

    assert_close(host(jax.jit(jax.grad(functools.partial(penalty, bjax.blocksparse_matmul)))(w_)),
                 host(jax.grad(functools.partial(penalty, dense_matmul))(w_)), "float32", "gradient penalty")
    assert_close(host(jax.jit(functools.partial(hvp, bjax.blocksparse_matmul))(w_)),
                 host(hvp(dense_matmul, w_)), "float32", "Hessian-vector product")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_gradients(device, dtype):
    """Gradients in half precision keep the dtype and match float64 at the dtype's tolerance."""
    op, x, dy, w = make_case(31, 1, 16, dtype)
    _, vjp = jax.vjp(lambda x, w: bjax.blocksparse_matmul(x, w, op), put(x, device), put(w, device))
    dx, dw = vjp(put(dy, device))
    assert dx.dtype == dw.dtype == jnp.dtype(dtype)
    assert_close(host(dx), ref_bprop(op.layout, w, BS, dy, 1), dtype, "dx")
    assert_close(host(dw), ref_updat(op.layout, BS, x, dy, 1), dtype, "dw")


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
def test_recurrent_net_under_scan(device, remat):
    """The seed's use: one block-sparse weight applied at every step of an RNN (lax.scan),
    optionally rematerialized; gradients against the dense twin's autodiff (rtol 1e-5)."""
    rng = np.random.default_rng(33)
    op = bsmm.BlocksparseMatMul(random_layout(rng, 4, 4, 0.5), block_size=BS)
    w = put(random_data(rng, op.w_shape, "float32") / 4, device)
    xs = put(random_data(rng, (6, 5, op.C), "float32"), device)

    def loss(matmul, w):
        def step(h, x):
            h = jnp.tanh(matmul(h, w, op) + x)
            return h, h.sum()

        h, sums = jax.lax.scan(jax.checkpoint(step) if remat else step, jnp.zeros((5, op.C)), xs)
        return sums.sum() + (h**2).sum()

    dw = jax.jit(jax.grad(functools.partial(loss, bjax.blocksparse_matmul)))(w)
    dense_dw = jax.grad(functools.partial(loss, dense_matmul))(w)
    assert_close(host(dw), host(dense_dw), "float32", "dw through scan")


def test_backward_runs_only_the_passes_it_needs():
    """A data input (no gradient for x) skips bprop; frozen weights skip updat."""
    op, x, _, w = make_case(32, 1, 4)
    f = functools.partial(bjax.blocksparse_matmul, op=op)
    only_w = passes_in(jax.make_jaxpr(jax.grad(lambda w: f(x, w).sum()))(w))
    only_x = passes_in(jax.make_jaxpr(jax.grad(lambda x: f(x, w).sum()))(x))
    both = passes_in(jax.make_jaxpr(jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1)))(x, w))
    assert [p.split("(")[0] for p in only_w] == ["bsmm.fprop", "bsmm.updat"]
    assert [p.split("(")[0] for p in only_x] == ["bsmm.fprop", "bsmm.bprop"]
    assert sorted(p.split("(")[0] for p in both) == ["bsmm.bprop", "bsmm.fprop", "bsmm.updat"]


# -- jit ----------------------------------------------------------------------------------------------
def test_jit_traces_once(device, monkeypatch):
    """Repeated calls (eager, under an outer jit, and of the gradient) trace bsmm's passes once."""
    op, x, _, w = make_case(40, 1, 5)
    x_, w_ = put(x, device), put(w, device)
    traced = []  # each trace of a pass makes its XLA callback once
    original = bsmm.jax.passes.buffer_callback
    monkeypatch.setattr(bsmm.jax.passes, "buffer_callback",
                        lambda callback, *args, **kwargs: traced.append(callback.pass_name) or original(callback, *args,
                                                                                                      **kwargs))
    outer = jax.jit(lambda x, w: bjax.blocksparse_matmul(x, w, op) * 2)
    grad = jax.grad(lambda w: bjax.blocksparse_matmul(x_, w, op).sum())
    for _ in range(3):
        eager, jitted, dw = bjax.blocksparse_matmul(x_, w_, op), outer(x_, w_), grad(w_)
    assert traced == ["fprop", "updat"], traced
    calls_after_warmup = len(traced)
    bjax.blocksparse_matmul(x_, w_, op), outer(x_, w_), grad(w_)
    assert len(traced) == calls_after_warmup
    assert_close(host(jitted), 2 * host(eager).astype(np.float64), "float32")
    assert_close(host(dw), ref_updat(op.layout, BS, x, np.ones((5, op.K)), 1), "float32")


def test_jit_with_op_as_static_argument(device):
    op, x, _, w = make_case(41, 0, 3)
    f = jax.jit(bjax.blocksparse_matmul, static_argnums=2)
    y = f(put(x, device), put(w, device), op)
    assert_close(host(y), ref_fprop(op.layout, w, BS, x, 0), "float32")


# -- vmap ---------------------------------------------------------------------------------------------
def _loop(f, *batched):
    return np.stack([host(f(*args)) for args in zip(*batched)])


def assert_matches_loop(batched, looped, folded: bool) -> None:
    """vmap against a loop of calls: bitwise where vmap makes the loop's calls, within float32's
    tolerance where it folds the batch into the rows of one pass. One pass over 3 x N rows need
    not round as three over N do: OpenBLAS's Haswell kernels (2 threads, an AMD EPYC host) gave
    15-row sgemm results a unit in the last place off the 5-row ones."""
    if folded:
        assert_close(batched, looped, "float32", "vmap against a loop")
    else:
        np.testing.assert_array_equal(batched, looped)


@AXES
def test_vmap_over_activations_matches_a_loop(device, axis):
    op, _, _, w = make_case(50, axis, 1)
    rng = np.random.default_rng(51)
    xs = random_data(rng, (3,) + activation_shape(op, 5, op.C), "float32")
    w_ = put(w, device)
    f = jax.vmap(bjax.blocksparse_matmul, in_axes=(0, None, None))
    ys = f(put(xs, device), w_, op)
    expected = _loop(lambda x: bjax.blocksparse_matmul(put(x, device), w_, op), xs)
    assert_matches_loop(host(ys), expected, folded=axis == 1)
    for b in range(3):
        assert_close(host(ys)[b], ref_fprop(op.layout, w, BS, xs[b], axis), "float32")
    # feature_axis 1 folds the batch into N (one pass, batch_shape ()); axis 0 loops over views.
    (pass_,) = passes_in(jax.make_jaxpr(f, static_argnums=2)(xs, w, op))
    assert pass_ == ("bsmm.fprop(batch_shape=())" if axis == 1 else "bsmm.fprop(batch_shape=(3,))")


@AXES
def test_vmap_over_weights_and_both(device, axis):
    op, x, _, _ = make_case(52, axis, 4)
    rng = np.random.default_rng(53)
    ws = random_data(rng, (2,) + op.w_shape, "float32")
    xs = random_data(rng, (2,) + x.shape, "float32")
    shared_x = jax.vmap(bjax.blocksparse_matmul, in_axes=(None, 0, None))(put(x, device), put(ws, device), op)
    paired = jax.vmap(bjax.blocksparse_matmul, in_axes=(0, 0, None))(put(xs, device), put(ws, device), op)
    for b in range(2):
        assert_close(host(shared_x)[b], ref_fprop(op.layout, ws[b], BS, x, axis), "float32")
        assert_close(host(paired)[b], ref_fprop(op.layout, ws[b], BS, xs[b], axis), "float32")


def test_nested_vmap(device):
    """vmap(vmap) with the inner level over x and the outer over w: (2 w) x (3 x) products."""
    op, _, _, _ = make_case(54, 1, 1)
    rng = np.random.default_rng(55)
    xs = random_data(rng, (3, 4, op.C), "float32")
    ws = random_data(rng, (2,) + op.w_shape, "float32")
    inner = jax.vmap(bjax.blocksparse_matmul, in_axes=(0, None, None))
    outer = jax.vmap(inner, in_axes=(None, 0, None))
    ys = outer(put(xs, device), put(ws, device), op)
    assert ys.shape == (2, 3, 4, op.K)
    for i in range(2):
        for j in range(3):
            assert_close(host(ys)[i, j], ref_fprop(op.layout, ws[i], BS, xs[j], 1), "float32")


@AXES
def test_gradients_under_vmap_match_a_loop(device, axis):
    """Per-example gradients (vmap of grad) and the gradient of a vmapped loss (grad of vmap)."""
    op, _, _, w = make_case(56, axis, 1)
    rng = np.random.default_rng(57)
    xs = random_data(rng, (3,) + activation_shape(op, 4, op.C), "float32")
    dys = random_data(rng, (3,) + activation_shape(op, 4, op.K), "float32")
    w_, xs_, dys_ = put(w, device), put(xs, device), put(dys, device)

    def loss(w, x, dy):
        return jnp.vdot(bjax.blocksparse_matmul(x, w, op), dy)

    per_example = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(None, 0, 0)))(w_, xs_, dys_)
    summed = jax.grad(lambda w: jax.vmap(loss, in_axes=(None, 0, 0))(w, xs_, dys_).sum())(w_)
    for b in range(3):
        dw, dx = jax.grad(loss, argnums=(0, 1))(w_, xs_[b], dys_[b])
        np.testing.assert_array_equal(host(per_example[0])[b], host(dw))  # one updat per example
        assert_matches_loop(host(per_example[1])[b], host(dx), folded=axis == 1)
    expected = sum(ref_updat(op.layout, BS, xs[b], dys[b], axis) for b in range(3))
    assert_close(host(summed), expected, "float32", "grad of vmap")


# -- inputs, errors -----------------------------------------------------------------------------------
def test_inputs_are_not_modified(device):
    op, x, dy, w = make_case(60, 1, 6)
    x_, w_, dy_ = put(x, device), put(w, device), put(dy, device)
    _, vjp = jax.vjp(lambda x, w: bjax.blocksparse_matmul(x, w, op), x_, w_)
    jax.block_until_ready(vjp(dy_))
    for before, after in ((x, x_), (w, w_), (dy, dy_)):
        np.testing.assert_array_equal(host(after), before)


def test_cpu_buffers_are_shared_not_copied(monkeypatch):
    """On the CPU the pass reads XLA's input buffers and writes the jit output buffer itself."""
    op, x, _, w = make_case(61, 1, 6)
    dev = jax.devices("cpu")[0]
    x_, w_ = put(x, dev), put(w, dev)
    seen = []  # the arrays the CPU backend's pass is handed
    original = bsmm.BlocksparseMatMul.fprop
    monkeypatch.setattr(bsmm.BlocksparseMatMul, "fprop",
                        lambda self, x, w, out=None, **kwargs: seen.extend((out, x, w)) or original(self, x, w, out,
                                                                                                    **kwargs))
    y = jax.jit(lambda x, w: bjax.blocksparse_matmul(x, w, op))(x_, w_)
    out, a, b = seen
    assert out.ctypes.data == y.unsafe_buffer_pointer(), "the result must be written into the output buffer"
    assert a.ctypes.data == x_.unsafe_buffer_pointer() and b.ctypes.data == w_.unsafe_buffer_pointer()
    assert not a.flags.writeable and not b.flags.writeable and out.flags.writeable


def test_bad_inputs_name_the_argument():
    op, x, _, w = make_case(62, 1, 3)
    x_, w_ = jnp.asarray(x), jnp.asarray(w)
    f = bjax.blocksparse_matmul
    with pytest.raises(TypeError, match=r"x has dtype int32; supported dtypes are float32, float16, bfloat16"):
        f(x_.astype(jnp.int32), w_, op)
    with pytest.raises(TypeError, match=r"w has dtype float16 but x has float32; pass one dtype"):
        f(x_, w_.astype(jnp.float16), op)
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 32\) .*; got \(3, 31\)"):
        f(x_[:, :-1], w_, op)
    with pytest.raises(ValueError, match=r"w must have shape w_shape \(\d+, 8, 8\); got \(\d+, 8, 7\)"):
        f(x_, w_[:, :, :-1], op)
    with pytest.raises(TypeError, match="op must be a bsmm.BlocksparseMatMul; got str"):
        f(x_, w_, "op")
    with pytest.raises(TypeError, match="x must be a JAX or NumPy array; got list"):
        f(x.tolist(), w_, op)
    op0 = bsmm.BlocksparseMatMul(op.layout, block_size=BS, feature_axis=0)
    with pytest.raises(ValueError, match=r"x must have shape \(32, N\) or \(32,\) .*; got \(2, 32, 3\)"):
        f(jnp.zeros((2, op.C, 3)), w_, op0)
    # The checks also hold inside jit and vmap, where x is a tracer.
    with pytest.raises(TypeError, match="w has dtype bfloat16 but x has float32"):
        jax.jit(lambda x, w: f(x, w, op))(x_, w_.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 32\)"):
        jax.vmap(f, in_axes=(1, None, None))(x_, w_, op)


def test_mixed_devices_are_refused():
    """x and w committed to different devices: refused before anything runs, naming both."""
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs two JAX CPU devices (jax_num_cpu_devices was set too late)")
    op, x, _, w = make_case(63, 1, 3)
    expected = rf"w is on \['{re.escape(str(devices[1]))}'\] but x is on \['{re.escape(str(devices[0]))}'\]; move them"
    with pytest.raises(ValueError, match=expected):
        bjax.blocksparse_matmul(put(x, devices[0]), put(w, devices[1]), op)


# -- the layer and a small model trained a few steps ----------------------------------------------
def test_layer_init(device):
    layout = random_layout(np.random.default_rng(70), 8, 4, 0.5)
    layout[:, 0] = 1  # a full block column: fan-in 8 blocks
    layer = bjax.BlockSparseDense(64, 32, layout, block_size=BS)
    params = layer.init(jax.random.key(0))
    assert set(params) == {"w", "b"} and params["w"].shape == layer.op.w_shape
    assert params["w"].dtype == jnp.float32 and not host(params["b"]).any()
    first_column = host(params["w"])[np.nonzero(layout)[1] == 0]
    assert abs(first_column.std() - 1 / np.sqrt(8 * BS)) < 0.15 / np.sqrt(8 * BS)
    half = bjax.BlockSparseDense(64, 32, layout, block_size=BS, bias=False).init(jax.random.key(1), "bfloat16")
    assert set(half) == {"w"} and half["w"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"in_features must be layout.shape\[0\] \* block_size = 64; got 60"):
        bjax.BlockSparseDense(60, 32, layout, block_size=BS)
    with pytest.raises(ValueError, match=r"out_features must be layout.shape\[1\] \* block_size = 32; got 33"):
        bjax.BlockSparseDense(64, 33, layout, block_size=BS)
    with pytest.raises(ValueError, match=r"params\['b'\] must have shape \(32,\); got \(31,\)"):
        layer.apply({"w": params["w"], "b": params["b"][:-1]}, jnp.ones((2, 64)))


@AXES
def test_small_model_trains_like_a_masked_dense_model(device, axis):
    """Two block-sparse layers with a tanh between, 5 SGD steps, against the same model built
    from dense layers whose weights are masked by the layouts: same losses (rtol 1e-5)."""
    rng = np.random.default_rng(80 + axis)
    layers = [bjax.BlockSparseDense(48, 32, random_layout(rng, 6, 4, 0.5), block_size=BS, feature_axis=axis),
              bjax.BlockSparseDense(32, 16, random_layout(rng, 4, 2, 0.6), block_size=BS, feature_axis=axis)]
    params = [layer.init(key) for layer, key in zip(layers, jax.random.split(jax.random.key(axis), 2))]
    masks = [jnp.asarray(np.kron(layer.op.layout, np.ones((BS, BS), np.float32))) for layer in layers]
    dense_params = [{"w": dense_w(layer.op, p["w"]), "b": p["b"]} for layer, p in zip(layers, params)]
    x = put(random_data(rng, activation_shape(layers[0].op, 10, 48), "float32"), device)
    target = put(random_data(rng, activation_shape(layers[1].op, 10, 16), "float32"), device)

    def sparse_loss(params):
        h = jnp.tanh(layers[0].apply(params[0], x))
        return jnp.mean((layers[1].apply(params[1], h) - target) ** 2)

    def dense_loss(params):
        h = x
        for p, mask, activation in zip(params, masks, (jnp.tanh, lambda v: v)):
            weight = p["w"] * mask
            h = activation(h @ weight + p["b"] if axis == 1 else weight.T @ h + p["b"][:, None])
        return jnp.mean((h - target) ** 2)

    def train(loss, params):
        step = jax.jit(jax.value_and_grad(loss))
        losses = []
        for _ in range(5):
            value, grads = step(params)
            params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
            losses.append(float(value))
        return np.array(losses), params

    sparse_losses, sparse_params = train(sparse_loss, params)
    dense_losses, dense_final = train(dense_loss, dense_params)
    assert sparse_losses[-1] < 0.9 * sparse_losses[0], f"the model did not learn: {sparse_losses}"
    np.testing.assert_allclose(sparse_losses, dense_losses, rtol=1e-5)
    for layer, p, d in zip(layers, sparse_params, dense_final):
        assert_close(host(dense_w(layer.op, p["w"])), host(d["w"]), "float32", "trained weights")


# -- GPU: zero copy and stream order --------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_jitted_passes_allocate_only_their_outputs():
    """Device memory statistics: a jitted pass adds exactly its output to the memory in use,
    and the peak never exceeds what was in use plus the outputs (no copies of inputs);
    inputs are unchanged."""
    dev = gpu_or_skip()
    if dev.memory_stats() is None:
        pytest.skip("this JAX GPU client reports no memory statistics")
    rng = np.random.default_rng(90)
    op = bsmm.BlocksparseMatMul(random_layout(rng, 64, 64, 0.3), block_size=32)  # C = K = 2048
    # Larger than anything else the suite allocates, so the peak statistic sees any copy.
    x = random_data(rng, (8192, op.C), "float32")
    dy = random_data(rng, (8192, op.K), "float32")
    w = random_data(rng, op.w_shape, "float32")
    x_, w_, dy_ = put(x, dev), put(w, dev), put(dy, dev)
    forward = jax.jit(lambda x, w: bjax.blocksparse_matmul(x, w, op))
    backward = jax.jit(lambda x, w, dy: jax.vjp(lambda x, w: bjax.blocksparse_matmul(x, w, op), x, w)[1](dy))

    for run, args in ((forward, (x_, w_)), (backward, (x_, w_, dy_))):
        for warm in jax.tree.leaves(jax.block_until_ready(run(*args))):  # compile, build bsmm's plans
            warm.delete()  # freed now, not whenever Python collects it
        before = dev.memory_stats()
        outputs = jax.block_until_ready(run(*args))
        after = dev.memory_stats()
        out_bytes = sum(o.nbytes for o in jax.tree.leaves(outputs))
        grown = after["bytes_in_use"] - before["bytes_in_use"]
        # Slack for XLA's own bookkeeping around the callbacks (44 KB measured on the H100 for the
        # backward jit); a copy of the smallest input here would be 5 MB.
        assert out_bytes <= grown <= out_bytes + 65536, f"{grown} bytes allocated for {out_bytes} of outputs"
        # The backward jit may keep the (unused) forward output alive while it runs.
        slack = 0 if run is forward else 8192 * op.K * 4
        assert after["peak_bytes_in_use"] <= max(before["peak_bytes_in_use"],
                                                 before["bytes_in_use"] + out_bytes + slack + 4096)
        del outputs
    for before_, after_ in ((x, x_), (w, w_), (dy, dy_)):
        np.testing.assert_array_equal(host(after_), before_)


@pytest.mark.gpu
def test_gpu_pass_is_ordered_on_xla_stream():
    """Inside one jit, XLA writes x*2+1 just before the pass and reads the result right after:
    on another stream the kernels would read stale input or XLA would read an unfinished output."""
    dev = gpu_or_skip()
    rng = np.random.default_rng(91)
    op = bsmm.BlocksparseMatMul(random_layout(rng, 32, 32, 0.5), block_size=32)
    x = random_data(rng, (4096, op.C), "float32")
    w = random_data(rng, op.w_shape, "float32")
    f = jax.jit(lambda x, w: bjax.blocksparse_matmul(x * 2 + 1, w, op) - 3)
    for _ in range(3):
        y = f(put(x, dev), put(w, dev))
        assert_close(host(y) + 3, ref_fprop(op.layout, w, op.block_size, x * 2 + 1, 1), "float32")


_REPLAY_SCRIPT = r'''
import json
import jax, jax.numpy as jnp, numpy as np
import bsmm, bsmm.config, bsmm.jax
from bsmm.jax import passes as jax_passes
from bsmm.layouts import random_layout

seen = []
original = jax_passes.PassCallback.__call__

def counted(self, context, *buffers):
    import cupy
    seen.append((self.op is replayed, bool(cupy.cuda.runtime.streamIsCapturing(int(context.stream)))))
    return original(self, context, *buffers)

jax_passes.PassCallback.__call__ = counted
layout = random_layout(24, 40, 0.2, seed=3)
replayed = bsmm.BlocksparseMatMul(layout, block_size=32)  # (C 768, K 1280: rectangular)
eager = bsmm.BlocksparseMatMul(layout, block_size=32)  # the same layout, traced with replays off
rng = np.random.default_rng(5)
dense = jnp.asarray(rng.standard_normal((replayed.C, replayed.C)) / 30, jnp.bfloat16)
w = jnp.asarray(rng.standard_normal(replayed.w_shape), jnp.bfloat16)

def step_of(op):
    def loss(x, w):
        return (bsmm.jax.blocksparse_matmul(jnp.tanh(x @ dense), w, op).astype(jnp.float32) ** 2).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1)))

replayed_step = step_of(replayed)
with bsmm.config.overriding({"jax": {"command_buffers": False}}):
    eager_step = step_of(eager)
    jax.block_until_ready(eager_step(jnp.ones((48, replayed.C), jnp.bfloat16), w))
calls, equal = [], []
for i in range(10):
    x = jnp.asarray(rng.standard_normal((48, replayed.C)), jnp.bfloat16)
    before = sum(1 for mine, _ in seen if mine)
    got = jax.block_until_ready(replayed_step(x, w))
    calls.append(sum(1 for mine, _ in seen if mine) - before)
    expected = eager_step(x, w)
    equal.append(all(bool((np.asarray(a.astype(jnp.float32)) == np.asarray(b.astype(jnp.float32))).all())
                     for a, b in zip(got, expected)))
print(json.dumps({"calls": calls, "equal": equal,
                  "captured": sum(1 for mine, capturing in seen if mine and capturing),
                  "eager_captured": sum(1 for mine, capturing in seen if not mine and capturing)}))
'''


@pytest.mark.gpu
def test_gpu_passes_replay_from_xla_command_buffers():
    """With XLA's command buffers on for every op (min graph size 1), a jitted training step
    records bsmm's passes into a CUDA graph after their first, uncaptured call and replays them
    without calling Python; every step equals the same step traced with replays off, bitwise,
    and those passes are never captured."""
    gpu_or_skip()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1").strip(),
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    done = subprocess.run([sys.executable, "-c", _REPLAY_SCRIPT], check=False, capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(result["equal"]), result
    assert result["captured"] > 0, result  # the passes were recorded into a graph
    assert result["eager_captured"] == 0, result
    # A later step replayed without calling Python. (Not every later step: XLA records a graph per
    # set of buffer addresses, and fresh inputs each step may bring new ones; seen: [3, 3, 3, 3, 3, 0, ...].)
    assert 0 in result["calls"][1:], result
    assert result["calls"][0] >= 2, result  # the first step ran bprop and updat uncaptured


@pytest.mark.gpu
def test_gpu_repeated_pass_launches_on_raw_pointers(monkeypatch):
    """A pass XLA calls again with a shape it ran before takes the kept call on the buffers' raw
    pointers (no CuPy arrays): the first call of each pass runs the operator's checked pass,
    no later one does."""
    dev = gpu_or_skip()
    taken = []
    for pass_name in ("bprop", "updat"):
        method = getattr(bsmm.BlocksparseMatMul, pass_name)
        monkeypatch.setattr(bsmm.BlocksparseMatMul, pass_name, lambda self, *args, _method=method, _name=pass_name,
                            **kwargs: taken.append(_name) or _method(self, *args, **kwargs))
    rng = np.random.default_rng(92)
    op = bsmm.BlocksparseMatMul(random_layout(rng, 8, 12, 0.4), block_size=32)
    x, w, dy = (put(random_data(rng, shape, "float16"), dev) for shape in ((64, op.C), op.w_shape, (64, op.K)))
    step = jax.jit(lambda x, w: jax.vjp(lambda x, w: bjax.blocksparse_matmul(x, w, op), x, w)[1](dy))
    with bsmm.config.overriding({"jax": {"command_buffers": False}}):  # (a replay would call no Python)
        results = [jax.block_until_ready(step(x, w)) for _ in range(3)]
    for result in results[1:]:
        for got, first in zip(result, results[0]):
            np.testing.assert_array_equal(host(got), host(first))
    assert sorted(taken) == ["bprop", "updat"], taken  # the first step's, checked; the later two on raw pointers


@pytest.mark.parametrize("gpus", [1, 0])
def test_jax_on_the_cpu_beside_a_gpu_warns_once(monkeypatch, gpus):
    # A JAX without its CUDA plugin next to a GPU: the passes silently ran on the CPU backend.
    import types

    import bsmm.config
    from bsmm.jax import passes

    if jax.default_backend() != "cpu":
        pytest.skip("JAX runs on a GPU here")
    runtime = types.SimpleNamespace(getDeviceCount=lambda: gpus)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(bsmm.config, "_TOLD", set())
    layout = random_layout(np.random.default_rng(gpus), 3, 2, 0.7)
    op = bsmm.BlocksparseMatMul(layout, block_size=8)
    x, w = (jnp.asarray(np.random.default_rng(5).standard_normal(s), jnp.float32) for s in ((4, 24), op.w_shape))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = bsmm.jax.blocksparse_matmul(x, w, op)  # traced here: the warning comes from this call
        for _ in range(2):
            passes._warn_if_a_gpu_sits_idle()
    told = [w for w in caught if issubclass(w.category, bsmm.BsmmWarning)]
    assert len(told) == gpus, [str(w.message) for w in told]
    if gpus:
        assert "bsmm[jax-cuda12]" in str(told[0].message) and "1 GPU(s)" in str(told[0].message)
        assert told[0].filename == __file__, told[0].filename  # the user's call, not JAX's tracing
    assert_close(np.asarray(y), ref_fprop(layout, np.asarray(w), 8, np.asarray(x), 1), "float32")

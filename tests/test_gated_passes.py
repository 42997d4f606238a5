"""Per-block gates on the array API: ``BlocksparseMatMul``'s fprop, bprop and updat with ``gate=`` and
``gate_grad`` against float64 written out here (y = x·(g ⊙ W), dx = dy·(g ⊙ W)ᵀ, dW = g ⊙ (xᵀ·dy),
dg_j = ⟨W_j, (xᵀ·dy)_j⟩), on NumPy and (marker gpu) CuPy; the refusals; and the same semantics through
bsmm.torch.blocksparse_matmul and bsmm.jax.blocksparse_matmul, gradients by their autodiff."""

from __future__ import annotations

import numpy as np
import pytest

import bsmm
from bsmm.layouts import random_layout
from conftest import poisoned, to_numpy, to_xp

BS = 16
LAYOUT = random_layout(4, 5, 0.45, seed=3)  # C 64, K 80


def dense_blocks(values: np.ndarray, op) -> np.ndarray:
    """(C, K) of per-slot blocks (nnzb, bs, bs), zeros elsewhere."""
    grid = np.zeros((*op.layout.shape, BS, BS))
    grid[op.index.rows, op.index.indices] = values
    return grid.transpose(0, 2, 1, 3).reshape(op.C, op.K)


def slots_of(dense: np.ndarray, op) -> np.ndarray:
    return dense.reshape(op.layout.shape[0], BS, op.layout.shape[1], BS).transpose(0, 2, 1, 3)[
        op.index.rows, op.index.indices]


def case(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    op = bsmm.BlocksparseMatMul(LAYOUT, BS)
    w = rng.standard_normal(op.w_shape).astype(dtype)
    gate = rng.uniform(0.1, 1.5, op.blocks).astype(dtype)
    gate[0] = 0  # a closed block
    x, dy = rng.standard_normal((7, op.C)).astype(dtype), rng.standard_normal((7, op.K)).astype(dtype)
    return op, x, dy, w, gate


def reference(op, x, dy, w, gate):
    x, dy, w, gate = (np.asarray(a, np.float64) for a in (x, dy, w, gate))
    gated = dense_blocks(w * gate[:, None, None], op)
    raw = slots_of(x.T @ dy, op)
    return {"y": x @ gated, "dx": dy @ gated.T, "dw": raw * gate[:, None, None], "dg": (w * raw).sum(axis=(1, 2))}


def test_gated_passes_against_float64(xp):
    op, x, dy, w, gate = case()
    expected = reference(op, x, dy, w, gate)
    xs, dys, ws, gates = (to_xp(xp, a) for a in (x, dy, w, gate))
    out = poisoned(xp, (7, op.K), np.float32)
    got = {"y": op.fprop(xs, ws, out=out, gate=gates), "dx": op.bprop(dys, ws, gate=gates),
           "dw": op.updat(xs, dys, gate=gates), "dg": op.gate_grad(xs, dys, ws)}
    assert got["y"] is out
    for name, value in got.items():
        value = to_numpy(value).astype(np.float64)
        assert value.shape == expected[name].shape, name
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-5 * np.abs(expected[name]).max(),
                                   err_msg=name)
    assert not to_numpy(got["dw"])[0].any()  # the closed gate's block gets no gradient
    # updat's out= and accumulate= take the gated gradient too
    buffer = xp.ones(op.w_shape, dtype=np.float32)
    assert op.updat(xs, dys, out=buffer, accumulate=True, gate=gates) is buffer
    np.testing.assert_allclose(to_numpy(buffer), expected["dw"] + 1, rtol=1e-5, atol=1e-4)
    assert np.array_equal(to_numpy(ws), w) and np.array_equal(to_numpy(gates), gate)  # inputs untouched


def test_gate_refusals():
    op, x, dy, w, gate = case()
    for bad, error, match in [
        (gate[:-1], ValueError, rf"gate must have shape \({op.blocks},\), one value a block; got \({op.blocks - 1},\)"),
        (gate.astype(np.float64), TypeError, "gate has dtype float64 but (w|x) has float32; pass one dtype"),
    ]:
        for call in (lambda: op.fprop(x, w, gate=bad), lambda: op.bprop(dy, w, gate=bad),
                     lambda: op.updat(x, dy, gate=bad)):
            with pytest.raises(error, match=match):
                call()
    with pytest.raises(ValueError, match="accumulate=True needs out="):
        op.updat(x, dy, accumulate=True, gate=gate)


def test_gate_grad_of_float64_sums_in_float64():
    op, x, dy, w, gate = case(np.float64, seed=4)
    np.testing.assert_allclose(op.gate_grad(x, dy, w), reference(op, x, dy, w, gate)["dg"], rtol=1e-12)


def test_torch_functional_gate():
    torch = pytest.importorskip("torch")
    import bsmm.torch  # noqa: F401

    op, x, dy, w, gate = case(np.float64, seed=1)
    expected = reference(op, x, dy, w, gate)
    tx, tw, tg = (torch.tensor(a, requires_grad=True) for a in (x, w, gate))
    y = bsmm.torch.blocksparse_matmul(tx, tw, op, gate=tg)
    y.backward(torch.tensor(dy))
    for name, value in (("y", y), ("dx", tx.grad), ("dw", tw.grad), ("dg", tg.grad)):
        np.testing.assert_allclose(value.detach().numpy(), expected[name], rtol=1e-10, atol=1e-10, err_msg=name)
    with pytest.raises(ValueError, match=rf"gate must be a tensor of shape \({op.blocks},\)"):
        bsmm.torch.blocksparse_matmul(tx, tw, op, gate=tg[:2])


def test_jax_functional_gate():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import bsmm.jax

    op, x, dy, w, gate = case(np.float32, seed=2)
    expected = reference(op, x, dy, w, gate)

    def loss(x, w, g):
        return jnp.sum(bsmm.jax.blocksparse_matmul(x, w, op, gate=g) * dy)

    y = bsmm.jax.blocksparse_matmul(jnp.asarray(x), jnp.asarray(w), op, gate=jnp.asarray(gate))
    dx, dw, dg = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(x), jnp.asarray(w), jnp.asarray(gate))
    for name, value in (("y", y), ("dx", dx), ("dw", dw), ("dg", dg)):
        np.testing.assert_allclose(np.asarray(value, np.float64), expected[name], rtol=2e-5,
                                   atol=2e-5 * np.abs(expected[name]).max(), err_msg=name)
    with pytest.raises(ValueError, match=rf"gate must have shape \({op.blocks},\)"):
        bsmm.jax.blocksparse_matmul(jnp.asarray(x), jnp.asarray(w), op, gate=jnp.ones(3))

"""bsmm.torch.gates: a gated layer's y, dx, dW and gate gradient against float64 written out here (the
seed's semantics: y = x·(g ⊙ W) + b); the hard-concrete gates' distribution, penalty and target density;
prune_by_gates keeping what the gated layer computes. CUDA cases carry the ``gpu`` marker."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bsmm.torch tests skipped")

import bsmm.torch as bt  # noqa: E402
from bsmm.torch import dynamic  # noqa: E402
import torch_cases  # noqa: E402

device = torch_cases.device  # the fixture (tests take it by name)


class FixedGates(torch.nn.Module):
    """Stands in for BlockGates: returns one given tensor, so its gradient can be read."""

    def __init__(self, gate):
        super().__init__()
        self.gate = gate

    def forward(self):
        return self.gate


def per_block(values: np.ndarray, layout: np.ndarray, bs: int) -> np.ndarray:
    """(C, K): each present block (row-major slot order) filled with its value, zero elsewhere."""
    grid = np.zeros(layout.shape)
    grid[np.nonzero(layout)] = values
    return np.kron(grid, np.ones((bs, bs)))


@pytest.mark.parametrize("feature_axis", [1, 0])
def test_gated_layer_against_float64(device, feature_axis):
    dtype = torch.float64 if device == "cpu" else torch.float32
    tolerance = 1e-12 if dtype == torch.float64 else 2e-5
    bs, rng = 16, np.random.default_rng(0)
    layer = bt.BlockSparseLinear(64, 80, density=0.45, block_size=bs, seed=5, feature_axis=feature_axis,
                                 device=device, dtype=dtype)
    nnzb = layer.op.blocks
    values = rng.uniform(0.2, 1.0, nnzb)
    values[:2] = [0.0, 1.0]  # a closed gate and an open one
    gate = torch.tensor(values, device=device, dtype=torch.float32, requires_grad=True)
    layer.gates = FixedGates(gate)
    x_np, dy_np = rng.standard_normal((9, 64)), rng.standard_normal((9, 80))
    x = torch.tensor(x_np if feature_axis else x_np.T, device=device, dtype=dtype, requires_grad=True)
    y = layer(x)
    y.backward(torch.tensor(dy_np if feature_axis else dy_np.T, device=device, dtype=dtype))

    w = layer.to_dense_weight().detach().cpu().double().numpy()  # ungated
    g = per_block(values.astype(np.float32).astype(np.float64), layer.op.layout, bs)
    product = x_np.T @ dy_np
    expected = {"y": x_np @ (w * g) + layer.bias.detach().cpu().double().numpy(), "dx": dy_np @ (w * g).T}
    actual = {"y": y.detach(), "dx": x.grad}
    for name in ("y", "dx"):
        got = actual[name].cpu().double().numpy()
        got = got if feature_axis else got.T
        np.testing.assert_allclose(got, expected[name], rtol=0, atol=tolerance * np.abs(expected[name]).max())
    # dW = g ⊙ (xᵀ·dy) on the present blocks, in slot order; dg_j = ⟨W_j, (xᵀ·dy)_j⟩
    blocks = product.reshape(4, bs, 5, bs).transpose(0, 2, 1, 3)[layer.op.index.rows, layer.op.index.indices]
    weights = w.reshape(4, bs, 5, bs).transpose(0, 2, 1, 3)[layer.op.index.rows, layer.op.index.indices]
    expected_dw = blocks * values.astype(np.float32)[:, None, None]
    np.testing.assert_allclose(layer.weight.grad.cpu().double().numpy(), expected_dw, rtol=0,
                               atol=tolerance * np.abs(expected_dw).max())
    assert not layer.weight.grad[0].any()  # the closed gate passes no gradient to its block
    expected_dg = (weights * blocks).sum(axis=(1, 2))
    np.testing.assert_allclose(gate.grad.double().cpu().numpy(), expected_dg, rtol=1e-5,
                               atol=1e-6 * np.abs(expected_dg).max())


class ClampedGates(FixedGates):
    """Gates clamped to [0, 1] from a raw tensor, as hard-concrete gates are: 0 where the raw value is
    below 0, with derivative 0 there, so the weight gradient's pass may skip those blocks too."""

    closed_gradient_is_zero = True

    def forward(self):
        return self.gate.clamp(0, 1)


@pytest.mark.parametrize("activation, with_bias", [(None, True), ("relu", False), ("gelu", True)])
def test_clamped_gates_skip_closed_blocks_with_exact_gradients(device, activation, with_bias):
    """A layer whose closed gates take no gradient (dW's pass may skip them on CUDA): y, dx, dW and the
    raw gates' gradient all as float64 says, through the fused epilogues too and under torch.compile."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    tolerance = 1e-12 if dtype == torch.float64 else 3e-5
    bs, rng = 16, np.random.default_rng(3)
    layer = bt.BlockSparseLinear(96, 64, density=0.6, block_size=bs, seed=8, bias=with_bias, activation=activation,
                                 device=device, dtype=dtype)
    nnzb, grid = layer.op.blocks, layer.op.index
    raw_values = np.where(rng.random(nnzb) < 0.5, -rng.uniform(0.1, 1.0, nnzb), rng.uniform(0.2, 0.9, nnzb))
    raw_values = raw_values.astype(np.float32).astype(np.float64)  # (what the float32 gates hold)
    raw = torch.tensor(raw_values, device=device, dtype=torch.float32, requires_grad=True)
    layer.gates = ClampedGates(raw)

    # float64 reference: z = x·(g ⊙ W) + b, y = A(z); dz from PyTorch; dx = dz·(g ⊙ W)ᵀ, the block
    # products P_j = (xᵀ·dz)_j, dW_j = g_j P_j, and the raw gates' dg_j = ⟨W_j, P_j⟩ where open, else 0.
    g = np.clip(raw_values, 0, 1)
    w = layer.to_dense_weight().detach().cpu().double().numpy()
    x_np, dy_np = rng.standard_normal((21, 96)), rng.standard_normal((21, 64))
    z = torch.tensor(x_np @ (w * per_block(g, layer.op.layout, bs)), requires_grad=True)
    if with_bias:
        z_b = z + layer.bias.detach().cpu().double()
    else:
        z_b = z
    act = {None: lambda t: t, "relu": torch.relu, "gelu": torch.nn.functional.gelu}[activation]
    y_ref = act(z_b)
    y_ref.backward(torch.tensor(dy_np))
    dz = z.grad.numpy()
    dx_ref = dz @ (w * per_block(g, layer.op.layout, bs)).T
    blocks_of = lambda dense: dense.reshape(6, bs, 4, bs).transpose(0, 2, 1, 3)[grid.rows, grid.indices]
    products, weights = blocks_of(x_np.T @ dz), blocks_of(w)
    dw_ref = products * g[:, None, None]
    dg_ref = np.where(raw_values > 0, (weights * products).sum(axis=(1, 2)), 0.0)

    def close(got, expected, relative=tolerance):
        expected = np.asarray(expected)
        return np.allclose(got.detach().cpu().double().numpy(), expected, rtol=0,
                           atol=relative * max(np.abs(expected).max(), 1e-30))

    for run in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        for tensor in (layer.weight, raw):
            tensor.grad = None
        x = torch.tensor(x_np, device=device, dtype=dtype, requires_grad=True)
        y = run(x)
        y.backward(torch.tensor(dy_np, device=device, dtype=dtype))
        assert close(y, y_ref.detach().numpy()) and close(x.grad, dx_ref) and close(layer.weight.grad, dw_ref)
        assert close(raw.grad, dg_ref, 2e-6)  # (summed in the gates' float32)
        assert not layer.weight.grad[raw.detach() < 0].any()  # closed blocks: no gradient


def test_gated_weight_is_one_node_with_first_and_second_derivatives():
    """gated_weight (one autograd node: the cast, the view and the product) against torch.autograd's checks."""
    from bsmm.torch.functional import gated_weight, gated_weight_and_gate

    generator = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, 4, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    gate = torch.randn(5, dtype=torch.float64, generator=generator, requires_grad=True)
    assert torch.autograd.gradcheck(gated_weight, (w, gate))
    assert torch.autograd.gradgradcheck(gated_weight, (w, gate))
    scaled, cast = gated_weight_and_gate(w.float(), gate)
    assert cast.dtype == torch.float32 and not cast.requires_grad
    assert scaled.grad_fn.name().endswith("_GatedWeightBackward")
    # gates of the weights' dtype that take no gradient (a fixed mask): nothing to cast
    w32 = w.detach().float().requires_grad_(True)
    mask = (torch.arange(5) % 2).float()
    scaled, cast = gated_weight_and_gate(w32, mask)
    scaled.sum().backward()
    assert torch.equal(cast, mask) and torch.equal(w32.grad, mask.view(-1, 1, 1, 1).expand_as(w32))


def test_hard_concrete_gates():
    torch.manual_seed(0)
    gates = bt.BlockGates(5, density=0.6)
    with torch.no_grad():
        gates.log_alpha.copy_(torch.tensor([-3.0, -0.5, 0.0, 1.0, 4.0]))
    draws = torch.stack([gates() for _ in range(20000)])
    assert draws.min() == 0 and draws.max() == 1 and ((draws > 0) & (draws < 1)).any()
    np.testing.assert_allclose((draws > 0).float().mean(0).numpy(), gates.nonzero_probability().detach().numpy(),
                               atol=0.012)
    gates.eval()
    s = torch.sigmoid(gates.log_alpha.detach())
    assert torch.equal(gates().detach(), (s * 1.2 - 0.1).clamp(0, 1))
    assert gates.kept().tolist() == [False, True, True, True, True]  # sigmoid(-3)·1.2 - 0.1 < 0
    penalty = gates.penalty()
    penalty.backward()
    assert gates.log_alpha.grad is not None and (gates.log_alpha.grad > 0).all()
    assert abs(penalty.item() - gates.nonzero_probability().sum().item()) < 1e-6
    assert bt.BlockGates(1000, density=0.3).expected_density().item() == pytest.approx(0.3, abs=1e-6)


def test_penalty_reaches_a_target_density():
    gates = bt.BlockGates(64, density=0.9)
    optimizer = torch.optim.Adam(gates.parameters(), lr=0.05)
    for _ in range(400):
        optimizer.zero_grad()
        gates.penalty(target=0.3).backward()
        optimizer.step()
    assert gates.expected_density().item() == pytest.approx(0.3, abs=0.01)


def test_gated_layer_trains_its_gates_and_prunes(device):
    dtype = torch.float64 if device == "cpu" else torch.float32
    torch.manual_seed(1)
    layer = bt.BlockSparseLinear(64, 64, density=0.75, block_size=16, seed=2, device=device, dtype=dtype)
    gates = bt.gate_layer(layer, density=0.95)
    assert gates.log_alpha.device == layer.weight.device and layer.gates is gates
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.05)
    x = torch.randn(32, 64, device=device, dtype=dtype)
    target = torch.randn(32, 64, device=device, dtype=dtype)
    for _ in range(60):  # the task and an L0 push toward half the blocks
        optimizer.zero_grad()
        ((layer(x) - target).square().mean() + 0.5 * gates.penalty(target=0.5)).backward()
        optimizer.step()
    assert gates.log_alpha.grad is not None and gates.log_alpha.grad.abs().sum() > 0
    with torch.no_grad():
        gates.log_alpha[[1, 4, 7]] = -10.0  # three gates closed for good
    layer.eval()
    kept = gates.kept()
    assert int(kept.sum()) == layer.op.blocks - 3
    pruned = bt.prune_by_gates(layer)
    assert pruned.gates is None and pruned.op.blocks == int(kept.sum()) and not gates.training
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    with torch.no_grad():
        assert torch.allclose(pruned(x), layer(x), rtol=tolerance, atol=tolerance)
    exact = bt.prune_by_gates(layer, blocks=4)  # the four largest gates, whatever their state
    largest = torch.argsort(-gates.log_alpha.detach().cpu(), stable=True)[:4].sort().values.numpy()
    assert exact.op.blocks == 4 and np.array_equal(
        np.argwhere(exact.op.layout), np.stack([layer.op.index.rows[largest], layer.op.index.indices[largest]], 1))
    with pytest.raises(ValueError, match=r"blocks must be an int in \[0, 12\] \(the layer's blocks\); got 13"):
        bt.prune_by_gates(layer, blocks=13)
    state = layer.state_dict()
    assert "gates.log_alpha" in state
    again = bt.BlockSparseLinear(64, 64, density=0.75, block_size=16, seed=2, device=device, dtype=dtype)
    bt.gate_layer(again)
    again.load_state_dict(state)
    again.eval()
    with torch.no_grad():
        assert torch.equal(again(x), layer(x))


def test_gate_refusals():
    layer = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0)
    with pytest.raises(ValueError, match="layer has no gates: give it some with bsmm.torch.gate_layer"):
        bt.prune_by_gates(layer)
    bt.gate_layer(layer)
    with pytest.raises(ValueError, match=r"layer already has gates \(layer.gates\)"):
        bt.gate_layer(layer)
    with pytest.raises(ValueError, match="layer has gates"):
        dynamic.change_layout(layer, layer.op.layout)
    with pytest.raises(TypeError, match="layer must be a bsmm.torch.BlockSparseLinear; got Linear"):
        bt.gate_layer(torch.nn.Linear(4, 4))
    for kwargs, match in [({"blocks": 0}, "blocks must be a positive int; got 0"),
                          ({"blocks": 3, "density": 0.0}, r"density must be a number in \(0, 1\]; got 0.0"),
                          ({"blocks": 3, "gamma": 0.1}, "beta must be > 0, gamma < 0 and zeta > 1")]:
        with pytest.raises(ValueError, match=match):
            bt.BlockGates(**kwargs)
    with pytest.raises(ValueError, match=r"target must be in \[0, 1\]; got 2"):
        bt.BlockGates(3).penalty(target=2)


def test_gates_follow_the_layer_mode_and_deferred_initialisation():
    layer = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0).eval()
    gates = bt.gate_layer(layer, density=0.7)
    x = torch.randn(3, 64)
    assert not gates.training and torch.equal(layer(x), layer(x))  # evaluation: deterministic
    with torch.device("meta"):
        deferred = bt.BlockGates(6, density=0.3)
    deferred.to_empty(device="cpu")
    deferred.reset_parameters()
    assert deferred.expected_density().item() == pytest.approx(0.3, abs=1e-6)
    as_bf16 = bt.BlockGates(6, density=0.3).bfloat16()
    assert as_bf16().dtype == torch.float32 and torch.isfinite(as_bf16()).all()

"""bsmm.torch.pruning: gradual magnitude pruning. The cubic schedule; each pruning closes the open blocks of
smallest norm (checked against NumPy's ordering), zeroes their weights and Adam moments; the masked layer
against float64 written out here (y, dx, dW, no gradient on a pruned block); compaction keeps what the
masked layer computes; no recompilation under torch.compile as blocks close. CUDA cases carry ``gpu``."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bsmm.torch tests skipped")

import bsmm.torch as bt  # noqa: E402
import torch_cases  # noqa: E402

device = torch_cases.device  # the fixture (tests take it by name)


def test_the_schedule_is_cubic_from_start_to_end():
    layer = bt.BlockSparseLinear(64, 64, density=1.0, block_size=16, seed=0)
    pruning = bt.GradualPruning([layer], torch.optim.SGD(layer.parameters(), lr=0.1), density=0.2, start=10,
                                end=50, every=10)
    assert [pruning.density_at(t) for t in (0, 10)] == [1.0, 1.0]
    assert pruning.density_at(30) == pytest.approx(0.2 + 0.8 * 0.5 ** 3)
    assert pruning.density_at(50) == pytest.approx(0.2) and pruning.density_at(99) == pytest.approx(0.2)


def test_pruning_closes_the_smallest_blocks_and_zeroes_their_state(device):
    dtype = torch.float64 if device == "cpu" else torch.float32
    torch.manual_seed(0)
    layer = bt.BlockSparseLinear(128, 96, density=0.8, block_size=16, seed=3, device=device, dtype=dtype)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    pruning = bt.GradualPruning([layer], optimizer, density=0.25, end=6, every=2)
    nnzb, rng = layer.op.blocks, np.random.default_rng(1)
    x = torch.tensor(rng.standard_normal((17, 128)), device=device, dtype=dtype)
    history = []
    for step in range(1, 9):
        open_before = layer.gates.kept().cpu().numpy()
        layer(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        kept = layer.gates.kept().cpu().numpy()
        history.append(int(kept.sum()))
        if step in (2, 4, 6):
            target = round(pruning.density_at(step) * nnzb)
            assert kept.sum() == target
            closing = open_before & ~kept
            assert closing.sum() == open_before.sum() - target
            weights = layer.weight.detach().double().cpu().numpy()
            assert not weights[closing].any() and not weights[~kept].any()
            state = optimizer.state[layer.weight]
            assert not state["exp_avg"][torch.as_tensor(~kept, device=device)].any()
            assert not state["exp_avg_sq"][torch.as_tensor(~kept, device=device)].any()
    assert history[-1] == round(0.25 * nnzb) and history == sorted(history, reverse=True)


def test_the_smallest_norms_go_first():
    layer = bt.BlockSparseLinear(64, 64, density=1.0, block_size=16, seed=0, bias=False, dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(1, 17, dtype=torch.float64).flip(0).view(16, 1, 1).expand(16, 16, 16))
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)
    pruning = bt.GradualPruning([layer], optimizer, density=0.25, end=1, every=1)
    layer(torch.randn(3, 64, dtype=torch.float64)).sum().backward()
    optimizer.step()
    assert pruning.steps == 1
    np.testing.assert_array_equal(layer.gates.kept().numpy(), np.arange(16) < 4)  # the four largest: slots 0-3


def test_a_masked_layer_against_float64_and_compaction(device):
    dtype = torch.float64 if device == "cpu" else torch.float32
    tolerance = 1e-12 if dtype == torch.float64 else 3e-5
    bs, rng = 16, np.random.default_rng(5)
    model = torch.nn.Sequential(bt.BlockSparseLinear(96, 64, density=0.7, block_size=bs, seed=2, device=device,
                                                     dtype=dtype, activation="relu"))
    layer = model[0]
    pruning = bt.GradualPruning(model, torch.optim.SGD(model.parameters(), lr=0.0), density=0.5, end=10)
    kept = rng.random(layer.op.blocks) < 0.5
    with torch.no_grad():
        layer.gates.mask.copy_(torch.as_tensor(kept, dtype=torch.float32))
    x_np, dy_np = rng.standard_normal((13, 96)), rng.standard_normal((13, 64))
    grid = np.zeros(layer.op.layout.shape)
    grid[np.nonzero(layer.op.layout)] = kept
    w = layer.to_dense_weight().detach().cpu().double().numpy() * np.kron(grid, np.ones((bs, bs)))
    z = x_np @ w + layer.bias.detach().cpu().double().numpy()
    dz = dy_np * (z > 0)
    x = torch.tensor(x_np, device=device, dtype=dtype, requires_grad=True)
    y = layer(x)
    y.backward(torch.tensor(dy_np, device=device, dtype=dtype))
    for got, expected in ((y, np.maximum(z, 0)), (x.grad, dz @ w.T)):
        np.testing.assert_allclose(got.detach().cpu().double().numpy(), expected, rtol=0,
                                   atol=tolerance * np.abs(expected).max())
    products = (x_np.T @ dz).reshape(6, bs, 4, bs).transpose(0, 2, 1, 3)[layer.op.index.rows, layer.op.index.indices]
    expected_dw = products * kept[:, None, None]
    np.testing.assert_allclose(layer.weight.grad.cpu().double().numpy(), expected_dw, rtol=0,
                               atol=tolerance * np.abs(expected_dw).max())
    small = pruning.compact(model)["0"]
    assert model[0] is small and small.gates is None and small.op.blocks == int(kept.sum())
    with torch.no_grad():
        np.testing.assert_allclose(small(x).cpu().double().numpy(), np.maximum(z, 0), rtol=0,
                                   atol=tolerance * np.abs(z).max())


def test_blocks_close_with_no_recompilation():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = torch.nn.Sequential(bt.BlockSparseLinear(64, 64, density=1.0, block_size=16, seed=0), torch.nn.ReLU(),
                                bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    pruning = bt.GradualPruning(model, optimizer, density=0.25, end=4, every=1)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    counts = []
    for _ in range(5):
        compiled(torch.randn(4, 64)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        counts.append(int(model[0].gates.kept().sum()))
    assert counts == sorted(counts, reverse=True) and counts[-1] == 4 and pruning.steps == 5
    assert counter.frame_count == 1, counter.frame_count


def test_pruning_refusals():
    layer = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for kwargs, match in [({"density": 1.0, "end": 5}, r"density must be a number in \(0, 1\); got 1.0"),
                          ({"density": 0.5, "end": 0}, r"end must be an int > start \(0\); got 0"),
                          ({"density": 0.5, "end": 5, "every": 0}, "every must be an int >= 1; got 0"),
                          ({"density": 0.5, "end": 5, "ord": "l1"}, "ord must be")]:
        with pytest.raises(ValueError, match=match):
            bt.GradualPruning([layer], optimizer, **kwargs)
    with pytest.raises(ValueError, match="optimizer does not hold the weight of layer '0'"):
        bt.GradualPruning([layer], torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), density=0.5, end=5)
    bt.gate_layer(layer)
    with pytest.raises(ValueError, match="layer '0' has gates"):
        bt.GradualPruning([layer], optimizer, density=0.5, end=5)
    with pytest.raises(ValueError, match="criterion='magnitude' prunes without regrowing.*GradualPruning"):
        bt.DynamicSparsity([layer], optimizer, criterion="magnitude")
    with pytest.raises(TypeError, match="must be a bsmm.torch.BlockSparseLinear; got Linear"):
        bt.GradualPruning([torch.nn.Linear(4, 4)], optimizer, density=0.5, end=5)

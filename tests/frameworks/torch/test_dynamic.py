"""bsmm.torch.dynamic: block norms and the dense gradient's block norms against float64 written out here;
change_layout moving values, gradients and optimizer state with their blocks; DynamicSparsity (RigL, SET)
against a reference that takes the same steps on dense masked weights. CUDA cases carry the ``gpu`` marker."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bsmm.torch tests skipped")

import bsmm  # noqa: E402
import bsmm.torch as bt  # noqa: E402
from bsmm.layouts import random_layout  # noqa: E402
from bsmm.torch import dynamic  # noqa: E402
import torch_cases  # noqa: E402

device = torch_cases.device  # the fixture (tests take it by name)


def dtype_on(device):
    """float64 where bsmm runs it (the CPU); float32 on CUDA."""
    return torch.float64 if device == "cpu" else torch.float32


def tolerance_of(dtype):
    return 1e-10 if dtype == torch.float64 else 2e-5


def block_grid(dense: np.ndarray, bs: int) -> np.ndarray:
    """(CB, KB, bs, bs) blocks of a (C, K) array."""
    c, k = dense.shape
    return dense.reshape(c // bs, bs, k // bs, bs).transpose(0, 2, 1, 3)


def reference_norms(dense: np.ndarray, bs: int, ord: str) -> np.ndarray:
    blocks = block_grid(dense, bs)
    return np.sqrt((blocks ** 2).sum(axis=(2, 3))) if ord == "l2" else np.abs(blocks).max(axis=(2, 3))


@pytest.mark.parametrize("ord", ["l2", "max"])
@pytest.mark.parametrize("feature_axis", [1, 0])
def test_gradient_block_norms_against_float64(device, ord, feature_axis, monkeypatch):
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((2, 19, 96)), rng.standard_normal((2, 19, 160))  # 38 rows, C 96, K 160
    expected = reference_norms(x.reshape(-1, 96).T @ dy.reshape(-1, 160), 32, ord)
    tx, tdy = (torch.tensor(a, device=device) for a in (x, dy))
    if feature_axis == 0:
        tx, tdy = tx.movedim(-1, 0), tdy.movedim(-1, 0)
    whole = dynamic.gradient_block_norms(tx, tdy, 32, ord, feature_axis)
    assert whole.shape == (3, 5) and whole.dtype == torch.float32
    np.testing.assert_allclose(whole.cpu().numpy(), expected, rtol=2e-6)
    monkeypatch.setattr(dynamic, "GRADIENT_CHUNK_BYTES", 1)  # one block row at a time
    # (the same values; on CUDA, a reduction's order follows its tensor's size, so not always the same bits)
    torch.testing.assert_close(dynamic.gradient_block_norms(tx, tdy, 32, ord, feature_axis), whole, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rows", [1, 38, 300])
def test_gram_route_against_float64(device, rows):
    """The Gram route (no dW block formed) against the float64 product; "auto" picks it at one row."""
    rng = np.random.default_rng(rows)
    x, dy = rng.standard_normal((rows, 96)), rng.standard_normal((rows, 160))
    expected = reference_norms(x.T @ dy, 32, "l2")
    tx, tdy = (torch.tensor(a, device=device) for a in (x, dy))
    gram = dynamic.gradient_block_norms(tx, tdy, 32, route="gram")
    assert gram.shape == (3, 5) and gram.dtype == torch.float32
    np.testing.assert_allclose(gram.cpu().numpy(), expected, rtol=1e-6)  # (float64 inside, float32 out)
    assert dynamic._gram_is_cheaper(rows, 96, 160, 32, "l2", None) == (rows == 1)
    assert dynamic._gram_is_cheaper(8, 4096, 4096, 128, "l2", None)
    assert not dynamic._gram_is_cheaper(8, 4096, 4096, 128, "max", None)
    # Rows alike (x a shared row plus a little noise, dy in ± pairs): the Gram sum cancels deeply, which float32
    # sums (relative error 0.59 on a reviewer's case) could not carry.
    base = rng.standard_normal(96)
    x = base + 1e-3 * rng.standard_normal((64, 96))
    half = rng.standard_normal((32, 160))
    dy = np.concatenate([half, -half]) + 1e-3 * rng.standard_normal((64, 160))
    gram = dynamic.gradient_block_norms(torch.tensor(x, device=device), torch.tensor(dy, device=device), 32,
                                        route="gram")
    np.testing.assert_allclose(gram.cpu().numpy(), reference_norms(x.T @ dy, 32, "l2"), rtol=1e-5)


def test_gradient_block_norms_refusals():
    x, dy = torch.ones(4, 64), torch.ones(4, 32)
    with pytest.raises(ValueError, match="same rows; got 4 and 3"):
        dynamic.gradient_block_norms(x, dy[:3], 32)
    with pytest.raises(ValueError, match=r"x's features \(64\) must be a multiple of block_size 48"):
        dynamic.gradient_block_norms(x, torch.ones(4, 48), 48)
    with pytest.raises(ValueError, match="ord must be one of 'l2', 'max'; got 'l1'"):
        dynamic.gradient_block_norms(x, dy, 32, "l1")
    with pytest.raises(ValueError, match="feature_axis must be 0 or 1; got 2"):
        dynamic.gradient_block_norms(x, dy, 32, feature_axis=2)
    with pytest.raises(ValueError, match="route must be one of 'auto', 'dense', 'gram'; got 'sparse'"):
        dynamic.gradient_block_norms(x, dy, 32, route="sparse")
    with pytest.raises(ValueError, match="route='gram' takes L2 norms"):
        dynamic.gradient_block_norms(x, dy, 32, "max", route="gram")


@pytest.mark.parametrize("ord", ["l2", "max"])
def test_block_norms_of_a_layer(device, ord):
    layer = bt.BlockSparseLinear(96, 128, density=0.4, block_size=32, seed=2, device=device, dtype=dtype_on(device))
    norms = dynamic.block_norms(layer, ord).cpu().numpy()
    expected = reference_norms(layer.to_dense_weight().detach().cpu().double().numpy(), 32, ord)
    np.testing.assert_allclose(norms, expected, rtol=1e-6)
    assert (norms[layer.op.layout == 0] == 0).all() and (norms[layer.op.layout != 0] > 0).all()


def a_moved_layout(layout: np.ndarray, rng, count: int) -> np.ndarray:
    """``layout`` with ``count`` present blocks moved to absent places."""
    moved = layout.copy()
    present, absent = np.argwhere(layout != 0), np.argwhere(layout == 0)
    for r, c in present[rng.choice(len(present), count, replace=False)]:
        moved[r, c] = 0
    for r, c in absent[rng.choice(len(absent), count, replace=False)]:
        moved[r, c] = 1
    return moved


@pytest.mark.parametrize("init", ["zero", "fan_in"])
def test_change_layout_moves_values_gradients_and_adam_state(device, init):
    dtype = dtype_on(device)
    rng = np.random.default_rng(4)
    layer = bt.BlockSparseLinear(128, 96, density=0.5, block_size=32, seed=1, device=device, dtype=dtype)
    weight = layer.weight
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x = torch.tensor(rng.standard_normal((7, 128)), device=device, dtype=dtype)
    layer(x).square().sum().backward()
    optimizer.step()
    layer(x).square().sum().backward()  # a gradient in place when the layout changes
    before = {"weight": layer.to_dense_weight().detach().clone(), "layout": layer.op.layout.copy()}

    def dense(slots):  # (C, K) of a per-slot tensor under the layer's current index
        blocks = torch.zeros(*layer.op.layout.shape, 32, 32, dtype=slots.dtype, device=slots.device)
        blocks[torch.tensor(layer.op.index.rows, dtype=torch.long), torch.tensor(layer.op.index.indices,
                                                                                  dtype=torch.long)] = slots
        return blocks.permute(0, 2, 1, 3).reshape(128, 96)

    state_before = {k: dense(v).clone() for k, v in optimizer.state[weight].items() if torch.is_tensor(v) and
                    v.shape == weight.shape}
    grad_before = dense(weight.grad).clone()
    assert set(state_before) == {"exp_avg", "exp_avg_sq"}
    new_layout = a_moved_layout(before["layout"], rng, 3)
    change = dynamic.change_layout(layer, torch.tensor(new_layout), optimizer, init=init)
    assert layer.weight is weight and np.array_equal(layer.op.layout, new_layout)
    assert torch.equal(layer.layout.cpu(), torch.tensor(new_layout))
    assert len(change.dropped) == len(change.grown) == 3 and (change.source == -1).sum() == 3
    kept = np.kron((before["layout"] != 0) & (new_layout != 0), np.ones((32, 32))).astype(bool)
    grown = np.kron((before["layout"] == 0) & (new_layout != 0), np.ones((32, 32))).astype(bool)
    after = layer.to_dense_weight().detach()
    kept_t, grown_t = torch.tensor(kept, device=device), torch.tensor(grown, device=device)
    assert torch.equal(after[kept_t], before["weight"][kept_t])
    for name, value in state_before.items():
        moved = dense(optimizer.state[weight][name])
        assert torch.equal(moved[kept_t], value[kept_t]) and not moved[grown_t].any(), name
    assert torch.equal(dense(weight.grad)[kept_t], grad_before[kept_t]) and not dense(weight.grad)[grown_t].any()
    if init == "zero":
        assert not after[grown_t].any()
    else:  # nn.Linear's bound 1/sqrt(fan_in) of each block column under the new layout
        bounds = 1 / np.sqrt((new_layout != 0).sum(axis=0) * 32)
        limit = torch.tensor(np.broadcast_to(np.repeat(bounds, 32), (128, 96))[grown], device=device, dtype=dtype)
        values = after[grown_t]
        assert values.abs().min() > 0 and (values.abs() <= limit).all()
    # The layer computes with the new layout, and trains on: forward, backward and a step
    expected = x @ after + layer.bias.detach()
    assert torch.allclose(layer(x), expected, rtol=tolerance_of(dtype), atol=tolerance_of(dtype))
    layer(x).square().sum().backward()
    optimizer.step()
    assert torch.isfinite(layer.weight).all()


def test_change_layout_keeps_checkpoints_loadable():
    """A changed layer's state_dict carries its layout: a fresh layer of as many blocks adopts it on
    load_state_dict, one of other blocks is rebuilt by load_layouts; both then compute as the changed one."""
    layer = bt.BlockSparseLinear(64, 96, density=0.5, block_size=32, seed=3)
    dynamic.change_layout(layer, a_moved_layout(layer.op.layout, np.random.default_rng(0), 1), init="fan_in")
    state = layer.state_dict()  # the buffer agrees with the layout computed with: no refusal
    assert np.array_equal(state["layout"].numpy(), layer.op.layout)
    x = torch.randn(5, 64)
    fresh = bt.BlockSparseLinear(64, 96, density=0.5, block_size=32, seed=3)
    fresh.load_state_dict(state)
    assert np.array_equal(fresh.op.layout, layer.op.layout) and torch.equal(fresh(x), layer(x))
    denser = torch.nn.Sequential(bt.BlockSparseLinear(64, 96, density=0.75, block_size=32, seed=3))
    with pytest.raises(RuntimeError, match="layout"):
        denser.load_state_dict({"0." + k: v for k, v in state.items()})
    bt.load_layouts(denser, {"0." + k: v for k, v in state.items()}).load_state_dict(
        {"0." + k: v for k, v in state.items()})
    assert torch.equal(denser(x), layer(x))
    copied = copy.deepcopy(layer)
    assert torch.equal(copied(x), layer(x))


def test_change_layout_refusals():
    layer = bt.BlockSparseLinear(64, 64, np.array([[1, 0], [0, 1]]), block_size=32)
    weight = layer.weight.detach().clone()
    with pytest.raises(ValueError, match=r"layout must hold 2 blocks, as the layer's does; got 3"):
        dynamic.change_layout(layer, np.array([[1, 1], [0, 1]]))
    with pytest.raises(ValueError, match=r"layout must have the layer's layout shape \(2, 2\); got \(1, 2\)"):
        dynamic.change_layout(layer, np.array([[1, 1]]))
    with pytest.raises(ValueError, match="init must be one of 'zero', 'fan_in'; got 'ones'"):
        dynamic.change_layout(layer, np.array([[1, 1], [0, 0]]), init="ones")
    with pytest.raises(TypeError, match="layer must be a bsmm.torch.BlockSparseLinear or BlockSparseLSTM; got Linear"):
        dynamic.change_layout(torch.nn.Linear(4, 4), np.ones((1, 1)))
    assert torch.equal(layer.weight, weight) and np.array_equal(layer.op.layout, [[1, 0], [0, 1]])


# -- DynamicSparsity against the same steps on dense masked weights ---------------------------------------------
class MaskedReference:
    """Two dense layers (float64) with block masks, ReLU between, Adam; the RigL or SET update written
    out: drop the present blocks of smallest L2 norm (row-major order breaks ties), grow the absent ones
    of largest dense-gradient norm (or of largest uniform draw), new blocks and their Adam state zero."""

    def __init__(self, layers, bs, criterion, rng_seed):
        self.bs, self.criterion = bs, criterion
        self.masks = [layer.op.layout != 0 for layer in layers]
        # (clones: on the CPU in float64, .double().cpu() would share the layers' storage)
        self.weights = [torch.nn.Parameter(layer.to_dense_weight().detach().double().cpu().clone())
                        for layer in layers]
        self.biases = [torch.nn.Parameter(layer.bias.detach().double().cpu().clone()) for layer in layers]
        self.optimizer = torch.optim.Adam([*self.weights, *self.biases], lr=1e-2)
        self.generator = np.random.default_rng(rng_seed)

    def expanded(self, i):
        return torch.tensor(np.kron(self.masks[i], np.ones((self.bs, self.bs))))

    def step(self, x, update_fraction=None):
        masked = [w * self.expanded(i) for i, w in enumerate(self.weights)]
        for m in masked:
            m.retain_grad()
        y = torch.relu(x @ masked[0] + self.biases[0]) @ masked[1] + self.biases[1]
        y.square().mean().backward()
        self.optimizer.step()
        if update_fraction is not None:
            for i, mask in enumerate(self.masks):
                self.update(i, mask, masked[i].grad.numpy(), update_fraction)
        self.optimizer.zero_grad()

    def update(self, i, mask, full_gradient, fraction):
        present, absent = np.argwhere(mask), np.argwhere(~mask)
        count = min(round(fraction * len(present)), len(absent))
        norms = reference_norms((self.weights[i] * self.expanded(i)).detach().numpy(), self.bs, "l2")
        dropped = present[np.argsort(norms[mask], kind="stable")[:count]]
        if self.criterion == "rigl":
            scores = reference_norms(full_gradient, self.bs, "l2")
        else:
            scores = self.generator.random(mask.shape)
        grown = absent[np.argsort(-scores[~mask], kind="stable")[:count]]
        mask[tuple(dropped.T)] = False
        mask[tuple(grown.T)] = True
        fresh = torch.tensor(np.kron(np.isin(np.arange(mask.size), np.ravel_multi_index(tuple(grown.T), mask.shape))
                                     .reshape(mask.shape), np.ones((self.bs, self.bs))).astype(bool))
        with torch.no_grad():
            self.weights[i][fresh] = 0
            for value in self.optimizer.state[self.weights[i]].values():
                if torch.is_tensor(value) and value.shape == fresh.shape:
                    value[fresh] = 0


@pytest.mark.parametrize("criterion", ["rigl", "set"])
def test_dynamic_sparsity_against_dense_masked_reference(device, criterion):
    dtype = dtype_on(device)
    bs, seed = 16, 7
    torch.manual_seed(0)
    layers = [bt.BlockSparseLinear(64, 96, random_layout(4, 6, 0.4, seed=1), bs, device=device, dtype=dtype),
              bt.BlockSparseLinear(96, 48, random_layout(6, 3, 0.5, seed=2), bs, device=device, dtype=dtype)]
    model = torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1])
    reference = MaskedReference(layers, bs, criterion, seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    sparsity = bt.DynamicSparsity(model, optimizer, criterion=criterion, drop_fraction=0.3, every=3,
                                  schedule="constant", seed=seed)
    rng = np.random.default_rng(5)
    for step in range(1, 8):
        x = rng.standard_normal((2, 11, 64))  # leading axes: the captured rows are 22
        out = model(torch.tensor(x, device=device, dtype=dtype))
        out.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        reference.step(torch.tensor(x), 0.3 if step % 3 == 0 else None)
    assert sparsity.steps == 7 and len(sparsity.history) == 2
    for i, layer in enumerate(layers):
        assert np.array_equal(layer.op.layout != 0, reference.masks[i]), i
        assert int(np.count_nonzero(layer.op.layout)) == len(layer.weight)
        expected = (reference.weights[i] * reference.expanded(i)).detach()
        np.testing.assert_allclose(layer.to_dense_weight().detach().cpu().double().numpy(), expected.numpy(),
                                   rtol=0, atol=tolerance_of(dtype))
    moved = sum(len(change.grown) for update in sparsity.history for change in update.values())
    assert moved == 2 * (round(0.3 * 10) + round(0.3 * 9))  # 10 and 9 blocks: 3 and 3 moved at each update


def test_cosine_schedule_and_end():
    layer = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    sparsity = bt.DynamicSparsity([layer], optimizer, criterion="set", drop_fraction=0.4, every=2, end=4)
    assert [round(sparsity.fraction(t), 6) for t in (0, 2, 4, 5)] == [0.4, 0.2, 0.0, 0.0]
    for _ in range(8):
        layer(torch.randn(3, 64)).sum().backward()
        optimizer.step()
    # after step 2 only: at step 4 (end) the fraction is 0, so there is no update (and nothing captured for it)
    assert sparsity.steps == 8 and len(sparsity.history) == 1
    assert not sparsity._updates_after(4) and not sparsity._capturing
    sparsity.remove()
    optimizer.step()
    assert sparsity.steps == 8


def test_dynamic_sparsity_refusals():
    layer = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for kwargs, error, match in [
        ({"criterion": "random"}, ValueError, "criterion must be one of 'rigl', 'set'; got 'random'"),
        ({"criterion": "magnitude"}, ValueError, "criterion='magnitude' prunes without regrowing.*GradualPruning"),
        ({"drop_fraction": 1.0}, ValueError, r"drop_fraction must be a number in \(0, 1\); got 1.0"),
        ({"every": 0}, ValueError, "every must be a positive int; got 0"),
        ({"schedule": "cosine"}, ValueError, "schedule='cosine' decays to 0 at end: pass end="),
        ({"schedule": "linear", "end": 5}, ValueError, "schedule must be one of 'cosine', 'constant'"),
    ]:
        with pytest.raises(error, match=match):
            bt.DynamicSparsity([layer], optimizer, **kwargs)
    with pytest.raises(ValueError, match="holds no bsmm.torch.BlockSparseLinear"):
        bt.DynamicSparsity(torch.nn.Linear(4, 4), optimizer, end=4)
    with pytest.raises(ValueError, match="optimizer does not hold the weight of layer '0'"):
        bt.DynamicSparsity([layer], torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), end=4)
    activated = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0, activation="relu")
    with pytest.raises(ValueError, match="layer '0' fuses activation 'relu': use criterion='set'"):
        bt.DynamicSparsity([activated], torch.optim.SGD(activated.parameters(), lr=1), end=4)
    with pytest.raises(TypeError, match=r"model_or_layers\[0\] must be a bsmm.torch.BlockSparseLinear or BlockSparseLSTM; got ReLU"):
        bt.DynamicSparsity([torch.nn.ReLU()], optimizer, end=4)


def test_rigl_without_a_captured_gradient_says_so():
    layer = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    bt.DynamicSparsity([layer], optimizer, criterion="rigl", every=1, schedule="constant")
    layout = layer.op.layout.copy()
    with torch.no_grad():
        layer.weight.grad = torch.ones_like(layer.weight)
    with pytest.raises(RuntimeError, match="no gradient of the output of layer '0' was captured in step 1"):
        optimizer.step()
    assert np.array_equal(layer.op.layout, layout)


def test_a_compiled_model_computes_with_the_changed_layout():
    layer = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0)
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(5, 64)
    assert torch.allclose(compiled(x), layer(x), rtol=1e-5, atol=1e-6)
    dynamic.change_layout(layer, a_moved_layout(layer.op.layout, np.random.default_rng(1), 2), init="fan_in")
    expected = x @ layer.to_dense_weight().detach() + layer.bias.detach()
    assert torch.allclose(compiled(x), expected, rtol=1e-5, atol=1e-5)


def _sparse_model(device="cpu", dtype=torch.float32):
    return torch.nn.Sequential(
        bt.BlockSparseLinear(64, 96, density=0.5, block_size=16, seed=0, device=device, dtype=dtype), torch.nn.ReLU(),
        bt.BlockSparseLinear(96, 64, density=0.4, block_size=16, seed=1, device=device, dtype=dtype))


def _dense_forward(model, x):
    """The model's forward on its dense masked weights (each layer's current layout)."""
    hidden = torch.relu(x @ model[0].to_dense_weight() + model[0].bias)
    return hidden @ model[2].to_dense_weight() + model[2].bias


def test_a_compiled_model_trains_through_layout_changes_with_no_recompilation():
    """DynamicSparsity gives its layers moving keys: four updates, one compiled frame, and after each update
    the compiled model computes with the new layouts (against the dense masked weights)."""
    torch.manual_seed(0)
    model = _sparse_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sparsity = bt.DynamicSparsity(model, optimizer, criterion="set", drop_fraction=0.3, every=1, schedule="constant",
                                  init="fan_in")
    keys = [layer._key for layer in sparsity.layers.values()]
    assert all("/moving-" in key for key in keys)
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    start = [layer.op.layout.copy() for layer in sparsity.layers.values()]
    for _ in range(4):
        x = torch.randn(6, 64)
        compiled(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        # (in grad mode, as the step: Dynamo guards on it, so no_grad would compile a frame of its own)
        torch.testing.assert_close(compiled(x).detach(), _dense_forward(model, x).detach(), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1, counter.frame_count
    assert len(sparsity.history) == 4
    assert [layer._key for layer in sparsity.layers.values()] == keys
    assert all(not np.array_equal(a, layer.op.layout) for a, layer in zip(start, sparsity.layers.values()))


def test_recorded_cuda_graphs_give_a_changed_layer_a_new_key(monkeypatch):
    """Where torch.compile recorded CUDA graphs, a change takes a new moving key, so the compiled model
    compiles (and records) again rather than replay launches of the old layout."""
    layer = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0, bias=False)
    rng = np.random.default_rng(2)
    dynamic.change_layout(layer, a_moved_layout(layer.op.layout, rng, 2))
    key = layer._key
    dynamic.change_layout(layer, a_moved_layout(layer.op.layout, rng, 2))
    assert layer._key == key and not bt.registry.cuda_graphs_recorded()
    y = layer(torch.randn(3, 64))  # (x needs no gradient: the weight is not saved, no version counter to trip)
    monkeypatch.setattr(bt.layers, "cuda_graphs_recorded", lambda: True)
    dynamic.change_layout(layer, a_moved_layout(layer.op.layout, rng, 2))
    assert layer._key != key and "/moving-" in layer._key
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ layer.to_dense_weight().detach())
    with pytest.raises(RuntimeError, match="changed between this forward and its backward"):
        y.sum().backward()  # its registration is retired, though nothing else moved its key
    # Loading a checkpoint of another layout likewise takes a new key; a plain layer keeps content keys.
    key, saved = layer._key, copy.deepcopy(layer.state_dict())
    dynamic.change_layout(layer, a_moved_layout(layer.op.layout, rng, 2))
    assert layer._key != key
    key = layer._key
    layer.load_state_dict(saved)
    assert layer._key != key and "/moving-" in layer._key and np.array_equal(saved["layout"].numpy(), layer.op.layout)
    plain = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0, bias=False)
    plain.load_state_dict(saved)
    assert "/moving-" not in plain._key and np.array_equal(plain.op.layout, layer.op.layout)


def test_removing_dynamic_sparsity_returns_layers_to_content_keys():
    model = _sparse_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sparsity = bt.DynamicSparsity(model, optimizer, criterion="set", every=1, schedule="constant")
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    assert all("/moving-" in layer._key for layer in sparsity.layers.values())
    sparsity.remove()
    for layer in sparsity.layers.values():
        assert layer._key == bt.registry.layout_key(layer.op.index)
    x = torch.randn(4, 64)
    torch.testing.assert_close(model(x), _dense_forward(model, x))


def test_a_moving_key_moves_to_layouts_of_as_many_blocks_only():
    first = bt.registry.moving(bsmm.block_index(np.eye(4), 8))
    with pytest.raises(ValueError, match="4 blocks of"):
        bt.registry.move(first, bsmm.block_index(np.ones((4, 4)), 8))
    with pytest.raises(ValueError, match="content key, not a moving one"):
        bt.registry.move(bt.registry.register(bsmm.block_index(np.eye(4), 8)), bsmm.block_index(np.eye(4), 8))
    second = bt.registry.move(first, bsmm.block_index(np.eye(4)[::-1], 8))
    assert first.retired and not second.retired and bt.registry.lookup(first.key) is second.index


def test_a_backward_pending_across_a_change_is_refused():
    """dW of a forward before a change would land in the new layout's slots: refused. (Without a bias the
    weight is not saved for dW, so PyTorch's version counter alone would not notice.)"""
    layer = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0, bias=False)
    layer._moving_registration()  # (as DynamicSparsity does, or a first change)
    y = layer(torch.randn(3, 64))
    dynamic.change_layout(layer, a_moved_layout(layer.op.layout, np.random.default_rng(3), 2))
    with pytest.raises(RuntimeError, match="changed between this forward and its backward"):
        y.sum().backward()


def test_a_copy_of_a_moving_layer_keeps_its_own_layout():
    """copy.deepcopy of a layer under a moving key: the copy computes with its own layout (a content key),
    not with the original's next one."""
    layer = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0)
    rng = np.random.default_rng(5)
    dynamic.change_layout(layer, a_moved_layout(layer.op.layout, rng, 2))
    twin = copy.deepcopy(layer)
    assert "/moving-" not in twin._key and np.array_equal(twin.op.layout, layer.op.layout)
    dynamic.change_layout(layer, a_moved_layout(layer.op.layout, rng, 2))
    x = torch.randn(3, 64)
    torch.testing.assert_close(twin(x), x @ twin.to_dense_weight().detach() + twin.bias.detach())
    assert not np.array_equal(twin.op.layout, layer.op.layout)


@pytest.mark.gpu
def test_reduce_overhead_replays_the_changed_layout():
    """torch.compile(mode="reduce-overhead") records CUDA graphs: after each update the compiled model
    computes with the new layouts (recorded again), never a replay of the old ones."""
    torch_cases.cuda_or_skip()
    torch.manual_seed(0)
    model = _sparse_model("cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sparsity = bt.DynamicSparsity(model, optimizer, criterion="set", drop_fraction=0.3, every=2, schedule="constant")
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead")
    for step in range(6):
        x = torch.randn(6, 64, device="cuda")
        torch.compiler.cudagraph_mark_step_begin()
        compiled(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            torch.compiler.cudagraph_mark_step_begin()
            torch.testing.assert_close(compiled(x).clone(), _dense_forward(model, x), rtol=1e-4, atol=1e-4)
    assert len(sparsity.history) == 3


@pytest.mark.parametrize("criterion", ["rigl", "set"])
def test_grace_keeps_the_blocks_the_last_updates_grew(criterion):
    """With grace=0 an update drops what the update before grew (zero-started, smallest); with grace=1 it never
    does, and the protection ends after one update. grown_at travels in the state_dict."""
    def run(grace):
        torch.manual_seed(0)
        model = _sparse_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        sparsity = bt.DynamicSparsity(model, optimizer, criterion=criterion, drop_fraction=0.3, every=1,
                                      schedule="constant", grace=grace, seed=3)
        for _ in range(4):
            optimizer.zero_grad()
            model(torch.randn(8, 64)).square().sum().backward()
            optimizer.step()
        redropped = []
        for before, after in zip(list(sparsity.history)[:-1], list(sparsity.history)[1:]):
            for name in after:
                grown = {tuple(c) for c in before[name].grown.tolist()}
                redropped.append(len(grown & {tuple(c) for c in after[name].dropped.tolist()}))
        return sparsity, redropped

    _, unprotected = run(0)
    assert sum(unprotected) > 0, unprotected
    sparsity, protected = run(1)
    assert sum(protected) == 0 and len(sparsity.history) == 4
    assert sparsity.updates == 4
    for name, layer in sparsity.layers.items():
        grown_last = sparsity.history[-1][name].grown
        assert (sparsity.grown_at[name][grown_last[:, 0], grown_last[:, 1]] == 4).all()
    state = sparsity.state_dict()
    model = _sparse_model()
    other = bt.DynamicSparsity(model, torch.optim.SGD(model.parameters(), lr=0.1), criterion="set", grace=1, every=1,
                               schedule="constant")
    other.load_state_dict(state)
    assert other.updates == 4 and all(np.array_equal(other.grown_at[n], sparsity.grown_at[n]) for n in state["grown_at"])
    with pytest.raises(ValueError, match="grace must be a non-negative int; got -1"):
        bt.DynamicSparsity(model, torch.optim.SGD(model.parameters(), lr=0.1), criterion="set", grace=-1, end=9)


def test_rigl_on_features_first_with_accumulated_gradients(device):
    """feature_axis=0 and two forward-backward passes before the step: the growth signal is the norm of the
    summed dW, Σ xᵢ·dyᵢᵀ, over both micro-batches."""
    dtype = dtype_on(device)
    layer = bt.BlockSparseLinear(64, 96, density=0.25, block_size=16, seed=4, feature_axis=0, device=device,
                                 dtype=dtype)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)  # the weights stay: the drop is checked against them
    sparsity = bt.DynamicSparsity([layer], optimizer, criterion="rigl", drop_fraction=0.35, every=1,
                                  schedule="constant")
    present, absent = np.argwhere(layer.op.layout != 0), np.argwhere(layer.op.layout == 0)
    count = round(0.35 * len(present))
    norms = dynamic.block_norms(layer).cpu().numpy()[layer.op.layout != 0]
    gradient = 0
    rng = np.random.default_rng(9)
    for rows in (5, 8):
        x = torch.tensor(rng.standard_normal((64, rows)), device=device, dtype=dtype)
        out = layer(x)
        out.retain_grad()
        out.sin().sum().backward()
        gradient = gradient + (x @ out.grad.T).double().cpu().numpy()
    optimizer.step()
    expected = np.zeros(layer.op.layout.shape, dtype=np.uint8)  # from the starting layout
    expected[tuple(present.T)] = 1
    expected[tuple(present[np.argsort(norms, kind="stable")[:count]].T)] = 0
    growth = reference_norms(gradient, 16, "l2")[tuple(absent.T)]
    expected[tuple(absent[np.argsort(-growth, kind="stable")[:count]].T)] = 1
    assert len(sparsity.history) == 1 and np.array_equal(layer.op.layout, expected)


def test_a_run_resumes_from_checkpoints_as_it_would_have_gone_on(tmp_path):
    """Model, optimizer and DynamicSparsity saved mid-run and loaded into fresh objects (load_state_dict adopts
    the saved layouts: as many blocks as the fresh layers'): the rest of the run equals the uninterrupted one."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(bt.BlockSparseLinear(64, 64, density=0.4, block_size=16, seed=1),
                                    torch.nn.Tanh(), bt.BlockSparseLinear(64, 32, density=0.5, block_size=16, seed=2))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, optimizer, bt.DynamicSparsity(model, optimizer, criterion="set", drop_fraction=0.3, every=2,
                                                    end=8, seed=3)

    def train(model, optimizer, steps):
        for step in steps:
            x = torch.tensor(np.random.default_rng(step).standard_normal((4, 64)), dtype=torch.float32)
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()

    model, optimizer, sparsity = build()
    train(model, optimizer, range(3))
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "sparsity": sparsity.state_dict()}, tmp_path / "run.pt")
    train(model, optimizer, range(3, 8))
    saved = torch.load(tmp_path / "run.pt", weights_only=False)
    resumed, _, _ = build()
    resumed.load_state_dict(saved["model"])
    optimizer2 = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    optimizer2.load_state_dict(saved["optimizer"])
    sparsity2 = bt.DynamicSparsity(resumed, optimizer2, criterion="set", drop_fraction=0.3, every=2, end=8, seed=99)
    sparsity2.load_state_dict(saved["sparsity"])
    train(resumed, optimizer2, range(3, 8))
    assert sparsity2.steps == sparsity.steps == 8 and (len(sparsity.history), len(sparsity2.history)) == (3, 2)
    for a, b in zip(model.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


# -- what a training loop does around the updates (the review's cases) ------------------------------------------
def test_per_slot_optimizer_state_of_other_shapes_moves_and_other_state_is_refused():
    """Adafactor's factors (nnzb, bs, 1) and (nnzb, 1, bs) move with their blocks like Adam's moments; a state
    tensor not of one entry a block cannot be followed and is refused before anything changes."""
    layer = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0, bias=False)
    optimizer = torch.optim.Adafactor(layer.parameters(), lr=1e-2)
    layer(torch.randn(5, 64)).square().sum().backward()
    optimizer.step()
    state = optimizer.state[layer.weight]
    before = {k: state[k].clone() for k in ("row_var", "col_var")}
    old = layer.op.layout.copy()
    change = dynamic.change_layout(layer, a_moved_layout(old, np.random.default_rng(2), 3), optimizer)
    source = torch.tensor(change.source)
    for key, value in before.items():
        assert torch.equal(state[key][source >= 0], value[source[source >= 0]]), key
        assert not state[key][source < 0].any(), key
    state["odd"] = torch.ones(7)
    layout, weight = layer.op.layout.copy(), layer.weight.detach().clone()
    with pytest.raises(ValueError, match=r"the optimizer's state 'odd' of the weight has shape \(7,\), not one entry "
                                         r"a block \(8, \.\.\.\)"):
        dynamic.change_layout(layer, old, optimizer)
    assert np.array_equal(layer.op.layout, layout) and torch.equal(layer.weight, weight)


def rigl_layout_after(layer, gradient: np.ndarray, fraction: float) -> np.ndarray:
    """RigL's next layout written out: drop the smallest weight blocks, grow the largest gradient blocks."""
    present, absent = np.argwhere(layer.op.layout != 0), np.argwhere(layer.op.layout == 0)
    count = round(fraction * len(present))
    norms = dynamic.block_norms(layer).numpy()[layer.op.layout != 0]
    expected = np.zeros(layer.op.layout.shape, dtype=np.uint8)
    expected[tuple(present.T)] = 1
    expected[tuple(present[np.argsort(norms, kind="stable")[:count]].T)] = 0
    growth = reference_norms(gradient, layer.op.block_size, "l2")[tuple(absent.T)]
    expected[tuple(absent[np.argsort(-growth, kind="stable")[:count]].T)] = 1
    return expected


def test_rigl_sums_backward_passes_and_leaves_out_forwards_without_a_usable_gradient():
    """Two backward passes through one forward count both (as weight.grad does); a forward whose output reaches
    no loss, and one whose gradient overflowed (a step GradScaler skips), are left out."""
    layer = bt.BlockSparseLinear(64, 96, density=0.3, block_size=16, seed=6, bias=False, dtype=torch.float64)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)
    sparsity = bt.DynamicSparsity([layer], optimizer, criterion="rigl", drop_fraction=0.3, every=2,
                                  schedule="constant")
    rng = np.random.default_rng(0)
    x1, x2, x3 = (torch.tensor(rng.standard_normal((6, 64))) for _ in range(3))
    layer(x1).sum().backward()
    optimizer.step()  # step 1: nothing captured
    with torch.no_grad():
        layer.weight.grad = None
    overflowed = layer(x3)
    (overflowed * float("inf")).sum().backward()  # the step GradScaler would skip: no optimizer.step
    layer.weight.grad = None
    layer(x3)  # a forward under grad whose output reaches no loss
    out = layer(x2)
    out.retain_grad()
    out.square().sum().backward(retain_graph=True)
    first = out.grad.clone()
    out.sin().sum().backward()
    gradient = (x2.T @ out.grad).numpy()  # out.grad sums both backward passes
    assert not torch.equal(out.grad, first)
    expected = rigl_layout_after(layer, gradient, 0.3)
    optimizer.step()  # step 2: the update
    assert len(sparsity.history) == 1 and np.array_equal(layer.op.layout, expected)
    assert sparsity._captured == {}


def test_a_failed_update_changes_no_layer_and_keeps_nothing_captured():
    layers = [bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=s) for s in (0, 1)]
    optimizer = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=0.1)
    sparsity = bt.DynamicSparsity(layers, optimizer, criterion="rigl", every=1, schedule="constant")
    before = [layer.op.layout.copy() for layer in layers]
    layers[0](torch.randn(3, 64)).sum().backward()  # the second layer is never run: no gradient for it
    with pytest.raises(RuntimeError, match="no gradient of the output of layer '1'"):
        optimizer.step()
    assert all(np.array_equal(layer.op.layout, b) for layer, b in zip(layers, before))
    assert sparsity._captured == {} and len(sparsity.history) == 0
    sparsity.remove()
    layers[0](torch.randn(3, 64)).sum().backward()
    optimizer.step()  # detached: no update, nothing captured
    assert sparsity._captured == {} and np.array_equal(layers[0].op.layout, before[0])


def test_dynamic_sparsity_argument_and_state_checks():
    layer = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for seed in (None, -1, 1.5):
        with pytest.raises(ValueError, match=f"seed must be a non-negative int; got {seed!r}"):
            bt.DynamicSparsity([layer], optimizer, criterion="set", end=4, seed=seed)
    gated = bt.BlockSparseLinear(64, 64, density=0.5, block_size=16, seed=0)
    bt.gate_layer(gated)
    with pytest.raises(ValueError, match="layer '0' has gates"):
        bt.DynamicSparsity([gated], torch.optim.SGD(gated.parameters(), lr=0.1), criterion="set", end=4)
    sparsity = bt.DynamicSparsity([layer], optimizer, criterion="set", every=1, schedule="constant", seed=2 ** 62)
    assert sparsity.state_dict()["seed"] == 2 ** 62 and sparsity.history.maxlen == dynamic.HISTORY
    layer(torch.randn(3, 64)).sum().backward()
    optimizer.step()  # a large seed derives its draws without overflow
    assert len(sparsity.history) == 1


def test_loading_a_layout_without_its_weight_is_refused():
    layer = bt.BlockSparseLinear(64, 64, np.array([[1, 0], [0, 1]] * 1).repeat(2, 0).repeat(2, 1), block_size=16)
    source = bt.BlockSparseLinear(64, 64, np.array([[0, 1], [1, 0]]).repeat(2, 0).repeat(2, 1), block_size=16)
    state = {"layout": source.state_dict()["layout"]}
    layout = layer.op.layout.copy()
    with pytest.raises(RuntimeError, match="layout"):
        layer.load_state_dict(state, strict=False)
    assert np.array_equal(layer.op.layout, layout)


def test_rigl_counts_every_forward_before_the_backward():
    """A layer applied twice in one step (weight sharing, or micro-batches summed into one loss): both forwards'
    xᵀ·dy count, as both reach weight.grad."""
    layer = bt.BlockSparseLinear(64, 64, density=0.3, block_size=16, seed=8, bias=False, dtype=torch.float64)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)
    sparsity = bt.DynamicSparsity([layer], optimizer, criterion="rigl", drop_fraction=0.3, every=1,
                                  schedule="constant")
    x = torch.tensor(np.random.default_rng(3).standard_normal((5, 64)))
    hidden = layer(x)
    hidden.retain_grad()
    out = layer(torch.tanh(hidden))
    out.retain_grad()
    out.square().sum().backward()
    gradient = (x.T @ hidden.grad + torch.tanh(hidden).T @ out.grad).detach().numpy()
    expected = rigl_layout_after(layer, gradient, 0.3)
    optimizer.step()
    assert len(sparsity.history) == 1 and np.array_equal(layer.op.layout, expected)


def test_rigl_forgets_a_step_whose_gradients_were_thrown_away():
    """A forward and backward whose step was skipped (GradScaler found an overflow elsewhere) and whose gradients
    were then zeroed: the update grows as if that batch had never been seen."""
    def run(skipped: bool):
        torch.manual_seed(0)  # the same weights in both runs
        layer = bt.BlockSparseLinear(64, 64, density=0.3, block_size=16, seed=9, bias=False, dtype=torch.float64)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)
        bt.DynamicSparsity([layer], optimizer, criterion="rigl", drop_fraction=0.3, every=1, schedule="constant")
        rng = np.random.default_rng(4)
        thrown, kept = (torch.tensor(rng.standard_normal((5, 64))) for _ in range(2))
        thrown[:, 48:] *= 100  # the thrown batch would make the last block row's blocks grow
        if skipped:
            layer(thrown).sin().sum().backward()
            optimizer.zero_grad(set_to_none=True)  # no optimizer.step: the step was skipped
        layer(kept).sin().sum().backward()
        optimizer.step()
        return layer.op.layout.copy()

    assert np.array_equal(run(skipped=True), run(skipped=False))

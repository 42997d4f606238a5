"""bsmm.torch.dynamic for BlockSparseLSTM (bsmm.torch.dynamic_lstm): change_layout against a fresh layer
built with the new layout and the moved weights (float64), gradients and Adam state moved with their blocks,
SET and RigL under DynamicSparsity, RigL's growth signal against the dense dWh (and dWx) of a float64 LSTM
written out here, and the refusals. The CUDA case carries the ``gpu`` marker."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bsmm.torch tests skipped")

import bsmm.torch as bt  # noqa: E402
from bsmm.torch import dynamic, dynamic_lstm, lstm_steps  # noqa: E402

HIDDEN, BS = 64, 16
HB = HIDDEN // BS
INPUTS = {"shared": "recurrent", "dense": None, "own": np.eye(HB, dtype=np.uint8)}


def make_lstm(input_kind: str, seed: int = 0, **options) -> bt.BlockSparseLSTM:
    torch.manual_seed(seed)
    return bt.BlockSparseLSTM(HIDDEN, HIDDEN, block_size=BS, density=0.4, seed=seed, input_layout=INPUTS[input_kind],
                              dtype=options.pop("dtype", torch.float64), **options)


def another_layout(lstm, seed: int = 1) -> np.ndarray:
    """A (H/bs, 4H/bs) layout of as many blocks, some kept, some moved."""
    old = lstm.recurrent_layout.cpu().numpy() != 0
    rng = np.random.default_rng(seed)
    present, absent = np.argwhere(old), np.argwhere(~old)
    drop = present[rng.choice(len(present), 3, replace=False)]
    grow = absent[rng.choice(len(absent), 3, replace=False)]
    new = old.copy()
    new[drop[:, 0], drop[:, 1]] = False
    new[grow[:, 0], grow[:, 1]] = True
    return new.astype(np.uint8)


def dense(tensor, index) -> torch.Tensor:
    return bt.BlockSparseLSTM._dense(tensor, index)


def block_mask(layout: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.kron(layout != 0, np.ones((BS, BS))))


def run(lstm, x, h0, c0):
    out, (h_n, c_n) = lstm(x, (h0, c0))
    (out.square().sum() + out.sin().sum() + h_n.sum() + 2 * c_n.sum()).backward()
    return out.detach()


def problem(seed: int = 3, steps: int = 5, n: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in
            ((steps, n, HIDDEN), (1, n, HIDDEN), (1, n, HIDDEN))]


@pytest.mark.parametrize("input_kind", ["shared", "dense", "own"])
def test_change_layout_equals_a_fresh_layer_with_the_moved_weights(input_kind):
    lstm = make_lstm(input_kind)
    x, h0, c0 = problem()
    run(lstm, x, h0, c0)
    old_index = lstm._recurrent.index
    old_input = lstm._input
    before = {name: dense(getattr(lstm, name).detach(), old_index) for name in ("weight_hh", "weight_ih")
              if name == "weight_hh" or input_kind == "shared"}
    grads = {name: dense(getattr(lstm, name).grad, old_index) for name in before}
    layout = another_layout(lstm)
    change = dynamic.change_layout(lstm, layout)
    kept = block_mask(layout & (old_index.layout != 0))
    assert len(change.dropped) == len(change.grown) == 3
    assert np.array_equal(lstm.recurrent_layout.numpy(), layout)
    for name in before:  # kept blocks in their places, grown ones zero; gradients alike
        assert torch.equal(dense(getattr(lstm, name).detach(), lstm._recurrent.index), before[name] * kept), name
        assert torch.equal(dense(getattr(lstm, name).grad, lstm._recurrent.index), grads[name] * kept), name
    if input_kind == "shared":
        assert torch.equal(lstm.input_layout, lstm.recurrent_layout)
    else:
        assert lstm._input is old_input  # a dense Wx, or one of its own layout, stays

    fresh = bt.BlockSparseLSTM(HIDDEN, HIDDEN, layout, block_size=BS, dtype=torch.float64,
                               input_layout="recurrent" if input_kind == "shared" else INPUTS[input_kind])
    fresh.load_state_dict(lstm.state_dict())
    for layer in (lstm, fresh):
        for p in layer.parameters():
            p.grad = None
    outputs = [run(layer, x, h0, c0) for layer in (lstm, fresh)]
    assert torch.equal(outputs[0], outputs[1])
    for (name, a), b in zip(lstm.named_parameters(), fresh.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12), name


@pytest.mark.parametrize("init", ["zero", "fan_in"])
def test_adam_state_moves_and_grown_blocks_start_as_asked(init):
    lstm = make_lstm("shared")
    optimizer = torch.optim.Adam(lstm.parameters(), lr=0.01)
    run(lstm, *problem())
    optimizer.step()
    old_index = lstm._recurrent.index
    moments = {(name, key): dense(optimizer.state[getattr(lstm, name)][key], old_index)
               for name in ("weight_hh", "weight_ih") for key in ("exp_avg", "exp_avg_sq")}
    layout = another_layout(lstm)
    change = dynamic.change_layout(lstm, layout, optimizer, init=init, generator=torch.Generator().manual_seed(0))
    kept = block_mask(layout & (old_index.layout != 0))
    for (name, key), value in moments.items():
        assert torch.equal(dense(optimizer.state[getattr(lstm, name)][key], lstm._recurrent.index), value * kept)
    grown = torch.as_tensor(change.source < 0)
    bounds = 1 / np.sqrt(BS * layout.sum(axis=0))[np.nonzero(layout)[1][change.source < 0]]
    for weight in (lstm.weight_hh, lstm.weight_ih):
        blocks = weight.detach()[grown].abs().amax(dim=(1, 2)).numpy()
        if init == "zero":
            assert not blocks.any()
        else:
            assert (blocks > 0).all() and (blocks <= bounds).all()
    optimizer.step()  # the moved state is usable


def test_set_keeps_the_block_count_and_moves_blocks():
    model = torch.nn.ModuleDict({"lstm": make_lstm("shared", dtype=torch.float32)})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sparsity = bt.DynamicSparsity(model, optimizer, criterion="set", drop_fraction=0.3, every=2, schedule="constant")
    lstm = model["lstm"]
    start = lstm.recurrent_layout.clone()
    for _ in range(4):
        optimizer.zero_grad()
        run(lstm, *(t.float() for t in problem()))
        optimizer.step()
    assert list(sparsity.layers) == ["lstm"] and len(sparsity.history) == 2
    assert int(lstm.recurrent_layout.sum()) == int(start.sum()) and not torch.equal(lstm.recurrent_layout, start)
    assert torch.equal(lstm.input_layout, lstm.recurrent_layout)


def reference_gradients(lstm, x, h0, c0):
    """Dense dWh and dWx of the loss of :func:`run`, from a float64 LSTM written out here (bsmm's gate order
    input, forget, output, candidate) over the layer's dense weights: every block's gradient, absent ones too."""
    wx, wh = (w.detach().clone().requires_grad_(True) for w in lstm.to_dense_weights())
    h, c, outs = h0[0], c0[0], []
    for t in range(x.shape[0]):
        z = x[t] @ wx + h @ wh + lstm.bias.detach()
        i, f, o, g = z.split(HIDDEN, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs.append(h)
    out = torch.stack(outs)
    (out.square().sum() + out.sin().sum() + h.sum() + 2 * c.sum()).backward()
    return wh.grad, wx.grad


def block_norms_of(dense_grad: torch.Tensor) -> np.ndarray:
    c, k = dense_grad.shape
    return torch.linalg.vector_norm(dense_grad.reshape(c // BS, BS, k // BS, BS), dim=(1, 3)).numpy()


@pytest.mark.parametrize("input_kind", ["shared", "dense"])
def test_rigl_grows_by_the_norms_of_the_dense_recurrent_gradient(input_kind):
    lstm = make_lstm(input_kind)
    optimizer = torch.optim.SGD(lstm.parameters(), lr=0.0)  # the weights stay: the drop norms are known
    sparsity = bt.DynamicSparsity([lstm], optimizer, criterion="rigl", drop_fraction=0.25, every=1,
                                  schedule="constant")
    x, h0, c0 = problem()
    d_wh, d_wx = reference_gradients(lstm, x, h0, c0)
    scores = block_norms_of(d_wh)
    norms = dynamic._reduce_blocks(lstm.weight_hh.detach(), "l2")
    if input_kind == "shared":  # one structure: Wx's blocks count with Wh's
        scores = np.sqrt(scores ** 2 + block_norms_of(d_wx) ** 2)
        norms = torch.sqrt(norms ** 2 + dynamic._reduce_blocks(lstm.weight_ih.detach(), "l2") ** 2)
    assert torch.equal(dynamic_lstm.slot_norms(lstm), norms.float())
    index = lstm._recurrent.index
    count = round(0.25 * index.nnzb)
    expected = index.layout != 0
    dropped = np.argsort(norms.numpy(), kind="stable")[:count]
    absent = np.argwhere(~expected)
    grown = absent[np.argsort(-scores[absent[:, 0], absent[:, 1]], kind="stable")[:count]]
    expected[index.rows[dropped], index.indices[dropped]] = False
    expected[grown[:, 0], grown[:, 1]] = True

    captured = []  # the rows the backward hands over, next to DynamicSparsity's own capture
    lstm.register_gradient_capture(lambda: lambda h_in, rows, dz: captured.append((h_in, rows, dz.clone())))
    run(lstm, x, h0, c0)
    h_in, rows, dz = captured[0]
    assert torch.allclose(h_in.T @ dz, d_wh, rtol=1e-10, atol=1e-10)
    assert torch.allclose(rows.T @ dz, d_wx, rtol=1e-10, atol=1e-10)
    optimizer.step()
    assert len(sparsity.history) == 1 and np.array_equal(lstm.recurrent_layout.numpy() != 0, expected)
    assert sparsity._captured == {}


def test_rigl_sums_backward_passes_through_one_forward():
    lstm = make_lstm("dense")
    optimizer = torch.optim.SGD(lstm.parameters(), lr=0.0)
    sparsity = bt.DynamicSparsity([lstm], optimizer, criterion="rigl", every=1, schedule="constant")
    x, h0, c0 = problem()
    out, _ = lstm(x, (h0, c0))
    out.square().sum().backward(retain_graph=True)
    out.sin().sum().backward()
    (h_in, _), dz = sparsity._captured["0"][0]
    assert h_in.shape == (x.shape[0] * x.shape[1], HIDDEN)
    single = []
    lstm.register_gradient_capture(lambda: lambda a, b, d: single.append(d.clone()))
    for loss in (lambda o: o.square().sum(), lambda o: o.sin().sum()):
        loss(lstm(x, (h0, c0))[0]).backward()
    assert torch.allclose(dz, single[-2] + single[-1], rtol=1e-12, atol=1e-12)


def test_refusals():
    lstm = make_lstm("shared")
    layout = lstm.recurrent_layout.numpy()
    with pytest.raises(ValueError, match="layout must hold"):
        dynamic.change_layout(lstm, np.ones_like(layout))
    with pytest.raises(ValueError, match="layout must have shape"):
        dynamic.change_layout(lstm, np.ones((HB, 2 * HB)))
    with pytest.raises(ValueError, match="init must be one of"):
        dynamic.change_layout(lstm, layout, init="normal")
    with pytest.raises(TypeError, match="lstm must be a bsmm.torch.BlockSparseLSTM"):
        dynamic_lstm.change_lstm_layout(torch.nn.LSTM(4, 4), layout)
    optimizer = torch.optim.SGD(lstm.parameters(), lr=0.1)
    optimizer.state[lstm.weight_ih]["odd"] = torch.zeros(3)
    with pytest.raises(ValueError, match="state 'odd' of weight_ih"):
        dynamic.change_layout(lstm, another_layout(lstm), optimizer)
    assert np.array_equal(lstm.recurrent_layout.numpy(), layout)  # refused before anything changed
    with pytest.raises(ValueError, match="optimizer does not hold the weight"):
        bt.DynamicSparsity([lstm], torch.optim.SGD([lstm.bias], lr=0.1), criterion="set", every=1,
                           schedule="constant")
    with pytest.raises(TypeError, match="BlockSparseLinear or BlockSparseLSTM"):
        bt.DynamicSparsity([torch.nn.LSTM(4, 4)], optimizer, criterion="set", every=1, schedule="constant")


def test_a_capture_is_refused_under_torch_compile(monkeypatch):
    lstm = make_lstm("dense")
    handle = lstm.register_gradient_capture(lambda: None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(NotImplementedError, match="criterion='set'"):
        lstm(problem()[0])
    handle.remove()
    assert not lstm._gradient_captures


def test_a_changed_layout_loads_into_a_layer_of_the_old_one_and_graphs_are_forgotten(monkeypatch):
    lstm = make_lstm("shared")
    forgotten = []
    monkeypatch.setattr(lstm._graphs, "invalidate", lambda: forgotten.append(True))
    dynamic.change_layout(lstm, another_layout(lstm))
    assert forgotten == [True]
    other = make_lstm("shared")
    other.load_state_dict(lstm.state_dict())
    assert torch.equal(other.recurrent_layout, lstm.recurrent_layout)
    x, h0, c0 = problem()
    assert torch.equal(lstm(x, (h0, c0))[0], other(x, (h0, c0))[0])


def test_a_layout_loads_only_with_its_weights_and_a_refused_load_changes_nothing():
    """A saved layout without its weights is not adopted (the weights' slots would mean the old blocks); a
    load refused for its input layout leaves the recurrent layout as it was."""
    source = make_lstm("shared")
    dynamic.change_layout(source, another_layout(source))
    saved = {name: value.clone() for name, value in source.state_dict().items()}
    target = make_lstm("shared")
    before = target.recurrent_layout.clone()
    with pytest.raises(RuntimeError, match="in other places"):
        target.load_state_dict({k: v for k, v in saved.items() if not k.startswith("weight_")}, strict=False)
    assert torch.equal(target.recurrent_layout, before)
    own = make_lstm("own")
    dynamic.change_layout(own, another_layout(own))
    saved = {name: value.clone() for name, value in own.state_dict().items()}
    saved["input_layout"] = torch.ones_like(saved["input_layout"])
    target = make_lstm("own")
    before = target.recurrent_layout.clone()
    with pytest.raises(RuntimeError, match="input_layout"):
        target.load_state_dict(saved)
    assert torch.equal(target.recurrent_layout, before)


def test_a_layer_pickled_before_layouts_could_change_still_runs():
    lstm = make_lstm("shared")
    state = lstm.__dict__.copy()
    del state["_gradient_captures"], state["shared_layout"]
    old = bt.BlockSparseLSTM.__new__(bt.BlockSparseLSTM)
    old.__setstate__(state)
    assert old.shared_layout and len(old._gradient_captures) == 0
    x, h0, c0 = problem()
    assert torch.equal(old(x, (h0, c0))[0], lstm(x, (h0, c0))[0])
    dynamic.change_layout(old, another_layout(old))


def test_no_change_under_recorded_cuda_graphs(monkeypatch):
    lstm = make_lstm("shared")
    weight, layout = lstm.weight_hh.detach().clone(), lstm.recurrent_layout.clone()
    monkeypatch.setattr(bt.lstm, "cuda_graphs_recorded", lambda: True)
    with pytest.raises(RuntimeError, match="cannot change under CUDA graphs"):
        dynamic.change_layout(lstm, another_layout(lstm))
    assert torch.equal(lstm.weight_hh, weight) and torch.equal(lstm.recurrent_layout, layout)


@pytest.mark.parametrize("input_kind", ["shared", "dense"])
def test_block_norms_of_an_lstm(input_kind):
    """Over the recurrent layout: Wh's block norms, combined with Wx's where the layout is shared (L2 of the two)."""
    lstm = make_lstm(input_kind)
    norms = dynamic.block_norms(lstm).numpy()
    layout = lstm.recurrent_layout.numpy() != 0
    squares = dense(lstm.weight_hh.detach(), lstm._recurrent.index).numpy() ** 2
    if input_kind == "shared":
        squares = squares + dense(lstm.weight_ih.detach(), lstm._recurrent.index).numpy() ** 2
    expected = np.sqrt(squares.reshape(HB, BS, 4 * HB, BS).sum(axis=(1, 3)))
    np.testing.assert_allclose(norms, expected, rtol=1e-6)
    assert (norms[~layout] == 0).all() and (norms[layout] > 0).all()
    with pytest.raises(TypeError, match="layer must be a bsmm.torch.BlockSparseLinear or BlockSparseLSTM"):
        dynamic.block_norms(torch.nn.Linear(4, 4))


def test_a_compiled_lstm_follows_layout_changes_with_no_recompilation():
    """SET on a compiled LSTM (shared layout): one set of frames over three updates, and after each the compiled
    layer equals a fresh one built with the new layout and the moved weights; remove() gives content keys back,
    and a plain layer's load keeps content keys."""
    from torch._dynamo.testing import CompileCounter

    lstm = make_lstm("shared", dtype=torch.float32)
    optimizer = torch.optim.SGD(lstm.parameters(), lr=0.05)
    sparsity = bt.DynamicSparsity(lstm, optimizer, criterion="set", drop_fraction=0.2, every=1, schedule="constant")
    assert "/moving-" in lstm._recurrent.key and lstm._input is lstm._recurrent
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(lstm, backend=counter)
    x, h0, c0 = (t.float() for t in problem())
    frames = None
    for _ in range(3):
        compiled(x, (h0, c0))[0].square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        fresh = bt.BlockSparseLSTM(HIDDEN, HIDDEN, lstm.recurrent_layout.numpy(), block_size=BS,
                                   input_layout="recurrent")
        fresh.load_state_dict(lstm.state_dict())
        torch.testing.assert_close(compiled(x, (h0, c0))[0].detach(), fresh(x, (h0, c0))[0].detach())
        frames = counter.frame_count if frames is None else frames
        assert counter.frame_count == frames
        assert "/moving-" not in fresh._recurrent.key  # (built with the layout: a content key)
    assert len(sparsity.history) == 3
    sparsity.remove()
    assert lstm._recurrent.key == bt.registry.layout_key(lstm._recurrent.index) and lstm._input is lstm._recurrent


def test_invalidate_forgets_free_sets_and_held_ones_on_release():
    graphs = lstm_steps.SequenceGraphs()
    key = lstm_steps.SetKey(2, 1, torch.float32, torch.device("cpu"), 0, False, 0)
    free, held = (lstm_steps.StepBuffers(2, 1, 8, torch.float32, torch.device("cpu"), False) for _ in range(2))
    held.owner = 7
    graphs._sets[key] = [free, held]
    assert (graphs.free_sets(), graphs.held_sets()) == (1, 1)
    graphs.invalidate()
    graphs._release(held, 7)
    assert (graphs.free_sets(), graphs.held_sets()) == (0, 0)


@pytest.mark.gpu
def test_gpu_change_then_forward_equals_a_fresh_layer():
    """The graphs captured for the old layout are not replayed: after a change, outputs and gradients equal a
    fresh layer's built with the new layout and the moved weights, through training steps."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cuda = torch.device("cuda")
    lstm = make_lstm("shared", dtype=torch.float32, device=cuda)
    x, h0, c0 = (t.float().to(cuda) for t in problem())
    for _ in range(3):  # launched, then captured, then replayed
        run(lstm, x, h0, c0)
    weight_hh = lstm.weight_hh.data_ptr()
    dynamic.change_layout(lstm, another_layout(lstm))
    assert lstm.weight_hh.data_ptr() == weight_hh  # (the graphs' key alone would not tell the layouts apart)
    fresh = bt.BlockSparseLSTM(HIDDEN, HIDDEN, lstm.recurrent_layout.cpu().numpy(), block_size=BS,
                               input_layout="recurrent", device=cuda)
    fresh.load_state_dict(lstm.state_dict())
    for _ in range(3):
        results = []
        for layer in (lstm, fresh):
            for p in layer.parameters():
                p.grad = None
            results.append([run(layer, x, h0, c0), *(p.grad for p in layer.parameters())])
        for index, (a, b) in enumerate(zip(*results)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), index

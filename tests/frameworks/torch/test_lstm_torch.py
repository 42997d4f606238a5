"""bsmm.torch.BlockSparseLSTM against torch.nn.LSTM (dense layouts) and a masked dense LSTM (sparse ones).

Two independent references, neither of which calls bsmm: ``torch.nn.LSTM`` in float64 on the
CPU, fed the layer's weights moved into its gate order and orientation (its ``weight_ih_l0`` is
``Wx.T`` with the gate blocks i, f, g, o; bsmm's columns are i, f, o, g), and a float64 LSTM
written out step by step below with the layer's block data placed by ``reference.dense_weight``.
Outputs, final states and the gradients of the input, ``h0``, ``c0`` and every parameter are
compared norm-wise (``reference.rel_error``). Half-precision runs are compared with the
reference fed the same rounded weights, inputs and states. CUDA cases carry the ``gpu`` marker.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bsmm.torch tests skipped")

import bsmm.torch as bt  # noqa: E402
import bsmm.torch.lstm_sequence as torch_lstm  # noqa: E402
from bsmm.layouts.small_world import small_world_layout  # noqa: E402
from reference import (  # noqa: E402
    dense_to_present_blocks, dense_weight, random_layout, rel_error, skewed_layout, tolerance,
)
import torch_cases  # noqa: E402
from torch_cases import cuda_or_skip, eager_and_compiled  # noqa: E402

device = torch_cases.device  # the fixture (tests take it by name)

TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}
#: Norm-wise relative error allowed: one pass's (``reference.tolerance``). Measured on the CPU over these
#: sequences (T <= 5): 1.2e-15 (float64), 3.6e-7 (float32), 4.9e-4 (float16), 3.6e-3 (bfloat16).
#: bsmm's gate columns (i, f, o, g) taken from torch.nn.LSTM's gate rows (i, f, g, o), and back: a swap.
TORCH_GATE_ORDER = (0, 1, 3, 2)


def gate_permutation(hidden: int) -> np.ndarray:
    """Indices of the 4H gate features that move one order of gates into the other (an involution)."""
    return np.concatenate([np.arange(q * hidden, (q + 1) * hidden) for q in TORCH_GATE_ORDER])


def host(t) -> np.ndarray:
    """A float64 NumPy copy of a tensor (NumPy arrays pass through)."""
    if isinstance(t, np.ndarray):
        return t.astype(np.float64)
    return t.detach().cpu().double().numpy()


def full_layout(layout, hidden_blocks: int) -> np.ndarray:
    """A per-gate layout tiled over the four gates; an all-gates layout as it is."""
    layout = np.asarray(layout)
    return np.tile(layout, (1, 4)) if layout.shape[1] == hidden_blocks else layout


# -- the float64 references ----------------------------------------------------------------------------------
def sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def reference_lstm(wx, wh, b, x, h0, c0, d_out, d_h, d_c):
    """Forward and backward of a dense LSTM (T, N, ·), gate columns (i, f, o, g), in float64 NumPy."""
    steps, hidden = x.shape[0], wh.shape[0]
    h, c, acts = [h0], [c0], []
    for t in range(steps):
        z = x[t] @ wx + h[-1] @ wh + b
        i, f, o = (sigmoid(z[:, q * hidden:(q + 1) * hidden]) for q in range(3))
        g = np.tanh(z[:, 3 * hidden:])
        c.append(f * c[-1] + i * g)
        h.append(o * np.tanh(c[-1]))
        acts.append((i, f, o, g))
    grads = {"x": np.zeros_like(x), "wx": np.zeros_like(wx), "wh": np.zeros_like(wh), "b": np.zeros_like(b)}
    dh_next, dc_next = d_h.copy(), d_c.copy()
    for t in reversed(range(steps)):
        i, f, o, g = acts[t]
        dh = d_out[t] + dh_next
        tanh_c = np.tanh(c[t + 1])
        dc = dc_next + dh * o * (1 - tanh_c**2)
        dz = np.concatenate([dc * g * i * (1 - i), dc * c[t] * f * (1 - f), dh * tanh_c * o * (1 - o),
                             dc * i * (1 - g**2)], axis=1)
        grads["x"][t] = dz @ wx.T
        grads["wx"] += x[t].T @ dz
        grads["wh"] += h[t].T @ dz
        grads["b"] += dz.sum(axis=0)
        dh_next, dc_next = dz @ wh.T, dc * f
    return {"output": np.stack(h[1:]), "h_n": h[-1], "c_n": c[-1], "dx": grads["x"], "dwx": grads["wx"],
            "dwh": grads["wh"], "db": grads["b"], "dh0": dh_next, "dc0": dc_next}


def run_layer(lstm, x, h0, c0, d_out, d_h, d_c, names=("weight_ih", "weight_hh", "bias")):
    """Outputs and gradients of ``lstm`` (or of an nn.LSTM, its parameters' ``names`` given) for host
    data in the layout the layer takes; the upstream gradients are float64."""
    parameters = [getattr(lstm, name) for name in names]
    device, dtype = parameters[0].device, parameters[0].dtype
    x, h0, c0 = (torch.tensor(a, dtype=dtype, device=device, requires_grad=True) for a in (x, h0, c0))
    output, (h_n, c_n) = lstm(x, (h0[None], c0[None]))
    loss = sum((result.double() * torch.tensor(upstream, device=device)).sum()
               for result, upstream in ((output, d_out), (h_n[0], d_h), (c_n[0], d_c)))
    loss.backward()
    return {"output": output, "h_n": h_n[0], "c_n": c_n[0], "dx": x.grad, "dh0": h0.grad, "dc0": c0.grad,
            "dwx": parameters[0].grad, "dwh": parameters[1].grad, "db": parameters[2].grad}


def random_problem(rng, steps, n, input_size, hidden):
    """x, h0, c0 and the upstream gradients of output, h_n and c_n: standard normal, float64."""
    return (rng.standard_normal((steps, n, input_size)), rng.standard_normal((n, hidden)),
            rng.standard_normal((n, hidden)), rng.standard_normal((steps, n, hidden)),
            rng.standard_normal((n, hidden)), rng.standard_normal((n, hidden)))


def rounded(array, dtype):
    """``array`` rounded to ``dtype`` and back to float64 (what the layer multiplies with)."""
    return torch.tensor(array).to(TORCH_DTYPES[dtype]).double().numpy()


def check_errors(actual: dict, expected: dict, dtype: str, what: str) -> None:
    errors = {key: rel_error(host(actual[key]), expected[key]) for key in expected}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance(dtype), f"{what} {dtype}: {worst} off by {errors[worst]:.3g}; {errors}"


def skip_float64_on_cuda(device, dtype):
    if device == "cuda" and dtype == "float64":
        pytest.skip("bsmm runs float64 on the CPU only (tested as refused below)")


# -- dense layouts: torch.nn.LSTM -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("sparse_input", [True, False])
@pytest.mark.parametrize("n,batch_first", [(3, False), (1, True), (4, True)])
def test_dense_layout_matches_torch_lstm(device, dtype, sparse_input, n, batch_first):
    """All blocks present: the layer is torch.nn.LSTM with its weights moved across (rectangular I != H)."""
    skip_float64_on_cuda(device, dtype)
    rng = np.random.default_rng(1)
    input_size, hidden, bs, steps = 24, 16, 8, 5
    reference = torch.nn.LSTM(input_size, hidden, batch_first=batch_first, dtype=torch.float64)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.copy_(torch.from_numpy(rng.standard_normal(parameter.shape) * 0.5))
    gates = gate_permutation(hidden)
    wx = host(reference.weight_ih_l0)[gates].T  # (I, 4H), bsmm's gate order
    wh = host(reference.weight_hh_l0)[gates].T
    b = host(reference.bias_ih_l0 + reference.bias_hh_l0)[gates]
    input_layout, recurrent_layout = np.ones((3, 8)), np.ones((2, 8))
    lstm = bt.BlockSparseLSTM(input_size, hidden, recurrent_layout, bs, batch_first=batch_first,
                              input_layout=input_layout if sparse_input else None, device=device,
                              dtype=TORCH_DTYPES[dtype])
    with torch.no_grad():
        lstm.weight_ih.copy_(torch.from_numpy(dense_to_present_blocks(input_layout, wx, bs) if sparse_input else wx))
        lstm.weight_hh.copy_(torch.from_numpy(dense_to_present_blocks(recurrent_layout, wh, bs)))
        lstm.bias.copy_(torch.from_numpy(b))

    x, h0, c0, d_out, d_h, d_c = random_problem(rng, steps, n, input_size, hidden)
    layout_x = x.transpose(1, 0, 2) if batch_first else x  # as both modules take it
    layout_d_out = d_out.transpose(1, 0, 2) if batch_first else d_out
    expected = run_layer(reference, layout_x, h0, c0, layout_d_out, d_h, d_c,
                         ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0"))
    actual = run_layer(lstm, layout_x, h0, c0, layout_d_out, d_h, d_c)
    assert actual["output"].shape == expected["output"].shape
    assert actual["output"].dtype == TORCH_DTYPES[dtype] and actual["dx"].dtype == TORCH_DTYPES[dtype]
    # torch.nn.LSTM's weight gradients in bsmm's orientation and order; both its biases get db.
    expected["dwx"] = host(expected["dwx"])[gates].T
    expected["dwh"] = host(expected["dwh"])[gates].T
    assert rel_error(host(reference.bias_ih_l0.grad), host(reference.bias_hh_l0.grad)) <= 1e-14
    expected["db"] = host(expected["db"])[gates]
    dwx = host(actual["dwx"])
    actual["dwx"] = dense_weight(input_layout, dwx, bs) if sparse_input else dwx
    actual["dwh"] = dense_weight(recurrent_layout, host(actual["dwh"]), bs)
    check_errors(actual, {key: host(value) for key, value in expected.items()}, dtype, "nn.LSTM")


# -- sparse layouts: a masked dense LSTM ----------------------------------------------------------------------
def make_case(name, rng):
    """(input_size, hidden_size, block size, constructor keywords, T, N)."""
    if name == "random":  # 3 x 5 input blocks, 5 x 5 recurrent
        return 24, 40, 8, {"input_layout": random_layout(rng, 3, 5, 0.5),
                           "recurrent_layout": random_layout(rng, 5, 5, 0.5)}, 4, 3
    if name == "skewed":  # empty and dense block rows and columns, one layout per gate
        layouts = {"input_layout": skewed_layout(rng, 4, 16), "recurrent_layout": skewed_layout(rng, 4, 16)}
        return 32, 32, 8, layouts, 3, 2
    if name == "n1_t1":
        return 16, 16, 16, {"input_layout": np.ones((1, 1)), "recurrent_layout": np.ones((1, 1))}, 1, 1
    if name == "dense_input_odd":  # a dense Wx takes any input size
        return 7, 16, 8, {"recurrent_layout": random_layout(rng, 2, 8, 0.6)}, 3, 3
    if name == "empty_recurrent":  # no recurrent blocks at all: every step sees only its input
        return 16, 16, 8, {"recurrent_layout": np.zeros((2, 2))}, 3, 2
    if name == "small_world":
        return 64, 64, 8, {"density": 0.4, "seed": 3, "input_layout": "recurrent"}, 5, 4
    raise AssertionError(name)


SPARSE_CASES = ("random", "skewed", "n1_t1", "dense_input_odd", "empty_recurrent", "small_world")


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", SPARSE_CASES)
def test_sparse_layout_matches_masked_dense_lstm(device, dtype, case):
    skip_float64_on_cuda(device, dtype)
    rng = np.random.default_rng(2)
    input_size, hidden, bs, options, steps, n = make_case(case, rng)
    torch.manual_seed(2)
    lstm = bt.BlockSparseLSTM(input_size, hidden, block_size=bs, device=device, dtype=TORCH_DTYPES[dtype], **options)
    with torch.no_grad():
        lstm.bias.uniform_(-1, 1)  # (the initial bias is as small as the weights)
    recurrent_layout = host(lstm.recurrent_layout)
    if "recurrent_layout" in options:
        assert np.array_equal(recurrent_layout, full_layout(options["recurrent_layout"] != 0, hidden // bs))
    wh = dense_weight(recurrent_layout, host(lstm.weight_hh), bs)
    if lstm.input_layout is None:
        wx = host(lstm.weight_ih)
    else:
        wx = dense_weight(host(lstm.input_layout), host(lstm.weight_ih), bs)
    x, h0, c0, d_out, d_h, d_c = random_problem(rng, steps, n, input_size, hidden)
    x, h0, c0 = (rounded(a, dtype) for a in (x, h0, c0))
    expected = reference_lstm(wx, wh, host(lstm.bias), x, h0, c0, d_out, d_h, d_c)
    actual = run_layer(lstm, x, h0, c0, d_out, d_h, d_c)
    if lstm.input_layout is not None:
        actual["dwx"] = dense_weight(host(lstm.input_layout), host(actual["dwx"]), bs)
        expected["dwx"] *= dense_weight(host(lstm.input_layout), np.ones(lstm.weight_ih.shape), bs)
    actual["dwh"] = dense_weight(recurrent_layout, host(actual["dwh"]), bs)
    expected["dwh"] *= dense_weight(recurrent_layout, np.ones(lstm.weight_hh.shape), bs)  # present blocks only
    assert actual["output"].dtype == TORCH_DTYPES[dtype] and actual["dwh"].dtype == np.float64
    check_errors(actual, expected, dtype, case)


def test_gradcheck_float64():
    """torch.autograd.gradcheck (finite differences, default tolerances) over every input and parameter."""
    torch.manual_seed(3)
    lstm = bt.BlockSparseLSTM(16, 16, np.array([[1, 0], [1, 1]]), 8, input_layout=np.array([[0, 1], [1, 1]]),
                              dtype=torch.float64)
    x, h0, c0 = (torch.randn(shape, dtype=torch.float64, requires_grad=True) for shape in ((3, 2, 16), (1, 2, 16),
                                                                                            (1, 2, 16)))
    parameters = (lstm.weight_ih, lstm.weight_hh, lstm.bias)

    def function(x, h0, c0, weight_ih, weight_hh, bias):
        output, (h_n, c_n) = torch.func.functional_call(
            lstm, {"weight_ih": weight_ih, "weight_hh": weight_hh, "bias": bias}, (x, (h0, c0)))
        return output, h_n, c_n

    assert torch.autograd.gradcheck(function, (x, h0, c0, *(p.detach().requires_grad_() for p in parameters)))


# -- the structure of a sequence's passes ---------------------------------------------------------------------
def test_one_pass_for_the_input_and_one_updat_per_weight(monkeypatch):
    """x·Wx, dx and dWx: one pass each over all T·N rows; per step one fprop and one bprop of N rows
    with Wh; dWh: one updat over the stacked states h_0 ... h_{T-1} into one buffer, equal to the
    sum of the per-step products h_{t-1}ᵀ·dz_t."""
    steps, n, size, bs = 5, 2, 16, 8
    torch.manual_seed(4)
    lstm = bt.BlockSparseLSTM(size, size, np.eye(2), bs, input_layout=np.ones((2, 2)))
    calls, operands = [], {}
    run_on = torch_lstm.run_on

    def spy(op, pass_name, a, b, key):
        which = "recurrent" if key == lstm._recurrent.key else "input"
        calls.append((which, pass_name, tuple(a.shape), tuple(b.shape)))
        operands[which, pass_name] = (a.clone(), b.clone())
        return run_on(op, pass_name, a, b, key)

    monkeypatch.setattr(torch_lstm, "run_on", spy)
    x = torch.randn(steps, n, size, requires_grad=True)
    h0 = torch.randn(1, n, size, requires_grad=True)
    output, _ = lstm(x, (h0, torch.zeros(1, n, size)))
    output.square().sum().backward()
    rows, wide, w_hh, w_ih = steps * n, 4 * size, tuple(lstm.weight_hh.shape), tuple(lstm.weight_ih.shape)
    assert calls == [
        ("input", "fprop", (rows, size), w_ih),
        *[("recurrent", "fprop", (n, size), w_hh)] * steps,
        *[("recurrent", "bprop", (n, wide), w_hh)] * steps,
        ("recurrent", "updat", (rows, size), (rows, wide)),
        ("input", "bprop", (rows, wide), w_ih),
        ("input", "updat", (rows, size), (rows, wide)),
    ]
    h_in, dz = (host(t) for t in operands["recurrent", "updat"])
    assert np.array_equal(h_in, np.concatenate([host(h0[0]), host(output[:-1]).reshape(-1, size)]))
    layout = host(lstm.recurrent_layout)
    per_step = sum(dense_to_present_blocks(layout, h_in[t * n:(t + 1) * n].T @ dz[t * n:(t + 1) * n], bs)
                   for t in range(steps))
    assert rel_error(host(lstm.weight_hh.grad), per_step) <= 1e-6


# -- construction ---------------------------------------------------------------------------------------------
def test_small_world_layout_from_density():
    """density and seed make the symmetric small-world graph of bsmm.layouts, tiled once per gate."""
    lstm = bt.BlockSparseLSTM(64, 64, block_size=8, density=0.5, seed=5, input_layout="recurrent")
    graph = small_world_layout(8, 32, seed=5)
    assert np.array_equal(host(lstm.recurrent_layout), np.tile(graph, (1, 4)))
    assert np.array_equal(host(lstm.input_layout), host(lstm.recurrent_layout))
    assert int(graph.sum()) == 32 and np.array_equal(graph, graph.T)
    again = bt.BlockSparseLSTM(64, 64, block_size=8, density=0.5, seed=5, kind="watts_strogatz")
    assert lstm.input_layout is not None and again.input_layout is None
    assert np.array_equal(host(again.recurrent_layout), np.tile(small_world_layout(8, 32, "watts_strogatz", 5), (1, 4)))
    assert tuple(lstm.weight_hh.shape) == tuple(lstm.weight_ih.shape) == (4 * 32, 8, 8)
    assert lstm.bias.shape == (256,) and tuple(again.weight_ih.shape) == (64, 256)
    full = bt.BlockSparseLSTM(16, 32, block_size=8)
    assert host(full.recurrent_layout).all() and tuple(full.weight_hh.shape) == (4 * 16, 8, 8)


def test_initialization_follows_torch_lstm_with_the_true_fan_in():
    """U(-1/sqrt(fan_in_k), 1/sqrt(fan_in_k)) per gate column k: nn.LSTM's 1/sqrt(H) for a dense layout."""
    torch.manual_seed(6)
    dense = bt.BlockSparseLSTM(32, 64, block_size=8, dtype=torch.float64)
    for parameter in dense.parameters():
        bound = float(parameter.detach().abs().max())
        assert 0.9 / 8 < bound <= 1 / 8, bound  # 1/sqrt(64)
    layout = np.zeros((4, 4))
    layout[:, 0] = 1  # block column 0 hears all 4 blocks, the others only the diagonal
    layout[np.arange(4), np.arange(4)] = 1
    sparse = bt.BlockSparseLSTM(32, 32, layout, 8, input_layout=np.ones((4, 4)), dtype=torch.float64)
    full = np.tile(layout, (1, 4))
    fan_in = full.sum(axis=0) * 8
    for weight, weight_layout in ((sparse.weight_hh, full), (sparse.weight_ih, np.ones((4, 16)))):
        blocks = np.nonzero(weight_layout)[1]  # block column of each stored block
        for column in range(16):
            bound = float(weight.detach()[blocks == column].abs().max())
            assert 0.8 / np.sqrt(fan_in[column]) < bound <= 1 / np.sqrt(fan_in[column]), (column, bound)
    bias = host(sparse.bias).reshape(16, 8)
    assert (np.abs(bias).max(axis=1) <= 1 / np.sqrt(fan_in)).all()
    assert sparse.input_layout is not None and sparse.bias.dtype == torch.float64


def test_shapes_are_those_of_torch_lstm():
    """Unbatched, batch-first and time-major inputs, with and without hx, no bias."""
    torch.manual_seed(7)
    for batch_first in (False, True):
        lstm = bt.BlockSparseLSTM(8, 16, np.eye(2), 8, bias=False, batch_first=batch_first)
        reference = torch.nn.LSTM(8, 16, bias=False, batch_first=batch_first)
        assert lstm.bias is None
        batched = (3, 4, 8) if batch_first else (4, 3, 8)  # T = 4 steps, N = 3
        for shape, state in ((batched, (1, 3, 16)), ((4, 8), (1, 16))):
            x = torch.randn(shape)
            hx = (torch.randn(state), torch.randn(state))
            for args in ((x,), (x, hx)):
                (output, (h_n, c_n)), (expected, (h_e, c_e)) = lstm(*args), reference(*args)
                assert output.shape == expected.shape and h_n.shape == h_e.shape and c_n.shape == c_e.shape
                last = output[:, -1] if batch_first and len(shape) == 3 else output[-1]
                assert torch.equal(last, h_n[0])


def test_outputs_can_be_changed_in_place_and_gradients_accumulate():
    """output, h_n and c_n are fresh tensors (not views of what backward reads); two backwards add up."""
    torch.manual_seed(8)
    lstm = bt.BlockSparseLSTM(16, 16, np.eye(2), 8, dtype=torch.float64)
    x = torch.randn(3, 2, 16, dtype=torch.float64)
    output, (h_n, c_n) = lstm(x)
    loss = output.sum() + h_n.sum() + c_n.sum()
    loss.backward()
    first = [p.grad.clone() for p in lstm.parameters()]
    output, (h_n, c_n) = lstm(x)
    h_n.mul_(2)
    c_n.mul_(2)
    (output.sum() + h_n.sum() / 2 + c_n.sum() / 2).backward()
    for before, parameter in zip(first, lstm.parameters()):
        assert rel_error(host(parameter.grad), 2 * host(before)) <= 1e-12
    with torch.no_grad():
        output, _ = lstm(x)
    assert not output.requires_grad and output.shape == (3, 2, 16)


def compiled_against_eager(device, dtype=torch.float32):
    """A model around the layer, eager and ``torch.compile(fullgraph=True)``'d (no graph break at the
    layer: its sequence is the operators bsmm::lstm_forward and bsmm::lstm_backward): loss and every
    gradient over three steps, and the number of compiles."""
    torch.manual_seed(12)
    lstm = bt.BlockSparseLSTM(16, 16, np.array([[1, 1], [0, 1]]), 8, device=device, dtype=dtype)
    head = torch.nn.Linear(16, 3, device=device, dtype=dtype)
    xs = [torch.randn(3, 2, 16, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    c0 = torch.randn(1, 2, 16, device=device, dtype=dtype, requires_grad=True)

    def loss(x):
        output, (h_n, c_n) = lstm(x, (torch.zeros_like(c0), c0))
        return head(torch.relu(output)).square().sum() + c_n.sum()

    def step(run, x):
        lstm.zero_grad()
        x.grad = c0.grad = None
        value = run(x)
        value.backward()
        return [value.detach(), x.grad, c0.grad, *(p.grad.clone() for p in lstm.parameters())]

    return eager_and_compiled(loss, xs, step)


def test_torch_compile_traces_the_sequence_without_a_graph_break():
    pairs, graphs = compiled_against_eager("cpu")
    assert graphs == 1  # one graph for three calls: no recompile
    for eager, compiled in pairs:
        for a, b in zip(eager, compiled):
            assert rel_error(host(b), host(a)) <= 1e-6


def test_sequence_operators_pass_opcheck():
    """bsmm::lstm_forward and bsmm::lstm_backward: schemas, fake kernels and no aliasing (torch.library.opcheck)."""
    torch.manual_seed(3)
    lstm = bt.BlockSparseLSTM(16, 16, np.array([[1, 1], [0, 1]]), 8, input_layout=np.ones((2, 2)))
    x, h0, c0 = torch.randn(3, 2, 16), torch.randn(2, 16), torch.randn(2, 16)
    keys = (lstm._recurrent.key, lstm._input.key, False)
    forward = (x, h0, c0, lstm.weight_ih.detach(), lstm.weight_hh.detach(), lstm.bias.detach(), *keys)
    torch.library.opcheck(torch.ops.bsmm.lstm_forward.default, forward, test_utils=("test_schema", "test_faketensor"))
    out, cells, gates = torch.ops.bsmm.lstm_forward(*forward)
    for needs in ([True] * 6, [False, True, False, True, True, False]):
        backward = (x, h0, *forward[3:5], out, cells, gates, torch.randn_like(out), torch.randn_like(h0),
                    torch.randn_like(c0), *keys, needs)
        torch.library.opcheck(torch.ops.bsmm.lstm_backward.default, backward,
                              test_utils=("test_schema", "test_faketensor"))
        grads = torch.ops.bsmm.lstm_backward(*backward)
        assert [g.numel() > 0 for g in grads] == needs


def test_to_dense_weights_and_repr():
    torch.manual_seed(9)
    lstm = bt.BlockSparseLSTM(16, 16, np.array([[1, 0], [0, 1]]), 8, input_layout=np.array([[1, 1], [0, 1]]))
    wx, wh = lstm.to_dense_weights()
    assert np.array_equal(host(wh), dense_weight(np.tile(np.eye(2), (1, 4)), host(lstm.weight_hh), 8))
    assert np.array_equal(host(wx), dense_weight(np.tile([[1, 1], [0, 1]], (1, 4)), host(lstm.weight_ih), 8))
    wh.sum().backward()
    assert torch.equal(lstm.weight_hh.grad, torch.ones_like(lstm.weight_hh))
    assert repr(lstm) == "BlockSparseLSTM(16, 16, block_size=8, recurrent_density=0.5, input_density=0.75, bias=True)"
    dense_input = bt.BlockSparseLSTM(7, 16, block_size=8, batch_first=True, tf32=True)
    assert repr(dense_input) == ("BlockSparseLSTM(7, 16, block_size=8, recurrent_density=1, input_density=dense, "
                                 "bias=True, batch_first=True, tf32=True)")
    assert dense_input.to_dense_weights()[0] is dense_input.weight_ih


def test_state_dict_pickle_and_deepcopy():
    torch.manual_seed(10)
    lstm = bt.BlockSparseLSTM(16, 16, block_size=8, density=0.75, seed=1, input_layout="recurrent")
    x = torch.randn(3, 2, 16)
    expected = lstm(x)[0]
    state = lstm.state_dict()
    assert set(state) == {"weight_ih", "weight_hh", "bias", "recurrent_layout", "input_layout"}
    rebuilt = bt.BlockSparseLSTM(16, 16, state["recurrent_layout"], 8, input_layout=state["input_layout"])
    rebuilt.load_state_dict(state)
    buffer = io.BytesIO()
    torch.save(lstm, buffer)
    buffer.seek(0)
    for other in (rebuilt, copy.deepcopy(lstm), pickle.loads(pickle.dumps(lstm)),
                  torch.load(buffer, weights_only=False)):
        assert torch.equal(other(x)[0], expected)


@pytest.mark.parametrize("other,match", [
    ({"recurrent_layout": np.eye(2)}, r"recurrent_layout: the state_dict holds a layout of shape \(2, 8\) with 12 "
                                      r"blocks, this BlockSparseLSTM has a layout of shape \(2, 8\) with 8 blocks; "
                                      r"build the layer with the saved layouts"),
    # (a moved layout of as many blocks is adopted, bsmm.torch.dynamic_lstm; not with a shared Wx saved dense)
    ({"recurrent_layout": np.array([[1, 0], [1, 1]]), "input_layout": "recurrent"},
     r"with 12 blocks, this BlockSparseLSTM has a layout of shape \(2, 8\) with 12 blocks in other places"),
    ({"recurrent_layout": np.array([[1, 1], [0, 1]]), "input_layout": np.ones((2, 2))},
     r"input_layout: the state_dict holds none \(a dense Wx\), this BlockSparseLSTM has a layout of shape \(2, 8\)"),
])
def test_state_dict_of_another_layout_is_refused(other, match):
    saved = bt.BlockSparseLSTM(16, 16, np.array([[1, 1], [0, 1]]), 8).state_dict()
    with pytest.raises(RuntimeError, match=match):
        bt.BlockSparseLSTM(16, 16, block_size=8, **other).load_state_dict(saved)


# -- errors ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,kwargs,error,match", [
    ((16, 20), {"block_size": 8}, ValueError, r"hidden_size must be a multiple of block_size \(8\); got 20"),
    ((0, 16), {"block_size": 8}, ValueError, "input_size must be >= 1; got 0"),
    ((16, 16), {"block_size": 12}, ValueError, "block_size must be one of"),
    ((16, 16, np.ones((2, 3))), {"block_size": 8}, ValueError,
     r"recurrent_layout must have shape \(2, 2\) \(one gate, tiled\) or \(2, 8\) \(all gates\); got \(2, 3\)"),
    ((16, 16), {"block_size": 8, "input_layout": np.ones((3, 2))}, ValueError,
     r"input_layout must have shape \(2, 2\) \(one gate, tiled\) or \(2, 8\) \(all gates\); got \(3, 2\)"),
    ((12, 16), {"block_size": 8, "input_layout": np.ones((2, 2))}, ValueError,
     r"input_size must be a multiple of block_size \(8\) for a sparse input_layout; got 12"),
    ((8, 16), {"block_size": 8, "input_layout": "recurrent"}, ValueError,
     "input_layout='recurrent' needs input_size == hidden_size; got 8 and 16"),
    ((16, 16), {"block_size": 8, "input_layout": "same"}, ValueError,
     "input_layout must be None, 'recurrent' or a layout; got 'same'"),
    ((16, 16, np.eye(2)), {"block_size": 8, "density": 0.5}, ValueError, "pass recurrent_layout or density, not both"),
    ((16, 16), {"block_size": 8, "density": 0.0}, ValueError, r"density must be in \(0, 1\]; got 0.0"),
    ((16, 16), {"block_size": 8, "density": "half"}, TypeError, r"density must be a real number in \(0, 1\]; got str"),
    ((32, 32), {"block_size": 8, "density": 0.5, "kind": "ring"}, ValueError, "kind must be 'barabasi_albert'"),
    ((16, 16), {"block_size": 8, "dtype": torch.int32}, TypeError, "dtype has dtype torch.int32; supported dtypes"),
])
def test_constructor_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        bt.BlockSparseLSTM(*args, **kwargs)


def test_call_errors():
    lstm = bt.BlockSparseLSTM(16, 16, np.eye(2), 8)
    x = torch.randn(3, 2, 16)
    cases = [
        ((np.zeros((3, 2, 16)),), TypeError, "input must be a torch.Tensor; got ndarray"),
        ((torch.randn(3, 2, 8),), ValueError, r"input must have shape \(T, N, 16\) or \(T, 16\) with T, N >= 1; "
                                              r"got \(3, 2, 8\)"),
        ((torch.randn(0, 2, 16),), ValueError, r"with T, N >= 1; got \(0, 2, 16\)"),
        ((torch.randn(2, 3, 2, 16),), ValueError, r"got \(2, 3, 2, 16\)"),
        ((x.double(),), TypeError, "input has dtype torch.float64 but weight_hh has torch.float32"),
        ((x.int(),), TypeError, "input has dtype torch.int32; supported dtypes"),
        ((x, torch.zeros(1, 2, 16)), TypeError, r"hx must be a tuple \(h0, c0\); got Tensor"),
        ((x, (torch.zeros(2, 16), torch.zeros(1, 2, 16))), ValueError,
         r"h0 must have shape \(1, 2, 16\) for this input; got \(2, 16\)"),
        ((x, (torch.zeros(1, 2, 16), torch.zeros(1, 3, 16))), ValueError,
         r"c0 must have shape \(1, 2, 16\) for this input; got \(1, 3, 16\)"),
        ((x, (torch.zeros(1, 2, 16), np.zeros((1, 2, 16)))), TypeError, "c0 must be a torch.Tensor; got ndarray"),
        ((x, (torch.zeros(1, 2, 16, dtype=torch.float64), torch.zeros(1, 2, 16))), TypeError,
         "h0 has dtype torch.float64 but input has torch.float32"),
        ((x[0], (torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))), ValueError,
         r"h0 must have shape \(1, 16\) for this input; got \(1, 2, 16\)"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            lstm(*args)
    batch_first = bt.BlockSparseLSTM(16, 16, np.eye(2), 8, batch_first=True)
    with pytest.raises(ValueError, match=r"input must have shape \(N, T, 16\)"):
        batch_first(torch.randn(3, 2, 4))


# -- GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_refuses_float64_and_mixed_devices():
    cuda = cuda_or_skip()
    with pytest.raises(TypeError, match="dtype has dtype torch.float64, which bsmm runs only on the CPU; on cuda"):
        bt.BlockSparseLSTM(16, 16, np.eye(2), 8, device=cuda, dtype=torch.float64)
    lstm = bt.BlockSparseLSTM(16, 16, np.eye(2), 8, device=cuda)
    with pytest.raises(ValueError, match="input is on cpu but weight_hh is on cuda:0"):
        lstm(torch.randn(3, 2, 16))
    with pytest.raises(TypeError, match="input has dtype torch.float64, which bsmm runs only on the CPU"):
        lstm(torch.randn(3, 2, 16, device=cuda, dtype=torch.float64))
    with pytest.raises(ValueError, match="h0 is on cpu but input is on cuda:0"):
        lstm(torch.randn(3, 2, 16, device=cuda), (torch.zeros(1, 2, 16), torch.zeros(1, 2, 16, device=cuda)))


@pytest.mark.gpu
def test_gpu_matches_the_cpu_layer_through_training_steps():
    """The same layer on the CPU and on the GPU: outputs and gradients agree, and so do the outputs after
    three SGD steps (the GPU's float32 products are exact, as the CPU's)."""
    cuda = cuda_or_skip()
    torch.manual_seed(11)
    cpu = bt.BlockSparseLSTM(64, 64, block_size=8, density=0.3, seed=2, input_layout="recurrent")
    gpu = copy.deepcopy(cpu).to(cuda)
    x = torch.randn(6, 5, 64)
    runs = {}
    for name, lstm, data in (("cpu", cpu, x), ("gpu", gpu, x.to(cuda))):
        optimizer = torch.optim.SGD(lstm.parameters(), lr=0.5)
        runs[name] = []
        for _ in range(3):
            optimizer.zero_grad()
            output, (h_n, c_n) = lstm(data)
            (output.square().mean() + c_n.mean()).backward()
            runs[name].append([output, h_n, c_n, *(p.grad.clone() for p in lstm.parameters())])
            optimizer.step()
    for step, (on_cpu, on_gpu) in enumerate(zip(runs["cpu"], runs["gpu"])):
        for index, (a, b) in enumerate(zip(on_cpu, on_gpu)):
            assert rel_error(host(b), host(a)) <= 1e-5, (step, index)


# -- the fused cell on CUDA (cuda/bsmm_lstm_cell.cu) ------------------------------------------------------------
def poison_free_memory(cuda) -> None:
    """NaN into blocks that PyTorch's caching allocator then holds free: its small pool (tensors up to
    1 MiB) and its large one, which later ``torch.empty`` calls hand out again."""
    held = [torch.full((1 << 17,), float("nan"), device=cuda) for _ in range(64)]  # 512 KiB each
    held.append(torch.full((1 << 24,), float("nan"), device=cuda))  # 64 MiB
    del held


#: (hidden, block size, T, N): hidden 320 is two whole thread blocks of 128 units a row and a partial third;
#: 96 is one partial block; N = 1 and N = 33 (not a multiple of a tile) rows.
FUSED_SHAPES = [(320, 32, 4, 5), (96, 32, 3, 1), (128, 16, 2, 33)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("hidden,bs,steps,n", FUSED_SHAPES)
def test_fused_cell_matches_the_float64_reference_at_wide_layers(dtype, hidden, bs, steps, n):
    """The fused cell's forward and backward, every output and gradient, against the float64 LSTM; the
    allocator's free memory poisoned with NaN first, so that an element the kernels leave unwritten shows."""
    cuda = cuda_or_skip()
    rng = np.random.default_rng(hidden + n)
    torch.manual_seed(hidden)
    lstm = bt.BlockSparseLSTM(hidden, hidden, block_size=bs, density=0.3, seed=4, input_layout="recurrent",
                              device=cuda, dtype=TORCH_DTYPES[dtype])
    with torch.no_grad():
        lstm.bias.uniform_(-1, 1)
    layout, input_layout = host(lstm.recurrent_layout), host(lstm.input_layout)
    wh, wx = dense_weight(layout, host(lstm.weight_hh), bs), dense_weight(input_layout, host(lstm.weight_ih), bs)
    x, h0, c0, d_out, d_h, d_c = random_problem(rng, steps, n, hidden, hidden)
    x, h0, c0 = (rounded(a, dtype) for a in (x, h0, c0))
    expected = reference_lstm(wx, wh, host(lstm.bias), x, h0, c0, d_out, d_h, d_c)
    poison_free_memory(cuda)
    actual = run_layer(lstm, x, h0, c0, d_out, d_h, d_c)
    actual["dwx"] = dense_weight(input_layout, host(actual["dwx"]), bs)
    actual["dwh"] = dense_weight(layout, host(actual["dwh"]), bs)
    for name, mask in (("dwx", input_layout), ("dwh", layout)):
        expected[name] *= dense_weight(mask, np.ones(lstm.weight_hh.shape), bs)
    check_errors(actual, expected, dtype, f"fused H={hidden} N={n}")


@pytest.mark.gpu
def test_fused_cell_is_one_launch_a_step_each_way():
    """A step forward is the recurrent fprop and one cell kernel, backward one cell kernel and the
    recurrent bprop: no per-step element-wise operators of PyTorch."""
    cuda = cuda_or_skip()
    steps = 6
    lstm = bt.BlockSparseLSTM(64, 64, block_size=16, density=0.5, seed=0, input_layout="recurrent", device=cuda,
                              cuda_graphs=False)
    x = torch.randn(steps, 4, 64, device=cuda)
    lstm(x)[0].sum().backward()  # warm: kernels compiled and calls kept
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        output, _ = lstm(x)
        output.sum().backward()
        torch.cuda.synchronize()
    names = [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    cells = [name for name in names if "lstm_cell" in name]
    assert sum("lstm_cell_forward" in name for name in cells) == steps
    assert sum("lstm_cell_backward" in name for name in cells) == steps
    passes = [name for name in names if "bsmm_matmul" in name]
    # fprop of x and of each step; bprop of each step but the first (h0 and x need no gradient here);
    # updat of Wh and of Wx.
    assert len(passes) == 1 + steps + (steps - 1) + 2, passes
    # Everything else (state copies, casts, the bias sum, the output's copies) does not grow with T.
    assert len(names) - len(cells) - len(passes) <= 16, names


# -- the loops replayed from the layer's CUDA graphs (bsmm.torch.lstm_steps) -------------------------------------
def twin_layers(cuda, **options):
    """The same layer twice: replaying its loops from CUDA graphs, and launching them."""
    torch.manual_seed(5)
    kwargs = dict(block_size=32, density=0.3, seed=1, input_layout="recurrent", device=cuda, **options)
    graphed = bt.BlockSparseLSTM(128, 128, **kwargs)
    launched = bt.BlockSparseLSTM(128, 128, cuda_graphs=False, **kwargs)
    launched.load_state_dict(graphed.state_dict())
    return graphed, launched


def training_run(lstm, xs, h0, c0):
    """Outputs and gradients of a step per input, SGD in between (the weights change in place)."""
    optimizer = torch.optim.SGD(lstm.parameters(), lr=0.1)
    results = []
    for x in xs:
        optimizer.zero_grad()
        x = x.clone().requires_grad_(True)
        h = h0.clone().requires_grad_(True)
        output, (h_n, c_n) = lstm(x, (h, c0))
        (output.square().sum() + h_n.sum() + 2 * c_n.sum()).backward()
        results.append([output.detach().clone(), h_n.detach().clone(), c_n.detach().clone(), x.grad, h.grad,
                        *(p.grad.clone() for p in lstm.parameters())])
        optimizer.step()
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replays_equal_the_launched_loops_bit_for_bit(dtype):
    """Call 1 launches (and keeps the passes' calls), call 2 captures, calls 3 and 4 replay: every output and
    gradient equals the launched layer's exactly (the same kernels on the same data), through SGD steps."""
    cuda = cuda_or_skip()
    graphed, launched = twin_layers(cuda, dtype=TORCH_DTYPES[dtype])
    xs = [torch.randn(5, 3, 128, device=cuda, dtype=TORCH_DTYPES[dtype]) for _ in range(4)]
    h0 = torch.randn(1, 3, 128, device=cuda, dtype=TORCH_DTYPES[dtype])
    c0 = torch.randn(1, 3, 128, device=cuda, dtype=TORCH_DTYPES[dtype])
    for step, (a, b) in enumerate(zip(training_run(graphed, xs, h0, c0), training_run(launched, xs, h0, c0))):
        for index, (u, v) in enumerate(zip(a, b)):
            assert torch.equal(u, v), (step, index)
    gc.collect()
    assert graphed._graphs.free_sets() >= 1  # the sets came back once autograd let go of them


@pytest.mark.gpu
def test_graph_sets_of_forwards_alive_together_stay_apart():
    """Two forwards before their backwards (and one under no_grad between them) take sets of their own:
    each backward sees its own forward's states; an output handed out is never written again."""
    cuda = cuda_or_skip()
    graphed, launched = twin_layers(cuda)
    xs = [torch.randn(4, 2, 128, device=cuda) for _ in range(3)]
    for lstm in (graphed, launched):  # warm: kept calls (graphed: then captured on the next calls)
        lstm(xs[0])[0].sum().backward()
    results = {}
    for name, lstm in (("graphed", graphed), ("launched", launched)):
        for p in lstm.parameters():
            p.grad = None
        first, _ = lstm(xs[0])
        kept = first.detach().clone()
        second, _ = lstm(xs[1])
        with torch.no_grad():
            third, _ = lstm(xs[2])
        (second * 3).sum().backward()
        grads_second = [p.grad.clone() for p in lstm.parameters()]
        first.sum().backward()
        assert torch.equal(first.detach(), kept), name  # not overwritten by the later calls
        results[name] = [first.detach(), second.detach(), third, *grads_second, *(p.grad for p in lstm.parameters())]
    for index, (u, v) in enumerate(zip(results["graphed"], results["launched"])):
        assert torch.equal(u, v), index


@pytest.mark.gpu
def test_graphs_follow_replaced_weights_and_retained_graphs():
    cuda = cuda_or_skip()
    graphed, launched = twin_layers(cuda)
    x = torch.randn(3, 2, 128, device=cuda)
    for _ in range(2):
        for lstm in (graphed, launched):
            lstm(x)[0].sum().backward()
    replacement = torch.randn_like(graphed.weight_hh) * 0.05
    for lstm in (graphed, launched):  # Wh at a new address: the graphs of the old one must not be replayed
        lstm.weight_hh = torch.nn.Parameter(replacement.clone())
    outputs = []
    for lstm in (graphed, launched):
        for p in lstm.parameters():
            p.grad = None
        output, _ = lstm(x)
        loss = output.square().sum()
        loss.backward(retain_graph=True)
        loss.backward()  # twice through the retained graph: the gradients add up
        outputs.append([output.detach(), *(p.grad for p in lstm.parameters())])
    for index, (u, v) in enumerate(zip(*outputs)):
        assert torch.equal(u, v), index


@pytest.mark.gpu
def test_inside_a_user_cuda_graph_the_loops_are_captured_as_launches():
    """A training step the caller captures whole (the layer's own graphs are not nested in it) replays to
    the launched layer's results."""
    cuda = cuda_or_skip()
    graphed, launched = twin_layers(cuda)
    x = torch.randn(4, 2, 128, device=cuda)
    d_out = torch.randn(4, 2, 128, device=cuda)

    def step(lstm):
        for p in lstm.parameters():
            p.grad = None
        lstm(x)[0].backward(d_out)
        return [p.grad for p in lstm.parameters()]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(graphed)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(graphed)
    graph.replay()
    torch.cuda.synchronize()
    expected = step(launched)
    for u, v in zip(captured, expected):
        assert torch.equal(u, v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_compile_on_cuda_traces_the_sequence_without_a_graph_break(dtype):
    cuda_or_skip()
    pairs, graphs = compiled_against_eager("cuda", TORCH_DTYPES[dtype])
    assert graphs == 1
    for eager, compiled in pairs:
        for a, b in zip(eager, compiled):
            assert rel_error(host(b), host(a)) <= (1e-6 if dtype == "float32" else 2e-2)


@pytest.mark.gpu
def test_a_set_is_freed_by_its_backward_and_sets_made_for_inference_serve_training():
    """The usual loop keeps the last loss alive into the next forward: each backward frees its set anyway,
    so one set serves every step. A set first made under torch.inference_mode serves training later."""
    cuda = cuda_or_skip()
    graphed, _ = twin_layers(cuda)
    x = torch.randn(4, 2, 128, device=cuda)
    with torch.inference_mode():
        for _ in range(2):  # kept calls, then a set made (and captured) in inference mode
            graphed(x)
    loss = None
    for _ in range(4):
        loss = graphed(x)[0].square().sum()
        loss.backward()
        assert graphed._graphs.held_sets() == 0
    assert graphed._graphs.free_sets() == 1
    graphed._graphs.clear()
    assert graphed._graphs.free_sets() == 0

"""``bsmm.nn.lstm.BlocksparseLSTM`` against a float64 dense LSTM whose weights are masked by the layout.

The reference below is an explicit per-step loop in float64 NumPy that places
block data with ``reference.dense_weight`` (never bsmm's own ``to_dense``) and
writes out the LSTM equations and their derivatives by hand. The layer is
checked on the forward outputs and on every gradient: dx, dh0, dc0, dWx, dWh,
db. Half-precision runs are compared with the reference fed the same rounded
weights and inputs; what remains, one rounding of ``z``, ``h`` and ``dz`` per
step, stays within the single-pass tolerances of ``reference.py`` for these
short sequences (measured: about 1e-3 for float16, 7e-3 for bfloat16).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # an optional speed-up
    threadpool_limits = None

from bsmm.layouts.small_world import small_world_layout
from bsmm.nn.lstm import GATES, BlocksparseLSTM, DenseMatMul, gate_layout, small_world_lstm
from examples.char_lstm.optim import Adam, clip_by_global_norm, softmax_cross_entropy
from examples.char_lstm.text import (
    CharLanguageModel, char_corpus, corpus_files, corpus_text, evaluate_bpc, matched_models, stream_chunks, train,
)
from conftest import require_dtype, to_numpy, to_xp
from reference import (
    DTYPES, as_float64, dense_to_present_blocks, dense_weight, random_layout, rel_error, skewed_layout, tolerance,
)



# -- the reference --------------------------------------------------------------------------
def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def dense_matrix(op_layout, weights, bs):
    """Dense float64 weight (C, 4H) of one gate matrix; dense weights pass through."""
    if op_layout is None:
        return as_float64(weights)
    return dense_weight(op_layout, weights, bs)


def reference_lstm(wx, wh, b, x, h0, c0, dh, dh_T, dc_T):
    """Forward and backward of a dense LSTM, gate order (i, f, o, g), all in float64."""
    steps, n, _ = x.shape
    hidden = wh.shape[0]
    h, c, acts = [h0], [c0], []
    for t in range(steps):
        z = x[t] @ wx + h[-1] @ wh + b
        i, f, o = (_sigmoid(z[:, q * hidden:(q + 1) * hidden]) for q in range(3))
        g = np.tanh(z[:, 3 * hidden:])
        c.append(f * c[-1] + i * g)
        h.append(o * np.tanh(c[-1]))
        acts.append((i, f, o, g))
    dwx, dwh, db = np.zeros_like(wx), np.zeros_like(wh), np.zeros_like(b)
    dx = np.zeros_like(x)
    dh_next, dc_next = dh_T.copy(), dc_T.copy()
    for t in reversed(range(steps)):
        i, f, o, g = acts[t]
        total_dh = dh[t] + dh_next
        tanh_c = np.tanh(c[t + 1])
        dc = dc_next + total_dh * o * (1 - tanh_c**2)
        dz = np.concatenate([
            dc * g * i * (1 - i),
            dc * c[t] * f * (1 - f),
            total_dh * tanh_c * o * (1 - o),
            dc * i * (1 - g**2),
        ], axis=1)
        dwx += x[t].T @ dz
        dwh += h[t].T @ dz
        db += dz.sum(axis=0)
        dx[t] = dz @ wx.T
        dh_next = dz @ wh.T
        dc_next = dc * f
    return {
        "h": np.stack(h[1:]), "h_T": h[-1], "c_T": c[-1],
        "dx": dx, "dwx": dwx, "dwh": dwh, "db": db, "dh0": dh_next, "dc0": dc_next,
    }


# -- cases ------------------------------------------------------------------------------------
def make_case(name, rng):
    """(input_size, hidden_size, block size, input layout, recurrent layout, T, N)."""
    if name == "random":  # odd sizes: 3 x 5 blocks, N = 3
        return 24, 40, 8, random_layout(rng, 3, 5, 0.5), random_layout(rng, 5, 5, 0.5), 4, 3
    if name == "skewed":  # empty block rows and columns, dense ones
        return 32, 32, 8, skewed_layout(rng, 4, 16), skewed_layout(rng, 4, 4), 3, 2
    if name == "per_gate":  # one layout per gate, (Hb, 4Hb)
        return 16, 32, 16, random_layout(rng, 1, 8, 0.6), random_layout(rng, 2, 8, 0.5), 3, 2
    if name == "n1_t1":
        return 16, 16, 16, None, np.ones((1, 1)), 1, 1
    if name == "dense_odd":  # no layouts: any sizes
        return 7, 5, 8, None, None, 3, 3
    if name == "small_world":
        return 64, 64, 8, small_world_layout(8, 30, seed=1), small_world_layout(8, 30, "watts_strogatz", 2), 5, 4
    if name == "wide":  # on the GPU, the fused cell's rows of 320 units: two thread blocks and part of a third
        return 32, 320, 32, random_layout(rng, 1, 10, 0.6), small_world_layout(10, 30, seed=3), 3, 5
    raise AssertionError(name)


def random_state(rng, n, hidden):
    return rng.standard_normal((n, hidden)), rng.standard_normal((n, hidden))


def compare_to_reference(xp, case, dtype, seed=0):
    rng = np.random.default_rng(seed)
    input_size, hidden, bs, input_layout, recurrent_layout, steps, n = make_case(case, rng)
    lstm = BlocksparseLSTM(input_size, hidden, bs, input_layout, recurrent_layout, dtype=dtype)
    params = lstm.init_params(xp, seed=seed)
    params["b"] = xp.asarray(rng.standard_normal(4 * hidden).astype(np.float32))
    x = rng.standard_normal((steps, n, input_size)).astype(DTYPES[dtype])
    h0, c0 = random_state(rng, n, hidden)
    dh = rng.standard_normal((steps, n, hidden))
    dh_T, dc_T = random_state(rng, n, hidden)

    h, (h_T, c_T), cache = lstm.forward(params, to_xp(xp, x), xp.asarray(h0), xp.asarray(c0))
    dx, grads, (dh0, dc0) = lstm.backward(params, cache, xp.asarray(dh), xp.asarray(dh_T), xp.asarray(dc_T))

    layouts = [None if layout is None else np.tile(layout, (1, 4 // (layout.shape[1] * bs // hidden)))
               for layout in (input_layout, recurrent_layout)]
    # The reference sees the weights the layer multiplies with: master weights rounded to dtype.
    wx, wh = (dense_matrix(layout, to_numpy(params[name]).astype(DTYPES[dtype]), bs)
              for layout, name in zip(layouts, ("wx", "wh")))
    expected = reference_lstm(wx, wh, as_float64(to_numpy(params["b"])), as_float64(x), h0, c0, dh, dh_T, dc_T)

    def cut(layout, dense):
        return dense if layout is None else dense_to_present_blocks(layout, dense, bs)

    actual = {
        "h": h, "h_T": h_T, "c_T": c_T, "dx": dx, "dwx": grads["wx"], "dwh": grads["wh"], "db": grads["b"],
        "dh0": dh0, "dc0": dc0,
    }
    expected["dwx"], expected["dwh"] = cut(layouts[0], expected["dwx"]), cut(layouts[1], expected["dwh"])
    errors = {key: rel_error(to_numpy(actual[key]), expected[key]) for key in expected}
    assert h.dtype == DTYPES[dtype] and dx.dtype == DTYPES[dtype]
    assert all(grads[name].dtype == np.float32 for name in grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance(dtype), f"{case} {dtype}: {worst} off by {errors[worst]:.3g}; {errors}"


CASES = ("random", "skewed", "per_gate", "n1_t1", "dense_odd", "small_world", "wide")


@pytest.mark.parametrize("case", CASES)
def test_float32_matches_masked_dense_lstm(xp, case):
    compare_to_reference(xp, case, "float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_half_precision_matches_masked_dense_lstm(xp, case, dtype):
    require_dtype(xp, DTYPES[dtype])
    compare_to_reference(xp, case, dtype, seed=1)


def test_finite_differences_in_float64():
    """Every gradient of the loss sum(h·R) + sum(h_T·r) + sum(c_T·s) against central differences."""
    rng = np.random.default_rng(5)
    lstm = BlocksparseLSTM(16, 16, 8, random_layout(rng, 2, 2, 0.7), random_layout(rng, 2, 8, 0.6), dtype="float64")
    params = lstm.init_params(seed=3)
    params["b"] = rng.standard_normal(64)
    x = rng.standard_normal((3, 2, 16))
    h0, c0 = random_state(rng, 2, 16)
    r, r_T, s_T = rng.standard_normal((3, 2, 16)), *random_state(rng, 2, 16)

    def loss(params, x, h0, c0):
        h, (h_T, c_T), _ = lstm.forward(params, x, h0, c0)
        return float((h * r).sum() + (h_T * r_T).sum() + (c_T * s_T).sum())

    _, _, cache = lstm.forward(params, x, h0, c0)
    dx, grads, (dh0, dc0) = lstm.backward(params, cache, r, r_T, s_T)
    assert dx.dtype == grads["wh"].dtype == np.float64
    analytic = {"x": dx, "h0": dh0, "c0": dc0, **grads}
    for name, array in [("x", x), ("h0", h0), ("c0", c0), *params.items()]:
        flat = array.reshape(-1)
        for index in rng.choice(flat.size, size=min(flat.size, 12), replace=False):
            saved, eps = flat[index], 1e-6
            flat[index] = saved + eps
            up = loss(params, x, h0, c0)
            flat[index] = saved - eps
            down = loss(params, x, h0, c0)
            flat[index] = saved
            numeric = (up - down) / (2 * eps)
            assert abs(analytic[name].reshape(-1)[index] - numeric) <= 1e-7 * max(1.0, abs(numeric)), (name, index)


def test_truncated_bptt_over_chunks_equals_the_whole_sequence(xp):
    """Forward in two chunks carrying (h, c); backward chunk by chunk into one set of buffers."""
    rng = np.random.default_rng(7)
    lstm = BlocksparseLSTM(16, 32, 8, random_layout(rng, 2, 4, 0.5), small_world_layout(4, 10, seed=0))
    params = lstm.init_params(xp, seed=1)
    x = xp.asarray(rng.standard_normal((6, 3, 16)).astype(np.float32))
    dh = xp.asarray(rng.standard_normal((6, 3, 32)).astype(np.float32))
    h, state, cache = lstm.forward(params, x)
    dx, grads, _ = lstm.backward(params, cache, dh)

    h_a, state_a, cache_a = lstm.forward(params, x[:4])
    h_b, state_b, cache_b = lstm.forward(params, x[4:], *state_a)
    dx_b, chunk_grads, (dh_a, dc_a) = lstm.backward(params, cache_b, dh[4:])
    dx_a, chunk_grads_again, _ = lstm.backward(params, cache_a, dh[:4], dh_a, dc_a, grads=chunk_grads)
    assert chunk_grads_again is chunk_grads
    for actual, expected in [(h_a, h[:4]), (h_b, h[4:]), (state_b[0], state[0]), (state_b[1], state[1]),
                             (dx_a, dx[:4]), (dx_b, dx[4:]), *[(chunk_grads[k], grads[k]) for k in grads]]:
        assert rel_error(to_numpy(actual), to_numpy(expected)) <= 1e-6


def test_weight_gradients_accumulate_into_one_buffer_per_matrix(xp):
    """dWh and dWx: one updat each over all T·N rows into its buffer, which then holds the sum over the steps."""
    rng = np.random.default_rng(8)
    steps, n, size = 5, 2, 16
    lstm = BlocksparseLSTM(size, size, 8, np.ones((2, 2)), np.eye(2))
    params = lstm.init_params(xp, seed=0)
    calls, operands, updats = {"input": [], "recurrent": []}, {}, {}
    for name, op in (("input", lstm.input_op), ("recurrent", lstm.recurrent_op)):
        def spy(x, dy, out=None, accumulate=False, _updat=op.updat, _name=name):
            calls[_name].append((tuple(x.shape), tuple(dy.shape), id(out), accumulate))
            operands[_name] = (to_numpy(x).copy(), to_numpy(dy).copy())
            return _updat(x, dy, out=out, accumulate=accumulate)
        updats[name], op.updat = op.updat, spy
    x = xp.asarray(rng.standard_normal((steps, n, size)).astype(np.float32))
    h, _, cache = lstm.forward(params, x)
    _, grads, _ = lstm.backward(params, cache, xp.ones_like(h))
    rows = (steps * n, size), (steps * n, 4 * size)
    assert calls["recurrent"] == [(*rows, id(grads["wh"]), False)]
    assert calls["input"] == [(*rows, id(grads["wx"]), False)]
    # dWh's rows are the states h_0 ... h_{T-1} that the steps read, with their dz rows (those of dWx too).
    h_in, dz = operands["recurrent"]
    assert np.array_equal(h_in, to_numpy(cache.h[:steps]).reshape(rows[0]))
    assert np.array_equal(dz, operands["input"][1])
    # The one buffer holds the sum over the steps of h_{t-1}ᵀ·dz_t.
    per_step = [to_numpy(updats["recurrent"](xp.asarray(h_in[t * n:(t + 1) * n]), xp.asarray(dz[t * n:(t + 1) * n])))
                for t in range(steps)]
    assert rel_error(to_numpy(grads["wh"]), np.sum(per_step, axis=0)) <= 1e-6
    before = {name: to_numpy(grad).copy() for name, grad in grads.items()}
    calls["recurrent"].clear()
    calls["input"].clear()
    lstm.backward(params, cache, xp.ones_like(h), grads=grads)
    assert calls["recurrent"] == [(*rows, id(grads["wh"]), True)]
    assert calls["input"] == [(*rows, id(grads["wx"]), True)]
    for name, grad in grads.items():
        assert rel_error(to_numpy(grad), 2 * before[name]) <= 1e-6


def test_step_is_one_step_of_forward(xp):
    rng = np.random.default_rng(9)
    lstm = BlocksparseLSTM(8, 16, 8, None, small_world_layout(2, 4, seed=0))
    params = lstm.init_params(xp, seed=0)
    x = xp.asarray(rng.standard_normal((2, 3, 8)).astype(np.float32))
    h, (h_T, c_T), _ = lstm.forward(params, x)
    state = lstm.step(params, x[0], None, None)
    state = lstm.step(params, x[1], *state)
    assert rel_error(to_numpy(state[0]), to_numpy(h_T)) <= 1e-6
    assert rel_error(to_numpy(state[1]), to_numpy(c_T)) <= 1e-6


def test_inputs_and_parameters_are_not_modified(xp):
    rng = np.random.default_rng(10)
    lstm = BlocksparseLSTM(16, 16, 8, np.ones((2, 2)), np.eye(2), dtype="float16")
    require_dtype(xp, np.float16)
    params = lstm.init_params(xp, seed=0)
    x = xp.asarray(rng.standard_normal((3, 2, 16)).astype(np.float16))
    h0, c0 = (xp.asarray(a.astype(np.float32)) for a in random_state(rng, 2, 16))
    before = [to_numpy(a).copy() for a in (x, h0, c0, *params.values())]
    h, _, cache = lstm.forward(params, x, h0, c0)
    lstm.backward(params, cache, xp.ones_like(h))
    for old, new in zip(before, (x, h0, c0, *params.values())):
        assert np.array_equal(old, to_numpy(new))


def test_init_params_and_parameter_count():
    layout = small_world_layout(8, 30, seed=0)
    lstm = BlocksparseLSTM(32, 64, 8, np.ones((4, 8)), layout, forget_bias=2.0)
    params = lstm.init_params(seed=0)
    blocks = 4 * 8 * 4 + 4 * int(layout.sum())
    assert lstm.n_params == blocks * 64 + 4 * 64 == sum(a.size for a in params.values())
    assert (params["b"][64:128] == 2.0).all() and (np.delete(params["b"], np.s_[64:128]) == 0).all()
    assert all(a.dtype == np.float32 for a in params.values())
    dense = BlocksparseLSTM(7, 5)
    assert dense.n_params == 4 * 5 * (7 + 5) + 4 * 5
    wh = dense.init_params(seed=1)["wh"]
    for q in range(len(GATES)):  # orthogonal per gate
        block = wh[:, q * 5:(q + 1) * 5].astype(np.float64)
        assert np.allclose(block.T @ block, np.eye(5), atol=1e-6)
    again = lstm.init_params(seed=0)
    assert all(np.array_equal(params[k], again[k]) for k in params)


def test_float64_on_the_gpu_is_refused(xp):
    if xp is np:
        pytest.skip("float64 runs on the CPU backend")
    lstm = BlocksparseLSTM(8, 8, 8, np.ones((1, 1)), np.ones((1, 1)), dtype="float64")
    with pytest.raises(TypeError, match="only on the CPU"):
        lstm.forward(lstm.init_params(xp), xp.zeros((1, 1, 8)))


def test_gate_layout():
    tiled = gate_layout(np.array([[1, 0], [0, 1]]), 2)
    assert tiled.shape == (2, 8) and (tiled[:, 2:4] == np.eye(2)).all()
    full = np.arange(8).reshape(1, 8) % 2
    assert (gate_layout(full, 2) == full).all()
    with pytest.raises(ValueError, match=r"must have 2 block columns \(one gate, tiled\) or 8"):
        gate_layout(np.ones((2, 3)), 2)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"input_size": 10, "hidden_size": 16, "input_layout": np.ones((1, 2))}, ValueError,
     r"input_size \(10\) must be a multiple of block_size \(8\)"),
    ({"input_size": 8, "hidden_size": 12, "recurrent_layout": np.ones((1, 1))}, ValueError,
     r"hidden_size \(12\) must be a multiple of block_size \(8\)"),
    ({"input_size": 8, "hidden_size": 16, "recurrent_layout": np.ones((2, 3))}, ValueError,
     "must have 2 block columns"),
    ({"input_size": 8, "hidden_size": 16, "recurrent_layout": np.ones((3, 2))}, ValueError,
     r"recurrent_layout must have 2 block rows; got shape \(3, 2\)"),
    ({"input_size": 0, "hidden_size": 16}, ValueError, "input_size must be >= 1; got 0"),
    ({"input_size": 8, "hidden_size": 2.0}, TypeError, "hidden_size must be an int"),
    ({"input_size": 8, "hidden_size": 8, "dtype": "int8"}, TypeError, "dtype has dtype int8"),
    ({"input_size": 8, "hidden_size": 8, "block_size": 12}, ValueError, "block_size must be one of"),
])
def test_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        BlocksparseLSTM(**{"block_size": 8, **kwargs})


def test_call_errors():
    lstm = BlocksparseLSTM(8, 8, 8, None, np.ones((1, 1)))
    params = lstm.init_params(seed=0)
    x = np.zeros((2, 3, 8), np.float32)
    with pytest.raises(ValueError, match=r"x must have shape \(T, N, 8\) with T, N >= 1; got \(2, 3, 7\)"):
        lstm.forward(params, np.zeros((2, 3, 7), np.float32))
    with pytest.raises(ValueError, match=r"x must have shape .* got \(0, 3, 8\)"):
        lstm.forward(params, np.zeros((0, 3, 8), np.float32))
    with pytest.raises(ValueError, match=r"params must hold \['b', 'wh', 'wx'\]; 'b' is missing"):
        lstm.forward({"wx": params["wx"], "wh": params["wh"]}, x)
    with pytest.raises(ValueError, match=r"params\['wh'\] must have shape \(4, 8, 8\); got \(8, 32\)"):
        lstm.forward({**params, "wh": np.zeros((8, 32), np.float32)}, x)
    with pytest.raises(ValueError, match=r"h0 must have shape \(3, 8\); got \(2, 8\)"):
        lstm.forward(params, x, h0=np.zeros((2, 8)))
    h, _, cache = lstm.forward(params, x)
    with pytest.raises(ValueError, match=r"dh must have shape \(2, 3, 8\); got \(2, 3, 9\)"):
        lstm.backward(params, cache, np.zeros((2, 3, 9)))
    with pytest.raises(ValueError, match=r"dc_T must have shape \(3, 8\)"):
        lstm.backward(params, cache, None, dc_T=np.zeros((8,)))
    with pytest.raises(ValueError, match=r"grads must hold \['b', 'wh', 'wx'\]; got \['wh'\]"):
        lstm.backward(params, cache, h, grads={"wh": np.zeros((1, 8, 8), np.float32)})
    with pytest.raises(ValueError, match="accumulate=True needs out="):
        DenseMatMul(2, 2).fprop(np.ones((1, 2)), np.ones((2, 2)), accumulate=True)
    with pytest.raises(ValueError, match="sparse_input needs input_size == hidden_size"):
        small_world_lstm(8, 16, 1000, 8)


@pytest.mark.parametrize("sparse_input", [True, False])
def test_small_world_lstm_matches_a_parameter_budget(sparse_input):
    dense = BlocksparseLSTM(128, 128)
    sparse = small_world_lstm(256 if sparse_input else 32, 256, dense.n_params, 8, seed=0,
                              sparse_input=sparse_input, dtype="float16")
    # Off by at most one block (64 parameters) per gate of each sparse matrix.
    assert abs(sparse.n_params - dense.n_params) <= 64 * 4 * (2 if sparse_input else 1)
    assert sparse.dtype == np.float16 and (sparse.input_layout is None) != sparse_input
    assert (sparse.recurrent_layout == sparse.recurrent_op.layout[:, :32]).all()


# -- the training kit: optimizer, loss, corpus, character model ---------------------------------
def test_softmax_cross_entropy_gradient_by_finite_differences():
    rng = np.random.default_rng(11)
    logits, targets = rng.standard_normal((5, 7)) * 3, rng.integers(0, 7, size=5)
    loss, dlogits = softmax_cross_entropy(logits, targets)
    expected = np.mean(np.log(np.exp(logits).sum(axis=1)) - logits[np.arange(5), targets])
    assert abs(float(loss) - expected) <= 1e-12
    numeric = np.zeros_like(logits)
    for index in np.ndindex(logits.shape):
        step = np.zeros_like(logits)
        step[index] = 1e-6
        numeric[index] = (float(softmax_cross_entropy(logits + step, targets)[0])
                          - float(softmax_cross_entropy(logits - step, targets)[0])) / 2e-6
    assert np.abs(dlogits - numeric).max() <= 1e-8


def test_adam_and_clipping(xp):
    target = xp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    w, b = xp.zeros((2, 3), dtype=np.float32), xp.ones(3, dtype=np.float32)
    adam = Adam([w, b], lr=0.05)
    for _ in range(500):
        grads = [2 * (w - target), 2 * b]
        clip_by_global_norm(grads, 5.0)
        adam.step(grads)
    assert float(xp.abs(w - target).max()) < 0.05 and float(xp.abs(b).max()) < 0.05
    small = [xp.ones(3, dtype=np.float32)]
    assert abs(float(clip_by_global_norm(small, 10.0)) - 3**0.5) < 1e-6 and float(small[0][0]) == 1.0
    with pytest.raises(ValueError, match="grads must hold 2 arrays, one per parameter; got 1"):
        adam.step([w])


def test_corpus_is_deterministic_and_split_by_chunks():
    corpus = char_corpus(max_chars=30_000, valid_every=3, chunk_chars=1_000)
    assert (corpus.train.size, corpus.valid.size) == (20_000, 10_000)
    text = corpus_text(30_000)
    assert corpus.decode(corpus.valid[:1_000]) == text[2_000:3_000]
    assert corpus.decode(corpus.train[2_000:3_000]) == text[3_000:4_000]
    again = char_corpus(max_chars=30_000, valid_every=3, chunk_chars=1_000)
    assert again.sha256 == corpus.sha256 and np.array_equal(again.train, corpus.train)
    assert corpus_files()[0].name == "argparse.py"
    assert not any("test" in path.parts for path in corpus_files())
    with pytest.raises(RuntimeError, match="none of the corpus sources was found"):
        corpus_text(stdlib="/nonexistent")


def test_stream_chunks_continue_each_other(xp):
    ids = np.arange(103)
    chunks = list(stream_chunks(ids, 4, 6, xp))
    assert len(chunks) == 4  # streams of 25: chunks start at 0, 6, 12, 18
    x = np.concatenate([to_numpy(x) for x, _ in chunks])
    y = np.concatenate([to_numpy(y) for _, y in chunks])
    assert (x[:, 1] == np.arange(25, 49)).all() and (y == x + 1).all()
    with pytest.raises(ValueError, match="too short for 4 streams of 30"):
        next(stream_chunks(ids, 4, 30))


@pytest.mark.parametrize("sparse", [False, True])
def test_char_model_gradients_by_finite_differences(sparse):
    rng = np.random.default_rng(12)
    lstm = (BlocksparseLSTM(16, 16, 8, np.eye(2), small_world_layout(2, 4, seed=0), dtype="float64") if sparse
            else BlocksparseLSTM(5, 6, dtype="float64"))
    model = CharLanguageModel(7, lstm)
    params = model.init_params(seed=1)
    x, y = rng.integers(0, 7, size=(4, 3)), rng.integers(0, 7, size=(4, 3))
    loss, grads, _ = model.loss_and_grads(params, x, y)
    for name, array in params.items():
        flat = array.reshape(-1)
        for index in rng.choice(flat.size, size=min(flat.size, 6), replace=False):
            saved = flat[index]
            flat[index] = saved + 1e-6
            up = float(model.loss(params, x, y)[0])
            flat[index] = saved - 1e-6
            down = float(model.loss(params, x, y)[0])
            flat[index] = saved
            numeric = (up - down) / 2e-6
            assert abs(grads[name].reshape(-1)[index] - numeric) <= 1e-7 * max(1.0, abs(numeric)), (name, index)


def test_training_lowers_validation_bits_per_character(xp):
    # Many tiny BLAS products: threads only wait on each other (seconds more on busy cores).
    with threadpool_limits(1, user_api="blas") if threadpool_limits else contextlib.nullcontext():
        train_both_models(xp)


def train_both_models(xp):
    corpus = char_corpus(max_chars=40_000, chunk_chars=2_000)
    dense, sparse = matched_models(corpus.vocab_size, 96, 128, 8, seed=0)
    assert abs(sparse.n_params - dense.n_params) <= 0.02 * dense.n_params
    for model in (dense, sparse):
        params = model.init_params(xp, seed=0)
        before = evaluate_bpc(model, params, corpus.valid, 8, 16, xp=xp)
        result = train(model, params, corpus, batch_size=8, steps=16, lr=1e-2, max_updates=40, eval_every=20,
                       eval_chars=2_000, xp=xp)
        assert result["updates"] == 40 and result["chars"] == 40 * 8 * 16
        assert [row["update"] for row in result["curve"]] == [20, 40]
        assert result["valid_bpc"] < before - 1.0
        assert result["curve"][-1]["valid_bpc"] == evaluate_bpc(model, params, corpus.valid[:2_000], 8, 16, xp=xp)
    with pytest.raises(ValueError, match="train needs max_updates or time_limit"):
        train(dense, params, corpus)

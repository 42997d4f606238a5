"""Repeated GPU calls: the operator's per-shape fast path (``bsmm.backends.cuda.backend.FastCall``).

After a pass has run once through the checked path, later calls with CuPy arrays of
the same shape skip the full validation. These tests make sure a repeat computes the
same thing, and that anything the checked path would refuse or treat differently
(shapes, dtypes, strides, overlap, alignment, streams) still goes through it.
"""

from __future__ import annotations

import numpy as np
import pytest

import bsmm
from conftest import poisoned, snapshot, to_numpy, to_xp
from reference import random_data, ref_bprop, ref_fprop, ref_updat, rel_error, tolerance

pytestmark = pytest.mark.gpu
BS = 16
LAYOUT = np.array([[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 1]], dtype=np.uint8)  # C = 48, K = 64


def make(cupy, axis=1, n=33, dtype="float16", seed=0):
    rng = np.random.default_rng(seed)
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS, feature_axis=axis)
    shape = lambda features: (n, features) if axis == 1 else (features, n)
    host = {"x": random_data(rng, shape(op.C), dtype), "dy": random_data(rng, shape(op.K), dtype),
            "w": random_data(rng, op.w_shape, dtype)}
    return op, host, {k: to_xp(cupy, v) for k, v in host.items()}


def run(op, pass_name, arrays, **kwargs):
    if pass_name == "fprop":
        return op.fprop(arrays["x"], arrays["w"], **kwargs)
    if pass_name == "bprop":
        return op.bprop(arrays["dy"], arrays["w"], **kwargs)
    return op.updat(arrays["x"], arrays["dy"], **kwargs)


def check(op, pass_name, host, result, dtype):
    layout, bs, axis = op.layout, op.block_size, op.feature_axis
    expected = {
        "fprop": lambda: ref_fprop(layout, host["w"], bs, host["x"], axis),
        "bprop": lambda: ref_bprop(layout, host["w"], bs, host["dy"], axis),
        "updat": lambda: ref_updat(layout, bs, host["x"], host["dy"], axis),
    }[pass_name]()
    assert rel_error(to_numpy(result), expected) < tolerance(dtype)


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("pass_name", ["fprop", "bprop", "updat"])
def test_repeats_match_first_call_and_reference(cupy, pass_name, axis):
    op, host, arrays = make(cupy, axis)
    first = run(op, pass_name, arrays)
    assert op.kept_calls, "the checked path should leave a repeatable call behind"
    for _ in range(3):
        again = run(op, pass_name, arrays)
        assert again.data.ptr != first.data.ptr  # a new output each call
        assert snapshot(again) == snapshot(first)
    out = poisoned(cupy, first.shape, first.dtype)
    assert run(op, pass_name, arrays, out=out) is out
    assert snapshot(out) == snapshot(first)
    check(op, pass_name, host, out, "float16")


def test_repeat_with_new_data_uses_the_new_data(cupy):
    op, host, arrays = make(cupy)
    op.fprop(arrays["x"], arrays["w"])
    _, host2, arrays2 = make(cupy, seed=1)
    check(op, "fprop", host2, op.fprop(arrays2["x"], arrays2["w"]), "float16")


def test_accumulate_repeats_add(cupy):
    op, host, arrays = make(cupy)
    dw = op.updat(arrays["x"], arrays["dy"])
    total = dw.copy()
    for _ in range(3):
        op.updat(arrays["x"], arrays["dy"], out=total, accumulate=True)
    np.testing.assert_allclose(to_numpy(total).astype(np.float32), 4 * to_numpy(dw).astype(np.float32),
                               rtol=5e-3, atol=1e-2)
    with pytest.raises(ValueError, match="accumulate=True needs out="):
        op.updat(arrays["x"], arrays["dy"], accumulate=True)


@pytest.mark.parametrize("pass_name", ["fprop", "bprop", "updat"])
def test_bad_repeat_still_refused(cupy, pass_name):
    op, host, arrays = make(cupy, dtype="float32")
    run(op, pass_name, arrays)
    bad_w = dict(arrays, w=arrays["w"][:-1])
    # One operand of another dtype than the other: w for fprop/bprop, dy for updat.
    bad_dtype = (dict(arrays, dy=arrays["dy"].astype(np.float16)) if pass_name == "updat"
                 else dict(arrays, w=arrays["w"].astype(np.float16)))
    wide = {k: cupy.concatenate([v, v], axis=-1) for k, v in arrays.items() if k != "w"}
    strided = dict(arrays, x=wide["x"][:, ::2], dy=wide["dy"][:, ::2])
    if pass_name != "updat":
        with pytest.raises(ValueError, match="w must have shape"):
            run(op, pass_name, bad_w)
    with pytest.raises(TypeError, match="dtype"):
        run(op, pass_name, bad_dtype)
    with pytest.raises(ValueError, match="C-contiguous"):
        run(op, pass_name, strided)
    good = run(op, pass_name, arrays)
    with pytest.raises(TypeError, match="out has dtype"):
        run(op, pass_name, arrays, out=good.astype(np.float16))
    with pytest.raises(ValueError, match="out must have shape"):
        run(op, pass_name, arrays, out=good[:-1])


def test_out_overlapping_an_input_refused_on_repeat(cupy):
    layout = np.ones((2, 2), dtype=np.uint8)
    op = bsmm.BlocksparseMatMul(layout, block_size=BS)
    x = cupy.asarray(np.random.default_rng(0).standard_normal((8, op.C)), dtype=np.float32)
    w = cupy.asarray(np.random.default_rng(1).standard_normal(op.w_shape), dtype=np.float32)
    op.fprop(x, w)
    before = snapshot(x, w)
    with pytest.raises(ValueError, match="overlaps an input"):
        op.fprop(x, w, out=x)
    assert snapshot(x, w) == before


@pytest.mark.parametrize("pass_name", ["fprop", "bprop", "updat"])
def test_misaligned_repeat_takes_the_general_kernel(cupy, pass_name):
    op, host, arrays = make(cupy, n=32)
    run(op, pass_name, arrays)  # aligned first: the fast plan is the aligned kernel
    shifted = {}
    for name, value in arrays.items():
        storage = cupy.empty(value.size + 1, dtype=value.dtype)
        view = storage[1:].reshape(value.shape)  # C-contiguous, 2 bytes off a 16-byte boundary
        view[...] = value
        shifted[name] = view
    check(op, pass_name, host, run(op, pass_name, shifted), "float16")


def test_feature_axis_and_tf32_changes_are_not_served_stale(cupy):
    op, host, arrays = make(cupy, dtype="float32")
    y1 = op.fprop(arrays["x"], arrays["w"])
    op.tf32 = True
    y2 = op.fprop(arrays["x"], arrays["w"])
    assert rel_error(to_numpy(y2), to_numpy(y1)) < 1e-2
    assert len(op.kept_calls) == 2


def test_repeat_on_another_stream_is_ordered(cupy):
    op, host, arrays = make(cupy)
    op.fprop(arrays["x"], arrays["w"])
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = arrays["x"] * 1  # produced on this stream, consumed on it
        y = op.fprop(x, arrays["w"])
    stream.synchronize()
    check(op, "fprop", host, y, "float16")


@pytest.mark.parametrize("tall", [False, True], ids=["plain", "tall-columns"])
def test_kept_parameter_blocks_follow_buffers_and_data(cupy, tall):
    """Calls that rotate weight and output buffers (as an eager loop or the benchmark does) keep
    one parameter block per (operands, output, accumulate) from the second launch on; each call
    still reads the buffer it names and its current data, and accumulate keeps its own block.
    ``tall``: block 32 columns of 36 blocks, which Hopper runs through TMA (tensor maps in the
    block), other GPUs through cp.async."""
    from bsmm.backends.cuda import plans as cuda_plans

    rng = np.random.default_rng(5)
    layout = (rng.random((48, 4)) < 0.75).astype(np.uint8) if tall else LAYOUT
    layout[:, 0] = 1  # no empty column: a block to read everywhere
    bs = 32 if tall else BS
    op = bsmm.BlocksparseMatMul(layout, block_size=bs)
    x_host = random_data(rng, (32, op.C), "float16")
    w_hosts = [random_data(rng, op.w_shape, "float16") for _ in range(3)]
    x, ws = to_xp(cupy, x_host), [to_xp(cupy, w) for w in w_hosts]
    outs = [poisoned(cupy, (32, op.K), np.float16) for _ in range(2)]
    for turn in range(18):  # each (weights, output) pair three times
        k = turn % 3
        out = outs[turn % 2]
        out[...] = np.nan
        assert op.fprop(x, ws[k], out=out) is out
        assert rel_error(to_numpy(out), ref_fprop(layout, w_hosts[k], bs, x_host, 1)) < tolerance("float16")
    call = op.kept_calls[("fprop", x.shape, x.dtype, 1, False, "store")]
    if tall and cupy.cuda.Device().compute_capability == "90":
        assert isinstance(call.plan, cuda_plans.TmaPlan)
    assert len(call.blocks) == 6, "each (weights, output) pair launched twice by the repeat path keeps a block"
    w_hosts[0] = random_data(rng, op.w_shape, "float16")  # new data in a kept buffer
    ws[0][...] = to_xp(cupy, w_hosts[0])
    op.fprop(x, ws[0], out=outs[0])
    assert rel_error(to_numpy(outs[0]), ref_fprop(layout, w_hosts[0], bs, x_host, 1)) < tolerance("float16")
    first = to_numpy(outs[0]).astype(np.float32)
    for _ in range(2):  # accumulate: a key of its own, launched through the plan, then kept
        op.fprop(x, ws[0], out=outs[0], accumulate=True)
    assert len(call.blocks) == 7
    np.testing.assert_allclose(to_numpy(outs[0]).astype(np.float32), 3 * first, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_back_to_back_dependent_passes(cupy, dtype):
    """Each call reads what the call before it wrote, with no host synchronisation between them:
    on Hopper every pass is launched to start while the one before it finishes (programmatic
    stream serialization), and must still wait for its results. A chain of fprops through a
    square layout, updat on the chain's last two outputs, then accumulating calls into one output."""
    rng = np.random.default_rng(7)
    layout = (rng.random((40, 40)) < 0.6).astype(np.uint8)  # block 32: 24 blocks a column
    op = bsmm.BlocksparseMatMul(layout, block_size=32)
    x_host = random_data(rng, (32, op.C), dtype)
    # Scaled so that the chain keeps unit size (24 blocks of 32 features add up in each output).
    w_host = (random_data(rng, op.w_shape, dtype).astype(np.float32) / np.sqrt(24 * 32)).astype(x_host.dtype)
    x, w = to_xp(cupy, x_host), to_xp(cupy, w_host)
    chain = [x]
    for _ in range(4):
        chain.append(op.fprop(chain[-1], w))
    dw = op.updat(chain[-2], chain[-1])
    total = op.fprop(x, w)
    for _ in range(3):
        op.fprop(x, w, out=total, accumulate=True)
    expected = [x_host.astype(np.float64)]
    for _ in range(4):
        expected.append(ref_fprop(layout, w_host, 32, expected[-1], 1))
    tol = tolerance(dtype) * (4 if dtype == "float16" else 1)  # four roundings to fp16 along the chain
    for k in range(1, 5):
        assert rel_error(to_numpy(chain[k]), expected[k]) < tol, f"fprop {k} of the chain"
    assert rel_error(to_numpy(dw), ref_updat(layout, 32, to_numpy(chain[-2]), to_numpy(chain[-1]), 1)) < tolerance(dtype)
    assert rel_error(to_numpy(total), 4 * expected[1]) < tolerance(dtype)

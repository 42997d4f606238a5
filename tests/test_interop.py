"""Foreign arrays through DLPack: shared without copies, results handed back.

``bsmm.arrays`` wraps any DLPack producer as NumPy (CPU) without a copy and hands
results back through ``from_dlpack`` of the producer's top-level module; a
module without ``from_dlpack`` gets the NumPy array itself.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import bsmm
from reference import Producer, assert_close, random_data, random_layout, ref_bprop, ref_fprop, ref_updat

BS = 16


assert "from_dlpack" not in globals(), "this module must not offer from_dlpack (the fallback is under test)"


@pytest.fixture(params=[1, 0], ids=["axis1", "axis0"])
def setup(request):
    axis = request.param
    rng = np.random.default_rng(100 + axis)
    layout = random_layout(rng, 4, 3, 0.6)
    op = bsmm.BlocksparseMatMul(layout, block_size=BS, feature_axis=axis)
    n = 6

    def shape(features):
        return (n, features) if axis == 1 else (features, n)

    x, dy = random_data(rng, shape(op.C), "float32"), random_data(rng, shape(op.K), "float32")
    w = random_data(rng, op.w_shape, "float32")
    return op, layout, axis, x, dy, w


def test_producer_results_come_back_as_numpy(setup):
    """Without a from_dlpack in the producer's module, the result is the NumPy array bsmm computed."""
    op, layout, axis, x, dy, w = setup
    y = op(Producer(x), Producer(w))
    assert type(y) is np.ndarray
    assert_close(y, ref_fprop(layout, w, BS, x, axis), "float32")
    dx = op.bprop(Producer(dy), Producer(w))
    assert type(dx) is np.ndarray
    assert_close(dx, ref_bprop(layout, w, BS, dy, axis), "float32")
    dw = op.updat(Producer(x), Producer(dy))
    assert type(dw) is np.ndarray
    assert_close(dw, ref_updat(layout, BS, x, dy, axis), "float32")


def test_producer_out_is_written_in_place(setup):
    """out= given as a producer: bsmm writes straight into the wrapped buffer (no copy)
    and returns the producer object itself."""
    op, layout, axis, x, dy, w = setup
    for run, buffer_shape, expected in [
        (lambda out: op(Producer(x), Producer(w), out=out), ref_fprop(layout, w, BS, x, axis).shape,
         ref_fprop(layout, w, BS, x, axis)),
        (lambda out: op.bprop(Producer(dy), Producer(w), out=out), ref_bprop(layout, w, BS, dy, axis).shape,
         ref_bprop(layout, w, BS, dy, axis)),
        (lambda out: op.updat(Producer(x), Producer(dy), out=out), op.w_shape, ref_updat(layout, BS, x, dy, axis)),
    ]:
        buffer = np.full(buffer_shape, np.nan, np.float32)
        out = Producer(buffer)
        assert run(out) is out
        assert np.isfinite(buffer).all(), "the wrapped buffer itself must hold the result"
        assert_close(buffer, expected, "float32")


def test_producer_inputs_are_not_modified(setup):
    op, layout, axis, x, dy, w = setup
    copies = [a.copy() for a in (x, dy, w)]
    op(Producer(x), Producer(w))
    op.bprop(Producer(dy), Producer(w))
    op.updat(Producer(x), Producer(dy), out=Producer(w.copy()), accumulate=True)
    assert all(np.array_equal(a, b) for a, b in zip((x, dy, w), copies))


def test_producer_accumulate_adds_into_the_wrapped_buffer(setup):
    op, layout, axis, x, dy, w = setup
    start = random_data(np.random.default_rng(1), op.w_shape, "float32")
    buffer = start.copy()
    op.updat(Producer(x), Producer(dy), out=Producer(buffer), accumulate=True)
    assert_close(buffer, start.astype(np.float64) + ref_updat(layout, BS, x, dy, axis), "float32")


def test_result_goes_back_through_the_library_from_dlpack(setup, monkeypatch):
    """A library that offers from_dlpack gets its own array type back (zero-copy)."""
    op, layout, axis, x, dy, w = setup
    library = types.ModuleType("fakearrays")

    class FakeArray(Producer):
        pass

    FakeArray.__module__ = "fakearrays"
    handed_back = []

    def from_dlpack(array):
        handed_back.append(array)
        return FakeArray(np.from_dlpack(array))

    library.from_dlpack = from_dlpack
    monkeypatch.setitem(sys.modules, "fakearrays", library)

    y = op(FakeArray(x), FakeArray(w))
    assert isinstance(y, FakeArray)
    assert len(handed_back) == 1 and np.shares_memory(y.array, handed_back[0]), "the result must not be copied"
    assert_close(y.array, ref_fprop(layout, w, BS, x, axis), "float32")


# -- PyTorch ----------------------------------------------------------------------------------------------
@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def test_torch_tensors_in_torch_tensors_out(setup, torch):
    op, layout, axis, x, dy, w = setup
    tx, tdy, tw = (torch.from_numpy(a.copy()) for a in (x, dy, w))
    y, dx, dw = op(tx, tw), op.bprop(tdy, tw), op.updat(tx, tdy)
    for result in (y, dx, dw):
        assert isinstance(result, torch.Tensor) and result.dtype == torch.float32 and result.device.type == "cpu"
    assert_close(y.numpy(), ref_fprop(layout, w, BS, x, axis), "float32")
    assert_close(dx.numpy(), ref_bprop(layout, w, BS, dy, axis), "float32")
    assert_close(dw.numpy(), ref_updat(layout, BS, x, dy, axis), "float32")


def test_torch_out_is_written_into_the_tensor_storage(setup, torch):
    op, layout, axis, x, dy, w = setup
    tx, tw = torch.from_numpy(x.copy()), torch.from_numpy(w.copy())
    expected = ref_fprop(layout, w, BS, x, axis)
    out = torch.full(expected.shape, float("nan"), dtype=torch.float32)
    storage = out.data_ptr()
    assert op(tx, tw, out=out) is out
    assert out.data_ptr() == storage
    assert bool(torch.isfinite(out).all())
    assert_close(out.numpy(), expected, "float32")

    grad = torch.from_numpy(random_data(np.random.default_rng(2), op.w_shape, "float32"))
    start = grad.numpy().astype(np.float64).copy()
    op.updat(tx, torch.from_numpy(dy.copy()), out=grad, accumulate=True)
    assert_close(grad.numpy(), start + ref_updat(layout, BS, x, dy, axis), "float32")


def test_torch_float16(setup, torch):
    op, layout, axis, x, dy, w = setup
    x16, w16 = x.astype(np.float16), w.astype(np.float16)
    y = op(torch.from_numpy(x16), torch.from_numpy(w16))
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float16
    assert_close(y.numpy(), ref_fprop(layout, w16, BS, x16, axis), "float16")


def test_torch_mixed_with_numpy_is_refused(setup, torch):
    op, layout, axis, x, dy, w = setup
    with pytest.raises(ValueError, match="w is a numpy array but x is a torch array"):
        op(torch.from_numpy(x.copy()), w)


def test_torch_non_contiguous_is_refused(setup, torch):
    op, layout, axis, x, dy, w = setup
    transposed = torch.from_numpy(np.ascontiguousarray(x.T)).T  # same values, strided
    assert not transposed.is_contiguous()
    with pytest.raises(ValueError, match=r"x must be C-contiguous; got strides .*; pass x\.contiguous\(\)"):
        op(transposed, torch.from_numpy(w))


def test_torch_tensor_requiring_grad_is_refused(setup, torch):
    op, layout, axis, x, dy, w = setup
    with pytest.raises(TypeError, match="cannot be shared through DLPack"):
        op(torch.from_numpy(x.copy()).requires_grad_(), torch.from_numpy(w))


def test_torch_bfloat16_raises_the_documented_type_error(setup, torch):
    """NumPy cannot import bfloat16 through DLPack. as_operand documents a TypeError for a
    dtype DLPack cannot express for NumPy; PyTorch's tensors currently raise RuntimeError
    ("Unsupported dtype in DLTensor") straight out of np.from_dlpack instead."""
    op, layout, axis, x, dy, w = setup
    tx = torch.from_numpy(x.copy()).to(torch.bfloat16)
    tw = torch.from_numpy(w.copy()).to(torch.bfloat16)
    with pytest.raises(TypeError, match="cannot be shared through DLPack"):
        op(tx, tw)

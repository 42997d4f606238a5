"""BlockSparseLinear where users expect ``nn.Linear``'s behaviour (issue 39, items 2, 3, 4, 5, 8).

Deferred initialisation on the meta device, strided inputs, the weight as a ``torch.sparse_bsr``
tensor, checkpoints whose layouts differ from the model's, and sizes that are not multiples of
the block size. CPU only: what is checked here is the adapter, not the kernels.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bsmm.torch tests skipped")

import bsmm  # noqa: E402
import bsmm.torch as bt  # noqa: E402
from bsmm.nn.conv import BlocksparseConv  # noqa: E402

LAYOUT = np.array([[1, 0], [1, 1], [0, 1]])  # (3, 2) blocks: 48 -> 32 features at block size 16
BS = 16


@pytest.fixture(autouse=True)
def _quiet_bsr_beta():
    # PyTorch warns once per process that BSR support is in beta; irrelevant to these checks.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta")
        yield


def dense_reference(layer, x):
    """``x @ W + b`` in float64, W from the layer's own blocks."""
    y = x.double() @ layer.to_dense_weight().double()
    return y if layer.bias is None else y + layer.bias.double()


# -- item 2: deferred initialisation --------------------------------------------------------------------
@pytest.mark.parametrize("feature_axis", [1, 0])
def test_meta_forward_and_backward_give_shapes(feature_axis):
    layer = bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS, device="meta", feature_axis=feature_axis)
    assert layer.weight.device.type == "meta" and layer.layout.device.type == "meta"
    shape = (4, 5, 48) if feature_axis == 1 else (48, 4, 5)
    x = torch.empty(shape, device="meta", requires_grad=True)
    y = layer(x)
    assert y.device.type == "meta"
    assert tuple(y.shape) == ((4, 5, 32) if feature_axis == 1 else (32, 4, 5))
    y.sum().backward()
    assert x.grad.shape == x.shape and x.grad.device.type == "meta"
    assert layer.weight.grad.shape == (4, BS, BS) and layer.bias.grad.shape == (32,)


def test_meta_layer_with_activation_and_float64():
    layer = bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS, device="meta", dtype=torch.float16,
                                 activation="gelu")
    y = layer(torch.empty(7, 48, device="meta", dtype=torch.float16))
    assert (tuple(y.shape), y.dtype, y.device.type) == ((7, 32), torch.float16, "meta")
    # float64 runs on the CPU only; on meta the final device is not known yet, so the layer is built.
    layer = bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS, device="meta", dtype=torch.float64)
    layer.to_empty(device="cpu").reset_parameters()
    x = torch.randn(2, 48, dtype=torch.float64)
    torch.testing.assert_close(layer(x), dense_reference(layer, x))


@pytest.mark.parametrize("bias", [True, False])
def test_to_empty_then_reset_parameters_gives_a_working_layer(bias):
    torch.manual_seed(0)
    layer = bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS, bias=bias, device="meta")
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert layer.weight.device.type == "cpu"
    assert torch.equal(layer.layout, torch.from_numpy(np.array(layer.op.layout)))  # to_empty left it garbage
    bound = 1 / np.sqrt(2 * BS)  # every block column has 2 blocks
    assert 0 < layer.weight.abs().max().item() <= bound
    x = torch.randn(6, 48)
    expected = x @ layer.to_dense_weight() + (layer.bias if bias else 0)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    assert set(layer.state_dict()) == {"layout", "weight"} | ({"bias"} if bias else set())


def test_to_empty_without_reset_refuses_to_save_the_uninitialised_layout():
    layer = bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        layer.layout.fill_(0)  # what to_empty may leave: any bytes
    with pytest.raises(RuntimeError, match=r"layout no longer equals .*layer\.op\.layout.*reset_parameters"):
        layer.state_dict()
    layer.reset_parameters()
    assert torch.equal(layer.state_dict()["layout"], torch.from_numpy(np.array(layer.op.layout)))


# -- item 3: strided inputs ------------------------------------------------------------------------------
def test_layer_accepts_what_nn_linear_accepts():
    torch.manual_seed(1)
    layer = bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS)
    linear = layer.to_linear()
    inputs = {
        "transposed": torch.randn(48, 8).T,
        "sliced rows": torch.randn(16, 48)[::2],
        "sliced features": torch.randn(8, 96)[:, ::2],
        "expanded": torch.randn(1, 48).expand(5, 48),
        "permuted 3-D": torch.randn(48, 3, 4).permute(1, 2, 0),
    }
    for name, x in inputs.items():
        assert not x.is_contiguous(), name
        torch.testing.assert_close(layer(x), linear(x), atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(layer(x), layer(x.contiguous()), atol=0, rtol=0, msg=name)


def test_strided_input_gets_its_gradient():
    layer = bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS, dtype=torch.float64)
    base = torch.randn(48, 8, dtype=torch.float64, requires_grad=True)
    layer(base.T).square().sum().backward()
    expected = base.detach().clone().requires_grad_()
    dense_reference(layer, expected.T).square().sum().backward()
    torch.testing.assert_close(base.grad, expected.grad)


def test_feature_axis_0_layer_accepts_a_transposed_input():
    layer = bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS, feature_axis=0)
    x = torch.randn(8, 48).T  # (48, 8), strided
    expected = (x.T @ layer.to_dense_weight() + layer.bias).T
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_blocksparse_matmul_accepts_strided_x_and_w():
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    w_t = torch.randn(op.w_shape).transpose(1, 2)  # every block transposed: a different, valid weight
    x = torch.randn(48, 5).T
    dense = torch.from_numpy(op.to_dense(w_t.contiguous().numpy()))
    torch.testing.assert_close(bt.blocksparse_matmul(x, w_t, op), x @ dense, atol=1e-5, rtol=1e-5)


def test_blocksparse_conv_accepts_a_strided_input():
    conv = BlocksparseConv(np.ones((2, 1)), 8, (3, 3), padding=1, channels_last=False)
    x, w = torch.randn(2, 5, 5, 16).permute(0, 3, 1, 2), torch.randn(conv.w_shape)  # (N, C, H, W), strided
    assert not x.is_contiguous()
    dense = torch.from_numpy(conv.to_dense(w.numpy())).permute(3, 2, 0, 1)
    torch.testing.assert_close(bt.blocksparse_conv(x, w, conv),
                               torch.nn.functional.conv2d(x, dense, padding=1), atol=1e-4, rtol=1e-4)


def test_numpy_operator_keeps_its_contract_and_says_how_to_fix():
    op = bsmm.BlocksparseMatMul(LAYOUT, block_size=BS)
    x, w = np.ones((5, 48), np.float32), np.ones(op.w_shape, np.float32)
    with pytest.raises(ValueError, match=r"x must be C-contiguous; got strides .*; pass numpy\.ascontiguousarray\(x\)"):
        op(np.asfortranarray(x), w)
    with pytest.raises(ValueError, match=r"w must be C-contiguous; .*; pass numpy\.ascontiguousarray\(w\)"):
        op(x, w.transpose(0, 2, 1))
    with pytest.raises(ValueError, match=r"x must be C-contiguous; .*; pass x\.contiguous\(\)"):
        op(torch.from_numpy(x).T.contiguous().T, torch.from_numpy(w))
    with pytest.raises(ValueError, match=r"out must be C-contiguous; .*; pass a C-contiguous array, or out=None"):
        op(x, w, out=np.ones((5, 64), np.float32)[:, ::2])


# -- item 4: the weight as a torch.sparse_bsr tensor ------------------------------------------------------
def test_to_sparse_bsr_of_a_layer_is_its_weight_in_bsmm_orientation():
    layer = bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS)
    for bsr in (bt.to_sparse_bsr(layer), layer.to_sparse_bsr()):
        assert bsr.layout == torch.sparse_bsr and tuple(bsr.shape) == (48, 32)  # (in, out)
        assert bsr.values().shape == (4, BS, BS)
        assert torch.equal(bsr.to_dense(), layer.to_dense_weight())
        assert bsr.values().data_ptr() == layer.weight.data_ptr()  # shared, as for a BlockSparseMatrix
        # nn.Linear's (out, in): a BSC view, or a BSR copy.
        assert bsr.t().layout == torch.sparse_bsc
        assert torch.equal(bsr.t().to_dense(), layer.to_linear().weight)
        assert torch.equal(bsr.t().to_sparse_bsr((BS, BS)).to_dense(), layer.to_linear().weight)
    copied = layer.to_sparse_bsr(copy=True)
    assert copied.values().data_ptr() != layer.weight.data_ptr()
    assert torch.equal(copied.to_dense(), layer.to_dense_weight())


def test_to_sparse_bsr_of_a_layer_is_differentiable_and_round_trips():
    layer = bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS)
    layer.to_sparse_bsr().to_dense().sum().backward()
    assert torch.equal(layer.weight.grad, torch.ones_like(layer.weight))
    matrix = bt.from_sparse_bsr(layer.to_sparse_bsr())
    assert np.array_equal(matrix.layout, layer.op.layout)
    assert np.array_equal(matrix.toarray(), layer.to_dense_weight().detach().numpy())


def test_to_sparse_bsr_names_what_it_takes():
    with pytest.raises(TypeError, match="matrix must be a bsmm.BlockSparseMatrix or a bsmm.torch.BlockSparseLinear; "
                                        "got Linear"):
        bt.to_sparse_bsr(torch.nn.Linear(4, 4))


# -- item 5a: a layout edited in place ---------------------------------------------------------------------
def test_layout_edited_in_place_refuses_to_be_saved():
    model = torch.nn.Sequential(bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS))
    with torch.no_grad():
        model[0].layout[0, 0] = 0
    with pytest.raises(RuntimeError, match=r"0\.layout no longer equals the layout this BlockSparseLinear computes "
                                           r"with \(layer\.op\.layout\): it was changed in place \(3 blocks against "
                                           r"4\).*build a new BlockSparseLinear with the new layout"):
        model.state_dict()
    with torch.no_grad():
        model[0].layout.copy_(torch.tensor(model[0].op.layout))  # the fix the message names
    assert torch.equal(model.state_dict()["0.layout"], torch.from_numpy(np.array(LAYOUT, np.uint8)))


def test_unedited_checkpoint_round_trips():
    torch.manual_seed(2)
    layer = bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS, activation="relu")
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    fresh = bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS, activation="relu")
    fresh.load_state_dict(torch.load(buffer))
    x = torch.randn(3, 48)
    assert torch.equal(fresh(x), layer(x))
    assert torch.equal(fresh.layout, layer.layout)


# -- item 5b: a checkpoint of other layouts ---------------------------------------------------------------
def test_from_state_dict_builds_the_saved_layer():
    torch.manual_seed(3)
    saved = bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS, dtype=torch.float64)
    state = {"head." + name: value for name, value in saved.state_dict().items()}
    rng_before = torch.get_rng_state()
    layer = bt.BlockSparseLinear.from_state_dict(state, "head.", activation="relu")
    assert torch.equal(torch.get_rng_state(), rng_before)  # no draws: the weights are the saved ones
    assert (layer.in_features, layer.out_features, layer.op.block_size, layer.activation) == (48, 32, BS, "relu")
    assert layer.weight.dtype == torch.float64 and np.array_equal(layer.op.layout, LAYOUT)
    assert torch.equal(layer.weight, saved.weight) and torch.equal(layer.bias, saved.bias)
    assert layer.weight.data_ptr() != saved.weight.data_ptr()  # copied
    x = torch.randn(4, 48, dtype=torch.float64)
    torch.testing.assert_close(layer(x), torch.relu(dense_reference(saved, x)))
    unbiased = bt.BlockSparseLinear.from_state_dict(
        bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS, bias=False).state_dict(), dtype=torch.float16)
    assert unbiased.bias is None and unbiased.weight.dtype == torch.float16


def test_from_state_dict_names_a_missing_key():
    with pytest.raises(KeyError, match=r"state_dict has no 'layout'.*pass the prefix of the layer's keys"):
        bt.BlockSparseLinear.from_state_dict({"0.layout": torch.ones(1, 1), "0.weight": torch.ones(1, 8, 8)})


def _model(first, second):
    return torch.nn.Sequential(bt.BlockSparseLinear(48, 32, first, block_size=BS, activation="relu", tf32=True),
                               torch.nn.Dropout(0.0),
                               bt.BlockSparseLinear(32, 32, second, block_size=BS, bias=False))


def test_load_layouts_rebuilds_the_layers_of_other_layouts():
    torch.manual_seed(4)
    trained = _model(LAYOUT, np.eye(2))
    state = trained.state_dict()
    model = _model(np.ones((3, 2)), np.eye(2)).eval()
    model[0].weight.requires_grad_(False)
    kept = model[2]
    with pytest.raises(RuntimeError, match=r"0\.layout: the state_dict holds a layout of shape \(3, 2\) with 4 blocks"):
        model.load_state_dict(state)  # without load_layouts
    assert bt.load_layouts(model, state) is model
    model.load_state_dict(state)
    assert model[2] is kept  # the same layout: not rebuilt
    rebuilt = model[0]
    assert isinstance(rebuilt, bt.BlockSparseLinear) and np.array_equal(rebuilt.op.layout, LAYOUT)
    assert (rebuilt.activation, rebuilt.tf32, rebuilt.op.block_size, rebuilt.training) == ("relu", True, BS, False)
    assert not rebuilt.weight.requires_grad and rebuilt.bias.requires_grad
    x = torch.randn(5, 48)
    assert torch.equal(model(x), trained(x))
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


def test_load_layouts_replaces_a_root_layer_and_refuses_other_sizes():
    saved = bt.BlockSparseLinear(48, 32, LAYOUT, block_size=BS).state_dict()
    root = bt.BlockSparseLinear(48, 32, np.ones((3, 2)), block_size=BS)
    layer = bt.load_layouts(root, saved)
    assert layer is not root and np.array_equal(layer.op.layout, LAYOUT)
    other = bt.BlockSparseLinear(32, 32, np.ones((2, 2)), block_size=BS)
    with pytest.raises(ValueError, match=r"layout: the state_dict's layer maps 48 to 32 features, the model's 32 to "
                                         r"32; load_layouts changes layouts, not sizes"):
        bt.load_layouts(other, saved)


# -- item 8: sizes that are not multiples of the block size ----------------------------------------------
def test_sizes_not_multiples_of_the_block_size_are_refused_with_the_nearest():
    with pytest.raises(ValueError, match=r"in_features must be a multiple of block_size 32; got 784 \(nearest: 768 "
                                         r"or 800\)\. Keep a layer of such a size as torch\.nn\.Linear"):
        bt.BlockSparseLinear(784, 256, np.ones((25, 8)), block_size=32)
    with pytest.raises(ValueError, match=r"out_features must be a multiple of block_size 32; got 10 \(nearest: 32\)"
                                         r"\. Keep a layer of such a size as torch\.nn\.Linear"):
        bt.BlockSparseLinear(256, 10, np.ones((8, 1)), block_size=32)
    with pytest.raises(ValueError, match=r"in_channels must be a multiple of block_size 8; got 12 "
                                         r"\(nearest: 8 or 16\)"):
        bt.BlockSparseConv2d(12, 8, 3, np.ones((2, 1)), block_size=8)


def test_multiples_that_do_not_fit_the_layout_name_the_layout():
    with pytest.raises(ValueError, match=r"in_features must be layout.shape\[0\] \* block_size = 3 \* 16 = 48; got 64"):
        bt.BlockSparseLinear(64, 32, LAYOUT, block_size=BS)

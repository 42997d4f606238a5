"""bsmm.torch: the custom operators, blocksparse_matmul and BlockSparseLinear.

References are float64 dense products built by ``reference.py`` (never bsmm's own
``to_dense``), compared norm-wise (``reference.assert_close``: relative error
<= 1e-5 for float32, 1e-2 float16, 2e-2 bfloat16). CPU cases always run; CUDA
cases carry the ``gpu`` marker and need PyTorch with CUDA and CuPy.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bsmm.torch tests skipped")

import bsmm  # noqa: E402
import bsmm.backends.cpu  # noqa: E402
import bsmm.torch as bt  # noqa: E402
from bsmm.torch import ops as torch_ops  # noqa: E402
from reference import assert_close, dense_to_present_blocks, dense_weight, random_data, random_layout  # noqa: E402
from reference import ref_bprop, ref_fprop, ref_updat  # noqa: E402
import torch_cases  # noqa: E402
from torch_cases import cuda_or_skip  # noqa: E402

device = torch_cases.device  # the fixture (tests take it by name)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BS = 8


@pytest.fixture
def cuda() -> str:
    return cuda_or_skip()


def tensor(array, device="cpu", dtype=None, requires_grad=False) -> torch.Tensor:
    """A torch copy of host ``array`` (bfloat16 via float32, exactly)."""
    array = np.asarray(array)
    name = dtype or array.dtype.name
    result = torch.from_numpy(array.astype(np.float32)).to(device=device, dtype=TORCH_DTYPES[name])
    return result.requires_grad_(requires_grad)


def host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().double().numpy()


def make_layout(kind: str, rng, cb: int = 4, kb: int = 3) -> np.ndarray:
    if kind == "empty":
        return np.zeros((cb, kb), np.uint8)
    if kind == "full":
        return np.ones((cb, kb), np.uint8)
    return random_layout(rng, cb, kb, 0.5)


def shape_of(n: int, features: int, axis: int) -> tuple:
    return (n, features) if axis == 1 else (features, n)


# -- the passes against float64 references -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("kind,n", [("random", 7), ("random", 1), ("empty", 5), ("full", 3)])
def test_operators_match_dense(device, dtype, axis, kind, n):
    """The three custom operators on random, empty and full layouts, N odd and 1."""
    rng = np.random.default_rng(1)
    layout = make_layout(kind, rng)
    op = bsmm.BlocksparseMatMul(layout, BS, axis)
    registration = bt.register(op.index)  # held: the key resolves while it lives
    key = registration.key
    x, dy = random_data(rng, shape_of(n, op.C, axis), dtype), random_data(rng, shape_of(n, op.K, axis), dtype)
    w = random_data(rng, op.w_shape, dtype)
    tx, tdy, tw = (tensor(a, device) for a in (x, dy, w))
    y = torch.ops.bsmm.matmul.default(tx, tw, key, axis, False)
    dx = torch.ops.bsmm.matmul_bprop.default(tdy, tw, key, axis, False)
    dw = torch.ops.bsmm.matmul_updat.default(tx, tdy, key, axis, False)
    for result, shape in ((y, shape_of(n, op.K, axis)), (dx, shape_of(n, op.C, axis)), (dw, op.w_shape)):
        assert result.dtype == TORCH_DTYPES[dtype] and result.device.type == device and result.shape == shape
    assert_close(host(y), ref_fprop(layout, w, BS, x, axis), dtype, "fprop")
    assert_close(host(dx), ref_bprop(layout, w, BS, dy, axis), dtype, "bprop")
    assert_close(host(dw), ref_updat(layout, BS, x, dy, axis), dtype, "updat")


def test_empty_batch(device):
    """N = 0: empty outputs, zero weight gradient."""
    layer = bt.BlockSparseLinear(32, 24, np.ones((4, 3)), block_size=BS, device=device)
    x = torch.zeros(0, 32, device=device, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (0, 24) and x.grad.shape == (0, 32)
    assert not layer.weight.grad.any() and not layer.bias.grad.any()


@pytest.mark.parametrize("axis,batch", [(1, (2, 3)), (1, ()), (0, (5,)), (0, (2, 3))])
def test_blocksparse_matmul_batch_dimensions(device, axis, batch):
    """Leading (axis 1) or trailing (axis 0) batch dimensions, and a single vector."""
    rng = np.random.default_rng(2)
    layout = random_layout(rng, 4, 3, 0.6)
    op = bsmm.BlocksparseMatMul(layout, BS, axis)
    x = random_data(rng, (*batch, op.C) if axis == 1 else (op.C, *batch), "float32")
    w = random_data(rng, op.w_shape, "float32")
    y = bt.blocksparse_matmul(tensor(x, device), tensor(w, device), op)
    dense = dense_weight(layout, w, BS)
    expected = x @ dense if axis == 1 else np.tensordot(dense.T, x, axes=1)
    assert y.shape == expected.shape
    assert_close(host(y), expected, "float32")


# -- gradients --------------------------------------------------------------------------------------------
def _dense_model_gradients(layout, x, w, bias, upstream, axis):
    """dx, dW (C, K) and dbias of sum(upstream * (x·W + b)) in float64, dense, W built from the blocks."""
    x64 = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    w64 = torch.tensor(dense_weight(layout, w, BS), requires_grad=True)
    b64 = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
    y = x64 @ w64 + b64 if axis == 1 else w64.T @ x64 + b64[:, None]
    (y * torch.tensor(upstream, dtype=torch.float64)).sum().backward()
    return y.detach().numpy(), x64.grad.numpy(), w64.grad.numpy(), b64.grad.numpy()


@pytest.mark.parametrize("axis", [1, 0])
def test_gradients_match_float64_dense_model(device, axis):
    """bsmm's forward and autograd dx, dw, dbias against a float64 dense model at float32 tolerance
    (norm-wise relative error <= 1e-5); dw is compared with the dense model's dW cut to present blocks."""
    rng = np.random.default_rng(3)
    layout = random_layout(rng, 5, 3, 0.5)
    layer = bt.BlockSparseLinear(5 * BS, 3 * BS, layout, block_size=BS, feature_axis=axis, device=device)
    x = random_data(rng, shape_of(9, layer.in_features, axis), "float32")
    upstream = random_data(rng, shape_of(9, layer.out_features, axis), "float32")
    w, bias = host(layer.weight), host(layer.bias)
    tx = tensor(x, device, requires_grad=True)
    y = layer(tx)
    y.backward(tensor(upstream, device))
    y64, dx64, dw64, db64 = _dense_model_gradients(layout, x, w, bias, upstream, axis)
    assert_close(host(y), y64, "float32", "forward")
    assert_close(host(tx.grad), dx64, "float32", "dx")
    assert_close(host(layer.weight.grad), dense_to_present_blocks(layout, dw64, BS), "float32", "dw")
    assert_close(host(layer.bias.grad), db64, "float32", "dbias")


def test_weight_gradient_lands_only_on_present_blocks(device):
    """Blocks cut out of a dense parameter by indexing: its gradient is the dense model's gradient on
    present blocks and exactly zero on absent ones, where the dense gradient is not zero."""
    rng = np.random.default_rng(4)
    layout = random_layout(rng, 4, 4, 0.4)
    op = bsmm.BlocksparseMatMul(layout, BS)
    rows, cols = (torch.tensor(a, dtype=torch.long, device=device) for a in np.nonzero(layout))
    dense = tensor(random_data(rng, (op.C, op.K), "float32"), device, requires_grad=True)
    x = tensor(random_data(rng, (6, op.C), "float32"), device)
    blocks = dense.view(4, BS, 4, BS).permute(0, 2, 1, 3)[rows, cols]  # (nnzb, bs, bs), a new contiguous tensor
    bt.blocksparse_matmul(x, blocks, op).square().sum().backward()
    mask = np.kron(layout, np.ones((BS, BS))).astype(bool)
    x64 = host(x)
    full = x64.T @ (2 * x64 @ (host(dense) * mask))  # dW of the dense model x @ (W * mask)
    assert np.abs(full[~mask]).max() > 1, "the test needs non-zero dense gradients off the layout"
    assert (host(dense.grad)[~mask] == 0).all()
    assert_close(host(dense.grad)[mask], full[mask], "float32")


def _float64(array, requires_grad=False) -> torch.Tensor:
    return torch.tensor(np.asarray(array), dtype=torch.float64, requires_grad=requires_grad)


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("kind,n", [("random", 3), ("random", 1), ("empty", 2)])
def test_operators_in_float64_match_dense(axis, kind, n):
    """float64 CPU tensors are computed in float64: the three operators agree with the float64
    reference to 1e-12 relative (float32 arithmetic would be ~1e-7 off)."""
    rng = np.random.default_rng(11)
    layout = make_layout(kind, rng)
    op = bsmm.BlocksparseMatMul(layout, BS, axis)
    registration = bt.register(op.index)
    key = registration.key
    x, dy = rng.standard_normal(shape_of(n, op.C, axis)), rng.standard_normal(shape_of(n, op.K, axis))
    w = rng.standard_normal(op.w_shape)
    results = {
        "fprop": (torch.ops.bsmm.matmul.default(_float64(x), _float64(w), key, axis, False), ref_fprop(layout, w, BS, x, axis)),
        "bprop": (torch.ops.bsmm.matmul_bprop.default(_float64(dy), _float64(w), key, axis, False),
                  ref_bprop(layout, w, BS, dy, axis)),
        "updat": (torch.ops.bsmm.matmul_updat.default(_float64(x), _float64(dy), key, axis, False),
                  ref_updat(layout, BS, x, dy, axis)),
    }
    for name, (result, expected) in results.items():
        assert result.dtype == torch.float64, name
        error = np.linalg.norm(result.numpy() - expected) / max(np.linalg.norm(expected), 1e-300)
        assert error <= 1e-12, f"{name}: relative error {error:.3g}"


@pytest.mark.parametrize("axis", [1, 0])
def test_gradcheck_blocksparse_matmul_float64(axis):
    """torch.autograd.gradcheck and gradgradcheck in float64 at their default tolerances
    (eps 1e-6, atol 1e-5, rtol 1e-3) over x and w, with a batch dimension."""
    rng = np.random.default_rng(5)
    op = bsmm.BlocksparseMatMul(random_layout(rng, 3, 2, 0.7), BS, axis)
    x = _float64(rng.standard_normal((2, 3, op.C) if axis == 1 else (op.C, 3)), requires_grad=True)
    w = _float64(rng.standard_normal(op.w_shape), requires_grad=True)

    def function(a, b):
        return bt.blocksparse_matmul(a, b, op)

    assert torch.autograd.gradcheck(function, (x, w))
    assert torch.autograd.gradgradcheck(function, (x, w))


@pytest.mark.parametrize("axis", [1, 0])
def test_gradcheck_block_sparse_linear_float64(axis):
    """gradcheck and gradgradcheck (default tolerances) of a float64 BlockSparseLinear over its
    input, weight and bias, through torch.func.functional_call."""
    rng = np.random.default_rng(12)
    torch.manual_seed(12)
    layer = bt.BlockSparseLinear(3 * BS, 2 * BS, random_layout(rng, 3, 2, 0.7), block_size=BS,
                                 feature_axis=axis, dtype=torch.float64)
    assert layer.weight.dtype == layer.bias.dtype == torch.float64
    x = _float64(rng.standard_normal(shape_of(3, layer.in_features, axis)), requires_grad=True)
    w = layer.weight.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()

    def function(x, w, b):
        return torch.func.functional_call(layer, {"weight": w, "bias": b}, (x,))

    assert torch.autograd.gradcheck(function, (x, w, b))
    assert torch.autograd.gradgradcheck(function, (x, w, b))


@pytest.mark.parametrize("axis", [1, 0])
def test_second_order_gradients_match_dense(device, axis):
    """A gradient penalty: backward through bprop and updat (double backward) against float64 dense."""
    rng = np.random.default_rng(6)
    layout = random_layout(rng, 3, 4, 0.6)
    op = bsmm.BlocksparseMatMul(layout, BS, axis)
    x, w = random_data(rng, shape_of(5, op.C, axis), "float32"), random_data(rng, op.w_shape, "float32")

    def penalty(x_t, w_t, product):
        y = product(x_t, w_t)
        (dx,) = torch.autograd.grad(y.square().sum(), x_t, create_graph=True)
        return (dx.square().sum() + y.sum())

    tx, tw = tensor(x, device, requires_grad=True), tensor(w, device, requires_grad=True)
    penalty(tx, tw, lambda a, b: bt.blocksparse_matmul(a, b, op)).backward()
    x64 = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    w64 = torch.tensor(dense_weight(layout, w, BS), requires_grad=True)
    penalty(x64, w64, lambda a, b: a @ b if axis == 1 else b.T @ a).backward()
    assert_close(host(tx.grad), x64.grad.numpy(), "float32", "dx")
    assert_close(host(tw.grad), dense_to_present_blocks(layout, w64.grad.numpy(), BS), "float32", "dw")


# -- opcheck, torch.compile --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, dtype, axis, requires_grad):
    """Schema, fake tensor, autograd registration and AOT dispatch (dynamic shapes) of all three operators."""
    rng = np.random.default_rng(7)
    op = bsmm.BlocksparseMatMul(random_layout(rng, 3, 2, 0.6), BS, axis)
    registration = bt.register(op.index)
    key = registration.key

    def sample(shape):
        return tensor(random_data(rng, shape, dtype), device, requires_grad=requires_grad)

    x, dy, w = sample(shape_of(5, op.C, axis)), sample(shape_of(5, op.K, axis)), sample(op.w_shape)
    for operator, args in ((torch.ops.bsmm.matmul.default, (x, w)), (torch.ops.bsmm.matmul_bprop.default, (dy, w)),
                           (torch.ops.bsmm.matmul_updat.default, (x, dy))):
        results = torch.library.opcheck(operator, (*args, key, axis, False))
        assert set(results.values()) == {"SUCCESS"}, results


def _two_layers(axis=1, seed=8, device="cpu"):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    return torch.nn.Sequential(
        bt.BlockSparseLinear(32, 24, random_layout(rng, 4, 3, 0.6), block_size=BS, feature_axis=axis, device=device),
        torch.nn.ReLU(),
        bt.BlockSparseLinear(24, 16, random_layout(rng, 3, 2, 0.6), block_size=BS, feature_axis=axis, device=device),
    )


def _forward_backward(model, x):
    model.zero_grad()
    x = x.detach().requires_grad_()
    y = model(x)
    y.square().sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(device, axis, dynamic):
    """torch.compile(fullgraph=True) (aot_eager: the AOTAutograd graphs without inductor's compile time)
    traces the layers and their backward without graph breaks and agrees with eager."""
    model = _two_layers(axis, device=device)
    x = torch.randn((7, 32) if axis == 1 else (32, 7), device=device)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for got, expected in zip(_forward_backward(compiled, x), _forward_backward(model, x)):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_compile_blocksparse_matmul_with_an_op():
    """The functional form compiles too; another op (another layout) recompiles instead of reusing the graph."""
    rng = np.random.default_rng(9)
    ops = [bsmm.BlocksparseMatMul(random_layout(rng, 2, 2, 0.7), BS) for _ in range(2)]
    compiled = torch.compile(bt.blocksparse_matmul, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 2 * BS)
    for op in ops:
        w = torch.randn(op.w_shape)
        torch.testing.assert_close(compiled(x, w, op), bt.blocksparse_matmul(x, w, op), rtol=0, atol=0)


# -- autocast ------------------------------------------------------------------------------------------------
def test_autocast_cpu_bfloat16():
    """Under CPU autocast a float32 layer takes float32 input, computes in bfloat16 like nn.Linear,
    and returns float32 gradients for its float32 parameters."""
    rng = np.random.default_rng(10)
    layout = random_layout(rng, 4, 3, 0.6)
    layer = bt.BlockSparseLinear(32, 24, layout, block_size=BS)
    x = random_data(rng, (6, 32), "float32")
    tx = tensor(x, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(tx)
        reference_linear = torch.nn.functional.linear(tx, layer.to_dense_weight().T, layer.bias)
    assert y.dtype == reference_linear.dtype == torch.bfloat16
    y.float().sum().backward()
    assert tx.grad.dtype == layer.weight.grad.dtype == layer.bias.grad.dtype == torch.float32
    # autocast rounds x and w to bfloat16 before the product
    x16, w16 = (host(torch.as_tensor(a).bfloat16()) for a in (x, layer.weight.detach()))
    assert_close(host(y), ref_fprop(layout, w16, BS, x16, 1) + host(layer.bias), "bfloat16")
    assert_close(host(y), host(reference_linear), "bfloat16", "against nn.Linear under autocast")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(tx)
    assert compiled.dtype == torch.bfloat16 and torch.equal(compiled, y)


# -- the module -------------------------------------------------------------------------------------------
def test_module_parameters_and_repr():
    layout = np.array([[1, 0, 1], [0, 0, 1]])
    layer = bt.BlockSparseLinear(16, 24, layout, block_size=BS, bias=False, feature_axis=0, tf32=True)
    assert layer.weight.shape == (3, BS, BS) and layer.bias is None
    assert layer.layout.dtype == torch.uint8 and (layer.layout.numpy() == layout).all()
    assert repr(layer) == ("BlockSparseLinear(in_features=16, out_features=24, block_size=8, blocks=3, "
                           "density=0.5, bias=False, feature_axis=0, tf32=True)")
    half = bt.BlockSparseLinear(16, 24, layout, block_size=BS).to(torch.bfloat16)
    assert half.weight.dtype == half.bias.dtype == torch.bfloat16 and half.layout.dtype == torch.uint8
    assert half(torch.ones(2, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_initialization_scales_with_fan_in():
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)) per block column, seeded by torch.manual_seed; empty column: zero bias."""
    layout = np.zeros((16, 3), np.uint8)
    layout[:, 0], layout[:1, 1] = 1, 1  # fan-in 128 and 8; column 2 empty
    torch.manual_seed(0)
    layer = bt.BlockSparseLinear(128, 24, layout, block_size=BS)
    torch.manual_seed(0)
    again = bt.BlockSparseLinear(128, 24, layout, block_size=BS)
    assert torch.equal(layer.weight, again.weight) and torch.equal(layer.bias, again.bias)
    cols = torch.tensor(layer.op.indices)
    column_0, column_1 = layer.weight.detach()[cols == 0], layer.weight.detach()[cols == 1]
    assert column_0.abs().max() <= 128**-0.5 and column_0.std() == pytest.approx(128**-0.5 / 3**0.5, rel=0.05)
    assert column_1.abs().max() <= 8**-0.5 and column_1.abs().max() > 0.8 * 8**-0.5
    assert layer.bias[:8].abs().max() <= 128**-0.5 and not layer.bias[16:].any()
    layer.reset_parameters()
    assert not torch.equal(layer.weight, again.weight)


def test_to_dense_weight_places_blocks_and_is_differentiable():
    rng = np.random.default_rng(11)
    layout = random_layout(rng, 3, 4, 0.5)
    layer = bt.BlockSparseLinear(24, 32, layout, block_size=BS)
    dense = layer.to_dense_weight()
    assert dense.shape == (24, 32)
    np.testing.assert_array_equal(dense.detach().numpy(), dense_weight(layout, host(layer.weight), BS))
    dense.sum().backward()
    assert torch.equal(layer.weight.grad, torch.ones_like(layer.weight))


def test_state_dict_round_trip_into_a_fresh_module(tmp_path):
    rng = np.random.default_rng(12)
    layout = random_layout(rng, 4, 3, 0.5)
    torch.manual_seed(1)
    saved = bt.BlockSparseLinear(32, 24, layout, block_size=BS)
    torch.save(saved.state_dict(), tmp_path / "layer.pt")
    assert set(saved.state_dict()) == {"weight", "bias", "layout"}
    fresh = bt.BlockSparseLinear(32, 24, torch.tensor(layout), block_size=BS)
    fresh.load_state_dict(torch.load(tmp_path / "layer.pt", weights_only=True))
    x = torch.randn(3, 32)
    assert torch.equal(fresh(x), saved(x))


def test_state_dict_of_as_many_blocks_elsewhere_is_adopted():
    """A checkpoint of a layout changed while training (bsmm.torch.dynamic), as many blocks elsewhere: loading
    adopts its layout, and the layer computes what the saved one did."""
    layer = bt.BlockSparseLinear(16, 16, np.array([[1, 0], [0, 1]]), block_size=BS)
    weight = layer.weight
    source = bt.BlockSparseLinear(16, 16, np.array([[0, 1], [0, 1]]), block_size=BS)
    layer.load_state_dict(source.state_dict())
    assert layer.weight is weight and np.array_equal(layer.op.layout, [[0, 1], [0, 1]])
    x = torch.randn(3, 16)
    assert torch.equal(layer(x), source(x))
    assert np.array_equal(layer.state_dict()["layout"].numpy(), [[0, 1], [0, 1]])


@pytest.mark.parametrize("other", ["more blocks", "other shape"])
def test_state_dict_of_another_layout_is_refused(other):
    layout = np.array([[1, 0], [0, 1]])
    layer = bt.BlockSparseLinear(16, 16, layout, block_size=BS)
    if other == "more blocks":
        source = bt.BlockSparseLinear(16, 16, np.array([[1, 1], [0, 1]]), block_size=BS)
        match = r"layout: the state_dict holds a layout of shape \(2, 2\) with 3 blocks, this .* with 2 blocks; build"
    else:
        source = bt.BlockSparseLinear(24, 16, np.array([[1, 0], [0, 1], [1, 1]]), block_size=BS)
        match = r"layout: the state_dict holds a layout of shape \(3, 2\) with 4 blocks, this .* shape \(2, 2\)"
    before = layer.weight.detach().clone()
    with pytest.raises(RuntimeError, match=match):
        layer.load_state_dict(source.state_dict())
    with pytest.raises(RuntimeError, match="build the layer with the saved layout"):
        layer.load_state_dict(source.state_dict(), strict=False)
    assert torch.equal(layer.weight, before) and np.array_equal(layer.op.layout, layout)


def test_pickled_and_copied_modules_register_their_layout_again():
    """Pickling carries the layout only; the copy works after the original and its registration are gone."""
    rng = np.random.default_rng(13)
    layout = random_layout(rng, 5, 7, 0.3)  # a layout no other test uses
    layer = bt.BlockSparseLinear(40, 56, layout, block_size=BS)
    x = torch.randn(2, 40)
    with torch.no_grad():  # no pending backward that would hold the registration
        expected, key = layer(x), layer._key
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    data = pickle.dumps(layer)
    del layer
    gc.collect()
    with pytest.raises(ValueError, match="names no layout registered in this process"):
        bt.lookup(key)
    for restored in (pickle.loads(data), torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)):
        assert torch.equal(restored(x), expected)
        assert torch.equal(copy.deepcopy(restored)(x), expected)
        assert torch.equal(torch.compile(restored, fullgraph=True, backend="eager")(x), expected)


def test_backward_outlives_the_op():
    """A pending backward keeps its layout registered after the caller drops the op."""
    rng = np.random.default_rng(14)
    op = bsmm.BlocksparseMatMul(random_layout(rng, 6, 5, 0.3), BS)
    w = torch.randn(op.w_shape, requires_grad=True)
    y = bt.blocksparse_matmul(torch.randn(3, op.C), w, op)
    key = bt.register(op.index).key
    del op
    gc.collect()
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape
    del y
    gc.collect()
    with pytest.raises(ValueError, match="names no layout"):
        bt.lookup(key)


def test_inputs_are_not_modified(device):
    model = _two_layers(device=device)
    x = torch.randn(5, 32, device=device)
    before = [t.detach().clone() for t in (x, *model.parameters(), *model.buffers())]
    _forward_backward(model, x)
    after = [x, *model.parameters(), *model.buffers()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_cpu_passes_share_memory_with_the_tensors(monkeypatch):
    """Zero copy on the CPU: the backend reads x and w and writes y at the tensors' own addresses."""
    seen = []
    real = bsmm.backends.cpu.fprop

    def spy(index, x, w, out, *args, **kwargs):
        seen.append([a.__array_interface__["data"][0] for a in (x, w, out)])
        return real(index, x, w, out, *args, **kwargs)

    monkeypatch.setattr(bsmm.backends.cpu, "fprop", spy)
    for dtype in (torch.float32, torch.bfloat16):
        layer = bt.BlockSparseLinear(16, 16, np.ones((2, 2)), block_size=BS, bias=False, dtype=dtype)
        x = torch.randn(3, 16, dtype=dtype)
        y = layer(x)
        assert seen.pop() == [x.data_ptr(), layer.weight.data_ptr(), y.data_ptr()]


# -- errors ------------------------------------------------------------------------------------------------
@pytest.fixture
def small():
    layer = bt.BlockSparseLinear(24, 16, np.array([[1, 0], [1, 1], [0, 1]]), block_size=BS)
    return layer, torch.randn(5, 24)


def test_errors_name_the_argument(small):
    layer, x = small
    op, w = layer.op, layer.weight.detach()
    cases = [
        (TypeError, "x has dtype torch.int32; supported dtypes are float32, float16, bfloat16, and float64 on the CPU",
         lambda: layer(x.int())),
        (TypeError, "w has dtype torch.float32 but x has torch.float64; pass one dtype", lambda: layer(x.double())),
        (TypeError, "w has dtype torch.float16 but x has torch.float32; pass one dtype",
         lambda: bt.blocksparse_matmul(x, w.half(), op)),
        (ValueError, r"x must have shape \(\.\.\., 24\) with feature_axis=1; got \(5, 23\)", lambda: layer(x[:, :23])),
        (ValueError, r"x must have shape \(\.\.\., 24\) with feature_axis=1; got \(\)", lambda: layer(x[0, 0])),
        (ValueError, r"w must have shape w_shape \(4, 8, 8\); got \(3, 8, 8\)",
         lambda: bt.blocksparse_matmul(x, w[:3], op)),
        (TypeError, "x must be a torch.Tensor; got ndarray", lambda: layer(x.numpy())),
        (TypeError, "op must be a bsmm.BlocksparseMatMul; got BlockSparseLinear",
         lambda: bt.blocksparse_matmul(x, w, layer)),
        (ValueError, r"dy has N = 4 but x has N = 5",
         lambda: torch.ops.bsmm.matmul_updat.default(x, torch.randn(4, 16), layer._key, 1, False)),
        (ValueError, r"dy must have shape \(N, 16\)", lambda: torch.ops.bsmm.matmul_bprop.default(x, w, layer._key, 1, False)),
        (ValueError, "feature_axis must be 0 or 1; got 2", lambda: torch.ops.bsmm.matmul.default(x, w, layer._key, 2, False)),
        (ValueError, "key 'nope' names no layout registered", lambda: torch.ops.bsmm.matmul.default(x, w, "nope", 1, False)),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()


def test_constructor_errors():
    layout = np.ones((2, 3))
    with pytest.raises(ValueError, match=r"in_features must be layout.shape\[0\] \* block_size = 2 \* 8 = 16; got 24"):
        bt.BlockSparseLinear(24, 24, layout, block_size=BS)
    with pytest.raises(ValueError, match=r"in_features must be a multiple of block_size 8; got 15 "
                                         r"\(nearest: 8 or 16\)"):
        bt.BlockSparseLinear(15, 24, layout, block_size=BS)
    with pytest.raises(ValueError, match=r"out_features must be layout.shape\[1\] \* block_size = 3 \* 8 = 24"):
        bt.BlockSparseLinear(16, 16, layout, block_size=BS)
    with pytest.raises(TypeError, match="dtype has dtype torch.int32; supported dtypes are float32, float16, bfloat16"):
        bt.BlockSparseLinear(16, 24, layout, block_size=BS, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size must be one of"):
        bt.BlockSparseLinear(16, 24, layout, block_size=12)
    with pytest.raises(ValueError, match="feature_axis must be 0 or 1"):
        bt.BlockSparseLinear(16, 24, layout, block_size=BS, feature_axis=2)


@pytest.mark.gpu
def test_float64_is_refused_on_cuda(cuda):
    """float64 runs on the CPU only: CUDA tensors and a CUDA layer of float64 are refused by name."""
    with pytest.raises(TypeError, match="dtype has dtype torch.float64, which bsmm runs only on the CPU; on cuda"):
        bt.BlockSparseLinear(16, 16, np.ones((2, 2)), block_size=BS, device=cuda, dtype=torch.float64)
    layer = bt.BlockSparseLinear(16, 16, np.ones((2, 2)), block_size=BS, device=cuda)
    x, w = torch.randn(3, 16, device=cuda, dtype=torch.float64), layer.weight.detach().double()
    with pytest.raises(TypeError, match="x has dtype torch.float64, which bsmm runs only on the CPU; on cuda:0 "
                                        "supported dtypes are float32, float16, bfloat16"):
        bt.blocksparse_matmul(x, w, layer.op)
    with pytest.raises(TypeError, match="dy has dtype torch.float64, which bsmm runs only on the CPU"):
        torch.ops.bsmm.matmul_bprop.default(torch.randn(3, 16, device=cuda, dtype=torch.float64), w, layer._key, 1, False)


@pytest.mark.gpu
def test_mixed_devices_are_refused(cuda):
    layer = bt.BlockSparseLinear(16, 16, np.ones((2, 2)), block_size=BS, device=cuda)
    with pytest.raises(ValueError, match="w is on cuda:0 but x is on cpu; move them to one device"):
        bt.blocksparse_matmul(torch.randn(3, 16), layer.weight, layer.op)


def test_import_bsmm_imports_no_torch():
    code = "import sys, bsmm; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# -- training ------------------------------------------------------------------------------------------
class MaskedLinear(torch.nn.Linear):
    """nn.Linear whose weight is multiplied by the layout's mask, initialized from a BlockSparseLinear."""

    def __init__(self, layer: bt.BlockSparseLinear):
        super().__init__(layer.in_features, layer.out_features, device=layer.weight.device)
        with torch.no_grad():
            self.weight.copy_(layer.to_dense_weight().T)
            self.bias.copy_(layer.bias)
        mask = np.kron(layer.layout.cpu().numpy(), np.ones((layer.op.block_size,) * 2)).T
        self.register_buffer("mask", torch.tensor(mask, dtype=torch.float32, device=layer.weight.device))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight * self.mask, self.bias)


@pytest.mark.parametrize("device_kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_training_matches_a_masked_dense_model(device_kind):
    """8 SGD steps of a two-layer regression model: the losses of bsmm and of masked dense
    nn.Linear layers from the same initial weights agree to 1e-5 relative at every step."""
    device = "cpu" if device_kind == "cpu" else cuda_or_skip()
    sparse = _two_layers(seed=15, device=device)
    dense = torch.nn.Sequential(MaskedLinear(sparse[0]), torch.nn.ReLU(), MaskedLinear(sparse[2]))
    generator = torch.Generator().manual_seed(15)
    x = torch.randn(64, 32, generator=generator).to(device)
    target = torch.randn(64, 16, generator=generator).to(device)
    losses = {}
    for name, model in (("sparse", sparse), ("dense", dense)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[name] = []
        for _ in range(8):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    assert losses["sparse"][-1] < 0.9 * losses["sparse"][0], "the model should learn"
    np.testing.assert_allclose(losses["sparse"], losses["dense"], rtol=1e-5)
    for layer, masked in ((sparse[0], dense[0]), (sparse[2], dense[2])):
        assert_close(host(layer.to_dense_weight()), host(masked.weight * masked.mask).T, "float32")


# -- GPU: streams, allocations, compile ------------------------------------------------------------------
def _pass_calls(layer, x):
    dy = torch.randn(x.shape[0], layer.out_features, device=x.device)
    return {
        "fprop": lambda: torch.ops.bsmm.matmul.default(x, layer.weight.detach(), layer._key, 1, False),
        "bprop": lambda: torch.ops.bsmm.matmul_bprop.default(dy, layer.weight.detach(), layer._key, 1, False),
        "updat": lambda: torch.ops.bsmm.matmul_updat.default(x, dy, layer._key, 1, False),
    }


@pytest.mark.gpu
def test_gpu_each_pass_allocates_only_its_output(cuda):
    """Zero copy on the GPU: one allocation from PyTorch's allocator per pass, of the output's size."""
    layer = bt.BlockSparseLinear(256, 128, random_layout(np.random.default_rng(16), 8, 4, 0.5), block_size=32,
                                 device=cuda)
    x = torch.randn(96, 256, device=cuda)
    results = []  # kept alive: freeing one pass's result would show in the next pass's figures
    for name, call in _pass_calls(layer, x).items():
        results.append(call())  # first use builds the launch plan (CuPy's memory, not PyTorch's)
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
        result = call()
        results.append(result)
        after = torch.cuda.memory_stats()
        allocations = after["allocation.all.allocated"] - before["allocation.all.allocated"]
        grown = after["allocated_bytes.all.current"] - before["allocated_bytes.all.current"]
        assert allocations == 1, f"{name}: {allocations} allocations"
        assert grown == -(-result.numel() * result.element_size() // 512) * 512, f"{name}: {grown} bytes"


@pytest.mark.gpu
def test_gpu_kernels_write_the_output_tensor_on_torch_stream(cuda, monkeypatch):
    """The kernel's out is the returned tensor's memory, and it runs on PyTorch's current (side) stream."""
    import cupy

    import bsmm.backends.cuda.backend

    seen = []
    real = bsmm.backends.cuda.backend.fprop

    def spy(index, x, w, out, *args, **kwargs):
        seen.append((x.data.ptr, w.data.ptr, out.data.ptr, cupy.cuda.get_current_stream().ptr))
        return real(index, x, w, out, *args, **kwargs)

    monkeypatch.setattr(bsmm.backends.cuda.backend, "fprop", spy)
    layer = bt.BlockSparseLinear(64, 64, np.ones((2, 2)), block_size=32, bias=False, device=cuda)
    x = torch.randn(8, 64, device=cuda)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = layer(x)
    torch.cuda.current_stream().wait_stream(side)
    assert seen == [(x.data_ptr(), layer.weight.data_ptr(), y.data_ptr(), side.cuda_stream)]
    torch.testing.assert_close(y, x @ layer.to_dense_weight(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_autocast(cuda, dtype):
    layer = bt.BlockSparseLinear(64, 64, np.array([[1, 0], [1, 1]]), block_size=32, device=cuda)
    x = torch.randn(16, 64, device=cuda, requires_grad=True)
    with torch.autocast("cuda", dtype=dtype):
        y = layer(x)
        expected = torch.nn.functional.linear(x, layer.to_dense_weight().T, layer.bias)
    assert y.dtype == dtype
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32
    assert_close(host(y), host(expected), "float16" if dtype == torch.float16 else "bfloat16")


@pytest.mark.gpu
def test_gpu_compile_with_inductor(cuda):
    model = _two_layers(device=cuda)
    x = torch.randn(16, 32, device=cuda)
    compiled = torch.compile(model, fullgraph=True)
    for got, expected in zip(_forward_backward(compiled, x), _forward_backward(model, x)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_tf32_layer(cuda):
    """tf32=True reaches the kernels: float32 on TF32 tensor cores, ~1e-3 relative error (bound 5e-3)."""
    rng = np.random.default_rng(17)
    layout = random_layout(rng, 4, 4, 0.5)
    layer = bt.BlockSparseLinear(128, 128, layout, block_size=32, bias=False, tf32=True, device=cuda)
    x = random_data(rng, (64, 128), "float32")
    y = layer(tensor(x, cuda))
    error = np.linalg.norm(host(y) - ref_fprop(layout, host(layer.weight), 32, x, 1))
    assert error <= 5e-3 * np.linalg.norm(ref_fprop(layout, host(layer.weight), 32, x, 1))

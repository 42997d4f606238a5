"""bsmm.torch's convolutions: blocksparse_conv, the conv operators and BlockSparseConv1d/2d/3d.

Compared with PyTorch's own dense convolution (``F.conv1d/2d/3d``) on the layout-masked
weight, built from the blocks by ``reference.dense_weight`` (never bsmm's ``to_dense``);
weight gradients are the dense gradient cut into the present blocks. CPU cases always
run; CUDA cases carry the ``gpu`` marker and need PyTorch with CUDA and CuPy.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bsmm.torch tests skipped")
F = torch.nn.functional

import bsmm.torch as bt  # noqa: E402
from bsmm.torch import conv_ops  # noqa: E402
from bsmm.nn.conv import BlocksparseConv  # noqa: E402
from reference import assert_close, dense_to_present_blocks, dense_weight, random_data, random_layout  # noqa: E402
from test_torch import _forward_backward, host  # noqa: E402
import torch_cases  # noqa: E402
from torch_cases import cuda_or_skip  # noqa: E402

device = torch_cases.device  # the fixture (tests take it by name)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}
BS = 8
DENSE_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def tensor(array, device="cpu", dtype=None, requires_grad=False) -> torch.Tensor:
    """A torch copy of host ``array`` (bfloat16 via float32, exactly)."""
    array = np.asarray(array)
    result = torch.from_numpy(array.astype(np.float64)).to(device=device, dtype=TORCH_DTYPES[dtype or array.dtype.name])
    return result.requires_grad_(requires_grad)


def torch_weight(conv: BlocksparseConv, w) -> np.ndarray:
    """The masked dense weight as ``nn.Conv`` holds it: (K, C, *kernel_size), float64."""
    per_offset = np.asarray(w, np.float64).reshape((-1,) + conv.index.w_shape)
    dense = np.stack([dense_weight(conv.layout, blocks, conv.block_size) for blocks in per_offset])
    return np.moveaxis(dense.reshape(conv.kernel_size + (conv.C, conv.K)), (-1, -2), (0, 1))


def present_blocks(conv: BlocksparseConv, dense_grad: np.ndarray) -> np.ndarray:
    """A dense weight gradient (K, C, *kernel_size) cut into w_shape."""
    per_offset = np.moveaxis(dense_grad, (0, 1), (-1, -2)).reshape(-1, conv.C, conv.K)
    blocks = [dense_to_present_blocks(conv.layout, m, conv.block_size) for m in per_offset]
    return np.stack(blocks).reshape(conv.w_shape)


def dense_model(conv: BlocksparseConv, x64: torch.Tensor, weight64: torch.Tensor) -> torch.Tensor:
    """PyTorch's float64 convolution on channels-first ``x64``."""
    return DENSE_CONV[conv.ndim](x64, weight64, stride=conv.stride, padding=conv.padding, dilation=conv.dilation)


GEOMETRIES = {  # kernel_size, stride, padding, dilation, input spatial shape
    "1d-5-s2-p2": ((5,), 2, 2, 1, (11,)),
    "2d-3x3-p1": ((3, 3), 1, 1, 1, (5, 6)),
    "2d-3x2-s(2,3)-d2": ((3, 2), (2, 3), (1, 0), 2, (9, 10)),
    "3d-3-s2-p1": ((3, 3, 3), 2, 1, 1, (4, 5, 3)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_blocksparse_conv_matches_torch(device, name, channels_last, dtype):
    """Forward, input and weight gradients against F.conv on the masked weight in float64."""
    kernel, stride, padding, dilation, spatial = GEOMETRIES[name]
    rng = np.random.default_rng([len(name), channels_last, len(dtype)])
    layout = random_layout(rng, 3, 2, 0.6)
    layout[0, 0] = 1
    conv = BlocksparseConv(layout, BS, kernel, stride, padding, dilation, channels_last=channels_last)
    x = random_data(rng, (2, conv.C, *spatial), dtype)  # channels first on the host
    w = random_data(rng, conv.w_shape, dtype)
    x_in = np.ascontiguousarray(np.moveaxis(x, 1, -1)) if channels_last else x
    tx, tw = tensor(x_in, device, requires_grad=True), tensor(w, device, requires_grad=True)
    y = bt.blocksparse_conv(tx, tw, conv)
    assert y.dtype == TORCH_DTYPES[dtype] and y.device.type == device
    dy = random_data(rng, tuple(y.shape), dtype)
    y.backward(tensor(dy, device))
    x64, w64 = tensor(x, dtype="float64", requires_grad=True), torch.tensor(torch_weight(conv, w), requires_grad=True)
    y64 = dense_model(conv, x64, w64)
    dy64 = torch.tensor(dy.astype(np.float64))
    dy64 = dy64.movedim(-1, 1) if channels_last else dy64
    y64.backward(dy64)
    to_layout = (lambda a: np.moveaxis(a, 1, -1)) if channels_last else (lambda a: a)
    assert_close(host(y), to_layout(y64.detach().numpy()), dtype, "y")
    assert_close(host(tx.grad), to_layout(x64.grad.numpy()), dtype, "dx")
    assert_close(host(tw.grad), present_blocks(conv, w64.grad.numpy()), dtype, "dw")


@pytest.mark.parametrize("name, spatial, fast", [("1d-5-s2-p2", (11,), False), ("2d-3x2-s(2,3)-d2", (5, 7), True)])
def test_gradcheck_float64(name, spatial, fast):
    """gradcheck and gradgradcheck (default tolerances) over x and w: every pass's backward is a pass.

    The full Jacobian for 1-D gradcheck (1.5 s); the rest in fast mode (a random projection of
    the Jacobian: a full 2-D gradgradcheck takes 15 s of CPU passes).
    """
    kernel, stride, padding, dilation, _ = GEOMETRIES[name]
    rng = np.random.default_rng(11)
    conv = BlocksparseConv(np.array([[1, 1]]), BS, kernel, stride, padding, dilation)  # C = 8, K = 16
    x = tensor(rng.standard_normal((1, *spatial, conv.C)), requires_grad=True)
    w = tensor(rng.standard_normal(conv.w_shape), requires_grad=True)

    def function(a, b):
        return bt.blocksparse_conv(a, b, conv)

    assert torch.autograd.gradcheck(function, (x, w), fast_mode=fast)
    assert torch.autograd.gradgradcheck(function, (x, w), fast_mode=True)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, requires_grad):
    """Schema, fake tensors, autograd registration and AOT dispatch of the three conv operators."""
    rng = np.random.default_rng(12)
    conv = BlocksparseConv(random_layout(rng, 2, 3, 0.6), BS, (3, 3), stride=(2, 1), padding=1, channels_last=False)
    registration = bt.register(conv.index)
    spec = conv_ops.conv_spec(conv, (5, 4))

    def sample(shape):
        return tensor(random_data(rng, shape, "float32"), device, requires_grad=requires_grad)

    x, w = sample((3, conv.C, 5, 4)), sample(conv.w_shape)
    dy = sample(conv.output_shape(tuple(x.shape)))
    for operator, args in ((conv_ops.conv_fprop, (x, w)), (conv_ops.conv_bprop, (dy, w)),
                           (conv_ops.conv_updat, (x, dy))):
        results = torch.library.opcheck(operator, (*args, registration.key, spec, False))
        assert set(results.values()) == {"SUCCESS"}, results


def _model(device="cpu", seed=13):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    return torch.nn.Sequential(
        bt.BlockSparseConv2d(16, 24, 3, random_layout(rng, 2, 3, 0.7), block_size=BS, padding=1, device=device),
        torch.nn.ReLU(),
        bt.BlockSparseConv2d(24, 16, (1, 3), random_layout(rng, 3, 2, 0.7), block_size=BS, stride=2, device=device),
    )


@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
def test_layers_match_a_dense_model(device, memory_format):
    """Two BlockSparseConv2d layers against nn.functional.conv2d with their dense weights: outputs,
    input, weight and bias gradients; channels_last inputs give channels_last outputs."""
    model = _model(device)
    x = torch.randn(2, 16, 7, 6, device=device)
    if memory_format == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    got = _forward_backward(model, x)
    assert got[0].shape == (2, 16, 4, 2)
    assert got[0].is_contiguous(memory_format=getattr(torch, memory_format.replace("contiguous", "contiguous_format")))
    first, _, second = model
    weights = [layer.to_dense_weight().detach().double().requires_grad_() for layer in (first, second)]
    biases = [layer.bias.detach().double().requires_grad_() for layer in (first, second)]
    x64 = x.detach().double().requires_grad_()
    hidden = F.relu(F.conv2d(x64, weights[0], biases[0], padding=1))
    y64 = F.conv2d(hidden, weights[1], biases[1], stride=2)
    y64.square().sum().backward()
    assert_close(host(got[0]), host(y64), "float32", "y")
    assert_close(host(got[1]), host(x64.grad), "float32", "dx")
    for layer, grad, weight, bias in zip((first, second), (got[2:4], got[4:6]), weights, biases):
        assert_close(host(grad[0]), present_blocks(layer.op, host(weight.grad)), "float32", "dw")
        assert_close(host(grad[1]), host(bias.grad), "float32", "db")


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(device, dynamic):
    """torch.compile(fullgraph=True, aot_eager) traces the layers and their backward and agrees with eager."""
    model = _model(device)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for batch in (3, 4):
        x = torch.randn(batch, 16, 5, 6, device=device)
        for got, expected in zip(_forward_backward(compiled, x), _forward_backward(model, x)):
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_compile_blocksparse_conv():
    rng = np.random.default_rng(14)
    conv = BlocksparseConv(random_layout(rng, 2, 2, 0.7), BS, (3,), padding=1)
    compiled = torch.compile(bt.blocksparse_conv, fullgraph=True, backend="aot_eager")
    x, w = torch.randn(2, 9, conv.C), torch.randn(conv.w_shape)
    torch.testing.assert_close(compiled(x, w, conv), bt.blocksparse_conv(x, w, conv), rtol=0, atol=0)


@pytest.mark.parametrize("layer_type, shape", [(bt.BlockSparseConv1d, (2, 16, 9)),
                                               (bt.BlockSparseConv3d, (1, 16, 3, 4, 5))])
def test_1d_and_3d_layers(layer_type, shape):
    """Both memory formats (a transposed 1-D input, channels_last_3d) against F.conv1d/3d."""
    rng = np.random.default_rng(15)
    layer = layer_type(16, 8, 3, random_layout(rng, 2, 1, 1.0), block_size=BS, padding=1, dilation=1)
    dense = DENSE_CONV[len(shape) - 2]
    x = torch.randn(shape)
    fast = x.movedim(1, -1).contiguous().movedim(-1, 1)  # channels last in memory
    expected = dense(x, layer.to_dense_weight(), layer.bias, padding=1)
    for x_in in (x, fast):
        torch.testing.assert_close(layer(x_in), expected, rtol=1e-5, atol=1e-5)


def test_autocast_cpu_bfloat16():
    rng = np.random.default_rng(16)
    layer = bt.BlockSparseConv2d(16, 16, 3, random_layout(rng, 2, 2, 0.7), block_size=BS, padding=1)
    x = torch.randn(2, 16, 5, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        dense = F.conv2d(x, layer.to_dense_weight(), layer.bias, padding=1)
    assert y.dtype == dense.dtype == torch.bfloat16
    assert_close(host(y), host(dense), "bfloat16")
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32


def test_initialization_and_dense_weight():
    """U(±1/sqrt(fan-in)) per output channel, fan-in = present blocks × block size × kernel volume;
    to_dense_weight places the blocks where torch_weight (the reference) does."""
    torch.manual_seed(17)
    layout = np.array([[1, 1], [1, 0], [1, 0], [1, 0]])  # fan-in 4 and 1 blocks
    layer = bt.BlockSparseConv2d(4 * 32, 2 * 32, (3, 3), layout, block_size=32)
    w = layer.weight.detach().numpy()
    columns = layer.op.index.indices
    full, single = w[:, :, columns == 0], w[:, :, columns == 1]
    assert abs(full).max() <= 1 / np.sqrt(4 * 32 * 9) and abs(single).max() <= 1 / np.sqrt(32 * 9)
    assert abs(single).max() > 0.9 / np.sqrt(32 * 9)
    np.testing.assert_array_equal(host(layer.to_dense_weight()), torch_weight(layer.op, w))


def test_state_dict_pickle_and_repr(tmp_path):
    rng = np.random.default_rng(18)
    layout = random_layout(rng, 2, 3, 0.6)
    layer = bt.BlockSparseConv2d(16, 24, 3, layout, block_size=BS, stride=2, bias=False)
    assert repr(layer) == (f"BlockSparseConv2d(16, 24, kernel_size=(3, 3), stride=(2, 2), padding=(0, 0), "
                           f"dilation=(1, 1), block_size=8, blocks={int(layout.sum())}, "
                           f"density={layout.mean():.3g}, bias=False)")
    x = torch.randn(1, 16, 7, 7)
    fresh = bt.BlockSparseConv2d(16, 24, 3, layout, block_size=BS, stride=2, bias=False)
    fresh.load_state_dict(layer.state_dict())
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)
    for clone in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        torch.testing.assert_close(clone(x), layer(x), rtol=0, atol=0)
    other = bt.BlockSparseConv2d(16, 24, 3, 1 - layout, block_size=BS, stride=2, bias=False)
    with pytest.raises(RuntimeError, match=r"this BlockSparseConv2d has shape \(2, 3\).*BlockSparseConv2d\(\.\.\., "):
        other.load_state_dict(layer.state_dict())


def test_inputs_are_not_modified(device):
    model = _model(device)
    x = torch.randn(2, 16, 6, 6, device=device).to(memory_format=torch.channels_last)
    before = x.clone()
    _forward_backward(model, x)
    assert torch.equal(x, before)


def test_repeated_calls_reuse_one_operator_per_layout_and_geometry(device, monkeypatch):
    """The custom operators keep the convolution (and its row maps, stacked layouts, plans) on the
    layout's registration: training steps build it once, not once per call of every pass."""
    built = []
    real = BlocksparseConv.from_index.__func__

    def counting(cls, *args, **kwargs):
        built.append(args[1:])
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(BlocksparseConv, "from_index", classmethod(counting))
    rng = np.random.default_rng(9)
    layer = bt.BlockSparseConv2d(16, 24, 3, random_layout(rng, 2, 3, 0.7), block_size=BS, padding=1, device=device)
    x = torch.randn(2, 16, 5, 5, device=device, requires_grad=True)
    for _ in range(3):
        layer(x).square().sum().backward()
    assert len(built) == 1, f"built {len(built)} convolutions for 3 steps of 3 passes"


def test_errors_name_the_argument():
    conv = BlocksparseConv(np.ones((2, 1)), BS, (3, 3))
    x, w = torch.randn(1, 5, 5, 16), torch.randn(conv.w_shape)
    cases = [
        (lambda: bt.blocksparse_conv(x.numpy(), w, conv), TypeError, "x must be a torch.Tensor"),
        (lambda: bt.blocksparse_conv(x, w, "conv"), TypeError, "conv must be a bsmm.nn.conv.BlocksparseConv"),
        (lambda: bt.blocksparse_conv(x[0], w, conv), ValueError, r"x must have shape \(N, \*spatial, C\)"),
        (lambda: bt.blocksparse_conv(x[..., :8].contiguous(), w, conv), ValueError, r"x must have shape \(1, 5, 5, 16\)"),
        (lambda: bt.blocksparse_conv(x, w[:1], conv), ValueError, "w must have shape"),
        (lambda: bt.blocksparse_conv(x, w.double(), conv), TypeError, "w has dtype torch.float64 but x has"),
        (lambda: bt.blocksparse_conv(x.int(), w, conv), TypeError, "x has dtype torch.int32"),
        (lambda: bt.blocksparse_conv(x[:, :2, :2].contiguous(), w, conv), ValueError, "smaller than the dilated"),
        (lambda: bt.BlockSparseConv2d(16, 16, 3, np.ones((2, 1)), BS), ValueError, "out_channels must be"),
        (lambda: bt.BlockSparseConv2d(16, 8, (3,), np.ones((2, 1)), BS), ValueError,
         "kernel_size must be an int or a tuple of 2 ints for BlockSparseConv2d"),
        (lambda: bt.BlockSparseConv1d(16, 8, 3, np.ones((2, 1)), BS)(torch.randn(2, 8, 9)), ValueError,
         r"x must have shape \(N, 16, \*spatial\)"),
        (lambda: conv_ops.conv_fprop(x, w, bt.register(conv.index).key, [2, 3], False), ValueError,
         "spec must be"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


# -- GPU only ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_layer_in_half_precision_channels_last(dtype):
    """The benchmark's path: a channels_last half-precision layer on CUDA against cuDNN on the dense weight."""
    device = cuda_or_skip()
    layer = bt.BlockSparseConv2d(64, 64, 3, random_layout(np.random.default_rng(19), 2, 2, 0.5), block_size=32,
                                 padding=1, device=device, dtype=TORCH_DTYPES[dtype])
    x = torch.randn(4, 64, 9, 10, device=device, dtype=TORCH_DTYPES[dtype]).to(memory_format=torch.channels_last)
    y = layer(x)
    assert y.is_contiguous(memory_format=torch.channels_last)
    dense = F.conv2d(x.float(), layer.to_dense_weight().float(), layer.bias.float(), padding=1)
    assert_close(host(y), host(dense), dtype)

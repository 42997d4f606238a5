"""bsmm.torch's fused epilogue: ``BlockSparseLinear(activation=)`` and ``blocksparse_matmul(bias=, activation=)``.

References are dense float64 models on the CPU built with ``torch.nn.functional`` from the layer's own
``to_dense_weight`` (their weight gradients reach the present blocks through it), compared norm-wise
(``reference.assert_close``, each dtype's tolerance). CPU cases always run (float32 and float64); CUDA
cases carry the ``gpu`` marker (``device``) and run float32, bfloat16 and float16. Second derivatives
(gradgradcheck) of the activations that keep z go through the backward that recomputes z differentiably.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bsmm.torch tests skipped")

import torch.nn.functional as F  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import bsmm  # noqa: E402
import bsmm.torch as bt  # noqa: E402
from reference import assert_close  # noqa: E402
import torch_cases  # noqa: E402

device = torch_cases.device  # the fixture (tests take it by name)

BS = 8
#: Block column 1 is empty: there the output is A(bias) alone.
LAYOUT = np.array([[1, 0, 1], [0, 0, 1], [1, 0, 0], [1, 0, 1]], np.uint8)
REFERENCES = {None: lambda z: z, "none": lambda z: z, "relu": F.relu, "gelu": F.gelu,
              "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "silu": F.silu}
ACTIVATIONS = [None, "relu", "gelu", "gelu_tanh", "silu"]
DTYPES = {"cpu": (torch.float32, torch.float64), "cuda": (torch.float32, torch.bfloat16, torch.float16)}
PASS_OPERATORS = ("fprop", "bprop", "updat", "fprop_epilogue")

PRE_READERS = ("gelu", "gelu_tanh", "silu")  # their backward reads the pre-activation z


def gradcheck_cases():
    for activation in ("none", "relu", *PRE_READERS):
        for name, check in (("grad", torch.autograd.gradcheck), ("gradgrad", torch.autograd.gradgradcheck)):
            yield pytest.param(activation, check, id=f"{activation}-{name}")


def host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().double().numpy()


def make_layer(activation, bias=True, axis=1, dtype=torch.float32, device="cpu", seed=0, layout=LAYOUT):
    torch.manual_seed(seed)
    layer = bt.BlockSparseLinear(layout.shape[0] * BS, layout.shape[1] * BS, layout, block_size=BS, bias=bias,
                                 feature_axis=axis, device=device, dtype=dtype, activation=activation)
    if bias:
        with torch.no_grad():  # non-zero on the empty block column too
            layer.bias.copy_(torch.randn(layer.out_features, dtype=torch.float64))
    return layer


def batch_shape(features: int, axis: int, ndim: int) -> tuple:
    batch = (2, 3) if ndim == 3 else (5,)
    return (*batch, features) if axis == 1 else (features, *batch)


def dense_reference(layer, x, activation):
    """(float64 CPU copy of ``layer``, float64 x, F.<act>(x·W + b)): the dense model, differentiable."""
    ref = copy.deepcopy(layer).to("cpu", torch.float64)
    x64 = x.detach().to("cpu", torch.float64).requires_grad_()
    dense = ref.to_dense_weight()
    if layer.feature_axis == 1:
        z = x64 @ dense + (0 if ref.bias is None else ref.bias)
    else:
        z = torch.tensordot(dense, x64, dims=([0], [0]))
        z = z + (0 if ref.bias is None else ref.bias.view(-1, *[1] * (x64.dim() - 1)))
    return ref, x64, REFERENCES[activation](z)


# -- 1. the layer against the dense model --------------------------------------------------------------------
def layer_cases(test):
    """Every activation, with and without a bias, both feature axes, 2-D and 3-D inputs."""
    for name, values in (("ndim", [2, 3]), ("axis", [1, 0]), ("bias", [True, False]), ("activation", ACTIVATIONS)):
        test = pytest.mark.parametrize(name, values)(test)
    return test


def layer_and_input(activation, bias, axis, ndim, dtype, device):
    """A layer of the case and a float64-drawn input of its batch shape in ``dtype``."""
    layer = make_layer(activation, bias, axis, dtype, device)
    return layer, torch.randn(batch_shape(layer.in_features, axis, ndim), dtype=torch.float64).to(device, dtype)


@layer_cases
def test_forward_matches_dense(device, activation, bias, axis, ndim):
    """A(x·W + b) against F.<act> of the dense product, 2-D and 3-D, both feature axes, each dtype."""
    for dtype in DTYPES[device]:
        layer, x = layer_and_input(activation, bias, axis, ndim, dtype, device)
        y = layer(x)
        assert y.shape == batch_shape(layer.out_features, axis, ndim) and y.dtype == dtype
        assert_close(host(y), host(dense_reference(layer, x, activation)[2]), str(dtype)[6:], f"y ({dtype})")


@layer_cases
def test_gradients_match_dense(device, activation, bias, axis, ndim):
    """dx, dW (the dense model's cut to the present blocks) and dbias of backward(g), random g."""
    for dtype in DTYPES[device]:
        layer, x = layer_and_input(activation, bias, axis, ndim, dtype, device)
        x.requires_grad_()
        y = layer(x)
        g = torch.randn(y.shape, dtype=torch.float64).to(device, dtype)
        y.backward(g)
        ref, x64, y64 = dense_reference(layer, x, activation)
        y64.backward(g.to("cpu", torch.float64))
        name = str(dtype)[6:]
        assert_close(host(x.grad), host(x64.grad), name, f"dx ({dtype})")
        assert_close(host(layer.weight.grad), host(ref.weight.grad), name, f"dW ({dtype})")
        if bias:
            assert_close(host(layer.bias.grad), host(ref.bias.grad), name, f"dbias ({dtype})")


@pytest.mark.parametrize("fused", [True, False], ids=["y-and-z-fused", "z-then-torch"])
@pytest.mark.parametrize("activation", PRE_READERS)
def test_training_forward_of_either_size(device, activation, fused, monkeypatch):
    """Above FUSED_PRE_MAX_BYTES a training forward of GELU or SiLU writes z alone and PyTorch applies the
    activation (eager.keeps_pre_fused); below, one kernel writes y and z: both agree with the dense model."""
    from bsmm.torch import eager

    monkeypatch.setattr(eager, "FUSED_PRE_MAX_BYTES", 1 << 40 if fused else 0)
    for dtype in DTYPES[device]:
        layer = make_layer(activation, True, 1, dtype, device)
        x = torch.randn(batch_shape(layer.in_features, 1, 3), dtype=torch.float64).to(device, dtype).requires_grad_()
        y = layer(x)
        assert (type(y.grad_fn).__name__ == "BiasActBackward") == fused and y._base is None
        g = torch.randn(y.shape, dtype=torch.float64).to(device, dtype)
        y.backward(g)
        ref, x64, y64 = dense_reference(layer, x, activation)
        y64.backward(g.to("cpu", torch.float64))
        name = str(dtype)[6:]
        assert_close(host(y), host(y64), name, f"y ({dtype})")
        assert_close(host(x.grad), host(x64.grad), name, f"dx ({dtype})")
        assert_close(host(layer.weight.grad), host(ref.weight.grad), name, f"dW ({dtype})")
        assert_close(host(layer.bias.grad), host(ref.bias.grad), name, f"dbias ({dtype})")


# -- 2. gradcheck and gradgradcheck through blocksparse_matmul --------------------------------------------------
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation,check", list(gradcheck_cases()))
def test_gradcheck(activation, check, bias, axis):
    """Float64 finite differences, first and second order, through blocksparse_matmul(bias=, activation=)."""
    op = bsmm.BlocksparseMatMul(LAYOUT[:2, [0, 2]], BS, axis)  # (16, 16), 3 blocks, no empty column
    generator = torch.Generator().manual_seed(3)
    x = torch.randn((3, op.C) if axis == 1 else (op.C, 3), dtype=torch.float64, generator=generator)
    w = torch.randn(op.w_shape, dtype=torch.float64, generator=generator)
    b = torch.randn(op.K, dtype=torch.float64, generator=generator) if bias else None
    if activation == "relu":  # finite differences need every z away from relu's kink
        z = bt.blocksparse_matmul(x, w, op, bias=b, activation="none")
        assert z.abs().min() > 1e-3, "pick another seed: some z is at relu's kink"
    inputs = tuple(t.requires_grad_() for t in (x, w, b) if t is not None)

    def f(x, w, *b):
        return bt.blocksparse_matmul(x, w, op, bias=b[0] if b else None, activation=activation)

    assert check(f, inputs)


# -- 3. outputs are not views ----------------------------------------------------------------------------------
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_output_is_not_a_view(device, activation, axis, grad):
    """FSDP2 wants module outputs that are not views: 3-D input (reshaped to 2-D inside) with a bias."""
    layer = make_layer(activation, True, axis, device=device)
    x = torch.randn(batch_shape(layer.in_features, axis, 3), device=device, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        y = layer(x)
    assert y._base is None and y.is_contiguous() and y.shape == batch_shape(layer.out_features, axis, 3)


# -- 4. torch.compile ------------------------------------------------------------------------------------------
def make_mlp(activation, axis, device):
    first = make_layer(activation, True, axis, device=device, seed=1)
    second = make_layer(None, True, axis, device=device, seed=2, layout=np.array([[1, 0], [1, 1], [0, 1]]))
    return torch.nn.Sequential(first, second)


def forward_backward(model, x):
    model.zero_grad()
    x = x.detach().requires_grad_()
    y = model(x)
    y.backward(torch.ones_like(y) + y.detach())  # d(½ Σ(y+1)²)/dy: not constant in y
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_compiled_mlp_matches_eager_without_breaks_or_recompiles(device, activation, axis):
    torch._dynamo.reset()
    counters.clear()
    model = make_mlp(activation, axis, device)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for call in range(3):
        x = torch.randn(batch_shape(model[0].in_features, axis, 3), device=device)
        stance = torch.compiler.set_stance("fail_on_recompile") if call else contextlib.nullcontext()
        with stance:
            got = forward_backward(compiled, x)
        for a, b in zip(got, forward_backward(model, x)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


# -- 5. the fast path: operators without an autograd layer --------------------------------------------------
@pytest.mark.parametrize("name", PASS_OPERATORS)
def test_pass_operators_have_no_autograd_kernel(name):
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", "Autograd")  # the query works
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"bsmm::{name}", "Autograd")
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"bsmm::{name}", key)


def bsmm_targets(graph_module) -> set:
    """The bsmm operators a graph calls, as ``"bsmm.<name>.default"``."""
    return {str(node.target) for node in graph_module.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("bsmm.")}


FAST = {f"bsmm.{name}.default" for name in PASS_OPERATORS}


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_compiled_graphs_call_only_the_pass_operators(device, activation):
    torch._dynamo.reset()
    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    model = make_mlp(activation, 1, device)
    backend = aot_autograd(fw_compiler=capture, bw_compiler=capture)
    forward_backward(torch.compile(model, fullgraph=True, backend=backend), torch.randn(4, 32, device=device))
    forward, backward = graphs
    assert bsmm_targets(forward) == {"bsmm.fprop_epilogue.default"}
    assert bsmm_targets(backward) == {"bsmm.bprop.default", "bsmm.updat.default"}
    for target in bsmm_targets(forward) | bsmm_targets(backward):  # nothing between the graph and the kernel
        name = target.rsplit(".", 1)[0].replace(".", "::")  # bsmm.fprop.default -> bsmm::fprop
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd"), name


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_make_fx_training_step_records_only_the_pass_operators(device, activation):
    model = make_mlp(activation, 1, device)
    names = [name for name, _ in model.named_parameters()]

    def step(x, *params):
        y = torch.func.functional_call(model, dict(zip(names, params)), (x,))
        return torch.autograd.grad(y.square().sum(), (x, *params))

    x = torch.randn(4, 32, device=device, requires_grad=True)
    params = [p.detach().requires_grad_() for p in model.parameters()]
    graph = make_fx(step)(x, *params)
    targets = bsmm_targets(graph)
    assert targets <= FAST and "bsmm.fprop_epilogue.default" in targets, targets
    assert {"bsmm.bprop.default", "bsmm.updat.default"} <= targets, targets
    for got, expected in zip(graph(x, *params), step(x, *params)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis", [1, 0])
def test_public_matmul_operator_stays_differentiable(axis):
    op = bsmm.BlocksparseMatMul(LAYOUT, BS, axis)
    registration = bt.register(op.index)  # held: the key resolves while it lives
    generator = torch.Generator().manual_seed(4)
    x = torch.randn((3, op.C) if axis == 1 else (op.C, 3), dtype=torch.float64, generator=generator)
    w = torch.randn(op.w_shape, dtype=torch.float64, generator=generator)
    x.requires_grad_(), w.requires_grad_()
    matmul = torch.ops.bsmm.matmul.default
    assert torch.autograd.gradcheck(lambda x, w: matmul(x, w, registration.key, axis, False), (x, w))
    assert torch.autograd.gradgradcheck(lambda x, w: matmul(x, w, registration.key, axis, False), (x, w))
    results = torch.library.opcheck(matmul, (x, w, registration.key, axis, False))
    assert set(results.values()) == {"SUCCESS"}, results


@pytest.mark.parametrize("keep_pre", [True, False])
@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
def test_opcheck_fprop_epilogue(activation, keep_pre):
    """Schema, fake tensor and AOT dispatch of the fused operator (inputs not requiring grad: it has no formula)."""
    op = bsmm.BlocksparseMatMul(LAYOUT, BS)
    registration = bt.register(op.index)
    x, w, b = torch.randn(5, op.C), torch.randn(op.w_shape), torch.randn(op.K)
    args = (x, w, b, registration.key, 1, False, activation, keep_pre)
    results = torch.library.opcheck(torch.ops.bsmm.fprop_epilogue.default, args)
    assert set(results.values()) == {"SUCCESS"}, results
    y, pre = torch.ops.bsmm.fprop_epilogue.default(*args)
    z = x @ torch.from_numpy(op.to_dense(w.numpy())) + b
    torch.testing.assert_close(y, REFERENCES[activation](z), rtol=1e-5, atol=1e-5)
    assert pre.shape == (z.shape if keep_pre else (0,))
    if keep_pre:
        torch.testing.assert_close(pre, z, rtol=1e-5, atol=1e-5)


# -- 6. errors; 7. repr -------------------------------------------------------------------------------------
def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="activation"):
        make_layer("tanh")
    op = bsmm.BlocksparseMatMul(LAYOUT, BS)
    with pytest.raises(ValueError, match="activation"):
        bt.blocksparse_matmul(torch.randn(2, op.C), torch.randn(op.w_shape), op, activation="tanh")


@pytest.mark.parametrize("requires_grad", [True, False])
def test_bad_bias_is_refused(requires_grad):
    op = bsmm.BlocksparseMatMul(LAYOUT, BS)
    x, w = torch.randn(2, op.C), torch.randn(op.w_shape, requires_grad=requires_grad)
    with pytest.raises(ValueError, match="bias"):
        bt.blocksparse_matmul(x, w, op, bias=torch.randn(op.K - 1), activation="relu")
    with pytest.raises(TypeError, match="bias"):
        bt.blocksparse_matmul(x, w, op, bias=[0.0] * op.K, activation="relu")
    # a float64 bias with float32 x is cast, as the docstring says
    assert bt.blocksparse_matmul(x, w, op, bias=torch.zeros(op.K, dtype=torch.float64)).dtype == torch.float32


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_repr_names_the_activation(activation):
    text = repr(make_layer(activation))
    assert (f"activation={activation!r}" in text) if activation else ("activation" not in text), text

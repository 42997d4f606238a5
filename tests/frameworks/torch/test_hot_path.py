"""The hot path of repeated calls: after the first call of a shape, a call builds no plan, uploads
nothing, synchronises nothing and allocates only its output (CuPy's allocating call, and a
PyTorch layer's forward and training step); a CUDA graph of the training step replays bitwise
what eager computes.
"""

from __future__ import annotations

import numpy as np
import pytest

import bsmm


@pytest.fixture
def spies(cupy, monkeypatch):
    """Counts of plan builds, host-to-device uploads and host synchronisations while a test runs."""
    from bsmm.backends.cuda import backend as cuda_backend
    from bsmm.backends.cuda import plans as cuda_plans

    counts = {"plans": 0, "uploads": 0, "syncs": 0}

    def counting(name, function):
        def counted(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)
        return counted

    monkeypatch.setattr(cuda_plans, "build_plan", counting("plans", cuda_plans.build_plan))
    monkeypatch.setattr(cuda_backend.cupy, "asarray", counting("uploads", cupy.asarray))
    for name in ("deviceSynchronize", "streamSynchronize"):
        monkeypatch.setattr(cupy.cuda.runtime, name, counting("syncs", getattr(cupy.cuda.runtime, name)))
    return counts


def _checked_calls(step):
    """(the passes ``step()`` ran through the checked path, its result): the checked path runs the
    operator's passes; the kept raw-pointer repeat does not."""
    checked = []
    with pytest.MonkeyPatch.context() as patch:
        for pass_name in ("fprop", "bprop", "updat"):
            method = getattr(bsmm.BlocksparseMatMul, pass_name)
            patch.setattr(bsmm.BlocksparseMatMul, pass_name,
                          lambda self, *args, _method=method, **kwargs: checked.append(args) or _method(self, *args,
                                                                                                        **kwargs))
        result = step()
    return checked, result


def _layout(density=0.1, blocks=64):
    return (np.random.default_rng(1).random((blocks, blocks)) < density).astype(np.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_cupy_allocating_calls_after_the_first_plan_nothing(cupy, spies, dtype):
    op = bsmm.BlocksparseMatMul(_layout(), block_size=32)
    rng = np.random.default_rng(0)
    x, dy = (cupy.asarray(rng.standard_normal((32, f)).astype(dtype)) for f in (op.C, op.K))
    w = cupy.asarray(rng.standard_normal(op.w_shape).astype(dtype))
    first = [op(x, w), op.bprop(dy, w), op.updat(x, dy)]
    assert spies["plans"] >= 3
    before = dict(spies)
    pool = cupy.get_default_memory_pool()
    used = pool.used_bytes()
    for _ in range(5):
        again = [op(x, w), op.bprop(dy, w), op.updat(x, dy)]
    assert spies == before, f"repeat calls planned, uploaded or synchronised: {before} -> {spies}"
    # What stays allocated is the last three outputs (CuPy rounds each up to 512 bytes).
    assert pool.used_bytes() - used == sum(-(-a.nbytes // 512) * 512 for a in again)
    for a, b in zip(first, again):
        assert a.get().tobytes() == b.get().tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_torch_training_step_after_the_first_plans_nothing_and_allocates_its_outputs(cupy, spies, dtype):
    torch = pytest.importorskip("torch")
    import bsmm.torch

    dtype = getattr(torch, dtype)
    layer = bsmm.torch.BlockSparseLinear(2048, 2048, _layout(), block_size=32, bias=False, device="cuda", dtype=dtype)
    x = torch.randn(32, 2048, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn(32, 2048, device="cuda", dtype=dtype)

    def step():
        layer.weight.grad = x.grad = None
        y = layer(x)
        y.backward(grad)
        return y.detach().clone(), x.grad.clone(), layer.weight.grad.clone()

    first = step()
    torch.cuda.synchronize()
    before = dict(spies)
    stats = torch.cuda.memory_stats()["allocation.all.allocated"]
    checked, again = _checked_calls(step)
    torch.cuda.synchronize()
    assert not checked, "a repeated step took the checked (DLPack) path instead of the kept raw-pointer call"
    assert spies == before, f"a repeated step planned, uploaded or synchronised: {before} -> {spies}"
    # y, dx, dW, and the three clones of this test
    assert torch.cuda.memory_stats()["allocation.all.allocated"] - stats == 6
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_compiled_training_step_takes_the_kept_raw_pointer_calls(cupy, spies, activation):
    """torch.compile's graph calls the pass operators, and after its first step each operator call is the
    kept raw-pointer repeat (no checked path, no planning), as the eager step's are: the slow path a
    compiled step once took (an autograd layer and the checked call per operator) stays gone."""
    torch = pytest.importorskip("torch")
    import bsmm.torch

    torch._dynamo.reset()
    up = bsmm.torch.BlockSparseLinear(2048, 2048, _layout(), block_size=32, device="cuda", dtype=torch.bfloat16,
                                      activation=activation)
    down = bsmm.torch.BlockSparseLinear(2048, 2048, _layout(), block_size=32, device="cuda", dtype=torch.bfloat16)
    model = torch.compile(lambda x: down(up(x)), fullgraph=True)
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)

    def step():
        for parameter in (*up.parameters(), *down.parameters()):
            parameter.grad = None
        x.grad = None
        model(x).backward(grad)
        return x.grad.clone(), up.weight.grad.clone(), down.weight.grad.clone()

    first = step()
    torch.cuda.synchronize()
    before = dict(spies)
    checked, again = _checked_calls(step)
    torch.cuda.synchronize()
    assert not checked, "a compiled step took the checked (DLPack) path instead of the kept raw-pointer call"
    assert spies == before, f"a compiled step planned, uploaded or synchronised: {before} -> {spies}"
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_torch_training_step_in_a_cuda_graph_replays_what_eager_computes(cupy):
    torch = pytest.importorskip("torch")
    import bsmm.torch

    layer = bsmm.torch.BlockSparseLinear(4096, 4096, _layout(0.1, 128), block_size=32, bias=False, device="cuda",
                                         dtype=torch.bfloat16)
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        layer.weight.grad = x.grad = None
        y = layer(x)
        y.backward(grad)
        return y

    from bsmm.cli.framework_bench import capture_graph

    replay, y = capture_graph(torch, step)
    x.data.copy_(torch.randn_like(x))
    replay()
    replayed = (y.clone(), x.grad.clone(), layer.weight.grad.clone())
    eager = step()
    assert torch.equal(replayed[0], eager)
    assert torch.equal(replayed[1], x.grad) and torch.equal(replayed[2], layer.weight.grad)


@pytest.mark.gpu
def test_torch_compile_reduce_overhead_matches_eager(cupy):
    torch = pytest.importorskip("torch")
    import bsmm.torch

    layer = bsmm.torch.BlockSparseLinear(2048, 2048, _layout(), block_size=32, device="cuda", dtype=torch.float16)
    x = torch.randn(16, 2048, device="cuda", dtype=torch.float16)
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        got = compiled(x)
    assert torch.equal(got, layer(x))


@pytest.mark.gpu
def test_torch_repeat_calls_still_refuse_what_the_first_call_would(cupy):
    """The raw-pointer repeat checks what could differ from the call it repeats; anything else takes
    the checked path, which raises or computes as on a first call."""
    torch = pytest.importorskip("torch")
    from bsmm.torch import ops as torch_ops

    index = bsmm.block_index(_layout(), 32)
    registration = torch_ops.register(index)  # held: keeps the key registered
    key = registration.key
    x = torch.randn(32, index.C, device="cuda", dtype=torch.float16)
    w = torch.randn(index.w_shape, device="cuda", dtype=torch.float16)
    expected = torch.ops.bsmm.matmul.default(x, w, key, 1, False)
    with pytest.raises(TypeError, match="w has dtype torch.float32"):
        torch.ops.bsmm.matmul.default(x, w.float(), key, 1, False)
    with pytest.raises(ValueError, match="w must be contiguous"):
        torch.ops.bsmm.matmul.default(x, w.transpose(1, 2), key, 1, False)
    with pytest.raises(ValueError, match="w must have shape"):
        torch.ops.bsmm.matmul.default(x, w[:-1], key, 1, False)
    shifted = torch.empty(x.numel() + 1, device="cuda", dtype=x.dtype)[1:].view_as(x)  # 2 bytes past 16
    shifted.copy_(x)
    assert torch.equal(torch.ops.bsmm.matmul.default(shifted, w, key, 1, False), expected)


def test_traced_layers_record_the_operator():
    """make_fx (a dispatch mode) sees the pass operators (bsmm::fprop, and bsmm::fprop_epilogue with a
    bias or an activation), not the eager path's kernels: its graph replays."""
    torch = pytest.importorskip("torch")
    from torch.fx.experimental.proxy_tensor import make_fx

    import bsmm.torch

    for options, operator in (({"bias": False}, "bsmm.fprop"), ({"activation": "gelu"}, "bsmm.fprop_epilogue")):
        layer = bsmm.torch.BlockSparseLinear(32, 32, np.array([[1, 0], [1, 1]]), block_size=16, **options)
        graph = make_fx(layer)(torch.randn(4, 32))
        assert operator in str(graph.graph)
        x = torch.randn(4, 32)
        assert torch.allclose(graph(x), layer(x), atol=1e-5)


def test_inference_calls_record_no_graph_and_match_the_training_forward():
    torch = pytest.importorskip("torch")
    import bsmm.torch

    layer = bsmm.torch.BlockSparseLinear(32, 48, np.array([[1, 0, 1], [0, 1, 1]]), block_size=16)
    x = torch.randn(5, 32)
    trained = layer(x)
    with torch.no_grad():
        inferred = layer(x)
    assert trained.grad_fn is not None and inferred.grad_fn is None
    assert torch.equal(trained.detach(), inferred)

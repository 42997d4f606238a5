"""l2_normalize (the seed's weight normalization) and its gradients: NumPy/CuPy, PyTorch and JAX.

The reference normalizes the columns of the dense float64 ``W`` (built by ``reference.py``, never
by bsmm) over their present entries: ``W * gain / sqrt(max(sum of squares, epsilon))``. Gradients
are checked by central differences in float64 (NumPy), ``torch.autograd.gradcheck`` and
``jax.test_util.check_grads``, and the three implementations against each other.
"""

from __future__ import annotations

import numpy as np
import pytest

import bsmm
from bsmm.normalization import l2_normalize, l2_normalize_grad
from conftest import to_numpy, to_xp
from reference import assert_close, dense_to_present_blocks, dense_weight, random_data, random_layout, rel_error

BS = 8


def reference(layout, w, gain=None, epsilon=1e-12) -> np.ndarray:
    """Normalized blocks, float64: the dense W's columns scaled over their present entries."""
    dense = dense_weight(layout, w, BS)
    squares = (dense**2).sum(axis=0)  # absent entries are 0
    gains = np.ones(dense.shape[1]) if gain is None else np.asarray(gain, np.float64)
    return dense_to_present_blocks(layout, dense * gains / np.sqrt(np.maximum(squares, epsilon)), BS)


def make_layout(kind: str, rng) -> np.ndarray:
    if kind == "small":  # for the gradient checks, whose cost grows with the entries: 4 blocks, column 1 empty
        return np.array([[1, 0, 1], [0, 0, 1], [1, 0, 0]], np.uint8)
    if kind == "empty column":  # block column 1 has no block; block row 2 neither
        layout = random_layout(rng, 4, 5, 0.6)
        layout[:, 1] = 0
        layout[2, :] = 0
        layout[0, [0, 2, 3, 4]] = 1
        return layout
    shapes = {"square": (5, 5, 0.5), "wide": (2, 7, 0.6), "tall": (7, 1, 0.7), "one block": (1, 1, 1.0),
              "full": (3, 4, 1.0), "empty": (3, 2, 0.0)}
    rows, cols, density = shapes[kind]
    return random_layout(rng, rows, cols, density)


KINDS = ["square", "wide", "tall", "one block", "full", "empty column", "empty"]


def case(kind: str, seed: int, dtype="float64", with_gain: bool = False):
    rng = np.random.default_rng(seed)
    layout = make_layout(kind, rng)
    op = bsmm.BlocksparseMatMul(layout, block_size=BS)
    w = random_data(rng, op.w_shape, dtype) if dtype != "float64" else rng.standard_normal(op.w_shape)
    gain = rng.uniform(0.5, 2.0, op.K) if with_gain else None
    return op, w, gain, rng


def directional_derivative(function, point, direction, step=1e-6) -> float:
    return float((function(point + step * direction) - function(point - step * direction)) / (2 * step))


# -- NumPy / CuPy: forward ----------------------------------------------------------------------------
@pytest.mark.parametrize("with_gain", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_matches_dense_reference(xp, kind, dtype, with_gain):
    op, w, gain, _ = case(kind, 1, dtype, with_gain)
    y = l2_normalize(to_xp(xp, w), op, None if gain is None else to_xp(xp, gain.astype(np.float32)))
    assert y.dtype == w.dtype and y.shape == op.w_shape and type(y) is type(to_xp(xp, w))
    assert_close(to_numpy(y), reference(op.layout, w, gain), dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_float64_is_computed_in_float64(kind):
    op, w, gain, _ = case(kind, 2, with_gain=True)
    y = l2_normalize(w, op, gain)
    assert y.dtype == np.float64
    assert rel_error(y, reference(op.layout, w, gain)) <= 1e-14


def test_every_present_column_gets_the_gain_as_norm():
    op, w, gain, _ = case("empty column", 3, with_gain=True)
    dense = op.to_dense(l2_normalize(w, op, gain))
    columns_present = np.repeat(op.layout.any(axis=0), BS)
    assert np.allclose(np.linalg.norm(dense, axis=0)[columns_present], gain[columns_present], rtol=1e-14)


def test_columns_below_epsilon_are_divided_by_its_root():
    op, w, gain, _ = case("full", 4, with_gain=True)
    w[op.index.indices == 1] *= 1e-4  # block column 1: squared norms ~1e-7 < epsilon
    epsilon = 1e-3
    y = l2_normalize(w, op, gain, epsilon=epsilon)
    small = op.index.indices == 1
    expected = w[small] * gain.reshape(-1, BS)[1] / np.sqrt(epsilon)
    assert np.allclose(y[small], expected, rtol=1e-14, atol=0)
    assert rel_error(y, reference(op.layout, w, gain, epsilon)) <= 1e-14


def test_zero_columns_and_empty_columns_give_no_nan():
    op, w, gain, rng = case("empty column", 5, with_gain=True)
    w[op.index.indices == 0] = 0  # a present block column of zeros
    dy = rng.standard_normal(op.w_shape)
    y = l2_normalize(w, op, gain)
    dw, dgain = l2_normalize_grad(dy, w, op, gain)
    for array in (y, dw, dgain):
        assert np.isfinite(array).all()
    assert (y[op.index.indices == 0] == 0).all()
    assert (dgain.reshape(-1, BS)[1] == 0).all()  # block column 1 holds no block


def test_empty_layout():
    op, w, gain, _ = case("empty", 6, with_gain=True)
    assert l2_normalize(w, op, gain).shape == (0, BS, BS)
    dw, dgain = l2_normalize_grad(w, w, op, gain)
    assert dw.shape == (0, BS, BS) and (dgain == 0).all() and dgain.shape == (op.K,)


def test_block_index_works_as_op_and_input_is_kept():
    op, w, gain, _ = case("square", 7, "float32", with_gain=True)
    before = w.copy()
    assert (l2_normalize(w, op.index, gain) == l2_normalize(w, op, gain)).all()
    assert (w == before).all()


# -- NumPy / CuPy: gradients -----------------------------------------------------------------------------
@pytest.mark.parametrize("epsilon", [1e-12, 0.3])
@pytest.mark.parametrize("kind", ["square", "wide", "tall", "one block", "empty column"])
def test_gradient_matches_central_differences(kind, epsilon):
    """float64: <dw, v> and <dgain, u> against central differences of <dy, l2_normalize(w, gain)>
    along random directions, at relative error 1e-6. With epsilon 0.3 some columns are clamped."""
    op, w, gain, rng = case(kind, 8, with_gain=True)
    w *= rng.uniform(0.05, 1.0, (op.index.nnzb, 1, 1))  # a mix of clamped and unclamped columns
    dy = rng.standard_normal(op.w_shape)
    dw, dgain = l2_normalize_grad(dy, w, op, gain, epsilon)
    dw_plain, none = l2_normalize_grad(dy, w, op, None, epsilon)
    assert none is None
    for _ in range(3):
        v, u = rng.standard_normal(op.w_shape), rng.standard_normal(op.K)
        along_w = directional_derivative(lambda p: (dy * l2_normalize(p, op, gain, epsilon)).sum(), w, v)
        along_gain = directional_derivative(lambda g: (dy * l2_normalize(w, op, g, epsilon)).sum(), gain, u)
        along_w_plain = directional_derivative(lambda p: (dy * l2_normalize(p, op, None, epsilon)).sum(), w, v)
        assert (dw * v).sum() == pytest.approx(along_w, rel=1e-6, abs=1e-9)
        assert (dgain * u).sum() == pytest.approx(along_gain, rel=1e-6, abs=1e-9)
        assert (dw_plain * v).sum() == pytest.approx(along_w_plain, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gradient_dtypes_and_libraries(xp, dtype):
    """Low precision: the gradient of the rounded inputs, computed in float32 and rounded once."""
    op, w, gain, rng = case("empty column", 9, dtype, with_gain=True)
    dy = random_data(rng, op.w_shape, dtype)
    gain32 = gain.astype(np.float32)
    dw, dgain = l2_normalize_grad(to_xp(xp, dy), to_xp(xp, w), op, to_xp(xp, gain32))
    assert dw.dtype == w.dtype and dgain.dtype == np.float32
    expected_dw, expected_dgain = l2_normalize_grad(dy.astype(np.float64), w.astype(np.float64), op,
                                                    gain32.astype(np.float64))
    assert_close(to_numpy(dw), expected_dw, dtype)
    assert_close(to_numpy(dgain), expected_dgain, "float32")


# -- NumPy / CuPy: validation -------------------------------------------------------------------------
def _arguments(**changes):
    op = bsmm.BlocksparseMatMul(np.array([[1, 0], [1, 1]]), block_size=BS)
    arguments = {"w": np.ones(op.w_shape, np.float32), "op": op, "gain": None, "epsilon": 1e-12}
    arguments.update(changes)
    return arguments


@pytest.mark.parametrize(
    "changes, error, message",
    [
        ({"w": np.ones((2, 8, 8))}, ValueError, r"w must have shape \(nnzb, bs, bs\) = \(3, 8, 8\) .* got \(2, 8, 8\)"),
        ({"w": np.ones((3, 8, 8), np.int32)}, TypeError, r"w has dtype int32; supported dtypes are float16"),
        ({"w": [[1.0]]}, TypeError, r"w must be an array"),
        ({"gain": np.ones(8)}, ValueError, r"gain must have shape \(K,\) = \(16,\); got \(8,\)"),
        ({"gain": np.ones(16, np.int64)}, TypeError, r"gain has dtype int64"),
        ({"op": np.eye(2)}, TypeError, r"op must be a bsmm.BlocksparseMatMul or a bsmm.BlockIndex; got ndarray"),
        ({"epsilon": 0.0}, ValueError, r"epsilon must be finite and > 0; got 0.0"),
        ({"epsilon": -1}, ValueError, r"epsilon must be finite and > 0; got -1"),
        ({"epsilon": float("nan")}, ValueError, r"epsilon must be finite and > 0; got nan"),
        ({"epsilon": float("inf")}, ValueError, r"epsilon must be finite and > 0; got inf"),
        ({"epsilon": "1e-6"}, TypeError, r"epsilon must be a real number; got str"),
        ({"epsilon": True}, TypeError, r"epsilon must be a real number; got bool"),
    ],
)
def test_validation(changes, error, message):
    arguments = _arguments(**changes)
    with pytest.raises(error, match=message):
        l2_normalize(**arguments)
    with pytest.raises(error, match=message):
        l2_normalize_grad(arguments["w"], **arguments)


def test_grad_validates_dy():
    arguments = _arguments()
    with pytest.raises(ValueError, match=r"dy must have w's shape \(3, 8, 8\); got \(3, 8, 4\)"):
        l2_normalize_grad(np.ones((3, 8, 4), np.float32), **arguments)


def test_framework_tensors_are_sent_to_their_adapter():
    torch = pytest.importorskip("torch")
    arguments = _arguments(w=torch.ones(3, 8, 8))
    with pytest.raises(TypeError, match=r"w must be a NumPy or CuPy array; got a torch Tensor .*bsmm.torch.l2_normalize"):
        l2_normalize(**arguments)


@pytest.mark.gpu
def test_mixed_libraries_are_refused(cupy):
    arguments = _arguments(w=cupy.ones((3, 8, 8), cupy.float32), gain=np.ones(16))
    with pytest.raises(ValueError, match=r"gain is a numpy array but w is a cupy array; pass arrays of one library"):
        l2_normalize(**arguments)


# -- PyTorch -------------------------------------------------------------------------------------------
@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def torch_device(request):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device: GPU tests skipped")
    return request.param


def _torch(array, device, dtype=None, requires_grad=False):
    import torch

    array = np.asarray(array)
    dtype = getattr(torch, dtype or array.dtype.name)
    return torch.from_numpy(array.astype(np.float64)).to(device=device, dtype=dtype).requires_grad_(requires_grad)


@pytest.mark.parametrize("with_gain", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_torch_forward_matches_dense_reference(torch_device, kind, dtype, with_gain):
    from bsmm.torch.normalization import l2_normalize as torch_l2_normalize

    op, w, gain, _ = case(kind, 11, dtype, with_gain)
    y = torch_l2_normalize(_torch(w, torch_device), op, None if gain is None else _torch(gain, torch_device, "float32"))
    assert str(y.dtype) == f"torch.{dtype}" and y.device.type == torch_device
    assert_close(y.detach().cpu().double().numpy(), reference(op.layout, w, gain), dtype)


@pytest.mark.parametrize("epsilon", [1e-12, 0.3])
@pytest.mark.parametrize("kind", ["small", "one block"])
def test_torch_gradcheck_float64(kind, epsilon):
    """torch.autograd.gradcheck and gradgradcheck in float64 over w and gain, clamped columns included."""
    import torch

    from bsmm.torch.normalization import l2_normalize as torch_l2_normalize

    op, w, gain, rng = case(kind, 12, with_gain=True)
    w *= rng.uniform(0.05, 1.0, (op.index.nnzb, 1, 1))
    w_t, gain_t = _torch(w, "cpu", requires_grad=True), _torch(gain, "cpu", requires_grad=True)

    def function(w_t, gain_t):
        return torch_l2_normalize(w_t, op, gain_t, epsilon)

    assert torch.autograd.gradcheck(function, (w_t, gain_t))
    assert torch.autograd.gradgradcheck(function, (w_t, gain_t))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_gradients_match_the_numpy_vjp(torch_device, dtype):
    """float64 too on a GPU: the function is plain torch operations."""
    from bsmm.torch.normalization import l2_normalize as torch_l2_normalize

    op, w, gain, rng = case("empty column", 13, dtype, with_gain=True)
    dy = rng.standard_normal(op.w_shape).astype(w.dtype)
    w_t, gain_t = _torch(w, torch_device, requires_grad=True), _torch(gain, torch_device, dtype, requires_grad=True)
    torch_l2_normalize(w_t, op, gain_t).backward(_torch(dy, torch_device))
    expected_dw, expected_dgain = l2_normalize_grad(dy, w, op, gain.astype(w.dtype))
    tolerance = 1e-12 if dtype == "float64" else 1e-5
    assert rel_error(w_t.grad.cpu().numpy(), expected_dw) <= tolerance
    assert rel_error(gain_t.grad.cpu().numpy(), expected_dgain) <= tolerance
    assert (gain_t.grad.cpu().numpy().reshape(-1, BS)[1] == 0).all()


def test_torch_on_a_block_sparse_linear_layer():
    torch = pytest.importorskip("torch")
    import bsmm.torch

    from bsmm.torch.normalization import l2_normalize as torch_l2_normalize

    layer = bsmm.torch.BlockSparseLinear(24, 40, np.array([[1, 0, 1, 0, 0], [1, 1, 0, 0, 1], [0, 1, 1, 0, 1]]),
                                         block_size=BS, bias=False)
    y = torch_l2_normalize(layer.weight, layer.op)
    expected = reference(layer.op.layout, layer.weight.detach().numpy().astype(np.float64))
    assert_close(y.detach().numpy(), expected, "float32")
    x = torch.randn(3, 24)
    out = bsmm.torch.blocksparse_matmul(x, y, layer.op)
    out.square().sum().backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()
    assert layer.weight.grad.abs().sum() > 0


def test_torch_validation():
    torch = pytest.importorskip("torch")
    from bsmm.torch.normalization import l2_normalize as torch_l2_normalize

    op, w = _arguments()["op"], torch.ones(3, 8, 8)
    for arguments, error, message in [
        ((np.ones((3, 8, 8)), op), TypeError, r"w must be a torch.Tensor; got ndarray"),
        ((torch.ones(3, 8, 8, dtype=torch.int32), op), TypeError, r"w has dtype torch.int32; supported dtypes"),
        ((torch.ones(3, 8, 4), op), ValueError, r"w must have shape \(nnzb, bs, bs\) = \(3, 8, 8\) .* got \(3, 8, 4\)"),
        ((w, op, torch.ones(15)), ValueError, r"gain must have shape \(K,\) = \(16,\); got \(15,\)"),
        ((w, op, np.ones(16)), TypeError, r"gain must be a torch.Tensor; got ndarray"),
        ((w, op, None, 0), ValueError, r"epsilon must be finite and > 0; got 0"),
        ((w, np.ones((2, 2))), TypeError, r"op must be a bsmm.BlocksparseMatMul or a bsmm.BlockIndex; got ndarray"),
    ]:
        with pytest.raises(error, match=message):
            torch_l2_normalize(*arguments)


@pytest.mark.gpu
def test_torch_gain_on_another_device_is_refused(torch_device):
    import torch

    if torch_device != "cuda":
        pytest.skip("needs a CUDA device")
    from bsmm.torch.normalization import l2_normalize as torch_l2_normalize

    with pytest.raises(ValueError, match=r"gain is on cpu but w is on cuda:0; move them to one device"):
        torch_l2_normalize(torch.ones(3, 8, 8, device="cuda"), _arguments()["op"], torch.ones(16))


def test_the_three_implementations_agree_at_the_clamp():
    """Where a squared norm equals epsilon exactly, the gradient takes the unclamped branch
    (the seed's convention) in NumPy, PyTorch and JAX alike."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    from bsmm.jax.normalization import l2_normalize as jax_l2_normalize
    from bsmm.torch.normalization import l2_normalize as torch_l2_normalize

    op = bsmm.BlocksparseMatMul(np.ones((1, 1)), block_size=BS)
    w = np.zeros(op.w_shape, np.float32)
    w[0, 3, :] = 0.5  # every feature's squared norm is 0.25 exactly
    w[0, 5, ::2] = 0.25  # ... except the even ones: 0.3125
    dy = np.random.default_rng(31).standard_normal(op.w_shape).astype(np.float32)
    epsilon = 0.25
    expected, _ = l2_normalize_grad(dy, w, op, epsilon=epsilon)
    odd = expected[0, 3, 1::2]
    assert np.allclose(odd, (dy[0, 3, 1::2] - 0.5 * dy[0, 3, 1::2] * 0.5 / 0.25) / 0.5)  # = 0: w's own direction
    w_t = torch.from_numpy(w).requires_grad_(True)
    torch_l2_normalize(w_t, op, epsilon=epsilon).backward(torch.from_numpy(dy))
    _, vjp = jax.vjp(lambda w: jax_l2_normalize(w, op, epsilon=epsilon), jax.numpy.asarray(w))
    for actual in (w_t.grad.numpy(), np.asarray(vjp(jax.numpy.asarray(dy))[0])):
        assert np.allclose(actual, expected, rtol=1e-6, atol=1e-7)


# -- JAX --------------------------------------------------------------------------------------------------


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def jax_device(request):
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    try:
        return jax.devices(request.param)[0]
    except RuntimeError:
        pytest.skip(f"JAX has no {request.param} device")


@pytest.mark.parametrize("with_gain", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_jax_forward_matches_dense_reference(jax_device, kind, dtype, with_gain):
    import jax

    from bsmm.jax.normalization import l2_normalize as jax_l2_normalize

    op, w, gain, _ = case(kind, 21, dtype, with_gain)
    w_j = jax.device_put(w, jax_device)
    gain_j = None if gain is None else jax.device_put(gain.astype(np.float32), jax_device)
    y = jax.jit(jax_l2_normalize, static_argnums=1)(w_j, op, gain_j)
    assert np.dtype(y.dtype) == w.dtype
    assert_close(np.asarray(y).astype(np.float64), reference(op.layout, w, gain), dtype)


@pytest.mark.parametrize("epsilon", [1e-12, 0.3])
@pytest.mark.parametrize("kind", ["small", "one block"])
def test_jax_check_grads_float64(x64, kind, epsilon):
    """jax.test_util.check_grads in float64 at its default tolerances: forward and reverse, order 2."""
    import jax
    import jax.numpy as jnp
    from jax.test_util import check_grads

    from bsmm.jax.normalization import l2_normalize as jax_l2_normalize

    op, w, gain, rng = case(kind, 22, with_gain=True)
    w *= rng.uniform(0.05, 1.0, (op.index.nnzb, 1, 1))
    function = jax.jit(lambda w, g: jax_l2_normalize(w, op, g, epsilon))
    check_grads(function, (jnp.asarray(w), jnp.asarray(gain)), order=2, modes=["fwd", "rev"])


def test_jax_gradients_match_the_numpy_vjp(x64):
    import jax
    import jax.numpy as jnp

    from bsmm.jax.normalization import l2_normalize as jax_l2_normalize

    op, w, gain, rng = case("empty column", 23, with_gain=True)
    dy = rng.standard_normal(op.w_shape)
    _, vjp = jax.vjp(lambda w, g: jax_l2_normalize(w, op, g), jnp.asarray(w), jnp.asarray(gain))
    dw, dgain = vjp(jnp.asarray(dy))
    expected_dw, expected_dgain = l2_normalize_grad(dy, w, op, gain)
    assert rel_error(np.asarray(dw), expected_dw) <= 1e-12
    assert rel_error(np.asarray(dgain), expected_dgain) <= 1e-12


def test_jax_validation():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from bsmm.jax.normalization import l2_normalize as jax_l2_normalize

    op = _arguments()["op"]
    with pytest.raises(ValueError, match=r"w must have shape \(nnzb, bs, bs\) = \(3, 8, 8\) for this layout; got \(3, 8\)"):
        jax_l2_normalize(jnp.ones((3, 8)), op)
    with pytest.raises(TypeError, match=r"w has dtype int32"):
        jax_l2_normalize(jnp.ones((3, 8, 8), jnp.int32), op)
    with pytest.raises(TypeError, match=r"w must be a JAX or NumPy array; got list"):
        jax_l2_normalize([1.0], op)
    with pytest.raises(ValueError, match=r"gain must have shape \(K,\) = \(16,\); got \(4,\)"):
        jax_l2_normalize(jnp.ones((3, 8, 8)), op, jnp.ones(4))
    with pytest.raises(ValueError, match=r"epsilon must be finite and > 0"):
        jax_l2_normalize(jnp.ones((3, 8, 8)), op, epsilon=-1.0)
    with pytest.raises(TypeError, match=r"w has dtype float64, which JAX turns into float32 unless 64-bit"):
        jax_l2_normalize(np.ones((3, 8, 8)), op)

"""bsmm.torch.gated_unit: a GLU's A(g)·u over a [gate | up] tensor and its backward, one kernel each way
on CUDA (cuda/bsmm_gated_unit.cu), PyTorch's operators elsewhere; against a float64 reference of its own."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import bsmm.torch as bt  # noqa: E402
from bsmm.torch.glu import GATED_ACTIVATIONS  # noqa: E402
from torch_cases import cuda_or_skip, device  # noqa: E402,F401

TOLERANCES = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _activation(name: str, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A(z) and A'(z) in float64, written here from the formulas."""
    if name == "relu":
        return np.maximum(z, 0), (z > 0).astype(np.float64)
    if name == "silu":
        s = 1 / (1 + np.exp(-z))
        return z * s, s * (1 + z * (1 - s))
    if name == "gelu":
        erf = np.vectorize(math.erf)(z / math.sqrt(2))
        return 0.5 * z * (1 + erf), 0.5 * (1 + erf) + z * np.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    c = math.sqrt(2 / math.pi)
    t = np.tanh(c * (z + 0.044715 * z ** 3))
    return 0.5 * z * (1 + t), 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * 0.044715 * z * z)


def reference(gate_up: torch.Tensor, dh: torch.Tensor, name: str):
    """(h, d[gate | up]) in float64."""
    values = gate_up.detach().cpu().double().numpy()
    hidden = values.shape[-1] // 2
    g, u = values[..., :hidden], values[..., hidden:]
    a, a_grad = _activation(name, g)
    d = dh.detach().cpu().double().numpy()
    return a * u, np.concatenate([d * u * a_grad, d * a], axis=-1)


def assert_close(actual: torch.Tensor, expected: np.ndarray, dtype, what: str):
    actual = actual.detach().cpu().double().numpy()
    assert np.isfinite(actual).all(), f"{what}: not finite"
    scale = max(np.abs(expected).max(), 1.0)
    error = np.abs(actual - expected).max() / scale
    assert error < TOLERANCES[dtype], f"{what}: relative error {error:.2e}"


def poison_next(device: str, shape: tuple, dtype) -> None:
    """On CUDA, a freed block of PyTorch's caching allocator the size of the next output, full of NaN:
    the allocator hands the next allocation of that size this block (a kernel's unwritten element
    then shows). A block of another size would sit in another pool or size class."""
    if device == "cuda":
        junk = torch.full(shape, float("nan"), device=device, dtype=dtype)
        del junk


@pytest.mark.parametrize("name", GATED_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (5, 3, 96), (33, 2060), (2, 6)],
                         ids=["one row", "leading dims", "pairs past a thread block", "hidden odd"])
def test_forward_and_backward_match_the_reference(device, name, dtype, shape):
    """(2, 6): hidden 3, odd, so PyTorch's operators; (33, 2060): 515 column pairs a row, three thread
    blocks of 256 along y, the last partly idle."""
    if device == "cpu" and dtype in (torch.float16,):
        pytest.skip("float16 element-wise on the CPU is PyTorch's concern")
    generator = torch.Generator().manual_seed(sum(shape))
    gate_up = (2 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(device, dtype)
    dh = torch.randn((*shape[:-1], shape[-1] // 2), generator=generator, dtype=torch.float64).to(device, dtype)
    expected_h, expected_d = reference(gate_up, dh, name)
    poison_next(device, tuple(dh.shape), dtype)
    gate_up.requires_grad_(True)
    h = bt.gated_unit(gate_up, name)
    assert h.shape == (*shape[:-1], shape[-1] // 2) and h.dtype == dtype and h.device == gate_up.device
    assert_close(h, expected_h, dtype, "h")
    poison_next(device, shape, dtype)
    h.backward(dh)
    assert_close(gate_up.grad, expected_d, dtype, "d[gate | up]")


def test_strided_and_misaligned_inputs_take_pytorch_s_operators(device):
    """A strided view (every other 16 columns of a wider tensor) and a contiguous view one element off
    its allocation's alignment: both right, forward and backward (the gradient reaches the base)."""
    generator = torch.Generator().manual_seed(7)
    dh = torch.randn(6, 8, generator=generator, dtype=torch.float64).to(device, torch.float32)
    for kind in ("strided", "misaligned"):
        base = torch.randn(6 * 32 + 1, generator=generator, dtype=torch.float64).to(device, torch.float32)
        base.requires_grad_(True)
        gate_up = base[:6 * 32].view(6, 32)[:, :16] if kind == "strided" else base[1:1 + 6 * 16].view(6, 16)
        assert gate_up.is_contiguous() == (kind == "misaligned")
        expected_h, expected_d = reference(gate_up, dh, "silu")
        h = bt.gated_unit(gate_up, "silu")
        assert_close(h, expected_h, torch.float32, f"{kind}: h")
        h.backward(dh)
        grad = base.grad[:6 * 32].view(6, 32)[:, :16] if kind == "strided" else base.grad[1:1 + 6 * 16].view(6, 16)
        assert_close(grad, expected_d, torch.float32, f"{kind}: d[gate | up]")


@pytest.mark.parametrize("name", GATED_ACTIVATIONS)
def test_gradcheck_and_a_differentiable_gradient(name):
    """float64 on the CPU: gradcheck, and gradgradcheck through create_graph (PyTorch's operators)."""
    generator = torch.Generator().manual_seed(3)
    gate_up = torch.randn(3, 8, generator=generator, dtype=torch.float64)
    gate_up = gate_up + 0.1 * torch.sign(gate_up)  # (away from relu's kink)
    gate_up.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: bt.gated_unit(t, name), (gate_up,))
    assert torch.autograd.gradgradcheck(lambda t: bt.gated_unit(t, name), (gate_up,))


def test_the_operators_pass_opcheck():
    """Contiguous and transposed inputs: the fakes' outputs are laid out as the kernels' (contiguous)."""
    for gate_up in (torch.randn(4, 12), torch.randn(12, 4).t()):
        torch.library.opcheck(torch.ops.bsmm.gated_unit, (gate_up.requires_grad_(True), "gelu"))
        torch.library.opcheck(torch.ops.bsmm.gated_unit_backward, (torch.randn(4, 6), gate_up.detach(), "gelu"))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="gate_up's last dimension must hold the gate and the up halves"):
        bt.gated_unit(torch.randn(3, 5))
    with pytest.raises(ValueError, match="activation must be one of"):
        bt.gated_unit(torch.randn(3, 4), "tanh")
    with pytest.raises(TypeError, match="gate_up must be a floating-point torch.Tensor"):
        bt.gated_unit(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="an even size, not 0"):
        bt.gated_unit(torch.ones(3, 0))


def test_the_mlp_block_runs_one_kernel_each_way():
    """GPU: a GLU BlockSparseMLP's step has one gated_unit kernel forward and one backward, and no
    concatenation or element-wise kernel of PyTorch's between its passes."""
    cuda = cuda_or_skip()
    mlp = bt.BlockSparseMLP(256, 512, density=0.5, block_size=32, seed=0, device=cuda, dtype=torch.bfloat16)
    x = torch.randn(64, 256, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    mlp(x).float().sum().backward()  # warm: kernels compiled and calls kept
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        mlp(x).sum().backward()
        torch.cuda.synchronize()
    names = [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("gated_unit_forward" in n for n in names) == 1, names
    assert sum("gated_unit_backward" in n for n in names) == 1, names
    assert not any("CatArray" in n for n in names), names

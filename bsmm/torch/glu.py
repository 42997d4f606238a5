"""``gated_unit(gate_up, activation)``: a GLU's ``A(g)·u`` over the ``[gate | up]`` product of
:class:`~bsmm.torch.BlockSparseMLP`, one kernel forward and one backward on CUDA.

Each row of ``gate_up`` holds the gate ``g`` then the up projection ``u`` (``hidden`` columns each).
Forward writes ``h = A(g)·u``; backward writes ``d[gate | up] = [dh·u·A'(g) | dh·A(g)]`` in one pass,
the gradient the ``[gate | up]`` product's bprop and updat read, where PyTorch's own operators would
take about five passes and a concatenation (``cuda/bsmm_gated_unit.cu``). The two are the operators
``bsmm::gated_unit`` and ``bsmm::gated_unit_backward``, so ``torch.compile`` traces them whole and
CUDA graphs record them. Elsewhere (the CPU, float64, a strided or misaligned tensor) they compute
the same with PyTorch's operators. A backward that builds a graph (``create_graph=True``) differentiates
PyTorch's operators instead, so that the gradient is differentiable again.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad

from bsmm.torch.checks import ARRAY_DTYPES
from bsmm.torch.eager import _TORCH_ACTIVATIONS, TORCH_ACTIVATIONS, _activation_grad

__all__ = ["gated_unit", "GATED_ACTIVATIONS"]

#: The activations ``gated_unit`` takes.
GATED_ACTIVATIONS = tuple(TORCH_ACTIVATIONS)
def _on_kernel(*tensors: torch.Tensor) -> bool:
    """The kernels take these: CUDA, one kernel dtype, contiguous, 2-element aligned, hidden even."""
    first = tensors[0]
    return (first.is_cuda and first.dtype in ARRAY_DTYPES and first.shape[-1] > 0 and first.shape[-1] % 4 == 0
            and all(t.dtype == first.dtype and t.is_contiguous() and t.data_ptr() % (2 * t.element_size()) == 0
                    for t in tensors))


def _stream(tensor: torch.Tensor) -> int:
    return torch.cuda.current_stream(tensor.device).cuda_stream


def _forward(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    hidden = gate_up.shape[-1] // 2
    if not _on_kernel(gate_up):
        gate, up = gate_up.split(hidden, dim=-1)
        return (TORCH_ACTIVATIONS[activation](gate) * up).contiguous()  # (the fake's layout, whatever gate_up's)
    from bsmm.backends.cuda.gated_unit import gated_forward  # lazily: CuPy is needed on CUDA only

    h = gate_up.new_empty((*gate_up.shape[:-1], hidden))
    with torch.cuda.device(gate_up.device):
        gated_forward(_stream(gate_up), ARRAY_DTYPES[gate_up.dtype].name, activation, gate_up.numel() // (2 * hidden),
                      hidden, gate_up.data_ptr(), h.data_ptr())
    return h


def _backward_values(dh: torch.Tensor, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    hidden = gate_up.shape[-1] // 2
    if not _on_kernel(gate_up, dh):
        gate, up = gate_up.split(hidden, dim=-1)
        return torch.cat([_activation_grad(activation, dh * up, gate), dh * TORCH_ACTIVATIONS[activation](gate)],
                         dim=-1).contiguous()
    from bsmm.backends.cuda.gated_unit import gated_backward  # lazily: CuPy is needed on CUDA only

    d_gate_up = gate_up.new_empty(gate_up.shape)
    with torch.cuda.device(gate_up.device):
        gated_backward(_stream(gate_up), ARRAY_DTYPES[gate_up.dtype].name, activation, gate_up.numel() // (2 * hidden),
                       hidden, dh.data_ptr(), gate_up.data_ptr(), d_gate_up.data_ptr())
    return d_gate_up


def _setup_context(ctx, inputs, output):
    gate_up, ctx.activation = inputs
    ctx.save_for_backward(gate_up)


def _backward(ctx, dh):
    (gate_up,) = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: a gradient that is itself differentiable
        with torch.enable_grad():
            gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
            h = _TORCH_ACTIVATIONS[ctx.activation](gate) * up
        return torch.autograd.grad(h, gate_up, dh, create_graph=True)[0], None
    return _BACKWARD_OP(dh.contiguous(), gate_up, ctx.activation), None


# Operators of torch.library (not custom_op, whose Python wrapper cost about 90 µs a call on the lent
# host: results/v25/), each with a CPU and a CUDA kernel and a fake.
_LIBRARY = torch.library.Library("bsmm", "FRAGMENT")
_LIBRARY.define("gated_unit(Tensor gate_up, str activation) -> Tensor")
_LIBRARY.define("gated_unit_backward(Tensor dh, Tensor gate_up, str activation) -> Tensor")
for _key in ("CPU", "CUDA"):
    _LIBRARY.impl("gated_unit", _forward, _key)
    _LIBRARY.impl("gated_unit_backward", _backward_values, _key)
torch.library.register_fake("bsmm::gated_unit", lambda gate_up, activation: gate_up.new_empty(
    (*gate_up.shape[:-1], gate_up.shape[-1] // 2)), lib=_LIBRARY)
torch.library.register_fake("bsmm::gated_unit_backward", lambda dh, gate_up, activation: gate_up.new_empty(
    gate_up.shape), lib=_LIBRARY)
torch.library.register_autograd("bsmm::gated_unit", _backward, setup_context=_setup_context, lib=_LIBRARY)
_OP, _BACKWARD_OP = torch.ops.bsmm.gated_unit.default, torch.ops.bsmm.gated_unit_backward.default


def gated_unit(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``A(g)·u`` of a ``[gate | up]`` tensor (..., 2·hidden): (..., hidden), differentiable.

    ``activation``: ``"silu"`` (SwiGLU), ``"gelu"`` or ``"gelu_tanh"`` (GeGLU) or ``"relu"``.

    Examples
    --------
    >>> import torch
    >>> gate_up = torch.randn(3, 8)
    >>> h = gated_unit(gate_up, "silu")
    >>> torch.allclose(h, torch.nn.functional.silu(gate_up[:, :4]) * gate_up[:, 4:])
    True
    """
    if not isinstance(gate_up, torch.Tensor) or not gate_up.is_floating_point():
        raise TypeError(f"gate_up must be a floating-point torch.Tensor; got {type(gate_up).__name__}"
                        + (f" of {gate_up.dtype}" if isinstance(gate_up, torch.Tensor) else ""))
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2 or gate_up.shape[-1] == 0:
        raise ValueError(f"gate_up's last dimension must hold the gate and the up halves (an even size, not 0); "
                         f"got shape {tuple(gate_up.shape)}")
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, GATED_ACTIVATIONS))}; got {activation!r}")
    if (type(gate_up) is torch.Tensor and not (gate_up.requires_grad and torch.is_grad_enabled())
            and not torch.compiler.is_compiling() and forward_ad._current_level < 0
            and torch._C._len_torch_dispatch_stack() == 0):
        # Nothing to record (decode: no autograd, no forward-mode tangent, no tracing or dispatch
        # mode): the kernel without the dispatcher's ~10 µs.
        return _forward(gate_up, activation)
    return _OP(gate_up, activation)

"""The functional API: :func:`blocksparse_matmul` and :func:`blocksparse_conv`.

Under ``torch.autocast`` the input and the weight are cast to the autocast dtype first, as
``nn.Linear`` does (copies, as in any autocast region; the pass itself copies nothing). They take
what ``F.linear`` and ``F.conv2d`` take: a non-contiguous input or weight (a transposed or sliced
view) is copied into a contiguous tensor first, as those functions do internally; the operators
(``torch.ops.bsmm.*``) and the NumPy/CuPy API keep a strict contract and refuse it instead. Meta
tensors (deferred initialisation) run the operators' fake kernels: shapes only. Both reach their
operators by the layout's registry key; the layers call :func:`matmul_by_key` and
:func:`conv_by_key` with the key they hold.
"""

from __future__ import annotations

import weakref

import torch

from bsmm.matmul import BlocksparseMatMul
from bsmm.nn.conv import BlocksparseConv
from bsmm.torch.checks import SUPPORTED_DTYPES
from bsmm.torch.conv_ops import conv_fprop, conv_spec
from bsmm.epilogues import check_activation
from bsmm.torch.eager import biased_product, product
from bsmm.torch.registry import Registration, register

__all__ = ["blocksparse_conv", "blocksparse_matmul", "conv_by_key", "matmul_by_key"]

# The registration of each BlocksparseMatMul used through blocksparse_matmul, alive as long as the op.
_OPS: "weakref.WeakKeyDictionary[BlocksparseMatMul, Registration]" = weakref.WeakKeyDictionary()


def _autocast(x: torch.Tensor, w: torch.Tensor):
    """Cast both to the autocast dtype where autocast is on for x's device, as ``F.linear`` would."""
    device_type = x.device.type
    # Meta tensors (deferred initialisation) have no autocast state; asking raises, so they are left alone.
    # (Compared by name: torch.compile of PyTorch 2.11 cannot trace torch.amp.is_autocast_available.)
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if dtype in SUPPORTED_DTYPES:
            # float64 (CPU only) is left alone, as autocast does: computed in float64 on the CPU, refused on a GPU.
            return ((x.to(dtype) if x.dtype in SUPPORTED_DTYPES else x),
                    (w.to(dtype) if w.dtype in SUPPORTED_DTYPES else w))
    return x, w


class _GatedWeight(torch.autograd.Function):
    """g ⊙ W as one autograd node: ``apply(w, gate, cast)``, ``cast`` the gates in W's dtype, detached.

    The gradients are ``dW = g ⊙ dY`` and ``dg_j = Σ (dY ⊙ W)_j`` (the products in W's dtype, summed in
    float32, float64 for float64, then cast to the gate's dtype): what PyTorch's own cast, view and
    multiply compute, in one node instead of three (eager steps pay their autograd engine per node)."""

    @staticmethod
    def forward(w, gate, cast):
        return w * cast.view(-1, *([1] * (w.dim() - 1)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        w, gate, cast = inputs
        ctx.gate_dtype = gate.dtype
        needs_w, needs_gate = ctx.needs_input_grad[:2]
        # (dW reads the gate itself, not its detached cast: a backward that builds a graph differentiates it)
        ctx.save_for_backward(w if needs_gate else None, gate if needs_w else None)

    @staticmethod
    def backward(ctx, grad):
        w, gate = ctx.saved_tensors
        dw = dgate = None
        if ctx.needs_input_grad[0]:
            dw = grad * (gate if gate.dtype == grad.dtype else gate.to(grad.dtype)).view(-1, *([1] * (grad.dim() - 1)))
        if ctx.needs_input_grad[1]:
            wide = torch.promote_types(w.dtype, torch.float32)  # (float64 stays float64)
            dgate = (grad * w).sum(tuple(range(1, grad.dim())), dtype=wide).to(ctx.gate_dtype)
        return dw, dgate, None


def gated_weight(w: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """g ⊙ W: each block of ``w`` (nnzb, ..., bs, bs) scaled by its gate (nnzb,), differentiable in both."""
    return gated_weight_and_gate(w, gate)[0]


def gated_weight_and_gate(w: torch.Tensor, gate: torch.Tensor) -> tuple:
    """(g ⊙ W, g in W's dtype and detached): :func:`gated_weight`, and the gates as :func:`matmul_by_key`
    takes them (cast once for both)."""
    cast = gate.detach()
    if cast.dtype != w.dtype:
        cast = cast.to(w.dtype)
    return _GatedWeight.apply(w, gate, cast), cast


def matmul_by_key(x, w, key: str, features_in: int, features_out: int, feature_axis: int, tf32: bool,
                  bias: torch.Tensor | None = None, activation: str | None = None,
                  gate: torch.Tensor | None = None, updat_gate: bool = False) -> torch.Tensor:
    """``A(x·W + bias)`` over any leading (feature_axis=1) or trailing (feature_axis=0) batch
    dimensions; without ``bias`` and ``activation``, ``x·W``. The bias is cast to the product's
    dtype (under autocast: the autocast dtype, as ``nn.Linear``'s).

    ``gate`` (nnzb,): the gates ``w`` is already scaled by (:func:`gated_weight`, on w's device); the
    CUDA kernels skip the blocks they close, in the forward and in dx. ``updat_gate``: dW's pass may
    skip them too, which leaves the gradient of ``w ⊙ g`` there unspecified: right where no gradient
    reads it (a gate that takes none, or one whose derivative is 0 where it is closed, as
    :class:`bsmm.torch.BlockGates`'s)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor; got {type(w).__name__}")
    x, w = _autocast(x, w)
    axis = x.dim() - 1 if feature_axis == 1 else 0
    if x.dim() == 0 or x.shape[axis] != features_in:
        expected = f"(..., {features_in})" if feature_axis == 1 else f"({features_in}, ...)"
        raise ValueError(f"x must have shape {expected} with feature_axis={feature_axis}; got {tuple(x.shape)}")
    # As nn.Linear: a strided view is copied (differentiably) rather than refused; the kernels read dense memory.
    # (Tested first, not called unconditionally: this is every layer call's host path.)
    if not x.is_contiguous():
        x = x.contiguous()
    if not w.is_contiguous():
        w = w.contiguous()
    if gate is not None:  # (a hint the kernels read as w's dtype, detached: its gradient flows through w)
        gate = gate.detach()
        if gate.dtype != w.dtype:  # (autocast cast w after it was gated)
            gate = gate.to(w.dtype)
        if not gate.is_contiguous():
            gate = gate.contiguous()
    out_shape = None
    if x.dim() != 2:  # on a contiguous tensor these reshapes are views; y is made in its final shape
        if feature_axis == 1:
            x, out_shape = x.reshape(-1, features_in), (*x.shape[:-1], features_out)
        else:
            x, out_shape = x.reshape(features_in, -1), (features_out, *x.shape[1:])
    if bias is None and activation is None:
        return product(x, w, key, feature_axis, tf32, out_shape, gate, updat_gate)
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None; got {type(bias).__name__}")
        bias = bias.to(x.dtype)
    return biased_product(x, w, bias, key, feature_axis, tf32, check_activation(activation) or "none", out_shape,
                          features_out, gate, updat_gate)


def _registration_for(op: BlocksparseMatMul) -> Registration:
    registration = _OPS.get(op)
    if registration is None:
        registration = _OPS[op] = register(op.index)
    return registration


@torch.compiler.assume_constant_result
def _static_arguments(op: BlocksparseMatMul) -> tuple:
    # Run once when torch.compile traces a call (the op is guarded): the layout tables never enter the graph.
    if not isinstance(op, BlocksparseMatMul):
        raise TypeError(f"op must be a bsmm.BlocksparseMatMul; got {type(op).__name__}")
    return (_registration_for(op).key, op.C, op.K, op.feature_axis, op.tf32)


def blocksparse_matmul(x: torch.Tensor, w: torch.Tensor, op: BlocksparseMatMul, bias: torch.Tensor | None = None,
                       activation: str | None = None, *, gate: torch.Tensor | None = None) -> torch.Tensor:
    """y = x·W for the block-sparse ``W`` of ``op``'s layout, differentiable in ``x`` and ``w``;
    with ``bias`` or ``activation``, y = A(x·W + bias) in one kernel.

    Parameters
    ----------
    x : (..., C) tensor, or (C, ...) with ``op.feature_axis == 0``
        float32, float16 or bfloat16, on the CPU or a CUDA device; float64 on the CPU; or
        on the meta device (shapes only). Any strides: a non-contiguous ``x`` is copied
        first (``x.contiguous()``), as ``F.linear`` does.
    w : (nnzb, bs, bs) tensor, ``op.w_shape``
        Block data, x's dtype and device; copied first too where not contiguous.
    op : bsmm.BlocksparseMatMul
        The layout, block size, feature axis and TF32 choice.
    bias : (K,) tensor, optional
        Added inside the kernel (differentiable); cast to the product's dtype.
    activation : {None, "none", "relu", "gelu", "gelu_tanh", "silu"}
        Applied inside the kernel to x·W + bias (:mod:`bsmm.epilogues`); ``"gelu"`` is
        ``F.gelu``'s default (erf), ``"gelu_tanh"`` its ``approximate="tanh"``.
    gate : (nnzb,) tensor, optional
        One scale a block: y = x·(g ⊙ W), differentiable in ``g`` too (cast to w's dtype;
        :mod:`bsmm.torch.gates` learns such gates). On CUDA the kernels skip the blocks whose gate is
        0 in y and dx, and in dW where ``g`` takes no gradient.

    Returns
    -------
    y : (..., K) tensor, or (K, ...) with ``op.feature_axis == 0``; x's dtype and device
        (the autocast dtype under ``torch.autocast``).

    Raises
    ------
    TypeError
        If ``x`` or ``w`` is not a tensor or not of a supported dtype, their dtypes
        differ, or ``op`` is not a BlocksparseMatMul.
    ValueError
        If a shape does not fit ``op``, or ``x`` and ``w`` are on different devices.

    Notes
    -----
    ``op``'s layout stays registered while ``op`` lives, and in eager mode until a
    pending backward has run. A ``torch.compile``'d backward holds only the key, so
    keep ``op`` alive until it has run (a ``BlockSparseLinear`` holds its own).

    Examples
    --------
    >>> import numpy as np, torch, bsmm, bsmm.torch
    >>> op = bsmm.BlocksparseMatMul(np.array([[1, 0], [1, 1]]), block_size=8)
    >>> w = torch.randn(op.w_shape, requires_grad=True)
    >>> x = torch.randn(2, 3, op.C)
    >>> y = bsmm.torch.blocksparse_matmul(x, w, op)
    >>> y.shape
    torch.Size([2, 3, 16])
    >>> dense = torch.from_numpy(op.to_dense(w.detach().numpy()))
    >>> torch.allclose(y, x @ dense, atol=1e-5)
    True
    >>> y.sum().backward()
    >>> w.grad.shape
    torch.Size([3, 8, 8])
    """
    key, features_in, features_out, feature_axis, tf32 = _static_arguments(op)
    if gate is not None:
        if not isinstance(gate, torch.Tensor):
            raise TypeError(f"gate must be a torch.Tensor or None; got {type(gate).__name__}")
        if tuple(gate.shape) != (op.blocks,):
            raise ValueError(f"gate must be a tensor of shape ({op.blocks},), one value a block; got "
                             f"{tuple(gate.shape)}")
        # The gradient of w ⊙ g at a closed block is the gate's there (⟨W, xᵀ·dy⟩): kept exact where g takes one.
        updat_gate = not (gate.requires_grad and torch.is_grad_enabled())
        w, cast = gated_weight_and_gate(w, gate)
        return matmul_by_key(x, w, key, features_in, features_out, feature_axis, tf32, bias, activation, cast,
                             updat_gate)
    return matmul_by_key(x, w, key, features_in, features_out, feature_axis, tf32, bias, activation)


def conv_by_key(x, w, key: str, base: tuple, tf32: bool) -> torch.Tensor:
    """``bsmm::conv_fprop`` on ``x`` in the channel layout of ``base`` (``conv_spec`` without the spatial shape)."""
    for name, value in (("x", x), ("w", w)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    x, w = _autocast(x, w)
    rank, channels_last = base[0], base[-1]
    if x.dim() != rank + 2:
        expected = "(N, *spatial, C)" if channels_last else "(N, C, *spatial)"
        raise ValueError(f"x must have shape {expected} with {rank} spatial dimensions; got {tuple(x.shape)}")
    x, w = x.contiguous(), w.contiguous()  # as matmul_by_key: strided views copied, not refused
    spatial = x.shape[1:-1] if channels_last else x.shape[2:]
    return conv_fprop(x, w, key, [*base, *spatial], tf32)


@torch.compiler.assume_constant_result
def _static_conv_arguments(conv: BlocksparseConv) -> tuple:
    # As _static_arguments: run once when torch.compile traces a call.
    if not isinstance(conv, BlocksparseConv):
        raise TypeError(f"conv must be a bsmm.nn.conv.BlocksparseConv; got {type(conv).__name__}")
    return (_registration_for(conv).key, tuple(conv_spec(conv, ())), conv.tf32)


def blocksparse_conv(x: torch.Tensor, w: torch.Tensor, conv: BlocksparseConv) -> torch.Tensor:
    """y = conv(x, W) for a :class:`bsmm.nn.conv.BlocksparseConv`, differentiable in ``x`` and ``w``.

    Parameters
    ----------
    x : (N, *spatial, C) tensor, or (N, C, *spatial) with ``conv.channels_last == False``
        Any strides (a non-contiguous one is copied first, as ``w`` is); float32, float16 or
        bfloat16 on the CPU or a CUDA device, float64 on the CPU.
    w : ``conv.w_shape`` = (*kernel_size, nnzb, bs, bs) tensor of x's dtype and device
    conv : bsmm.nn.conv.BlocksparseConv
        Layout, geometry, channel layout and TF32 choice.

    Returns
    -------
    y : ``conv.output_shape(x.shape)`` tensor, x's dtype (the autocast dtype under autocast)

    Notes
    -----
    Runs the ``bsmm::conv_fprop`` operator; its backward runs ``bsmm::conv_bprop`` and
    ``bsmm::conv_updat``, whose own backwards give gradients of any order. Besides its
    output, a pass allocates the canvas and grid of :class:`bsmm.nn.conv.BlocksparseConv`
    (NumPy on the CPU, CuPy's pool on a GPU). Keep ``conv`` alive until a
    ``torch.compile``'d backward has run (as for :func:`blocksparse_matmul`).

    Examples
    --------
    >>> import numpy as np, torch, bsmm.torch
    >>> from bsmm.nn.conv import BlocksparseConv
    >>> conv = BlocksparseConv(np.array([[1, 0], [1, 1]]), 8, (3, 3), padding=1, channels_last=False)
    >>> x = torch.randn(2, 16, 5, 5)
    >>> w = torch.randn(conv.w_shape, requires_grad=True)
    >>> y = bsmm.torch.blocksparse_conv(x, w, conv)
    >>> dense = torch.from_numpy(conv.to_dense(w.detach().numpy())).permute(3, 2, 0, 1)  # (K, C, 3, 3)
    >>> torch.allclose(y, torch.nn.functional.conv2d(x, dense, padding=1), atol=1e-4)
    True
    >>> y.square().sum().backward()
    >>> w.grad.shape
    torch.Size([3, 3, 3, 8, 8])
    """
    key, base, tf32 = _static_conv_arguments(conv)
    return conv_by_key(x, w, key, base, tf32)

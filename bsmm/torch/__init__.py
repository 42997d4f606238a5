"""PyTorch adapter: block-sparse ``x·W`` as a differentiable, compilable operator and an ``nn.Module``.

>>> import numpy as np, torch, bsmm.torch
>>> layer = bsmm.torch.BlockSparseLinear(64, 64, np.array([[1, 0], [1, 1]]), block_size=32)
>>> layer.weight.shape, layer(torch.ones(5, 64)).shape
(torch.Size([3, 32, 32]), torch.Size([5, 64]))

- :func:`blocksparse_matmul` ``(x, w, op)``: ``x·W`` for a :class:`bsmm.BlocksparseMatMul`
  ``op`` and block data ``w`` (``op.w_shape``), with leading batch dimensions and autocast.
- :class:`BlockSparseLinear`: the layer, weight parameter of shape ``w_shape``.
- Both run ``torch.ops.bsmm.matmul`` (:mod:`bsmm.torch.ops`), a ``torch.library``
  custom operator with a fake implementation and an autograd formula made of the
  ``bsmm::matmul_bprop`` and ``bsmm::matmul_updat`` operators: ``torch.compile(fullgraph=True)``
  traces through it, and gradients of any order are block-sparse.
- CPU tensors run the CPU backend, CUDA tensors the GPU kernels on PyTorch's
  current stream; tensors are shared through DLPack, never copied, and each pass
  allocates only its output (through PyTorch's allocator).
- Dtypes float32, float16, bfloat16, and float64 on the CPU only (computed in float64, so
  ``torch.autograd.gradcheck`` runs at its default tolerances); under ``torch.autocast`` the input and the
  weight are cast to the autocast dtype first, as ``nn.Linear`` does (those casts
  are copies, as in any autocast region; the pass itself still copies nothing).
- Convolutions: :func:`blocksparse_conv` ``(x, w, conv)`` for a :class:`bsmm.nn.conv.BlocksparseConv`
  and the layers :class:`BlockSparseConv1d`, :class:`BlockSparseConv2d`, :class:`BlockSparseConv3d`
  (``nn.Conv`` shapes; a ``channels_last`` input runs without a layout copy), through the
  ``bsmm::conv_fprop``, ``conv_bprop`` and ``conv_updat`` operators, built the same way.
- The layout reaches the operators as a content-derived string key resolved in a
  process-wide registry (:func:`register`, :func:`lookup`; why, in :mod:`bsmm.torch.ops`).
  Layers and ``BlocksparseMatMul`` objects register themselves; pickled or deep-copied
  layers register again on load, and ``state_dict`` carries the layout as a buffer.
- Inputs must be contiguous (a ``ValueError`` otherwise, rather than a hidden copy);
  gradients arriving in backward are made contiguous when they are not (``y.sum()``
  sends an expanded one).
"""

from __future__ import annotations

import math
import weakref

import numpy as np

# First, for its clear ImportError when PyTorch is missing.
from bsmm.torch.ops import SUPPORTED_DTYPES, Registration, check_dtype, lookup, product, register
from bsmm.torch.conv_ops import conv_fprop, conv_spec  # noqa: I001  (after ops: see above)

import torch  # noqa: E402  (after the guarded import above)

from bsmm.nn.conv import BlocksparseConv  # noqa: E402
from bsmm.matmul import BlocksparseMatMul  # noqa: E402

__all__ = ["BlockSparseConv1d", "BlockSparseConv2d", "BlockSparseConv3d", "BlockSparseLinear", "blocksparse_conv",
           "blocksparse_matmul", "register", "lookup"]

# The registration of each BlocksparseMatMul used through blocksparse_matmul, alive as long as the op.
_OPS: "weakref.WeakKeyDictionary[BlocksparseMatMul, Registration]" = weakref.WeakKeyDictionary()


def _autocast(x: torch.Tensor, w: torch.Tensor):
    """Cast both to the autocast dtype where autocast is on for x's device, as ``F.linear`` would."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if dtype in SUPPORTED_DTYPES:
            # float64 is left alone, as autocast does: computed in float64 on the CPU, refused on a GPU.
            cast = (torch.float32, torch.float16, torch.bfloat16)
            return (x.to(dtype) if x.dtype in cast else x), (w.to(dtype) if w.dtype in cast else w)
    return x, w


def _matmul(x, w, key: str, features_in: int, features_out: int, feature_axis: int, tf32: bool) -> torch.Tensor:
    """``x·W`` over any leading (feature_axis=1) or trailing (feature_axis=0) batch dimensions."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor; got {type(w).__name__}")
    x, w = _autocast(x, w)
    axis = x.dim() - 1 if feature_axis == 1 else 0
    if x.dim() == 0 or x.shape[axis] != features_in:
        expected = f"(..., {features_in})" if feature_axis == 1 else f"({features_in}, ...)"
        raise ValueError(f"x must have shape {expected} with feature_axis={feature_axis}; got {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous; got shape {tuple(x.shape)}, strides {x.stride()}")
    if x.dim() == 2:  # (the common case: no reshapes)
        return product(x, w, key, feature_axis, tf32)
    # On a contiguous tensor these reshapes are views.
    if feature_axis == 1:
        y = product(x.reshape(-1, features_in), w, key, feature_axis, tf32)
        return y.reshape(*x.shape[:-1], features_out)
    y = product(x.reshape(features_in, -1), w, key, feature_axis, tf32)
    return y.reshape(features_out, *x.shape[1:])


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


def blocksparse_matmul(x: torch.Tensor, w: torch.Tensor, op: BlocksparseMatMul) -> torch.Tensor:
    """y = x·W for the block-sparse ``W`` of ``op``'s layout, differentiable in ``x`` and ``w``.

    Parameters
    ----------
    x : (..., C) tensor, or (C, ...) with ``op.feature_axis == 0``
        float32, float16 or bfloat16, contiguous, on the CPU or a CUDA device; float64 on the CPU.
    w : (nnzb, bs, bs) tensor, ``op.w_shape``
        Block data, x's dtype and device.
    op : bsmm.BlocksparseMatMul
        The layout, block size, feature axis and TF32 choice.

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
        If a shape does not fit ``op``, a tensor is not contiguous, or ``x`` and
        ``w`` are on different devices.

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
    return _matmul(x, w, key, features_in, features_out, feature_axis, tf32)


def _layout_array(layout) -> np.ndarray:
    if isinstance(layout, torch.Tensor):
        return layout.detach().cpu().numpy()
    return np.asarray(layout)


class _BlockSparseLayer(torch.nn.Module):
    """What the block-sparse layers share: the operator ``op`` (a BlocksparseMatMul or a
    BlocksparseConv), its registration, the ``layout`` buffer, the weight and bias, their
    fan-in initialization, and the refusal of a state_dict of another layout."""

    def _build(self, make_op, sizes: tuple, bias: bool, device, dtype) -> None:
        """Make ``self.op`` and the parameters; ``sizes``: (argument, value, layout axis) to check."""
        dtype = torch.get_default_dtype() if dtype is None else dtype
        check_dtype(dtype, torch.empty(0, device=device).device, "dtype")
        self.op = make_op()
        for argument, value, blocks in sizes:
            expected = self.op.layout.shape[blocks] * self.op.block_size
            if value != expected:
                raise ValueError(
                    f"{argument} must be layout.shape[{blocks}] * block_size = {self.op.layout.shape[blocks]} * "
                    f"{self.op.block_size} = {expected}; got {value}"
                )
        # Pickles as its layout and re-registers on load (see bsmm.torch.ops).
        self._registration = register(self.op.index)
        self._key = self._registration.key
        self.register_buffer("layout", torch.tensor(np.array(self.op.layout), device=device))
        self.weight = torch.nn.Parameter(torch.empty(self.op.w_shape, device=device, dtype=dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(self.op.K, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the weight and bias again (see Notes), with PyTorch's random generator."""
        taps = math.prod(getattr(self.op, "kernel_size", ()))  # 1 for a product
        fan_in = np.count_nonzero(self.op.layout, axis=0) * self.op.block_size * taps
        bounds = np.where(fan_in > 0, 1.0 / np.sqrt(np.maximum(fan_in, 1)), 0.0)  # 0 for an empty block column
        with torch.no_grad():
            block_bounds = torch.tensor(bounds[self.op.index.indices], dtype=self.weight.dtype,
                                        device=self.weight.device)
            self.weight.uniform_(-1.0, 1.0).mul_(block_bounds.view(-1, 1, 1))
            if self.bias is not None:
                feature_bounds = np.repeat(bounds, self.op.block_size)
                self.bias.uniform_(-1.0, 1.0).mul_(
                    torch.tensor(feature_bounds, dtype=self.bias.dtype, device=self.bias.device)
                )

    def _dense_blocks(self) -> torch.Tensor:
        """(CB, KB, *kernel_size, bs, bs): the weight's blocks in place, zeros elsewhere; differentiable."""
        rows = torch.tensor(self.op.index.rows, dtype=torch.long, device=self.weight.device)
        cols = torch.tensor(self.op.index.indices, dtype=torch.long, device=self.weight.device)
        blocks = self.weight.movedim(-3, 0)  # (nnzb, *kernel_size, bs, bs)
        return blocks.new_zeros(*self.op.layout.shape, *blocks.shape[1:]).index_put((rows, cols), blocks)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        saved = state_dict.get(prefix + "layout")
        name = type(self).__name__
        if saved is not None:
            saved = saved.detach().cpu()
            if tuple(saved.shape) != self.op.layout.shape or not np.array_equal(saved.numpy() != 0,
                                                                              self.op.layout != 0):
                error_msgs.append(
                    f"{prefix}layout: the state_dict holds a layout of shape {tuple(saved.shape)} with "
                    f"{int(torch.count_nonzero(saved))} blocks, this {name} has shape "
                    f"{self.op.layout.shape} with {self.op.blocks} blocks"
                    + ("" if tuple(saved.shape) != self.op.layout.shape else " in other places")
                    + f"; build the layer with the saved layout, {name}(..., layout=state_dict"
                    f"['{prefix}layout'])"
                )
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


class BlockSparseLinear(_BlockSparseLayer):
    """y = x·W + b with a block-sparse ``W`` (in_features × out_features) of a fixed layout.

    Parameters
    ----------
    in_features, out_features : int
        ``C`` and ``K``; must equal ``layout.shape[0] * block_size`` and ``layout.shape[1] * block_size``.
    layout : (C // block_size, K // block_size) array or tensor of 0/1
        ``layout[c, k] != 0``: block ``(c, k)`` of ``W`` is present.
    block_size : int
        8, 16, 32, 64 or 128.
    bias : bool
        Add a learnable bias of shape (out_features,).
    feature_axis : {1, 0}
        1: input (..., C), output (..., K). 0: input (C, ...), output (K, ...).
    tf32 : bool
        On the GPU, float32 products on TF32 tensor cores.
    device, dtype
        Of the parameters (and of the ``layout`` buffer's device); dtype float32, float16 or bfloat16,
        or float64 on the CPU.

    Attributes
    ----------
    weight : Parameter (nnzb, block_size, block_size)
        The present blocks of ``W``, row-major over the layout (``op.w_shape``).
    bias : Parameter (out_features,) or None
    layout : buffer (C // block_size, K // block_size) uint8
        Saved in the ``state_dict``; loading a state_dict of another layout raises.
        It records the layout: changing it in place does not change the layer.
    op : bsmm.BlocksparseMatMul
        The operator over the layout (``op.to_dense``, ``op.flops``, ...).

    Notes
    -----
    Initialization follows ``nn.Linear`` with each output feature's true fan-in:
    the weights of block column ``k`` and the bias entries of its features are drawn
    from U(-1/sqrt(fan_in_k), 1/sqrt(fan_in_k)), ``fan_in_k = block_size ×`` the
    present blocks of column ``k``, with PyTorch's generator (``torch.manual_seed``
    applies). For a dense layout this is ``nn.Linear``'s distribution; features of
    an empty block column get a zero bias.

    Examples
    --------
    >>> import numpy as np, torch, bsmm.torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> layer = bsmm.torch.BlockSparseLinear(64, 64, np.eye(2), block_size=32)
    >>> layer
    BlockSparseLinear(in_features=64, out_features=64, block_size=32, blocks=2, density=0.5, bias=True)
    >>> x = torch.randn(8, 64)
    >>> dense = layer.to_dense_weight()  # (in_features, out_features)
    >>> torch.allclose(layer(x), x @ dense + layer.bias, atol=1e-5)
    True
    """

    def __init__(self, in_features: int, out_features: int, layout, block_size: int = 32, bias: bool = True,
                 feature_axis: int = 1, tf32: bool = False, device=None, dtype=None):
        super().__init__()
        self._build(lambda: BlocksparseMatMul(_layout_array(layout), block_size, feature_axis, tf32),
                    (("in_features", in_features, 0), ("out_features", out_features, 1)), bias, device, dtype)
        self.in_features, self.out_features = self.op.C, self.op.K
        self.feature_axis, self.tf32 = self.op.feature_axis, self.op.tf32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., C) -> (..., K), or (C, ...) -> (K, ...) with feature_axis=0."""
        y = _matmul(x, self.weight, self._key, self.in_features, self.out_features, self.feature_axis, self.tf32)
        if self.bias is None:
            return y
        bias = self.bias.to(y.dtype)  # autocast: the product's dtype, as nn.Linear
        if self.feature_axis == 0:
            bias = bias.view(-1, *([1] * (y.dim() - 1)))
        # In place: y is a fresh output nothing else holds, and its backward does not need it.
        return y.add_(bias)

    def to_dense_weight(self) -> torch.Tensor:
        """Dense ``W`` (in_features, out_features), zero where blocks are absent; differentiable.

        ``nn.Linear`` stores the transpose: ``nn.Linear.weight`` equals ``to_dense_weight().T``.
        """
        return self._dense_blocks().permute(0, 2, 1, 3).reshape(self.in_features, self.out_features)

    def extra_repr(self) -> str:
        text = (
            f"in_features={self.in_features}, out_features={self.out_features}, block_size={self.op.block_size}, "
            f"blocks={self.op.blocks}, density={self.op.density:.3g}, bias={self.bias is not None}"
        )
        if self.feature_axis != 1:
            text += f", feature_axis={self.feature_axis}"
        return text + (", tf32=True" if self.tf32 else "")


# -- convolutions ------------------------------------------------------------------------------------------
def _conv(x, w, key: str, base: tuple, tf32: bool) -> torch.Tensor:
    """``bsmm::conv_fprop`` on ``x`` in the channel layout of ``base`` (``conv_spec`` without the spatial shape)."""
    for name, value in (("x", x), ("w", w)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    x, w = _autocast(x, w)
    rank, channels_last = base[0], base[-1]
    if x.dim() != rank + 2:
        expected = "(N, *spatial, C)" if channels_last else "(N, C, *spatial)"
        raise ValueError(f"x must have shape {expected} with {rank} spatial dimensions; got {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous; got shape {tuple(x.shape)}, strides {x.stride()}")
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
        Contiguous; float32, float16 or bfloat16 on the CPU or a CUDA device, float64 on the CPU.
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
    return _conv(x, w, key, base, tf32)


class _BlockSparseConvNd(_BlockSparseLayer):
    """The convolution layers; subclasses set the spatial rank."""

    _rank = 0

    def __init__(self, in_channels: int, out_channels: int, kernel_size, layout, block_size: int = 32, stride=1,
                 padding=0, dilation=1, bias: bool = True, tf32: bool = False, device=None, dtype=None):
        super().__init__()
        if not isinstance(kernel_size, int) and len(tuple(kernel_size)) != self._rank:
            raise ValueError(f"kernel_size must be an int or a tuple of {self._rank} ints for "
                             f"{type(self).__name__}; got {kernel_size!r}")
        kernel_size = (kernel_size,) * self._rank if isinstance(kernel_size, int) else tuple(kernel_size)
        self._build(lambda: BlocksparseConv(_layout_array(layout), block_size, kernel_size, stride, padding, dilation,
                                            channels_last=False, tf32=tf32),
                    (("in_channels", in_channels, 0), ("out_channels", out_channels, 1)), bias, device, dtype)
        op = self.op
        self.in_channels, self.out_channels, self.tf32 = op.C, op.K, op.tf32
        self.kernel_size, self.stride, self.padding, self.dilation = op.kernel_size, op.stride, op.padding, op.dilation
        first = tuple(conv_spec(op, ()))
        self._specs = {False: first, True: first[:-1] + (1,)}  # by channels_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, C, *spatial) -> (N, K, *out), the memory format of x kept (see the class Notes)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
        if x.dim() != self._rank + 2 or x.shape[1] != self.in_channels:
            raise ValueError(f"x must have shape (N, {self.in_channels}, *spatial) with {self._rank} spatial "
                             f"dimensions; got {tuple(x.shape)}")
        last = x.movedim(1, -1)
        channels_last = last.is_contiguous()
        y = _conv(last if channels_last else x.contiguous(), self.weight, self._key, self._specs[channels_last],
                  self.tf32)
        if self.bias is not None:
            bias = self.bias.to(y.dtype)  # autocast: the convolution's dtype, as nn.Conv
            # In place: y is a fresh output nothing else holds, and its backward does not need it.
            y = y.add_(bias if channels_last else bias.view(-1, *([1] * self._rank)))
        return y.movedim(-1, 1) if channels_last else y

    def to_dense_weight(self) -> torch.Tensor:
        """Dense weight (out_channels, in_channels, *kernel_size) as ``nn.Conv`` stores it; differentiable."""
        rank = self._rank
        blocks = self._dense_blocks()  # (CB, KB, *kernel, bs_c, bs_k)
        dense = blocks.permute(1, 3 + rank, 0, 2 + rank, *range(2, 2 + rank))
        return dense.reshape(self.out_channels, self.in_channels, *self.kernel_size)

    def extra_repr(self) -> str:
        text = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, block_size={self.op.block_size}, "
                f"blocks={self.op.blocks}, density={self.op.density:.3g}, bias={self.bias is not None}")
        return text + (", tf32=True" if self.tf32 else "")


_CONV_DOC = """A {rank}-D convolution whose input × output channel connectivity is block-sparse.

    Same shapes as ``torch.nn.Conv{rank}d``: ``x`` (N, C, {spatial}) -> (N, K, {out}); one
    block-sparse ``C × K`` matrix of the given layout per kernel offset, the kernel dense.

    Parameters
    ----------
    in_channels, out_channels : int
        ``C`` and ``K``: ``layout.shape[0] * block_size`` and ``layout.shape[1] * block_size``.
    kernel_size : int or tuple of {rank} ints
    layout : (C // block_size, K // block_size) array or tensor of 0/1
    block_size : int, default 32
    stride, padding, dilation : int or tuple of {rank} ints
        padding may also be "valid" or "same" (stride 1, odd dilated kernel).
    bias : bool
    tf32 : bool
        On the GPU, float32 on TF32 tensor cores.
    device, dtype
        Of the parameters: float32, float16 or bfloat16, or float64 on the CPU.

    Attributes
    ----------
    weight : Parameter (*kernel_size, nnzb, block_size, block_size)
        Per kernel offset, the present blocks in the layout's storage order (``op.w_shape``).
    bias : Parameter (out_channels,) or None
    layout : buffer, checked when a state_dict is loaded
    op : bsmm.nn.conv.BlocksparseConv
        The channels-first convolution (``op.flops``, ``op.to_dense``, ...).

    Notes
    -----
    The memory format of ``x`` picks the path: a ``channels_last`` tensor{cl} is run as
    (N, {spatial}, C) without a layout copy and the output is ``channels_last`` too; a
    contiguous one is transposed by the convolution's canvas copy (see
    :class:`bsmm.nn.conv.BlocksparseConv`). Other strides are made contiguous first.
    Initialization follows ``nn.Conv{rank}d`` with each output channel's true fan-in
    (present blocks of its block column × block size × kernel volume).

    Examples
    --------
    >>> import numpy as np, torch, bsmm.torch
    >>> layer = bsmm.torch.{name}(64, 32, 3, np.array([[1], [0]]), block_size=32, padding=1)
    >>> layer
    {name}(64, 32, kernel_size={kernel}, stride={ones}, padding={ones}, dilation={ones}, block_size=32, blocks=1, density=0.5, bias=True)
    >>> x = torch.randn(2, 64, {example})
    >>> dense = torch.nn.functional.conv{rank}d(x, layer.to_dense_weight(), layer.bias, padding=1)
    >>> torch.allclose(layer(x), dense, atol=1e-4)
    True
    """


def _conv_doc(rank: int, name: str, spatial: str, out: str, example: str, fast: str) -> str:
    kernel, ones = (3,) * rank, (1,) * rank
    return _CONV_DOC.format(rank=rank, name=name, spatial=spatial, out=out, example=example, cl=fast, kernel=kernel,
                            ones=ones)


class BlockSparseConv1d(_BlockSparseConvNd):
    __doc__ = _conv_doc(1, "BlockSparseConv1d", "L", "L_out", "9", " (``x.transpose(1, 2)`` contiguous)")
    _rank = 1


class BlockSparseConv2d(_BlockSparseConvNd):
    __doc__ = _conv_doc(2, "BlockSparseConv2d", "H, W", "H_out, W_out", "5, 6",
                        " (``x.is_contiguous(memory_format=torch.channels_last)``)")
    _rank = 2


class BlockSparseConv3d(_BlockSparseConvNd):
    __doc__ = _conv_doc(3, "BlockSparseConv3d", "D, H, W", "D_out, H_out, W_out", "3, 4, 5",
                        " (``torch.channels_last_3d``)")
    _rank = 3

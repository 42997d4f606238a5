"""The ``nn.Module`` layers: :class:`BlockSparseLinear` and :class:`BlockSparseConv1d`, ``2d``, ``3d``.

Each registers its layout (:mod:`bsmm.torch.registry`) for as long as it lives; pickled or
deep-copied layers register again on load, and the ``state_dict`` carries the layout as a buffer.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from bsmm.block_index import check_block_size
from bsmm.epilogues import check_activation
from bsmm.layouts import random_layout
from bsmm.matmul import BlocksparseMatMul
from bsmm.matrix import BlockSparseMatrix
from bsmm.nn.conv import BlocksparseConv
from bsmm.torch.checks import check_dtype
from bsmm.torch.conv_ops import conv_spec
from bsmm.torch.conversions import weight_bsr
from bsmm.torch.functional import conv_by_key, gated_weight_and_gate, matmul_by_key
from bsmm.torch.registry import Registration, cuda_graphs_recorded, is_moving, move, register
from bsmm.torch.registry import moving as moving_registration

__all__ = ["BlockSparseConv1d", "BlockSparseConv2d", "BlockSparseConv3d", "BlockSparseLinear", "load_layouts"]


def _layout_array(layout) -> np.ndarray:
    if isinstance(layout, torch.Tensor):
        return layout.detach().cpu().numpy()
    return np.asarray(layout)


def fan_in_bounds(layout: np.ndarray, block_size: int, taps: int = 1) -> np.ndarray:
    """Per block column k of ``layout``: ``nn.Linear``'s initialization bound 1/sqrt(fan_in_k), the fan-in
    ``block_size × taps ×`` the column's present blocks; 0 for an empty column."""
    fan_in = np.count_nonzero(layout, axis=0) * block_size * taps
    return np.where(fan_in > 0, 1.0 / np.sqrt(np.maximum(fan_in, 1)), 0.0)


def bias_along(bias: torch.Tensor, y: torch.Tensor, feature_axis: int) -> torch.Tensor:
    """``bias`` (K,) in ``y``'s dtype (autocast: the product's, as ``nn.Linear``), shaped to add to ``y``."""
    bias = bias.to(y.dtype)
    return bias if feature_axis == 1 else bias.view(-1, *([1] * (y.dim() - 1)))


def _check_multiple(argument: str, value: int, block_size: int) -> None:
    """Refuse a feature count that is not a multiple of ``block_size``, naming the nearest ones that are."""
    if value % block_size == 0:
        return
    # Refused rather than padded: padding changes the layer's shape and its parameter count behind the caller.
    below, above = value // block_size * block_size, (value // block_size + 1) * block_size
    nearest = f"{below} or {above}" if below else f"{above}"
    raise ValueError(
        f"{argument} must be a multiple of block_size {block_size}; got {value} (nearest: {nearest}). Keep a "
        f"layer of such a size as torch.nn.Linear (a 10-class head, 784 pixel inputs), or pad its features to "
        f"a multiple"
    )


def largest_blocks(weight: torch.Tensor, block_size: int, density: float | None) -> np.ndarray:
    """The layout (in × out blocks, bsmm's orientation) of the blocks of largest Frobenius norm of a
    dense ``nn.Linear`` weight (out × in), ``round(density × blocks)`` of them; with ``density`` None,
    the blocks holding a non-zero (:meth:`bsmm.BlockSparseMatrix.from_dense`)."""
    # float32 holds float16 and bfloat16 exactly: the norms are those of the weight itself.
    host = weight.detach().T.to("cpu", torch.float64 if weight.dtype == torch.float64 else torch.float32).numpy()
    return BlockSparseMatrix.from_dense(host, block_size, density=density).layout


def present_blocks(weight: torch.Tensor, index) -> torch.Tensor:
    """The blocks of a dense ``nn.Linear`` weight (out × in) that ``index`` (in × out blocks) keeps,
    row-major over its layout: a layer's ``weight`` data."""
    bs = index.block_size
    rows = torch.tensor(index.rows, dtype=torch.long, device=weight.device)
    cols = torch.tensor(index.indices, dtype=torch.long, device=weight.device)
    # W (in, out) blocked as (CB, KB, bs, bs): block (c, k) is weight.T[c*bs:(c+1)*bs, k*bs:(k+1)*bs].
    grid = weight.detach().T.reshape(index.layout.shape[0], bs, index.layout.shape[1], bs).transpose(1, 2)
    return grid[rows, cols]


class _BlockSparseLayer(torch.nn.Module):
    """What the block-sparse layers share: the operator ``op`` (a BlocksparseMatMul or a
    BlocksparseConv), its registration, the ``layout`` buffer, the weight and bias, their
    fan-in initialization, and the refusal of a state_dict of another layout."""

    def _build(self, make_op, sizes: tuple, bias: bool, device, dtype) -> None:
        """Make ``self.op`` and the parameters; ``sizes``: (argument, value, layout axis) to check."""
        dtype = torch.get_default_dtype() if dtype is None else dtype
        device_of = torch.empty(0, device=device).device
        # On the meta device the layer's final device is not known yet: float64 is checked where it runs.
        check_dtype(dtype, torch.device("cpu") if device_of.type == "meta" else device_of, "dtype")
        self.op = make_op()
        for argument, value, blocks in sizes:
            _check_multiple(argument, value, self.op.block_size)
            expected = self.op.layout.shape[blocks] * self.op.block_size
            if value != expected:
                raise ValueError(
                    f"{argument} must be layout.shape[{blocks}] * block_size = {self.op.layout.shape[blocks]} * "
                    f"{self.op.block_size} = {expected}; got {value}"
                )
        self._use(self.op)
        self.register_buffer("layout", torch.tensor(np.array(self.op.layout), device=device))
        self.weight = torch.nn.Parameter(torch.empty(self.op.w_shape, device=device, dtype=dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(self.op.K, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def _use(self, op, registration: Registration | None = None) -> None:
        """Compute with ``op``: its registration held (by default its layout's content key; the layer pickles
        as its layout and registers again on load, see bsmm.torch.registry) and its key for the operators."""
        self.op, self._registration = op, register(op.index) if registration is None else registration
        self._key = self._registration.key

    def reset_parameters(self) -> None:
        """Draw the weight and bias again (see Notes), with PyTorch's random generator, and write
        the ``layout`` buffer from the operator's layout.

        With ``module.to_empty(device=...)`` after building on ``device="meta"`` (deferred
        initialisation, as for ``fully_shard``), this is the call that makes the layer usable:
        ``to_empty`` leaves the buffer's memory uninitialised too.
        """
        taps = math.prod(getattr(self.op, "kernel_size", ()))  # 1 for a product
        bounds = fan_in_bounds(self.op.layout, self.op.block_size, taps)
        with torch.no_grad():
            self.layout.copy_(torch.from_numpy(np.array(self.op.layout)))
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

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The operator, not the buffer, is what the weight was made for: a buffer edited in place
        # would save a layout that the weight does not fit, and the checkpoint would not load.
        layout = self.layout
        if layout.device.type != "meta" and not np.array_equal(layout.detach().cpu().numpy() != 0,
                                                                self.op.layout != 0):
            name = type(self).__name__
            raise RuntimeError(
                f"{prefix}layout no longer equals the layout this {name} computes with (layer.op.layout): it was "
                f"changed in place ({int(torch.count_nonzero(layout))} blocks against {self.op.blocks}), so its "
                f"weight would be saved with a layout it does not fit. Change a layer's layout with "
                f"bsmm.torch.dynamic.change_layout(layer, layout) (its weight's blocks move with it), "
                f"build a new {name} with the new layout, or restore the buffer with layer.reset_parameters() "
                f"(new weights) or layer.layout.copy_(torch.tensor(layer.op.layout))"
            )
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        saved = state_dict.get(prefix + "layout")
        name = type(self).__name__
        if saved is not None:
            saved = saved.detach().cpu()
            same_shape = tuple(saved.shape) == self.op.layout.shape
            moved = same_shape and not np.array_equal(saved.numpy() != 0, self.op.layout != 0)
            if moved and hasattr(self, "_adopt_layout") and int(torch.count_nonzero(saved)) == self.op.blocks \
                    and prefix + "weight" in state_dict:  # (without the weight, its slots would mean other blocks)
                # The same number of blocks elsewhere (a layout changed while training, bsmm.torch.dynamic):
                # the weight's shape fits, so the layer adopts the saved layout and loads into it.
                self._adopt_layout((saved.numpy() != 0).astype(np.uint8))
            elif not same_shape or moved:
                error_msgs.append(
                    f"{prefix}layout: the state_dict holds a layout of shape {tuple(saved.shape)} with "
                    f"{int(torch.count_nonzero(saved))} blocks, this {name} has shape "
                    f"{self.op.layout.shape} with {self.op.blocks} blocks"
                    + (" in other places" if same_shape and int(torch.count_nonzero(saved)) == self.op.blocks else "")
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
    layout : (C // block_size, K // block_size) array or tensor of 0/1, optional
        ``layout[c, k] != 0``: block ``(c, k)`` of ``W`` is present. Without it, ``density``
        draws one.
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
    activation : {None, "relu", "gelu", "gelu_tanh", "silu"}
        Applied to x·W + b inside the product's kernel, with the bias (:mod:`bsmm.epilogues`):
        the layer is then ``A(Linear(x))`` in one launch. ``"gelu"`` is ``F.gelu``'s default
        (erf), ``"gelu_tanh"`` its ``approximate="tanh"``. GELU and SiLU keep the
        pre-activation for the backward (one more output, written by the same kernel).
    density : float in [0, 1], keyword-only
        In place of ``layout``: a random layout with ``round(density × blocks)`` blocks
        (:func:`bsmm.layouts.random_layout`), drawn with ``seed`` (an int, a NumPy Generator or
        None). Both sizes must then be multiples of ``block_size``.

    Attributes
    ----------
    weight : Parameter (nnzb, block_size, block_size)
        The present blocks of ``W``, row-major over the layout (``op.w_shape``).
    bias : Parameter (out_features,) or None
    layout : buffer (C // block_size, K // block_size) uint8
        Saved in the ``state_dict``. Loading a state_dict whose layout has as many blocks
        elsewhere adopts it (a layout changed while training: :mod:`bsmm.torch.dynamic`); one of
        another shape or number of blocks raises (rebuild the layers first: :meth:`from_state_dict`,
        :func:`load_layouts`). The buffer records the layout: changing it in place does not change
        the layer, and ``state_dict()`` then raises rather than save a layout the weight does not
        fit (change a layout with :func:`bsmm.torch.dynamic.change_layout`).
    op : bsmm.BlocksparseMatMul
        The operator over the layout (``op.to_dense``, ``op.flops``, ...).

    Raises
    ------
    ValueError
        If ``in_features`` or ``out_features`` is not a multiple of ``block_size`` (the
        message names the nearest multiples: keep such a layer, a 10-class head or 784
        pixel inputs, as ``nn.Linear``), or does not match ``layout``'s shape.

    Notes
    -----
    As ``nn.Linear``: inputs of any strides (a non-contiguous one is copied first),
    ``device="meta"`` for deferred initialisation (forward and backward on meta tensors
    give shapes; ``layer.to_empty(device=...)`` then :meth:`reset_parameters` makes it
    usable, as ``fully_shard`` expects), ``torch.autocast``.

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

    def __init__(self, in_features: int, out_features: int, layout=None, block_size: int = 32, bias: bool = True,
                 feature_axis: int = 1, tf32: bool = False, device=None, dtype=None, activation: str | None = None,
                 *, density: float | None = None, seed=None):
        super().__init__()
        self.activation = None if activation in (None, "none") else check_activation(activation)
        if (layout is None) == (density is None):
            raise ValueError("pass a layout or a density (a random layout of that fraction of blocks), not "
                             f"{'both' if layout is not None else 'neither'}")
        if layout is None:
            for argument, value in (("in_features", in_features), ("out_features", out_features)):
                _check_multiple(argument, value, block_size)
            layout = random_layout(in_features // block_size, out_features // block_size, density, seed)
        elif seed is not None:
            raise ValueError("seed draws a layout of the given density: pass it with density=, not with a layout")
        self._build(lambda: BlocksparseMatMul(_layout_array(layout), block_size, feature_axis, tf32),
                    (("in_features", in_features, 0), ("out_features", out_features, 1)), bias, device, dtype)
        self.in_features, self.out_features = self.op.C, self.op.K
        self.feature_axis, self.tf32 = self.op.feature_axis, self.op.tf32
        self.gates = None  # per-block gates, given by bsmm.torch.gate_layer

    def __setstate__(self, state):
        super().__setstate__(state)
        if "gates" not in self.__dict__ and "gates" not in self._modules:  # pickled before gates existed
            self.gates = None
        # The registration unpickles under its layout's content key; a moving key would name the original's
        # layout (copy.deepcopy in one process), which moves with the original, not with this copy.
        self._key = self._registration.key

    def _adopt_layout(self, layout: np.ndarray, moving: bool = False) -> None:
        """Compute with ``layout`` from now on, a layout of as many blocks (the weight's slots are
        reordered by the caller: :func:`bsmm.torch.dynamic.change_layout`, ``load_state_dict``).

        A layer under a moving key (or any layer, with ``moving``: a change of :mod:`bsmm.torch.dynamic`)
        moves its key to the layout, so a compiled graph holding it needs no recompilation; another
        layer takes the layout's content key. Under CUDA graphs that ``torch.compile`` recorded, whose
        replays would launch the old layout's tables, the layer takes a new key either way (the model
        compiles and records again)."""
        op = BlocksparseMatMul(layout, self.op.block_size, self.feature_axis, self.tf32)
        if op.w_shape != self.op.w_shape:
            raise ValueError(f"layout must hold {self.op.blocks} blocks, as the layer's does (its weight's slots); "
                             f"got {op.blocks}")
        old = self._registration
        moving_now = is_moving(self._key)
        if not (moving or moving_now):
            registration = register(op.index)
        elif cuda_graphs_recorded():
            registration = moving_registration(op.index)
            old.retired = moving_now  # (a content key's registration may be another layer's too)
        else:
            registration = move(self._moving_registration(), op.index)
        self._use(op, registration)
        with torch.no_grad():
            self.layout.copy_(torch.from_numpy(np.array(op.layout)))

    def _moving_registration(self) -> Registration:
        """The layer's registration, moved to a moving key of its own on the first call (a model compiled
        before that compiles once more; :class:`bsmm.torch.DynamicSparsity` calls this when it is built)."""
        if not is_moving(self._key):
            self._use(self.op, moving_registration(self.op.index))
        return self._registration

    def _content_registration(self) -> None:
        """Back to the layout's content key (:meth:`bsmm.torch.DynamicSparsity.remove`), the moving
        registration retired."""
        if is_moving(self._key):
            self._registration.retired = True
            self._use(self.op)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., C) -> (..., K), or (C, ...) -> (K, ...) with feature_axis=0."""
        # The bias (cast to the product's dtype) and the activation are added in the kernel; y is a
        # tensor of its own, never a view (FSDP2 warns about module outputs that are views).
        weight = self.weight
        if self.gates is not None:  # y = x·(g ⊙ W) + b, a gate a block (bsmm.torch.gates)
            weight, cast = gated_weight_and_gate(weight, self.gates())
            # The kernels skip the closed blocks; dW's pass too where the gates' derivative is 0 there.
            return matmul_by_key(x, weight, self._key, self.in_features, self.out_features, self.feature_axis,
                                 self.tf32, self.bias, self.activation, cast,
                                 getattr(self.gates, "closed_gradient_is_zero", False))
        return matmul_by_key(x, weight, self._key, self.in_features, self.out_features, self.feature_axis,
                             self.tf32, self.bias, self.activation)

    def to_dense_weight(self) -> torch.Tensor:
        """Dense ``W`` (in_features, out_features), zero where blocks are absent; differentiable.

        ``nn.Linear`` stores the transpose: ``nn.Linear.weight`` equals ``to_dense_weight().T``.
        """
        return self._dense_blocks().permute(0, 2, 1, 3).reshape(self.in_features, self.out_features)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, layout=None, *, density: float | None = None,
                    block_size: int = 32, feature_axis: int = 1, tf32: bool = False) -> "BlockSparseLinear":
        """A layer computing what ``linear`` computes, with only some blocks of its weight kept.

        Parameters
        ----------
        linear : torch.nn.Linear (out_features × in_features weight)
            Both sizes multiples of ``block_size``. The new layer has its
            dtype, device and bias (copied); its weight blocks are copied exactly.
        layout : (in_features // block_size, out_features // block_size) array or tensor, optional
            The blocks to keep, in bsmm's ``W`` (in × out) orientation, which is
            the transpose of ``linear.weight``'s.
        density : float in [0, 1], optional
            Keep the ``round(density × blocks)`` blocks of largest Frobenius norm
            (magnitude pruning; :meth:`bsmm.BlockSparseMatrix.from_dense`). Equal
            norms keep the block earlier in row-major order over ``layout``, that
            is, of the lower input block, then the lower output block.
            With neither ``layout`` nor ``density``, the blocks holding a
            non-zero are kept (a weight pruned elsewhere, e.g. by ``torch.nn.utils.prune``).
        block_size, feature_axis, tf32
            As for :class:`BlockSparseLinear`.

        Raises
        ------
        TypeError
            If ``linear`` is not an ``nn.Linear``, or its dtype is not one bsmm runs on its device.
        ValueError
            If both ``layout`` and ``density`` are given, its sizes are not
            multiples of ``block_size``, ``layout`` has the wrong shape or
            ``density`` is out of range.

        Notes
        -----
        The ranking runs on a host copy of the weight (exact, in float32, or
        float64 for a float64 layer). The random number generators are left as they
        were. At density 1 the weight and bias are ``linear``'s exactly, and the
        outputs equal ``linear``'s up to the rounding of a different order of
        summation (bsmm's kernels against PyTorch's GEMM).

        Examples
        --------
        >>> import torch, bsmm.torch
        >>> linear = torch.nn.Linear(64, 32)
        >>> layer = bsmm.torch.BlockSparseLinear.from_linear(linear, density=0.5, block_size=16)
        >>> layer.op.blocks, layer.weight.dtype
        (4, torch.float32)
        >>> kept = layer.layout.bool().repeat_interleave(16, 0).repeat_interleave(16, 1)  # (64, 32)
        >>> torch.equal(layer.to_dense_weight(), torch.where(kept, linear.weight.T, 0))
        True
        >>> torch.equal(layer.to_linear().weight, torch.where(kept.T, linear.weight, 0))
        True
        """
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear; got {type(linear).__name__}")
        if layout is not None and density is not None:
            raise ValueError("give layout or density, not both")
        block_size = check_block_size(block_size)
        weight = linear.weight.detach()  # (out_features, in_features)
        blocks = (linear.in_features // block_size, linear.out_features // block_size)
        if linear.in_features % block_size or linear.out_features % block_size:
            raise ValueError(
                f"linear's in_features {linear.in_features} and out_features {linear.out_features} must be "
                f"multiples of block_size {block_size}; keep such a layer as torch.nn.Linear"
            )
        check_dtype(weight.dtype, weight.device, "linear.weight")
        if layout is None:
            layout = largest_blocks(weight, block_size, density)
        else:
            layout = _layout_array(layout)
            if layout.shape != blocks:
                raise ValueError(
                    f"layout must have shape (in_features // block_size, out_features // block_size) = {blocks}, "
                    f"the transpose of linear.weight's blocks; got {layout.shape}"
                )
        devices = [weight.device] if weight.device.type != "cpu" else []
        with torch.random.fork_rng(devices, device_type=weight.device.type):  # the draws of reset_parameters
            layer = cls(linear.in_features, linear.out_features, layout, block_size, linear.bias is not None,
                        feature_axis, tf32, weight.device, weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(present_blocks(weight, layer.op.index))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def to_sparse_bsr(self, *, copy: bool | None = None) -> torch.Tensor:
        """``W`` as a ``torch.sparse_bsr`` tensor (in_features, out_features), blocksize (bs, bs).

        bsmm's orientation: ``nn.Linear.weight`` is the transpose, (out_features,
        in_features). PyTorch transposes a BSR tensor into a BSC one: ``bsr.t()`` is
        ``nn.Linear``'s orientation as a ``torch.sparse_bsc`` view, and
        ``bsr.t().to_sparse_bsr((bs, bs))`` (or ``self.to_linear().weight.to_sparse_bsr((bs, bs))``)
        a BSR copy. ``values()`` is the ``weight`` itself (differentiable, sharing its
        memory) unless ``copy=True``. See :func:`bsmm.torch.to_sparse_bsr`.

        Examples
        --------
        >>> import numpy as np, torch, bsmm.torch
        >>> layer = bsmm.torch.BlockSparseLinear(32, 16, np.array([[1, 0], [1, 1], [0, 1], [0, 0]]), block_size=8)
        >>> bsr = layer.to_sparse_bsr()
        >>> bsr.layout, tuple(bsr.shape), bsr.crow_indices().tolist(), bsr.col_indices().tolist()
        (torch.sparse_bsr, (32, 16), [0, 1, 3, 4, 4], [0, 0, 1, 1])
        >>> torch.equal(bsr.to_dense(), layer.to_dense_weight())
        True
        >>> torch.equal(bsr.t().to_dense(), layer.to_linear().weight)  # nn.Linear's (out, in), as BSC
        True
        """
        return weight_bsr(self.op.index, self.weight, copy)

    @classmethod
    def from_state_dict(cls, state_dict, prefix: str = "", *, feature_axis: int = 1, tf32: bool = False,
                        device=None, dtype=None, activation: str | None = None) -> "BlockSparseLinear":
        """A layer of the layout saved in ``state_dict``, holding its weight and bias.

        Sizes, layout, block size and bias presence come from ``state_dict``'s
        ``{prefix}layout``, ``{prefix}weight`` (nnzb, bs, bs) and ``{prefix}bias``;
        what a state_dict does not hold is given as for :class:`BlockSparseLinear`.
        ``device`` and ``dtype`` default to the saved weight's. The tensors are
        copied; no random numbers are drawn. For whole models see :func:`load_layouts`.

        Raises
        ------
        KeyError
            If ``state_dict`` has no ``{prefix}layout`` or ``{prefix}weight``.
        RuntimeError
            If the saved weight does not fit the saved layout (``load_state_dict``'s error).

        Examples
        --------
        >>> import numpy as np, torch, bsmm.torch
        >>> saved = bsmm.torch.BlockSparseLinear(64, 32, np.array([[1], [0]]), block_size=32).state_dict()
        >>> layer = bsmm.torch.BlockSparseLinear.from_state_dict(saved)
        >>> layer
        BlockSparseLinear(in_features=64, out_features=32, block_size=32, blocks=1, density=0.5, bias=True)
        >>> torch.equal(layer.weight, saved["weight"])
        True
        """
        for name in ("layout", "weight"):
            if prefix + name not in state_dict:
                raise KeyError(f"state_dict has no {prefix + name!r}, which a {cls.__name__} saves; "
                               f"pass the prefix of the layer's keys (prefix={prefix!r} now)")
        layout, weight = state_dict[prefix + "layout"], state_dict[prefix + "weight"]
        block_size = weight.shape[-1]
        rows, cols = tuple(layout.shape)
        # Built on the meta device, so that reset_parameters draws nothing and allocates nothing twice.
        layer = cls(rows * block_size, cols * block_size, layout, block_size, prefix + "bias" in state_dict,
                    feature_axis, tf32, "meta", weight.dtype if dtype is None else dtype, activation)
        layer.to_empty(device=weight.device if device is None else device)
        layer.load_state_dict({name[len(prefix):]: value for name, value in state_dict.items()
                               if name.startswith(prefix) and "." not in name[len(prefix):]})
        return layer

    def to_linear(self) -> torch.nn.Linear:
        """An ``nn.Linear`` with this layer's dense weight (zeros where blocks are absent) and bias.

        Of this layer's dtype and device; a copy, not linked to this layer. The
        ``nn.Linear`` takes features last whatever this layer's ``feature_axis``.
        See :meth:`from_linear` for an example.
        """
        linear = torch.nn.utils.skip_init(torch.nn.Linear, self.in_features, self.out_features,
                                          bias=self.bias is not None, device=self.weight.device,
                                          dtype=self.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.to_dense_weight().T)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def extra_repr(self) -> str:
        text = (
            f"in_features={self.in_features}, out_features={self.out_features}, block_size={self.op.block_size}, "
            f"blocks={self.op.blocks}, density={self.op.density:.3g}, bias={self.bias is not None}"
        )
        if self.feature_axis != 1:
            text += f", feature_axis={self.feature_axis}"
        if self.activation is not None:
            text += f", activation={self.activation!r}"
        return text + (", tf32=True" if self.tf32 else "")


def load_layouts(model: torch.nn.Module, state_dict) -> torch.nn.Module:
    """Rebuild each :class:`BlockSparseLinear` of ``model`` whose layout differs from the one
    saved in ``state_dict``, so that ``model.load_state_dict(state_dict)`` then succeeds.

    A layer is replaced by one of its class built with :meth:`BlockSparseLinear.from_state_dict`:
    the saved layout, block size, weight and bias, and the layer's own ``feature_axis``,
    ``tf32``, ``activation``, device, dtype, training mode and ``requires_grad`` flags.
    Layers whose saved layout equals theirs, or that ``state_dict`` does not hold, are kept.
    The new layers are new modules: hooks on the old ones, and an optimizer built over
    the old parameters, do not carry over (build the optimizer after loading).

    Parameters
    ----------
    model : torch.nn.Module
        Changed in place; if ``model`` itself is a ``BlockSparseLinear`` to rebuild, the
        new layer is returned instead.
    state_dict : mapping
        ``model.state_dict()`` of a model of the same structure, other layouts allowed.

    Returns
    -------
    torch.nn.Module
        ``model``, or the layer that replaces it.

    Raises
    ------
    ValueError
        If a saved layer's feature counts differ from the layer it would replace (the
        model around it expects the same sizes).

    Examples
    --------
    >>> import numpy as np, torch, bsmm.torch
    >>> def model(first, second):
    ...     return torch.nn.Sequential(bsmm.torch.BlockSparseLinear(64, 64, first, block_size=32), torch.nn.ReLU(),
    ...                                bsmm.torch.BlockSparseLinear(64, 32, second, block_size=32))
    >>> saved = model(np.eye(2), np.array([[1], [0]])).state_dict()
    >>> fresh = model(np.ones((2, 2)), np.array([[1], [0]]))
    >>> fresh = bsmm.torch.load_layouts(fresh, saved)
    >>> fresh.load_state_dict(saved)
    <All keys matched successfully>
    >>> fresh[0].layout.tolist(), fresh[2].layout.tolist()
    ([[1, 0], [0, 1]], [[1], [0]])
    """
    replacements = []
    for name, module in model.named_modules():
        prefix = name + "." if name else ""
        saved = state_dict.get(prefix + "layout")
        if not isinstance(module, BlockSparseLinear) or saved is None:
            continue
        saved = saved.detach().cpu().numpy()
        if saved.shape == module.op.layout.shape and np.array_equal(saved != 0, module.op.layout != 0):
            continue
        layer = type(module).from_state_dict(state_dict, prefix, feature_axis=module.feature_axis, tf32=module.tf32,
                                             device=module.weight.device, dtype=module.weight.dtype,
                                             activation=module.activation)
        if (layer.in_features, layer.out_features) != (module.in_features, module.out_features):
            raise ValueError(
                f"{prefix}layout: the state_dict's layer maps {layer.in_features} to {layer.out_features} features, "
                f"the model's {module.in_features} to {module.out_features}; load_layouts changes layouts, not sizes"
            )
        layer.train(module.training)
        for new, old in zip(layer.parameters(), module.parameters()):
            new.requires_grad_(old.requires_grad)
        replacements.append((name, layer))
    return replace_modules(model, replacements)  # after the walk: named_modules must not see a changing tree


def replace_modules(model: torch.nn.Module, replacements) -> torch.nn.Module:
    """``model`` with the submodule named by each ``(name, module)`` of ``replacements`` set to ``module``;
    the name ``""`` is the model itself, whose replacement is returned instead."""
    for name, module in replacements:
        if not name:
            return module
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)
    return model


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
        y = conv_by_key(last if channels_last else x.contiguous(), self.weight, self._key, self._specs[channels_last],
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

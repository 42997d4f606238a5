"""``BlocksparseConv``: a convolution whose channel connectivity is block-sparse.

Every kernel offset has its own block-sparse ``C × K`` matrix, all of one layout;
the spatial kernel is dense. This module holds the operator: its arguments, shapes,
weights and the checks of its three passes; :mod:`bsmm.nn.conv_passes` runs the
passes on the canvas of :mod:`bsmm.nn.conv_geometry`.
"""

from __future__ import annotations

import math

import numpy as np

from bsmm import initializers
from bsmm.arrays import Operand, array_module, as_operand, check_same_place, output_array
from bsmm.backends import for_operand
from bsmm.block_index import BlockIndex
from bsmm.dtypes import canonical_dtype
from bsmm.layouts.checks import as_generator
from bsmm.matmul import BlocksparseMatMul, blocks_to_dense, dense_to_blocks
from bsmm.nn.conv_geometry import ConvGeometry, conv_geometry, padding_tuple, spatial_tuple
from bsmm.nn.conv_passes import ConvPasses

__all__ = ["BlocksparseConv"]

_AXIS_NAMES = {1: ("L",), 2: ("H", "W"), 3: ("D", "H", "W")}

class BlocksparseConv:
    """A convolution ``y = conv(x, W)`` whose ``C × K`` channel matrix is block-sparse.

    ``y[n, o, :] = sum over kernel offsets k of x_pad[n, o·stride + k·dilation, :] · W[k]``,
    each ``W[k]`` (C, K) block-sparse with the one ``layout``; 1-D, 2-D or 3-D.

    Parameters
    ----------
    layout : (C // block_size, K // block_size) array of 0/1
        ``layout[c, k] != 0``: block ``(c, k)`` connects those input and output channels.
    block_size : int or None
        8, 16, 32, 64 or 128; None takes ``bsmm.toml``'s default (32).
    kernel_size : int or tuple of 1 to 3 ints
        Its length is the spatial rank; an int means a square 2-D kernel.
    stride, dilation : int or tuple, default 1
    padding : int, tuple, "valid" or "same", default 0
        Zeros on both sides of each spatial dimension ("same": stride 1, odd dilated kernel).
    channels_last : bool, default True
        True: ``x`` is (N, *spatial, C) and ``y`` (N, *out, K), the copy-saving layout.
        False: (N, C, *spatial) and (N, K, *out).
    tf32 : bool, optional
        On the GPU, float32 on TF32 tensor cores; default from ``bsmm.toml``.

    Notes
    -----
    Weights ``w`` have shape :attr:`w_shape` = ``(*kernel_size, nnzb, bs, bs)``: per kernel
    offset, the present blocks in the layout's storage order (as :class:`bsmm.BlocksparseMatMul`).
    :attr:`passes` (:class:`~bsmm.nn.conv_passes.ConvPasses`) runs the passes and keeps
    what they reuse between calls.

    *Memory.* Each pass works on the canvas (:mod:`bsmm.nn.conv_geometry`): the padded
    input, split by phase along strided outer dimensions, about ``N·ΠP_i·C``
    elements, made by one copy of the input, or none (channels last, no padding,
    stride only on the last dimension dividing it). Results are computed on a
    grid of about ``N·Π(P_i / s_i)`` rows, which the output is cropped from by one
    copy unless they coincide. Over-computed rows cost ``Π P_i/(P_i - d_i(k_i-1))``
    in time (1.07 for 3×3 on 56×56 with padding 1). Per pass:

    - fprop: canvas of x (copy), grid of y (cropped into y, copy);
    - bprop: dy on the grid (copy, zeros elsewhere), the canvas of dx, gathered
      into dx (copy);
    - updat: canvas of x and dy on the grid, as above; dW written in place.

    Each channels-last copy is one row gather (:mod:`bsmm.nn.row_maps`).
    Channels-first arrays are transposed by those same copies, so where channels
    last needs none, channels first makes one per operand.

    *Launches.* fprop and updat are one launch over every kernel offset; bprop is one
    launch per residue of the offsets' shifts modulo the last stride (one with stride 1,
    two for a 3-wide kernel with stride 2), each writing its own rows of the canvas.

    *Precision.* Results are summed over all offsets in float32 and rounded once.
    float64 runs on the CPU only.

    Examples
    --------
    >>> import numpy as np
    >>> from bsmm.nn.conv import BlocksparseConv
    >>> conv = BlocksparseConv(np.array([[1, 0], [1, 1]]), block_size=8, kernel_size=(3, 3), padding=1)
    >>> conv.w_shape, conv.output_shape((2, 5, 5, 16))
    ((3, 3, 3, 8, 8), (2, 5, 5, 16))
    >>> w = conv.normal_init(seed=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 5, 16)).astype(np.float32)
    >>> y = conv(x, w)
    >>> dense = conv.to_dense(w)  # (3, 3, C, K)
    >>> x_pad = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    >>> ref = sum(x_pad[:, i:i + 5, j:j + 5] @ dense[i, j] for i in range(3) for j in range(3))
    >>> bool(np.allclose(y, ref, atol=1e-4))
    True
    >>> dx = conv.bprop(np.ones_like(y), w, x_shape=x.shape)
    >>> dw = conv.updat(x, np.ones_like(y))
    >>> dx.shape, dw.shape
    ((2, 5, 5, 16), (3, 3, 3, 8, 8))
    """

    def __init__(self, layout, block_size, kernel_size, stride=1, padding=0, dilation=1, channels_last: bool = True,
                 tf32: bool | None = None):
        self.matmul = BlocksparseMatMul(layout, block_size, feature_axis=1, tf32=tf32)
        self._configure(kernel_size, stride, padding, dilation, channels_last)

    @classmethod
    def from_index(cls, index: BlockIndex, kernel_size, stride=1, padding=0, dilation=1,
                   channels_last: bool = True, tf32: bool | None = None):
        """A convolution over an already-validated :class:`BlockIndex` (the layout is not checked again)."""
        conv = cls.__new__(cls)
        conv.matmul = BlocksparseMatMul.from_index(index, feature_axis=1, tf32=tf32)
        conv._configure(kernel_size, stride, padding, dilation, channels_last)
        return conv

    def _configure(self, kernel_size, stride, padding, dilation, channels_last) -> None:
        if isinstance(kernel_size, (int, np.integer)) and not isinstance(kernel_size, bool):
            kernel_size = (kernel_size, kernel_size)
        dims = len(kernel_size) if isinstance(kernel_size, (tuple, list)) else 0
        if dims not in (1, 2, 3):
            raise ValueError(f"kernel_size must be an int or a tuple of 1, 2 or 3 ints; got {kernel_size!r}")
        self.kernel_size = spatial_tuple(kernel_size, "kernel_size", dims, 1)
        self.stride = spatial_tuple(stride, "stride", dims, 1)
        self.dilation = spatial_tuple(dilation, "dilation", dims, 1)
        self.padding = padding_tuple(padding, self.kernel_size, self.stride, self.dilation)
        if not isinstance(channels_last, (bool, np.bool_)):
            raise TypeError(f"channels_last must be True or False; got {channels_last!r}")
        self.channels_last = bool(channels_last)
        self.passes = ConvPasses(self.matmul, self.kernel_size, self.stride, self.channels_last)

    # -- the layout and shapes -------------------------------------------------------------
    @property
    def index(self) -> BlockIndex:
        return self.matmul.index

    @property
    def layout(self) -> np.ndarray:
        """(CB, KB) uint8, read-only."""
        return self.matmul.layout

    @property
    def block_size(self) -> int:
        return self.matmul.block_size

    @property
    def C(self) -> int:
        """Input channels."""
        return self.matmul.C

    @property
    def K(self) -> int:
        """Output channels."""
        return self.matmul.K

    @property
    def blocks(self) -> int:
        """Present blocks per kernel offset, ``nnzb``."""
        return self.matmul.blocks

    @property
    def density(self) -> float:
        return self.matmul.density

    @property
    def tf32(self) -> bool:
        return self.matmul.tf32

    @property
    def ndim(self) -> int:
        """Spatial dimensions: 1, 2 or 3."""
        return len(self.kernel_size)

    @property
    def w_shape(self) -> tuple:
        """``(*kernel_size, nnzb, bs, bs)``."""
        return self.kernel_size + self.index.w_shape

    def array_shape(self, batch: int, spatial: tuple, channels) -> tuple:
        """The shape of an activation array of this convolution's layout: ``(batch, *spatial,
        channels)`` channels last, else ``(batch, channels, *spatial)``."""
        return (batch, *spatial, channels) if self.channels_last else (batch, channels, *spatial)

    def _shape_text(self) -> str:
        return "(" + ", ".join(map(str, self.array_shape("N", _AXIS_NAMES[self.ndim], self.C))) + ")"

    def geometry(self, shape: tuple, argument: str = "x") -> ConvGeometry:
        """The geometry (:class:`bsmm.nn.conv_geometry.ConvGeometry`) of an input of ``shape``,
        or ``ValueError`` naming ``argument`` where the shape does not fit this convolution."""
        channel_axis = -1 if self.channels_last else 1
        if len(shape) != self.ndim + 2 or shape[channel_axis] != self.C:
            layout = "channels last" if self.channels_last else "channels first"
            raise ValueError(
                f"{argument} must have shape {self._shape_text()} ({layout}) for this {self.ndim}-D convolution; "
                f"got {tuple(shape)}"
            )
        spatial = shape[1:-1] if self.channels_last else shape[2:]
        try:
            return conv_geometry(shape[0], spatial, self.C, self.kernel_size, self.stride, self.padding,
                                 self.dilation)
        except ValueError as error:
            raise ValueError(f"{argument} of shape {tuple(shape)}: {error}") from None

    def output_shape(self, input_shape) -> tuple:
        """Shape of ``y`` for an ``x`` of ``input_shape`` (both in this convolution's channel layout)."""
        shape = tuple(int(v) for v in input_shape)
        geometry = self.geometry(shape, "input_shape")
        return self.array_shape(geometry.batch, geometry.out, self.K)

    def flops(self, input_shape) -> int:
        """Useful floating-point operations of one pass: 2 · N · ΠO · Πkernel · nnzb · bs²."""
        shape = tuple(int(v) for v in input_shape)
        geometry = self.geometry(shape, "input_shape")
        return 2 * geometry.batch * math.prod(geometry.out) * math.prod(self.kernel_size) * self.blocks \
            * self.block_size**2

    # -- weights --------------------------------------------------------------------------------
    def to_dense(self, w):
        """Dense weights ``(*kernel_size, C, K)`` of block data ``w`` (NumPy or CuPy); absent blocks are 0."""
        w_op = as_operand(w, "w")
        self._check_weights(w_op, canonical_dtype(w_op.array.dtype, "w", w_op.backend))
        xp = array_module(w_op.array)
        per_offset = w_op.array.reshape((math.prod(self.kernel_size),) + self.index.w_shape)
        dense = xp.stack([blocks_to_dense(self.index, blocks) for blocks in per_offset])
        return w_op.wrap(dense.reshape(self.kernel_size + (self.C, self.K)))

    def from_dense(self, dense):
        """Block data :attr:`w_shape` of the present blocks of dense weights ``(*kernel_size, C, K)``."""
        expected = self.kernel_size + (self.C, self.K)
        if tuple(getattr(dense, "shape", ())) != expected:
            raise ValueError(f"dense must have shape {expected}; got {getattr(dense, 'shape', None)}")
        xp = array_module(dense)
        per_offset = dense.reshape((math.prod(self.kernel_size), self.C, self.K))
        blocks = xp.stack([dense_to_blocks(self.index, matrix) for matrix in per_offset])
        return blocks.reshape(self.w_shape)

    def normal_init(self, scale: float = 1.0, dtype=np.float32, seed=None) -> np.ndarray:
        """Gaussian block data, std = scale / sqrt(fan-in), the fan-in of an output channel
        counting its present blocks times the kernel volume (:func:`bsmm.initializers.normal`)."""
        volume = math.prod(self.kernel_size)
        rng = as_generator(seed)
        data = [initializers.normal(self.layout, self.block_size, scale / math.sqrt(volume), dtype, rng)
                for _ in range(volume)]
        return np.stack(data).reshape(self.w_shape)

    # -- the three passes --------------------------------------------------------------------
    def __call__(self, x, w, out=None):
        """Same as :meth:`fprop`."""
        return self.fprop(x, w, out=out)

    def fprop(self, x, w, out=None):
        """y = conv(x, W).

        Parameters
        ----------
        x : (N, *spatial, C) array, or (N, C, *spatial) with ``channels_last=False``
            C-contiguous, float32, float16 or bfloat16 (float64 on the CPU).
        w : :attr:`w_shape` array of x's dtype, library and device
        out : array of :meth:`output_shape`, optional
            Written in place and returned.

        Returns
        -------
        y : (N, *out, K) or (N, K, *out), x's dtype and library
        """
        x_op, w_op = as_operand(x, "x"), as_operand(w, "w")
        geometry = self.geometry(tuple(x_op.array.shape), "x")
        dtype = self._check_operands({"x": x_op, "w": w_op})
        y = output_array(out, x_op, self.array_shape(geometry.batch, geometry.out, self.K), dtype, (x_op, w_op))
        self.passes.fprop(for_operand(x_op), x_op.array, w_op.array, y, geometry)
        return out if out is not None else x_op.wrap(y)

    def bprop(self, dy, w, x_shape, out=None):
        """dx, the gradient of ``sum(dy · conv(x, W))`` with respect to ``x``.

        Parameters
        ----------
        dy : array of ``output_shape(x_shape)``
        w : :attr:`w_shape` array of dy's dtype
        x_shape : tuple of ints
            The input's shape: with a stride, several input sizes give ``dy``'s size.
        out : array of ``x_shape``, optional

        Returns
        -------
        dx : array of ``x_shape``, dy's dtype and library
        """
        dy_op, w_op = as_operand(dy, "dy"), as_operand(w, "w")
        x_shape = self._checked_x_shape(x_shape)
        geometry = self.geometry(x_shape, "x_shape")
        self._check_output_gradient(dy_op, geometry, f"x_shape {x_shape}")
        dtype = self._check_operands({"dy": dy_op, "w": w_op})
        dx = output_array(out, dy_op, x_shape, dtype, (dy_op, w_op))
        self.passes.bprop(for_operand(dy_op), dy_op.array, w_op.array, dx, geometry)
        return out if out is not None else dy_op.wrap(dx)

    def updat(self, x, dy, out=None, accumulate: bool = False):
        """dW, the gradient of ``sum(dy · conv(x, W))`` with respect to the present blocks.

        Parameters
        ----------
        x : input array, as for :meth:`fprop`
        dy : array of ``output_shape(x.shape)``, x's dtype
        out : :attr:`w_shape` array, optional
            Written in place and returned.
        accumulate : bool
            Add to ``out`` (needs ``out``) instead of overwriting it.

        Returns
        -------
        dw : :attr:`w_shape`, x's dtype and library
        """
        x_op, dy_op = as_operand(x, "x"), as_operand(dy, "dy")
        geometry = self.geometry(tuple(x_op.array.shape), "x")
        self._check_output_gradient(dy_op, geometry, f"x of shape {tuple(x_op.array.shape)}")
        dtype = self._check_operands({"x": x_op, "dy": dy_op})
        if accumulate and out is None:
            raise ValueError("accumulate=True needs out=, the buffer to add the gradient to")
        dw = output_array(out, x_op, self.w_shape, dtype, (x_op, dy_op))
        self.passes.updat(for_operand(x_op), x_op.array, dy_op.array, dw, geometry, accumulate)
        return out if out is not None else x_op.wrap(dw)

    # -- checks -----------------------------------------------------------------------------
    def _check_operands(self, operands: dict[str, Operand]) -> np.dtype:
        """The common dtype of the operands (activations first, weights last), or raise naming one."""
        (first_name, first), *_ = operands.items()
        dtype = canonical_dtype(first.array.dtype, first_name, first.backend)
        for name, operand in operands.items():
            if operand.array.dtype != dtype:
                raise TypeError(f"{name} has dtype {operand.array.dtype} but {first_name} has {dtype}; pass one dtype")
            if not operand.array.flags.c_contiguous:
                raise ValueError(f"{name} must be C-contiguous; got strides {operand.array.strides}")
        if "w" in operands:
            self._check_weights(operands["w"], dtype)
        check_same_place(operands)
        return dtype

    def _check_weights(self, operand: Operand, dtype) -> None:
        if tuple(operand.array.shape) != self.w_shape:
            raise ValueError(f"w must have shape w_shape {self.w_shape}; got {tuple(operand.array.shape)}")
        if operand.array.dtype != dtype:
            raise TypeError(f"w has dtype {operand.array.dtype} but the activations have {dtype}; pass one dtype")

    def _check_output_gradient(self, dy: Operand, geometry: ConvGeometry, source: str) -> None:
        expected = self.array_shape(geometry.batch, geometry.out, self.K)
        if tuple(dy.array.shape) != expected:
            raise ValueError(f"dy must have shape {expected}, the output shape for {source}; "
                             f"got {tuple(dy.array.shape)}")

    def _checked_x_shape(self, x_shape) -> tuple:
        try:
            shape = tuple(x_shape)
        except TypeError:
            raise TypeError(f"x_shape must be a tuple of ints; got {x_shape!r}") from None
        if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0 for v in shape):
            raise TypeError(f"x_shape must be a tuple of ints >= 0; got {x_shape!r}")
        return tuple(int(v) for v in shape)

    # -- identity, pickling -------------------------------------------------------------------
    def __reduce__(self):
        return (type(self), (np.array(self.layout), self.block_size, self.kernel_size, self.stride, self.padding,
                             self.dilation, self.channels_last, self.tf32))

    def __repr__(self) -> str:
        return (
            f"BlocksparseConv(C={self.C}, K={self.K}, block_size={self.block_size}, blocks={self.blocks}, "
            f"density={self.density:.3g}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}, channels_last={self.channels_last})"
        )

"""``BlocksparseConv``: a convolution whose channel connectivity is block-sparse.

Every kernel offset has its own block-sparse ``C × K`` matrix, all of one layout;
the spatial kernel is dense. The three passes are implicit GEMMs over shifted rows
of one padded copy of the input (the *canvas*, :mod:`bsmm.nn.conv_geometry`): the
offsets are blocks of one stacked layout whose blocks read their own shift
(``shifted_pass``, :mod:`bsmm.backends.strided`), never an im2col. Everything but those
calls is the same code for NumPy (CPU backend) and CuPy (GPU kernels), so the CPU
tests cover the index arithmetic.
"""

from __future__ import annotations

import math

import numpy as np

from bsmm import initializers
from bsmm.nn import row_maps
from bsmm.arrays import Operand, array_module, as_operand, check_same_place, output_array
from bsmm.backends import for_operand
from bsmm.block_index import BlockIndex, block_index
from bsmm.nn.conv_geometry import ConvGeometry, conv_geometry
from bsmm.dtypes import canonical_dtype
from bsmm.layouts.checks import as_generator
from bsmm.matmul import BlocksparseMatMul, blocks_to_dense, dense_to_blocks
from bsmm.backends.strided import BlockOrder

__all__ = ["BlocksparseConv"]

# Copies and zero fills move bits: one code path for every dtype, bfloat16 on CuPy included.
_BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_AXIS_NAMES = {1: ("L",), 2: ("H", "W"), 3: ("D", "H", "W")}


def _bits(array):
    return array.view(_BITS[array.dtype.itemsize])


def _rows(array, width: int):
    """The bits of a C-contiguous array as rows of ``width`` elements (what gather_rows moves)."""
    return _bits(array).reshape(-1, width)


def _zeros(xp, shape: tuple, dtype):
    return xp.zeros(shape, dtype=_BITS[np.dtype(dtype).itemsize]).view(dtype)


def _empty(xp, shape: tuple, dtype):
    return xp.empty(shape, dtype=_BITS[np.dtype(dtype).itemsize]).view(dtype)


def _spatial_tuple(value, name: str, dims: int, minimum: int) -> tuple:
    """``value`` (int or sequence of ints) as a tuple of ``dims`` ints >= ``minimum``, or raise naming it."""
    values = (value,) * dims if isinstance(value, (int, np.integer)) else value
    try:
        values = tuple(values)
    except TypeError:
        raise TypeError(f"{name} must be an int or a tuple of {dims} ints; got {value!r}") from None
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in values):
        raise TypeError(f"{name} must be an int or a tuple of {dims} ints; got {value!r}")
    if len(values) != dims:
        raise ValueError(f"{name} must have {dims} entries, one per spatial dimension of kernel_size; got {value!r}")
    if any(v < minimum for v in values):
        raise ValueError(f"{name} must be >= {minimum}; got {value!r}")
    return tuple(int(v) for v in values)


def _padding(padding, kernel: tuple, stride: tuple, dilation: tuple) -> tuple:
    if isinstance(padding, str):
        if padding == "valid":
            return (0,) * len(kernel)
        if padding != "same":
            raise ValueError(f"padding must be an int, a tuple, 'valid' or 'same'; got {padding!r}")
        if any(s != 1 for s in stride):
            raise ValueError(f"padding='same' needs stride 1; got stride {stride}")
        reach = [d * (k - 1) for k, d in zip(kernel, dilation)]
        if any(r % 2 for r in reach):
            raise NotImplementedError(
                f"padding='same' with an even dilated kernel ({reach} beyond one element) needs asymmetric "
                f"padding; pad the input yourself or pick an odd kernel"
            )
        return tuple(r // 2 for r in reach)
    return _spatial_tuple(padding, "padding", len(kernel), 0)


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

    Weights ``w`` have shape :attr:`w_shape` = ``(*kernel_size, nnzb, bs, bs)``: per kernel
    offset, the present blocks in the layout's storage order (as :class:`bsmm.BlocksparseMatMul`).

    Notes
    -----
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
        self.kernel_size = _spatial_tuple(kernel_size, "kernel_size", dims, 1)
        self.stride = _spatial_tuple(stride, "stride", dims, 1)
        self.dilation = _spatial_tuple(dilation, "dilation", dims, 1)
        self.padding = _padding(padding, self.kernel_size, self.stride, self.dilation)
        if not isinstance(channels_last, (bool, np.bool_)):
            raise TypeError(f"channels_last must be True or False; got {channels_last!r}")
        self.channels_last = bool(channels_last)

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

    def _shape(self, batch: int, spatial: tuple, channels) -> tuple:
        return (batch, *spatial, channels) if self.channels_last else (batch, channels, *spatial)

    def _shape_text(self) -> str:
        return "(" + ", ".join(map(str, self._shape("N", _AXIS_NAMES[self.ndim], self.C))) + ")"

    def _geometry(self, shape: tuple, argument: str) -> ConvGeometry:
        """The geometry for an input of ``shape``, or raise naming ``argument``."""
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
        geometry = self._geometry(shape, "input_shape")
        return self._shape(geometry.batch, geometry.out, self.K)

    def flops(self, input_shape) -> int:
        """Useful floating-point operations of one pass: 2 · N · ΠO · Πkernel · nnzb · bs²."""
        shape = tuple(int(v) for v in input_shape)
        geometry = self._geometry(shape, "input_shape")
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
        geometry = self._geometry(tuple(x_op.array.shape), "x")
        dtype = self._check_operands({"x": x_op, "w": w_op})
        y = output_array(out, x_op, self._shape(geometry.batch, geometry.out, self.K), dtype, (x_op, w_op))
        xp, backend = array_module(y), for_operand(x_op)
        if geometry.rows == 0 or self.blocks == 0:
            _bits(y)[...] = 0
            return out if out is not None else x_op.wrap(y)
        canvas = self._canvas(xp, backend, x_op.array, geometry)
        direct = geometry.grid_is_output and self.channels_last
        grid = y if direct else _empty(xp, (geometry.batch, *geometry.grid, self.K), dtype)
        # One launch for every kernel offset: the offsets are block rows of one stacked layout
        # whose blocks read the canvas at their offset's shift (no output re-read per offset).
        backend.shifted_pass("fprop", self._stacked_index, canvas, w_op.array.reshape(-1), grid.reshape(-1),
                             geometry.rows, (geometry.row_stride, self.K), self._shifted_blocks(geometry),
                             tf32=self.tf32)
        if not direct and self.channels_last:
            backend.gather_rows(_rows(y, self.K), _rows(grid, self.K),
                                self._row_map("crop", geometry, row_maps.crop_rows))
        elif not direct:
            _bits(self._channels_last(y))[...] = _bits(grid)[geometry.crop]
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
        geometry = self._geometry(x_shape, "x_shape")
        self._check_output_gradient(dy_op, geometry, f"x_shape {x_shape}")
        dtype = self._check_operands({"dy": dy_op, "w": w_op})
        dx = output_array(out, dy_op, x_shape, dtype, (dy_op, w_op))
        xp, backend = array_module(dx), for_operand(dy_op)
        if geometry.rows == 0 or self.blocks == 0:
            _bits(dx)[...] = 0
            return out if out is not None else dy_op.wrap(dx)
        direct = not geometry.copies_input and self.channels_last
        # Offset k adds dy grid row r times W_kᵀ into canvas row shift_k / C + r·s (s: the last
        # stride). Canvas rows of one residue φ mod s are then a stride-1 bprop over the
        # offsets of that residue, side by side: row φ + q·s sums dy row q - e_k, e_k =
        # (shift_k / C) // s. dy sits ``lead`` = max e_k zero rows into its buffer so every
        # read lands inside it; each residue is one launch writing all its rows.
        step, canvas_rows = self.stride[-1], math.prod(geometry.canvas_shape[:-1])
        lead, launches = self._bprop_launches(geometry)
        dy_rows = self._on_grid(xp, backend, dy_op.array, geometry, lead, lead + -(-canvas_rows // step))
        canvas = dx if direct else _empty(xp, geometry.canvas_shape, dtype)
        if len(launches) < step:  # rows no offset reaches (a kernel narrower than the stride)
            _bits(canvas)[...] = 0
        flat = canvas.reshape(-1)
        for residue, index, order, blocks in launches:
            backend.shifted_pass("bprop", index, dy_rows, w_op.array.reshape(-1), flat[residue * self.C:],
                                 -(-(canvas_rows - residue) // step), (self.K, step * self.C), blocks,
                                 tf32=self.tf32, weight_blocks=order)
        if not direct and self.channels_last:
            backend.gather_rows(_rows(dx, self.C), _rows(canvas, self.C),
                                self._row_map("input", geometry, row_maps.input_rows))
        elif not direct:
            target, source = _bits(self._channels_last(dx)), _bits(canvas)
            for dst, src in geometry.slices:
                target[src] = source[dst]
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
        geometry = self._geometry(tuple(x_op.array.shape), "x")
        self._check_output_gradient(dy_op, geometry, f"x of shape {tuple(x_op.array.shape)}")
        dtype = self._check_operands({"x": x_op, "dy": dy_op})
        if accumulate and out is None:
            raise ValueError("accumulate=True needs out=, the buffer to add the gradient to")
        dw = output_array(out, x_op, self.w_shape, dtype, (x_op, dy_op))
        xp, backend = array_module(dw), for_operand(x_op)
        if geometry.rows == 0 or self.blocks == 0:
            if not accumulate:
                _bits(dw)[...] = 0
            return out if out is not None else x_op.wrap(dw)
        canvas = self._canvas(xp, backend, x_op.array, geometry)
        dy_rows = self._on_grid(xp, backend, dy_op.array, geometry)
        # Every offset's gradient in one launch over the stacked layout (see fprop).
        backend.shifted_pass("updat", self._stacked_index, canvas, dy_rows, dw.reshape(-1), geometry.rows,
                             (geometry.row_stride, self.K), self._shifted_blocks(geometry),
                             accumulate=bool(accumulate), tf32=self.tf32)
        return out if out is not None else x_op.wrap(dw)

    # -- layout changes shared by the passes -----------------------------------------------------
    def _channels_last(self, array):
        """A channels-last view of an activation array of this convolution's layout."""
        if self.channels_last:
            return array
        return array.transpose(0, *range(2, array.ndim), 1)

    @property
    def _stacked_index(self) -> BlockIndex:
        """The layout repeated once per kernel offset along C: its blocks in storage order are
        exactly ``w``'s (offset-major, then the layout's row-major order)."""
        stacked = self.__dict__.get("_stacked")
        if stacked is None:
            stacked = self.__dict__["_stacked"] = block_index(
                np.tile(self.layout, (math.prod(self.kernel_size), 1)), self.block_size)
        return stacked

    def _shifted_blocks(self, geometry: ConvGeometry) -> tuple:
        """Where block row (offset k, c) of the stacked layout reads the canvas: block
        shift_k / bs + c of a row (every shift is a whole number of channel vectors)."""
        cached = self.__dict__.setdefault("_shifted", {})
        blocks = cached.get(geometry.shifts)
        if blocks is None:
            per_row = self.C // self.block_size
            blocks = cached[geometry.shifts] = tuple(
                shift // self.block_size + c for shift in geometry.shifts for c in range(per_row))
        return blocks

    def _bprop_launches(self, geometry: ConvGeometry) -> tuple[int, list]:
        """(lead, one (residue, side-by-side index, its BlockOrder, act_blocks) per residue of
        the offsets' canvas row shifts modulo the last stride), kept per set of shifts."""
        cached = self.__dict__.setdefault("_bprop", {})
        entry = cached.get(geometry.shifts)
        if entry is None:
            step, per_row = self.stride[-1], self.K // self.block_size
            rows = [shift // self.C for shift in geometry.shifts]
            lead = max(rows) // step
            by_residue = {}
            for k, row in enumerate(rows):
                by_residue.setdefault(row % step, []).append(k)
            launches = []
            for residue, offsets in sorted(by_residue.items()):
                blocks = tuple((lead - rows[k] // step) * per_row + kb for k in offsets for kb in range(per_row))
                launches.append((residue, *self._side_by_side(tuple(offsets)), blocks))
            entry = cached[geometry.shifts] = (lead, launches)
        return entry

    def _side_by_side(self, offsets: tuple) -> tuple[BlockIndex, BlockOrder]:
        """The layout repeated once per offset in ``offsets`` along K (block column (j, kb):
        offset ``offsets[j]``'s column kb), and where each of its blocks is in ``w``: offset
        k's block (c, kb) is block ``k · nnzb`` + its place in the layout's storage order."""
        index = self.index
        side = block_index(np.tile(self.layout, (1, len(offsets))), self.block_size)
        place = np.full(self.layout.shape, -1, dtype=np.int64)
        place[index.rows, index.indices] = np.arange(index.nnzb)
        j, column = np.divmod(side.indices, index.n_block_cols)
        positions = np.asarray(offsets, dtype=np.int64)[j] * index.nnzb + place[side.rows, column]
        return side, BlockOrder(positions, stored=math.prod(self.kernel_size) * index.nnzb)

    def _row_map(self, name: str, geometry: ConvGeometry, build) -> row_maps.RowMap:
        """``build(geometry)``, kept per (name, input shape): a training loop asks for the same few."""
        maps = self.__dict__.setdefault("_row_maps", {})
        key = (name, geometry.batch, geometry.spatial)
        row_map = maps.get(key)
        if row_map is None:
            row_map = maps[key] = build(geometry)
        return row_map

    def _canvas(self, xp, backend, x, geometry: ConvGeometry):
        """The flat canvas of ``x``: ``x`` itself where it already is one, else a zero-padded copy."""
        if not geometry.copies_input and self.channels_last:
            return x.reshape(-1)
        if self.channels_last:  # padding and phases in one gather
            canvas = _empty(xp, geometry.canvas_shape, x.dtype)
            backend.gather_rows(_rows(canvas, self.C), _rows(x, self.C),
                                self._row_map("canvas", geometry, row_maps.canvas_rows))
            return canvas.reshape(-1)
        canvas = _zeros(xp, geometry.canvas_shape, x.dtype)
        target, source = _bits(canvas), _bits(self._channels_last(x))
        for dst, src in geometry.slices:
            target[dst] = source[src]
        return canvas.reshape(-1)

    def _on_grid(self, xp, backend, dy, geometry: ConvGeometry, lead: int = 0, total: int | None = None):
        """Flat ``dy`` on the grid, zero in the over-computed rows (so they add nothing),
        after ``lead`` rows of zeros and followed by zero rows up to ``total`` rows."""
        n_grid = geometry.batch * math.prod(geometry.grid)
        total = lead + n_grid if total is None else total
        if not lead and total == n_grid and geometry.grid_is_output and self.channels_last:
            return dy.reshape(-1)
        if self.channels_last:
            row_map = self._row_map(f"grid+{lead}:{total}", geometry, lambda g: row_maps.grid_rows(g, lead, total))
            grid = _empty(xp, (total, self.K), dy.dtype)
            backend.gather_rows(_bits(grid), _rows(dy, self.K), row_map)
            return grid.reshape(-1)
        grid = _zeros(xp, (total, self.K), dy.dtype)
        _bits(grid[lead:lead + n_grid]).reshape(geometry.batch, *geometry.grid, self.K)[geometry.crop] = \
            _bits(self._channels_last(dy))
        return grid.reshape(-1)

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
        expected = self._shape(geometry.batch, geometry.out, self.K)
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

"""The three passes of a :class:`~bsmm.nn.conv.BlocksparseConv` on its canvas.

Each pass is an implicit GEMM over shifted rows of the canvas
(:mod:`bsmm.nn.conv_geometry`): the kernel offsets are blocks of one stacked layout
whose blocks read their own shift (``shifted_pass``, :mod:`bsmm.backends.strided`),
never an im2col. :class:`ConvPasses` makes the canvas and the result grid, runs the
launches and keeps what they reuse (stacked layouts, launch plans, row maps). Only the
backend calls differ between NumPy (CPU backend) and CuPy (GPU kernels), so the CPU
tests cover the index arithmetic.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from bsmm.arrays import array_module
from bsmm.backends.strided import BlockOrder
from bsmm.block_index import BlockIndex, block_index
from bsmm.matmul import BlocksparseMatMul
from bsmm.nn import row_maps
from bsmm.nn.conv_geometry import ConvGeometry

__all__ = ["ConvPasses"]

# Copies and zero fills move bits: one code path for every dtype, bfloat16 on CuPy included.
_BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(array):
    return array.view(_BITS[array.dtype.itemsize])


def _rows(array, width: int):
    """The bits of a C-contiguous array as rows of ``width`` elements (what gather_rows moves)."""
    return _bits(array).reshape(-1, width)


def _zeros(xp, shape: tuple, dtype):
    return xp.zeros(shape, dtype=_BITS[np.dtype(dtype).itemsize]).view(dtype)


def _empty(xp, shape: tuple, dtype):
    return xp.empty(shape, dtype=_BITS[np.dtype(dtype).itemsize]).view(dtype)


class ConvPasses:
    """fprop, bprop and updat of one convolution on checked, C-contiguous NumPy or CuPy arrays.

    ``matmul`` holds the per-offset layout (and ``tf32``, read at every launch); arrays are
    channels last when ``channels_last``, else channels first. Each pass writes its
    result into the array it is given; :class:`~bsmm.nn.conv.BlocksparseConv` checks the
    operands and allocates the results.

    Examples
    --------
    >>> import numpy as np
    >>> from bsmm.backends import cpu
    >>> from bsmm.matmul import BlocksparseMatMul
    >>> from bsmm.nn.conv_geometry import conv_geometry
    >>> passes = ConvPasses(BlocksparseMatMul(np.ones((1, 1)), 8, feature_axis=1), (3,), (1,), True)
    >>> geometry = conv_geometry(1, (4,), 8, (3,), (1,), (1,), (1,))
    >>> y = np.empty((1, 4, 8), np.float32)
    >>> passes.fprop(cpu, np.ones((1, 4, 8), np.float32), np.ones((3, 1, 8, 8), np.float32), y, geometry)
    >>> y[0, :, 0].tolist()  # 8 channels times the 2 or 3 offsets inside the input
    [16.0, 24.0, 24.0, 16.0]
    """

    def __init__(self, matmul: BlocksparseMatMul, kernel_size: tuple, stride: tuple, channels_last: bool):
        self.matmul = matmul
        self.kernel_size, self.stride, self.channels_last = kernel_size, stride, channels_last
        # Kept per set of shifts or per input shape: a training loop asks for the same few.
        self._shifted_blocks, self._bprop_launches, self._row_maps = {}, {}, {}

    # -- the passes --------------------------------------------------------------------------
    def fprop(self, backend, x, w, y, geometry: ConvGeometry) -> None:
        """y = conv(x, W), written into ``y``."""
        K = self.matmul.K
        if geometry.rows == 0 or self.matmul.blocks == 0:
            _bits(y)[...] = 0
            return
        xp = array_module(y)
        canvas = self.canvas(backend, x, geometry)
        direct = geometry.grid_is_output and self.channels_last
        grid = y if direct else _empty(xp, (geometry.batch, *geometry.grid, K), y.dtype)
        # One launch for every kernel offset: the offsets are block rows of one stacked layout
        # whose blocks read the canvas at their offset's shift (no output re-read per offset).
        backend.shifted_pass("fprop", self.stacked_index, canvas, w.reshape(-1), grid.reshape(-1),
                             geometry.rows, (geometry.row_stride, K), self.shifted_blocks(geometry),
                             tf32=self.matmul.tf32)
        if not direct and self.channels_last:
            backend.gather_rows(_rows(y, K), _rows(grid, K), self.row_map("crop", geometry, row_maps.crop_rows))
        elif not direct:
            _bits(self._channels_last_view(y))[...] = _bits(grid)[geometry.crop]

    def bprop(self, backend, dy, w, dx, geometry: ConvGeometry) -> None:
        """dx, the gradient of ``sum(dy · conv(x, W))`` with respect to ``x``, written into ``dx``."""
        C, K = self.matmul.C, self.matmul.K
        if geometry.rows == 0 or self.matmul.blocks == 0:
            _bits(dx)[...] = 0
            return
        xp = array_module(dx)
        direct = not geometry.copies_input and self.channels_last
        # Offset k adds dy grid row r times W_kᵀ into canvas row shift_k / C + r·s (s: the last
        # stride). Canvas rows of one residue φ mod s are then a stride-1 bprop over the
        # offsets of that residue, side by side: row φ + q·s sums dy row q - e_k, e_k =
        # (shift_k / C) // s. dy sits ``lead`` = max e_k zero rows into its buffer so every
        # read lands inside it; each residue is one launch writing all its rows.
        step, canvas_rows = self.stride[-1], math.prod(geometry.canvas_shape[:-1])
        lead, launches = self.bprop_launches(geometry)
        dy_rows = self.on_grid(backend, dy, geometry, lead, lead + -(-canvas_rows // step))
        canvas = dx if direct else _empty(xp, geometry.canvas_shape, dx.dtype)
        if len(launches) < step:  # rows no offset reaches (a kernel narrower than the stride)
            _bits(canvas)[...] = 0
        flat = canvas.reshape(-1)
        for residue, index, order, blocks in launches:
            backend.shifted_pass("bprop", index, dy_rows, w.reshape(-1), flat[residue * C:],
                                 -(-(canvas_rows - residue) // step), (K, step * C), blocks,
                                 tf32=self.matmul.tf32, weight_blocks=order)
        if not direct and self.channels_last:
            backend.gather_rows(_rows(dx, C), _rows(canvas, C), self.row_map("input", geometry, row_maps.input_rows))
        elif not direct:
            target, source = _bits(self._channels_last_view(dx)), _bits(canvas)
            for dst, src in geometry.slices:
                target[src] = source[dst]

    def updat(self, backend, x, dy, dw, geometry: ConvGeometry, accumulate: bool) -> None:
        """dW, the gradient of ``sum(dy · conv(x, W))`` with respect to the present blocks,
        written into (``accumulate``: added to) ``dw``."""
        if geometry.rows == 0 or self.matmul.blocks == 0:
            if not accumulate:
                _bits(dw)[...] = 0
            return
        canvas = self.canvas(backend, x, geometry)
        dy_rows = self.on_grid(backend, dy, geometry)
        # Every offset's gradient in one launch over the stacked layout (see fprop).
        backend.shifted_pass("updat", self.stacked_index, canvas, dy_rows, dw.reshape(-1), geometry.rows,
                             (geometry.row_stride, self.matmul.K), self.shifted_blocks(geometry),
                             accumulate=bool(accumulate), tf32=self.matmul.tf32)

    # -- the layouts the launches run over --------------------------------------------------
    @functools.cached_property
    def stacked_index(self) -> BlockIndex:
        """The layout repeated once per kernel offset along C: its blocks in storage order are
        exactly ``w``'s (offset-major, then the layout's row-major order)."""
        return block_index(np.tile(self.matmul.layout, (math.prod(self.kernel_size), 1)), self.matmul.block_size)

    def shifted_blocks(self, geometry: ConvGeometry) -> tuple:
        """Where block row (offset k, c) of the stacked layout reads the canvas: block
        shift_k / bs + c of a row (every shift is a whole number of channel vectors)."""
        blocks = self._shifted_blocks.get(geometry.shifts)
        if blocks is None:
            bs = self.matmul.block_size
            per_row = self.matmul.C // bs
            blocks = self._shifted_blocks[geometry.shifts] = tuple(
                shift // bs + c for shift in geometry.shifts for c in range(per_row))
        return blocks

    def bprop_launches(self, geometry: ConvGeometry) -> tuple[int, list]:
        """(lead, one (residue, side-by-side index, its BlockOrder, act_blocks) per residue of
        the offsets' canvas row shifts modulo the last stride)."""
        entry = self._bprop_launches.get(geometry.shifts)
        if entry is None:
            step, per_row = self.stride[-1], self.matmul.K // self.matmul.block_size
            rows = [shift // self.matmul.C for shift in geometry.shifts]
            lead = max(rows) // step
            by_residue = {}
            for k, row in enumerate(rows):
                by_residue.setdefault(row % step, []).append(k)
            launches = []
            for residue, offsets in sorted(by_residue.items()):
                blocks = tuple((lead - rows[k] // step) * per_row + kb for k in offsets for kb in range(per_row))
                launches.append((residue, *self._side_by_side(tuple(offsets)), blocks))
            entry = self._bprop_launches[geometry.shifts] = (lead, launches)
        return entry

    def _side_by_side(self, offsets: tuple) -> tuple[BlockIndex, BlockOrder]:
        """The layout repeated once per offset in ``offsets`` along K (block column (j, kb):
        offset ``offsets[j]``'s column kb), and where each of its blocks is in ``w``: offset
        k's block (c, kb) is block ``k · nnzb`` + its place in the layout's storage order."""
        index, layout = self.matmul.index, self.matmul.layout
        side = block_index(np.tile(layout, (1, len(offsets))), self.matmul.block_size)
        place = np.full(layout.shape, -1, dtype=np.int64)
        place[index.rows, index.indices] = np.arange(index.nnzb)
        j, column = np.divmod(side.indices, index.n_block_cols)
        positions = np.asarray(offsets, dtype=np.int64)[j] * index.nnzb + place[side.rows, column]
        return side, BlockOrder(positions, stored=math.prod(self.kernel_size) * index.nnzb)

    # -- the canvas and the grid ------------------------------------------------------------
    def row_map(self, name: str, geometry: ConvGeometry, build) -> row_maps.RowMap:
        """``build(geometry)``, kept per (name, input shape)."""
        key = (name, geometry.batch, geometry.spatial)
        row_map = self._row_maps.get(key)
        if row_map is None:
            row_map = self._row_maps[key] = build(geometry)
        return row_map

    def canvas(self, backend, x, geometry: ConvGeometry):
        """The flat canvas of ``x``: ``x`` itself where it already is one, else a zero-padded copy."""
        C = self.matmul.C
        if not geometry.copies_input and self.channels_last:
            return x.reshape(-1)
        xp = array_module(x)
        if self.channels_last:  # padding and phases in one gather
            canvas = _empty(xp, geometry.canvas_shape, x.dtype)
            backend.gather_rows(_rows(canvas, C), _rows(x, C), self.row_map("canvas", geometry, row_maps.canvas_rows))
            return canvas.reshape(-1)
        canvas = _zeros(xp, geometry.canvas_shape, x.dtype)
        target, source = _bits(canvas), _bits(self._channels_last_view(x))
        for dst, src in geometry.slices:
            target[dst] = source[src]
        return canvas.reshape(-1)

    def on_grid(self, backend, dy, geometry: ConvGeometry, lead: int = 0, total: int | None = None):
        """Flat ``dy`` on the grid, zero in the over-computed rows (so they add nothing),
        after ``lead`` rows of zeros and followed by zero rows up to ``total`` rows."""
        K = self.matmul.K
        n_grid = geometry.batch * math.prod(geometry.grid)
        total = lead + n_grid if total is None else total
        if not lead and total == n_grid and geometry.grid_is_output and self.channels_last:
            return dy.reshape(-1)
        xp = array_module(dy)
        if self.channels_last:
            row_map = self.row_map(f"grid+{lead}:{total}", geometry, lambda g: row_maps.grid_rows(g, lead, total))
            grid = _empty(xp, (total, K), dy.dtype)
            backend.gather_rows(_bits(grid), _rows(dy, K), row_map)
            return grid.reshape(-1)
        grid = _zeros(xp, (total, K), dy.dtype)
        _bits(grid[lead:lead + n_grid]).reshape(geometry.batch, *geometry.grid, K)[geometry.crop] = \
            _bits(self._channels_last_view(dy))
        return grid.reshape(-1)

    def _channels_last_view(self, array):
        """A channels-last view of an activation array of this convolution's layout."""
        if self.channels_last:
            return array
        return array.transpose(0, *range(2, array.ndim), 1)

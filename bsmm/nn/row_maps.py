"""Row maps: every layout change of a convolution as one gather of channel rows.

A convolution (:mod:`bsmm.nn.conv`) moves channels-last rows between four arrangements
of one call's :class:`~bsmm.nn.conv_geometry.ConvGeometry`: the input ``(N, *S)``, the
padded canvas, the result grid ``(N, *grid)`` and the output ``(N, *O)``. Each move
is ``dst[r] = src[row_map[r]]``, zeros where ``row_map[r] < 0``, which both backends
run as one gather (``gather_rows``): on the GPU one launch of 16-byte copies
(``cuda/bsmm_gather_rows.cu``) instead of a zero fill plus a strided copy per slice.

The maps are pure NumPy on the geometry, so the CPU tests check the same arithmetic
the GPU runs.
"""

from __future__ import annotations

import math

import numpy as np

from bsmm.nn.conv_geometry import ConvGeometry

__all__ = ["RowMap", "canvas_rows", "input_rows", "crop_rows", "grid_rows"]


class RowMap:
    """An int32 row map (read-only) with its device copies, uploaded once per device.

    Examples
    --------
    >>> m = RowMap(np.array([2, -1, 0]))
    >>> m.rows, len(m)
    (array([ 2, -1,  0], dtype=int32), 3)
    """

    __slots__ = ("rows", "_on_device")

    def __init__(self, rows):
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and rows.max() >= 2**31:
            raise NotImplementedError(f"row maps index at most 2**31 - 1 rows; this one reaches row {rows.max()}")
        self.rows = rows.astype(np.int32)
        self.rows.setflags(write=False)
        self._on_device = {}

    def __len__(self) -> int:
        return len(self.rows)

    def device_array(self):
        """The map on CuPy's current device (uploaded on first use there)."""
        import cupy

        device = cupy.cuda.runtime.getDevice()
        array = self._on_device.get(device)
        if array is None:
            array = self._on_device[device] = cupy.asarray(self.rows)
        return array


def _canvas_of_inputs(g: ConvGeometry) -> np.ndarray:
    """Canvas-shaped (without channels) array of input row numbers, -1 on padding."""
    inputs = np.arange(g.batch * math.prod(g.spatial), dtype=np.int64).reshape((g.batch, *g.spatial))
    canvas = np.full(g.canvas_shape[:-1], -1, dtype=np.int64)
    for dst, src in g.slices:  # the slices end with the channel axis, which rows do not have
        canvas[dst[:-1]] = inputs[src[:-1]]
    return canvas.reshape(-1)


def canvas_rows(g: ConvGeometry) -> RowMap:
    """Canvas row -> input row (channels last), -1 where the canvas is padding."""
    return RowMap(_canvas_of_inputs(g))


def input_rows(g: ConvGeometry) -> RowMap:
    """Input row -> the canvas row holding it (gathers an input gradient out of its canvas)."""
    canvas = _canvas_of_inputs(g)
    held = np.flatnonzero(canvas >= 0)
    rows = np.empty(g.batch * math.prod(g.spatial), dtype=np.int64)
    rows[canvas[held]] = held
    return RowMap(rows)


def _output_grid_rows(g: ConvGeometry) -> np.ndarray:
    grid = np.arange(g.batch * math.prod(g.grid), dtype=np.int64).reshape((g.batch, *g.grid))
    return grid[g.crop[:-1]].reshape(-1)


def crop_rows(g: ConvGeometry) -> RowMap:
    """Output row -> the grid row computing it."""
    return RowMap(_output_grid_rows(g))


def grid_rows(g: ConvGeometry, lead: int = 0, total: int | None = None) -> RowMap:
    """Row ``lead + r`` -> output row of grid row ``r``; -1 on over-computed rows, the ``lead``
    rows before the grid and the rows after it up to ``total`` (default: the grid's end)."""
    outputs = _output_grid_rows(g)
    size = lead + g.batch * math.prod(g.grid) if total is None else total
    rows = np.full(size, -1, dtype=np.int64)
    rows[lead + outputs] = np.arange(len(outputs))
    return RowMap(rows)

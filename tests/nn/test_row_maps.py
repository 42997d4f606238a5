"""Row maps and the row gather: every layout change of a convolution as one gather.

The maps are checked against the slice copies of the geometry (the reference path the
channels-first layout still takes), and the gather on both backends against NumPy
indexing, over every access unit the GPU picks (16, 8, 4 and 2 bytes).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from bsmm.nn import row_maps
from bsmm.nn.conv_geometry import conv_geometry
from conftest import to_numpy, to_xp

GEOMETRIES = [  # (batch, spatial, kernel, stride, padding, dilation)
    (2, (5, 6), (3, 3), (1, 1), (1, 1), (1, 1)),
    (2, (5, 6), (3, 3), (2, 2), (1, 1), (1, 1)),
    (1, (7,), (3,), (3,), (2,), (2,)),
    (2, (3, 4, 5), (3, 1, 2), (2, 1, 2), (1, 0, 1), (1, 1, 2)),
    (3, (4, 6), (2, 2), (2, 2), (0, 0), (1, 1)),
]


def _backend(xp):
    return importlib.import_module("bsmm.backends.cpu" if xp is np else "bsmm.backends.cuda.backend")


@pytest.mark.parametrize("args", GEOMETRIES)
def test_maps_match_the_geometry_slices(args):
    batch, spatial, kernel, stride, padding, dilation = args
    g = conv_geometry(batch, spatial, 1, kernel, stride, padding, dilation)
    inputs = np.arange(1, batch * np.prod(spatial) + 1).reshape(batch, *spatial, 1)
    canvas = np.zeros(g.canvas_shape, np.int64)
    for dst, src in g.slices:
        canvas[dst] = inputs[src]
    canvas = canvas.reshape(-1)
    canvas_map = row_maps.canvas_rows(g).rows
    assert np.array_equal(np.where(canvas_map >= 0, canvas_map + 1, 0), canvas)
    input_map = row_maps.input_rows(g).rows
    assert np.array_equal(canvas[input_map], inputs.reshape(-1))
    grid = np.arange(batch * np.prod(g.grid)).reshape(batch, *g.grid)
    crop = row_maps.crop_rows(g).rows
    assert np.array_equal(crop, grid[g.crop[:-1]].reshape(-1))
    for lead in (0, 3):
        placed = row_maps.grid_rows(g, lead).rows
        assert len(placed) == lead + grid.size
        assert np.all(placed[:lead] == -1)
        assert np.array_equal(placed[lead + crop], np.arange(len(crop)))
        assert np.sum(placed >= 0) == len(crop)


def test_row_map_is_read_only_int32():
    m = row_maps.RowMap([3, -1, 0])
    assert m.rows.dtype == np.int32 and len(m) == 3
    with pytest.raises(ValueError):
        m.rows[0] = 1
    with pytest.raises(NotImplementedError, match="2\\*\\*31"):
        row_maps.RowMap([2**31])


@pytest.mark.parametrize("dtype, width, offset", [
    ("float32", 8, 0),   # 32-byte rows: 16-byte units
    ("float16", 12, 0),  # 24-byte rows: 8-byte units
    ("float16", 6, 0),   # 12-byte rows: 4-byte units
    ("float16", 8, 1),   # a source starting 2 bytes in: 2-byte units
    ("uint16", 200, 0),  # rows wider than one block's threads
])
def test_gather_rows_matches_indexing(xp, dtype, width, offset):
    rng = np.random.default_rng(width + offset)
    src_rows, dst_rows = 37, 53
    source = rng.standard_normal(src_rows * width + offset).astype(dtype)
    row_map = row_maps.RowMap(rng.integers(-1, src_rows, dst_rows))
    src = to_xp(xp, source)[offset:].reshape(src_rows, width)
    dst = to_xp(xp, np.full((dst_rows, width), 7, dtype))
    snapshot = to_numpy(src).copy()
    _backend(xp).gather_rows(dst, src, row_map)
    expected = np.where(row_map.rows[:, None] >= 0, snapshot[np.maximum(row_map.rows, 0)], 0)
    assert np.array_equal(to_numpy(dst), expected)
    assert np.array_equal(to_numpy(src), snapshot)


def test_gather_rows_refuses_mismatched_rows(xp):
    src = to_xp(xp, np.zeros((4, 8), np.float32))
    for dst, row_map in ((to_xp(xp, np.zeros((3, 8), np.float32)), row_maps.RowMap([0, 1])),
                         (to_xp(xp, np.zeros((2, 4), np.float32)), row_maps.RowMap([0, 1]))):
        with pytest.raises(ValueError, match="gather_rows"):
            _backend(xp).gather_rows(dst, src, row_map)


def test_gather_rows_empty(xp):
    dst = to_xp(xp, np.zeros((0, 8), np.float32))
    _backend(xp).gather_rows(dst, to_xp(xp, np.zeros((4, 8), np.float32)), row_maps.RowMap([]))
    assert dst.shape == (0, 8)

"""The contract of ``strided_pass``, shared by the CPU and CUDA backends.

A strided pass runs fprop, bprop or updat over ``rows`` activation rows whose
starts are a fixed number of elements apart (at least one row wide), inside flat
1-D buffers. Successive calls may read shifted windows of one buffer (a
convolution's kernel offsets over one padded input) and rows may leave gaps (a
stride), which is how :mod:`bsmm.nn.conv` runs an implicit GEMM per kernel
offset without an im2col copy.
"""

from __future__ import annotations

import numpy as np

from bsmm.block_index import BlockIndex
from bsmm.passes import PASSES

__all__ = ["BlockOrder", "check_strided_operands", "row_widths", "virtual_width"]


class BlockOrder:
    """Where each block of an index is stored in a weight array of ``stored`` blocks.

    A pass over a layout assembled from other layouts (a convolution's kernel offsets side by
    side) reads the weights in their own storage order: block ``b`` of the index, in the
    index's storage order, is block ``positions[b]`` of the weight array, which holds
    ``stored`` blocks (default: one per position, i.e. a permutation). Hashed once (it keys
    cached launch plans).

    Examples
    --------
    >>> order = BlockOrder([4, 0, 2], stored=5)  # 3 of the 5 stored blocks, in this order
    >>> order.positions, order.stored
    (array([4, 0, 2]), 5)
    """

    __slots__ = ("positions", "stored", "_hash")

    def __init__(self, positions, stored: int | None = None):
        positions = np.asarray(positions, dtype=np.int64)
        stored = len(positions) if stored is None else int(stored)
        if (positions.ndim != 1 or (positions.size and (positions.min() < 0 or positions.max() >= stored))
                or len(np.unique(positions)) != positions.size):
            raise ValueError(f"positions must be distinct block numbers in [0, stored = {stored})")
        positions.setflags(write=False)
        self.positions, self.stored = positions, stored
        self._hash = hash((positions.tobytes(), stored))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, BlockOrder) and self.stored == other.stored
                                 and np.array_equal(self.positions, other.positions))


def row_widths(pass_name: str, index: BlockIndex) -> tuple[int, int]:
    """Features per row of the two row-major operands: (activation, output), or (x, dy) for updat."""
    widths = {"fprop": (index.C, index.K), "bprop": (index.K, index.C), "updat": (index.C, index.K)}
    if pass_name not in widths:
        raise ValueError(f"pass_name must be one of {sorted(widths)}; got {pass_name!r}")
    return widths[pass_name]


def virtual_width(pass_name: str, index: BlockIndex, act_blocks) -> int:
    """Elements an activation row spans when its block b is read at block ``act_blocks[b]``.

    ``act_blocks`` (one entry per activation block of the index: block rows for fprop and
    updat, block columns for bprop) lets one pass read each block at its own offset: a
    convolution's kernel offsets become block rows of one stacked layout whose blocks read
    the input shifted by that offset, so every offset is summed inside one launch.
    """
    count = index.n_block_cols if PASSES[pass_name].reads_weights_transposed else index.n_block_rows
    if len(act_blocks) != count:
        raise ValueError(f"act_blocks must have one entry per activation block ({count}); got {len(act_blocks)}")
    if count and min(act_blocks) < 0:
        raise ValueError("act_blocks must be >= 0")
    return (max(act_blocks, default=-1) + 1) * index.block_size


def check_strided_operands(pass_name: str, index: BlockIndex, act, other, out, rows: int,
                           row_strides: tuple, act_width: int | None = None,
                           weight_blocks: BlockOrder | None = None) -> None:
    """Raise ValueError naming the operand unless every row lies inside its flat 1-D array.

    ``act_width``: the activation row's span when it is read through ``act_blocks``;
    ``weight_blocks``: the weights' storage order (fprop and bprop only).
    """
    if weight_blocks is not None:
        if PASSES[pass_name].updates_weights:
            raise NotImplementedError("weight_blocks reorders the weights read by fprop and bprop, not updat's output")
        if len(weight_blocks.positions) != index.nnzb:
            raise ValueError(f"weight_blocks must have one position per block ({index.nnzb}); "
                             f"got {len(weight_blocks.positions)}")
    widths = row_widths(pass_name, index)
    if act_width is not None:
        widths = (act_width, widths[1])
    updates_weights = PASSES[pass_name].updates_weights
    row_major = {"act": act, "other": other} if updates_weights else {"act": act, "out": out}
    weights_name = "out" if updates_weights else "other"
    weights = out if updates_weights else other
    for name, array in {"act": act, "other": other, "out": out}.items():
        if array.ndim != 1:
            raise ValueError(f"strided_pass: {name} must be a flat 1-D array; got shape {tuple(array.shape)}")
        if array.dtype != act.dtype:
            raise TypeError(f"strided_pass: {name} has dtype {array.dtype} but act has {act.dtype}")
    if rows < 0:
        raise ValueError(f"strided_pass: rows must be >= 0; got {rows}")
    for (name, array), stride, width in zip(row_major.items(), row_strides, widths):
        if stride < width and not (name == "act" and act_width is not None):
            raise ValueError(f"strided_pass: {name}'s rows are {stride} apart but {width} wide; they would overlap")
        if rows and (rows - 1) * stride + width > array.size:
            raise ValueError(f"strided_pass: {name} holds {array.size} elements but {rows} rows of {width}, "
                             f"{stride} apart, need {(rows - 1) * stride + width}")
    stored = index.nnzb if weight_blocks is None else weight_blocks.stored
    if weights.size != stored * index.block_size**2:
        raise ValueError(f"strided_pass: {weights_name} must hold {stored} blocks of bs*bs = "
                         f"{stored * index.block_size**2} weight elements; got {weights.size}")

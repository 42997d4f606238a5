"""The contract of ``strided_pass``, shared by the CPU and CUDA backends.

A strided pass runs fprop, bprop or updat over ``rows`` activation rows whose
starts are a fixed number of elements apart (at least one row wide), inside flat
1-D buffers. Successive calls may read shifted windows of one buffer (a
convolution's kernel offsets over one padded input) and rows may leave gaps (a
stride), which is how :mod:`bsmm.conv` runs an implicit GEMM per kernel
offset without an im2col copy.
"""

from __future__ import annotations

from .block_index import BlockIndex

__all__ = ["check_strided_operands", "row_widths"]


def row_widths(pass_name: str, index: BlockIndex) -> tuple[int, int]:
    """Features per row of the two row-major operands: (activation, output), or (x, dy) for updat."""
    widths = {"fprop": (index.C, index.K), "bprop": (index.K, index.C), "updat": (index.C, index.K)}
    if pass_name not in widths:
        raise ValueError(f"pass_name must be one of {sorted(widths)}; got {pass_name!r}")
    return widths[pass_name]


def check_strided_operands(pass_name: str, index: BlockIndex, act, other, out, rows: int,
                           row_strides: tuple) -> None:
    """Raise ValueError naming the operand unless every row lies inside its flat 1-D array."""
    widths = row_widths(pass_name, index)
    row_major = {"act": act, "out": out} if pass_name != "updat" else {"act": act, "other": other}
    weights_name = "other" if pass_name != "updat" else "out"
    weights = other if pass_name != "updat" else out
    for name, array in {"act": act, "other": other, "out": out}.items():
        if array.ndim != 1:
            raise ValueError(f"strided_pass: {name} must be a flat 1-D array; got shape {tuple(array.shape)}")
        if array.dtype != act.dtype:
            raise TypeError(f"strided_pass: {name} has dtype {array.dtype} but act has {act.dtype}")
    if rows < 0:
        raise ValueError(f"strided_pass: rows must be >= 0; got {rows}")
    for (name, array), stride, width in zip(row_major.items(), row_strides, widths):
        if stride < width:
            raise ValueError(f"strided_pass: {name}'s rows are {stride} apart but {width} wide; they would overlap")
        if rows and (rows - 1) * stride + width > array.size:
            raise ValueError(f"strided_pass: {name} holds {array.size} elements but {rows} rows of {width}, "
                             f"{stride} apart, need {(rows - 1) * stride + width}")
    if weights.size != index.nnzb * index.block_size**2:
        raise ValueError(f"strided_pass: {weights_name} must hold nnzb*bs*bs = {index.nnzb * index.block_size**2} "
                         f"weight elements; got {weights.size}")

"""The parameters of a matmul kernel launch: one struct, named on both sides.

``cuda/bsmm_params.cuh`` declares ``bsmm::MatmulParams``, which ``bsmm_matmul`` and
``bsmm_matmul_tma`` take by value; :class:`MatmulParams` is the same struct as a
``ctypes.Structure`` (every field 8 bytes, in the same order: a test reads the header and
compares). A launch packs the values of :func:`values` straight into such a struct with one
``struct.pack_into`` (filling it field by field through ctypes costs about 17 attribute writes;
``results/`` has the measurement), and the kernel's one parameter points at it.

>>> [name for name, _ in MatmulParams._fields_][:3], ctypes.sizeof(MatmulParams)
(['act', 'other', 'out'], 144)
>>> Sizes(n_rows=32, ld_act=1024, ld_other=0, ld_out=2048, out_blocks=64).out_blocks
64
"""

from __future__ import annotations

import ctypes
import struct
from typing import NamedTuple

__all__ = ["FIELDS", "MatmulParams", "Sizes", "PACK", "values"]

#: The fields of ``bsmm::MatmulParams`` in order: the pointers, then the sizes and flags.
FIELDS = ("act", "other", "out", "segments", "units", "table", "workspace", "counters", "bias", "pre",
          "n_rows", "ld_act", "ld_other", "ld_out", "out_blocks", "accumulate", "band_rows", "gate")
#: The fields that hold device pointers (unsigned on the host); the others are sizes and flags.
_POINTER_FIELDS = frozenset(FIELDS[:10] + ("gate",))


class MatmulParams(ctypes.Structure):
    """``bsmm::MatmulParams`` (``cuda/bsmm_params.cuh``): the fields' meanings are documented there."""

    _fields_ = [(name, ctypes.c_uint64 if name in _POINTER_FIELDS else ctypes.c_int64) for name in FIELDS]


#: Packs :func:`values`' tuple into a :class:`MatmulParams` (or any buffer of its size).
PACK = struct.Struct(f"<{len(FIELDS)}Q").pack_into


class Sizes(NamedTuple):
    """The sizes of one launch: rows of the batch, elements between rows of the activations, of
    the other operand (updat's dy; 0 for fprop and bprop) and of the output, and the output's
    blocks (fprop and bprop; 0 for updat)."""

    n_rows: int
    ld_act: int
    ld_other: int
    ld_out: int
    out_blocks: int


def values(act: int, other: int, out: int, scratch: tuple, bias: int, pre: int, sizes: Sizes, accumulate: int,
           band_rows: int, gate: int = 0) -> tuple:
    """The struct's values in field order; ``scratch`` = (segments, units, table, workspace, counters);
    ``gate``: the per-block gates' pointer (0: none)."""
    return (act, other, out, *scratch, bias, pre, *sizes, accumulate, band_rows, gate)

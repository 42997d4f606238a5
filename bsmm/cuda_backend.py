"""The three passes on CUDA GPUs: launch plans over the kernels of ``cuda/bsmm_matmul.cu``.

A *plan* fixes everything about a pass that does not change from call to call
for one (layout, pass, N, dtype, feature axis, math mode, alignment, device):
the kernel variant, the grid, and the device-side tables (segments, units,
step table), uploaded once. A pass then costs one kernel launch on CuPy's
current stream, no host synchronisation and no allocation besides the output
and, for layouts whose long block columns are cut into parts, a workspace and
counters kept per (plan, stream) and reused.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import os
import struct
import threading
import weakref
from typing import Iterator

import cupy
import numpy as np

from .block_index import BlockIndex, block_index
from .config import settings
from .dtypes import DTYPE_NAMES, SUPPORTED_DTYPES
from .launches import SerializedLaunch
from .kernels import (ELEMENT_BYTES, MAX_PART_BLOCKS, BlockTransposeVariant, GatherVariant, TransposeVariant, Variant,
                      load_kernel)
from .strided import BlockOrder, check_strided_operands, virtual_width
from .tensor_maps import MAP_BYTES, tensor_map

__all__ = ["FastCall", "fprop", "bprop", "updat", "strided_pass", "shifted_pass", "gather_rows", "plan_for",
           "tile_for", "forget_plans", "recording_table_lookups"]

_VEC_BYTES = 16
# Bound once: the per-call path looks these up on every launch.
_launch_kernel = cupy.cuda.driver.launchKernel
_get_device = cupy.cuda.runtime.getDevice
_current_stream = cupy.cuda.get_current_stream


def _serialized_launches(device) -> bool:
    """Whether launches on ``device`` use programmatic stream serialization (:mod:`bsmm.launches`):
    Hopper and newer, unless ``[kernels] programmatic_launch`` or ``BSMM_PDL=0`` turn it off."""
    return (int(device.compute_capability) >= 90 and settings()["kernels"]["programmatic_launch"]
            and os.environ.get("BSMM_PDL", "1") != "0")


def _batch_class(n: int) -> str:
    for limit in (16, 32, 64):
        if n <= limit:
            return f"n{limit}"
    return "large"


#: While :func:`recording_table_lookups` runs: (entry, tile) of every launch-table entry
#: :func:`tile_for` returned, entry = (section, table, group, block size, batch class).
_table_lookups: list | None = None


@contextlib.contextmanager
def recording_table_lookups() -> Iterator[list]:
    """Collects the launch-table entries that plans built meanwhile read (``bsmm tune`` learns
    which entry a pass runs with from it); one recorder at a time."""
    global _table_lookups
    if _table_lookups is not None:
        raise RuntimeError("launch-table lookups are already being recorded")
    _table_lookups = found = []
    try:
        yield found
    finally:
        _table_lookups = None


def tile_for(math_mode: str, pass_name: str, block_size: int, n: int, arch_key: str | None = None,
             columns: bool = False, optional: bool = False) -> tuple | None:
    """[BM, BN, BK, WARPS_M, WARPS_N, STAGES] from the launch table in ``bsmm.toml``.

    ``columns=True``: the column-group tile [..., COLS] (fprop/bprop: ``columns``, updat:
    ``updat_rows``), or None where the table has none (so does any mode with ``optional=True``). ``arch_key`` ("sm90", "sm80", ...)
    selects a device's override section.
    """
    if columns:
        group = "updat_rows" if pass_name == "updat" else "columns"
    else:
        group = "updat" if pass_name == "updat" else "sparse"
    batches = (_batch_class(n), "any")  # updat tables may give small-batch tiles before "any"
    tables = settings()["kernels"]
    for arch, section in ((arch_key, tables.get(arch_key or "", {})), ("default", tables["default"])):
        entries = section.get(math_mode, {}).get(group, {}).get(str(block_size), {})
        batch = next((b for b in batches if b in entries), None)
        if batch is not None:
            tile = tuple(int(v) for v in entries[batch])
            if _table_lookups is not None:
                _table_lookups.append(((arch, math_mode, group, str(block_size), batch), tile))
            return tile
    if columns or optional:
        return None
    raise NotImplementedError(f"no {math_mode} kernel tile for {pass_name} at block size {block_size}")


def math_mode(dtype: str, pass_name: str, block_size: int, tf32: bool) -> str:
    """simt, tf32 or tensor16: how a pass multiplies for this dtype and block size."""
    if pass_name == "updat" and block_size < 16:
        return "simt"  # an 8x8 weight block is smaller than one 16-row tensor-core tile
    if dtype == "float32":
        return "tf32" if tf32 else "simt"
    return "tensor16"


_ARG_COUNT = 14  # parameters of bsmm_matmul


class _Launcher:
    """Launches one kernel with a parameter block packed in one call.

    CuPy's generic launch converts every argument on every call (tens of
    microseconds for 14 arguments); here the values are packed into a fixed
    buffer whose slot addresses were computed once. ``cuLaunchKernel`` copies
    the parameters, so the buffer is free again when it returns. ``map_count``
    128-byte TMA tensor maps (:mod:`bsmm.tensor_maps`) follow the 8-byte slots.
    """

    def __init__(self, kernel, grid, threads: int, shared_bytes: int, arg_count: int = _ARG_COUNT,
                 map_count: int = 0, serialized: bool = False):
        self.function = kernel.kernel.ptr
        # Launched with programmatic stream serialization (bsmm.launches): stream -> its configuration.
        self.serialized: dict | None = {} if serialized else None
        self.grid, self.threads, self.shared_bytes = grid, threads, shared_bytes
        # cuLaunchKernel's arguments before the stream: function, grid, block, shared bytes.
        self.head = (self.function, *grid, threads, 1, 1, shared_bytes)
        # Each parameter gets an 8-byte slot; int parameters are read from the low 4 bytes (little-endian).
        self.arg_count = arg_count
        self.pack = struct.Struct(f"<{arg_count}Q").pack_into
        self.values = (ctypes.c_uint64 * arg_count)()
        self.maps = [(ctypes.c_uint64 * (MAP_BYTES // 8))() for _ in range(map_count)]
        base = ctypes.addressof(self.values)
        self.map_addresses = [ctypes.addressof(m) for m in self.maps]
        self.pointers = (ctypes.c_uint64 * (arg_count + map_count))(
            *(base + 8 * i for i in range(arg_count)), *self.map_addresses)
        self.pointers_address = ctypes.addressof(self.pointers)
        self.map_key = None  # what the tensor maps in the buffer describe
        self.lock = threading.Lock()

    def launch(self, stream_ptr: int, *values: int, map_key=None, make_maps=None) -> None:
        """One launch on ``stream_ptr`` with the kernel's parameters in order. ``make_maps()`` gives
        the tensor maps' bytes; it is called only where ``map_key`` differs from the last launch's
        (an eager loop over the same arrays skips it)."""
        with self.lock:
            self.pack(self.values, 0, *values)
            if map_key != self.map_key:
                for address, data in zip(self.map_addresses, make_maps()):
                    ctypes.memmove(address, data, MAP_BYTES)
                self.map_key = map_key
            if self.serialized is None:
                _launch_kernel(*self.head, stream_ptr, self.pointers_address, 0)
            else:
                self.serialized_on(stream_ptr).launch(self.pointers_address)

    def serialized_on(self, stream_ptr: int) -> SerializedLaunch:
        """The serialized launch configuration of this kernel on ``stream_ptr`` (made once)."""
        launch = self.serialized.get(stream_ptr)
        if launch is None:
            launch = self.serialized[stream_ptr] = SerializedLaunch(self.function, self.grid, (self.threads, 1, 1),
                                                                    self.shared_bytes, stream_ptr)
        return launch

    def parameters(self, stream_ptr: int, values: tuple, maps: tuple = ()) -> "_Parameters":
        """A parameter block of its own for a launch on ``stream_ptr`` with these values and maps,
        never written again: a repeated call launches it as it is, without packing, locking or
        copying maps (:class:`FastCall`)."""
        block = _Parameters(self.arg_count, values, maps)
        if self.serialized is not None:  # cuLaunchKernelEx and its arguments, made once
            launch = self.serialized_on(stream_ptr)
            block.driver, block.arguments = launch.driver, launch.arguments(block.address)
        return block


class _Parameters:
    """A kernel's parameters laid out as :class:`_Launcher` lays them out, held for a launch to
    pass by address (``cuLaunchKernel`` copies them during the call)."""

    __slots__ = ("values", "maps", "pointers", "address", "driver", "arguments")

    def __init__(self, arg_count: int, values: tuple, maps: tuple):
        self.driver = self.arguments = None  # cuLaunchKernelEx and its arguments, where launches are serialized
        self.values = (ctypes.c_uint64 * arg_count)(*values)
        self.maps = [(ctypes.c_uint64 * (MAP_BYTES // 8)).from_buffer_copy(data) for data in maps]
        base = ctypes.addressof(self.values)
        self.pointers = (ctypes.c_uint64 * (arg_count + len(maps)))(
            *(base + 8 * i for i in range(arg_count)), *(ctypes.addressof(m) for m in self.maps))
        self.address = ctypes.addressof(self.pointers)


@dataclasses.dataclass
class Plan:
    """Everything one pass launch needs, built once; see the module docstring."""

    variant: Variant
    segments: object  # cupy int32 (n_segments, 4)
    units: object  # cupy int32 (n_units, 2)
    table: object  # cupy int32 (entries, 2)
    workspace_floats: int
    counter_count: int
    launcher: _Launcher
    band_rows: int = 1  # fprop/bprop: row tiles per band of the kernel's visiting order
    # stream -> (kernel pointer arguments 3..7, the workspace and counter arrays they point into)
    scratch: dict = dataclasses.field(default_factory=dict)

    def launch(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: tuple,
               accumulate: int) -> None:
        """One launch on ``stream_ptr``; ``sizes`` = (N, ld_act, ld_other, ld_out)."""
        self.launcher.launch(stream_ptr, *self.values(stream_ptr, act_ptr, other_ptr, out_ptr, sizes, accumulate))

    def values(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: tuple,
               accumulate: int) -> tuple:
        """The kernel's integer parameters, in order, for a launch on ``stream_ptr``."""
        return (act_ptr, other_ptr, out_ptr, *self.scratch_for(stream_ptr), *sizes, int(accumulate), self.band_rows)

    def parameters(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: tuple,
                   accumulate: int):
        """The parameters of :meth:`launch` as a block of their own, to launch again as they are."""
        return self.launcher.parameters(stream_ptr,
                                        self.values(stream_ptr, act_ptr, other_ptr, out_ptr, sizes, accumulate))

    def scratch_for(self, stream_ptr: int) -> tuple:
        """Pointers to the tables and to this stream's workspace and counters (allocated once)."""
        entry = self.scratch.get(stream_ptr)
        if entry is None:
            # Counters start at zero and each launch's last part resets the ones it used.
            workspace = cupy.empty(max(1, self.workspace_floats), dtype=np.float32)
            counters = cupy.zeros(max(1, self.counter_count), dtype=np.int32)
            pointers = (self.segments.data.ptr, self.units.data.ptr, self.table.data.ptr,
                        workspace.data.ptr, counters.data.ptr)
            entry = self.scratch[stream_ptr] = (pointers, (workspace, counters))
        return entry[0]


@dataclasses.dataclass
class TmaPlan(Plan):
    """A :class:`Plan` of ``bsmm_matmul_tma`` (Hopper): each launch also passes TMA tensor maps
    (:mod:`bsmm.tensor_maps`) of the activations (N rows of ld_act elements), of the other
    operand (fprop/bprop: the weights as ``block_rows`` rows of one block each; updat: dy as N
    rows of ld_other) and of the output (fprop/bprop: N rows of the output features, ld_out
    apart; updat: the weights' ``block_rows`` rows). On feature axis 0 (updat row groups) x and
    dy are ``feature_rows`` rows of N elements. Boxes are (elements, rows)."""

    act_box: tuple = (64, 64)
    other_box: tuple = (64, 64)
    out_box: tuple | None = None  # None: tiles are not stored through TMA (mma.sync, row groups)
    block_rows: int = 0  # nnzb x block size
    feature_rows: tuple = (0, 0)  # (C, K): the rows of x and dy on feature axis 0

    def launch(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: tuple,
               accumulate: int) -> None:
        # A new output array (each eager call's) changes no map the kernel reads where tiles
        # are not stored through TMA.
        out_key = out_ptr if self.out_box is not None else None
        self.launcher.launch(stream_ptr, *self.values(stream_ptr, act_ptr, other_ptr, out_ptr, sizes, accumulate),
                             map_key=(act_ptr, other_ptr, out_key, sizes),
                             make_maps=lambda: self.maps(act_ptr, other_ptr, out_ptr, sizes))

    def parameters(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: tuple,
                   accumulate: int):
        return self.launcher.parameters(stream_ptr,
                                        self.values(stream_ptr, act_ptr, other_ptr, out_ptr, sizes, accumulate),
                                        self.maps(act_ptr, other_ptr, out_ptr, sizes))

    def maps(self, act_ptr: int, other_ptr: int, out_ptr: int, sizes: tuple) -> tuple[bytes, bytes, bytes]:
        """The activation, other-operand and output tensor maps of a launch (``sizes`` as for
        :meth:`Plan.launch`; fprop/bprop carry the output blocks in ld_other). Only wgmma tiles
        are stored through TMA: mma.sync tiles and updat row groups get zeros for the output map."""
        n, ld_act, ld_other, ld_out = sizes
        bs = self.variant.block_size
        e = ELEMENT_BYTES[self.variant.dtype]
        if self.variant.feature_axis == 0:  # updat row groups: xᵀ and dyᵀ, N columns (past N: zeros)
            return (tensor_map(act_ptr, n, self.feature_rows[0], e * ld_act, *self.act_box, e),
                    tensor_map(other_ptr, n, self.feature_rows[1], e * ld_other, *self.other_box, e), _NO_MAP)
        act = tensor_map(act_ptr, ld_act, n, e * ld_act, *self.act_box, e)
        stored = self.out_box is not None
        if self.variant.pass_name == "updat":
            dy = tensor_map(other_ptr, ld_other, n, e * ld_other, *self.other_box, e)
            return act, dy, tensor_map(out_ptr, bs, self.block_rows, e * bs, *self.out_box, e) if stored else _NO_MAP
        weights = tensor_map(other_ptr, bs, self.block_rows, e * bs, *self.other_box, e)
        return act, weights, tensor_map(out_ptr, ld_other * bs, n, e * ld_out, *self.out_box, e) if stored else _NO_MAP

    @staticmethod
    def boxes(variant: Variant) -> dict:
        """The boxes of ``bsmm_matmul_tma``'s copies (its BOX-column panels) and, for wgmma tiles,
        of its output stores."""
        bm, bn, bk = variant.tile[:3]
        bs = variant.block_size
        if variant.cols > 1 and variant.pass_name == "updat":  # row groups: a block's features by BK batch rows
            box = (bk, bs) if variant.feature_axis == 0 else (bs, bk)
            return dict(act_box=box, other_box=box, out_box=None)
        if variant.cols > 1:  # column groups: a block's features by BM rows, whole weight blocks
            return dict(act_box=(bs, bm), other_box=(bs, bs), out_box=(64, bm))
        wgmma = variant.math in ("wgmma16", "wgmma_tf32")
        box = 128 // ELEMENT_BYTES[variant.dtype] if wgmma else 32  # 128- or 64-byte rows
        out_box = (64, bm) if variant.math == "wgmma16" else None  # (TF32 tiles: fragment stores)
        if variant.pass_name == "updat":
            return dict(act_box=(box, bk), other_box=(box, bk), out_box=out_box)
        return dict(act_box=(bk, bm), other_box=(box, bk) if variant.pass_name == "fprop" else (bk, bn), out_box=out_box)


_NO_MAP = bytes(MAP_BYTES)  # a tensor-map parameter the kernel does not read


def _parts(counts: np.ndarray, part_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut each unit's run of length counts[u] into parts of at most part_length (at least one part)."""
    parts = np.maximum(1, -(-counts // part_length))
    unit_of = np.repeat(np.arange(len(counts)), parts)
    first_part = np.cumsum(parts) - parts
    part_index = np.arange(parts.sum()) - np.repeat(first_part, parts)
    return parts, unit_of, part_index


def _unit_table(parts: np.ndarray) -> np.ndarray:
    """(first workspace slot, parts) per unit; only units cut into several parts use slots."""
    split = np.where(parts > 1, parts, 0)
    first_slot = np.cumsum(split) - split
    return np.stack([first_slot, parts], axis=1).astype(np.int32)


def _block_steps(index: BlockIndex, by_column: bool) -> tuple[np.ndarray, np.ndarray]:
    """Step table of fprop (units = block columns) or bprop (block rows), one block a step.

    Returns (entries (steps, 2) = (weight block, activation feature block), steps per unit).
    """
    ptr = index.colptr if by_column else index.indptr
    entries = index.col_order if by_column else np.arange(index.nnzb)
    operand_blocks = index.rows[entries] if by_column else index.indices
    return np.stack([entries, operand_blocks], axis=1), np.diff(ptr).astype(np.int64)


def _group_steps(index: BlockIndex, by_column: bool, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Step table of column groups: units are ``cols`` adjacent block columns (fprop) or rows
    (bprop); a unit steps over the union of its blocks' rows (columns), in increasing order.

    Returns (entries (steps, 1 + cols) = (activation feature block, weight block of each
    column of the group or -1), steps per unit).
    """
    unit_axis, step_axis = (index.indices, index.rows) if by_column else (index.rows, index.indices)
    n_step_blocks = index.n_block_rows if by_column else index.n_block_cols
    n_out_blocks = index.n_block_cols if by_column else index.n_block_rows
    n_units = -(-n_out_blocks // cols)
    keys = (unit_axis // cols).astype(np.int64) * n_step_blocks + step_axis
    unique_keys, step_of_block = np.unique(keys, return_inverse=True)
    entries = np.full((len(unique_keys), 1 + cols), -1, dtype=np.int64)
    entries[:, 0] = unique_keys % n_step_blocks
    entries[step_of_block, 1 + unit_axis % cols] = np.arange(index.nnzb)
    counts = np.bincount(unique_keys // n_step_blocks, minlength=n_units).astype(np.int64)
    return entries, counts


def _row_groups(index: BlockIndex, cols: int, window: int | None = None) -> np.ndarray:
    """updat row groups: each block row's blocks, in storage order, cut into groups of ``cols``.

    ``window`` (block columns): groups stay inside windows of that many block columns and are
    ordered window by window, so the thread blocks running at one time read the dy panels of
    one window (sized to stay in L2) instead of all of dy.
    Returns (groups, 1 + 2 cols) = (block row, block column of each block or -1, its storage
    index or -1): the blocks of a group share their x tile.
    """
    rows, columns = index.rows.astype(np.int64), index.indices.astype(np.int64)
    band = columns // window if window else np.zeros_like(columns)
    order = np.lexsort((columns, rows, band))  # storage order within a (window, row) run
    run_key = band[order] * index.n_block_rows + rows[order]
    starts = np.flatnonzero(np.r_[True, run_key[1:] != run_key[:-1]])
    lengths = np.diff(np.r_[starts, len(order)])
    per_run = -(-lengths // cols)
    place = np.arange(len(order)) - np.repeat(starts, lengths)
    group = np.repeat(np.cumsum(per_run) - per_run, lengths) + place // cols
    slot = place % cols
    entries = np.full((int(per_run.sum()), 1 + 2 * cols), -1, dtype=np.int64)
    entries[group, 0] = rows[order]
    entries[group, 1 + slot] = columns[order]
    entries[group, 1 + cols + slot] = order
    return entries


def _column_groups(index: BlockIndex, pass_name: str, mode: str, n: int, aligned: bool, arch_key: str,
                   item_bytes: int = 2, tile: tuple | None = None, least: float | None = None):
    """(tile, cols, step table, steps per unit) of a column-group launch where one pays, else None.

    updat: row groups (:func:`_row_groups`; steps per unit is None), a batch past one step only,
    where the groups hold enough blocks on average (``[kernels] group_min_blocks_per_step``).
    ``tile``: the wgmma group tile of :func:`_group_tma_tile` to use instead of the ``mode``
    table's, with the block size's ``wgmma_group_min_blocks_per_step`` (0 if absent) as the threshold.
    ``least``: another threshold for the ``mode`` table's tiles.
    """
    cfg = settings()["kernels"]
    if least is None:
        least = (cfg["group_min_blocks_per_step"] if tile is None
                 else cfg["wgmma_group_min_blocks_per_step"].get(str(index.block_size), 0))
    if tile is None and aligned:
        tile = tile_for(mode, pass_name, index.block_size, n, arch_key, columns=True)
    if tile is None or (pass_name == "updat" and n <= tile[2]):
        return None
    if pass_name == "updat":
        panel = n * index.block_size * item_bytes  # one block column of dy
        window = max(1, cfg["updat_l2_window_bytes"] // panel)
        table, counts = _row_groups(index, tile[6], window), None
    else:
        table, counts = _group_steps(index, pass_name == "fprop", tile[6])
    if index.nnzb < least * max(1, len(table)):
        return None  # too sparse: most steps (groups) would feed one block, as without groups
    return tile[:6], tile[6], table, counts


def _build_plan(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, tf32: bool,
                aligned: bool, device, act_blocks: tuple | None = None,
                weight_blocks: BlockOrder | None = None, act_transposed: bool = False) -> Plan:
    # act_transposed: fprop/bprop on feature axis 0 operands whose output is written on axis 1
    # (TransposedActivations); feature_axis is then 0, which keeps the wgmma and TMA kernels out.
    bs = index.block_size
    mode = math_mode(dtype, pass_name, bs, tf32)
    arch_key = f"sm{device.compute_capability}"
    item_bytes = SUPPORTED_DTYPES[dtype].itemsize
    group_tma = _group_tma_tile(index, pass_name, mode, n, feature_axis, aligned, arch_key, act_blocks, weight_blocks)
    groups = _column_groups(index, pass_name, mode, n, aligned, arch_key, item_bytes, group_tma) if group_tma else None
    on_wgmma_groups = groups is not None
    if groups is None:
        least = settings()["kernels"]["act_transpose_group_min_blocks_per_step"] if act_transposed else None
        groups = _column_groups(index, pass_name, mode, n, aligned, arch_key, item_bytes, least=least)
    tile, cols = (groups[0], groups[1]) if groups else (tile_for(mode, pass_name, bs, n, arch_key), 1)
    wgmma = _wgmma_tile(mode, pass_name, bs, n, feature_axis, aligned, arch_key) if not groups else None
    tma = None
    if on_wgmma_groups:
        mode, tma = "wgmma_tf32" if mode == "tf32" else "wgmma16", tile
    elif wgmma is not None:
        mode, tile = "wgmma16", wgmma
        tma = _tma_tile("tma16", index, pass_name, n, arch_key, act_blocks, weight_blocks)
    elif mode == "tensor16" and not groups and feature_axis == 1 and aligned:
        tma = _tma_tile("tma_mma16", index, pass_name, n, arch_key, act_blocks, weight_blocks)
    elif mode == "tf32" and pass_name == "bprop" and feature_axis == 1 and aligned:
        # TF32 wgmma takes K-major operands only: bprop's dy rows and weight rows are.
        tma = _tma_tile("tma_tf32", index, pass_name, n, arch_key, act_blocks, weight_blocks)
        mode = "wgmma_tf32" if tma else mode
    tile = tma or tile
    bm, bn, bk = tile[:3]
    # A batch no deeper than one step: stream many weight blocks through each thread block.
    grouped = pass_name == "updat" and aligned and 0 < n <= bk
    variant = Variant(dtype, bs, tile, mode, pass_name, feature_axis, aligned, grouped, cols, tma is not None,
                      act_transposed)
    kernel = load_kernel(variant, device.id)
    cfg = settings()["kernels"]
    target_ctas = cfg["waves"] * device.attributes["MultiProcessorCount"]

    if grouped:
        tiles_per_unit = (bs // bm) * (bs // bn)
        group = max(1, min(MAX_PART_BLOCKS, math.ceil(index.nnzb * tiles_per_unit / target_ctas)))
        first = np.arange(0, index.nnzb, group)
        # (first block, end block, -, -): nothing is cut into parts, so no units, workspace or counters.
        segments = np.stack([first, np.minimum(first + group, index.nnzb), 0 * first, 0 * first], axis=1)
        parts = np.ones(0, dtype=np.int64)
        table = np.stack([index.rows, index.indices], axis=1)
        grid_yz = (bs // bm, bs // bn)
    elif pass_name == "updat":
        table = groups[2] if groups else np.stack([index.rows, index.indices], axis=1)
        n_units = len(table)
        tiles_per_unit = 1 if groups else (bs // bm) * (bs // bn)
        ctas_unsplit = max(1, n_units * tiles_per_unit)
        resident = device.attributes["MultiProcessorCount"] * _occupancy(kernel, variant)
        want_parts = _batch_parts(ctas_unsplit, resident, max(1, min(math.ceil(target_ctas / ctas_unsplit),
                                                                      math.ceil(n / (4 * bk)))))
        rows_per_part = bk * math.ceil(math.ceil(n / want_parts) / bk) if n else bk
        counts = np.full(n_units, n, dtype=np.int64)
        parts, unit_of, part_index = _parts(counts, rows_per_part)
        begin = part_index * rows_per_part
        end = np.minimum(begin + rows_per_part, n)
        grid_yz = (1, 1) if groups else (bs // bm, bs // bn)
    else:
        table, counts = groups[2:] if groups else _block_steps(index, pass_name == "fprop")
        ptr = np.concatenate([[0], np.cumsum(counts)])
        n_units = len(counts)
        tiles_per_unit = math.ceil(max(n, 1) / bm) * max(1, bs // bn)
        total = max(1, int(ptr[-1]))
        # Balance: no part much longer than twice the average unit, and enough parts to fill the GPU.
        fill = math.ceil(total * tiles_per_unit / target_ctas)
        shortest = cfg["min_part_blocks"] if mode != "simt" else min(cfg["min_part_blocks"], cfg["min_part_blocks_simt"])
        part_length = max(shortest, min(math.ceil(2 * total / n_units), fill))
        if (tma is not None and mode == "tensor16"
                and n_units * tiles_per_unit >= device.attributes["MultiProcessorCount"]):
            # Small batches through TMA walk whole columns (bsmm.toml) where the columns alone
            # give every SM a thread block; fewer columns are cut to fill the GPU.
            part_length = max(part_length, cfg["tma_mma_min_part_blocks"])
        part_length = min(part_length, MAX_PART_BLOCKS)
        parts, unit_of, part_index = _parts(counts, part_length)
        begin = ptr[unit_of] + part_index * part_length
        end = np.minimum(begin + part_length, ptr[unit_of + 1])
        grid_yz = (math.ceil(max(n, 1) / bm), max(1, bs // bn))

    if act_blocks is not None:  # where each activation block is read (see bsmm.strided.virtual_width)
        column = 0 if (pass_name == "updat" or groups) else 1
        table = np.array(table, dtype=np.int64)
        table[:, column] = np.asarray(act_blocks, dtype=np.int64)[table[:, column]]
    if weight_blocks is not None:  # fprop/bprop: where each weight block is stored (BlockOrder)
        if pass_name == "updat":
            raise NotImplementedError("weight_blocks reorders the weights fprop and bprop read, not updat's output")
        table = np.array(table, dtype=np.int64)
        weights = table[:, 1:] if groups else table[:, :1]
        weights[weights >= 0] = weight_blocks.positions[weights[weights >= 0]]
    if not grouped:
        segments = np.stack([unit_of, begin, end, part_index], axis=1)
        # Longest parts first: the hardware hands out thread blocks roughly in order.
        segments = segments[np.argsort(-(segments[:, 2] - segments[:, 1]), kind="stable")]
    segments = segments.astype(np.int32)
    units = _unit_table(parts)
    split_parts = int(np.where(parts > 1, parts, 0).sum())
    grid = (len(segments), *grid_yz)
    tma_fields = {} if tma is None else dict(TmaPlan.boxes(variant), block_rows=index.nnzb * bs,
                                             feature_rows=(index.C, index.K))
    with device:
        return (TmaPlan if tma else Plan)(
            variant=variant,
            launcher=_Launcher(kernel, grid, variant.threads, variant.shared_bytes, map_count=3 if tma else 0,
                               serialized=_serialized_launches(device)),
            segments=cupy.asarray(segments),
            units=cupy.asarray(units),
            table=cupy.asarray(np.ascontiguousarray(table, dtype=np.int32)),
            workspace_floats=split_parts * tiles_per_unit * bm * bn,
            counter_count=len(parts) * tiles_per_unit,
            band_rows=_band_rows(index, pass_name, dtype),
            **tma_fields,
        )


def _band_rows(index: BlockIndex, pass_name: str, dtype: str) -> int:
    """Row tiles per band of fprop/bprop's visiting order (``banded_tile`` in the kernel): banded
    at the block sizes of ``[kernels] band_block_sizes`` where the weights outgrow
    ``band_min_weight_bytes`` (about half the L2), else 1.

    T fp16, 50 % (weights 64 MiB), bands of 8: block 64 1.05 -> 0.94 ms, block 128 750 -> 666 us
    fprop; at 10 % (13 MiB, in L2) bands lost 5-14 % (the longest-first order of the
    segments is kept only within a band); block 16 at 50 % lost 10 % (there the activation
    tiles that neighbouring thread blocks share are the larger stream).
    """
    cfg = settings()["kernels"]
    weight_bytes = index.nnzb * index.block_size ** 2 * SUPPORTED_DTYPES[dtype].itemsize
    banded = (pass_name != "updat" and index.block_size in cfg["band_block_sizes"]
              and weight_bytes > cfg["band_min_weight_bytes"])
    return cfg["band_rows"] if banded else 1


def _batch_parts(ctas: int, resident: int, most: int) -> int:
    """Into how many parts (1 to ``most``) updat cuts the batch of each of its ``ctas`` tiles.

    Time is taken as whole waves of ``resident`` thread blocks, each 1/parts of the batch
    long: a cut pays where it fills waves the uncut grid leaves idle, and is made only where
    it shortens that time by ``[kernels] updat_cut_gain`` or more, since each cut adds a
    reduction and shortens every thread block's pipeline (T block 128 at 10 %: 410 tiles on
    132 slots, 3 parts 236 us, uncut 165 us). The fewest parts within 10 % of the best.
    """
    def waves(parts: int) -> float:
        return math.ceil(ctas * parts / resident) / parts

    best = min(waves(p) for p in range(1, most + 1))
    if best > (1 - settings()["kernels"]["updat_cut_gain"]) * waves(1):
        return 1
    return next(p for p in range(1, most + 1) if waves(p) <= 1.1 * best)


def _occupancy(kernel, variant) -> int:
    """Thread blocks of ``variant`` one SM holds at once."""
    return max(1, cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
        kernel.kernel.ptr, variant.threads, variant.shared_bytes))


def _wgmma_tile(mode: str, pass_name: str, block_size: int, n: int, feature_axis: int, aligned: bool,
               arch_key: str) -> tuple | None:
    """The sm_90a warpgroup-MMA tile for this pass, or None where the mma.sync kernels run.

    Only half precision, feature axis 1 and aligned operands (the swizzled stages are filled
    by 16-byte copies), N past one 64-row step, and only where ``bsmm.toml`` lists a tile.
    ``BSMM_WGMMA=0`` turns it off, to compare both on one GPU.
    """
    if (mode != "tensor16" or feature_axis != 1 or not aligned or n <= 64 or arch_key != "sm90"
            or os.environ.get("BSMM_WGMMA", "1") == "0"):
        return None
    return tile_for("wgmma16", pass_name, block_size, n, arch_key, optional=True)


def _group_tma_tile(index: BlockIndex, pass_name: str, mode: str, n: int, feature_axis: int, aligned: bool,
                    arch_key: str, act_blocks, weight_blocks) -> tuple | None:
    """The [..., COLS] tile of groups on wgmma in ``bsmm_matmul_tma`` (blocks 16 to 64), or None:
    updat row groups computed transposed (``[kernels.sm90.tma16.updat_rows]``) on the feature
    axes of ``[kernels] updat_rows_tma_axes``, fprop/bprop column groups
    (``[kernels.sm90.tma16.columns]``) on feature axis 1 from ``wgmma_columns_min_rows`` rows;
    half precision, aligned, on sm_90a, with the conditions of :func:`_tma_tile`. TF32: updat
    row groups on feature axis 0 (``[kernels.sm90.tma_tf32.updat_rows]``).
    ``BSMM_WGMMA=0`` turns them off with the other wgmma kernels."""
    cfg = settings()["kernels"]
    if not aligned or os.environ.get("BSMM_WGMMA", "1") == "0":
        return None
    if mode == "tf32":  # TF32 updat row groups on K-major x and dy (feature axis 0: TransposedUpdat's copies)
        if pass_name != "updat" or feature_axis != 0:
            return None
        return _tma_tile("tma_tf32", index, pass_name, n, arch_key, act_blocks, weight_blocks, columns=True)
    axes = cfg["updat_rows_tma_axes"] if pass_name == "updat" else (1,)
    if mode != "tensor16" or feature_axis not in axes:
        return None
    if pass_name != "updat" and n < cfg["wgmma_columns_min_rows"]:
        return None  # too few row tiles: the groups leave SMs idle
    return _tma_tile("tma16", index, pass_name, n, arch_key, act_blocks, weight_blocks, columns=True)


def _tma_tile(table: str, index: BlockIndex, pass_name: str, n: int, arch_key: str, act_blocks,
              weight_blocks, columns: bool = False) -> tuple | None:
    """The tile of ``bsmm_matmul_tma`` (:class:`TmaPlan`) from launch table ``table`` (``tma16``:
    wgmma passes, ``tma_mma16``: mma.sync fprop/bprop), or None.

    Plain layouts only: the step tables of shifted passes (convolutions) may point an
    activation block past the rows a tensor map would describe. wgmma passes of fewer than
    ``[kernels] tma_min_macs`` multiply-adds keep cp.async; mma.sync passes take TMA only at
    ``tma_mma_min_column_blocks`` to ``tma_mma_max_column_blocks`` blocks per block column
    (``bsmm.toml`` says why). ``BSMM_TMA=0`` turns it off, to compare both on one GPU.
    """
    cfg = settings()["kernels"]
    if (act_blocks is not None or weight_blocks is not None or index.nnzb == 0
            or os.environ.get("BSMM_TMA", "1") == "0"):
        return None
    if table == "tma16" and n * index.nnzb * index.block_size ** 2 < cfg["tma_min_macs"]:
        return None  # a pass this short is bound by the host, where a TMA launch costs more
    if table == "tma_mma16" and (pass_name == "updat" or not cfg["tma_mma_min_column_blocks"] <= index.nnzb / max(
            1, index.n_block_cols) <= cfg["tma_mma_max_column_blocks"]):
        return None
    return tile_for(table, pass_name, index.block_size, n, arch_key, columns=columns, optional=True)


_PLANS: "weakref.WeakKeyDictionary[BlockIndex, dict]" = weakref.WeakKeyDictionary()
_PLAN_LOCK = threading.Lock()


def forget_plans() -> None:
    """Drop every cached plan, so that the next call of a pass plans it from the current settings
    (:func:`bsmm.config.overriding`). Operators keep the calls they already made
    (:class:`FastCall`): make new ones."""
    with _PLAN_LOCK:
        _PLANS.clear()


def _copy_row_elements(n: int, item: int) -> int:
    """Elements of one row of a transposed copy: the batch of ``n`` rows padded to 16 bytes."""
    return -(-n * item // 16) * 16 // item


def _per_stream(workspaces: dict, stream_ptr: int, make):
    """The workspace kept for this stream, made by ``make()`` on first use (a CUDA graph captures
    its address, so it stays)."""
    found = workspaces.get(stream_ptr)
    if found is None:
        found = workspaces[stream_ptr] = make()
    return found


def _transpose_launcher(item: int, ld: int, features: int, device) -> _Launcher:
    """A launch of ``transpose_tiles`` (``cuda/bsmm_transpose.cu``) turning an (N, features)
    operand of ``item``-byte elements into its (features, ld) copy."""
    tile = TransposeVariant.TILE
    return _Launcher(load_kernel(TransposeVariant(item), device.id), (-(-ld // tile), -(-features // tile), 1),
                     TransposeVariant.threads, 0, 5, serialized=_serialized_launches(device))


class TransposedActivations:
    """fprop (bprop) on feature axis 1 through a transposed copy of x (dy): one launch of
    ``cuda/bsmm_transpose.cu`` into a workspace, then the pass reading that copy as on feature
    axis 0 and writing its output on axis 1 (``Variant.act_transposed``).

    At block 16 a row of the activations holds a block's features as one 32-byte segment, its
    own cache-line request, and those requests, not the bytes, bound the pass; in the copy every
    row of a tile is whole lines. Used for the block sizes of ``[kernels] act_transpose``,
    float16/bfloat16, batches of at least ``act_transpose_min_rows`` rows and where the copy,
    features x N elements (N rounded up to 16 bytes with zeros), fits
    ``act_transpose_max_bytes``; kept per stream like :class:`TransposedUpdat`'s. Same launch
    interface as :class:`Plan`.
    """

    def __init__(self, index: BlockIndex, pass_name: str, n: int, dtype: str, device):
        self.n = n
        self.features = index.C if pass_name == "fprop" else index.K
        item = ELEMENT_BYTES[dtype]
        self.ld = _copy_row_elements(n, item)
        self.plan = _build_plan(index, pass_name, n, dtype, 0, False, True, device, act_transposed=True)
        self.variant = self.plan.variant
        self.transpose = _transpose_launcher(item, self.ld, self.features, device)
        self.dtype = SUPPORTED_DTYPES[dtype]
        self.workspaces: dict = {}  # stream -> the activations transposed

    @staticmethod
    def wanted(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, aligned: bool) -> bool:
        """Whether this pass of ``n`` rows on ``feature_axis`` takes the transposed copy (see above)."""
        cfg = settings()["kernels"]
        if feature_axis != 1 or not aligned or dtype == "float32" or n < cfg["act_transpose_min_rows"]:
            return False
        item = ELEMENT_BYTES[dtype]
        copy_bytes = (index.C if pass_name == "fprop" else index.K) * _copy_row_elements(n, item) * item
        return index.block_size in cfg["act_transpose"] and copy_bytes <= cfg["act_transpose_max_bytes"]

    def launch(self, stream_ptr: int, act_ptr: int, w_ptr: int, out_ptr: int, sizes: tuple, accumulate: int) -> None:
        act_t = _per_stream(self.workspaces, stream_ptr, lambda: cupy.empty((self.features, self.ld), dtype=self.dtype))
        self.transpose.launch(stream_ptr, act_ptr, act_t.data.ptr, self.n, self.features, self.ld)
        # (n, activation row length, output blocks, output row length): the copy's rows are ld long.
        self.plan.launch(stream_ptr, act_t.data.ptr, w_ptr, out_ptr, (sizes[0], self.ld, *sizes[2:]), accumulate)


class TransposedUpdat:
    """updat on feature axis 1 through transposed copies of x and dy: two launches of
    ``cuda/bsmm_transpose.cu`` into a workspace, then the feature-axis-0 updat over them.

    At block 16 (32) a row of x or dy holds a block's features as one 32 (64)-byte segment,
    its own cache line, and those line requests, not the bytes, bound the pass; transposed,
    every row of a tile is whole lines (T, fp16: block 16 5-6 -> 9-10 % efficiency, block 32
    14-15 -> 15-18 %; ``results/RESULTS.md``, v8). TF32 on Hopper takes it too, for its wgmma
    row groups, which read 32-bit operands K-major only (:func:`_transposes`). Used for
    the block sizes listed in ``[kernels] updat_transpose``, batches of at least
    ``updat_transpose_min_rows`` rows and where the workspace, (C + K) x N elements (N
    rounded up to 16 bytes with zeros), fits ``updat_transpose_max_bytes``;
    the workspace is kept per stream, like a plan's (CUDA graphs capture its address).
    Same launch interface as :class:`Plan`.
    """

    def __init__(self, index: BlockIndex, n: int, dtype: str, device, tf32: bool = False):
        self.n, self.C, self.K = n, index.C, index.K
        item = ELEMENT_BYTES[dtype]
        self.ld = _copy_row_elements(n, item)
        self.plan = _build_plan(index, "updat", n, dtype, 0, tf32, True, device)
        self.variant = self.plan.variant
        self.transpose_x, self.transpose_dy = (_transpose_launcher(item, self.ld, features, device)
                                               for features in (self.C, self.K))
        self.dtype = SUPPORTED_DTYPES[dtype]
        self.workspaces: dict = {}  # stream -> (x transposed, dy transposed)

    @staticmethod
    def workspace_bytes(index: BlockIndex, n: int, item: int = 2) -> int:
        """Bytes of the two transposed copies for a batch of ``n`` rows of ``item``-byte elements."""
        return (index.C + index.K) * _copy_row_elements(n, item) * item

    def launch(self, stream_ptr: int, x_ptr: int, dy_ptr: int, out_ptr: int, sizes: tuple, accumulate: int) -> None:
        x_t, dy_t = _per_stream(self.workspaces, stream_ptr, lambda: (
            cupy.empty((self.C, self.ld), dtype=self.dtype), cupy.empty((self.K, self.ld), dtype=self.dtype)))
        self.transpose_x.launch(stream_ptr, x_ptr, x_t.data.ptr, self.n, self.C, self.ld)
        self.transpose_dy.launch(stream_ptr, dy_ptr, dy_t.data.ptr, self.n, self.K, self.ld)
        self.plan.launch(stream_ptr, x_t.data.ptr, dy_t.data.ptr, out_ptr, (self.n, self.ld, self.ld, 0), accumulate)


class TransposedWeightsFprop:
    """TF32 fprop on Hopper as a bprop over the transposed layout: y = x·W is x·W'ᵀ, W' holding
    each block of W transposed, in the row-major order of the layout's transpose (its
    ``col_order``). TF32 wgmma reads 32-bit operands K-major only: bprop's weight rows are,
    fprop's are not. One launch of ``transpose_blocks`` (``cuda/bsmm_transpose.cu``) writes W'
    into a workspace of nnzb x block² floats, kept per stream like a plan's; then the transposed
    layout's bprop plan runs on W'. Used where that plan is a TF32 wgmma one
    (``[kernels.sm90.tma_tf32]``); same launch interface as :class:`Plan`.
    """

    def __init__(self, index: BlockIndex, n: int, device):
        self.index_t = block_index(np.ascontiguousarray(index.layout.T), index.block_size)
        self.plan = _build_plan(self.index_t, "bprop", n, "float32", 1, True, True, device)
        self.variant = self.plan.variant
        self.order = cupy.asarray(index.col_order, dtype=np.int32)
        transpose = BlockTransposeVariant(index.block_size)
        self.transpose = _Launcher(load_kernel(transpose, device.id), (index.nnzb, transpose.tiles, 1),
                                   transpose.threads, 0, 3, serialized=_serialized_launches(device))
        self.weight_count = index.nnzb * index.block_size ** 2
        self.workspaces: dict = {}  # stream -> W'

    def launch(self, stream_ptr: int, x_ptr: int, w_ptr: int, out_ptr: int, sizes: tuple, accumulate: int) -> None:
        # (n, C, K / block, K) of the fprop are (n, K', C' / block, C') of the transposed bprop.
        w_t = _per_stream(self.workspaces, stream_ptr, lambda: cupy.empty(self.weight_count, dtype=np.float32))
        self.transpose.launch(stream_ptr, w_ptr, w_t.data.ptr, self.order.data.ptr)
        self.plan.launch(stream_ptr, x_ptr, w_t.data.ptr, out_ptr, sizes, accumulate)


def _tf32_wgmma_tile(pass_name: str, block_size: int, n: int, columns: bool = False) -> tuple | None:
    """The ``[kernels.sm90.tma_tf32]`` tile of this pass where the current device is Hopper, else None."""
    if cupy.cuda.Device().compute_capability != "90":
        return None
    return tile_for("tma_tf32", pass_name, block_size, n, "sm90", columns=columns, optional=True)


def _tf32_fprop(index: BlockIndex, n: int, aligned: bool, device) -> TransposedWeightsFprop | None:
    """The :class:`TransposedWeightsFprop` of a TF32 fprop on feature axis 1 where its bprop runs
    on TF32 wgmma, else None."""
    if not aligned or index.nnzb == 0 or _tf32_wgmma_tile("bprop", index.block_size, n) is None:
        return None
    fprop = TransposedWeightsFprop(index, n, device)
    return fprop if fprop.variant.math == "wgmma_tf32" else None


def _transposes(index: BlockIndex, n: int, dtype: str, feature_axis: int, aligned: bool, tf32: bool = False) -> bool:
    """Whether updat takes :class:`TransposedUpdat` (see there). TF32 does on Hopper at the block
    sizes of ``[kernels.sm90.tma_tf32.updat_rows]``: its wgmma row groups need x and dy K-major."""
    cfg = settings()["kernels"]
    if feature_axis != 1 or not aligned or n < cfg["updat_transpose_min_rows"]:
        return False
    if dtype == "float32":
        wanted = tf32 and _tf32_wgmma_tile("updat", index.block_size, n, columns=True) is not None
    else:
        wanted = index.block_size in cfg["updat_transpose"]
    return wanted and TransposedUpdat.workspace_bytes(index, n, ELEMENT_BYTES[dtype]) <= cfg["updat_transpose_max_bytes"]


def plan_for(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, tf32: bool,
             aligned: bool, act_blocks: tuple | None = None, weight_blocks: BlockOrder | None = None,
             transposed: bool = False) -> Plan:
    """The cached plan for this pass on the current device, built on first use
    (``transposed``: the :class:`TransposedUpdat` of an updat on feature axis 1, or the
    :class:`TransposedActivations` of an fprop/bprop there, which the caller asks for: their
    copies assume rows of C and K features). A TF32 fprop gets its
    :class:`TransposedWeightsFprop` where that applies."""
    device_id = cupy.cuda.runtime.getDevice()
    key = (pass_name, n, dtype, feature_axis, tf32, aligned, device_id, act_blocks, weight_blocks, transposed)
    plans = _PLANS.get(index)
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        with _PLAN_LOCK:
            plans = _PLANS.setdefault(index, {})
            plan = plans.get(key)
            if plan is None:
                device = cupy.cuda.Device(device_id)
                plan = None
                if (pass_name == "fprop" and tf32 and dtype == "float32" and feature_axis == 1
                        and act_blocks is None and weight_blocks is None):
                    plan = _tf32_fprop(index, n, aligned, device)
                if transposed:
                    plan = (TransposedUpdat(index, n, dtype, device, tf32) if pass_name == "updat" else
                            TransposedActivations(index, pass_name, n, dtype, device))
                plan = plans[key] = plan or _build_plan(index, pass_name, n, dtype, feature_axis, tf32, aligned,
                                                        device, act_blocks, weight_blocks)
    return plan


def _aligned(feature_axis: int, n: int, *arrays) -> bool:
    item = arrays[0].dtype.itemsize
    if feature_axis == 0 and (n * item) % _VEC_BYTES:
        return False  # rows of length N are not whole 16-byte chunks
    return all(a.data.ptr % _VEC_BYTES == 0 for a in arrays)


class FastCall:
    """A pass that already ran once through the checked path, repeated with only the cheap checks.

    :class:`bsmm.BlocksparseMatMul` keeps one per (pass, activation shape, dtype, feature axis,
    math mode) once the full path (argument checks, plan lookup) has launched it. A call costs
    attribute comparisons against what that path accepted, the output allocation and one
    launch: the eager per-call host time is what bounds small passes (workload S at 2 %).
    Anything that differs (device, strides, the other operand's shape or dtype, alignment,
    an ``out`` that overlaps an input) returns None, and the caller takes the checked path,
    which raises the precise error if there is one.

    The second launch with the same stream, operands and output keeps its parameter block
    (:meth:`Plan.parameters`), and later ones pass it as it is: an eager loop that rotates a
    few buffers neither packs parameters nor copies tensor maps (three 128-byte copies took
    about 5 us of host time per Hopper launch).
    """

    __slots__ = ("plan", "device", "dtype", "act_strides", "other_shape", "other_strides", "out_shape",
                 "out_strides", "aligned", "sizes", "act_bytes", "other_bytes", "out_bytes", "head", "blocks",
                 "seen")

    def __init__(self, plan: Plan, act, other, out, sizes: tuple):
        self.plan, self.device, self.dtype = plan, act.data.device_id, act.dtype
        self.act_strides, self.other_shape, self.other_strides = act.strides, other.shape, other.strides
        self.out_shape, self.out_strides = out.shape, out.strides
        self.act_bytes, self.other_bytes, self.out_bytes = act.nbytes, other.nbytes, out.nbytes
        self.aligned, self.sizes = plan.variant.aligned, sizes
        # A TransposedUpdat (TransposedActivations, TransposedWeightsFprop) launches three (two)
        # kernels: it keeps the plan's own launch.
        self.head = plan.launcher.head if isinstance(plan, Plan) else None
        self.blocks: dict = {}  # (stream, act, other, out, accumulate) -> _Parameters
        self.seen: set = set()  # keys launched once

    def __call__(self, act, other, out=None, accumulate: bool = False):
        device = _get_device()
        act_data, other_data = act.data, other.data
        if (device != self.device or act_data.device_id != device or other.__class__ is not act.__class__
                or other_data.device_id != device or act.strides != self.act_strides
                or other.shape != self.other_shape or other.strides != self.other_strides
                or other.dtype is not self.dtype):
            return None
        act_ptr, other_ptr = act_data.ptr, other_data.ptr
        if self.aligned and (act_ptr | other_ptr) & 15:
            return None
        if out is None:
            out = cupy.ndarray(self.out_shape, self.dtype)
            out_ptr = out.data.ptr
        else:
            if (out.__class__ is not act.__class__ or out.shape != self.out_shape or out.strides != self.out_strides
                    or out.dtype is not self.dtype):
                return None
            out_data = out.data
            out_ptr = out_data.ptr
            if (out_data.device_id != device or (self.aligned and out_ptr & 15)
                    or (out_ptr < act_ptr + self.act_bytes and act_ptr < out_ptr + self.out_bytes)
                    or (out_ptr < other_ptr + self.other_bytes and other_ptr < out_ptr + self.out_bytes)):
                return None
        stream_ptr = _current_stream().ptr
        key = (stream_ptr, act_ptr, other_ptr, out_ptr, accumulate)
        block = self.blocks.get(key)
        if block is None:
            block = self._keep(key)
            if block is None:  # launched through the plan
                return out
        if block.arguments is None:
            _launch_kernel(*self.head, stream_ptr, block.address, 0)
        else:
            result = block.driver(*block.arguments)
            if result:
                raise RuntimeError(f"cuLaunchKernelEx failed (CUresult {result})")
        return out

    def _keep(self, key: tuple):
        """The block to launch for a key seen before, kept from now on; a key seen the first time
        (or any key of a plan that copies first, as TransposedUpdat) launches through the plan
        instead, and gives None."""
        stream_ptr, act_ptr, other_ptr, out_ptr, accumulate = key
        if self.head is None or key not in self.seen:
            if self.head is not None:
                if len(self.seen) >= _MAX_KEPT_LAUNCHES:
                    self.seen.clear()
                self.seen.add(key)
            self.plan.launch(stream_ptr, act_ptr, other_ptr, out_ptr, self.sizes, int(accumulate))
            return None
        if len(self.blocks) >= _MAX_KEPT_LAUNCHES:
            self.blocks.clear()  # e.g. outputs at new addresses every call: keep the dict small
        block = self.blocks[key] = self.plan.parameters(stream_ptr, act_ptr, other_ptr, out_ptr, self.sizes,
                                                        int(accumulate))
        return block


_MAX_KEPT_LAUNCHES = 64


def _sparse_pass(pass_name: str, index: BlockIndex, act, w, out, feature_axis: int, tf32: bool,
                 features_in: int, features_out: int, accumulate: bool) -> FastCall | None:
    n = act.shape[1 - feature_axis]
    if n == 0 or out.size == 0:
        return None
    dtype = DTYPE_NAMES[act.dtype]
    aligned = _aligned(feature_axis, n, act, w, out)
    plan = plan_for(index, pass_name, n, dtype, feature_axis, tf32, aligned,
                    transposed=TransposedActivations.wanted(index, pass_name, n, dtype, feature_axis, aligned))
    ld_act, ld_out = (features_in, features_out) if feature_axis == 1 else (n, n)
    # Column groups read the number of output blocks from the otherwise unused ld_other.
    sizes = (n, ld_act, features_out // index.block_size, ld_out)
    plan.launch(_current_stream().ptr, act.data.ptr, w.data.ptr, out.data.ptr, sizes, int(accumulate))
    return FastCall(plan, act, w, out, sizes)


def fprop(index: BlockIndex, x, w, out, feature_axis: int, tf32: bool = False,
          accumulate: bool = False) -> FastCall | None:
    """y = x·W into ``out`` (CuPy arrays, validated by the caller), added if ``accumulate``; returns the call."""
    return _sparse_pass("fprop", index, x, w, out, feature_axis, tf32, index.C, index.K, accumulate)


def bprop(index: BlockIndex, dy, w, out, feature_axis: int, tf32: bool = False,
          accumulate: bool = False) -> FastCall | None:
    """dx = dy·Wᵀ into ``out``, added if ``accumulate``; returns the call to repeat it."""
    return _sparse_pass("bprop", index, dy, w, out, feature_axis, tf32, index.K, index.C, accumulate)


def updat(index: BlockIndex, x, dy, out, feature_axis: int, accumulate: bool, tf32: bool = False) -> FastCall | None:
    """dW = xᵀ·dy on the present blocks into ``out``, added to it if ``accumulate``; returns the call to repeat it."""
    if out.size == 0:
        return None
    n = x.shape[1 - feature_axis]
    dtype = DTYPE_NAMES[x.dtype]
    aligned = _aligned(feature_axis, n, x, dy, out)
    plan = plan_for(index, "updat", n, dtype, feature_axis, tf32, aligned,
                    transposed=_transposes(index, n, dtype, feature_axis, aligned, tf32))
    ld_x, ld_dy = (index.C, index.K) if feature_axis == 1 else (n, n)
    sizes = (n, ld_x, ld_dy, 0)
    plan.launch(_current_stream().ptr, x.data.ptr, dy.data.ptr, out.data.ptr, sizes, int(accumulate))
    return FastCall(plan, x, dy, out, sizes)


def strided_pass(pass_name: str, index: BlockIndex, act, other, out, rows: int, row_strides: tuple,
                 accumulate: bool = False, tf32: bool = False) -> None:
    """One pass over ``rows`` feature rows (feature axis 1) whose starts are ``row_strides`` apart.

    The building block of implicit GEMMs (:mod:`bsmm.conv`): each kernel offset of a
    convolution is one call whose rows start at a shifted position of one padded input
    and may leave gaps (strides), so no im2col copy is made. ``act``, ``other`` and ``out`` are flat 1-D
    CuPy arrays of one dtype whose element 0 starts the first row; ``row_strides``
    gives the distance in elements between consecutive rows of the two row-major
    operands: (activation, output) for fprop and bprop, (x, dy) for updat. The weight
    operand (``other``, or ``out`` for updat) holds nnzb·bs·bs elements in storage
    order. ``accumulate`` adds into ``out``. Rows must lie inside their flat arrays
    (checked); the output rows of one call must not overlap each other (not checked).
    Same contract as :func:`bsmm.cpu_backend.strided_pass`.
    """
    shifted_pass(pass_name, index, act, other, out, rows, row_strides, None, accumulate, tf32)


def shifted_pass(pass_name: str, index: BlockIndex, act, other, out, rows: int, row_strides: tuple,
                 act_blocks: tuple | None, accumulate: bool = False, tf32: bool = False,
                 weight_blocks: BlockOrder | None = None) -> None:
    """:func:`strided_pass` whose activation block b is read at block ``act_blocks[b]`` of each row.

    One launch then sums blocks that read the activations at different offsets: the kernel's
    step table holds the activation block of every step, and only that table changes
    (:func:`bsmm.strided.virtual_width`). ``act_blocks`` is a tuple (it keys the cached plan).
    ``weight_blocks`` (fprop, bprop): weight block b of the index is block
    ``weight_blocks.positions[b]`` of ``other`` (the step table holds those positions).
    """
    span = virtual_width(pass_name, index, act_blocks) if act_blocks is not None else None
    check_strided_operands(pass_name, index, act, other, out, rows, row_strides, span, weight_blocks)
    if rows == 0:
        return
    stride_a, stride_b = (int(v) for v in row_strides)
    item = act.dtype.itemsize
    aligned = _aligned(1, rows, act, other, out) and all((s * item) % _VEC_BYTES == 0 for s in (stride_a, stride_b))
    plan = plan_for(index, pass_name, rows, DTYPE_NAMES[act.dtype], 1, tf32, aligned, act_blocks, weight_blocks)
    if pass_name == "updat":
        sizes = (rows, stride_a, stride_b, 0)
    else:
        features_out = index.K if pass_name == "fprop" else index.C
        sizes = (rows, stride_a, features_out // index.block_size, stride_b)
    plan.launch(_current_stream().ptr, act.data.ptr, other.data.ptr, out.data.ptr, sizes, int(accumulate))


_GATHERS = {unit: GatherVariant(unit) for unit in (16, 8, 4, 2)}


def gather_rows(dst, src, row_map) -> None:
    """``dst[r] = src[row_map.rows[r]]``, zeros where the map is negative, in one launch on CuPy's
    current stream (``cuda/bsmm_gather_rows.cu``); ``dst`` and ``src`` are C-contiguous 2-D CuPy
    arrays of one dtype and row width, ``row_map`` a :class:`bsmm.row_maps.RowMap`."""
    if len(row_map) != dst.shape[0] or dst.shape[1:] != src.shape[1:]:
        raise ValueError(f"gather_rows: a map of {len(row_map)} rows moves rows of {src.shape[1:]} into "
                         f"{dst.shape[0]} rows of {dst.shape[1:]}")
    rows, row_bytes = dst.shape[0], dst.shape[1] * dst.dtype.itemsize
    if rows == 0 or row_bytes == 0:
        return
    unit = next(u for u in (16, 8, 4, 2) if row_bytes % u == 0 and (dst.data.ptr | src.data.ptr) % u == 0)
    units = row_bytes // unit
    kernel = load_kernel(_GATHERS[unit], _get_device())  # the device row_map.device_array() uses
    across = 32 if units <= 32 else 64 if units <= 64 else 128  # threads along a row, 256 a block
    down = 256 // across
    blocks = min(-(-rows // down), 1 << 20)
    kernel((blocks,), (across, down), (src, dst, row_map.device_array(), np.int64(rows), np.int32(units)))

"""Which kernel path a pass takes, and its launch tables: pure NumPy, no GPU needed.

For one (layout, pass, N, dtype, feature axis, math mode, alignment) on a :class:`Device`,
:func:`select` makes every decision of a launch (the kernel variant from ``bsmm.toml``'s
launch tables, column or row groups, streamed blocks, parts and their reduction, TMA and
wgmma, transposed copies, bands, programmatic launches) and :func:`launch_layout` builds the
step tables, segments and grid of that choice. :mod:`bsmm.backends.cuda.backend` uploads them and
launches; :class:`Path` names the decisions, so that a test (and ``tests/path_census.py``)
can say which path a shape takes without running it (``tests/path_census.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Callable, Iterator

import numpy as np

from bsmm.block_index import BlockIndex
from bsmm.config import settings
from bsmm.dtypes import SUPPORTED_DTYPES
from bsmm.backends.cuda import step_tables
from bsmm.backends.cuda.kernels import ELEMENT_BYTES, MAX_PART_BLOCKS, Variant
from bsmm.backends.strided import BlockOrder

__all__ = ["Device", "Path", "LaunchLayout", "path", "launch_layout", "copies", "device_model", "tile_for",
           "math_mode", "recording_table_lookups"]


@dataclasses.dataclass(frozen=True)
class Device:
    """What the planner needs to know of a GPU: its architecture key (``"sm90"``, ``"sm80"``),
    multiprocessor count, the switches read from the environment when a plan is made
    (``BSMM_WGMMA``, ``BSMM_TMA``, ``BSMM_PDL``) and how many thread blocks of a variant one
    multiprocessor holds (``occupancy``: the driver's answer on a GPU, an estimate in
    :func:`device_model`)."""

    arch: str
    sm_count: int
    occupancy: Callable[[Variant], int] = dataclasses.field(compare=False)
    wgmma: bool = True
    tma: bool = True
    programmatic: bool = True

    @classmethod
    def with_environment(cls, arch: str, sm_count: int, occupancy) -> "Device":
        """The device as the environment switches of this moment leave it."""
        return cls(arch, sm_count, occupancy, wgmma=os.environ.get("BSMM_WGMMA", "1") != "0",
                   tma=os.environ.get("BSMM_TMA", "1") != "0",
                   programmatic=(int(arch[2:]) >= 90 and settings()["kernels"]["programmatic_launch"]
                                 and os.environ.get("BSMM_PDL", "1") != "0"))


def estimated_occupancy(variant: Variant) -> int:
    """Thread blocks of ``variant`` per multiprocessor on an H100 (228 KiB of shared memory, 64K
    registers, 2048 threads), registers taken as the accumulators plus 64 a thread; the GPU
    backend asks the driver instead."""
    bm, bn = variant.tile[:2]
    threads = variant.threads
    registers = min(255, bm * bn // max(1, threads - (32 if variant.tma else 0)) + 64)
    by_shared = (228 * 1024) // (variant.shared_bytes + 1024 + 8 * MAX_PART_BLOCKS)
    return max(1, min(32, 2048 // threads, 65536 // (threads * registers), by_shared))


def device_model(arch: str = "sm90", sm_count: int = 132, **switches) -> Device:
    """A :class:`Device` without a GPU: an H100 by default, occupancy estimated
    (:func:`estimated_occupancy`); ``switches`` as :class:`Device`'s (programmatic launches
    follow the architecture unless given)."""
    switches.setdefault("programmatic", int(arch[2:]) >= 90 and settings()["kernels"]["programmatic_launch"])
    return Device(arch, sm_count, estimated_occupancy, **switches)


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
        table, counts = step_tables.row_groups(index, tile[6], window), None
    else:
        table, counts = step_tables.group_steps(index, pass_name == "fprop", tile[6])
    if index.nnzb < least * max(1, len(table)):
        return None  # too sparse: most steps (groups) would feed one block, as without groups
    return tile[:6], tile[6], table, counts


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


def _wgmma_tile(mode: str, pass_name: str, block_size: int, n: int, feature_axis: int, aligned: bool,
                device: Device) -> tuple | None:
    """The sm_90a warpgroup-MMA tile for this pass, or None where the mma.sync kernels run.

    Only half precision, feature axis 1 and aligned operands (the swizzled stages are filled
    by 16-byte copies), N past one 64-row step, and only where ``bsmm.toml`` lists a tile.
    ``BSMM_WGMMA=0`` turns it off, to compare both on one GPU.
    """
    if mode != "tensor16" or feature_axis != 1 or not aligned or n <= 64 or device.arch != "sm90" or not device.wgmma:
        return None
    return tile_for("wgmma16", pass_name, block_size, n, device.arch, optional=True)


def _group_tma_tile(index: BlockIndex, pass_name: str, mode: str, n: int, feature_axis: int, aligned: bool,
                    device: Device, act_blocks, weight_blocks) -> tuple | None:
    """The [..., COLS] tile of groups on wgmma in ``bsmm_matmul_tma`` (blocks 16 to 64), or None:
    updat row groups computed transposed (``[kernels.sm90.tma16.updat_rows]``) on the feature
    axes of ``[kernels] updat_rows_tma_axes``, fprop/bprop column groups
    (``[kernels.sm90.tma16.columns]``) on feature axis 1 from ``wgmma_columns_min_rows`` rows;
    half precision, aligned, on sm_90a, with the conditions of :func:`_tma_tile`. TF32: updat
    row groups on feature axis 0 (``[kernels.sm90.tma_tf32.updat_rows]``).
    ``BSMM_WGMMA=0`` turns them off with the other wgmma kernels."""
    cfg = settings()["kernels"]
    if not aligned or not device.wgmma:
        return None
    if mode == "tf32":  # TF32 updat row groups on K-major x and dy (feature axis 0: TransposedUpdat's copies)
        if pass_name != "updat" or feature_axis != 0:
            return None
        return _tma_tile("tma_tf32", index, pass_name, n, device, act_blocks, weight_blocks, columns=True)
    axes = cfg["updat_rows_tma_axes"] if pass_name == "updat" else (1,)
    if mode != "tensor16" or feature_axis not in axes:
        return None
    if pass_name != "updat" and n < cfg["wgmma_columns_min_rows"]:
        return None  # too few row tiles: the groups leave SMs idle
    return _tma_tile("tma16", index, pass_name, n, device, act_blocks, weight_blocks, columns=True)


def _tma_tile(table: str, index: BlockIndex, pass_name: str, n: int, device: Device, act_blocks,
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
    if act_blocks is not None or weight_blocks is not None or index.nnzb == 0 or not device.tma:
        return None
    if table == "tma16" and n * index.nnzb * index.block_size ** 2 < cfg["tma_min_macs"]:
        return None  # a pass this short is bound by the host, where a TMA launch costs more
    if table == "tma_mma16" and (pass_name == "updat" or not cfg["tma_mma_min_column_blocks"] <= index.nnzb / max(
            1, index.n_block_cols) <= cfg["tma_mma_max_column_blocks"]):
        return None
    return tile_for(table, pass_name, index.block_size, n, device.arch, columns=columns, optional=True)




def tma_boxes(variant: Variant) -> dict:
    """The boxes of ``bsmm_matmul_tma``'s copies (its BOX-column panels) and, for wgmma tiles,
    of its output stores (the fields of ``plans.TmaPlan``)."""
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


@dataclasses.dataclass(frozen=True)
class Path:
    """The decisions behind one pass's launch, as :func:`path` makes them.

    ``copies``: what is transposed into a workspace before the kernel runs: ``""`` (nothing),
    ``"x+dy"`` (updat on feature axis 1 reading both transposed), ``"x"`` / ``"dy"`` (fprop /
    bprop reading its activations transposed) or ``"w"`` (TF32 fprop as the bprop of the
    transposed layout over transposed weight blocks). ``variant``: the kernel instance (tile
    from a launch-table entry, math, the feature axis it reads, aligned copies, streamed
    blocks, column/row groups, TMA). ``streaming``: updat with the whole batch in one step,
    ``"one"`` or ``"several"`` blocks per thread block (``""`` otherwise). ``parts``: some
    output tile is summed from parts in a float32 workspace. ``banded``: fprop/bprop visit
    their tiles in bands. ``programmatic``: launched with programmatic stream serialization.
    """

    pass_name: str
    copies: str
    variant: Variant
    streaming: str
    parts: bool
    banded: bool
    programmatic: bool

    def describe(self) -> str:
        """One line: the pass and each decision, e.g. for a census table or a failure message."""
        v = self.variant
        flags = [name for name, on in (("aligned", v.aligned), ("tma", v.tma), ("parts", self.parts),
                                       ("banded", self.banded), ("pdl", self.programmatic)) if on]
        if self.copies:
            flags.insert(0, f"copies={self.copies}")
        if self.streaming:
            flags.append(f"streaming={self.streaming}")
        if v.cols > 1:
            flags.append(f"{'rows' if v.pass_name == 'updat' else 'columns'}={v.cols}")
        return (f"{self.pass_name} {v.dtype} bs{v.block_size} {v.math} axis{v.feature_axis} "
                f"tile={list(v.tile)} {' '.join(flags)}")


@dataclasses.dataclass
class LaunchLayout:
    """The host tables and grid of one kernel launch (uploaded by :mod:`bsmm.backends.cuda.plans`)."""

    variant: Variant
    segments: np.ndarray  # int32 (n_segments, 4)
    units: np.ndarray  # int32 (n_units, 2)
    table: np.ndarray  # int32 (entries, 2 or more)
    grid: tuple
    workspace_floats: int
    counter_count: int
    band_rows: int
    tma_fields: dict
    streaming: str


def launch_layout(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, tf32: bool,
                  aligned: bool, device: Device, act_blocks: tuple | None = None,
                  weight_blocks: BlockOrder | None = None, act_transposed: bool = False) -> LaunchLayout:
    """Every decision of one kernel launch and its tables.

    act_transposed: fprop/bprop on feature axis 0 operands whose output is written on axis 1
    (``plans.TransposedActivations``); feature_axis is then 0, which keeps the wgmma and
    TMA kernels out.
    """
    bs = index.block_size
    mode = math_mode(dtype, pass_name, bs, tf32)
    arch_key = device.arch
    item_bytes = SUPPORTED_DTYPES[dtype].itemsize
    group_tma = _group_tma_tile(index, pass_name, mode, n, feature_axis, aligned, device, act_blocks, weight_blocks)
    groups = _column_groups(index, pass_name, mode, n, aligned, arch_key, item_bytes, group_tma) if group_tma else None
    on_wgmma_groups = groups is not None
    if groups is None:
        least = settings()["kernels"]["act_transpose_group_min_blocks_per_step"] if act_transposed else None
        groups = _column_groups(index, pass_name, mode, n, aligned, arch_key, item_bytes, least=least)
    tile, cols = (groups[0], groups[1]) if groups else (tile_for(mode, pass_name, bs, n, arch_key), 1)
    wgmma = _wgmma_tile(mode, pass_name, bs, n, feature_axis, aligned, device) if not groups else None
    tma = None
    if on_wgmma_groups:
        mode, tma = "wgmma_tf32" if mode == "tf32" else "wgmma16", tile
    elif wgmma is not None:
        mode, tile = "wgmma16", wgmma
        tma = _tma_tile("tma16", index, pass_name, n, device, act_blocks, weight_blocks)
    elif mode == "tensor16" and not groups and feature_axis == 1 and aligned:
        tma = _tma_tile("tma_mma16", index, pass_name, n, device, act_blocks, weight_blocks)
    elif mode == "tf32" and pass_name == "bprop" and feature_axis == 1 and aligned:
        # TF32 wgmma takes K-major operands only: bprop's dy rows and weight rows are.
        tma = _tma_tile("tma_tf32", index, pass_name, n, device, act_blocks, weight_blocks)
        mode = "wgmma_tf32" if tma else mode
    tile = tma or tile
    bm, bn, bk = tile[:3]
    # A batch no deeper than one step: stream many weight blocks through each thread block.
    grouped = pass_name == "updat" and aligned and 0 < n <= bk
    variant = Variant(dtype, bs, tile, mode, pass_name, feature_axis, aligned, grouped, cols, tma is not None,
                      act_transposed)
    cfg = settings()["kernels"]
    target_ctas = cfg["waves"] * device.sm_count
    streaming = ""

    if grouped:
        tiles_per_unit = (bs // bm) * (bs // bn)
        group = max(1, min(MAX_PART_BLOCKS, math.ceil(index.nnzb * tiles_per_unit / target_ctas)))
        streaming = "several" if group > 1 else "one"
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
        resident = device.sm_count * device.occupancy(variant)
        want_parts = _batch_parts(ctas_unsplit, resident, max(1, min(math.ceil(target_ctas / ctas_unsplit),
                                                                      math.ceil(n / (4 * bk)))))
        rows_per_part = bk * math.ceil(math.ceil(n / want_parts) / bk) if n else bk
        counts = np.full(n_units, n, dtype=np.int64)
        parts, unit_of, part_index = step_tables.parts(counts, rows_per_part)
        begin = part_index * rows_per_part
        end = np.minimum(begin + rows_per_part, n)
        grid_yz = (1, 1) if groups else (bs // bm, bs // bn)
    else:
        table, counts = groups[2:] if groups else step_tables.block_steps(index, pass_name == "fprop")
        ptr = np.concatenate([[0], np.cumsum(counts)])
        n_units = len(counts)
        tiles_per_unit = math.ceil(max(n, 1) / bm) * max(1, bs // bn)
        total = max(1, int(ptr[-1]))
        # Balance: no part much longer than twice the average unit, and enough parts to fill the GPU.
        fill = math.ceil(total * tiles_per_unit / target_ctas)
        shortest = cfg["min_part_blocks"] if mode != "simt" else min(cfg["min_part_blocks"], cfg["min_part_blocks_simt"])
        part_length = max(shortest, min(math.ceil(2 * total / n_units), fill))
        if tma is not None and mode == "tensor16" and n_units * tiles_per_unit >= device.sm_count:
            # Small batches through TMA walk whole columns (bsmm.toml) where the columns alone
            # give every SM a thread block; fewer columns are cut to fill the GPU.
            part_length = max(part_length, cfg["tma_mma_min_part_blocks"])
        part_length = min(part_length, MAX_PART_BLOCKS)
        parts, unit_of, part_index = step_tables.parts(counts, part_length)
        begin = ptr[unit_of] + part_index * part_length
        end = np.minimum(begin + part_length, ptr[unit_of + 1])
        grid_yz = (math.ceil(max(n, 1) / bm), max(1, bs // bn))

    if act_blocks is not None:  # where each activation block is read (see bsmm.backends.strided.virtual_width)
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
    split_parts = int(np.where(parts > 1, parts, 0).sum())
    tma_fields = {} if tma is None else dict(tma_boxes(variant), block_rows=index.nnzb * bs,
                                             feature_rows=(index.C, index.K))
    return LaunchLayout(variant=variant, segments=segments.astype(np.int32), units=step_tables.unit_table(parts),
                        table=np.ascontiguousarray(table, dtype=np.int32), grid=(len(segments), *grid_yz),
                        workspace_floats=split_parts * tiles_per_unit * bm * bn,
                        counter_count=len(parts) * tiles_per_unit, band_rows=_band_rows(index, pass_name, dtype),
                        tma_fields=tma_fields, streaming=streaming)


def copy_row_elements(n: int, item: int) -> int:
    """Elements of one row of a transposed copy: the batch of ``n`` rows padded to 16 bytes."""
    return -(-n * item // 16) * 16 // item


def transposes_activations(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int,
                           aligned: bool) -> bool:
    """Whether fprop (bprop) of ``n`` rows on ``feature_axis`` reads a transposed copy of x (dy)
    (``plans.TransposedActivations``): half precision on feature axis 1 at the block
    sizes of ``[kernels] act_transpose``, from ``act_transpose_min_rows`` rows, where the copy,
    features x N elements (N rounded up to 16 bytes), fits ``act_transpose_max_bytes``."""
    cfg = settings()["kernels"]
    if feature_axis != 1 or not aligned or dtype == "float32" or n < cfg["act_transpose_min_rows"]:
        return False
    item = ELEMENT_BYTES[dtype]
    copy_bytes = (index.C if pass_name == "fprop" else index.K) * copy_row_elements(n, item) * item
    return index.block_size in cfg["act_transpose"] and copy_bytes <= cfg["act_transpose_max_bytes"]


def updat_copy_bytes(index: BlockIndex, n: int, item: int = 2) -> int:
    """Bytes of updat's two transposed copies for a batch of ``n`` rows of ``item``-byte elements."""
    return (index.C + index.K) * copy_row_elements(n, item) * item


def _tf32_wgmma_tile(pass_name: str, block_size: int, n: int, device: Device, columns: bool = False) -> tuple | None:
    """The ``[kernels.sm90.tma_tf32]`` tile of this pass on a Hopper ``device``, else None."""
    if device.arch != "sm90":
        return None  # no sm_90 tables: nothing to transpose for
    return tile_for("tma_tf32", pass_name, block_size, n, "sm90", columns=columns, optional=True)


def transposes_updat(index: BlockIndex, n: int, dtype: str, feature_axis: int, aligned: bool, device: Device,
                     tf32: bool = False) -> bool:
    """Whether updat reads transposed copies of x and dy (``plans.TransposedUpdat``): half
    precision at the block sizes of ``[kernels] updat_transpose``, TF32 on Hopper at those of
    ``[kernels.sm90.tma_tf32.updat_rows]`` (its wgmma row groups need x and dy K-major); feature
    axis 1, aligned, from ``updat_transpose_min_rows`` rows, copies within ``updat_transpose_max_bytes``."""
    cfg = settings()["kernels"]
    if feature_axis != 1 or not aligned or n < cfg["updat_transpose_min_rows"]:
        return False
    if dtype == "float32":
        wanted = tf32 and _tf32_wgmma_tile("updat", index.block_size, n, device, columns=True) is not None
    else:
        wanted = index.block_size in cfg["updat_transpose"]
    return wanted and updat_copy_bytes(index, n, ELEMENT_BYTES[dtype]) <= cfg["updat_transpose_max_bytes"]


def transposed_layout(index: BlockIndex) -> BlockIndex:
    """The index of the transposed layout (TF32 fprop runs as its bprop)."""
    from bsmm.block_index import block_index

    return block_index(np.ascontiguousarray(index.layout.T), index.block_size)


def transposes_weights(index: BlockIndex, n: int, dtype: str, feature_axis: int, tf32: bool, aligned: bool,
                       device: Device, plain: bool = True) -> bool:
    """Whether fprop runs as the TF32 wgmma bprop of the transposed layout over transposed weight
    blocks (``plans.TransposedWeightsFprop``): TF32 on feature axis 1, aligned, a plain
    layout, where that bprop is a TF32 wgmma one."""
    if (dtype != "float32" or not tf32 or feature_axis != 1 or not plain or not aligned or index.nnzb == 0
            or _tf32_wgmma_tile("bprop", index.block_size, n, device) is None):
        return False
    return launch_layout(transposed_layout(index), "bprop", n, "float32", 1, True, True, device).variant.math == \
        "wgmma_tf32"


def copies(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, tf32: bool, aligned: bool,
           device: Device) -> str:
    """What a plain pass (no shifted activations, no reordered weights) transposes before its
    kernel: ``""``, ``"x+dy"``, ``"x"``, ``"dy"`` or ``"w"`` (see :class:`Path`)."""
    if pass_name == "updat":
        return "x+dy" if transposes_updat(index, n, dtype, feature_axis, aligned, device, tf32) else ""
    if transposes_activations(index, pass_name, n, dtype, feature_axis, aligned):
        return "x" if pass_name == "fprop" else "dy"
    if pass_name == "fprop" and transposes_weights(index, n, dtype, feature_axis, tf32, aligned, device):
        return "w"
    return ""


def path(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, tf32: bool, aligned: bool,
         device: Device) -> Path:
    """The :class:`Path` a plain pass of ``n`` rows takes on ``device`` (what :mod:`bsmm.backends.cuda.plans`
    would launch), computed without a GPU.

    Examples
    --------
    >>> import numpy as np, bsmm
    >>> index = bsmm.block_index(np.ones((64, 64)), 32)
    >>> p = path(index, "updat", 8, "float16", 1, False, True, device_model())
    >>> p.variant.math, p.streaming, p.variant.tile[2]
    ('tensor16', 'several', 16)
    """
    copied = copies(index, pass_name, n, dtype, feature_axis, tf32, aligned, device)
    if copied == "w":
        layout = launch_layout(transposed_layout(index), "bprop", n, dtype, 1, True, True, device)
    elif copied:  # the kernel reads the copies as on feature axis 0, aligned
        layout = launch_layout(index, pass_name, n, dtype, 0, tf32, True, device,
                               act_transposed=pass_name != "updat")
    else:
        layout = launch_layout(index, pass_name, n, dtype, feature_axis, tf32, aligned, device)
    return layout_path(pass_name, copied, layout, device)


def layout_path(pass_name: str, copied: str, layout: LaunchLayout, device: Device) -> Path:
    """The :class:`Path` of a launch laid out as ``layout``."""
    return Path(pass_name, copied, layout.variant, layout.streaming, layout.workspace_floats > 0,
                layout.band_rows > 1, device.programmatic)

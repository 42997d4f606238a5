"""Which kernel a pass runs with: every decision of a launch, made from a :class:`Policy`.

For one (layout, pass, N, dtype, feature axis, math mode, alignment) on a :class:`Device`,
:func:`select` picks the kernel :class:`~bsmm.backends.cuda.kernels.Variant` (tile from the
policy's launch tables, math, column or row groups, streamed blocks, TMA, wgmma) and returns
it as a :class:`Selection`; :func:`copies` says what a plain pass transposes before its
kernel. Pure NumPy and no settings: everything tunable comes in the policy
(:mod:`bsmm.backends.cuda.policy`). :mod:`bsmm.backends.cuda.planner` lays the chosen launch out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from bsmm.block_index import BlockIndex, block_index
from bsmm.backends.cuda import step_tables
from bsmm.backends.cuda.kernels import ELEMENT_BYTES, Variant, tiling_problem
from bsmm.backends.cuda.policy import GroupTile, Policy, Tile
from bsmm.passes import PASSES

__all__ = ["Device", "Groups", "Selection", "select", "math_mode", "column_groups", "band_rows", "batch_parts",
           "wgmma_tile", "group_tma_tile", "tma_tile", "copies", "copy_row_elements", "updat_copy_bytes",
           "transposes_activations", "transposes_updat", "transposes_weights", "transposed_layout"]


@dataclasses.dataclass(frozen=True)
class Device:
    """What the planner needs to know of a GPU: its architecture key (``"sm90"``, ``"sm80"``),
    multiprocessor count and how many thread blocks of a variant one multiprocessor holds
    (``occupancy``: the driver's answer on a GPU, an estimate in
    :func:`bsmm.backends.cuda.planner.device_model`)."""

    arch: str
    sm_count: int
    occupancy: Callable[[Variant], int] = dataclasses.field(compare=False)


def math_mode(dtype: str, pass_name: str, block_size: int, tf32: bool) -> str:
    """simt, tf32 or tensor16: how a pass multiplies for this dtype and block size."""
    if PASSES[pass_name].updates_weights and block_size < 16:
        return "simt"  # an 8x8 weight block is smaller than one 16-row tensor-core tile
    if dtype == "float32":
        return "tf32" if tf32 else "simt"
    return "tensor16"


@dataclasses.dataclass(frozen=True, eq=False)
class Groups:
    """Column groups (fprop/bprop: output tiles spanning ``size`` block columns or rows) or updat
    row groups (``size`` weight blocks of a block row per thread block): the tile, the step
    table and, for column groups, the steps of each group."""

    tile: Tile
    size: int
    table: np.ndarray
    counts: np.ndarray | None


def column_groups(index: BlockIndex, pass_name: str, mode: str, n: int, aligned: bool, arch: str, policy: Policy,
                  item_bytes: int = 2, entry: GroupTile | None = None, least: float | None = None) -> Groups | None:
    """The groups of a launch where they pay, else None.

    updat: row groups, a batch past one step only. Groups are taken where they hold enough
    blocks on average (the policy's ``group_min_blocks_per_step``). ``entry``: the wgmma group
    entry of :func:`group_tma_tile` to use instead of the ``mode`` table's, with the block
    size's ``wgmma_group_min_blocks_per_step`` (0 if absent) as the threshold. ``least``:
    another threshold for the ``mode`` table's entries.
    """
    if least is None:
        least = (policy.group_min_blocks_per_step if entry is None
                 else policy.wgmma_group_min_blocks_per_step.get(index.block_size, 0))
    if entry is None and aligned:
        entry = policy.group_tile(mode, pass_name, index.block_size, n, arch)
    updat = PASSES[pass_name].updates_weights
    if entry is None or (updat and n <= entry.tile.bk):
        return None
    if updat:
        panel = n * index.block_size * item_bytes  # one block column of dy
        window = max(1, policy.updat_l2_window_bytes // panel)
        table, counts = step_tables.row_groups(index, entry.size, window), None
    else:
        table, counts = step_tables.group_steps(index, PASSES[pass_name].walks_block_columns, entry.size)
    if index.nnzb < least * max(1, len(table)):
        return None  # too sparse: most steps (groups) would feed one block, as without groups
    return Groups(entry.tile, entry.size, table, counts)


def band_rows(index: BlockIndex, pass_name: str, dtype: str, policy: Policy) -> int:
    """Row tiles per band of fprop/bprop's visiting order (``banded_tile`` in the kernel): banded
    at the policy's ``band_block_sizes`` where the weights outgrow ``band_min_weight_bytes``
    (about half the L2), else 1. Outside those, bands lost time: the longest-first order of the
    segments is kept only within a band (``results/archive/launch_table_notes.md``)."""
    weight_bytes = index.nnzb * index.block_size ** 2 * ELEMENT_BYTES[dtype]
    banded = (not PASSES[pass_name].updates_weights and index.block_size in policy.band_block_sizes
              and weight_bytes > policy.band_min_weight_bytes)
    return policy.band_rows if banded else 1


def batch_parts(ctas: int, resident: int, most: int, cut_gain: float) -> int:
    """Into how many parts (1 to ``most``) updat cuts the batch of each of its ``ctas`` tiles.

    Time is taken as whole waves of ``resident`` thread blocks, each 1/parts of the batch
    long: a cut pays where it fills waves the uncut grid leaves idle, and is made only where
    it shortens that time by ``cut_gain`` or more, since each cut adds a reduction and
    shortens every thread block's pipeline. The fewest parts within 10 % of the best.

    >>> batch_parts(ctas=66, resident=132, most=4, cut_gain=0.25), batch_parts(400, 132, 4, 0.25)
    (2, 1)
    """
    def waves(parts: int) -> float:
        return math.ceil(ctas * parts / resident) / parts

    best = min(waves(p) for p in range(1, most + 1))
    if best > (1 - cut_gain) * waves(1):
        return 1
    return next(p for p in range(1, most + 1) if waves(p) <= 1.1 * best)


def wgmma_tile(mode: str, pass_name: str, block_size: int, n: int, feature_axis: int, aligned: bool,
               device: Device, policy: Policy) -> Tile | None:
    """The sm_90a warpgroup-MMA tile for this pass, or None where the mma.sync kernels run.

    Only half precision, feature axis 1 and aligned operands (the swizzled stages are filled
    by 16-byte copies), N past one 64-row step, only where the policy lists a tile and allows
    wgmma.
    """
    if mode != "tensor16" or feature_axis != 1 or not aligned or n <= 64 or device.arch != "sm90" or not policy.wgmma:
        return None
    return policy.tile("wgmma16", pass_name, block_size, n, device.arch, optional=True)


def group_tma_tile(index: BlockIndex, pass_name: str, mode: str, n: int, feature_axis: int, aligned: bool,
                   device: Device, policy: Policy, act_blocks, weight_blocks) -> GroupTile | None:
    """The group entry of wgmma groups in ``bsmm_matmul_tma`` (blocks 16 to 64), or None: updat
    row groups computed transposed (``tma16.updat_rows``) on the policy's
    ``updat_rows_tma_axes``, fprop/bprop column groups (``tma16.columns``) on feature axis 1
    from ``wgmma_columns_min_rows`` rows; half precision, aligned, on sm_90a, with the
    conditions of :func:`tma_tile`. TF32: updat row groups on feature axis 0
    (``tma_tf32.updat_rows``). Off where the policy turns wgmma off."""
    if not aligned or not policy.wgmma:
        return None
    updat = PASSES[pass_name].updates_weights
    if mode == "tf32":  # TF32 updat row groups on K-major x and dy (feature axis 0: TransposedUpdat's copies)
        if not updat or feature_axis != 0:
            return None
        return tma_tile("tma_tf32", index, pass_name, n, device, policy, act_blocks, weight_blocks, groups=True)
    axes = policy.updat_rows_tma_axes if updat else (1,)
    if mode != "tensor16" or feature_axis not in axes:
        return None
    if not updat and n < policy.wgmma_columns_min_rows:
        return None  # too few row tiles: the groups leave SMs idle
    return tma_tile("tma16", index, pass_name, n, device, policy, act_blocks, weight_blocks, groups=True)


def tma_tile(table: str, index: BlockIndex, pass_name: str, n: int, device: Device, policy: Policy, act_blocks,
             weight_blocks, groups: bool = False):
    """The tile (with ``groups``, the :class:`GroupTile`) of ``bsmm_matmul_tma`` from launch
    table ``table`` (``tma16``: wgmma passes, ``tma_mma16``: mma.sync fprop/bprop), or None.

    Plain layouts only: the step tables of shifted passes (convolutions) may point an
    activation block past the rows a tensor map would describe. wgmma passes of fewer than
    ``tma_min_macs`` multiply-adds keep cp.async; mma.sync passes take TMA only at
    ``tma_mma_min_column_blocks`` to ``tma_mma_max_column_blocks`` blocks per block column and,
    at up to ``tma_mma_stream_max_rows`` rows, weights of at most ``tma_mma_max_stream_bytes``.
    Off where the policy turns TMA off.
    """
    if act_blocks is not None or weight_blocks is not None or index.nnzb == 0 or not policy.tma:
        return None
    if table == "tma16" and n * index.nnzb * index.block_size ** 2 < policy.tma_min_macs:
        return None  # a pass this short is bound by the host, where a TMA launch costs more
    if table == "tma_mma16" and (PASSES[pass_name].updates_weights or not policy.tma_mma_min_column_blocks
                                 <= index.nnzb / max(1, index.n_block_cols) <= policy.tma_mma_max_column_blocks):
        return None
    if (table == "tma_mma16" and n <= policy.tma_mma_stream_max_rows
            and index.nnzb * index.block_size ** 2 * 2 > policy.tma_mma_max_stream_bytes):
        return None  # weights streamed from memory at a few rows: cp.async runs them faster (bsmm.toml)
    if groups:
        return policy.group_tile(table, pass_name, index.block_size, n, device.arch)
    return policy.tile(table, pass_name, index.block_size, n, device.arch, optional=True)


@dataclasses.dataclass(frozen=True, eq=False)
class Selection:
    """The kernel a launch runs (``variant``) and, where it runs in groups, their tables."""

    variant: Variant
    groups: Groups | None


def select(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, tf32: bool, aligned: bool,
           device: Device, policy: Policy, act_blocks=None, weight_blocks=None,
           act_transposed: bool = False) -> Selection:
    """The kernel of one launch: wgmma groups, else groups of the ``mode`` table, else one tile
    (wgmma, TMA mma.sync or TF32 wgmma where they apply, cp.async otherwise).

    act_transposed: fprop/bprop on feature axis 0 operands whose output is written on axis 1
    (``plans.TransposedActivations``); feature_axis is then 0, which keeps the wgmma and
    TMA kernels out. Raises ``ValueError`` where the policy's table gives a tile the kernel
    template cannot build (:func:`bsmm.backends.cuda.kernels.tiling_problem`).
    """
    bs = index.block_size
    mode = math_mode(dtype, pass_name, bs, tf32)
    item_bytes = ELEMENT_BYTES[dtype]
    group_entry = group_tma_tile(index, pass_name, mode, n, feature_axis, aligned, device, policy, act_blocks,
                                 weight_blocks)
    groups = column_groups(index, pass_name, mode, n, aligned, device.arch, policy, item_bytes,
                           group_entry) if group_entry else None
    tma = groups is not None
    if groups is not None:
        mode = "wgmma_tf32" if mode == "tf32" else "wgmma16"
    else:
        least = policy.act_transpose_group_min_blocks_per_step if act_transposed else None
        groups = column_groups(index, pass_name, mode, n, aligned, device.arch, policy, item_bytes, least=least)
    tile = groups.tile if groups else policy.tile(mode, pass_name, bs, n, device.arch)
    if not tma and groups is None:
        wgmma = wgmma_tile(mode, pass_name, bs, n, feature_axis, aligned, device, policy)
        if wgmma is not None:
            mode, tile = "wgmma16", wgmma
            tile, tma = _on_tma(tile, tma_tile("tma16", index, pass_name, n, device, policy, act_blocks,
                                               weight_blocks))
        elif mode == "tensor16" and feature_axis == 1 and aligned:
            tile, tma = _on_tma(tile, tma_tile("tma_mma16", index, pass_name, n, device, policy, act_blocks,
                                               weight_blocks))
        elif mode == "tf32" and PASSES[pass_name].reads_weights_transposed and feature_axis == 1 and aligned:
            # TF32 wgmma takes K-major operands only: bprop's dy rows and weight rows are.
            tile, tma = _on_tma(tile, tma_tile("tma_tf32", index, pass_name, n, device, policy, act_blocks,
                                               weight_blocks))
            mode = "wgmma_tf32" if tma else mode
    # A batch no deeper than one step: stream many weight blocks through each thread block.
    grouped = PASSES[pass_name].updates_weights and aligned and 0 < n <= tile.bk
    variant = Variant(dtype, bs, tile, mode, pass_name, feature_axis, aligned, grouped,
                      groups.size if groups else 1, tma, act_transposed)
    problem = tiling_problem(variant)
    if problem:
        raise ValueError(f"the launch tables give {variant} a tile the kernel cannot build: {problem}")
    return Selection(variant, groups)


def _on_tma(tile: Tile, tma: Tile | None) -> tuple[Tile, bool]:
    return (tma, True) if tma is not None else (tile, False)


def copy_row_elements(n: int, item: int) -> int:
    """Elements of one row of a transposed copy: the batch of ``n`` rows padded to 16 bytes."""
    return -(-n * item // 16) * 16 // item


def transposes_activations(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int,
                           aligned: bool, policy: Policy) -> bool:
    """Whether fprop (bprop) of ``n`` rows on ``feature_axis`` reads a transposed copy of x (dy)
    (``plans.TransposedActivations``): half precision on feature axis 1 at the policy's
    ``act_transpose`` block sizes, from ``act_transpose_min_rows`` rows, where the copy,
    features x N elements (N rounded up to 16 bytes), fits ``act_transpose_max_bytes``."""
    if feature_axis != 1 or not aligned or dtype == "float32" or n < policy.act_transpose_min_rows:
        return False
    item = ELEMENT_BYTES[dtype]
    features = PASSES[pass_name].features(index.C, index.K)[0]
    copy_bytes = features * copy_row_elements(n, item) * item
    return index.block_size in policy.act_transpose and copy_bytes <= policy.act_transpose_max_bytes


def updat_copy_bytes(index: BlockIndex, n: int, item: int = 2) -> int:
    """Bytes of updat's two transposed copies for a batch of ``n`` rows of ``item``-byte elements."""
    return (index.C + index.K) * copy_row_elements(n, item) * item


def transposes_updat(index: BlockIndex, n: int, dtype: str, feature_axis: int, aligned: bool, device: Device,
                     policy: Policy, tf32: bool = False) -> bool:
    """Whether updat reads transposed copies of x and dy (``plans.TransposedUpdat``): half
    precision at the policy's ``updat_transpose`` block sizes, TF32 on Hopper where
    ``tma_tf32.updat_rows`` lists the block size (its wgmma row groups need x and dy K-major);
    feature axis 1, aligned, from ``updat_transpose_min_rows`` rows, copies within
    ``updat_transpose_max_bytes``."""
    if feature_axis != 1 or not aligned or n < policy.updat_transpose_min_rows:
        return False
    if dtype == "float32":
        wanted = (tf32 and device.arch == "sm90"
                  and policy.group_tile("tma_tf32", "updat", index.block_size, n, "sm90") is not None)
    else:
        wanted = index.block_size in policy.updat_transpose
    return wanted and updat_copy_bytes(index, n, ELEMENT_BYTES[dtype]) <= policy.updat_transpose_max_bytes


def transposed_layout(index: BlockIndex) -> BlockIndex:
    """The index of the transposed layout (TF32 fprop runs as its bprop)."""
    return block_index(np.ascontiguousarray(index.layout.T), index.block_size)


def transposes_weights(index: BlockIndex, n: int, dtype: str, feature_axis: int, tf32: bool, aligned: bool,
                       device: Device, policy: Policy) -> bool:
    """Whether fprop runs as the TF32 wgmma bprop of the transposed layout over transposed weight
    blocks (``plans.TransposedWeightsFprop``): TF32 on feature axis 1, aligned, where that
    bprop is a TF32 wgmma one."""
    if (dtype != "float32" or not tf32 or feature_axis != 1 or not aligned or index.nnzb == 0
            or device.arch != "sm90" or policy.tile("tma_tf32", "bprop", index.block_size, n, "sm90",
                                                    optional=True) is None):
        return False
    chosen = select(transposed_layout(index), "bprop", n, "float32", 1, True, True, device, policy)
    return chosen.variant.math == "wgmma_tf32"


def copies(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, tf32: bool, aligned: bool,
           device: Device, policy: Policy) -> str:
    """What a plain pass (no shifted activations, no reordered weights) transposes before its
    kernel: ``""``, ``"x+dy"``, ``"x"``, ``"dy"`` or ``"w"`` (see
    :class:`bsmm.backends.cuda.planner.Path`)."""
    if PASSES[pass_name].updates_weights:
        return "x+dy" if transposes_updat(index, n, dtype, feature_axis, aligned, device, policy, tf32) else ""
    if transposes_activations(index, pass_name, n, dtype, feature_axis, aligned, policy):
        return PASSES[pass_name].operands[0]
    if pass_name == "fprop" and transposes_weights(index, n, dtype, feature_axis, tf32, aligned, device, policy):
        return "w"
    return ""

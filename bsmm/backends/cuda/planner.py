"""How a chosen kernel is launched: its step tables, segments and grid, pure NumPy, no GPU needed.

:func:`launch_layout` takes the :class:`~bsmm.backends.cuda.selection.Selection` of
:func:`~bsmm.backends.cuda.selection.select` and lays the launch out: parts of long block
columns and their reduction, streamed blocks, bands, TMA boxes. :mod:`bsmm.backends.cuda.plans`
uploads the tables and launches. :func:`path` names every decision of a pass
(:class:`Path`), so that a test (and ``tests/path_census.py``) can say which path a shape takes
without running it; :func:`device_model` is an H100 without a GPU.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from bsmm.block_index import BlockIndex
from bsmm.backends.cuda import step_tables
from bsmm.backends.cuda.kernels import ELEMENT_BYTES, MAX_PART_BLOCKS, Variant
from bsmm.backends.cuda.policy import Policy, current_policy
from bsmm.backends.cuda.selection import (Device, Selection, band_rows, batch_parts, copies, select,
                                          transposed_layout)
from bsmm.backends.strided import BlockOrder
from bsmm.passes import PASSES

__all__ = ["Device", "Path", "LaunchLayout", "path", "launch_layout", "layout_path", "device_model",
           "estimated_occupancy", "tma_boxes"]


def estimated_occupancy(variant: Variant) -> int:
    """Thread blocks of ``variant`` per multiprocessor on an H100 (228 KiB of shared memory, 64K
    registers, 2048 threads), registers taken as the accumulators plus 64 a thread; the GPU
    backend asks the driver instead."""
    threads = variant.threads
    registers = min(255, variant.tile.bm * variant.tile.bn // max(1, threads - (32 if variant.tma else 0)) + 64)
    by_shared = (228 * 1024) // (variant.shared_bytes + 1024 + 8 * MAX_PART_BLOCKS)
    return max(1, min(32, 2048 // threads, 65536 // (threads * registers), by_shared))


def device_model(arch: str = "sm90", sm_count: int = 132) -> Device:
    """A :class:`Device` without a GPU: an H100 by default, occupancy estimated
    (:func:`estimated_occupancy`)."""
    return Device(arch, sm_count, estimated_occupancy)


def tma_boxes(variant: Variant) -> dict:
    """The boxes of ``bsmm_matmul_tma``'s copies (its BOX-column panels) and, for wgmma tiles,
    of its output stores (the fields of ``plans.TmaPlan``)."""
    bm, bn, bk = variant.tile.bm, variant.tile.bn, variant.tile.bk
    bs = variant.block_size
    the_pass = PASSES[variant.pass_name]
    if variant.cols > 1 and the_pass.updates_weights:  # row groups: a block's features by BK batch rows
        box = (bk, bs) if variant.feature_axis == 0 else (bs, bk)
        return dict(act_box=box, other_box=box, out_box=None)
    if variant.cols > 1:  # column groups: a block's features by BM rows, whole weight blocks
        return dict(act_box=(bs, bm), other_box=(bs, bs), out_box=(64, bm))
    wgmma = variant.math in ("wgmma16", "wgmma_tf32")
    box = 128 // ELEMENT_BYTES[variant.dtype] if wgmma else 32  # 128- or 64-byte rows
    out_box = (64, bm) if variant.math == "wgmma16" else None  # (TF32 tiles: fragment stores)
    if the_pass.updates_weights:
        return dict(act_box=(box, bk), other_box=(box, bk), out_box=out_box)
    return dict(act_box=(bk, bm), other_box=(box, bk) if the_pass.walks_block_columns else (bk, bn), out_box=out_box)


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
            flags.append(f"{'rows' if PASSES[v.pass_name].updates_weights else 'columns'}={v.cols}")
        return (f"{self.pass_name} {v.dtype} bs{v.block_size} {v.math} axis{v.feature_axis} "
                f"tile={v.tile.as_list()} {' '.join(flags)}")


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
                  weight_blocks: BlockOrder | None = None, act_transposed: bool = False,
                  policy: Policy | None = None, selection: Selection | None = None) -> LaunchLayout:
    """The tables and grid of one kernel launch of ``selection`` (by default
    :func:`~bsmm.backends.cuda.selection.select`'s choice under ``policy``, by default
    :func:`~bsmm.backends.cuda.policy.current_policy`).

    act_blocks: where each activation block is read (shifted passes,
    :func:`bsmm.backends.strided.virtual_width`); weight_blocks: where each weight block is
    stored (fprop/bprop); act_transposed: as for :func:`~bsmm.backends.cuda.selection.select`.
    """
    policy = current_policy() if policy is None else policy
    if selection is None:
        selection = select(index, pass_name, n, dtype, feature_axis, tf32, aligned, device, policy, act_blocks,
                           weight_blocks, act_transposed)
    variant, groups = selection.variant, selection.groups
    the_pass = PASSES[pass_name]
    bs = index.block_size
    bm, bn, bk = variant.tile.bm, variant.tile.bn, variant.tile.bk
    grouped, mode = variant.grouped, variant.math
    target_ctas = policy.waves * device.sm_count
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
    elif the_pass.updates_weights:
        table = groups.table if groups else np.stack([index.rows, index.indices], axis=1)
        n_units = len(table)
        tiles_per_unit = 1 if groups else (bs // bm) * (bs // bn)
        ctas_unsplit = max(1, n_units * tiles_per_unit)
        resident = device.sm_count * device.occupancy(variant)
        most = max(1, min(math.ceil(target_ctas / ctas_unsplit), math.ceil(n / (4 * bk))))
        want_parts = batch_parts(ctas_unsplit, resident, most, policy.updat_cut_gain)
        rows_per_part = bk * math.ceil(math.ceil(n / want_parts) / bk) if n else bk
        counts = np.full(n_units, n, dtype=np.int64)
        parts, unit_of, part_index = step_tables.parts(counts, rows_per_part)
        begin = part_index * rows_per_part
        end = np.minimum(begin + rows_per_part, n)
        grid_yz = (1, 1) if groups else (bs // bm, bs // bn)
    else:
        table, counts = ((groups.table, groups.counts) if groups
                         else step_tables.block_steps(index, the_pass.walks_block_columns))
        ptr = np.concatenate([[0], np.cumsum(counts)])
        n_units = len(counts)
        tiles_per_unit = math.ceil(max(n, 1) / bm) * max(1, bs // bn)
        total = max(1, int(ptr[-1]))
        # Balance: no part much longer than twice the average unit, and enough parts to fill the GPU.
        fill = math.ceil(total * tiles_per_unit / target_ctas)
        shortest = (policy.min_part_blocks if mode != "simt"
                    else min(policy.min_part_blocks, policy.min_part_blocks_simt))
        if n <= policy.few_rows and not variant.tma:  # (TMA's small-batch walks: not measured cut this short)
            shortest = min(shortest, policy.min_part_blocks_few_rows)
        part_length = max(shortest, min(math.ceil(2 * total / n_units), fill))
        if variant.tma and mode == "tensor16" and n_units * tiles_per_unit >= device.sm_count:
            # Small batches through TMA walk whole columns (bsmm.toml) where the columns alone
            # give every SM a thread block; fewer columns are cut to fill the GPU.
            part_length = max(part_length, policy.tma_mma_min_part_blocks)
        part_length = min(part_length, MAX_PART_BLOCKS)
        parts, unit_of, part_index = step_tables.parts(counts, part_length)
        begin = ptr[unit_of] + part_index * part_length
        end = np.minimum(begin + part_length, ptr[unit_of + 1])
        grid_yz = (math.ceil(max(n, 1) / bm), max(1, bs // bn))

    if act_blocks is not None:  # where each activation block is read (see bsmm.backends.strided.virtual_width)
        column = 0 if (the_pass.updates_weights or groups) else 1
        table = np.array(table, dtype=np.int64)
        table[:, column] = np.asarray(act_blocks, dtype=np.int64)[table[:, column]]
    if weight_blocks is not None:  # fprop/bprop: where each weight block is stored (BlockOrder)
        if the_pass.updates_weights:
            raise NotImplementedError("weight_blocks reorders the weights fprop and bprop read, not updat's output")
        table = np.array(table, dtype=np.int64)
        weights = table[:, 1:] if groups else table[:, :1]
        weights[weights >= 0] = weight_blocks.positions[weights[weights >= 0]]
    if not grouped:
        segments = np.stack([unit_of, begin, end, part_index], axis=1)
        # Longest parts first: the hardware hands out thread blocks roughly in order.
        segments = segments[np.argsort(-(segments[:, 2] - segments[:, 1]), kind="stable")]
    split_parts = int(np.where(parts > 1, parts, 0).sum())
    tma_fields = {} if not variant.tma else dict(tma_boxes(variant), block_rows=index.nnzb * bs,
                                             feature_rows=(index.C, index.K))
    return LaunchLayout(variant=variant, segments=segments.astype(np.int32), units=step_tables.unit_table(parts),
                        table=np.ascontiguousarray(table, dtype=np.int32), grid=(len(segments), *grid_yz),
                        workspace_floats=split_parts * tiles_per_unit * bm * bn,
                        counter_count=len(parts) * tiles_per_unit, band_rows=band_rows(index, pass_name, dtype, policy),
                        tma_fields=tma_fields, streaming=streaming)


def path(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, tf32: bool, aligned: bool,
         device: Device, policy: Policy | None = None) -> Path:
    """The :class:`Path` a plain pass of ``n`` rows takes on ``device`` under ``policy`` (by
    default the current one): what :mod:`bsmm.backends.cuda.plans` would launch, computed
    without a GPU.

    Examples
    --------
    >>> import numpy as np, bsmm
    >>> index = bsmm.block_index(np.ones((64, 64)), 32)
    >>> p = path(index, "updat", 8, "float16", 1, False, True, device_model())
    >>> p.variant.math, p.streaming, p.variant.tile.bk
    ('tensor16', 'several', 16)
    """
    policy = current_policy() if policy is None else policy
    copied = copies(index, pass_name, n, dtype, feature_axis, tf32, aligned, device, policy)
    if copied == "w":
        layout = launch_layout(transposed_layout(index), "bprop", n, dtype, 1, True, True, device, policy=policy)
    elif copied:  # the kernel reads the copies as on feature axis 0, aligned
        layout = launch_layout(index, pass_name, n, dtype, 0, tf32, True, device, policy=policy,
                               act_transposed=not PASSES[pass_name].updates_weights)
    else:
        layout = launch_layout(index, pass_name, n, dtype, feature_axis, tf32, aligned, device, policy=policy)
    return layout_path(pass_name, copied, layout, device, policy)


def layout_path(pass_name: str, copied: str, layout: LaunchLayout, device: Device, policy: Policy) -> Path:
    """The :class:`Path` of a launch laid out as ``layout`` under ``policy``."""
    return Path(pass_name, copied, layout.variant, layout.streaming, layout.workspace_floats > 0,
                layout.band_rows > 1, policy.programmatic_on(device.arch))

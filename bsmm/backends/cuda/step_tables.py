"""The step tables a plan uploads, built from a layout in pure NumPy (no GPU, no settings).

A kernel's thread block reads its *unit* (an output block column or row, a weight block, a
group of them) as a run of *steps*; these functions lay the runs out and cut long ones into
*parts* whose partial sums meet in a workspace. :mod:`bsmm.backends.cuda.planner` decides which
table a pass takes; this module only builds it.
"""

from __future__ import annotations

import numpy as np

from bsmm.block_index import BlockIndex, stable_order

__all__ = ["parts", "unit_table", "block_steps", "group_steps", "row_groups"]


def parts(counts: np.ndarray, part_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut each unit's run of length counts[u] into parts of at most part_length (at least one part)."""
    parts = np.maximum(1, -(-counts // part_length))
    unit_of = np.repeat(np.arange(len(counts)), parts)
    first_part = np.cumsum(parts) - parts
    part_index = np.arange(parts.sum()) - np.repeat(first_part, parts)
    return parts, unit_of, part_index


def unit_table(parts: np.ndarray) -> np.ndarray:
    """(first workspace slot, parts) per unit; only units cut into several parts use slots."""
    split = np.where(parts > 1, parts, 0)
    first_slot = np.cumsum(split) - split
    return np.stack([first_slot, parts], axis=1).astype(np.int32)


def block_steps(index: BlockIndex, by_column: bool) -> tuple[np.ndarray, np.ndarray]:
    """Step table of fprop (units = block columns) or bprop (block rows), one block a step.

    Returns (entries (steps, 2) = (weight block, activation feature block), steps per unit).
    """
    ptr = index.colptr if by_column else index.indptr
    entries = index.col_order if by_column else np.arange(index.nnzb)
    operand_blocks = index.rows[entries] if by_column else index.indices
    return np.stack([entries, operand_blocks], axis=1), np.diff(ptr).astype(np.int64)


def group_steps(index: BlockIndex, by_column: bool, cols: int) -> tuple[np.ndarray, np.ndarray]:
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
    # np.unique(keys, return_inverse=True) through a table of the key space (no larger than the layout):
    # linear time, where sorting took most of a changed layout's planning.
    used = np.zeros(n_units * n_step_blocks, dtype=bool)
    used[keys] = True
    unique_keys = np.flatnonzero(used)
    step_of_block = (np.cumsum(used) - 1)[keys]
    entries = np.full((len(unique_keys), 1 + cols), -1, dtype=np.int64)
    entries[:, 0] = unique_keys % n_step_blocks
    entries[step_of_block, 1 + unit_axis % cols] = np.arange(index.nnzb)
    counts = np.bincount(unique_keys // n_step_blocks, minlength=n_units).astype(np.int64)
    return entries, counts


def row_groups(index: BlockIndex, cols: int, window: int | None = None) -> np.ndarray:
    """updat row groups: each block row's blocks, in storage order, cut into groups of ``cols``.

    ``window`` (block columns): groups stay inside windows of that many block columns and are
    ordered window by window, so the thread blocks running at one time read the dy panels of
    one window (sized to stay in L2) instead of all of dy.
    Returns (groups, 1 + 2 cols) = (block row, block column of each block or -1, its storage
    index or -1): the blocks of a group share their x tile.
    """
    rows, columns = index.rows.astype(np.int64), index.indices.astype(np.int64)
    band = columns // window if window else np.zeros_like(columns)
    # Storage order is by (row, column) already: a stable sort by window keeps it within a (window, row) run.
    order = stable_order(band, -(-index.n_block_cols // window)) if window else np.arange(len(rows))
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

"""Splitting one layer's layout across devices for model parallelism: :func:`split_layout`.

A layer too large for one device is cut along its block columns (each device computes some
output features from the whole input, then the outputs are all-gathered) or along its block rows
(each device multiplies some input features, then the partial sums are all-reduced or
reduce-scattered). The cost of a shard is its number of present blocks, so the cut points are
chosen to balance block counts, not features: on a skewed layout, equal feature ranges can leave
one device with most of the work. Shards are contiguous ranges, so gathered outputs and sliced
inputs need no permutation.

The framework modules build on this: :class:`bsmm.torch.ShardedBlockSparseLinear` and
:func:`bsmm.jax.sharded_matmul`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bsmm.block_index import check_layout

__all__ = ["LayoutSplit", "split_layer", "split_layout"]

_AXES = {"columns": 1, "rows": 0}
_MODES = ("replicated", "sharded")


@dataclass(frozen=True, eq=False)
class LayoutSplit:
    """A layout cut into ``parts`` contiguous ranges of block columns or block rows.

    Attributes
    ----------
    layout : (CB, KB) bool array
        The whole layout (read-only).
    by : {"columns", "rows"}
        ``"columns"``: part ``p`` holds block columns ``bounds[p]:bounds[p + 1]`` (output
        features); ``"rows"``: block rows (input features).
    bounds : tuple of parts + 1 ints
        Block indices along the split axis; ``bounds[0] == 0`` and the last is KB or CB.
    blocks : tuple of ints
        Present blocks in each part.
    """

    layout: np.ndarray
    by: str
    bounds: tuple
    blocks: tuple

    @property
    def parts(self) -> int:
        return len(self.bounds) - 1

    def part_layout(self, part: int) -> np.ndarray:
        """Part ``part``'s layout: (CB, its block columns) or (its block rows, KB)."""
        lo, hi = self._range(part)
        return self.layout[:, lo:hi] if self.by == "columns" else self.layout[lo:hi, :]

    def features(self, part: int, block_size: int) -> slice:
        """The features of part ``part`` along the split axis: outputs for ``"columns"``, inputs for ``"rows"``."""
        lo, hi = self._range(part)
        return slice(lo * block_size, hi * block_size)

    def feature_counts(self, block_size: int) -> tuple:
        """Each part's number of features along the cut (outputs for ``"columns"``, inputs for ``"rows"``)."""
        return tuple((b - a) * block_size for a, b in zip(self.bounds, self.bounds[1:]))

    def weight_index(self, part: int) -> np.ndarray:
        """Where part ``part``'s blocks sit in the whole layer's weight (nnzb, bs, bs): int64
        indices in the part's own storage order (row-major over its layout), so
        ``w[split.weight_index(p)]`` is part ``p``'s weight, for NumPy, CuPy, PyTorch and JAX arrays."""
        lo, hi = self._range(part)
        order = np.full(self.layout.shape, -1, np.int64)
        order[self.layout] = np.arange(int(np.count_nonzero(self.layout)))
        mine = order[:, lo:hi] if self.by == "columns" else order[lo:hi, :]
        return mine[mine >= 0]

    def gather_index(self) -> np.ndarray:
        """int64 indices that put the parts' weights, concatenated in part order, back in the whole
        layer's order: ``concatenate([w_0, ..., w_last])[split.gather_index()]`` is ``w``."""
        return np.argsort(np.concatenate([self.weight_index(p) for p in range(self.parts)]), kind="stable")

    def _range(self, part: int) -> tuple:
        if isinstance(part, bool) or not isinstance(part, (int, np.integer)) or not 0 <= part < self.parts:
            raise ValueError(f"part must be an int in [0, {self.parts - 1}]; got {part!r}")
        return self.bounds[part], self.bounds[part + 1]

    def __repr__(self) -> str:
        return (f"LayoutSplit(by={self.by!r}, layout={self.layout.shape}, bounds={list(self.bounds)}, "
                f"blocks={list(self.blocks)})")


def _fewest_parts_from_end(counts: np.ndarray, capacity: int) -> np.ndarray:
    """``first[j]``: the smallest start s with counts[s:] cut into at most j parts of load <= capacity."""
    n = len(counts)
    suffix = np.concatenate([np.cumsum(counts[::-1])[::-1], [0]])  # suffix[s] = counts[s:].sum()
    first = [n]
    for _ in range(n):
        end = first[-1]
        if end == 0:
            break
        # The furthest-back start s whose part s:end fits: suffix[s] - suffix[end] <= capacity.
        first.append(int(np.searchsorted(-suffix[:end], -(suffix[end] + capacity), side="left")))
    return np.array(first)


def _fits(prefix: np.ndarray, parts: int, capacity: int) -> bool:
    """Whether the loads whose prefix sums are ``prefix`` cut into ``parts`` contiguous parts of load <= capacity."""
    start, n = 0, len(prefix) - 1
    for _ in range(parts):
        start = int(np.searchsorted(prefix, prefix[start] + capacity, side="right")) - 1
        if start >= n:
            return True
    return False


def _balanced_bounds(counts: np.ndarray, parts: int) -> tuple:
    """Cut points giving each part at least one line and the smallest possible largest load; among those,
    each cut lies as near as it can to an even share of the blocks."""
    n = len(counts)
    prefix = np.concatenate([[0], np.cumsum(counts)])
    total = int(prefix[-1])
    low, high = int(counts.max(initial=0)), total
    while low < high:  # the least capacity that fits: a binary search over loads
        middle = (low + high) // 2
        low, high = (low, middle) if _fits(prefix, parts, middle) else (middle + 1, high)
    capacity = low
    first = _fewest_parts_from_end(counts, capacity)
    bounds = [0]
    for cut in range(1, parts):
        left = parts - cut  # parts still to place after this cut
        start = bounds[-1]
        # Feasible cuts: this part fits the capacity, the rest fits ``left`` parts, every part gets a line.
        latest = min(int(np.searchsorted(prefix, prefix[start] + capacity, side="right")) - 1, n - left)
        earliest = max(start + 1, int(first[left]) if left < len(first) else 0)
        candidates = np.arange(earliest, latest + 1)
        # Nearest an even share of the blocks; among equals (empty lines), nearest an even share of the lines.
        by_blocks = np.abs(prefix[candidates] - total * cut / parts)
        by_lines = np.abs(candidates - n * cut / parts)
        bounds.append(int(candidates[np.lexsort((by_lines, by_blocks))[0]]))
    bounds.append(n)
    return tuple(bounds)


def split_layout(layout, parts: int, by: str = "columns", bounds=None) -> LayoutSplit:
    """Cut ``layout`` into ``parts`` contiguous shards with balanced block counts.

    Parameters
    ----------
    layout : (CB, KB) array of 0/1
    parts : int
        Number of shards (devices), at most the number of block columns (or rows).
    by : {"columns", "rows"}
        ``"columns"`` cuts the outputs (block columns), ``"rows"`` the inputs (block rows).
    bounds : sequence of parts + 1 ints, optional
        Cut points (block indices) to use instead of balancing: to make a layer's input
        shards match the output shards of the layer before it.

    Returns
    -------
    LayoutSplit
        Balanced: the largest shard holds as few blocks as any contiguous cut allows, and
        each cut lies as near to an even share of the blocks as that permits.

    Raises
    ------
    ValueError
        ``by`` unknown, ``parts`` out of range, or ``bounds`` not increasing from 0 to the axis length.

    Examples
    --------
    >>> import numpy as np, bsmm
    >>> layout = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 1]])
    >>> split = bsmm.split_layout(layout, 2, by="columns")
    >>> split.bounds, split.blocks
    ((0, 1, 4), (3, 4))
    >>> split.part_layout(1).astype(int).tolist()
    [[1, 1, 0], [1, 0, 0], [0, 0, 1]]
    >>> split.weight_index(0).tolist()   # the whole weight's blocks 0, 3 and 5 are column 0's
    [0, 3, 5]
    """
    if by not in _AXES:
        raise ValueError(f"by must be 'columns' or 'rows'; got {by!r}")
    present = check_layout(layout) != 0
    present.flags.writeable = False
    axis = _AXES[by]
    lines = present.shape[axis]
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)) or not 1 <= parts <= lines:
        raise ValueError(f"parts must be an int in [1, {lines}] (the layout's block {by}); got {parts!r}")
    counts = np.count_nonzero(present, axis=1 - axis)
    if bounds is None:
        cuts = _balanced_bounds(counts, int(parts))
    else:
        if any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) for b in bounds):
            raise ValueError(f"bounds must be ints (block indices); got {list(bounds)}")
        cuts = tuple(int(b) for b in bounds)
        if len(cuts) != parts + 1 or cuts[0] != 0 or cuts[-1] != lines or any(
                b <= a for a, b in zip(cuts, cuts[1:])):
            raise ValueError(f"bounds must be {parts + 1} increasing block indices from 0 to {lines}; got "
                             f"{list(bounds)}")
    blocks = tuple(int(counts[a:b].sum()) for a, b in zip(cuts, cuts[1:]))
    return LayoutSplit(present, by, cuts, blocks)


def split_layer(layout, parts: int, block_size: int, by: str, input: str, output: str, bounds=None,
                devices: str = "devices") -> LayoutSplit:
    """:func:`split_layout` for a model-parallel layer, after checking its ``input`` and ``output`` modes
    (the framework layers' shared checks; ``devices`` names what the parts run on, in messages).

    Raises
    ------
    ValueError
        A mode other than ``"replicated"`` or ``"sharded"``, ``input="sharded"`` with ``by="columns"``
        (a part of block columns multiplies the whole input), ``output="sharded"`` with ``by="rows"``
        and out_features not divisible by ``parts``, or what :func:`split_layout` raises.
    """
    for name, value in (("input", input), ("output", output)):
        if value not in _MODES:
            raise ValueError(f"{name} must be 'replicated' or 'sharded'; got {value!r}")
    if by == "columns" and input == "sharded":
        raise ValueError("input='sharded' needs by='rows': a part of block columns multiplies the whole input")
    split = split_layout(layout, parts, by, bounds)
    out_features = split.layout.shape[1] * block_size
    if by == "rows" and output == "sharded" and out_features % parts:
        raise ValueError(f"output='sharded' with by='rows' gives each of the {parts} {devices} out_features / "
                         f"{parts} features: out_features must be divisible by {parts}; got {out_features}")
    return split

"""bsmm.split_layout: contiguous cuts of a layout with the smallest largest part, and the weight maps of the parts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import bsmm
from reference import random_layout, skewed_layout

AXES = {"columns": 0, "rows": 1}  # the axis block counts are summed over


def _best_largest_part(counts: np.ndarray, parts: int) -> int:
    """The smallest largest load of any contiguous cut into ``parts`` non-empty ranges (every cut tried)."""
    n = len(counts)
    return min(max(int(counts[a:b].sum()) for a, b in zip((0, *cuts), (*cuts, n)))
               for cuts in itertools.combinations(range(1, n), parts - 1))


def _layouts(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for trial in range(count):
        cb, kb = (int(v) for v in rng.integers(1, 9, size=2))
        kind = trial % 4
        if kind == 0:
            yield random_layout(rng, cb, kb, float(rng.random()))
        elif kind == 1:
            yield skewed_layout(rng, cb + 3, kb + 3)  # (at least 4 x 4)
        elif kind == 2:
            yield np.zeros((cb, kb), np.uint8)
        else:
            yield np.ones((cb, kb), np.uint8)


@pytest.mark.parametrize("by", ["columns", "rows"])
def test_cuts_are_optimal_and_cover_every_block(by):
    """Against every possible cut: the largest part is as small as any contiguous cut allows; the parts
    are non-empty ranges that tile the axis and hold every block exactly once."""
    rng = np.random.default_rng(1)
    for layout in _layouts(2 if by == "columns" else 3, 400):
        counts = np.count_nonzero(layout, axis=AXES[by])
        parts = int(rng.integers(1, len(counts) + 1))
        split = bsmm.split_layout(layout, parts, by)
        assert split.parts == parts and split.bounds[0] == 0 and split.bounds[-1] == len(counts)
        assert all(b > a for a, b in zip(split.bounds, split.bounds[1:]))
        assert max(split.blocks) == _best_largest_part(counts, parts), (layout.tolist(), parts)
        assert split.blocks == tuple(int(counts[a:b].sum()) for a, b in zip(split.bounds, split.bounds[1:]))
        order = np.concatenate([split.weight_index(p) for p in range(parts)])
        assert sorted(order.tolist()) == list(range(int(np.count_nonzero(layout))))


def test_even_layouts_get_even_cuts():
    """Among the optimal cuts, the even one: 8 equal columns in 4 parts are cut every 2 columns."""
    split = bsmm.split_layout(np.ones((3, 8)), 4)
    assert split.bounds == (0, 2, 4, 6, 8) and split.blocks == (6, 6, 6, 6)
    split = bsmm.split_layout(np.ones((12, 2)), 3, by="rows")
    assert split.bounds == (0, 4, 8, 12)


def test_balanced_by_blocks_not_features():
    """A skewed layout: equal feature ranges would give one part 12 of 16 blocks; the cut gives it 10."""
    layout = np.zeros((6, 4), np.uint8)
    layout[:, 0] = 1
    layout[:, 1] = 1
    layout[3:, 2] = layout[5, 3] = 1
    split = bsmm.split_layout(layout, 2)
    assert split.blocks == (6, 10) and split.bounds == (0, 1, 4)


@pytest.mark.parametrize("by", ["columns", "rows"])
def test_weight_maps_round_trip(by):
    """Each part's weight, taken with weight_index, equals the blocks of its own layout in its own storage
    order (as a BlocksparseMatMul of the part stores them); gather_index puts the parts back."""
    rng = np.random.default_rng(4)
    layout = random_layout(rng, 7, 9, 0.5)
    op = bsmm.BlocksparseMatMul(layout, block_size=8)
    w = rng.standard_normal(op.w_shape)
    dense = op.to_dense(w)
    split = bsmm.split_layout(layout, 3, by)
    parts = []
    for p in range(3):
        part_op = bsmm.BlocksparseMatMul(split.part_layout(p), block_size=8)
        part_w = w[split.weight_index(p)]
        features = split.features(p, 8)
        expected = dense[:, features] if by == "columns" else dense[features, :]
        np.testing.assert_array_equal(part_op.to_dense(part_w), expected)
        parts.append(part_w)
    np.testing.assert_array_equal(np.concatenate(parts)[split.gather_index()], w)


def test_empty_lines_are_shared_out_evenly():
    """Cuts equal in blocks: the one nearest an even share of the lines (empty columns still cost traffic)."""
    counts_layout = np.zeros((2, 6), np.uint8)
    counts_layout[0, 0] = counts_layout[0, 5] = 1  # 1, 0, 0, 0, 0, 1 blocks per column
    assert bsmm.split_layout(counts_layout, 2).bounds == (0, 3, 6)
    assert bsmm.split_layout(np.zeros((3, 8)), 4).bounds == (0, 2, 4, 6, 8)


def test_given_bounds_are_kept():
    layout = np.ones((4, 6))
    split = bsmm.split_layout(layout, 3, bounds=(0, 1, 2, 6))
    assert split.bounds == (0, 1, 2, 6) and split.blocks == (4, 4, 16)


def test_large_layouts_are_cut_quickly():
    """65536 features in 2048 block columns (block 32) cut for 8 devices: balanced to within one column's blocks."""
    layout = skewed_layout(np.random.default_rng(5), 2048, 2048, 0.05)
    split = bsmm.split_layout(layout, 8)
    counts = np.count_nonzero(layout, axis=0)
    assert max(split.blocks) - min(split.blocks) <= 2 * counts.max()
    assert max(split.blocks) <= int(np.ceil(counts.sum() / 8)) + counts.max()


def test_errors_name_the_argument():
    layout = np.ones((2, 3))
    with pytest.raises(ValueError, match="by must be 'columns' or 'rows'; got 'blocks'"):
        bsmm.split_layout(layout, 2, by="blocks")
    with pytest.raises(ValueError, match=r"parts must be an int in \[1, 3\] \(the layout's block columns\); got 4"):
        bsmm.split_layout(layout, 4)
    with pytest.raises(ValueError, match=r"parts must be an int in \[1, 2\] \(the layout's block rows\); got 0"):
        bsmm.split_layout(layout, 0, by="rows")
    with pytest.raises(ValueError, match="parts must be an int"):
        bsmm.split_layout(layout, 2.0)
    with pytest.raises(ValueError, match=r"bounds must be 3 increasing block indices from 0 to 3; got \[0, 3, 3\]"):
        bsmm.split_layout(layout, 2, bounds=(0, 3, 3))
    with pytest.raises(ValueError, match="bounds must be 3 increasing"):
        bsmm.split_layout(layout, 2, bounds=(0, 1))
    with pytest.raises(ValueError, match=r"bounds must be ints \(block indices\); got \[0, 2.9, 3\]"):
        bsmm.split_layout(layout, 2, bounds=(0, 2.9, 3))
    with pytest.raises(ValueError, match="bounds must be ints"):
        bsmm.split_layout(layout, 2, bounds=(0, True, 3))
    split = bsmm.split_layout(layout, 2)
    with pytest.raises(ValueError, match=r"part must be an int in \[0, 1\]; got 2"):
        split.weight_index(2)
    with pytest.raises(ValueError, match="layout"):
        bsmm.split_layout(np.ones(3), 1)

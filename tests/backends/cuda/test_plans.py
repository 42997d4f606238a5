"""Host-side launch tables of the GPU backend (pure NumPy: runs without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import bsmm

from bsmm.backends.cuda import planner, selection, step_tables
from bsmm.backends.cuda.planner import device_model
from bsmm.backends.cuda.policy import GroupTile, Policy, Tile

#: bsmm.toml's policy, whatever the environment says (each test states what it changes).
POLICY = Policy.from_settings(environ={})


def brute_force_group_steps(layout, by_column: bool, cols: int):
    """Union-of-rows step table built by walking the layout one cell at a time."""
    rows, columns = np.nonzero(layout)
    ids = -np.ones(layout.shape, dtype=np.int64)
    ids[rows, columns] = np.arange(len(rows))
    by_step = ids if by_column else ids.T  # (step blocks, output blocks)
    n_units = -(-by_step.shape[1] // cols)
    padded = np.full((by_step.shape[0], n_units * cols), -1)
    padded[:, :by_step.shape[1]] = by_step
    entries, counts = [], []
    for unit in range(n_units):
        group = padded[:, unit * cols:(unit + 1) * cols]
        present = [r for r in range(by_step.shape[0]) if (group[r] >= 0).any()]
        entries += [[r, *group[r]] for r in present]
        counts.append(len(present))
    return np.array(entries, dtype=np.int64).reshape(-1, cols + 1), np.array(counts)


@pytest.mark.parametrize("cb, kb, cols, density", [(7, 10, 4, 0.3), (12, 8, 8, 0.5), (5, 5, 4, 0.0), (9, 16, 4, 1.0)])
@pytest.mark.parametrize("by_column", [True, False], ids=["fprop", "bprop"])
def test_group_steps_are_the_union_of_rows_in_order(cb, kb, cols, density, by_column):
    layout = (np.random.default_rng([cb, kb]).random((cb, kb)) < density).astype(np.uint8)
    index = bsmm.block_index(layout, 16)
    entries, counts = step_tables.group_steps(index, by_column, cols)
    expected_entries, expected_counts = brute_force_group_steps(layout, by_column, cols)
    np.testing.assert_array_equal(entries, expected_entries)
    np.testing.assert_array_equal(counts, expected_counts)


@pytest.mark.parametrize("density, expected_cols", [(0.5, 4), (0.05, 1)])
def test_column_groups_only_where_steps_feed_several_blocks(density, expected_cols):
    layout = (np.random.default_rng(3).random((64, 64)) < density).astype(np.uint8)
    index = bsmm.block_index(layout, 32)
    groups = selection.column_groups(index, "fprop", "tensor16", 4096, True, "sm90", POLICY)
    assert (groups.size if groups else 1) == expected_cols
    assert selection.column_groups(index, "fprop", "tensor16", 4096, False, "sm90", POLICY) is None  # unaligned
    assert selection.column_groups(index, "fprop", "tensor16", 32, True, "sm90", POLICY) is None  # no n32 tile


@pytest.mark.parametrize("cb, kb, cols, density", [(7, 10, 4, 0.3), (12, 19, 8, 0.5), (5, 5, 4, 0.0), (3, 16, 4, 1.0)])
def test_row_groups_cut_each_block_row_in_storage_order(cb, kb, cols, density):
    layout = (np.random.default_rng([cb, kb, 1]).random((cb, kb)) < density).astype(np.uint8)
    layout[cb // 2] = 0  # an empty block row has no group
    index = bsmm.block_index(layout, 16)
    entries = step_tables.row_groups(index, cols)
    expected, block = [], 0
    for row in range(cb):
        columns = list(np.flatnonzero(layout[row]))
        for first in range(0, len(columns), cols):
            group = columns[first:first + cols]
            ids = list(range(block, block + len(group)))
            block += len(group)
            pad = [-1] * (cols - len(group))
            expected.append([row, *group, *pad, *ids, *pad])
    np.testing.assert_array_equal(entries, np.array(expected, dtype=np.int64).reshape(-1, 1 + 2 * cols))


@pytest.mark.parametrize("window", [1, 3, 7])
def test_row_groups_in_column_windows(window):
    layout = (np.random.default_rng([window, 2]).random((9, 20)) < 0.6).astype(np.uint8)
    index = bsmm.block_index(layout, 16)
    entries = step_tables.row_groups(index, 4, window)
    ids = entries[:, 5:][entries[:, 5:] >= 0]
    assert sorted(ids) == list(range(index.nnzb))  # every block once
    np.testing.assert_array_equal(index.rows[entries[:, 5:]][entries[:, 5:] >= 0],
                                  np.repeat(entries[:, 0], (entries[:, 5:] >= 0).sum(1)))
    np.testing.assert_array_equal(index.indices[ids], entries[:, 1:5][entries[:, 1:5] >= 0])
    bands = [set(row[1:5][row[1:5] >= 0] // window) for row in entries]
    assert all(len(b) == 1 for b in bands)  # a group stays in one window
    keys = [(b.pop(), row[0]) for b, row in zip(bands, entries)]
    assert keys == sorted(keys)  # window by window, block rows in order inside
    wide = step_tables.row_groups(index, 4, 20)
    np.testing.assert_array_equal(wide, step_tables.row_groups(index, 4))


def test_row_groups_only_for_long_batches_and_full_groups():
    layout = (np.random.default_rng(4).random((64, 64)) < 0.25).astype(np.uint8)
    index = bsmm.block_index(layout, 32)

    def groups(n, aligned=True, mode="tensor16", where=index):
        return selection.column_groups(where, "updat", mode, n, aligned, "sm90", POLICY)

    found = groups(4096)
    assert (found.size, found.tile.bn, found.counts) == (4, 4 * 32, None) and found.table.shape[1] == 1 + 2 * 4
    assert groups(64) is None  # one step
    assert groups(4096, aligned=False) is None
    assert groups(4096, mode="simt") is None  # float32
    diagonal = bsmm.block_index(np.eye(64, dtype=np.uint8), 32)  # one block a row: nothing shared
    assert groups(4096, where=diagonal) is None


def test_updat_transposes_only_listed_half_precision_axis_1_long_batches():
    policy = POLICY.replace(updat_transpose=[16], updat_transpose_max_bytes=2 * (512 + 256) * 4096,
                            updat_transpose_min_rows=128)
    index = bsmm.block_index(np.ones((32, 16), dtype=np.uint8), 16)  # C = 512, K = 256

    def wanted(n, dtype="float16", axis=1, aligned=True, where=index):
        return selection.transposes_updat(where, n, dtype, axis, aligned, device_model(), policy)

    assert wanted(4096) and wanted(4090, "bfloat16")  # N padded to 4096
    assert not wanted(4097)  # past the workspace limit
    assert not wanted(127)  # a short batch
    assert not wanted(4096, axis=0)  # already transposed
    assert not wanted(4096, aligned=False)  # unaligned operands
    assert not wanted(4096, "float32")
    assert not wanted(4096, where=bsmm.block_index(np.ones((16, 8), dtype=np.uint8), 32))  # block 32 is not listed


def test_fprop_bprop_transpose_activations_only_listed_half_precision_axis_1_long_batches():
    policy = POLICY.replace(act_transpose=[16], act_transpose_max_bytes=2 * 256 * 4096,  # K x N, not C x N
                            act_transpose_min_rows=128)
    index = bsmm.block_index(np.ones((32, 16), dtype=np.uint8), 16)  # C = 512, K = 256

    def wanted(where, pass_name, n, dtype, axis, aligned):
        return selection.transposes_activations(where, pass_name, n, dtype, axis, aligned, policy)

    assert wanted(index, "bprop", 4096, "float16", 1, True)  # dy: K x N
    assert wanted(index, "bprop", 4090, "bfloat16", 1, True)  # N padded to 4096
    assert not wanted(index, "fprop", 4096, "float16", 1, True)  # x (C x N) is past the limit
    assert not wanted(index, "bprop", 4097, "float16", 1, True)
    assert not wanted(index, "bprop", 127, "float16", 1, True)  # a short batch
    assert not wanted(index, "bprop", 4096, "float16", 0, True)  # already transposed
    assert not wanted(index, "bprop", 4096, "float16", 1, False)  # unaligned operands
    assert not wanted(index, "bprop", 4096, "float32", 1, True)
    assert not wanted(bsmm.block_index(np.ones((16, 8), dtype=np.uint8), 32), "bprop", 4096, "float16", 1, True)


def test_updat_batch_parts_fill_idle_waves_only_where_that_pays():
    def parts(ctas, resident, most):
        return selection.batch_parts(ctas, resident, most, cut_gain=0.25)

    assert parts(410, 132, 3) == 1  # 3.1 waves: cutting saves under a quarter
    assert parts(819, 132, 2) == 1
    assert parts(288, 264, 8) == 5  # 1.09 waves: 2 -> 1.2 waves of full length
    assert parts(20, 264, 16) == 12  # a fraction of one wave: fill it (13 fills it best, 12 within 10 %)
    assert parts(20, 264, 1) == 1  # the batch is too short to cut
    assert 120 <= parts(1, 132, 200) <= 132


def test_decode_passes_cut_their_columns_into_short_parts():
    """Passes of at most few_rows rows cut block columns into parts of min_part_blocks_few_rows blocks
    (the decoder's down projection 8192 -> 2048 at block 128, 10 %: 16 columns of about 6 blocks would
    be 16 thread blocks); more rows keep min_part_blocks, which such short columns never reach."""
    layout = (np.random.default_rng(5).random((64, 16)) < 0.1).astype(np.uint8)
    layout[:8, :] = 1  # every column at least 8 blocks long
    index = bsmm.block_index(layout, 128)

    def path(n, policy=POLICY, pass_name="fprop"):
        return planner.path(index, pass_name, n, "bfloat16", 1, False, True, device_model(), policy)

    def thread_blocks(n, policy=POLICY):
        return planner.launch_layout(index, "fprop", n, "bfloat16", 1, False, True, device_model(), policy=policy).grid[0]

    assert POLICY.few_rows == 16 and POLICY.min_part_blocks_few_rows == 2
    for n in (1, 8, 16):
        assert path(n).parts and path(n, pass_name="bprop").parts
        assert thread_blocks(n) >= index.nnzb // 2
    assert not path(17).parts and thread_blocks(17) == 16
    assert not path(8, POLICY.replace(few_rows=4)).parts
    # Off TMA only: a small-batch walk through TMA (block 32, about 19 blocks a column) keeps whole columns.
    tma_index = bsmm.block_index((np.random.default_rng(1).random((64, 16)) < 0.3).astype(np.uint8), 32)
    tma_path = planner.path(tma_index, "fprop", 8, "bfloat16", 1, False, True, device_model(), POLICY)
    assert tma_path.variant.tma and not tma_path.parts
    assert thread_blocks(8, POLICY.replace(min_part_blocks_few_rows=4)) < thread_blocks(8)


def test_fprop_bprop_bands_only_for_large_blocks_whose_weights_outgrow_the_l2():
    policy = POLICY.replace(band_rows=8, band_block_sizes=[64, 128], band_min_weight_bytes=2**20)

    def bands(where, pass_name, dtype="float16"):
        return selection.band_rows(where, pass_name, dtype, policy)

    full = bsmm.block_index(np.ones((16, 16), dtype=np.uint8), 64)  # 2 MiB of float16 weights
    assert bands(full, "fprop") == 8 and bands(full, "bprop", "bfloat16") == 8
    assert bands(full, "updat") == 1
    sparse = bsmm.block_index(np.eye(16, dtype=np.uint8), 64)  # 128 KiB: stays in L2
    assert bands(sparse, "fprop") == 1
    small_blocks = bsmm.block_index(np.ones((64, 64), dtype=np.uint8), 16)  # 2 MiB, block 16
    assert bands(small_blocks, "fprop") == 1


def _listed(table: str, group: str, block_size: int, batch: str) -> Tile:
    return Tile.of(POLICY.tables["sm90"][table][group][str(block_size)][batch][:6])


def test_tma_only_for_plain_passes_long_enough_and_listed():
    policy = POLICY.replace(tma_min_macs=10**9)
    index = bsmm.block_index(np.ones((8, 8), dtype=np.uint8), 128)  # 64 blocks of 128 x 128

    def tma(table, where, pass_name, n, arch="sm90", act_blocks=None, policy=policy):
        return selection.tma_tile(table, where, pass_name, n, device_model(arch), policy, act_blocks, None)

    assert tma("tma16", index, "fprop", 1024) is not None  # 1.07e9 multiply-adds
    assert tma("tma16", index, "updat", 1024) is not None
    assert tma("tma16", index, "fprop", 512) is None  # short: bound by the host
    assert tma("tma16", index, "fprop", 1024, "sm80") is None  # no sm80 table
    assert tma("tma16", index, "fprop", 1024, act_blocks=(0,) * 8) is None  # a shifted pass
    empty = bsmm.block_index(np.zeros((8, 8), dtype=np.uint8), 128)
    assert tma("tma16", empty, "fprop", 10**6) is None
    assert tma("tma16", index, "fprop", 1024, policy=policy.replace(tma=False)) is None
    small = bsmm.block_index(np.ones((32, 8), dtype=np.uint8), 32)  # the mma.sync table: block 32, N <= 64
    assert tma("tma_mma16", small, "fprop", 32) == _listed("tma_mma16", "sparse", 32, "n32")  # 32 blocks a column
    assert tma("tma_mma16", small, "fprop", 4096) is None
    assert tma("tma_mma16", small, "updat", 32) is None
    above = policy.replace(tma_mma_max_column_blocks=16)  # above the window: L1 sharing wins
    assert tma("tma_mma16", small, "fprop", 32, policy=above) is None
    below = policy.replace(tma_mma_max_column_blocks=64, tma_mma_min_column_blocks=33)  # the host's call wins
    assert tma("tma_mma16", small, "fprop", 32, policy=below) is None
    # Weights past tma_mma_max_stream_bytes (8 MiB here) at up to 32 rows stream through cp.async; 64 rows keep TMA.
    wide = bsmm.block_index(np.ones((256, 64), dtype=np.uint8), 32)  # 16384 blocks of 2 KiB in half precision
    streamed = policy.replace(tma_mma_max_stream_bytes=8 << 20)
    assert tma("tma_mma16", wide, "fprop", 32) is not None  # today's 48 MiB
    assert tma("tma_mma16", wide, "fprop", 32, policy=streamed) is None
    assert tma("tma_mma16", wide, "bprop", 8, policy=streamed) is None
    assert tma("tma_mma16", wide, "fprop", 64, policy=streamed) == _listed("tma_mma16", "sparse", 32, "n64")
    assert tma("tma_mma16", small, "fprop", 32, policy=streamed) is not None  # 64 KiB


def test_wgmma_groups_only_for_half_precision_aligned_long_passes_on_hopper():
    policy = POLICY.replace(tma_min_macs=10**9)
    index = bsmm.block_index(np.ones((64, 64), dtype=np.uint8), 32)  # 4096 blocks of 32 x 32

    def tile(pass_name, n=256, axis=1, aligned=True, mode="tensor16", arch="sm90", where=index, policy=policy):
        return selection.group_tma_tile(where, pass_name, mode, n, axis, aligned, device_model(arch), policy,
                                        None, None)

    rows = GroupTile(_listed("tma16", "updat_rows", 32, "any"), POLICY.tables["sm90"]["tma16"]["updat_rows"]["32"]["any"][6])
    columns_entry = POLICY.tables["sm90"]["tma16"]["columns"]["32"]["large"]
    columns = GroupTile(Tile.of(columns_entry[:6]), columns_entry[6])
    assert tile("updat") == rows and tile("updat", axis=0) == rows  # 1.07e9 multiply-adds
    assert rows.tile.bm == rows.size * 32 and rows.tile.bn == 32, "M holds the row group's blocks, N one block"
    assert tile("fprop") is None  # column groups only from wgmma_columns_min_rows
    from_256 = policy.replace(wgmma_columns_min_rows=256)
    assert tile("fprop", policy=from_256) == tile("bprop", policy=from_256) == columns
    assert columns.tile.bn == columns.size * 32 and columns.tile.bk % 32 == 0, \
        "N holds the column group's blocks, whole blocks a step"
    assert tile("fprop", axis=0, policy=from_256) is None  # column groups read (N, features) activations only
    assert tile("fprop", n=64, policy=from_256) is None  # no tile for N <= 64
    assert tile("updat", n=128) is None  # short: bound by the host
    assert tile("updat", aligned=False) is None
    assert tile("updat", mode="simt") is None  # float32
    assert tile("updat", arch="sm80") is None
    for off in (policy.replace(tma=False), policy.replace(wgmma=False)):
        assert tile("updat", policy=off) is None and tile("fprop", policy=off.replace(wgmma_columns_min_rows=256)) is None
    assert selection.group_tma_tile(index, "fprop", "tensor16", 256, 1, True, device_model(), from_256, (0,) * 64,
                                    None) is None
    axis_0 = policy.replace(updat_rows_tma_axes=[0])
    assert tile("updat", policy=axis_0) is None and tile("updat", axis=0, policy=axis_0) == rows
    entry64 = POLICY.tables["sm90"]["tma16"]["columns"]["64"]["large"]
    group64 = GroupTile(Tile.of(entry64[:6]), 2)
    grouping = POLICY.replace(wgmma_group_min_blocks_per_step={64: 1.25})
    diagonal = bsmm.block_index(np.eye(8, dtype=np.uint8), 64)  # one block a step: not grouped
    assert selection.column_groups(diagonal, "fprop", "tensor16", 4096, True, "sm90", grouping, 2, group64) is None
    dense = bsmm.block_index(np.ones((8, 8), dtype=np.uint8), 64)  # two blocks a step
    found = selection.column_groups(dense, "fprop", "tensor16", 4096, True, "sm90", grouping, 2, group64)
    assert (found.tile, found.size) == (group64.tile, 2)
    wide = bsmm.block_index(np.ones((8, 8), dtype=np.uint8), 128)  # no group tables at block 128
    assert tile("updat", n=10**5, where=wide) is None and tile("fprop", n=10**5, where=wide, policy=from_256) is None


def test_tma_maps_describe_what_each_kernel_copies(monkeypatch):
    """The tensor maps of every kind of ``bsmm_matmul_tma`` launch, as (address, inner elements,
    outer rows, row pitch in bytes, box inner, box outer): the geometry the kernel's copy
    coordinates assume (x, dy, y as N rows of features; weights as nnzb x block rows of one
    block; the transposed copies of updat as feature rows of N); no output map where tiles are
    not stored through TMA."""
    from bsmm.backends.cuda.kernels import Variant

    cuda_plans = pytest.importorskip("bsmm.backends.cuda.plans", reason="CuPy is not installed")
    from bsmm.backends.cuda.params import Sizes
    monkeypatch.setattr(cuda_plans, "tensor_map", lambda *args: args)
    n, C, K, nnzb = 300, 512, 384, 7
    x, other, out = 0x1000, 0x2000, 0x3000

    def maps(bs, tile, math, pass_name, axis=1, cols=1, sizes=None, dtype="float16"):
        variant = Variant(dtype, bs, tile, math, pass_name, axis, True, False, cols, True)
        plan = cuda_plans.TmaPlan(variant=variant, segments=None, units=None, table=None, workspace_floats=0,
                                    counter_count=0, launcher=None, **planner.tma_boxes(variant),
                                    block_rows=nnzb * bs, feature_rows=(C, K))
        default = (n, C, 0, K, K // bs) if pass_name != "updat" else (n, C, K, 0, 0)
        found = plan.maps(x, other, out, Sizes(*(sizes or default)))
        item = 4 if dtype == "float32" else 2
        assert all(m == none or m[-1] == item for m in found), "every map is of the operands' element size"
        return tuple(m if m == none else m[:-1] for m in found)

    none = bytes(128)
    # TF32 bprop on wgmma: 32-float (128-byte) boxes of K-major rows; tiles stored by fragments
    assert maps(64, (128, 64, 32, 8, 1, 4), "wgmma_tf32", "bprop", sizes=(n, K, 0, C, C // 64), dtype="float32") == (
        (x, K, n, 4 * K, 32, 128), (other, 64, nnzb * 64, 256, 32, 64), none)
    # one block column a tile (wgmma): 64-feature boxes of BM rows, 64-column weight panels (fprop)
    # or BK x BN K-major weight boxes (bprop), output boxes of 64 x BM
    assert maps(64, (128, 64, 64, 8, 1, 4), "wgmma16", "fprop") == (
        (x, C, n, 2 * C, 64, 128), (other, 64, nnzb * 64, 128, 64, 64), (out, K, n, 2 * K, 64, 128))
    assert maps(128, (256, 128, 64, 16, 1, 4), "wgmma16", "bprop", sizes=(n, K, 0, C, C // 128)) == (
        (x, K, n, 2 * K, 64, 256), (other, 128, nnzb * 128, 256, 64, 128), (out, C, n, 2 * C, 64, 256))
    # updat one weight block a tile: x and dy in 64-feature boxes of BK batch rows, the weights' rows out
    assert maps(64, (64, 64, 64, 4, 1, 4), "wgmma16", "updat") == (
        (x, C, n, 2 * C, 64, 64), (other, K, n, 2 * K, 64, 64), (out, 64, nnzb * 64, 128, 64, 64))
    # column groups: one block's features by BM rows, whole weight blocks, TMA-stored output
    assert maps(32, (128, 128, 64, 8, 1, 3), "wgmma16", "fprop", cols=4) == (
        (x, C, n, 2 * C, 32, 128), (other, 32, nnzb * 32, 64, 32, 32), (out, K, n, 2 * K, 64, 128))
    # row groups on feature axis 1: one block's features by BK batch rows; no output map
    assert maps(32, (128, 32, 64, 8, 1, 3), "wgmma16", "updat", cols=4) == (
        (x, C, n, 2 * C, 32, 64), (other, K, n, 2 * K, 32, 64), none)
    # row groups on feature axis 0 (the transposed copies, rows padded to ld): BK batch columns by one block
    ld = 304
    assert maps(16, (128, 16, 64, 8, 1, 3), "wgmma16", "updat", axis=0, cols=8, sizes=(n, ld, ld, 0, 0)) == (
        (x, n, C, 2 * ld, 64, 16), (other, n, K, 2 * ld, 64, 16), none)
    # mma.sync fed by TMA (small batches, block 32): 64-byte boxes, no output map
    assert maps(32, (32, 32, 32, 2, 2, 8), "tensor16", "fprop") == (
        (x, C, n, 2 * C, 32, 32), (other, 32, nnzb * 32, 64, 32, 32), none)


def test_a_policy_reaches_plans_made_on_other_threads_and_only_inside_its_block():
    """PyTorch runs backward passes on threads of its own: planning() is process-wide, and
    restores the policy it found on leaving."""
    import threading

    from bsmm.backends.cuda.policy import current_policy, planning

    before = current_policy()
    forced = before.replace(min_part_blocks=3, wgmma_group_min_blocks_per_step={"64": 2})
    assert forced.wgmma_group_min_blocks_per_step == {64: 2.0} and forced.min_part_blocks == 3
    seen = []
    with planning(forced):
        worker = threading.Thread(target=lambda: seen.append(current_policy()))
        worker.start()
        worker.join()
        with planning(POLICY):
            assert current_policy() is POLICY
        assert current_policy() is forced
    assert seen == [forced] and current_policy() is before
    with pytest.raises(TypeError, match="policy must be"):
        with planning({"min_part_blocks": 2}):
            pass
    with pytest.raises(TypeError):
        before.replace(min_part_block=2)  # a misspelt field is refused, not ignored

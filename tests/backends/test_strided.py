"""``strided_pass``: the three passes over rows a fixed stride apart in flat buffers.

Rows that start inside a buffer (a convolution's shifted window), tight rows and
gapped rows (stride > width, as strided convolutions read) are checked against the float64 dense reference on the rows as the kernel sees them,
with NaN in the gaps of the output to show any stray write.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import bsmm
from conftest import to_numpy, to_xp
from reference import DTYPES, as_float64, assert_close, random_data, random_layout, ref_bprop, ref_fprop, ref_updat


def _backend(xp):
    return importlib.import_module("bsmm.backends.cpu" if xp is np else "bsmm.backends.cuda.backend")


def _rows(flat: np.ndarray, rows: int, width: int, stride: int) -> np.ndarray:
    return np.stack([flat[r * stride:r * stride + width] for r in range(rows)]) if rows else np.zeros((0, width))


@pytest.mark.parametrize("dtype", list(DTYPES))
# Block 64 at 70 rows takes the Hopper TMA kernel (half precision) on an H100 (bsmm.toml's tma_min_macs is 0).
@pytest.mark.parametrize("bs", [8, 32, 64])
@pytest.mark.parametrize("rows", [1, 7, 70])
@pytest.mark.parametrize("spacing", ["tight", "gapped", "shifted"])
def test_strided_passes_match_reference(xp, dtype, bs, rows, spacing):
    rng = np.random.default_rng([bs, rows, DTYPES[dtype].num, len(spacing)])
    layout = random_layout(rng, 3, 2, 0.6)
    layout[0, 0] = 1
    op = bsmm.BlocksparseMatMul(layout, block_size=bs)
    C, K = op.C, op.K
    backend = _backend(xp)
    w = random_data(rng, op.w_shape, dtype)
    for pass_name, width_in, width_out in (("fprop", C, K), ("bprop", K, C)):
        # "shifted": the input starts one block into its buffer (a convolution's offset window)
        extra = 3 * bs if spacing == "gapped" else 0
        s_in, s_out = width_in + extra, width_out + extra
        act = random_data(rng, ((rows - 1) * s_in + width_in + bs,), dtype)
        act = act[bs:] if spacing == "shifted" else act[:-bs]
        start = random_data(rng, ((rows - 1) * s_out + width_out,), dtype)
        for accumulate in (False, True):
            out = start.copy()
            if not accumulate:
                for r in range(rows):
                    out[r * s_out:r * s_out + width_out] = np.nan
            out_x = to_xp(xp, out)
            backend.strided_pass(pass_name, op.index, to_xp(xp, act), to_xp(xp, w.ravel()), out_x, rows,
                                 (s_in, s_out), accumulate=accumulate)
            got = to_numpy(out_x)
            a = _rows(act, rows, width_in, s_in)
            ref = ref_fprop(layout, w, bs, a, 1) if pass_name == "fprop" else ref_bprop(layout, w, bs, a, 1)
            if accumulate:
                ref = ref + as_float64(_rows(start, rows, width_out, s_out))
            assert_close(_rows(got, rows, width_out, s_out), ref, dtype, f"{pass_name} accumulate={accumulate}")
            gaps = np.ones(got.size, bool)
            for r in range(rows):
                gaps[r * s_out:r * s_out + width_out] = False
            assert got[gaps].tobytes() == start[gaps].tobytes(), "wrote between rows"
    # updat over overlapping x rows (stride one block): dW = Σ_r x_rᵀ dy_r
    s_x = C if spacing == "tight" else (C + 2 * bs if spacing == "gapped" else C)
    x = random_data(rng, ((rows - 1) * s_x + C + (bs if spacing == "shifted" else 0),), dtype)
    dy = random_data(rng, (rows * K,), dtype)
    x_start = x[bs:] if spacing == "shifted" else x  # a row start inside the buffer
    out = to_xp(xp, np.full(op.w_shape, np.nan, dtype).ravel())
    backend.strided_pass("updat", op.index, to_xp(xp, x_start), to_xp(xp, dy), out, rows, (s_x, K))
    ref = ref_updat(layout, bs, _rows(x_start, rows, C, s_x), _rows(dy, rows, K, K), 1)
    assert_close(to_numpy(out).reshape(op.w_shape), ref, dtype, "updat")


def test_strided_pass_refuses_rows_past_the_buffer(xp):
    op = bsmm.BlocksparseMatMul(np.ones((2, 2), np.uint8), block_size=8)
    backend = _backend(xp)
    act = to_xp(xp, np.ones(3 * 16, np.float32))
    w = to_xp(xp, np.ones(4 * 64, np.float32))
    out = to_xp(xp, np.ones(3 * 16, np.float32))
    with pytest.raises(ValueError, match="act holds 48 elements"):
        backend.strided_pass("fprop", op.index, act, w, out, 4, (16, 16))
    with pytest.raises(ValueError, match="would overlap"):
        backend.strided_pass("fprop", op.index, act, w, out, 3, (16, 8))
    with pytest.raises(ValueError, match="must hold 4 blocks"):
        backend.strided_pass("fprop", op.index, act, w[:10], out, 3, (16, 16))
    with pytest.raises(ValueError, match="flat 1-D"):
        backend.strided_pass("fprop", op.index, act.reshape(3, 16), w, out, 3, (16, 16))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("pass_name", ["fprop", "bprop", "updat"])
def test_shifted_pass_reads_each_block_at_its_place(xp, pass_name, dtype):
    """act_blocks: block b of each activation row is read at block act_blocks[b] (repeats and
    any order allowed), as the stacked layout of a convolution reads its shifted windows."""
    rng = np.random.default_rng([len(pass_name), DTYPES[dtype].num])
    bs, rows = 8, 150
    layout = random_layout(rng, 4, 3, 0.6)
    layout[0, :] = 1
    op = bsmm.BlocksparseMatMul(layout, block_size=bs)
    n_act = op.index.n_block_cols if pass_name == "bprop" else op.index.n_block_rows
    act_blocks = tuple(int(v) for v in rng.integers(0, 7, n_act))
    span, stride = 7 * bs, 5 * bs  # rows overlap: each reads 7 blocks, 5 blocks apart
    act = random_data(rng, ((rows - 1) * stride + span,), dtype)
    gathered = _rows(act, rows, span, stride).reshape(rows, 7, bs)[:, list(act_blocks), :].reshape(rows, -1)
    w = random_data(rng, op.w_shape, dtype)
    backend = _backend(xp)
    if pass_name == "updat":
        dy = random_data(rng, (rows * op.K,), dtype)
        out = to_xp(xp, np.full(op.w_shape, np.nan, dtype).ravel())
        backend.shifted_pass("updat", op.index, to_xp(xp, act), to_xp(xp, dy), out, rows, (stride, op.K), act_blocks)
        expected = ref_updat(layout, bs, gathered, dy.reshape(rows, op.K), 1)
        assert_close(to_numpy(out).reshape(op.w_shape), expected, dtype, "updat")
        return
    width_out = op.K if pass_name == "fprop" else op.C
    out = to_xp(xp, np.full(rows * width_out, np.nan, dtype))
    backend.shifted_pass(pass_name, op.index, to_xp(xp, act), to_xp(xp, w.ravel()), out, rows,
                         (stride, width_out), act_blocks)
    ref = ref_fprop if pass_name == "fprop" else ref_bprop
    assert_close(to_numpy(out).reshape(rows, width_out), ref(layout, w, bs, gathered, 1), dtype, pass_name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("pass_name", ["fprop", "bprop"])
@pytest.mark.parametrize("bs, n_cols", [(8, 3), (16, 12)])
def test_shifted_pass_reads_weights_in_their_order(xp, pass_name, dtype, bs, n_cols):
    """weight_blocks: block b of the index is block positions[b] of a weight array of more
    blocks, as the side-by-side layout of a convolution's bprop reads the offsets' weights
    (and with 12 block columns, column groups take the table too)."""
    rng = np.random.default_rng([bs, n_cols, len(pass_name)])
    layout = random_layout(rng, 5, n_cols, 0.7)
    op = bsmm.BlocksparseMatMul(layout, block_size=bs)
    # Some of the stored blocks, in any order (a convolution's residue reads a subset of offsets).
    n_stored = op.index.nnzb + 5
    order = bsmm.backends.strided.BlockOrder(rng.choice(n_stored, op.index.nnzb, replace=False), stored=n_stored)
    stored = random_data(rng, (n_stored, bs, bs), dtype)
    in_index_order = stored[order.positions]
    rows = 129
    width_in, width_out = (op.C, op.K) if pass_name == "fprop" else (op.K, op.C)
    act = random_data(rng, (rows * width_in,), dtype)
    out = to_xp(xp, np.full(rows * width_out, np.nan, dtype))
    _backend(xp).shifted_pass(pass_name, op.index, to_xp(xp, act), to_xp(xp, stored.ravel()), out, rows,
                              (width_in, width_out), None, weight_blocks=order)
    ref = ref_fprop if pass_name == "fprop" else ref_bprop
    expected = ref(layout, in_index_order, bs, act.reshape(rows, width_in), 1)
    assert_close(to_numpy(out).reshape(rows, width_out), expected, dtype, pass_name)
    if xp is not np and dtype == "bfloat16" and bs == 16:
        from bsmm.backends.cuda import plan_cache

        plans = [p for key, p in plan_cache.plans_of(op.index).items() if any(k is order for k in key)]
        assert plans and all(p.variant.cols > 1 for p in plans), "column groups did not take the reordered table"


def test_block_order_errors(xp):
    with pytest.raises(ValueError, match="distinct"):
        bsmm.backends.strided.BlockOrder([0, 0, 1])
    with pytest.raises(ValueError, match="distinct"):
        bsmm.backends.strided.BlockOrder([0, 3], stored=3)
    op = bsmm.BlocksparseMatMul(np.ones((2, 2)), block_size=8)
    backend, flat = _backend(xp), to_xp(xp, np.zeros(16 * 8 * 4, np.float32))
    w = to_xp(xp, np.zeros(op.w_shape, np.float32).ravel())
    with pytest.raises(ValueError, match="one position per block"):
        backend.shifted_pass("fprop", op.index, flat, w, flat[:16 * 4], 4, (16, 16), None,
                             weight_blocks=bsmm.backends.strided.BlockOrder([1, 0]))
    with pytest.raises(NotImplementedError, match="not updat"):
        backend.shifted_pass("updat", op.index, flat, flat, w, 4, (16, 16), None,
                             weight_blocks=bsmm.backends.strided.BlockOrder([1, 0, 3, 2]))
    assert bsmm.backends.strided.BlockOrder([1, 0]) == bsmm.backends.strided.BlockOrder(np.array([1, 0]))
    assert hash(bsmm.backends.strided.BlockOrder([1, 0])) == hash(bsmm.backends.strided.BlockOrder([1, 0]))

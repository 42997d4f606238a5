"""The three passes on the CPU, vectorized with NumPy and SciPy.

Every pass is a batch of small block products followed, for ``fprop`` and
``bprop``, by a segmented sum: the products that feed one output block
(one block column of ``W`` for ``fprop``, one block row for ``bprop``) are
adjacent in the visiting order, so a 0/1 CSR matrix sums each run of them.
Work is split into chunks of whole output segments, sized to stay in cache,
and spread over a thread pool (NumPy's BLAS calls and SciPy's sparse products
release the GIL). Each output segment is written by exactly one chunk in a
fixed order, so results are bitwise reproducible whatever the thread timing.

Arithmetic is float32 for float32, float16 and bfloat16 inputs; results are
rounded to the output dtype once, at the end. This is also the reference the
GPU kernels are checked against (through a float64 dense product in the tests).
float64 inputs (a CPU-only dtype) are computed and summed in float64 throughout.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os

import numpy as np
import scipy.sparse

from bsmm.block_index import BlockIndex
from bsmm.passes import PASSES
from bsmm.arrays import empty_aligned
from bsmm.config import settings
from bsmm.epilogues import apply_epilogue
from bsmm.backends.strided import check_strided_operands, row_widths, virtual_width

__all__ = ["fprop", "bprop", "updat", "strided_pass", "shifted_pass", "gather_rows"]

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype of the arithmetic for inputs of ``dtype``: float64 stays float64, the rest is float32."""
    return _F64 if dtype == _F64 else _F32


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    threads = settings()["cpu"]["threads"] or os.cpu_count() or 1
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="bsmm-cpu")


def run_chunks(task, chunks) -> None:
    """``task(*chunk)`` for every chunk, on the backend's worker threads (inline for one chunk)."""
    if len(chunks) == 1:
        task(*chunks[0])
        return
    for future in [_pool().submit(task, *chunk) for chunk in chunks]:
        future.result()  # re-raises a worker's exception here


def _chunk_bounds(segptr: np.ndarray, bytes_per_block: int) -> list[tuple[int, int]]:
    """Split segments into runs of about ``chunk_bytes`` of temporaries each."""
    blocks_per_chunk = max(1, settings()["cpu"]["chunk_bytes"] // bytes_per_block)
    n_segments = len(segptr) - 1
    targets = np.arange(blocks_per_chunk, segptr[-1], blocks_per_chunk)
    cuts = np.unique(np.concatenate(([0], np.searchsorted(segptr, targets), [n_segments])))
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))


def _activation_blocks(array: np.ndarray, n_blocks: int, block_size: int, feature_axis: int) -> np.ndarray:
    """Activations as blocks of the compute dtype: (n_blocks, N, bs) for axis 1, (n_blocks, bs, N) for axis 0."""
    if feature_axis == 1:
        n = array.shape[0]
        blocked = array.reshape(n, n_blocks, block_size).transpose(1, 0, 2)
    else:
        blocked = array.reshape(n_blocks, block_size, array.shape[1])
    return np.ascontiguousarray(blocked, dtype=_compute_dtype(array.dtype))


def _output_blocks(out: np.ndarray, n_blocks: int, block_size: int, feature_axis: int) -> np.ndarray:
    """A view of ``out`` with one output block per leading index, like :func:`_activation_blocks`."""
    if feature_axis == 1:
        return out.reshape(out.shape[0], n_blocks, block_size).transpose(1, 0, 2)
    return out.reshape(n_blocks, block_size, out.shape[1])


def _segmented_pass(
    index: BlockIndex,
    activations: np.ndarray,
    w: np.ndarray,
    out: np.ndarray,
    feature_axis: int,
    by_column: bool,
    accumulate: bool = False,
) -> np.ndarray:
    """Shared body of fprop (``by_column``) and bprop: out[s] = sum over segment s of block products."""
    bs = index.block_size
    if by_column:  # fprop: segments are block columns, operands are x's block rows
        order, segptr, operand_ids = index.col_order, index.colptr, index.rows
        n_in, n_out = index.n_block_rows, index.n_block_cols
    else:  # bprop: segments are block rows (storage order), operands are dy's block columns
        order, segptr, operand_ids = None, index.indptr, index.indices
        n_in, n_out = index.n_block_cols, index.n_block_rows
    # Which side W's block goes on, and whether transposed: y_k = x_c W_ck (axis 1),
    # y_k = W_ck^T x_c (axis 0), dx_c = dy_k W_ck^T (axis 1), dx_c = W_ck dy_k (axis 0).
    transpose_w = by_column == (feature_axis == 0)
    compute = _compute_dtype(activations.dtype)
    operands = _activation_blocks(activations, n_in, bs, feature_axis)
    targets = _output_blocks(out, n_out, bs, feature_axis)
    n = activations.shape[1 - feature_axis]
    if n == 0:
        return out

    def chunk(first_segment: int, end_segment: int) -> None:
        start, stop = int(segptr[first_segment]), int(segptr[end_segment])
        if start == stop:  # only empty segments: nothing contributes
            if not accumulate:
                targets[first_segment:end_segment] = 0
            return
        blocks = slice(start, stop) if order is None else order[start:stop]
        w_blocks = w[blocks].astype(compute, copy=False)
        if transpose_w:
            w_blocks = w_blocks.transpose(0, 2, 1)
        act = np.take(operands, operand_ids[blocks], axis=0)
        products = act @ w_blocks if feature_axis == 1 else w_blocks @ act
        n_segments = end_segment - first_segment
        segment_sums = scipy.sparse.csr_array(
            (np.ones(stop - start, compute), np.arange(stop - start), segptr[first_segment:end_segment + 1] - start),
            shape=(n_segments, stop - start),
        ) @ products.reshape(stop - start, -1)
        sums = segment_sums.reshape((n_segments,) + products.shape[1:])
        if accumulate:  # in the compute dtype, rounded once
            sums += targets[first_segment:end_segment].astype(compute)
        targets[first_segment:end_segment] = sums

    run_chunks(chunk, _chunk_bounds(segptr, compute.itemsize * (2 * n * bs + bs * bs)))
    return out


def fprop(index: BlockIndex, x: np.ndarray, w: np.ndarray, out: np.ndarray, feature_axis: int,
          tf32: bool = False, accumulate: bool = False, epilogue=None, gate=None) -> np.ndarray:
    """y = x·W into ``out``: (N, K) for ``feature_axis=1`` ((K, N) for 0). Inputs are validated by the caller.

    ``tf32`` is accepted for a uniform backend interface; the CPU always computes exact float32 (float64
    for float64 inputs). ``epilogue``: a :class:`bsmm.epilogues.EpilogueCall`, or None (stored).
    ``gate`` (and bprop's, updat's) is accepted for the same reason: the caller passes weights already
    scaled by the gates, and the reference multiplies every block, closed ones too (the GPU skips them).
    """
    return _through_epilogue(index, x, w, out, feature_axis, True, accumulate, epilogue)


def bprop(index: BlockIndex, dy: np.ndarray, w: np.ndarray, out: np.ndarray, feature_axis: int,
          tf32: bool = False, accumulate: bool = False, epilogue=None, gate=None) -> np.ndarray:
    """dx = dy·Wᵀ into ``out``: (N, C) for ``feature_axis=1`` ((C, N) for 0), added to it if ``accumulate``."""
    return _through_epilogue(index, dy, w, out, feature_axis, False, accumulate, epilogue)


def _through_epilogue(index, act, w, out, feature_axis, by_column, accumulate, epilogue) -> np.ndarray:
    """The pass, then the epilogue as the kernels apply it: on the float sums, rounded once."""
    if epilogue is None:
        return _segmented_pass(index, act, w, out, feature_axis, by_column=by_column, accumulate=accumulate)
    sums = np.empty(out.shape, _compute_dtype(out.dtype))
    _segmented_pass(index, act, w, sums, feature_axis, by_column=by_column)
    apply_epilogue(np, sums, out, epilogue.bias, epilogue.name, epilogue.pre, feature_axis, accumulate)
    return out


def updat(index: BlockIndex, x: np.ndarray, dy: np.ndarray, out: np.ndarray, feature_axis: int,
          tf32: bool = False, accumulate: bool = False, gate=None) -> np.ndarray:
    """dW = xᵀ·dy on the present blocks into ``out`` (nnzb, bs, bs), added to it if ``accumulate``."""
    bs = index.block_size
    n = x.shape[1 - feature_axis]
    if n == 0:
        if not accumulate:
            out[...] = 0
        return out
    x_blocks = _activation_blocks(x, index.n_block_rows, bs, feature_axis)
    dy_blocks = _activation_blocks(dy, index.n_block_cols, bs, feature_axis)

    def chunk(start: int, stop: int) -> None:
        a = np.take(x_blocks, index.rows[start:stop], axis=0)
        b = np.take(dy_blocks, index.indices[start:stop], axis=0)
        grad = a.transpose(0, 2, 1) @ b if feature_axis == 1 else a @ b.transpose(0, 2, 1)
        if accumulate:
            grad += out[start:stop]
        out[start:stop] = grad

    # Treat every block as its own segment so chunks split anywhere.
    itemsize = x_blocks.dtype.itemsize
    run_chunks(chunk, _chunk_bounds(np.arange(index.nnzb + 1), itemsize * (2 * n * bs + bs * bs)))
    return out


def _rows_view(flat: np.ndarray, rows: int, width: int, stride: int) -> np.ndarray:
    """``rows`` rows of ``width`` elements, ``stride`` apart, over the flat buffer (no copy)."""
    item = flat.dtype.itemsize
    return np.lib.stride_tricks.as_strided(flat, shape=(rows, width), strides=(stride * item, item),
                                           writeable=flat.flags.writeable)


def strided_pass(pass_name: str, index: BlockIndex, act: np.ndarray, other: np.ndarray, out: np.ndarray,
                 rows: int, row_strides: tuple, accumulate: bool = False, tf32: bool = False) -> None:
    """The CPU twin of :func:`bsmm.backends.cuda.backend.strided_pass` (same contract, see :mod:`bsmm.backends.strided`).

    Overlapping rows are gathered into a contiguous copy first: the CPU backend is the
    reference, and the copy keeps the segmented products below unchanged.
    """
    shifted_pass(pass_name, index, act, other, out, rows, row_strides, None, accumulate)


def shifted_pass(pass_name: str, index: BlockIndex, act: np.ndarray, other: np.ndarray, out: np.ndarray,
                 rows: int, row_strides: tuple, act_blocks, accumulate: bool = False, tf32: bool = False,
                 weight_blocks=None) -> None:
    """:func:`strided_pass` whose activation block b is read at block ``act_blocks[b]`` of each
    row (``None``: block b) and, given ``weight_blocks`` (a :class:`bsmm.backends.strided.BlockOrder`),
    whose weight block b is block ``weight_blocks.positions[b]`` of ``other``; the CPU twin of
    :func:`bsmm.backends.cuda.backend.shifted_pass`."""
    bs = index.block_size
    width_a, width_b = row_widths(pass_name, index)
    span = virtual_width(pass_name, index, act_blocks) if act_blocks is not None else None
    check_strided_operands(pass_name, index, act, other, out, rows, row_strides, span, weight_blocks)
    if act_blocks is None:
        a = np.ascontiguousarray(_rows_view(act, rows, width_a, row_strides[0]))
    else:  # gather each block from its own place in the row
        a = _rows_view(act, rows, span, row_strides[0]).reshape(rows, span // bs, bs)
        a = np.ascontiguousarray(a[:, np.asarray(act_blocks, dtype=np.int64), :]).reshape(rows, width_a)
    if PASSES[pass_name].updates_weights:
        b = np.ascontiguousarray(_rows_view(other, rows, width_b, row_strides[1]))
        updat(index, a, b, out.reshape(index.nnzb, bs, bs), 1, accumulate=accumulate)
        return
    w = other.reshape(-1, bs, bs)
    if weight_blocks is not None:
        w = w[weight_blocks.positions]
    target = _rows_view(out, rows, width_b, row_strides[1])
    result = empty_aligned((rows, width_b), out.dtype)
    if accumulate:
        result[...] = target
    (bprop if PASSES[pass_name].reads_weights_transposed else fprop)(index, a, w, result, 1, accumulate=accumulate)
    target[...] = result


def gather_rows(dst: np.ndarray, src: np.ndarray, row_map) -> None:
    """``dst[r] = src[row_map.rows[r]]``, zeros where the map is negative (:mod:`bsmm.nn.row_maps`);
    ``dst`` and ``src`` are 2-D arrays of one dtype and row width. The CPU twin of
    :func:`bsmm.backends.cuda.backend.gather_rows`."""
    rows = row_map.rows
    if len(rows) != dst.shape[0] or dst.shape[1:] != src.shape[1:]:
        raise ValueError(f"gather_rows: a map of {len(rows)} rows moves rows of {src.shape[1:]} into "
                         f"{dst.shape[0]} rows of {dst.shape[1:]}")
    held = rows >= 0
    dst[held] = src[rows[held]]
    dst[~held] = 0

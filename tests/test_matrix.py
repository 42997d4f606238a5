"""``BlockSparseMatrix``: building from dense/SciPy, converting back, ``.T`` and the four products."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse

import bsmm
from conftest import require_dtype, to_numpy, to_xp
from reference import DTYPES, as_float64, assert_close, dense_weight, random_data, random_layout, skewed_layout

BS = 8
CB, KB = 5, 3  # W is (40, 24): C != K


def blocked_view(dense: np.ndarray, bs: int) -> np.ndarray:
    """(CB, KB, bs, bs) view of a dense (C, K) matrix, one block per leading index pair."""
    return dense.reshape(dense.shape[0] // bs, bs, dense.shape[1] // bs, bs).transpose(0, 2, 1, 3)


def block_norms(dense: np.ndarray, bs: int) -> np.ndarray:
    return np.sqrt((blocked_view(as_float64(dense), bs) ** 2).sum(axis=(2, 3)))


def sparse_dense(rng, dtype, density=0.5, cb=CB, kb=KB, bs=BS) -> tuple[np.ndarray, np.ndarray]:
    """A dense matrix that is zero outside a random layout; returns (dense, layout)."""
    layout = random_layout(rng, cb, kb, density)
    mask = np.kron(layout, np.ones((bs, bs), dtype=np.uint8)).astype(bool)
    dense = random_data(rng, (cb * bs, kb * bs), dtype)
    dense[~mask] = 0
    return dense, layout


@pytest.fixture(params=list(DTYPES))
def dtype(request):
    return request.param


# -- from_dense ------------------------------------------------------------------------------------------
def test_from_dense_keeps_exactly_the_blocks_with_nonzeros(xp, dtype):
    """Default selector: a block is kept iff it holds a non-zero (NaN counts; -0.0 does not)."""
    rng = np.random.default_rng(1)
    dense, layout = sparse_dense(rng, dtype)
    dense[:BS, :BS] = 0  # block (0, 0): a single non-zero
    dense[3, 5] = 1.5
    dense[BS:2 * BS, :BS] = 0  # block (1, 0): only NaN
    dense[BS + 2, 1] = np.nan
    dense[2 * BS:3 * BS, 2 * BS:] = -0.0  # block (2, 2): negative zeros only
    expected_layout = layout.copy()
    expected_layout[0, 0] = expected_layout[1, 0] = 1
    expected_layout[2, 2] = 0

    matrix = bsmm.BlockSparseMatrix.from_dense(to_xp(xp, dense), block_size=BS)
    assert np.array_equal(matrix.layout, expected_layout)
    assert matrix.nnzb == np.count_nonzero(expected_layout) and matrix.shape == dense.shape
    assert matrix.dtype == DTYPES[dtype] and type(matrix.data) is type(to_xp(xp, dense))
    kept = blocked_view(dense, BS)[np.nonzero(expected_layout)]
    assert to_numpy(matrix.data).tobytes() == np.ascontiguousarray(kept).tobytes()


def test_from_dense_keeps_blocks_whose_only_nonzeros_are_tiny():
    """1e-30 and a float32 subnormal are non-zeros: their blocks must be kept (default selector).

    Fails while from_dense ranks blocks by float32 sum of squares, which underflows to 0.
    """
    dense = np.zeros((16, 16), np.float32)
    dense[0, 0] = 1e-30
    dense[9, 1] = np.float32(1e-42)  # subnormal
    dense[12, 12] = 1.0
    matrix = bsmm.BlockSparseMatrix.from_dense(dense, block_size=8)
    assert matrix.layout.tolist() == [[1, 0], [1, 1]]
    assert np.array_equal(matrix.to_dense(), dense)


def test_from_dense_threshold(xp):
    """threshold keeps blocks whose Frobenius norm exceeds it."""
    rng = np.random.default_rng(2)
    dense = random_data(rng, (CB * BS, KB * BS), "float32") * rng.uniform(0.1, 3, (CB * BS, 1)).astype(np.float32)
    norms = block_norms(dense, BS)
    ranked = np.sort(norms, axis=None)
    threshold = float((ranked[6] + ranked[7]) / 2)  # between two norms: no rounding ambiguity
    matrix = bsmm.BlockSparseMatrix.from_dense(to_xp(xp, dense), block_size=BS, threshold=threshold)
    assert np.array_equal(matrix.layout, (norms > threshold).astype(np.uint8))
    assert matrix.nnzb == norms.size - 7
    assert np.array_equal(as_float64(to_numpy(matrix.to_dense())),
                          dense_weight(matrix.layout, blocked_view(dense, BS)[norms > threshold], BS))


def test_from_dense_top_k_and_density(xp):
    """top_k keeps the k largest-norm blocks; density is top_k as a fraction of all blocks."""
    rng = np.random.default_rng(3)
    dense = random_data(rng, (CB * BS, KB * BS), "float32") * rng.uniform(0.1, 3, (1, KB * BS)).astype(np.float32)
    norms = block_norms(dense, BS)
    order = np.argsort(-norms, axis=None)
    for k in (0, 1, 4, norms.size):
        expected = np.zeros(norms.size, np.uint8)
        expected[order[:k]] = 1
        expected = expected.reshape(norms.shape)
        top = bsmm.BlockSparseMatrix.from_dense(to_xp(xp, dense), block_size=BS, top_k=k)
        assert np.array_equal(top.layout, expected), f"top_k={k}"
        fraction = bsmm.BlockSparseMatrix.from_dense(to_xp(xp, dense), block_size=BS, density=k / norms.size)
        assert np.array_equal(fraction.layout, expected), f"density={k}/{norms.size}"


def test_from_dense_top_k_ties_keep_the_earlier_block():
    """Equal norms: row-major order decides (documented tie rule)."""
    dense = np.ones((3 * BS, 2 * BS), np.float32)
    matrix = bsmm.BlockSparseMatrix.from_dense(dense, block_size=BS, top_k=3)
    assert matrix.layout.tolist() == [[1, 1], [1, 0], [0, 0]]


def test_from_dense_top_k_ranks_huge_blocks_correctly():
    """Blocks with norms 1e20 and 3e20 (fine in float32) must rank by size.

    Fails while norms are summed in float32: both squares overflow to inf and tie.
    """
    dense = np.zeros((16, 16), np.float32)
    dense[0, 0] = 1e20  # earlier block, smaller
    dense[8, 8] = 3e20  # later block, larger
    matrix = bsmm.BlockSparseMatrix.from_dense(dense, block_size=8, top_k=1)
    assert matrix.layout.tolist() == [[0, 0], [0, 1]]


def test_from_dense_to_dense_round_trip(xp, dtype):
    """Default from_dense keeps every non-zero, so to_dense gives back the same bits."""
    rng = np.random.default_rng(4)
    dense, _ = sparse_dense(rng, dtype, density=0.4)
    matrix = bsmm.BlockSparseMatrix.from_dense(to_xp(xp, dense), block_size=BS)
    back = matrix.to_dense()
    assert back.dtype == DTYPES[dtype] and type(back) is type(matrix.data)
    assert to_numpy(back).tobytes() == dense.tobytes()


def test_constructor_places_blocks_in_row_major_order(xp, dtype):
    rng = np.random.default_rng(5)
    layout = random_layout(rng, CB, KB, 0.6)
    data = random_data(rng, (int(layout.sum()), BS, BS), dtype)
    matrix = bsmm.BlockSparseMatrix(layout, to_xp(xp, data))
    assert matrix.data is not None and matrix.shape == (CB * BS, KB * BS) and matrix.block_size == BS
    assert matrix.density == pytest.approx(layout.mean())
    assert np.array_equal(as_float64(to_numpy(matrix.to_dense())), dense_weight(layout, data, BS))


def test_empty_matrix(xp):
    """density=0 keeps nothing: every product is zero."""
    rng = np.random.default_rng(6)
    dense = random_data(rng, (CB * BS, KB * BS), "float32")
    matrix = bsmm.BlockSparseMatrix.from_dense(to_xp(xp, dense), block_size=BS, density=0)
    assert matrix.nnzb == 0 and not to_numpy(matrix.to_dense()).any()
    X = to_xp(xp, random_data(rng, (4, CB * BS), "float32"))
    assert not to_numpy(X @ matrix).any()


# -- .T --------------------------------------------------------------------------------------------------
def test_transpose_is_a_view(xp, dtype):
    """.T shares the block data and equals the dense transpose; .T.T is the original again."""
    rng = np.random.default_rng(7)
    dense, layout = sparse_dense(rng, dtype)
    matrix = bsmm.BlockSparseMatrix.from_dense(to_xp(xp, dense), block_size=BS)
    transposed = matrix.T
    assert transposed.data is matrix.data
    if xp is np:
        assert np.shares_memory(transposed.data, matrix.data)
    assert transposed.shape == (KB * BS, CB * BS) and transposed.T.shape == matrix.shape
    assert np.array_equal(transposed.layout, matrix.layout.T)
    assert to_numpy(transposed.to_dense()).tobytes() == np.ascontiguousarray(dense.T).tobytes()
    assert to_numpy(transposed.T.to_dense()).tobytes() == dense.tobytes()
    # a write through the original's data shows in the view: block 0 is the first present block
    r, c = np.argwhere(matrix.layout)[0]
    matrix.data[0] = 0
    expected = dense.copy()
    expected[r * BS:(r + 1) * BS, c * BS:(c + 1) * BS] = 0
    assert np.array_equal(as_float64(to_numpy(transposed.to_dense())), as_float64(expected).T)


# -- products ----------------------------------------------------------------------------------------------
PRODUCTS = {
    # name: (operand shape given N, the product, the float64 dense equivalent)
    "W @ X": (lambda n: (KB * BS, n), lambda W, X: W @ X, lambda D, X: D @ X),
    "X @ W": (lambda n: (n, CB * BS), lambda W, X: X @ W, lambda D, X: X @ D),
    "W.T @ X": (lambda n: (CB * BS, n), lambda W, X: W.T @ X, lambda D, X: D.T @ X),
    "X @ W.T": (lambda n: (n, KB * BS), lambda W, X: X @ W.T, lambda D, X: X @ D.T),
}


@pytest.mark.parametrize("order", ["C", "F", "strided"])
@pytest.mark.parametrize("product", list(PRODUCTS))
def test_products_match_dense(xp, dtype, product, order):
    """All four products against the float64 dense product, for C-, F-ordered and strided X."""
    rng = np.random.default_rng([len(product), len(order), DTYPES[dtype].num])
    dense, _ = sparse_dense(rng, dtype, density=0.6)
    matrix = bsmm.BlockSparseMatrix.from_dense(to_xp(xp, dense), block_size=BS)
    shape_of, run, reference = PRODUCTS[product]
    host = random_data(rng, shape_of(7), dtype)
    if order == "F":
        X = xp.asfortranarray(to_xp(xp, host))
        assert X.flags.f_contiguous and not X.flags.c_contiguous
    elif order == "strided":
        X = to_xp(xp, np.repeat(host, 2, axis=1))[:, ::2]
        assert not (X.flags.c_contiguous or X.flags.f_contiguous)
    else:
        X = to_xp(xp, host)
    before = to_numpy(X).copy()
    result = run(matrix, X)
    expected = reference(as_float64(dense), as_float64(host))
    assert type(result) is type(X) and result.dtype == DTYPES[dtype] and tuple(result.shape) == expected.shape
    assert_close(to_numpy(result), expected, dtype, product)
    assert np.array_equal(to_numpy(X), before), "the operand must not be modified"


@pytest.mark.parametrize("product", list(PRODUCTS))
def test_products_with_vectors(xp, product):
    """A 1-D operand works like a one-column (right) or one-row (left) matrix and gives 1-D."""
    rng = np.random.default_rng(len(product) + 50)
    dense, _ = sparse_dense(rng, "float32", density=0.6)
    matrix = bsmm.BlockSparseMatrix.from_dense(to_xp(xp, dense), block_size=BS)
    shape_of, run, reference = PRODUCTS[product]
    vector = random_data(rng, max(shape_of(1)), "float32")  # the inner dimension
    result = run(matrix, to_xp(xp, vector))
    expected = reference(as_float64(dense), as_float64(vector))
    assert tuple(result.shape) == expected.shape and expected.ndim == 1
    assert_close(to_numpy(result), expected, "float32", product)


@pytest.mark.parametrize("transposed", [False, True])
def test_stack_on_the_left(xp, transposed):
    """X (2, 3, C) @ W -> (2, 3, K): leading axes are a stack of rows."""
    rng = np.random.default_rng(60 + transposed)
    dense, _ = sparse_dense(rng, "float32", density=0.6)
    matrix = bsmm.BlockSparseMatrix.from_dense(to_xp(xp, dense), block_size=BS)
    operator = matrix.T if transposed else matrix
    reference_matrix = as_float64(dense.T if transposed else dense)
    stack = random_data(rng, (2, 3, reference_matrix.shape[0]), "float32")
    result = to_xp(xp, stack) @ operator
    assert tuple(result.shape) == (2, 3, reference_matrix.shape[1])
    assert_close(to_numpy(result), as_float64(stack) @ reference_matrix, "float32")


def test_product_with_no_rows(xp):
    rng = np.random.default_rng(61)
    dense, _ = sparse_dense(rng, "float32")
    matrix = bsmm.BlockSparseMatrix.from_dense(to_xp(xp, dense), block_size=BS)
    result = to_xp(xp, np.zeros((0, CB * BS), np.float32)) @ matrix
    assert tuple(result.shape) == (0, KB * BS)


def test_astype(xp):
    """astype casts the block data (a copy) and keeps layout and orientation."""
    require_dtype(xp, DTYPES["bfloat16"])
    rng = np.random.default_rng(8)
    dense, _ = sparse_dense(rng, "float32")
    matrix = bsmm.BlockSparseMatrix.from_dense(to_xp(xp, dense), block_size=BS).T
    cast = matrix.astype("bfloat16")
    assert cast.dtype == DTYPES["bfloat16"] and cast.shape == matrix.shape
    assert np.array_equal(cast.layout, matrix.layout) and cast.data is not matrix.data
    assert np.array_equal(as_float64(to_numpy(cast.to_dense())),
                          as_float64(dense.T.astype(DTYPES["bfloat16"])))


# -- SciPy ---------------------------------------------------------------------------------------------------
def test_to_scipy_round_trip(xp, dtype):
    """to_scipy gives a BSR array of the same matrix; from_scipy gives back layout and blocks."""
    rng = np.random.default_rng(9)
    dense, layout = sparse_dense(rng, dtype)
    matrix = bsmm.BlockSparseMatrix.from_dense(to_xp(xp, dense), block_size=BS)
    bsr = matrix.to_scipy()
    assert isinstance(bsr, scipy.sparse.bsr_array)
    assert bsr.blocksize == (BS, BS) and bsr.shape == dense.shape and bsr.dtype == np.float32
    assert np.array_equal(bsr.toarray(), dense.astype(np.float32))
    if xp is np and dtype == "float32":
        assert np.shares_memory(bsr.data, matrix.data), "float32 data of an untransposed matrix is not copied"

    back = bsmm.BlockSparseMatrix.from_scipy(bsr)
    assert np.array_equal(back.layout, matrix.layout) and back.block_size == BS
    assert back.dtype == np.float32  # SciPy holds float32: that is what comes back by default
    assert np.array_equal(back.to_dense(), dense.astype(np.float32))
    back_in_dtype = bsmm.BlockSparseMatrix.from_scipy(bsr, dtype=dtype)
    assert back_in_dtype.dtype == DTYPES[dtype]
    assert back_in_dtype.to_dense().tobytes() == dense.tobytes()


def test_transposed_to_scipy(xp):
    rng = np.random.default_rng(10)
    dense, _ = sparse_dense(rng, "float32")
    transposed = bsmm.BlockSparseMatrix.from_dense(to_xp(xp, dense), block_size=BS).T
    bsr = transposed.to_scipy()
    assert isinstance(bsr, scipy.sparse.bsr_array) and bsr.shape == dense.T.shape
    assert bsr.has_sorted_indices, "the transposed BSR must be a valid (sorted) BSR"
    assert np.array_equal(bsr.toarray(), dense.T)
    back = bsmm.BlockSparseMatrix.from_scipy(bsr)
    assert np.array_equal(back.layout, transposed.layout)
    assert np.array_equal(back.to_dense(), dense.T)


def test_from_scipy_csr_with_block_size():
    """A CSR input is cut into blocks of the given size; all-zero blocks are absent."""
    rng = np.random.default_rng(11)
    dense, layout = sparse_dense(rng, "float32")
    csr = scipy.sparse.csr_array(dense.astype(np.float64))
    matrix = bsmm.BlockSparseMatrix.from_scipy(csr, block_size=BS)
    assert matrix.block_size == BS and matrix.dtype == np.float64  # the matrix's own dtype is kept
    assert np.array_equal(matrix.layout, layout)
    assert np.array_equal(matrix.to_dense(), dense)
    half = bsmm.BlockSparseMatrix.from_scipy(csr, block_size=BS, dtype=np.float16)
    assert half.dtype == np.float16 and np.array_equal(half.to_dense(), dense.astype(np.float16))


def test_from_scipy_keeps_explicit_zero_blocks_and_sorts():
    """A stored all-zero block stays present; unsorted and duplicate blocks are normalised."""
    data = np.stack([np.full((BS, BS), 2.0), np.zeros((BS, BS)), np.full((BS, BS), 1.0), np.full((BS, BS), 3.0)])
    # block row 0: column 1 then column 0 (unsorted); block row 1: column 1 twice (duplicates)
    bsr = scipy.sparse.bsr_array((data, np.array([1, 0, 1, 1]), np.array([0, 2, 4])), shape=(2 * BS, 2 * BS))
    matrix = bsmm.BlockSparseMatrix.from_scipy(bsr)
    assert matrix.layout.tolist() == [[1, 1], [0, 1]]
    assert matrix.nnzb == 3
    blocks = as_float64(matrix.data)
    assert not blocks[0].any()  # block (0, 0): the explicit zero block
    assert np.all(blocks[1] == 2.0) and np.all(blocks[2] == 4.0)  # (0, 1) and the summed (1, 1)
    assert bsr.indices.tolist() == [1, 0, 1, 1], "the caller's matrix must be left as it was"


def test_from_scipy_of_other_formats():
    """COO and CSC inputs and the older spmatrix classes work too."""
    rng = np.random.default_rng(12)
    dense, layout = sparse_dense(rng, "float32")
    for converted in (scipy.sparse.coo_array(dense), scipy.sparse.csc_matrix(dense),
                      scipy.sparse.bsr_matrix(dense, blocksize=(BS, BS))):
        matrix = bsmm.BlockSparseMatrix.from_scipy(converted, block_size=BS)
        assert np.array_equal(matrix.layout, layout), type(converted).__name__
        assert np.array_equal(matrix.to_dense(), dense), type(converted).__name__


@pytest.mark.parametrize("scipy_blocksize", [(4, 4), (16, 16), (8, 4)])
def test_from_scipy_reblocks_a_bsr_input_of_another_block_size(scipy_blocksize):
    """A BSR input whose own blocks differ from block_size is cut into block_size blocks.

    Fails while from_scipy relies on scipy.sparse.bsr_array(bsr, blocksize=...), which
    keeps a BSR input's own blocksize (the layout is then built from the wrong index).
    """
    rng = np.random.default_rng(13)
    dense, layout = sparse_dense(rng, "float32", cb=4, kb=2)  # (32, 16): divisible by all block sizes used
    bsr = scipy.sparse.bsr_array(dense, blocksize=scipy_blocksize)
    matrix = bsmm.BlockSparseMatrix.from_scipy(bsr, block_size=BS)
    assert matrix.block_size == BS
    assert np.array_equal(matrix.to_dense(), dense)


# -- float64 (NumPy data: the CPU backend) -------------------------------------------------------------------
def test_float64_data_is_kept_on_the_cpu():
    """float64 block data, accepted by BlocksparseMatMul on the CPU, is accepted here too and computed in float64."""
    rng = np.random.default_rng(14)
    layout = random_layout(rng, CB, KB, 0.6)
    data = rng.standard_normal((int(layout.sum()), BS, BS))
    matrix = bsmm.BlockSparseMatrix(layout, data)
    assert matrix.dtype == np.float64 and matrix.data is data
    dense = dense_weight(layout, data, BS)
    X, Y = rng.standard_normal((7, CB * BS)), rng.standard_normal((KB * BS, 3))
    for result, expected in ((X @ matrix, X @ dense), (matrix @ Y, dense @ Y), (matrix.T @ X.T, dense.T @ X.T)):
        assert result.dtype == np.float64
        np.testing.assert_allclose(result, expected, rtol=1e-12, atol=1e-12)


def test_float64_from_dense_astype_and_scipy_round_trip():
    """from_dense, astype, to_scipy and from_scipy keep float64 (from_scipy used to turn it into float32)."""
    rng = np.random.default_rng(15)
    dense, layout = sparse_dense(rng, "float32")
    dense = dense.astype(np.float64) * (1 + 2.0**-40)  # bits float32 cannot hold
    matrix = bsmm.BlockSparseMatrix.from_dense(dense, block_size=BS)
    assert matrix.dtype == np.float64 and np.array_equal(matrix.layout, layout)
    bsr = matrix.to_scipy()
    assert bsr.dtype == np.float64 and np.shares_memory(bsr.data, matrix.data)
    back = bsmm.BlockSparseMatrix.from_scipy(bsr)
    assert back.dtype == np.float64 and back.to_dense().tobytes() == dense.tobytes()
    assert bsmm.BlockSparseMatrix.from_scipy(bsr, dtype=np.float32).dtype == np.float32
    single = matrix.astype(np.float32)
    assert single.dtype == np.float32 and single.astype("float64").dtype == np.float64


def test_from_scipy_of_integers_gives_float32():
    csr = scipy.sparse.csr_array(np.eye(16, dtype=np.int64))
    matrix = bsmm.BlockSparseMatrix.from_scipy(csr, block_size=BS)
    assert matrix.dtype == np.float32 and np.array_equal(matrix.to_dense(), np.eye(16))


def test_layout_values_other_than_one_mean_present():
    """Any finite non-zero layout entry is a present block, as for BlocksparseMatMul."""
    layout = np.array([[2.0, 0.0], [-0.5, 3.0]])
    matrix = bsmm.BlockSparseMatrix(layout, np.ones((3, BS, BS), np.float32))
    assert matrix.layout.tolist() == [[1, 0], [1, 1]] and matrix.nnzb == 3


# -- SciPy's BSR names and scalar arithmetic -------------------------------------------------------------------
def scipy_bsr_of(layout: np.ndarray, data: np.ndarray, bs: int) -> scipy.sparse.bsr_array:
    """SciPy's BSR array of ``data`` in row-major block order over ``layout``, its index built here."""
    rows, cols = np.nonzero(layout)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=layout.shape[0]))])
    return scipy.sparse.bsr_array((data, cols, indptr), shape=(layout.shape[0] * bs, layout.shape[1] * bs))


LAYOUTS = {
    "random": lambda rng: random_layout(rng, CB, KB, 0.5),
    "skewed": lambda rng: skewed_layout(rng, 6, 5),
    "empty": lambda rng: np.zeros((CB, KB), np.uint8),
    "one block": lambda rng: np.ones((1, 1), np.uint8),
}


def layout_and_data(xp, dtype: str, kind: str, seed: int):
    """A layout of ``kind``, fresh blocks for it (host) and the matrix over them (``xp``)."""
    if xp is not np and dtype == "float64":
        pytest.skip("float64 block data is the CPU backend's only")
    rng = np.random.default_rng([seed, len(kind), np.dtype(dtype).num])
    layout = LAYOUTS[kind](rng)
    data = random_data(rng, (int(layout.sum()), BS, BS), np.dtype(dtype))
    return layout, data, bsmm.BlockSparseMatrix(layout, to_xp(xp, data))


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_scipy_names_match_bsr_array(xp, dtype_name, kind):
    """toarray, nnz, blocksize, indptr, indices and data are scipy's for the same blocks; the triple rebuilds W."""
    layout, data, matrix = layout_and_data(xp, dtype_name, kind, 20)
    reference = scipy_bsr_of(layout, data, BS)
    assert matrix.blocksize == reference.blocksize == (BS, BS)
    assert matrix.nnz == reference.nnz == int(layout.sum()) * BS * BS
    assert np.array_equal(matrix.indptr, reference.indptr) and np.array_equal(matrix.indices, reference.indices)
    assert to_numpy(matrix.data).tobytes() == reference.data.tobytes()
    dense = matrix.toarray()
    assert type(dense) is type(matrix.data) and dense.dtype == np.dtype(dtype_name)
    assert to_numpy(dense).tobytes() == reference.toarray().tobytes()
    rebuilt = scipy.sparse.bsr_array((to_numpy(matrix.data), matrix.indices, matrix.indptr), shape=matrix.shape)
    assert np.array_equal(rebuilt.toarray(), dense_weight(layout, data, BS))
    if xp is np and data.size:
        assert np.shares_memory(rebuilt.data, matrix.data), "data is the block array itself, not a copy"
    for table in (matrix.indptr, matrix.indices):
        with pytest.raises(ValueError, match="read-only"):
            table[0] = 1  # the block index is cached and shared: it cannot be changed through W


def test_scipy_names_on_a_transposed_view(xp):
    """A .T view: toarray, nnz and blocksize of the view; no index of its own (data is in the stored order)."""
    layout, data, matrix = layout_and_data(xp, "float32", "random", 21)
    view = matrix.T
    assert to_numpy(view.toarray()).tobytes() == np.ascontiguousarray(dense_weight(layout, data, BS).T,
                                                                          np.float32).tobytes()
    assert view.nnz == matrix.nnz and view.blocksize == (BS, BS) and view.data is matrix.data
    for name in ("indptr", "indices"):
        with pytest.raises(ValueError, match=rf"{name} of a \.T view .* view\.to_scipy\(\)"):
            getattr(view, name)
        assert getattr(view.T, name) is getattr(matrix, name)
    bsr = view.to_scipy()  # the view's own BSR triple, a copy
    assert np.array_equal(bsr.toarray(), dense_weight(layout, data, BS).T)


@pytest.mark.parametrize("transposed", [False, True])
def test_copy(xp, dtype, transposed):
    """copy() holds new data, equal to the old, in the same layout and orientation."""
    layout, data, matrix = layout_and_data(xp, dtype, "random", 22)
    matrix = matrix.T if transposed else matrix
    copied = matrix.copy()
    assert copied.data is not matrix.data and copied.transposed == transposed and copied.dtype == matrix.dtype
    assert np.array_equal(copied.layout, matrix.layout) and copied.data.flags.c_contiguous
    assert to_numpy(copied.data).tobytes() == data.tobytes()
    copied.data[...] = 0
    assert to_numpy(matrix.data).tobytes() == data.tobytes(), "the copy shares no memory with the original"


SCALARS = [2.5, -3, np.float32(0.75), np.float64(-1.25), np.array(4.0), True]
OPERATIONS = {
    "W * s": lambda W, s: W * s,
    "s * W": lambda W, s: s * W,
    "W / s": lambda W, s: W / s,
    "-W": lambda W, s: -W,
}


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("kind", ["random", "empty"])
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_scalar_arithmetic_matches_scipy(xp, dtype_name, kind, operation, transposed):
    """Each operation by each kind of scalar: the float64 dense result in W's dtype and layout, into new
    data, and SciPy's result for the same blocks."""
    layout, data, matrix = layout_and_data(xp, dtype_name, kind, 23)
    reference, dense = scipy_bsr_of(layout, data, BS), dense_weight(layout, data, BS)
    if transposed:
        matrix, reference, dense = matrix.T, reference.T, dense.T
    run = OPERATIONS[operation]
    for scalar in SCALARS:
        what = f"{operation}, {scalar!r}"
        result = run(matrix, scalar)
        assert isinstance(result, bsmm.BlockSparseMatrix), what
        assert result.dtype == np.dtype(dtype_name), f"{what}: W's dtype must be kept"
        assert result.transposed == transposed and np.array_equal(result.layout, matrix.layout)
        assert result.data is not matrix.data and type(result.data) is type(matrix.data)
        assert_close(to_numpy(result.toarray()), run(dense, float(scalar)), dtype_name, what)
        # SciPy promotes as NumPy does and divides through a reciprocal rounded to the scalar's
        # dtype (1. / np.float32(0.75) is float32): the same values up to float32 rounding.
        assert_close(to_numpy(result.toarray()), run(reference, scalar).toarray(), "float32", f"{what} (SciPy)")
    assert to_numpy(matrix.data).tobytes() == data.tobytes(), "the operand must not change"


def test_scalar_arithmetic_in_half_precision(xp):
    """float16 and bfloat16 data stay in their dtype; scaling by a power of two is exact."""
    for name in ("float16", "bfloat16"):
        layout, data, matrix = layout_and_data(xp, name, "random", 24)
        for result in (matrix * 4, 0.5 * matrix, matrix / np.float64(8), -matrix):
            assert result.dtype == DTYPES[name]
        expected = as_float64(data) * 4
        assert np.array_equal(as_float64(to_numpy((matrix * 4).data)), expected)
        assert np.array_equal(as_float64(to_numpy((matrix / np.float64(8)).data)), as_float64(data) / 8)


def test_adding_zero_is_a_copy_and_non_zero_is_refused_as_in_scipy(xp):
    """W ± 0 and 0 ± W are copies (0 - W negated); a non-zero scalar raises NotImplementedError, as SciPy does."""
    layout, data, matrix = layout_and_data(xp, "float32", "random", 25)
    reference = scipy_bsr_of(layout, data, BS)
    for result, expected in ((matrix + 0, data), (0.0 + matrix, data), (matrix - np.float32(0), data),
                             (0 - matrix, -data)):
        assert result.data is not matrix.data and to_numpy(result.data).tobytes() == expected.tobytes()
    refusals = {"W + other": lambda W: W + 1, "other + W": lambda W: 2.5 + W, "W - other": lambda W: W - 1,
                "other - W": lambda W: np.float64(1) - W}
    for expression, run in refusals.items():
        with pytest.raises(NotImplementedError):
            run(reference)  # what is mirrored: SciPy refuses these too
        with pytest.raises(NotImplementedError, match=rf"{expression.replace('+', '[+]')} with a non-zero scalar"):
            run(matrix)


def test_scalar_arithmetic_refusals(xp):
    """Non-scalars, complex numbers, a scalar over W and division by zero are refused, naming the operand."""
    _, _, matrix = layout_and_data(xp, "float32", "random", 26)
    with pytest.raises(TypeError, match=r"W \* other needs other a real scalar .* got list"):
        matrix * [2.0]
    with pytest.raises(TypeError, match=r"other \* W needs other a real scalar .* got ndarray"):
        np.ones(3) * matrix
    with pytest.raises(TypeError, match=r"W \* other needs other a real scalar .* got complex"):
        matrix * 1j
    with pytest.raises(TypeError, match=r"W \+ other needs other a real scalar .* got BlockSparseMatrix"):
        matrix + matrix
    with pytest.raises(TypeError, match=r"other / W is not supported"):
        2 / matrix
    with pytest.raises(ZeroDivisionError, match=r"W / other needs other != 0; got 0"):
        matrix / 0
    with pytest.raises(ZeroDivisionError, match=r"W / other needs other != 0"):
        matrix / np.float32(0)


def test_scaling_by_nan_leaves_absent_blocks_zero():
    """Only the present blocks are scaled, as in SciPy: absent blocks stay zero even for W * nan."""
    layout, data, matrix = layout_and_data(np, "float32", "skewed", 27)
    scaled = (matrix * np.nan).toarray()
    mask = np.kron(layout, np.ones((BS, BS))).astype(bool)
    assert np.isnan(scaled[mask]).all() and not scaled[~mask].any()
    assert np.array_equal(np.isnan(scaled), np.isnan((scipy_bsr_of(layout, data, BS) * np.nan).toarray()))

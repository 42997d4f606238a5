"""bsmm.torch conversions: ``BlockSparseMatrix`` ⇄ ``torch.sparse_bsr`` and ``nn.Linear`` ⇄ ``BlockSparseLinear``.

References are built without bsmm: BSR indices from ``np.nonzero`` of the layout, dense
weights from ``reference.dense_weight``, products in float64 NumPy. CPU cases always run;
CUDA cases carry the ``gpu`` marker and need PyTorch with CUDA and CuPy.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bsmm.torch tests skipped")

import bsmm  # noqa: E402
import bsmm.torch as bt  # noqa: E402
from conftest import require_dtype  # noqa: E402
from reference import as_float64, assert_close, dense_weight, random_data, random_layout, skewed_layout  # noqa: E402
import torch_cases  # noqa: E402
from torch_cases import cuda_or_skip  # noqa: E402

device = torch_cases.device  # the fixture (tests take it by name)

BS = 8
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}
LAYOUTS = {
    "random": lambda rng: random_layout(rng, 5, 3, 0.5),
    "skewed": lambda rng: skewed_layout(rng, 4, 6),
    "empty": lambda rng: np.zeros((3, 5), np.uint8),
    "one block": lambda rng: np.ones((1, 1), np.uint8),
}

pytestmark = pytest.mark.filterwarnings("ignore:Sparse BSR tensor support is in beta state")


def on(device: str, array: np.ndarray):
    """A copy of host ``array`` where bsmm computes for ``device``: NumPy (cpu) or CuPy (cuda)."""
    if device == "cpu":
        return array.copy()
    import cupy

    require_dtype(cupy, array.dtype)
    return cupy.asarray(array)


def host(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") else np.asarray(array)


def pointer(array) -> int:
    return array.ctypes.data if isinstance(array, np.ndarray) else array.data.ptr


def bsr_index(layout: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(crow_indices, col_indices) of ``layout``, row-major, built here."""
    rows, cols = np.nonzero(layout)
    # A copy: np.nonzero's arrays may have odd strides (one element: 16 bytes), which torch.tensor keeps.
    return np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=layout.shape[0]))]), cols.copy()


def case(device: str, dtype: str, kind: str, seed: int):
    """(layout, host blocks, matrix over a device copy of them)."""
    if dtype == "float64" and device != "cpu":
        pytest.skip("float64 block data is the CPU backend's only")
    rng = np.random.default_rng([seed, len(kind), len(dtype)])
    layout = LAYOUTS[kind](rng)
    data = random_data(rng, (int(layout.sum()), BS, BS), bsmm.SUPPORTED_DTYPES.get(dtype, np.dtype(dtype)))
    return layout, data, bsmm.BlockSparseMatrix(layout, on(device, data))


def to_host_float64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy()


# -- BlockSparseMatrix -> torch.sparse_bsr --------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_to_sparse_bsr_shares_the_values(device, dtype, kind):
    """values() is W.data's memory (a write shows on the other side); the index is torch's BSR index."""
    layout, data, matrix = case(device, dtype, kind, 1)
    bsr = bt.to_sparse_bsr(matrix)
    crow, col = bsr_index(layout)
    assert bsr.layout == torch.sparse_bsr and bsr.device.type == device and bsr.dtype == TORCH_DTYPES[dtype]
    assert tuple(bsr.shape) == matrix.shape and tuple(bsr.values().shape) == data.shape
    assert bsr.crow_indices().dtype == torch.int64 and bsr.col_indices().dtype == torch.int64
    assert np.array_equal(bsr.crow_indices().cpu().numpy(), crow)
    assert np.array_equal(bsr.col_indices().cpu().numpy(), col)
    assert np.array_equal(to_host_float64(bsr.to_dense()), dense_weight(layout, data, BS))
    if data.size:
        assert bsr.values().data_ptr() == pointer(matrix.data)
        matrix.data[0] = 7
        assert bool((bsr.values()[0] == 7).all()), "a write to W.data shows in values()"
        bsr.values()[-1].fill_(-3)
        assert (as_float64(host(matrix.data)[-1]) == -3).all(), "a write to values() shows in W.data"


@pytest.mark.parametrize("kind", ["random", "skewed", "one block"])
def test_to_sparse_bsr_of_a_transposed_view_is_a_valid_copy(device, kind):
    """A .T view's blocks are copied, transposed and reordered; copy=False refuses."""
    layout, data, matrix = case(device, "float32", kind, 2)
    bsr = bt.to_sparse_bsr(matrix.T)
    assert tuple(bsr.shape) == matrix.T.shape
    assert np.array_equal(to_host_float64(bsr.to_dense()), dense_weight(layout, data, BS).T)
    crow, col = bsr_index(layout.T)
    assert np.array_equal(bsr.crow_indices().cpu().numpy(), crow)
    assert np.array_equal(bsr.col_indices().cpu().numpy(), col)
    assert bsr.values().data_ptr() != pointer(matrix.data)
    torch.sparse_bsr_tensor(bsr.crow_indices(), bsr.col_indices(), bsr.values(), bsr.shape,
                            check_invariants=True)  # raises unless a valid BSR index
    with pytest.raises(ValueError, match=r"matrix is a \.T view.*copy=None or copy=True"):
        bt.to_sparse_bsr(matrix.T, copy=False)


def test_to_sparse_bsr_copy_true_copies(device):
    layout, data, matrix = case(device, "float32", "random", 3)
    bsr = bt.to_sparse_bsr(matrix, copy=True)
    assert bsr.values().data_ptr() != pointer(matrix.data)
    assert np.array_equal(to_host_float64(bsr.values()), as_float64(data))
    shared = bt.to_sparse_bsr(matrix, copy=False)
    assert shared.values().data_ptr() == pointer(matrix.data)


def test_to_sparse_bsr_refuses_other_types():
    with pytest.raises(TypeError,
                       match="matrix must be a bsmm.BlockSparseMatrix or a bsmm.torch.BlockSparseLinear; got ndarray"):
        bt.to_sparse_bsr(np.ones((8, 8)))


# -- torch.sparse_bsr -> BlockSparseMatrix --------------------------------------------------------------------
def bsr_tensor(layout: np.ndarray, data: np.ndarray, device: str, dtype: str) -> torch.Tensor:
    """A BSR tensor of ``data``'s blocks over ``layout``, its index built here (int32, as a user may)."""
    crow, col = bsr_index(layout)
    values = torch.from_numpy(as_float64(data)).to(device, TORCH_DTYPES[dtype])
    return torch.sparse_bsr_tensor(torch.tensor(crow, dtype=torch.int32, device=device),
                                   torch.tensor(col, dtype=torch.int32, device=device), values,
                                   size=(layout.shape[0] * BS, layout.shape[1] * BS),
                                   # torch's check refuses an empty col_indices on CUDA as "not contiguous"
                                   check_invariants=bool(col.size))


@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_from_sparse_bsr_shares_the_values(device, dtype, kind):
    """W.data is values()' memory (writes cross both ways); layout and blocks are the tensor's."""
    if dtype == "float64" and device != "cpu":
        pytest.skip("float64 block data is the CPU backend's only")
    rng = np.random.default_rng([4, len(kind), len(dtype)])
    layout = LAYOUTS[kind](rng)
    data = random_data(rng, (int(layout.sum()), BS, BS), bsmm.SUPPORTED_DTYPES.get(dtype, np.dtype(dtype)))
    tensor = bsr_tensor(layout, data, device, dtype)
    matrix = bt.from_sparse_bsr(tensor)
    assert isinstance(matrix, bsmm.BlockSparseMatrix) and matrix.shape == tuple(tensor.shape)
    assert matrix.block_size == BS and np.array_equal(matrix.layout, layout) and not matrix.transposed
    assert type(matrix.data).__module__.split(".")[0] == ("numpy" if device == "cpu" else "cupy")
    assert matrix.dtype == bsmm.SUPPORTED_DTYPES.get(dtype, np.dtype(dtype))
    assert np.array_equal(as_float64(host(matrix.toarray())), dense_weight(layout, data, BS))
    if data.size:
        assert pointer(matrix.data) == tensor.values().data_ptr()
        tensor.values()[0].fill_(5)
        assert (as_float64(host(matrix.data)[0]) == 5).all()


def test_from_sparse_bsr_keeps_stored_zero_blocks_and_reads_through_detach():
    """A stored all-zero block stays present; a tensor that requires grad is read without error."""
    values = torch.randn(3, BS, BS, dtype=torch.float64)
    values[1] = 0
    tensor = torch.sparse_bsr_tensor(torch.tensor([0, 2, 3]), torch.tensor([0, 2, 1]), values.requires_grad_(),
                                     size=(2 * BS, 3 * BS), check_invariants=True)
    matrix = bt.from_sparse_bsr(tensor)
    assert matrix.layout.tolist() == [[1, 0, 1], [0, 1, 0]] and matrix.nnzb == 3
    assert np.array_equal(matrix.toarray(), tensor.detach().to_dense().numpy())


def test_from_sparse_bsr_copies_strided_values_and_copy_flags():
    """Non-contiguous values are copied (copy=False refuses); copy=True always copies."""
    rng = np.random.default_rng(5)
    layout = random_layout(rng, 4, 3, 0.6)
    data = random_data(rng, (int(layout.sum()), BS, BS), np.float32)
    crow, col = bsr_index(layout)
    strided = torch.from_numpy(data).transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    assert not strided.is_contiguous()
    tensor = torch.sparse_bsr_tensor(torch.tensor(crow), torch.tensor(col), strided, size=(4 * BS, 3 * BS),
                                     check_invariants=True)
    matrix = bt.from_sparse_bsr(tensor)
    assert matrix.data.flags.c_contiguous and pointer(matrix.data) != tensor.values().data_ptr()
    assert np.array_equal(matrix.toarray(), dense_weight(layout, data, BS))
    with pytest.raises(ValueError, match=r"tensor's values are not contiguous .*copy=None or copy=True"):
        bt.from_sparse_bsr(tensor, copy=False)
    contiguous = bsr_tensor(layout, data, "cpu", "float32")
    copied = bt.from_sparse_bsr(contiguous, copy=True)
    assert pointer(copied.data) != contiguous.values().data_ptr()
    assert np.array_equal(copied.toarray(), dense_weight(layout, data, BS))


def test_round_trip_shares_one_buffer(device):
    """from_sparse_bsr(to_sparse_bsr(W)) is W's layout over W's own data."""
    layout, data, matrix = case(device, "float32", "skewed", 6)
    back = bt.from_sparse_bsr(bt.to_sparse_bsr(matrix))
    assert np.array_equal(back.layout, layout) and pointer(back.data) == pointer(matrix.data)
    assert np.array_equal(host(back.toarray()), host(matrix.toarray()))


def test_from_sparse_bsr_refusals():
    """Each kind of tensor bsmm cannot take is refused, naming it."""
    dense = torch.randn(16, 32)
    with pytest.raises(TypeError, match=r"tensor must be a torch.Tensor of layout torch.sparse_bsr.*got torch.strided"):
        bt.from_sparse_bsr(dense)
    with pytest.raises(TypeError, match=r"got torch.sparse_csr"):
        bt.from_sparse_bsr(dense.to_sparse_csr())
    with pytest.raises(TypeError, match=r"got ndarray"):
        bt.from_sparse_bsr(dense.numpy())
    with pytest.raises(ValueError, match=r"without batch or dense dimensions; got shape \(2, 16, 32\)"):
        bt.from_sparse_bsr(torch.randn(2, 16, 32).to_sparse_bsr((8, 8)))
    with pytest.raises(ValueError, match=r"without batch or dense dimensions; got shape \(16, 32, 2\)"):
        bt.from_sparse_bsr(torch.randn(16, 32, 2).to_sparse_bsr((8, 8), dense_dim=1))
    with pytest.raises(ValueError, match=r"square blocks .* got blocksize \(8, 16\)"):
        bt.from_sparse_bsr(dense.to_sparse_bsr((8, 16)))
    with pytest.raises(ValueError, match=r"square blocks .* got blocksize \(4, 4\)"):
        bt.from_sparse_bsr(dense.to_sparse_bsr((4, 4)))
    with pytest.raises(TypeError, match=r"tensor has dtype torch.int32"):
        bt.from_sparse_bsr(dense.to(torch.int32).to_sparse_bsr((8, 8)))
    values = torch.randn(2, BS, BS)
    for crow, col in (([0, 2, 2], [1, 0]), ([0, 2, 2], [1, 1])):  # unsorted, then duplicated block columns
        unsorted = torch.sparse_bsr_tensor(torch.tensor(crow), torch.tensor(col), values, size=(16, 16),
                                           check_invariants=False)
        with pytest.raises(ValueError, match=r"col_indices must be sorted and distinct within each block row"):
            bt.from_sparse_bsr(unsorted)
    for crow, col in (([0, 1, 2], [0, 2]), ([0, 1, 3], [0, 1])):  # a column out of range, crow past the end
        broken = torch.sparse_bsr_tensor(torch.tensor(crow), torch.tensor(col), values, size=(16, 16),
                                         check_invariants=False)
        with pytest.raises(ValueError, match=r"do not describe a BSR index of \(2, 2\) blocks"):
            bt.from_sparse_bsr(broken)


@pytest.mark.gpu
def test_from_sparse_bsr_refuses_float64_on_cuda():
    cuda_or_skip()
    tensor = torch.randn(16, 16, dtype=torch.float64, device="cuda").to_sparse_bsr((8, 8))
    with pytest.raises(TypeError, match=r"tensor has dtype torch.float64, which bsmm runs only on the CPU"):
        bt.from_sparse_bsr(tensor)


# -- torch's own products on the converted tensor agree with bsmm's ----------------------------------------------
@pytest.mark.parametrize("n", [1, 7])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", ["random", "skewed", "empty"])
def test_torch_sparse_products_agree_with_bsmm(dtype, kind, n):
    """torch.sparse.mm and F.linear on the BSR tensors give bsmm's products and the float64 dense ones."""
    layout, data, matrix = case("cpu", dtype, kind, 7)
    dense = dense_weight(layout, data, BS)  # (C, K)
    rng = np.random.default_rng([8, n])
    y = random_data(rng, (dense.shape[1], n), np.dtype(dtype))  # W @ y
    x = random_data(rng, (n, dense.shape[0]), np.dtype(dtype))  # x @ W
    bsr, bsr_t = bt.to_sparse_bsr(matrix), bt.to_sparse_bsr(matrix.T)
    assert_close(to_host_float64(torch.sparse.mm(bsr, torch.from_numpy(y))), dense @ as_float64(y), dtype)
    assert_close(matrix @ y, dense @ as_float64(y), dtype)
    # nn.Linear's weight is (out, in): W.T's BSR tensor makes F.linear(x, ·) = x @ W, bsmm's fprop.
    linear = torch.nn.functional.linear(torch.from_numpy(x), bsr_t)
    assert_close(to_host_float64(linear), as_float64(x) @ dense, dtype)
    assert_close(to_host_float64(linear), x @ matrix, dtype)
    transposed = torch.nn.functional.linear(torch.from_numpy(np.ascontiguousarray(y.T)), bsr)
    assert_close(to_host_float64(transposed), as_float64(y).T @ dense.T, dtype)
    assert_close(to_host_float64(transposed), y.T @ matrix.T, dtype)


# -- nn.Linear <-> BlockSparseLinear -----------------------------------------------------------------------------------
def trained_linear(in_features: int, out_features: int, dtype=torch.float32, device="cpu", bias=True, seed=0):
    """An nn.Linear after a few Adam steps on a random regression: weights that are not its initialization."""
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
    optimizer = torch.optim.Adam(linear.parameters(), lr=1e-2)
    x = torch.randn(64, in_features, device=device, dtype=dtype)
    target = torch.randn(64, out_features, device=device, dtype=dtype)
    for _ in range(5):
        loss = (linear(x) - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return linear


def blocks_of(weight: torch.Tensor) -> np.ndarray:
    """(in // BS, out // BS, BS, BS) float64 blocks of W = weight.T, built here."""
    w = to_host_float64(weight).T
    return w.reshape(w.shape[0] // BS, BS, w.shape[1] // BS, BS).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_from_linear_at_full_density_reproduces_the_layer(device, dtype):
    """Density 1: weight and bias bitwise linear's; outputs within the dtype's rounding of linear's and of float64.

    The outputs are not bitwise equal: bsmm's kernels sum in another order than PyTorch's GEMM.
    """
    if dtype == "float64" and device != "cpu":
        pytest.skip("float64 runs on the CPU only")
    linear = trained_linear(48, 24, device=device).to(TORCH_DTYPES[dtype])
    layer = bt.BlockSparseLinear.from_linear(linear, density=1.0, block_size=BS)
    assert layer.op.layout.all() and layer.weight.dtype == linear.weight.dtype
    assert layer.weight.device == linear.weight.device and layer.layout.device == linear.weight.device
    assert torch.equal(layer.to_dense_weight().T, linear.weight) and torch.equal(layer.bias, linear.bias)
    x = torch.randn(7, 48, device=device).to(TORCH_DTYPES[dtype])
    expected = to_host_float64(x) @ to_host_float64(linear.weight).T + to_host_float64(linear.bias)
    with torch.no_grad():
        assert_close(to_host_float64(layer(x)), expected, dtype, "from_linear")
        assert_close(to_host_float64(layer(x)), to_host_float64(linear(x)), dtype, "from_linear against linear")
    back = layer.to_linear()
    assert type(back) is torch.nn.Linear and back.weight.dtype == linear.weight.dtype
    assert back.weight.device == linear.weight.device
    assert torch.equal(back.weight, linear.weight) and torch.equal(back.bias, linear.bias), "round trip: identical"


@pytest.mark.parametrize("density", [0.5, 0.2, 0.0])
def test_from_linear_keeps_the_blocks_of_largest_norm(device, density):
    """density d keeps the round(d × blocks) blocks of largest Frobenius norm, copied exactly; the rest are zero."""
    linear = trained_linear(5 * BS, 3 * BS, device=device, seed=1)
    with torch.no_grad():  # spread the block norms so that the ranking is clear-cut
        scale = torch.from_numpy(np.random.default_rng(9).uniform(0.1, 3, (3, 5))).float().to(device)
        linear.weight.mul_(scale.repeat_interleave(BS, 0).repeat_interleave(BS, 1))
    blocks = blocks_of(linear.weight)
    norms = np.sqrt((blocks ** 2).sum(axis=(2, 3)))
    expected = np.zeros(norms.size, np.uint8)
    expected[np.argsort(-norms, axis=None)[:round(density * norms.size)]] = 1
    expected = expected.reshape(norms.shape)
    layer = bt.BlockSparseLinear.from_linear(linear, density=density, block_size=BS)
    assert np.array_equal(layer.op.layout, expected)
    assert np.array_equal(to_host_float64(layer.to_dense_weight()),
                          dense_weight(expected, blocks[expected.astype(bool)], BS))
    assert torch.equal(layer.bias, linear.bias)
    assert np.array_equal(to_host_float64(layer.to_linear().weight).T,
                          dense_weight(expected, blocks[expected.astype(bool)], BS))


def test_from_linear_ties_keep_the_lower_input_block():
    """Equal norms: row-major over the (in, out) layout decides, as BlockSparseMatrix.from_dense."""
    linear = torch.nn.Linear(3 * BS, 2 * BS)
    with torch.no_grad():
        linear.weight.fill_(0.5)
    layer = bt.BlockSparseLinear.from_linear(linear, density=0.5, block_size=BS)
    assert layer.op.layout.tolist() == [[1, 1], [1, 0], [0, 0]]


@pytest.mark.parametrize("as_tensor", [False, True])
def test_from_linear_with_a_layout(device, as_tensor):
    """layout: exactly its blocks, in bsmm's (in, out) orientation; no bias stays no bias."""
    linear = trained_linear(4 * BS, 6 * BS, device=device, bias=False, seed=2)
    layout = skewed_layout(np.random.default_rng(10), 4, 6)
    given = torch.from_numpy(layout) if as_tensor else layout
    layer = bt.BlockSparseLinear.from_linear(linear, given, block_size=BS)
    kept = blocks_of(linear.weight)[layout.astype(bool)]
    assert np.array_equal(layer.op.layout, layout) and layer.bias is None
    assert np.array_equal(to_host_float64(layer.weight), kept)
    x = torch.randn(5, 4 * BS, device=device)
    with torch.no_grad():
        assert_close(to_host_float64(layer(x)), to_host_float64(x) @ dense_weight(layout, kept, BS), "float32")
    assert layer.to_linear().bias is None


def test_from_linear_without_a_selector_keeps_the_non_zero_blocks():
    """Neither layout nor density: blocks holding a non-zero (a weight zeroed by another pruning) are kept."""
    linear = trained_linear(2 * BS, 3 * BS, seed=3)
    with torch.no_grad():
        linear.weight[BS:2 * BS, :BS] = 0  # W block (0, 1): weight rows are W's columns
        linear.weight[:BS, BS:2 * BS] = 0  # W block (1, 0)
    layer = bt.BlockSparseLinear.from_linear(linear, block_size=BS)
    assert layer.op.layout.tolist() == [[1, 0, 1], [0, 1, 1]]
    assert torch.equal(layer.to_linear().weight, linear.weight)


def test_from_linear_and_to_linear_leave_the_random_generator_alone():
    """Neither draws from torch's generator (the layer's own initialization is undone, not seen)."""
    linear = trained_linear(2 * BS, 2 * BS, seed=4)
    state = torch.get_rng_state()
    layer = bt.BlockSparseLinear.from_linear(linear, density=0.5, block_size=BS)
    layer.to_linear()
    assert torch.equal(torch.get_rng_state(), state)


def test_from_linear_feature_axis_zero():
    linear = trained_linear(2 * BS, 3 * BS, seed=5)
    layer = bt.BlockSparseLinear.from_linear(linear, density=1.0, block_size=BS, feature_axis=0)
    x = torch.randn(4, 2 * BS)
    with torch.no_grad():
        assert_close(to_host_float64(layer(x.T.contiguous()).T), to_host_float64(linear(x)), "float32")


def test_from_linear_refusals():
    linear = torch.nn.Linear(2 * BS, 3 * BS)
    with pytest.raises(TypeError, match="linear must be a torch.nn.Linear; got Conv1d"):
        bt.BlockSparseLinear.from_linear(torch.nn.Conv1d(16, 24, 1), density=0.5, block_size=BS)
    with pytest.raises(ValueError, match="give layout or density, not both"):
        bt.BlockSparseLinear.from_linear(linear, np.ones((2, 3)), density=0.5, block_size=BS)
    with pytest.raises(ValueError, match=r"in_features 20 and out_features 24 must be multiples of block_size 8"):
        bt.BlockSparseLinear.from_linear(torch.nn.Linear(20, 24), density=0.5, block_size=BS)
    with pytest.raises(ValueError, match=r"layout must have shape .* = \(2, 3\), the transpose of linear.weight's"):
        bt.BlockSparseLinear.from_linear(linear, np.ones((3, 2)), block_size=BS)
    with pytest.raises(ValueError, match=r"density must be in \[0, 1\]; got 1.5"):
        bt.BlockSparseLinear.from_linear(linear, density=1.5, block_size=BS)
    with pytest.raises(ValueError, match=r"block_size must be one of"):
        bt.BlockSparseLinear.from_linear(linear, density=0.5, block_size=4)
    with pytest.raises(TypeError, match=r"linear.weight has dtype torch.complex64; supported dtypes are"):
        bt.BlockSparseLinear.from_linear(torch.nn.Linear(16, 16, dtype=torch.complex64), block_size=BS)


@pytest.mark.gpu
def test_from_linear_refuses_float64_on_cuda():
    cuda_or_skip()
    linear = torch.nn.Linear(16, 16, device="cuda", dtype=torch.float64)
    with pytest.raises(TypeError, match=r"linear.weight has dtype torch.float64, which bsmm runs only on the CPU"):
        bt.BlockSparseLinear.from_linear(linear, block_size=BS)

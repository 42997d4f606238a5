"""The three passes of ``BlocksparseMatMul`` against float64 dense references.

Every comparison goes through ``reference.py``, which builds W from the layout
and block data with a plain loop (never bsmm's own ``to_dense``). Inputs are
fresh standard-normal data; each pass is called with ``out=None`` and with a
NaN-poisoned ``out=`` so an element a kernel forgets to write cannot pass.
"""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import scipy.sparse
from hypothesis import given, settings, strategies as st

import bsmm
import bsmm.config
from bsmm.backends.cuda.policy import Policy, current_policy, planning
from conftest import poisoned, snapshot, to_numpy, to_xp
from reference import (
    DTYPES,
    as_float64,
    assert_close,
    dense_weight,
    random_data,
    random_layout,
    ref_bprop,
    ref_fprop,
    ref_updat,
    rel_error,
    skewed_layout,
    tolerance,
)

PASSES = ("fprop", "bprop", "updat")
BLOCK_SIZES = (8, 16, 32, 64, 128)
# Layout shape in blocks per block size: non-square (C != K), at least 4x4 for
# the skewed layout, and a smaller one for 128 to keep the suite fast.
SHAPE_IN_BLOCKS = {8: (7, 5), 16: (6, 5), 32: (5, 6), 64: (5, 4), 128: (4, 5)}
BATCH_SIZES = (0, 1, 7, 32, 129)


@dataclasses.dataclass
class Case:
    """One operator with host inputs for all three passes."""

    op: bsmm.BlocksparseMatMul
    layout: np.ndarray
    dtype: str
    x: np.ndarray  # (N, C) or (C, N)
    dy: np.ndarray  # (N, K) or (K, N)
    w: np.ndarray  # (nnzb, bs, bs)
    tolerance_name: str = ""  # the tolerance to compare at, if not the dtype's ("tf32")

    @property
    def bs(self) -> int:
        return self.op.block_size

    @property
    def axis(self) -> int:
        return self.op.feature_axis


def make_case(rng, layout, bs, n, dtype, axis) -> Case:
    op = bsmm.BlocksparseMatMul(layout, block_size=bs, feature_axis=axis)

    def activation(features):
        return (n, features) if axis == 1 else (features, n)

    return Case(
        op=op,
        layout=np.asarray(layout),
        dtype=dtype,
        x=random_data(rng, activation(op.C), dtype),
        dy=random_data(rng, activation(op.K), dtype),
        w=random_data(rng, op.w_shape, dtype),
    )


def make_layout(rng, kind: str, cb: int, kb: int) -> np.ndarray:
    if kind == "random":
        return random_layout(rng, cb, kb, 0.4)
    if kind == "skewed":
        return skewed_layout(rng, cb, kb)
    if kind == "zero":
        return np.zeros((cb, kb), dtype=np.uint8)
    if kind == "full":
        return np.ones((cb, kb), dtype=np.uint8)
    raise AssertionError(kind)


def reference(case: Case, pass_name: str) -> np.ndarray:
    if pass_name == "fprop":
        return ref_fprop(case.layout, case.w, case.bs, case.x, case.axis)
    if pass_name == "bprop":
        return ref_bprop(case.layout, case.w, case.bs, case.dy, case.axis)
    return ref_updat(case.layout, case.bs, case.x, case.dy, case.axis)


def device_inputs(xp, case: Case, pass_name: str) -> tuple:
    """The positional arguments of ``pass_name``, as ``xp`` arrays."""
    host = {"fprop": (case.x, case.w), "bprop": (case.dy, case.w), "updat": (case.x, case.dy)}[pass_name]
    return tuple(to_xp(xp, a) for a in host)


def call(op, pass_name: str, args: tuple, **kwargs):
    if pass_name == "fprop":
        return op(*args, **kwargs)  # __call__ is the seed's spelling of fprop
    return getattr(op, pass_name)(*args, **kwargs)


def check_pass(xp, case: Case, pass_name: str) -> None:
    """out=None and a NaN-poisoned out= both give the reference, in x's dtype and library."""
    expected = reference(case, pass_name)
    args = device_inputs(xp, case, pass_name)

    result = call(case.op, pass_name, args)
    assert type(result) is type(args[0]), "result must be of the inputs' library"
    assert result.dtype == DTYPES[case.dtype]
    assert tuple(result.shape) == expected.shape
    assert_close(to_numpy(result), expected, case.tolerance_name or case.dtype, f"{pass_name} out=None")

    out = poisoned(xp, expected.shape, DTYPES[case.dtype])
    returned = call(case.op, pass_name, args, out=out)
    assert returned is out, "a pass given out= must return that very object"
    written = as_float64(to_numpy(out))
    assert np.isfinite(written).all(), f"{pass_name} left {np.count_nonzero(~np.isfinite(written))} elements unwritten"
    assert_close(written, expected, case.tolerance_name or case.dtype, f"{pass_name} out=")


# -- the main grid ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", BATCH_SIZES)
@pytest.mark.parametrize("layout_kind", ["random", "skewed", "zero"])
@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_passes_match_reference(xp, bs, dtype, feature_axis, layout_kind, n):
    """fprop, bprop and updat equal x·W, dy·Wᵀ and xᵀ·dy (present blocks) in float64."""
    rng = np.random.default_rng([bs, feature_axis, n, len(layout_kind), DTYPES[dtype].num])
    cb, kb = SHAPE_IN_BLOCKS[bs]
    case = make_case(rng, make_layout(rng, layout_kind, cb, kb), bs, n, dtype, feature_axis)
    for pass_name in PASSES:
        check_pass(xp, case, pass_name)


@pytest.mark.gpu
@pytest.mark.parametrize("layout_kind", ["random", "skewed"])
@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("dtype", [*DTYPES, "tf32"])
@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_passes_match_reference_at_4096_rows(cupy, bs, dtype, feature_axis, layout_kind):
    """N = 4096 reaches the large-batch kernels (256-row TMA tiles, wgmma groups, transposed updat
    operands) that the grid's batches stay under. GPU only: the CPU backend has no such variants."""
    rng = np.random.default_rng([bs, feature_axis, 4096, len(layout_kind), len(dtype)])
    cb, kb = SHAPE_IN_BLOCKS[bs]
    case = make_case(rng, make_layout(rng, layout_kind, cb, kb), bs, 4096, "float32" if dtype == "tf32" else dtype,
                     feature_axis)
    if dtype == "tf32":
        case.op = bsmm.BlocksparseMatMul(case.layout, block_size=bs, feature_axis=feature_axis, tf32=True)
        case.tolerance_name = "tf32"
    for pass_name in PASSES:
        check_pass(cupy, case, pass_name)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [64, 128])
def test_tf32_fprop_through_transposed_weights(cupy, bs):
    """On Hopper a TF32 fprop runs as the transposed layout's bprop over transposed weight blocks
    (TransposedWeightsFprop): calls with new weights (the kept workspace rewritten) and an
    accumulating call all match the float64 reference; a skewed layout, N off the tile."""
    from bsmm.backends.cuda import copy_plans
    from bsmm.backends.cuda import plan_cache

    rng = np.random.default_rng([bs, 7])
    layout = skewed_layout(rng, *SHAPE_IN_BLOCKS[bs])
    op = bsmm.BlocksparseMatMul(layout, block_size=bs, tf32=True)
    x_host = random_data(rng, (300, op.C), "float32")
    x = cupy.asarray(x_host)
    plan = plan_cache.plan_for(op.index, "fprop", 300, "float32", 1, True, True)
    assert isinstance(plan, copy_plans.TransposedWeightsFprop) == (cupy.cuda.Device().compute_capability == "90")
    for _ in range(3):
        w = random_data(rng, op.w_shape, "float32")
        assert_close(to_numpy(op(x, cupy.asarray(w))), ref_fprop(layout, w, bs, x_host, 1), "tf32")
    start = random_data(rng, (300, op.K), "float32")
    out = cupy.asarray(start)
    op(x, cupy.asarray(w), out=out, accumulate=True)
    assert_close(to_numpy(out), as_float64(start) + ref_fprop(layout, w, bs, x_host, 1), "tf32")


@pytest.mark.parametrize("n", BATCH_SIZES[1:])
@pytest.mark.parametrize("layout_kind", ["random", "skewed"])
@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_tf32_passes_match_reference(xp, bs, feature_axis, layout_kind, n):
    """tf32=True: float32 data on TF32 tensor cores (GPU; the CPU computes exactly), within 2e-3."""
    rng = np.random.default_rng([bs, feature_axis, n, len(layout_kind), 32])
    cb, kb = SHAPE_IN_BLOCKS[bs]
    case = make_case(rng, make_layout(rng, layout_kind, cb, kb), bs, n, "float32", feature_axis)
    case.op = bsmm.BlocksparseMatMul(case.layout, block_size=bs, feature_axis=feature_axis, tf32=True)
    case.tolerance_name = "tf32"
    for pass_name in PASSES:
        check_pass(xp, case, pass_name)


@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("shape_in_blocks", [(1, 1), (1, 6), (6, 1), (3, 8)])
def test_passes_full_and_thin_layouts(xp, shape_in_blocks, feature_axis):
    """A fully dense layout and single block rows/columns (one segment, one operand)."""
    rng = np.random.default_rng(list(shape_in_blocks) + [feature_axis])
    case = make_case(rng, make_layout(rng, "full", *shape_in_blocks), 16, 9, "float32", feature_axis)
    for pass_name in PASSES:
        check_pass(xp, case, pass_name)


@pytest.mark.parametrize("n", [4, 8, 20, 40, 72])
@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bs", [8, 32, 64])
def test_updat_batch_sizes_off_the_tile_depth(xp, bs, dtype, feature_axis, n):
    """updat sums over N: batch sizes whose rows are whole 16-byte vectors (N = 4, 8, 20, ...)
    but not whole multiples of a 16/32/64-deep reduction tile end in a partial tile."""
    rng = np.random.default_rng([bs, n, feature_axis, DTYPES[dtype].num, 2])
    case = make_case(rng, random_layout(rng, 3, 2, 0.7), bs, n, dtype, feature_axis)
    check_pass(xp, case, "updat")


@pytest.mark.parametrize("feature_axis", [1, 0])
def test_passes_with_empty_block_rows_and_columns(xp, feature_axis):
    """Outputs fed by an empty block column (fprop) or row (bprop) are exactly zero."""
    rng = np.random.default_rng(7)
    layout = random_layout(rng, 6, 5, 0.7)
    layout[[0, 4], :] = 0  # empty block rows: bprop outputs there must be 0
    layout[:, [1, 3]] = 0  # empty block columns: fprop outputs there must be 0
    case = make_case(rng, layout, 8, 11, "float32", feature_axis)
    check_pass(xp, case, "fprop")
    check_pass(xp, case, "bprop")

    y = to_numpy(case.op(to_xp(xp, case.x), to_xp(xp, case.w)))
    dx = to_numpy(case.op.bprop(to_xp(xp, case.dy), to_xp(xp, case.w)))
    y_features = y if feature_axis == 1 else y.T  # (N, K)
    dx_features = dx if feature_axis == 1 else dx.T  # (N, C)
    for k in (1, 3):
        assert not y_features[:, k * 8:(k + 1) * 8].any()
    for c in (0, 4):
        assert not dx_features[:, c * 8:(c + 1) * 8].any()


# -- updat accumulate ----------------------------------------------------------------------------
@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bs", [8, 32])
def test_updat_accumulate_adds_to_out(xp, bs, dtype, feature_axis):
    """accumulate=True: out = G + xᵀ·dy; two steps sum both gradients."""
    rng = np.random.default_rng([bs, feature_axis, DTYPES[dtype].num, 1])
    layout = skewed_layout(rng, 5, 4)
    first = make_case(rng, layout, bs, 13, dtype, feature_axis)
    second = make_case(rng, layout, bs, 13, dtype, feature_axis)
    op = first.op
    start = random_data(rng, op.w_shape, dtype)  # G

    out = to_xp(xp, start)
    returned = op.updat(to_xp(xp, first.x), to_xp(xp, first.dy), out=out, accumulate=True)
    assert returned is out
    one_step = as_float64(start) + ref_updat(layout, bs, first.x, first.dy, feature_axis)
    assert_close(to_numpy(out), one_step, dtype, "G + dW")

    op.updat(to_xp(xp, second.x), to_xp(xp, second.dy), out=out, accumulate=True)
    two_steps = one_step + ref_updat(layout, bs, second.x, second.dy, feature_axis)
    assert_close(to_numpy(out), two_steps, dtype, "G + dW1 + dW2")


@pytest.mark.parametrize("feature_axis", [1, 0])
def test_updat_accumulate_from_zero_equals_sum_of_separate_gradients(xp, feature_axis):
    """Summing two steps into a zero buffer equals adding the two separate updat results."""
    rng = np.random.default_rng(11 + feature_axis)
    layout = random_layout(rng, 4, 6, 0.5)
    a = make_case(rng, layout, 16, 20, "float32", feature_axis)
    b = make_case(rng, layout, 16, 20, "float32", feature_axis)
    op = a.op
    buffer = to_xp(xp, np.zeros(op.w_shape, np.float32))
    op.updat(to_xp(xp, a.x), to_xp(xp, a.dy), out=buffer, accumulate=True)
    op.updat(to_xp(xp, b.x), to_xp(xp, b.dy), out=buffer, accumulate=True)
    separate = as_float64(to_numpy(op.updat(to_xp(xp, a.x), to_xp(xp, a.dy)))) + as_float64(
        to_numpy(op.updat(to_xp(xp, b.x), to_xp(xp, b.dy)))
    )
    assert_close(to_numpy(buffer), separate, "float32")


@pytest.mark.parametrize("feature_axis", [1, 0])
def test_updat_with_no_rows(xp, feature_axis):
    """N = 0: the gradient is zero, so accumulate leaves out bitwise unchanged and overwrite zeroes it."""
    rng = np.random.default_rng(5)
    case = make_case(rng, random_layout(rng, 3, 4, 0.6), 8, 0, "float32", feature_axis)
    start = random_data(rng, case.op.w_shape, "float32")
    out = to_xp(xp, start)
    case.op.updat(to_xp(xp, case.x), to_xp(xp, case.dy), out=out, accumulate=True)
    assert to_numpy(out).tobytes() == start.tobytes()
    case.op.updat(to_xp(xp, case.x), to_xp(xp, case.dy), out=out)
    assert not to_numpy(out).any()


# -- fprop / bprop accumulate -------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 129])
@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bs", [8, 32, 64])
@pytest.mark.parametrize("pass_name", ["fprop", "bprop"])
def test_activation_passes_accumulate_into_out(xp, pass_name, bs, dtype, feature_axis, n):
    """accumulate=True: out = Y0 + result, also for empty block columns/rows (out unchanged there)."""
    rng = np.random.default_rng([bs, feature_axis, DTYPES[dtype].num, n, len(pass_name)])
    layout = make_layout(rng, "skewed", 5, 4)
    layout[:, 1] = 0  # an empty block column: fprop adds nothing there
    layout[2, :] = 0  # an empty block row: bprop adds nothing there
    case = make_case(rng, layout, bs, n, dtype, feature_axis)
    expected = reference(case, pass_name)
    start = random_data(rng, expected.shape, dtype)
    out = to_xp(xp, start)
    returned = call(case.op, pass_name, device_inputs(xp, case, pass_name), out=out, accumulate=True)
    assert returned is out
    assert_close(to_numpy(out), as_float64(start) + expected, dtype, f"{pass_name} Y0 + result")
    # A second, repeated call (the GPU's fast path) adds again.
    call(case.op, pass_name, device_inputs(xp, case, pass_name), out=out, accumulate=True)
    assert_close(to_numpy(out), as_float64(start) + 2 * expected, dtype, f"{pass_name} Y0 + 2 result")


@pytest.mark.parametrize("pass_name", ["fprop", "bprop"])
def test_activation_pass_accumulate_needs_out(xp, pass_name):
    rng = np.random.default_rng(3)
    case = make_case(rng, random_layout(rng, 3, 4, 0.6), 8, 5, "float32", 1)
    with pytest.raises(ValueError, match="accumulate=True needs out="):
        call(case.op, pass_name, device_inputs(xp, case, pass_name), accumulate=True)


# -- NaN / Inf: absent blocks are structural zeros ---------------------------------------------
def _nan_layout() -> np.ndarray:
    """Block row 1 has blocks in columns 0 and 3; block row 2 is empty; column 2 holds only row 3."""
    return np.array(
        [
            [1, 1, 0, 0, 1],
            [1, 0, 0, 1, 0],
            [0, 0, 0, 0, 0],
            [0, 1, 1, 1, 0],
        ],
        dtype=np.uint8,
    )


def _poison(array: np.ndarray, sample: int, feature: int, axis: int, value: float) -> np.ndarray:
    poisoned_copy = array.copy()
    poisoned_copy[(sample, feature) if axis == 1 else (feature, sample)] = value
    return poisoned_copy


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # BLAS touching inf
@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nonfinite_input_reaches_exactly_the_outputs_its_blocks_feed(xp, dtype, feature_axis, value):
    """A NaN/Inf in x (dy) spreads only through present blocks, as with scipy.sparse.

    fprop: x[n, j] with j in block row 1 -> y[n, block columns 0 and 3], nothing else.
    bprop: dy[n, j] with j in block column 3 -> dx[n, block rows 1 and 3].
    updat: x[n, j] -> row j % bs of every block in block row 1; dy[n, j] -> column j % bs
    of every block in block column 3. Every other output equals the reference computed
    with the poisoned element set to zero.
    """
    bs, n_rows, sample = 8, 6, 4
    layout = _nan_layout()
    rng = np.random.default_rng([feature_axis, DTYPES[dtype].num])
    case = make_case(rng, layout, bs, n_rows, dtype, feature_axis)
    op, coords = case.op, list(zip(*np.nonzero(layout)))
    x_feature, dy_feature = 1 * bs + 3, 3 * bs + 5

    def check(actual, expected_bad, clean_reference):
        actual = as_float64(to_numpy(actual))
        assert np.array_equal(~np.isfinite(actual), expected_bad), "non-finite values in the wrong places"
        assert_close(actual[~expected_bad], clean_reference[~expected_bad], dtype, "finite part")

    x_bad = _poison(case.x, sample, x_feature, feature_axis, value)
    dy_bad = _poison(case.dy, sample, dy_feature, feature_axis, value)
    x_clean = _poison(case.x, sample, x_feature, feature_axis, 0)
    dy_clean = _poison(case.dy, sample, dy_feature, feature_axis, 0)

    # fprop
    bad = np.zeros((n_rows, op.K), dtype=bool)
    for k in (0, 3):
        bad[sample, k * bs:(k + 1) * bs] = True
    y = op(to_xp(xp, x_bad), to_xp(xp, case.w))
    check(y, bad if feature_axis == 1 else bad.T, ref_fprop(layout, case.w, bs, x_clean, feature_axis))

    # bprop
    bad = np.zeros((n_rows, op.C), dtype=bool)
    for c in (1, 3):
        bad[sample, c * bs:(c + 1) * bs] = True
    dx = op.bprop(to_xp(xp, dy_bad), to_xp(xp, case.w))
    check(dx, bad if feature_axis == 1 else bad.T, ref_bprop(layout, case.w, bs, dy_clean, feature_axis))

    # updat, poisoned x then poisoned dy
    bad = np.zeros(op.w_shape, dtype=bool)
    for b, (r, _) in enumerate(coords):
        if r == 1:
            bad[b, x_feature % bs, :] = True
    dw = op.updat(to_xp(xp, x_bad), to_xp(xp, case.dy))
    check(dw, bad, ref_updat(layout, bs, x_clean, case.dy, feature_axis))

    bad = np.zeros(op.w_shape, dtype=bool)
    for b, (_, k) in enumerate(coords):
        if k == 3:
            bad[b, :, dy_feature % bs] = True
    dw = op.updat(to_xp(xp, case.x), to_xp(xp, dy_bad))
    check(dw, bad, ref_updat(layout, bs, case.x, dy_clean, feature_axis))


@pytest.mark.parametrize("feature_axis", [1, 0])
def test_nan_under_absent_blocks_goes_nowhere(xp, feature_axis):
    """NaN in x's features of the empty block row 2 reaches no output of fprop or updat;
    NaN in dy's block column 2, whose only block sits in block row 3, reaches only dx's
    block row 3. Absent blocks are structural zeros, not 0 * NaN."""
    bs, sample = 8, 2
    layout = _nan_layout()
    rng = np.random.default_rng(31 + feature_axis)
    case = make_case(rng, layout, bs, 5, "float32", feature_axis)
    op = case.op
    x_bad = _poison(case.x, sample, 2 * bs + 1, feature_axis, np.nan)  # block row 2 is empty
    x_clean = _poison(case.x, sample, 2 * bs + 1, feature_axis, 0)

    y = as_float64(to_numpy(op(to_xp(xp, x_bad), to_xp(xp, case.w))))
    assert np.isfinite(y).all()
    assert_close(y, ref_fprop(layout, case.w, bs, x_clean, feature_axis), "float32")

    dw = as_float64(to_numpy(op.updat(to_xp(xp, x_bad), to_xp(xp, case.dy))))
    assert np.isfinite(dw).all()
    assert_close(dw, ref_updat(layout, bs, x_clean, case.dy, feature_axis), "float32")

    # dy's block column 2 only meets block row 3: dx is NaN in block row 3 only.
    dy_bad = _poison(case.dy, sample, 2 * bs + 6, feature_axis, np.nan)
    dx = to_numpy(op.bprop(to_xp(xp, dy_bad), to_xp(xp, case.w)))
    dx_features = dx if feature_axis == 1 else dx.T
    expected_bad = np.zeros(dx_features.shape, dtype=bool)
    expected_bad[sample, 3 * bs:4 * bs] = True
    assert np.array_equal(np.isnan(dx_features), expected_bad)


# -- inputs untouched, determinism ------------------------------------------------------------
@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_inputs_are_never_modified(xp, dtype, feature_axis):
    """No pass writes into x, dy or w, whether or not out= and accumulate are given."""
    rng = np.random.default_rng([3, feature_axis, DTYPES[dtype].num])
    case = make_case(rng, skewed_layout(rng, 5, 6), 16, 19, dtype, feature_axis)
    x, dy, w = (to_xp(xp, a) for a in (case.x, case.dy, case.w))
    before = snapshot(x, dy, w)
    case.op(x, w)
    case.op(x, w, out=poisoned(xp, (19, case.op.K) if feature_axis == 1 else (case.op.K, 19), w.dtype))
    case.op.bprop(dy, w)
    case.op.updat(x, dy)
    case.op.updat(x, dy, out=to_xp(xp, case.w), accumulate=True)
    assert snapshot(x, dy, w) == before
    # the host originals too (to_xp copies on CuPy; on NumPy these are other copies)
    assert snapshot(case.x, case.dy, case.w) == snapshot(*(to_numpy(a) for a in (x, dy, w)))


@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_calls_are_bitwise_equal(xp, dtype, feature_axis, monkeypatch):
    """Same inputs, same bits, also when the CPU backend splits work over many threaded chunks."""
    monkeypatch.setitem(bsmm.config.settings()["cpu"], "chunk_bytes", 4096)
    rng = np.random.default_rng([9, feature_axis])
    case = make_case(rng, random_layout(rng, 12, 10, 0.5), 16, 33, dtype, feature_axis)
    for pass_name in PASSES:
        args = device_inputs(xp, case, pass_name)
        first = to_numpy(call(case.op, pass_name, args))
        second = to_numpy(call(case.op, pass_name, args))
        assert first.tobytes() == second.tobytes(), f"{pass_name} is not deterministic"


def check_every_pass_repeats(xp, case: Case, dtype: str) -> None:
    """Each pass of ``case`` matches the reference, and a second call repeats the first bitwise."""
    for pass_name in PASSES:
        args = device_inputs(xp, case, pass_name)
        first = to_numpy(call(case.op, pass_name, args))
        assert_close(first, reference(case, pass_name), dtype, pass_name)
        assert first.tobytes() == to_numpy(call(case.op, pass_name, args)).tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("min_part_blocks", [None, 1], ids=["default", "shortest"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_long_block_columns_cut_into_parts(xp, dtype, min_part_blocks):
    """GPU: block columns longer than a part meet in the ordered last-part reduction.

    A tall layout (70 block rows, one dense column) is cut into parts even with the default
    table; ``min_part_blocks = 1`` cuts every column as short as the plan allows. Results match
    the reference and repeat bitwise.
    """
    if xp is np:
        pytest.skip("the CPU backend has no parts")
    # (a policy of its own even unchanged: its plans are made here, not found made by another test)
    policy = current_policy().replace(**({} if min_part_blocks is None else {"min_part_blocks": min_part_blocks}))
    rng = np.random.default_rng([70, min_part_blocks or 0])
    layout = random_layout(rng, 70, 3, 0.3)
    layout[:, 1] = 1
    layout[5:40, 2] = 1  # and a long run in one more column
    with planning(policy):
        for axis in (1, 0):
            case = make_case(rng, layout, 8, 37, dtype, axis)
            check_every_pass_repeats(xp, case, dtype)
    plans = plans_under(policy, case.op.index)
    assert any(p.workspace_floats > 0 for key, p in plans.items() if key[0] in ("fprop", "bprop")), \
        "no column was cut into parts: the reduction path went untested"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_passes_in_short_parts(xp, dtype):
    """GPU: at up to few_rows rows (bsmm.toml) the columns of a decoder's down projection (8192 -> 2048,
    block 128, ~10 %) are cut into parts of two blocks, which meet in the ordered reduction: each pass
    at N 1, 8 and 16 matches the reference and repeats bitwise, and its plan has parts."""
    if xp is np:
        pytest.skip("the CPU backend has no parts")
    policy = current_policy().replace()  # (plans of its own, not found made by another test)
    rng = np.random.default_rng(16)
    layout = random_layout(rng, 64, 16, 0.1)
    layout[:8, :] = 1
    with planning(policy):
        for n in (1, 8, 16):
            case = make_case(rng, layout, 128, n, dtype, 1)
            check_every_pass_repeats(xp, case, dtype)
            plans = {key[0]: p for key, p in plans_under(policy, case.op.index).items() if key[1] == n}
            assert {"fprop", "bprop"} <= set(plans) and all(plans[name].workspace_floats > 0 for name in ("fprop", "bprop"))


@pytest.mark.gpu
@pytest.mark.parametrize("bs, tile", [(16, [32, 128, 16, 1, 8, 4, 8]), (32, [32, 128, 32, 1, 4, 4, 4]),
                                      (64, [64, 128, 64, 2, 2, 3, 2])])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("wgmma", ["listed", "deep", "off"])
def test_column_groups(xp, bs, tile, dtype, wgmma):
    """GPU: output tiles spanning several block columns (rows), forced for every batch size and
    density; partial last group, empty and dense columns, long columns cut into parts; bitwise
    repeat and accumulate. On Hopper, N past 64 on feature axis 1 runs as wgmma groups
    (bsmm_matmul_tma) where bsmm.toml lists them, whose absent blocks are never copied; "deep":
    a wgmma tile whose steps take several block rows (a part's last step partly empty)."""
    if xp is np:
        pytest.skip("the CPU backend has no column groups")
    base = current_policy()
    if wgmma == "deep":
        deep = [128, 128, 2 * max(32, bs), 8, 1, 3, 128 // bs]
        base = (base.without_table("sm90", "tma16", "columns")
                .with_tile("sm90", "tma16", "columns", bs, "large", deep))
    listed = base.group_tile("tma16", "fprop", bs, 4096, "sm90") is not None
    policy, hopper = wgmma_policy(xp, base, wgmma != "off")
    hopper = hopper and listed
    policy = (policy.replace(group_min_blocks_per_step=0, wgmma_group_min_blocks_per_step={}, min_part_blocks=2)
              .without_table("default", "tensor16", "columns")
              .with_tile("default", "tensor16", "columns", bs, "any", tile))
    rng = np.random.default_rng([bs, len(dtype)])
    layout = random_layout(rng, 11, tile[6] * 2 + 3, 0.3)  # the last group is partial
    layout[:, 1] = 0
    layout[:, 2] = 1
    layout[3, :] = 1
    with planning(policy):
        for axis in (1, 0):
            for n in (1, 7, 70, 300):
                case = make_case(rng, layout, bs, n, dtype, axis)
                for pass_name in ("fprop", "bprop"):
                    check_pass_repeat_accumulate(xp, rng, case, pass_name, device_inputs(xp, case, pass_name))
    plans = plans_under(policy, case.op.index)
    aligned_plans = [p for p in plans.values() if p.variant.aligned]
    assert aligned_plans and all(p.variant.cols == tile[6] for p in aligned_plans), \
        "an aligned plan did not use column groups"
    on_wgmma = {(key[1], key[3]) for key, p in plans.items() if p.variant.tma and p.variant.math == "wgmma16"}
    assert on_wgmma == ({(n, 1) for n in (70, 300)} if hopper else set()), f"wgmma groups ran for {on_wgmma}"


@pytest.mark.gpu
@pytest.mark.parametrize("bs, dtype", [(16, "float16"), (32, "bfloat16"), (64, "float16"), (128, "bfloat16"),
                                       (32, "float32")])
def test_banded_order_matches_launch_order(xp, bs, dtype):
    """GPU: fprop/bprop visiting their tiles in bands of row tiles (forced; 3 rows a band over
    8 row tiles leaves a short last band), with columns cut into parts: the reference, and
    bitwise the result of launch order."""
    if xp is np:
        pytest.skip("the visiting order is a GPU launch detail")
    base = current_policy().replace(min_part_blocks=2, band_block_sizes=[bs], band_min_weight_bytes=0,
                                    tma_min_macs=0)  # blocks 64/128 in bands through TMA as well
    rng = np.random.default_rng([bs, len(dtype), 3])
    layout = random_layout(rng, 7, 5, 0.6)
    layout[:, 1] = 1
    case = make_case(rng, layout, bs, 1000, dtype, 1)
    for pass_name in ("fprop", "bprop"):
        args = device_inputs(xp, case, pass_name)
        results = []
        for band_rows in (3, 1):
            policy = base.replace(band_rows=band_rows)
            case.op.forget_calls()  # the repeat-call path would keep the first plan
            out = poisoned(xp, reference(case, pass_name).shape, case.x.dtype)
            with planning(policy):
                call(case.op, pass_name, args, out=out)
            plan = next(p for key, p in plans_under(policy, case.op.index).items() if key[0] == pass_name)
            assert plan.band_rows == band_rows and plan.launcher.grid[1] == -(-1000 // plan.variant.tile.bm)
            results.append(to_numpy(out))
        assert_close(results[0], reference(case, pass_name), dtype, f"{pass_name} in bands")
        assert results[0].tobytes() == results[1].tobytes(), f"{pass_name}: bands changed the result"


def plans_under(policy: Policy, index) -> dict:
    """The plans cached for ``index`` that were made under ``policy`` (a plan-cache key's last
    element): a layout's index, and with it its plans, is shared by every operator of that
    layout, other tests' included."""
    from bsmm.backends.cuda import plan_cache

    return {key: plan for key, plan in plan_cache.plans_of(index).items() if key[10] is policy}


def check_pass_repeat_accumulate(xp, rng, case: Case, pass_name: str, args: tuple) -> None:
    """fprop/bprop into a NaN-poisoned out= gives the reference, a second call the same bits,
    and accumulate=True the reference added to fresh random contents."""
    n, dtype = case.x.shape[1 - case.op.feature_axis], case.dtype
    where = f"{pass_name} N={n} axis={case.op.feature_axis}"
    expected = reference(case, pass_name)
    out = poisoned(xp, expected.shape, case.x.dtype)
    call(case.op, pass_name, args, out=out)
    assert_close(to_numpy(out), expected, dtype, where)
    again = to_numpy(call(case.op, pass_name, args))
    assert again.tobytes() == to_numpy(out).tobytes(), f"{where} not bitwise repeatable"
    start = random_data(rng, expected.shape, dtype)
    summed = to_xp(xp, start)
    call(case.op, pass_name, args, out=summed, accumulate=True)
    assert_close(to_numpy(summed), as_float64(start) + expected, dtype, f"{where} +=")


def check_updat_repeat_accumulate(xp, rng, case: Case, args: tuple) -> None:
    """updat into a NaN-poisoned out= gives the reference, a second call the same bits, and
    accumulate=True the reference added to fresh random contents."""
    n, dtype = case.x.shape[1 - case.op.feature_axis], case.dtype
    out = poisoned(xp, case.op.w_shape, case.x.dtype)
    call(case.op, "updat", args, out=out)
    assert_close(to_numpy(out), reference(case, "updat"), dtype, f"updat N={n}")
    assert to_numpy(call(case.op, "updat", args)).tobytes() == to_numpy(out).tobytes(), "not bitwise repeatable"
    start = random_data(rng, case.op.w_shape, dtype)
    summed = to_xp(xp, start)
    call(case.op, "updat", args, out=summed, accumulate=True)
    assert_close(to_numpy(summed), as_float64(start) + reference(case, "updat"), dtype, f"updat += N={n}")


def wgmma_policy(xp, base: Policy, wgmma: bool) -> tuple[Policy, bool]:
    """``base`` letting the sm_90a wgmma/TMA kernels take even short passes (``wgmma``), or with
    them turned off; and whether they can run on this GPU."""
    if wgmma:
        policy = base.replace(wgmma=True, tma=True, tma_min_macs=0, wgmma_columns_min_rows=0)
    else:
        policy = base.replace(wgmma=False)
    return policy, wgmma and xp.cuda.Device().compute_capability == "90"


@pytest.mark.gpu
@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma_sync"])
@pytest.mark.parametrize("bs, cols", [(16, 8), (32, 4), (64, 2)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("batch_parts", [False, True])
@pytest.mark.parametrize("feature_axis", [1, 0])
def test_updat_row_groups(xp, bs, cols, dtype, batch_parts, feature_axis, wgmma):
    """GPU: updat tiles of several blocks of one block row sharing their x tile, forced for
    every layout: partial last groups, empty and full block rows, N off the tile depth, batches
    cut into parts (ordered reduction); NaN-poisoned output, bitwise repeat, accumulate. On
    Hopper they also run as transposed wgmma groups (bsmm_matmul_tma; feature axis 1: MN-major
    boxes of x and dy as they are), whose absent group members are never copied."""
    if xp is np:
        pytest.skip("the CPU backend has no row groups")
    policy, hopper = wgmma_policy(xp, current_policy(), wgmma)
    if bs == 64 and not hopper:
        pytest.skip("block 64 has row groups on Hopper's wgmma only")
    policy = policy.replace(
        group_min_blocks_per_step=0,
        updat_transpose=[],  # test_updat_through_transposed_copies
        # Few groups and a long batch: the batch is cut so that every SM has work (0 waves: never).
        waves=64 if batch_parts else 0,
        updat_cut_gain=0)
    rng = np.random.default_rng([bs, cols, len(dtype), batch_parts, feature_axis])
    layout = random_layout(rng, 6, 2 * cols + 3, 0.5)
    layout[1, :] = 0
    layout[2, :] = 1
    with planning(policy):
        # Feature axis 0 takes aligned copies only where a batch row is whole 16-byte chunks.
        for n in (65, 130, 1000) if feature_axis == 1 else (72, 136, 1000):
            case = make_case(rng, layout, bs, n, dtype, feature_axis)
            check_updat_repeat_accumulate(xp, rng, case, device_inputs(xp, case, "updat"))
    plans = [p for key, p in plans_under(policy, case.op.index).items() if key[0] == "updat"]
    assert plans and all(p.variant.cols == cols for p in plans), "updat did not run on row groups"
    assert any(p.workspace_floats > 0 for p in plans) == batch_parts
    on_wgmma = hopper
    assert all(p.variant.tma == on_wgmma and (p.variant.math == "wgmma16") == on_wgmma for p in plans), \
        f"wgmma row groups {'did not run' if on_wgmma else 'ran'}"


@pytest.mark.gpu
@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma_sync"])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_updat_through_transposed_copies(xp, bs, dtype, wgmma):
    """GPU: updat on feature axis 1 through transposed copies of x and dy (forced here for
    blocks 16 and 32): the copies equal x and dy transposed with zero-padded batch columns
    (N off 8 included), the result the reference; NaN-poisoned output, bitwise repeat,
    accumulate, inputs unchanged; refused past the workspace limit. On Hopper the copies
    feed transposed wgmma row groups, or (wgmma off) mma.sync."""
    if xp is np:
        pytest.skip("transposed copies are a GPU path")
    from bsmm.backends.cuda import copy_plans, selection
    from bsmm.backends.cuda import plans as cuda_plans

    policy, hopper = wgmma_policy(xp, current_policy(), wgmma)
    policy = policy.replace(updat_transpose=[bs], updat_transpose_min_rows=65)
    rng = np.random.default_rng([bs, len(dtype), 7])
    layout = random_layout(rng, 5, 19, 0.4)
    layout[1, :] = 0
    layout[:, 3] = 0
    layout[2, :] = 1
    for n in (65, 130, 1001):
        case = make_case(rng, layout, bs, n, dtype, 1)
        args = device_inputs(xp, case, "updat")
        before = [to_numpy(a).copy() for a in args]
        with planning(policy):
            check_updat_repeat_accumulate(xp, rng, case, args)
        assert all(to_numpy(a).tobytes() == b.tobytes() for a, b in zip(args, before)), "input modified"
        plan = next(p for key, p in plans_under(policy, case.op.index).items() if key[0] == "updat" and key[1] == n)
        assert isinstance(plan, copy_plans.TransposedUpdat), "updat did not take the transposed copies"
        assert plan.variant.tma == hopper and plan.variant.cols > 1, f"{plan.variant} under the copies"
        ((_, x_t), (_, dy_t)), = plan.workspaces.values()  # (pointer, CuPy memory) of each copy
        for memory, source in ((x_t, args[0]), (dy_t, args[1])):
            padded = np.zeros((source.shape[1], -(-n // 8) * 8), dtype=case.x.dtype)
            copy = xp.ndarray(padded.shape, padded.dtype, memptr=memory)
            padded[:, :n] = to_numpy(source).T
            assert to_numpy(copy).tobytes() == padded.tobytes(), f"transposed copy N={n}"
    assert not selection.transposes_updat(case.op.index, 1001, dtype, 1, True,
                                          cuda_plans.device_traits(xp.cuda.Device()),
                                          policy.replace(updat_transpose_max_bytes=0))


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [True, False], ids=["column_groups", "one_block"])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_passes_through_transposed_activations(xp, bs, dtype, groups):
    """GPU: fprop and bprop on feature axis 1 through a transposed copy of x (dy), forced here
    for blocks 16 and 32 and any batch: the copy equals the activations transposed with
    zero-padded batch columns (N off 8 included), the output (written on axis 1) the reference;
    one block a step or column groups, long columns cut into parts; NaN-poisoned output,
    bitwise repeat, accumulate, inputs unchanged; refused past the workspace limit."""
    if xp is np:
        pytest.skip("transposed copies are a GPU path")
    from bsmm.backends.cuda import copy_plans, selection

    policy = current_policy().replace(act_transpose=[bs], act_transpose_min_rows=1, min_part_blocks=2,
                                      act_transpose_group_min_blocks_per_step=0 if groups else 1e9)
    rng = np.random.default_rng([bs, len(dtype), 11])
    layout = random_layout(rng, 13, 21, 0.35)
    layout[1, :] = 0
    layout[:, 3] = 0
    layout[:, 5] = 1  # a long column (row) for the parts
    layout[2, :] = 1
    for n in (1, 7, 130, 1001):
        case = make_case(rng, layout, bs, n, dtype, 1)
        for pass_name in ("fprop", "bprop"):
            args = device_inputs(xp, case, pass_name)
            before = [to_numpy(a).copy() for a in args]
            with planning(policy):
                check_pass_repeat_accumulate(xp, rng, case, pass_name, args)
            assert all(to_numpy(a).tobytes() == b.tobytes() for a, b in zip(args, before)), "input modified"
            plan = next(p for key, p in plans_under(policy, case.op.index).items()
                        if key[0] == pass_name and key[1] == n)
            assert isinstance(plan, copy_plans.TransposedActivations), f"{pass_name} did not take the copy"
            # (bsmm.toml lists column-group tiles for large batches only)
            assert plan.variant.act_transposed and (plan.variant.cols > 1) == (groups and n > 64), f"{plan.variant}"
            (_, memory), = plan.workspaces.values()  # (pointer, CuPy memory) of the copy
            padded = np.zeros((args[0].shape[1], -(-n // 8) * 8), dtype=case.x.dtype)
            copy = xp.ndarray(padded.shape, padded.dtype, memptr=memory)
            padded[:, :n] = to_numpy(args[0]).T
            assert to_numpy(copy).tobytes() == padded.tobytes(), f"transposed copy N={n}"
    parted = [p.plan for p in plans_under(policy, case.op.index).values()
              if isinstance(p, copy_plans.TransposedActivations)]
    assert any(p.workspace_floats > 0 for p in parted), "no column was cut into parts"
    assert selection.transposes_activations(case.op.index, "bprop", 1001, dtype, 1, True, policy)
    assert not selection.transposes_activations(case.op.index, "bprop", 1001, dtype, 1, True,
                                                policy.replace(act_transpose_max_bytes=0))


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "cp_async"])
@pytest.mark.parametrize("min_part_blocks", [None, 1], ids=["default", "shortest"])
@pytest.mark.parametrize("bs", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_passes(xp, dtype, bs, min_part_blocks, tma):
    """GPU, Hopper: the three passes on warpgroup MMA (sm_90a) for N past one tile, N not a
    multiple of the tile, empty and dense block columns/rows, columns (batches) cut into parts;
    NaN-poisoned outputs, reference, bitwise repeat, accumulate. Checks that wgmma ran, and
    that the passes took the TMA kernel (bsmm_matmul_tma) or, with the policy's TMA off, did not."""
    if xp is np:
        pytest.skip("wgmma is a GPU kernel")
    if xp.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma kernels run on compute capability 9.0 only")
    policy = current_policy().replace(wgmma=True, tma=tma, tma_min_macs=0)  # these passes are short
    if min_part_blocks is not None:
        policy = policy.replace(min_part_blocks=min_part_blocks)
    rng = np.random.default_rng([bs, len(dtype), min_part_blocks or 0])
    layout = random_layout(rng, 9, 7, 0.4)
    layout[:, 1] = 0
    layout[:, 2] = 1
    layout[4, :] = 0
    with planning(policy):
        for n in (65, 129, 1000):
            case = make_case(rng, layout, bs, n, dtype, 1)
            for pass_name in PASSES:
                args = device_inputs(xp, case, pass_name)
                out = poisoned(xp, reference(case, pass_name).shape, case.x.dtype)
                call(case.op, pass_name, args, out=out)
                assert_close(to_numpy(out), reference(case, pass_name), dtype, f"{pass_name} N={n}")
                again = to_numpy(call(case.op, pass_name, args))
                assert again.tobytes() == to_numpy(out).tobytes(), f"{pass_name} N={n} not bitwise repeatable"
                start = random_data(rng, again.shape, dtype)
                summed = to_xp(xp, start)
                call(case.op, pass_name, args, out=summed, accumulate=True)
                assert_close(to_numpy(summed), as_float64(start) + reference(case, pass_name), dtype,
                             f"{pass_name} +=")
    plans = plans_under(policy, case.op.index)
    used = {key[0] for key, p in plans.items() if p.variant.math == "wgmma16"}
    assert used == set(PASSES), f"wgmma ran for {used or 'no pass'}"
    with_tma = {key[0] for key, p in plans.items() if p.variant.tma}
    assert with_tma == (set(PASSES) if tma else set()), f"TMA ran for {with_tma or 'no pass'}"
    if min_part_blocks == 1:
        assert any(p.workspace_floats > 0 for p in plans.values()), "no column was cut into parts"


def tma_for_any_layout(xp, base: Policy) -> Policy:
    """Skips unless on Hopper; ``base`` letting every layout take the small-batch TMA kernel and
    cutting block columns into parts of 2 blocks."""
    if xp is np:
        pytest.skip("TMA is a GPU kernel")
    if xp.cuda.Device().compute_capability != "90":
        pytest.skip("TMA kernels run on compute capability 9.0 only")
    return base.replace(min_part_blocks=2, tma_mma_min_column_blocks=0, tma_mma_max_column_blocks=1 << 30)


@pytest.mark.gpu
@pytest.mark.parametrize("bs, n", [(64, 777), (128, 777), (32, 1), (32, 7), (32, 32), (32, 50)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tma_matches_cp_async_bitwise(xp, dtype, bs, n, monkeypatch):
    """GPU, Hopper: the passes through the TMA kernel give bitwise what the cp.async kernels
    give (same steps, same instructions, only the copies differ): wgmma at blocks 64/128 with
    a batch that ends inside a tile (updat: inside a step), mma.sync fprop/bprop at block 32
    for small batches; columns (batches) cut into parts."""
    from bsmm.backends.cuda import plans as cuda_plans

    base = tma_for_any_layout(xp, current_policy()).replace(
        wgmma=True,
        tma_mma_min_part_blocks=0,  # the same parts as cp.async
        tma_min_macs=0,
        # wgmma groups (TMA only) visit other steps and parts: not the tile compared here.
        wgmma_group_min_blocks_per_step={bs: float("inf")})
    # updat's cut of the batch depends on the kernel's occupancy, which differs between the two.
    monkeypatch.setattr(cuda_plans, "occupancy", lambda kernel, variant: 2)
    rng = np.random.default_rng([bs, len(dtype), 7])
    layout = random_layout(rng, 8, 6, 0.5)
    layout[:, 3] = 1
    layout[:, 0] = 0  # an empty block column: thread blocks with no step
    layout[2, :] = 0
    case = make_case(rng, layout, bs, n, dtype, 1)
    for pass_name in PASSES if bs > 32 else ("fprop", "bprop"):
        args = device_inputs(xp, case, pass_name)
        results = {}
        for tma in ("1", "0"):
            policy = base.replace(tma=tma == "1")
            case.op.forget_calls()  # the repeat-call path would keep the first plan
            out = poisoned(xp, reference(case, pass_name).shape, case.x.dtype)
            with planning(policy):
                call(case.op, pass_name, args, out=out)
            plan = next(p for key, p in plans_under(policy, case.op.index).items() if key[0] == pass_name)
            assert plan.variant.tma == (tma == "1") and plan.variant.math == ("wgmma16" if bs > 32 else "tensor16")
            assert pass_name != "updat" or plan.workspace_floats > 0, "updat's batch was not cut into parts"
            results[tma] = to_numpy(out)
        assert_close(results["1"], reference(case, pass_name), dtype, f"{pass_name} TMA")
        assert results["1"].tobytes() == results["0"].tobytes(), f"{pass_name}: TMA and cp.async differ"


@pytest.mark.gpu
@pytest.mark.parametrize("pass_name", ["fprop", "bprop"])
def test_small_batch_tma_walks_whole_columns(xp, pass_name):
    """GPU, Hopper: small-batch fprop/bprop through TMA cut no block column (row) of up to
    tma_mma_min_part_blocks blocks into parts, and cut longer ones; exact either way. The
    layout has more block columns (rows) than the H100 has SMs: fewer are cut to fill it."""
    base = tma_for_any_layout(xp, current_policy()).replace(tma=True)
    rng = np.random.default_rng([len(pass_name), 32])
    layout = random_layout(rng, 140, 140, 0.02)  # about 3 blocks a column (row), rarely over 10
    layout[:, 4] = 0
    layout[:12, 4] = 1  # a block column of 12 blocks
    layout[5, :] = 0
    layout[5, :12] = 1  # a block row of 12 blocks
    assert layout.sum(axis=0).max() <= 12 and layout.sum(axis=1).max() <= 12
    case = make_case(rng, layout, 32, 32, "float16", 1)
    args = device_inputs(xp, case, pass_name)
    for least, cut in ((16, False), (8, True)):
        policy = base.replace(tma_mma_min_part_blocks=least)
        case.op.forget_calls()
        out = poisoned(xp, reference(case, pass_name).shape, case.x.dtype)
        with planning(policy):
            call(case.op, pass_name, args, out=out)
        assert_close(to_numpy(out), reference(case, pass_name), "float16", f"{pass_name} parts of {least}")
        plan = next(p for key, p in plans_under(policy, case.op.index).items() if key[0] == pass_name)
        assert plan.variant.tma and plan.variant.math == "tensor16", plan.variant
        assert (plan.workspace_floats > 0) == cut, f"parts of at least {least}: cut={plan.workspace_floats > 0}"


# -- a bigger case: many chunks on many threads ----------------------------------------------
@pytest.mark.parametrize("feature_axis", [1, 0])
def test_many_chunks_equal_one_chunk_bitwise(xp, feature_axis, monkeypatch):
    """C = K = 2048, bs 32, N 64: tiny chunks (one segment each, spread over the thread
    pool) give bitwise the same result as one chunk, and both match the reference.

    Bitwise, not just to tolerance: each output segment is summed by one chunk in a
    fixed order, so chunking must not change a single bit.
    """
    rng = np.random.default_rng(2048 + feature_axis)
    layout = random_layout(rng, 64, 64, 0.15)
    case = make_case(rng, layout, 32, 64, "float32", feature_axis)
    cpu = bsmm.config.settings()["cpu"]

    chunk_counts = []
    if xp is np:
        import bsmm.backends.cpu as cpu_backend

        real_run_chunks = cpu_backend.run_chunks

        def counting_run_chunks(task, chunks):
            chunk_counts.append(len(chunks))
            return real_run_chunks(task, chunks)

        monkeypatch.setattr(cpu_backend, "run_chunks", counting_run_chunks)

    results = {}
    for chunk_bytes in (1, 1 << 40):  # one block's worth per chunk / everything in one chunk
        monkeypatch.setitem(cpu, "chunk_bytes", chunk_bytes)
        results[chunk_bytes] = {
            name: to_numpy(call(case.op, name, device_inputs(xp, case, name))) for name in PASSES
        }
    if xp is np:
        assert min(chunk_counts[:3]) > 1, "small chunk_bytes must split every pass into several chunks"
        assert chunk_counts[3:] == [1, 1, 1], "huge chunk_bytes must run every pass as one chunk"
    for name in PASSES:
        assert results[1][name].tobytes() == results[1 << 40][name].tobytes(), f"{name} depends on chunking"
        assert_close(results[1][name], reference(case, name), "float32", name)


@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("pass_name", ["fprop", "bprop"])
def test_out_aliasing_the_input_is_computed_correctly_or_refused(xp, pass_name, feature_axis, monkeypatch):
    """op(x, w, out=x) with C == K: either right (like NumPy's overlap handling) or a ValueError.

    Silently wrong results are the failure: the CPU backend reads x's blocks chunk by
    chunk while earlier chunks already overwrote them (feature_axis=0, many chunks).
    """
    monkeypatch.setitem(bsmm.config.settings()["cpu"], "chunk_bytes", 4096)
    rng = np.random.default_rng(41 + feature_axis)
    case = make_case(rng, random_layout(rng, 16, 16, 0.5), 32, 64, "float32", feature_axis)
    source = case.x if pass_name == "fprop" else case.dy
    expected = to_numpy(call(case.op, pass_name, (to_xp(xp, source), to_xp(xp, case.w))))
    aliased = to_xp(xp, source)
    try:
        call(case.op, pass_name, (aliased, to_xp(xp, case.w)), out=aliased)
    except ValueError:
        return  # refusing overlapping out= is an acceptable contract
    error = rel_error(to_numpy(aliased), expected)
    assert error <= tolerance("float32"), f"out aliasing the input gave wrong values (relative error {error:.3g})"


# -- property tests --------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(
    bs=st.sampled_from([8, 16, 32]),
    cb=st.integers(1, 6),
    kb=st.integers(1, 6),
    density=st.floats(0.0, 1.0),
    n=st.integers(0, 40),
    feature_axis=st.sampled_from([0, 1]),
    dtype=st.sampled_from(list(DTYPES)),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_passes_match_reference(xp, bs, cb, kb, density, n, feature_axis, dtype, seed):
    """Any block size, shape, density, N, axis and dtype: all passes match the reference."""
    rng = np.random.default_rng(seed)
    case = make_case(rng, random_layout(rng, cb, kb, density), bs, n, dtype, feature_axis)
    for pass_name in PASSES:
        check_pass(xp, case, pass_name)


@settings(max_examples=50, deadline=None)
@given(
    bs=st.sampled_from([8, 16]),
    cb=st.integers(1, 5),
    kb=st.integers(1, 5),
    density=st.floats(0.0, 1.0),
    n=st.integers(1, 24),
    feature_axis=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_passes_are_adjoint(xp, bs, cb, kb, density, n, feature_axis, seed):
    """<x·W, dy> = <x, dy·Wᵀ> = <xᵀ·dy, W>: the three passes agree with each other."""
    rng = np.random.default_rng(seed)
    case = make_case(rng, random_layout(rng, cb, kb, density), bs, n, "float32", feature_axis)
    x, dy, w = (to_xp(xp, a) for a in (case.x, case.dy, case.w))
    y, dx, dw = (as_float64(to_numpy(r)) for r in (case.op(x, w), case.op.bprop(dy, w), case.op.updat(x, dy)))
    via_fprop = float(np.sum(y * as_float64(case.dy)))
    via_bprop = float(np.sum(as_float64(case.x) * dx))
    via_updat = float(np.sum(dw * as_float64(case.w)))
    scale = float(np.sum(np.abs(y * as_float64(case.dy)))) + 1e-30
    assert abs(via_fprop - via_bprop) <= 1e-5 * scale
    assert abs(via_fprop - via_updat) <= 1e-5 * scale


# -- the operator object ---------------------------------------------------------------------------
def test_properties_match_their_definitions():
    """C, K, blocks, density, w_shape, layout, indptr, indices and flops(N), from the layout."""
    rng = np.random.default_rng(1)
    layout = skewed_layout(rng, 7, 5)
    op = bsmm.BlocksparseMatMul(layout, block_size=16, feature_axis=0)
    rows, cols = np.nonzero(layout)
    assert (op.C, op.K, op.block_size, op.feature_axis) == (7 * 16, 5 * 16, 16, 0)
    assert op.blocks == len(rows) == np.count_nonzero(layout)
    assert op.density == pytest.approx(np.count_nonzero(layout) / layout.size)
    assert op.w_shape == (len(rows), 16, 16)
    assert op.layout.dtype == np.uint8 and np.array_equal(op.layout, layout)
    assert not op.layout.flags.writeable
    assert op.indices.tolist() == cols.tolist()
    assert op.indptr.tolist() == [0] + np.cumsum(layout.sum(axis=1)).tolist()
    for n in (0, 1, 64):
        assert op.flops(n) == 2 * n * len(rows) * 16 * 16
    # indptr/indices are the BSR index scipy builds for the same pattern
    bsr = scipy.sparse.bsr_array(np.kron(layout, np.ones((16, 16))), blocksize=(16, 16))
    assert np.array_equal(op.indptr, bsr.indptr) and np.array_equal(op.indices, bsr.indices)


def test_block_index_tables():
    """rows expands indptr; col_order/colptr list the blocks column by column."""
    layout = np.array([[1, 0, 1], [0, 0, 0], [1, 1, 1]], dtype=np.uint8)
    index = bsmm.block_index(layout, block_size=8)
    rows, cols = np.nonzero(layout)
    assert index.rows.tolist() == rows.tolist()
    assert index.nnzb == 5 and index.n_block_rows == 3 and index.n_block_cols == 3
    for k in range(3):
        blocks_in_column = index.col_order[index.colptr[k]:index.colptr[k + 1]]
        assert cols[blocks_in_column].tolist() == [k] * int(layout[:, k].sum())
        assert rows[blocks_in_column].tolist() == sorted(rows[blocks_in_column].tolist())
    assert sorted(index.col_order.tolist()) == list(range(5))


def test_layout_is_copied_not_aliased():
    """Changing the caller's layout afterwards leaves the operator (and its cached index) alone."""
    layout = np.array([[1, 0], [0, 1]], dtype=np.uint8)
    op = bsmm.BlocksparseMatMul(layout, block_size=8)
    layout[0, 1] = 1
    assert op.layout.tolist() == [[1, 0], [0, 1]] and op.blocks == 2
    assert layout.flags.writeable, "the caller's array must stay writeable"
    assert bsmm.BlocksparseMatMul(layout, block_size=8).blocks == 3


def test_defaults_come_from_config():
    """block_size, feature_axis and tf32 default to bsmm.toml's [defaults]."""
    defaults = bsmm.config.settings()["defaults"]
    op = bsmm.BlocksparseMatMul(np.ones((2, 2)))
    assert (op.block_size, op.feature_axis) == (defaults["block_size"], defaults["feature_axis"]) == (32, 1)
    assert op.tf32 is bool(defaults["tf32"]) is False


@pytest.mark.parametrize("tf32", [False, True])
@pytest.mark.parametrize("feature_axis", [1, 0])
def test_pickle_round_trip(xp, feature_axis, tf32):
    """A pickled operator comes back with the same layout and settings and identical results."""
    rng = np.random.default_rng(17)
    case = make_case(rng, skewed_layout(rng, 4, 6), 16, 10, "float32", feature_axis)
    case.op = bsmm.BlocksparseMatMul(case.layout, block_size=16, feature_axis=feature_axis, tf32=tf32)
    clone = pickle.loads(pickle.dumps(case.op))
    assert clone is not case.op
    assert (clone.C, clone.K, clone.block_size, clone.feature_axis, clone.w_shape, clone.tf32) == (
        case.op.C, case.op.K, case.op.block_size, case.op.feature_axis, case.op.w_shape, tf32)
    assert np.array_equal(clone.layout, case.op.layout)
    for pass_name in PASSES:
        args = device_inputs(xp, case, pass_name)
        original = to_numpy(call(case.op, pass_name, args))
        assert to_numpy(call(clone, pass_name, args)).tobytes() == original.tobytes()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_to_dense_and_from_dense_place_blocks_in_row_major_order(xp, dtype):
    """op.to_dense(w) equals the loop-built W exactly; op.from_dense inverts it."""
    rng = np.random.default_rng(23)
    layout = skewed_layout(rng, 5, 4)
    op = bsmm.BlocksparseMatMul(layout, block_size=8)
    w = random_data(rng, op.w_shape, dtype)
    dense = op.to_dense(to_xp(xp, w))
    assert dense.dtype == DTYPES[dtype] and tuple(dense.shape) == (op.C, op.K)
    assert np.array_equal(as_float64(to_numpy(dense)), dense_weight(layout, w, 8))
    blocks = op.from_dense(dense)
    assert to_numpy(blocks).tobytes() == w.tobytes()
    assert np.array_equal(as_float64(to_numpy(bsmm.blocks_to_dense(op.index, to_xp(xp, w)))),
                          dense_weight(layout, w, 8))


def test_seed_example(xp):
    """The seed's example (hidden size 4096 shrunk to 512): x of ones through a random 0/1 layout."""
    hidden_size, block_size, minibatch_size = 512, 32, 64
    legacy = np.random.RandomState(2017)  # np.random.randint / randn as in the seed, but seeded
    sparsity = legacy.randint(2, size=(hidden_size // block_size, hidden_size // block_size))
    bsmm_op = bsmm.BlocksparseMatMul(sparsity, block_size=block_size)
    w = legacy.randn(*bsmm_op.w_shape).astype(np.float32)
    x = np.ones((minibatch_size, hidden_size), dtype=np.float32)
    y = bsmm_op(to_xp(xp, x), to_xp(xp, w))
    assert tuple(y.shape) == (minibatch_size, hidden_size)
    assert_close(to_numpy(y), ref_fprop(sparsity, w, block_size, x, 1), "float32", "seed example")

"""BlocksparseConv: the three passes against a float64 dense convolution with the masked weight.

The reference below pads the input with ``np.pad`` and sums, over kernel offsets, strided
slices of it times each offset's dense weight (built by ``reference.dense_weight``, never
bsmm's ``to_dense``): no canvas, no phases, no grid, so it shares no index arithmetic
with :mod:`bsmm.nn.conv_geometry`. It is itself checked against PyTorch's convolution.
Outputs are passed NaN-poisoned, inputs are checked unchanged, and every body runs on
NumPy (CPU backend) and, marked ``gpu``, on CuPy.
"""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest

import bsmm
from bsmm.nn.conv import BlocksparseConv
from bsmm.nn.conv_geometry import conv_geometry
from conftest import REPO_ROOT, poisoned, snapshot, to_numpy, to_xp
from reference import (
    DTYPES,
    Producer,
    as_float64,
    assert_close,
    dense_to_present_blocks,
    dense_weight,
    random_data,
    random_layout,
    skewed_layout,
)


# -- the float64 reference (channels last) ------------------------------------------------------------
def _windows(shape, kernel, stride, padding, dilation):
    """Per kernel offset, the index of the padded input that each output position reads."""
    out = [(s + 2 * p - d * (k - 1) - 1) // st + 1 for s, k, st, p, d in zip(shape, kernel, stride, padding, dilation)]
    for offset in np.ndindex(*kernel):
        yield offset, (slice(None),) + tuple(
            slice(k * d, k * d + st * (o - 1) + 1, st) for k, d, st, o in zip(offset, dilation, stride, out)
        )


def _pad(x, padding):
    return np.pad(as_float64(x), ((0, 0),) + tuple((p, p) for p in padding) + ((0, 0),))


def ref_conv(x, dense, conv):
    x_pad = _pad(x, conv.padding)
    args = (x.shape[1:-1], conv.kernel_size, conv.stride, conv.padding, conv.dilation)
    return sum(x_pad[index] @ dense[offset] for offset, index in _windows(*args))


def ref_input_grad(dy, dense, x_shape, conv):
    dx_pad = _pad(np.zeros(x_shape), conv.padding)
    for offset, index in _windows(x_shape[1:-1], conv.kernel_size, conv.stride, conv.padding, conv.dilation):
        dx_pad[index] += as_float64(dy) @ dense[offset].T
    crop = (slice(None),) + tuple(slice(p, p + s) for p, s in zip(conv.padding, x_shape[1:-1]))
    return dx_pad[crop]


def ref_weight_grad(x, dy, conv):
    x_pad, dy = _pad(x, conv.padding), as_float64(dy)
    grads = []
    for _, index in _windows(x.shape[1:-1], conv.kernel_size, conv.stride, conv.padding, conv.dilation):
        full = x_pad[index].reshape(-1, conv.C).T @ dy.reshape(-1, conv.K)
        grads.append(dense_to_present_blocks(conv.layout, full, conv.block_size))
    return np.stack(grads).reshape(conv.w_shape)


def dense_kernel(conv, w) -> np.ndarray:
    """(*kernel, C, K) float64 from block data, through the test reference."""
    per_offset = np.asarray(w).reshape((np.prod(conv.kernel_size),) + conv.index.w_shape)
    dense = [dense_weight(conv.layout, blocks, conv.block_size) for blocks in per_offset]
    return np.stack(dense).reshape(conv.kernel_size + (conv.C, conv.K))


def to_first(array):
    """Channels last -> channels first (a contiguous copy)."""
    return np.ascontiguousarray(np.moveaxis(array, -1, 1))


def to_last(array):
    return np.moveaxis(array, 1, -1)


class Case:
    """A convolution, its data (channels last, host) and float64 references."""

    def __init__(self, rng, conv, batch, spatial, dtype):
        self.conv = conv
        self.x = random_data(rng, (batch, *spatial, conv.C), dtype)
        self.w = random_data(rng, conv.w_shape, dtype)
        self.dense = dense_kernel(conv, self.w)
        self.y_ref = ref_conv(self.x, self.dense, conv)
        self.dy = random_data(rng, self.y_ref.shape, dtype)
        self.dx_ref = ref_input_grad(self.dy, self.dense, self.x.shape, conv)
        self.dw_ref = ref_weight_grad(self.x, self.dy, conv)

    def layout_of(self, array):
        """Host array (channels last) in the convolution's own channel layout."""
        return array if self.conv.channels_last else to_first(array)

    def back(self, array):
        """A result (NumPy or CuPy) as a channels-last host array."""
        array = to_numpy(array)
        return array if self.conv.channels_last else to_last(array)


def make_case(rng, layout_kind, bs, kernel, stride, padding, dilation, channels_last, batch, spatial, dtype):
    if layout_kind == "skewed":  # empty and dense block rows and columns
        layout = skewed_layout(rng, 4, 5)
    elif layout_kind == "empty":
        layout = np.zeros((2, 3), np.uint8)
    else:
        layout = random_layout(rng, 3, 2, 0.6)
        layout[0, 0] = 1
    conv = BlocksparseConv(layout, bs, kernel, stride, padding, dilation, channels_last=channels_last)
    return Case(rng, conv, batch, spatial, dtype)


# (layout, bs, kernel, stride, padding, dilation, channels_last, N, spatial)
GEOMETRIES = {
    "2d-3x3-p1": ("skewed", 8, (3, 3), 1, 1, 1, True, 2, (5, 6)),
    "2d-3x3-s2-p1-first": ("random", 8, (3, 3), 2, 1, 1, False, 2, (7, 9)),
    "2d-5x5-s3-p2": ("random", 8, (5, 5), 3, 2, 1, True, 1, (11, 13)),
    "2d-3x3-d2-p2-first": ("random", 16, (3, 3), 1, 2, 2, False, 2, (7, 5)),
    "2d-3x3-s2-valid": ("skewed", 8, (3, 3), 2, 0, 1, True, 2, (7, 7)),
    "2d-3x3-valid": ("random", 16, (3, 3), 1, 0, 1, True, 2, (6, 7)),  # dx is the canvas
    "2d-1x1": ("random", 8, (1, 1), 1, 0, 1, True, 2, (4, 5)),
    "2d-1x1-s2-first": ("random", 8, (1, 1), 2, 0, 1, False, 1, (5, 7)),
    "2d-3x2-mixed": ("random", 8, (3, 2), (2, 3), (2, 0), (1, 2), True, 2, (9, 11)),
    "2d-2x2-patchify": ("random", 32, (2, 2), 2, 0, 1, True, 2, (6, 8)),
    "2d-5x1-s(1,2)": ("skewed", 8, (5, 1), (1, 2), (2, 0), 1, True, 1, (6, 8)),
    "1d-3-p1": ("random", 8, (3,), 1, 1, 1, True, 2, (9,)),
    "1d-5-s3-d2-p2-first": ("skewed", 8, (5,), 3, 2, 2, False, 2, (17,)),
    "1d-3-s2": ("random", 8, (3,), 2, 0, 1, True, 3, (8,)),
    "3d-3-s(2,1,2)": ("random", 8, (3, 3, 3), (2, 1, 2), (1, 1, 0), 1, True, 2, (5, 4, 7)),
    "3d-first-d2": ("random", 8, (2, 1, 3), 1, (0, 0, 1), (1, 1, 2), False, 1, (3, 4, 5)),
}


def _run_three_passes(xp, case: Case, dtype):
    """fprop, bprop and updat into NaN-poisoned outputs, inputs checked unchanged."""
    conv = case.conv
    x, dy = (to_xp(xp, case.layout_of(a)) for a in (case.x, case.dy))
    w = to_xp(xp, case.w)
    before = snapshot(x, w, dy)
    y = poisoned(xp, conv.output_shape(x.shape), dtype)
    assert conv.fprop(x, w, out=y) is y
    dx = conv.bprop(dy, w, x.shape, out=poisoned(xp, x.shape, dtype))
    dw = conv.updat(x, dy, out=poisoned(xp, conv.w_shape, dtype))
    assert snapshot(x, w, dy) == before, "an input changed"
    return case.back(y), case.back(dx), to_numpy(dw)


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_passes_match_dense_convolution(xp, name):
    rng = np.random.default_rng(list(name.encode()))
    case = make_case(rng, *GEOMETRIES[name], "float32")
    y, dx, dw = _run_three_passes(xp, case, "float32")
    assert_close(y, case.y_ref, "float32", "fprop")
    assert_close(dx, case.dx_ref, "float32", "bprop")
    assert_close(dw, case.dw_ref, "float32", "updat")


def _random_geometry(rng):
    """A random geometry whose output is at least 1 wide: rank 1-3, kernel 1-5, stride 1-3,
    padding 0-2, dilation 1-2, odd and even sizes, either channel layout."""
    dims = int(rng.integers(1, 4))
    kernel = tuple(int(k) for k in rng.integers(1, 6 if dims < 3 else 4, dims))
    stride = tuple(int(s) for s in rng.integers(1, 4, dims))
    padding = tuple(int(p) for p in rng.integers(0, 3, dims))
    dilation = tuple(int(d) for d in rng.integers(1, 3, dims))
    reach = [d * (k - 1) + 1 - 2 * p for k, d, p in zip(kernel, dilation, padding)]
    spatial = tuple(max(1, r) + int(rng.integers(0, 9 if dims < 3 else 4)) for r in reach)
    bs = int(rng.choice([8, 16]))
    batch = int(rng.integers(1, 4))
    return "random", bs, kernel, stride, padding, dilation, bool(rng.integers(2)), batch, spatial


@pytest.mark.parametrize("seed", range(24))
def test_random_geometries(xp, seed):
    rng = np.random.default_rng([seed, 10])
    geometry = _random_geometry(rng)
    case = make_case(rng, *geometry, "float32")
    for got, ref, what in zip(_run_three_passes(xp, case, "float32"), (case.y_ref, case.dx_ref, case.dw_ref),
                              ("fprop", "bprop", "updat")):
        assert_close(got, ref, "float32", f"{what} of {geometry}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["2d-3x3-s2-p1-first", "2d-5x5-s3-p2", "1d-3-p1"])
@pytest.mark.parametrize("bs", [16, 32])
def test_half_precision(xp, dtype, name, bs):
    rng = np.random.default_rng([bs, len(dtype), len(name)])
    layout_kind, _, *geometry = GEOMETRIES[name]
    case = make_case(rng, layout_kind, bs, *geometry, dtype)
    for got, ref, what in zip(_run_three_passes(xp, case, dtype), (case.y_ref, case.dx_ref, case.dw_ref),
                              ("fprop", "bprop", "updat")):
        assert got.dtype == DTYPES[dtype]
        assert_close(got, ref, dtype, what)


@pytest.mark.parametrize("name", ["2d-3x3-s2-p1-first", "3d-3-s(2,1,2)"])
def test_float64_on_the_cpu(name):
    rng = np.random.default_rng(64)
    case = make_case(rng, *GEOMETRIES[name], "float32")
    case = Case(rng, case.conv, case.x.shape[0], case.x.shape[1:-1], np.float64)
    y, dx, dw = _run_three_passes(np, case, np.float64)
    for got, ref in zip((y, dx, dw), (case.y_ref, case.dx_ref, case.dw_ref)):
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_results_are_fresh_arrays_of_the_inputs_library(xp):
    rng = np.random.default_rng(1)
    case = make_case(rng, *GEOMETRIES["2d-3x3-p1"], "float32")
    x, w, dy = to_xp(xp, case.x), to_xp(xp, case.w), to_xp(xp, case.dy)
    for got, ref in ((case.conv(x, w), case.y_ref), (case.conv.bprop(dy, w, x_shape=x.shape), case.dx_ref),
                     (case.conv.updat(x, dy), case.dw_ref)):
        assert type(got) is type(x)
        assert_close(to_numpy(got), ref, "float32")


def test_updat_accumulates_into_out(xp):
    rng = np.random.default_rng(2)
    case = make_case(rng, *GEOMETRIES["2d-3x3-s2-valid"], "float32")
    start = random_data(rng, case.conv.w_shape, "float32")
    out = to_xp(xp, start)
    got = case.conv.updat(to_xp(xp, case.x), to_xp(xp, case.dy), out=out, accumulate=True)
    assert got is out
    assert_close(to_numpy(out), case.dw_ref + start, "float32", "updat accumulate")


def test_empty_layout_gives_zeros(xp):
    rng = np.random.default_rng(3)
    case = make_case(rng, "empty", 8, (3, 3), 2, 1, 1, True, 2, (5, 5), "float32")
    conv = case.conv
    assert conv.w_shape == (3, 3, 0, 8, 8) and conv.blocks == 0
    y, dx, dw = _run_three_passes(xp, case, "float32")
    assert not y.any() and not dx.any() and dw.shape == conv.w_shape


def test_empty_batch(xp):
    conv = BlocksparseConv(np.ones((1, 2)), 8, (3, 3), padding=1)
    x = to_xp(xp, np.ones((0, 4, 4, 8), np.float32))
    w = to_xp(xp, np.ones(conv.w_shape, np.float32))
    assert conv(x, w).shape == (0, 4, 4, 16)
    dy = to_xp(xp, np.ones((0, 4, 4, 16), np.float32))
    assert conv.bprop(dy, w, x.shape).shape == x.shape
    assert not to_numpy(conv.updat(x, dy, out=poisoned(xp, conv.w_shape, np.float32))).any()


@pytest.mark.parametrize("channels_last", [True, False])
def test_padding_same_and_valid(xp, channels_last):
    rng = np.random.default_rng(4)
    layout = random_layout(rng, 2, 2, 0.7)
    same = BlocksparseConv(layout, 8, (5, 3), padding="same", dilation=(1, 2), channels_last=channels_last)
    valid = BlocksparseConv(layout, 8, (5, 3), padding="valid", channels_last=channels_last)
    assert (same.padding, valid.padding) == ((2, 2), (0, 0))
    shape = (1, 7, 9, 16) if channels_last else (1, 16, 7, 9)
    assert same.output_shape(shape) == shape
    x = to_xp(xp, random_data(rng, shape, "float32"))
    assert same(x, to_xp(xp, same.normal_init(seed=0))).shape == shape


def test_copies_are_made_only_where_needed(monkeypatch):
    """Channels last, no padding, stride only on the last dimension and dividing it, and a grid
    equal to the output: the passes read ``x`` and ``dy`` and write ``y`` and ``dx`` in place."""
    rng = np.random.default_rng(5)
    case = make_case(rng, "random", 8, (1, 2), (1, 2), 0, 1, True, 2, (3, 8), "float32")
    conv = case.conv
    geometry = conv_geometry(2, (3, 8), 8, (1, 2), (1, 2), (0, 0), (1, 1))
    assert not geometry.copies_input and geometry.grid_is_output
    calls = []
    real = bsmm.backends.cpu.shifted_pass  # strided_pass goes through it too

    def spy(pass_name, index, act, other, out, *args, **kwargs):
        calls.append((act, other, out))
        return real(pass_name, index, act, other, out, *args, **kwargs)

    monkeypatch.setattr(bsmm.backends.cpu, "shifted_pass", spy)
    x, w, dy = case.x, case.w, case.dy
    y, dx, dw = conv(x, w), conv.bprop(dy, w, x.shape), conv.updat(x, dy)
    assert_close(y, case.y_ref, "float32")
    assert_close(dx, case.dx_ref, "float32")
    assert_close(dw, case.dw_ref, "float32")
    # fprop and updat: one pass for both kernel offsets; bprop: one per residue of their
    # shifts modulo the stride 2 (columns 0 and 1: two).
    assert len(calls) == 1 + 2 + 1
    updat = calls[3:]
    assert all(np.shares_memory(act, x) and np.shares_memory(other, dy) for act, other, _ in updat)


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("stride, bprops", [(1, 1), (2, 2), ((2, 3), 2)])
def test_passes_sum_every_offset_in_one_launch(monkeypatch, channels_last, stride, bprops):
    """fprop and updat sum every kernel offset inside one pass; bprop needs one per residue of
    the offsets' shifts modulo the last stride (2 kernel columns: at most 2)."""
    rng = np.random.default_rng(11)
    case = make_case(rng, "skewed", 8, (3, 2), stride, (1, 0), (2, 1), channels_last, 2, (6, 5), "float32")
    calls = []
    real = bsmm.backends.cpu.shifted_pass

    def spy(pass_name, *args, **kwargs):
        calls.append(pass_name)
        return real(pass_name, *args, **kwargs)

    monkeypatch.setattr(bsmm.backends.cpu, "shifted_pass", spy)
    y, dx, dw = _run_three_passes(np, case, "float32")
    assert calls == ["fprop"] + ["bprop"] * bprops + ["updat"]
    assert_close(y, case.y_ref, "float32")
    assert_close(dx, case.dx_ref, "float32")
    assert_close(dw, case.dw_ref, "float32")


@pytest.mark.parametrize("args, copies, cropped", [
    (((4, 6), (3, 3), (1, 1), (1, 1), (1, 1)), True, True),      # padding
    (((4, 6), (3, 3), (1, 1), (0, 0), (1, 1)), False, True),      # valid 3x3: over-computes
    (((4, 6), (1, 1), (2, 1), (0, 0), (1, 1)), True, False),      # stride on an outer dimension
    (((4, 7), (1, 1), (1, 2), (0, 0), (1, 1)), True, False),      # width not a multiple of the stride
    (((4, 6), (2, 2), (2, 2), (0, 0), (1, 1)), True, False),      # patchify
    (((9,), (3,), (3,), (0,), (1,)), False, False),               # 1-D patchify
])
def test_geometry_copies(args, copies, cropped):
    geometry = conv_geometry(2, args[0], 8, *args[1:])
    assert geometry.copies_input is copies
    assert (not geometry.grid_is_output) is cropped
    assert geometry.rows <= 2 * np.prod(geometry.grid)
    assert max(geometry.shifts) + (geometry.rows - 1) * geometry.row_stride + 8 <= np.prod(geometry.canvas_shape)


def test_dlpack_inputs_come_back_as_numpy():
    rng = np.random.default_rng(6)
    case = make_case(rng, *GEOMETRIES["1d-3-p1"], "float32")
    y = case.conv(Producer(case.x), Producer(case.w))
    assert isinstance(y, np.ndarray)
    assert_close(y, case.y_ref, "float32")


def test_dense_round_trip_and_initializer():
    conv = BlocksparseConv(np.array([[1, 0, 1], [0, 1, 1]]), 8, (3, 1), padding=(1, 0))
    w = conv.normal_init(seed=0)
    assert w.shape == conv.w_shape == (3, 1, 4, 8, 8) and w.dtype == np.float32
    dense = conv.to_dense(w)
    assert dense.shape == (3, 1, 16, 24)
    assert not dense[:, :, :8, 8:16].any() and not dense[:, :, 8:, :8].any()
    np.testing.assert_array_equal(conv.from_dense(dense), w)
    # std 1/sqrt(fan-in): 3 taps x 8 channels for block column 0, 3 x 16 for column 2
    big = BlocksparseConv(np.ones((4, 1)), 32, (3, 3)).normal_init(scale=2.0, seed=1)
    assert big.std() == pytest.approx(2.0 / np.sqrt(9 * 128), rel=0.03)
    assert not np.array_equal(big[0, 0], big[0, 1]), "offsets drew the same numbers"


def test_properties_pickle_and_repr():
    conv = BlocksparseConv(np.array([[1, 0], [1, 1]]), 16, (3, 5), stride=(1, 2), padding=(1, 2), dilation=2,
                           channels_last=False, tf32=True)
    assert (conv.C, conv.K, conv.blocks, conv.ndim, conv.block_size) == (32, 32, 3, 2, 16)
    assert conv.density == 0.75 and conv.tf32 is True
    assert conv.output_shape((4, 32, 10, 12)) == (4, 32, 8, 4)
    assert conv.flops((4, 32, 10, 12)) == 2 * 4 * 8 * 4 * 15 * 3 * 16 * 16
    clone = pickle.loads(pickle.dumps(conv))
    assert repr(clone) == repr(conv) and clone.w_shape == conv.w_shape == (3, 5, 3, 16, 16)
    assert "kernel_size=(3, 5), stride=(1, 2), padding=(1, 2), dilation=(2, 2), channels_last=False" in repr(conv)
    assert BlocksparseConv(np.ones((1, 1)), 8, 3).kernel_size == (3, 3)


# -- errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, match", [
    ({"kernel_size": (3, 3, 3, 3)}, ValueError, "kernel_size must be an int or a tuple of 1, 2 or 3"),
    ({"kernel_size": (3, 0)}, ValueError, "kernel_size must be >= 1"),
    ({"kernel_size": (3, 2.0)}, TypeError, "kernel_size must be an int or a tuple of 2 ints"),
    ({"stride": (1, 2, 3)}, ValueError, "stride must have 2 entries"),
    ({"stride": 0}, ValueError, "stride must be >= 1"),
    ({"padding": -1}, ValueError, "padding must be >= 0"),
    ({"padding": "full"}, ValueError, "padding must be an int, a tuple, 'valid' or 'same'"),
    ({"padding": "same", "stride": 2}, ValueError, "padding='same' needs stride 1"),
    ({"padding": "same", "kernel_size": (2, 3)}, NotImplementedError, "asymmetric"),
    ({"dilation": None}, TypeError, "dilation must be an int or a tuple"),
    ({"channels_last": "yes"}, TypeError, "channels_last must be True or False"),
])
def test_constructor_errors(kwargs, error, match):
    arguments = {"kernel_size": (3, 3)} | kwargs
    with pytest.raises(error, match=match):
        BlocksparseConv(np.ones((1, 1)), 8, **arguments)


def test_pass_errors_name_the_argument(xp):
    conv = BlocksparseConv(np.ones((2, 1)), 8, (3, 3), stride=2)
    x = to_xp(xp, np.ones((2, 7, 7, 16), np.float32))
    w = to_xp(xp, np.ones(conv.w_shape, np.float32))
    dy = to_xp(xp, np.ones((2, 3, 3, 8), np.float32))
    cases = [
        (lambda: conv(x[0], w), ValueError, r"x must have shape \(N, H, W, 16\) \(channels last\)"),
        (lambda: conv(x[..., :8], w), ValueError, "x must have shape"),
        (lambda: conv(x[:, :2, :2].copy(), w), ValueError, "x of shape .*smaller than the dilated kernel"),
        (lambda: conv(x[:, :, ::2], w), ValueError, "x must be C-contiguous"),
        (lambda: conv(x, w[:2]), ValueError, r"w must have shape w_shape \(3, 3, 2, 8, 8\)"),
        (lambda: conv(x, w.astype(np.float16)), TypeError, "w has dtype float16 but x has float32"),
        (lambda: conv(x.astype(np.int32), w), TypeError, "x has dtype int32"),
        (lambda: conv(x, w, out=xp.empty((2, 3, 3, 9), np.float32)), ValueError, "out must have shape"),
        (lambda: conv([1, 2], w), TypeError, "x must be an array"),
        (lambda: conv.bprop(dy, w, (2, 9, 9, 16)), ValueError, r"dy must have shape \(2, 4, 4, 8\)"),
        (lambda: conv.bprop(dy, w, (2, 7, 7, 8)), ValueError, "x_shape must have shape"),
        (lambda: conv.bprop(dy, w, 7), TypeError, "x_shape must be a tuple of ints"),
        (lambda: conv.bprop(dy, w, (2, 7.0, 7, 16)), TypeError, "x_shape must be a tuple of ints"),
        (lambda: conv.updat(x, dy[:1]), ValueError, "dy must have shape .* for x of shape"),
        (lambda: conv.updat(x, dy.astype(np.float16)), TypeError, "dy has dtype float16 but x has float32"),
        (lambda: conv.updat(x, dy, accumulate=True), ValueError, "accumulate=True needs out="),
        (lambda: conv.output_shape((2, 16, 7, 7)), ValueError, "input_shape must have shape"),
        (lambda: conv.to_dense(w[0]), ValueError, "w must have shape w_shape"),
        (lambda: conv.from_dense(np.ones((3, 3, 8, 16))), ValueError, r"dense must have shape \(3, 3, 16, 8\)"),
    ]
    if xp is not np:
        cases.append((lambda: conv(x, np.ones(conv.w_shape, np.float32)), ValueError, "numpy array but x is a cupy"))
        cases.append((lambda: conv(x.astype(np.float64), w.astype(np.float64)), TypeError, "only on the CPU"))
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()


def test_reference_matches_torch():
    """The test's own reference against PyTorch's float64 convolution (when PyTorch is there)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    case = make_case(rng, *GEOMETRIES["2d-3x2-mixed"], np.float64)
    conv = case.conv
    weight = torch.from_numpy(np.moveaxis(case.dense, (-2, -1), (1, 0)).copy())  # (K, C, kh, kw)
    x = torch.from_numpy(to_first(case.x)).requires_grad_()
    w = weight.requires_grad_()
    y = torch.nn.functional.conv2d(x, w, stride=conv.stride, padding=conv.padding, dilation=conv.dilation)
    np.testing.assert_allclose(to_last(y.detach().numpy()), case.y_ref, rtol=1e-10, atol=1e-10)
    y.backward(torch.from_numpy(to_first(case.dy)))
    np.testing.assert_allclose(to_last(x.grad.numpy()), case.dx_ref, rtol=1e-10, atol=1e-10)
    dw_dense = np.moveaxis(w.grad.numpy(), (0, 1), (-1, -2))  # (kh, kw, C, K)
    per_offset = dw_dense.reshape(-1, conv.C, conv.K)
    dw = np.stack([dense_to_present_blocks(conv.layout, m, conv.block_size) for m in per_offset])
    np.testing.assert_allclose(dw.reshape(conv.w_shape), case.dw_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.gpu
def test_gpu_tf32(xp):
    if xp is np:
        pytest.skip("TF32 is a GPU math mode")
    rng = np.random.default_rng(8)
    case = make_case(rng, "random", 32, (3, 3), 1, 1, 1, True, 2, (6, 7), "float32")
    conv = BlocksparseConv(case.conv.layout, 32, (3, 3), padding=1, tf32=True)
    x, w = to_xp(xp, case.x), to_xp(xp, case.w)
    error = np.linalg.norm(to_numpy(conv(x, w)) - case.y_ref) / np.linalg.norm(case.y_ref)
    assert 0 < error < 3e-3


def test_bench_cpu_mode_runs(tmp_path, capsys, monkeypatch):
    """``tools/gpu/bench_conv.py --cpu``: the NumPy smoke run checks itself and writes its JSON."""
    import importlib.util
    import json
    import sys

    path = REPO_ROOT / "tools" / "gpu" / "bench_conv.py"
    spec = importlib.util.spec_from_file_location("bench_conv", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_conv", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    output = tmp_path / "conv.json"
    assert bench.main(["--cpu", "--densities", "0.25", "--repeats", "1", "--json", str(output)]) == 0
    rows = json.loads(output.read_text())["rows"]
    assert [row["pass_name"] for row in rows] == ["fprop", "bprop", "updat"]
    assert all(row["error"] < 1e-5 and row["sparse_s"] > 0 for row in rows)
    assert "| efficiency |" in capsys.readouterr().out
    # The GPU run's code on PyTorch's CPU convolution: data sharing, masking, the check, the rows.
    pytest.importorskip("torch")
    spec = dict(N=2, H=9, W=7, C=64, K=32, kernel=3, stride=2, padding=1)
    rows = bench.bench_torch({"tiny": spec}, ["float32", "bfloat16"], [0.5], 16, 0, False,
                             _seconds_of_one_call, device="cpu")
    assert len(rows) == 6 and all(row.error < 2e-2 and row.shape == "tiny" for row in rows)


def _seconds_of_one_call(fn) -> float:
    """A timer for bench_torch's rows on the CPU: what is checked is the rows, not the time."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start

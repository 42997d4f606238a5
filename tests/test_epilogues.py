"""Fused epilogues of fprop, y = A(x·W (+ out) + bias), against float64 dense references.

The activations are written here again from their formulas (relu, erf-GELU through SciPy, tanh-GELU,
SiLU) and never taken from :mod:`bsmm.epilogues`; x·W comes from ``reference.py``. Inputs are fresh
standard-normal data; outputs and ``pre=`` buffers start NaN-poisoned, so an element a pass forgets
to write cannot pass. Each body runs on NumPy and, marked ``gpu``, on CuPy (conftest's ``xp``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import erf

import bsmm
from bsmm.dtypes import ELEMENT_TYPES
from bsmm.epilogues import ACTIVATIONS, activation_grad, epilogue_name
from conftest import poisoned, snapshot, to_numpy, to_xp
from reference import DTYPES, as_float64, assert_close, random_data, random_layout, ref_fprop, skewed_layout

ALL_DTYPES = [*DTYPES, "float64"]  # float64: the CPU backend only
NAMES = [None, "none", "relu", "gelu", "gelu_tanh", "silu"]
_C = math.sqrt(2.0 / math.pi)


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _tanh_inner(z):
    return np.tanh(_C * (z + 0.044715 * z ** 3))


#: name -> (A(z), A'(z)) in float64, from the formulas.
FORMULAS = {
    None: (lambda z: z, np.ones_like),
    "none": (lambda z: z, np.ones_like),
    "relu": (lambda z: np.maximum(z, 0.0), lambda z: (z > 0).astype(np.float64)),
    "gelu": (lambda z: 0.5 * z * (1.0 + erf(z / math.sqrt(2.0))),
             lambda z: 0.5 * (1.0 + erf(z / math.sqrt(2.0))) + z * np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)),
    "gelu_tanh": (lambda z: 0.5 * z * (1.0 + _tanh_inner(z)),
                  lambda z: 0.5 * (1.0 + _tanh_inner(z))
                  + 0.5 * z * (1.0 - _tanh_inner(z) ** 2) * _C * (1.0 + 3 * 0.044715 * z * z)),
    "silu": (lambda z: z * _sigmoid(z), lambda z: _sigmoid(z) * (1.0 + z * (1.0 - _sigmoid(z)))),
}


def dtype_of(name: str) -> np.dtype:
    return ELEMENT_TYPES[name].numpy


def skip_float64_on_gpu(xp, dtype: str) -> None:
    if dtype == "float64" and xp is not np:
        pytest.skip("float64 runs on the CPU backend only")


def features(op, n: int, count: int) -> tuple:
    return (n, count) if op.feature_axis == 1 else (count, n)


def reference(op, x, w, bias=None, activation=None, start=None):
    """(z, y) in float64: z = x·W (+ start) (+ bias along the features), y = A(z)."""
    z = ref_fprop(op.layout, w, op.block_size, x, op.feature_axis)
    if start is not None:
        z = z + as_float64(start)
    if bias is not None:
        b = as_float64(bias)
        z = z + (b if op.feature_axis == 1 else b[:, None])
    return z, FORMULAS[activation][0](z)


def refill_with_nan(array) -> None:
    """Poison ``array`` in place (its address kept), through the bits like conftest.poisoned."""
    element = ELEMENT_TYPES[np.dtype(array.dtype).name]
    array.view(element.uint).fill(element.nan_bits)


def check_epilogue(xp, op, x, w, dtype, bias=None, activation=None, with_pre=False) -> None:
    """op(...) with out=None and op.fprop(..., out=poisoned): y and pre against the reference,
    results of x's dtype and library, the inputs untouched."""
    z, y = reference(op, x, w, bias, activation)
    dt = dtype_of(dtype)
    args = [to_xp(xp, x), to_xp(xp, w)]
    bias_xp = None if bias is None else to_xp(xp, bias)
    before = snapshot(*args, *([] if bias is None else [bias_xp]))
    for out in (None, poisoned(xp, y.shape, dt)):
        pre = poisoned(xp, y.shape, dt) if with_pre else None
        call = op if out is None else op.fprop
        result = call(*args, out=out, bias=bias_xp, activation=activation, pre=pre)
        assert out is None or result is out, "a pass given out= must return that very object"
        assert type(result) is type(args[0]) and result.dtype == dt and tuple(result.shape) == y.shape
        assert_close(to_numpy(result), y, dtype, f"y (out={'new' if out is None else 'given'})")
        if with_pre:
            assert_close(to_numpy(pre), z, dtype, "pre")
    assert snapshot(*args, *([] if bias is None else [bias_xp])) == before, "an input was modified"


# -- 1. every epilogue, dtype and feature axis; shapes and layouts ------------------------------------
EPILOGUES = [(a, b, p) for a in NAMES for b in (False, True) for p in (False, True) if a is not None or b or not p]


@pytest.mark.parametrize("activation,with_bias,with_pre", EPILOGUES,
                         ids=[f"{a}-{'bias' if b else 'nobias'}-{'pre' if p else 'nopre'}" for a, b, p in EPILOGUES])
@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_epilogue_matches_reference(xp, dtype, feature_axis, activation, with_bias, with_pre):
    """y = A(x·W + bias) and pre = x·W + bias, for C != K and N = 37 (no multiple of 16)."""
    skip_float64_on_gpu(xp, dtype)
    rng = np.random.default_rng([NAMES.index(activation), with_bias, with_pre, feature_axis, ALL_DTYPES.index(dtype)])
    layout = random_layout(rng, 5, 3, 0.5)
    layout[0, 0] = 1
    op = bsmm.BlocksparseMatMul(layout, block_size=16, feature_axis=feature_axis)  # C = 80, K = 48
    x = random_data(rng, features(op, 37, op.C), dtype_of(dtype))
    w = random_data(rng, op.w_shape, dtype_of(dtype))
    bias = random_data(rng, (op.K,), dtype_of(dtype)) if with_bias else None
    check_epilogue(xp, op, x, w, dtype, bias, activation, with_pre)


LAYOUTS = {"random": (16, (5, 3)), "skewed": (32, (4, 5)), "empty": (8, (3, 4)), "full": (64, (1, 2))}


@pytest.mark.parametrize("n", [1, 37, 64])
@pytest.mark.parametrize("layout_kind", list(LAYOUTS))
@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("activation", NAMES[1:])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_epilogue_layouts_and_batches(xp, dtype, activation, feature_axis, layout_kind, n):
    """Block sizes 8 to 64, skewed, empty (y = A(bias)) and full layouts, N = 1, 37, 64; bias and pre."""
    bs, (cb, kb) = LAYOUTS[layout_kind]
    rng = np.random.default_rng([bs, n, feature_axis, NAMES.index(activation), len(dtype)])
    layout = {"random": lambda: random_layout(rng, cb, kb, 0.5), "skewed": lambda: skewed_layout(rng, cb, kb),
              "empty": lambda: np.zeros((cb, kb), np.uint8), "full": lambda: np.ones((cb, kb), np.uint8)}[layout_kind]()
    op = bsmm.BlocksparseMatMul(layout, block_size=bs, feature_axis=feature_axis)
    x = random_data(rng, features(op, n, op.C), dtype)
    w = random_data(rng, op.w_shape, dtype)
    bias = random_data(rng, (op.K,), dtype)
    if layout_kind == "empty":  # nothing to multiply: every row (column) of y is A(bias)
        _, y = reference(op, x, w, bias, activation)
        along = y if feature_axis == 1 else y.T
        assert np.array_equal(along, np.broadcast_to(FORMULAS[activation][0](as_float64(bias)), along.shape))
    check_epilogue(xp, op, x, w, dtype, bias, activation, with_pre=True)


# -- 2. accumulate: z includes what out held -------------------------------------------------------------
@pytest.mark.parametrize("activation,with_bias", [(a, b) for a in [None, *NAMES[2:]] for b in (True, False)
                                                   if a is not None or b])  # bias alone: the "none" epilogue
@pytest.mark.parametrize("layout_kind", ["skewed", "empty"])
@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_accumulate_adds_out_before_the_activation(xp, dtype, feature_axis, layout_kind, activation, with_bias):
    """out = A(x·W + out_old + bias), pre = x·W + out_old + bias; twice (a repeat on the GPU)."""
    rng = np.random.default_rng([feature_axis, len(layout_kind), NAMES.index(activation), with_bias, len(dtype)])
    layout = skewed_layout(rng, 4, 5) if layout_kind == "skewed" else np.zeros((4, 5), np.uint8)
    op = bsmm.BlocksparseMatMul(layout, block_size=16, feature_axis=feature_axis)
    x, w = random_data(rng, features(op, 21, op.C), dtype), random_data(rng, op.w_shape, dtype)
    bias = random_data(rng, (op.K,), dtype) if with_bias else None
    start = random_data(rng, features(op, 21, op.K), dtype)
    out, pre = to_xp(xp, start), poisoned(xp, start.shape, start.dtype)
    args = (to_xp(xp, x), to_xp(xp, w))
    bias_xp = None if bias is None else to_xp(xp, bias)
    for step in range(2):
        held = to_numpy(out).copy()
        z, y = reference(op, x, w, bias, activation, start=held)
        assert op(*args, out=out, accumulate=True, bias=bias_xp, activation=activation, pre=pre) is out
        assert_close(to_numpy(out), y, dtype, f"y, step {step}")
        assert_close(to_numpy(pre), z, dtype, f"pre, step {step}")


# -- 3. activation_grad ---------------------------------------------------------------------------------
def test_epilogue_name_keeps_unchecked_names_apart():
    """The repeat path looks its kept calls up by this name before any check: a name that is not an
    activation (the empty string among them) must not alias "none", or a GPU repeat would skip the refusal."""
    assert epilogue_name(None, None) == "store"
    assert epilogue_name(np.zeros(2), None) == "none"
    assert epilogue_name(None, "relu") == "relu"
    assert epilogue_name(np.zeros(2), "") == ""
    assert epilogue_name(None, "") == ""


def test_formula_derivatives_match_finite_differences():
    """The reference derivatives of this file are those of its formulas (central differences)."""
    z = np.random.default_rng(3).standard_normal(1000) * 3
    h = 1e-5
    for name in ("gelu", "gelu_tanh", "silu", "relu"):
        forward, derivative = FORMULAS[name]
        numeric = (forward(z + h) - forward(z - h)) / (2 * h)
        np.testing.assert_allclose(derivative(z), numeric, rtol=1e-7, atol=1e-8, err_msg=name)


@pytest.mark.parametrize("activation", NAMES)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_activation_grad(xp, dtype, activation):
    """dz = dy·A'(z), given z for the activations that read "pre" and y for relu and none;
    in dy's dtype and library. relu's derivative is 0 where z is 0."""
    rng = np.random.default_rng([NAMES.index(activation), ALL_DTYPES.index(dtype)])
    z = (rng.standard_normal((33, 20)) * 3).astype(dtype_of(dtype))
    z[0, :3] = 0
    dy = random_data(rng, z.shape, dtype_of(dtype))
    reads = "output" if activation in (None, "none", "relu") else "pre"
    assert activation is None or ACTIVATIONS[activation].reads == reads
    saved = FORMULAS[activation][0](as_float64(z)).astype(z.dtype) if reads == "output" else z
    dy_xp = to_xp(xp, dy)
    dz = activation_grad(dy_xp, to_xp(xp, saved), activation)
    assert type(dz) is type(dy_xp) and dz.dtype == dy.dtype and dz.shape == dy.shape
    assert_close(to_numpy(dz), as_float64(dy) * FORMULAS[activation][1](as_float64(z)), dtype)


@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_activation_grad_of_what_fprop_kept(xp, activation, feature_axis):
    """The backward's inputs from a forward: y (relu) or pre (others) give dz = dy·A'(x·W + bias)."""
    rng = np.random.default_rng([NAMES.index(activation), feature_axis, 9])
    op = bsmm.BlocksparseMatMul(skewed_layout(rng, 4, 5), block_size=8, feature_axis=feature_axis)
    x, w = random_data(rng, features(op, 19, op.C), "float32"), random_data(rng, op.w_shape, "float32")
    bias, dy = random_data(rng, (op.K,), "float32"), random_data(rng, features(op, 19, op.K), "float32")
    pre = poisoned(xp, dy.shape, np.float32)
    y = op(to_xp(xp, x), to_xp(xp, w), bias=to_xp(xp, bias), activation=activation, pre=pre)
    saved = y if ACTIVATIONS[activation].reads == "output" else pre
    z, _ = reference(op, x, w, bias, activation)
    dz = activation_grad(to_xp(xp, dy), saved, activation)
    assert_close(to_numpy(dz), as_float64(dy) * FORMULAS[activation][1](z), "float32")


# -- 4. repeat calls on the GPU (FastCall) ---------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("feature_axis", [1, 0])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_repeat_calls_with_new_bias_and_pre(cupy, activation, feature_axis, monkeypatch):
    """Three rounds of calls rotating two biases, two pre buffers, no bias, no pre and out=: each
    right, pre written only where passed, and only the first call of each epilogue checked."""
    rng = np.random.default_rng([NAMES.index(activation), feature_axis, 4])
    op = bsmm.BlocksparseMatMul(skewed_layout(rng, 4, 5), block_size=16, feature_axis=feature_axis)
    xs = [random_data(rng, features(op, 40, op.C), "float16") for _ in range(2)]
    w = random_data(rng, op.w_shape, "float16")
    biases = [random_data(rng, (op.K,), "float16") for _ in range(2)]
    xs_gpu, w_gpu, biases_gpu = [cupy.asarray(x) for x in xs], cupy.asarray(w), [cupy.asarray(b) for b in biases]
    shape = features(op, 40, op.K)
    pres, out = [poisoned(cupy, shape, np.float16) for _ in range(2)], poisoned(cupy, shape, np.float16)
    # (bias, pre, out=): new bias and pre arrays, then without bias, then into out=
    variants = [(0, 0, False), (1, 1, False), (None, None, False), (0, None, True), (1, 0, True), (None, 1, False)]
    if activation is None:
        variants = [v for v in variants if v[0] is not None or v[1] is None]
    real, checked = op._activation_pass, []
    monkeypatch.setattr(op, "_activation_pass", lambda *a, **k: checked.append(1) or real(*a, **k))
    for round_ in range(3):
        for b, p, into_out in variants:
            x = round_ % 2
            for unused in pres:
                refill_with_nan(unused)
            if into_out:
                refill_with_nan(out)
            result = op(xs_gpu[x], w_gpu, out=out if into_out else None, activation=activation,
                        bias=None if b is None else biases_gpu[b], pre=None if p is None else pres[p])
            assert (result is out) == into_out
            z, y = reference(op, xs[x], w, None if b is None else biases[b], activation)
            what = f"round {round_}, bias {b}, pre {p}, out= {into_out}"
            assert_close(to_numpy(result), y, "float16", f"y, {what}")
            for i, buffer in enumerate(pres):
                if i == p:
                    assert_close(to_numpy(buffer), z, "float16", f"pre, {what}")
                else:
                    assert np.isnan(as_float64(to_numpy(buffer))).all(), f"pre {i} written, {what}"
    names = {"store" if activation is None and b is None else activation or "none" for b, _, _ in variants}
    assert len(checked) == len(names), "repeats of a kept epilogue should not take the checked path"
    assert {key[-1] for key in op.kept_calls} == names


# -- 5. refused calls --------------------------------------------------------------------------------------
class Args:
    """Valid float32 arrays for C = 48, K = 32, N = 5, and views into shared buffers for overlap."""

    def __init__(self, xp, feature_axis):
        self.xp, self.op = xp, bsmm.BlocksparseMatMul(np.array([[1, 0], [1, 1], [0, 1]]), 16, feature_axis)
        self.K, self.y_shape = self.op.K, features(self.op, 5, self.op.K)
        self.x = self.new(features(self.op, 5, self.op.C))
        self.w, self.bias = self.new(self.op.w_shape), self.new((self.K,))
        self.out, self.pre = poisoned(xp, self.y_shape, np.float32), poisoned(xp, self.y_shape, np.float32)

    def new(self, shape, dtype=np.float32):
        return to_xp(self.xp, random_data(np.random.default_rng([*shape, 5]), shape, dtype))

    def sharing(self, first_shape):
        """(a view of first_shape, a view of y's shape) of one buffer, overlapping by one element."""
        head = math.prod(first_shape)
        flat = self.new((head - 1 + math.prod(self.y_shape),))
        return flat[:head].reshape(first_shape), flat[head - 1:].reshape(self.y_shape)


def _overlap(s, argument):
    shape = {"x": s.x.shape, "w": s.w.shape, "bias": (s.K,), "out": s.y_shape}[argument]
    first, pre = s.sharing(shape)
    return {"activation": "silu", "bias": s.bias, argument: first, "pre": pre}  # argument may replace bias


BAD = {
    "bias_long": (lambda s: {"bias": s.new((s.K + 1,))}, ValueError, r"bias must have shape \(32,\); got \(33,\)"),
    "bias_2d": (lambda s: {"bias": s.new((1, s.K))}, ValueError, r"bias must have shape \(32,\); got \(1, 32\)"),
    "bias_of_C": (lambda s: {"bias": s.new((48,)), "activation": "relu"}, ValueError, r"bias must have shape \(32,\)"),
    "bias_dtype": (lambda s: {"bias": s.new((s.K,), np.float16)}, TypeError,
                   "bias has dtype float16 but the activations have float32"),
    "bias_strided": (lambda s: {"bias": s.new((2 * s.K,))[::2]}, ValueError, "bias must be C-contiguous"),
    "pre_shape": (lambda s: {"bias": s.bias, "pre": s.new(s.y_shape[::-1])}, ValueError,
                  r"pre must have the output's shape"),
    "pre_dtype": (lambda s: {"activation": "gelu", "pre": s.new(s.y_shape, np.float16)}, TypeError,
                  "pre has dtype float16 but the activations have float32"),
    "pre_strided": (lambda s: {"activation": "gelu", "pre": s.new((s.y_shape[0], 2 * s.y_shape[1]))[:, ::2]},
                    ValueError, "pre must be C-contiguous"),
    "pre_alone": (lambda s: {"pre": s.pre}, ValueError, "pre= keeps the pre-activation of an epilogue: pass bias="),
    "pre_is_out": (lambda s: {"out": s.out, "pre": s.out, "accumulate": True, "activation": "relu"}, ValueError,
                   "pre overlaps out or an input"),
    **{f"pre_overlaps_{a}": (lambda s, a=a: _overlap(s, a), ValueError, "pre overlaps out or an input")
       for a in ("out", "x", "w", "bias")},
    **{f"activation_{a!r}": (lambda s, a=a: {"activation": a, "bias": s.bias}, ValueError,
                             r"activation must be None or one of 'none', 'relu', 'gelu', 'gelu_tanh', 'silu'; got ")
       for a in ("tanh", "RELU", "", 0, False, 1, ("relu",), ["relu"])},
}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("feature_axis", [1, 0])
def test_refused_calls_modify_nothing(xp, feature_axis, bad):
    """Each bad bias, pre or activation raises its error and writes into no argument, also after the
    valid calls that leave repeatable GPU calls of every kind behind (store, bias alone, relu + pre)."""
    s = Args(xp, feature_axis)
    s.op(s.x, s.w)
    s.op(s.x, s.w, bias=s.bias)
    s.op(s.x, s.w, out=s.out, bias=s.bias, activation="relu", pre=s.pre)
    build, error, match = BAD[bad]
    kwargs = build(s)
    x, w = kwargs.pop("x", s.x), kwargs.pop("w", s.w)
    arrays = [x, w, s.x, s.w, s.bias, s.out, s.pre, *(v for v in kwargs.values() if hasattr(v, "shape"))]
    before = snapshot(*arrays)
    with pytest.raises(error, match=match):
        s.op(x, w, **kwargs)
    assert snapshot(*arrays) == before, "a refused call modified an argument"

"""Randomized differential sweep of the three passes on the GPU, at users' shapes.

Each run draws a fresh seed (``--seed S`` to repeat one), prints ``seed S`` first, then draws
``--cases`` cases: block size, dtype kind (float32, tf32, float16, bfloat16), feature axis,
C and K (rectangular, up to 16384), N (1 to 8192, weighted towards small and odd batches),
density (1-60 %) and a layout kind (random, skewed, holes, barabasi_albert). Every pass of
every case runs four ways against a float64 reference computed on the GPU with CuPy:

- ``alloc``: a plain allocating call;
- ``repeat``: a second identical call, which must be bitwise equal to the first;
- ``out``: into an ``out=`` buffer poisoned with NaN;
- ``accumulate``: ``accumulate=True`` into an ``out`` holding known random data of about the
  product's size (expected: that data + the product).

A check fails on a norm-wise relative error above the dtype's tolerance (tests/reference.py's
TOLERANCE), on any NaN/Inf, on a wrong shape or dtype, or on an exception. One line per
failure is printed as it happens, a summary at the end; exit status 1 on any failure.

Caps (each case takes well under a second on an H100, its float64 data a few GiB at most):

- C, K <= 16384 (dense W in float64: C*K*8 bytes <= 2 GiB), multiples of the block size;
- N <= 8192, N*C <= 2**26 and N*K <= 2**26 (float64 activations <= 512 MiB);
- N*C*K <= 2**37, i.e. <= 2**38 flop per float64 reference GEMM (about 5 ms on an H100).

A drawn case over a cap keeps its shape and gets a smaller N, or (half the time) keeps N and
halves the larger of C and K until it fits. On an H100 with the kernels in the cache
(``tools/ci/compile_kernels.py --populate-cache``, as tools/gpu/gpu_check.sh does) 240 cases took 30 s
(median 10 ms a case, CuPy's first kernels included), 3000 cases 43 s; kernels not yet cached
compile at first use and count against ``--budget``.

    PYTHONPATH=$PWD python tools/gpu/gpu_sweep.py [--seed S] [--cases 240] [--budget 300] [--json PATH]
    PYTHONPATH=$PWD python tools/gpu/gpu_sweep.py --seed S --case I     # re-run case I of seed S
    python tools/gpu/gpu_sweep.py --dry-run [--seed S]                  # draw and print the cases only
    python tools/gpu/gpu_sweep.py --cpu --cases 20                      # NumPy CPU backend (slow)

Case drawing (:func:`draw_cases`) needs NumPy and bsmm only: CuPy is imported when cases run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from bsmm.dtypes import ELEMENT_TYPES, GPU_KINDS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from reference import TOLERANCE, kind_dtype  # noqa: E402  (tests/reference.py: the tolerances of the test suite)

BLOCK_SIZES = (8, 16, 32, 64, 128)
KINDS = GPU_KINDS  # float32, tf32, float16, bfloat16 (bsmm.dtypes; the draws depend on the order)
LAYOUT_KINDS = ("random", "skewed", "holes", "barabasi_albert")
PASSES = ("fprop", "bprop", "updat")
WAYS = ("alloc", "repeat", "out", "accumulate")

MAX_FEATURES = 16384
MAX_N = 8192
MAX_ACTIVATION = 2**26  # N*C and N*K
MAX_VOLUME = 2**37  # N*C*K
MIN_DENSITY, MAX_DENSITY = 0.01, 0.6

#: Layer widths seen in users' models (rounded down to the block size when drawn).
USER_WIDTHS = (96, 200, 768, 1000, 1184, 1536, 2400, 3072, 4320, 5120, 6144, 10240, 12288, 16384)
#: Batch sizes at and around the multiples of 16, 32 and 64 that tiles are cut at.
SPECIAL_N = (1, 2, 3, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 257,
             1023, 1024, 1025, 4095, 4096, 4097, 8191, 8192)

_KIND_WEIGHTS = {"random": 0.35, "skewed": 0.25, "holes": 0.2, "barabasi_albert": 0.2}


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn case; the layout and data follow from its seeds, so the case reproduces alone."""

    index: int
    block_size: int
    kind: str  # a key of TOLERANCE: float32, tf32, float16 or bfloat16
    feature_axis: int
    N: int
    C: int
    K: int
    density: float  # the drawn target; the layout's own density is close to it
    layout_kind: str
    layout_seed: int
    data_seed: int

    @property
    def dtype(self) -> str:
        """The array dtype's name (tf32 runs on float32 data)."""
        return kind_dtype(self.kind)

    @property
    def tf32(self) -> bool:
        return self.kind == "tf32"

    def describe(self) -> str:
        return (f"case {self.index}: {self.kind} bs={self.block_size} axis={self.feature_axis} N={self.N} "
                f"C={self.C} K={self.K} layout={self.layout_kind} density={self.density:.3f}")

    def layout(self) -> np.ndarray:
        """The (C // bs, K // bs) uint8 layout, built from ``layout_seed``."""
        return _build_layout(self.layout_kind, self.C // self.block_size, self.K // self.block_size,
                             self.density, np.random.default_rng(self.layout_seed))


def fits_caps(n: int, c: int, k: int) -> bool:
    """Whether a case of these sizes stays within the caps of the module docstring."""
    return (1 <= n <= MAX_N and max(c, k) <= MAX_FEATURES and n * c <= MAX_ACTIVATION
            and n * k <= MAX_ACTIVATION and n * c * k <= MAX_VOLUME)


def fresh_seed() -> int:
    """A seed from os.urandom (the clock where that fails), below 2**32."""
    try:
        return int.from_bytes(os.urandom(4), "little")
    except NotImplementedError:
        return time.time_ns() % 2**32


def draw_cases(seed: int, count: int) -> list[Case]:
    """Cases ``0 .. count - 1`` of ``seed``; case ``i`` does not depend on ``count``."""
    return [draw_case(seed, index) for index in range(count)]


def draw_case(seed: int, index: int) -> Case:
    """Case ``index`` of ``seed``, drawn from its own generator."""
    rng = np.random.default_rng([seed, index])
    bs = int(rng.choice(BLOCK_SIZES))
    kind = str(rng.choice(KINDS))
    feature_axis = int(rng.integers(2))
    layout_kind = str(rng.choice(list(_KIND_WEIGHTS), p=list(_KIND_WEIGHTS.values())))
    c, k = _draw_width(rng, bs), _draw_width(rng, bs)
    if layout_kind == "barabasi_albert":  # a graph among block nodes: square, 4 nodes at least
        c = k = max(c, 4 * bs)
    n = _draw_n(rng)
    density = float(math.exp(rng.uniform(math.log(MIN_DENSITY), math.log(MAX_DENSITY))))
    if not fits_caps(n, c, k):
        if rng.random() < 0.5:  # keep the layer, shrink the batch
            n = min(n, MAX_ACTIVATION // max(c, k), MAX_VOLUME // (c * k))
        while not fits_caps(n, c, k):  # keep the batch, halve the wider side (both if square)
            if layout_kind == "barabasi_albert":
                c = k = max(4 * bs, c // (2 * bs) * bs)
            elif c >= k:
                c = max(bs, c // (2 * bs) * bs)
            else:
                k = max(bs, k // (2 * bs) * bs)
    layout_seed, data_seed = (int(s) for s in rng.integers(2**63, size=2))
    return Case(index, bs, kind, feature_axis, int(n), int(c), int(k), density, layout_kind, layout_seed, data_seed)


def _log_uniform_int(rng: np.random.Generator, low: int, high: int) -> int:
    """An int in [low, high], log-uniform."""
    value = int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))
    return min(max(value, low), high)


def _draw_width(rng: np.random.Generator, bs: int) -> int:
    if rng.random() < 0.25:
        return max(bs, int(rng.choice(USER_WIDTHS)) // bs * bs)
    return bs * _log_uniform_int(rng, 1, MAX_FEATURES // bs)


def _draw_n(rng: np.random.Generator) -> int:
    u = rng.random()
    if u < 0.35:
        return _log_uniform_int(rng, 1, MAX_N)
    if u < 0.55:
        return int(rng.integers(1, 18))
    if u < 0.70:
        return int(rng.integers(17, 65))
    if u < 0.85:
        return int(rng.choice(SPECIAL_N))
    step = int(rng.choice((16, 32, 64)))
    return min(max(step * _log_uniform_int(rng, 1, MAX_N // step) + int(rng.integers(-1, 2)), 1), MAX_N)


def _build_layout(kind: str, cb: int, kb: int, density: float, rng: np.random.Generator) -> np.ndarray:
    from bsmm import layouts

    if kind == "barabasi_albert":
        return layouts.barabasi_albert(cb, min(max(round(density * cb / 2), 1), cb - 1), seed=rng)
    layout = layouts.random_layout(cb, kb, density=density / 2 if kind == "skewed" else density, seed=rng)
    if kind == "skewed":  # a few full block columns and rows over a sparse rest
        layout[:, rng.choice(kb, size=min(kb, int(rng.integers(1, 4))), replace=False)] = 1
        layout[rng.choice(cb, size=min(cb, int(rng.integers(1, 4))), replace=False), :] = 1
    elif kind == "holes":  # empty block rows and columns, the last ones often among them
        if rng.random() < 0.05:
            return np.zeros_like(layout)  # nothing present: every output must still be written
        rows, cols = _empty_lines(rng, cb), _empty_lines(rng, kb)
        layout[rows, :] = 0
        layout[:, cols] = 0
        if not layout.any():
            layout[rng.choice(np.setdiff1d(np.arange(cb), rows)), rng.choice(np.setdiff1d(np.arange(kb), cols))] = 1
        return layout
    elif kind != "random":
        raise ValueError(f"layout kind must be one of {LAYOUT_KINDS}; got {kind!r}")
    if not layout.any():
        layout[rng.integers(cb), rng.integers(kb)] = 1
    return layout


def _empty_lines(rng: np.random.Generator, count: int) -> np.ndarray:
    """Indices of 1 to half of ``count`` lines (never all of them), often the last or first."""
    if count < 2:
        return np.zeros(0, dtype=np.intp)
    chosen = set(rng.choice(count, size=int(rng.integers(1, count // 2 + 1)), replace=False).tolist())
    if rng.random() < 0.5:
        chosen.add(count - 1)
    if rng.random() < 0.3:
        chosen.add(0)
    if len(chosen) == count:
        chosen.discard(min(chosen))
    return np.array(sorted(chosen), dtype=np.intp)


# -- array helpers, for NumPy or CuPy (``xp``) -------------------------------------------------------
#: Element size -> the unsigned integer dtype elements are viewed as bitwise (ElementType.uint).
_BITS = {t.element_bytes: t.uint for t in ELEMENT_TYPES.values()}


def as_float32(array):
    """A float32 copy; bfloat16 through its bits (CuPy need not convert it)."""
    if array.dtype.name == "bfloat16":
        return (array.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return array.astype(np.float32)


def as_float64(array):
    return as_float32(array).astype(np.float64) if array.dtype.name == "bfloat16" else array.astype(np.float64)


def from_float32(array, dtype: str):
    """``array`` (float32) rounded to ``dtype``, to nearest even; bfloat16 through the bits."""
    if dtype != "bfloat16":
        return array.astype(dtype)
    bits = array.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype(np.uint16).view(ELEMENT_TYPES["bfloat16"].numpy)


def normal(rng, shape, dtype: str, scale: float = 1.0):
    """Standard-normal data times ``scale`` (a power of two: exact), rounded to ``dtype``."""
    data = rng.standard_normal(shape, dtype=np.float32)
    if scale != 1.0:
        data *= np.float32(scale)
    return from_float32(data, dtype)


def copy_bits(array):
    """A copy of ``array`` made through its bits (no copy kernel of bfloat16 needed)."""
    return array.view(_BITS[array.dtype.itemsize]).copy().view(array.dtype)


def poisoned(xp, shape, dtype: str):
    """An array of ``dtype`` whose every element is a quiet NaN (ElementType.nan_bits)."""
    element = ELEMENT_TYPES[dtype]
    return xp.full(shape, element.nan_bits, dtype=element.uint).view(element.numpy)


def rel_error(xp, actual, expected, dtype: str) -> tuple[float, str]:
    """(||actual - expected|| / ||expected||, "" or what is wrong) in float64; inf on NaN/Inf."""
    if tuple(actual.shape) != tuple(expected.shape):
        return math.inf, f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    if actual.dtype.name != dtype:
        return math.inf, f"dtype {actual.dtype.name} != {dtype}"
    got = as_float64(actual)
    bad = int(xp.count_nonzero(~xp.isfinite(got)))
    if bad:
        return math.inf, f"{bad} NaN/Inf of {got.size}"
    norm = float(xp.linalg.norm(expected.ravel()))
    return float(xp.linalg.norm((got - expected).ravel())) / max(norm, np.finfo(np.float64).tiny), ""


def bitwise_differences(xp, first, second) -> int:
    """How many elements of two same-shaped arrays differ in their bits."""
    bits = _BITS[first.dtype.itemsize]
    return int(xp.count_nonzero(first.view(bits) != second.view(bits)))


def _power_of_two_rms(xp, reference) -> float:
    """2**round(log2(rms(reference))), or 1 for an empty or all-zero reference."""
    rms = float(xp.sqrt(xp.mean(reference * reference))) if reference.size else 0.0
    return 2.0 ** round(math.log2(rms)) if rms > 0 else 1.0


# -- one case ------------------------------------------------------------------------------------
def references(op, x, dy, w, feature_axis: int) -> dict:
    """Float64 products of the three passes; updat's cut to the present blocks with op.from_dense."""
    dense = op.to_dense(as_float32(w)).astype(np.float64)
    x64, dy64 = as_float64(x), as_float64(dy)
    if feature_axis == 1:
        return {"fprop": x64 @ dense, "bprop": dy64 @ dense.T, "updat": op.from_dense(x64.T @ dy64)}
    return {"fprop": dense.T @ x64, "bprop": dense @ dy64, "updat": op.from_dense(x64 @ dy64.T)}


def run_case(case: Case, xp) -> tuple[list[dict], dict]:
    """Every check of ``case`` on ``xp``'s backend: (check records, facts about the case)."""
    import bsmm

    layout = case.layout()
    op = bsmm.BlocksparseMatMul(layout, block_size=case.block_size, feature_axis=case.feature_axis, tf32=case.tf32)
    rng = xp.random.default_rng(case.data_seed)

    def activations(features):
        shape = (case.N, features) if case.feature_axis == 1 else (features, case.N)
        return normal(rng, shape, case.dtype)

    x, dy, w = activations(case.C), activations(case.K), normal(rng, op.w_shape, case.dtype)
    refs = references(op, x, dy, w, case.feature_axis)
    calls = {
        "fprop": lambda out=None, accumulate=False: op.fprop(x, w, out=out, accumulate=accumulate),
        "bprop": lambda out=None, accumulate=False: op.bprop(dy, w, out=out, accumulate=accumulate),
        "updat": lambda out=None, accumulate=False: op.updat(x, dy, out=out, accumulate=accumulate),
    }
    tolerance = TOLERANCE[case.kind]
    records = []

    def record(pass_name, way, error, note=""):
        records.append({"pass": pass_name, "way": way, "error": error, "tolerance": tolerance,
                        "ok": bool(error <= tolerance) and not note, "note": note})

    for pass_name, call in calls.items():
        ref = refs[pass_name]
        first, second = call(), call()
        record(pass_name, "alloc", *rel_error(xp, first, ref, case.dtype))
        if tuple(first.shape) == tuple(second.shape) and first.dtype == second.dtype:
            differing = bitwise_differences(xp, first, second)
            record(pass_name, "repeat", 0.0 if not differing else math.inf,
                   f"{differing} of {first.size} elements differ between two identical calls" if differing else "")
        else:
            record(pass_name, "repeat", math.inf, "two identical calls gave different shapes or dtypes")
        out = poisoned(xp, ref.shape, case.dtype)
        returned = call(out=out)
        error, note = rel_error(xp, out, ref, case.dtype)
        record(pass_name, "out", error, note or ("" if returned is out else "the call did not return out"))
        base = normal(rng, ref.shape, case.dtype, scale=_power_of_two_rms(xp, ref))
        total = copy_bits(base)
        returned = call(out=total, accumulate=True)
        error, note = rel_error(xp, total, as_float64(base) + ref, case.dtype)
        record(pass_name, "accumulate", error, note or ("" if returned is total else "the call did not return out"))
    return records, {"blocks": int(op.blocks), "layout_density": float(op.density)}


# -- the sweep -------------------------------------------------------------------------------------
def _json_number(value: float):
    return value if math.isfinite(value) else str(value)


def _context_lost(xp) -> bool:
    """After an exception on the GPU: whether the CUDA context is broken (e.g. by a bad address)."""
    if xp is np:
        return False
    try:
        xp.cuda.runtime.deviceSynchronize()
        xp.cuda.Stream.null.synchronize()
    except Exception:
        return True
    return False


def run_sweep(cases: list[Case], xp, budget: float, out=print) -> dict:
    """Run ``cases`` until ``budget`` seconds have passed; print failures as they happen."""
    start = time.perf_counter()
    results, failures, stopped = [], 0, ""
    for number, case in enumerate(cases):
        if time.perf_counter() - start > budget:
            stopped = f"budget of {budget:g} s spent: {len(cases) - number} of {len(cases)} cases not run"
            break
        began = time.perf_counter()
        try:
            records, facts = run_case(case, xp)
        except Exception as error:  # an exception is a failure of the case, not of the sweep
            records, facts = [{"pass": "-", "way": "exception", "error": math.inf, "tolerance": TOLERANCE[case.kind],
                               "ok": False, "note": f"{type(error).__name__}: {error}"[:500]}], {}
        seconds = time.perf_counter() - began
        for check in records:
            if not check["ok"]:
                failures += 1
                out(f"FAIL {case.describe()} {check['pass']} {check['way']}: rel err {check['error']:.2e} "
                    f"(tol {check['tolerance']:.0e}){' ' + check['note'] if check['note'] else ''}", flush=True)
        results.append({**dataclasses.asdict(case), **facts, "seconds": seconds, "checks": records})
        if xp is not np:
            xp.get_default_memory_pool().free_all_blocks()
        if any(check["way"] == "exception" for check in records) and _context_lost(xp):
            stopped = f"the CUDA context is lost after case {case.index}: {len(cases) - number - 1} cases not run"
            break
        if (number + 1) % 40 == 0:
            out(f"... {number + 1} cases, {failures} failures, {time.perf_counter() - start:.0f} s", flush=True)
    return {"results": results, "failures": failures, "seconds": time.perf_counter() - start, "stopped": stopped}


def summary_lines(sweep: dict, requested: int) -> list[str]:
    results = sweep["results"]
    checks = [(case, check) for case in results for check in case["checks"]]
    lines = [f"ran {len(results)} of {requested} cases, {len(checks)} checks, {sweep['failures']} failures "
             f"in {sweep['seconds']:.0f} s"]
    if sweep["stopped"]:
        lines.append(f"stopped: {sweep['stopped']}")
    for label, key, order in (("block size", lambda case, check: case["block_size"], BLOCK_SIZES),
                              ("dtype", lambda case, check: case["kind"], KINDS),
                              ("pass", lambda case, check: check["pass"], PASSES + ("-",)),
                              ("way", lambda case, check: check["way"], WAYS + ("exception",))):
        run, failed = Counter(), Counter()
        for case, check in checks:
            run[key(case, check)] += 1
            failed[key(case, check)] += not check["ok"]
        lines.append(f"  by {label:10s} " + "  ".join(f"{value}: {failed[value]}/{run[value]} failed"
                                                      for value in order if run[value]))
    worst = defaultdict(float)
    for case, check in checks:
        if check["way"] in ("alloc", "out", "accumulate"):
            worst[(case["kind"], check["pass"])] = max(worst[(case["kind"], check["pass"])], check["error"])
    for kind in KINDS:
        row = [f"{p} {worst[(kind, p)]:.1e}" for p in PASSES if (kind, p) in worst]
        if row:
            lines.append(f"  worst {kind:9s} (tol {TOLERANCE[kind]:.0e}): " + ", ".join(row))
    if results:
        slowest = max(results, key=lambda case: case["seconds"])
        lines.append(f"  slowest case {slowest['index']}: {slowest['seconds']:.2f} s; "
                     f"median {float(np.median([case['seconds'] for case in results])):.3f} s")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, help="repeat the cases of this seed (default: a fresh one)")
    parser.add_argument("--cases", type=int, default=240, help="cases to draw (default 240)")
    parser.add_argument("--case", type=int, help="run only case I of the seed")
    parser.add_argument("--budget", type=float, default=300.0,
                        help="seconds after which no new case starts (default 300)")
    parser.add_argument("--json", help="write every case and check to this file")
    parser.add_argument("--dry-run", action="store_true", help="draw and print the cases; run nothing")
    parser.add_argument("--cpu", action="store_true", help="run on the NumPy CPU backend (slow; tests the sweep)")
    args = parser.parse_args(argv)
    if args.seed is not None and not 0 <= args.seed < 2**64:
        parser.error(f"--seed must be in [0, 2**64); got {args.seed}")
    if args.cases < 1 or (args.case is not None and args.case < 0):
        parser.error("--cases must be >= 1 and --case >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    seed = fresh_seed() if args.seed is None else args.seed
    print(f"seed {seed}", flush=True)
    cases = [draw_case(seed, args.case)] if args.case is not None else draw_cases(seed, args.cases)
    if args.dry_run:
        for case in cases:
            print(case.describe())
        flop = sum(2 * case.N * case.C * case.K for case in cases)
        print(f"{len(cases)} cases; float64 reference GEMMs {3 * flop / 1e12:.1f} Tflop in all")
        return 0
    if args.cpu:
        xp = np
    else:
        import cupy as xp
    sweep = run_sweep(cases, xp, args.budget)
    for line in summary_lines(sweep, len(cases)):
        print(line)
    print(f"repeat a failing case with: python tools/gpu/gpu_sweep.py --seed {seed} --case I")
    if args.json:
        for case in sweep["results"]:
            for check in case["checks"]:
                check["error"] = _json_number(check["error"])
        with open(args.json, "w") as file:
            json.dump({"seed": seed, "requested": len(cases), "failures": sweep["failures"],
                       "seconds": sweep["seconds"], "stopped": sweep["stopped"], "cases": sweep["results"]},
                      file, indent=1)
    return 1 if sweep["failures"] or (sweep["stopped"] and "lost" in sweep["stopped"]) else 0


if __name__ == "__main__":
    sys.exit(main())

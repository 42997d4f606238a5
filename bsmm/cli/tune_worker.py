"""The GPU side of ``python -m bsmm tune``: a child process that plans or times passes.

:mod:`bsmm.cli.tune` starts it (``python -m bsmm.cli.tune_worker``), writes one JSON request to its
stdin and reads one JSON line per result from its stdout:

- ``{"survey": [case, ...], "seed"}``: plans each case (a :class:`bsmm.cli.tune.Case` as a dict)
  and prints ``{"device", "arch", "max_shared", "cases": [{"entry", "variant"}, ...]}``: the
  launch-table entry each pass took its tile from (None if none) and its kernel variant.
- ``{"entry", "tiles", "cases", "calls", "batches", "seed", "check"}``: for each tile, prints
  ``{"trying": tile}``, then ``{"tile", "ratios"}`` (its time over the current tile's, case by
  case, each pair timed one after the other; with ``check``, nothing is timed and ``{"tile"}``
  says the outputs matched) or ``{"tile", "error"}``. A tile whose outputs
  differ from the current tile's beyond the dtype's tolerance, or hold NaN, is an error. After a
  CUDA error the process exits with status 3, as the GPU may be unusable; the parent goes on in
  a fresh one.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import cupy
import numpy as np

from bsmm.backends.cuda import plan_cache
from bsmm.backends.cuda.policy import Policy, current_policy, planning, recording_table_lookups
from bsmm.cli.bench import pass_calls, weight_sets
from bsmm.cli.bench_gpu import _gpu_seconds
from bsmm.dtypes import TOLERANCES, canonical_dtype
from bsmm.layouts import random_layout
from bsmm.matmul import BlocksparseMatMul
from bsmm.cli.tune import Case, Entry, used_entry

_CUDA_ERRORS = (cupy.cuda.driver.CUDADriverError, cupy.cuda.runtime.CUDARuntimeError)


class _Operands:
    """Random operands of the cases, made once: activations per (N, C, K, dtype, feature axis),
    layouts and weight sets per (C, K, block size, density, dtype), outputs per case."""

    def __init__(self, seed: int):
        self.seed = seed
        self.rng = cupy.random.default_rng(seed)
        self.made: dict = {}

    def _once(self, key, make):
        if key not in self.made:
            self.made[key] = make()
        return self.made[key]

    def op(self, case: Case) -> BlocksparseMatMul:
        """A new operator (no plans, no kept calls) over the case's layout."""

        def make_layout():
            layout = random_layout(case.C // case.block_size, case.K // case.block_size, density=case.density,
                                   seed=self.seed)
            if case.holes:
                layout[::3, :] = 0
                layout[:, ::3] = 0
            return layout

        layout = self._once(("layout", case.C, case.K, case.block_size, case.density, case.holes), make_layout)
        return BlocksparseMatMul(layout, block_size=case.block_size, feature_axis=case.feature_axis,
                                 tf32=case.dtype == "tf32")

    def run(self, case: Case, op: BlocksparseMatMul):
        """The case's pass on ``op`` as an argument-less call (rotating weight sets), and its output."""
        dtype = canonical_dtype("float32" if case.dtype == "tf32" else case.dtype, "dtype")

        def activations(features):
            shape = (case.N, features) if case.feature_axis == 1 else (features, case.N)
            return self._once(("act", shape, dtype),
                              lambda: self.rng.standard_normal(shape, dtype=np.float32).astype(dtype))

        x, dy = activations(case.C), activations(case.K)
        ws = self._once(("w", case.C, case.K, case.block_size, case.density, case.holes, dtype),
                        lambda: weight_sets(op, dtype, self.rng))
        out = self._once(("out", case), lambda: cupy.empty(
            op.w_shape if case.pass_name == "updat" else (x if case.pass_name == "bprop" else dy).shape, dtype=dtype))
        return pass_calls(op, x, dy, ws, {case.pass_name: out})[case.pass_name], out


def _survey(request: dict) -> dict:
    operands = _Operands(request["seed"])
    device = cupy.cuda.Device()
    found = []
    for fields in request["survey"]:
        case = Case(**fields)
        op = operands.op(case)
        plan_cache.forget_plans()
        with recording_table_lookups() as lookups:
            operands.run(case, op)[0]()
        # The operator keeps the call it just made (BlocksparseMatMul.kept_calls), and the call its plan.
        variant = next(iter(op.kept_calls.values())).plan.variant
        entry = used_entry(lookups, variant)
        found.append({"entry": entry and dataclasses.asdict(entry), "variant": dataclasses.asdict(variant)})
    cupy.cuda.runtime.deviceSynchronize()
    return {"device": cupy.cuda.runtime.getDeviceProperties(device.id)["name"].decode(),
            "arch": f"sm{device.compute_capability}",
            "max_shared": cupy.cuda.runtime.deviceGetAttribute(
                cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device.id), "cases": found}


def _measure(request: dict) -> None:
    operands = _Operands(request["seed"])
    cases = [Case(**fields) for fields in request["cases"]]
    # Set where the tuned file will put it: the device's own section, read before "default".
    entry = Entry(**request["entry"]).on(f"sm{cupy.cuda.Device().compute_capability}")
    calls, batches = request["calls"], request["batches"]

    def outputs_and_times(policy: Policy) -> tuple[list, list]:
        with planning(policy):
            found, times = [], []
            for case in cases:
                run, out = operands.run(case, operands.op(case))
                out.fill(np.nan)
                run()
                found.append(out.astype(np.float64))
                if not request["check"]:
                    times.append(_gpu_seconds(run, calls, batches))
        plan_cache.forget_plans()  # nothing planned with a candidate outlives it
        return found, times

    for tile in request["tiles"]:
        print(json.dumps({"trying": tile}), flush=True)
        try:
            current = current_policy()
            reference, base = outputs_and_times(current)
            found, times = outputs_and_times(entry.policy(current, tuple(tile)))
            for case, expected, got in zip(cases, reference, found):
                error = float(cupy.linalg.norm(got - expected) / max(float(cupy.linalg.norm(expected)), 1e-30))
                # At most the kind's tolerance against float64 (Case.dtype: float32, tf32, float16,
                # bfloat16) from the current tile's output. NaN fails too.
                if not error <= TOLERANCES[case.dtype]:
                    raise ValueError(f"{case}: relative difference {error:.1e} from the current tile's output")
            result = {"tile": tile}
            if not request["check"]:
                result["ratios"] = [t / b for t, b in zip(times, base)]
        except _CUDA_ERRORS as error:
            print(json.dumps({"tile": tile, "error": f"CUDA error: {error}"}), flush=True)
            sys.exit(3)
        except Exception as error:  # noqa: BLE001 - a compile error, a rejected tile: report it, go on
            result = {"tile": tile, "error": f"{type(error).__name__}: {error}"}
        print(json.dumps(result), flush=True)


def main() -> int:
    request = json.load(sys.stdin)
    if "survey" in request:
        print(json.dumps(_survey(request)), flush=True)
    else:
        _measure(request)
    return 0


if __name__ == "__main__":
    sys.exit(main())

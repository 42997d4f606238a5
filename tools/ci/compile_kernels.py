"""Compile every kernel variant of the launch table for sm_80 and sm_90a, as the library does
at run time (same NVRTC options), and print the register/spill report. Needs no GPU.

    python tools/ci/compile_kernels.py [--arch sm_80 --arch sm_90a] [--jobs 2] [--out report.txt]
"""

from __future__ import annotations

import argparse
import json
import concurrent.futures
import re
import sys
import time

from bsmm.config import settings
from bsmm.dtypes import SUPPORTED_DTYPES
from bsmm.backends.cuda.kernels import (ARCH_ONLY_MODES, GATHER_UNITS, BlockTransposeVariant, GatherVariant, TransposeVariant, Variant,
                          _cached_cubin, compile_variant, tiling_problem)
from bsmm.backends.cuda.policy import current_policy
from bsmm.backends.cuda.selection import math_mode
from bsmm.passes import PASS_NAMES, PASSES


def all_variants() -> list[Variant | GatherVariant | TransposeVariant | BlockTransposeVariant]:
    """Every kernel the launch tables of the current policy can select, on any device."""
    policy = current_policy()
    variants = {GatherVariant(unit) for unit in GATHER_UNITS}  # the convolution's row gathers
    variants.add(TransposeVariant(2))  # updat's transposed operands (half precision at blocks 16, 32)
    variants.add(TransposeVariant(4))  # (TF32 on Hopper)
    block_sizes = settings()["limits"]["block_sizes"]
    # Every GPU dtype with tf32 off and on: math_mode maps both to what that dtype runs (tf32 only
    # changes float32's), and the set keeps each variant once.
    for dtype in SUPPORTED_DTYPES:
        for tf32 in (False, True):
            for pass_name in PASS_NAMES:
                updat = PASSES[pass_name].updates_weights
                for bs in block_sizes:
                    mode = math_mode(dtype, pass_name, bs, tf32)
                    for n in (16, 32, 64, 4096):
                        tile = policy.tile(mode, pass_name, bs, n)
                        columns = policy.group_tile(mode, pass_name, bs, n)
                        wgmma = policy.tile("wgmma16", pass_name, bs, n, "sm90", optional=True)
                        if mode == "tensor16" and wgmma and n > 64:
                            variants.add(Variant(dtype, bs, wgmma, "wgmma16", pass_name, 1, True))
                            tma = policy.tile("tma16", pass_name, bs, n, "sm90", optional=True)
                            if tma:  # bsmm_matmul_tma (selection.tma_tile)
                                variants.add(Variant(dtype, bs, tma, "wgmma16", pass_name, 1, True, tma=True))
                        group_tma = policy.group_tile("tma16", pass_name, bs, n, "sm90")
                        if mode == "tensor16" and group_tma and not updat:
                            # wgmma column groups (selection.group_tma_tile)
                            variants.add(Variant(dtype, bs, group_tma.tile, "wgmma16", pass_name, 1, True, False,
                                                 group_tma.size, tma=True))
                        if mode == "tensor16" and group_tma and updat and n > 64:
                            # transposed wgmma row groups (selection.group_tma_tile)
                            for axis in (0, 1):
                                variants.add(Variant(dtype, bs, group_tma.tile, "wgmma16", pass_name, axis, True,
                                                     False, group_tma.size, tma=True))
                        tma_mma = policy.tile("tma_mma16", pass_name, bs, n, "sm90", optional=True)
                        if mode == "tensor16" and tma_mma and not updat:  # mma.sync fed by TMA
                            variants.add(Variant(dtype, bs, tma_mma, mode, pass_name, 1, True, tma=True))
                        tma_tf32 = policy.tile("tma_tf32", pass_name, bs, n, "sm90", optional=True)
                        if mode == "tf32" and tma_tf32 and pass_name == "bprop":  # TF32 wgmma (selection.select)
                            variants.add(Variant(dtype, bs, tma_tf32, "wgmma_tf32", pass_name, 1, True, tma=True))
                            variants.add(BlockTransposeVariant(bs))  # its fprop (TransposedWeightsFprop)
                        tf32_rows = policy.group_tile("tma_tf32", pass_name, bs, n, "sm90")
                        if mode == "tf32" and tf32_rows and updat and n > 64:  # on x and dy transposed
                            variants.add(Variant(dtype, bs, tf32_rows.tile, "wgmma_tf32", pass_name, 0, True, False,
                                                 tf32_rows.size, tma=True))
                        if mode == "tensor16" and not updat and n > 64 and bs in policy.act_transpose:
                            # on transposed activations, output on axis 1 (copy_plans.TransposedActivations)
                            variants.add(Variant(dtype, bs, tile, mode, pass_name, 0, True, act_transposed=True))
                            if columns:
                                variants.add(Variant(dtype, bs, columns.tile, mode, pass_name, 0, True, False,
                                                     columns.size, act_transposed=True))
                        for axis in (0, 1):
                            for aligned in (True, False):
                                variants.add(Variant(dtype, bs, tile, mode, pass_name, axis, aligned))
                            if updat:  # small batches stream blocks (aligned copies only)
                                variants.add(Variant(dtype, bs, tile, mode, pass_name, axis, True, True))
                            # Column groups (fprop/bprop) and row groups (updat): aligned only.
                            if columns:
                                variants.add(Variant(dtype, bs, columns.tile, mode, pass_name, axis, True, False,
                                                     columns.size))
    return sorted(variants, key=repr)


def _compile(args):
    variant, arch, populate_cache = args
    start = time.perf_counter()
    try:
        if populate_cache:  # the run-time path: compile into bsmm's disk cache
            path, _ = _cached_cubin(variant, arch)
            log = json.loads(path.with_suffix(".json").read_text())["log"]
        else:
            _, _, log = compile_variant(variant, arch)
    except RuntimeError as error:
        return variant, arch, None, str(error), time.perf_counter() - start
    return variant, arch, log, None, time.perf_counter() - start


# ptxas compiles a kernel whose wgmma it cannot keep in flight (a branch it cannot prove
# uniform around one, accumulators indexed at run time) and only says so in its log (C7520):
# a variant like that fails the check (results/archive/RESULTS.md, v11).
_WGMMA_SERIALIZED = "wgmma.mma_async instructions are serialized"


def _summary(log: str) -> str:
    regs = re.search(r"Used (\d+) registers", log)
    stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (f"regs {regs.group(1) if regs else '?'}, stack {stack.group(1)} B, spills {stack.group(2)}/{stack.group(3)} B"
            if stack else "no ptxas report")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", action="append", default=None)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--limit", type=int, default=0, help="compile only the first N variants (smoke)")
    parser.add_argument("--populate-cache", action="store_true", help="write the cubins to bsmm's kernel cache")
    parser.add_argument("--quiet", action="store_true", help="print failures and the summary only")
    args = parser.parse_args()
    archs = args.arch or ["sm_80", "sm_90a"]
    variants = all_variants()
    if args.limit:
        variants = variants[: args.limit]
    jobs = [(v, a, args.populate_cache) for v in variants for a in archs
            if ARCH_ONLY_MODES.get(v.math, "sm_90a" if getattr(v, "tma", False) else a) == a]
    failures, spills = 0, 0
    # The planner refuses a tile that tiling_problem rejects: every tile the tables hold must pass
    # it, and NVRTC's static_asserts below check the same rules from the kernel's side.
    for variant in variants:
        problem = isinstance(variant, Variant) and tiling_problem(variant)
        if problem:
            failures += 1
            print(f"FAIL {variant.name_expression}: {problem}", flush=True)
    start = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        for variant, arch, log, error, seconds in pool.map(_compile, jobs, chunksize=4):
            if error:
                failures += 1
                print(f"FAIL {arch} {variant.name_expression}\n{error}", flush=True)
                continue
            if _WGMMA_SERIALIZED in log:
                failures += 1
                print(f"FAIL {arch} {variant.name_expression}: ptxas serialized its wgmma (C7520)", flush=True)
                continue
            line = _summary(log)
            spilled = "spill stores" in log and not re.search(r" 0 bytes spill stores", log)
            spills += spilled
            if not args.quiet or spilled:
                print(f"{arch:7s} {variant.name_expression:151s} {line} ({seconds:.1f}s)", flush=True)
    print(f"compiled {len(jobs) - failures}/{len(jobs)} variant x arch in {time.perf_counter() - start:.0f}s; "
          f"{failures} failed; {spills} with spills")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

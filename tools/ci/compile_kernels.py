"""Compile every kernel variant of the launch tables for sm_80 and sm_90a, as the library does at
run time (same NVRTC options, through ``compile_variant``), and check each: no NVRTC error, no
serialized wgmma, no register spills unnoticed. Needs no GPU.

    python tools/ci/compile_kernels.py [--arch sm_80 --arch sm_90a] [--jobs 2] [--sample N]
                                       [--report build/compile_report.txt] [--quiet]

Prints a summary (compiles per architecture and kernel kind, failures and spills in full, the
slowest variants, the total time), its last line the totals; the per-variant listing (registers,
stack, spills, seconds) goes to the ``--report`` file. ``--sample N`` compiles a representative
subset instead of all (:func:`representative_sample` says how it is picked).
"""

from __future__ import annotations

import argparse
import dataclasses
import collections
import contextlib
import concurrent.futures
import itertools
import json
import re
import sys
import time
import zlib
from pathlib import Path

from bsmm.config import settings
from bsmm.dtypes import SUPPORTED_DTYPES
from bsmm.epilogues import EPILOGUES
from bsmm.backends.cuda.kernels import (ARCH_ONLY_MODES, C_TYPES, GATHER_UNITS, BlockTransposeVariant, GatherVariant,
                                        GatedUnitVariant, LstmCellVariant, TransposeVariant, Variant,
                          _cached_cubin, compile_variant, tiling_problem)
from bsmm.backends.cuda.policy import current_policy
from bsmm.backends.cuda.selection import math_mode
from bsmm.passes import PASS_NAMES, PASSES

DEFAULT_REPORT = Path(__file__).resolve().parents[2] / "build" / "compile_report.txt"
#: Slowest compiles named in the summary.
SLOWEST = 5


def all_variants() -> list[Variant | GatherVariant | TransposeVariant | BlockTransposeVariant]:
    """Every kernel the launch tables of the current policy can select, on any device."""
    policy = current_policy()
    variants = {GatherVariant(unit) for unit in GATHER_UNITS}  # the convolution's row gathers
    variants.add(TransposeVariant(2))  # updat's transposed operands (half precision at blocks 16, 32)
    variants.add(TransposeVariant(4))  # (TF32 on Hopper)
    variants.update(LstmCellVariant(dtype, direction) for dtype in C_TYPES  # the LSTM's fused cell
                    for direction in LstmCellVariant.ARGS)
    variants.update(GatedUnitVariant(dtype, activation, direction) for dtype in C_TYPES  # GLU MLPs' gated unit
                    for activation in GatedUnitVariant.NAMES for direction in GatedUnitVariant.ARGS)
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
    variants |= epilogue_variants(variants)
    return sorted(variants, key=repr)


def epilogue_variants(variants) -> set:
    """The fused epilogues (bsmm.epilogues) on one variant of each kernel kind that runs them: an
    fprop, or the TF32 wgmma bprop that TF32 fprops run as on Hopper (TransposedWeightsFprop), of
    each math mode, kernel, groups, feature axis, alignment and dtype. The epilogue changes only
    how output tiles leave a kernel, not its tiling; every variant at its own tile is compiled
    at run time on first use like any other. (Every kernel with every epilogue would be five
    times the fprops again: CI's budget.)"""
    kinds = {}
    for v in sorted((v for v in variants if isinstance(v, Variant)), key=repr):
        if v.pass_name == "fprop" or (v.pass_name == "bprop" and v.math == "wgmma_tf32"):
            kinds.setdefault((v.math, v.pass_name, v.tma, v.cols > 1, v.act_transposed, v.feature_axis, v.aligned,
                              v.dtype), v)
    return {dataclasses.replace(v, epilogue=name) for v in kinds.values() for name in EPILOGUES if name != "store"}


AnyVariant = Variant | GatherVariant | TransposeVariant | BlockTransposeVariant | LstmCellVariant | GatedUnitVariant

#: What tells two kernels apart for the sample (:func:`describe`).
FIELDS = ("kind", "pass", "block_size", "dtype", "tma", "streamed", "groups", "act_transposed", "feature_axis",
          "aligned")
#: The fields every combination of which a large enough sample holds.
COMBINATION = ("kind", "pass", "block_size", "dtype", "tma", "streamed", "groups", "act_transposed")


def describe(variant: AnyVariant) -> dict:
    """The fields of :data:`FIELDS`: the kernel kind (math mode, or the copy kernel's class), pass,
    block size, dtype and flags. A copy kernel carries its one parameter as the block size
    (``BlockTransposeVariant``) or as the dtype (bytes an access), and None elsewhere."""
    if isinstance(variant, Variant):
        return {"kind": variant.math, "pass": variant.pass_name, "block_size": variant.block_size,
                "dtype": variant.dtype, "tma": variant.tma, "streamed": variant.grouped, "groups": variant.cols > 1,
                "act_transposed": variant.act_transposed, "feature_axis": variant.feature_axis,
                "aligned": variant.aligned}
    fields = dict.fromkeys(FIELDS)
    fields["kind"] = type(variant).__name__
    fields["block_size"] = getattr(variant, "block_size", None)
    fields["dtype"] = getattr(variant, "unit_bytes", getattr(variant, "element_bytes", getattr(variant, "dtype", None)))
    return fields


def representative_sample(variants: list[AnyVariant], size: int) -> list[AnyVariant]:
    """``size`` of ``variants``, picked greedily. While some combination of the :data:`COMBINATION`
    fields is missing from the sample, each pick brings a missing one, and among those the variant
    that brings the most value pairs of two :data:`FIELDS` not yet in it (pairwise coverage: each
    kernel kind meets each pass, block size, dtype, flag, feature axis and alignment it is built
    with, and so on for every two fields); ties go to the smallest CRC-32 of the variant's repr, so
    the sample is the same on every run and machine. In today's launch tables 34 picks hold every
    pair and 151 every combination; further picks follow the CRC order. Returned in the order of
    ``variants``.
    """
    if size >= len(variants):
        return list(variants)
    order = sorted(variants, key=lambda v: zlib.crc32(repr(v).encode()))
    features = {}
    for variant in order:
        fields = describe(variant)
        pairs = frozenset((a, fields[a], b, fields[b]) for a, b in itertools.combinations(FIELDS, 2))
        features[variant] = (pairs, tuple(fields[name] for name in COMBINATION))
    pairs_in, combinations_in, chosen = set(), set(), set()
    for _ in range(size):
        pick = max((v for v in order if v not in chosen),
                   key=lambda v: (features[v][1] not in combinations_in, len(features[v][0] - pairs_in)))
        chosen.add(pick)
        pairs_in |= features[pick][0]
        combinations_in.add(features[pick][1])
    return [v for v in variants if v in chosen]


def arch_jobs(variants: list[AnyVariant], archs: list[str]) -> list[tuple[AnyVariant, str]]:
    """(variant, arch) for every architecture a variant is built for: wgmma and TMA kernels exist
    for sm_90a only."""
    return [(v, a) for v in variants for a in archs
            if ARCH_ONLY_MODES.get(v.math, "sm_90a" if getattr(v, "tma", False) else a) == a]


def _compile(args):
    variant, arch, populate_cache = args
    start = time.perf_counter()
    try:
        if populate_cache:  # the run-time path: compile into bsmm's disk cache
            path, _ = _cached_cubin(variant, arch)
            log = json.loads(path.with_suffix(".json").read_text())["log"]
        else:
            _, _, log = compile_variant(variant, arch)
    except Exception as error:  # any failure fails the check, named with its variant (not a bare traceback)
        return variant, arch, None, f"{type(error).__name__}: {error}", time.perf_counter() - start
    return variant, arch, log, None, time.perf_counter() - start


# ptxas compiles a kernel whose wgmma it cannot keep in flight (a branch it cannot prove
# uniform around one, accumulators indexed at run time) and only says so in its log (C7520):
# a variant like that fails the check (results/archive/RESULTS.md, v11).
_WGMMA_SERIALIZED = "wgmma.mma_async instructions are serialized"


def ptxas_report(log: str) -> tuple[str, bool]:
    """(registers, stack and spills as one line, whether it spilled) from ptxas's -v log.

    >>> ptxas_report("ptxas info : Used 96 registers, used 1 barriers, 16 bytes stack frame, "
    ...              "8 bytes spill stores, 8 bytes spill loads")
    ('regs 96, stack 16 B, spills 8/8 B', True)
    """
    regs = re.search(r"Used (\d+) registers", log)
    stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not stack:
        return "no ptxas report", False
    line = f"regs {regs.group(1) if regs else '?'}, stack {stack.group(1)} B, spills {stack.group(2)}/{stack.group(3)} B"
    return line, stack.group(2) != "0" or stack.group(3) != "0"


def nvrtc_version() -> str:
    """The NVRTC version the compiles go through ("12.9"): CuPy's, the one bsmm uses at run time."""
    from cupy_backends.cuda.libs import nvrtc

    return ".".join(map(str, nvrtc.getVersion()))


def _kind(variant: AnyVariant) -> str:
    return describe(variant)["kind"]


def summary(rows: list[tuple], wall_seconds: float, slowest: int = SLOWEST) -> list[str]:
    """The summary's lines: compiles per architecture and per kernel kind, the slowest variants.
    ``rows`` are (arch, status, seconds, ptxas line, variant), status "ok", "SPILL" or "FAIL"."""
    lines = []
    for arch in sorted({row[0] for row in rows}):
        mine = [row for row in rows if row[0] == arch]
        status = collections.Counter(row[1] for row in mine)
        lines.append(f"{arch:7s} {status['ok'] + status['SPILL']} compiled, {status['FAIL']} failed, "
                     f"{status['SPILL']} with spills; {sum(row[2] for row in mine):.0f} s of compile time")
    kinds = collections.Counter(_kind(row[4]) for row in rows)
    lines.append("by kind: " + ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items())))
    lines.append(f"slowest {min(slowest, len(rows))} of {len(rows)} (wall time {wall_seconds:.0f} s):")
    for arch, _, seconds, _, variant in sorted(rows, key=lambda row: -row[2])[:slowest]:
        lines.append(f"  {seconds:5.1f} s  {arch:7s} {variant.name_expression}")
    return lines


def _count(minimum: int):
    """An argparse type: a whole number of at least ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number; got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {minimum} or more; got {value}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", action="append", default=None,
                        help="an architecture to compile for, repeatable (default: sm_80 and sm_90a)")
    parser.add_argument("--jobs", type=_count(1), default=2, help="compiles at once (default 2; 1: in this process)")
    parser.add_argument("--sample", type=_count(0), default=0, metavar="N",
                        help="compile N representative variants instead of all: every kernel kind, pass, block "
                             "size, dtype and flag, pairwise, then each combination (see representative_sample)")
    parser.add_argument("--populate-cache", action="store_true", help="write the cubins to bsmm's kernel cache")
    parser.add_argument("--report", type=Path, default=DEFAULT_REPORT,
                        help=f"the per-variant listing (default: {DEFAULT_REPORT})")
    parser.add_argument("--quiet", action="store_true", help="print failures, spills and the totals line only")
    args = parser.parse_args(argv)
    archs = args.arch or ["sm_80", "sm_90a"]
    variants = all_variants()
    if args.sample:
        variants = representative_sample(variants, args.sample)
    jobs = arch_jobs(variants, archs)
    what = (f"{len(jobs)} variant x arch ({len(variants)} variants{' sampled' if args.sample else ''}, "
            f"{', '.join(archs)}) with NVRTC {nvrtc_version()}")
    listing = [f"# {what}; columns: arch, status, seconds, ptxas -v (registers, stack, spills), template instance"]
    rows, failures = [], 0
    # The planner refuses a tile that tiling_problem rejects: every tile the tables hold must pass
    # it, and NVRTC's static_asserts below check the same rules from the kernel's side.
    for variant in variants:
        problem = isinstance(variant, Variant) and tiling_problem(variant)
        if problem:
            failures += 1
            print(f"FAIL {variant.name_expression}: {problem}", flush=True)
            listing.append(f"{'-':7s} FAIL   {0:6.2f} s  {problem}  {variant.name_expression}")
    if not args.quiet:
        print(f"compiling {what}, {args.jobs} at once; the listing goes to {args.report}", flush=True)
    start = time.perf_counter()
    work = [(variant, arch, args.populate_cache) for variant, arch in jobs]
    with contextlib.ExitStack() as stack:
        if args.jobs > 1:
            pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(args.jobs))
            results = pool.map(_compile, work, chunksize=4)
        else:
            results = map(_compile, work)
        for variant, arch, log, error, seconds in results:
            if error or _WGMMA_SERIALIZED in log:
                failures += 1
                reason = error or "ptxas serialized its wgmma (C7520)"
                print(f"FAIL {arch} {variant.name_expression}\n{reason}", flush=True)
                rows.append((arch, "FAIL", seconds, reason.splitlines()[0], variant))
                continue
            line, spilled = ptxas_report(log)
            if spilled:
                print(f"SPILL {arch} {variant.name_expression}: {line}", flush=True)
            rows.append((arch, "SPILL" if spilled else "ok", seconds, line, variant))
    wall = time.perf_counter() - start
    listing += [f"{arch:7s} {status:6s} {seconds:6.2f} s  {line:38s} {variant.name_expression}"
                for arch, status, seconds, line, variant in rows]
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text("\n".join(listing) + "\n")
    if not args.quiet:
        print("\n".join(summary(rows, wall)))
    compiled = sum(row[1] != "FAIL" for row in rows)
    spills = sum(row[1] == "SPILL" for row in rows)
    print(f"compiled {compiled}/{len(jobs)} variant x arch in {wall:.0f}s; {failures} failed; {spills} with spills; "
          f"listing in {args.report}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

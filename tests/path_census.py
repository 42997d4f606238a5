"""The path census: every kernel path the planner can choose, and a shape that chooses it.

The planner (:mod:`bsmm.backends.cuda.planner`) picks a pass's path from its shape: the launch-table entry
(by batch class), column or row groups, streamed blocks, parts, TMA, wgmma, transposed copies,
bands. :func:`census` walks a grid of shapes (every dtype, TF32, block size, feature axis and
alignment; batches on both sides of every threshold; narrow, wide, dense, skewed, rectangular
and empty layouts) on a model H100, with Hopper's kernels on and off (``BSMM_WGMMA=0 BSMM_TMA=0``:
the kernels sm_80 runs, though on an sm_80 device launches are not serialized and TF32 passes
take no transposed copies, paths the census does not hold), and keeps for each distinct :class:`bsmm.backends.cuda.planner.Path`
the cheapest shape that takes it. ``tests/test_census.py`` checks on the CPU that the walk
reaches every line of the selection code and every launch-table entry, and on a GPU runs each
kept shape through the three passes against float64, asserting the path it took.

    python tests/path_census.py [--markdown]     # the census table
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys

import numpy as np

import bsmm
from bsmm.backends.cuda import planner
from bsmm.backends.cuda.policy import Policy
from bsmm.dtypes import ELEMENT_TYPES, GPU_KINDS
from reference import kind_dtype

KINDS = GPU_KINDS  # float32, tf32, float16, bfloat16
BLOCK_SIZES = (8, 16, 32, 64, 128)
PASSES = ("fprop", "bprop", "updat")
#: Batches on both sides of the batch classes (16, 32, 64), of one updat step (BK 16 to 64), of
#: the thresholds at 1024 rows (transposed copies, wgmma column groups), and N = 1.
BATCHES = (1, 8, 16, 17, 32, 33, 64, 65, 256, 1024, 2048)
#: Hopper's kernels on (sm_90a) and off (BSMM_WGMMA=0 BSMM_TMA=0: the kernels of sm_80).
MODES = ("hopper", "no-hopper")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One census case: a layout (by name, see :func:`layout`), its block size, a batch and how
    the operands are given."""

    kind: str  # float32, tf32, float16, bfloat16
    block_size: int
    layout_name: str
    n: int
    feature_axis: int
    aligned: bool
    mode: str  # hopper / no-hopper

    @property
    def dtype(self) -> str:
        return kind_dtype(self.kind)

    @property
    def tf32(self) -> bool:
        return self.kind == "tf32"

    def index(self):
        return bsmm.block_index(layout(self.layout_name, self.block_size), self.block_size)

    @property
    def cost(self) -> int:
        """Work of the case on a GPU (its float64 reference included): the dense product's size."""
        index = self.index()
        return index.C * index.K * (self.n + 8)

    def describe(self) -> str:
        index = self.index()
        return (f"{self.kind} bs{self.block_size} {self.layout_name} {index.C}x{index.K} nnzb={index.nnzb} "
                f"N={self.n} axis{self.feature_axis} {'aligned' if self.aligned else 'unaligned'} {self.mode}")


#: Layouts by name: (block rows, block columns, density, kind) at block sizes up to 32, and for
#: 64 and 128 (fewer, larger blocks: the same features).
_LAYOUTS = {
    "small": ((6, 5, 0.5, "random"), (6, 5, 0.5, "random")),
    "empty": ((4, 4, 0.0, "random"), (4, 4, 0.0, "random")),
    "sparse": ((96, 96, 0.0, "one a row"), (64, 64, 0.0, "one a row")),  # no row or column groups
    "wide": ((160, 160, 0.1, "random"), (128, 128, 0.1, "random")),
    "dense": ((48, 48, 0.6, "random"), (16, 16, 0.6, "random")),
    "skewed": ((72, 40, 0.05, "skewed"), (40, 24, 0.05, "skewed")),
    "rectangular": ((32, 128, 0.25, "random"), (32, 128, 0.25, "random")),
    "big": ((128, 128, 0.3, "random"), (64, 64, 0.3, "random")),
}


@functools.lru_cache(maxsize=None)
def layout(name: str, block_size: int) -> np.ndarray:
    """The census layout ``name`` at ``block_size`` (seeded: the same on every machine)."""
    rows, cols, density, kind = _LAYOUTS[name][block_size >= 64]
    rng = np.random.default_rng([rows, cols, block_size, len(name)])
    found = (rng.random((rows, cols)) < density).astype(np.uint8)
    if kind == "one a row":  # one block in each block row, in a random column
        found[np.arange(rows), rng.integers(0, cols, rows)] = 1
    if kind == "skewed":  # one dense block column (cut into parts), one dense row, an empty row and column
        found[:, cols // 2] = 1
        found[rows // 3, :] = 1
        found[:, 0] = 0
        found[0, :] = 0
    return found


@functools.cache
def policy(mode: str) -> Policy:
    """The policy of ``mode``: bsmm.toml's, with Hopper's wgmma and TMA kernels on or off."""
    on = mode == "hopper"
    return Policy.from_settings(environ={}).replace(wgmma=on, tma=on, programmatic=True)


def path(shape: Shape, pass_name: str, occupancy=planner.estimated_occupancy) -> planner.Path:
    """The path of ``pass_name`` on ``shape`` on a model H100 (``occupancy``: thread blocks of a variant an SM holds)."""
    return planner.path(shape.index(), pass_name, shape.n, shape.dtype, shape.feature_axis, shape.tf32,
                        shape.aligned, planner.Device("sm90", 132, occupancy), policy(shape.mode))


def grid():
    """Every shape the census considers."""
    for kind, bs, name, n, axis, aligned, mode in itertools.product(KINDS, BLOCK_SIZES, _LAYOUTS, BATCHES, (1, 0),
                                                                    (True, False), MODES):
        if aligned and axis == 0 and (n * ELEMENT_TYPES[kind_dtype(kind)].element_bytes) % 16:
            continue  # rows of N elements that are not whole 16-byte chunks make a pass unaligned
        if name in ("big", "wide") and n > 1024 and bs <= 16:
            continue  # (the same decisions as at 1024, at a quarter of the cost)
        yield Shape(kind, bs, name, n, axis, aligned, mode)


@dataclasses.dataclass(frozen=True)
class Entry:
    """A path of the census, and the shape that takes it (``stable``: the path does not change
    when the occupancy the planner assumes is halved or doubled, so that a GPU's own occupancy
    cannot move it)."""

    path: planner.Path
    shape: Shape
    stable: bool


def _stable(shape: Shape, pass_name: str, found: planner.Path) -> bool:
    estimate = planner.estimated_occupancy
    return all(path(shape, pass_name, lambda v, f=f: max(1, int(estimate(v) * f))) == found for f in (0.5, 2))


def census(shapes=None) -> list[Entry]:
    """Each distinct path of the grid (per dtype kind) with the cheapest shape taking it (stable
    shapes first, then shapes whose layout has blocks)."""
    best: dict = {}
    # Layouts with blocks first: an empty layout takes a path without multiplying anything.
    for shape in sorted(shapes or grid(), key=lambda s: (s.index().nnzb == 0, s.cost)):
        for pass_name in PASSES:
            if pass_name == "updat" and shape.index().nnzb == 0:
                continue  # no block to write: the backend launches nothing
            found = path(shape, pass_name)
            key = (shape.kind, found)  # (TF32 passes that run exact float32 kernels are kept too)
            kept = best.get(key)
            if kept is not None and kept.stable:
                continue
            stable = _stable(shape, pass_name, found)
            if kept is None or stable:
                best[key] = Entry(found, shape, stable)
    return sorted(best.values(), key=lambda e: (e.path.pass_name, e.shape.kind, e.shape.block_size, e.shape.cost))


def table(entries: list[Entry]) -> str:
    lines = ["| pass | path | shape |", "| --- | --- | --- |"]
    for entry in entries:
        lines.append(f"| {entry.path.pass_name} | {entry.path.describe()} | {entry.shape.describe()}"
                     f"{'' if entry.stable else ' (occupancy-sensitive)'} |")
    return "\n".join(lines)


def summary(entries: list[Entry]) -> str:
    """Paths per pass and dtype kind, one line each."""
    counts: dict = {}
    for entry in entries:
        key = (entry.path.pass_name, entry.shape.kind)
        counts[key] = counts.get(key, 0) + 1
    return "\n".join(f"{p:6s} " + " ".join(f"{k}={counts.get((p, k), 0)}" for k in KINDS) for p in PASSES)


if __name__ == "__main__":
    found = census()
    print(table(found) if "--markdown" in sys.argv else summary(found))
    print(f"{len(found)} paths, {len({e.shape for e in found})} shapes")

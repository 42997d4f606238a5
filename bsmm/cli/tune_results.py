"""The records of a ``python -m bsmm tune`` run: the cases measured, the launch-table entries
they use, the tiles tried on an entry and what tuning an entry found.

:mod:`bsmm.cli.tune` makes them (and exports them: ``from bsmm.cli.tune import EntryResult``);
:mod:`bsmm.cli.tuned_file` writes the kept tiles of :class:`EntryResult` s to the tuned file.
They live here, below both, so that neither imports the other to name them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bsmm.backends.cuda.kernels import Variant
    from bsmm.backends.cuda.policy import Policy

__all__ = ["Case", "Entry", "EntryResult", "Trial"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One pass on one shape: what a tile is measured on (``dtype`` "tf32": float32 on TF32 cores)."""

    pass_name: str
    N: int
    C: int
    K: int
    block_size: int
    density: float
    dtype: str
    feature_axis: int = 1
    holes: bool = False  # every third block row and column of the layout emptied (``tune.checking_cases``)

    def __str__(self) -> str:
        return (f"{self.pass_name} {self.dtype} N={self.N} C={self.C} K={self.K} block {self.block_size} "
                f"{self.density:.0%}" + (" axis 0" if self.feature_axis == 0 else "")
                + (" with empty block rows and columns" if self.holes else ""))


@dataclasses.dataclass(frozen=True)
class Entry:
    """A launch-table entry: ``[kernels.<section>.<table>.<group>]``, key ``block_size``, batch class ``batch``."""

    section: str  # "default" or an architecture ("sm90")
    table: str  # "tensor16", "tma16", ...
    group: str  # "sparse", "updat", "columns", "updat_rows"
    block_size: str
    batch: str  # "n16", "n32", "n64", "large" or "any"

    @property
    def name(self) -> str:
        return ".".join((self.section, self.table, self.group, self.block_size, self.batch))

    def on(self, arch: str) -> "Entry":
        """The same entry in the section of ``arch``, where a tuned tile goes."""
        return dataclasses.replace(self, section=arch)

    def policy(self, base: Policy, tile: tuple) -> Policy:
        """``base`` with this entry set to ``tile`` (plans made in ``planning(...)`` of it use it)."""
        return base.with_tile(self.section, self.table, self.group, int(self.block_size), self.batch, tile)


@dataclasses.dataclass
class Trial:
    """One tile measured on an entry's cases: time ratios against the current tile, or why not."""

    tile: tuple
    ratios: list[float] | None = None
    error: str | None = None

    @property
    def score(self) -> float:
        """Geometric mean of the time ratios (below 1: faster than the current tile)."""
        if not self.ratios:
            return math.inf
        return math.exp(sum(math.log(r) for r in self.ratios) / len(self.ratios))


@dataclasses.dataclass
class EntryResult:
    """What tuning one entry found: its current tile, the kept one (None: the current one stays)."""

    entry: Entry
    variants: list[Variant]  # the kernel variant of each case (they differ in pass, dtype, ...)
    cases: list[Case]
    current: tuple
    trials: list[Trial] = dataclasses.field(default_factory=list)
    kept: tuple | None = None
    confirmed: float | None = None  # the best tile's score in its confirming run
    rejected: str | None = None  # why the best tile failed the check at other shapes

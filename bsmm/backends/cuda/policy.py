"""What the GPU planner decides with, as one frozen value: :class:`Policy`.

A policy holds the launch tables and thresholds of ``bsmm.toml``'s ``[kernels]`` section and the
environment switches (``BSMM_WGMMA``, ``BSMM_TMA``, ``BSMM_PDL``). :func:`current_policy` is the
one the library plans with: the settings and environment of this moment, or the policy of an
enclosing :func:`planning` block. A test, ``bsmm tune`` or a user forcing a kernel path states it
as a policy (``current_policy().replace(min_part_blocks=2)``, ``.with_tile(...)``) and plans
inside ``planning(policy)``; plans are cached per policy, so none leaks into another.

Examples
--------
>>> from bsmm.backends.cuda.policy import Tile, current_policy, planning
>>> forced = current_policy().replace(tma=False, min_part_blocks=2)
>>> with planning(forced):
...     current_policy().min_part_blocks, current_policy().tma
(2, False)
>>> current_policy().tile("tensor16", "fprop", 32, 4096, "sm80")
Tile(bm=128, bn=32, bk=32, warps_m=4, warps_n=1, stages=4)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import threading
from collections.abc import Iterator, Mapping

from bsmm.config import once, settings

__all__ = ["Tile", "GroupTile", "Policy", "current_policy", "planning", "recording_table_lookups"]

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Tile:
    """A kernel tile: ``bm`` x ``bn`` outputs per thread block, ``bk`` deep a pipeline stage,
    ``warps_m`` x ``warps_n`` warps, ``stages`` stages in flight (the template parameters BM, BN,
    BK, WARPS_M, WARPS_N, STAGES of ``cuda/bsmm_kernel_traits.cuh``)."""

    bm: int
    bn: int
    bk: int
    warps_m: int
    warps_n: int
    stages: int

    @classmethod
    def of(cls, values) -> "Tile":
        """A tile from a launch-table entry's six numbers, or from its fields by name (a Tile stays itself)."""
        if isinstance(values, Tile):
            return values
        if isinstance(values, Mapping):  # dataclasses.asdict of a Variant (bsmm tune's messages)
            values = [values[field.name] for field in dataclasses.fields(cls)]
        values = tuple(int(v) for v in values)
        if len(values) != 6:
            raise ValueError(f"a tile has 6 numbers (BM, BN, BK, WARPS_M, WARPS_N, STAGES), got {list(values)}")
        return cls(*values)

    def as_list(self) -> list[int]:
        """The six numbers as a launch table writes them."""
        return [self.bm, self.bn, self.bk, self.warps_m, self.warps_n, self.stages]


@dataclasses.dataclass(frozen=True)
class GroupTile:
    """A column-group (fprop/bprop) or row-group (updat) entry: the tile and ``size``, the block
    columns (rows) one output tile spans (the table's seventh number, COLS)."""

    tile: Tile
    size: int


#: The [kernels] settings a policy holds beside the launch tables: name -> how it is read.
_THRESHOLDS = {
    "waves": int, "group_min_blocks_per_step": float, "min_part_blocks": int, "min_part_blocks_simt": int,
    "min_part_blocks_few_rows": int, "few_rows": int,
    "band_rows": int, "band_block_sizes": frozenset, "band_min_weight_bytes": int, "updat_cut_gain": float,
    "updat_transpose": frozenset, "updat_transpose_max_bytes": int, "updat_transpose_min_rows": int,
    "act_transpose": frozenset, "act_transpose_min_rows": int, "act_transpose_max_bytes": int,
    "act_transpose_group_min_blocks_per_step": float, "updat_rows_tma_axes": frozenset,
    "updat_l2_window_bytes": int, "wgmma_columns_min_rows": int, "tma_mma_min_column_blocks": int,
    "tma_mma_max_column_blocks": int, "tma_mma_min_part_blocks": int, "tma_mma_max_stream_bytes": int,
    "tma_mma_stream_max_rows": int,
    "tma_min_macs": int,
}


#: The environment switches a policy reads (on unless set to 0) -> what turning one off does.
_SWITCHES = {
    "BSMM_WGMMA": "Hopper's warpgroup-MMA (wgmma) kernels are off; mma.sync kernels run instead",
    "BSMM_TMA": "Hopper's TMA kernels are off; cp.async copies fill the pipeline instead",
    "BSMM_PDL": "kernels are launched without programmatic stream serialization (sm_90 and newer)",
}


def _batch_class(n: int) -> str:
    for limit in (16, 32, 64):
        if n <= limit:
            return f"n{limit}"
    return "large"


#: While :func:`recording_table_lookups` runs: (entry, numbers) of every launch-table entry a
#: policy returned, entry = (section, table, group, block size, batch class), numbers the entry's
#: six (seven for a group entry) numbers.
_table_lookups: list | None = None


@contextlib.contextmanager
def recording_table_lookups() -> Iterator[list]:
    """Collects the launch-table entries that plans built meanwhile read (``bsmm tune`` learns
    which entry a pass runs with from it); one recorder at a time."""
    global _table_lookups
    if _table_lookups is not None:
        raise RuntimeError("launch-table lookups are already being recorded")
    _table_lookups = found = []
    try:
        yield found
    finally:
        _table_lookups = None


@dataclasses.dataclass(frozen=True, eq=False)
class Policy:
    """The launch tables, thresholds and switches one plan is made with (see the module docstring).

    ``tables``: the launch tables, ``{section: {table: {group: {block size: {batch class:
    numbers}}}}}`` with sections ``"default"`` and architectures (``"sm90"``); read-only.
    The thresholds are ``[kernels]``'s keys of the same names (``bsmm.toml`` says what each
    does). ``wgmma``, ``tma``: Hopper's warpgroup-MMA and TMA kernels allowed; ``programmatic``:
    launches on sm_90 and newer use programmatic stream serialization. Policies compare by
    identity: each is its own plan cache key.
    """

    tables: Mapping
    waves: int
    group_min_blocks_per_step: float
    min_part_blocks: int
    min_part_blocks_simt: int
    min_part_blocks_few_rows: int
    few_rows: int
    band_rows: int
    band_block_sizes: frozenset
    band_min_weight_bytes: int
    updat_cut_gain: float
    updat_transpose: frozenset
    updat_transpose_max_bytes: int
    updat_transpose_min_rows: int
    act_transpose: frozenset
    act_transpose_min_rows: int
    act_transpose_max_bytes: int
    act_transpose_group_min_blocks_per_step: float
    updat_rows_tma_axes: frozenset
    updat_l2_window_bytes: int
    #: block size -> the wgmma column groups' threshold (0 where absent)
    wgmma_group_min_blocks_per_step: Mapping
    wgmma_columns_min_rows: int
    tma_mma_min_column_blocks: int
    tma_mma_max_column_blocks: int
    tma_mma_min_part_blocks: int
    tma_mma_max_stream_bytes: int
    tma_mma_stream_max_rows: int
    tma_min_macs: int
    wgmma: bool = True
    tma: bool = True
    programmatic: bool = True

    @classmethod
    def from_settings(cls, kernels: Mapping | None = None, environ: Mapping | None = None) -> "Policy":
        """The policy of a ``[kernels]`` section (the current settings' by default) and an
        environment (``os.environ`` by default). A switch found off is logged, once a process."""
        kernels = settings()["kernels"] if kernels is None else kernels
        environ = os.environ if environ is None else environ
        tables = {name: section for name, section in kernels.items() if isinstance(section, dict)
                  and name != "wgmma_group_min_blocks_per_step"}
        switches = {name: environ.get(name, "1") != "0" for name in _SWITCHES}
        for name, on in switches.items():
            if not on and once(("switch", name)):
                _log.info("%s=0: %s", name, _SWITCHES[name])
        if not kernels["programmatic_launch"] and once(("switch", "programmatic_launch")):
            _log.info("programmatic_launch = false in the settings: %s", _SWITCHES["BSMM_PDL"])
        return cls(tables=copy.deepcopy(tables),
                   wgmma_group_min_blocks_per_step={int(k): float(v) for k, v in
                                                    kernels["wgmma_group_min_blocks_per_step"].items()},
                   wgmma=switches["BSMM_WGMMA"], tma=switches["BSMM_TMA"],
                   programmatic=bool(kernels["programmatic_launch"]) and switches["BSMM_PDL"],
                   **{name: read(kernels[name]) for name, read in _THRESHOLDS.items()})

    def replace(self, **changes) -> "Policy":
        """This policy with some fields changed, read as :meth:`from_settings` reads them (sets may
        be given as lists; ``wgmma_group_min_blocks_per_step`` keyed by block size as ints or
        strings)."""
        for name, value in changes.items():
            if name in _THRESHOLDS:
                changes[name] = _THRESHOLDS[name](value)
            elif name == "wgmma_group_min_blocks_per_step":
                changes[name] = {int(k): float(v) for k, v in value.items()}
        return dataclasses.replace(self, **changes)

    def with_tile(self, section: str, table: str, group: str, block_size: int, batch: str, numbers) -> "Policy":
        """This policy with one launch-table entry set (``numbers``: a :class:`Tile`, its six
        numbers, or seven for a group entry); e.g. ``with_tile("sm90", "tma16", "columns", 64,
        "large", [128, 128, 128, 8, 1, 3, 2])``. The block size's other batch classes stay:
        :meth:`without_table` first to have every batch take this entry (as ``"any"``)."""
        tables = copy.deepcopy(dict(self.tables))
        numbers = numbers.as_list() if isinstance(numbers, Tile) else [int(v) for v in numbers]
        entries = tables.setdefault(section, {}).setdefault(table, {}).setdefault(group, {})
        entries.setdefault(str(block_size), {})[batch] = numbers
        return dataclasses.replace(self, tables=tables)

    def without_table(self, section: str, table: str, group: str, block_size: int | None = None) -> "Policy":
        """This policy without a launch table's entries (of one block size, or all of them)."""
        tables = copy.deepcopy(dict(self.tables))
        entries = tables.get(section, {}).get(table, {}).get(group)
        if entries is not None:
            if block_size is None:
                entries.clear()
            else:
                entries.pop(str(block_size), None)
        return dataclasses.replace(self, tables=tables)

    def _entry(self, table: str, group: str, block_size: int, n: int, arch: str | None):
        batches = (_batch_class(n), "any")  # updat tables may give small-batch tiles before "any"
        for section_name in (arch, "default"):
            entries = self.tables.get(section_name or "", {}).get(table, {}).get(group, {}).get(str(block_size), {})
            batch = next((b for b in batches if b in entries), None)
            if batch is not None:
                numbers = tuple(int(v) for v in entries[batch])
                if _table_lookups is not None:
                    _table_lookups.append(((section_name, table, group, str(block_size), batch), numbers))
                return numbers
        return None

    def tile(self, table: str, pass_name: str, block_size: int, n: int, arch: str | None = None,
             optional: bool = False) -> Tile | None:
        """The tile of launch table ``table`` (a math mode: ``"tensor16"``, ``"tma16"``, ...) for
        ``pass_name`` at this block size and batch of ``n`` rows, from ``arch``'s section
        (``"sm90"``) before ``"default"``; None where there is none and ``optional``."""
        numbers = self._entry(table, "updat" if pass_name == "updat" else "sparse", block_size, n, arch)
        if numbers is None:
            if optional:
                return None
            raise NotImplementedError(f"no {table} kernel tile for {pass_name} at block size {block_size}")
        return Tile.of(numbers[:6])

    def group_tile(self, table: str, pass_name: str, block_size: int, n: int, arch: str | None = None
                   ) -> GroupTile | None:
        """The column-group (fprop/bprop: ``columns``) or row-group (updat: ``updat_rows``) entry
        of ``table``, or None where the table has none."""
        numbers = self._entry(table, "updat_rows" if pass_name == "updat" else "columns", block_size, n, arch)
        return None if numbers is None else GroupTile(Tile.of(numbers[:6]), numbers[6])

    def programmatic_on(self, arch: str) -> bool:
        """Whether launches on a device of ``arch`` (``"sm90"``) use programmatic serialization."""
        return self.programmatic and int(arch[2:]) >= 90


_chosen: Policy | None = None  # the policy of the innermost planning() block
_from_settings: tuple = (None, None, None)  # (the [kernels] dict, the switches, the policy made of them)
_lock = threading.Lock()


def current_policy() -> Policy:
    """The policy plans are made with now: that of the innermost :func:`planning` block, else
    the current settings' and environment's. It is made again when the settings are read again
    (:func:`bsmm.config.overriding`, a new ``$BSMM_CONFIG``) or a switch changes, not when the
    dict of :func:`bsmm.config.settings` is changed in place: state a policy instead."""
    chosen = _chosen
    if chosen is not None:
        return chosen
    global _from_settings
    kernels = settings()["kernels"]
    switches = (os.environ.get("BSMM_WGMMA"), os.environ.get("BSMM_TMA"), os.environ.get("BSMM_PDL"))
    made_from, made_switches, policy = _from_settings
    if made_from is not kernels or made_switches != switches:
        with _lock:
            policy = Policy.from_settings(kernels)
            _from_settings = (kernels, switches, policy)
    return policy


@contextlib.contextmanager
def planning(policy: Policy) -> Iterator[Policy]:
    """Plans made while this block runs are made with ``policy``, in every thread (PyTorch runs
    backward passes on threads of its own), as :func:`bsmm.config.overriding` does for settings.

    Operators keep the calls they made before (their plans): use new ones inside.
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a bsmm.backends.cuda.policy.Policy, got {type(policy).__name__}")
    global _chosen
    with _lock:
        outer, _chosen = _chosen, policy
    try:
        yield policy
    finally:
        with _lock:
            _chosen = outer

"""``python -m bsmm tune``: refine the launch tiles of ``bsmm.toml`` for this GPU and these shapes.

A pass runs with the tile of one launch-table entry (table, block size, batch class). For the
passes and shapes asked for, :func:`tune` finds which entries they use, tries tiles near each
entry's (more or fewer stages, rows, warps, depth), each on every case that uses the entry,
and keeps the fastest where it beats the current tile by at least ``margin`` over those cases
(geometric mean of the time ratios), again in a second, confirming measurement, and where it
computes what the current tile does at the edges of its batch class too
(:func:`checking_cases`). Kept tiles go to
:func:`bsmm.config.tuned_path` as overrides of the device's architecture section
(``[kernels.sm90...]``), which :func:`bsmm.config.settings` reads from then on
(``BSMM_TUNED=0`` ignores them; ``python -m bsmm tune --reset`` removes them).

Every measurement runs in a child process (:mod:`bsmm.cli.tune_worker`): a candidate that fails
to compile, gives results off the current tile's, or faults the GPU is reported and skipped,
and the next one runs in a fresh process. The times are :mod:`bsmm.cli.bench`'s: CUDA-event
medians of back-to-back calls on random data, each candidate beside the current tile.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import select
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Callable, Iterable

from bsmm.config import settings, tuned_path
from bsmm.backends.cuda.kernels import ELEMENT_BYTES, MAX_PART_BLOCKS, Variant

__all__ = ["Case", "Entry", "candidate_tiles", "checking_cases", "tune", "tuned_entries", "format_report"]

PASSES = ("fprop", "bprop", "updat")


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
    holes: bool = False  # every third block row and column of the layout emptied (:func:`checking_cases`)

    def __str__(self) -> str:
        return (f"{self.pass_name} {self.dtype} N={self.N} C={self.C} K={self.K} block {self.block_size} "
                f"{self.density:.0%}" + (" axis 0" if self.feature_axis == 0 else "")
                + (" with empty block rows and columns" if self.holes else ""))


#: Batch rows a kept tile is also checked at, by its entry's batch class: the class's edges and odd sizes.
CHECK_ROWS = {"n16": (1, 7, 16), "n32": (17, 31, 32), "n64": (33, 63, 64), "large": (65, 129, 1000),
              "any": (1, 7, 65, 129, 1000)}


def checking_cases(cases: list[Case], batch: str) -> list[Case]:
    """What a tile kept for an entry of batch class ``batch`` must also compute as the current
    tile does: each of ``cases`` at the rows of :data:`CHECK_ROWS` (and, for the open classes,
    at its own N and 7 rows more), on its layout and on one with empty block rows and columns.

    Examples
    --------
    >>> checked = checking_cases([Case("fprop", 4096, 512, 512, 32, 0.1, "float16")], "large")
    >>> sorted({c.N for c in checked}), sorted({c.holes for c in checked})
    ([65, 129, 1000, 4096, 4103], [False, True])
    """
    found = {}
    for case in cases:
        rows = CHECK_ROWS[batch] + ((case.N, case.N + 7) if batch in ("large", "any") else ())
        for n in rows:
            for holes in (False, True):
                found.setdefault(dataclasses.replace(case, N=n, holes=holes), None)
    return list(found)


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

    def layer(self, tile: tuple) -> dict:
        """A settings layer (:func:`bsmm.config.overriding`) that sets this entry to ``tile``."""
        return {"kernels": {self.section: {self.table: {self.group: {self.block_size: {self.batch: list(tile)}}}}}}


def used_entry(lookups: list, variant: Variant) -> Entry | None:
    """The entry a plan's ``variant`` took its tile from, given the lookups made while planning it
    (:func:`bsmm.backends.cuda.planner.recording_table_lookups`): the last whose tile is the variant's
    (tiles of ``bsmm_matmul_tma`` come from the tma tables, the others from the rest)."""
    for entry, tile in reversed(lookups):
        same = tile[:6] == tuple(variant.tile) and (len(tile) == 6 or tile[6] == variant.cols)
        if same and entry[1].startswith("tma") == variant.tma:
            return Entry(*entry)
    return None


# ---- candidate tiles ------------------------------------------------------------------------
#: Static shared memory beside the stages: the staged step table and the groups' entries (bytes).
def _static_shared(variant: Variant) -> int:
    steps = (MAX_PART_BLOCKS + 8) * (variant.cols + 1) * 4 if variant.cols > 1 else 0
    return MAX_PART_BLOCKS * 8 + steps + 256


def tile_fits(variant: Variant, max_shared: int) -> bool:
    """Whether ``variant``'s tile meets the kernel template's tiling rules (``Kernel`` in
    ``cuda/bsmm_kernel_traits.cuh``; NVRTC checks them all, this skips the hopeless compiles) and the
    device's ``max_shared`` bytes of shared memory a thread block."""
    bm, bn, bk, wm, wn, stages = variant.tile
    item = ELEMENT_BYTES[variant.dtype]
    vec = 16 // item
    wgmma = variant.math.startswith("wgmma")
    if min(variant.tile) < 1 or not 2 <= stages <= 8 or variant.threads > 1024:
        return False
    if bk % vec or bm % vec or bn % vec:
        return False
    if variant.shared_bytes + _static_shared(variant) > max_shared:
        return False
    groups, updat = variant.cols > 1, variant.pass_name == "updat"
    if wgmma and groups and updat and (bm != variant.cols * variant.block_size or bn != variant.block_size):
        return False  # transposed row groups: M holds the group's blocks
    whole_blocks = bm == variant.block_size if updat else bk == variant.block_size
    if groups and not wgmma and (wn != variant.cols or not whole_blocks):
        return False  # a warp column a block; updat row groups take whole blocks, column groups a block row a step
    if wgmma:
        column_groups = groups and not updat
        depth_ok = bk % variant.block_size == 0 if column_groups else bk * item == 128
        three_stages = stages >= 3 or variant.tma  # cp.async wgmma: one in flight, one read, one filling
        stored_fits = not variant.tma or bm * bn <= stages * (bm * bk + bk * bn)
        return bm % 64 == 0 and wn == 1 and wm * 16 == bm and depth_ok and three_stages and stored_fits
    if bm % wm or bn % wn:
        return False
    if variant.math == "simt":
        nt = wm * wn * 32
        tx0 = min(bn // 4, 16)
        tx = nt // bm if tx0 * bm < nt else tx0
        if tx == 0 or nt % tx:
            return False
        ty = nt // tx
        return bk % 4 == 0 and tx <= bn and bm % ty == 0 and bn % tx == 0
    wtm, wtn = bm // wm, bn // wn
    depth = 16 if variant.math == "tensor16" else 8
    if variant.tma:  # mma.sync on TMA's 64-byte swizzled rows
        return wtm % 16 == 0 and wtn % 8 == 0 and bk * item == 64 and bn * item == 64
    return wtm % 16 == 0 and wtn % 8 == 0 and bk % depth == 0


def candidate_tiles(variant: Variant, max_shared: int) -> list[tuple]:
    """Tiles one move away from ``variant``'s that fit (:func:`tile_fits`): a stage more or
    fewer, half or twice the rows (with the warps scaled or kept), half or twice the depth, and
    warps moved between rows and columns; never the block columns a tile spans.

    Examples
    --------
    >>> from bsmm.backends.cuda.kernels import Variant
    >>> v = Variant("float16", 64, (128, 64, 64, 8, 1, 4), "wgmma16", "fprop", 1, True, tma=True)
    >>> for tile in candidate_tiles(v, 232448):
    ...     print(tile)
    (128, 64, 64, 8, 1, 3)
    (128, 64, 64, 8, 1, 5)
    (128, 64, 64, 8, 1, 6)
    (64, 64, 64, 4, 1, 4)
    (256, 64, 64, 16, 1, 4)
    """
    bm, bn, bk, wm, wn, stages = variant.tile
    moves = [(bm, bk, wm, wn, s) for s in (stages - 1, stages + 1, stages + 2)]
    if variant.math.startswith("wgmma"):  # 64-row warpgroups: rows and warps move together
        moves += [(m, bk, m // 16, 1, stages) for m in (bm // 2, bm * 2)]
        if variant.cols > 1 and variant.pass_name != "updat":  # column groups: whole block rows a step
            moves += [(bm, k, wm, wn, stages) for k in (bk // 2, bk * 2)]
    else:
        for m in (bm // 2, bm * 2):
            moves += [(m, bk, max(1, wm * m // bm), wn, stages), (m, bk, wm, wn, stages)]
        if variant.cols == 1 and not variant.tma:
            moves += [(bm, k, wm, wn, stages) for k in (bk // 2, bk * 2)]
        moves += [(bm, bk, wm * 2, wn // 2, stages), (bm, bk, wm // 2, wn * 2, stages),
                  (bm, bk, wm * 2, wn, stages), (bm, bk, wm // 2, wn, stages)]
    found = []
    for m, k, a, b, s in moves:
        tile = (m, bn, k, a, b, s)
        fits = tile_fits(dataclasses.replace(variant, tile=tile), max_shared)
        if fits and tile != variant.tile and tile not in found:
            found.append(tile)
    return found


# ---- the search -----------------------------------------------------------------------------
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


class Runner:
    """Runs :mod:`bsmm.cli.tune_worker` in child processes: :meth:`survey` and :meth:`measure`."""

    command = (sys.executable, "-m", "bsmm.cli.tune_worker")

    def __init__(self, calls: int = 20, batches: int = 7, seed: int = 0, timeout: float = 600):
        self.calls, self.batches, self.seed = calls, batches, seed
        self.timeout = timeout  # seconds a worker may go without printing a line (a hung kernel)

    def run_request(self, request: dict, on_line: Callable[[dict], None]) -> tuple[int, str]:
        """Runs one worker on ``request``, handing each JSON line it prints to ``on_line``;
        returns its exit status and the end of what it wrote to stderr. A worker silent for
        ``timeout`` seconds is killed."""
        with tempfile.TemporaryFile("w+") as errors:
            process = subprocess.Popen(self.command, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=errors, bufsize=0)
            process.stdin.write(json.dumps(request).encode())
            process.stdin.close()
            pending, hung = b"", False
            while True:
                if not select.select([process.stdout], [], [], self.timeout)[0]:
                    process.kill()
                    hung = True
                    break
                chunk = os.read(process.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line.startswith(b"{"):  # anything else printed there is not the protocol's
                        on_line(json.loads(line))
            status = process.wait()
            process.stdout.close()
            errors.seek(0)
            said = errors.read()[-2000:]
            return status, said + (f"\nkilled: no result for {self.timeout:.0f} s" if hung else "")

    def survey(self, cases: list[Case]) -> dict:
        """{"device", "arch", "max_shared", "cases": [{"entry": Entry fields or None, "variant": Variant fields}]}."""
        found: dict = {}
        status, errors = self.run_request({"survey": [dataclasses.asdict(c) for c in cases], "seed": self.seed}, found.update)
        if status != 0 or "cases" not in found:
            raise RuntimeError(f"the tuning worker failed while planning the passes (exit {status}):\n{errors}")
        return found

    def measure(self, entry: Entry, tiles: list[tuple], cases: list[Case],
                progress: Callable[[Trial], None] | None = None, check: bool = False) -> list[Trial]:
        """Each tile of ``tiles`` set at ``entry`` and timed on ``cases`` beside the current tiles,
        in as many workers as faults take (a faulting tile is reported, the rest go on).
        ``check``: outputs compared only, not timed (a trial without ratios or error passed)."""
        trials: dict[tuple, Trial] = {}
        remaining = list(tiles)
        while remaining:
            current: list = []  # the tile being measured
            finished: list = []  # tiles this worker reported

            def on_line(line: dict) -> None:
                if "trying" in line:
                    current[:] = [tuple(line["trying"])]
                elif "tile" in line:
                    tile = tuple(line["tile"])
                    trial = trials[tile] = Trial(tile, line.get("ratios"), line.get("error"))
                    remaining.remove(trial.tile)
                    current.clear()
                    finished.append(trial.tile)
                    if progress:
                        progress(trial)

            request = {"entry": dataclasses.asdict(entry), "tiles": [list(t) for t in remaining],
                       "cases": [dataclasses.asdict(c) for c in cases], "calls": self.calls,
                       "batches": self.batches, "seed": self.seed, "check": check}
            status, errors = self.run_request(request, on_line)
            if not remaining:
                break
            if not current:
                if status != 0 and finished:
                    continue  # it stopped after a fault it reported: the rest in a fresh process
                raise RuntimeError(f"the tuning worker failed (exit {status}):\n{errors}")
            last_words = (errors.strip().splitlines() or [""])[-1]
            trial = trials[current[0]] = Trial(current[0], error=f"the worker died (exit {status}): {last_words}")
            remaining.remove(trial.tile)
            if progress:
                progress(trial)
        return [trials[t] for t in tiles]

    def check(self, entry: Entry, tile: tuple, cases: list[Case]) -> str | None:
        """None where ``tile`` set at ``entry`` gives the current tile's outputs on ``cases``, else why not."""
        return self.measure(entry, [tile], cases, check=True)[0].error


def _variant(fields: dict) -> Variant:
    return Variant(**{**fields, "tile": tuple(fields["tile"])})


def tune(cases: Iterable[Case], rounds: int = 2, margin: float = 0.03, runner: Runner | None = None,
         write: bool = True, progress: Callable[[str], None] | None = None) -> list[EntryResult]:
    """Refine the launch-table entries that ``cases`` run with on the current GPU (see the module).

    Parameters
    ----------
    cases : the passes and shapes to tune for (:class:`Case`); an entry is judged on all of
        its cases together
    rounds : moves from the best tile so far, each round trying the tiles one move away
    margin : a tile is kept where it is at least this fraction faster (geometric mean of the
        time ratios over the entry's cases), in the search and again in a confirming run
    runner : :class:`Runner` (the default) or a stand-in with its ``survey`` and ``measure``
    write : merge the kept tiles into :func:`bsmm.config.tuned_path`
    progress : called with one line of text at each step

    Returns
    -------
    One :class:`EntryResult` per entry used.

    Examples
    --------
    ``tune([Case("fprop", 4096, 8192, 8192, 64, 0.1, "float16")])`` tunes the entry of a
    block-64 fprop at workload T's shape at 10 % (needs a GPU).
    """
    cases = list(cases)
    runner = runner or Runner()
    say = progress or (lambda line: None)
    say(f"planning {len(cases)} passes")
    survey = runner.survey(cases)
    results: dict[Entry, EntryResult] = {}
    for case, found in zip(cases, survey["cases"]):
        if found["entry"] is None:
            say(f"  {case}: no launch-table tile (not tunable)")
            continue
        entry, variant = Entry(**found["entry"]), _variant(found["variant"])
        result = results.setdefault(entry, EntryResult(entry, [], [], variant.tile + (
            (variant.cols,) if variant.cols > 1 else ())))
        result.variants.append(variant)
        result.cases.append(case)
    for number, result in enumerate(results.values(), 1):
        _tune_entry(result, runner, rounds, margin, survey["max_shared"], say, f"[{number}/{len(results)}]")
    if write and any(r.kept for r in results.values()):
        write_tuned(list(results.values()), survey["device"], survey["arch"])
    return list(results.values())


def _tune_entry(result: EntryResult, runner, rounds: int, margin: float, max_shared: int,
                say: Callable[[str], None], label: str) -> None:
    tried = {result.current}
    best = Trial(result.current, ratios=[1.0] * len(result.cases))
    extra = result.current[6:]  # a group tile's block columns
    say(f"{label} {result.entry.name}: {len(result.cases)} passes, current tile {list(result.current)}")
    for round_number in range(1, rounds + 1):
        start = dataclasses.replace(result.variants[0], tile=best.tile[:6])
        tiles = [t + extra for t in candidate_tiles(start, max_shared) if t + extra not in tried and all(
            tile_fits(dataclasses.replace(v, tile=t), max_shared) for v in result.variants[1:])]
        if not tiles:
            break
        tried.update(tiles)
        done = []

        def show(trial: Trial) -> None:
            done.append(trial)
            outcome = f"{trial.score:.3f}x time" if trial.error is None else f"skipped: {trial.error[:80]}"
            say(f"{label} round {round_number} {_bar(len(done), len(tiles))} {list(trial.tile)} {outcome}")

        trials = runner.measure(result.entry, tiles, result.cases, show)
        result.trials += trials
        winner = min(trials, key=lambda t: t.score)
        if winner.score > (1 - margin) * best.score:
            break
        best = winner
    if best.tile == result.current:
        say(f"{label} {result.entry.name}: the current tile stays")
        return
    confirm = runner.measure(result.entry, [best.tile], result.cases)[0]
    result.confirmed = confirm.score
    if confirm.score > 1 - margin:
        say(f"{label} {result.entry.name}: {list(best.tile)} was {best.score:.3f}x, "
            f"{confirm.score:.3f}x on confirming: the current tile stays")
        return
    # The tile will serve every shape of its batch class, not only the ones timed.
    wrong = runner.check(result.entry, best.tile, checking_cases(result.cases, result.entry.batch))
    if wrong:
        result.rejected = wrong
        say(f"{label} {result.entry.name}: {list(best.tile)} was {confirm.score:.3f}x but {wrong}: "
            "the current tile stays")
        return
    result.kept = best.tile
    say(f"{label} {result.entry.name}: {list(best.tile)} kept, {confirm.score:.3f}x time on confirming")


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = round(width * done / max(total, 1))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


# ---- the tuned file -------------------------------------------------------------------------
def tuned_entries(path: Path | None = None) -> dict:
    """The ``[tuned]`` records of the tuned file, by entry name ({} without a file)."""
    path = path or tuned_path()
    if not path.is_file():
        return {}
    with open(path, "rb") as f:
        return tomllib.load(f).get("tuned", {})


def write_tuned(results: list[EntryResult], device: str, arch: str, path: Path | None = None) -> Path:
    """Merges the kept tiles of ``results`` into the tuned file (set in ``arch``'s section, with a
    ``[tuned."<entry>"]`` record of what was measured) and returns its path."""
    path = path or tuned_path()
    data: dict = {}
    if path.is_file():
        with open(path, "rb") as f:
            data = tomllib.load(f)
    today = datetime.date.today().isoformat()
    for result in results:
        if result.kept is None:
            continue
        entry = result.entry.on(arch)
        tables = data.setdefault("kernels", {}).setdefault(arch, {}).setdefault(entry.table, {})
        tables.setdefault(entry.group, {}).setdefault(entry.block_size, {})[entry.batch] = list(result.kept)
        data.setdefault("tuned", {})[entry.name] = {
            "device": device, "date": today, "replaced": list(result.current), "tile": list(result.kept),
            "time_ratio": round(result.confirmed, 4), "cases": [str(c) for c in result.cases]}
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".tmp{os.getpid()}")
    scratch.write_text("# Launch tiles measured by `python -m bsmm tune` on this machine; read over bsmm.toml.\n"
                       "# BSMM_TUNED=0 ignores this file; `python -m bsmm tune --reset` removes it.\n\n"
                       + toml_text(data))
    os.replace(scratch, path)  # readers never see half a file
    return path


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_text(data: dict) -> str:
    """``data`` (tables of numbers, strings, booleans and lists of them) written as TOML.

    Examples
    --------
    >>> print(toml_text({"kernels": {"sm90": {"tma16": {"sparse": {"64": {"large": [256, 64]}}}}}}).strip())
    [kernels.sm90.tma16.sparse.64]
    large = [256, 64]
    """
    lines: list[str] = []

    def key(k: str) -> str:
        return k if _BARE_KEY.fullmatch(k) else json.dumps(k)

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v, ensure_ascii=False)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise TypeError(f"cannot write {type(v).__name__} to TOML")

    def table(path: list[str], d: dict) -> None:
        leaves = [(k, v) for k, v in d.items() if not isinstance(v, dict)]
        if leaves and path:
            lines.append(f"[{'.'.join(key(p) for p in path)}]")
        lines.extend(f"{key(k)} = {value(v)}" for k, v in leaves)
        if leaves:
            lines.append("")
        for k, v in d.items():
            if isinstance(v, dict):
                table(path + [k], v)

    table([], data)
    return "\n".join(lines)


def format_report(results: list[EntryResult]) -> str:
    """Markdown table: one line per entry, its current and kept tile and the time ratio."""
    lines = ["| entry | passes | current tile | kept tile | time ratio | tried (skipped) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        skipped = sum(t.error is not None for t in r.trials)
        kept = str(list(r.kept)) if r.kept else "(current)"
        ratio = f"{r.confirmed:.3f}" if r.confirmed is not None else "-"
        lines.append(f"| {r.entry.name} | {len(r.cases)} | {list(r.current)} | {kept} | {ratio} | "
                     f"{len(r.trials)} ({skipped}) |")
    return "\n".join(lines)


def current_tuned_table() -> str:
    """The tuned file's records as a Markdown table (for ``--show``)."""
    records = tuned_entries()
    if not records:
        return f"no tuned launch tiles ({tuned_path()} does not exist or holds none)"
    lines = [f"{tuned_path()}" + ("" if os.environ.get("BSMM_TUNED", "1") != "0" else " (ignored: BSMM_TUNED=0)"),
             "", "| entry | device | date | replaced | tile | time ratio |", "| --- | --- | --- | --- | --- | --- |"]
    for name, r in records.items():
        lines.append(f"| {name} | {r['device']} | {r['date']} | {r['replaced']} | {r['tile']} | {r['time_ratio']} |")
    return "\n".join(lines)


def in_effect() -> int:
    """How many tuned entries the current settings read (0 where none or ``BSMM_TUNED=0``)."""
    return len(settings().get("tuned", {}))

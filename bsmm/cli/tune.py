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
import json
import os
import select
import subprocess
import sys
import tempfile
from typing import Callable, Iterable

from bsmm.backends.cuda.kernels import Variant, tiling_problem
from bsmm.passes import PASSES
from bsmm.cli.bench import progress_bar
from bsmm.cli.tune_results import Case, Entry, EntryResult, Trial
from bsmm.cli.tuned_file import write_tuned

__all__ = ["Case", "Entry", "EntryResult", "Runner", "Trial", "candidate_tiles", "checking_cases", "tile_fits", "tune",
           "used_entry"]

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


def used_entry(lookups: list, variant: Variant) -> Entry | None:
    """The entry a plan's ``variant`` took its tile from, given the lookups made while planning it
    (:func:`bsmm.backends.cuda.policy.recording_table_lookups`): the last whose tile is the variant's
    (tiles of ``bsmm_matmul_tma`` come from the tma tables, the others from the rest)."""
    for entry, tile in reversed(lookups):
        same = list(tile[:6]) == variant.tile.as_list() and (len(tile) == 6 or tile[6] == variant.cols)
        if same and entry[1].startswith("tma") == variant.tma:
            return Entry(*entry)
    return None


# ---- candidate tiles ------------------------------------------------------------------------
def tile_fits(variant: Variant, max_shared: int) -> bool:
    """Whether ``variant``'s tile builds (:func:`bsmm.backends.cuda.kernels.tiling_problem`) and
    fits the device's ``max_shared`` bytes of shared memory a thread block."""
    return not tiling_problem(variant, max_shared)


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
    bm, bn, bk, wm, wn, stages = variant.tile.as_list()
    moves = [(bm, bk, wm, wn, s) for s in (stages - 1, stages + 1, stages + 2)]
    if variant.math.startswith("wgmma"):  # 64-row warpgroups: rows and warps move together
        moves += [(m, bk, m // 16, 1, stages) for m in (bm // 2, bm * 2)]
        if variant.cols > 1 and not PASSES[variant.pass_name].updates_weights:  # column groups: whole block rows a step
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
        if fits and list(tile) != variant.tile.as_list() and tile not in found:
            found.append(tile)
    return found


# ---- the search -----------------------------------------------------------------------------
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


def tune(cases: Iterable[Case], rounds: int = 2, margin: float = 0.03, runner: Runner | None = None,
         write: bool = True, progress: Callable[[str], None] | None = None, bar: bool = False) -> list[EntryResult]:
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
    progress : called with one line of text at each step (each tile measured, each decision)
    bar : show a progress bar of each round's tiles on stderr (:func:`bsmm.cli.bench.progress_bar`)

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
        entry, variant = Entry(**found["entry"]), Variant(**found["variant"])
        result = results.setdefault(entry, EntryResult(entry, [], [], tuple(variant.tile.as_list()) + (
            (variant.cols,) if variant.cols > 1 else ())))
        result.variants.append(variant)
        result.cases.append(case)
    for number, result in enumerate(results.values(), 1):
        _tune_entry(result, runner, rounds, margin, survey["max_shared"], say, f"[{number}/{len(results)}]", bar)
    if write and any(r.kept for r in results.values()):
        write_tuned(list(results.values()), survey["device"], survey["arch"])
    return list(results.values())


def _tune_entry(result: EntryResult, runner, rounds: int, margin: float, max_shared: int,
                say: Callable[[str], None], label: str, bar: bool) -> None:
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
        with progress_bar(len(tiles), f"{label} round {round_number}", bar, unit="tile") as shown:

            def show(trial: Trial) -> None:
                done.append(trial)
                shown.update(1)
                outcome = f"{trial.score:.3f}x time" if trial.error is None else f"skipped: {trial.error[:80]}"
                say(f"{label} round {round_number}, tile {len(done)}/{len(tiles)}: {list(trial.tile)} {outcome}")

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

"""The tuned file of ``python -m bsmm tune``: kept tiles by architecture and a record of each.

:func:`bsmm.config.tuned_path` names it; :func:`bsmm.config.settings` reads its ``[kernels]``
tables over ``bsmm.toml``'s (``BSMM_TUNED=0`` ignores them). Written by ``tomli_w`` (the
standard library reads TOML, it does not write it).
"""

from __future__ import annotations

import datetime
import os
import tomllib
from pathlib import Path

from bsmm.config import settings, tuned_path
from bsmm.cli.tune_results import EntryResult

__all__ = ["tuned_entries", "write_tuned", "format_report", "current_tuned_table", "in_effect"]


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
    # Imported here: only `bsmm tune` writes TOML (tomli-w is a dependency of bsmm; a copy of bsmm
    # run from a source tree without it still reads tuned files and benchmarks).
    try:
        import tomli_w
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise RuntimeError("writing the tuned file needs tomli-w: pip install tomli-w") from error
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".tmp{os.getpid()}")
    scratch.write_text("# Launch tiles measured by `python -m bsmm tune` on this machine; read over bsmm.toml.\n"
                       "# BSMM_TUNED=0 ignores this file; `python -m bsmm tune --reset` removes it.\n\n"
                       + tomli_w.dumps(data))
    os.replace(scratch, path)  # readers never see half a file
    return path


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

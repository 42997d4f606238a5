"""The tuned file of ``python -m bsmm tune``: kept tiles by architecture and a record of each.

:func:`bsmm.config.tuned_path` names it; :func:`bsmm.config.settings` reads its ``[kernels]``
tables over ``bsmm.toml``'s (``BSMM_TUNED=0`` ignores them). Written as TOML text by
:func:`toml_text` (the standard library reads TOML, it does not write it).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import tomllib
from pathlib import Path

from bsmm.config import settings, tuned_path
from bsmm.cli.tune_results import EntryResult

__all__ = ["tuned_entries", "write_tuned", "toml_text", "format_report", "current_tuned_table", "in_effect"]


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

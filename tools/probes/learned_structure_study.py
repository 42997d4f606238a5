"""Why RigL/SET lose to a fixed random layout (issue 38): ``examples/learned_structure/experiment_lstm.py``
run with a ``DynamicSparsity`` that records each layout update, and the runs summarised per method.

    python3 tools/probes/learned_structure_study.py OUT [experiment_lstm.py's arguments]
    python3 tools/probes/learned_structure_study.py --summary OUT [OUT ...]

The first form writes ``OUT.json`` and ``OUT.md`` (the experiment's outputs) and ``OUT.updates.json``: for
each RigL/SET run, in order, every update's step, the blocks it replaced, the share of those dropped that
the previous update had grown (with ``init="zero"`` a grown block starts at zero, so it is often still the
smallest), and, for RigL, the share of the dense gradient's squared norm on the present blocks just
before it (a random layout's is near its density). The second prints a Markdown row per method of each
OUT: seeds, held-out bits/char, degree spread, the final layout's dense-gradient share, and those update
measures (mean ± s.d. over seeds).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import bsmm.torch  # noqa: E402
from examples.learned_structure import experiment_lstm  # noqa: E402

#: One record per RigL/SET run, in the order the runs start.
RECORDS: list[dict] = []


class RecordingSparsity(bsmm.torch.DynamicSparsity):
    """:class:`bsmm.torch.DynamicSparsity` of one LSTM, keeping what each update did in :data:`RECORDS`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        (self._lstm_layer,) = self.layers.values()
        self._start = self._present()
        self._share = None
        self.record = {"updates": [], "start_kept": 1.0}
        RECORDS.append(self.record)

    def _present(self) -> np.ndarray:
        return self._lstm_layer._recurrent.index.layout != 0

    def _growth_scores(self, name, layer):
        scores = super()._growth_scores(name, layer)
        if self.criterion == "rigl":
            squares = scores ** 2
            self._share = float(squares[self._present()].sum() / squares.sum())
        return scores

    def update(self):
        self._share = None
        (grown_at,) = self.grown_at.values()
        last_grown = (grown_at == self.updates) & (self.updates > 0)  # (what the update before grew)
        changes = super().update()
        (change,) = changes.values()
        dropped = np.zeros_like(self._start)
        dropped[change.dropped[:, 0], change.dropped[:, 1]] = True
        count = len(change.dropped)
        self.record["updates"].append({
            "step": self.steps, "replaced": count, "present_share": self._share,
            "dropped_last_grown": float((dropped & last_grown).sum() / count) if count else None})
        self.record["start_kept"] = float((self._present() & self._start).sum() / self._start.sum())
        return changes


def _mean_sd(values, digits: int) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def _mean_over_updates(record: dict, key: str):
    values = [u[key] for u in record["updates"] if u[key] is not None]
    return statistics.mean(values) if values else None


def summary(outs: list[str]) -> str:
    lines = ["| run: method | seeds | held-out bits/char | degree spread | final dense-gradient share | "
             "share before updates (RigL) | dropped that were last grown | start layout kept |", "|" + " --- |" * 8]
    for out in outs:
        results = json.loads(pathlib.Path(out + ".json").read_text())["results"]
        records = iter(json.loads(pathlib.Path(out + ".updates.json").read_text()))
        for r in results:
            r["record"] = next(records) if r["method"] in ("rigl", "set") else None
        for method in dict.fromkeys(r["method"] for r in results):
            runs = [r for r in results if r["method"] == method]
            records_of = [r["record"] for r in runs if r["record"]]
            lines.append(
                f"| {pathlib.Path(out).name}: {method} | {len(runs)} | {_mean_sd([r['valid_bpc'] for r in runs], 4)} | "
                f"{_mean_sd([r['degree_spread'] for r in runs], 2)} | "
                f"{_mean_sd([r['gradient_share'] for r in runs], 3)} | "
                f"{_mean_sd([_mean_over_updates(c, 'present_share') for c in records_of], 3)} | "
                f"{_mean_sd([_mean_over_updates(c, 'dropped_last_grown') for c in records_of], 2)} | "
                f"{_mean_sd([c['start_kept'] for c in records_of], 2)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--summary"]:
        print(summary(argv[1:]))
        return 0
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: learned_structure_study.py OUT [experiment_lstm.py's arguments] | --summary OUT ...")
    out, rest = argv[0], argv[1:]
    experiment_lstm.bsmm.torch.DynamicSparsity = RecordingSparsity  # the experiment builds its own
    code = experiment_lstm.main([*rest, "--json", out + ".json", "--markdown", out + ".md"])
    pathlib.Path(out + ".updates.json").write_text(json.dumps(RECORDS, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())

"""``examples/learned_structure/experiment_torch.py`` at tiny sizes on the CPU: every way of choosing the
blocks trains, ends at the density asked for, is scored on held-out text, and the outputs hold its curve."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed")

from examples.learned_structure import experiment_torch  # noqa: E402


def test_every_method_trains_to_the_density_and_is_scored(tmp_path):
    out, table = tmp_path / "run.json", tmp_path / "run.md"
    assert experiment_torch.main(["--device", "cpu", "--d-model", "64", "--d-hidden", "128", "--layers", "2",
                                  "--heads", "2", "--batch", "4", "--sequence", "32", "--steps", "8", "--every", "2",
                                  "--block-size", "16", "--density", "0.25", "--eval-chars", "2000",
                                  "--max-chars", "200000", "--seeds", "0,1", "--log-every", "2", "--json", str(out),
                                  "--markdown", str(table)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["method"], r["seed"]) for r in results] == [(m, s) for m in experiment_torch.METHODS for s in (0, 1)]
    for r in results:
        assert r["density"] == pytest.approx(0.25), r["method"]  # equal density at the end, whatever the way
        assert [step for step, _ in r["curve"]] == [2, 4, 6, 8]
        assert 1.0 < r["valid_bpc"] < 9.0
    assert {r["layout_updates"] for r in results if r["method"] in ("rigl", "set")} == {2}  # after steps 2 and 4 (at 6, the end, the fraction is 0)
    assert "| rigl |" in table.read_text() and "| l0 |" in table.read_text()


def test_an_unknown_method_is_refused():
    with pytest.raises(SystemExit):
        experiment_torch.main(["--methods", "rigl,magic", "--device", "cpu"])

"""``examples/learned_structure/experiment_lstm.py`` at tiny sizes on the CPU: every way of choosing the LSTM's
blocks trains, ends at the same block count, is scored on held-out text, and the outputs hold its curve and
its layout's measures."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed")

from examples.learned_structure import experiment_lstm  # noqa: E402


TINY = ("--device cpu --hidden 128 --block-size 16 --density 0.25 --batch 4 --bptt 16 --steps 8 --every 2 "
        "--log-every 2 --eval-chars 2000 --max-chars 200000 --seeds 0,1").split()


def test_every_method_trains_to_the_same_block_count_and_is_scored(tmp_path):
    out, table = tmp_path / "run.json", tmp_path / "run.md"
    assert experiment_lstm.main([*TINY, "--json", str(out), "--markdown", str(table)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["method"], r["seed"]) for r in results] == [(m, s) for m in experiment_lstm.METHODS for s in (0, 1)]
    for seed in (0, 1):  # equal density at the end, whatever the way
        assert len({r["blocks"] for r in results if r["seed"] == seed}) == 1
    for r in results:
        assert [step for step, _ in r["curve"]] == [2, 4, 6, 8]
        assert 1.0 < r["valid_bpc"] < 9.0
        assert 0.0 <= r["clustering"] <= 1.0 and r["degree_spread"] >= 0.0
    assert {r["layout_updates"] for r in results if r["method"] in ("rigl", "set")} == {2}
    assert "| smallworld |" in table.read_text() and "| prune |" in table.read_text()


def test_an_unknown_method_is_refused():
    with pytest.raises(SystemExit):
        experiment_lstm.main(["--methods", "rigl,l0", "--device", "cpu"])

"""``examples/char_lstm/experiment_torch.py`` at tiny sizes on the CPU: both models train, are scored on
held-out text, and the outputs hold the learning curves the results page plots."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed")

from examples.char_lstm import experiment_torch  # noqa: E402


def test_both_models_train_for_the_budget_and_are_scored(tmp_path):
    out = tmp_path / "run.json"
    assert experiment_torch.main(["--device", "cpu", "--hidden", "64", "--block-size", "8", "--density", "0.3",
                                  "--budget", "1", "--batch", "4", "--steps", "16", "--eval-chars", "4096",
                                  "--curve-chars", "2048", "--points", "2", "--json", str(out),
                                  "--markdown", str(tmp_path / "run.md")]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["model"] for r in results] == ["sparse", "dense"]
    for r in results:
        # A point a mark passed (a slow first update on a busy machine may pass both at once).
        assert r["train_seconds"] >= 1.0 and r["updates"] > 0 and 1 <= len(r["curve"]) <= 2
        assert 0.5 < r["valid_bpc"] < 9.0  # below log2(vocabulary) + 1: scored, not NaN
    sparse, dense = results
    assert sparse["density"] < 1.0 and dense["density"] == 1.0
    # Equal parameters in the LSTM layers, to the width step of 8 (large at these tiny sizes).
    assert abs(sparse["lstm_parameters"] - dense["lstm_parameters"]) < 0.2 * sparse["lstm_parameters"]
    assert "| sparse | 64 |" in (tmp_path / "run.md").read_text()

"""The model-level run scripts on the CPU: ``tools/gpu/fsdp_transformer.py`` (the decoder, dense and
MLP-sparse, under FSDP2 over gloo processes) trains to the same losses on 1 and 2 ranks, and its table
says what its rows hold; ``tools/gpu/heldout_llama.py`` (transformers' Llama, where installed) sparsifies the
library's MLPs and matches the dense model at density 1."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

FSDP_TOOL = REPO_ROOT / "tools" / "gpu" / "fsdp_transformer.py"
HELDOUT_TOOL = REPO_ROOT / "tools" / "gpu" / "heldout_llama.py"


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fsdp_decoder_losses_on_two_ranks_match_one(tmp_path):
    """Two gloo ranks, each half of the batch, against one: the same loss at every step, dense and sparse."""
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, str(FSDP_TOOL), "--device", "cpu", "--small", "--steps", "4",
                          "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["world"]) for r in rows] == [("dense", 1), ("dense", 2), ("bsmm 25%, block 64", 1),
                                                        ("bsmm 25%, block 64", 2)]
    by = {(r["kind"], r["world"]): r for r in rows}
    for kind in ("dense", "bsmm"):
        one, two = by[kind, 1]["losses"], by[kind, 2]["losses"]
        assert len(one) == len(two) == 4 and all(math.isfinite(x) for x in one + two)
        assert abs(one[0] - math.log(512)) < 0.5  # a fresh model on random tokens of a 512-word vocabulary
        for a, b in zip(one, two):  # bf16 parameters, gradients reduced in another order
            assert abs(a - b) <= 2e-3 * abs(a), (kind, one, two)
    assert by["dense", 1]["losses"] != by["bsmm", 1]["losses"]  # the sparse model is another model
    assert "| bsmm 25%, block 64 | 2 |" in run.stdout


def test_fsdp_table_scaling_and_loss_differences():
    tool = load(FSDP_TOOL, "fsdp_transformer")
    rows = [{"model": "dense", "kind": "dense", "world": 1, "ms": 100.0, "tokens_per_s": 1000.0, "losses": [4.0, 2.0],
             "peak_gib": 3.0},
            {"model": "dense", "kind": "dense", "world": 2, "ms": 50.0, "tokens_per_s": 1500.0, "losses": [4.0, 2.01],
             "peak_gib": 1.5}]
    lines = tool.table(rows).splitlines()
    assert lines[2].split(" | ")[4] == "1.00×" and lines[2].split(" | ")[7] == "—"
    two = lines[3].split(" | ")
    assert two[4] == "1.50×" and two[5] == "4.0000" and two[6] == "2.0100" and two[7] == "5.0e-03"


def test_heldout_llama_small_run(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, str(HELDOUT_TOOL), "--small", "--device", "cpu", "--block-size", "64",
                          "--density", "0.25", "--repeats", "1", "--no-compile", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    # bf16 throughout: the fused MLP rounds gate and up once, as the dense model's separate layers do
    assert result["density_one"]["loss relative"] < 1e-3
    assert all(value < 3e-2 for value in result["density_one"].values()), result["density_one"]
    assert [r["measure"] for r in result["rows"]] == ["train eager", "prefill", "generate, static cache, eager"]
    assert all(r["dense_tokens_per_s"] > 0 and r["bsmm_tokens_per_s"] > 0 for r in result["rows"])

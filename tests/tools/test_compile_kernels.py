"""``tools/ci/compile_kernels.py`` on the CPU: the representative sample (size, determinism, what it
covers), which architectures each kernel is built for, and the report (summary on stdout, listing
in a file, exit status) over faked compiles; one real NVRTC compile where CuPy is installed."""

from __future__ import annotations

import importlib.util
import itertools

import pytest

from bsmm.backends.cuda.kernels import Variant
from conftest import REPO_ROOT

# The script's module, loaded from its file: tools/ci stays off sys.path for the other tests.
_SPEC = importlib.util.spec_from_file_location("compile_kernels", REPO_ROOT / "tools" / "ci" / "compile_kernels.py")
ck = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ck)


@pytest.fixture(scope="module")
def variants():
    return ck.all_variants()


def _combination(variant):
    fields = ck.describe(variant)
    return tuple(fields[name] for name in ck.COMBINATION)


def test_sample_is_a_deterministic_ordered_subset(variants):
    sample = ck.representative_sample(variants, 25)
    assert len(sample) == 25 == len(set(sample))
    assert sample == ck.representative_sample(list(variants), 25)
    positions = [variants.index(v) for v in sample]
    assert positions == sorted(positions)


def test_sample_covers_every_value_then_every_combination(variants):
    values = {(name, value) for v in variants for name, value in ck.describe(v).items()}
    small = ck.representative_sample(variants, 40)
    assert {(name, value) for v in small for name, value in ck.describe(v).items()} == values
    combinations = {_combination(v) for v in variants}
    covering = ck.representative_sample(variants, len(combinations))
    assert {_combination(v) for v in covering} == combinations


def test_sample_of_40_covers_every_value_pair(variants):
    """Today's tables: 34 picks reach every pair of two fields' values (the docstring's claim)."""
    def pairs(vs):
        out = set()
        for v in vs:
            fields = ck.describe(v)
            out |= {(a, fields[a], b, fields[b]) for a, b in itertools.combinations(ck.FIELDS, 2)}
        return out

    assert pairs(ck.representative_sample(variants, 40)) == pairs(variants)


def test_sample_at_least_as_large_as_all_is_all(variants):
    assert ck.representative_sample(variants, len(variants) + 5) == variants


def test_wgmma_and_tma_kernels_build_for_sm90a_only(variants):
    jobs = ck.arch_jobs(variants, ["sm_80", "sm_90a"])
    for variant, arch in jobs:
        if variant.math.startswith("wgmma") or getattr(variant, "tma", False):
            assert arch == "sm_90a", variant
    simt = next(v for v in variants if v.math == "simt")
    assert [arch for v, arch in jobs if v == simt] == ["sm_80", "sm_90a"]


def test_ptxas_report_without_spills_or_report():
    assert ck.ptxas_report("Used 40 registers, 0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads") == (
        "regs 40, stack 0 B, spills 0/0 B", False)
    assert ck.ptxas_report("") == ("no ptxas report", False)


_CLEAN = "ptxas info : Used 64 registers, 0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
_SPILLED = "ptxas info : Used 255 registers, 24 bytes stack frame, 16 bytes spill stores, 8 bytes spill loads"


@pytest.fixture
def faked(monkeypatch):
    """Compiles that succeed in no time, except those whose variant a test names."""
    outcomes = {}

    def compile_one(args):
        variant, arch, _ = args
        log, error = outcomes.get(variant, (_CLEAN, None))
        return variant, arch, log, error, 0.25

    monkeypatch.setattr(ck, "_compile", compile_one)
    monkeypatch.setattr(ck, "nvrtc_version", lambda: "12.9")
    return outcomes


def test_report_summary_on_stdout_listing_in_file(faked, tmp_path, capsys):
    report = tmp_path / "sub" / "report.txt"
    assert ck.main(["--sample", "6", "--jobs", "1", "--report", str(report)]) == 0
    out = capsys.readouterr().out.splitlines()
    jobs = ck.arch_jobs(ck.representative_sample(ck.all_variants(), 6), ["sm_80", "sm_90a"])
    assert out[0].startswith(f"compiling {len(jobs)} variant x arch (6 variants sampled, sm_80, sm_90a) with NVRTC 12.9")
    assert any(line.startswith("sm_80 ") and " compiled, 0 failed, 0 with spills" in line for line in out)
    assert any(line.startswith("by kind: ") for line in out)
    assert out[-1].startswith(f"compiled {len(jobs)}/{len(jobs)} variant x arch in ")
    listing = report.read_text().splitlines()
    assert listing[0].startswith("# ") and len(listing) == 1 + len(jobs)
    assert all(" ok " in line and "regs 64" in line for line in listing[1:])


def test_failures_and_spills_print_in_full_even_when_quiet(faked, tmp_path, capsys):
    sample = ck.representative_sample(ck.all_variants(), 6)
    failing, spilling = [v for v in sample if isinstance(v, Variant)][:2]
    faked[failing] = (None, "NVRTC failed on it:\nerror: line two")
    faked[spilling] = (_SPILLED, None)
    report = tmp_path / "report.txt"
    assert ck.main(["--sample", "6", "--jobs", "1", "--report", str(report), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL sm_90a {failing.name_expression}\nNVRTC failed on it:\nerror: line two" in out
    assert f"SPILL sm_90a {spilling.name_expression}: regs 255, stack 24 B, spills 16/8 B" in out
    assert "by kind" not in out and "compiling" not in out
    failed = sum(1 for v, _ in ck.arch_jobs([failing], ["sm_80", "sm_90a"]))
    assert f"; {failed} failed; " in out.splitlines()[-1]
    listing = report.read_text()
    assert "FAIL   " in listing and "SPILL  " in listing


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs CuPy's NVRTC binding")
def test_a_real_compile_reports_registers(tmp_path, capsys):
    report = tmp_path / "report.txt"
    assert ck.main(["--sample", "2", "--arch", "sm_80", "--jobs", "1", "--report", str(report), "--quiet"]) == 0
    rows = report.read_text().splitlines()[1:]
    assert rows and all(row.startswith("sm_80   ok") and "regs " in row for row in rows)

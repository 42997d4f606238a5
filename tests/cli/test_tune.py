"""``bsmm tune``: the tuned settings layer, candidate tiles, the search and its file (CPU), and a
short tuning run on the GPU."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import sys
import tomllib

import numpy as np
import pytest

import bsmm
import bsmm.config
from bsmm.cli import tune, tuned_file
from bsmm.backends.cuda.kernels import Variant
from conftest import compile_or_skip

plan_cache = pytest.importorskip("bsmm.backends.cuda.plan_cache", reason="CuPy is not installed")
from bsmm.backends.cuda.policy import Policy, Tile, recording_table_lookups  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache folder whose tuned file the settings read (BSMM_TUNED=1); fresh settings."""
    monkeypatch.setenv("BSMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BSMM_TUNED", "1")
    monkeypatch.delenv("BSMM_CONFIG", raising=False)
    bsmm.config.settings.cache_clear()
    yield tmp_path
    bsmm.config.settings.cache_clear()


def shipped(*keys):
    value = bsmm.config.settings()["kernels"]
    for key in keys:
        value = value[key]
    return value


def test_settings_read_tuned_architecture_tables_under_bsmm_config_and_overrides(cache, tmp_path, monkeypatch):
    fprop64 = ("sm90", "tma16", "sparse", "64", "large")
    before = list(shipped(*fprop64))
    waves = shipped("waves")
    (cache / "tuned.toml").write_text(
        "[kernels]\nwaves = 99\n"  # not an architecture's table: ignored
        "[kernels.default.tensor16.sparse.64]\nlarge = [1, 2, 3, 4, 5, 6]\n"  # nor is the default section
        "[kernels.sm90.tma16.sparse.64]\nlarge = [256, 64, 64, 16, 1, 3]\n"
        '[tuned."sm90.tma16.sparse.64.large"]\ndevice = "a GPU"\n')
    bsmm.config.settings.cache_clear()
    with pytest.warns(bsmm.config.BsmmWarning, match=r"keys \['default', 'waves'\]"):
        assert shipped(*fprop64) == [256, 64, 64, 16, 1, 3]
    assert shipped("sm90", "tma16", "sparse", "128", "large") != [256, 64, 64, 16, 1, 3]  # the rest stays
    assert shipped("waves") == waves and shipped("default", "tensor16", "sparse", "64", "large") != [1, 2, 3, 4, 5, 6]
    assert tuned_file.in_effect() == 1
    user = tmp_path / "user.toml"
    user.write_text("[kernels.sm90.tma16.sparse.64]\nlarge = [128, 64, 64, 8, 1, 6]\n")
    monkeypatch.setenv("BSMM_CONFIG", str(user))
    bsmm.config.settings.cache_clear()
    assert shipped(*fprop64) == [128, 64, 64, 8, 1, 6]  # the user's file over the tuned one
    layer = {"kernels": {"sm90": {"tma16": {"sparse": {"64": {"large": [64, 64, 64, 4, 1, 4]}}}}}}
    with bsmm.config.overriding(layer):
        assert shipped(*fprop64) == [64, 64, 64, 4, 1, 4]
    assert shipped(*fprop64) == [128, 64, 64, 8, 1, 6]
    monkeypatch.delenv("BSMM_CONFIG")
    monkeypatch.setenv("BSMM_TUNED", "0")
    bsmm.config.settings.cache_clear()
    assert shipped(*fprop64) == before and tuned_file.in_effect() == 0


def test_an_unreadable_tuned_file_names_itself_and_the_way_out(cache):
    (cache / "tuned.toml").write_text("[kernels.sm90\n")
    bsmm.config.settings.cache_clear()
    with pytest.raises(RuntimeError, match=r"tuned\.toml.*--reset"):
        bsmm.config.settings()


def test_the_tuned_file_reads_back_what_was_written(tmp_path):
    """Written by tomli-w: entry names with dots, a device name with quotes and non-ASCII text, merged
    with what the file held, read back by the standard library."""
    path = tmp_path / "tuned.toml"
    result = tune.EntryResult(ENTRY64, [TMA64], CASES[:1], tuple(TMA64.tile.as_list()), kept=(256, 64, 64, 16, 1, 4),
                              confirmed=0.93124)
    tuned_file.write_tuned([result], 'NVIDIA "H100" ü', "sm90", path)
    tuned_file.write_tuned([result], "another GPU", "sm80", path)
    data = tomllib.loads(path.read_text())
    name = ENTRY64.on("sm90").name
    assert data["tuned"][name]["device"] == 'NVIDIA "H100" ü' and data["tuned"][name]["time_ratio"] == 0.9312
    assert data["tuned"][ENTRY64.on("sm80").name]["device"] == "another GPU"
    assert tuned_file.tuned_entries(path) == data["tuned"]


def _entry_variants():
    """(entry, the variant of its shipped tile) for every launch-table entry of bsmm.toml, as a
    half-precision (float32 for the float tables) pass on feature axis 1 would run it."""
    families = {"tensor16": ("tensor16", False), "tf32": ("tf32", False), "simt": ("simt", False),
                "wgmma16": ("wgmma16", False), "tma16": ("wgmma16", True), "tma_mma16": ("tensor16", True),
                "tma_tf32": ("wgmma_tf32", True)}
    for section in ("default", "sm90"):
        for table, groups in shipped(section).items():
            math_mode, tma = families[table]
            for group, sizes in groups.items():
                for block_size, batches in sizes.items():
                    for batch, tile in batches.items():
                        pass_name = ("updat" if group.startswith("updat") else
                                     "bprop" if math_mode == "wgmma_tf32" else "fprop")
                        dtype = "float32" if math_mode in ("simt", "tf32", "wgmma_tf32") else "float16"
                        axis = 0 if (math_mode == "wgmma_tf32" and group == "updat_rows") else 1
                        cols = tile[6] if len(tile) == 7 else 1
                        yield (tune.Entry(section, table, group, block_size, batch),
                               Variant(dtype, int(block_size), tuple(tile[:6]), math_mode, pass_name, axis, True,
                                       False, cols, tma))


H100_SHARED = 232448


def test_candidates_are_fitting_moves_that_keep_the_tile_width():
    for entry, variant in _entry_variants():
        assert tune.tile_fits(variant, H100_SHARED), f"{entry.name}: the shipped tile fits"
        candidates = tune.candidate_tiles(variant, H100_SHARED)
        assert candidates, f"{entry.name}: something to try"
        assert len(set(candidates)) == len(candidates) and tuple(variant.tile.as_list()) not in candidates
        for tile in candidates:
            assert tile[1] == variant.tile.bn, f"{entry.name} {tile}: the block columns a tile spans stay"
            assert tune.tile_fits(dataclasses.replace(variant, tile=tile), H100_SHARED)
    small = Variant("float16", 128, (128, 128, 64, 8, 1, 4), "wgmma16", "fprop", 1, True, tma=True)
    assert all(dataclasses.replace(small, tile=t).shared_bytes <= 100_000
               for t in tune.candidate_tiles(small, 100_000))  # a device with less shared memory


def test_candidates_compile():
    """Candidates of the largest block size of every table compile through NVRTC, as the tuner's
    workers will compile them (sm_90a for the Hopper tables, sm_80 for the default ones)."""
    from bsmm.backends.cuda.kernels import compile_variant

    largest = {}
    for entry, variant in _entry_variants():
        key = (entry.section, entry.table, entry.group)
        if key not in largest or variant.block_size >= largest[key].block_size:
            largest[key] = variant
    compile_or_skip(next(iter(largest.values())), "sm_80")
    jobs = [(dataclasses.replace(variant, tile=tile), "sm_90a" if section == "sm90" else "sm_80")
            for (section, table, group), variant in largest.items()
            for tile in tune.candidate_tiles(variant, H100_SHARED if section == "sm90" else 166912)]
    # Spawned, not forked: the test process may hold threads (JAX's) that a fork would copy mid-lock.
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(compile_variant, *zip(*jobs)))  # raises on a compile error


def test_the_used_entry_is_the_last_lookup_of_the_variants_tile_and_kind():
    tile = (128, 64, 64, 8, 1, 4)
    lookups = [(("sm90", "wgmma16", "sparse", "64", "large"), tile), (("sm90", "tma16", "sparse", "64", "large"), tile)]
    on_tma = Variant("float16", 64, tile, "wgmma16", "fprop", 1, True, tma=True)
    assert tune.used_entry(lookups, on_tma) == tune.Entry("sm90", "tma16", "sparse", "64", "large")
    assert tune.used_entry(lookups[:1], dataclasses.replace(on_tma, tma=False)).table == "wgmma16"
    assert tune.used_entry(lookups[:1], on_tma) is None  # a cp.async tile does not make a TMA variant
    group = (("sm90", "tma16", "columns", "32", "large"), (128, 128, 64, 8, 1, 3, 4))
    grouped = Variant("float16", 32, (128, 128, 64, 8, 1, 3), "wgmma16", "fprop", 1, True, False, 4, True)
    assert tune.used_entry([group], grouped).group == "columns"
    assert tune.used_entry([group], dataclasses.replace(grouped, cols=2)) is None


def test_tile_lookups_are_recorded_only_while_asked():
    policy = Policy.from_settings(environ={})
    with recording_table_lookups() as found:
        tile = policy.tile("tensor16", "fprop", 64, 4096, "sm90")
        policy.tile("tma16", "updat", 128, 4096, "sm90", optional=True)
        assert policy.tile("tma16", "fprop", 16, 4096, "sm90", optional=True) is None  # none: not recorded
        with pytest.raises(RuntimeError, match="already"):
            with recording_table_lookups():
                pass
    assert found == [(("default", "tensor16", "sparse", "64", "large"), tuple(tile.as_list())),
                     (("sm90", "tma16", "updat", "128", "any"), tuple(shipped("sm90", "tma16", "updat", "128", "any")))]
    policy.tile("tensor16", "fprop", 64, 4096, "sm90")
    assert len(found) == 2


def test_an_entry_sets_its_tile_in_a_policy_and_nowhere_else():
    base = Policy.from_settings(environ={})
    entry = tune.Entry("sm90", "tma16", "sparse", "64", "large")
    tuned = entry.policy(base, (64, 64, 64, 4, 1, 4))
    assert tuned.tile("tma16", "fprop", 64, 4096, "sm90") == Tile(64, 64, 64, 4, 1, 4)
    assert base.tile("tma16", "fprop", 64, 4096, "sm90") == Tile.of(shipped("sm90", "tma16", "sparse", "64", "large"))
    assert tuned.tile("tma16", "fprop", 128, 4096, "sm90") == base.tile("tma16", "fprop", 128, 4096, "sm90")


class StandIn:
    """A runner whose times follow a made-up cost: the tile nearest ``best`` is fastest."""

    def __init__(self, entry, variant, best, confirm_factor=1.0, fails=(), wrong=None):
        self.entry, self.variant, self.best = entry, variant, best
        self.confirm_factor, self.fails, self.wrong = confirm_factor, set(fails), wrong
        self.measured: list[list[tuple]] = []
        self.checked: list = []

    def check(self, entry, tile, cases):
        self.checked.append((tile, cases))
        return self.wrong

    def survey(self, cases):
        used = {"entry": dataclasses.asdict(self.entry), "variant": dataclasses.asdict(self.variant)}
        found = [used] * (len(cases) - 1)
        return {"device": "Stand-in GPU", "arch": "sm90", "max_shared": H100_SHARED,
                "cases": found + [{"entry": None, "variant": dataclasses.asdict(self.variant)}]}

    def cost(self, tile):
        return 1.0 - 0.05 * sum(a == b for a, b in zip(tile, self.best)) + 0.05 * sum(
            a == b for a, b in zip(tile, self.variant.tile.as_list()))

    def measure(self, entry, tiles, cases, progress=None):
        assert entry == self.entry
        self.measured.append(list(tiles))
        confirming = progress is None  # tune confirms its pick without a progress line
        trials = []
        for tile in tiles:
            if tile in self.fails:
                trial = tune.Trial(tile, error="CompileException: no")
            else:
                factor = self.confirm_factor if confirming else 1.0
                trial = tune.Trial(tile, [factor * self.cost(tile) / self.cost(tuple(self.variant.tile.as_list()))] * len(cases))
            trials.append(trial)
            if progress:
                progress(trial)
        return trials


CASES = [tune.Case(p, 4096, 8192, 8192, 64, 0.1, "float16") for p in ("fprop", "bprop", "updat")]
TMA64 = Variant("float16", 64, (128, 64, 64, 8, 1, 4), "wgmma16", "fprop", 1, True, tma=True)
ENTRY64 = tune.Entry("sm90", "tma16", "sparse", "64", "large")


def test_tune_moves_towards_the_fastest_tile_and_writes_what_it_kept(cache):
    runner = StandIn(ENTRY64, TMA64, best=(256, 64, 64, 16, 1, 5), fails=[(128, 64, 64, 8, 1, 3)])
    lines = []
    (result,) = tune.tune(CASES, rounds=3, runner=runner, progress=lines.append)
    assert result.entry == ENTRY64 and result.cases == CASES[:2]  # updat had no table entry
    assert result.kept == (256, 64, 64, 16, 1, 5)
    assert math.isclose(result.confirmed, runner.cost(result.kept) / runner.cost(tuple(TMA64.tile.as_list())))
    assert runner.checked == [(result.kept, tune.checking_cases(CASES[:2], "large"))]
    assert runner.measured[0] == tune.candidate_tiles(TMA64, H100_SHARED)
    assert all(set(later).isdisjoint(runner.measured[0]) for later in runner.measured[1:-1]), "no tile twice"
    assert any("skipped: CompileException" in line for line in lines)
    first_round = len(runner.measured[0])
    assert any(f"round 1, tile {first_round}/{first_round}:" in line for line in lines)
    bsmm.config.settings.cache_clear()
    assert shipped("sm90", "tma16", "sparse", "64", "large") == [256, 64, 64, 16, 1, 5]
    record = tuned_file.tuned_entries()["sm90.tma16.sparse.64.large"]
    assert record["replaced"] == TMA64.tile.as_list() and record["device"] == "Stand-in GPU"
    assert record["cases"] == [str(c) for c in CASES[:2]]
    assert "sm90.tma16.sparse.64.large" in tuned_file.current_tuned_table()
    assert "| sm90.tma16.sparse.64.large | 2 | [128, 64, 64, 8, 1, 4] | [256, 64, 64, 16, 1, 5] | 0.739 | 7 (1) |" in (
        tuned_file.format_report([result]))
    # A second entry tuned later joins the first in the file.
    bf = tune.Entry("default", "tensor16", "sparse", "32", "large")
    mma = Variant("bfloat16", 32, (128, 32, 32, 4, 1, 4), "tensor16", "fprop", 1, True)
    tune.tune(CASES[:2], rounds=1, runner=StandIn(bf, mma, best=(128, 32, 32, 4, 1, 5)), progress=None)
    bsmm.config.settings.cache_clear()
    assert shipped("sm90", "tensor16", "sparse", "32", "large") == [128, 32, 32, 4, 1, 5]  # in the device's section
    assert shipped("default", "tensor16", "sparse", "32", "large") == [128, 32, 32, 4, 1, 4]
    assert shipped("sm90", "tma16", "sparse", "64", "large") == [256, 64, 64, 16, 1, 5]


def test_tune_keeps_the_current_tile_unless_it_is_beaten_twice_by_the_margin(cache):
    near = StandIn(ENTRY64, TMA64, best=(128, 64, 64, 8, 1, 4))  # the current tile is the best
    (result,) = tune.tune(CASES[:2], runner=near, progress=None)
    assert result.kept is None and len(near.measured) == 1 and not (cache / "tuned.toml").exists()
    unconfirmed = StandIn(ENTRY64, TMA64, best=(128, 64, 64, 8, 1, 5), confirm_factor=1.2)
    (result,) = tune.tune(CASES[:2], runner=unconfirmed, progress=None)
    assert result.kept is None and result.confirmed > 0.97
    (result,) = tune.tune(CASES[:2], runner=StandIn(ENTRY64, TMA64, best=(128, 64, 64, 8, 1, 5)), margin=0.2,
                          progress=None)
    assert result.kept is None  # 0.95 / 1.05 is not 20 % faster
    wrong = StandIn(ENTRY64, TMA64, best=(128, 64, 64, 8, 1, 5), wrong="fprop at N=7: relative difference 1e+00")
    (result,) = tune.tune(CASES[:2], runner=wrong, progress=None)
    assert result.kept is None and result.rejected.startswith("fprop at N=7") and result.confirmed < 0.97
    assert not (cache / "tuned.toml").exists()


def test_a_kept_tile_is_checked_at_the_edges_of_its_batch_class_and_on_empty_rows_and_columns():
    case = tune.Case("updat", 4096, 1024, 512, 32, 0.25, "bfloat16", 0)
    checked = tune.checking_cases([case, dataclasses.replace(case, density=0.1)], "any")
    assert len(checked) == 2 * 7 * 2 and len(set(checked)) == len(checked)
    assert {c.N for c in checked} == {1, 7, 65, 129, 1000, 4096, 4103}
    assert all(c.C == 1024 and c.K == 512 and c.feature_axis == 0 and c.dtype == "bfloat16" for c in checked)
    small = tune.checking_cases([tune.Case("fprop", 32, 12288, 12288, 32, 0.02, "float16")], "n32")
    assert sorted({c.N for c in small}) == [17, 31, 32] and "empty block rows" in str(small[1])


def test_a_tile_is_tried_only_where_it_fits_every_variant_of_the_entry():
    runner = StandIn(ENTRY64, TMA64, best=(256, 64, 64, 16, 1, 5))
    survey = runner.survey(CASES)
    # A second variant of the entry for which the depth of every tile is wrong (64 floats a row).
    misfit = dataclasses.replace(TMA64, pass_name="bprop", dtype="float32", math="wgmma_tf32")
    assert tune.candidate_tiles(misfit, H100_SHARED) == []
    survey["cases"][1] = {"entry": dataclasses.asdict(ENTRY64), "variant": dataclasses.asdict(misfit)}
    runner.survey = lambda cases: survey
    (result,) = tune.tune(CASES, runner=runner, progress=None, write=False)
    assert result.variants == [TMA64, misfit] and runner.measured == [] and result.kept is None


def test_a_worker_that_dies_costs_its_tile_only(monkeypatch):
    runs = []
    script = [
        ([{"trying": [1]}, {"tile": [1], "ratios": [0.9]}, {"trying": [2]}], 139, "Segmentation fault"),
        ([{"trying": [3]}, {"tile": [3], "error": "CUDA error: illegal address"}], 3, ""),
        ([{"trying": [4]}, {"tile": [4], "ratios": [1.1]}], 0, ""),
    ]

    def run(self, request, on_line):
        lines, status, errors = script[len(runs)]
        runs.append(request["tiles"])
        for line in lines:
            on_line(line)
        return status, errors

    monkeypatch.setattr(tune.Runner, "run_request", run)
    trials = tune.Runner().measure(ENTRY64, [(1,), (2,), (3,), (4,)], CASES)
    assert runs == [[[1], [2], [3], [4]], [[3], [4]], [[4]]]
    assert [t.ratios for t in trials] == [[0.9], None, None, [1.1]]
    assert "died (exit 139): Segmentation fault" in trials[1].error and "illegal address" in trials[2].error
    script[:] = [([], 1, "ImportError: no")]
    runs.clear()
    with pytest.raises(RuntimeError, match=r"(?s)exit 1\).*ImportError"):
        tune.Runner().measure(ENTRY64, [(1,)], CASES)


def test_worker_lines_are_read_as_they_come_and_a_silent_worker_is_killed(monkeypatch):
    """Runner._run against real child processes standing in for the worker."""
    echo = ("import json, sys; request = json.load(sys.stdin); print('not a result line')\n"
            "for tile in request['tiles']: print(json.dumps({'tile': tile, 'ratios': [0.5]}), flush=True)")
    monkeypatch.setattr(tune.Runner, "command", (sys.executable, "-c", echo))
    lines = []
    assert tune.Runner().run_request({"tiles": [[1], [2]]}, lines.append) == (0, "")
    assert lines == [{"tile": [1], "ratios": [0.5]}, {"tile": [2], "ratios": [0.5]}]
    silent = "import json, sys, time; print(json.dumps({'trying': [1]}), flush=True); time.sleep(60)"
    monkeypatch.setattr(tune.Runner, "command", (sys.executable, "-c", silent))
    lines.clear()
    status, errors = tune.Runner(timeout=1).run_request({}, lines.append)
    assert status != 0 and "no result for 1 s" in errors and lines == [{"trying": [1]}]


def test_tune_draws_a_bar_a_round_through_tqdm(tqdm_bars):
    """Each round's tiles advance a ``tqdm.auto`` bar on stderr, drawn only where asked."""
    runner = StandIn(ENTRY64, TMA64, best=(256, 64, 64, 16, 1, 5))
    tune.tune(CASES, rounds=2, runner=runner, progress=None, write=False, bar=True)
    rounds = runner.measured[:-1]  # the last measurement confirms the pick, without a bar
    assert [(b.total, b.steps, b.disable) for b in tqdm_bars] == [(len(tiles), len(tiles), False) for tiles in rounds]
    assert [b.desc for b in tqdm_bars] == [f"[1/1] round {n}" for n in range(1, len(rounds) + 1)]
    tqdm_bars.clear()
    tune.tune(CASES, rounds=1, runner=StandIn(ENTRY64, TMA64, best=(256, 64, 64, 16, 1, 5)), progress=None,
              write=False)
    assert tqdm_bars and all(b.disable for b in tqdm_bars)


def test_command_line_without_a_gpu(cache, monkeypatch, capsys):
    from bsmm.cli import arguments, main as cli

    monkeypatch.setattr(arguments, "gpu_problem", lambda: "CuPy finds no CUDA GPU here")
    assert cli.main(["tune", "--workload", "T"]) == 2
    assert capsys.readouterr().err == "bsmm tune: error: tune measures kernels on a CUDA GPU: CuPy finds no CUDA GPU here\n"
    assert cli.main(["tune", "--dtype", "float64"]) == 2
    assert "argument --dtype: float64 runs on the CPU backend only; expected some of float32, tf32" in (
        capsys.readouterr().err)
    assert cli.main(["tune", "--show"]) == 0 and "no tuned launch tiles" in capsys.readouterr().out
    tuned_file.write_tuned([tune.EntryResult(ENTRY64, [TMA64], CASES[:1], tuple(TMA64.tile.as_list()), kept=(256, 64, 64, 16, 1, 4),
                                       confirmed=0.9)], "Stand-in GPU", "sm90")
    assert cli.main(["tune", "--show"]) == 0 and "[256, 64, 64, 16, 1, 4]" in capsys.readouterr().out
    assert cli.main(["tune", "--reset"]) == 0 and not (cache / "tuned.toml").exists()


def test_tune_cases_follow_the_workload_and_the_arguments():
    import argparse

    from bsmm.cli.arguments import _tune_cases

    def cases(**given):
        arguments = dict(workload=None, N=None, C=None, K=None, block_size=None, densities=None, dtype=None,
                         passes=None, feature_axis=1)
        return _tune_cases(argparse.Namespace(**{**arguments, **given}))

    default = cases()
    shapes = {(c.N, c.C, c.K, c.block_size, c.density, c.dtype) for c in default}
    assert shapes == {(4096, 8192, 8192, 32, 0.1, "float16")}
    assert [c.pass_name for c in default] == ["fprop", "bprop", "updat"]
    assert cases(workload="S", K=4096, block_size=(32, 64), densities=(0.02,), dtype=("tf32",), passes=("updat",),
                 feature_axis=0) == [tune.Case("updat", 32, 12288, 4096, bs, 0.02, "tf32", 0) for bs in (32, 64)]
    assert len(cases(workload="T")) == 3 * 4 * 3 * 4  # passes x dtypes x densities x block sizes
    rectangular = cases(workload="F", block_size=(128,), densities=(0.1,), dtype=("bfloat16",), passes=("fprop",))
    assert [(c.N, c.C, c.K) for c in rectangular] == [(8192, 4096, 16384), (8192, 16384, 4096)]
    assert {(c.C, c.K) for c in cases(workload="F", C=2048)} == {(2048, 2048)}


@pytest.mark.gpu
def test_tune_on_the_gpu(cupy, cache):
    """A short real run: the survey finds the entry of a block-32 fprop, every candidate is
    measured or skipped with a reason, a tile that cannot compile is skipped, and what is kept
    (if anything) computes the same product."""
    case = tune.Case("fprop", 512, 1024, 1024, 32, 0.5, "float16")
    runner = tune.Runner(calls=3, batches=3)
    survey = runner.survey([case])
    assert survey["arch"] == f"sm{cupy.cuda.Device().compute_capability}" and survey["max_shared"] > 48 * 1024
    found = survey["cases"][0]
    assert found["entry"] is not None, "a block-32 fprop takes its tile from the launch tables"
    entry = tune.Entry(**found["entry"])
    tile = Tile.of(found["variant"]["tile"])
    assert tile.as_list() == shipped(entry.section, entry.table, entry.group, entry.block_size, entry.batch)[:6]
    wrong = (tile.bm, 7, *tile.as_list()[2:])  # 7 columns: no kernel
    (bad,) = runner.measure(entry, [wrong + tuple(shipped(entry.section, entry.table, entry.group,
                                                          entry.block_size, entry.batch))[6:]], [case])
    assert bad.ratios is None and bad.error
    (result,) = tune.tune([case], rounds=1, runner=runner, progress=None)
    assert result.trials and all((t.ratios is None) != (t.error is None) for t in result.trials)
    assert all(r > 0 for t in result.trials if t.ratios for r in t.ratios)
    bsmm.config.settings.cache_clear()
    plan_cache.forget_plans()
    layout = bsmm.layouts.random_layout(32, 32, density=0.5, seed=1)
    op = bsmm.BlocksparseMatMul(layout, block_size=32)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 1024)).astype(np.float16)
    w = rng.standard_normal(op.w_shape).astype(np.float16)
    y = op(cupy.asarray(x), cupy.asarray(w)).get().astype(np.float64)
    expected = x.astype(np.float64) @ op.to_dense(w).astype(np.float64)
    assert np.linalg.norm(y - expected) / np.linalg.norm(expected) < 1e-2
    plan_cache.forget_plans()

"""What bsmm tells: kernel compiles, fallbacks and tuned tiles on the "bsmm" logger, once per
cause; warnings where a user should act; and none of it configured by ``import bsmm``. CPU only:
NVRTC compiles without a GPU, and policies and plan notices need none."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import warnings

import pytest

import bsmm
import bsmm.config
from bsmm.backends.cuda import kernels
from bsmm.backends.cuda.policy import Policy


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """Every cause new to the process, a private cache folder (compiled kernels, tuned file) read
    with BSMM_TUNED=1, fresh settings, and the "bsmm" logger recorded from DEBUG up."""
    monkeypatch.setattr(bsmm.config, "_TOLD", set())
    monkeypatch.setenv("BSMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BSMM_TUNED", "1")
    monkeypatch.delenv("BSMM_CONFIG", raising=False)
    for switch in ("BSMM_WGMMA", "BSMM_TMA", "BSMM_PDL"):
        monkeypatch.delenv(switch, raising=False)
    bsmm.config.settings.cache_clear()
    yield tmp_path
    bsmm.config.settings.cache_clear()


def messages(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name.startswith("bsmm.")]


def test_a_kernel_compile_is_logged_with_its_variant_and_time_and_a_cache_hit_at_debug(caplog):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (CuPy) is not installed")
    tile = Policy.from_settings(environ={}).tile("simt", "fprop", 32, 4096, "sm80")
    variant = kernels.Variant("float32", 32, tile, "simt", "fprop", 1, True)
    name = kernels.variant_name(variant)
    assert name.startswith(f"fprop float32 block 32 simt tile {tile.bm}x{tile.bn}x{tile.bk} ")
    caplog.set_level(logging.DEBUG, logger="bsmm")
    try:
        kernels._cached_cubin(variant, "sm_80")
    except RuntimeError as error:
        if "cuda_fp16.h" in str(error):
            pytest.skip(str(error))
        raise
    compiled = messages(caplog, logging.INFO)
    assert len(compiled) == 1 and re.fullmatch(rf"compiled kernel {re.escape(name)} for sm_80 in \d+\.\d\d s .*",
                                               compiled[0])
    assert messages(caplog, logging.DEBUG) == []
    caplog.clear()
    kernels._cached_cubin(variant, "sm_80")  # from the disk cache now
    assert messages(caplog, logging.INFO) == []
    assert [m for m in messages(caplog, logging.DEBUG) if m.startswith(f"kernel {name} for sm_80 from the disk cache")]


def test_switches_turned_off_are_logged_once_per_cause(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="bsmm")
    monkeypatch.setenv("BSMM_WGMMA", "0")
    monkeypatch.setenv("BSMM_TMA", "0")
    policies = [Policy.from_settings() for _ in range(3)]
    assert all(not p.wgmma and not p.tma and p.programmatic for p in policies)
    told = messages(caplog, logging.INFO)
    assert len(told) == 2 and told[0].startswith("BSMM_WGMMA=0: ") and told[1].startswith("BSMM_TMA=0: ")
    caplog.clear()
    monkeypatch.setenv("BSMM_PDL", "0")
    assert not Policy.from_settings().programmatic and not Policy.from_settings().programmatic
    assert [m.split(":")[0] for m in messages(caplog, logging.INFO)] == ["BSMM_PDL=0"]  # the others told already
    caplog.clear()
    kernels_section = {**bsmm.config.settings()["kernels"], "programmatic_launch": False}
    Policy.from_settings(kernels_section, environ={})
    Policy.from_settings(kernels_section, environ={})
    assert [m.split(":")[0] for m in messages(caplog, logging.INFO)] == ["programmatic_launch = false in the settings"]


def test_default_settings_log_no_fallback(caplog):
    caplog.set_level(logging.DEBUG, logger="bsmm")
    policy = Policy.from_settings()
    assert policy.wgmma and policy.tma and caplog.records == []


TUNED = """
[kernels.sm90.tma16.sparse.64]
large = [256, 64, 64, 16, 1, 3]
n64 = [128, 64, 64, 8, 1, 4]

[tuned."sm90.tma16.sparse.64.large"]
device = "NVIDIA H200"
"""


def test_tuned_tiles_in_effect_are_logged_when_read_and_when_ignored(fresh, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="bsmm")
    path = fresh / "tuned.toml"
    path.write_text(TUNED)
    assert bsmm.config.settings()["kernels"]["sm90"]["tma16"]["sparse"]["64"]["n64"] == [128, 64, 64, 8, 1, 4]
    assert messages(caplog, logging.INFO) == [
        f"2 tuned launch tiles in effect (sm90) from {path}, read over bsmm.toml (BSMM_TUNED=0 ignores them)"]
    caplog.clear()
    for _ in range(2):  # read again (each overriding() does): the same file is not told again
        with bsmm.config.overriding({"defaults": {"block_size": 64}}):
            bsmm.config.settings()
    assert messages(caplog, logging.INFO) == []
    monkeypatch.setenv("BSMM_TUNED", "0")
    for _ in range(2):
        bsmm.config.settings.cache_clear()
        assert bsmm.config.settings().get("tuned", {}) == {}
    assert messages(caplog, logging.INFO) == [
        f"BSMM_TUNED=0: the tuned launch tiles in {path} are ignored; bsmm.toml's are used"]


def test_keys_a_tuned_file_may_not_set_are_warned_about_at_the_users_line(fresh):
    (fresh / "tuned.toml").write_text("[kernels]\nwaves = 99\n" + TUNED)
    with pytest.warns(bsmm.BsmmWarning, match=r"tuned\.toml sets \[kernels\] keys \['waves'\].*BSMM_CONFIG") as caught:
        waves = bsmm.config.settings()["kernels"]["waves"]
    assert waves != 99 and caught[0].filename == __file__
    bsmm.config.settings.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bsmm.config.settings()  # the same file: warned once


def test_plan_notices_are_logged_once_and_tuned_tiles_of_another_gpu_warned_about(fresh, caplog, monkeypatch):
    plans = pytest.importorskip("bsmm.backends.cuda.plan_cache", reason="CuPy is not installed")
    caplog.set_level(logging.INFO, logger="bsmm")
    for _ in range(3):
        plans._tell_once("sm80", False, 0)
        plans._tell_once("sm90", True, 0)
    told = messages(caplog, logging.INFO)
    assert len(told) == 2 and told[0].startswith("sm80: the wgmma and TMA kernels are built for Hopper")
    assert "programmatic launches need sm_90" in told[0] and told[1].startswith("a pass reads operands that are not")
    (fresh / "tuned.toml").write_text(TUNED)
    bsmm.config.settings.cache_clear()
    monkeypatch.setattr(plans, "_device_name", lambda device_id: "NVIDIA H100 80GB HBM3")
    with pytest.warns(bsmm.BsmmWarning, match=r"measured on NVIDIA H200, not on this NVIDIA H100 80GB HBM3.*"
                                              r"BSMM_TUNED=0") as caught:
        plans._tell_once("sm90", True, 0)
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plans._tell_once("sm90", True, 0)  # once a process
        monkeypatch.setattr(bsmm.config, "_TOLD", set())
        monkeypatch.setattr(plans, "_device_name", lambda device_id: "NVIDIA H200")
        plans._tell_once("sm90", True, 0)  # the GPU the tiles were measured on


def test_warn_points_at_the_first_line_outside_bsmm():
    with pytest.warns(bsmm.BsmmWarning, match="act") as caught:
        bsmm.config.warn("act")
    assert caught[0].filename == __file__


def test_import_bsmm_configures_no_logging_and_imports_no_progress_bars():
    code = ("import json, logging, sys, bsmm; "
            "print(json.dumps({'tqdm': 'tqdm' in sys.modules, 'root': len(logging.getLogger().handlers), "
            "'bsmm': [type(h).__name__ for h in logging.getLogger('bsmm').handlers], "
            "'level': logging.getLogger('bsmm').level}))")
    found = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout)
    assert found == {"tqdm": False, "root": 0, "bsmm": ["NullHandler"], "level": logging.NOTSET}

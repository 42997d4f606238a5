"""Where bsmm's data files are, and the settings read from ``bsmm.toml``.

The CUDA sources (``cuda/``) and ``bsmm.toml`` sit at the repository root in a
source checkout and under ``bsmm/data/`` in an installed wheel (``setup.cfg``
maps them there); :data:`DATA_DIR` is whichever of the two holds them.
"""

from __future__ import annotations

import functools
import os
import tomllib
from pathlib import Path
from typing import Any

__all__ = ["DATA_DIR", "CUDA_DIR", "settings"]


def _find_data_dir() -> Path:
    package_dir = Path(__file__).resolve().parent
    for candidate in (package_dir / "data", package_dir.parent):
        if (candidate / "bsmm.toml").is_file() and (candidate / "cuda").is_dir():
            return candidate
    raise RuntimeError(
        f"bsmm's data files (bsmm.toml, cuda/) were found neither in {package_dir / 'data'} "
        f"nor in {package_dir.parent}; the installation is incomplete"
    )


DATA_DIR = _find_data_dir()
CUDA_DIR = DATA_DIR / "cuda"


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@functools.cache
def settings() -> dict[str, Any]:
    """The merged configuration: ``bsmm.toml``, then the file in ``$BSMM_CONFIG``.

    Examples
    --------
    >>> import bsmm.config
    >>> bsmm.config.settings()["defaults"]["block_size"]
    32
    """
    with open(DATA_DIR / "bsmm.toml", "rb") as f:
        merged = tomllib.load(f)
    user_file = os.environ.get("BSMM_CONFIG")
    if user_file:
        with open(user_file, "rb") as f:
            merged = _merge(merged, tomllib.load(f))
    return merged

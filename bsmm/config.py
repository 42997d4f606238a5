"""Where bsmm's data files are, and the settings read from ``bsmm.toml``.

The CUDA sources (``cuda/``) and ``bsmm.toml`` sit at the repository root in a
source checkout and under ``bsmm/data/`` in an installed wheel (``setup.cfg``
maps them there); :data:`DATA_DIR` is whichever of the two holds them.

Settings are layered: ``bsmm.toml``; the launch-table entries ``python -m bsmm
tune`` measured on this machine (:func:`tuned_path`, skipped with ``BSMM_TUNED=0``);
the file named by ``$BSMM_CONFIG``; layers pushed by :func:`overriding`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Iterator

__all__ = ["DATA_DIR", "CUDA_DIR", "cache_dir", "overriding", "settings", "tuned_path"]


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


def cache_dir() -> Path:
    """bsmm's per-user cache: ``$BSMM_CACHE_DIR``, else ``$XDG_CACHE_HOME/bsmm`` (``~/.cache/bsmm``).

    Compiled kernels live in its ``kernels/`` folder, tuned launch-table entries in
    :func:`tuned_path`. Nothing is created here.
    """
    root = os.environ.get("BSMM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "bsmm"
    )
    return Path(root)


def tuned_path() -> Path:
    """The launch-table entries ``python -m bsmm tune`` wrote for this machine (may not exist).

    Examples
    --------
    >>> import bsmm.config
    >>> bsmm.config.tuned_path().name
    'tuned.toml'
    """
    return cache_dir() / "tuned.toml"


#: Sections of ``[kernels]`` a tuned file may set: one architecture's launch tables ("sm90").
_ARCH_SECTION = re.compile(r"sm\d+")


def _tuned_layer() -> dict:
    path = tuned_path()
    if os.environ.get("BSMM_TUNED", "1") == "0" or not path.is_file():
        return {}
    try:
        with open(path, "rb") as f:
            tuned = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise RuntimeError(f"cannot read the tuned launch tables {path}: {error}; "
                           "`python -m bsmm tune --reset` removes them") from error
    # Only launch tables of an architecture: a tuned file never changes thresholds or defaults.
    kernels = {key: value for key, value in tuned.get("kernels", {}).items() if _ARCH_SECTION.fullmatch(key)}
    return {"kernels": kernels, "tuned": tuned.get("tuned", {})}


_OVERRIDES: list[dict] = []


@contextlib.contextmanager
def overriding(layer: dict) -> Iterator[None]:
    """Settings with ``layer`` merged over them for the duration. The GPU planner's policy follows
    (:func:`bsmm.backends.cuda.policy.current_policy`); to force a kernel path, pass a policy to
    :func:`bsmm.backends.cuda.policy.planning` instead.

    Examples
    --------
    >>> import bsmm.config
    >>> with bsmm.config.overriding({"defaults": {"block_size": 64}}):
    ...     bsmm.config.settings()["defaults"]["block_size"]
    64
    >>> bsmm.config.settings()["defaults"]["block_size"]
    32
    """
    _OVERRIDES.append(layer)
    settings.cache_clear()
    try:
        yield
    finally:
        _OVERRIDES.remove(layer)
        settings.cache_clear()


@functools.cache
def settings() -> dict[str, Any]:
    """The merged configuration: ``bsmm.toml``, tuned launch tables (:func:`tuned_path`), the
    file in ``$BSMM_CONFIG``, then any :func:`overriding` layers.

    Examples
    --------
    >>> import bsmm.config
    >>> bsmm.config.settings()["defaults"]["block_size"]
    32
    """
    with open(DATA_DIR / "bsmm.toml", "rb") as f:
        merged = tomllib.load(f)
    merged = _merge(merged, _tuned_layer())
    user_file = os.environ.get("BSMM_CONFIG")
    if user_file:
        with open(user_file, "rb") as f:
            merged = _merge(merged, tomllib.load(f))
    for layer in _OVERRIDES:
        merged = _merge(merged, layer)
    return merged

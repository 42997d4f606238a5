"""Where bsmm's data files are, and the settings read from ``bsmm.toml``.

The CUDA sources (``cuda/``) and ``bsmm.toml`` sit at the repository root in a
source checkout and under ``bsmm/data/`` in an installed wheel (``setup.cfg``
maps them there); :data:`DATA_DIR` is whichever of the two holds them.

Settings are layered: ``bsmm.toml``; the launch-table entries ``python -m bsmm
tune`` measured on this machine (:func:`tuned_path`, skipped with ``BSMM_TUNED=0``);
the file named by ``$BSMM_CONFIG``; layers pushed by :func:`overriding`.

What bsmm does on its own (kernel compiles, fallbacks, tuned tiles in effect) is logged to the
``"bsmm"`` logger; what a user should act on is a :class:`BsmmWarning`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
import threading
import tomllib
import warnings
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Iterator

__all__ = ["DATA_DIR", "CUDA_DIR", "BsmmWarning", "cache_dir", "once", "overriding", "settings", "tuned_path",
           "warn"]

_log = logging.getLogger(__name__)


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
# As code objects name their files (not resolved: a symlinked install keeps its path).
_PACKAGE_DIR = os.path.dirname(__file__) + os.sep


class BsmmWarning(UserWarning):
    """What bsmm warns about: something a user should act on (``warnings.filterwarnings("ignore",
    category=bsmm.BsmmWarning)`` silences them all)."""


def warn(message: str, category: type[Warning] = BsmmWarning, also_skip: tuple[str, ...] = ()) -> None:
    """``warnings.warn`` pointing at the user's line: the first caller outside the bsmm package
    and outside the folders ``also_skip`` (a framework that calls bsmm while tracing, e.g. JAX's).

    Examples
    --------
    >>> import warnings, bsmm.config
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     bsmm.config.warn("act on this")
    >>> caught[0].category.__name__, str(caught[0].message)
    ('BsmmWarning', 'act on this')
    """
    skipped = (_PACKAGE_DIR, *also_skip)
    frame, level = sys._getframe(1), 2  # level 2: warn's caller
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


_TOLD: set = set()
_TOLD_LOCK = threading.Lock()  # plans are also built on other threads (PyTorch's autograd engine)


def once(cause: Hashable) -> bool:
    """True the first time this process asks about ``cause``: a fallback is logged (or warned
    about) once, where settings are read or plans built, never on each call.

    Examples
    --------
    >>> import bsmm.config
    >>> [bsmm.config.once(("doctest", "example")) for _ in range(2)]
    [True, False]
    """
    with _TOLD_LOCK:
        if cause in _TOLD:
            return False
        _TOLD.add(cause)
        return True


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
    if not path.is_file():
        return {}
    if os.environ.get("BSMM_TUNED", "1") == "0":
        if once(("tuned ignored", str(path))):
            _log.info("BSMM_TUNED=0: the tuned launch tiles in %s are ignored; bsmm.toml's are used", path)
        return {}
    try:
        with open(path, "rb") as f:
            tuned = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise RuntimeError(f"cannot read the tuned launch tables {path}: {error}; "
                           "`python -m bsmm tune --reset` removes them") from error
    # Only launch tables of an architecture: a tuned file never changes thresholds or defaults.
    kernels = {key: value for key, value in tuned.get("kernels", {}).items() if _ARCH_SECTION.fullmatch(key)}
    # Told again only when the file changes (settings are read again at each overriding()).
    if once(("tuned read", str(path), path.stat().st_mtime_ns)):
        ignored = sorted(set(tuned.get("kernels", {})) - set(kernels))
        if ignored:
            warn(f"{path} sets [kernels] keys {ignored}, which a tuned file may not set (only architecture "
                 "sections such as sm90): they are ignored; put them in the file named by $BSMM_CONFIG")
        _log.info("%d tuned launch tiles in effect (%s) from %s, read over bsmm.toml (BSMM_TUNED=0 ignores them)",
                  _count_entries(kernels), ", ".join(sorted(kernels)) or "no architecture", path)
    return {"kernels": kernels, "tuned": tuned.get("tuned", {})}


def _count_entries(tables: dict) -> int:
    """Launch-table entries (lists of numbers) in nested tables."""
    return sum(_count_entries(value) if isinstance(value, dict) else 1 for value in tables.values())


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

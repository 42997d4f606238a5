"""Doctest collection of the package: adapter modules whose framework is missing are skipped.

The adapter packages ``bsmm/torch``, ``bsmm/jax`` and ``bsmm/tf`` import their framework on import
(``import bsmm`` does not); where it is not installed their doctests cannot run, and importing them
raises ImportError.
"""

import importlib.util
import os

_ADAPTERS = {
    "bsmm/torch": "torch",
    "bsmm/jax": "jax",
    "bsmm/tf": "tensorflow",
    "bsmm/flax.py": "flax",
    "bsmm/equinox.py": "equinox",
    "bsmm/keras.py": "keras",
}

collect_ignore = [path for path, module in _ADAPTERS.items() if importlib.util.find_spec(module) is None]

# Tests measure the launch tables bsmm.toml ships, never tiles `bsmm tune` kept on this machine.
os.environ["BSMM_TUNED"] = "0"

"""Doctest collection of the package: adapter modules whose framework is missing are skipped.

``bsmm/torch/__init__.py`` and friends import their framework on import (``import bsmm`` does not);
where it is not installed their doctests cannot run, and importing them raises ImportError.
"""

import importlib.util
import os

_ADAPTERS = {
    "bsmm/torch/__init__.py": "torch",
    "bsmm/torch/ops.py": "torch",
    "bsmm/torch/conv_ops.py": "torch",
    "bsmm/jax/__init__.py": "jax",
    "bsmm/jax/passes.py": "jax",
    "bsmm/tf.py": "tensorflow",
}

collect_ignore = [path for path, module in _ADAPTERS.items() if importlib.util.find_spec(module) is None]

# Tests measure the launch tables bsmm.toml ships, never tiles `bsmm tune` kept on this machine.
os.environ["BSMM_TUNED"] = "0"

"""The element-type table (bsmm.dtypes.ELEMENT_TYPES) is the one source of every dtype list."""

import re

import numpy as np

from bsmm.backends.cuda.kernels import C_TYPES, ELEMENT_BYTES
from bsmm.config import CUDA_DIR
from bsmm.dtypes import CPU_ONLY_DTYPES, DTYPE_NAMES, ELEMENT_TYPES, SUPPORTED_DTYPES


def test_table_drives_the_dtype_lists():
    gpu = [t for t in ELEMENT_TYPES.values() if not t.cpu_only]
    assert SUPPORTED_DTYPES == {t.name: t.numpy for t in gpu}
    assert CPU_ONLY_DTYPES == {t.name: t.numpy for t in ELEMENT_TYPES.values() if t.cpu_only}
    assert C_TYPES == {t.name: t.c_type for t in gpu}
    assert ELEMENT_BYTES == {t.name: t.numpy.itemsize for t in gpu}
    assert DTYPE_NAMES == {t.numpy: t.name for t in gpu}
    # Order matters (error messages list the names in it), and so do the exact values.
    assert list(SUPPORTED_DTYPES) == ["float32", "float16", "bfloat16"]
    assert list(CPU_ONLY_DTYPES) == ["float64"]
    assert C_TYPES == {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
    assert ELEMENT_BYTES == {"float32": 4, "float16": 2, "bfloat16": 2}
    assert CPU_ONLY_DTYPES["float64"] == np.float64


def test_table_keys_are_names():
    assert all(name == t.name for name, t in ELEMENT_TYPES.items())
    assert all(t.numpy.name == t.name for t in ELEMENT_TYPES.values())


def test_every_gpu_dtype_has_an_element_type_in_the_cuda_sources():
    sources = "\n".join(path.read_text() for path in sorted(CUDA_DIR.glob("*.cu*")))
    specialized = set(re.findall(r"template\s*<>\s*struct\s+Elem<\s*([\w:]+)\s*>", sources))
    for name in SUPPORTED_DTYPES:
        assert ELEMENT_TYPES[name].c_type in specialized, name
    assert set(C_TYPES.values()) <= specialized

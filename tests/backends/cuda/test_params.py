"""The kernel's parameter struct and its host mirror agree field for field (cuda/bsmm_params.cuh,
bsmm.backends.cuda.params), and a launch's values land in the fields that name them."""

from __future__ import annotations

import ctypes
import re
import struct

import pytest

from bsmm.backends.cuda import params
from bsmm.config import CUDA_DIR

# (type, name) of each field declared in the header's struct MatmulParams.
_FIELD = re.compile(r"^\s*((?:const\s+)?(?:long\s+long|[\w:]+)\s*\**)\s*(\w+);", re.M)


def _header_fields() -> list[tuple[str, str]]:
    text = (CUDA_DIR / "bsmm_params.cuh").read_text(encoding="utf-8")
    body = text[text.index("struct MatmulParams {"):text.index("};", text.index("struct MatmulParams {"))]
    return [(kind.replace(" ", ""), name) for kind, name in _FIELD.findall(body)]


def test_the_header_and_the_host_struct_have_the_same_fields_in_order():
    header = _header_fields()
    assert [name for _, name in header] == list(params.FIELDS)
    assert [name for name, _ in params.MatmulParams._fields_] == list(params.FIELDS)
    for (kind, name), (_, host_type) in zip(header, params.MatmulParams._fields_):
        # Every field is 8 bytes: pointers on the host are unsigned, sizes and flags signed 64-bit.
        assert kind.endswith("*") or kind == "longlong", f"{name}: {kind} is not 8 bytes"
        assert ctypes.sizeof(host_type) == 8
        assert (host_type is ctypes.c_uint64) == kind.endswith("*"), name
    assert ctypes.sizeof(params.MatmulParams) == 8 * len(params.FIELDS)


def test_values_fill_the_fields_that_name_them():
    sizes = params.Sizes(n_rows=33, ld_act=96, ld_other=0, ld_out=160, out_blocks=5)
    scratch = (0x10, 0x20, 0x30, 0x40, 0x50)
    values = params.values(0x1000, 0x2000, 0x3000, scratch, 0x4000, 0x5000, sizes, 1, 8, 0x6000)
    block = params.MatmulParams()
    params.PACK(block, 0, *values)
    expected = {"act": 0x1000, "other": 0x2000, "out": 0x3000, "segments": 0x10, "units": 0x20, "table": 0x30,
                "workspace": 0x40, "counters": 0x50, "bias": 0x4000, "pre": 0x5000, "n_rows": 33, "ld_act": 96,
                "ld_other": 0, "ld_out": 160, "out_blocks": 5, "accumulate": 1, "band_rows": 8, "gate": 0x6000}
    assert {name: getattr(block, name) for name in params.FIELDS} == expected
    assert struct.unpack(f"<{len(params.FIELDS)}Q", bytes(block)) == values


def test_a_launch_packs_one_struct_and_points_at_it():
    """A matmul launcher's kernelParams hold one pointer, to the struct, then the tensor maps'."""
    plans = pytest.importorskip("bsmm.backends.cuda.plans", reason="CuPy is not installed")

    class Kernel:  # what Launcher reads of a loaded kernel
        class kernel:
            ptr = 0x1234

    launcher = plans.Launcher(Kernel, (1, 1, 1), 128, 0, map_count=3)
    assert isinstance(launcher.values, params.MatmulParams)
    assert len(launcher.pointers) == 4 and launcher.pointers[0] == ctypes.addressof(launcher.values)
    copy = plans.Launcher(Kernel, (1, 1, 1), 128, 0, 5)  # a copy kernel: five 8-byte parameters
    assert len(copy.pointers) == 5

"""``bsmm.backends.cuda.launches`` builds ``cuLaunchKernelEx``'s structures with ctypes: their layout must be
the driver header's, byte for byte (a wrong offset would launch with a wrong grid or stream)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from bsmm.backends.cuda import launches
from bsmm.backends.cuda.kernels import cuda_include_dirs

PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
int main(void) {
    printf("%zu %zu %zu %zu %zu %zu %d\n", sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, hStream),
           offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs), sizeof(CUlaunchAttribute),
           offsetof(CUlaunchAttribute, value), (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
    return 0;
}
"""


def header_layout(tmp_path: Path) -> list[int]:
    compiler = shutil.which("cc") or shutil.which("gcc")
    headers = [d for d in cuda_include_dirs() if (Path(d) / "cuda.h").is_file()]
    if compiler is None or not headers:
        pytest.skip("needs a C compiler and cuda.h (the NVIDIA wheels or a CUDA toolkit)")
    source, program = tmp_path / "probe.c", tmp_path / "probe"
    source.write_text(PROBE)
    subprocess.run([compiler, f"-I{headers[0]}", str(source), "-o", str(program)], check=True)
    return [int(v) for v in subprocess.run([str(program)], check=True, capture_output=True, text=True).stdout.split()]


def test_launch_structures_match_the_driver_header(tmp_path):
    config, attribute = launches._Config, launches._Attribute
    assert header_layout(tmp_path) == [
        ctypes.sizeof(config), config.stream.offset, config.attributes.offset, config.attribute_count.offset,
        ctypes.sizeof(attribute), attribute.value.offset, launches._PROGRAMMATIC_STREAM_SERIALIZATION]


def test_a_configuration_holds_grid_block_and_stream():
    # (no driver is loaded before a launch: this runs on a CPU machine)
    launch = launches.SerializedLaunch(0x1234, (7, 2, 1), (160, 1, 1), 4096, 0xABC0)
    config = launch.config
    assert (config.grid_x, config.grid_y, config.grid_z, config.block_x, config.block_y, config.block_z) == (
        7, 2, 1, 160, 1, 1)
    assert (config.shared_bytes, config.stream, config.attribute_count) == (4096, 0xABC0, 1)
    assert config.attributes.contents.id == launches._PROGRAMMATIC_STREAM_SERIALIZATION
    assert config.attributes.contents.value[0] == 1
    by_ref, function, parameters, extra = launch.arguments(0x5000)
    assert (function.value, parameters.value, extra) == (0x1234, 0x5000, None)

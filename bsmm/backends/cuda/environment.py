"""Whether the installed CuPy can run on this machine's NVIDIA driver, checked once at the first GPU use.

A CuPy wheel is built for one CUDA major version (``cupy-cuda12x``, ``cupy-cuda13x``), and a driver
runs CUDA versions up to its own (``nvidia-smi`` prints it as "CUDA Version"). A CuPy newer than
the driver fails its first call with a bare ``cudaErrorInsufficientDriver``;
:func:`check_environment` raises instead an error that names both versions and the bsmm extra to
install. Two CuPy wheels in one environment write over each other's files, which breaks CuPy in
ways that point nowhere near the cause: that is warned about.

CUDA versions are encoded as ``1000 * major + 10 * minor``:

>>> cuda_version_text(12080)
'12.8'
"""

from __future__ import annotations

import functools
import re

from bsmm.config import warn

__all__ = ["EXTRAS", "MINIMUM_DRIVERS", "check_environment", "check_gpu", "cuda_version_text", "cupy_distributions",
           "driver_problem"]

#: CUDA major version -> the bsmm extra that installs CuPy, NVRTC and the runtime headers for it.
EXTRAS = {12: "cuda12", 13: "cuda13"}
#: CUDA major version -> the oldest NVIDIA driver (Linux) that runs it (minor-version compatibility).
MINIMUM_DRIVERS = {12: "525", 13: "580"}

# Distributions that install the `cupy` package: CUDA wheels, ROCm wheels, the source build.
_CUPY_DISTRIBUTION = re.compile(r"cupy(-cuda\d+x|-rocm-[\d-]+)?")


def cuda_version_text(version: int) -> str:
    """``12080`` -> ``"12.8"``: a CUDA version as CUDA's API encodes it, as people write it."""
    return f"{version // 1000}.{version % 1000 // 10}"


def driver_problem(runtime_version: int, driver_version: int) -> str:
    """Why CuPy, built for CUDA ``runtime_version``, cannot run on a driver of CUDA
    ``driver_version``, or ``""`` where it can. A driver version of 0 means no driver is loaded
    (a machine without a GPU): nothing to compare, and CuPy's own error says so at its first call.

    Examples
    --------
    >>> driver_problem(12090, 12020)  # a newer CUDA 12 on an older 12.x driver: minor-version compatible
    ''
    >>> print(driver_problem(13000, 12080))  # doctest: +ELLIPSIS
    CuPy is built for CUDA 13.0 but the NVIDIA driver supports CUDA up to 12.8 ...
    """
    runtime_major, driver_major = runtime_version // 1000, driver_version // 1000
    if driver_version == 0 or runtime_major <= driver_major:
        return ""
    needed = MINIMUM_DRIVERS.get(runtime_major)
    upgrade = f"upgrade the NVIDIA driver to {needed} or newer" if needed else "upgrade the NVIDIA driver"
    if driver_major in EXTRAS:
        remedy = (f"install the CuPy of the driver's CUDA: pip uninstall cupy-cuda{runtime_major}x && "
                  f"pip install 'bsmm[{EXTRAS[driver_major]}]', or {upgrade}")
    else:
        remedy = f"{upgrade} (bsmm's GPU backend needs CUDA {min(EXTRAS)} or newer)"
    return (f"CuPy is built for CUDA {cuda_version_text(runtime_version)} but the NVIDIA driver supports "
            f"CUDA up to {cuda_version_text(driver_version)} (see `nvidia-smi`); {remedy}")


def cupy_distributions() -> list[str]:
    """Names of the installed distributions that provide the ``cupy`` package, sorted.

    Examples
    --------
    >>> all(name.startswith("cupy") for name in cupy_distributions())
    True
    """
    import importlib.metadata  # here: `import bsmm` reaches this module and should stay quick

    names = set()
    for distribution in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", distribution.metadata["Name"] or "").lower()
        if _CUPY_DISTRIBUTION.fullmatch(name):
            names.add(name)
    return sorted(names)


def _cuda_versions() -> tuple[int, int]:
    """(CUDA version CuPy's runtime is built for, newest CUDA version the driver supports)."""
    try:
        from cupy.cuda import runtime
    except ImportError as error:  # a GPU array reached bsmm, but CuPy is not (or not wholly) installed
        raise RuntimeError(f"bsmm runs GPU arrays through CuPy, which cannot be imported ({error}): "
                           "pip install 'bsmm[cuda12]' (CUDA 12 driver) or 'bsmm[cuda13]' (CUDA 13 driver)") from error

    return runtime.runtimeGetVersion(), runtime.driverGetVersion()


@functools.cache
def check_environment() -> None:
    """Warn if several CuPy wheels are installed; raise RuntimeError if CuPy cannot be imported or
    its CUDA major version is newer than the driver's. Runs its checks once per process (about 30 ms, most of it reading
    the installed distributions); a failed check runs again at the next call.

    Raises
    ------
    RuntimeError
        If CuPy is missing, or needs a newer driver (naming both CUDA versions and the extra to
        install: the message of :func:`driver_problem`).
    """
    wheels = cupy_distributions()
    if len(wheels) > 1:
        warn(f"several CuPy distributions are installed ({', '.join(wheels)}); they overwrite each other's "
             f"files: keep the one of your driver's CUDA (`pip uninstall {' '.join(wheels)}`, then "
             f"pip install 'bsmm[cuda12]' or 'bsmm[cuda13]')")
    problem = driver_problem(*_cuda_versions())
    if problem:
        raise RuntimeError(problem)


def check_gpu() -> str:
    """Whether bsmm's GPU backend can run here: one line naming CuPy, the CUDA versions, NVRTC and
    the GPU; or a RuntimeError saying why not and what to install. Call it first after installing a
    CUDA extra: with a CuPy newer than the driver, CuPy's own first call (``cupy.ones``) fails with a
    bare ``cudaErrorInsufficientDriver``, before bsmm sees any array.

    Examples
    --------
    >>> import bsmm
    >>> try:
    ...     line = bsmm.check_gpu()
    ... except RuntimeError as error:
    ...     line = f"no GPU backend here: {error}"
    >>> line.startswith(("CuPy ", "no GPU backend here: "))
    True
    """
    check_environment()
    runtime_version, driver_version = _cuda_versions()
    if driver_version == 0:
        raise RuntimeError("no NVIDIA driver is loaded (a machine without a GPU, or a container started "
                           "without one): bsmm runs on its CPU backend")
    import cupy
    from cupy_backends.cuda.libs import nvrtc

    if cupy.cuda.runtime.getDeviceCount() == 0:
        raise RuntimeError("the NVIDIA driver sees no GPU (nvidia-smi lists them): bsmm runs on its CPU backend")
    device = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"].decode()
    return (f"CuPy {cupy.__version__} (CUDA {cuda_version_text(runtime_version)}), driver for CUDA up to "
            f"{cuda_version_text(driver_version)}, NVRTC {'.'.join(map(str, nvrtc.getVersion()))}; "
            f"GPU {device.id}: {name} (sm_{device.compute_capability})")


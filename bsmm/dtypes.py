"""The one table of element types bsmm supports (:data:`ELEMENT_TYPES`), and what is derived from it.

Every other list of dtypes in the package is built from :data:`ELEMENT_TYPES`: the NumPy dtypes
accepted on every backend (:data:`SUPPORTED_DTYPES`) and on the CPU only (:data:`CPU_ONLY_DTYPES`),
the CUDA backend's ``C_TYPES`` and ``ELEMENT_BYTES`` (:mod:`bsmm.backends.cuda.kernels`), and the
kinds of arithmetic results are checked by, with their tolerances (:data:`KIND_DTYPES`,
:data:`TOLERANCES`, :data:`GPU_KINDS`: the test suite, ``tools/gpu``, ``bsmm tune``).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

__all__ = ["ElementType", "ELEMENT_TYPES", "SUPPORTED_DTYPES", "CPU_ONLY_DTYPES", "DTYPE_NAMES", "KIND_DTYPES",
           "TOLERANCES", "GPU_KINDS", "canonical_dtype"]


@dataclasses.dataclass(frozen=True)
class ElementType:
    """One element type bsmm computes on.

    Examples
    --------
    >>> t = ELEMENT_TYPES["bfloat16"]
    >>> t.numpy, t.c_type, t.element_bytes, t.cpu_only
    (dtype(bfloat16), '__nv_bfloat16', 2, False)
    >>> t.tolerance, t.tf32_tolerance
    (0.02, None)
    >>> t.uint, hex(t.nan_bits), hex(t.exponent_mask)
    (dtype('uint16'), '0x7fc0', '0x7f80')
    >>> ELEMENT_TYPES["float32"].tf32_tolerance
    0.002
    >>> ELEMENT_TYPES["float64"].cpu_only
    True
    """

    name: str  # the name users and launch tables give it ("bfloat16")
    numpy: np.dtype  # its NumPy dtype
    # The element type of the CUDA kernel templates (``Elem<...>`` in cuda/bsmm_common.cuh), or None
    # where no GPU kernel exists: the type then runs on the CPU backend only.
    c_type: str | None
    # Norm-wise relative (Frobenius) error a pass's result in this type may have against the float64
    # product of the same inputs: float32 arithmetic plus one rounding of the result to the type
    # (float16 2**-11, bfloat16 2**-8); float64 is computed in float64 throughout.
    tolerance: float
    # The same where float32 data are multiplied on TF32 tensor cores (``tf32=True``: operands
    # rounded to 2**-11), or None where the type has no TF32 mode.
    tf32_tolerance: float | None = None

    @property
    def element_bytes(self) -> int:
        """Bytes an element (the NumPy dtype's itemsize)."""
        return self.numpy.itemsize

    @property
    def cpu_only(self) -> bool:
        """True where only the CPU backend computes in this type (no CUDA kernel exists for it)."""
        return self.c_type is None

    @property
    def uint(self) -> np.dtype:
        """The unsigned integer dtype of the element's size, to view, copy or fill elements bitwise
        (e.g. where an array library has no kernels for the type)."""
        return np.dtype(f"uint{8 * self.element_bytes}")

    @property
    def nan_bits(self) -> int:
        """The bits of a positive quiet NaN: what outputs are poisoned with before a pass writes them."""
        return int(np.array(np.nan, self.numpy).view(self.uint))

    @property
    def exponent_mask(self) -> int:
        """The bits of the exponent field (also +Inf's bits): an element is NaN or Inf where all are set."""
        return int(np.array(np.inf, self.numpy).view(self.uint))


#: name -> :class:`ElementType`, the one place a dtype's facts are written down. Order matters:
#: error messages list the names in it. bfloat16 comes from ml_dtypes, the type NumPy-side code
#: (JAX, TensorFlow) already uses for it. float64 is computed and accumulated in float64 on the
#: CPU backend, for gradient checks by finite differences.
ELEMENT_TYPES: dict[str, ElementType] = {t.name: t for t in (
    ElementType("float32", np.dtype(np.float32), "float", 1e-5, tf32_tolerance=2e-3),
    ElementType("float16", np.dtype(np.float16), "__half", 1e-2),
    ElementType("bfloat16", np.dtype(ml_dtypes.bfloat16), "__nv_bfloat16", 2e-2),
    ElementType("float64", np.dtype(np.float64), None, 1e-12),
)}

#: name -> NumPy dtype, on every backend (the types of :data:`ELEMENT_TYPES` with a CUDA kernel).
SUPPORTED_DTYPES: dict[str, np.dtype] = {name: t.numpy for name, t in ELEMENT_TYPES.items() if not t.cpu_only}

#: name -> NumPy dtype run by the CPU backend only (no GPU kernel exists for it): float64.
CPU_ONLY_DTYPES: dict[str, np.dtype] = {name: t.numpy for name, t in ELEMENT_TYPES.items() if t.cpu_only}

#: dtype -> name of :data:`SUPPORTED_DTYPES`, for hot paths (``str(dtype)`` is slow in NumPy).
DTYPE_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in SUPPORTED_DTYPES.items()}

#: Kind of arithmetic -> name of the element type of its data: each type of :data:`ELEMENT_TYPES`
#: by its own name, each followed by "tf32" where it has a TF32 mode (float32 data on TF32 tensor
#: cores, ``tf32=True``). Order: the table's (seeds and draws of the GPU tools depend on it).
KIND_DTYPES: dict[str, str] = {
    kind: t.name
    for t in ELEMENT_TYPES.values()
    for kind in (t.name, *(("tf32",) if t.tf32_tolerance is not None else ()))
}

#: Kind of arithmetic (a key of :data:`KIND_DTYPES`) -> the norm-wise relative error its results may
#: have against a float64 reference (:attr:`ElementType.tolerance`, :attr:`ElementType.tf32_tolerance`).
TOLERANCES: dict[str, float] = {
    kind: ELEMENT_TYPES[name].tolerance if kind == name else ELEMENT_TYPES[name].tf32_tolerance
    for kind, name in KIND_DTYPES.items()
}

#: The kinds of :data:`KIND_DTYPES` that run on the GPU: float32, tf32, float16, bfloat16.
GPU_KINDS: tuple[str, ...] = tuple(kind for kind, name in KIND_DTYPES.items() if not ELEMENT_TYPES[name].cpu_only)

_ALL_DTYPES: dict[str, np.dtype] = {**SUPPORTED_DTYPES, **CPU_ONLY_DTYPES}
_ALL_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in _ALL_DTYPES.items()}


def _known_name(dtype) -> str | None:
    """The name in :data:`SUPPORTED_DTYPES` or :data:`CPU_ONLY_DTYPES` of ``dtype``, or None."""
    try:
        name = _ALL_NAMES.get(dtype)  # the common case: already a NumPy dtype
    except TypeError:  # unhashable: certainly not a dtype
        return None
    if name is not None or dtype is None:  # np.dtype(None) would be float64
        return name
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        return None
    for known, candidate in _ALL_DTYPES.items():
        if resolved == candidate:
            return known
    return None


def canonical_dtype(dtype, argument: str, backend: str | None = None) -> np.dtype:
    """Return the NumPy dtype for ``dtype`` or raise naming ``argument``.

    Accepts a NumPy dtype or type, a name such as ``"bfloat16"``, or any object
    with a ``dtype`` attribute that NumPy understands.

    Parameters
    ----------
    dtype : dtype-like
    argument : str
        The name the error message gives the value.
    backend : {None, "cpu", "cuda"}
        Where the data will be computed on: ``"cpu"`` also accepts
        :data:`CPU_ONLY_DTYPES`; None (the backend is not known, e.g. for stored
        block data or initializers) accepts :data:`SUPPORTED_DTYPES` only.

    Raises
    ------
    TypeError
        If the dtype is not supported there; for float64 on the GPU the message
        says that float64 runs on the CPU backend only.

    Examples
    --------
    >>> canonical_dtype("float16", "x")
    dtype('float16')
    >>> canonical_dtype(np.float64, "x", backend="cpu")
    dtype('float64')
    >>> canonical_dtype(np.float64, "x", backend="cuda")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: x has dtype float64, which runs only on the CPU backend (...); on the GPU supported dtypes are ...
    """
    name = _known_name(dtype)
    if name in SUPPORTED_DTYPES:
        return SUPPORTED_DTYPES[name]
    if name in CPU_ONLY_DTYPES:
        if backend == "cpu":
            return CPU_ONLY_DTYPES[name]
        if backend is not None:
            raise TypeError(
                f"{argument} has dtype {name}, which runs only on the CPU backend (NumPy arrays, CPU tensors); "
                f"on the GPU supported dtypes are {', '.join(SUPPORTED_DTYPES)}"
            )
    where = "" if backend is None else f", and {', '.join(CPU_ONLY_DTYPES)} on the CPU backend"
    raise TypeError(f"{argument} has dtype {dtype}; supported dtypes are {', '.join(SUPPORTED_DTYPES)}{where}")

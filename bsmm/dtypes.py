"""The one table of element types bsmm supports, on every backend."""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["SUPPORTED_DTYPES", "DTYPE_NAMES", "canonical_dtype"]

#: name -> NumPy dtype. bfloat16 comes from ml_dtypes, the type NumPy-side code
#: (JAX, TensorFlow) already uses for it.
SUPPORTED_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}


#: dtype -> name, for hot paths (``str(dtype)`` is slow in NumPy).
DTYPE_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in SUPPORTED_DTYPES.items()}


def canonical_dtype(dtype, argument: str) -> np.dtype:
    """Return the supported NumPy dtype for ``dtype`` or raise naming ``argument``.

    Accepts a NumPy dtype or type, a name such as ``"bfloat16"``, or any object
    with a ``dtype`` attribute that NumPy understands.

    Raises
    ------
    TypeError
        If the dtype is not one of :data:`SUPPORTED_DTYPES`.

    Examples
    --------
    >>> canonical_dtype("float16", "x")
    dtype('float16')
    """
    try:
        name = DTYPE_NAMES.get(dtype)  # the common case: already a supported dtype
    except TypeError:  # unhashable: certainly not a dtype
        name = None
    if name is not None:
        return SUPPORTED_DTYPES[name]
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    for supported in SUPPORTED_DTYPES.values():
        if resolved == supported:
            return supported
    raise TypeError(
        f"{argument} has dtype {dtype}; supported dtypes are {', '.join(SUPPORTED_DTYPES)}"
    )

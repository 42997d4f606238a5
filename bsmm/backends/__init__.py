"""The backends that run the passes: :mod:`bsmm.backends.cpu` (NumPy/SciPy, also the reference)
and :mod:`bsmm.backends.cuda` (kernels compiled at run time). Both take the same arguments in the
same order: ``fprop(index, x, w, out, feature_axis, tf32, accumulate)``, ``bprop(index, dy, w, ...)``
and ``updat(index, x, dy, ...)`` alike, ``strided_pass`` and ``shifted_pass(pass_name, index, act,
other, out, rows, row_strides, ...)``; :func:`for_operand` picks one."""

from __future__ import annotations

__all__ = ["for_operand"]


def for_operand(operand):
    """The backend module that runs passes on ``operand`` (a :class:`bsmm.arrays.Operand`)."""
    # Each imported lazily, on the first pass of its kind: the CPU backend loads SciPy, the GPU one
    # CuPy (optional) and its driver checks.
    if operand.backend == "cpu":
        from bsmm.backends import cpu  # lazily (see above)

        return cpu
    from bsmm.backends.cuda import backend  # lazily (see above)

    return backend

"""Launch configurations of the element-wise kernels (:class:`~bsmm.backends.cuda.kernels.LstmCellVariant`,
:class:`~bsmm.backends.cuda.kernels.GatedUnitVariant`): rows along the grid's x (any N), ``columns``
threads' worth of work a row along y; one kept per (variant, rows, columns, device), the variant made
only when none is kept (a loop of steps launches with no object made a step).
"""

from __future__ import annotations

from bsmm.backends.cuda import launches
from bsmm.backends.cuda.kernels import load_kernel
from bsmm.backends.cuda.plans import Launcher
from bsmm.backends.cuda.policy import current_policy

__all__ = ["launcher"]

_LAUNCHERS: dict = {}
_MAX_LAUNCHERS = 64


def launcher(variant_type, fields: tuple, rows: int, columns: int) -> Launcher:
    """The launcher of ``variant_type(*fields)`` (its ``direction``'s ``ARGS`` parameters of 8 bytes) over
    a grid of ``rows`` × ceil(``columns`` / threads) thread blocks on the current device."""
    device = launches.current_device()
    key = (variant_type, fields, rows, columns, device)
    kept = _LAUNCHERS.get(key)
    if kept is None:
        variant = variant_type(*fields)
        if len(_LAUNCHERS) >= _MAX_LAUNCHERS:
            _LAUNCHERS.clear()  # shapes seen once (a last short batch, evaluation) are not kept forever
        import cupy

        arch = f"sm{cupy.cuda.Device(device).compute_capability}"
        kept = _LAUNCHERS[key] = Launcher(load_kernel(variant, device), (rows, -(-columns // variant.threads), 1),
                                          variant.threads, 0, variant.ARGS[variant.direction],
                                          serialized=current_policy().programmatic_on(arch))
    return kept

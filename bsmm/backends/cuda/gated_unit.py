"""A GLU's gated unit on the GPU, ``h = A(g)·u`` over a ``[gate | up]`` product and its backward, one
launch each way (``cuda/bsmm_gated_unit.cu``).

:func:`gated_forward` and :func:`gated_backward` take raw device pointers and the stream, as the LSTM's
cell launchers do (:mod:`bsmm.backends.cuda.lstm_cell`); what each pointer holds is documented in the
kernel source. A launch configuration is kept per (dtype, activation, direction, rows, hidden, device).
"""

from __future__ import annotations

from bsmm.backends.cuda import launches
from bsmm.backends.cuda.kernels import GatedUnitVariant, load_kernel
from bsmm.backends.cuda.plans import Launcher
from bsmm.backends.cuda.policy import current_policy

__all__ = ["gated_forward", "gated_backward"]

_LAUNCHERS: dict = {}
_MAX_LAUNCHERS = 64


def _launcher(dtype: str, activation: str, direction: str, rows: int, hidden: int) -> Launcher:
    device = launches.current_device()
    key = (dtype, activation, direction, rows, hidden, device)
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        if len(_LAUNCHERS) >= _MAX_LAUNCHERS:
            _LAUNCHERS.clear()  # shapes seen once (a last short batch, evaluation) are not kept forever
        import cupy

        variant = GatedUnitVariant(dtype, activation, direction)
        arch = f"sm{cupy.cuda.Device(device).compute_capability}"
        grid = (rows, -(-hidden // (2 * variant.threads)), 1)  # rows along x: any N; a thread a column pair
        launcher = _LAUNCHERS[key] = Launcher(load_kernel(variant, device), grid, variant.threads, 0,
                                              GatedUnitVariant.ARGS[direction],
                                              serialized=current_policy().programmatic_on(arch))
    return launcher


def gated_forward(stream: int, dtype: str, activation: str, rows: int, hidden: int, gate_up: int, h: int) -> None:
    """h (rows, hidden) = A(g)·u from ``gate_up`` (rows, 2·hidden), all in ``dtype``; ``hidden`` even
    and both pointers aligned to two elements."""
    if rows:
        _launcher(dtype, activation, "forward", rows, hidden).launch(stream, gate_up, h, hidden)


def gated_backward(stream: int, dtype: str, activation: str, rows: int, hidden: int, dh: int, gate_up: int,
                   d_gate_up: int) -> None:
    """d_gate_up (rows, 2·hidden) = [dh·u·A'(g) | dh·A(g)] from ``dh`` (rows, hidden) and ``gate_up``."""
    if rows:
        _launcher(dtype, activation, "backward", rows, hidden).launch(stream, dh, gate_up, d_gate_up, hidden)

"""A GLU's gated unit on the GPU, ``h = A(g)·u`` over a ``[gate | up]`` product and its backward, one
launch each way (``cuda/bsmm_gated_unit.cu``).

:func:`gated_forward` and :func:`gated_backward` take raw device pointers and the stream, as the LSTM's
cell launchers do (:mod:`bsmm.backends.cuda.lstm_cell`); what each pointer holds is documented in the
kernel source; a thread a column pair (:mod:`bsmm.backends.cuda.elementwise` keeps the launchers).
"""

from __future__ import annotations

from bsmm.backends.cuda.elementwise import launcher
from bsmm.backends.cuda.kernels import GatedUnitVariant

__all__ = ["gated_forward", "gated_backward"]


def gated_forward(stream: int, dtype: str, activation: str, rows: int, hidden: int, gate_up: int, h: int) -> None:
    """h (rows, hidden) = A(g)·u from ``gate_up`` (rows, 2·hidden), all in ``dtype``; ``hidden`` even
    and both pointers aligned to two elements."""
    if rows:
        launcher(GatedUnitVariant, (dtype, activation, "forward"), rows, hidden // 2).launch(stream, gate_up, h, hidden)


def gated_backward(stream: int, dtype: str, activation: str, rows: int, hidden: int, dh: int, gate_up: int,
                   d_gate_up: int) -> None:
    """d_gate_up (rows, 2·hidden) = [dh·u·A'(g) | dh·A(g)] from ``dh`` (rows, hidden) and ``gate_up``."""
    if rows:
        launcher(GatedUnitVariant, (dtype, activation, "backward"), rows, hidden // 2).launch(stream, dh, gate_up,
                                                                                             d_gate_up, hidden)

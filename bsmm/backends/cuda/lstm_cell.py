"""The LSTM's fused cell on the GPU: one launch a step each way (``cuda/bsmm_lstm_cell.cu``).

:func:`cell_forward` and :func:`cell_backward` take raw device pointers (0 for an operand left
out) and the stream, so that the sequence loops of :class:`bsmm.torch.BlockSparseLSTM` and
:class:`bsmm.nn.lstm.BlocksparseLSTM` launch them without an array exchange a step; what each
pointer holds is documented in the kernel source. A launch configuration is kept per (dtype,
direction, rows, hidden size, device) (:mod:`bsmm.backends.cuda.elementwise`).
"""

from __future__ import annotations

from bsmm.backends.cuda.elementwise import launcher
from bsmm.backends.cuda.kernels import LstmCellVariant

__all__ = ["cell_forward", "cell_backward"]


def cell_forward(stream: int, dtype: str, n: int, hidden: int, z_in: int, z_rec: int, bias: int, c_prev: int,
                 gates: int, c: int, h: int, h_master: int) -> None:
    """One step forward: gates (N, 4H) float32, c (N, H) float32 and h (N, H) in ``dtype`` and/or
    float32 from the pre-activations ``z_in`` (+ ``z_rec``) (N, 4H) in ``dtype``, ``bias`` (4H,)
    float32 and ``c_prev`` (N, H) float32; pointers, 0 for what is left out."""
    launcher(LstmCellVariant, (dtype, "forward"), n, hidden).launch(stream, z_in, z_rec, bias, c_prev, gates, c, h,
                                                                     h_master, hidden)


def cell_backward(stream: int, dtype: str, n: int, hidden: int, d_out: int, dh_rec: int, dh_init: int, dc: int,
                  gates: int, c_prev: int, c: int, dz: int, dz_master: int) -> None:
    """One step backward: dz (N, 4H) in ``dtype`` and/or float32, and ``dc`` (N, H) float32 updated in
    place from dc_t to dc_{t-1}; dh is ``d_out`` (float32) + ``dh_rec`` (``dtype``) + ``dh_init``
    (float32), those left out (0) counting as zeros."""
    launcher(LstmCellVariant, (dtype, "backward"), n, hidden).launch(stream, d_out, dh_rec, dh_init, dc, gates,
                                                                      c_prev, c, dz, dz_master, hidden)

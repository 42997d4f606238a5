"""The four gates of :class:`~bsmm.nn.lstm.BlocksparseLSTM`: their order and the layout of a gate matrix.

The four gates of a step are one product of width ``4H``,
``z = x_t·Wx + h_{t-1}·Wh + b``, in the order input ``i``, forget ``f``,
output ``o``, candidate ``g``: columns ``[q*H, (q+1)*H)`` hold gate ``q``
(the three sigmoid gates first, so one call squashes them all). Then
``c_t = f*c_{t-1} + i*g`` and ``h_t = o*tanh(c_t)`` (:mod:`bsmm.nn.lstm_cell`).

``Wx`` (I, 4H) and ``Wh`` (H, 4H) are each one :class:`~bsmm.BlocksparseMatMul`
whose layout has ``4 * H // bs`` block columns. A square layout ``L`` (H/bs,
H/bs), e.g. a small-world graph among hidden blocks, is tiled once per gate,
``[L | L | L | L]``: hidden block ``k`` hears block ``c`` through all four
gates exactly when ``L[c, k]``. A layout that is already 4 times as wide gives
each gate its own. A layout of None makes the matrix dense
(:class:`~bsmm.nn.dense_matmul.DenseMatMul`), which is how the dense baseline
runs through the same code with any sizes.
"""

from __future__ import annotations

import numpy as np

from bsmm.block_index import check_layout

__all__ = ["GATES", "gate_layout"]

#: Gate order along the 4H columns of the gate matrices.
GATES = ("input", "forget", "output", "candidate")


def gate_layout(layout, columns: int) -> np.ndarray:
    """The (rows, 4·columns) layout of a gate matrix from a per-gate or full layout.

    A layout ``columns`` block columns wide is tiled once per gate; one
    ``4 * columns`` wide is returned as it is.

    Examples
    --------
    >>> gate_layout(np.eye(2), 2).astype(int).tolist()
    [[1, 0, 1, 0, 1, 0, 1, 0], [0, 1, 0, 1, 0, 1, 0, 1]]
    """
    checked = check_layout(layout)
    if checked.shape[1] == columns:
        return np.tile(checked, (1, len(GATES)))
    if checked.shape[1] == len(GATES) * columns:
        return np.array(checked)
    raise ValueError(
        f"layout must have {columns} block columns (one gate, tiled) or {len(GATES) * columns} (all gates); "
        f"got shape {checked.shape}"
    )

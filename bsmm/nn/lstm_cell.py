"""One LSTM step's elementwise math, forward and backward, on the gate columns of
:mod:`bsmm.nn.lstm_gates` (NumPy or CuPy arrays, written in place)."""

from __future__ import annotations

from bsmm.arrays import array_module

__all__ = ["cell_backward", "cell_forward"]


def _sigmoid(x, out):
    # 1/2 + tanh(x/2)/2 overflows nowhere, unlike 1 / (1 + exp(-x)).
    array_module(x).tanh(x * 0.5, out=out)
    out *= 0.5
    out += 0.5
    return out


def cell_forward(z, b, c_prev, gates, h_out, c_out) -> None:
    """Gate activations into ``gates`` (master dtype) and the new ``h``, ``c`` from pre-activations ``z``.

    Examples
    --------
    >>> import numpy as np
    >>> z, c_prev = np.zeros((1, 4)), np.ones((1, 1))
    >>> gates, h, c = np.empty((1, 4)), np.empty((1, 1)), np.empty((1, 1))
    >>> cell_forward(z, np.zeros(4), c_prev, gates, h, c)
    >>> gates.tolist(), c.tolist()  # i = f = o = 1/2, g = 0: c = c_prev / 2
    ([[0.5, 0.5, 0.5, 0.0]], [[0.5]])
    """
    xp = array_module(gates)
    hidden = c_prev.shape[1]
    gates[...] = z
    gates += b
    sig = gates[:, :3 * hidden]
    _sigmoid(sig, sig)
    xp.tanh(gates[:, 3 * hidden:], out=gates[:, 3 * hidden:])
    i, f, o, g = (gates[:, q * hidden:(q + 1) * hidden] for q in range(4))
    xp.multiply(f, c_prev, out=c_out)
    c_out += i * g
    xp.multiply(o, xp.tanh(c_out), out=h_out)


def cell_backward(dh, dc_next, gates, c_prev, c, dz_out):
    """Pre-activation gradients into ``dz_out``; returns the gradient for ``c_prev``.

    Examples
    --------
    >>> import numpy as np
    >>> gates, dz = np.array([[0.5, 0.5, 0.5, 0.0]]), np.empty((1, 4))
    >>> dc_prev = cell_backward(np.zeros((1, 1)), np.ones((1, 1)), gates, np.ones((1, 1)), np.full((1, 1), 0.5), dz)
    >>> dz.tolist(), dc_prev.tolist()  # dh = 0: only dc_next flows, into f, g and c_prev
    ([[0.0, 0.25, 0.0, 0.5]], [[0.5]])
    """
    xp = array_module(gates)
    hidden = c.shape[1]
    i, f, o, g = (gates[:, q * hidden:(q + 1) * hidden] for q in range(4))
    tanh_c = xp.tanh(c)
    dc = dh * o
    dc *= 1 - tanh_c * tanh_c
    dc += dc_next
    d_i, d_f, d_o, d_g = (dz_out[:, q * hidden:(q + 1) * hidden] for q in range(4))
    xp.multiply(dc, g, out=d_i)
    xp.multiply(dc, c_prev, out=d_f)
    xp.multiply(dh, tanh_c, out=d_o)
    sig = gates[:, :3 * hidden]
    dz_out[:, :3 * hidden] *= sig * (1 - sig)
    xp.multiply(dc, i, out=d_g)
    d_g *= 1 - g * g
    return dc * f

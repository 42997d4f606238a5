"""A minimal training kit on NumPy or CuPy arrays: Adam, global-norm clipping, softmax cross-entropy.

Everything runs in the arrays' own library and nothing waits for the GPU:
the clipping factor and the loss stay device scalars until the caller reads them.
"""

from __future__ import annotations

import math

from bsmm.arrays import array_module

__all__ = ["Adam", "clip_by_global_norm", "softmax_cross_entropy"]


class Adam:
    """Adam (Kingma & Ba, 2015) updating a list of arrays in place.

    Parameters
    ----------
    params : list of arrays
        Updated in place by :meth:`step`.
    lr : float
    betas : (float, float)
    eps : float

    Examples
    --------
    >>> import numpy as np
    >>> w = np.array([3.0, -2.0])
    >>> adam = Adam([w], lr=0.1)
    >>> for _ in range(300):
    ...     adam.step([2 * w])  # gradient of |w|^2
    >>> bool(np.abs(w).max() < 0.05)
    True
    """

    def __init__(self, params, lr: float = 2e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        self.params = list(params)
        self.lr, self.betas, self.eps = float(lr), (float(betas[0]), float(betas[1])), float(eps)
        self.m = [array_module(p).zeros_like(p) for p in self.params]
        self.v = [array_module(p).zeros_like(p) for p in self.params]
        self.t = 0

    def step(self, grads) -> None:
        """One update from ``grads``, a list matching ``params`` in order and shapes."""
        grads = list(grads)
        if len(grads) != len(self.params):
            raise ValueError(f"grads must hold {len(self.params)} arrays, one per parameter; got {len(grads)}")
        self.t += 1
        beta1, beta2 = self.betas
        # The bias corrections folded into the step size (the paper's efficient form).
        step_size = self.lr * math.sqrt(1 - beta2**self.t) / (1 - beta1**self.t)
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            xp = array_module(p)
            m *= beta1
            m += (1 - beta1) * g
            v *= beta2
            v += (1 - beta2) * g * g
            p -= step_size * m / (xp.sqrt(v) + self.eps)


def clip_by_global_norm(grads, max_norm: float):
    """Scale ``grads`` in place so that their joint L2 norm is at most ``max_norm``.

    Returns the norm before clipping as a 0-d array of the grads' library (not synchronized).

    Examples
    --------
    >>> import numpy as np
    >>> grads = [np.array([3.0]), np.array([4.0])]
    >>> float(clip_by_global_norm(grads, 1.0)), [round(float(g[0]), 6) for g in grads]
    (5.0, [0.6, 0.8])
    """
    grads = list(grads)
    xp = array_module(grads[0])
    norm = xp.sqrt(sum((g * g).sum() for g in grads))
    scale = xp.minimum(1.0, max_norm / (norm + 1e-12))
    for g in grads:
        g *= scale.astype(g.dtype)
    return norm


def softmax_cross_entropy(logits, targets):
    """Mean cross-entropy (nats) of integer ``targets`` (M,) under ``logits`` (M, V), and its gradient.

    Returns
    -------
    loss : 0-d array (of the logits' library)
    dlogits : (M, V), the gradient of ``loss`` with respect to ``logits``

    Examples
    --------
    >>> import numpy as np
    >>> loss, dlogits = softmax_cross_entropy(np.zeros((2, 4)), np.array([1, 3]))
    >>> round(float(loss), 6), dlogits[0].tolist()  # ln 4
    (1.386294, [0.125, -0.375, 0.125, 0.125])
    """
    xp = array_module(logits)
    m = logits.shape[0]
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    rows = xp.arange(m)
    loss = (xp.log(total[:, 0]) - shifted[rows, targets]).mean()
    dlogits = exp / total
    dlogits[rows, targets] -= 1
    dlogits /= m
    return loss, dlogits

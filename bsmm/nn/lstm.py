"""A block-sparse LSTM layer: forward over a sequence and backpropagation through time.

Its gate matrices are laid out as :mod:`bsmm.nn.lstm_gates` says, and each step's
elementwise math is :mod:`bsmm.nn.lstm_cell`.

Steps
-----
``x·Wx`` of all time steps is one pass over ``T·N`` rows; each step then adds
``h_{t-1}·Wh`` into its slice with ``fprop(..., out=, accumulate=True)``.
Backward runs the steps in reverse for the pre-activation gradients ``dz_t``
(kept for all steps) and ``dh_{t-1} = dz_t·Whᵀ``. The weight gradients are
then accumulated across time steps into one buffer per matrix, each by a
single ``updat`` over all ``T·N`` rows, the sum over the steps taken inside
the pass: ``dWh = Σ_t h_{t-1}ᵀ·dz_t`` from the stacked states ``h_0 … h_{T-1}``,
``dWx = Σ_t x_tᵀ·dz_t``. Passing ``grads=`` adds to the caller's buffers
instead (``updat(..., out=, accumulate=True)``), so the gradients of several
truncated-BPTT chunks or micro-batches also sum in place.

Dtypes
------
``dtype`` is the dtype of the activation passes (fprop and bprop): float32,
float16 or bfloat16, or float64 on the CPU backend (for gradient checks).
Parameters, the cell state, gate activations and weight gradients are kept in
the *master* dtype, float32 (float64 for float64): half-precision weights are a
cast of the master copy made once per :meth:`BlocksparseLSTM.forward`, and
``updat`` runs on the float32 copies of ``h`` and ``dz`` so that summing over
time steps rounds nothing to half precision.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from bsmm import initializers
from bsmm.arrays import array_module
from bsmm.block_index import check_block_size, check_layout
from bsmm.config import settings
from bsmm.dtypes import canonical_dtype
from bsmm.layouts.checks import as_generator, check_int
from bsmm.layouts.small_world import small_world_layout
from bsmm.matmul import BlocksparseMatMul
from bsmm.nn.dense_matmul import DenseMatMul
from bsmm.nn.lstm_cell import cell_backward, cell_forward
from bsmm.nn.lstm_gates import GATES, gate_layout

__all__ = [
    "BlocksparseLSTM",
    "DenseMatMul",
    "LSTMCache",
    "gate_layout",
    "small_world_lstm",
    "GATES",
]

_F64 = np.dtype(np.float64)
_F32 = np.dtype(np.float32)


class LSTMCache(NamedTuple):
    """What :meth:`BlocksparseLSTM.forward` keeps for the backward pass.

    Attributes
    ----------
    x : (T, N, I), compute dtype
    h : (T + 1, N, H), master dtype; ``h[0]`` is the initial state
    c : (T + 1, N, H), master dtype
    gates : (T, N, 4H), master dtype: the gate activations, order :data:`~bsmm.nn.lstm_gates.GATES`
    wx, wh : the weights in the compute dtype
    """

    x: object
    h: object
    c: object
    gates: object
    wx: object
    wh: object


class BlocksparseLSTM:
    """An LSTM layer whose input and recurrent gate matrices are block-sparse.

    Parameters
    ----------
    input_size, hidden_size : int
        ``I`` and ``H``; multiples of ``block_size`` where the matrix has a layout.
    block_size : int, default from ``bsmm.toml``
    input_layout : (I/bs, H/bs) or (I/bs, 4H/bs) array of 0/1, or None
        Layout of ``Wx`` (see :mod:`bsmm.nn.lstm_gates`); None: dense.
    recurrent_layout : (H/bs, H/bs) or (H/bs, 4H/bs) array of 0/1, or None
        Layout of ``Wh``; None: dense.
    dtype : float32, float16, bfloat16, or float64 (CPU backend only)
        Dtype of the activation passes; parameters stay float32 (float64).
    forget_bias : float
        Initial bias of the forget gate (the other gates start at 0).

    Raises
    ------
    ValueError
        If a size is not a positive multiple of the block size where a layout
        is given, or a layout has the wrong shape.
    TypeError
        If ``dtype`` is not supported.

    Examples
    --------
    >>> import numpy as np
    >>> from bsmm.nn.lstm import BlocksparseLSTM
    >>> lstm = BlocksparseLSTM(16, 32, block_size=8, recurrent_layout=np.eye(4))
    >>> params = lstm.init_params(seed=0)
    >>> x = np.zeros((5, 3, 16), dtype=np.float32)  # (T, N, I)
    >>> h, (h_T, c_T), cache = lstm.forward(params, x)
    >>> h.shape, h_T.shape
    ((5, 3, 32), (3, 32))
    >>> dx, grads, (dh0, dc0) = lstm.backward(params, cache, np.ones_like(h))
    >>> dx.shape, grads["wh"].shape == lstm.recurrent_op.w_shape
    ((5, 3, 16), True)
    """

    def __init__(self, input_size: int, hidden_size: int, block_size: int | None = None, input_layout=None,
                 recurrent_layout=None, dtype="float32", forget_bias: float = 1.0):
        self.input_size = check_int(input_size, "input_size", 1)
        self.hidden_size = check_int(hidden_size, "hidden_size", 1)
        self.dtype = canonical_dtype(dtype, "dtype", backend="cpu")
        self.master_dtype = _F64 if self.dtype == _F64 else _F32
        self.forget_bias = float(forget_bias)
        self.block_size = check_block_size(settings()["defaults"]["block_size"] if block_size is None else block_size)
        self.input_op = self._operator(input_layout, self.input_size, "input")
        self.recurrent_op = self._operator(recurrent_layout, self.hidden_size, "recurrent")
        #: The layouts as given (per gate or all gates), read-only; None for a dense matrix.
        self.input_layout = None if input_layout is None else check_layout(input_layout)
        self.recurrent_layout = None if recurrent_layout is None else check_layout(recurrent_layout)

    def _operator(self, layout, rows: int, name: str):
        width = len(GATES) * self.hidden_size
        if layout is None:
            return DenseMatMul(rows, width)
        bs = self.block_size
        sizes = {"input_size": rows, "hidden_size": self.hidden_size} if name == "input" else {"hidden_size": rows}
        for what, size in sizes.items():
            if size % bs:
                raise ValueError(f"{what} ({size}) must be a multiple of block_size ({bs}) for a {name}_layout")
        full = gate_layout(layout, self.hidden_size // bs)
        if full.shape[0] != rows // bs:
            raise ValueError(f"{name}_layout must have {rows // bs} block rows; got shape {np.shape(layout)}")
        return BlocksparseMatMul(full, block_size=bs, feature_axis=1)

    # -- parameters -----------------------------------------------------------------------
    @property
    def param_shapes(self) -> dict[str, tuple]:
        """Shapes of the parameters: ``wx``, ``wh`` (block data or dense) and ``b`` (4H,)."""
        return {"wx": self.input_op.w_shape, "wh": self.recurrent_op.w_shape, "b": (len(GATES) * self.hidden_size,)}

    @property
    def n_params(self) -> int:
        """Number of stored parameters (present blocks only)."""
        return sum(math.prod(shape) for shape in self.param_shapes.values())

    def init_params(self, xp=np, seed=None) -> dict:
        """Initial parameters as ``xp`` arrays of the master dtype.

        ``wx``: N(0, 1/fan-in) per output column (:func:`bsmm.initializers.normal`);
        ``wh``: orthonormal columns per block column (per gate when dense);
        ``b``: ``forget_bias`` on the forget gate, 0 elsewhere.
        """
        rng = as_generator(seed)
        wx = _initial_weights(self.input_op, "normal", rng)
        wh = _initial_weights(self.recurrent_op, "orthogonal", rng)
        b = np.zeros(self.param_shapes["b"])
        b[self.hidden_size:2 * self.hidden_size] = self.forget_bias
        return {name: xp.asarray(value.astype(self.master_dtype)) for name, value in
                (("wx", wx), ("wh", wh), ("b", b))}

    def _check_params(self, params) -> None:
        shapes = self.param_shapes
        for name, shape in shapes.items():
            if name not in params:
                raise ValueError(f"params must hold {sorted(shapes)}; {name!r} is missing")
            if tuple(params[name].shape) != shape:
                raise ValueError(f"params[{name!r}] must have shape {shape}; got {tuple(params[name].shape)}")

    def _compute_weights(self, params):
        self._check_params(params)
        return (params["wx"].astype(self.dtype, copy=False), params["wh"].astype(self.dtype, copy=False),
                params["b"].astype(self.master_dtype, copy=False))

    # -- forward ----------------------------------------------------------------------------
    def forward(self, params, x, h0=None, c0=None):
        """Run the layer over a sequence.

        Parameters
        ----------
        params : dict of ``wx``, ``wh``, ``b`` (see :attr:`param_shapes`)
        x : (T, N, I) array, cast to ``dtype``; T, N >= 1
        h0, c0 : (N, H) arrays, optional (zeros), cast to the master dtype

        Returns
        -------
        h : (T, N, H), compute dtype: every hidden state (in float32 and float64
            a view of ``cache.h``: do not write to it before :meth:`backward`)
        state : (h_T, c_T), each (N, H), master dtype: pass as ``h0, c0`` of the next chunk
        cache : :class:`LSTMCache`
        """
        wx, wh, b = self._compute_weights(params)
        xp = array_module(x)
        if x.ndim != 3 or x.shape[2] != self.input_size or 0 in x.shape:
            raise ValueError(f"x must have shape (T, N, {self.input_size}) with T, N >= 1; got {tuple(x.shape)}")
        steps, n, hidden = x.shape[0], x.shape[1], self.hidden_size
        x = xp.ascontiguousarray(x.astype(self.dtype, copy=False))
        z = self.input_op.fprop(x.reshape(steps * n, self.input_size), wx).reshape(steps, n, 4 * hidden)
        h = xp.empty((steps + 1, n, hidden), dtype=self.master_dtype)
        c = xp.empty_like(h)
        h[0] = self._state(h0, n, "h0")
        c[0] = self._state(c0, n, "c0")
        h_compute = h
        if self.dtype != self.master_dtype:
            h_compute = xp.empty(h.shape, dtype=self.dtype)
            h_compute[0] = h[0]
        gates = xp.empty((steps, n, 4 * hidden), dtype=self.master_dtype)
        fused = _fused_cell(xp, self.dtype)
        if fused is not None:
            b, stream = xp.ascontiguousarray(b), _stream(xp)
        for t in range(steps):
            self.recurrent_op.fprop(h_compute[t], wh, out=z[t], accumulate=True)
            if fused is not None:  # one launch: gates, c, and h in both dtypes
                fused.cell_forward(stream, self.dtype.name, n, hidden, z[t].data.ptr, 0, b.data.ptr,
                                   c[t].data.ptr, gates[t].data.ptr, c[t + 1].data.ptr,
                                   0 if h_compute is h else h_compute[t + 1].data.ptr, h[t + 1].data.ptr)
                continue
            cell_forward(z[t], b, c[t], gates[t], h[t + 1], c[t + 1])
            if h_compute is not h:
                h_compute[t + 1] = h[t + 1]
        cache = LSTMCache(x, h, c, gates, wx, wh)
        return h_compute[1:], (h[steps], c[steps]), cache

    def step(self, params, x, h, c):
        """One step of the cell: x (N, I), h and c (N, H) -> new (h, c) in the master dtype."""
        return self.forward(params, x[None], h, c)[1]

    def _state(self, value, n: int, name: str):
        if value is None:
            return 0
        if tuple(value.shape) != (n, self.hidden_size):
            raise ValueError(f"{name} must have shape ({n}, {self.hidden_size}); got {tuple(value.shape)}")
        return value.astype(self.master_dtype, copy=False)

    # -- backward ---------------------------------------------------------------------------
    def backward(self, params, cache: LSTMCache, dh, dh_T=None, dc_T=None, grads=None):
        """Backpropagation through time over the sequence of ``cache``.

        Parameters
        ----------
        params : the dict given to :meth:`forward` (checked for shape only: the
            weights multiplied with are the compute-dtype copies in ``cache``)
        cache : :class:`LSTMCache` from :meth:`forward`
        dh : (T, N, H) array or None
            Loss gradient with respect to every returned hidden state.
        dh_T, dc_T : (N, H) arrays, optional
            Gradient with respect to the final state (from a later chunk).
        grads : dict of ``wx``, ``wh``, ``b`` buffers of the master dtype, optional
            Added to in place (e.g. over truncated-BPTT chunks); new buffers if None.

        Returns
        -------
        dx : (T, N, I), compute dtype
        grads : dict ``wx``, ``wh``, ``b``, master dtype. Each weight gradient is
            accumulated across the time steps into its one buffer by a single
            ``updat`` over all ``T·N`` rows (see the module docstring).
        state_grads : (dh0, dc0), each (N, H), master dtype
        """
        self._check_params(params)
        xp = array_module(cache.h)
        steps, n, hidden = cache.gates.shape[0], cache.gates.shape[1], self.hidden_size
        accumulate = grads is not None
        if grads is None:
            grads = {name: xp.empty(shape, dtype=self.master_dtype) for name, shape in self.param_shapes.items()}
        elif set(grads) != set(self.param_shapes):
            raise ValueError(f"grads must hold {sorted(self.param_shapes)}; got {sorted(grads)}")
        if dh is not None and tuple(dh.shape) != (steps, n, hidden):
            raise ValueError(f"dh must have shape {(steps, n, hidden)}; got {tuple(dh.shape)}")
        # New arrays (never the caller's): dh_next is updated in place, step after step.
        dh_next = self._state(dh_T, n, "dh_T") + xp.zeros((n, hidden), dtype=self.master_dtype)
        dc_next = self._state(dc_T, n, "dc_T") + xp.zeros((n, hidden), dtype=self.master_dtype)
        dz = xp.empty_like(cache.gates)
        dz_compute = dz if self.dtype == self.master_dtype else xp.empty(dz.shape, dtype=self.dtype)
        # bprop writes dz_t·Whᵀ straight into dh_next in float32 (float64); half precision casts it in.
        dh_recurrent = dh_next if self.dtype == self.master_dtype else xp.empty((n, hidden), dtype=self.dtype)
        fused = _fused_cell(xp, self.dtype)
        if fused is not None:
            self._backward_steps_fused(fused, cache, dh, dh_next, dc_next, dz, dz_compute, dh_recurrent)
        else:
            for t in reversed(range(steps)):
                if dh is not None:
                    dh_next += dh[t]
                dc_next = cell_backward(dh_next, dc_next, cache.gates[t], cache.c[t], cache.c[t + 1], dz[t])
                if dz_compute is not dz:
                    dz_compute[t] = dz[t]
                self.recurrent_op.bprop(dz_compute[t], cache.wh, out=dh_recurrent)
                if dh_recurrent is not dh_next:
                    dh_next[...] = dh_recurrent
        rows = steps * n
        # h[t] is the state step t read (h[0] the initial one): h[:T] stacks every step's input state, and the
        # slice of the contiguous (T + 1, N, H) array along its first axis is contiguous itself.
        h_in = cache.h[:steps].reshape(rows, hidden)
        self.recurrent_op.updat(h_in, dz.reshape(rows, 4 * hidden), out=grads["wh"], accumulate=accumulate)
        x_master = cache.x.reshape(rows, self.input_size).astype(self.master_dtype, copy=False)
        self.input_op.updat(x_master, dz.reshape(rows, 4 * hidden), out=grads["wx"], accumulate=accumulate)
        bias = dz.sum(axis=(0, 1))
        if accumulate:
            grads["b"] += bias
        else:
            grads["b"][...] = bias
        dx = self.input_op.bprop(dz_compute.reshape(rows, 4 * hidden), cache.wx).reshape(steps, n, self.input_size)
        return dx, grads, (dh_next, dc_next)

    def _backward_steps_fused(self, fused, cache: LSTMCache, dh, dh_next, dc_next, dz, dz_compute, dh_recurrent):
        """:meth:`backward`'s steps on the GPU: one launch of the fused cell and the recurrent bprop a
        step. Leaves dh_next and dc_next holding the initial state's gradients, dz (and dz_compute) filled."""
        xp = array_module(dh_next)
        steps, n, hidden = cache.gates.shape[0], cache.gates.shape[1], self.hidden_size
        stream = _stream(xp)
        dh_master = None if dh is None else xp.ascontiguousarray(dh, dtype=self.master_dtype)
        for t in reversed(range(steps)):
            last = t == steps - 1
            fused.cell_backward(stream, self.dtype.name, n, hidden, 0 if dh is None else dh_master[t].data.ptr,
                                0 if last else dh_recurrent.data.ptr, dh_next.data.ptr if last else 0,
                                dc_next.data.ptr, cache.gates[t].data.ptr, cache.c[t].data.ptr, cache.c[t + 1].data.ptr,
                                0 if dz_compute is dz else dz_compute[t].data.ptr, dz[t].data.ptr)
            self.recurrent_op.bprop(dz_compute[t], cache.wh, out=dh_recurrent)
        if dh_recurrent is not dh_next:
            dh_next[...] = dh_recurrent

    def __repr__(self) -> str:
        return (f"BlocksparseLSTM(input_size={self.input_size}, hidden_size={self.hidden_size}, "
                f"block_size={self.block_size}, input_density={self.input_op.density:.3g}, "
                f"recurrent_density={self.recurrent_op.density:.3g}, dtype={self.dtype.name})")


def _fused_cell(xp, dtype: np.dtype):
    """The fused cell's launches (:mod:`bsmm.backends.cuda.lstm_cell`) for CuPy arrays of a GPU dtype,
    None for NumPy (and float64, which the GPU's passes refuse)."""
    if xp is np or dtype == _F64:
        return None
    from bsmm.backends.cuda import lstm_cell  # lazily: CuPy's, on the GPU only

    return lstm_cell


def _stream(xp) -> int:
    return xp.cuda.get_current_stream().ptr


def _initial_weights(op, kind: str, rng) -> np.ndarray:
    """Host float64 weights for ``op``: block data (block-sparse) or a dense (C, K) matrix."""
    if isinstance(op, BlocksparseMatMul):
        if kind == "normal":
            return initializers.normal(op.layout, op.block_size, seed=rng).astype(_F64)
        return initializers.orthogonal(op.layout, op.block_size, seed=rng).astype(_F64)
    if kind == "normal":
        return rng.standard_normal(op.w_shape) / math.sqrt(op.C)
    # Only Wh (H, 4H) is orthogonal: per gate, a Haar-orthogonal (H, H) matrix.
    assert op.K == len(GATES) * op.C, op.w_shape
    parts = []
    for _ in GATES:
        q, r = np.linalg.qr(rng.standard_normal((op.C, op.C)))
        q *= np.sign(np.diagonal(r))
        parts.append(q)
    return np.concatenate(parts, axis=1)


# -- small-world models -------------------------------------------------------------------------
def small_world_lstm(input_size: int, hidden_size: int, n_params: int, block_size: int | None = None,
                     kind: str = "barabasi_albert", seed=None, sparse_input: bool = True, **kwargs) -> BlocksparseLSTM:
    """A :class:`BlocksparseLSTM` with about ``n_params`` parameters on one small-world graph.

    The graph, among the ``hidden_size / block_size`` hidden blocks (see
    :func:`bsmm.layouts.small_world.small_world_layout`), is the recurrent
    layout of every gate and, with ``sparse_input`` (which needs
    ``input_size == hidden_size``), the input layout too; otherwise ``Wx`` is dense. Its block count is the one
    closest to what ``n_params`` leaves after the bias and a dense ``Wx``.
    ``kwargs`` go to :class:`BlocksparseLSTM` (``dtype``, ``forget_bias``).

    Examples
    --------
    >>> dense = BlocksparseLSTM(128, 128)
    >>> sparse = small_world_lstm(256, 256, dense.n_params, block_size=8, seed=0)
    >>> round(sparse.n_params / dense.n_params, 2), round(sparse.recurrent_op.density, 3)
    (1.0, 0.25)
    """
    bs = check_block_size(settings()["defaults"]["block_size"] if block_size is None else block_size)
    gates = len(GATES)
    if sparse_input and input_size != hidden_size:
        raise ValueError(f"sparse_input needs input_size == hidden_size (one graph); got {input_size} and {hidden_size}")
    weights = n_params - gates * hidden_size - (0 if sparse_input else input_size * gates * hidden_size)
    blocks_per_gate = weights / (bs * bs) / gates / (2 if sparse_input else 1)
    hidden_blocks = check_int(hidden_size, "hidden_size", 1) // bs
    layout = small_world_layout(hidden_blocks, round(blocks_per_gate), kind, seed)
    return BlocksparseLSTM(input_size, hidden_size, bs, layout if sparse_input else None, layout, **kwargs)

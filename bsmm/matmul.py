"""``BlocksparseMatMul``: the seed's operator object and its three passes.

Array-in, same-kind-out: NumPy arrays run on the CPU backend, CuPy arrays on the
GPU backend, other DLPack producers (PyTorch, JAX, TensorFlow tensors) are
shared without a copy and the result comes back as the caller's type.
"""

from __future__ import annotations

import numpy as np

from bsmm import initializers
from bsmm.arrays import Operand, array_module, as_operand, check_same_place, output_array, overlaps
from bsmm.backends import for_operand
from bsmm.block_index import BlockIndex, block_index
from bsmm.config import settings
from bsmm.dtypes import canonical_dtype
from bsmm.epilogues import EpilogueCall, check_activation, epilogue_name

__all__ = ["BlocksparseMatMul", "blocks_to_dense", "dense_to_blocks"]

# cupy.ndarray once the GPU backend has run a pass (before that no repeatable call exists).
_gpu_array_type = None
# Repeatable GPU calls an operator keeps (one per pass, batch shape and dtype in use).
_MAX_GPU_CALLS = 64




def blocks_to_dense(index: BlockIndex, data):
    """Dense ``W`` (C, K) from block data (nnzb, bs, bs) in storage order; absent blocks are 0.

    Works on NumPy and CuPy arrays; the result is of the same library and dtype.
    """
    xp = array_module(data)
    bs = index.block_size
    dense = xp.zeros((index.n_block_rows, bs, index.n_block_cols, bs), dtype=data.dtype)
    dense[xp.asarray(index.rows), :, xp.asarray(index.indices), :] = data
    return dense.reshape(index.C, index.K)


def dense_to_blocks(index: BlockIndex, dense):
    """Block data (nnzb, bs, bs) in storage order, cut out of a dense ``W`` (C, K)."""
    xp = array_module(dense)
    bs = index.block_size
    blocked = dense.reshape(index.n_block_rows, bs, index.n_block_cols, bs)
    return xp.ascontiguousarray(blocked[xp.asarray(index.rows), :, xp.asarray(index.indices), :])


def _check_feature_axis(feature_axis) -> int:
    """Return ``feature_axis`` as the int 0 or 1, or raise (the one check every operator and adapter uses)."""
    if isinstance(feature_axis, (bool, np.bool_)) or not isinstance(feature_axis, (int, np.integer)):
        raise TypeError(f"feature_axis must be an int, 0 or 1; got {feature_axis!r} ({type(feature_axis).__name__})")
    if feature_axis not in (0, 1):
        raise ValueError(f"feature_axis must be 0 or 1; got {feature_axis!r}")
    return int(feature_axis)


def _check_tf32(tf32, default: bool) -> bool:
    """Return ``tf32`` as a bool (None: ``default``, from ``bsmm.toml``), or raise: ``"no"`` is not False."""
    if tf32 is None:
        return bool(default)
    if not isinstance(tf32, (bool, np.bool_)):
        raise TypeError(f"tf32 must be a bool or None; got {tf32!r} ({type(tf32).__name__})")
    return bool(tf32)


# How to make an input of each caller's library C-contiguous, for the refusal's message.
_CONTIGUOUS_COPY = {"numpy": "numpy.ascontiguousarray({0})", "cupy": "cupy.ascontiguousarray({0})",
                    "torch": "{0}.contiguous()"}


def _pointer(gate) -> int:
    """The device address of a CuPy gate array, 0 for None (no gates)."""
    return 0 if gate is None else gate.data.ptr


def _not_contiguous(operand: Operand, argument: str) -> ValueError:
    """The refusal of a strided input: the passes read dense memory and copy nothing behind the caller's back."""
    fix = _CONTIGUOUS_COPY.get(operand.library, "a C-contiguous copy of {0}").format(argument)
    return ValueError(f"{argument} must be C-contiguous; got strides {operand.array.strides}; pass {fix}")


class BlocksparseMatMul:
    """y = x·W where ``W`` (C, K) is block-sparse with the given layout.

    Parameters
    ----------
    layout : (C // block_size, K // block_size) array of 0/1
        ``layout[c, k] != 0`` means block ``(c, k)`` of ``W`` is present.
    block_size : int, default from ``bsmm.toml`` (32)
        Edge of the square blocks: 8, 16, 32, 64 or 128.
    feature_axis : {1, 0}, default 1
        1: activations are (N, C) and (N, K); 0: (C, N) and (K, N).
    tf32 : bool, default from ``bsmm.toml`` (False)
        On the GPU, run float32 inputs on TF32 tensor cores (~1e-3 relative
        error) instead of exact float32. The CPU backend is always exact.

    Notes
    -----
    Block data ``w`` has shape :attr:`w_shape` = (nnzb, bs, bs), blocks in
    row-major order over the layout (see :mod:`bsmm.block_index`).

    Dtypes: float32, float16 and bfloat16 on every backend (accumulated in
    float32); float64 on the CPU backend only, computed in float64 (for gradient
    checks), while GPU arrays of float64 raise ``TypeError``.

    Examples
    --------
    >>> import numpy as np, bsmm
    >>> layout = np.array([[1, 0], [1, 1]])
    >>> op = bsmm.BlocksparseMatMul(layout, block_size=8)
    >>> w = np.random.default_rng(0).standard_normal(op.w_shape).astype(np.float32)
    >>> x = np.ones((4, op.C), dtype=np.float32)
    >>> y = op(x, w)
    >>> y.shape, bool(np.allclose(y, x @ op.to_dense(w), atol=1e-5))
    ((4, 16), True)
    """

    def __init__(self, layout, block_size: int | None = None, feature_axis: int | None = None,
                 tf32: bool | None = None):
        defaults = settings()["defaults"]
        self.tf32 = _check_tf32(tf32, defaults["tf32"])
        self.index: BlockIndex = block_index(
            layout, defaults["block_size"] if block_size is None else block_size
        )
        self.feature_axis = _check_feature_axis(defaults["feature_axis"] if feature_axis is None else feature_axis)
        self._gpu_calls: dict = {}

    @classmethod
    def from_index(cls, index: BlockIndex, feature_axis: int | None = None, tf32: bool | None = None):
        """An operator over an already-validated :class:`BlockIndex` (no re-validation of the layout)."""
        op = cls.__new__(cls)
        defaults = settings()["defaults"]
        op.index = index
        op.feature_axis = _check_feature_axis(defaults["feature_axis"] if feature_axis is None else feature_axis)
        op.tf32 = _check_tf32(tf32, defaults["tf32"])
        op._gpu_calls = {}
        return op

    # -- the layout -----------------------------------------------------------------
    @property
    def layout(self) -> np.ndarray:
        """(CB, KB) uint8, read-only."""
        return self.index.layout

    @property
    def block_size(self) -> int:
        return self.index.block_size

    @property
    def C(self) -> int:
        """Input features (rows of ``W``)."""
        return self.index.C

    @property
    def K(self) -> int:
        """Output features (columns of ``W``)."""
        return self.index.K

    @property
    def blocks(self) -> int:
        """Number of present blocks, ``nnzb``."""
        return self.index.nnzb

    @property
    def density(self) -> float:
        return self.index.density

    @property
    def w_shape(self) -> tuple[int, int, int]:
        return self.index.w_shape

    @property
    def indptr(self) -> np.ndarray:
        """(CB + 1,) row pointers of the BSR index (scipy.sparse conventions)."""
        return self.index.indptr

    @property
    def indices(self) -> np.ndarray:
        """(nnzb,) block column of each block."""
        return self.index.indices

    def flops(self, N: int) -> int:
        """Floating-point operations of one pass on ``N`` rows: 2·N·nnzb·bs²."""
        return 2 * int(N) * self.blocks * self.block_size**2

    # -- block data <-> dense -----------------------------------------------------------
    def to_dense(self, w):
        """Dense W (C, K) from block data ``w`` (NumPy or CuPy); absent blocks are 0."""
        self._check_weights(as_operand(w, "w"), "w", None)
        return blocks_to_dense(self.index, w)

    def from_dense(self, dense):
        """Block data (nnzb, bs, bs) of the present blocks of a dense ``W`` (C, K)."""
        if tuple(getattr(dense, "shape", ())) != (self.C, self.K):
            raise ValueError(f"dense must have shape ({self.C}, {self.K}); got {getattr(dense, 'shape', None)}")
        return dense_to_blocks(self.index, dense)

    # -- initial weights, as the seed's operator offered them ---------------------------------
    def normal_init(self, scale: float = 1.0, dtype=np.float32, seed=None) -> np.ndarray:
        """Block data from :func:`bsmm.initializers.normal` (std = scale / sqrt(fan-in))."""
        return initializers.normal(self.layout, self.block_size, scale=scale, dtype=dtype, seed=seed)

    def identity_init(self, dtype=np.float32, scale: float = 1.0) -> np.ndarray:
        """Block data from :func:`bsmm.initializers.identity` (any layout: the seed's identity,
        repeated along the longer side of a non-square layout), times ``scale``."""
        return initializers.identity(self.layout, self.block_size, dtype=dtype, scale=scale)

    def ortho_init(self, gain: float = 1.0, dtype=np.float32, seed=None) -> np.ndarray:
        """Block data from :func:`bsmm.initializers.orthogonal` (orthonormal per block column)."""
        return initializers.orthogonal(self.layout, self.block_size, gain=gain, dtype=dtype, seed=seed)

    # -- the three passes ---------------------------------------------------------------
    def __call__(self, x, w, out=None, accumulate: bool = False, *, bias=None, activation: str | None = None,
                 pre=None, gate=None):
        """Same as :meth:`fprop`."""
        return self.fprop(x, w, out=out, accumulate=accumulate, bias=bias, activation=activation, pre=pre,
                          gate=gate)

    def fprop(self, x, w, out=None, accumulate: bool = False, *, bias=None, activation: str | None = None,
              pre=None, gate=None, _skip=None):
        """y = x·W, or with a fused epilogue y = A(x·W + bias).

        Parameters
        ----------
        x : (N, C) array, or (C, N) with ``feature_axis=0``
        w : (nnzb, bs, bs) array of x's dtype
        out : (N, K) (or (K, N)) array, optional; written in place and returned
        accumulate : bool
            Add x·W to ``out`` (needs ``out``), rounding once: e.g. an LSTM's
            gates x·Wx + h·Wh without a separate sum. With an epilogue, what
            ``out`` held is added before the bias and the activation.
        bias : (K,) array of x's dtype and library, optional
            Added to every row inside the kernel.
        activation : {None, "none", "relu", "gelu", "gelu_tanh", "silu"}
            Applied inside the kernel to x·W + bias, in float32 (``"gelu"``: the
            erf form, PyTorch's default; see :mod:`bsmm.epilogues`).
        pre : array of y's shape, dtype and library, optional
            Receives z = x·W + bias before the activation: what
            :func:`bsmm.epilogues.activation_grad` needs for GELU and SiLU.
        gate : (nnzb,) array of w's dtype and library, optional
            One scale a block: y = x·(g ⊙ W) (:meth:`gated_weights`; NumPy and CuPy arrays). On CUDA
            the kernels skip the blocks whose gate is 0 (and updat's, whose dW is then 0).
        _skip : (nnzb,) array, private
            Gates that ``w`` is already scaled by (:mod:`bsmm.torch`; checked by the caller): the
            GPU kernels leave out the blocks where they are 0, with the same result.

        Returns
        -------
        y : (N, K) or (K, N), x's dtype and library

        Examples
        --------
        >>> import numpy as np, bsmm
        >>> op = bsmm.BlocksparseMatMul(np.array([[1, 0], [1, 1]]), block_size=8)
        >>> rng = np.random.default_rng(0)
        >>> x = rng.standard_normal((3, 16)).astype(np.float32)
        >>> w, b = op.normal_init(seed=1), rng.standard_normal(16).astype(np.float32)
        >>> y = op(x, w, bias=b, activation="relu")
        >>> bool(np.allclose(y, np.maximum(x @ op.to_dense(w) + b, 0), atol=1e-5))
        True
        """
        skip = _skip
        if gate is not None:
            w, skip = self._gated_and_skipped(w, gate, "w")
        if x.__class__ is _gpu_array_type and (out is not None or not accumulate) and (
                activation is None or activation.__class__ is str):  # a repeat: see FastCall
            # (only checked names are kept: any other string finds no call and takes the checked path)
            call = self._gpu_calls.get(("fprop", x.shape, x.dtype, self.feature_axis, self.tf32,
                                        epilogue_name(bias, activation)))
            result = call(x, w, out, accumulate, bias, pre, _pointer(skip)) if call is not None else None
            if result is not None:
                return result
        return self._activation_pass("fprop", x, "x", w, out, accumulate, self.C, self.K, bias, activation, pre,
                                     skip)

    def bprop(self, dy, w, out=None, accumulate: bool = False, *, gate=None, _skip=None):
        """dx = dy·Wᵀ.

        Parameters
        ----------
        dy : (N, K) array, or (K, N) with ``feature_axis=0``
        w : (nnzb, bs, bs) array of dy's dtype
        out : (N, C) (or (C, N)) array, optional
        accumulate : bool
            Add dy·Wᵀ to ``out`` (needs ``out``).
        gate : (nnzb,) array, optional
            As :meth:`fprop`'s: dx = dy·(g ⊙ W)ᵀ.
        _skip : as :meth:`fprop`'s

        Returns
        -------
        dx : (N, C) or (C, N), dy's dtype and library
        """
        skip = _skip
        if gate is not None:
            w, skip = self._gated_and_skipped(w, gate, "w")
        if dy.__class__ is _gpu_array_type and (out is not None or not accumulate):
            call = self._gpu_calls.get(("bprop", dy.shape, dy.dtype, self.feature_axis, self.tf32, "store"))
            result = call(dy, w, out, accumulate, gate_ptr=_pointer(skip)) if call is not None else None
            if result is not None:
                return result
        return self._activation_pass("bprop", dy, "dy", w, out, accumulate, self.K, self.C, skip=skip)

    def _activation_pass(self, pass_name: str, act, act_name: str, w, out, accumulate: bool,
                         features_in: int, features_out: int, bias=None, activation=None, pre=None, skip=None):
        """fprop and bprop through the checked path: ``act`` (features_in wide) times W or Wᵀ into
        features_out, through the epilogue that ``bias``, ``activation`` and ``pre`` ask for; ``skip``:
        the checked gates ``w`` was scaled by, whose closed blocks the kernels may leave out."""
        act_op, w_op = as_operand(act, act_name), as_operand(w, "w")
        n = self._check_activation(act_op, act_name, features_in)
        dtype = canonical_dtype(act_op.array.dtype, act_name, act_op.backend)
        self._check_weights(w_op, "w", dtype)
        places = {act_name: act_op, "w": w_op}
        activation = check_activation(activation)
        shape = self._activation_shape(n, features_out)
        bias_op = None if bias is None else self._check_vector(as_operand(bias, "bias"), "bias", features_out, dtype)
        pre_op = None if pre is None else as_operand(pre, "pre")
        if pre_op is not None:
            if activation is None and bias is None:
                raise ValueError("pre= keeps the pre-activation of an epilogue: pass bias= or activation= too")
            self._check_like_output(pre_op, "pre", shape, dtype)
        places.update({name: op for name, op in (("bias", bias_op), ("pre", pre_op)) if op is not None})
        check_same_place(places)
        if accumulate and out is None:
            raise ValueError("accumulate=True needs out=, the buffer to add the product to")
        inputs = tuple(op for op in (act_op, w_op, bias_op) if op is not None)
        result = output_array(out, act_op, shape, dtype, inputs)
        if pre_op is not None and any(overlaps(pre_op.array, a) for a in (result, *(op.array for op in inputs))):
            raise ValueError("pre overlaps out or an input; pass a separate buffer")
        name = epilogue_name(bias, activation)
        epilogue = None if name == "store" else EpilogueCall(
            name, None if bias_op is None else bias_op.array, None if pre_op is None else pre_op.array)
        backend = for_operand(act_op)
        options = {"accumulate": bool(accumulate)}
        if epilogue is not None:
            options["epilogue"] = epilogue
        if skip is not None:
            options["gate"] = skip
        call = getattr(backend, pass_name)(self.index, act_op.array, w_op.array, result, self.feature_axis, self.tf32,
                                           **options)
        self._remember(pass_name, act_op, call, name)
        return out if out is not None else act_op.wrap(result)

    @staticmethod
    def _check_vector(operand: Operand, argument: str, length: int, dtype) -> Operand:
        array = operand.array
        if tuple(array.shape) != (length,):
            raise ValueError(f"{argument} must have shape ({length},); got {tuple(array.shape)}")
        if array.dtype != dtype:
            raise TypeError(f"{argument} has dtype {array.dtype} but the activations have {dtype}; pass one dtype")
        if not array.flags.c_contiguous:
            raise _not_contiguous(operand, argument)
        return operand

    @staticmethod
    def _check_like_output(operand: Operand, argument: str, shape: tuple, dtype) -> None:
        array = operand.array
        if tuple(array.shape) != tuple(shape):
            raise ValueError(f"{argument} must have the output's shape {tuple(shape)}; got {tuple(array.shape)}")
        if array.dtype != dtype:
            raise TypeError(f"{argument} has dtype {array.dtype} but the activations have {dtype}; pass one dtype")
        if not array.flags.c_contiguous:  # (an output: a contiguous copy would not receive what is written)
            raise ValueError(f"{argument} must be C-contiguous; got strides {array.strides}; pass a C-contiguous "
                             f"array to be written")

    def updat(self, x, dy, out=None, accumulate: bool = False, *, gate=None, _skip=None):
        """dW = xᵀ·dy on the present blocks only.

        Parameters
        ----------
        x : (N, C) array, or (C, N) with ``feature_axis=0``
        dy : (N, K) array, or (K, N), same dtype and N as ``x``
        out : (nnzb, bs, bs) array, optional
            Written in place and returned.
        accumulate : bool
            Add to ``out`` instead of overwriting it (needs ``out``), e.g. to
            sum the gradients of many time steps into one buffer.
        gate : (nnzb,) array of x's dtype and library, optional
            As :meth:`fprop`'s: dW = g ⊙ (xᵀ·dy), each block scaled by its gate
            (the gate's own gradient: :meth:`gate_grad`).
        _skip : (nnzb,) array, private
            Gates (checked by the caller, :mod:`bsmm.torch`) whose closed (0) blocks the GPU kernels may
            leave out: their gradient is then 0, or what the pass computes where it cannot skip them.

        Returns
        -------
        dw : (nnzb, bs, bs), x's dtype and library
        """
        if gate is not None:
            if accumulate and out is None:
                raise ValueError("accumulate=True needs out=, the buffer to add the gradient to")
            # The kernels may leave the closed blocks out (zeros); the scale then sets every block.
            skip = self._skipped(as_operand(x, "x"), gate, "x")
            scaled = self._gated(self._updat(x, dy, None, False, skip), gate, "x")
            if out is None:
                return scaled
            out_op = as_operand(out, "out")
            self._check_weights(out_op, "out", scaled.dtype)
            if accumulate:
                out_op.array += scaled
            else:
                out_op.array[...] = scaled
            return out
        return self._updat(x, dy, out, accumulate, _skip)

    def _updat(self, x, dy, out, accumulate: bool, skip):
        """:meth:`updat` without gates; ``skip``: checked gates whose closed blocks the kernels may leave out."""
        if x.__class__ is _gpu_array_type and (out is not None or not accumulate):
            call = self._gpu_calls.get(("updat", x.shape, x.dtype, self.feature_axis, self.tf32, "store"))
            result = call(x, dy, out, accumulate, gate_ptr=_pointer(skip)) if call is not None else None
            if result is not None:
                return result
        x_op, dy_op = as_operand(x, "x"), as_operand(dy, "dy")
        n = self._check_activation(x_op, "x", self.C)
        n_dy = self._check_activation(dy_op, "dy", self.K)
        dtype = canonical_dtype(x_op.array.dtype, "x", x_op.backend)
        if dy_op.array.dtype != dtype:
            raise TypeError(f"dy has dtype {dy_op.array.dtype} but x has {dtype}; pass one dtype")
        if n_dy != n:
            raise ValueError(f"dy has {n_dy} rows (N) but x has {n}; they must match")
        check_same_place({"x": x_op, "dy": dy_op})
        if accumulate and out is None:
            raise ValueError("accumulate=True needs out=, the buffer to add the gradient to")
        result = output_array(out, x_op, self.w_shape, dtype, (x_op, dy_op))
        options = {} if skip is None else {"gate": skip}
        call = for_operand(x_op).updat(
            self.index, x_op.array, dy_op.array, result, self.feature_axis, self.tf32, accumulate=bool(accumulate),
            **options)
        self._remember("updat", x_op, call, "store")
        return out if out is not None else x_op.wrap(result)

    # -- checks shared by the passes ----------------------------------------------------
    def _activation_shape(self, n: int, features: int) -> tuple[int, int]:
        return (n, features) if self.feature_axis == 1 else (features, n)

    def _check_activation(self, operand: Operand, argument: str, features: int) -> int:
        """Return N, or raise naming ``argument``."""
        array = operand.array
        expected = "(N, {0})" if self.feature_axis == 1 else "({0}, N)"
        if array.ndim != 2 or array.shape[self.feature_axis] != features:
            raise ValueError(
                f"{argument} must have shape {expected.format(features)} with feature_axis={self.feature_axis}; "
                f"got {tuple(array.shape)}"
            )
        if not array.flags.c_contiguous:
            raise _not_contiguous(operand, argument)
        return array.shape[1 - self.feature_axis]

    def gated_weights(self, w, gate):
        """g ⊙ W: each block of ``w`` scaled by its gate, a new array (the gated passes compute with it).

        Parameters
        ----------
        w : (nnzb, bs, bs) NumPy or CuPy array
        gate : (nnzb,) array of w's dtype, library and device

        Examples
        --------
        >>> import numpy as np, bsmm
        >>> op = bsmm.BlocksparseMatMul(np.array([[1, 0], [1, 1]]), block_size=8)
        >>> w = np.ones(op.w_shape, np.float32)
        >>> op.gated_weights(w, np.array([0.0, 0.5, 2.0], np.float32))[:, 0, 0].tolist()
        [0.0, 0.5, 2.0]
        """
        return self._gated(w, gate, "w")

    def _gated(self, blocks, gate, argument: str):
        """``blocks`` (nnzb, bs, bs) scaled by ``gate``; ``argument`` names the array whose dtype ``gate`` must have."""
        return self._gated_and_skipped(blocks, gate, argument)[0]

    def _gated_and_skipped(self, blocks, gate, argument: str) -> tuple:
        """(:meth:`_gated`, :meth:`_skipped`) of ``blocks`` and ``gate``."""
        w_op = as_operand(blocks, argument)
        skip = self._skipped(w_op, gate, argument)
        self._check_weights(w_op, argument, None)
        return w_op.array * as_operand(gate, "gate").array.reshape(-1, 1, 1), skip

    def _skipped(self, like: Operand, gate, argument: str):
        """``gate`` checked against ``like`` (the array named ``argument``: library, place, dtype) and
        its shape against the layout; the array the kernels may skip closed blocks by (C-contiguous),
        else None (the product is the same: the weights are scaled by the gate first)."""
        gate_op = as_operand(gate, "gate")
        if like.library not in ("numpy", "cupy"):
            raise TypeError(f"gate= takes NumPy or CuPy arrays here; {argument} is a {like.library} array: in PyTorch "
                            f"or JAX pass gate= to bsmm.torch.blocksparse_matmul or bsmm.jax.blocksparse_matmul")
        check_same_place({argument: like, "gate": gate_op})
        if tuple(gate_op.array.shape) != (self.blocks,):
            raise ValueError(f"gate must have shape ({self.blocks},), one value a block; "
                             f"got {tuple(gate_op.array.shape)}")
        if gate_op.array.dtype != like.array.dtype:
            raise TypeError(f"gate has dtype {gate_op.array.dtype} but {argument} has {like.array.dtype}; "
                            f"pass one dtype")
        return gate_op.array if gate_op.array.flags.c_contiguous else None

    def gate_grad(self, x, dy, w):
        """The gates' gradient of a gated product: ``dg_j = ⟨W_j, (xᵀ·dy)_j⟩``, summed in float32 (float64
        for float64).

        Parameters
        ----------
        x, dy : as :meth:`updat`'s
        w : (nnzb, bs, bs) array, the ungated weights

        Returns
        -------
        dg : (nnzb,), w's dtype and library

        Examples
        --------
        >>> import numpy as np, bsmm
        >>> op = bsmm.BlocksparseMatMul(np.array([[1]]), block_size=8)
        >>> x, dy, w = np.ones((3, 8), np.float32), np.ones((3, 8), np.float32), np.ones(op.w_shape, np.float32)
        >>> op.gate_grad(x, dy, w).tolist()   # 64 entries of 3 times 1
        [192.0]
        """
        raw, w_op = self.updat(x, dy), as_operand(w, "w")
        self._check_weights(w_op, "w", raw.dtype)
        xp = array_module(w_op.array)
        wide = xp.float64 if w_op.array.dtype == xp.float64 else xp.float32
        product = w_op.array.astype(wide) * raw.astype(wide)
        return product.sum(axis=(1, 2)).astype(w_op.array.dtype)

    def _check_weights(self, operand: Operand, argument: str, dtype) -> None:
        array = operand.array
        if tuple(array.shape) != self.w_shape:
            raise ValueError(f"{argument} must have shape w_shape {self.w_shape}; got {tuple(array.shape)}")
        if dtype is None:
            canonical_dtype(array.dtype, argument, operand.backend)
        elif array.dtype != dtype:
            raise TypeError(f"{argument} has dtype {array.dtype} but the activations have {dtype}; pass one dtype")
        if not array.flags.c_contiguous:
            raise _not_contiguous(operand, argument)

    @property
    def kept_calls(self) -> dict:
        """The repeatable GPU calls this operator keeps (``bsmm.backends.cuda.backend.FastCall``),
        by (pass, activation shape, dtype, feature axis, tf32, epilogue): the calls a repeat of that shape
        launches without checks or planning. Read it; :meth:`forget_calls` empties it."""
        return self._gpu_calls

    def forget_calls(self) -> None:
        """Drop the kept calls: the next call of each shape is checked and planned again (under
        the policy current then, :func:`bsmm.backends.cuda.policy.planning`)."""
        self._gpu_calls.clear()

    def _remember(self, pass_name: str, act: Operand, call, epilogue: str) -> None:
        """Keep the GPU backend's repeatable call for CuPy arrays of this shape (see FastCall)."""
        global _gpu_array_type
        if act.backend != "cuda" or act.library != "cupy" or call is None:
            return  # CPU passes and DLPack callers keep the checked path
        _gpu_array_type = type(act.array)
        if len(self._gpu_calls) >= _MAX_GPU_CALLS:
            self._gpu_calls.clear()  # e.g. a new batch size every call: keep the dict small
        self._gpu_calls[(pass_name, act.array.shape, act.array.dtype, self.feature_axis, self.tf32, epilogue)] = call

    # -- identity, pickling -----------------------------------------------------------
    def __reduce__(self):
        # Only the layout travels; the index is rebuilt (and cached) on load.
        return (type(self), (np.array(self.layout), self.block_size, self.feature_axis, self.tf32))

    def __repr__(self) -> str:
        return (
            f"BlocksparseMatMul(C={self.C}, K={self.K}, block_size={self.block_size}, "
            f"blocks={self.blocks}, density={self.density:.3g}, feature_axis={self.feature_axis})"
        )

"""``BlockSparseLSTM``: one ``torch.nn.LSTM`` layer whose gate matrices follow block-sparse layouts.

A sequence runs as one differentiable operation (:mod:`bsmm.torch.lstm_sequence`), eagerly and under
``torch.compile``; on CUDA its steps are two launches each way, replayed from CUDA graphs the layer
keeps (:mod:`bsmm.torch.lstm_steps`).

The gates are bsmm's (:mod:`bsmm.nn.lstm_gates`): input, forget, output, candidate along the
``4H`` columns, so the parameters are those of :class:`bsmm.nn.lstm.BlocksparseLSTM`
(``wx``, ``wh``, ``b``). ``torch.nn.LSTM`` orders its gates input, forget, candidate, output,
stores ``Wᵀ`` and has two biases: see :class:`BlockSparseLSTM`'s Notes.
"""

from __future__ import annotations

import collections

import numpy as np
import torch
import torch.utils.hooks

from bsmm.block_index import check_block_size, check_layout
from bsmm.layouts.checks import check_int
from bsmm.layouts.small_world import small_world_layout
from bsmm.matmul import BlocksparseMatMul
from bsmm.nn.lstm_gates import GATES
from bsmm.torch import lstm_steps
from bsmm.torch.checks import check_dtype, check_like
from bsmm.torch.lstm_sequence import CompiledSequence, Sequence, plan_of
from bsmm.torch.registry import Registration, cuda_graphs_recorded, is_moving, move, register
from bsmm.torch.registry import moving as moving_registration

__all__ = ["BlockSparseLSTM"]

_GATES = len(GATES)


def _layout_array(layout) -> np.ndarray:
    if isinstance(layout, torch.Tensor):
        return layout.detach().cpu().numpy()
    return np.asarray(layout)


def _gate_layout(layout, argument: str, rows: int, hidden_blocks: int) -> np.ndarray:
    """The (rows, 4·hidden_blocks) layout of a gate matrix from a per-gate or all-gates ``layout``."""
    checked = check_layout(_layout_array(layout))
    widths = (hidden_blocks, _GATES * hidden_blocks)
    if checked.shape[0] != rows or checked.shape[1] not in widths:
        raise ValueError(f"{argument} must have shape ({rows}, {widths[0]}) (one gate, tiled) or ({rows}, "
                         f"{widths[1]}) (all gates); got {checked.shape}")
    return np.tile(checked, (1, _GATES)) if checked.shape[1] == hidden_blocks else checked


def gate_column_bounds(layout: np.ndarray, block_size: int, hidden_size: int) -> np.ndarray:
    """Per block column ``k`` of a (H/bs, 4H/bs) recurrent layout: the initialization bound
    1/sqrt(fan_in_k), ``fan_in_k = block_size ×`` the column's present blocks (``hidden_size`` for an empty one)."""
    fan_in = np.count_nonzero(layout, axis=0) * block_size
    return 1.0 / np.sqrt(np.where(fan_in > 0, fan_in, hidden_size))


def _describe(layout) -> str:
    """A layout (or None, a dense ``Wx``) in words, for the state_dict's error."""
    if layout is None:
        return "none (a dense Wx)"
    return f"a layout of shape {layout.shape} with {int(np.count_nonzero(layout))} blocks"


def _refuse_under_recorded_graphs() -> None:
    """Raise where ``torch.compile`` recorded CUDA graphs in this thread: their replays would launch an old
    layout's tables, so a BlockSparseLSTM's layout does not change there."""
    if cuda_graphs_recorded():
        raise RuntimeError("BlockSparseLSTM: its layout cannot change under CUDA graphs that torch.compile "
                           "recorded in this thread (mode='reduce-overhead'): compile without CUDA graphs")


class BlockSparseLSTM(torch.nn.Module):
    """One LSTM layer (one direction) whose recurrent, and optionally input, weights are block-sparse.

    Parameters
    ----------
    input_size, hidden_size : int
        ``I`` and ``H``. ``H`` must be a multiple of ``block_size``, and ``I`` too where ``Wx`` is sparse.
    recurrent_layout : (H/bs, H/bs) or (H/bs, 4H/bs) array or tensor of 0/1, optional
        Layout of ``Wh`` (H, 4H): one square layout is tiled once per gate (block ``c`` feeds hidden
        block ``k`` through all four gates exactly when ``layout[c, k]``), a wider one gives each gate
        its own. Leave out for a small-world layout of ``density``, or, without ``density``, all blocks.
    block_size : int
        8, 16, 32, 64 or 128.
    bias : bool
        Learn a bias of the gates, ``(4H,)``.
    batch_first : bool
        Input and output ``(N, T, ·)`` instead of ``(T, N, ·)``, as ``torch.nn.LSTM``.
    input_layout : None, "recurrent", or (I/bs, H/bs) or (I/bs, 4H/bs) array or tensor
        Layout of ``Wx`` (I, 4H). None: ``Wx`` is dense (any ``input_size``). ``"recurrent"``: the
        layout of ``Wh`` (needs ``input_size == hidden_size``), as the seed's small-world LSTMs.
    density : float in (0, 1], optional
        Without ``recurrent_layout``: a symmetric small-world graph among the ``H/bs`` hidden blocks
        with about ``density · (H/bs)²`` blocks, or the sparsest graph of ``kind`` where that has more
        (:func:`bsmm.layouts.small_world_layout`).
    kind : {"barabasi_albert", "watts_strogatz"}
        The small-world graph of ``density``.
    seed : int, numpy.random.Generator or None
        Of the small-world graph.
    tf32 : bool
        On the GPU, float32 products on TF32 tensor cores.
    cuda_graphs : bool
        On CUDA, replay each sequence's per-step loops (forward and backward) from CUDA graphs the layer
        captures once per (T, N, dtype, device) into buffers of its own (:mod:`bsmm.torch.lstm_steps`):
        a sequence then costs a handful of host calls instead of four launches a step. Inside a CUDA
        graph capture of the caller's, the loops run as launches that capture records. False: always
        the launches.
    device, dtype
        Of the parameters: float32, float16 or bfloat16, or float64 on the CPU.

    Attributes
    ----------
    weight_ih : Parameter, block data (nnzb, bs, bs) of ``Wx``'s layout, or dense (I, 4H)
    weight_hh : Parameter, block data (nnzb, bs, bs) of ``Wh``'s layout
        Blocks row-major over ``recurrent_layout`` (see :class:`bsmm.BlocksparseMatMul`).
    bias : Parameter (4H,) or None
    recurrent_layout : buffer (H/bs, 4H/bs) uint8
        Every gate's layout side by side; saved in the ``state_dict`` (loading a state_dict of another
        layout raises). Pass it back as ``recurrent_layout`` to rebuild the layer.
    input_layout : buffer (I/bs, 4H/bs) uint8, or None where ``Wx`` is dense

    Notes
    -----
    Shapes are ``torch.nn.LSTM``'s for one layer and one direction: ``input`` (T, N, I), (N, T, I)
    with ``batch_first``, or (T, I) unbatched; ``hx = (h0, c0)`` each (1, N, H) or (1, H), zeros if
    left out; returns ``output`` (T, N, H) (or batch-first, or unbatched) and ``(h_n, c_n)``, each
    (1, N, H) or (1, H). The input must have the parameters' dtype and device (``torch.autocast``
    does not cast it: choose ``dtype``).

    The pre-activations are ``z = x·Wx + h·Wh + b`` with bsmm's gate order along the 4H columns,
    input, forget, output, candidate (:data:`bsmm.nn.lstm.GATES`). For a dense layout the layer is
    ``torch.nn.LSTM`` with ``weight_ih_l0 = Wx.T`` and ``weight_hh_l0 = Wh.T`` after moving the gate
    blocks of rows into its order (input, forget, candidate, output), and ``b = bias_ih_l0 + bias_hh_l0``.

    Initialization follows ``torch.nn.LSTM`` with each gate column's true fan-in: the weights of
    block column ``k`` (in ``Wx`` and ``Wh``) and the bias entries of its features are drawn from
    U(-1/sqrt(fan_in_k), 1/sqrt(fan_in_k)), ``fan_in_k = block_size ×`` the present blocks of column
    ``k`` of ``Wh`` (``H`` for an empty column), with PyTorch's generator. For a dense layout this is
    ``torch.nn.LSTM``'s U(-1/sqrt(H), 1/sqrt(H)).

    A sequence is one differentiable operation (:mod:`bsmm.torch.lstm_sequence`): the gradients are
    first-order (no ``create_graph``); a ``torch.compile``'d model traces it as two operators, with no
    graph break at the layer.

    Examples
    --------
    >>> import torch, bsmm.torch
    >>> lstm = bsmm.torch.BlockSparseLSTM(64, 64, block_size=8, density=0.5, seed=0, input_layout="recurrent")
    >>> lstm
    BlockSparseLSTM(64, 64, block_size=8, recurrent_density=0.5, input_density=0.5, bias=True)
    >>> x = torch.randn(5, 3, 64)  # (T, N, I)
    >>> output, (h_n, c_n) = lstm(x)
    >>> output.shape, h_n.shape, c_n.shape
    (torch.Size([5, 3, 64]), torch.Size([1, 3, 64]), torch.Size([1, 3, 64]))
    >>> torch.equal(output[-1], h_n[0])
    True
    >>> output.square().sum().backward()
    >>> lstm.weight_hh.grad.shape == lstm.weight_hh.shape
    True
    """

    def __init__(self, input_size: int, hidden_size: int, recurrent_layout=None, block_size: int = 32,
                 bias: bool = True, batch_first: bool = False, *, input_layout=None, density=None,
                 kind: str = "barabasi_albert", seed=None, tf32: bool = False, cuda_graphs: bool = True, device=None,
                 dtype=None):
        super().__init__()
        self.cuda_graphs = bool(cuda_graphs)
        self._graphs = lstm_steps.SequenceGraphs()
        self._gradient_captures: collections.OrderedDict = collections.OrderedDict()
        self.input_size = check_int(input_size, "input_size", 1)
        self.hidden_size = check_int(hidden_size, "hidden_size", 1)
        self.block_size = bs = check_block_size(block_size)
        self.batch_first, self.tf32 = bool(batch_first), bool(tf32)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        check_dtype(dtype, torch.empty(0, device=device).device, "dtype")
        if self.hidden_size % bs:
            raise ValueError(f"hidden_size must be a multiple of block_size ({bs}); got {self.hidden_size}")
        hidden_blocks = self.hidden_size // bs
        recurrent = _gate_layout(self._recurrent_graph(recurrent_layout, density, kind, seed, hidden_blocks),
                                 "recurrent_layout", hidden_blocks, hidden_blocks)
        self._recurrent = register(BlocksparseMatMul(recurrent, bs).index)
        self._input = self._input_registration(input_layout, recurrent, hidden_blocks)
        #: Whether ``Wx`` follows ``Wh``'s layout (``input_layout="recurrent"``): a layout change moves both.
        self.shared_layout = isinstance(input_layout, str)
        for name, registration in (("recurrent_layout", self._recurrent), ("input_layout", self._input)):
            self.register_buffer(name, None if registration is None else
                                 torch.tensor(np.array(registration.index.layout), device=device))
        factory = {"device": device, "dtype": dtype}
        ih_shape = (self.input_size, _GATES * self.hidden_size) if self._input is None else self._input.index.w_shape
        self.weight_ih = torch.nn.Parameter(torch.empty(ih_shape, **factory))
        self.weight_hh = torch.nn.Parameter(torch.empty(self._recurrent.index.w_shape, **factory))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(_GATES * self.hidden_size, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    @staticmethod
    def _recurrent_graph(layout, density, kind: str, seed, hidden_blocks: int):
        if density is None:
            return np.ones((hidden_blocks, hidden_blocks), np.uint8) if layout is None else layout
        if layout is not None:
            raise ValueError("pass recurrent_layout or density, not both: density makes a small-world recurrent_layout")
        if isinstance(density, bool) or not isinstance(density, (int, float, np.integer, np.floating)):
            raise TypeError(f"density must be a real number in (0, 1]; got {type(density).__name__}")
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1]; got {density}")
        return small_world_layout(hidden_blocks, round(density * hidden_blocks**2), kind, seed)

    def _input_registration(self, layout, recurrent: np.ndarray, hidden_blocks: int) -> Registration | None:
        """The registration of ``Wx``'s layout, None where ``Wx`` is dense."""
        if layout is None:
            return None
        if isinstance(layout, str):
            if layout != "recurrent":
                raise ValueError(f"input_layout must be None, 'recurrent' or a layout; got {layout!r}")
            if self.input_size != self.hidden_size:
                raise ValueError(f"input_layout='recurrent' needs input_size == hidden_size; got {self.input_size} "
                                 f"and {self.hidden_size}")
            full = recurrent
        else:
            if self.input_size % self.block_size:
                raise ValueError(f"input_size must be a multiple of block_size ({self.block_size}) for a sparse "
                                 f"input_layout; got {self.input_size}")
            full = _gate_layout(layout, "input_layout", self.input_size // self.block_size, hidden_blocks)
        return register(BlocksparseMatMul(full, self.block_size).index)

    def reset_parameters(self) -> None:
        """Draw the weights and bias again (see Notes), with PyTorch's random generator."""
        bounds = gate_column_bounds(self._recurrent.index.layout, self.block_size, self.hidden_size)
        with torch.no_grad():
            for weight, registration in ((self.weight_hh, self._recurrent), (self.weight_ih, self._input)):
                column_bounds = bounds[registration.index.indices] if registration is not None else \
                    np.repeat(bounds, self.block_size)
                scale = torch.tensor(column_bounds, dtype=weight.dtype, device=weight.device)
                weight.uniform_(-1.0, 1.0).mul_(scale.view(-1, 1, 1) if registration is not None else scale)
            if self.bias is not None:
                scale = torch.tensor(np.repeat(bounds, self.block_size), dtype=self.bias.dtype, device=self.bias.device)
                self.bias.uniform_(-1.0, 1.0).mul_(scale)

    def forward(self, input: torch.Tensor, hx=None):
        """input (T, N, I) (or batch-first, or (T, I)) -> output, (h_n, c_n) as ``torch.nn.LSTM``."""
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor; got {type(input).__name__}")
        batched = input.dim() == 3
        if input.dim() not in (2, 3) or input.shape[-1] != self.input_size or 0 in input.shape:
            order = "(N, T, {0})" if self.batch_first else "(T, N, {0})"
            raise ValueError(f"input must have shape {order.format(self.input_size)} or (T, {self.input_size}) "
                             f"with T, N >= 1; got {tuple(input.shape)}")
        check_dtype(input.dtype, input.device, "input")
        check_like(input, "input", self.weight_hh, "weight_hh")
        x = input if batched else input.unsqueeze(1)
        if self.batch_first and batched:
            x = x.transpose(0, 1)
        x = x.contiguous()
        n = x.shape[1]
        if hx is None:
            h0 = c0 = x.new_zeros(n, self.hidden_size)
        else:
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise TypeError(f"hx must be a tuple (h0, c0); got {type(hx).__name__}")
            h0, c0 = (self._state(state, name, input, batched, n) for state, name in zip(hx, ("h0", "c0")))
        input_key = None if self._input is None else self._input.key
        if torch.compiler.is_compiling():  # the sequence's two operators, traced into the caller's graph
            if self._gradient_captures:
                raise NotImplementedError("BlockSparseLSTM: a gradient capture (register_gradient_capture, as "
                                          "DynamicSparsity(criterion='rigl') registers) runs in the eager backward "
                                          "only: run the model uncompiled, or use criterion='set'")
            output, h_n, c_n = CompiledSequence.apply(x, h0, c0, self.weight_ih, self.weight_hh, self.bias,
                                                      self._recurrent.key, input_key, self.tf32)
        else:
            plan = plan_of(self._recurrent.key, input_key, self.tf32, (self._recurrent, self._input),
                           self._graphs if self.cuda_graphs else None, self._armed_captures())
            output, h_n, c_n = Sequence.apply(x, h0, c0, self.weight_ih, self.weight_hh, self.bias, plan)
        if not batched:  # N = 1: h_n and c_n are (1, H) already
            return output.squeeze(1), (h_n, c_n)
        if self.batch_first:
            output = output.transpose(0, 1)
        return output, (h_n.unsqueeze(0), c_n.unsqueeze(0))

    def register_gradient_capture(self, hook) -> torch.utils.hooks.RemovableHandle:
        """Call ``hook()`` at every eager forward under grad; where it returns a function, the sequence's
        backward calls that with the rows of the weight gradients, ``(h_in, x, dz)``: ``h_in`` (T·N, H) the
        states each step read (``h_0 … h_{T-1}``), ``x`` (T·N, I) the input and ``dz`` (T·N, 4H) the
        pre-activation gradients, so that ``dWh = h_inᵀ·dz`` and ``dWx = xᵀ·dz``. ``dz`` may be a buffer
        the layer writes again: copy what you keep. A capture is refused under ``torch.compile``.

        Examples
        --------
        >>> import torch, bsmm.torch
        >>> lstm = bsmm.torch.BlockSparseLSTM(32, 32, block_size=16, bias=False)
        >>> rows = []
        >>> handle = lstm.register_gradient_capture(lambda: lambda h_in, x, dz: rows.append(dz.clone()))
        >>> lstm(torch.randn(5, 2, 32))[0].sum().backward()
        >>> handle.remove()
        >>> rows[0].shape
        torch.Size([10, 128])
        """
        handle = torch.utils.hooks.RemovableHandle(self._gradient_captures)
        self._gradient_captures[handle.id] = hook
        return handle

    def _armed_captures(self) -> tuple:
        """This forward's gradient captures (see :meth:`register_gradient_capture`)."""
        if not self._gradient_captures or not torch.is_grad_enabled():
            return ()
        return tuple(call for call in (hook() for hook in self._gradient_captures.values()) if call is not None)

    def __setstate__(self, state):
        super().__setstate__(state)
        if "_gradient_captures" not in self.__dict__:  # pickled before layouts could change
            self._gradient_captures = collections.OrderedDict()
            self.shared_layout = self._input is not None and self._input.key == self._recurrent.key

    def _adopt_layout(self, layout: np.ndarray, moving: bool = False) -> None:
        """Compute ``Wh`` (and ``Wx`` where it shares the layout) with ``layout`` (H/bs, 4H/bs) from now on,
        a layout of as many blocks; the caller reorders the weights' slots
        (:func:`bsmm.torch.dynamic.change_layout`). The CUDA graphs of the old layout are forgotten. Under a
        moving key (or with ``moving``: a change of :mod:`bsmm.torch.dynamic`) the key follows the layout, so
        a compiled model needs no recompilation; else the layer takes the layout's content key."""
        _refuse_under_recorded_graphs()
        index = BlocksparseMatMul(layout, self.block_size).index
        old = self._recurrent.index
        if index.layout.shape != old.layout.shape or index.nnzb != old.nnzb:
            raise ValueError(f"layout must have shape {old.layout.shape} and hold {old.nnzb} blocks, as the layer's "
                             f"recurrent layout; got shape {index.layout.shape} with {index.nnzb} blocks")
        self._use_recurrent(move(self._moving_registration(), index)
                            if moving or is_moving(self._recurrent.key) else register(index))
        # The graphs launch the old layout's passes, and a new operator may reuse the id they are keyed by.
        self._graphs.invalidate()
        with torch.no_grad():
            for name in ("recurrent_layout",) + (("input_layout",) if self.shared_layout else ()):
                getattr(self, name).copy_(torch.from_numpy(np.array(index.layout)))

    def _moving_registration(self) -> Registration:
        """The recurrent layout's registration, moved to a moving key of its own on the first call (a model
        compiled before that compiles once more; :class:`bsmm.torch.DynamicSparsity` calls this when it is
        built). A shared input layout follows it."""
        if not is_moving(self._recurrent.key):
            self._use_recurrent(moving_registration(self._recurrent.index))
        return self._recurrent

    def _content_registration(self) -> None:
        """Back to the layout's content key (:meth:`bsmm.torch.DynamicSparsity.remove`), the moving
        registration retired."""
        if is_moving(self._recurrent.key):
            self._recurrent.retired = True
            self._use_recurrent(register(self._recurrent.index))

    def _use_recurrent(self, registration: Registration) -> None:
        """Compute ``Wh`` (and ``Wx`` where it shares the layout) under ``registration``."""
        self._recurrent = registration
        if self.shared_layout:
            self._input = registration

    def _state(self, state, name: str, input: torch.Tensor, batched: bool, n: int) -> torch.Tensor:
        """``h0`` or ``c0`` as (N, H), contiguous, or raise naming it."""
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(state).__name__}")
        expected = (1, n, self.hidden_size) if batched else (1, self.hidden_size)
        if tuple(state.shape) != expected:
            raise ValueError(f"{name} must have shape {expected} for this input; got {tuple(state.shape)}")
        check_like(state, name, input, "input")
        return state.reshape(n, self.hidden_size).contiguous()

    def to_dense_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``Wx`` (I, 4H) and ``Wh`` (H, 4H), zero where blocks are absent; differentiable.

        ``torch.nn.LSTM`` stores their transposes, its gates in another order (see the class Notes).
        """
        dense = [self.weight_ih if self._input is None else self._dense(self.weight_ih, self._input.index),
                 self._dense(self.weight_hh, self._recurrent.index)]
        return dense[0], dense[1]

    @staticmethod
    def _dense(weight: torch.Tensor, index) -> torch.Tensor:
        rows = torch.tensor(index.rows, dtype=torch.long, device=weight.device)
        cols = torch.tensor(index.indices, dtype=torch.long, device=weight.device)
        blocks = weight.new_zeros(*index.layout.shape, index.block_size, index.block_size).index_put((rows, cols),
                                                                                                      weight)
        return blocks.permute(0, 2, 1, 3).reshape(index.C, index.K)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        self._adopt_saved_layout(state_dict, prefix)
        for name, registration in (("recurrent_layout", self._recurrent), ("input_layout", self._input)):
            saved = state_dict.get(prefix + name)
            saved = None if saved is None else saved.detach().cpu().numpy() != 0
            own = None if registration is None else registration.index.layout != 0
            if (saved is None and own is None) or (saved is not None and own is not None and saved.shape == own.shape
                                                   and np.array_equal(saved, own)):
                continue
            moved = " in other places" if saved is not None and own is not None and saved.shape == own.shape and \
                np.count_nonzero(saved) == np.count_nonzero(own) else ""
            error_msgs.append(
                f"{prefix}{name}: the state_dict holds {_describe(saved)}, this BlockSparseLSTM has {_describe(own)}"
                f"{moved}; "
                f"build the layer with the saved layouts, BlockSparseLSTM(..., recurrent_layout=state_dict["
                f"'{prefix}recurrent_layout'], input_layout=state_dict.get('{prefix}input_layout'))"
            )
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _adopt_saved_layout(self, state_dict, prefix: str) -> None:
        """Adopt a saved recurrent layout of this one's shape and block count (one changed while training,
        :func:`bsmm.torch.dynamic.change_layout`), with the saved input layout where the layer shares it."""
        saved = state_dict.get(prefix + "recurrent_layout")
        if saved is None:
            return
        saved = saved.detach().cpu().numpy() != 0
        own = self._recurrent.index.layout != 0
        saved_input = state_dict.get(prefix + "input_layout")
        saved_input = None if saved_input is None else saved_input.detach().cpu().numpy() != 0
        if self.shared_layout:  # the input layout moves with it, and so do both weights
            follows = saved_input is not None and saved_input.shape == saved.shape and np.array_equal(saved_input,
                                                                                                     saved)
            weights = (prefix + "weight_hh", prefix + "weight_ih")
        else:  # the input layout must load as it is: else the load fails, and nothing may change before
            own_input = None if self._input is None else self._input.index.layout != 0
            follows = (own_input is None and saved_input is None) or (
                own_input is not None and saved_input is not None and own_input.shape == saved_input.shape
                and np.array_equal(own_input, saved_input))
            weights = (prefix + "weight_hh",)
        # (without the weights, their slots would mean the old layout's blocks under the new one)
        if saved.shape == own.shape and saved.sum() == own.sum() and not np.array_equal(saved, own) and follows \
                and all(name in state_dict for name in weights):
            self._adopt_layout(saved.astype(np.uint8))

    def extra_repr(self) -> str:
        text = (f"{self.input_size}, {self.hidden_size}, block_size={self.block_size}, "
                f"recurrent_density={self._recurrent.index.density:.3g}, input_density="
                f"{'dense' if self._input is None else format(self._input.index.density, '.3g')}, "
                f"bias={self.bias is not None}")
        return (text + (", batch_first=True" if self.batch_first else "") + (", tf32=True" if self.tf32 else "")
                + ("" if self.cuda_graphs else ", cuda_graphs=False"))

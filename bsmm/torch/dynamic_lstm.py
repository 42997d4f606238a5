"""Layouts that change while a :class:`~bsmm.torch.BlockSparseLSTM` trains: :mod:`bsmm.torch.dynamic` for
the recurrent weight.

What changes is ``Wh``'s layout, the (H/bs, 4H/bs) ``recurrent_layout`` over the four gates; each block
moves on its own, so a layout tiled once per gate (a square ``recurrent_layout`` at construction) need not
stay tiled. ``Wx`` moves with ``Wh`` exactly where the layer shares the layout
(``input_layout="recurrent"``): the two are one structure, as in the seed's small-world LSTMs, so a block
is kept, dropped or grown in both. A dense ``Wx``, or one of its own layout, stays as it is.

- :func:`change_lstm_layout`: :func:`bsmm.torch.dynamic.change_layout` for the LSTM (which dispatches here).
- :func:`slot_norms`: the drop criterion, each present block's norm (``Wh``'s and, shared, ``Wx``'s together).
- :func:`gradient_capture` and :func:`growth_scores`: RigL's growth signal, the block norms of the dense
  ``dWh = Σ_t h_{t-1}ᵀ·dz_t`` (and, shared, ``dWx = Σ_t x_tᵀ·dz_t``), from rows the sequence's eager
  backward hands over (:meth:`bsmm.torch.BlockSparseLSTM.register_gradient_capture`).
"""

from __future__ import annotations

import numpy as np
import torch

from bsmm.torch import dynamic
from bsmm.torch.lstm import BlockSparseLSTM, _gate_layout, _refuse_under_recorded_graphs, gate_column_bounds

__all__ = ["change_lstm_layout", "gradient_capture", "growth_scores", "slot_norms"]


def _moving_weights(lstm: BlockSparseLSTM) -> tuple:
    """The weights whose slots follow the recurrent layout."""
    return (lstm.weight_hh, lstm.weight_ih) if lstm.shared_layout else (lstm.weight_hh,)


def _combined(norms: list[torch.Tensor], ord: str) -> torch.Tensor:
    """One norm of blocks split over several matrices: the L2 norm of their L2 norms, or the largest."""
    stacked = torch.stack(norms)
    return torch.linalg.vector_norm(stacked, dim=0) if ord == "l2" else stacked.amax(dim=0)


def slot_norms(lstm: BlockSparseLSTM, ord: str = "l2") -> torch.Tensor:
    """(nnzb,) float32: each present block's norm, over ``Wh`` and, where it shares the layout, ``Wx``.

    Examples
    --------
    >>> import torch, bsmm.torch
    >>> lstm = bsmm.torch.BlockSparseLSTM(32, 32, block_size=16, input_layout="recurrent", bias=False)
    >>> with torch.no_grad():
    ...     _ = lstm.weight_hh.fill_(0.5), lstm.weight_ih.fill_(-1.0)
    >>> bsmm.torch.dynamic_lstm.slot_norms(lstm, "max").unique().tolist()
    [1.0]
    """
    dynamic._check_choice(ord, dynamic.NORMS, "ord")
    return _combined([dynamic._reduce_blocks(dynamic._whole(w.detach()), ord) for w in _moving_weights(lstm)], ord)


def change_lstm_layout(lstm: BlockSparseLSTM, layout, optimizer: torch.optim.Optimizer | None = None,
                       init: str = "zero", generator: torch.Generator | None = None) -> dynamic.LayoutChange:
    """Move ``lstm``'s recurrent layout to ``layout`` of as many blocks, in place (see the module docstring).

    ``layout``: (H/bs, 4H/bs), or (H/bs, H/bs) tiled once per gate. Kept blocks keep their values, gradients
    and per-slot optimizer state in ``Wh`` (and ``Wx`` where shared); a grown block starts at zero or, with
    ``init="fan_in"``, as the layer draws its weights (U(±1/sqrt(fan_in)) of its gate column in the new
    layout). The layer's CUDA graphs of the old layout are forgotten.

    Examples
    --------
    >>> import numpy as np, torch, bsmm.torch
    >>> lstm = bsmm.torch.BlockSparseLSTM(32, 32, np.eye(2), block_size=16, input_layout="recurrent")
    >>> change = bsmm.torch.dynamic.change_layout(lstm, np.array([[1, 1], [0, 0]]))
    >>> change.grown.tolist()[:2], change.source.tolist()
    ([[0, 1], [0, 3]], [0, -1, 1, -1, 2, -1, 3, -1])
    >>> torch.equal(lstm.input_layout, lstm.recurrent_layout)
    True
    """
    if not isinstance(lstm, BlockSparseLSTM):
        raise TypeError(f"lstm must be a bsmm.torch.BlockSparseLSTM; got {type(lstm).__name__}")
    dynamic._check_choice(init, dynamic.INITS, "init")
    old = lstm._recurrent.index
    hidden_blocks = lstm.hidden_size // lstm.block_size
    new_layout = _gate_layout(layout, "layout", hidden_blocks, hidden_blocks) != 0
    if int(new_layout.sum()) != old.nnzb:
        raise ValueError(f"layout must hold {old.nnzb} blocks, as the layer's recurrent layout does; "
                         f"got {int(new_layout.sum())}")
    change, cols = dynamic._slot_change(old, new_layout)
    if not len(change.dropped):
        return change
    _refuse_under_recorded_graphs()  # (before anything moves)
    weights = dict(zip(("weight_hh", "weight_ih"), _moving_weights(lstm)))
    slot_bounds = (gate_column_bounds(new_layout, lstm.block_size, lstm.hidden_size)[cols] if init == "fan_in"
                   else None)
    dynamic._move_slots(weights, optimizer, change, slot_bounds, generator)
    lstm._adopt_layout(new_layout.astype(np.uint8), moving=True)
    return change


def gradient_capture(sparsity: "dynamic.DynamicSparsity", name: str):
    """The hook :class:`~bsmm.torch.DynamicSparsity` registers on LSTM ``name``
    (:meth:`~bsmm.torch.BlockSparseLSTM.register_gradient_capture`). As for a linear layer's captured
    ``(x, dy)``, each forward of a capturing step adds an entry ``[(h_in, x), dz]``: ``dz`` summed over the
    backward passes through that forward (as ``weight.grad`` sums them), None until the first."""
    def hook():
        if not sparsity._capturing:
            return None
        if sparsity._held[name].grad is None:  # gradients thrown away since: see DynamicSparsity._capture_hook
            sparsity._captured[name] = [e for e in sparsity._captured.get(name, []) if e[1] is None]
        entry = [None, None]
        sparsity._captured.setdefault(name, []).append(entry)

        def keep(h_in, x, dz):  # dz may be a graph buffer set's, written again later: kept as a copy
            if entry[1] is None:
                entry[0], entry[1] = (h_in.detach(), x.detach()), dz.detach().clone()
            else:
                entry[1] += dz.detach()
        return keep
    return hook


def growth_scores(entries: list, lstm: BlockSparseLSTM, ord: str, group=None) -> np.ndarray:
    """(H/bs, 4H/bs): the block norms of ``dWh`` summed over ``entries`` (``[(h_in, x), dz]``, as
    :func:`gradient_capture` keeps them), combined with ``dWx``'s where the layout is shared; ``group``
    sums each over its ranks first (:func:`bsmm.torch.dynamic.gradient_block_norms`)."""
    dz = torch.cat([dz for _, dz in entries])
    norms = [dynamic.gradient_block_norms(torch.cat([rows[0] for rows, _ in entries]), dz, lstm.block_size, ord,
                                          group=group)]
    if lstm.shared_layout:
        norms.append(dynamic.gradient_block_norms(torch.cat([rows[1] for rows, _ in entries]), dz, lstm.block_size,
                                                  ord, group=group))
    return _combined(norms, ord).cpu().numpy()

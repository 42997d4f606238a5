"""The layout registry: how a custom operator, whose arguments are tensors and plain values, finds its layout.

The layout travels as a string *key*: block rows x block columns / block size / SHA-256 of the
packed layout. It is derived from the layout's content, not from an object's id or a counter,
because ``torch.compile`` bakes the key into graphs it may cache on disk and reload in another
process: there the same string must name the same layout. Keys resolve through a process-wide
registry of :class:`Registration` objects held weakly; whoever needs a layout (a layer, a
``BlocksparseMatMul`` used through :func:`bsmm.torch.blocksparse_matmul`, a pending backward)
holds its ``Registration``, so an entry lives exactly as long as something can call an operator
with its key. Nothing about the registry is pickled: the layout itself is, and unpickling
registers it again.

A layer whose layout changes while it trains (:mod:`bsmm.torch.dynamic`) holds a *moving* key
instead (:func:`moving`): ``"{CB}x{KB}/{block_size}/moving-{pid}-{n}-{random hex}"``, unique to the
process, which :func:`move` points at each new layout. A compiled graph that holds the key then
computes with the layer's current layout, with no recompilation; a key of one process never
names a layout in another, so cached graphs never confuse the two.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
import sys
import threading
import weakref

import numpy as np
import torch

from bsmm.block_index import BlockIndex, block_index

__all__ = ["Registration", "cuda_graphs_recorded", "is_moving", "layout_key", "live_registration", "lookup", "move",
           "moving", "register", "registration"]


class Registration:
    """Keeps one layout reachable from custom operators under :attr:`key` while referenced.

    Attributes
    ----------
    key : str
        ``"{CB}x{KB}/{block_size}/{sha256 of the packed layout}"``.
    index : BlockIndex
    """

    __slots__ = ("key", "index", "retired", "_operators", "__weakref__")

    def __init__(self, key: str, index: BlockIndex):
        self.key, self.index = key, index
        #: True once the layer that held this moving registration computes with another layout.
        self.retired = False
        self._operators = {}

    def operator(self, signature: tuple, build):
        """``build(index)``, kept per ``signature`` while the layout is registered: the custom
        operators then reuse one operator's caches (launch plans, repeat calls, a
        convolution's row maps and stacked layouts) instead of rebuilding them every call."""
        op = self._operators.get(signature)
        if op is None:
            op = self._operators[signature] = build(self.index)
        return op

    def __reduce__(self):
        # Only the layout travels; unpickling registers it in the loading process's registry.
        return (_register_layout, (np.array(self.index.layout), self.index.block_size))

    def __repr__(self) -> str:
        return f"Registration({self.key!r})"


_REGISTRY: "weakref.WeakValueDictionary[str, Registration]" = weakref.WeakValueDictionary()
_LOCK = threading.Lock()

#: ``live_registration(key)``: the :class:`Registration` of ``key`` while something holds it, else None.
#: The registry's own ``get``, bound once: operators call it on every eager call to hold the key until backward.
live_registration = _REGISTRY.get


def layout_key(index: BlockIndex) -> str:
    """The content-derived key of a layout (see the module docstring)."""
    digest = hashlib.sha256(np.packbits(index.layout).tobytes()).hexdigest()
    return f"{index.n_block_rows}x{index.n_block_cols}/{index.block_size}/{digest}"


def register(index: BlockIndex) -> Registration:
    """Make ``index`` reachable by its key; hold the result as long as operators may use the key.

    Registering an equal layout twice returns the live ``Registration`` of the first.

    Examples
    --------
    >>> import numpy as np, bsmm
    >>> registration = register(bsmm.block_index(np.eye(2), block_size=8))
    >>> registration.key[:5], lookup(registration.key) is registration.index
    ('2x2/8', True)
    """
    key = layout_key(index)
    with _LOCK:
        registration = _REGISTRY.get(key)
        if registration is None:
            registration = _REGISTRY[key] = Registration(key, index)
    return registration


_MOVING_NUMBERS = itertools.count()
_PROCESS_TAG = secrets.token_hex(6)  # (a moving key of this process never equals one of another)


def moving(index: BlockIndex) -> Registration:
    """A registration of ``index`` under a moving key of its own, which :func:`move` points at
    other layouts of the same shape, block size and number of blocks (see the module docstring).

    Examples
    --------
    >>> import numpy as np, bsmm
    >>> first = moving(bsmm.block_index(np.eye(2), block_size=8))
    >>> second = move(first, bsmm.block_index(np.array([[0, 1], [1, 0]]), block_size=8))
    >>> second.key == first.key, lookup(first.key).indices.tolist(), first.retired
    (True, [1, 0], True)
    """
    key = (f"{index.n_block_rows}x{index.n_block_cols}/{index.block_size}/"
           f"moving-{os.getpid()}-{next(_MOVING_NUMBERS)}-{_PROCESS_TAG}")  # (a forked worker: its own pid)
    registration = Registration(key, index)
    with _LOCK:
        _REGISTRY[key] = registration
    return registration


def is_moving(key: str) -> bool:
    """Whether ``key`` is a moving key (:func:`moving`) rather than a layout's content key.

    Examples
    --------
    >>> import numpy as np, bsmm
    >>> index = bsmm.block_index(np.eye(2), block_size=8)
    >>> is_moving(moving(index).key), is_moving(register(index).key)
    (True, False)
    """
    return "/moving-" in key


def move(registration: Registration, index: BlockIndex) -> Registration:
    """Point ``registration``'s moving key at ``index`` (a layout of the same shape, block size and
    number of blocks: compiled graphs hold the weight's shape) and return the new registration to hold
    in its place; ``registration`` is retired and keeps the old layout for whatever still holds it (a
    pending eager backward, which then refuses to run rather than compute with the new layout)."""
    old = registration.index
    if not is_moving(registration.key):
        raise ValueError(f"registration {registration.key!r} has a layout's content key, not a moving one: "
                         f"make one with bsmm.torch.registry.moving")
    if (index.n_block_rows, index.n_block_cols, index.block_size, index.nnzb) != (
            old.n_block_rows, old.n_block_cols, old.block_size, old.nnzb):
        raise ValueError(f"index must have the layout shape {(old.n_block_rows, old.n_block_cols)}, block size "
                         f"{old.block_size} and {old.nnzb} blocks of {registration.key!r}; got "
                         f"{(index.n_block_rows, index.n_block_cols)}, {index.block_size} and {index.nnzb}")
    moved = Registration(registration.key, index)
    registration.retired = True
    with _LOCK:
        _REGISTRY[registration.key] = moved
    return moved


def cuda_graphs_recorded() -> bool:
    """Whether ``torch.compile`` has recorded CUDA graphs (its CUDA-graph trees, ``mode="reduce-overhead"``)
    in this thread: their replays launch with the tables of the layouts they recorded, so a layer that
    changes layout then takes a new key (see :mod:`bsmm.torch.dynamic`).

    Thread-wide, not per model: one model compiled with CUDA graphs gives every layer changed in the thread
    a new key. Graphs recorded in another thread, or by the older ``cudagraph_trees=False`` path, are not
    seen.

    Examples
    --------
    >>> cuda_graphs_recorded()   # nothing compiled here
    False
    """
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    try:  # (PyTorch's private state: where it is not as expected, assume graphs were recorded)
        if not torch._C._is_key_in_tls("tree_manager_containers"):
            return False
        containers = trees.get_obj(trees.local, "tree_manager_containers")
        return any(getattr(container, "tree_manager", None) is not None for container in containers.values())
    except (AttributeError, RuntimeError, TypeError):
        return True


def _register_layout(layout: np.ndarray, block_size: int) -> Registration:
    return register(block_index(layout, block_size))


def lookup(key: str) -> BlockIndex:
    """The layout registered under ``key``.

    Raises
    ------
    ValueError
        If nothing holds a registration of ``key`` in this process.
    """
    return registration(key).index


def registration(key: str) -> Registration:
    """The :class:`Registration` of ``key``; raises as :func:`lookup` does."""
    registration = _REGISTRY.get(key)
    if registration is None:
        raise ValueError(
            f"key {key!r} names no layout registered in this process: the BlockSparseLinear or "
            f"BlocksparseMatMul that registered it is gone, or the key comes from another process "
            f"(build the layer or call bsmm.torch.register first)"
        )
    return registration

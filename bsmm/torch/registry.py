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
"""

from __future__ import annotations

import hashlib
import threading
import weakref

import numpy as np

from bsmm.block_index import BlockIndex, block_index

__all__ = ["Registration", "layout_key", "live_registration", "lookup", "register", "registration"]


class Registration:
    """Keeps one layout reachable from custom operators under :attr:`key` while referenced.

    Attributes
    ----------
    key : str
        ``"{CB}x{KB}/{block_size}/{sha256 of the packed layout}"``.
    index : BlockIndex
    """

    __slots__ = ("key", "index", "_operators", "__weakref__")

    def __init__(self, key: str, index: BlockIndex):
        self.key, self.index = key, index
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

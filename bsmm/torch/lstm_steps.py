"""The per-step loops of :class:`bsmm.torch.BlockSparseLSTM` on CUDA, and the CUDA graphs that replay them.

A step forward is two launches, the recurrent fprop ``h_{t-1}·Wh`` and the fused cell
(``cuda/bsmm_lstm_cell.cu``); a step backward is the cell's backward and the recurrent bprop. The
loops launch on raw addresses (:func:`forward_steps`, :func:`backward_steps`), so they can be run
eagerly or captured. :class:`SequenceGraphs`, kept by the layer, captures each loop once per
(steps, N, dtype, device, Wh) into a CUDA graph over buffers of its own (a :class:`StepBuffers`) and
replays it: a sequence then costs a handful of host calls rather than four launches a step.

A buffer set belongs to one forward until its saved tensors are freed (after its backward, unless the
graph is retained; when the forward's outputs are dropped; at once under ``torch.no_grad``): a second
forward before the first's backward takes another set. What leaves for the caller (the output, the
final state, ``dh0``, ``dc0``) is copied out of the set, never handed out.
"""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

import torch


__all__ = ["StepLaunches", "StepBuffers", "SetKey", "SequenceGraphs", "backward_steps", "capture", "capturing",
           "forward_steps"]

#: Buffer sets held by no forward that a layer keeps (each holds a sequence's gates and dz).
MAX_FREE_SETS = 2


class StepLaunches:
    """What the loops launch with: the stream, the cell's launches, and the address of step ``t``
    of a contiguous (steps, N, ·) tensor (no tensor is indexed a step)."""

    __slots__ = ("stream", "cell", "dtype")

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.stream = torch.cuda.current_stream(device).cuda_stream
        self.cell = _cell()
        self.dtype = str(dtype).removeprefix("torch.")

    @staticmethod
    def at(tensor: torch.Tensor, t: int) -> int:
        return tensor.data_ptr() + t * tensor.stride(0) * tensor.element_size()


def forward_steps(loop: StepLaunches, call, weight_hh: torch.Tensor, z: torch.Tensor, h0: torch.Tensor,
                  bias_ptr: int, cells: torch.Tensor, gates: torch.Tensor, out: torch.Tensor, z_rec: torch.Tensor,
                  first_done: bool = False) -> None:
    """The forward steps: ``z_rec = h_{t-1}·Wh`` through the kept fprop ``call`` (step 0's already in
    ``z_rec`` where ``first_done``), then the cell into ``gates[t]``, ``cells[t + 1]``, ``out[t]``."""
    steps, n, hidden = out.shape
    for t in range(steps):
        if t > 0 or not first_done:
            h_prev = h0.data_ptr() if t == 0 else loop.at(out, t - 1)
            call.launch(loop.stream, h_prev, weight_hh.data_ptr(), z_rec.data_ptr())
        loop.cell.cell_forward(loop.stream, loop.dtype, n, hidden, loop.at(z, t), z_rec.data_ptr(), bias_ptr,
                               loop.at(cells, t), loop.at(gates, t), loop.at(cells, t + 1), loop.at(out, t), 0)


def backward_steps(loop: StepLaunches, call, weight_hh: torch.Tensor, d_out: torch.Tensor, dh_init: torch.Tensor,
                   dc: torch.Tensor, gates: torch.Tensor, cells: torch.Tensor, dz: torch.Tensor,
                   dh_rec: torch.Tensor | None, need_dh0: bool, first_bprop=None) -> torch.Tensor | None:
    """The backward steps, last to first: the cell's backward into ``dz[t]`` (``dc`` updated in place),
    then ``dh_rec = dz_t·Whᵀ`` through the kept bprop ``call`` (at step 0 only where ``need_dh0``).
    Where ``call`` is None, ``first_bprop(t)`` makes the first product and gives ``(dh_rec, call)``.
    Returns ``dh_rec``: ``dh0`` where ``need_dh0``."""
    steps, n, hidden = cells.shape[0] - 1, cells.shape[1], cells.shape[2]
    for t in reversed(range(steps)):
        first = t == steps - 1
        loop.cell.cell_backward(loop.stream, loop.dtype, n, hidden, loop.at(d_out, t),
                                0 if first else dh_rec.data_ptr(), dh_init.data_ptr() if first else 0,
                                dc.data_ptr(), loop.at(gates, t), loop.at(cells, t), loop.at(cells, t + 1),
                                loop.at(dz, t), 0)
        if t == 0 and not need_dh0:
            break
        if call is None:
            dh_rec, call = first_bprop(t)
        else:  # dh_rec was read by the cell above before this overwrites it
            call.launch(loop.stream, loop.at(dz, t), weight_hh.data_ptr(), dh_rec.data_ptr())
    return dh_rec


class SetKey(NamedTuple):
    """What a buffer set's graphs were captured for: the sequence's shape and dtype, the device, the
    recurrent weight's address and the passes' identity (their operator: layout and TF32)."""

    steps: int
    n: int
    dtype: torch.dtype
    device: torch.device
    weight_hh: int
    bias: bool
    operator: int


class StepBuffers:
    """One sequence's buffers for the captured loops, and the graphs over them.

    Inputs copied in each call: ``z`` (x·Wx, (T, N, 4H)), ``h0``, ``cells[0]``, ``bias`` (float32);
    ``d_out``, ``dh_init``, ``dc`` (float32). Results read out: ``out``, ``cells``, ``gates``; ``dz``,
    ``dh_rec``, ``dc``. Made outside inference mode, whatever the caller's (training reuses the set).
    """

    def __init__(self, steps: int, n: int, hidden: int, dtype: torch.dtype, device: torch.device, bias: bool):
        def empty(*shape, of=dtype):
            return torch.empty(shape, dtype=of, device=device)

        f32, width = torch.float32, 4 * hidden
        with torch.inference_mode(False):
            self.z, self.h0, self.z_rec = empty(steps, n, width), empty(n, hidden), empty(n, width)
            self.bias = empty(width, of=f32) if bias else None
            self.out, self.cells, self.gates = empty(steps, n, hidden), empty(steps + 1, n, hidden, of=f32), \
                empty(steps, n, width, of=f32)
            self.d_out, self.dh_init, self.dc = empty(steps, n, hidden, of=f32), empty(n, hidden, of=f32), \
                empty(n, hidden, of=f32)
            self.dz, self.dh_rec = empty(steps, n, width), empty(n, hidden)
        self.forward_graph: torch.cuda.CUDAGraph | None = None
        self.backward_graphs: dict = {}  # need_dh0 -> graph
        self.calls: list = []  # the passes' kept calls the graphs launch (their plans' tables and workspaces)
        self.owner: int | None = None  # id of the token of the forward that holds the set
        self.stream: torch.cuda.Stream | None = None  # where the set was last used

    def owned_by(self, token: torch.Tensor) -> bool:
        return self.owner == id(token)


class SequenceGraphs:
    """The buffer sets and graphs of one layer, by :class:`SetKey`. At most :data:`MAX_FREE_SETS` sets
    held by no forward are kept (the least recently used go first), and none of Wh at another address.

    Examples
    --------
    >>> graphs = SequenceGraphs()
    >>> graphs.free_sets()
    0
    """

    def __init__(self):
        self._sets: dict = {}  # SetKey -> list of StepBuffers, in the order they were last acquired
        # Reentrant: a garbage collection while a set is made may finalize a token, whose release locks too.
        self._lock = threading.RLock()

    def __deepcopy__(self, memo):  # a copied layer captures graphs of its own
        return SequenceGraphs()

    def __reduce__(self):
        return (SequenceGraphs, ())

    def free_sets(self) -> int:
        """Buffer sets held by no forward."""
        with self._lock:
            return sum(buffers.owner is None for sets in self._sets.values() for buffers in sets)

    def held_sets(self) -> int:
        """Buffer sets a forward holds (its backward has not freed them yet)."""
        with self._lock:
            return sum(buffers.owner is not None for sets in self._sets.values() for buffers in sets)

    def clear(self) -> None:
        """Forget every set no forward holds (their memory and graphs)."""
        with self._lock:
            self._trim(0)

    def invalidate(self) -> None:
        """Forget every set: the free ones now, those a forward holds once its backward lets go of them
        (after a layout change, whose new operator may even reuse the old one's id in :class:`SetKey`)."""
        with self._lock:
            self._sets = {}  # a held set's release then finds it in no list, and it goes with its forward

    def acquire(self, key: SetKey, make) -> tuple[StepBuffers, torch.Tensor]:
        """A free set of ``key`` (``make()`` builds one where none is free) and the token whose death
        frees it again: save the token for the backward (it dies with the forward's saved tensors).
        Work queued on the set from another stream is waited for."""
        token = torch.empty(0)
        with self._lock:
            for stale in [k for k in self._sets if k.weight_hh != key.weight_hh or k.operator != key.operator]:
                self._sets[stale] = [b for b in self._sets[stale] if b.owner is not None]  # weights moved
            sets = self._sets.setdefault(key, [])
            buffers = next((b for b in sets if b.owner is None), None)
            if buffers is None:
                buffers = make()
            else:
                sets.remove(buffers)
            sets.append(buffers)
            buffers.owner = id(token)
        stream = torch.cuda.current_stream(key.device)
        if buffers.stream is not None and buffers.stream != stream:
            stream.wait_stream(buffers.stream)
        buffers.stream = stream
        weakref.finalize(token, self._release, buffers, id(token))
        return buffers, token

    def _release(self, buffers: StepBuffers, owner: int) -> None:
        with self._lock:
            if buffers.owner == owner:
                buffers.owner = None
                self._trim(MAX_FREE_SETS)

    def _trim(self, keep: int) -> None:
        """Drop free sets beyond the ``keep`` most recently acquired (the lock is held)."""
        free = [b for sets in self._sets.values() for b in sets if b.owner is None]
        recent = set(map(id, free[-keep:])) if keep else set()
        for key in list(self._sets):
            self._sets[key] = [b for b in self._sets[key] if b.owner is not None or id(b) in recent]
            if not self._sets[key]:
                del self._sets[key]


def capture(device: torch.device, run) -> torch.cuda.CUDAGraph:
    """``run()`` (launches on the current stream only) captured into a CUDA graph on ``device``, from a
    capture stream of that device's (PyTorch's default capture stream is made on one device only)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(device):
        stream = _CAPTURE_STREAMS.get(device)
        if stream is None:
            stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
        with torch.cuda.graph(graph, stream=stream):
            run()
    return graph


_CAPTURE_STREAMS: dict = {}


def capturing() -> bool:
    """Whether the caller is capturing a CUDA graph of its own: its capture records the eager loops
    (a graph is not captured inside another)."""
    return torch.cuda.is_current_stream_capturing()


def _cell():
    from bsmm.backends.cuda import lstm_cell  # lazily: the fused cell needs CuPy, on CUDA only

    return lstm_cell

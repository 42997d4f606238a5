"""Device memory a plan keeps per stream: workspaces, counters and transposed copies.

A plan's scratch memory is allocated once per (plan, stream) and kept, so that a repeated call
allocates nothing and a CUDA graph that captured its address stays valid.
"""

from __future__ import annotations

import cupy

__all__ = ["allocate_workspace", "per_stream"]


def allocate_workspace(nbytes: int) -> tuple[int, object]:
    """(device pointer, owner) of ``nbytes`` from CuPy's pool on the current device, for a plan's
    workspace on one stream. Kept outside any framework's allocator: a workspace first needed
    while a framework captures a CUDA graph (a captured training step) is then no allocation of
    the graph's pool that the framework would have to account for."""
    memory = cupy.cuda.alloc(nbytes)
    return memory.ptr, memory


def per_stream(workspaces: dict, stream_ptr: int, make):
    """The workspace kept for this stream, made by ``make()`` on first use (a CUDA graph captures
    its address, so it stays).

    A stream first seen while it captures a CUDA graph (``torch.cuda.graph``, the replays of
    ``torch.compile(mode="reduce-overhead")``) cannot allocate: it shares the workspace of the
    stream the plan ran on before (the warm-up every capture needs). Replays of that graph then
    must not run at the same time as launches of the same plan on that stream.
    """
    found = workspaces.get(stream_ptr)
    if found is None:
        if cupy.cuda.runtime.streamIsCapturing(stream_ptr):
            if not workspaces:
                raise RuntimeError("bsmm: a pass is captured into a CUDA graph before it ever ran: run it once "
                                   "(a warm-up call of the same shape) before the capture")
            found = workspaces[stream_ptr] = next(iter(workspaces.values()))
        else:
            found = workspaces[stream_ptr] = make()
    return found

"""The three passes on CUDA GPUs (CuPy arrays). The kernels are the next issue's work."""

from __future__ import annotations

__all__ = ["fprop", "bprop", "updat"]

_MESSAGE = (
    "bsmm's GPU kernels are not built yet: pass NumPy arrays (CPU backend) "
    "or move CuPy arrays to the host with .get()"
)


def fprop(index, x, w, out, feature_axis):
    raise NotImplementedError(_MESSAGE)


def bprop(index, dy, w, out, feature_axis):
    raise NotImplementedError(_MESSAGE)


def updat(index, x, dy, out, feature_axis, accumulate):
    raise NotImplementedError(_MESSAGE)

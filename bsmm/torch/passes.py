"""Running one pass on real tensors, for the operators of :mod:`bsmm.torch.ops`.

CPU tensors are shared with the CPU backend as NumPy arrays, CUDA tensors with the GPU kernels
as CuPy arrays, both through DLPack without a copy (bfloat16 passes as an int16 view, which
DLPack expresses for NumPy). float64 runs on the CPU only (computed in float64, for
``torch.autograd.gradcheck``); float64 CUDA tensors are refused with a ``TypeError``. On CUDA
the kernels run on PyTorch's current stream of the tensors' device. The only memory a pass
takes from PyTorch is its output, from ``torch.empty`` (so the caching allocator owns it).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

from bsmm.backends.cuda import launches
from bsmm.matmul import BlocksparseMatMul
from bsmm.torch.checks import ARRAY_DTYPES, epilogue_shapes, pass_shape
from bsmm.torch.registry import registration

__all__ = ["into_new", "kept_store_call", "matmul_operator", "run_epilogue", "run_on", "run_pass"]


def _shared_as(module, tensor: torch.Tensor):
    """``tensor``'s memory as a NumPy or CuPy array, without a copy."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        # DLPack's bfloat16 code is unknown to NumPy: share the bits as int16, then relabel them.
        return module.from_dlpack(tensor.view(torch.int16)).view(ml_dtypes.bfloat16)
    return module.from_dlpack(tensor)


#: (device, stream pointer) -> CuPy stream object; PyTorch pools its streams and never destroys them.
_CUPY_STREAMS: dict = {}


def _cupy_stream(cupy, device_index: int, ptr: int):
    """PyTorch's stream ``ptr`` as a CuPy stream (CuPy 14 deprecates ExternalStream for from_external)."""
    if ptr == 0:
        return cupy.cuda.Stream.null  # PyTorch's default stream is the legacy default stream
    stream = _CUPY_STREAMS.get((device_index, ptr))
    if stream is None:
        if hasattr(cupy.cuda.Stream, "from_external"):
            stream = cupy.cuda.Stream.from_external(launches.StreamHandle(ptr))
        else:
            stream = cupy.cuda.ExternalStream(ptr, device_index)
        _CUPY_STREAMS[(device_index, ptr)] = stream
    return stream


def matmul_operator(key: str, feature_axis: int, tf32: bool) -> BlocksparseMatMul:
    """The operator of ``key``'s layout, kept with its registration (its caches reused across calls)."""
    return registration(key).operator(("matmul", feature_axis, tf32),
                                       lambda index: BlocksparseMatMul.from_index(index, feature_axis, tf32))


def run_pass(pass_name: str, a: torch.Tensor, b: torch.Tensor, key: str, feature_axis: int, tf32: bool,
             out_shape: tuple | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """One pass (``fprop``: a = x, b = w; ``bprop``: dy, w; ``updat``: x, dy) into a new tensor,
    of ``out_shape`` where given (the leading dimensions of an activation the caller flattened).
    ``gate``: per-block gates (nnzb,), of the operands' dtype and device, contiguous, that the
    weights are already scaled by; the CUDA kernels leave out the blocks where they are 0 (updat:
    those blocks' gradients are then 0 or as computed, for callers that do not read them).

    A CUDA pass the operator has run before for this shape, dtype and device is repeated on raw
    pointers (:func:`_repeat_on_cuda`): no DLPack exchange, no re-validation beyond what could
    differ, the output from ``torch.empty``, one launch. Anything else takes the checked path.
    """
    return run_on(matmul_operator(key, feature_axis, tf32), pass_name, a, b, key, out_shape, gate)


def run_on(op: BlocksparseMatMul, pass_name: str, a: torch.Tensor, b: torch.Tensor, key: str,
           out_shape: tuple | None = None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`run_pass` with the operator of ``key`` already looked up.

    ``out_shape`` (same element count as the pass's 2-D result) shapes the new tensor itself, so a
    caller that flattened leading dimensions returns a tensor of its own rather than a reshaped view:
    FSDP2 warns about module outputs that are views (an in-place op on one would skip its hooks).
    """
    if a.is_cuda:
        out = _repeat_on_cuda(op, pass_name, a, b, out_shape, "store", gate=gate)
        if out is not None:
            return out
    shape = pass_shape(pass_name, a, b, key, op.feature_axis)
    options = {} if gate is None else {"_skip": gate}
    return into_new(getattr(op, pass_name), a, b, shape, out_shape=out_shape, **options)


def run_epilogue(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, key: str, feature_axis: int,
                 tf32: bool, activation: str, keep_pre: bool, out_shape: tuple | None = None,
                 gate: torch.Tensor | None = None) -> tuple:
    """``bsmm::fprop_epilogue``: (y = A(x·W + bias), and z = x·W + bias where ``keep_pre``, else an
    empty tensor), new tensors of ``out_shape`` where given; repeated on raw pointers as :func:`run_pass`,
    ``gate`` as there."""
    op = matmul_operator(key, feature_axis, tf32)
    if x.is_cuda:
        found = _repeat_on_cuda(op, "fprop", x, w, out_shape, activation, bias, keep_pre, gate)
        if found is not None:
            return found
    y_shape, pre_shape = epilogue_shapes(x, w, bias, key, feature_axis, activation, keep_pre)
    pre = torch.empty(pre_shape if out_shape is None or not keep_pre else out_shape, dtype=x.dtype, device=x.device)
    options = {} if gate is None else {"_skip": gate}
    y = into_new(op.fprop, x, w, y_shape, out_shape=out_shape, bias=bias, activation=activation,
                 pre=pre.view(y_shape) if keep_pre else None, **options)
    return y, pre


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _kept_call(op: BlocksparseMatMul, pass_name: str, a: torch.Tensor, b: torch.Tensor, epilogue: str):
    """The call ``op`` kept for this pass and epilogue on contiguous tensors like ``a`` and ``b`` (one dtype,
    the call's device, current), or None."""
    call = op.kept_calls.get((pass_name, a.shape, ARRAY_DTYPES.get(a.dtype), op.feature_axis, op.tf32, epilogue))
    if call is None or b.dtype is not a.dtype or b.shape != call.other_shape or not (
            a.is_contiguous() and b.is_contiguous()):
        return None
    device = a.get_device()
    if b.get_device() != device or device != call.device or launches.current_device() != device:
        return None
    return call


def _repeat_on_cuda(op: BlocksparseMatMul, pass_name: str, a: torch.Tensor, b: torch.Tensor, out_shape: tuple | None,
                    epilogue: str, bias: torch.Tensor | None = None, keep_pre: bool = False,
                    gate: torch.Tensor | None = None):
    """The pass through the call ``op`` kept from an earlier checked call of this shape and epilogue
    (``bsmm.backends.cuda.backend.FastCall.launch``, the repeat path every caller takes), or None where
    there is none or anything differs from it. A store call gives the output, an epilogue's (y, pre)."""
    call = _kept_call(op, pass_name, a, b, epilogue)
    if call is None or out_shape is not None and math.prod(out_shape) != math.prod(call.out_shape):
        return None  # (the checked path then raises: the kernel must not write past the tensor)
    device = call.device
    # (an int is a CUDA device index; the kernel sees only the pointer, so any shape of its size will do)
    shape = call.out_shape if out_shape is None else out_shape
    out = torch.empty(shape, dtype=a.dtype, device=device)
    a_ptr, b_ptr, out_ptr = a.data_ptr(), b.data_ptr(), out.data_ptr()
    if call.aligned and (a_ptr | b_ptr | out_ptr) & 15:
        return None
    stream = _raw_stream(device) if _raw_stream is not None else torch.cuda.current_stream(device).cuda_stream
    gate_ptr = 0 if gate is None else gate.data_ptr()  # (the caller checked it: bsmm.torch.functional)
    if epilogue == "store":
        call.launch(stream, a_ptr, b_ptr, out_ptr, gate_ptr=gate_ptr)
        return out
    bias_ptr = 0
    if bias is not None:
        if (bias.dtype is not a.dtype or bias.get_device() != device or bias.dim() != 1 or not bias.is_contiguous()
                or bias.shape[0] != call.sizes.out_blocks * call.plan.variant.block_size):
            return None
        bias_ptr = bias.data_ptr()
    pre = torch.empty(shape if keep_pre else 0, dtype=a.dtype, device=device)
    pre_ptr = pre.data_ptr() if keep_pre else 0
    if call.aligned and (bias_ptr | pre_ptr) & 15:
        return None
    call.launch(stream, a_ptr, b_ptr, out_ptr, False, bias_ptr, pre_ptr, gate_ptr)
    return out, pre


def kept_store_call(op: BlocksparseMatMul, pass_name: str, a: torch.Tensor, b: torch.Tensor):
    """The call ``op`` kept for this pass on tensors like ``a`` and ``b`` (contiguous CUDA tensors of one
    device and dtype), to launch on raw pointers again and again (``call.launch(stream, a_ptr, b_ptr,
    out_ptr)``), or None where it has none or it would not fit them. A loop of one shape (an LSTM's
    steps) checks once here and then launches into buffers of its own: no tensor is made a step. The
    caller keeps the pointers it launches with as aligned as ``a``'s and ``b``'s (16 bytes where the
    call is aligned)."""
    call = _kept_call(op, pass_name, a, b, "store") if a.is_cuda else None
    if call is None or call.aligned and (a.data_ptr() | b.data_ptr()) & 15:
        return None
    return call


def into_new(method, a: torch.Tensor, b: torch.Tensor, shape: tuple, out_shape: tuple | None = None,
             **options) -> torch.Tensor:
    """``method(a, b, out=..., **options)`` on shared NumPy/CuPy views, into a new tensor of ``shape``
    (the method's result), or of ``out_shape`` (as many elements) seen by the method as ``shape``.
    Tensor options (an epilogue's ``bias`` and ``pre``) are shared the same way."""
    result = torch.empty(shape if out_shape is None else out_shape, dtype=a.dtype, device=a.device)
    out = result if out_shape is None else result.view(shape)
    if a.device.type == "cpu":
        shared = {name: _shared_as(np, v) if isinstance(v, torch.Tensor) else v for name, v in options.items()}
        method(_shared_as(np, a), _shared_as(np, b), out=_shared_as(np, out), **shared)
    elif a.device.type == "cuda":
        import cupy

        ptr = torch.cuda.current_stream(a.device).cuda_stream
        # Import under torch's stream: DLPack then sees producer and consumer on one stream and adds no wait.
        with cupy.cuda.Device(a.device.index), _cupy_stream(cupy, a.device.index, ptr):
            shared = {name: _shared_as(cupy, v) if isinstance(v, torch.Tensor) else v for name, v in options.items()}
            method(_shared_as(cupy, a), _shared_as(cupy, b), out=_shared_as(cupy, out), **shared)
    else:
        raise ValueError(f"tensors are on {a.device}; bsmm runs on the CPU and on CUDA GPUs")
    return result

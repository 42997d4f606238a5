"""The three passes on CUDA GPUs: the backend contract of :mod:`bsmm.matmul` and :mod:`bsmm.nn.conv`.

Each pass looks up (or builds) its plan (:mod:`bsmm.backends.cuda.plans`) and launches it
on CuPy's current stream; :class:`FastCall` repeats a call of a shape seen before on raw
pointers. The strided and shifted passes serve convolutions (:mod:`bsmm.backends.strided`),
:func:`gather_rows` their row maps.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import cupy
import numpy as np

from bsmm.block_index import BlockIndex
from bsmm.passes import PASSES
from bsmm.dtypes import DTYPE_NAMES
from bsmm.backends.cuda import plans
from bsmm.backends.cuda.environment import check_environment
from bsmm.backends.cuda.kernels import GatherVariant, load_kernel
from bsmm.backends.cuda.params import Sizes
from bsmm.backends.cuda.plan_cache import plan_for
from bsmm.backends.cuda.plans import Plan
from bsmm.backends.strided import BlockOrder, check_strided_operands, virtual_width

__all__ = ["FastCall", "fprop", "bprop", "updat", "strided_pass", "shifted_pass", "gather_rows", "recording_paths"]

check_environment()  # once, where CuPy arrays first reach the GPU backend

_VEC_BYTES = 16
# Bound once: the per-call path looks these up on every launch.
_get_device = cupy.cuda.runtime.getDevice
_current_stream = cupy.cuda.get_current_stream

#: While :func:`recording_paths` runs: the :class:`bsmm.backends.cuda.planner.Path` of every pass launched
#: through the checked path (an operator's first call of a shape; repeats reuse its plan).
_paths: list | None = None


@contextlib.contextmanager
def recording_paths() -> Iterator[list]:
    """Collects the :class:`bsmm.backends.cuda.planner.Path` of each pass the operators launch meanwhile
    through their checked path (tests assert the path a shape was meant to take)."""
    global _paths
    if _paths is not None:
        raise RuntimeError("paths are already being recorded")
    _paths = found = []
    try:
        yield found
    finally:
        _paths = None


def _aligned(feature_axis: int, n: int, *arrays) -> bool:
    item = arrays[0].dtype.itemsize
    if feature_axis == 0 and (n * item) % _VEC_BYTES:
        return False  # rows of length N are not whole 16-byte chunks
    return all(a.data.ptr % _VEC_BYTES == 0 for a in arrays)


class FastCall:
    """A pass that already ran once through the checked path, repeated with only the cheap checks.

    :class:`bsmm.BlocksparseMatMul` keeps one per (pass, activation shape, dtype, feature axis,
    math mode) once the full path (argument checks, plan lookup) has launched it. A call costs
    attribute comparisons against what that path accepted, the output allocation and one
    launch: the eager per-call host time is what bounds small passes (workload S at 2 %).
    Anything that differs (device, strides, the other operand's shape or dtype, alignment,
    an ``out`` that overlaps an input) returns None, and the caller takes the checked path,
    which raises the precise error if there is one.

    The second launch with the same stream, operands and output keeps its parameter block
    (:meth:`Plan.parameters`), and later ones pass it as it is: an eager loop that rotates a
    few buffers neither packs parameters nor copies tensor maps (three 128-byte copies took
    about 5 us of host time per Hopper launch).
    """

    __slots__ = ("plan", "device", "dtype", "act_strides", "other_shape", "other_strides", "out_shape",
                 "out_strides", "aligned", "sizes", "act_bytes", "other_bytes", "out_bytes", "head", "blocks",
                 "seen", "epilogue")

    def __init__(self, plan: Plan, act, other, out, sizes: Sizes, epilogue: str = "store"):
        self.plan, self.device, self.dtype = plan, act.data.device_id, act.dtype
        self.act_strides, self.other_shape, self.other_strides = act.strides, other.shape, other.strides
        self.out_shape, self.out_strides = out.shape, out.strides
        self.act_bytes, self.other_bytes, self.out_bytes = act.nbytes, other.nbytes, out.nbytes
        self.aligned, self.sizes, self.epilogue = plan.variant.aligned, sizes, epilogue
        # A TransposedUpdat (TransposedActivations, TransposedWeightsFprop) launches three (two)
        # kernels: it keeps the plan's own launch.
        self.head = plan.launcher.head if isinstance(plan, Plan) else None
        self.blocks: dict = {}  # (stream, act, other, out, accumulate) -> Parameters (plans.py)
        self.seen: set = set()  # keys launched once

    def __call__(self, act, other, out=None, accumulate: bool = False, bias=None, pre=None, gate_ptr: int = 0):
        """The pass on CuPy arrays laid out as the first call's, with this call's epilogue arrays
        (a BiasAct call's ``bias`` and ``pre``, or None), or None where anything differs.
        ``gate_ptr``: the gates the caller checked and scaled the weights by (:meth:`launch`)."""
        device = _get_device()
        act_data, other_data = act.data, other.data
        if (device != self.device or act_data.device_id != device or other.__class__ is not act.__class__
                or other_data.device_id != device or act.strides != self.act_strides
                or other.shape != self.other_shape or other.strides != self.other_strides
                or other.dtype is not self.dtype):
            return None
        act_ptr, other_ptr = act_data.ptr, other_data.ptr
        if self.aligned and (act_ptr | other_ptr) & 15:
            return None
        if out is None:
            out = cupy.ndarray(self.out_shape, self.dtype)
            out_ptr = out.data.ptr
        else:
            if (out.__class__ is not act.__class__ or out.shape != self.out_shape or out.strides != self.out_strides
                    or out.dtype is not self.dtype):
                return None
            out_data = out.data
            out_ptr = out_data.ptr
            if (out_data.device_id != device or (self.aligned and out_ptr & 15)
                    or (out_ptr < act_ptr + self.act_bytes and act_ptr < out_ptr + self.out_bytes)
                    or (out_ptr < other_ptr + self.other_bytes and other_ptr < out_ptr + self.out_bytes)):
                return None
        if bias is None and pre is None:
            self.launch(_current_stream().ptr, act_ptr, other_ptr, out_ptr, accumulate, gate_ptr=gate_ptr)
            return out
        pointers = self._epilogue_pointers(act, device, bias, pre, (act_ptr, self.act_bytes),
                                           (other_ptr, self.other_bytes), (out_ptr, self.out_bytes))
        if pointers is None:
            return None
        self.launch(_current_stream().ptr, act_ptr, other_ptr, out_ptr, accumulate, *pointers, gate_ptr)
        return out

    def _epilogue_pointers(self, act, device: int, bias, pre, *spans) -> tuple | None:
        """(bias, pre) pointers of a BiasAct call's arrays where they are as the checked path
        accepts them (the bias one element per output feature, pre shaped as the output and
        apart from every other operand), else None."""
        if self.epilogue == "store":
            return None
        bias_ptr = pre_ptr = 0
        if bias is not None:
            if (bias.__class__ is not act.__class__ or bias.dtype is not self.dtype or bias.ndim != 1
                    or bias.shape[0] != self.sizes.out_blocks * self.plan.variant.block_size
                    or bias.strides[0] != bias.itemsize or bias.data.device_id != device):
                return None
            bias_ptr = bias.data.ptr
            if self.aligned and bias_ptr & 15:
                return None
        if pre is not None:
            if (pre.__class__ is not act.__class__ or pre.shape != self.out_shape or pre.strides != self.out_strides
                    or pre.dtype is not self.dtype or pre.data.device_id != device):
                return None
            pre_ptr = pre.data.ptr
            if ((self.aligned and pre_ptr & 15)
                    or any(pre_ptr < ptr + size and ptr < pre_ptr + self.out_bytes for ptr, size in spans)
                    or (bias is not None and pre_ptr < bias_ptr + bias.nbytes and bias_ptr < pre_ptr + self.out_bytes)):
                return None
        return bias_ptr, pre_ptr

    def launch(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, accumulate: bool = False,
               bias_ptr: int = 0, pre_ptr: int = 0, gate_ptr: int = 0) -> None:
        """The pass on raw device pointers of operands laid out as the first call's (the caller
        has checked shapes, strides, dtype, device, alignment and overlap): the one repeat path
        of every caller (CuPy arrays through :meth:`__call__` and :meth:`bsmm.BlocksparseMatMul.fprop`,
        :mod:`bsmm.torch.passes`, :mod:`bsmm.jax.passes`). ``bias_ptr`` and ``pre_ptr``: the bias
        and the pre-activation of a BiasAct epilogue (0: none); ``gate_ptr``: per-block gates, nnzb
        elements of the operands' type, whose closed (0) blocks the kernel skips (0: none; the caller
        passes weights already scaled by them: ``cuda/bsmm_gates.cuh``)."""
        key = (stream_ptr, act_ptr, other_ptr, out_ptr, accumulate, bias_ptr, pre_ptr, gate_ptr)
        block = self.blocks.get(key)
        if block is None:
            block = self._keep(key)
            if block is None:  # launched through the plan
                return
        if block.arguments is None:
            plans.launch_kernel(*self.head, stream_ptr, block.address, 0)
        else:
            result = block.driver(*block.arguments)
            if result:
                raise RuntimeError(f"cuLaunchKernelEx failed (CUresult {result})")

    def _keep(self, key: tuple):
        """The block to launch for a key seen before, kept from now on; a key seen the first time
        (or any key of a plan that copies first, as TransposedUpdat) launches through the plan
        instead, and gives None."""
        stream_ptr, act_ptr, other_ptr, out_ptr, accumulate, bias_ptr, pre_ptr, gate_ptr = key
        if self.head is None or key not in self.seen:
            if self.head is not None:
                if len(self.seen) >= _MAX_KEPT_LAUNCHES:
                    self.seen.clear()
                self.seen.add(key)
            self.plan.launch(stream_ptr, act_ptr, other_ptr, out_ptr, self.sizes, int(accumulate), bias_ptr, pre_ptr,
                             gate_ptr)
            return None
        if len(self.blocks) >= _MAX_KEPT_LAUNCHES:
            self.blocks.clear()  # e.g. outputs at new addresses every call: keep the dict small
        block = self.blocks[key] = self.plan.parameters(stream_ptr, act_ptr, other_ptr, out_ptr, self.sizes,
                                                        int(accumulate), bias_ptr, pre_ptr, gate_ptr)
        return block


_MAX_KEPT_LAUNCHES = 64


def _sparse_pass(pass_name: str, index: BlockIndex, act, w, out, feature_axis: int, tf32: bool,
                 features_in: int, features_out: int, accumulate: bool, epilogue, gate=None) -> FastCall | None:
    n = act.shape[1 - feature_axis]
    name = "store" if epilogue is None else epilogue.name
    if n == 0 or out.size == 0:
        return None
    dtype = DTYPE_NAMES[act.dtype]
    extra = () if epilogue is None else tuple(a for a in (epilogue.bias, epilogue.pre) if a is not None)
    aligned = _aligned(feature_axis, n, act, w, out, *extra)
    plan = plan_for(index, pass_name, n, dtype, feature_axis, tf32, aligned, plain=True, epilogue=name)
    if _paths is not None:
        _paths.append(plan.path)
    ld_act, ld_out = (features_in, features_out) if feature_axis == 1 else (n, n)
    sizes = Sizes(n, ld_act, 0, ld_out, features_out // index.block_size)
    bias_ptr, pre_ptr = (0, 0) if epilogue is None else epilogue.pointers()
    plan.launch(_current_stream().ptr, act.data.ptr, w.data.ptr, out.data.ptr, sizes, int(accumulate), bias_ptr,
                pre_ptr, 0 if gate is None else gate.data.ptr)
    return FastCall(plan, act, w, out, sizes, name)


def fprop(index: BlockIndex, x, w, out, feature_axis: int, tf32: bool = False,
          accumulate: bool = False, epilogue=None, gate=None) -> FastCall | None:
    """y = x·W into ``out`` (CuPy arrays, validated by the caller), added if ``accumulate``, through
    ``epilogue`` (a :class:`bsmm.epilogues.EpilogueCall`, None: stored); returns the call. ``gate``:
    a contiguous (nnzb,) array of the operands' dtype whose closed (0) blocks the kernel skips; ``w``
    is then already scaled by it (``cuda/bsmm_gates.cuh``)."""
    return _sparse_pass("fprop", index, x, w, out, feature_axis, tf32, index.C, index.K, accumulate, epilogue, gate)


def bprop(index: BlockIndex, dy, w, out, feature_axis: int, tf32: bool = False,
          accumulate: bool = False, epilogue=None, gate=None) -> FastCall | None:
    """dx = dy·Wᵀ into ``out``, added if ``accumulate``, through ``epilogue``, skipping ``gate``'s closed
    blocks as :func:`fprop`; returns the call to repeat it."""
    return _sparse_pass("bprop", index, dy, w, out, feature_axis, tf32, index.K, index.C, accumulate, epilogue, gate)


def updat(index: BlockIndex, x, dy, out, feature_axis: int, tf32: bool = False,
          accumulate: bool = False, gate=None) -> FastCall | None:
    """dW = xᵀ·dy on the present blocks into ``out``, added to it if ``accumulate``; returns the call to repeat it.
    ``gate`` (as :func:`fprop`'s): the blocks it closes may be skipped, their ``out`` then 0 (left as it
    is where ``accumulate``); the caller scales the others."""
    if out.size == 0:
        return None
    n = x.shape[1 - feature_axis]
    dtype = DTYPE_NAMES[x.dtype]
    aligned = _aligned(feature_axis, n, x, dy, out)
    plan = plan_for(index, "updat", n, dtype, feature_axis, tf32, aligned, plain=True)
    if _paths is not None:
        _paths.append(plan.path)
    ld_x, ld_dy = (index.C, index.K) if feature_axis == 1 else (n, n)
    sizes = Sizes(n, ld_x, ld_dy, 0, 0)
    plan.launch(_current_stream().ptr, x.data.ptr, dy.data.ptr, out.data.ptr, sizes, int(accumulate),
                gate_ptr=0 if gate is None else gate.data.ptr)
    return FastCall(plan, x, dy, out, sizes)


def strided_pass(pass_name: str, index: BlockIndex, act, other, out, rows: int, row_strides: tuple,
                 accumulate: bool = False, tf32: bool = False) -> None:
    """One pass over ``rows`` feature rows (feature axis 1) whose starts are ``row_strides`` apart.

    The building block of implicit GEMMs (:mod:`bsmm.nn.conv`): each kernel offset of a
    convolution is one call whose rows start at a shifted position of one padded input
    and may leave gaps (strides), so no im2col copy is made. ``act``, ``other`` and ``out`` are flat 1-D
    CuPy arrays of one dtype whose element 0 starts the first row; ``row_strides``
    gives the distance in elements between consecutive rows of the two row-major
    operands: (activation, output) for fprop and bprop, (x, dy) for updat. The weight
    operand (``other``, or ``out`` for updat) holds nnzb·bs·bs elements in storage
    order. ``accumulate`` adds into ``out``. Rows must lie inside their flat arrays
    (checked); the output rows of one call must not overlap each other (not checked).
    Same contract as :func:`bsmm.backends.cpu.strided_pass`.
    """
    shifted_pass(pass_name, index, act, other, out, rows, row_strides, None, accumulate, tf32)


def shifted_pass(pass_name: str, index: BlockIndex, act, other, out, rows: int, row_strides: tuple,
                 act_blocks: tuple | None, accumulate: bool = False, tf32: bool = False,
                 weight_blocks: BlockOrder | None = None) -> None:
    """:func:`strided_pass` whose activation block b is read at block ``act_blocks[b]`` of each row.

    One launch then sums blocks that read the activations at different offsets: the kernel's
    step table holds the activation block of every step, and only that table changes
    (:func:`bsmm.backends.strided.virtual_width`). ``act_blocks`` is a tuple (it keys the cached plan).
    ``weight_blocks`` (fprop, bprop): weight block b of the index is block
    ``weight_blocks.positions[b]`` of ``other`` (the step table holds those positions).
    """
    span = virtual_width(pass_name, index, act_blocks) if act_blocks is not None else None
    check_strided_operands(pass_name, index, act, other, out, rows, row_strides, span, weight_blocks)
    if rows == 0:
        return
    stride_a, stride_b = (int(v) for v in row_strides)
    item = act.dtype.itemsize
    aligned = _aligned(1, rows, act, other, out) and all((s * item) % _VEC_BYTES == 0 for s in (stride_a, stride_b))
    plan = plan_for(index, pass_name, rows, DTYPE_NAMES[act.dtype], 1, tf32, aligned, act_blocks, weight_blocks)
    if PASSES[pass_name].updates_weights:
        sizes = Sizes(rows, stride_a, stride_b, 0, 0)
    else:
        features_out = PASSES[pass_name].features(index.C, index.K)[1]
        sizes = Sizes(rows, stride_a, 0, stride_b, features_out // index.block_size)
    plan.launch(_current_stream().ptr, act.data.ptr, other.data.ptr, out.data.ptr, sizes, int(accumulate))


_GATHERS = {unit: GatherVariant(unit) for unit in (16, 8, 4, 2)}


def gather_rows(dst, src, row_map) -> None:
    """``dst[r] = src[row_map.rows[r]]``, zeros where the map is negative, in one launch on CuPy's
    current stream (``cuda/bsmm_gather_rows.cu``); ``dst`` and ``src`` are C-contiguous 2-D CuPy
    arrays of one dtype and row width, ``row_map`` a :class:`bsmm.nn.row_maps.RowMap`."""
    if len(row_map) != dst.shape[0] or dst.shape[1:] != src.shape[1:]:
        raise ValueError(f"gather_rows: a map of {len(row_map)} rows moves rows of {src.shape[1:]} into "
                         f"{dst.shape[0]} rows of {dst.shape[1:]}")
    rows, row_bytes = dst.shape[0], dst.shape[1] * dst.dtype.itemsize
    if rows == 0 or row_bytes == 0:
        return
    unit = next(u for u in (16, 8, 4, 2) if row_bytes % u == 0 and (dst.data.ptr | src.data.ptr) % u == 0)
    units = row_bytes // unit
    kernel = load_kernel(_GATHERS[unit], _get_device())  # the device row_map.device_array() uses
    across = 32 if units <= 32 else 64 if units <= 64 else 128  # threads along a row, 256 a block
    down = 256 // across
    blocks = min(-(-rows // down), 1 << 20)
    kernel((blocks,), (across, down), (src, dst, row_map.device_array(), np.int64(rows), np.int32(units)))

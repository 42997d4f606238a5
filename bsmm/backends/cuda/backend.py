"""The three passes on CUDA GPUs: launch plans over the kernels of ``cuda/bsmm_matmul.cu``.

A *plan* fixes everything about a pass that does not change from call to call
for one (layout, pass, N, dtype, feature axis, math mode, alignment, device):
the kernel variant, the grid, and the device-side tables (segments, units,
step table), uploaded once. A pass then costs one kernel launch on CuPy's
current stream, no host synchronisation and no allocation besides the output
and, for layouts whose long block columns are cut into parts, a workspace and
counters kept per (plan, stream) and reused.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import struct
import threading
import weakref
from typing import Iterator

import cupy
import numpy as np

from bsmm.block_index import BlockIndex
from bsmm.dtypes import DTYPE_NAMES
from bsmm.backends.cuda.launches import SerializedLaunch
from bsmm.backends.cuda.kernels import ELEMENT_BYTES, BlockTransposeVariant, GatherVariant, TransposeVariant, Variant, load_kernel
from bsmm.backends.cuda.planner import (Device, Path, copies, copy_row_elements, launch_layout, layout_path, math_mode,  # noqa: F401
                      recording_table_lookups, tile_for, transposed_layout, transposes_weights)
from bsmm.backends.strided import BlockOrder, check_strided_operands, virtual_width
from bsmm.backends.cuda.tensor_maps import MAP_BYTES, tensor_map

__all__ = ["FastCall", "fprop", "bprop", "updat", "strided_pass", "shifted_pass", "gather_rows", "plan_for",
           "tile_for", "forget_plans", "recording_table_lookups", "recording_paths", "device_traits"]

_VEC_BYTES = 16
# Bound once: the per-call path looks these up on every launch.
_launch_kernel = cupy.cuda.driver.launchKernel
_get_device = cupy.cuda.runtime.getDevice
_current_stream = cupy.cuda.get_current_stream


_ARG_COUNT = 14  # parameters of bsmm_matmul


class _Launcher:
    """Launches one kernel with a parameter block packed in one call.

    CuPy's generic launch converts every argument on every call (tens of
    microseconds for 14 arguments); here the values are packed into a fixed
    buffer whose slot addresses were computed once. ``cuLaunchKernel`` copies
    the parameters, so the buffer is free again when it returns. ``map_count``
    128-byte TMA tensor maps (:mod:`bsmm.backends.cuda.tensor_maps`) follow the 8-byte slots.
    """

    def __init__(self, kernel, grid, threads: int, shared_bytes: int, arg_count: int = _ARG_COUNT,
                 map_count: int = 0, serialized: bool = False):
        self.function = kernel.kernel.ptr
        # Launched with programmatic stream serialization (bsmm.backends.cuda.launches): stream -> its configuration.
        self.serialized: dict | None = {} if serialized else None
        self.grid, self.threads, self.shared_bytes = grid, threads, shared_bytes
        # cuLaunchKernel's arguments before the stream: function, grid, block, shared bytes.
        self.head = (self.function, *grid, threads, 1, 1, shared_bytes)
        # Each parameter gets an 8-byte slot; int parameters are read from the low 4 bytes (little-endian).
        self.arg_count = arg_count
        self.pack = struct.Struct(f"<{arg_count}Q").pack_into
        self.values = (ctypes.c_uint64 * arg_count)()
        self.maps = [(ctypes.c_uint64 * (MAP_BYTES // 8))() for _ in range(map_count)]
        base = ctypes.addressof(self.values)
        self.map_addresses = [ctypes.addressof(m) for m in self.maps]
        self.pointers = (ctypes.c_uint64 * (arg_count + map_count))(
            *(base + 8 * i for i in range(arg_count)), *self.map_addresses)
        self.pointers_address = ctypes.addressof(self.pointers)
        self.map_key = None  # what the tensor maps in the buffer describe
        self.lock = threading.Lock()

    def launch(self, stream_ptr: int, *values: int, map_key=None, make_maps=None) -> None:
        """One launch on ``stream_ptr`` with the kernel's parameters in order. ``make_maps()`` gives
        the tensor maps' bytes; it is called only where ``map_key`` differs from the last launch's
        (an eager loop over the same arrays skips it)."""
        with self.lock:
            self.pack(self.values, 0, *values)
            if map_key != self.map_key:
                for address, data in zip(self.map_addresses, make_maps()):
                    ctypes.memmove(address, data, MAP_BYTES)
                self.map_key = map_key
            if self.serialized is None:
                _launch_kernel(*self.head, stream_ptr, self.pointers_address, 0)
            else:
                self.serialized_on(stream_ptr).launch(self.pointers_address)

    def serialized_on(self, stream_ptr: int) -> SerializedLaunch:
        """The serialized launch configuration of this kernel on ``stream_ptr`` (made once)."""
        launch = self.serialized.get(stream_ptr)
        if launch is None:
            launch = self.serialized[stream_ptr] = SerializedLaunch(self.function, self.grid, (self.threads, 1, 1),
                                                                    self.shared_bytes, stream_ptr)
        return launch

    def parameters(self, stream_ptr: int, values: tuple, maps: tuple = ()) -> "_Parameters":
        """A parameter block of its own for a launch on ``stream_ptr`` with these values and maps,
        never written again: a repeated call launches it as it is, without packing, locking or
        copying maps (:class:`FastCall`)."""
        block = _Parameters(self.arg_count, values, maps)
        if self.serialized is not None:  # cuLaunchKernelEx and its arguments, made once
            launch = self.serialized_on(stream_ptr)
            block.driver, block.arguments = launch.driver, launch.arguments(block.address)
        return block


class _Parameters:
    """A kernel's parameters laid out as :class:`_Launcher` lays them out, held for a launch to
    pass by address (``cuLaunchKernel`` copies them during the call)."""

    __slots__ = ("values", "maps", "pointers", "address", "driver", "arguments")

    def __init__(self, arg_count: int, values: tuple, maps: tuple):
        self.driver = self.arguments = None  # cuLaunchKernelEx and its arguments, where launches are serialized
        self.values = (ctypes.c_uint64 * arg_count)(*values)
        self.maps = [(ctypes.c_uint64 * (MAP_BYTES // 8)).from_buffer_copy(data) for data in maps]
        base = ctypes.addressof(self.values)
        self.pointers = (ctypes.c_uint64 * (arg_count + len(maps)))(
            *(base + 8 * i for i in range(arg_count)), *(ctypes.addressof(m) for m in self.maps))
        self.address = ctypes.addressof(self.pointers)


@dataclasses.dataclass
class Plan:
    """Everything one pass launch needs, built once; see the module docstring."""

    variant: Variant
    segments: object  # cupy int32 (n_segments, 4)
    units: object  # cupy int32 (n_units, 2)
    table: object  # cupy int32 (entries, 2)
    workspace_floats: int
    counter_count: int
    launcher: _Launcher
    band_rows: int = 1  # fprop/bprop: row tiles per band of the kernel's visiting order
    path: Path | None = None  # the planner's decisions (bsmm.backends.cuda.planner.Path)
    # stream -> (kernel pointer arguments 3..7, the workspace and counter arrays they point into)
    scratch: dict = dataclasses.field(default_factory=dict)

    def launch(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: tuple,
               accumulate: int) -> None:
        """One launch on ``stream_ptr``; ``sizes`` = (N, ld_act, ld_other, ld_out)."""
        self.launcher.launch(stream_ptr, *self.values(stream_ptr, act_ptr, other_ptr, out_ptr, sizes, accumulate))

    def values(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: tuple,
               accumulate: int) -> tuple:
        """The kernel's integer parameters, in order, for a launch on ``stream_ptr``."""
        return (act_ptr, other_ptr, out_ptr, *self.scratch_for(stream_ptr), *sizes, int(accumulate), self.band_rows)

    def parameters(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: tuple,
                   accumulate: int):
        """The parameters of :meth:`launch` as a block of their own, to launch again as they are."""
        return self.launcher.parameters(stream_ptr,
                                        self.values(stream_ptr, act_ptr, other_ptr, out_ptr, sizes, accumulate))

    def scratch_for(self, stream_ptr: int) -> tuple:
        """Pointers to the tables and to this stream's workspace and counters (allocated once)."""
        entry = self.scratch.get(stream_ptr)
        if entry is None:
            entry = _per_stream(self.scratch, stream_ptr, lambda: self._new_scratch(stream_ptr))
        return entry[0]

    def _new_scratch(self, stream_ptr: int) -> tuple:
        # Counters start at zero and each launch's last part resets the ones it used.
        workspace, workspace_owner = allocate_workspace(4 * max(1, self.workspace_floats))
        counters, counters_owner = allocate_workspace(4 * max(1, self.counter_count))
        cupy.cuda.runtime.memsetAsync(counters, 0, 4 * max(1, self.counter_count), stream_ptr)
        pointers = (self.segments.data.ptr, self.units.data.ptr, self.table.data.ptr, workspace, counters)
        return pointers, (workspace_owner, counters_owner)


@dataclasses.dataclass
class TmaPlan(Plan):
    """A :class:`Plan` of ``bsmm_matmul_tma`` (Hopper): each launch also passes TMA tensor maps
    (:mod:`bsmm.backends.cuda.tensor_maps`) of the activations (N rows of ld_act elements), of the other
    operand (fprop/bprop: the weights as ``block_rows`` rows of one block each; updat: dy as N
    rows of ld_other) and of the output (fprop/bprop: N rows of the output features, ld_out
    apart; updat: the weights' ``block_rows`` rows). On feature axis 0 (updat row groups) x and
    dy are ``feature_rows`` rows of N elements. Boxes are (elements, rows)."""

    act_box: tuple = (64, 64)
    other_box: tuple = (64, 64)
    out_box: tuple | None = None  # None: tiles are not stored through TMA (mma.sync, row groups)
    block_rows: int = 0  # nnzb x block size
    feature_rows: tuple = (0, 0)  # (C, K): the rows of x and dy on feature axis 0

    def launch(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: tuple,
               accumulate: int) -> None:
        # A new output array (each eager call's) changes no map the kernel reads where tiles
        # are not stored through TMA.
        out_key = out_ptr if self.out_box is not None else None
        self.launcher.launch(stream_ptr, *self.values(stream_ptr, act_ptr, other_ptr, out_ptr, sizes, accumulate),
                             map_key=(act_ptr, other_ptr, out_key, sizes),
                             make_maps=lambda: self.maps(act_ptr, other_ptr, out_ptr, sizes))

    def parameters(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: tuple,
                   accumulate: int):
        return self.launcher.parameters(stream_ptr,
                                        self.values(stream_ptr, act_ptr, other_ptr, out_ptr, sizes, accumulate),
                                        self.maps(act_ptr, other_ptr, out_ptr, sizes))

    def maps(self, act_ptr: int, other_ptr: int, out_ptr: int, sizes: tuple) -> tuple[bytes, bytes, bytes]:
        """The activation, other-operand and output tensor maps of a launch (``sizes`` as for
        :meth:`Plan.launch`; fprop/bprop carry the output blocks in ld_other). Only wgmma tiles
        are stored through TMA: mma.sync tiles and updat row groups get zeros for the output map."""
        n, ld_act, ld_other, ld_out = sizes
        bs = self.variant.block_size
        e = ELEMENT_BYTES[self.variant.dtype]
        if self.variant.feature_axis == 0:  # updat row groups: xᵀ and dyᵀ, N columns (past N: zeros)
            return (tensor_map(act_ptr, n, self.feature_rows[0], e * ld_act, *self.act_box, e),
                    tensor_map(other_ptr, n, self.feature_rows[1], e * ld_other, *self.other_box, e), _NO_MAP)
        act = tensor_map(act_ptr, ld_act, n, e * ld_act, *self.act_box, e)
        stored = self.out_box is not None
        if self.variant.pass_name == "updat":
            dy = tensor_map(other_ptr, ld_other, n, e * ld_other, *self.other_box, e)
            return act, dy, tensor_map(out_ptr, bs, self.block_rows, e * bs, *self.out_box, e) if stored else _NO_MAP
        weights = tensor_map(other_ptr, bs, self.block_rows, e * bs, *self.other_box, e)
        return act, weights, tensor_map(out_ptr, ld_other * bs, n, e * ld_out, *self.out_box, e) if stored else _NO_MAP


_NO_MAP = bytes(MAP_BYTES)  # a tensor-map parameter the kernel does not read


def device_traits(device) -> Device:
    """The planner's :class:`bsmm.backends.cuda.planner.Device` for a CuPy device, as the environment
    switches of this moment leave it; occupancy comes from the driver (loading the kernel)."""
    return Device.with_environment(f"sm{device.compute_capability}", device.attributes["MultiProcessorCount"],
                                   lambda variant: _occupancy(load_kernel(variant, device.id), variant))


def _build_plan(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, tf32: bool,
                aligned: bool, device, act_blocks: tuple | None = None,
                weight_blocks: BlockOrder | None = None, act_transposed: bool = False, copied: str = "") -> Plan:
    """The plan of one kernel launch: :func:`bsmm.backends.cuda.planner.launch_layout`'s decisions and tables,
    uploaded to ``device``. ``copied``: what the caller transposes first (for :attr:`Plan.path`)."""
    traits = device_traits(device)
    layout = launch_layout(index, pass_name, n, dtype, feature_axis, tf32, aligned, traits, act_blocks,
                           weight_blocks, act_transposed)
    variant = layout.variant
    kernel = load_kernel(variant, device.id)
    with device:
        return (TmaPlan if variant.tma else Plan)(
            variant=variant,
            launcher=_Launcher(kernel, layout.grid, variant.threads, variant.shared_bytes,
                               map_count=3 if variant.tma else 0, serialized=traits.programmatic),
            segments=cupy.asarray(layout.segments),
            units=cupy.asarray(layout.units),
            table=cupy.asarray(layout.table),
            workspace_floats=layout.workspace_floats,
            counter_count=layout.counter_count,
            band_rows=layout.band_rows,
            path=layout_path(pass_name, copied, layout, traits),
            **layout.tma_fields,
        )


def _occupancy(kernel, variant) -> int:
    """Thread blocks of ``variant`` one SM holds at once."""
    return max(1, cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
        kernel.kernel.ptr, variant.threads, variant.shared_bytes))


_PLANS: "weakref.WeakKeyDictionary[BlockIndex, dict]" = weakref.WeakKeyDictionary()
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


_PLAN_LOCK = threading.Lock()


def forget_plans() -> None:
    """Drop every cached plan, so that the next call of a pass plans it from the current settings
    (:func:`bsmm.config.overriding`). Operators keep the calls they already made
    (:class:`FastCall`): make new ones."""
    with _PLAN_LOCK:
        _PLANS.clear()


def allocate_workspace(nbytes: int) -> tuple[int, object]:
    """(device pointer, owner) of ``nbytes`` from CuPy's pool on the current device, for a plan's
    workspace on one stream. Kept outside any framework's allocator: a workspace first needed
    while a framework captures a CUDA graph (a captured training step) is then no allocation of
    the graph's pool that the framework would have to account for."""
    memory = cupy.cuda.alloc(nbytes)
    return memory.ptr, memory


def _per_stream(workspaces: dict, stream_ptr: int, make):
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


def _transpose_launcher(item: int, ld: int, features: int, device) -> _Launcher:
    """A launch of ``transpose_tiles`` (``cuda/bsmm_transpose.cu``) turning an (N, features)
    operand of ``item``-byte elements into its (features, ld) copy."""
    tile = TransposeVariant.TILE
    return _Launcher(load_kernel(TransposeVariant(item), device.id), (-(-ld // tile), -(-features // tile), 1),
                     TransposeVariant.threads, 0, 5, serialized=device_traits(device).programmatic)


class TransposedActivations:
    """fprop (bprop) on feature axis 1 through a transposed copy of x (dy): one launch of
    ``cuda/bsmm_transpose.cu`` into a workspace, then the pass reading that copy as on feature
    axis 0 and writing its output on axis 1 (``Variant.act_transposed``).

    At block 16 a row of the activations holds a block's features as one 32-byte segment, its
    own cache-line request, and those requests, not the bytes, bound the pass; in the copy every
    row of a tile is whole lines. Used for the block sizes of ``[kernels] act_transpose``,
    float16/bfloat16, batches of at least ``act_transpose_min_rows`` rows and where the copy,
    features x N elements (N rounded up to 16 bytes with zeros), fits
    ``act_transpose_max_bytes`` (:func:`bsmm.backends.cuda.planner.transposes_activations`); kept per stream
    like :class:`TransposedUpdat`'s. Same launch interface as :class:`Plan`.
    """

    def __init__(self, index: BlockIndex, pass_name: str, n: int, dtype: str, device):
        self.n = n
        self.features = index.C if pass_name == "fprop" else index.K
        item = ELEMENT_BYTES[dtype]
        self.ld = copy_row_elements(n, item)
        self.plan = _build_plan(index, pass_name, n, dtype, 0, False, True, device, act_transposed=True,
                                copied="x" if pass_name == "fprop" else "dy")
        self.variant, self.path = self.plan.variant, self.plan.path
        self.transpose = _transpose_launcher(item, self.ld, self.features, device)
        self.item = item
        self.workspaces: dict = {}  # stream -> the activations transposed

    def launch(self, stream_ptr: int, act_ptr: int, w_ptr: int, out_ptr: int, sizes: tuple, accumulate: int) -> None:
        act_t, _ = _per_stream(self.workspaces, stream_ptr, lambda: allocate_workspace(self.features * self.ld * self.item))
        self.transpose.launch(stream_ptr, act_ptr, act_t, self.n, self.features, self.ld)
        # (n, activation row length, output blocks, output row length): the copy's rows are ld long.
        self.plan.launch(stream_ptr, act_t, w_ptr, out_ptr, (sizes[0], self.ld, *sizes[2:]), accumulate)


class TransposedUpdat:
    """updat on feature axis 1 through transposed copies of x and dy: two launches of
    ``cuda/bsmm_transpose.cu`` into a workspace, then the feature-axis-0 updat over them.

    At block 16 (32) a row of x or dy holds a block's features as one 32 (64)-byte segment,
    its own cache line, and those line requests, not the bytes, bound the pass; transposed,
    every row of a tile is whole lines (T, fp16: block 16 5-6 -> 9-10 % efficiency, block 32
    14-15 -> 15-18 %; ``results/archive/RESULTS.md``, v8). TF32 on Hopper takes it too, for its wgmma
    row groups, which read 32-bit operands K-major only (:func:`bsmm.backends.cuda.planner.transposes_updat`). Used for
    the block sizes listed in ``[kernels] updat_transpose``, batches of at least
    ``updat_transpose_min_rows`` rows and where the workspace, (C + K) x N elements (N
    rounded up to 16 bytes with zeros), fits ``updat_transpose_max_bytes``;
    the workspace is kept per stream, like a plan's (CUDA graphs capture its address).
    Same launch interface as :class:`Plan`.
    """

    def __init__(self, index: BlockIndex, n: int, dtype: str, device, tf32: bool = False):
        self.n, self.C, self.K = n, index.C, index.K
        item = ELEMENT_BYTES[dtype]
        self.ld = copy_row_elements(n, item)
        self.plan = _build_plan(index, "updat", n, dtype, 0, tf32, True, device, copied="x+dy")
        self.variant, self.path = self.plan.variant, self.plan.path
        self.transpose_x, self.transpose_dy = (_transpose_launcher(item, self.ld, features, device)
                                               for features in (self.C, self.K))
        self.item = item
        self.workspaces: dict = {}  # stream -> (x transposed, dy transposed)

    def launch(self, stream_ptr: int, x_ptr: int, dy_ptr: int, out_ptr: int, sizes: tuple, accumulate: int) -> None:
        (x_t, _), (dy_t, _) = _per_stream(self.workspaces, stream_ptr, lambda: (
            allocate_workspace(self.C * self.ld * self.item), allocate_workspace(self.K * self.ld * self.item)))
        self.transpose_x.launch(stream_ptr, x_ptr, x_t, self.n, self.C, self.ld)
        self.transpose_dy.launch(stream_ptr, dy_ptr, dy_t, self.n, self.K, self.ld)
        self.plan.launch(stream_ptr, x_t, dy_t, out_ptr, (self.n, self.ld, self.ld, 0), accumulate)


class TransposedWeightsFprop:
    """TF32 fprop on Hopper as a bprop over the transposed layout: y = x·W is x·W'ᵀ, W' holding
    each block of W transposed, in the row-major order of the layout's transpose (its
    ``col_order``). TF32 wgmma reads 32-bit operands K-major only: bprop's weight rows are,
    fprop's are not. One launch of ``transpose_blocks`` (``cuda/bsmm_transpose.cu``) writes W'
    into a workspace of nnzb x block² floats, kept per stream like a plan's; then the transposed
    layout's bprop plan runs on W'. Used where that plan is a TF32 wgmma one
    (``[kernels.sm90.tma_tf32]``); same launch interface as :class:`Plan`.
    """

    def __init__(self, index: BlockIndex, n: int, device):
        self.index_t = transposed_layout(index)
        self.plan = _build_plan(self.index_t, "bprop", n, "float32", 1, True, True, device, copied="w")
        self.variant, self.path = self.plan.variant, dataclasses.replace(self.plan.path, pass_name="fprop")
        self.order = cupy.asarray(index.col_order, dtype=np.int32)
        transpose = BlockTransposeVariant(index.block_size)
        self.transpose = _Launcher(load_kernel(transpose, device.id), (index.nnzb, transpose.tiles, 1),
                                   transpose.threads, 0, 3, serialized=device_traits(device).programmatic)
        self.weight_count = index.nnzb * index.block_size ** 2
        self.workspaces: dict = {}  # stream -> W'

    def launch(self, stream_ptr: int, x_ptr: int, w_ptr: int, out_ptr: int, sizes: tuple, accumulate: int) -> None:
        # (n, C, K / block, K) of the fprop are (n, K', C' / block, C') of the transposed bprop.
        w_t, _ = _per_stream(self.workspaces, stream_ptr, lambda: allocate_workspace(4 * self.weight_count))
        self.transpose.launch(stream_ptr, w_ptr, w_t, self.order.data.ptr)
        self.plan.launch(stream_ptr, x_ptr, w_t, out_ptr, sizes, accumulate)


def plan_for(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, tf32: bool,
             aligned: bool, act_blocks: tuple | None = None, weight_blocks: BlockOrder | None = None,
             plain: bool = False) -> Plan:
    """The cached plan for this pass on the current device, built on first use.

    ``plain``: the operands are whole (N, C) and (N, K) arrays (or their feature-axis-0
    transposes), so the pass may read transposed copies of them (:class:`TransposedUpdat`,
    :class:`TransposedActivations`); strided and shifted passes are not. A TF32 fprop gets its
    :class:`TransposedWeightsFprop` where that applies (:func:`bsmm.backends.cuda.planner.copies`).
    """
    device_id = cupy.cuda.runtime.getDevice()
    key = (pass_name, n, dtype, feature_axis, tf32, aligned, device_id, act_blocks, weight_blocks, plain)
    plans = _PLANS.get(index)
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        with _PLAN_LOCK:
            plans = _PLANS.setdefault(index, {})
            plan = plans.get(key)
            if plan is None:
                plan = plans[key] = _new_plan(index, pass_name, n, dtype, feature_axis, tf32, aligned, act_blocks,
                                              weight_blocks, plain, cupy.cuda.Device(device_id))
    return plan


def _new_plan(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, tf32: bool, aligned: bool,
              act_blocks, weight_blocks, plain: bool, device):
    """The plan :func:`plan_for` keeps: a :class:`Plan`, or one of the copying plans around one."""
    traits = device_traits(device)
    if plain:
        copied = copies(index, pass_name, n, dtype, feature_axis, tf32, aligned, traits)
    elif act_blocks is None and weight_blocks is None and pass_name == "fprop" and transposes_weights(
            index, n, dtype, feature_axis, tf32, aligned, traits):
        copied = "w"
    else:
        copied = ""
    if copied == "w":
        return TransposedWeightsFprop(index, n, device)
    if copied == "x+dy":
        return TransposedUpdat(index, n, dtype, device, tf32)
    if copied:
        return TransposedActivations(index, pass_name, n, dtype, device)
    return _build_plan(index, pass_name, n, dtype, feature_axis, tf32, aligned, device, act_blocks, weight_blocks)


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
                 "seen")

    def __init__(self, plan: Plan, act, other, out, sizes: tuple):
        self.plan, self.device, self.dtype = plan, act.data.device_id, act.dtype
        self.act_strides, self.other_shape, self.other_strides = act.strides, other.shape, other.strides
        self.out_shape, self.out_strides = out.shape, out.strides
        self.act_bytes, self.other_bytes, self.out_bytes = act.nbytes, other.nbytes, out.nbytes
        self.aligned, self.sizes = plan.variant.aligned, sizes
        # A TransposedUpdat (TransposedActivations, TransposedWeightsFprop) launches three (two)
        # kernels: it keeps the plan's own launch.
        self.head = plan.launcher.head if isinstance(plan, Plan) else None
        self.blocks: dict = {}  # (stream, act, other, out, accumulate) -> _Parameters
        self.seen: set = set()  # keys launched once

    def __call__(self, act, other, out=None, accumulate: bool = False):
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
        self.launch(_current_stream().ptr, act_ptr, other_ptr, out_ptr, accumulate)
        return out

    def launch(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, accumulate: bool = False) -> None:
        """The pass on raw device pointers of operands laid out as the first call's (the caller
        has checked shapes, strides, dtype, device, alignment and overlap): how a framework
        adapter repeats a call without wrapping its tensors (:mod:`bsmm.torch.ops`)."""
        key = (stream_ptr, act_ptr, other_ptr, out_ptr, accumulate)
        block = self.blocks.get(key)
        if block is None:
            block = self._keep(key)
            if block is None:  # launched through the plan
                return
        if block.arguments is None:
            _launch_kernel(*self.head, stream_ptr, block.address, 0)
        else:
            result = block.driver(*block.arguments)
            if result:
                raise RuntimeError(f"cuLaunchKernelEx failed (CUresult {result})")

    def _keep(self, key: tuple):
        """The block to launch for a key seen before, kept from now on; a key seen the first time
        (or any key of a plan that copies first, as TransposedUpdat) launches through the plan
        instead, and gives None."""
        stream_ptr, act_ptr, other_ptr, out_ptr, accumulate = key
        if self.head is None or key not in self.seen:
            if self.head is not None:
                if len(self.seen) >= _MAX_KEPT_LAUNCHES:
                    self.seen.clear()
                self.seen.add(key)
            self.plan.launch(stream_ptr, act_ptr, other_ptr, out_ptr, self.sizes, int(accumulate))
            return None
        if len(self.blocks) >= _MAX_KEPT_LAUNCHES:
            self.blocks.clear()  # e.g. outputs at new addresses every call: keep the dict small
        block = self.blocks[key] = self.plan.parameters(stream_ptr, act_ptr, other_ptr, out_ptr, self.sizes,
                                                        int(accumulate))
        return block


_MAX_KEPT_LAUNCHES = 64


def _sparse_pass(pass_name: str, index: BlockIndex, act, w, out, feature_axis: int, tf32: bool,
                 features_in: int, features_out: int, accumulate: bool) -> FastCall | None:
    n = act.shape[1 - feature_axis]
    if n == 0 or out.size == 0:
        return None
    dtype = DTYPE_NAMES[act.dtype]
    aligned = _aligned(feature_axis, n, act, w, out)
    plan = plan_for(index, pass_name, n, dtype, feature_axis, tf32, aligned, plain=True)
    if _paths is not None:
        _paths.append(plan.path)
    ld_act, ld_out = (features_in, features_out) if feature_axis == 1 else (n, n)
    # Column groups read the number of output blocks from the otherwise unused ld_other.
    sizes = (n, ld_act, features_out // index.block_size, ld_out)
    plan.launch(_current_stream().ptr, act.data.ptr, w.data.ptr, out.data.ptr, sizes, int(accumulate))
    return FastCall(plan, act, w, out, sizes)


def fprop(index: BlockIndex, x, w, out, feature_axis: int, tf32: bool = False,
          accumulate: bool = False) -> FastCall | None:
    """y = x·W into ``out`` (CuPy arrays, validated by the caller), added if ``accumulate``; returns the call."""
    return _sparse_pass("fprop", index, x, w, out, feature_axis, tf32, index.C, index.K, accumulate)


def bprop(index: BlockIndex, dy, w, out, feature_axis: int, tf32: bool = False,
          accumulate: bool = False) -> FastCall | None:
    """dx = dy·Wᵀ into ``out``, added if ``accumulate``; returns the call to repeat it."""
    return _sparse_pass("bprop", index, dy, w, out, feature_axis, tf32, index.K, index.C, accumulate)


def updat(index: BlockIndex, x, dy, out, feature_axis: int, accumulate: bool, tf32: bool = False) -> FastCall | None:
    """dW = xᵀ·dy on the present blocks into ``out``, added to it if ``accumulate``; returns the call to repeat it."""
    if out.size == 0:
        return None
    n = x.shape[1 - feature_axis]
    dtype = DTYPE_NAMES[x.dtype]
    aligned = _aligned(feature_axis, n, x, dy, out)
    plan = plan_for(index, "updat", n, dtype, feature_axis, tf32, aligned, plain=True)
    if _paths is not None:
        _paths.append(plan.path)
    ld_x, ld_dy = (index.C, index.K) if feature_axis == 1 else (n, n)
    sizes = (n, ld_x, ld_dy, 0)
    plan.launch(_current_stream().ptr, x.data.ptr, dy.data.ptr, out.data.ptr, sizes, int(accumulate))
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
    if pass_name == "updat":
        sizes = (rows, stride_a, stride_b, 0)
    else:
        features_out = index.K if pass_name == "fprop" else index.C
        sizes = (rows, stride_a, features_out // index.block_size, stride_b)
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

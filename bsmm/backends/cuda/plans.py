"""Launch plans: the decisions of :mod:`bsmm.backends.cuda.planner` uploaded to a device.

A *plan* fixes everything about a pass that does not change from call to call
for one (layout, pass, N, dtype, feature axis, math mode, alignment, device):
the kernel variant, the grid, and the device-side tables (segments, units,
step table), uploaded once. A pass then costs one kernel launch on the caller's
stream, no host synchronisation and no allocation besides the output and, for
layouts whose long block columns are cut into parts, a workspace and counters
kept per (plan, stream) and reused (:mod:`bsmm.backends.cuda.workspaces`).
Plans are cached per layout in :mod:`bsmm.backends.cuda.plan_cache`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct
import threading

import cupy

from bsmm.block_index import BlockIndex
from bsmm.backends.cuda.kernels import ELEMENT_BYTES, Variant, load_kernel
from bsmm.backends.cuda.launches import SerializedLaunch
from bsmm.backends.cuda.params import PACK, MatmulParams, Sizes, values as param_values
from bsmm.backends.cuda.planner import Path, launch_layout, layout_path
from bsmm.backends.cuda.policy import Policy
from bsmm.backends.cuda.selection import Device
from bsmm.backends.cuda.tensor_maps import MAP_BYTES, tensor_map
from bsmm.backends.cuda.workspaces import allocate_workspace, per_stream
from bsmm.backends.strided import BlockOrder
from bsmm.passes import PASSES

__all__ = ["Launcher", "Parameters", "Plan", "TmaPlan", "build_plan", "device_traits", "occupancy"]

# Bound once: the per-call path looks it up on every launch.
launch_kernel = cupy.cuda.driver.launchKernel

class Launcher:
    """Launches one kernel with a parameter block packed in one call.

    CuPy's generic launch converts every argument on every call; here the values are packed
    into a fixed buffer whose addresses were computed once. ``cuLaunchKernel`` copies the
    parameters, so the buffer is free again when it returns. ``arg_count`` scalar parameters
    of 8 bytes each (the copy kernels), or, with ``arg_count=None``, one
    :class:`~bsmm.backends.cuda.params.MatmulParams` struct (the matmul kernels); ``map_count``
    128-byte TMA tensor maps (:mod:`bsmm.backends.cuda.tensor_maps`) follow.
    """

    def __init__(self, kernel, grid, threads: int, shared_bytes: int, arg_count: int | None = None,
                 map_count: int = 0, serialized: bool = False):
        self.function = kernel.kernel.ptr
        # Launched with programmatic stream serialization (bsmm.backends.cuda.launches): stream -> its configuration.
        self.serialized: dict | None = {} if serialized else None
        self.grid, self.threads, self.shared_bytes = grid, threads, shared_bytes
        # cuLaunchKernel's arguments before the stream: function, grid, block, shared bytes.
        self.head = (self.function, *grid, threads, 1, 1, shared_bytes)
        # Scalar parameters get an 8-byte slot each; int parameters are read from the low 4 bytes (little-endian).
        self.arg_count = arg_count
        self.pack = PACK if arg_count is None else struct.Struct(f"<{arg_count}Q").pack_into
        self.values = _parameter_buffer(arg_count)
        self.maps = [(ctypes.c_uint64 * (MAP_BYTES // 8))() for _ in range(map_count)]
        self.map_addresses = [ctypes.addressof(m) for m in self.maps]
        self.pointers = _pointers(self.values, arg_count, self.map_addresses)
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
                launch_kernel(*self.head, stream_ptr, self.pointers_address, 0)
            else:
                self.serialized_on(stream_ptr).launch(self.pointers_address)

    def serialized_on(self, stream_ptr: int) -> SerializedLaunch:
        """The serialized launch configuration of this kernel on ``stream_ptr`` (made once)."""
        launch = self.serialized.get(stream_ptr)
        if launch is None:
            launch = self.serialized[stream_ptr] = SerializedLaunch(self.function, self.grid, (self.threads, 1, 1),
                                                                    self.shared_bytes, stream_ptr)
        return launch

    def parameters(self, stream_ptr: int, values: tuple, maps: tuple = ()) -> "Parameters":
        """A parameter block of its own for a launch on ``stream_ptr`` with these values and maps,
        never written again: a repeated call launches it as it is, without packing, locking or
        copying maps (:class:`FastCall`)."""
        block = Parameters(self.arg_count, values, maps)
        if self.serialized is not None:  # cuLaunchKernelEx and its arguments, made once
            launch = self.serialized_on(stream_ptr)
            block.driver, block.arguments = launch.driver, launch.arguments(block.address)
        return block


def _parameter_buffer(arg_count: int | None):
    """The buffer the values are packed into: a MatmulParams struct, or ``arg_count`` 8-byte slots."""
    return MatmulParams() if arg_count is None else (ctypes.c_uint64 * arg_count)()


def _pointers(buffer, arg_count: int | None, map_addresses: list):
    """``cuLaunchKernel``'s kernelParams: the address of each parameter (the struct is one), then the maps'."""
    base = ctypes.addressof(buffer)
    slots = [base] if arg_count is None else [base + 8 * i for i in range(arg_count)]
    return (ctypes.c_uint64 * (len(slots) + len(map_addresses)))(*slots, *map_addresses)


class Parameters:
    """A kernel's parameters laid out as :class:`Launcher` lays them out, held for a launch to
    pass by address (``cuLaunchKernel`` copies them during the call)."""

    __slots__ = ("values", "maps", "pointers", "address", "driver", "arguments")

    def __init__(self, arg_count: int | None, values: tuple, maps: tuple):
        self.driver = self.arguments = None  # cuLaunchKernelEx and its arguments, where launches are serialized
        self.values = _parameter_buffer(arg_count)
        (PACK if arg_count is None else struct.Struct(f"<{arg_count}Q").pack_into)(self.values, 0, *values)
        self.maps = [(ctypes.c_uint64 * (MAP_BYTES // 8)).from_buffer_copy(data) for data in maps]
        self.pointers = _pointers(self.values, arg_count, [ctypes.addressof(m) for m in self.maps])
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
    launcher: Launcher
    band_rows: int = 1  # fprop/bprop: row tiles per band of the kernel's visiting order
    path: Path | None = None  # the planner's decisions (bsmm.backends.cuda.planner.Path)
    # stream -> (kernel pointer arguments 3..7, the workspace and counter arrays they point into)
    scratch: dict = dataclasses.field(default_factory=dict)

    def launch(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: Sizes,
               accumulate: int, bias_ptr: int = 0, pre_ptr: int = 0, gate_ptr: int = 0) -> None:
        """One launch on ``stream_ptr``; ``bias_ptr`` and ``pre_ptr`` are read by a BiasAct epilogue (0: none),
        ``gate_ptr`` are per-block gates whose closed (0) blocks the kernel skips (``cuda/bsmm_gates.cuh``; 0: none)."""
        self.launcher.launch(stream_ptr, *self.values(stream_ptr, act_ptr, other_ptr, out_ptr, sizes, accumulate,
                                                      bias_ptr, pre_ptr, gate_ptr))

    def values(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: Sizes,
               accumulate: int, bias_ptr: int = 0, pre_ptr: int = 0, gate_ptr: int = 0) -> tuple:
        """The kernel's :class:`~bsmm.backends.cuda.params.MatmulParams`, in order, for a launch on ``stream_ptr``."""
        return param_values(act_ptr, other_ptr, out_ptr, self.scratch_for(stream_ptr), bias_ptr, pre_ptr, sizes,
                            int(accumulate), self.band_rows, gate_ptr)

    def parameters(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: Sizes,
                   accumulate: int, bias_ptr: int = 0, pre_ptr: int = 0, gate_ptr: int = 0):
        """The parameters of :meth:`launch` as a block of their own, to launch again as they are."""
        return self.launcher.parameters(stream_ptr, self.values(stream_ptr, act_ptr, other_ptr, out_ptr, sizes,
                                                                accumulate, bias_ptr, pre_ptr, gate_ptr))

    def scratch_for(self, stream_ptr: int) -> tuple:
        """Pointers to the tables and to this stream's workspace and counters (allocated once)."""
        entry = self.scratch.get(stream_ptr)
        if entry is None:
            entry = per_stream(self.scratch, stream_ptr, lambda: self._new_scratch(stream_ptr))
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

    def launch(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: Sizes,
               accumulate: int, bias_ptr: int = 0, pre_ptr: int = 0, gate_ptr: int = 0) -> None:
        # A new output array (each eager call's) changes no map the kernel reads where tiles
        # are not stored through TMA.
        out_key = out_ptr if self.out_box is not None else None
        self.launcher.launch(stream_ptr, *self.values(stream_ptr, act_ptr, other_ptr, out_ptr, sizes, accumulate,
                                                      bias_ptr, pre_ptr, gate_ptr),
                             map_key=(act_ptr, other_ptr, out_key, sizes),
                             make_maps=lambda: self.maps(act_ptr, other_ptr, out_ptr, sizes))

    def parameters(self, stream_ptr: int, act_ptr: int, other_ptr: int, out_ptr: int, sizes: Sizes,
                   accumulate: int, bias_ptr: int = 0, pre_ptr: int = 0, gate_ptr: int = 0):
        return self.launcher.parameters(stream_ptr, self.values(stream_ptr, act_ptr, other_ptr, out_ptr, sizes,
                                                                accumulate, bias_ptr, pre_ptr, gate_ptr),
                                        self.maps(act_ptr, other_ptr, out_ptr, sizes))

    def maps(self, act_ptr: int, other_ptr: int, out_ptr: int, sizes: tuple) -> tuple[bytes, bytes, bytes]:
        """The activation, other-operand and output tensor maps of a launch (``sizes`` as for
        :meth:`Plan.launch`). Only wgmma tiles
        are stored through TMA: mma.sync tiles and updat row groups get zeros for the output map."""
        n, ld_act, ld_other, ld_out, out_blocks = sizes
        bs = self.variant.block_size
        e = ELEMENT_BYTES[self.variant.dtype]
        if self.variant.feature_axis == 0:  # updat row groups: xᵀ and dyᵀ, N columns (past N: zeros)
            return (tensor_map(act_ptr, n, self.feature_rows[0], e * ld_act, *self.act_box, e),
                    tensor_map(other_ptr, n, self.feature_rows[1], e * ld_other, *self.other_box, e), _NO_MAP)
        act = tensor_map(act_ptr, ld_act, n, e * ld_act, *self.act_box, e)
        stored = self.out_box is not None
        if PASSES[self.variant.pass_name].updates_weights:
            dy = tensor_map(other_ptr, ld_other, n, e * ld_other, *self.other_box, e)
            return act, dy, tensor_map(out_ptr, bs, self.block_rows, e * bs, *self.out_box, e) if stored else _NO_MAP
        weights = tensor_map(other_ptr, bs, self.block_rows, e * bs, *self.other_box, e)
        return act, weights, tensor_map(out_ptr, out_blocks * bs, n, e * ld_out, *self.out_box, e) if stored else _NO_MAP


_NO_MAP = bytes(MAP_BYTES)  # a tensor-map parameter the kernel does not read


def device_traits(device) -> Device:
    """The planner's :class:`bsmm.backends.cuda.selection.Device` for a CuPy device; occupancy
    comes from the driver (loading the kernel)."""
    return Device(f"sm{device.compute_capability}", device.attributes["MultiProcessorCount"],
                  lambda variant: occupancy(load_kernel(variant, device.id), variant))


def build_plan(index: BlockIndex, pass_name: str, n: int, dtype: str, feature_axis: int, tf32: bool,
               aligned: bool, device, policy: Policy, act_blocks: tuple | None = None,
               weight_blocks: BlockOrder | None = None, act_transposed: bool = False, copied: str = "",
               epilogue: str = "store") -> Plan:
    """The plan of one kernel launch under ``policy``: :func:`bsmm.backends.cuda.planner.launch_layout`'s
    decisions and tables, uploaded to ``device``. ``copied``: what the caller transposes first
    (for :attr:`Plan.path`); ``epilogue``: how output tiles leave (:mod:`bsmm.epilogues`), which
    changes no decision of the planner."""
    traits = device_traits(device)
    layout = launch_layout(index, pass_name, n, dtype, feature_axis, tf32, aligned, traits, act_blocks,
                           weight_blocks, act_transposed, policy=policy)
    variant = layout.variant if epilogue == "store" else dataclasses.replace(layout.variant, epilogue=epilogue)
    kernel = load_kernel(variant, device.id)
    with device:
        return (TmaPlan if variant.tma else Plan)(
            variant=variant,
            launcher=Launcher(kernel, layout.grid, variant.threads, variant.shared_bytes,
                              map_count=3 if variant.tma else 0, serialized=policy.programmatic_on(traits.arch)),
            segments=cupy.asarray(layout.segments),
            units=cupy.asarray(layout.units),
            table=cupy.asarray(layout.table),
            workspace_floats=layout.workspace_floats,
            counter_count=layout.counter_count,
            band_rows=layout.band_rows,
            path=layout_path(pass_name, copied, layout, traits, policy),
            **layout.tma_fields,
        )


def occupancy(kernel, variant) -> int:
    """Thread blocks of ``variant`` one SM holds at once."""
    return max(1, cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
        kernel.kernel.ptr, variant.threads, variant.shared_bytes))

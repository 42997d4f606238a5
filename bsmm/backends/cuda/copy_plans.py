"""Plans that transpose an operand into a workspace before the pass: the launch of
``cuda/bsmm_transpose.cu`` and then a :class:`~bsmm.backends.cuda.plans.Plan` reading the copy.

:func:`bsmm.backends.cuda.selection.copies` decides which a pass takes; each has the launch
interface of :class:`~bsmm.backends.cuda.plans.Plan` and keeps its workspace per stream (CUDA
graphs capture its address).
"""

from __future__ import annotations

import dataclasses

import cupy
import numpy as np

from bsmm.block_index import BlockIndex
from bsmm.backends.cuda import plans
from bsmm.backends.cuda.kernels import ELEMENT_BYTES, BlockTransposeVariant, TransposeVariant, load_kernel
from bsmm.backends.cuda.params import Sizes
from bsmm.backends.cuda.plans import Launcher
from bsmm.backends.cuda.policy import Policy
from bsmm.backends.cuda.selection import copy_row_elements, transposed_layout
from bsmm.backends.cuda.workspaces import allocate_workspace, per_stream
from bsmm.passes import PASSES

__all__ = ["TransposedActivations", "TransposedUpdat", "TransposedWeightsFprop"]


def _serialized(device, policy: Policy) -> bool:
    return policy.programmatic_on(f"sm{device.compute_capability}")


def _transpose_launcher(item: int, ld: int, features: int, device, policy: Policy) -> Launcher:
    """A launch of ``transpose_tiles`` (``cuda/bsmm_transpose.cu``) turning an (N, features)
    operand of ``item``-byte elements into its (features, ld) copy."""
    tile = TransposeVariant.TILE
    return Launcher(load_kernel(TransposeVariant(item), device.id), (-(-ld // tile), -(-features // tile), 1),
                    TransposeVariant.threads, 0, 5, serialized=_serialized(device, policy))


class TransposedActivations:
    """fprop (bprop) on feature axis 1 through a transposed copy of x (dy): one launch of
    ``cuda/bsmm_transpose.cu`` into a workspace, then the pass reading that copy as on feature
    axis 0 and writing its output on axis 1 (``Variant.act_transposed``).

    At block 16 a row of the activations holds a block's features as one 32-byte segment, its
    own cache-line request, and those requests, not the bytes, bound the pass; in the copy every
    row of a tile is whole lines. Used for the block sizes of ``[kernels] act_transpose``,
    float16/bfloat16, batches of at least ``act_transpose_min_rows`` rows and where the copy,
    features x N elements (N rounded up to 16 bytes with zeros), fits
    ``act_transpose_max_bytes`` (:func:`bsmm.backends.cuda.selection.transposes_activations`); kept per stream
    like :class:`TransposedUpdat`'s. Same launch interface as :class:`Plan`.
    """

    def __init__(self, index: BlockIndex, pass_name: str, n: int, dtype: str, device, policy: Policy,
                 epilogue: str = "store"):
        self.n = n
        self.features = PASSES[pass_name].features(index.C, index.K)[0]
        item = ELEMENT_BYTES[dtype]
        self.ld = copy_row_elements(n, item)
        self.plan = plans.build_plan(index, pass_name, n, dtype, 0, False, True, device, policy, act_transposed=True,
                                     copied=PASSES[pass_name].operands[0], epilogue=epilogue)
        self.variant, self.path = self.plan.variant, self.plan.path
        self.transpose = _transpose_launcher(item, self.ld, self.features, device, policy)
        self.item = item
        self.workspaces: dict = {}  # stream -> the activations transposed

    def launch(self, stream_ptr: int, act_ptr: int, w_ptr: int, out_ptr: int, sizes: Sizes, accumulate: int,
               bias_ptr: int = 0, pre_ptr: int = 0, gate_ptr: int = 0) -> None:
        act_t, _ = per_stream(self.workspaces, stream_ptr, lambda: allocate_workspace(self.features * self.ld * self.item))
        self.transpose.launch(stream_ptr, act_ptr, act_t, self.n, self.features, self.ld)
        # The copy's rows are ld long.
        self.plan.launch(stream_ptr, act_t, w_ptr, out_ptr, sizes._replace(ld_act=self.ld), accumulate, bias_ptr,
                         pre_ptr, gate_ptr)


class TransposedUpdat:
    """updat on feature axis 1 through transposed copies of x and dy: two launches of
    ``cuda/bsmm_transpose.cu`` into a workspace, then the feature-axis-0 updat over them.

    At block 16 (32) a row of x or dy holds a block's features as one 32 (64)-byte segment,
    its own cache line, and those line requests, not the bytes, bound the pass; transposed,
    every row of a tile is whole lines (T, fp16: block 16 5-6 -> 9-10 % efficiency, block 32
    14-15 -> 15-18 %; ``results/archive/RESULTS.md``, v8). TF32 on Hopper takes it too, for its wgmma
    row groups, which read 32-bit operands K-major only (:func:`bsmm.backends.cuda.selection.transposes_updat`). Used for
    the block sizes listed in ``[kernels] updat_transpose``, batches of at least
    ``updat_transpose_min_rows`` rows and where the workspace, (C + K) x N elements (N
    rounded up to 16 bytes with zeros), fits ``updat_transpose_max_bytes``;
    the workspace is kept per stream, like a plan's (CUDA graphs capture its address).
    Same launch interface as :class:`Plan`.
    """

    def __init__(self, index: BlockIndex, n: int, dtype: str, device, policy: Policy, tf32: bool = False):
        self.n, self.C, self.K = n, index.C, index.K
        item = ELEMENT_BYTES[dtype]
        self.ld = copy_row_elements(n, item)
        self.plan = plans.build_plan(index, "updat", n, dtype, 0, tf32, True, device, policy, copied="x+dy")
        self.variant, self.path = self.plan.variant, self.plan.path
        self.transpose_x, self.transpose_dy = (_transpose_launcher(item, self.ld, features, device, policy)
                                               for features in (self.C, self.K))
        self.item = item
        self.workspaces: dict = {}  # stream -> (x transposed, dy transposed)

    def launch(self, stream_ptr: int, x_ptr: int, dy_ptr: int, out_ptr: int, sizes: Sizes, accumulate: int,
               bias_ptr: int = 0, pre_ptr: int = 0, gate_ptr: int = 0) -> None:
        (x_t, _), (dy_t, _) = per_stream(self.workspaces, stream_ptr, lambda: (
            allocate_workspace(self.C * self.ld * self.item), allocate_workspace(self.K * self.ld * self.item)))
        self.transpose_x.launch(stream_ptr, x_ptr, x_t, self.n, self.C, self.ld)
        self.transpose_dy.launch(stream_ptr, dy_ptr, dy_t, self.n, self.K, self.ld)
        self.plan.launch(stream_ptr, x_t, dy_t, out_ptr, Sizes(self.n, self.ld, self.ld, 0, 0), accumulate,
                         gate_ptr=gate_ptr)


class TransposedWeightsFprop:
    """TF32 fprop on Hopper as a bprop over the transposed layout: y = x·W is x·W'ᵀ, W' holding
    each block of W transposed, in the row-major order of the layout's transpose (its
    ``col_order``). TF32 wgmma reads 32-bit operands K-major only: bprop's weight rows are,
    fprop's are not. One launch of ``transpose_blocks`` (``cuda/bsmm_transpose.cu``) writes W'
    into a workspace of nnzb x block² floats, kept per stream like a plan's; then the transposed
    layout's bprop plan runs on W'. Used where that plan is a TF32 wgmma one
    (``[kernels.sm90.tma_tf32]``); same launch interface as :class:`Plan`.
    """

    def __init__(self, index: BlockIndex, n: int, device, policy: Policy, epilogue: str = "store"):
        self.index_t = transposed_layout(index)
        self.plan = plans.build_plan(self.index_t, "bprop", n, "float32", 1, True, True, device, policy, copied="w",
                                     epilogue=epilogue)
        self.variant, self.path = self.plan.variant, dataclasses.replace(self.plan.path, pass_name="fprop")
        self.order = cupy.asarray(index.col_order, dtype=np.int32)
        transpose = BlockTransposeVariant(index.block_size)
        self.transpose = Launcher(load_kernel(transpose, device.id), (index.nnzb, transpose.tiles, 1),
                                  transpose.threads, 0, 3, serialized=_serialized(device, policy))
        self.weight_count = index.nnzb * index.block_size ** 2
        self.workspaces: dict = {}  # stream -> W'

    def launch(self, stream_ptr: int, x_ptr: int, w_ptr: int, out_ptr: int, sizes: Sizes, accumulate: int,
               bias_ptr: int = 0, pre_ptr: int = 0, gate_ptr: int = 0) -> None:
        # The fprop's sizes are those of the transposed bprop (its K' is C, its C' is K). Gates are
        # not passed on: that plan's table holds W' positions, not the gates' blocks, and the
        # gated weights it multiplies already hold the closed blocks' zeros.
        w_t, _ = per_stream(self.workspaces, stream_ptr, lambda: allocate_workspace(4 * self.weight_count))
        self.transpose.launch(stream_ptr, w_ptr, w_t, self.order.data.ptr)
        self.plan.launch(stream_ptr, x_ptr, w_t, out_ptr, sizes, accumulate, bias_ptr, pre_ptr)

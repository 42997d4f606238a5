"""Geometry of :class:`bsmm.nn.conv.BlocksparseConv`: its spatial arguments and the index
arithmetic of an implicit GEMM over kernel offsets.

Pure Python on shapes, shared by the CPU and GPU paths (so the CPU tests check it).

The canvas
----------
The input (channels last, ``(N, S_1, ..., S_D, C)``) is zero-padded and, along every
spatial dimension but the last one, split by *phase* modulo its stride: padded
coordinate ``u_i`` goes to phase ``u_i % s_i``, plane ``u_i // s_i``. The last
dimension is only padded, to ``Wp`` columns, a multiple of its stride. The canvas
has shape ``(s_1, ..., s_{D-1}, N, M_1, ..., M_{D-1}, Wp, C)`` with phases outermost,
``M_i = ceil(P_i / s_i)`` planes of padded size ``P_i = S_i + 2 p_i``.

The grid
--------
Output element ``(n, o_1, ..., o_D)`` is row ``r`` of the *grid* ``(N, M_1, ...,
M_{D-1}, Wq)``, ``Wq = Wp / s_D``: a superset of the output ``(N, O_1, ..., O_D)``
(rows with some ``o_i >= O_i`` are computed and cropped away). For kernel offset
``(k_1, ..., k_D)`` output ``o`` reads padded input ``u_i = o_i s_i + k_i d_i``. With
``k_i d_i = q_i s_i + phi_i`` that is phase ``phi_i``, plane ``o_i + q_i`` for ``i < D``
and column ``o_D s_D + k_D d_D``, i.e. canvas element

    shift(k) + r · s_D · C

so every kernel offset reads rows of one flat canvas an affine step apart (the passes
of :mod:`bsmm.nn.conv_passes` read each offset's rows at its shift), and no im2col. Rows past the last output
``(N-1, O_1-1, ..., O_D-1)`` are never run, so the last row of every offset reads
an input element of the last image and no row leaves the canvas; rows of
cropped outputs read real (finite) input or zeros.

With no padding, no stride on the outer dimensions and ``S_D`` a multiple of
``s_D``, the canvas *is* the input (no copy); when the grid equals the output
(kernel = stride, "patchify" layers, or 1×1 kernels without padding) the result rows
are the output itself (no crop copy).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np

__all__ = ["ConvGeometry", "conv_geometry", "output_size", "padding_tuple", "spatial_tuple"]


def spatial_tuple(value, name: str, dims: int, minimum: int) -> tuple:
    """``value`` (int or sequence of ints) as a tuple of ``dims`` ints >= ``minimum``, or raise naming it.

    Examples
    --------
    >>> spatial_tuple(2, "stride", 3, 1)
    (2, 2, 2)
    >>> spatial_tuple((1, 0), "padding", 2, 0)
    (1, 0)
    """
    values = (value,) * dims if isinstance(value, (int, np.integer)) else value
    try:
        values = tuple(values)
    except TypeError:
        raise TypeError(f"{name} must be an int or a tuple of {dims} ints; got {value!r}") from None
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in values):
        raise TypeError(f"{name} must be an int or a tuple of {dims} ints; got {value!r}")
    if len(values) != dims:
        raise ValueError(f"{name} must have {dims} entries, one per spatial dimension of kernel_size; got {value!r}")
    if any(v < minimum for v in values):
        raise ValueError(f"{name} must be >= {minimum}; got {value!r}")
    return tuple(int(v) for v in values)


def padding_tuple(padding, kernel: tuple, stride: tuple, dilation: tuple) -> tuple:
    """Zeros on both sides of each spatial dimension for ``padding``: an int, a tuple, "valid" or "same".

    Examples
    --------
    >>> padding_tuple("same", kernel=(3, 5), stride=(1, 1), dilation=(1, 2))
    (1, 4)
    >>> padding_tuple("valid", kernel=(3, 3), stride=(2, 2), dilation=(1, 1))
    (0, 0)
    """
    if isinstance(padding, str):
        if padding == "valid":
            return (0,) * len(kernel)
        if padding != "same":
            raise ValueError(f"padding must be an int, a tuple, 'valid' or 'same'; got {padding!r}")
        if any(s != 1 for s in stride):
            raise ValueError(f"padding='same' needs stride 1; got stride {stride}")
        reach = [d * (k - 1) for k, d in zip(kernel, dilation)]
        if any(r % 2 for r in reach):
            raise NotImplementedError(
                f"padding='same' with an even dilated kernel ({reach} beyond one element) needs asymmetric "
                f"padding; pad the input yourself or pick an odd kernel"
            )
        return tuple(r // 2 for r in reach)
    return spatial_tuple(padding, "padding", len(kernel), 0)


def output_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """Output length of one spatial dimension (floor mode); < 1 when the kernel does not fit."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """Where every row of one convolution call lives; built by :func:`conv_geometry`.

    Attributes
    ----------
    batch : int
        ``N``.
    spatial, out : tuple of int
        Input spatial shape ``S`` and output spatial shape ``O``.
    grid : tuple of int
        ``(M_1, ..., M_{D-1}, Wq)``: the per-image grid the passes compute on, ``>= out``.
    canvas_shape : tuple of int
        ``(s_1, ..., s_{D-1}, N, M_1, ..., M_{D-1}, Wp, C)``.
    rows : int
        Grid rows each pass runs: up to the last output, ``0`` when ``N == 0``.
    row_stride : int
        Elements between the canvas rows of consecutive grid rows, ``s_D · C``.
    shifts : tuple of int
        Canvas element of grid row 0 for each kernel offset, offsets in C order.
    copies_input : bool
        The canvas differs from the channels-last input (padding, outer stride or
        a last dimension that is not a multiple of its stride).
    slices : tuple of (canvas index, input index) pairs
        Copying ``input[src]`` to ``canvas[dst]`` for each pair fills the canvas from
        a channels-last input view (and the reverse gathers an input gradient); each
        input element appears once.
    """

    batch: int
    spatial: tuple
    out: tuple
    grid: tuple
    canvas_shape: tuple
    rows: int
    row_stride: int
    shifts: tuple
    copies_input: bool
    slices: tuple

    @property
    def grid_is_output(self) -> bool:
        """Whether the grid rows are exactly the output rows (no crop)."""
        return self.grid == self.out

    @property
    def crop(self) -> tuple:
        """Index of the output inside a channels-last grid array ``(N, *grid, K)``."""
        return (slice(None),) + tuple(slice(0, o) for o in self.out) + (slice(None),)


def _phase_range(phase: int, size: int, stride: int, padding: int) -> tuple[slice, slice] | None:
    """(planes, input positions) of one phase of one outer dimension, or None if it holds no input."""
    first = (padding - phase + stride - 1) // stride  # first plane whose coordinate is >= padding
    last = (padding + size - 1 - phase) // stride
    if last < first:
        return None
    start = phase + stride * first - padding
    count = last - first + 1
    return slice(first, last + 1), slice(start, start + stride * (count - 1) + 1, stride)


@functools.lru_cache(maxsize=256)
def conv_geometry(batch: int, spatial: tuple, channels: int, kernel: tuple, stride: tuple, padding: tuple,
                  dilation: tuple) -> ConvGeometry:
    """The geometry of one convolution call; all tuples have one entry per spatial dimension.

    Cached (it is pure and a training step asks for the same few shapes again and again).

    Raises
    ------
    ValueError
        If the (dilated) kernel does not fit the padded input in some dimension.

    Examples
    --------
    >>> g = conv_geometry(2, (5, 6), 8, kernel=(3, 3), stride=(2, 2), padding=(1, 1), dilation=(1, 1))
    >>> g.out, g.grid, g.canvas_shape, g.rows, g.row_stride
    ((3, 3), (4, 4), (2, 2, 4, 8, 8), 27, 16)
    >>> g.shifts[:4]  # offsets (0, 0), (0, 1), (0, 2), (1, 0): phase 1 is 2*4*8*8 elements on
    (0, 8, 16, 512)
    """
    dims = len(spatial)
    out = tuple(output_size(*args) for args in zip(spatial, kernel, stride, padding, dilation))
    for axis, size in enumerate(out):
        if size < 1:
            raise ValueError(
                f"the input's spatial dimension {axis} has size {spatial[axis]}; with padding {padding[axis]} "
                f"it is smaller than the dilated kernel ({dilation[axis]} * ({kernel[axis]} - 1) + 1)"
            )
    padded = [s + 2 * p for s, p in zip(spatial, padding)]
    planes = [-(-p // s) for p, s in zip(padded[:-1], stride[:-1])]
    width_steps = -(-padded[-1] // stride[-1])
    width = width_steps * stride[-1]
    grid = tuple(planes) + (width_steps,)
    phases = tuple(stride[:-1])
    canvas_shape = phases + (batch,) + tuple(planes) + (width, channels)
    phase_size = math.prod(canvas_shape[dims - 1:])
    # Canvas rows (of C elements) between consecutive planes of each outer dimension.
    plane_rows = [math.prod(planes[i + 1:]) * width for i in range(dims - 1)]
    shifts = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        reach = [k * d for k, d in zip(offset, dilation)]
        phase = [r % s for r, s in zip(reach[:-1], stride[:-1])]
        phase_index = sum(p * math.prod(phases[i + 1:]) for i, p in enumerate(phase))
        row = sum((r // s) * n for r, s, n in zip(reach[:-1], stride[:-1], plane_rows)) + reach[-1]
        shifts.append(phase_index * phase_size + row * channels)
    rows = 0
    if batch:
        last = (batch - 1,) + tuple(o - 1 for o in out)
        dims_of_grid = (batch,) + grid
        rows = sum(i * math.prod(dims_of_grid[j + 1:]) for j, i in enumerate(last)) + 1
    slices = []
    for phase in itertools.product(*(range(s) for s in phases)):
        ranges = [_phase_range(p, size, s, pad) for p, size, s, pad in zip(phase, spatial, stride, padding)]
        if None in ranges:
            continue
        last_dim = slice(padding[-1], padding[-1] + spatial[-1])
        dst = phase + (slice(None),) + tuple(r[0] for r in ranges) + (last_dim, slice(None))
        src = (slice(None),) + tuple(r[1] for r in ranges) + (slice(None), slice(None))
        slices.append((dst, src))
    copies_input = any(padding) or any(s != 1 for s in phases) or width != spatial[-1]
    return ConvGeometry(batch, tuple(spatial), out, grid, canvas_shape, rows, stride[-1] * channels,
                        tuple(shifts), bool(copies_input), tuple(slices))

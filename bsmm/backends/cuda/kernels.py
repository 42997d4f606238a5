"""Compiling and loading bsmm's CUDA kernels at run time.

Kernel source lives in ``cuda/``. A *variant* (element type, block size, tile
shape, math mode, pass, feature axis, alignment) is one template instance of
``bsmm::bsmm_matmul`` (``bsmm_matmul_tma`` on Hopper, or of the convolution's row gather, :class:`GatherVariant`, or the
transpose of :class:`TransposeVariant`).
It is compiled with NVRTC (through CuPy's binding) for the exact architecture
of the device (``sm_80`` ... ``sm_90a``), the cubin is kept in a disk cache
keyed by source, options and NVRTC version, and loaded with ``cupy.RawModule``; loaded kernels are memoized per (device, variant).
The same :func:`compile_variant` runs in CI, where there is no GPU, so CI
compiles exactly what the library runs.

Element types are those of :data:`bsmm.dtypes.ELEMENT_TYPES` that have a GPU kernel:

>>> C_TYPES
{'float32': 'float', 'float16': '__half', 'bfloat16': '__nv_bfloat16'}
>>> ELEMENT_BYTES
{'float32': 4, 'float16': 2, 'bfloat16': 2}
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from bsmm.config import CUDA_DIR, cache_dir
from bsmm.dtypes import ELEMENT_TYPES
from bsmm.backends.cuda.policy import Tile
from bsmm.epilogues import ACTIVATIONS, EPILOGUES
from bsmm.passes import PASSES

__all__ = ["Variant", "tiling_problem", "static_shared_bytes", "GatherVariant", "TransposeVariant", "LstmCellVariant", "GatedUnitVariant", "compile_variant", "load_kernel", "arch_for", "cuda_include_dirs", "compile_options", "variant_name"]

_log = logging.getLogger(__name__)

SOURCE_FILE = "bsmm_matmul.cu"
#: ``Variant.math`` -> the kernel template's ``bsmm::Math`` enumerator (cuda/bsmm_kernel_traits.cuh).
MATH_ENUMS = {"simt": "bsmm::Math::Simt", "tensor16": "bsmm::Math::Tensor16", "tf32": "bsmm::Math::Tf32",
              "wgmma16": "bsmm::Math::Wgmma", "wgmma_tf32": "bsmm::Math::Wgmma"}  # (wgmma on float: TF32)
#: Math modes whose instructions exist only on one architecture (compiled for it alone);
#: TMA variants (``Variant.tma``) are built for sm_90a only as well.
ARCH_ONLY_MODES = {"wgmma16": "sm_90a", "wgmma_tf32": "sm_90a"}
#: ``Variant.pass_name`` -> the kernel template's ``bsmm::Pass`` enumerator.
PASS_ENUMS = {"fprop": "bsmm::Pass::Fprop", "bprop": "bsmm::Pass::Bprop", "updat": "bsmm::Pass::Updat"}
#: ``Variant.feature_axis`` (any axis but 1 reads as 0), or ``"act_transposed"`` where that is set,
#: -> the kernel template's ``bsmm::FeatureAxis`` enumerator.
FEATURE_AXIS_ENUMS = {0: "bsmm::FeatureAxis::Axis0", 1: "bsmm::FeatureAxis::Axis1",
                      "act_transposed": "bsmm::FeatureAxis::TransposedActivations"}
#: Longest part of a block column (row) one thread block takes; its step-table slice is staged in
#: shared memory (8 bytes an entry). Passed to NVRTC, so host and kernel agree.
MAX_PART_BLOCKS = 256
#: dtype name -> the kernel templates' element type, and -> bytes an element, for the dtypes
#: with a GPU kernel; both read from :data:`bsmm.dtypes.ELEMENT_TYPES`.
C_TYPES: dict[str, str] = {name: t.c_type for name, t in ELEMENT_TYPES.items() if not t.cpu_only}
ELEMENT_BYTES: dict[str, int] = {name: t.element_bytes for name, t in ELEMENT_TYPES.items() if not t.cpu_only}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled instance of the kernel template: everything fixed at compile time."""

    dtype: str  # a name of C_TYPES: "float32", "float16", "bfloat16"
    block_size: int
    tile: Tile  # BM, BN, BK, WARPS_M, WARPS_N, STAGES (six numbers are taken as a Tile)
    math: str  # "simt", "tensor16", "tf32", "wgmma16" or "wgmma_tf32" (sm_90a)
    pass_name: str  # "fprop", "bprop", "updat"
    feature_axis: int
    aligned: bool  # 16-byte vector copies are legal for every operand
    grouped: bool = False  # updat only: a thread block streams a group of blocks, whole batch per step
    # fprop/bprop: block columns (rows) per output tile, stepping over their union; updat: blocks of a row group
    cols: int = 1
    # ``bsmm_matmul_tma`` (sm_90a): stages filled by TMA from a copy warp (one more warp than the
    # tile's), three tensor maps passed by value after the 14 common parameters; wgmma16 passes
    # (with cols > 1: column groups, or updat row groups computed transposed), or tensor16
    # fprop/bprop one block a step (small batches).
    tma: bool = False
    # fprop/bprop (cp.async kernel): the activations come from a transposed copy, read as on
    # feature axis 0 (``feature_axis`` is then 0), and the output is written on feature axis 1
    # (``plans.TransposedActivations``).
    act_transposed: bool = False
    # What fprop/bprop tiles do on the way out: a name of bsmm.epilogues.EPILOGUES ("store": the
    # sums as they are; an activation's name: BiasAct of it). updat stores.
    epilogue: str = "store"

    source_file = SOURCE_FILE

    def __post_init__(self):
        object.__setattr__(self, "tile", Tile.of(self.tile))
        if self.epilogue not in EPILOGUES or (self.epilogue != "store" and PASSES[self.pass_name].updates_weights):
            raise ValueError(f"epilogue must be one of {sorted(EPILOGUES)} (updat: 'store'); got {self.epilogue!r}")

    @property
    def threads(self) -> int:
        return self.tile.warps_m * self.tile.warps_n * 32 + (32 if self.tma else 0)

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory: the cp.async pipeline's stages (mirrors Kernel::SMEM_BYTES)."""
        bm, bn, bk, stages = self.tile.bm, self.tile.bn, self.tile.bk, self.tile.stages
        item = ELEMENT_BYTES[self.dtype]
        if self.math == "wgmma16" or self.tma:  # swizzled, unpadded stages + 1 KiB to align them
            return stages * (bm * bk + bk * bn) * item + 1024
        vec = 16 // item
        the_pass = PASSES[self.pass_name]
        a_kmajor = (self.feature_axis == 0) if the_pass.updates_weights else (self.feature_axis == 1)
        b_kmajor = (self.feature_axis == 0) if the_pass.updates_weights else the_pass.reads_weights_transposed
        a = (bm * (bk + vec)) if a_kmajor else (bk * (bm + vec))
        b = (bn * (bk + vec)) if b_kmajor else (bk * (bn + vec))
        staging = bm * (bn + 4) * 4 if self.grouped and self.math != "simt" else 0  # finished tiles, as floats
        return stages * (a + b) * item + staging

    @property
    def name_expression(self) -> str:
        """The template instance NVRTC compiles, its math, pass and feature axis as enumerators:

        >>> Variant("float16", 32, (64, 32, 32, 2, 2, 3), "tensor16", "updat", 1, True).name_expression
        'bsmm::bsmm_matmul<__half, 32, 64, 32, 32, 2, 2, 3, bsmm::Math::Tensor16, bsmm::Pass::Updat, bsmm::FeatureAxis::Axis1, 1, 0, 1, bsmm::Store>'
        >>> Variant("float16", 32, (64, 32, 32, 2, 2, 3), "tensor16", "fprop", 1, True, epilogue="gelu").name_expression[-31:]
        'bsmm::BiasAct<bsmm::Act::Gelu>>'
        >>> Variant("float16", 16, (256, 16, 16, 8, 1, 6), "tensor16", "fprop", 0, True,
        ...         act_transposed=True).name_expression.split(", ")[8:11]
        ['bsmm::Math::Tensor16', 'bsmm::Pass::Fprop', 'bsmm::FeatureAxis::TransposedActivations']
        """
        bm, bn, bk, wm, wn, stages = self.tile.as_list()
        axis = FEATURE_AXIS_ENUMS["act_transposed" if self.act_transposed else int(self.feature_axis == 1)]
        return (
            f"bsmm::bsmm_matmul{'_tma' if self.tma else ''}<{C_TYPES[self.dtype]}, {self.block_size}, {bm}, {bn}, {bk}, {wm}, {wn}, {stages}, "
            f"{MATH_ENUMS[self.math]}, {PASS_ENUMS[self.pass_name]}, {axis}, "
            f"{int(self.aligned)}, "
            f"{int(self.grouped)}, {self.cols}, {EPILOGUES[self.epilogue]}>"
        )


def static_shared_bytes(variant: Variant) -> int:
    """Static shared memory beside a variant's stages: the staged step table and the groups' entries."""
    steps = (MAX_PART_BLOCKS + 8) * (variant.cols + 1) * 4 if variant.cols > 1 else 0
    return MAX_PART_BLOCKS * 8 + steps + 256


def tiling_problem(variant: Variant, max_shared: int | None = None) -> str:
    """Why the kernel template cannot build ``variant``'s tile, or ``""`` where it can: the
    tiling rules of ``Kernel`` in ``cuda/bsmm_kernel_traits.cuh`` (whose static_asserts NVRTC
    checks), and, given ``max_shared``, the device's shared memory a thread block. The planner
    checks every tile it selects, CI's compile check every variant it builds, and ``bsmm tune``
    every candidate.

    >>> tiling_problem(Variant("float16", 64, (128, 64, 64, 8, 1, 4), "wgmma16", "fprop", 1, True, tma=True))
    ''
    >>> tiling_problem(Variant("float16", 64, (128, 64, 60, 4, 1, 4), "tensor16", "fprop", 1, True))
    'tiles must be whole 16-byte chunks'
    """
    tile, item = variant.tile, ELEMENT_BYTES[variant.dtype]
    bm, bn, bk, wm, wn, stages = tile.bm, tile.bn, tile.bk, tile.warps_m, tile.warps_n, tile.stages
    vec = 16 // item
    wgmma = variant.math.startswith("wgmma")
    if min(tile.as_list()) < 1 or not 2 <= stages <= 8 or variant.threads > 1024:
        return "sizes at least 1, 2 to 8 stages, at most 1024 threads"
    if bk % vec or bm % vec or bn % vec:
        return "tiles must be whole 16-byte chunks"
    if max_shared is not None and variant.shared_bytes + static_shared_bytes(variant) > max_shared:
        return f"needs more than the device's {max_shared} bytes of shared memory"
    groups, updat = variant.cols > 1, PASSES[variant.pass_name].updates_weights
    if wgmma and groups and updat and (bm != variant.cols * variant.block_size or bn != variant.block_size):
        return "transposed row groups hold the group's blocks in M"
    whole_blocks = bm == variant.block_size if updat else bk == variant.block_size
    if groups and not wgmma and (wn != variant.cols or not whole_blocks):
        return "groups take a warp column a block and whole blocks a step"
    if wgmma:
        column_groups = groups and not updat
        depth_ok = bk % variant.block_size == 0 if column_groups else bk * item == 128
        three_stages = stages >= 3 or variant.tma  # cp.async wgmma: one in flight, one read, one filling
        stored_fits = not variant.tma or bm * bn <= stages * (bm * bk + bk * bn)
        fits = bm % 64 == 0 and wn == 1 and wm * 16 == bm and depth_ok and three_stages and stored_fits
        return "" if fits else "wgmma tiles: 64-row warpgroups in one column, 128-byte rows, 3 stages"
    if bm % wm or bn % wn:
        return "warps must divide the tile"
    if variant.math == "simt":
        nt = wm * wn * 32
        tx0 = min(bn // 4, 16)
        tx = nt // bm if tx0 * bm < nt else tx0
        if tx == 0 or nt % tx:
            return "simt threads must tile the output"
        ty = nt // tx
        fits = bk % 4 == 0 and tx <= bn and bm % ty == 0 and bn % tx == 0
        return "" if fits else "simt threads must tile the output"
    wtm, wtn = bm // wm, bn // wn
    depth = 16 if variant.math == "tensor16" else 8
    if variant.tma:  # mma.sync on TMA's 64-byte swizzled rows
        fits = wtm % 16 == 0 and wtn % 8 == 0 and bk * item == 64 and bn * item == 64
        return "" if fits else "mma.sync on TMA: 64-byte rows, warp tiles of 16 x 8"
    fits = wtm % 16 == 0 and wtn % 8 == 0 and bk % depth == 0
    return "" if fits else "mma.sync warp tiles of 16 x 8, depth a whole MMA"


#: Access units of the row gather, by bytes.
GATHER_UNITS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short"}


@dataclasses.dataclass(frozen=True)
class GatherVariant:
    """One instance of ``bsmm::gather_rows`` (``cuda/bsmm_gather_rows.cu``): rows moved in
    units of ``unit_bytes`` (16 where the row width and both pointers allow it)."""

    unit_bytes: int
    source_file = "bsmm_gather_rows.cu"
    math = "copy"
    shared_bytes = 0

    @property
    def name_expression(self) -> str:
        return f"bsmm::gather_rows<{GATHER_UNITS[self.unit_bytes]}>"


@dataclasses.dataclass(frozen=True)
class TransposeVariant:
    """``bsmm::transpose_tiles`` (``cuda/bsmm_transpose.cu``) over elements of ``element_bytes``:
    the transposed copies of x and dy that updat reads on feature axis 1 (half precision at
    blocks 16 and 32, TF32 on Hopper)."""

    element_bytes: int = 2
    source_file = "bsmm_transpose.cu"
    math = "copy"
    shared_bytes = 0
    threads = 256
    TILE = 64  # rows and columns of the matrix per thread block

    @property
    def name_expression(self) -> str:
        return f"bsmm::transpose_tiles<{'unsigned short' if self.element_bytes == 2 else 'unsigned int'}>"


@dataclasses.dataclass(frozen=True)
class BlockTransposeVariant:
    """``bsmm::transpose_blocks`` (``cuda/bsmm_transpose.cu``): float weight blocks transposed and
    reordered for the TF32 fprop that runs as a bprop over the transposed layout."""

    block_size: int
    source_file = "bsmm_transpose.cu"
    math = "copy"
    shared_bytes = 0
    threads = 256

    @property
    def tiles(self) -> int:
        """Thread blocks per weight block (32 x 32 sub-tiles, or the whole block below 32)."""
        return max(1, self.block_size // 32) ** 2

    @property
    def name_expression(self) -> str:
        return f"bsmm::transpose_blocks<{self.block_size}>"


class _ElementwiseVariant:
    """What the element-wise kernels' variants share: no shared memory, no tile; ``direction``
    "forward" or "backward", each with ``ARGS[direction]`` parameters of 8 bytes."""

    math = "elementwise"
    shared_bytes = 0


@dataclasses.dataclass(frozen=True)
class LstmCellVariant(_ElementwiseVariant):
    """``bsmm::lstm_cell_forward`` or ``lstm_cell_backward`` (``cuda/bsmm_lstm_cell.cu``): one LSTM
    step's element-wise math, reading and writing the passes' ``dtype`` (float32 inside)."""

    dtype: str
    direction: str
    source_file = "bsmm_lstm_cell.cu"
    threads = 128
    #: Parameters, 8 bytes each, of each direction.
    ARGS = {"forward": 9, "backward": 10}

    def __post_init__(self):
        if self.dtype not in C_TYPES or self.direction not in self.ARGS:
            raise ValueError(f"LstmCellVariant: dtype one of {sorted(C_TYPES)} and direction 'forward' or "
                             f"'backward'; got {self.dtype!r}, {self.direction!r}")

    @property
    def name_expression(self) -> str:
        """The template instance NVRTC compiles:

        >>> LstmCellVariant("bfloat16", "backward").name_expression
        'bsmm::lstm_cell_backward<__nv_bfloat16>'
        """
        return f"bsmm::lstm_cell_{self.direction}<{C_TYPES[self.dtype]}>"


@dataclasses.dataclass(frozen=True)
class GatedUnitVariant(_ElementwiseVariant):
    """``bsmm::gated_unit_forward`` or ``gated_unit_backward`` (``cuda/bsmm_gated_unit.cu``): a GLU's
    ``A(g)·u`` over a ``[gate | up]`` product and its backward, in ``dtype`` (float32 inside)."""

    dtype: str
    activation: str  # one of NAMES
    direction: str
    source_file = "bsmm_gated_unit.cu"
    threads = 256
    ARGS = {"forward": 3, "backward": 4}
    #: The activations a gated unit takes.
    NAMES = ("relu", "gelu", "gelu_tanh", "silu")

    def __post_init__(self):
        if self.dtype not in C_TYPES or self.direction not in self.ARGS or self.activation not in self.NAMES:
            raise ValueError(f"GatedUnitVariant: dtype one of {sorted(C_TYPES)}, activation one of "
                             f"{list(self.NAMES)} and direction 'forward' or 'backward'; got {self.dtype!r}, "
                             f"{self.activation!r}, {self.direction!r}")

    @property
    def name_expression(self) -> str:
        """The template instance NVRTC compiles:

        >>> GatedUnitVariant("bfloat16", "silu", "forward").name_expression
        'bsmm::gated_unit_forward<__nv_bfloat16, bsmm::Act::Silu>'
        """
        return (f"bsmm::gated_unit_{self.direction}<{C_TYPES[self.dtype]}, "
                f"bsmm::Act::{ACTIVATIONS[self.activation].cuda}>")


def variant_name(variant: Variant | GatherVariant | TransposeVariant | BlockTransposeVariant) -> str:
    """A variant as log lines name it: a :class:`Variant`'s pass, dtype, block size, math and tile
    (then what differs from the usual: feature axis 0, unaligned, streamed, groups, TMA), else
    its template instance.

    >>> variant_name(Variant("float16", 32, (64, 32, 32, 2, 2, 3), "tensor16", "updat", 1, True, cols=4, tma=True))
    'updat float16 block 32 tensor16 tile 64x32x32 warps 2x2 stages 3, groups of 4, TMA'
    >>> variant_name(GatherVariant(16))
    'bsmm::gather_rows<uint4>'
    """
    if not isinstance(variant, Variant):
        return variant.name_expression
    tile = variant.tile
    notes = [text for text, shown in (
        ("transposed activations" if variant.act_transposed else "feature axis 0", variant.feature_axis != 1),
        ("unaligned", not variant.aligned), ("streamed", variant.grouped),
        (f"groups of {variant.cols}", variant.cols > 1), ("TMA", variant.tma),
        (f"epilogue {variant.epilogue}", variant.epilogue != "store")) if shown]
    return ", ".join([f"{variant.pass_name} {variant.dtype} block {variant.block_size} {variant.math} tile "
                      f"{tile.bm}x{tile.bn}x{tile.bk} warps {tile.warps_m}x{tile.warps_n} stages {tile.stages}",
                      *notes])


def arch_for(compute_capability: str | int) -> str:
    """NVRTC's -arch for a device: sm_90a on Hopper (wgmma, setmaxnreg), sm_XY elsewhere."""
    cc = int(compute_capability)
    if cc < 80:
        raise RuntimeError(
            f"bsmm's kernels need compute capability 8.0 or newer (A100, L4/RTX 40xx, H100); "
            f"this GPU is {cc // 10}.{cc % 10}"
        )
    return "sm_90a" if cc == 90 else f"sm_{cc}"


@functools.cache
def cuda_include_dirs() -> tuple[str, ...]:
    """Directories holding cuda_fp16.h and friends: the NVIDIA wheels, else the toolkit; the headers
    of NVRTC's own CUDA major version first (an environment may hold both wheels' folders)."""
    from cupy_backends.cuda.libs import nvrtc

    wheel_dirs = {13: ("nvidia/cu13/include",), 12: ("nvidia/cuda_runtime/include", "nvidia/cu12/include")}
    major = nvrtc.getVersion()[0]
    subs = (*wheel_dirs.get(major, ()), *(d for m, dirs in wheel_dirs.items() if m != major for d in dirs))
    found = []
    for entry in sys.path:
        for sub in subs:
            candidate = Path(entry) / sub
            if (candidate / "cuda_fp16.h").is_file():
                found.append(str(candidate))
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_fp16.h").is_file():
            found.append(str(Path(root) / "include"))
    if not found:
        raise RuntimeError(
            "CUDA headers (cuda_fp16.h) not found: install the nvidia-cuda-runtime wheel "
            "(pip install 'bsmm[cuda12]' or 'bsmm[cuda13]', the one of your driver's CUDA) or set CUDA_PATH"
        )
    return tuple(dict.fromkeys(found))[:1]


def compile_options(arch: str) -> tuple[str, ...]:
    """NVRTC options, identical at run time and in CI's compile check."""
    includes = tuple(f"-I{d}" for d in (str(CUDA_DIR), *cuda_include_dirs()))
    extra = tuple(os.environ.get("BSMM_NVRTC_OPTIONS", "").split())  # e.g. -lineinfo for profiling
    return ("-std=c++17", f"-arch={arch}", "-DNDEBUG", f"-DBSMM_MAX_PART={MAX_PART_BLOCKS}", "-Xptxas=-v",
            *includes, *extra)


def _source(source_file: str) -> str:
    # UTF-8 whatever the locale: NVRTC 12.4 changes the process's locale at its first compile.
    return (CUDA_DIR / source_file).read_text(encoding="utf-8")


def _source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(CUDA_DIR.glob("*.cu*")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def compile_variant(variant: Variant | GatherVariant | TransposeVariant, arch: str) -> tuple[bytes, str, str]:
    """Compile one variant with NVRTC: (cubin, lowered kernel name, compiler log). Needs no GPU."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(_source(variant.source_file), variant.source_file, [], [])
    try:
        nvrtc.addNameExpression(program, variant.name_expression)
        try:
            nvrtc.compileProgram(program, list(compile_options(arch)))
        except nvrtc.NVRTCError as error:
            raise RuntimeError(
                f"NVRTC failed on {variant} for {arch}:\n{nvrtc.getProgramLog(program)}"
            ) from error
        return nvrtc.getCUBIN(program), nvrtc.getLoweredName(program, variant.name_expression), nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


def _cache_dir() -> Path:
    path = cache_dir() / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cached_cubin(variant: Variant | GatherVariant | TransposeVariant, arch: str) -> tuple[Path, str]:
    """The variant's cubin file in the disk cache, compiling it on a miss."""
    from cupy_backends.cuda.libs import nvrtc

    key = hashlib.sha256(
        json.dumps([_source_digest(), variant.name_expression, compile_options(arch), nvrtc.getVersion()]).encode()
    ).hexdigest()[:32]
    cubin_path, meta_path = _cache_dir() / f"{key}.cubin", _cache_dir() / f"{key}.json"
    if cubin_path.is_file() and meta_path.is_file():
        _log.debug("kernel %s for %s from the disk cache (%s)", variant_name(variant), arch, cubin_path)
        return cubin_path, json.loads(meta_path.read_text())["lowered_name"]
    start = time.perf_counter()
    cubin, lowered, log = compile_variant(variant, arch)
    _log.info("compiled kernel %s for %s in %.2f s (kept in %s)", variant_name(variant), arch,
              time.perf_counter() - start, cubin_path.parent)
    tmp = cubin_path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(cubin)
    os.replace(tmp, cubin_path)  # atomic: concurrent processes never see half a file
    meta_path.write_text(json.dumps({"lowered_name": lowered, "variant": repr(variant), "arch": arch, "log": log}))
    return cubin_path, lowered


_LOADED: dict = {}
_LOAD_LOCK = threading.Lock()


def load_kernel(variant: Variant | GatherVariant | TransposeVariant, device_id: int):
    """The loaded kernel for ``variant`` on ``device_id``, compiled or read from cache once."""
    key = (device_id, variant)
    kernel = _LOADED.get(key)
    if kernel is not None:
        return kernel
    import cupy

    with _LOAD_LOCK:
        kernel = _LOADED.get(key)
        if kernel is None:
            with cupy.cuda.Device(device_id) as device:
                arch = arch_for(device.compute_capability)
                cubin_path, lowered = _cached_cubin(variant, arch)
                kernel = cupy.RawModule(path=str(cubin_path)).get_function(lowered)
                # Always opt in: static shared memory (the staged step table) counts against the
                # 48 KiB default together with the dynamic stages.
                kernel.max_dynamic_shared_size_bytes = variant.shared_bytes
            _LOADED[key] = kernel
    return kernel

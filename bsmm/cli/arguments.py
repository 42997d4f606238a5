"""The command line's arguments: their types, the checks after parsing, and the parser with its help.

Every argument is checked before any work starts: a bad one ends the command with one line on
stderr that names it (``bsmm bench: error: argument --C: ...``) and exit status 2; a check after
parsing raises :class:`Refused`, which :func:`bsmm.cli.main.main` turns into that line.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from bsmm.cli.bench import SPREAD_LIMIT
from bsmm.cli.bench_gpu import WORKLOADS, gpu_plan
from bsmm.cli.framework_bench import SHAPES
from bsmm.cli.model_bench import LSTM_GRID
from bsmm.config import settings
from bsmm.dtypes import CPU_ONLY_DTYPES, GPU_KINDS, KIND_DTYPES
from bsmm.passes import PASS_NAMES

#: What to install for the GPU backend, in messages where it is missing.
_INSTALL_GPU = "pip install 'bsmm[cuda12]' (CUDA 12 driver) or 'bsmm[cuda13]' (CUDA 13 driver)"
#: The dtypes of the CPU bench: those NumPy's dense product runs through BLAS.
_CPU_BENCH_DTYPES = ("float32", "float64")
#: What the workloads stand for, in --help.
_WORKLOAD_WORDS = {"S": "the seed's shape", "T": "a training batch", "I": "an inference batch",
                   "F": "a transformer's feed-forward pair", "D": "decoding, a few rows"}
#: --framework name -> (the module it needs, the extra that installs it).
_FRAMEWORK_MODULES = {"torch": ("torch", "torch"), "jax": ("jax", "jax"), "cupy": ("cupy", "cuda12")}


def gpu_problem() -> str | None:
    """None where CuPy runs on a CUDA GPU here, else why not and what to install.

    Examples
    --------
    >>> problem = gpu_problem()  # e.g. "CuPy is not installed: pip install 'bsmm[cuda12]' ..."
    >>> backend = "gpu" if problem is None else "cpu"  # as bench --backend auto picks
    >>> backend in ("gpu", "cpu")
    True
    """
    try:
        import cupy
    except ImportError:
        return f"CuPy is not installed: {_INSTALL_GPU}"
    except Exception as error:  # noqa: BLE001 - a CuPy that fails to load is reported, not raised
        return f"CuPy does not load ({type(error).__name__}: {error})"
    from bsmm.backends.cuda.environment import check_environment

    try:
        check_environment()  # a CuPy newer than the driver: its message names the extra to install
    except RuntimeError as error:
        return str(error)
    try:
        if cupy.cuda.is_available():
            return None
    except Exception:  # noqa: BLE001 - a broken driver counts as no GPU
        pass
    return "CuPy finds no CUDA GPU here (nvidia-smi lists the GPUs and the driver's CUDA version)"


class Refused(Exception):
    """An argument refused after parsing (it depends on another, or on the machine)."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with every error one line on stderr (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help that gives each option's default, and the epilog's lines as written."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (action.option_strings and default is not None and default is not False and default != argparse.SUPPRESS
                and "%(default)" not in text):
            text += " (default: %(default)s)"
        return text


# ---- argument types: each raises ArgumentTypeError, which argparse prefixes with the argument --------
def _items(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if "" in items:
        raise argparse.ArgumentTypeError(f"{text!r} has an empty item; expected values separated by commas")
    return items


def _count(text: str) -> int:
    """A whole number above 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0; got {value}")
    return value


def _counts(text: str) -> tuple[int, ...]:
    return tuple(_count(item) for item in _items(text))


def _margin(text: str) -> float:
    """A percentage in [0, 100)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage in [0, 100); got {text!r}") from None
    if not 0 <= value < 100:
        raise argparse.ArgumentTypeError(f"expected a percentage in [0, 100); got {text}")
    return value


def _percentages(text: str) -> tuple[float, ...]:
    """Comma-separated percentages in (0, 100], as fractions: "50,2.5" -> (0.5, 0.025)."""
    found = []
    for item in _items(text):
        try:
            value = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a number; expected percentages of present blocks in (0, 100], e.g. 50,10") from None
        if not 0 < value <= 100:  # NaN fails this too
            raise argparse.ArgumentTypeError(f"{item} is outside (0, 100]; expected percentages of present blocks")
        found.append(value / 100)
    return tuple(found)


def _block_sizes(text: str) -> tuple[int, ...]:
    """Comma-separated block sizes bsmm has kernels for."""
    allowed = tuple(settings()["limits"]["block_sizes"])
    found = []
    for item in _items(text):
        if not item.isdigit() or int(item) not in allowed:
            raise argparse.ArgumentTypeError(f"{item} is not a block size bsmm has kernels for; expected "
                                             f"{', '.join(map(str, allowed))}")
        found.append(int(item))
    return tuple(found)


def _names(allowed, cpu_only=()):
    """An argument type of comma-separated names from ``allowed``; one of ``cpu_only`` is refused
    as running on the CPU backend only."""

    def parse(text: str) -> tuple[str, ...]:
        items = _items(text)
        for item in items:
            if item in cpu_only:
                raise argparse.ArgumentTypeError(f"{item} runs on the CPU backend only; expected some of "
                                                 f"{', '.join(allowed)}")
            if item not in allowed:
                raise argparse.ArgumentTypeError(f"{item!r} is not one of {', '.join(allowed)}")
        return tuple(items)

    return parse


def _output_path(text: str) -> str:
    """A file to write, in a folder that exists (checked now, not after the run)."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"no folder {folder} to write {text} in")
    return text


def _image_path(text: str) -> str:
    """An image file to draw, which needs matplotlib (checked now, not after the run)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("drawing needs matplotlib: pip install matplotlib")
    return _output_path(text)


# ---- checks after parsing ----------------------------------------------------------------------
def _given(args, dest: str) -> bool:
    return getattr(args, dest) not in (None, False)


def _multiple(flag: str, value: int, block_size: int) -> None:
    if value % block_size:
        near = " or ".join(str(v) for v in (value // block_size * block_size, (value // block_size + 1) * block_size)
                           if v)
        raise Refused(f"{flag} {value}: expected a multiple of the block size {block_size} (e.g. {near})")


def _some_blocks(C: int, K: int, block_size: int, densities) -> None:
    blocks = (C // block_size) * (K // block_size)
    for density in densities:
        if round(density * blocks) == 0:
            raise Refused(f"--densities {density * 100:g}: a {C // block_size} x {K // block_size} block layout "
                           "holds no block at that density; raise it, or --C and --K")


#: --model name -> (the flags it takes beyond --densities and --dtype, what it compares with).
_MODELS = {"lstm": (("hidden", "batch", "steps"), "bsmm.torch.BlockSparseLSTM against cuDNN"),
           "transformer": (("block_size",), "a Llama-shaped decoder with block-sparse MLPs against the dense one")}


def _check_bench_model(args) -> None:
    """``--model lstm`` (its grid: --hidden, --batch, --steps) or ``--model transformer`` (--block-size),
    with --densities and --dtype, on a GPU with PyTorch."""
    takes, what = _MODELS[args.model]
    for dest in ("framework", "N", "C", "K", "repeats", "quick", "block_size", "plot", "workloads", "hidden", "batch",
                 "steps"):
        if dest not in takes and _given(args, dest):
            flags = ", ".join(f"--{d.replace('_', '-')}" for d in (*takes, "densities", "dtype"))
            raise Refused(f"--{dest.replace('_', '-')} does not apply with --model {args.model} (it times {what} "
                           f"over {flags})")
    if args.backend == "cpu":
        raise Refused("--backend cpu does not apply with --model (it times models on the GPU)")
    problem = gpu_problem()
    if problem:
        raise Refused(f"--model needs a CUDA GPU: {problem}")
    if importlib.util.find_spec("torch") is None:
        raise Refused(f"--model {args.model} times {what}: PyTorch is not installed: pip install 'bsmm[torch]'")
    cpu_only = [d for d in args.dtype or () if d in CPU_ONLY_DTYPES]
    if cpu_only:
        raise Refused(f"--dtype {','.join(cpu_only)}: the models run {', '.join(GPU_KINDS)} on the GPU")
    if args.model == "transformer":
        args.densities = args.densities or (0.1, 0.25)
        args.block_size = args.block_size or (64, 128)
        args.dtype = args.dtype or ("bfloat16",)
        if len(args.dtype) > 1:
            raise Refused(f"--dtype {','.join(args.dtype)}: --model transformer takes one dtype")
        return
    block = LSTM_GRID["block_size"]
    for hidden in args.hidden or ():
        _multiple("--hidden", hidden, block)
    args.hidden = args.hidden or LSTM_GRID["hidden"]
    args.batch = args.batch or LSTM_GRID["batch"]
    args.densities = args.densities or LSTM_GRID["densities"]
    args.dtype = args.dtype or LSTM_GRID["dtypes"]
    args.steps = args.steps or LSTM_GRID["steps"]
    for hidden in args.hidden:
        _some_blocks(hidden, hidden, block, args.densities)


def _check_bench(args) -> None:
    """Refuses what the bench cannot run, and fills in the defaults of the mode it runs in."""
    if args.model:
        _check_bench_model(args)
        return
    if args.framework:
        if args.backend == "cpu":
            raise Refused("--backend cpu does not apply with --framework (it times layers on the GPU)")
        for dest in ("N", "C", "K", "repeats", "quick", "block_size", "densities", "dtype", "plot", "hidden", "batch",
                     "steps"):
            if _given(args, dest):
                raise Refused(f"--{dest.replace('_', '-')} does not apply with --framework (it times the "
                               f"shapes of its workloads, {', '.join(SHAPES)})")
        problem = gpu_problem()
        if problem:
            raise Refused(f"--framework needs a CUDA GPU: {problem}")
        for framework in args.framework:
            module, extra = _FRAMEWORK_MODULES[framework]
            if importlib.util.find_spec(module) is None:
                raise Refused(f"--framework {framework}: {module} is not installed: pip install 'bsmm[{extra}]'")
        args.workloads = args.workloads or tuple(SHAPES)
        unknown = [w for w in args.workloads if w not in SHAPES]
        if unknown:
            raise Refused(f"--workloads {','.join(unknown)}: with --framework, expected some of {', '.join(SHAPES)}")
        return
    if args.backend == "gpu":
        problem = gpu_problem()
        if problem:
            raise Refused(f"--backend gpu: {problem}")
    elif args.backend == "auto":
        problem = gpu_problem()
        args.backend = "gpu" if problem is None else "cpu"
        if problem and importlib.util.find_spec("cupy") is not None:  # CuPy is there but cannot run
            print(f"note: the GPU is not used: {problem}", file=sys.stderr)
    if args.backend == "gpu":
        _check_bench_gpu(args)
    else:
        _check_bench_cpu(args)


def _check_bench_cpu(args) -> None:
    for dest in ("hidden", "batch", "steps"):
        if _given(args, dest):
            raise Refused(f"--{dest} applies to --model lstm")
    for dest in ("workloads", "quick"):
        if _given(args, dest):
            raise Refused(f"--{dest} applies to the GPU bench (--backend gpu); the CPU bench times --N, --C, --K")
    args.N, args.C = args.N or 32, args.C or 12288
    args.K = args.K or args.C
    block_sizes = args.block_size or (32,)
    dtypes = args.dtype or ("float32",)
    args.densities = args.densities or (0.5, 0.25, 0.1, 0.05, 0.02)
    args.repeats = args.repeats or 5
    if len(block_sizes) > 1:
        raise Refused(f"--block-size {','.join(map(str, block_sizes))}: the CPU bench takes one block size")
    if len(dtypes) > 1:
        raise Refused(f"--dtype {','.join(dtypes)}: the CPU bench takes one dtype")
    (args.block_size,), (args.dtype,) = block_sizes, dtypes
    if args.dtype not in _CPU_BENCH_DTYPES:
        raise Refused(f"--dtype {args.dtype}: the CPU bench runs {' or '.join(_CPU_BENCH_DTYPES)} (NumPy's dense "
                       f"product of other types has no BLAS to compare with); {args.dtype} runs with --backend gpu")
    _multiple("--C", args.C, args.block_size)
    _multiple("--K", args.K, args.block_size)
    _some_blocks(args.C, args.K, args.block_size, args.densities)


def _check_bench_gpu(args) -> None:
    for dest in ("hidden", "batch", "steps"):
        if _given(args, dest):
            raise Refused(f"--{dest} applies to --model lstm")
    for dest in ("N", "C", "K", "repeats"):
        if _given(args, dest):
            raise Refused(f"--{dest} applies to the CPU bench (--backend cpu); the GPU bench times the shapes of "
                           "--workloads (bsmm bench --help lists them)")
    args.workloads = args.workloads or ("S", "T", "I")
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        raise Refused(f"--workloads {','.join(unknown)}: expected some of {', '.join(WORKLOADS)} "
                       f"({', '.join(w for w in SHAPES if w not in WORKLOADS)} only with --framework)")
    cpu_only = [d for d in args.dtype or () if d in CPU_ONLY_DTYPES]
    if cpu_only:
        raise Refused(f"--dtype {','.join(cpu_only)} runs on the CPU backend only (--backend cpu); the GPU runs "
                       f"{', '.join(GPU_KINDS)}")
    if not gpu_plan(args.workloads, args.quick, args.dtype, args.block_size, args.densities):
        specs = [WORKLOADS[w] for w in args.workloads]

        def listed(key: str, show=str) -> str:
            return ", ".join(show(value) for value in dict.fromkeys(v for spec in specs for v in spec[key]))

        raise Refused(f"--dtype, --block-size and --densities leave no row of workloads {','.join(args.workloads)}: "
                       f"they run dtypes {listed('dtypes')}, block sizes {listed('block_sizes')}, densities "
                       f"{listed('densities', lambda d: f'{d * 100:g}')}")


def _check_tune(args) -> None:
    if args.show or args.reset:
        return
    args.cases = _tune_cases(args)
    for case in args.cases:
        _multiple("--C", case.C, case.block_size)
        _multiple("--K", case.K, case.block_size)
        _some_blocks(case.C, case.K, case.block_size, (case.density,))
    problem = gpu_problem()
    if problem:
        raise Refused(f"tune measures kernels on a CUDA GPU: {problem}")


def _tune_cases(args) -> list:
    from bsmm.cli.tune import Case

    spec = dict(WORKLOADS[args.workload]) if args.workload else dict(
        N=4096, layers=((8192, 8192),), block_sizes=(32,), densities=(0.1,), dtypes=("float16",))
    N = args.N or spec["N"]
    # --C / --K replace every layer's input / output features (--C alone: a square layer).
    layers = list(dict.fromkeys((args.C or c, args.K or args.C or k) for c, k in spec["layers"]))
    block_sizes = args.block_size or spec["block_sizes"]
    densities = args.densities or spec["densities"]
    dtypes = args.dtype or spec["dtypes"]
    passes = args.passes or PASS_NAMES
    return [Case(p, N, C, K, bs, d, dtype, args.feature_axis)
            for dtype in dtypes for C, K in layers for bs in block_sizes for d in densities for p in passes]


# ---- the parser --------------------------------------------------------------------------------
def _workload_lines(framework: bool = True) -> list[str]:
    """The workloads for --help: a line of what each stands for, a line of its shapes."""
    lines = []
    for name, spec in WORKLOADS.items():
        layers = " and ".join(f"{c} → {k}" for c, k in spec["layers"])
        lines += [f"  {name}  {_WORKLOAD_WORDS[name]}: N={spec['N']}, {layers}",
                  f"     blocks {' '.join(map(str, spec['block_sizes']))}; densities "
                  f"{' '.join(f'{d * 100:g}' for d in spec['densities'])} %; {' '.join(spec['dtypes'])}"]
    if framework:
        lines.append("  with --framework, a layer each:")
        lines += [f"     {name}  N={n}, {c} → {k}, block {bs}" + ("" if name in WORKLOADS else f": {_WORKLOAD_WORDS[name]}")
                  for name, (n, c, k, bs, *_) in SHAPES.items()]
    return lines


_BENCH_COLUMNS = f"""\
columns of the tables (explained under each table too):
  bsmm, dense       median time a call of bsmm's pass and of the dense product of the same shape
                    and dtype: NumPy's on the CPU, timed in turns with bsmm's calls; cuBLAS on
                    the GPU, by CUDA events
  speed-up          dense time / bsmm time
  eff.              efficiency per useful FLOP = speed-up × density: bsmm's rate of useful
                    FLOPs (2·N·blocks·block² a pass, the products of present blocks only, i.e.
                    2·N·C·K·density) as a fraction of the dense product's FLOP rate (2·N·C·K a
                    pass); 100 % is as efficient per useful FLOP as dense; † marks over 100 %
  spread (CPU)      interquartile range / median of the repeated times, the larger of bsmm's
                    and dense's; a * after the speed-up: over {SPREAD_LIMIT * 100:g} %, the machine was busy, re-run
  allocating (GPU)  the call allocating its output, as y = op(x, w) does (bsmm: into out=)
  graph (GPU)       the call replayed from a CUDA graph; graph speed-up = dense / graph
  --framework       a framework's layer (bsmm.torch.BlockSparseLinear against nn.Linear, bsmm.jax
                    against x @ W, CuPy's calls against cupy.matmul): forward, training step and
                    host time a call, in µs
  --plot            speed-up against sparsity, a line per (dtype, block size, pass), 1/density
                    dashed; titled with the shape, the device, the dtypes and the date
"""


def build_parser(run: dict) -> argparse.ArgumentParser:
    """The parser of ``bsmm``; ``run`` maps each command (demo, bench, tune) to the function that runs it.

    >>> args = build_parser({"demo": None, "bench": None, "tune": None}).parse_args(["bench", "--densities", "50,2.5"])
    >>> args.densities
    (0.5, 0.025)
    """
    parser = _Parser(prog="bsmm", description="Block-sparse matrix multiplication: the seed's example, benchmarks "
                     "and tuning.", formatter_class=_Formatter,
                     epilog="Measured tables, with GPU, date and commit: results/README.md. The library: README.md "
                            "and the documentation.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,tune}")
    demo = commands.add_parser("demo", help="run the seed's example and a short speed table (GPU: also a PyTorch "
                               "training step)", formatter_class=_Formatter,
                               description="The seed's example on the CPU (and the GPU), then the speed of workload "
                                           "S against the dense product; on a GPU with PyTorch, also a "
                                           "BlockSparseLinear training step against nn.Linear.")
    demo.set_defaults(run=run["demo"], check=lambda args: None, parser=demo)

    bench = commands.add_parser(
        "bench", help="each pass side by side with the dense product", formatter_class=_Formatter,
        description="Times bsmm's three passes (fprop, bprop, updat) beside the dense product of the same shape: "
                    "NumPy on the CPU\n(--N, --C, --K), cuBLAS on the GPU (--workloads); or, with --framework, "
                    "the layers users call.",
        epilog=_BENCH_COLUMNS + "\nworkloads (--workloads; tune --workload):\n" + "\n".join(_workload_lines())
        + "\n\nMeasured tables, with GPU, date and commit: results/README.md.")
    bench.add_argument("--backend", choices=("auto", "cpu", "gpu"), default="auto",
                       help="auto: the GPU where CuPy finds one, else the CPU")
    bench.add_argument("--workloads", type=_names(tuple(dict.fromkeys((*WORKLOADS, *SHAPES)))),
                       help="GPU: workloads, comma-separated (default: S,T,I; with --framework S,D,F)")
    bench.add_argument("--quick", action="store_true", help="GPU: the first block size and two densities of each")
    bench.add_argument("--framework", type=_names(tuple(_FRAMEWORK_MODULES)),
                       help="torch, jax and/or cupy, comma-separated: time what users run (the layer's training "
                            "step, forward and allocating calls, and host time a call) beside the dense layer")
    bench.add_argument("--model", choices=tuple(_MODELS),
                       help="a model beside the framework's dense one: lstm, bsmm.torch.BlockSparseLSTM against "
                            "cuDNN's nn.LSTM of the same width and of equal parameters, and the per-step passes' "
                            "weight streaming against a copy; transformer, a Llama-shaped decoder (d 2048, MLP 8192, "
                            "8 layers) with block-sparse MLPs against the dense one: training eager and compiled, "
                            "prefill, decode in CUDA graphs, in tokens/s")
    bench.add_argument("--hidden", type=_counts, help="--model: hidden sizes, comma-separated (default: 4096,12288,16384)")
    bench.add_argument("--batch", type=_counts, help="--model: sequences a batch, comma-separated (default: 8,32,128)")
    bench.add_argument("--steps", type=_count, help="--model: time steps T (default: 32)")
    bench.add_argument("--N", type=_count, help="CPU: batch rows (default: 32)")
    bench.add_argument("--C", type=_count, help="CPU: input features, a multiple of the block size (default: 12288)")
    bench.add_argument("--K", type=_count, help="CPU: output features, a multiple of the block size (default: C)")
    bench.add_argument("--block-size", type=_block_sizes,
                       help="CPU: one block size (default: 32); GPU: only these of each workload's, comma-separated")
    bench.add_argument("--densities", type=_percentages,
                       help="percentages of present blocks, comma-separated (CPU default: 50,25,10,5,2; GPU: only "
                            "these of each workload's)")
    bench.add_argument("--dtype", type=_names(tuple(KIND_DTYPES)),
                       help="CPU: float32 or float64 (default: float32); GPU: only these of each workload's, "
                            "comma-separated, from float32, tf32, float16, bfloat16")
    bench.add_argument("--repeats", type=_count, help="CPU: timed calls of each side a row (default: 5)")
    bench.add_argument("--json", type=_output_path, help="also write the rows to this JSON file")
    bench.add_argument("--plot", type=_image_path,
                       help="also draw speed-up over dense against sparsity to this image (needs matplotlib)")
    bench.add_argument("-v", "--verbose", action="store_true", help="print each row on stderr as it is measured")
    bench.add_argument("-q", "--quiet", action="store_true",
                       help="no progress bar (one is drawn only where stderr is a terminal)")
    bench.set_defaults(run=run["bench"], check=_check_bench, parser=bench)

    tune = commands.add_parser(
        "tune", help="refine bsmm.toml's launch tiles for this GPU and these shapes (GPU)", formatter_class=_Formatter,
        description="Times launch tiles near bsmm.toml's on the given passes and shapes and keeps the faster ones "
                    "for this machine\n(bsmm.cli.tune). Without --workload: N=4096, C=K=8192, block 32, 10 %, "
                    "float16.",
        epilog="workloads (--workload; see bsmm bench --help):\n" + "\n".join(_workload_lines(framework=False))
        + "\n\nKept tiles go to the tuned file of this machine: --show prints them, --reset removes them,\n"
          "BSMM_TUNED=0 ignores them.")
    tune.add_argument("--workload", choices=tuple(WORKLOADS), help="the shapes of a benchmark workload")
    tune.add_argument("--N", type=_count, help="batch rows (default: the workload's, else 4096)")
    tune.add_argument("--C", type=_count, help="input features (default: the workload's, else 8192)")
    tune.add_argument("--K", type=_count, help="output features (default: C)")
    tune.add_argument("--block-size", type=_block_sizes, help="block sizes, comma-separated (default: 32)")
    tune.add_argument("--densities", type=_percentages, help="percentages, comma-separated (default: 10)")
    tune.add_argument("--dtype", type=_names(GPU_KINDS, tuple(CPU_ONLY_DTYPES)),
                      help=f"{', '.join(GPU_KINDS)}; comma-separated (default: float16)")
    tune.add_argument("--passes", type=_names(PASS_NAMES),
                      help=f"{', '.join(PASS_NAMES)}; comma-separated (default: all three)")
    tune.add_argument("--feature-axis", type=int, choices=(0, 1), default=1,
                      help="the axis of x that holds the features")
    tune.add_argument("--rounds", type=_count, default=2, help="moves from the best tile so far")
    tune.add_argument("--margin", type=_margin, default=3.0, help="percent faster a tile must be to be kept")
    tune.add_argument("--calls", type=_count, default=20, help="back-to-back calls a timing batch")
    tune.add_argument("--batches", type=_count, default=7, help="timing batches a median")
    tune.add_argument("--dry-run", action="store_true", help="measure and report, write nothing")
    tune.add_argument("--show", action="store_true", help="print the tiles tuned on this machine")
    tune.add_argument("--reset", action="store_true", help="remove the tiles tuned on this machine")
    tune.add_argument("-q", "--quiet", action="store_true", help="no progress bar or progress lines on stderr")
    tune.set_defaults(run=run["tune"], check=_check_tune, parser=tune)
    return parser

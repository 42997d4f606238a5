"""``python -m bsmm``: every refused argument is one line on stderr and exit status 2, checked
before any work; --help gives defaults and what the columns mean; the demo's CPU and GPU paths."""

from __future__ import annotations

import functools
import importlib.machinery
import json
import re
import subprocess
import sys
import types

import numpy as np
import pytest

from bsmm.cli import arguments, bench, bench_gpu, main as cli


@pytest.fixture
def no_work(monkeypatch):
    """Any benchmark or tuning run fails the test: a refused argument must stop everything before."""

    def work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(bench, "bench_cpu", work)
    monkeypatch.setattr(bench_gpu, "bench_gpu", work)
    monkeypatch.setattr("bsmm.cli.tune.tune", work)


@pytest.fixture
def gpu(monkeypatch):
    """A machine where CuPy finds a GPU, as far as the argument checks can tell."""
    monkeypatch.setattr(arguments, "gpu_problem", lambda: None)


@pytest.fixture
def no_gpu(monkeypatch):
    """A machine without CuPy (import cupy raises ImportError): the CPU's, wherever the tests run."""
    monkeypatch.setitem(sys.modules, "cupy", None)


def refused(capsys, argv) -> str:
    """Runs the command line on ``argv``, checks it was refused in one line, returns the line."""
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err and err.startswith(f"bsmm {argv[0]}: error: ")
    return err


CPU_CASES = [
    (["--C", "1000"], "--C 1000: expected a multiple of the block size 32 (e.g. 992 or 1024)"),
    (["--K", "100", "--block-size", "64"], "--K 100: expected a multiple of the block size 64 (e.g. 64 or 128)"),
    (["--C", "1024", "--block-size", "128", "--K", "64"], "--K 64: expected a multiple of the block size 128 (e.g. 128)"),
    (["--dtype", "float16"], "--dtype float16: the CPU bench runs float32 or float64"),
    (["--dtype", "tf32"], "--dtype tf32: the CPU bench runs float32 or float64"),
    (["--dtype", "float32,float64"], "--dtype float32,float64: the CPU bench takes one dtype"),
    (["--dtype", "int8"], "argument --dtype: 'int8' is not one of float32, tf32, float16, bfloat16, float64"),
    (["--densities", "50,abc"], "argument --densities: 'abc' is not a number; expected percentages"),
    (["--densities", "0"], "argument --densities: 0 is outside (0, 100]"),
    (["--densities", "100.5"], "argument --densities: 100.5 is outside (0, 100]"),
    (["--densities", "nan"], "argument --densities: nan is outside (0, 100]"),
    (["--densities", "50,,10"], "argument --densities: '50,,10' has an empty item"),
    (["--C", "64", "--densities", "2"], "--densities 2: a 2 x 2 block layout holds no block at that density"),
    (["--block-size", "3"], "argument --block-size: 3 is not a block size bsmm has kernels for; expected 8, 16, 32, 64"),
    (["--block-size", "32x"], "argument --block-size: 32x is not a block size"),
    (["--block-size", "32,64"], "--block-size 32,64: the CPU bench takes one block size"),
    (["--workloads", "T"], "--workloads applies to the GPU bench (--backend gpu)"),
    (["--quick"], "--quick applies to the GPU bench"),
    (["--N", "0"], "argument --N: expected a whole number above 0; got 0"),
    (["--C", "1e3"], "argument --C: expected a whole number above 0; got '1e3'"),
    (["--repeats", "x"], "argument --repeats: expected a whole number above 0; got 'x'"),
    (["--json", "/no/such/folder/rows.json"], "argument --json: no folder /no/such/folder to write"),
    (["--plot", "/no/such/folder/speedup.png"], "argument --plot: no folder /no/such/folder to write"),
    (["--backend", "tpu"], "argument --backend: invalid choice: 'tpu'"),
]


@pytest.mark.parametrize("argv, message", CPU_CASES, ids=[" ".join(a) for a, _ in CPU_CASES])
def test_a_bad_cpu_bench_argument_is_one_line_and_status_2(capsys, no_work, no_gpu, argv, message):
    assert message in refused(capsys, ["bench", *argv])


GPU_CASES = [
    (["--dtype", "float64"], "--dtype float64 runs on the CPU backend only (--backend cpu); the GPU runs float32, tf32"),
    (["--workloads", "S,X"], "argument --workloads: 'X' is not one of S, T, I, F, D"),
    (["--workloads", "D"], "--workloads D: expected some of S, T, I, F (D only with --framework)"),
    (["--N", "64"], "--N applies to the CPU bench (--backend cpu)"),
    (["--C", "1000"], "--C applies to the CPU bench (--backend cpu)"),
    (["--repeats", "3"], "--repeats applies to the CPU bench"),
    (["--workloads", "S", "--block-size", "64"], "leave no row of workloads S: they run dtypes float32, float16, "
                                                 "bfloat16, block sizes 32, densities 50, 25, 10, 5, 2"),
    (["--workloads", "I", "--dtype", "float32"], "leave no row of workloads I"),
    (["--densities", "30"], "leave no row of workloads S,T,I"),
]


@pytest.mark.parametrize("argv, message", GPU_CASES, ids=[" ".join(a) for a, _ in GPU_CASES])
def test_a_bad_gpu_bench_argument_is_one_line_and_status_2(capsys, no_work, gpu, argv, message):
    assert message in refused(capsys, ["bench", "--backend", "gpu", *argv])


def test_an_unknown_argument_or_command_is_one_line_and_status_2(capsys):
    for argv in (["bench", "--frobnicate"], ["bench", "--densities"], ["benchmark"], []):
        assert cli.main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("bsmm") and err.count("\n") == 1 and "Traceback" not in err, argv


def test_the_gpu_backend_without_cupy_says_what_to_install(capsys, no_work, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    assert arguments.gpu_problem().startswith("CuPy is not installed")
    line = refused(capsys, ["bench", "--backend", "gpu"])
    assert "--backend gpu: CuPy is not installed: pip install 'bsmm[cuda12]'" in line and "'bsmm[cuda13]'" in line
    # --backend auto falls back to the CPU, where the arguments are then checked.
    assert "--C 1000: expected a multiple" in refused(capsys, ["bench", "--C", "1000"])


def _fake_cuda_versions(monkeypatch, runtime_version: int, driver_version: int) -> None:
    from bsmm.backends.cuda import environment

    monkeypatch.setattr(environment, "_cuda_versions", lambda: (runtime_version, driver_version))
    monkeypatch.setattr(environment, "cupy_distributions", lambda: ["cupy-cuda13x"])
    environment.check_environment.cache_clear()
    monkeypatch.setattr(environment, "check_environment", functools.cache(environment.check_environment.__wrapped__))


def test_a_cupy_newer_than_the_driver_names_the_extra_to_install(capsys, no_work, monkeypatch):
    pytest.importorskip("cupy")
    _fake_cuda_versions(monkeypatch, 13000, 12080)
    line = refused(capsys, ["bench", "--backend", "gpu"])
    assert "CuPy is built for CUDA 13.0 but the NVIDIA driver supports CUDA up to 12.8" in line
    assert "pip install 'bsmm[cuda12]'" in line


def test_the_gpu_backend_without_a_gpu_says_so(capsys, no_work, monkeypatch):
    no_device = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "cupy", no_device)
    _fake_cuda_versions(monkeypatch, 13000, 0)  # no driver loaded: nothing to compare
    assert "--backend gpu: CuPy finds no CUDA GPU here" in refused(capsys, ["bench", "--backend", "gpu"])
    assert "tune measures kernels on a CUDA GPU: CuPy finds no CUDA GPU" in refused(capsys, ["tune", "--workload", "S"])


def test_the_auto_backend_says_why_an_installed_cupy_is_not_used(capsys, no_work, monkeypatch):
    cupy = types.ModuleType("cupy")  # installed, as importlib finds it
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(arguments, "gpu_problem", lambda: "CuPy finds no CUDA GPU here")
    assert cli.main(["bench", "--C", "1000"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "note: the GPU is not used: CuPy finds no CUDA GPU here",
        "bsmm bench: error: --C 1000: expected a multiple of the block size 32 (e.g. 992 or 1024)"]


def test_plot_without_matplotlib_is_refused_before_the_run(capsys, no_work, no_gpu, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    line = refused(capsys, ["bench", "--backend", "cpu", "--plot", str(tmp_path / "speedup.png")])
    assert "argument --plot: drawing needs matplotlib: pip install matplotlib" in line


FRAMEWORK_CASES = [
    (["--framework", "tf"], "argument --framework: 'tf' is not one of torch, jax, cupy"),
    (["--framework", "torch", "--densities", "10"], "--densities does not apply with --framework"),
    (["--framework", "torch", "--block-size", "32"], "--block-size does not apply with --framework"),
    (["--framework", "torch", "--plot", "x.png"], "--plot does not apply with --framework"),
    (["--framework", "torch", "--backend", "cpu"], "--backend cpu does not apply with --framework"),
    (["--framework", "cupy", "--workloads", "T"], "--workloads T: with --framework, expected some of S, D, F"),
]


@pytest.mark.parametrize("argv, message", FRAMEWORK_CASES, ids=[" ".join(a) for a, _ in FRAMEWORK_CASES])
def test_a_bad_framework_bench_argument_is_one_line_and_status_2(capsys, no_work, gpu, argv, message):
    assert message in refused(capsys, ["bench", *argv])


def test_the_framework_bench_needs_a_gpu_and_the_framework(capsys, no_work, no_gpu, monkeypatch):
    assert "--framework needs a CUDA GPU: CuPy is not installed" in refused(capsys, ["bench", "--framework", "torch"])
    monkeypatch.setattr(arguments, "gpu_problem", lambda: None)
    monkeypatch.setitem(sys.modules, "jax", None)  # find_spec("jax") is then None: not installed
    line = refused(capsys, ["bench", "--framework", "torch,jax"])
    assert "--framework jax: jax is not installed: pip install 'bsmm[jax]'" in line


TUNE_CASES = [
    (["--C", "1000"], "--C 1000: expected a multiple of the block size 32 (e.g. 992 or 1024)"),
    (["--K", "1001", "--block-size", "8"], "--K 1001: expected a multiple of the block size 8 (e.g. 1000 or 1008)"),
    (["--workload", "F", "--C", "4000", "--block-size", "64"], "--C 4000: expected a multiple of the block size 64"),
    (["--workload", "X"], "argument --workload: invalid choice: 'X'"),
    (["--dtype", "float64"], "argument --dtype: float64 runs on the CPU backend only; expected some of float32, tf32, "
                             "float16, bfloat16"),
    (["--dtype", "half"], "argument --dtype: 'half' is not one of float32, tf32, float16, bfloat16"),
    (["--densities", "50,abc"], "argument --densities: 'abc' is not a number"),
    (["--densities", "-5"], "argument --densities: -5 is outside (0, 100]"),
    (["--C", "64", "--densities", "10"], "--densities 10: a 2 x 2 block layout holds no block"),
    (["--passes", "fprop,xprop"], "argument --passes: 'xprop' is not one of fprop, bprop, updat"),
    (["--block-size", "3"], "argument --block-size: 3 is not a block size bsmm has kernels for"),
    (["--N", "-1"], "argument --N: expected a whole number above 0; got -1"),
    (["--rounds", "0"], "argument --rounds: expected a whole number above 0; got 0"),
    (["--margin", "100"], "argument --margin: expected a percentage in [0, 100); got 100"),
    (["--margin", "x"], "argument --margin: expected a percentage in [0, 100); got 'x'"),
    (["--feature-axis", "2"], "argument --feature-axis: invalid choice: 2"),
]


@pytest.mark.parametrize("argv, message", TUNE_CASES, ids=[" ".join(a) for a, _ in TUNE_CASES])
def test_a_bad_tune_argument_is_one_line_and_status_2(capsys, no_work, gpu, argv, message):
    assert message in refused(capsys, ["tune", *argv])


def test_errors_from_a_subprocess_are_one_line_without_a_traceback():
    """What a user sees: ``python -m bsmm bench --densities 50,abc``."""
    done = subprocess.run([sys.executable, "-m", "bsmm", "bench", "--densities", "50,abc"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("bsmm bench: error: argument --densities: 'abc' is not a number; expected percentages "
                           "of present blocks in (0, 100], e.g. 50,10\n")


def test_help_gives_defaults_columns_and_workloads(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps option help to the terminal's width
    assert cli.main(["bench", "--help"]) == 0
    text = capsys.readouterr().out
    assert "BENCHMARKS.md" not in text and "results/README.md" in text
    for default in ("(default: auto)", "(default: 32)", "(default: 12288)", "(default: C)", "(default: 5)",
                    "(default: float32)", "50,25,10,5,2"):
        assert default in text, default
    for column in ("speed-up ", "eff. ", "spread (CPU)", "allocating (GPU)", "graph (GPU)", "--plot "):
        assert re.search(rf"^  {re.escape(column)}", text, re.M), column
    assert "(2·N·blocks·block² a pass" in text and "speed-up × density" in text
    for name, spec in bench_gpu.WORKLOADS.items():
        assert re.search(rf"^  {name}  .*: N={spec['N']}, ", text, re.M), name
    assert re.search(r"^     D  N=8, 8192 → 8192, block 32: decoding", text, re.M)
    assert cli.main(["tune", "--help"]) == 0
    text = capsys.readouterr().out
    for default in ("(default: 2)", "(default: 3.0)", "(default: 20)", "(default: 7)", "(default: float16)",
                    "(default: 1)"):
        assert default in text, default
    assert "BENCHMARKS.md" not in text
    assert cli.main(["--help"]) == 0 and "BENCHMARKS.md" not in capsys.readouterr().out


def test_cpu_bench_prints_a_table_with_its_legend_rows_as_measured_json_and_plot(capsys, no_gpu, tmp_path):
    pytest.importorskip("matplotlib")
    rows_file, image = tmp_path / "rows.json", tmp_path / "speedup.png"
    assert cli.main(["bench", "--N", "4", "--C", "256", "--K", "128", "--densities", "50,25", "--repeats", "3",
                     "--dtype", "float64", "-v", "--json", str(rows_file), "--plot", str(image)]) == 0
    out, err = capsys.readouterr()
    table = [line for line in out.splitlines() if line.startswith("| cpu |")]
    assert len(table) == 6 and all("| float64 | 4 | 256 → 128 | 32 |" in line for line in table)
    assert "\n\nbsmm, dense: median time a call" in out and "* over 25 %: the machine was busy, re-run." in out
    assert [line for line in err.splitlines() if line.startswith("| cpu |")] == table  # -v: each row on stderr
    rows = json.loads(rows_file.read_text())["rows"]
    assert [(r["density"], r["pass_name"]) for r in rows][:2] == [(0.5, "fprop"), (0.5, "bprop")]
    assert all(r["spread"] >= 0 and r["sparse_s"] > 0 and r["dense_s"] > 0 for r in rows)
    assert image.stat().st_size > 0


def test_import_bsmm_imports_no_tqdm():
    code = ("import sys, bsmm, bsmm.cli.main, bsmm.cli.bench, bsmm.cli.bench_gpu, bsmm.cli.tune; "
            "print('tqdm' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


# ---- demo ----------------------------------------------------------------------------------------
@pytest.fixture
def small_cpu_table(monkeypatch):
    """The demo's table at a small shape: the real one (C = K = 12288) takes half a minute."""
    monkeypatch.setattr(bench, "bench_cpu", functools.partial(bench.bench_cpu, C=512, K=512))


def test_the_cpu_demo_prints_the_seed_example_and_a_speed_table(capsys, no_gpu, small_cpu_table, monkeypatch):
    monkeypatch.setattr(cli, "_nvidia_driver_loaded", lambda: True)  # a driver, but no CuPy: the extra helps
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("seed example: BlocksparseMatMul(")
    error = float(re.search(r"on the CPU: shape \(64, 4096\), relative error vs float64 dense (\S+)", out)[1])
    assert error < 1e-5
    assert "no GPU here: CuPy is not installed: pip install 'bsmm[cuda12]'" in out
    assert "the demo runs on the CPU backend" in out
    table = [line for line in out.splitlines() if line.startswith("| cpu |")]
    assert [line.split("|")[6:8] for line in table] == [[f" {d} ", f" {p} "] for d in ("25%", "10%", "2%")
                                                        for p in ("fprop", "bprop", "updat")]
    assert "eff.: speed-up × density" in out and "spread:" in out


@pytest.mark.parametrize("problem", ["CuPy is not installed: pip install 'bsmm[cuda12]' (CUDA 12 driver)",
                                     "CuPy finds no CUDA GPU here"])
def test_the_demo_without_an_nvidia_driver_says_so_and_suggests_no_cuda_extra(capsys, small_cpu_table, monkeypatch,
                                                                              problem):
    monkeypatch.setattr(arguments, "gpu_problem", lambda: problem)
    monkeypatch.setattr(cli, "_nvidia_driver_loaded", lambda: False)
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert ("no GPU here: no NVIDIA driver is loaded on this machine (no GPU, or a container started without one); "
            "the demo runs on the CPU backend.") in out
    assert "pip install" not in out and "cuda12" not in out and "CuPy" not in out
    assert len([line for line in out.splitlines() if line.startswith("| cpu |")]) == 9


def test_the_nvidia_driver_is_found_by_its_kernel_module_or_its_library(monkeypatch):
    monkeypatch.setattr(cli.os.path, "exists", lambda path: path == "/proc/driver/nvidia/version")
    assert cli._nvidia_driver_loaded()
    monkeypatch.setattr(cli.os.path, "exists", lambda path: False)

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(cli.ctypes, "CDLL", no_library)
    assert not cli._nvidia_driver_loaded()
    monkeypatch.setattr(cli.ctypes, "CDLL", lambda name: object())
    assert cli._nvidia_driver_loaded()


def test_the_gpu_demo_says_how_to_get_pytorch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert "PyTorch is not installed: pip install 'bsmm[torch]'" in cli._torch_step()


def test_the_gpu_demo_times_a_torch_training_step(monkeypatch):
    torch = pytest.importorskip("torch")
    from bsmm.cli import framework_bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "finds no CUDA GPU" in cli._torch_step()
    calls = []

    def bench_torch(*args, **kwargs):
        calls.append((args, kwargs))
        return [framework_bench.FrameworkRow("torch", "S", "bfloat16", 0.1, "step + SGD", 1e-4, 4e-4)]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(framework_bench, "bench_torch", bench_torch)
    shown = cli._torch_step()
    assert calls == [((("S",),), dict(host=False, graphs=False, dtypes=("bfloat16",), densities=(0.1,),
                                        optimizer=True))]
    assert "BlockSparseLinear against nn.Linear (N=32, 12288 → 12288, block 32, 10 %, bfloat16" in shown
    assert "| torch | S | bfloat16 | 10% | step + SGD | 100.0 | 400.0 | 4.00x |" in shown


def test_the_training_step_with_an_optimizer_updates_the_weight():
    """The step the demo times: forward, backward and SGD on bsmm's layer (CPU backend here)."""
    torch = pytest.importorskip("torch")
    import bsmm.torch
    from bsmm.cli.framework_bench import _torch_steps
    from bsmm.layouts import random_layout

    layer = bsmm.torch.BlockSparseLinear(64, 64, random_layout(2, 2, 0.5, seed=0), block_size=32, bias=False)
    x = torch.randn(4, 64, requires_grad=True)
    before = layer.weight.detach().clone()
    _torch_steps(torch, layer, x, optimizer=True)[2]()
    assert layer.weight.grad is not None and not torch.equal(layer.weight.detach(), before)
    dense = torch.nn.Linear(64, 64, bias=False)
    before = dense.weight.detach().clone()
    _torch_steps(torch, dense, x)[2]()  # no optimizer: gradients only
    assert dense.weight.grad is not None and torch.equal(dense.weight.detach(), before)


# ---- the GPU bench's code, on a stand-in CuPy over NumPy ---------------------------------------
class _Event:
    def record(self, stream=None):
        self.seconds = bench_gpu.time.perf_counter()

    def synchronize(self):
        pass


class _Stream:
    def __init__(self, non_blocking=False):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass

    def begin_capture(self):
        raise RuntimeError("a stand-in captures no graph")


class _DeviceArray:
    """A stand-in CuPy array, with CuPy's ``get``: NumPy memory that bsmm reaches through DLPack
    (its CPU backend computes). bsmm hands a result back through ``from_dlpack`` of the module
    the operands' type names, as for any DLPack library's arrays: here :data:`_DEVICE_MODULE`'s."""

    __module__ = "stand_in_device"

    def __init__(self, array):
        self.array = np.asarray(array)

    def __dlpack__(self, *args, **kwargs):
        return self.array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def get(self):
        return self.array.copy()


_DEVICE_MODULE = types.SimpleNamespace(from_dlpack=_DeviceArray)


@pytest.fixture
def stand_in_cupy(monkeypatch, gpu):
    """CuPy as far as the GPU bench and the demo use it, on NumPy memory (the CPU backend computes), with
    workload S made tiny; dense products through PyTorch's CPU build where it is installed
    (whose TF32 switch the bench sets, and this fixture puts back)."""
    cuda = types.SimpleNamespace(
        Event=_Event, Stream=_Stream, get_current_stream=_Stream, is_available=lambda: True,
        get_elapsed_time=lambda start, end: (end.seconds - start.seconds) * 1e3,
        Device=lambda: types.SimpleNamespace(id=0),
        runtime=types.SimpleNamespace(getDeviceProperties=lambda device: {"name": b"Stand-in GPU"}))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=cuda, random=np.random, empty=np.empty, matmul=np.matmul, asarray=_DeviceArray))
    monkeypatch.setitem(sys.modules, _DeviceArray.__module__, _DEVICE_MODULE)
    monkeypatch.setitem(bench_gpu.WORKLOADS, "S", dict(N=4, layers=((256, 128),), block_sizes=(32, 64),
                                                       densities=(0.5, 0.25), dtypes=("float32", "tf32")))
    try:
        import torch
    except ImportError:
        yield
        return
    tf32 = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


def test_the_gpu_bench_runs_its_rows_with_a_legend_json_and_plot(capsys, stand_in_cupy, tmp_path):
    pytest.importorskip("matplotlib")
    rows_file, image = tmp_path / "rows.json", tmp_path / "speedup.png"
    assert cli.main(["bench", "--workloads", "S", "--densities", "50", "-v", "--json", str(rows_file),
                     "--plot", str(image)]) == 0
    out, err = capsys.readouterr()
    table = [line for line in out.splitlines() if line.startswith("| S |")]
    assert [line.split("|")[2:8] for line in table] == [
        [f" {kind} ", " 4 ", " 256 → 128 ", f" {bs} ", " 50% ", f" {p} "]
        for kind in ("float32", "tf32") for bs in (32, 64) for p in ("fprop", "bprop", "updat")]
    assert all("| - |" in line for line in table)  # no graph on the stand-in
    assert "\n\nbsmm: median time a call into a kept output (out=)" in out
    assert [line for line in err.splitlines() if line.startswith("| S |")] == table
    saved = json.loads(rows_file.read_text())
    assert saved["meta"]["gpu"] == "Stand-in GPU" and len(saved["rows"]) == 12
    assert all(r["alloc_s"] > 0 and r["graph_s"] is None and r["workload"] == "S" for r in saved["rows"])
    assert image.stat().st_size > 0


def test_the_gpu_demo_checks_the_seed_example_on_the_gpu_then_times_workload_s(capsys, stand_in_cupy, monkeypatch):
    # Smaller still than the stand-in's workload S (the demo times all of it), dense through NumPy:
    # PyTorch's CPU threads took 13 ms a product on a busy machine.
    monkeypatch.setitem(bench_gpu.WORKLOADS, "S", dict(N=4, layers=((256, 128),), block_sizes=(32,), densities=(0.5,),
                                                       dtypes=("float32",)))
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("seed example: BlocksparseMatMul(") and "no GPU here" not in out
    error = float(re.search(r"^  the same on the GPU: relative error (\S+)$", out, re.M)[1])
    assert error < 1e-5
    assert "\nspeed, GPU kernels vs dense cuBLAS (workload S: N=32, C=K=12288, block 32):\n" in out
    table = [line for line in out.splitlines() if line.startswith("| S |")]
    assert [line.split("|")[2:8] for line in table] == [
        [" float32 ", " 4 ", " 256 → 128 ", " 32 ", " 50% ", f" {p} "] for p in ("fprop", "bprop", "updat")]
    assert "\n\nbsmm: median time a call into a kept output (out=)" in out
    # PyTorch's training step last: here, how to get it.
    assert out.rstrip().endswith("PyTorch is not installed: pip install 'bsmm[torch]' to see a BlockSparseLinear "
                                 "training step here")


def test_tune_runs_the_checked_cases_with_lines_and_a_bar_unless_quiet(capsys, gpu, monkeypatch):
    from bsmm.cli import tune

    calls = []
    monkeypatch.setattr(tune, "tune", lambda cases, **kwargs: calls.append((cases, kwargs)) or [])
    assert cli.main(["tune", "--workload", "S", "--dtype", "float16", "--densities", "10", "--dry-run"]) == 0
    assert "--dry-run: 0 kept tiles not written" in capsys.readouterr().out
    (cases, kwargs), = calls
    assert [(c.pass_name, c.N, c.C, c.K, c.block_size, c.density, c.dtype) for c in cases] == [
        (p, 32, 12288, 12288, 32, 0.1, "float16") for p in ("fprop", "bprop", "updat")]
    assert kwargs["progress"] is cli._say and kwargs["bar"] is False  # stderr is no terminal here
    assert kwargs["rounds"] == 2 and kwargs["margin"] == 0.03 and kwargs["write"] is False
    calls.clear()
    assert cli.main(["tune", "--quiet", "--margin", "5"]) == 0
    assert calls[0][1]["progress"] is None and calls[0][1]["margin"] == 0.05

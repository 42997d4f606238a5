"""Every notebook in ``notebooks/`` is committed clean, needs no checkout, and runs headless from top to bottom.

Each ``notebooks/*.ipynb`` (found at collection, so a new notebook is tested as soon
as it lands) is checked for outputs left in it and for what ties it to a checkout
(``sys.path`` edits, a search for ``bsmm.toml``, imports from ``examples``), then
executed by nbclient in a fresh kernel of this interpreter, in a temporary folder
outside the repository, with ``BSMM_NOTEBOOK_SIZE=small`` (unless already set),
which the notebooks read to pick sizes that run in well under a minute on the CPU
backend. bsmm is imported as installed (``pip install -e .`` in development), never
from the working directory. Each notebook must print at least one line starting
with ``Verdict:``: its machine-dependent conclusions are printed from its numbers,
not written in its markdown. The results the notebooks copy from ``results/`` (a pip
install has no ``results/``) are checked against the files they were copied from.

Clean a notebook before committing it::

    .venv/bin/python tests/test_notebooks.py notebooks/NAME.ipynb
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = REPOSITORY / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
#: Seconds a whole notebook may take, and any one cell (the kernel's start excluded).
TIMEOUT_S = 300
CLEAN_COMMAND = ".venv/bin/python tests/test_notebooks.py"
#: How a notebook's printed conclusions start (a line of a cell's printed output).
VERDICT = "Verdict:"
#: What only works inside a checkout of the repository, with what to do instead.
CHECKOUT_ONLY = {
    re.compile(r"sys\.path"): "edits sys.path: import bsmm as installed",
    re.compile(r"bsmm\.toml"): "looks for bsmm.toml: nothing in a notebook may depend on the repository's files",
    re.compile(r"^\s*(from|import)\s+examples\b", re.MULTILINE):
        "imports from examples/, which a pip install does not have: keep the code in the notebook",
}
#: The colours of IPython's tracebacks, dropped from failure reports.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def _dirty_cells(notebook: dict) -> list[int]:
    """Numbers (from 1) of the cells holding outputs, an execution count or execution timings."""
    return [
        number for number, cell in enumerate(notebook.get("cells", []), start=1)
        if cell.get("outputs") or cell.get("execution_count") is not None or "execution" in cell.get("metadata", {})
    ]


def strip(notebook: dict) -> dict:
    """``notebook`` without outputs, execution counts or execution timings (changed in place)."""
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        cell.get("metadata", {}).pop("execution", None)
    return notebook


def _cell_sources(path: Path) -> list[str]:
    """The source of every cell of the notebook at ``path``, markdown and code."""
    return ["".join(cell["source"]) for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_committed_clean(path):
    dirty = _dirty_cells(json.loads(path.read_text(encoding="utf-8")))
    if dirty:
        pytest.fail(
            f"{path.name}: cells {', '.join(map(str, dirty))} hold outputs or execution counts of a run; "
            f"commit the notebook without them: {CLEAN_COMMAND} notebooks/{path.name}",
            pytrace=False,
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_needs_no_checkout(path):
    found = [f"cell {number}: {problem}" for number, source in enumerate(_cell_sources(path), start=1)
             for pattern, problem in CHECKOUT_ONLY.items() if pattern.search(source)]
    assert not found, f"{path.name} only runs inside a checkout of the repository:\n" + "\n".join(found)


def test_checkout_patterns_catch_what_they_name():
    sources = ["sys.path.insert(0, root)", "(folder / 'bsmm.toml').is_file()", "from examples.char_lstm import text"]
    assert [any(pattern.search(source) for pattern in CHECKOUT_ONLY) for source in sources] == [True] * 3
    assert not any(pattern.search("run examples/char_lstm/experiment.py") for pattern in CHECKOUT_ONLY)


def _literal(path: Path, name: str):
    """The value of the assignment ``name = <literal>`` in a code cell of the notebook at ``path``."""
    for source in _cell_sources(path):
        if f"{name} = " not in source:
            continue
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == name for target in node.targets):
                return ast.literal_eval(node.value)
    raise LookupError(f"{path.name} assigns no literal to {name}")


def test_h100_speedups_copied_from_results():
    """Notebook 2's H100 table: microseconds rounded to 0.01 µs from the run's JSON."""
    copied = _literal(NOTEBOOK_DIR / "02_speedup_figure.ipynb", "H100_S_US")
    run = json.loads((REPOSITORY / "results" / "archive" / "h100_v17_review.json").read_text())
    rows = [row for row in run["rows"] if row["workload"] == "S"]
    assert len(rows) == 3 * 3 * 5 == sum(len(times) for _, times in copied.values())
    for row in rows:
        dense_us, times = copied[row["dtype"], row["pass_name"]]
        eager_us, graph_us = times[[0.5, 0.25, 0.1, 0.05, 0.02].index(round(row["density"], 2))]
        for copied_us, key in ((dense_us, "dense_s"), (eager_us, "sparse_s"), (graph_us, "graph_s")):
            assert copied_us == pytest.approx(row[key] * 1e6, abs=0.005), (row["dtype"], row["pass_name"], row["density"], key)


def test_h100_lstm_run_copied_from_results():
    """Notebook 3's H100 table: the run's JSON, rounded as the table prints it."""
    copied = _literal(NOTEBOOK_DIR / "03_small_world_lstm.ipynb", "H100_RUN")
    run = {model["model"]: model for model in json.loads((REPOSITORY / "results" / "lstm_h100.json").read_text())["models"]}
    assert set(copied) == set(run)
    for name, model in run.items():
        assert copied[name]["hidden"] == model["hidden"] and copied[name]["params"] == model["params"]
        assert copied[name]["updates"] == model["updates"]
        assert copied[name]["density"] == round(model["recurrent_density"], 3) == round(model["input_density"], 3)
        assert copied[name]["chars_per_second"] == round(model["chars_per_second"])
        assert copied[name]["valid_bpc"] == round(model["valid_bpc"], 3)


def _kernel_manager_class():
    """A kernel manager that starts this interpreter's ipykernel, whatever kernelspecs are installed.

    With no kernel directories to search, the kernelspec manager falls back to
    ipykernel's own spec, whose command is ``sys.executable``: the virtual
    environment's Python, never a ``python3`` kernel registered elsewhere on the machine.
    """
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    class ThisInterpreterKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(kernel_spec_manager=KernelSpecManager(kernel_dirs=[]), **kwargs)

    return ThisInterpreterKernelManager


def _printed_lines(notebook) -> list[str]:
    """Every line the executed ``notebook``'s cells printed (stdout and stderr streams)."""
    return [line for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])
            if output.get("output_type") == "stream" for line in output["text"].splitlines()]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_runs_headless(path, tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient", reason="notebook tests need: pip install -e . --group notebooks-ci")
    import nbformat

    # Outside the repository and with no PYTHONPATH, the kernel finds bsmm only as installed.
    assert not tmp_path.resolve().is_relative_to(REPOSITORY), f"{tmp_path} is inside {REPOSITORY}"
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("BSMM_NOTEBOOK_SIZE", os.environ.get("BSMM_NOTEBOOK_SIZE", "small"))
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=TIMEOUT_S,
        kernel_name="python3",
        kernel_manager_class=_kernel_manager_class(),
        resources={"metadata": {"path": str(tmp_path)}},
    )
    start = time.perf_counter()
    failure = None
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        failure = f"{path.name}: a cell raised\n{error}"
    except nbclient.exceptions.CellTimeoutError as error:
        failure = f"{path.name}: a cell ran past {TIMEOUT_S} s\n{error}"
    except nbclient.exceptions.DeadKernelError as error:
        failure = f"{path.name}: the kernel died (a crash, memory exhausted, or an exit)\n{error}"
    if failure:  # outside the except clause, so that the report holds the cell's error only once
        pytest.fail(_ANSI_ESCAPE.sub("", failure), pytrace=False)
    elapsed = time.perf_counter() - start
    assert elapsed < TIMEOUT_S, f"{path.name} took {elapsed:.0f} s; the limit is {TIMEOUT_S} s"
    verdicts = [line for line in _printed_lines(notebook) if line.startswith(VERDICT)]
    assert verdicts, f"{path.name} printed no line starting with {VERDICT!r}: print its conclusions from its numbers"
    assert not [line for line in verdicts if re.search(r"\bnan\b", line)], f"{path.name}: a verdict from NaN: {verdicts}"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(f"usage: {CLEAN_COMMAND} NOTEBOOK.ipynb ...")
    for name in sys.argv[1:]:
        target = Path(name)
        cleaned = strip(json.loads(target.read_text(encoding="utf-8")))
        # nbformat's own layout (sorted keys, indent 1, a final newline), so a cleaned notebook diffs cleanly.
        target.write_text(json.dumps(cleaned, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"cleaned {target}")

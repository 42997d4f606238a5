"""Every notebook in ``notebooks/`` is committed clean and runs headless from top to bottom.

Each ``notebooks/*.ipynb`` (found at collection, so a new notebook is tested as soon
as it lands) is checked for outputs left in it, then executed by nbclient in a fresh
kernel of this interpreter, with ``notebooks/`` as the working directory and
``BSMM_NOTEBOOK_SIZE=small`` (unless already set), which the notebooks read to pick
sizes that run in well under a minute on the CPU backend.

Clean a notebook before committing it::

    .venv/bin/python tests/test_notebooks.py notebooks/NAME.ipynb
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
#: Seconds a whole notebook may take, and any one cell (the kernel's start excluded).
TIMEOUT_S = 300
CLEAN_COMMAND = ".venv/bin/python tests/test_notebooks.py"
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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_committed_clean(path):
    dirty = _dirty_cells(json.loads(path.read_text(encoding="utf-8")))
    if dirty:
        pytest.fail(
            f"{path.name}: cells {', '.join(map(str, dirty))} hold outputs or execution counts of a run; "
            f"commit the notebook without them: {CLEAN_COMMAND} notebooks/{path.name}",
            pytrace=False,
        )


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_runs_headless(path, monkeypatch):
    nbclient = pytest.importorskip("nbclient", reason="notebook tests need the extra: pip install -e '.[notebooks]'")
    import nbformat

    monkeypatch.setenv("BSMM_NOTEBOOK_SIZE", os.environ.get("BSMM_NOTEBOOK_SIZE", "small"))
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=TIMEOUT_S,
        kernel_name="python3",
        kernel_manager_class=_kernel_manager_class(),
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
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


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(f"usage: {CLEAN_COMMAND} NOTEBOOK.ipynb ...")
    for name in sys.argv[1:]:
        target = Path(name)
        cleaned = strip(json.loads(target.read_text(encoding="utf-8")))
        # nbformat's own layout (sorted keys, indent 1, a final newline), so a cleaned notebook diffs cleanly.
        target.write_text(json.dumps(cleaned, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"cleaned {target}")

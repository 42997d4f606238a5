"""Run a notebook's code cells as one script, where no Jupyter kernel is installed (the lent GPU).

    python tools/gpu/run_notebook.py notebooks/03_small_world_lstm.ipynb

The cells run in order in one namespace with matplotlib's Agg backend; ``IPython.display`` is
replaced by printing where IPython is missing. Prints each cell's output as it comes and exits
non-zero at the first cell that raises. ``tests/test_notebooks.py`` runs notebooks through a real
kernel on the CPU; this is for their GPU paths only.
"""

from __future__ import annotations

import json
import sys
import time
import types


def _stub_ipython() -> None:
    """``from IPython.display import Markdown, display`` as plain printing."""
    try:
        import IPython.display  # noqa: F401
    except ImportError:
        display = types.ModuleType("IPython.display")
        display.Markdown = str
        display.display = print
        sys.modules["IPython"] = types.ModuleType("IPython")
        sys.modules["IPython.display"] = display


def main(path: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    _stub_ipython()
    cells = [c for c in json.load(open(path))["cells"] if c["cell_type"] == "code"]
    namespace: dict = {"__name__": "__main__"}
    for number, cell in enumerate(cells, start=1):
        start = time.perf_counter()
        exec(compile("".join(cell["source"]), f"{path} cell {number}", "exec"), namespace)
        print(f"[cell {number} of {len(cells)}: {time.perf_counter() - start:.1f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

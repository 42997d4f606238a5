"""Run a notebook's code cells as one script, where no Jupyter kernel is installed (the lent GPU).

    python tools/gpu/run_notebook.py notebooks/03_small_world_lstm.ipynb

The cells run in order in one namespace with matplotlib's Agg backend; ``IPython.display``'s
``display`` and ``Markdown`` print where IPython is missing. Prints each cell's output as it comes and exits
non-zero at the first cell that raises. ``tests/test_notebooks.py`` runs notebooks through a real
kernel on the CPU; this is for their GPU paths only.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import types


_IPYTHON_DISPLAY = "from IPython.display import"


def _display_module() -> str:
    """The module the cells' ``from IPython.display import ...`` reads: IPython's where it is
    installed, else a stand-in that prints (a fake ``IPython`` module would mislead matplotlib)."""
    if importlib.util.find_spec("IPython") is not None:
        return "IPython.display"
    display = types.ModuleType("_printed_display")
    display.Markdown = str
    display.display = print
    sys.modules[display.__name__] = display
    return display.__name__


def main(path: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    display_module = _display_module()
    cells = [c for c in json.load(open(path))["cells"] if c["cell_type"] == "code"]
    namespace: dict = {"__name__": "__main__"}
    for number, cell in enumerate(cells, start=1):
        start = time.perf_counter()
        source = "".join(cell["source"]).replace(_IPYTHON_DISPLAY, f"from {display_module} import")
        exec(compile(source, f"{path} cell {number}", "exec"), namespace)
        print(f"[cell {number} of {len(cells)}: {time.perf_counter() - start:.1f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

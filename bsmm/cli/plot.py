"""The seed's figure: speed-up over dense against sparsity, one line per pass."""

from __future__ import annotations

import datetime

__all__ = ["plot_speedup", "plot_title"]


def plot_title(rows, device: str, date: datetime.date | None = None) -> str:
    """The figure's title: the shapes of ``rows`` (N, C → K, block sizes), ``device``, dtypes, date.

    Examples
    --------
    >>> from bsmm.cli.bench import BenchRow
    >>> rows = [BenchRow("cpu", "float32", 32, 2048, 1024, 32, d, "fprop", 1.0, 2.0) for d in (0.5, 0.1)]
    >>> print(plot_title(rows, "CPU (x86_64)", datetime.date(2026, 11, 25)))
    N=32, C=2048 → K=1024, block 32, float32
    CPU (x86_64), 2026-11-25
    """
    shapes = {(getattr(r, "workload", ""), r.N, r.C, r.K): None for r in rows}
    shape = "; ".join(f"{workload} N={n}, C={c} → K={k}".strip() for workload, n, c, k in shapes)
    blocks = sorted({r.block_size for r in rows})
    dtypes = ", ".join(dict.fromkeys(r.dtype for r in rows))
    block_words = f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {', '.join(map(str, blocks))}"
    return f"{shape}, {block_words}, {dtypes}\n{device}, {(date or datetime.date.today()).isoformat()}"


def plot_speedup(rows, path: str, device: str = "CPU") -> None:
    """Draw each (workload, dtype, block size, pass) as a line of speed-up vs sparsity and save it
    to ``path``, titled by :func:`plot_title` (``device``: the GPU's name, or the CPU's).

    Examples
    --------
    >>> import importlib.util, pathlib, tempfile
    >>> from bsmm.cli.bench import BenchRow
    >>> rows = [BenchRow("cpu", "float32", 32, 2048, 1024, 32, d, p, 1.0, 0.5 / d)
    ...         for d in (0.5, 0.1) for p in ("fprop", "updat")]
    >>> if importlib.util.find_spec("matplotlib"):  # drawing needs it: pip install matplotlib
    ...     with tempfile.TemporaryDirectory() as folder:
    ...         path = pathlib.Path(folder, "speedup.png")
    ...         plot_speedup(rows, str(path), "CPU (x86_64)")
    ...         assert path.read_bytes()[1:4] == b"PNG"
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict = {}
    for r in rows:
        key = (getattr(r, "workload", ""), r.dtype, r.block_size, r.pass_name)
        series.setdefault(key, []).append((1 - r.density, r.speedup))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (workload, dtype, bs, pass_name), points in sorted(series.items()):
        points.sort()
        ax.plot([100 * s for s, _ in points], [v for _, v in points], marker="o",
                label=f"{workload} {dtype} b{bs} {pass_name}".strip())
    sparsities = sorted({1 - r.density for r in rows})
    ax.plot([100 * s for s in sparsities], [1 / (1 - s) for s in sparsities], "k--", label="1/density")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("sparsity (%)")
    ax.set_ylabel("speed-up over dense")
    ax.set_yscale("log")
    ax.set_title(plot_title(rows, device), fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""The seed's figure: speed-up over dense against sparsity, one line per pass."""

from __future__ import annotations

__all__ = ["plot_speedup"]


def plot_speedup(rows, path: str) -> None:
    """Draw each (dtype, block size, pass) as a line of speed-up vs sparsity and save it to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from error
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
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""Small-world layouts with a given number of blocks, and how small-world they came out.

:func:`small_world_layout` builds the symmetric block graphs that the
small-world LSTMs of Gray, Radford & Kingma (2017) use as recurrent layouts,
sized to a block budget rather than a degree; :func:`layout_report` sets the
measures of :mod:`bsmm.layouts.measures` next to those of a sampled random
graph with as many edges.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import sparse
from scipy.sparse import csgraph

from bsmm.layouts import generators, measures
from bsmm.layouts.checks import as_generator

__all__ = ["small_world_layout", "layout_report"]


def small_world_layout(n: int, blocks: int, kind: str = "barabasi_albert", seed=None, rewire: float = 0.1):
    """A symmetric small-world (n, n) layout with ``blocks`` blocks (or one more), diagonal included.

    ``barabasi_albert`` grows a graph with ``m`` edges per new node
    (``n + 2 (m n - m (m+1) / 2)`` blocks); ``watts_strogatz`` rewires a ring
    lattice of even degree ``k`` (``n (k + 1)`` blocks) with probability
    ``rewire`` per edge. The sparsest such graph with at least ``blocks``
    blocks is thinned to ``blocks`` by removing uniformly chosen edges, none
    of a spanning tree's, so thinning disconnects nothing. An edge is two
    blocks: an odd excess leaves one block more. A budget below the sparsest
    graph's (a tree, or a ring of degree 2) gives that graph.

    Examples
    --------
    >>> layout = small_world_layout(32, 200, seed=0)
    >>> layout.shape, int(layout.sum()), bool((layout == layout.T).all())
    ((32, 32), 200, True)
    """
    if kind == "barabasi_albert":
        counts = {m: n + 2 * (m * n - m * (m + 1) // 2) for m in range(1, n)}
    elif kind == "watts_strogatz":
        counts = {k: n * (k + 1) for k in range(2, n, 2)}
    else:
        raise ValueError(f"kind must be 'barabasi_albert' or 'watts_strogatz'; got {kind!r}")
    if not counts:
        raise ValueError(f"n must be large enough for a {kind} graph; got {n}")
    rng = as_generator(seed)
    degree = min((key for key in counts if counts[key] >= blocks), default=max(counts))
    if kind == "barabasi_albert":
        layout = generators.barabasi_albert(n, degree, seed=rng)
    else:
        layout = generators.watts_strogatz_1d(n, degree, rewire, seed=rng)
    excess = (int(layout.sum()) - blocks) // 2
    if excess > 0:
        # Edges of a breadth-first spanning tree stay, so the graph stays connected.
        tree = csgraph.breadth_first_tree(sparse.csr_array(layout), 0, directed=False).toarray() != 0
        rows, cols = np.nonzero(np.triu(layout, k=1) & ~(tree | tree.T))
        drop = rng.permutation(rows.size)[:excess]
        layout[rows[drop], cols[drop]] = layout[cols[drop], rows[drop]] = 0
    return layout


def layout_report(layout, seed=0) -> dict[str, float]:
    """Small-world measures of a square layout next to a sampled random graph with as many edges.

    Returns :func:`bsmm.layouts.small_world_summary` plus ``sampled_random_path_length``
    and ``sampled_random_clustering`` of an Erdős–Rényi graph G(n, M) with the
    layout's number of undirected edges M (NaN path length if it came out disconnected).

    Examples
    --------
    >>> report = layout_report(small_world_layout(64, 448, "watts_strogatz", seed=0, rewire=0.05))
    >>> report["n_nodes"], report["clustering"] > 2 * report["sampled_random_clustering"]
    (64, True)
    """
    report = measures.small_world_summary(layout)
    n = report["n_nodes"]
    edges = int(measures.degree(layout).sum()) // 2
    rng = as_generator(seed)
    upper_rows, upper_cols = np.triu_indices(n, k=1)
    chosen = rng.choice(upper_rows.size, size=edges, replace=False)
    random = np.eye(n, dtype=np.uint8)
    random[upper_rows[chosen], upper_cols[chosen]] = 1
    try:
        report["sampled_random_path_length"] = measures.average_shortest_path_length(random)
    except ValueError:
        report["sampled_random_path_length"] = math.nan
    report["sampled_random_clustering"] = measures.clustering_coefficient(random)
    return report

"""Graph measures of a square layout: degrees, path lengths, clustering, small-worldness.

A square layout (see :mod:`bsmm.layouts.generators`) is read as an undirected
simple graph among its block nodes: ``layout | layout.T`` with the diagonal
ignored, so a layout with self-loops and one without measure the same.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import sparse
from scipy.sparse import csgraph

from bsmm.block_index import check_layout

__all__ = [
    "degree",
    "average_shortest_path_length",
    "clustering_coefficient",
    "small_world_summary",
]


def _undirected(layout) -> np.ndarray:
    checked = check_layout(layout)
    if checked.shape[0] != checked.shape[1]:
        raise ValueError(f"layout must be square to be read as a graph; got shape {checked.shape}")
    adjacent = (checked | checked.T).astype(bool)
    np.fill_diagonal(adjacent, False)
    return adjacent


def degree(layout) -> np.ndarray:
    """Number of neighbours of each node of the layout read as an undirected graph.

    Parameters
    ----------
    layout : (n, n) array of 0/1
        Read as ``layout | layout.T`` without the diagonal.

    Returns
    -------
    (n,) int64 array

    Raises
    ------
    ValueError
        If ``layout`` is not a square 2-D array of 0/1.

    Examples
    --------
    >>> import numpy as np
    >>> degree(np.array([[1, 1, 0], [0, 1, 0], [0, 1, 1]])).tolist()
    [1, 2, 1]
    """
    return np.count_nonzero(_undirected(layout), axis=1).astype(np.int64)


def average_shortest_path_length(layout) -> float:
    """Mean hop count over all ordered pairs of distinct nodes.

    Breadth-first distances of ``layout | layout.T`` (diagonal ignored),
    computed with ``scipy.sparse.csgraph.shortest_path``; the distance matrix
    takes ``8 n^2`` bytes.

    Parameters
    ----------
    layout : (n, n) array of 0/1, n >= 2

    Returns
    -------
    float

    Raises
    ------
    ValueError
        If ``layout`` is not a square 2-D array of 0/1, has fewer than 2
        nodes, or its graph is disconnected.

    Examples
    --------
    >>> from bsmm.layouts import watts_strogatz_1d
    >>> round(average_shortest_path_length(watts_strogatz_1d(8, 2, 0.0)), 6)  # 16 / 7
    2.285714
    """
    adjacent = _undirected(layout)
    n = adjacent.shape[0]
    if n < 2:
        raise ValueError(f"layout must have at least 2 nodes for path lengths; got shape {adjacent.shape}")
    graph = sparse.csr_array(adjacent)
    n_components, _ = csgraph.connected_components(graph, directed=False)
    if n_components > 1:
        raise ValueError(f"layout must describe a connected graph; got {n_components} components")
    distances = csgraph.shortest_path(graph, directed=False, unweighted=True)
    return float(distances.sum() / (n * (n - 1)))


def clustering_coefficient(layout) -> float:
    """Average local clustering coefficient (Watts & Strogatz 1998).

    Node ``i`` of degree ``d_i`` lies on ``T_i = (A^3)_ii / 2`` triangles and
    has ``c_i = 2 T_i / (d_i (d_i - 1))``, or 0 when ``d_i < 2``; the result
    is the mean of ``c_i`` over all nodes. ``A`` is ``layout | layout.T``
    without the diagonal.

    Parameters
    ----------
    layout : (n, n) array of 0/1

    Returns
    -------
    float

    Raises
    ------
    ValueError
        If ``layout`` is not a square 2-D array of 0/1.

    Examples
    --------
    >>> import numpy as np
    >>> triangle_and_tail = np.array([[0, 1, 1, 0], [1, 0, 1, 0], [1, 1, 0, 1], [0, 0, 1, 0]])
    >>> round(clustering_coefficient(triangle_and_tail), 6)  # (1 + 1 + 1/3 + 0) / 4
    0.583333
    """
    adjacent = _undirected(layout)
    degrees = adjacent.sum(axis=1)
    graph = sparse.csr_array(adjacent, dtype=np.int64)
    # (A @ A) * A summed over a row is (A^3)_ii without forming the denser A^3.
    closed_walks = (graph @ graph).multiply(graph) @ np.ones(degrees.size)
    pairs = degrees * (degrees - 1)
    local = np.divide(closed_walks, pairs, out=np.zeros(pairs.shape), where=pairs > 0)
    return float(local.mean())


def small_world_summary(layout) -> dict[str, float]:
    """Path length and clustering of a layout next to those of a random graph of equal density.

    The random-graph references are analytic, for an Erdős–Rényi graph with
    the same mean degree ``<k>``: clustering ``<k> / (n - 1)`` (its edge
    probability) and path length ``(ln n - gamma) / ln <k> + 1/2`` (Fronczak,
    Fronczak & Hołyst 2004; ``gamma`` is Euler's constant), NaN when
    ``<k> <= 1`` where the formula does not apply. ``sigma`` is the
    small-world coefficient ``(C / C_rand) / (L / L_rand)`` (Humphries &
    Gurney 2008); well above 1 for a small world.

    Parameters
    ----------
    layout : (n, n) array of 0/1, n >= 2, connected

    Returns
    -------
    dict
        ``n_nodes`` (int), ``density`` (present blocks / ``n^2``, diagonal
        included), ``mean_degree``, ``path_length``, ``clustering``,
        ``random_path_length``, ``random_clustering``, ``sigma`` (floats).

    Raises
    ------
    ValueError
        As :func:`average_shortest_path_length`.

    Examples
    --------
    >>> from bsmm.layouts import watts_strogatz_1d
    >>> summary = small_world_summary(watts_strogatz_1d(400, 8, 0.05, seed=0))
    >>> summary["clustering"] > 10 * summary["random_clustering"], summary["sigma"] > 5
    (True, True)
    """
    path_length = average_shortest_path_length(layout)
    checked = check_layout(layout)
    n = checked.shape[0]
    mean_degree = float(degree(checked).mean())
    clustering = clustering_coefficient(checked)
    random_clustering = mean_degree / (n - 1)
    if mean_degree > 1:
        random_path_length = (math.log(n) - np.euler_gamma) / math.log(mean_degree) + 0.5
    else:
        random_path_length = math.nan
    return {
        "n_nodes": n,
        "density": float(np.count_nonzero(checked) / checked.size),
        "mean_degree": mean_degree,
        "path_length": path_length,
        "clustering": clustering,
        "random_path_length": random_path_length,
        "random_clustering": random_clustering,
        "sigma": (clustering / random_clustering) / (path_length / random_path_length),
    }

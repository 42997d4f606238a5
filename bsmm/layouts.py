"""Reproducible layout generators and the small-world measures of a layout.

A layout is a ``uint8`` array of 0/1 of shape ``(C // bs, K // bs)`` (see
:mod:`bsmm.block_index`). A square layout is also the adjacency matrix of a
graph among block nodes, ``c -> k`` where ``layout[c, k] != 0``; the
small-world layouts of Gray, Radford & Kingma (2017), "GPU Kernels for
Block-Sparse Weights", are built and judged as such graphs.

Every generator takes ``seed`` (int, None or ``numpy.random.Generator``):
the same int gives the same layout. The graph generators keep the diagonal
by default (``self_loops=True``), so that every block column holds its own
block, as the paper's layouts do. The measures read a layout as an undirected
simple graph: ``layout | layout.T`` with the diagonal ignored.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import sparse
from scipy.sparse import csgraph

from bsmm.block_index import check_layout

__all__ = [
    "random_layout",
    "skewed_layout",
    "barabasi_albert",
    "watts_strogatz_1d",
    "watts_strogatz_2d",
    "degree",
    "average_shortest_path_length",
    "clustering_coefficient",
    "small_world_summary",
]


def _as_generator(seed) -> np.random.Generator:
    if isinstance(seed, np.random.Generator):
        return seed
    if seed is None:
        return np.random.default_rng()
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, None or numpy.random.Generator; got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0; got {seed}")
    return np.random.default_rng(int(seed))


def _check_int(value, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        expected = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {expected}; got {value}")
    return int(value)


def _check_unit_interval(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number; got {type(value).__name__}")
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must be in [0, 1]; got {value}")
    return float(value)


def _block_budget(n_rows: int, n_cols: int | None, density) -> tuple[int, int, int]:
    n_rows = _check_int(n_rows, "n_rows", 1)
    n_cols = n_rows if n_cols is None else _check_int(n_cols, "n_cols", 1)
    density = _check_unit_interval(density, "density")
    return n_rows, n_cols, round(density * n_rows * n_cols)


def random_layout(n_rows, n_cols=None, density=0.1, seed=None) -> np.ndarray:
    """A layout with exactly ``round(density * n_rows * n_cols)`` blocks, placed uniformly.

    The blocks are a uniform sample without replacement of all positions, so
    a "10 %" layout holds exactly 10 % of the blocks (``round`` is Python's,
    halves to even).

    Parameters
    ----------
    n_rows : int
        Block rows, ``C // bs``; at least 1.
    n_cols : int, optional
        Block columns, ``K // bs``; default ``n_rows``.
    density : float
        Fraction of present blocks, in [0, 1].
    seed : int, None or numpy.random.Generator

    Returns
    -------
    (n_rows, n_cols) uint8 array of 0/1

    Raises
    ------
    TypeError
        If ``n_rows``/``n_cols`` are not ints, ``density`` is not a real or
        ``seed`` is of another type.
    ValueError
        If ``n_rows``/``n_cols`` < 1, ``density`` is outside [0, 1] or ``seed`` < 0.

    Examples
    --------
    >>> layout = random_layout(8, 16, density=0.25, seed=0)
    >>> layout.shape, int(layout.sum())
    ((8, 16), 32)
    >>> bool((layout == random_layout(8, 16, density=0.25, seed=0)).all())
    True
    """
    n_rows, n_cols, n_blocks = _block_budget(n_rows, n_cols, density)
    rng = _as_generator(seed)
    layout = np.zeros(n_rows * n_cols, dtype=np.uint8)
    layout[rng.choice(layout.size, size=n_blocks, replace=False)] = 1
    return layout.reshape(n_rows, n_cols)


def skewed_layout(n_rows, n_cols=None, density=0.1, dense_cols=None, seed=None) -> np.ndarray:
    """A layout whose blocks pile up in a few full block columns, for load-balancing tests.

    Exactly ``round(density * n_rows * n_cols)`` blocks are present, as in
    :func:`random_layout`. ``dense_cols`` block columns, chosen uniformly, are
    full (``n_rows`` blocks each); the remaining blocks are spread uniformly
    over the other columns. The skew is strongest when ``density`` is small.

    Parameters
    ----------
    n_rows : int
        Block rows; at least 1.
    n_cols : int, optional
        Block columns; default ``n_rows``.
    density : float
        Fraction of present blocks, in [0, 1].
    dense_cols : int, optional
        Number of full block columns. Default: ``max(1, n_cols // 32)``,
        lowered to ``budget // n_rows`` if the full columns alone would hold
        more blocks than the budget allows (possibly to 0). An explicit value
        must fit in the budget.
    seed : int, None or numpy.random.Generator

    Returns
    -------
    (n_rows, n_cols) uint8 array of 0/1

    Raises
    ------
    TypeError
        If an argument has the wrong type (see :func:`random_layout`).
    ValueError
        If an argument is out of range, or ``dense_cols * n_rows`` exceeds
        ``round(density * n_rows * n_cols)``.

    Examples
    --------
    >>> layout = skewed_layout(16, 64, density=0.1, seed=0)
    >>> int(layout.sum()), int((layout.sum(axis=0) == 16).sum())
    (102, 2)
    """
    n_rows, n_cols, n_blocks = _block_budget(n_rows, n_cols, density)
    if dense_cols is None:
        dense_cols = min(max(1, n_cols // 32), n_blocks // n_rows)
    else:
        dense_cols = _check_int(dense_cols, "dense_cols", 0, n_cols)
        if dense_cols * n_rows > n_blocks:
            raise ValueError(
                f"dense_cols must be <= {n_blocks // n_rows} so that {n_rows}-block columns fit in "
                f"round(density * n_rows * n_cols) = {n_blocks} blocks; got {dense_cols}"
            )
    rng = _as_generator(seed)
    dense = np.zeros(n_cols, dtype=bool)
    dense[rng.choice(n_cols, size=dense_cols, replace=False)] = True
    layout = np.zeros((n_rows, n_cols), dtype=np.uint8)
    layout[:, dense] = 1
    # n_blocks <= n_rows * n_cols, so the other columns have room for the remaining blocks.
    sparse_part = np.zeros(n_rows * (n_cols - dense_cols), dtype=np.uint8)
    sparse_part[rng.choice(sparse_part.size, size=n_blocks - dense_cols * n_rows, replace=False)] = 1
    layout[:, ~dense] = sparse_part.reshape(n_rows, n_cols - dense_cols)
    return layout


def _adjacency(n: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    adjacent = np.zeros((n, n), dtype=bool)
    adjacent[u, v] = adjacent[v, u] = True
    return adjacent


def _to_layout(adjacent: np.ndarray, self_loops: bool) -> np.ndarray:
    layout = adjacent.astype(np.uint8)
    if self_loops:
        np.fill_diagonal(layout, 1)
    return layout


def _check_self_loops(self_loops) -> bool:
    if not isinstance(self_loops, (bool, np.bool_)):
        raise TypeError(f"self_loops must be a bool; got {type(self_loops).__name__}")
    return bool(self_loops)


def _distinct_draws(pool: np.ndarray, m: int, rng: np.random.Generator) -> np.ndarray:
    # The first m distinct values of an i.i.d. stream of uniform picks from the
    # pool: sampling proportional to pool multiplicity, without replacement.
    draws = pool[rng.integers(pool.size, size=2 * m)]
    while True:
        _, first = np.unique(draws, return_index=True)
        if first.size >= m:
            return draws[np.sort(first)[:m]]
        draws = np.concatenate([draws, pool[rng.integers(pool.size, size=2 * m)]])


def barabasi_albert(n, m, seed=None, self_loops=True) -> np.ndarray:
    """An undirected Barabási–Albert preferential-attachment graph as a symmetric layout.

    Growth starts from the complete graph on nodes ``0..m`` (every node of
    degree ``m``; equivalently, a clique of ``m`` nodes that node ``m`` joins).
    Each later node ``v = m+1, ..., n-1`` links to ``m`` distinct earlier
    nodes, drawn one after another with probability proportional to their
    current degree. The graph has exactly ``m * n - m * (m + 1) // 2`` edges,
    and every node has degree at least ``m``.

    Parameters
    ----------
    n : int
        Nodes (block rows = block columns); at least 2.
    m : int
        Edges each new node brings, in [1, n - 1].
    seed : int, None or numpy.random.Generator
    self_loops : bool
        Set the diagonal, so every block column holds its own block.

    Returns
    -------
    (n, n) uint8 array of 0/1, symmetric

    Raises
    ------
    TypeError
        If ``n``/``m`` are not ints, ``self_loops`` is not a bool or ``seed``
        is of another type.
    ValueError
        If ``n`` < 2, ``m`` is outside [1, n - 1] or ``seed`` < 0.

    Examples
    --------
    >>> layout = barabasi_albert(100, 2, seed=0)
    >>> edges = (int(layout.sum()) - 100) // 2
    >>> edges, 2 * 100 - 3
    (197, 197)
    """
    n = _check_int(n, "n", 2)
    m = _check_int(m, "m", 1, n - 1)
    self_loops = _check_self_loops(self_loops)
    rng = _as_generator(seed)
    n_edges = m * n - m * (m + 1) // 2
    u = np.empty(n_edges, dtype=np.intp)
    v = np.empty(n_edges, dtype=np.intp)
    seed_u, seed_v = np.triu_indices(m + 1, k=1)
    n_seed = seed_u.size
    u[:n_seed], v[:n_seed] = seed_u, seed_v
    # Every edge puts both endpoints in the pool, so each node appears as often
    # as its degree and a uniform pick from the pool is a degree-proportional pick.
    pool = np.empty(2 * n_edges, dtype=np.intp)
    pool[: 2 * n_seed] = np.concatenate([seed_u, seed_v])
    for new, e in zip(range(m + 1, n), range(n_seed, n_edges, m), strict=True):
        targets = _distinct_draws(pool[: 2 * e], m, rng)
        u[e : e + m] = new
        v[e : e + m] = targets
        pool[2 * e : 2 * e + m] = targets
        pool[2 * e + m : 2 * (e + m)] = new
    return _to_layout(_adjacency(n, u, v), self_loops)


def _rewire(n: int, u: np.ndarray, v: np.ndarray, p: float, rng, self_loops: bool) -> np.ndarray:
    """Watts–Strogatz rewiring of lattice edges ``(u[e], v[e])``, visited in order.

    With probability ``p`` edge ``(a, b)`` becomes ``(a, w)``, ``w`` uniform
    among the nodes that are neither ``a`` nor already adjacent to ``a``; an
    ``a`` adjacent to every node keeps its edge. The edge count never changes.
    """
    adjacent = _adjacency(n, u, v)
    degrees = adjacent.sum(axis=1)
    # Sequential over the rewired edges only: which targets are free depends on
    # every earlier rewiring.
    for e in np.flatnonzero(rng.random(u.size) < p):
        a, b = u[e], v[e]
        if degrees[a] == n - 1:
            continue
        if 2 * degrees[a] < n:
            # Rejection needs fewer than two draws on average here, against O(n) for a candidate list.
            w = rng.integers(n)
            while w == a or adjacent[a, w]:
                w = rng.integers(n)
        else:
            free = ~adjacent[a]
            free[a] = False
            w = rng.choice(np.flatnonzero(free))
        adjacent[a, b] = adjacent[b, a] = False
        adjacent[a, w] = adjacent[w, a] = True
        degrees[b] -= 1
        degrees[w] += 1
    return _to_layout(adjacent, self_loops)


def watts_strogatz_1d(n, k, p, seed=None, self_loops=True) -> np.ndarray:
    """A Watts–Strogatz small-world graph on a ring, as a symmetric layout.

    Node ``i`` starts linked to the ``k`` nearest nodes on the ring, ``k / 2``
    on each side. Each lattice edge ``(i, i + j mod n)`` is then visited, for
    ``j = 1, ..., k / 2`` and ``i = 0, ..., n - 1`` in that order (Watts &
    Strogatz 1998), and with probability ``p`` its far end moves to a node
    chosen uniformly among those not yet linked to ``i`` (nor ``i`` itself).
    The graph always has ``n * k / 2`` edges; ``p = 0`` is the lattice.

    Parameters
    ----------
    n : int
        Nodes; at least 1.
    k : int
        Lattice degree: even, in [0, n - 1].
    p : float
        Rewiring probability, in [0, 1].
    seed : int, None or numpy.random.Generator
    self_loops : bool
        Set the diagonal, so every block column holds its own block.

    Returns
    -------
    (n, n) uint8 array of 0/1, symmetric

    Raises
    ------
    TypeError
        If ``n``/``k`` are not ints, ``p`` is not a real, ``self_loops`` is
        not a bool or ``seed`` is of another type.
    ValueError
        If ``n`` < 1, ``k`` is odd or outside [0, n - 1], ``p`` is outside
        [0, 1] or ``seed`` < 0.

    Examples
    --------
    >>> layout = watts_strogatz_1d(8, 2, 0.0)
    >>> layout[0].tolist()
    [1, 1, 0, 0, 0, 0, 0, 1]
    >>> round(clustering_coefficient(watts_strogatz_1d(20, 4, 0.0)), 6)
    0.5
    """
    n = _check_int(n, "n", 1)
    k = _check_int(k, "k", 0, n - 1)
    if k % 2:
        raise ValueError(f"k must be even (k / 2 neighbours on each side); got {k}")
    p = _check_unit_interval(p, "p")
    self_loops = _check_self_loops(self_loops)
    rng = _as_generator(seed)
    offsets = np.arange(1, k // 2 + 1)
    u = np.tile(np.arange(n), offsets.size)
    v = (u + np.repeat(offsets, n)) % n
    return _rewire(n, u, v, p, rng, self_loops)


def watts_strogatz_2d(side, k, p, seed=None, self_loops=True) -> np.ndarray:
    """A Watts–Strogatz small-world graph on a 2-D torus, as a symmetric layout.

    Node ``i * side + j`` sits at ``(i, j)`` of a ``side x side`` periodic
    grid and starts linked to every node within Chebyshev distance ``r`` on
    the torus (its ``(2r+1)^2 - 1`` Moore neighbours), so ``k`` must be
    ``(2r+1)^2 - 1``: 0, 8, 24, 48, ... Each lattice edge is visited once,
    offset by offset, and rewired with probability ``p`` exactly as in
    :func:`watts_strogatz_1d`. The graph always has ``side^2 * k / 2`` edges.

    Parameters
    ----------
    side : int
        Grid edge; ``n = side**2`` nodes. At least ``2r + 1`` so that the
        ``k`` neighbours are distinct.
    k : int
        Lattice degree, ``(2r+1)^2 - 1`` for an int ``r >= 0``.
    p : float
        Rewiring probability, in [0, 1].
    seed : int, None or numpy.random.Generator
    self_loops : bool
        Set the diagonal, so every block column holds its own block.

    Returns
    -------
    (side**2, side**2) uint8 array of 0/1, symmetric

    Raises
    ------
    TypeError
        If ``side``/``k`` are not ints, ``p`` is not a real, ``self_loops``
        is not a bool or ``seed`` is of another type.
    ValueError
        If ``side`` < 1, ``k`` is not of the form ``(2r+1)^2 - 1``,
        ``side`` < ``2r + 1``, ``p`` is outside [0, 1] or ``seed`` < 0.

    Examples
    --------
    >>> layout = watts_strogatz_2d(5, 8, 0.0, self_loops=False)
    >>> layout.shape, degree(layout).tolist() == [8] * 25
    ((25, 25), True)
    """
    side = _check_int(side, "side", 1)
    k = _check_int(k, "k", 0)
    r = (math.isqrt(k + 1) - 1) // 2
    if (2 * r + 1) ** 2 - 1 != k:
        raise ValueError(f"k must be (2r+1)^2 - 1 (0, 8, 24, 48, ...); got {k}")
    if side < 2 * r + 1:
        raise ValueError(f"side must be >= 2r + 1 = {2 * r + 1} for k = {k}; got {side}")
    p = _check_unit_interval(p, "p")
    self_loops = _check_self_loops(self_loops)
    rng = _as_generator(seed)
    d = np.arange(-r, r + 1)
    di, dj = (a.ravel() for a in np.meshgrid(d, d, indexing="ij"))
    # One offset of each +/- pair, so every undirected edge is listed once.
    half = (di > 0) | ((di == 0) & (dj > 0))
    di, dj = di[half, None], dj[half, None]
    i, j = np.divmod(np.arange(side * side), side)
    u = np.broadcast_to(np.arange(side * side), (di.size, side * side)).ravel()
    v = (((i + di) % side) * side + (j + dj) % side).ravel()
    return _rewire(side * side, u, v, p, rng, self_loops)


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

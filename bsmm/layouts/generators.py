"""Reproducible layout generators: uniform, skewed and small-world graphs of blocks.

A layout is a ``uint8`` array of 0/1 of shape ``(C // bs, K // bs)`` (see
:mod:`bsmm.block_index`). A square layout is also the adjacency matrix of a
graph among block nodes, ``c -> k`` where ``layout[c, k] != 0``; the
small-world layouts of Gray, Radford & Kingma (2017), "GPU Kernels for
Block-Sparse Weights", are built as such graphs (and judged by
:mod:`bsmm.layouts.measures`).

Every generator takes ``seed`` (int, None or ``numpy.random.Generator``):
the same int gives the same layout. The graph generators keep the diagonal
by default (``self_loops=True``), so that every block column holds its own
block, as the paper's layouts do.
"""

from __future__ import annotations

import math

import numpy as np

from bsmm.layouts.checks import as_generator, check_int, check_self_loops, check_unit_interval

__all__ = [
    "random_layout",
    "skewed_layout",
    "barabasi_albert",
    "watts_strogatz_1d",
    "watts_strogatz_2d",
]


def _block_budget(n_rows: int, n_cols: int | None, density) -> tuple[int, int, int]:
    n_rows = check_int(n_rows, "n_rows", 1)
    n_cols = n_rows if n_cols is None else check_int(n_cols, "n_cols", 1)
    density = check_unit_interval(density, "density")
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
    rng = as_generator(seed)
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
        dense_cols = check_int(dense_cols, "dense_cols", 0, n_cols)
        if dense_cols * n_rows > n_blocks:
            raise ValueError(
                f"dense_cols must be <= {n_blocks // n_rows} so that {n_rows}-block columns fit in "
                f"round(density * n_rows * n_cols) = {n_blocks} blocks; got {dense_cols}"
            )
    rng = as_generator(seed)
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
    n = check_int(n, "n", 2)
    m = check_int(m, "m", 1, n - 1)
    self_loops = check_self_loops(self_loops)
    rng = as_generator(seed)
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
    >>> from bsmm.layouts import clustering_coefficient
    >>> round(clustering_coefficient(watts_strogatz_1d(20, 4, 0.0)), 6)
    0.5
    """
    n = check_int(n, "n", 1)
    k = check_int(k, "k", 0, n - 1)
    if k % 2:
        raise ValueError(f"k must be even (k / 2 neighbours on each side); got {k}")
    p = check_unit_interval(p, "p")
    self_loops = check_self_loops(self_loops)
    rng = as_generator(seed)
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
    >>> from bsmm.layouts import degree
    >>> layout = watts_strogatz_2d(5, 8, 0.0, self_loops=False)
    >>> layout.shape, degree(layout).tolist() == [8] * 25
    ((25, 25), True)
    """
    side = check_int(side, "side", 1)
    k = check_int(k, "k", 0)
    r = (math.isqrt(k + 1) - 1) // 2
    if (2 * r + 1) ** 2 - 1 != k:
        raise ValueError(f"k must be (2r+1)^2 - 1 (0, 8, 24, 48, ...); got {k}")
    if side < 2 * r + 1:
        raise ValueError(f"side must be >= 2r + 1 = {2 * r + 1} for k = {k}; got {side}")
    p = check_unit_interval(p, "p")
    self_loops = check_self_loops(self_loops)
    rng = as_generator(seed)
    d = np.arange(-r, r + 1)
    di, dj = (a.ravel() for a in np.meshgrid(d, d, indexing="ij"))
    # One offset of each +/- pair, so every undirected edge is listed once.
    half = (di > 0) | ((di == 0) & (dj > 0))
    di, dj = di[half, None], dj[half, None]
    i, j = np.divmod(np.arange(side * side), side)
    u = np.broadcast_to(np.arange(side * side), (di.size, side * side)).ravel()
    v = (((i + di) % side) * side + (j + dj) % side).ravel()
    return _rewire(side * side, u, v, p, rng, self_loops)

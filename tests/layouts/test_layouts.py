"""Layout generators against their definitions; graph measures against networkx."""

import math

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bsmm.layouts import (
    average_shortest_path_length,
    barabasi_albert,
    clustering_coefficient,
    degree,
    random_layout,
    skewed_layout,
    small_world_summary,
    watts_strogatz_1d,
    watts_strogatz_2d,
)
from bsmm.layouts.small_world import layout_report, small_world_layout

seeds = st.integers(0, 2**32 - 1)


def _edge_count(layout):
    """Undirected edges of a symmetric layout, diagonal excluded."""
    return (np.count_nonzero(layout) - np.count_nonzero(np.diag(layout))) // 2


def _assert_layout(layout, shape):
    assert layout.shape == shape
    assert layout.dtype == np.uint8
    assert layout.flags.c_contiguous
    assert np.isin(layout, (0, 1)).all()


def _assert_graph(layout, n, self_loops):
    _assert_layout(layout, (n, n))
    assert (layout == layout.T).all()
    assert (np.diag(layout) == self_loops).all()


# -- random_layout -----------------------------------------------------------------


@settings(deadline=None)
@given(st.integers(1, 40), st.none() | st.integers(1, 40), st.floats(0, 1), seeds)
def test_random_layout_has_exact_block_count(n_rows, n_cols, density, seed):
    layout = random_layout(n_rows, n_cols, density=density, seed=seed)
    n_cols = n_rows if n_cols is None else n_cols
    _assert_layout(layout, (n_rows, n_cols))
    assert layout.sum() == round(density * n_rows * n_cols)


def test_random_layout_is_reproducible():
    assert (random_layout(32, 48, 0.1, seed=7) == random_layout(32, 48, 0.1, seed=7)).all()
    assert (random_layout(32, 48, 0.1, seed=7) != random_layout(32, 48, 0.1, seed=8)).any()


def test_generator_seed_is_used_and_advanced():
    first = random_layout(32, density=0.1, seed=np.random.default_rng(3))
    assert (first == random_layout(32, density=0.1, seed=np.random.default_rng(3))).all()
    rng = np.random.default_rng(3)
    assert (random_layout(32, density=0.1, seed=rng) != random_layout(32, density=0.1, seed=rng)).any()


def test_random_layout_places_blocks_uniformly():
    rng = np.random.default_rng(0)
    hits = sum(random_layout(8, 8, 0.25, seed=rng).astype(int) for _ in range(400))
    # Each position is present with probability 0.25: Binomial(400, 0.25), mean 100, sd 8.7.
    assert np.abs(hits - 100).max() < 45


# -- skewed_layout -----------------------------------------------------------------


@settings(deadline=None)
@given(st.integers(1, 40), st.integers(1, 100), st.floats(0, 1), seeds)
def test_skewed_layout_has_exact_count_and_default_dense_columns(n_rows, n_cols, density, seed):
    layout = skewed_layout(n_rows, n_cols, density=density, seed=seed)
    _assert_layout(layout, (n_rows, n_cols))
    budget = round(density * n_rows * n_cols)
    assert layout.sum() == budget
    expected_dense = min(max(1, n_cols // 32), budget // n_rows)
    assert (layout.sum(axis=0) == n_rows).sum() >= expected_dense


def test_skewed_layout_concentrates_blocks():
    layout = skewed_layout(64, 256, density=0.05, seed=1)
    col_counts = layout.sum(axis=0)
    assert layout.sum() == round(0.05 * 64 * 256)
    assert (col_counts == 64).sum() == 256 // 32
    sparse_cols = col_counts[col_counts < 64]
    assert sparse_cols.mean() < 2  # (819 - 8 * 64) / 248 blocks per sparse column


def test_skewed_layout_explicit_dense_cols():
    layout = skewed_layout(16, 40, density=0.25, dense_cols=9, seed=2)
    assert layout.sum() == 160
    assert (layout.sum(axis=0) == 16).sum() >= 9
    assert (layout == skewed_layout(16, 40, density=0.25, dense_cols=9, seed=2)).all()
    assert (layout != skewed_layout(16, 40, density=0.25, dense_cols=9, seed=3)).any()


def test_skewed_layout_drops_dense_columns_the_budget_cannot_hold():
    layout = skewed_layout(64, 128, density=0.005, seed=0)  # 41 blocks < one full column
    assert layout.sum() == 41
    assert not (layout.sum(axis=0) == 64).any()


def test_skewed_layout_rejects_dense_cols_over_budget():
    with pytest.raises(ValueError, match=r"dense_cols must be <= 2 .*; got 3"):
        skewed_layout(10, 10, density=0.25, dense_cols=3)
    with pytest.raises(ValueError, match=r"dense_cols must be in \[0, 10\]; got 11"):
        skewed_layout(10, 10, density=1.0, dense_cols=11)
    with pytest.raises(TypeError, match="dense_cols must be an int; got float"):
        skewed_layout(10, 10, dense_cols=1.0)


@pytest.mark.parametrize("generator", [random_layout, skewed_layout])
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"n_rows": 0}, ValueError, r"n_rows must be >= 1; got 0"),
        ({"n_rows": 2.0}, TypeError, r"n_rows must be an int; got float"),
        ({"n_rows": True}, TypeError, r"n_rows must be an int; got bool"),
        ({"n_cols": -3}, ValueError, r"n_cols must be >= 1; got -3"),
        ({"density": 1.5}, ValueError, r"density must be in \[0, 1\]; got 1.5"),
        ({"density": -0.1}, ValueError, r"density must be in \[0, 1\]; got -0.1"),
        ({"density": math.nan}, ValueError, r"density must be in \[0, 1\]; got nan"),
        ({"density": "0.1"}, TypeError, r"density must be a real number; got str"),
        ({"seed": "0"}, TypeError, r"seed must be an int, None or numpy.random.Generator; got str"),
        ({"seed": 1.0}, TypeError, r"seed must be an int, None or numpy.random.Generator; got float"),
        ({"seed": -1}, ValueError, r"seed must be >= 0; got -1"),
    ],
)
def test_block_budget_generators_validate(generator, kwargs, error, message):
    with pytest.raises(error, match=message):
        generator(**{"n_rows": 8, **kwargs})


# -- barabasi_albert ---------------------------------------------------------------


@settings(deadline=None)
@given(st.data(), st.integers(2, 60), st.booleans(), seeds)
def test_barabasi_albert_follows_its_growth_rule(data, n, self_loops, seed):
    m = data.draw(st.integers(1, n - 1))
    layout = barabasi_albert(n, m, seed=seed, self_loops=self_loops)
    _assert_graph(layout, n, self_loops)
    assert _edge_count(layout) == m * n - m * (m + 1) // 2
    # Nodes 0..m form a clique; every later node links to exactly m earlier ones.
    earlier_neighbours = np.tril(layout, k=-1).sum(axis=1)
    assert (earlier_neighbours == np.minimum(np.arange(n), m)).all()
    assert (degree(layout) >= m).all()


def test_barabasi_albert_degrees_follow_the_power_law():
    m = 3
    degrees = degree(barabasi_albert(5000, m, seed=2))
    # P(degree >= d) = m (m + 1) / (d (d + 1)) for the BA model (Bollobás et al. 2001);
    # attachment uniform instead of degree-proportional would give an exponential tail.
    for d in (6, 12, 20):
        expected = m * (m + 1) / (d * (d + 1))
        assert (degrees >= d).mean() == pytest.approx(expected, rel=0.15)
    assert degrees.max() > 10 * degrees.mean()


def test_barabasi_albert_is_reproducible():
    assert (barabasi_albert(300, 4, seed=5) == barabasi_albert(300, 4, seed=5)).all()
    assert (barabasi_albert(300, 4, seed=5) != barabasi_albert(300, 4, seed=6)).any()


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((1, 1), {}, ValueError, r"n must be >= 2; got 1"),
        ((10, 0), {}, ValueError, r"m must be in \[1, 9\]; got 0"),
        ((10, 10), {}, ValueError, r"m must be in \[1, 9\]; got 10"),
        ((10.0, 2), {}, TypeError, r"n must be an int; got float"),
        ((10, 2.0), {}, TypeError, r"m must be an int; got float"),
        ((10, 2), {"self_loops": 1}, TypeError, r"self_loops must be a bool; got int"),
        ((10, 2), {"seed": -5}, ValueError, r"seed must be >= 0; got -5"),
    ],
)
def test_barabasi_albert_validates(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        barabasi_albert(*args, **kwargs)


# -- watts_strogatz_1d -------------------------------------------------------------


def _ring_distance(n):
    offset = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    return np.minimum(offset, n - offset)


@settings(deadline=None)
@given(st.data(), st.integers(1, 50), st.booleans())
def test_watts_strogatz_1d_without_rewiring_is_the_ring_lattice(data, n, self_loops):
    k = data.draw(st.sampled_from(range(0, n, 2)))
    layout = watts_strogatz_1d(n, k, 0.0, seed=0, self_loops=self_loops)
    _assert_graph(layout, n, self_loops)
    distance = _ring_distance(n)
    assert ((layout != 0) == ((distance >= 1) & (distance <= k // 2) | (self_loops & (distance == 0)))).all()
    assert (degree(layout) == k).all()


@settings(deadline=None)
@given(st.data(), st.integers(1, 60), st.floats(0, 1), st.booleans(), seeds)
def test_watts_strogatz_1d_rewiring_keeps_the_edge_count(data, n, p, self_loops, seed):
    k = data.draw(st.sampled_from(range(0, n, 2)))
    layout = watts_strogatz_1d(n, k, p, seed=seed, self_loops=self_loops)
    _assert_graph(layout, n, self_loops)
    assert _edge_count(layout) == n * k // 2


@pytest.mark.parametrize("n, k", [(9, 2), (12, 4), (40, 6), (101, 10)])
def test_watts_strogatz_1d_lattice_measures(n, k):
    layout = watts_strogatz_1d(n, k, 0.0)
    # Nodes at ring distance d are ceil(d / (k / 2)) hops apart.
    hops = np.ceil(_ring_distance(n)[0, 1:] / (k // 2))
    assert average_shortest_path_length(layout) == pytest.approx(hops.mean())
    assert clustering_coefficient(layout) == pytest.approx(3 * (k - 2) / (4 * (k - 1)))


def test_watts_strogatz_1d_rewires_a_fraction_p_of_edges():
    n, k, p = 1000, 10, 0.2
    lattice = watts_strogatz_1d(n, k, 0.0, self_loops=False)
    rewired = watts_strogatz_1d(n, k, p, seed=4, self_loops=False)
    moved = _edge_count(lattice & ~rewired)
    # Binomial(5000, 0.2): mean 1000, sd 28; re-creating a removed lattice edge is rare.
    assert moved == pytest.approx(p * n * k / 2, rel=0.1)


def test_watts_strogatz_1d_is_a_small_world():
    n, k = 1000, 10
    lattice = watts_strogatz_1d(n, k, 0.0)
    small_world = watts_strogatz_1d(n, k, 0.05, seed=0)
    path_ratio = average_shortest_path_length(small_world) / average_shortest_path_length(lattice)
    clustering_ratio = clustering_coefficient(small_world) / clustering_coefficient(lattice)
    # Watts & Strogatz (1998), figure 2: at p = 0.05, L(p)/L(0) ~ 0.1 while C(p)/C(0) ~ (1 - p)^3.
    assert path_ratio < 0.25
    assert clustering_ratio > 0.75


def test_watts_strogatz_1d_fully_rewired_is_random():
    summary = small_world_summary(watts_strogatz_1d(1000, 10, 1.0, seed=1))
    assert summary["path_length"] == pytest.approx(summary["random_path_length"], rel=0.1)
    assert summary["clustering"] < 3 * summary["random_clustering"]


def test_watts_strogatz_1d_saturated_and_crowded_nodes():
    # Every node already touches all others: nothing can be rewired.
    assert (watts_strogatz_1d(7, 6, 1.0, seed=0) == 1).all()
    # Degree 6 of 10 nodes: free targets come from the explicit candidate list.
    layout = watts_strogatz_1d(10, 6, 1.0, seed=0, self_loops=False)
    _assert_graph(layout, 10, False)
    assert _edge_count(layout) == 30


def test_watts_strogatz_1d_is_reproducible():
    assert (watts_strogatz_1d(200, 6, 0.3, seed=9) == watts_strogatz_1d(200, 6, 0.3, seed=9)).all()
    assert (watts_strogatz_1d(200, 6, 0.3, seed=9) != watts_strogatz_1d(200, 6, 0.3, seed=10)).any()


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((0, 0, 0.1), {}, ValueError, r"n must be >= 1; got 0"),
        ((10, 3, 0.1), {}, ValueError, r"k must be even .*; got 3"),
        ((10, 10, 0.1), {}, ValueError, r"k must be in \[0, 9\]; got 10"),
        ((10, -2, 0.1), {}, ValueError, r"k must be in \[0, 9\]; got -2"),
        ((10, 2.0, 0.1), {}, TypeError, r"k must be an int; got float"),
        ((10, 2, 1.5), {}, ValueError, r"p must be in \[0, 1\]; got 1.5"),
        ((10, 2, math.nan), {}, ValueError, r"p must be in \[0, 1\]; got nan"),
        ((10, 2, None), {}, TypeError, r"p must be a real number; got NoneType"),
        ((10, 2, 0.1), {"self_loops": "yes"}, TypeError, r"self_loops must be a bool; got str"),
        ((10, 2, 0.1), {"seed": [1]}, TypeError, r"seed must be an int, None or numpy.random.Generator"),
    ],
)
def test_watts_strogatz_1d_validates(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        watts_strogatz_1d(*args, **kwargs)


# -- watts_strogatz_2d -------------------------------------------------------------


def _torus_chebyshev(side):
    i, j = np.divmod(np.arange(side * side), side)
    di = np.abs(i[:, None] - i[None, :])
    dj = np.abs(j[:, None] - j[None, :])
    return np.maximum(np.minimum(di, side - di), np.minimum(dj, side - dj))


@settings(deadline=None)
@given(st.data(), st.integers(0, 3), st.booleans())
def test_watts_strogatz_2d_without_rewiring_is_the_moore_lattice(data, r, self_loops):
    side = data.draw(st.integers(2 * r + 1, 12))
    k = (2 * r + 1) ** 2 - 1
    layout = watts_strogatz_2d(side, k, 0.0, self_loops=self_loops)
    _assert_graph(layout, side * side, self_loops)
    distance = _torus_chebyshev(side)
    assert ((layout != 0) == ((distance >= 1) & (distance <= r) | (self_loops & (distance == 0)))).all()
    assert (degree(layout) == k).all()


@settings(deadline=None)
@given(st.data(), st.integers(0, 2), st.floats(0, 1), seeds)
def test_watts_strogatz_2d_rewiring_keeps_the_edge_count(data, r, p, seed):
    side = data.draw(st.integers(2 * r + 1, 10))
    k = (2 * r + 1) ** 2 - 1
    layout = watts_strogatz_2d(side, k, p, seed=seed)
    _assert_graph(layout, side * side, True)
    assert _edge_count(layout) == side * side * k // 2


def test_watts_strogatz_2d_is_a_small_world():
    lattice = watts_strogatz_2d(32, 8, 0.0)
    small_world = watts_strogatz_2d(32, 8, 0.05, seed=0)
    path_ratio = average_shortest_path_length(small_world) / average_shortest_path_length(lattice)
    clustering_ratio = clustering_coefficient(small_world) / clustering_coefficient(lattice)
    assert path_ratio < 0.75
    assert clustering_ratio > 0.75


def test_watts_strogatz_2d_is_reproducible():
    assert (watts_strogatz_2d(10, 8, 0.3, seed=1) == watts_strogatz_2d(10, 8, 0.3, seed=1)).all()
    assert (watts_strogatz_2d(10, 8, 0.3, seed=1) != watts_strogatz_2d(10, 8, 0.3, seed=2)).any()


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((0, 8, 0.1), ValueError, r"side must be >= 1; got 0"),
        ((8, 4, 0.1), ValueError, r"k must be \(2r\+1\)\^2 - 1 .*; got 4"),
        ((8, -1, 0.1), ValueError, r"k must be >= 0; got -1"),
        ((4, 24, 0.1), ValueError, r"side must be >= 2r \+ 1 = 5 for k = 24; got 4"),
        ((8, 8, 2), ValueError, r"p must be in \[0, 1\]; got 2"),
        ((8.0, 8, 0.1), TypeError, r"side must be an int; got float"),
    ],
)
def test_watts_strogatz_2d_validates(args, error, message):
    with pytest.raises(error, match=message):
        watts_strogatz_2d(*args)


# -- measures ----------------------------------------------------------------------


def test_degree_symmetrizes_and_ignores_the_diagonal():
    layout = np.array([[1, 1, 0, 0], [0, 1, 0, 1], [0, 0, 1, 0], [1, 1, 0, 0]])
    assert degree(layout).tolist() == [2, 2, 0, 2]
    assert degree(layout).dtype == np.int64


def test_complete_graph_measures():
    layout = np.ones((6, 6), dtype=np.uint8)
    assert average_shortest_path_length(layout) == 1.0
    assert clustering_coefficient(layout) == 1.0


def _networkx_graph(layout):
    adjacent = (layout | layout.T).astype(np.uint8)
    np.fill_diagonal(adjacent, 0)
    return nx.from_numpy_array(adjacent)


@pytest.mark.parametrize(
    "layout",
    [
        barabasi_albert(200, 2, seed=0),
        watts_strogatz_1d(300, 6, 0.1, seed=0),
        watts_strogatz_2d(12, 8, 0.2, seed=0),
        watts_strogatz_2d(9, 24, 0.0),
        random_layout(120, density=0.05, seed=0),  # directed: read as undirected
    ],
    ids=["ba", "ws1d", "ws2d", "ws2d-lattice", "random-directed"],
)
def test_measures_match_networkx(layout):
    graph = _networkx_graph(layout)
    assert clustering_coefficient(layout) == pytest.approx(nx.average_clustering(graph), abs=1e-12)
    assert degree(layout).tolist() == [d for _, d in graph.degree()]
    assert average_shortest_path_length(layout) == pytest.approx(nx.average_shortest_path_length(graph))


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 14).flatmap(lambda n: st.lists(st.booleans(), min_size=n * n, max_size=n * n)))
def test_measures_match_networkx_on_small_graphs(bits):
    n = math.isqrt(len(bits))
    layout = np.array(bits, dtype=np.uint8).reshape(n, n)
    graph = _networkx_graph(layout)
    assert clustering_coefficient(layout) == pytest.approx(nx.average_clustering(graph), abs=1e-12)
    if nx.is_connected(graph):
        assert average_shortest_path_length(layout) == pytest.approx(nx.average_shortest_path_length(graph))
    else:
        with pytest.raises(ValueError, match="layout must describe a connected graph"):
            average_shortest_path_length(layout)


def test_small_world_summary():
    layout = watts_strogatz_1d(500, 8, 0.05, seed=3)
    summary = small_world_summary(layout)
    assert set(summary) == {
        "n_nodes",
        "density",
        "mean_degree",
        "path_length",
        "clustering",
        "random_path_length",
        "random_clustering",
        "sigma",
    }
    assert summary["n_nodes"] == 500
    assert summary["density"] == pytest.approx(layout.sum() / 500**2)
    assert summary["mean_degree"] == 8.0
    assert summary["path_length"] == average_shortest_path_length(layout)
    assert summary["clustering"] == clustering_coefficient(layout)
    assert summary["random_clustering"] == pytest.approx(8 / 499)
    random_path_length = (math.log(500) - np.euler_gamma) / math.log(8) + 0.5
    assert summary["random_path_length"] == pytest.approx(random_path_length)
    expected_sigma = (summary["clustering"] / summary["random_clustering"]) / (
        summary["path_length"] / summary["random_path_length"]
    )
    assert summary["sigma"] == pytest.approx(expected_sigma)
    assert summary["sigma"] > 5


def test_small_world_summary_without_a_random_path_estimate():
    summary = small_world_summary(np.array([[0, 1], [1, 0]]))  # mean degree 1: ln <k> = 0
    assert summary["path_length"] == 1.0
    assert math.isnan(summary["random_path_length"]) and math.isnan(summary["sigma"])


@pytest.mark.parametrize(
    "measure", [degree, average_shortest_path_length, clustering_coefficient, small_world_summary]
)
@pytest.mark.parametrize(
    "layout, message",
    [
        (np.ones((3, 4)), r"layout must be square to be read as a graph; got shape \(3, 4\)"),
        (np.ones(4), r"layout must be 2-D"),
        (np.array([[0, np.nan], [1, 0]]), r"layout must hold finite numbers"),
        (np.array([[0, np.inf], [1, 0]]), r"layout must hold finite numbers"),
    ],
)
def test_measures_validate_layout(measure, layout, message):
    with pytest.raises(ValueError, match=message):
        measure(layout)


def test_path_length_needs_two_connected_nodes():
    with pytest.raises(ValueError, match=r"layout must have at least 2 nodes .*; got shape \(1, 1\)"):
        average_shortest_path_length(np.ones((1, 1)))
    two_triangles = np.kron(np.eye(2, dtype=np.uint8), np.ones((3, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"layout must describe a connected graph; got 2 components"):
        average_shortest_path_length(two_triangles)
    with pytest.raises(ValueError, match=r"got 2 components"):
        small_world_summary(two_triangles)


# -- small_world_layout, layout_report ---------------------------------------------
@pytest.mark.parametrize("kind", ["barabasi_albert", "watts_strogatz"])
def test_small_world_layout_hits_the_block_budget(kind):
    for n, blocks in [(16, 64), (32, 200), (64, 600)]:
        layout = small_world_layout(n, blocks, kind, seed=0)
        assert layout.shape == (n, n) and (np.diag(layout) == 1).all() and (layout == layout.T).all()
        assert int(layout.sum()) - blocks in (0, 1)
        layout_report(layout)  # connected, or it raises
    assert (small_world_layout(16, 64, kind, seed=3) == small_world_layout(16, 64, kind, seed=3)).all()


def test_layout_report():
    report = layout_report(small_world_layout(64, 64 * 7, "watts_strogatz", seed=0, rewire=0.05))
    assert report["path_length"] > 1 and report["sampled_random_path_length"] > 1
    assert report["clustering"] > 2 * report["sampled_random_clustering"]  # the small world's mark


def test_small_world_layout_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="kind must be 'barabasi_albert' or 'watts_strogatz'"):
        small_world_layout(8, 16, "erdos_renyi")

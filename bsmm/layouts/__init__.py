"""Layouts of block-sparse matrices: seeded generators and graph measures.

:mod:`bsmm.layouts.generators` makes layouts (uniform, skewed, Barabási–Albert,
Watts–Strogatz), :mod:`bsmm.layouts.measures` reads a square layout as a graph
(degrees, path lengths, clustering), and :mod:`bsmm.layouts.small_world` sizes
small-world layouts to a block budget and reports on them.

>>> from bsmm.layouts import degree, watts_strogatz_1d
>>> degree(watts_strogatz_1d(6, 2, 0.0)).tolist()
[2, 2, 2, 2, 2, 2]
"""

from bsmm.layouts.generators import (
    barabasi_albert,
    random_layout,
    skewed_layout,
    watts_strogatz_1d,
    watts_strogatz_2d,
)
from bsmm.layouts.measures import (
    average_shortest_path_length,
    clustering_coefficient,
    degree,
    small_world_summary,
)
from bsmm.layouts.small_world import layout_report, small_world_layout

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
    "small_world_layout",
    "layout_report",
]

"""Learned structure against fixed structure at equal density, for the character-level LSTM: which blocks
should a block-sparse recurrent layer keep?

The model is the seed's (``examples/char_lstm/experiment_torch.py``'s ``CharModel``): an embedding, one
``bsmm.torch.BlockSparseLSTM`` (default hidden 2048, block 32) whose input and recurrent matrices share one
layout (``input_layout="recurrent"``), and a linear read-out, trained as a character-level language model
on Python's own sources (``examples.char_lstm.text``) by truncated BPTT: ``--batch`` streams of
``--bptt``-character windows, the state carried from one window to the next. Each seed's
Barabási–Albert layout of ``--density`` fixes the block count ``m`` of the (H/bs, H/bs) graph; every
method ends with ``4m`` blocks of the (H/bs, 4H/bs) gate layout (that graph tiled over the four gates):

- ``random``: a random graph of ``m`` blocks (the diagonal and uniformly chosen others), tiled, fixed;
- ``smallworld``: the Barabási–Albert graph, tiled, fixed (the seed's choice);
- ``rigl``: the random layout, then drop and regrow by dense-gradient norm every ``--every`` steps until 3/4
  of the run (``bsmm.torch.DynamicSparsity(criterion="rigl")``, cosine drop fraction from ``--drop-fraction``,
  0.3, grown blocks at ``--init``, zero): the growth
  signal is the block norms of ``dWh = Σ_t h_{t-1}ᵀ·dz_t`` and ``dWx`` together (:mod:`bsmm.torch.dynamic_lstm`);
  each block of each gate moves on its own, so the layout need not stay tiled;
- ``set``: the same, regrowing at random (``criterion="set"``);
- ``prune``: every block present for the first half of the run, then the ``4m`` blocks of largest norm
  (``Wh``'s and ``Wx``'s together) kept for the second, in a new layer (the LSTM's optimizer state
  starts afresh; the embedding's and read-out's go on).

L0 gates (the transformer half's ``l0``) are left out: ``bsmm.torch.gate_layer`` gates a
``BlockSparseLinear`` only.

Every method gets the same steps, batch, windows and seeds (``--seeds``). The script records the training
loss every ``--log-every`` steps, held-out bits per character at the end, and, for each final layout, the
spread of its block-column degrees, the share of the dense gradient on its blocks (``gradient_share``) and
the small-world measures (``bsmm.layouts.layout_report``) of its graph: block ``c`` linked to hidden block
``k`` where any gate holds block ``(c, k)``. It writes JSON, a
Markdown table (mean ± s.d. over seeds) and, with ``--plot``, the loss curves.

Parameters are float32 and the products TF32 on CUDA, not the seed experiment's bfloat16 copies of
float32 masters: ``DynamicSparsity`` moves the optimizer state of the parameters the optimizer holds, and
a second copy of each weight would not follow its blocks.

    python examples/learned_structure/experiment_lstm.py --steps 1000 --seeds 0,1,2 --json out.json \\
        --markdown out.md --plot out.png
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import time
import types

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import bsmm.torch  # noqa: E402
from bsmm.layouts import measures  # noqa: E402
from bsmm.layouts.small_world import layout_report, small_world_layout  # noqa: E402
from bsmm.torch.dynamic_lstm import growth_scores, slot_norms  # noqa: E402
from examples.char_lstm.experiment_torch import CharModel, bits_per_char  # noqa: E402
from examples.char_lstm.text import char_corpus, stream_chunks  # noqa: E402
from examples.learned_structure.experiment_torch import (  # noqa: E402
    checked_methods, common_arguments, degree_spread, run_methods)

METHODS = ("random", "smallworld", "rigl", "set", "prune")
#: The measures of :func:`bsmm.layouts.small_world.layout_report` kept for each final layout.
GRAPH_MEASURES = ("clustering", "path_length", "sigma", "mean_degree", "sampled_random_clustering",
                  "sampled_random_path_length")


def random_graph(blocks: int, count: int, seed: int) -> np.ndarray:
    """(blocks, blocks) uint8: the diagonal (each hidden block feeds itself, as in the small-world graphs)
    and ``count - blocks`` other blocks chosen uniformly."""
    layout = np.eye(blocks, dtype=np.uint8)
    others = np.flatnonzero(layout.ravel() == 0)
    chosen = np.random.default_rng(seed).choice(others, size=count - blocks, replace=False)
    layout.ravel()[chosen] = 1
    return layout


def start_layout(method: str, hidden_blocks: int, count: int, seed: int, small_world: np.ndarray) -> np.ndarray:
    """The square recurrent layout a method starts from (tiled over the gates by the layer)."""
    if method == "smallworld":
        return small_world
    if method == "prune":
        return np.ones((hidden_blocks, hidden_blocks), np.uint8)
    return random_graph(hidden_blocks, count, seed)


def lstm_of(layout: np.ndarray, args) -> bsmm.torch.BlockSparseLSTM:
    return bsmm.torch.BlockSparseLSTM(args.hidden, args.hidden, layout, block_size=args.block_size,
                                      input_layout="recurrent", tf32=args.device == "cuda", device=args.device)


def pruned(lstm: bsmm.torch.BlockSparseLSTM, blocks: int, args) -> bsmm.torch.BlockSparseLSTM:
    """A new layer of ``lstm``'s ``blocks`` blocks of largest norm (``Wh``'s and ``Wx``'s together), their values kept."""
    index = lstm._recurrent.index
    kept = np.sort(np.argsort(-slot_norms(lstm).cpu().numpy(), kind="stable")[:blocks])  # old slots, row-major
    layout = np.zeros(index.layout.shape, np.uint8)
    layout[index.rows[kept], index.indices[kept]] = 1
    new = lstm_of(layout, args)
    with torch.no_grad():
        slots = torch.as_tensor(kept, device=lstm.weight_hh.device)
        new.weight_hh.copy_(lstm.weight_hh[slots])
        new.weight_ih.copy_(lstm.weight_ih[slots])
        new.bias.copy_(lstm.bias)
    return new


def graph_measures(layout: np.ndarray, seed: int) -> dict:
    """The small-world measures of a gate layout's graph (see the module docstring); path lengths NaN
    where it came out disconnected."""
    hidden_blocks = layout.shape[0]
    graph = (layout.reshape(hidden_blocks, 4, hidden_blocks) != 0).any(axis=1).astype(np.uint8)
    try:
        report = layout_report(graph, seed)
    except ValueError:  # disconnected
        report = {"clustering": measures.clustering_coefficient(graph), "mean_degree": float(
            measures.degree(graph).mean())}
    return {name: float(report.get(name, math.nan)) for name in GRAPH_MEASURES}


def gradient_share(model: CharModel, ids: np.ndarray, args) -> float:
    """The share of the dense gradient's squared norm (``dWh`` and ``dWx``, every block) that falls on the
    blocks ``model``'s LSTM holds, for the first window of ``ids`` from a zero state (a random layout's is
    near its density; RigL grew blocks where it was large)."""
    entries = []

    def keep(h_in, x, dz):
        entries.append(((h_in.detach(), x.detach()), dz.detach().clone()))
    handle = model.lstm.register_gradient_capture(lambda: keep)
    x, y = next(stream_chunks(ids, args.batch, args.bptt))
    try:
        logits, _ = model(torch.from_numpy(x).long().to(args.device))
        target = torch.from_numpy(y).long().to(args.device).flatten()
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), target).backward()
    finally:
        handle.remove()
    model.zero_grad(set_to_none=True)
    squares = growth_scores(entries, model.lstm, "l2") ** 2
    return float(squares[model.lstm.recurrent_layout.cpu().numpy() != 0].sum() / squares.sum())


def run(method: str, seed: int, corpus, args) -> dict:
    torch.manual_seed(seed)
    hidden_blocks = args.hidden // args.block_size
    small_world = small_world_layout(hidden_blocks, round(args.density * hidden_blocks**2), "barabasi_albert", seed)
    count = int(small_world.sum())  # the graph's blocks: 4·count in the gate layout, for every method
    model = CharModel(corpus.vocab_size, lstm_of(start_layout(method, hidden_blocks, count, seed, small_world), args),
                      args.hidden).to(args.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    sparsity = None
    if method in ("rigl", "set"):
        sparsity = bsmm.torch.DynamicSparsity(model, optimizer, criterion=method, drop_fraction=args.drop_fraction,
                                              every=args.every, end=max(1, 3 * args.steps // 4), init=args.init,
                                              grace=args.grace, seed=seed)
    windows = stream_chunks(corpus.train, args.batch, args.bptt)
    state, curve, began = None, [], time.perf_counter()
    for step in range(1, args.steps + 1):
        if method == "prune" and step == args.steps // 2 + 1:  # dense half done: keep the largest blocks
            model.lstm = pruned(model.lstm, 4 * count, args)
            old, optimizer = optimizer, torch.optim.Adam(model.parameters(), lr=args.lr)
            for parameter in model.parameters():  # (the embedding and read-out go on as they were)
                if parameter in old.state:
                    optimizer.state[parameter] = old.state[parameter]
        x, y = next(windows, (None, None))
        if x is None:  # an epoch done: the streams start again, from a zero state
            windows, state = stream_chunks(corpus.train, args.batch, args.bptt), None
            x, y = next(windows)
        optimizer.zero_grad(set_to_none=True)
        logits, final = model(torch.from_numpy(x).long().to(args.device), state)
        state = tuple(s.detach() for s in final)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                 torch.from_numpy(y).long().to(args.device).flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps:
            curve.append((step, loss.item()))
    seconds = time.perf_counter() - began
    layout = model.lstm.recurrent_layout.cpu().numpy()
    evaluation = types.SimpleNamespace(batch=args.batch, steps=args.bptt, device=args.device)
    return {"method": method, "seed": seed, "steps": args.steps, "train_seconds": seconds, "curve": curve,
            "valid_bpc": bits_per_char(model, corpus.valid[:args.eval_chars], evaluation),
            "density": float(layout.mean()), "blocks": int(layout.sum()), "degree_spread": degree_spread(layout),
            "gradient_share": gradient_share(model, corpus.valid[:args.eval_chars], args),
            "layout_updates": len(sparsity.history) if sparsity else 0, **graph_measures(layout, seed)}


def _mean_sd(values) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.4f}"


def markdown(results: list[dict], args) -> str:
    lines = [f"Character-level LSTM, hidden {args.hidden}, blocks {args.block_size}, density {args.density:.0%} "
             f"(input and recurrent layouts shared); {args.steps} steps of {args.batch} × {args.bptt} characters; "
             f"seeds {args.seeds}; RigL/SET drop fraction {args.drop_fraction} every {args.every} steps, grown blocks "
             f"at {args.init}, grace {args.grace}.", "",
             "| method | held-out bits/char | final density | block-column degree spread | dense-gradient share | "
             "clustering | path length | sigma | seconds a run |", "|" + " --- |" * 9]
    for method in args.methods:
        runs = [r for r in results if r["method"] == method]
        lines.append(f"| {method} | {_mean_sd([r['valid_bpc'] for r in runs])} | "
                     f"{statistics.mean(r['density'] for r in runs):.4f} | "
                     f"{_mean_sd([r['degree_spread'] for r in runs])} | "
                     f"{_mean_sd([r['gradient_share'] for r in runs])} | {_mean_sd([r['clustering'] for r in runs])} | "
                     f"{_mean_sd([r['path_length'] for r in runs])} | {_mean_sd([r['sigma'] for r in runs])} | "
                     f"{statistics.mean(r['train_seconds'] for r in runs):.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, METHODS)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--bptt", type=int, default=64, help="characters a window of truncated BPTT")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipped to")
    parser.add_argument("--eval-chars", type=int, default=262_144)
    args = parser.parse_args(argv)
    checked_methods(parser, args, METHODS)
    if args.hidden % args.block_size:
        parser.error(f"--hidden ({args.hidden}) must be a multiple of --block-size ({args.block_size})")
    corpus = char_corpus(args.max_chars)
    if min(corpus.valid.size, args.eval_chars) < args.batch * args.bptt:
        parser.error(f"held-out text of {min(corpus.valid.size, args.eval_chars)} characters holds no window of "
                     f"{args.batch} × {args.bptt}: raise --eval-chars or --max-chars")
    return run_methods(run, corpus, args, markdown, lambda r: (
        f"{r['valid_bpc']:.4f} bits/char, density {r['density']:.4f}, clustering {r['clustering']:.3f}, "
        f"{r['train_seconds']:.1f} s"))


if __name__ == "__main__":
    sys.exit(main())

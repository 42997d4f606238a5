"""Learned structure against fixed structure at equal density: which blocks should a block-sparse
transformer keep?

A small decoder (the transformer benchmark's, default d 512, MLP 2048 SwiGLU, 4 layers, 8 heads) is
trained as a character-level language model on Python's own sources (``examples.char_lstm.text``).
Its MLP projections keep ``--density`` of their blocks, chosen in one of these ways:

- ``random``: a random layout, fixed (``sparsify(layout="random")``);
- ``rigl``: that random layout, then drop and regrow by dense-gradient norm every ``--every`` steps until
  3/4 of the run (``bsmm.torch.DynamicSparsity(criterion="rigl")``, cosine drop fraction from
  ``--drop-fraction``, 0.3, grown blocks at ``--init``, zero);
- ``set``: the same, regrowing at random (``criterion="set"``);
- ``l0``: the projections start at ``--l0-start`` × density with hard-concrete gates (``bsmm.torch.gate_layer``).
  A penalty holds the expected fraction of open gates at the target. Before the last quarter of the run,
  each layer keeps the blocks of its largest gates, as many as the density gives
  (``bsmm.torch.prune_by_gates(layer, blocks)``), and the last quarter trains the pruned model;
- ``prune``: dense MLPs for the first half of the run, then the blocks of largest norm kept
  (``sparsify(layout="magnitude")``) for the second.

Every way gets the same steps, batch and seeds (``--seeds``). The script records the training loss every
``--log-every`` steps and bits per character on held-out text at the end. For each learned layout it
records the spread of its block-column degrees (the coefficient of variation; a random layout's is
small). It writes JSON, a Markdown table (mean ± spread over seeds) and, with ``--plot``, the loss curves.

    python examples/learned_structure/experiment_torch.py --steps 1000 --seeds 0,1,2 --json out.json \\
        --markdown out.md --plot out.png
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import bsmm.torch  # noqa: E402
from bsmm.cli.transformer_bench import Decoder, DecoderConfig  # noqa: E402
from examples.char_lstm.text import char_corpus  # noqa: E402

METHODS = ("random", "rigl", "set", "l0", "prune")


def sparse_layers(model) -> dict:
    return {name: m for name, m in model.named_modules() if isinstance(m, bsmm.torch.BlockSparseLinear)}


def batches(ids: np.ndarray, args, generator: np.random.Generator):
    """Random windows of ``sequence + 1`` training characters, ``batch`` a step, forever."""
    while True:
        starts = generator.integers(0, len(ids) - args.sequence - 1, args.batch)
        window = np.stack([ids[s:s + args.sequence + 1] for s in starts])
        yield torch.from_numpy(window).long().to(args.device)


def loss_of(model, tokens, args) -> torch.Tensor:
    with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def bits_per_char(model, ids: np.ndarray, args) -> float:
    """Held-out bits per character over consecutive windows of the first ``--eval-chars`` characters."""
    model.eval()
    length = args.sequence + 1
    count = min(len(ids), args.eval_chars) // length
    if count == 0:
        raise ValueError(f"held-out text of {len(ids)} characters (--eval-chars {args.eval_chars}) holds no window "
                         f"of {length}: raise --max-chars or --eval-chars")
    windows = torch.from_numpy(ids[:count * length].reshape(count, length)).long().to(args.device)
    total = 0.0
    with torch.no_grad():
        for start in range(0, count, args.batch):
            total += loss_of(model, windows[start:start + args.batch], args).item() * len(
                windows[start:start + args.batch])
    model.train()
    return total / count / math.log(2)


def sparsified(model, density: float, args, seed: int, layout: str = "random"):
    return bsmm.torch.sparsify(model, density, args.block_size, include="*mlp*", layout=layout, seed=seed)


def rebuilt_optimizer(model, old: torch.optim.Optimizer, args) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters now, keeping the state of those the old one held (the attention and
    embeddings go on as they were; only the replaced MLP projections start afresh)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    for parameter in model.parameters():
        if parameter in old.state:
            optimizer.state[parameter] = old.state[parameter]
    return optimizer


def degree_spread(layout: np.ndarray) -> float:
    """Coefficient of variation of a layout's block-column degrees (blocks per column)."""
    degrees = (layout != 0).sum(axis=0)
    return float(degrees.std() / degrees.mean()) if degrees.mean() else 0.0


def run(method: str, seed: int, corpus, args) -> dict:
    torch.manual_seed(seed)
    config = DecoderConfig(d_model=args.d_model, d_hidden=args.d_hidden, layers=args.layers, heads=args.heads,
                           vocab=corpus.vocab_size, batch=args.batch, sequence=args.sequence, prompt=1, new_tokens=1)
    with torch.device(args.device):
        model = Decoder(config)
    start_density = min(1.0, args.density * args.l0_start) if method == "l0" else args.density
    if method != "prune":
        model = sparsified(model, start_density, args, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sparsity, gates = None, {}
    if method in ("rigl", "set"):
        sparsity = bsmm.torch.DynamicSparsity(model, optimizer, criterion=method, drop_fraction=args.drop_fraction,
                                              every=args.every, end=max(1, 3 * args.steps // 4), init=args.init,
                                              grace=args.grace, seed=seed)
    if method == "l0":
        gates = {name: bsmm.torch.gate_layer(layer) for name, layer in sparse_layers(model).items()}
        optimizer.add_param_group({"params": [g.log_alpha for g in gates.values()], "lr": args.lr * 10})
    data = batches(corpus.train, args, np.random.default_rng(seed))
    curve, began = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        if method == "prune" and step == args.steps // 2 + 1:  # dense half done: keep the largest blocks
            model = sparsified(model, args.density, args, seed, layout="magnitude")
            optimizer = rebuilt_optimizer(model, optimizer, args)
        if method == "l0" and step == 3 * args.steps // 4 + 1:  # gates decided: train the pruned model
            for name, layer in sparse_layers(model).items():
                kept = round(args.density * layer.op.layout.size)  # the target density exactly
                model.set_submodule(name, bsmm.torch.prune_by_gates(layer.eval(), kept).train())
            gates = {}
            optimizer = rebuilt_optimizer(model, optimizer, args)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, next(data), args)
        total = loss
        if gates:  # the fraction of open gates held at the target density (of the starting blocks)
            total = loss + args.l0_weight * sum(g.penalty(target=args.density / start_density)
                                                for g in gates.values())
        total.backward()
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps:
            curve.append((step, loss.item()))
    layers = sparse_layers(model)
    blocks = sum(layer.op.blocks for layer in layers.values())
    capacity = sum(layer.op.layout.size for layer in layers.values())
    result = {"method": method, "seed": seed, "steps": args.steps, "train_seconds": time.perf_counter() - began,
              "curve": curve, "valid_bpc": bits_per_char(model, corpus.valid, args),
              "density": blocks / capacity if capacity else 1.0,
              "degree_spread": statistics.mean(degree_spread(layer.op.layout) for layer in layers.values()),
              "layout_updates": len(sparsity.history) if sparsity else 0}
    return result


def markdown(results: list[dict], args) -> str:
    lines = [f"Decoder d {args.d_model}, MLP {args.d_hidden}, {args.layers} layers; MLP blocks {args.block_size}, "
             f"density {args.density:.0%}; {args.steps} steps of {args.batch} × {args.sequence} characters; "
             f"seeds {args.seeds}.", "",
             "| method | held-out bits/char (mean ± s.d.) | final density | block-column degree spread | "
             "seconds a run |", "| --- | --- | --- | --- | --- |"]
    for method in args.methods:
        runs = [r for r in results if r["method"] == method]
        bpc = [r["valid_bpc"] for r in runs]
        spread = statistics.stdev(bpc) if len(bpc) > 1 else 0.0
        lines.append(f"| {method} | {statistics.mean(bpc):.4f} ± {spread:.4f} | "
                     f"{statistics.mean(r['density'] for r in runs):.3f} | "
                     f"{statistics.mean(r['degree_spread'] for r in runs):.3f} | "
                     f"{statistics.mean(r['train_seconds'] for r in runs):.1f} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for index, method in enumerate(dict.fromkeys(r["method"] for r in results)):
        for r in (r for r in results if r["method"] == method):
            steps, losses = zip(*r["curve"])
            axes.plot(steps, np.array(losses) / math.log(2), color=f"C{index}", alpha=0.7,
                      label=method if r["seed"] == results[0]["seed"] else None)
    axes.set_xlabel("step")
    axes.set_ylabel("training bits/char")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def common_arguments(parser: argparse.ArgumentParser, methods: tuple) -> None:
    """The arguments of both halves of the experiment (this script and ``experiment_lstm.py``)."""
    parser.add_argument("--methods", default=",".join(methods), help=f"comma-separated, of {', '.join(methods)}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps a run")
    parser.add_argument("--every", type=int, default=100, help="steps between RigL/SET updates")
    parser.add_argument("--drop-fraction", type=float, default=0.3,
                        help="RigL/SET: fraction of blocks replaced at the first update (cosine decay to 0)")
    parser.add_argument("--init", choices=bsmm.torch.dynamic.INITS, default="zero",
                        help="RigL/SET: values of a grown block")
    parser.add_argument("--grace", type=int, default=0,
                        help="RigL/SET: updates after its growth during which a block is not dropped")
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--max-chars", type=int, default=None, help="corpus characters (default: all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--plot")


def checked_methods(parser: argparse.ArgumentParser, args, methods: tuple) -> None:
    """``args.methods`` as a list, each one of ``methods`` (else the parser's error)."""
    args.methods = [m for m in args.methods.split(",") if m]
    for method in args.methods:
        if method not in methods:
            parser.error(f"--methods: {method!r} is not one of {', '.join(methods)}")


def run_methods(run, corpus, args, markdown, summary) -> int:
    """``run(method, seed, corpus, args)`` for every method and seed (``summary(result)`` printed after
    each), then the table ``markdown(results, args)`` printed and the outputs asked for written."""
    results = []
    for method in args.methods:
        for seed in (int(s) for s in args.seeds.split(",")):
            results.append(run(method, seed, corpus, args))
            print(f"{method} seed {seed}: {summary(results[-1])}", flush=True)
    table = markdown(results, args)
    print(table)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    if args.markdown:
        pathlib.Path(args.markdown).write_text(table)
    if args.plot:
        plot(results, args.plot)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser, METHODS)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--d-hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=256)
    parser.add_argument("--l0-start", type=float, default=2.0, help="L0: starting density, times --density")
    parser.add_argument("--l0-weight", type=float, default=1.0, help="L0: weight of the target-density penalty")
    parser.add_argument("--eval-chars", type=int, default=200_000)
    args = parser.parse_args(argv)
    checked_methods(parser, args, METHODS)
    return run_methods(run, char_corpus(args.max_chars), args, markdown, lambda r: (
        f"{r['valid_bpc']:.4f} bits/char, density {r['density']:.3f}, {r['train_seconds']:.1f} s"))


if __name__ == "__main__":
    sys.exit(main())

"""The seed's experiment at the seed's scale, in PyTorch: a sparse-wide small-world LSTM against a dense
``nn.LSTM`` of equal parameters, each trained for the same wall-clock time on the same text.

Both are character-level language models on Python's own sources (``examples.char_lstm.text``):
an embedding, one LSTM layer and a linear read-out. The sparse one is ``bsmm.torch.BlockSparseLSTM``
(hidden 12288 by default, block 32, a Barabási–Albert layout of ``--density`` blocks shared by the
input and recurrent matrices, as the seed's); the dense one is cuDNN's ``nn.LSTM`` of the width whose
layer holds as many parameters (``bsmm.cli.model_bench.equal_parameter_width``). Parameters are
bfloat16 for the products, with float32 master copies that Adam updates (mixed precision); truncated
BPTT over ``--batch`` streams of ``--steps`` characters, gradients clipped to norm 1.

Each model trains for ``--budget`` seconds of wall clock (its evaluations are not counted), its
validation bits per character measured on the first ``--curve-chars`` validation characters at
``--points`` moments and, at the end, on ``--eval-chars``. Writes JSON (the curves too) and a
Markdown table; ``--plot`` draws bits/char against training seconds.

    python examples/char_lstm/experiment_torch.py --budget 180 --json out.json --markdown out.md --plot out.png
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import bsmm.torch  # noqa: E402
from bsmm.cli.model_bench import equal_parameter_width  # noqa: E402
from bsmm.layouts.small_world import layout_report  # noqa: E402
from examples.char_lstm.text import char_corpus, stream_chunks  # noqa: E402


class CharModel(torch.nn.Module):
    """Embedding -> one LSTM layer -> linear read-out over the vocabulary."""

    def __init__(self, vocab: int, lstm: torch.nn.Module, width: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.lstm = lstm
        self.head = torch.nn.Linear(lstm.hidden_size, vocab)

    def forward(self, ids, state=None):
        output, state = self.lstm(self.embed(ids), state)
        return self.head(output), state


class MasterAdam:
    """Adam over float32 copies of bfloat16 parameters, written back into them after each step."""

    def __init__(self, parameters, lr: float):
        self.parameters = [p for p in parameters if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.parameters]
        self.adam = torch.optim.Adam(self.masters, lr=lr)

    def step(self, clip: float) -> None:
        for master, p in zip(self.masters, self.parameters):
            master.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(self.masters, clip)
        self.adam.step()
        with torch.no_grad():
            for master, p in zip(self.masters, self.parameters):
                p.copy_(master)
                p.grad = None


def build(kind: str, vocab: int, args) -> tuple[CharModel, dict]:
    dtype = torch.bfloat16
    if kind == "sparse":
        lstm = bsmm.torch.BlockSparseLSTM(args.hidden, args.hidden, block_size=args.block_size, density=args.density,
                                          seed=args.seed, input_layout="recurrent", device=args.device, dtype=dtype)
        layout = lstm.recurrent_layout.cpu().numpy()[:, :args.hidden // args.block_size]
        info = {"hidden": args.hidden, "density": float(lstm._recurrent.index.density)}
        info |= {k: v for k, v in layout_report(layout).items() if isinstance(v, (int, float))}
        width = args.hidden
    else:
        count = sum(p.numel() for p in bsmm.torch.BlockSparseLSTM(
            args.hidden, args.hidden, block_size=args.block_size, density=args.density, seed=args.seed,
            input_layout="recurrent", device="meta").parameters())
        width = equal_parameter_width(count)
        lstm = torch.nn.LSTM(width, width, device=args.device, dtype=dtype)
        lstm.flatten_parameters()  # cuDNN's weights in one buffer (else compacted at every call)
        info = {"hidden": width, "density": 1.0}
    model = CharModel(vocab, lstm, width).to(device=args.device, dtype=dtype)
    info["lstm_parameters"] = sum(p.numel() for p in lstm.parameters())
    info["parameters"] = sum(p.numel() for p in model.parameters())
    return model, info


@torch.no_grad()
def bits_per_char(model: CharModel, ids: np.ndarray, args) -> float:
    total, count, state = 0.0, 0, None
    for x, y in stream_chunks(ids, args.batch, args.steps):
        logits, state = model(torch.from_numpy(x).long().to(args.device), state)
        target = torch.from_numpy(y).long().to(args.device).flatten()
        total += torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target, reduction="sum").item()
        count += y.size
    return total / count / math.log(2)


def _batches(corpus, args):
    """(x, y, state) chunks of truncated BPTT, epoch after epoch; ``state`` is a one-element list the
    update refreshes with the chunk's final state (detached), reset at each epoch."""
    while True:
        state = [None]
        for x, y in stream_chunks(corpus.train, args.batch, args.steps):
            yield x, y, state


def update(model: CharModel, optimizer: "MasterAdam", x, y, state: list, args) -> torch.Tensor:
    """One Adam step on a chunk; the chunk's loss (not synchronized)."""
    logits, final = model(torch.from_numpy(x).long().to(args.device), state[0])
    state[0] = tuple(s.detach() for s in final)
    target = torch.from_numpy(y).long().to(args.device).flatten()
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target)
    loss.backward()
    optimizer.step(args.clip)
    return loss


def train(kind: str, corpus, args) -> dict:
    torch.manual_seed(args.seed)
    model, info = build(kind, corpus.vocab_size, args)
    optimizer = MasterAdam(model.parameters(), args.lr)
    curve_ids = corpus.valid[:args.curve_chars]
    batches = _batches(corpus, args)
    for _ in range(args.warmup):  # kernels compiled and plans made before the clock starts (both models alike)
        update(model, optimizer, *next(batches), args)
    synchronize(args.device)
    trained, updates, curve = 0.0, 0, []
    marks = [args.budget * (k + 1) / args.points for k in range(args.points)]
    started = time.perf_counter()
    while trained < args.budget:
        x, y, state = next(batches)
        begin = time.perf_counter()
        loss = update(model, optimizer, x, y, state, args)
        updates += 1
        if updates % 10 == 0 or trained + (time.perf_counter() - begin) >= marks[0]:
            synchronize(args.device)  # the clock counts finished work
        trained += time.perf_counter() - begin
        if trained >= marks[0]:  # one point for the marks this update passed
            while marks and trained >= marks[0]:
                marks.pop(0)
            curve.append({"seconds": trained, "updates": updates, "chars": updates * args.batch * args.steps,
                          "train_bpc": loss.item() / math.log(2), "valid_bpc": bits_per_char(model, curve_ids, args)})
            print(f"{kind}: {trained:.0f} s, {updates} updates, valid {curve[-1]['valid_bpc']:.3f} bits/char", flush=True)
            if not marks:
                break
    final = bits_per_char(model, corpus.valid[:args.eval_chars], args)
    info |= {"model": kind, "updates": updates, "chars": updates * args.batch * args.steps, "train_seconds": trained,
             "wall_seconds": time.perf_counter() - started, "chars_per_second": updates * args.batch * args.steps / trained,
             "valid_bpc": final, "curve": curve}
    del model, optimizer
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return info


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def markdown(results: list[dict], args, corpus) -> str:
    lines = [f"Character-level LM on Python's sources ({corpus.train.size:,} training, {args.eval_chars:,} validation "
             f"characters scored; vocabulary {corpus.vocab_size}), batch {args.batch} × {args.steps} steps, Adam "
             f"lr {args.lr} on float32 masters of bfloat16 parameters, {args.budget:g} s of training each.", "",
             "| model | hidden | density | LSTM params | all params | updates | chars/s | valid bits/char |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['model']} | {r['hidden']} | {r['density']:.3f} | {r['lstm_parameters']:,} | {r['parameters']:,} | "
                     f"{r['updates']:,} | {r['chars_per_second']:,.0f} | {r['valid_bpc']:.3f} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for r in results:
        label = f"{r['model']}: H {r['hidden']}, {r['density']:.0%} blocks"
        axes.plot([p["seconds"] for p in r["curve"]], [p["valid_bpc"] for p in r["curve"]], marker="o", label=label)
    axes.set_xlabel("training seconds (wall clock, H200)")
    axes.set_ylabel("validation bits / character")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=180.0, help="training seconds each model gets")
    parser.add_argument("--hidden", type=int, default=12288)
    parser.add_argument("--density", type=float, default=0.05)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--points", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="updates before the clock starts")
    parser.add_argument("--curve-chars", type=int, default=65_536)
    parser.add_argument("--eval-chars", type=int, default=262_144)
    parser.add_argument("--models", default="sparse,dense")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test at tiny sizes")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    corpus = char_corpus()
    results = [train(kind, corpus, args) for kind in args.models.split(",")]
    table = markdown(results, args, corpus)
    print(table)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    if args.markdown:
        pathlib.Path(args.markdown).write_text(table + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

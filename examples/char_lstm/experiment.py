"""Dense LSTM vs a wider block-sparse small-world LSTM of the same size, on Python's own sources.

The GPU version of notebook 3: both character-level models (see ``examples.char_lstm.text``)
train for an equal share of a wall-clock budget, then report validation bits
per character, throughput and the layout's path lengths, as JSON and as a
markdown table. The budget covers everything (corpus, kernel compilation,
training, evaluation): after warm-up updates of each model, the time left
less the estimated cost of evaluating is spent on as many updates as fit, the
same number for both models (``--equal-time``: an equal share of the time).

    python examples/char_lstm/experiment.py --budget 240 --json results/lstm_h100.json --markdown results/lstm_h100.md
    python examples/char_lstm/experiment.py --cpu        # a tiny run on NumPy, for smoke tests

Training shows a progress bar on a terminal (``--no-progress`` or ``TQDM_DISABLE=1`` hides it);
``--verbose`` prints bsmm's log: kernel compiles with their time, fallbacks, tuned tiles in effect.

Exit status: 0 on success, 1 if a model failed (its error is in the outputs),
2 if the GPU cannot be used. A watchdog ends the process, printing every
thread's stack, if it runs two minutes past the budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import logging
import math
import pathlib
import platform
import sys
import time
import traceback

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bsmm.layouts.small_world import layout_report  # noqa: E402
from examples.char_lstm.optim import Adam  # noqa: E402
from examples.char_lstm.text import char_corpus, matched_models, stream_chunks, train, train_step  # noqa: E402

#: Defaults per mode; any flag given on the command line wins.
GPU_DEFAULTS = {"dense_hidden": 1024, "sparse_hidden": 4096, "block_size": 32, "batch_size": 64, "steps": 64,
                "budget": 240.0, "max_chars": None, "eval_chars": None}
CPU_DEFAULTS = {"dense_hidden": 128, "sparse_hidden": 256, "block_size": 8, "batch_size": 16, "steps": 32,
                "budget": 30.0, "max_chars": 200_000, "eval_chars": None}
# Characters of each learning-curve evaluation (the final one reads all of --eval-chars).
CURVE_CHARS = 65_536
CURVE_POINTS = 8


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on NumPy (smoke test)")
    parser.add_argument("--budget", type=float, help="seconds of wall clock for everything (GPU default 240)")
    parser.add_argument("--dense-hidden", type=int, help="hidden units of the dense LSTM (default 1024)")
    parser.add_argument("--sparse-hidden", type=int, help="hidden units of the small-world LSTM (default 4096)")
    parser.add_argument("--block-size", type=int, help="block size of the sparse matrices (default 32)")
    parser.add_argument("--kind", default="barabasi_albert", choices=["barabasi_albert", "watts_strogatz"])
    parser.add_argument("--batch-size", type=int, help="parallel streams (default 64)")
    parser.add_argument("--steps", type=int, help="truncated-BPTT length (default 64)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--max-chars", type=int, help="cut the corpus to this many characters (default: all)")
    parser.add_argument("--eval-chars", type=int, help="validation characters of the final evaluation (default all)")
    parser.add_argument("--max-updates", type=int, help="train each model for at most this many updates")
    parser.add_argument("--equal-time", action="store_true",
                        help="split the training time evenly (default: the same number of updates for both)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=pathlib.Path, help="write the results here")
    parser.add_argument("--markdown", type=pathlib.Path, help="write the markdown table here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while training")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print bsmm's log (kernel compiles and their time, fallbacks, tuned tiles)")
    args = parser.parse_args(argv)
    for key, value in (CPU_DEFAULTS if args.cpu else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def array_module(cpu: bool):
    """(xp, synchronize, device description); exits with status 2 if the GPU cannot be used."""
    if cpu:
        try:  # many tiny BLAS products: more threads only wait on each other
            from threadpoolctl import threadpool_limits
            threadpool_limits(1, user_api="blas")
        except ImportError:
            pass
        return np, lambda: None, f"CPU ({platform.processor() or platform.machine()}), NumPy {np.__version__}"
    try:
        import cupy

        if not cupy.cuda.is_available():
            raise RuntimeError("CuPy sees no CUDA device")
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        cupy.zeros(1).sum().item()  # a first kernel: fails here if the driver or NVRTC is broken
    except Exception as error:
        print(f"lstm_experiment: the GPU cannot be used ({type(error).__name__}: {error}); "
              f"run with --cpu for a NumPy smoke test", file=sys.stderr)
        sys.exit(2)
    return cupy, cupy.cuda.Device().synchronize, f"{name}, CuPy {cupy.__version__}"


def timed(synchronize, function):
    synchronize()
    start = time.perf_counter()
    function()
    synchronize()
    return time.perf_counter() - start


def warm_up(model, corpus, args, xp, synchronize) -> dict:
    """Compile every kernel the model needs (on a throwaway copy) and measure an update and an evaluation chunk."""
    params = model.init_params(xp, seed=args.seed)
    optimizer = Adam([params[name] for name in sorted(params)], lr=args.lr)
    chunks = stream_chunks(corpus.train, args.batch_size, args.steps, xp)
    state = (None, None)

    def update():  # train's own step, clipping included; the state carried from update to update
        nonlocal state
        x, y = next(chunks)
        _, state = train_step(model, params, optimizer, x, y, state, args.clip)

    first = timed(synchronize, update)
    x, y = next(chunks)
    timed(synchronize, lambda: model.loss(params, x, y)[0])
    update_seconds = min(timed(synchronize, update) for _ in range(3))
    chunk_seconds = min(timed(synchronize, lambda: float(model.loss(params, x, y)[0])) for _ in range(2))
    return {"first_update_seconds": first, "update_seconds": update_seconds, "eval_chunk_seconds": chunk_seconds}


def plan_training(seconds: float, update_seconds: dict, args) -> dict:
    """{model: (max_updates, time_limit)} sharing ``seconds`` of training between the models.

    By default both models train for the same number of updates (the same
    characters), as many as fit from the measured update times, each with a
    time limit 25 % over its estimate as a safety net; with ``--equal-time``
    each gets an equal share of the time instead.
    """
    if seconds < 10:
        print(f"lstm_experiment: warning: the budget leaves {seconds:.1f} s of training", file=sys.stderr)
    seconds = max(seconds, 1.0)
    if args.equal_time:
        return {name: (args.max_updates, seconds / len(update_seconds)) for name in update_seconds}
    updates = max(1, int(seconds / sum(update_seconds.values())))
    if args.max_updates is not None:
        updates = min(updates, args.max_updates)
    return {name: (updates, 1.25 * updates * each + 2.0) for name, each in update_seconds.items()}


def describe(name: str, model, args) -> dict:
    lstm = model.lstm
    row = {
        "model": name, "hidden": lstm.hidden_size, "params": model.n_params, "lstm_params": lstm.n_params,
        "block_size": lstm.block_size if lstm.recurrent_layout is not None else None,
        "input_density": lstm.input_op.density, "recurrent_density": lstm.recurrent_op.density,
        "layout": args.kind if lstm.recurrent_layout is not None else "dense",
    }
    if lstm.recurrent_layout is not None:
        report = layout_report(lstm.recurrent_layout, seed=args.seed)
        row.update({
            "graph_nodes": report["n_nodes"], "mean_degree": report["mean_degree"],
            "path_length": report["path_length"], "random_path_length": report["sampled_random_path_length"],
            "clustering": report["clustering"], "random_clustering": report["sampled_random_clustering"],
        })
    else:  # every hidden unit feeds every other: one hop
        row.update({"path_length": 1.0, "random_path_length": 1.0})
    return row


def markdown(results: dict) -> str:
    config = results["config"]
    lines = [
        f"# Dense vs small-world LSTM, character level ({results['device']})",
        "",
        f"Corpus: {results['corpus']['train_chars']:,} training and {results['corpus']['valid_chars']:,} validation "
        f"characters of Python {results['python']} standard-library sources (vocabulary "
        f"{results['corpus']['vocab_size']}, sha256 {results['corpus']['sha256'][:12]}). Batch "
        f"{config['batch_size']} streams x {config['steps']} steps (truncated BPTT), Adam lr {config['lr']}, "
        f"clip {config['clip']}, dtype {config['dtype']}, budget {config['budget']:.0f} s for both models "
        f"({results['wall_seconds']:.0f} s used), "
        + ("an equal share of the time each." if config["equal_time"] else "the same number of updates each."),
        "",
        "| model | hidden | params | density Wx / Wh | path length (random) | clustering (random) "
        "| updates | chars | train s | chars/s | valid bpc |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in results["models"]:
        if "error" in row:
            lines.append(f"| {row['model']} | {row.get('hidden', '')} | failed: {row['error']} |" + " |" * 8)
            continue
        clustering = (f"{row['clustering']:.3f} ({row['random_clustering']:.3f})" if "clustering" in row else "-")
        lines.append(
            f"| {row['model']} | {row['hidden']} | {row['params']:,} | {row['input_density']:.3f} / "
            f"{row['recurrent_density']:.3f} | {row['path_length']:.2f} ({row['random_path_length']:.2f}) "
            f"| {clustering} | {row['updates']:,} | {row['chars']:,} | {row['seconds']:.1f} "
            f"| {row['chars_per_second']:,.0f} | {row['valid_bpc']:.3f} |"
        )
    lines += ["", "Path lengths are of the recurrent layout as a graph among hidden blocks; \"random\" is a sampled "
              "Erdős–Rényi graph with as many edges. The dense LSTM's units are one hop apart."]
    return "\n".join(lines) + "\n"


def say(line: str) -> None:
    """A line on stdout, written around a progress bar rather than through it."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def run(args) -> int:
    start = time.perf_counter()
    if args.verbose:
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("bsmm").setLevel(logging.INFO)
    faulthandler.dump_traceback_later(args.budget + 120, exit=True)
    xp, synchronize, device = array_module(args.cpu)
    corpus = char_corpus(max_chars=args.max_chars)
    eval_chars = min(args.eval_chars or corpus.valid.size, corpus.valid.size)
    models = dict(zip(("dense", "small-world"), matched_models(
        corpus.vocab_size, args.dense_hidden, args.sparse_hidden, args.block_size, args.kind, args.seed, args.dtype)))
    rows, plans, failed = {}, {}, False
    for name, model in models.items():
        rows[name] = {"model": name, "hidden": model.lstm.hidden_size}
        print(f"{name}: {model.lstm}, {model.n_params:,} parameters", flush=True)
        try:
            rows[name] = describe(name, model, args)
            plans[name] = warm_up(model, corpus, args, xp, synchronize)
            print(f"  warm-up: {plans[name]}", flush=True)
        except Exception as error:
            rows[name]["error"] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
            failed = True
    chunk_chars = args.batch_size * args.steps
    # What evaluation will cost, from the measured chunk time (curve points plus the final pass), with slack.
    curve_chars = min(CURVE_CHARS, eval_chars)
    eval_cost = {name: 1.5 * plan["eval_chunk_seconds"] / chunk_chars * (eval_chars + CURVE_POINTS * curve_chars)
                 for name, plan in plans.items()}
    left = args.budget - (time.perf_counter() - start) - sum(eval_cost.values()) - 5.0
    limits = plan_training(left, {name: plan["update_seconds"] for name, plan in plans.items()}, args)
    print(f"plan: {limits} (evaluation estimated at "
          f"{', '.join(f'{n} {c:.1f} s' for n, c in eval_cost.items())})", flush=True)
    valid = dataclasses.replace(corpus, valid=corpus.valid[:eval_chars])
    for name, (max_updates, time_limit) in limits.items():
        model = models[name]
        try:
            params = model.init_params(xp, seed=args.seed)
            result = train(
                model, params, valid, batch_size=args.batch_size, steps=args.steps, lr=args.lr, clip=args.clip,
                max_updates=max_updates, time_limit=time_limit,
                eval_every=max(1, math.ceil(time_limit / plans[name]["update_seconds"] / CURVE_POINTS)),
                eval_chars=curve_chars, xp=xp, log=lambda line, name=name: say(f"  {name}: {line}"),
                progress=None if args.no_progress or not sys.stderr.isatty() else name)
            rows[name].update(result, **plans[name])
        except Exception as error:
            rows[name]["error"] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
            failed = True
    faulthandler.cancel_dump_traceback_later()
    results = {
        "device": device, "python": platform.python_version(),
        "config": {key: value for key, value in vars(args).items() if key not in ("json", "markdown")},
        "corpus": {"train_chars": int(corpus.train.size), "valid_chars": int(eval_chars),
                   "vocab_size": corpus.vocab_size, "sha256": corpus.sha256},
        "wall_seconds": time.perf_counter() - start,
        "models": list(rows.values()),
    }
    table = markdown(results)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    if args.markdown:
        args.markdown.write_text(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run(parse_args()))

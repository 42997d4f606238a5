"""Character-level language modelling on text that ships with Python: the corpus, a model, training.

Corpus
------
The sources of a fixed list of standard-library modules and packages
(:data:`CORPUS_SOURCES`), read from ``sysconfig.get_paths()["stdlib"]`` in
that order, package files sorted by path, test directories left out, and
joined by a blank line. Nothing is downloaded. Names a Python version lacks
are skipped, so the text (about 6 MB on Python 3.11) depends on the Python
version; :func:`char_corpus` reports a digest of it. The split is by chunks of
``chunk_chars`` characters: every ``valid_every``-th chunk goes to validation,
so both sets sample every module.

Model
-----
:class:`CharLanguageModel`: a learned embedding (V, I), one
:class:`~bsmm.nn.lstm.BlocksparseLSTM`, and a dense softmax layer (H, V),
trained by truncated backpropagation through time on ``batch_size``
parallel streams of the training text, the state carried from one chunk of
``steps`` characters to the next. Bits per character are the mean
cross-entropy in nats divided by ln 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pathlib
import sysconfig
import time

import numpy as np

from bsmm.nn.lstm import BlocksparseLSTM, small_world_lstm
from bsmm.arrays import array_module
from examples.char_lstm.optim import Adam, clip_by_global_norm, softmax_cross_entropy

__all__ = ["CORPUS_SOURCES", "CharCorpus", "CharLanguageModel", "char_corpus", "corpus_files", "corpus_text", "evaluate_bpc",
           "matched_models", "stream_chunks", "train", "train_step"]

#: Standard-library modules (``name.py``) and packages (``name/``), in corpus order.
CORPUS_SOURCES = (
    "argparse", "ast", "base64", "bdb", "bisect", "calendar", "cmd", "code", "codecs", "colorsys",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "difflib", "dis", "doctest", "enum",
    "filecmp", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob",
    "graphlib", "gzip", "heapq", "hmac", "imaplib", "inspect", "ipaddress", "linecache", "locale",
    "mailbox", "mimetypes", "netrc", "numbers", "operator", "optparse", "os", "pathlib", "pdb", "pickle",
    "pkgutil", "platform", "poplib", "posixpath", "pprint", "profile", "pstats", "queue", "quopri",
    "random", "reprlib", "runpy", "sched", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket",
    "socketserver", "ssl", "statistics", "string", "subprocess", "symtable", "sysconfig", "tabnanny",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace", "traceback",
    "tracemalloc", "turtle", "types", "typing", "uuid", "warnings", "wave", "weakref", "webbrowser",
    "zipapp", "zipfile", "zipimport",
    # packages
    "asyncio", "collections", "concurrent", "email", "html", "http", "importlib", "json", "logging",
    "multiprocessing", "re", "tomllib", "unittest", "urllib", "wsgiref", "xml", "xmlrpc", "zoneinfo",
)
_SKIPPED_DIRS = {"test", "tests", "idle_test", "__pycache__"}


def corpus_files(stdlib=None) -> list[pathlib.Path]:
    """The files of :data:`CORPUS_SOURCES` found under ``stdlib`` (default: this Python's), in corpus order."""
    root = pathlib.Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = []
    for name in CORPUS_SOURCES:
        module, package = root / f"{name}.py", root / name
        if module.is_file():
            files.append(module)
        elif package.is_dir():
            files.extend(sorted(path for path in package.rglob("*.py")
                                if not _SKIPPED_DIRS & set(path.relative_to(package).parts[:-1])))
    return files


def corpus_text(max_chars: int | None = None, stdlib=None) -> str:
    """The corpus, cut to its first ``max_chars`` characters if given."""
    parts, size = [], 0
    for path in corpus_files(stdlib):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text) + 2
        if max_chars is not None and size >= max_chars:
            break
    if not parts:
        raise RuntimeError(f"none of the corpus sources was found under {stdlib or sysconfig.get_paths()['stdlib']}")
    return "\n\n".join(parts)[:max_chars]


@dataclasses.dataclass(frozen=True)
class CharCorpus:
    """A character corpus split into training and validation ids.

    Attributes
    ----------
    vocab : str
        The distinct characters, sorted; id ``i`` is ``vocab[i]``.
    train, valid : (L,) int32 NumPy arrays of ids
    sha256 : str
        Digest of the whole text, to tell corpora of different Python versions apart.
    """

    vocab: str
    train: np.ndarray
    valid: np.ndarray
    sha256: str

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, ids) -> str:
        return "".join(self.vocab[i] for i in np.asarray(ids).tolist())


def char_corpus(max_chars: int | None = None, valid_every: int = 10, chunk_chars: int = 10_000,
                stdlib=None) -> CharCorpus:
    """Load the corpus (:func:`corpus_text`) and split it deterministically.

    Examples
    --------
    >>> corpus = char_corpus(max_chars=200_000)
    >>> corpus.train.size, corpus.valid.size
    (180000, 20000)
    >>> corpus.decode(corpus.train[:9])  # argparse.py comes first
    '# Author:'
    """
    text = corpus_text(max_chars, stdlib)
    vocab = "".join(sorted(set(text)))
    lookup = np.zeros(max(map(ord, vocab)) + 1, dtype=np.int32)
    lookup[[ord(ch) for ch in vocab]] = np.arange(len(vocab), dtype=np.int32)
    ids = lookup[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]
    chunk = np.arange(ids.size) // chunk_chars
    in_valid = chunk % valid_every == valid_every - 1
    return CharCorpus(vocab, ids[~in_valid], ids[in_valid], hashlib.sha256(text.encode("utf-8")).hexdigest())


def stream_chunks(ids, batch_size: int, steps: int, xp=np):
    """Inputs and targets of truncated BPTT: ``batch_size`` parallel streams cut into ``steps``-long chunks.

    Stream ``j`` is the ``j``-th of ``batch_size`` equal consecutive parts of
    ``ids``, so chunk ``k + 1`` continues chunk ``k`` in every stream. Yields
    ``(x, y)``, each (steps, batch_size) ``xp`` int32, ``y`` one character ahead;
    the incomplete last chunk is dropped.

    Examples
    --------
    >>> [x.T.tolist() for x, y in stream_chunks(np.arange(10), 2, 2)]
    [[[0, 1], [5, 6]], [[2, 3], [7, 8]]]
    """
    length = (len(ids) // batch_size) if batch_size else 0
    if length < steps + 1:
        raise ValueError(f"ids of length {len(ids)} are too short for {batch_size} streams of {steps} + 1")
    streams = xp.asarray(np.asarray(ids[:batch_size * length], dtype=np.int32).reshape(batch_size, length))
    for start in range(0, length - steps, steps):
        yield (xp.ascontiguousarray(streams[:, start:start + steps].T),
               xp.ascontiguousarray(streams[:, start + 1:start + steps + 1].T))


class CharLanguageModel:
    """Embedding -> :class:`~bsmm.nn.lstm.BlocksparseLSTM` -> dense softmax over ``vocab_size`` characters.

    Parameters live in one dict: ``embed`` (V, I), the LSTM's ``wx``, ``wh``,
    ``b``, and ``out_w`` (H, V), ``out_b`` (V,), all float32.

    Examples
    --------
    >>> import numpy as np
    >>> from bsmm.nn.lstm import BlocksparseLSTM
    >>> model = CharLanguageModel(5, BlocksparseLSTM(8, 16, 8, recurrent_layout=np.eye(2)))
    >>> params = model.init_params(seed=0)
    >>> x = np.zeros((3, 2), np.int32)
    >>> loss, grads, state = model.loss_and_grads(params, x, x + 1)
    >>> sorted(grads) == sorted(params), model.n_params == sum(p.size for p in params.values())
    (True, True)
    """

    def __init__(self, vocab_size: int, lstm: BlocksparseLSTM):
        self.vocab_size, self.lstm = int(vocab_size), lstm

    @property
    def n_params(self) -> int:
        v, lstm = self.vocab_size, self.lstm
        return v * lstm.input_size + lstm.n_params + lstm.hidden_size * v + v

    def init_params(self, xp=np, seed=None) -> dict:
        rng = np.random.default_rng(seed)
        v, lstm = self.vocab_size, self.lstm
        params = lstm.init_params(xp, seed=rng)
        host = {"embed": rng.standard_normal((v, lstm.input_size)),
                "out_w": rng.standard_normal((lstm.hidden_size, v)) / math.sqrt(lstm.hidden_size),
                "out_b": np.zeros(v)}
        params.update({name: xp.asarray(value.astype(lstm.master_dtype)) for name, value in host.items()})
        return params

    def _logits(self, params, x, state):
        h, state, cache = self.lstm.forward(params, params["embed"][x], *state)
        hidden = h.reshape(-1, self.lstm.hidden_size).astype(params["out_w"].dtype, copy=False)
        return hidden @ params["out_w"] + params["out_b"], hidden, state, cache

    def loss(self, params, x, y, state=(None, None)):
        """Mean cross-entropy (nats, 0-d array) of targets ``y`` after inputs ``x`` (T, N), and the final state."""
        logits, _, state, _ = self._logits(params, x, state)
        return softmax_cross_entropy(logits, y.reshape(-1))[0], state

    def loss_and_grads(self, params, x, y, state=(None, None)):
        """Loss, gradients of every parameter (a dict) and the final state (h_T, c_T) of one chunk."""
        xp = array_module(params["out_w"])
        logits, hidden, state, cache = self._logits(params, x, state)
        loss, dlogits = softmax_cross_entropy(logits, y.reshape(-1))
        dh = (dlogits @ params["out_w"].T).reshape(x.shape + (self.lstm.hidden_size,))
        dx, grads, _ = self.lstm.backward(params, cache, dh)
        # Row x of the embedding gets the sum of dx over the positions of character x.
        grads["embed"] = xp.zeros((self.vocab_size, self.lstm.input_size), dtype=dlogits.dtype)
        _scatter_add(grads["embed"], xp.asarray(x).reshape(-1),
                     dx.reshape(-1, self.lstm.input_size).astype(dlogits.dtype, copy=False))
        grads["out_w"] = hidden.T @ dlogits
        grads["out_b"] = dlogits.sum(axis=0)
        return loss, grads, state


def _scatter_add(out, rows, values) -> None:
    """``out[rows[k]] += values[k]`` for every k, repeated rows summed (NumPy or CuPy)."""
    if array_module(out) is np:
        np.add.at(out, rows, values)
    else:
        import cupyx

        cupyx.scatter_add(out, rows, values)


def matched_models(vocab_size: int, dense_hidden: int, sparse_hidden: int, block_size: int,
                   kind: str = "barabasi_albert", seed=0, dtype="float32"):
    """A dense model and a wider small-world one with (nearly) the same number of parameters.

    Both embed characters in as many dimensions as they have hidden units. The
    sparse model's input and recurrent matrices share one small-world graph
    (:func:`bsmm.nn.lstm.small_world_lstm`), sized so that its whole model,
    embedding and softmax included, matches the dense one's parameter count.

    Examples
    --------
    >>> dense, sparse = matched_models(96, 128, 256, 8)
    >>> dense.n_params, sparse.n_params, sparse.lstm.recurrent_op.density
    (156256, 156768, 0.203125)
    """
    dense = CharLanguageModel(vocab_size, BlocksparseLSTM(dense_hidden, dense_hidden, dtype=dtype))
    outside_lstm = 2 * vocab_size * sparse_hidden + vocab_size
    lstm = small_world_lstm(sparse_hidden, sparse_hidden, dense.n_params - outside_lstm, block_size, kind, seed,
                            dtype=dtype)
    return dense, CharLanguageModel(vocab_size, lstm)


def evaluate_bpc(model: CharLanguageModel, params, ids, batch_size: int = 32, steps: int = 64,
                 max_chars: int | None = None, xp=np) -> float:
    """Bits per character of ``model`` on ``ids`` (cut to ``max_chars``), streams as in training."""
    ids = ids[:max_chars]
    state, total, count = (None, None), 0.0, 0
    for x, y in stream_chunks(ids, batch_size, steps, xp):
        loss, state = model.loss(params, x, y, state)
        total = total + loss * x.size
        count += x.size
    return float(total) / count / math.log(2)


def train_step(model: CharLanguageModel, params, optimizer, x, y, state=(None, None), clip: float = 1.0):
    """One update of :func:`train`: gradients of a chunk, clipped to global norm ``clip``, and an optimizer step.

    ``optimizer`` holds the parameters in the order of their sorted names,
    e.g. ``Adam([params[name] for name in sorted(params)])``. Returns the
    chunk's loss (a 0-d array, not synchronized) and the final state, to pass
    as ``state`` with the next chunk of the same streams.
    """
    loss, grads, state = model.loss_and_grads(params, x, y, state)
    ordered = [grads[name] for name in sorted(params)]
    clip_by_global_norm(ordered, clip)
    optimizer.step(ordered)
    return loss, state


def train(model: CharLanguageModel, params, corpus: CharCorpus, *, batch_size: int = 32, steps: int = 64,
          lr: float = 2e-3, clip: float = 1.0, max_updates: int | None = None, time_limit: float | None = None,
          eval_every: int | None = None, eval_chars: int | None = 50_000, xp=np, log=None,
          progress: str | None = None) -> dict:
    """Adam on truncated-BPTT chunks of ``corpus.train``, epoch after epoch, updating ``params`` in place.

    Stops after ``max_updates`` updates or once ``time_limit`` seconds have
    passed (at least one must be given), then evaluates on all of
    ``corpus.valid``. For learning curves, validation bits per character are
    also measured on its first ``eval_chars`` characters (None: all) every
    ``eval_every`` updates and at the end.

    ``progress``: the label of a progress bar of the updates (``tqdm.auto``: a terminal or
    Jupyter), the latest loss in its postfix, read at most once a second since reading it
    waits for the GPU; None: no bar. ``TQDM_DISABLE=1`` in the environment hides it too.

    Returns
    -------
    dict
        ``updates``, ``chars`` (trained on), ``seconds`` (training, evaluation
        excluded), ``chars_per_second``, ``valid_bpc`` (final, all of
        ``corpus.valid``), ``curve``: a list of ``{"update", "seconds",
        "train_bpc", "valid_bpc"}`` rows (``train_bpc``: the mean over the
        updates since the previous row).
    """
    if max_updates is None and time_limit is None:
        raise ValueError("train needs max_updates or time_limit")
    from tqdm.auto import tqdm  # imported here: only training shows a bar

    optimizer = Adam([params[name] for name in sorted(params)], lr=lr)
    curve, updates, chars, trained, running = [], 0, 0, 0.0, []
    # No disable argument where a bar is asked for, so that TQDM_DISABLE=1 still hides it.
    bar = tqdm(total=max_updates, desc=progress, unit="update") if progress is not None else tqdm(disable=True)
    postfix: dict = {}
    shown = start = time.perf_counter()

    def evaluate(final: bool) -> float:
        return evaluate_bpc(model, params, corpus.valid, batch_size, steps, None if final else eval_chars, xp)

    def record(valid_bpc: float) -> None:
        train_bpc = float(sum(running)) / len(running) / math.log(2) if running else math.nan
        running.clear()
        curve.append({"update": updates, "seconds": trained, "train_bpc": train_bpc, "valid_bpc": valid_bpc})
        postfix.update(train_bpc=f"{train_bpc:.3f}", valid_bpc=f"{valid_bpc:.3f}")
        bar.set_postfix(postfix)
        if log is not None:
            log(f"update {updates:6d}  {trained:7.1f} s  train {train_bpc:.3f}  valid {valid_bpc:.3f} bpc")

    try:
        done = False
        while not done:
            state = (None, None)
            for x, y in stream_chunks(corpus.train, batch_size, steps, xp):
                loss, state = train_step(model, params, optimizer, x, y, state, clip)
                running.append(loss)
                updates += 1
                chars += x.size
                trained = time.perf_counter() - start
                bar.update()
                if not bar.disable and time.perf_counter() - shown >= 1.0:
                    postfix["loss"] = f"{float(loss):.3f}"
                    bar.set_postfix(postfix, refresh=False)
                    shown = time.perf_counter()
                done = (max_updates is not None and updates >= max_updates) or (
                    time_limit is not None and trained >= time_limit)
                if done:
                    break
                if eval_every and updates % eval_every == 0:
                    float(loss)  # as below: the GPU's queued updates count as training, not evaluation
                    trained = time.perf_counter() - start
                    record(evaluate(final=False))
                    start = time.perf_counter() - trained  # evaluation time is not training time
                    bar.unpause()  # nor part of the bar's rate
        float(loss)  # waits for the GPU's queued work, which belongs to the training time
        trained = time.perf_counter() - start
    except BaseException:
        bar.close()  # an interrupted or failed run leaves no bar behind
        raise
    bar.close()  # before the final evaluation: the bar's rate is of training
    final = evaluate(final=True)
    # The curve's last point on the same characters as its others.
    record(final if eval_chars is None or eval_chars >= len(corpus.valid) else evaluate(final=False))
    return {"updates": updates, "chars": chars, "seconds": trained, "chars_per_second": chars / trained,
            "valid_bpc": final, "curve": curve}

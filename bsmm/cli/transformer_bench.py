"""A Llama-shaped decoder, dense and with block-sparse MLPs, timed as users run it
(``python -m bsmm bench --model transformer``).

The model is plain PyTorch, written here: token embedding, ``layers`` blocks of RMSNorm, causal
self-attention with rotary positions (``F.scaled_dot_product_attention``) and RMSNorm, a GLU MLP
(``gate_proj``, ``up_proj``, ``down_proj``, SiLU: Llama's names), and a read-out. The sparse models
are copies of the dense one made by :func:`bsmm.torch.sparsify` with ``fuse_mlp=True`` on the MLPs
only (each becomes a :class:`~bsmm.torch.BlockSparseMLP`), at each density and block size.

Rows, in tokens a second beside the dense model in the same process, with the speed-up the work
allows (multiply-adds for training and prefill, :func:`flops_ratio`; weight bytes for decode):

- ``train eager`` and ``train compiled``: forward, cross-entropy over the vocabulary, backward and
  an AdamW step, on ``batch × sequence`` tokens (compiled: ``torch.compile`` of the model);
- ``prefill``: the forward under ``torch.no_grad`` over ``batch × sequence`` tokens;
- ``decode eager``, ``decode graphs``, ``decode compiled graphs``: greedy decoding of ``new_tokens``
  tokens a sequence after a prompt, with a static KV cache; each token's forward called eagerly,
  replayed from a CUDA graph captured once, or compiled (``fullgraph``) and then replayed from a graph
  (what ``torch.compile(mode="reduce-overhead")`` gives a static-cache decoder).

GPU time by CUDA events around whole runs, warm-up first, the median of ``repeats`` runs.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from typing import Callable

import torch
import torch.nn.functional as F

from bsmm.cli.framework_bench import capture_graph, gpu_time

__all__ = ["DecoderConfig", "Decoder", "TransformerRow", "bench_transformer", "flops_ratio", "format_transformer_rows"]


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The decoder's sizes (defaults: the benchmark's Llama shape) and the timed workload."""

    d_model: int = 2048
    d_hidden: int = 8192
    layers: int = 8
    heads: int = 16
    vocab: int = 32000
    batch: int = 8
    sequence: int = 1024
    prompt: int = 128
    new_tokens: int = 64

    def __post_init__(self):
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise ValueError(f"heads ({self.heads}) must divide d_model ({self.d_model}) into heads of an even size")
        if not 1 <= self.prompt <= self.sequence or self.new_tokens < 1:
            raise ValueError(f"prompt must be in [1, sequence] and new_tokens at least 1; got prompt {self.prompt}, "
                             f"sequence {self.sequence}, new_tokens {self.new_tokens}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


class RMSNorm(torch.nn.Module):
    """x (..., size) scaled to unit root-mean-square (computed in float32), times a learned weight."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        variance = x.float().square().mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on (B, heads, T, head_dim): the halves of each head rotated by the position's angles."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(torch.nn.Module):
    """Causal multi-head self-attention, (B, T, d) -> (B, T, d), rotary positions on queries and keys."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        d = config.d_model
        self.heads, self.head_dim = config.heads, config.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x, cos, sin, cache=None, position=None):
        """Causal attention over x (B, T, d); with ``cache`` ((keys, values), each (B, heads, S, head_dim)),
        x is one token at ``position`` (a 1-element tensor), written into the cache and attending to it."""
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keys, values = cache
            keys.index_copy_(2, position, k)
            values.index_copy_(2, position, v)
            visible = (torch.arange(keys.shape[2], device=x.device) <= position)[None, :]  # (1, S): this query's keys
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(torch.nn.Module):
    """Llama's GLU block, (B, T, d) -> (B, T, d), its names too (what ``sparsify(fuse_mlp=True)`` recognises)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        d, h = config.d_model, config.d_hidden
        self.gate_proj, self.up_proj = torch.nn.Linear(d, h, bias=False), torch.nn.Linear(d, h, bias=False)
        self.down_proj = torch.nn.Linear(h, d, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(torch.nn.Module):
    """A pre-norm decoder block, (B, T, d) -> (B, T, d): attention, then the MLP, each added back."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(config.d_model), Attention(config)
        self.mlp_norm, self.mlp = RMSNorm(config.d_model), MLP(config)

    def forward(self, x, cos, sin, cache=None, position=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, position)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(torch.nn.Module):
    """The benchmark's decoder: ``forward(tokens)`` -> logits (B, T, vocab); ``step(token, position,
    caches)`` -> the next token's logits (B, 1, vocab) with static KV caches."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.embed = torch.nn.Embedding(config.vocab, config.d_model)
        self.blocks = torch.nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.d_model)
        self.head = torch.nn.Linear(config.d_model, config.vocab, bias=False)
        half = config.head_dim // 2
        inverse = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
        angles = torch.arange(config.sequence + config.new_tokens, dtype=torch.float64)[:, None] * inverse
        self.register_buffer("cos", torch.cat((angles.cos(), angles.cos()), -1).float(), persistent=False)
        self.register_buffer("sin", torch.cat((angles.sin(), angles.sin()), -1).float(), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.embed(tokens)
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def caches(self, batch: int, length: int):
        """Empty static KV caches, one (keys, values) a block, each (batch, heads, length, head_dim)."""
        c, weight = self.config, self.head.weight
        return [tuple(weight.new_zeros(batch, c.heads, length, c.head_dim) for _ in range(2)) for _ in self.blocks]

    def step(self, token, position, caches):
        x = self.embed(token)
        cos, sin = self.cos[position].to(x.dtype), self.sin[position].to(x.dtype)
        for block, cache in zip(self.blocks, caches):
            x = block(x, cos, sin, cache, position)
        return self.head(self.norm(x))


#: The decode rows: each token's forward eagerly, replayed from a CUDA graph, and compiled then replayed.
DECODE_MEASURES = ("decode eager", "decode graphs", "decode compiled graphs")


@dataclasses.dataclass
class TransformerRow:
    """One model and measure: tokens a second of the model, of the dense one, and the speed-up."""

    model: str  # "dense" or "bsmm 10 %, block 128"
    measure: str  # "train eager", "train compiled", "prefill", or one of DECODE_MEASURES
    tokens_per_s: float
    dense_tokens_per_s: float
    allowed: float  # the speed-up the work allows: multiply-adds (train, prefill) or weight bytes (decode)

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.dense_tokens_per_s

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"speedup": self.speedup}


def _timed(run: Callable[[], object], repeats: int, synchronize, event) -> float:
    """Median seconds of ``run`` over ``repeats`` runs, warm-up first (:func:`~bsmm.cli.framework_bench.gpu_time`)."""
    return gpu_time(run, synchronize, event, lambda begin, end: begin.elapsed_time(end), calls=1, batches=repeats)


def _measures(model: Decoder, config: DecoderConfig, device, graphs: bool, compiled: bool, repeats: int) -> dict:
    """Seconds of each measure of ``model``."""
    cuda = torch.device(device).type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    event = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else _WallEvent
    generator = torch.Generator(device).manual_seed(0)
    tokens = torch.randint(config.vocab, (config.batch, config.sequence + 1), device=device, generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def train(forward):
        def run():
            logits = forward(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return run

    times = {"train eager": _timed(train(model), repeats, synchronize, event)}
    if compiled:
        # Each model compiled afresh: variants of one forward would otherwise count against Dynamo's
        # recompile limit, past which it runs the forward eagerly without saying so in the timing.
        torch._dynamo.reset()
        times["train compiled"] = _timed(train(torch.compile(model)), repeats, synchronize, event)

    def prefill():
        with torch.no_grad():
            model(tokens[:, :-1])

    times["prefill"] = _timed(prefill, repeats, synchronize, event)
    decode = functools.partial(_decode_time, model, config=config, tokens=tokens, repeats=repeats,
                               synchronize=synchronize, event=event)
    times["decode eager"] = decode(model.step, graphed=False)
    if graphs and cuda:
        times["decode graphs"] = decode(model.step, graphed=True)
        if compiled:
            # What torch.compile(mode="reduce-overhead") does for a static cache: the compiled step (its
            # element-wise work fused) replayed from one CUDA graph; captured here, as the caches are
            # inputs the step writes, which Inductor's own graphs would not take.
            torch._dynamo.reset()
            times["decode compiled graphs"] = decode(torch.compile(model.step, fullgraph=True), graphed=True)
    return times


def _decode_time(model: Decoder, step_function, config: DecoderConfig, tokens, repeats: int, synchronize, event,
                 graphed: bool) -> float:
    """Seconds of greedy decoding of ``new_tokens`` tokens after a prompt already in the static KV cache,
    each token's forward ``step_function`` (``model.step`` or its compiled form) called eagerly or, with
    ``graphed``, replayed from one CUDA graph captured once (the prompt went in through the same call)."""
    length = config.prompt + config.new_tokens
    caches = model.caches(config.batch, length)
    token = tokens[:, :1].clone()
    position = torch.zeros(1, dtype=torch.long, device=tokens.device)

    def step():
        with torch.no_grad():
            return step_function(token, position, caches)

    if graphed:
        forward, logits = capture_graph(torch, step)
    else:
        logits = None

    def advance(p: int):
        nonlocal logits
        position.fill_(p)
        if graphed:
            forward()
        else:
            logits = step()
        token.copy_(tokens[:, p + 1:p + 2] if p + 1 < config.prompt else logits[:, -1].argmax(-1, keepdim=True))

    for p in range(config.prompt - 1):  # the prompt, once: generation rewrites the positions after it
        advance(p)

    def generate():
        token.copy_(tokens[:, config.prompt - 1:config.prompt])  # each run continues the same prompt
        for p in range(config.prompt - 1, length - 1):
            advance(p)

    return _timed(generate, repeats, synchronize, event)


class _WallEvent:
    """CUDA events' interface on the host clock (the CPU smoke run)."""

    def __init__(self):
        self.time = 0.0

    def record(self):
        self.time = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end) -> float:
        return (end.time - self.time) * 1e3


def bench_transformer(config: DecoderConfig = DecoderConfig(), densities=(0.1, 0.25), block_sizes=(64, 128),
                      dtype: str = "bfloat16", device: str = "cuda", graphs: bool = True, compiled: bool = True,
                      repeats: int = 5, progress: Callable[[str], None] | None = None) -> list[TransformerRow]:
    """:class:`TransformerRow` s of the dense decoder and its MLP-sparse copies (see the module docstring)."""
    import bsmm.torch  # lazily: PyTorch's adapter, for sparsify

    with torch.random.fork_rng([torch.device(device)] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(0)  # the same decoder each run; the caller's random streams left as they were
        dense = Decoder(config).to(device=device, dtype=getattr(torch, dtype))
    tokens = {m: config.batch * (config.new_tokens if m in DECODE_MEASURES else config.sequence)
              for m in ("train eager", "train compiled", "prefill", *DECODE_MEASURES)}
    dense_times = _measures(dense, config, device, graphs, compiled, repeats)
    rows = [TransformerRow("dense", m, tokens[m] / s, tokens[m] / s, 1.0) for m, s in dense_times.items()]
    dense_weights = sum(p.numel() for p in dense.parameters())
    for block_size in block_sizes:
        for density in densities:
            sparse = bsmm.torch.sparsify(copy.deepcopy(dense), density, block_size, include="*mlp*", fuse_mlp=True)
            name = f"bsmm {density:.0%}, block {block_size}"
            allowed = {m: flops_ratio(config, density) for m in tokens}
            allowed.update(dict.fromkeys(DECODE_MEASURES, dense_weights / sum(p.numel() for p in sparse.parameters())))
            for measure, seconds in _measures(sparse, config, device, graphs, compiled, repeats).items():
                rows.append(TransformerRow(name, measure, tokens[measure] / seconds,
                                           tokens[measure] / dense_times[measure], allowed[measure]))
                if progress:
                    progress(format_transformer_rows(rows[-1:], header=False))
            del sparse
    return rows


def format_transformer_rows(rows: list[TransformerRow], header: bool = True) -> str:
    """A Markdown table: tokens a second and the speed-up over the dense model."""
    lines = ["| model | measure | tokens/s | dense tokens/s | speed-up | allowed by the work |",
             "| --- | --- | --- | --- | --- | --- |"] if header else []
    lines += [f"| {r.model} | {r.measure} | {r.tokens_per_s:,.0f} | {r.dense_tokens_per_s:,.0f} | {r.speedup:.2f}× | "
              f"{r.allowed:.2f}× |" for r in rows]
    return "\n".join(lines)


def flops_ratio(config: DecoderConfig, density: float) -> float:
    """What the work allows a training step or a prefill: the dense model's multiply-adds a token over the
    sparse one's (MLP projections at ``density``; attention's products and the read-out as they are)."""
    d, h, t = config.d_model, config.d_hidden, config.sequence
    attention = 4 * d * d + t * d  # projections; scores and values, each over half the T keys a token (causal)
    mlp = 3 * d * h
    head = d * config.vocab
    dense = config.layers * (attention + mlp) + head
    return dense / (config.layers * (attention + density * mlp) + head)


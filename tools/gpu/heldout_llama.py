"""A held-out model: Hugging Face transformers' ``LlamaForCausalLM``, dense and sparsified by
``bsmm.torch.sparsify``, timed as its users run it.

    python3 tools/gpu/heldout_llama.py [--density 0.1] [--block-size 128] [--no-compile] [--json rows.json]
    python3 tools/gpu/heldout_llama.py --small --device cpu    # a smoke run of the script itself

This is the model of issue 37's report: 8 layers, d 2048, MLP 8192 SwiGLU, 16 heads, vocab 32000, bf16,
random init. It is the library's own code, not the benchmark's decoder. The sparse copy is
``sparsify(model, density, block_size, include="*mlp*", fuse_mlp=True)``, so each ``LlamaMLP``
becomes one ``BlockSparseMLP``.

Rows, in tokens a second, dense and sparse side by side:
- ``train eager`` and ``train compiled``: ``model(input_ids, labels=...)``, backward and an AdamW
  step, on 8 × 1024 tokens (compiled: ``torch.compile(model)``);
- ``prefill``: the forward under ``torch.no_grad`` on 8 × 1024 tokens;
- ``generate, static cache``: ``model.generate`` of 64 new tokens a sequence after a 128-token prompt,
  greedy, ``cache_implementation="static"``. The eager row sets ``disable_compile=True``. The compiled
  row is the library's default for a static cache, which compiles the decoding forward.

First, at density 1 the sparsified model's loss, logits and embedding gradient are compared with the
dense model's. GPU time is taken by CUDA events around whole runs, warm-up first, the median of
``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import bsmm.torch  # noqa: E402
from bsmm.cli.transformer_bench import _timed, _WallEvent  # noqa: E402

BATCH, SEQUENCE, PROMPT, NEW_TOKENS = 8, 1024, 128, 64


def llama(small: bool, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = (dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=512) if small else
             dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=32000))
    config = LlamaConfig(max_position_embeddings=2 * SEQUENCE, tie_word_embeddings=False, **sizes)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()


def sparse_copy(model, density: float, block_size: int):
    sparse = bsmm.torch.sparsify(copy.deepcopy(model), density, block_size, include="*mlp*", fuse_mlp=True)
    fused = sum(isinstance(m, bsmm.torch.BlockSparseMLP) for m in sparse.modules())
    if fused != model.config.num_hidden_layers:
        raise RuntimeError(f"sparsify fused {fused} of {model.config.num_hidden_layers} MLPs")
    return sparse


def density_one_check(model, tokens, block_size: int) -> dict:
    """Loss, logits and the embedding's gradient of the model sparsified at density 1 against the dense one's."""
    results = []
    for candidate in (model, sparse_copy(model, 1.0, block_size)):
        candidate.zero_grad(set_to_none=True)
        output = candidate(input_ids=tokens, labels=tokens)
        output.loss.backward()
        results.append((output.loss.detach().float(), output.logits.detach().float(),
                        candidate.model.embed_tokens.weight.grad.float()))
        candidate.zero_grad(set_to_none=True)
    (loss, logits, grad), (loss1, logits1, grad1) = results
    return {"loss relative": float((loss1 - loss).abs() / loss.abs()),
            "logits, largest difference / largest value": float((logits1 - logits).abs().max() / logits.abs().max()),
            "embedding gradient, relative norm of the difference": float((grad1 - grad).norm() / grad.norm())}


def measures(model, tokens, device: str, compiled: bool, repeats: int) -> dict:
    cuda = device == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    event = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else _WallEvent
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def train(forward):
        def run():
            forward(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return run

    seconds = {}

    def attempt(name, run):  # a failing row is said on stderr and left out; the others still run
        try:
            seconds[name] = _timed(run, repeats, synchronize, event)
        except Exception as error:
            print(f"{name}: failed, {type(error).__name__}: {str(error)[:300]}", file=sys.stderr)

    model.train()
    attempt("train eager", train(model))
    if compiled:
        torch._dynamo.reset()
        attempt("train compiled", train(torch.compile(model)))
    model.eval()

    def prefill():
        with torch.no_grad():
            model(input_ids=tokens)

    attempt("prefill", prefill)
    prompt = tokens[:, :PROMPT]
    for name, disable in (("generate, static cache, eager", True), ("generate, static cache, compiled", False)):
        if not disable and not compiled:
            continue
        torch._dynamo.reset()

        def generate():
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                     cache_implementation="static", disable_compile=disable, pad_token_id=0)
            assert out.shape[1] == PROMPT + NEW_TOKENS, out.shape
        attempt(name, generate)
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled rows")
    parser.add_argument("--small", action="store_true", help="a 2-layer d 256 model (a smoke run)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    import transformers

    dtype = torch.bfloat16
    dense = llama(args.small, args.device, dtype)
    vocab = dense.config.vocab_size
    generator = torch.Generator(args.device).manual_seed(0)
    tokens = torch.randint(vocab, (BATCH, SEQUENCE), device=args.device, generator=generator)
    check = density_one_check(dense, tokens[:2, :256], args.block_size if not args.small else 64)
    sparse = sparse_copy(dense, args.density, args.block_size)
    dense_seconds = measures(dense, tokens, args.device, not args.no_compile, args.repeats)
    sparse_seconds = measures(sparse, tokens, args.device, not args.no_compile, args.repeats)
    decode_tokens, work_tokens = BATCH * NEW_TOKENS, BATCH * SEQUENCE
    weights = [sum(p.numel() for p in m.parameters()) for m in (dense, sparse)]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}; "
          f"{weights[0] / 1e6:.0f}M parameters dense, {weights[1] / 1e6:.0f}M sparse "
          f"({args.density:.0%} of the MLP blocks, block {args.block_size})\n")
    print("| at density 1, sparsified against dense | relative |\n| --- | --- |")
    for name, value in check.items():
        print(f"| {name} | {value:.1e} |")
    print("\n| measure | dense tokens/s | bsmm tokens/s | speed-up |\n| --- | --- | --- | --- |")
    rows = []
    for measure in dict.fromkeys([*dense_seconds, *sparse_seconds]):
        count = decode_tokens if measure.startswith("generate") else work_tokens
        seconds = dense_seconds.get(measure, float("nan"))
        sparse_rate = count / sparse_seconds.get(measure, float("nan"))
        rows.append({"measure": measure, "dense_tokens_per_s": count / seconds, "bsmm_tokens_per_s": sparse_rate})
        print(f"| {measure} | {count / seconds:,.0f} | {sparse_rate:,.0f} | {sparse_rate * seconds / count:.2f}× |")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"transformers": transformers.__version__, "torch": torch.__version__, "density": args.density,
                       "block_size": args.block_size, "density_one": check, "rows": rows}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

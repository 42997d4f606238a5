"""Why transformers' compiled static-cache ``generate`` is slower with bsmm MLPs: graph breaks,
recompiles and skipped CUDA graphs of the decoding forward, dense against sparse.

    TORCH_LOGS="graph_breaks,recompiles,perf_hints,cudagraphs" python3 tools/probes/probe_hf_decode.py [--layers 2]

The model is ``tools/gpu/heldout_llama.py``'s Llama (d 2048, MLP 8192) with ``--layers`` blocks,
dense and at 10 %, block 128. Each runs ``generate`` three times with the library's default compile
for a static cache. The probe prints Dynamo's counters after each run and the time of the last
one. The logs that ``TORCH_LOGS`` asks for go to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "gpu"))
from heldout_llama import PROMPT, NEW_TOKENS, sparse_copy  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        dense = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    prompt = torch.randint(32000, (8, PROMPT), device="cuda")
    for name, model in (("dense", dense), ("bsmm 10%, block 128", sparse_copy(dense, 0.1, 128))):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        for run in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                               cache_implementation="static", pad_token_id=0)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            counters = {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if v}
            print(f"{name}, run {run}: {seconds * 1e3:.1f} ms, {seconds / NEW_TOKENS * 1e3:.2f} ms a token; "
                  f"counters {counters}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

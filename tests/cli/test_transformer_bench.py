"""The decoder of ``bsmm bench --model transformer`` at tiny sizes on the CPU: its cached one-token step
gives the forward's logits, the bench makes its rows, and the sparse copies' MLPs are BlockSparseMLP."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import bsmm.torch as bt  # noqa: E402
from bsmm.cli import main  # noqa: E402
from bsmm.cli.transformer_bench import Decoder, DecoderConfig, bench_transformer, flops_ratio  # noqa: E402

TINY = DecoderConfig(d_model=64, d_hidden=128, layers=2, heads=4, vocab=50, batch=2, sequence=12, prompt=4,
                     new_tokens=4)


def test_the_cached_step_gives_the_forward_s_logits():
    torch.manual_seed(0)
    model = Decoder(TINY).double()
    tokens = torch.randint(TINY.vocab, (TINY.batch, 8))
    expected = model(tokens)
    caches = model.caches(TINY.batch, 8)
    with torch.no_grad():
        steps = [model.step(tokens[:, p:p + 1], torch.tensor([p]), caches) for p in range(8)]
    assert torch.allclose(torch.cat(steps, dim=1), expected, rtol=1e-10, atol=1e-12)


def test_the_bench_times_the_dense_and_the_sparse_models():
    rows = bench_transformer(TINY, densities=(0.5,), block_sizes=(32,), dtype="float32", device="cpu", graphs=False,
                             compiled=False, repeats=1)
    measures = ["train eager", "prefill", "decode eager"]
    assert [(r.model, r.measure) for r in rows] == [(m, measure) for m in ("dense", "bsmm 50%, block 32")
                                                    for measure in measures]
    assert all(r.tokens_per_s > 0 and r.dense_tokens_per_s > 0 for r in rows)
    dense, sparse = rows[:3], rows[3:]
    assert [s.dense_tokens_per_s for s in sparse] == [d.tokens_per_s for d in dense]
    assert all(d.allowed == 1.0 for d in dense)
    assert sparse[0].allowed == sparse[1].allowed == pytest.approx(flops_ratio(TINY, 0.5))
    assert 1.0 < sparse[2].allowed < 2.0  # weight bytes: the MLPs at half, attention, embedding and head whole


def test_sparsify_makes_every_mlp_one_block_and_leaves_attention_dense():
    model, report = bt.sparsify(Decoder(TINY), 0.5, 32, include="*mlp*", fuse_mlp=True, return_report=True)
    assert report.fused == ["blocks.0.mlp", "blocks.1.mlp"] and report.replaced == []
    assert type(model.blocks[0].attention.q_proj) is torch.nn.Linear
    assert model(torch.randint(TINY.vocab, (1, 5))).shape == (1, 5, TINY.vocab)


def test_what_the_work_allows():
    assert flops_ratio(DecoderConfig(), 1.0) == 1.0
    assert 1.5 < flops_ratio(DecoderConfig(), 0.1) < 3.0


def test_model_flags_are_checked(capsys):
    assert main.main(["bench", "--model", "transformer", "--hidden", "4096"]) == 2
    assert "--hidden does not apply with --model transformer" in capsys.readouterr().err


def test_the_config_is_checked():
    with pytest.raises(ValueError, match="heads"):
        DecoderConfig(d_model=64, heads=3)
    with pytest.raises(ValueError, match="prompt must be in"):
        DecoderConfig(sequence=16, prompt=32)


def test_at_density_one_the_sparsified_decoder_is_the_dense_one():
    """Every nn.Linear made block-sparse (the MLPs fused) at density 1: logits, the input embedding's and
    the attention's gradients equal the dense model's to float32 rounding."""
    torch.manual_seed(2)
    dense = Decoder(TINY)
    tokens = torch.randint(TINY.vocab, (TINY.batch, 9))
    sparse = bt.sparsify(copy.deepcopy(dense), 1.0, 32, fuse_mlp=True)
    assert isinstance(sparse.blocks[0].mlp, bt.BlockSparseMLP)
    assert isinstance(sparse.blocks[0].attention.q_proj, bt.BlockSparseLinear)  # (the 50-word head stays dense)
    grads = []
    for model in (dense, sparse):
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        grads.append([logits.detach(), model.embed.weight.grad, model.blocks[1].attention_norm.weight.grad])
    for a, b in zip(*grads):
        assert torch.allclose(b, a, rtol=1e-4, atol=1e-6)

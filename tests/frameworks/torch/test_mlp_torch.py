"""bsmm.torch.BlockSparseMLP and sparsify(fuse_mlp=True): a transformer's feed-forward block with its gate
and up projections one product, against a float64 reference of masked dense weights written out here,
and against the dense modules it replaces. CUDA cases carry the ``gpu`` marker."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: bsmm.torch tests skipped")

import bsmm.torch as bt  # noqa: E402
from bsmm.torch.mlp import activation_of  # noqa: E402
from reference import dense_weight, rel_error, tolerance  # noqa: E402
import torch_cases  # noqa: E402
from bsmm.cli.transformer_bench import Decoder as BenchDecoder, DecoderConfig  # noqa: E402
from torch_cases import eager_and_compiled  # noqa: E402

device = torch_cases.device  # the fixture (tests take it by name)

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_C = np.sqrt(2 / np.pi)


def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def _gelu_tanh_grad(z):
    t = np.tanh(_C * (z + 0.044715 * z ** 3))
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _C * (1 + 3 * 0.044715 * z * z)


#: The activations and their derivatives in float64 NumPy, written out (not bsmm's).
REFERENCE = {
    "silu": (lambda z: z * _sigmoid(z), lambda z: _sigmoid(z) * (1 + z * (1 - _sigmoid(z)))),
    "relu": (lambda z: np.maximum(z, 0), lambda z: (z > 0).astype(np.float64)),
    "gelu_tanh": (lambda z: 0.5 * z * (1 + np.tanh(_C * (z + 0.044715 * z ** 3))), _gelu_tanh_grad),
}


def host(t) -> np.ndarray:
    return t.detach().cpu().double().numpy()


def skip_float64_on_cuda(device, dtype):
    if device == "cuda" and dtype == "float64":
        pytest.skip("bsmm runs float64 on the CPU only")


def reference(mlp, x: np.ndarray, dy: np.ndarray) -> dict:
    """The block's output and the gradients of x and of every dense weight, in float64 NumPy."""
    bs = mlp.up.op.block_size
    w_up, w_down = dense_weight(host(mlp.up.layout), host(mlp.up.weight), bs), \
        dense_weight(host(mlp.down.layout), host(mlp.down.weight), bs)
    b_up = host(mlp.up.bias) if mlp.up.bias is not None else 0.0
    b_down = host(mlp.down.bias) if mlp.down.bias is not None else 0.0
    z = x @ w_up + b_up
    act, act_grad = REFERENCE[mlp.activation]
    d_act = act_grad(z)
    if mlp.gated:
        h = mlp.d_hidden
        gate, up = z[:, :h], z[:, h:]
        a = act(gate) * up
    else:
        a = act(z)
    y = a @ w_down + b_down
    da = dy @ w_down.T
    dw_down = a.T @ dy
    if mlp.gated:
        dz = np.concatenate([da * up * d_act[:, :h], da * act(gate)], axis=1)
    else:
        dz = da * d_act
    return {"y": y, "dx": dz @ w_up.T, "dw_up": x.T @ dz, "dw_down": dw_down}


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("gated,activation,bias", [(True, "silu", False), (True, "gelu_tanh", True),
                                                   (False, "relu", True), (False, "silu", False)])
def test_the_block_matches_the_float64_reference(device, dtype, gated, activation, bias):
    skip_float64_on_cuda(device, dtype)
    torch.manual_seed(1)
    mlp = bt.BlockSparseMLP(48, 80, density=0.5, block_size=16, activation=activation, gated=gated, bias=bias,
                            seed=2, device=device, dtype=DTYPES[dtype])
    if bias:
        with torch.no_grad():
            mlp.up.bias.uniform_(-1, 1)
            mlp.down.bias.uniform_(-1, 1)
    rng = np.random.default_rng(3)
    x = torch.tensor(rng.standard_normal((7, 48)), dtype=DTYPES[dtype], device=device, requires_grad=True)
    dy = rng.standard_normal((7, 48))
    y = mlp(x)
    y.backward(torch.tensor(dy, dtype=DTYPES[dtype], device=device))
    expected = reference(mlp, host(x), dy)
    bs = 16
    actual = {"y": host(y), "dx": host(x.grad), "dw_up": dense_weight(host(mlp.up.layout), host(mlp.up.weight.grad), bs),
              "dw_down": dense_weight(host(mlp.down.layout), host(mlp.down.weight.grad), bs)}
    expected["dw_up"] *= dense_weight(host(mlp.up.layout), np.ones(mlp.up.weight.shape), bs)
    expected["dw_down"] *= dense_weight(host(mlp.down.layout), np.ones(mlp.down.weight.shape), bs)
    for key in expected:
        error = rel_error(actual[key], expected[key])
        assert error <= 4 * tolerance(dtype), (key, error)


def test_gate_and_up_are_one_product_each_way(monkeypatch):
    """Forward: one fprop over [gate | up] and one down; backward: one bprop and one updat over [gate | up]
    (and one of each for down)."""
    import bsmm.torch.eager as eager

    mlp = bt.BlockSparseMLP(32, 64, density=0.5, block_size=16, seed=0)
    x = torch.randn(5, 32, requires_grad=True)
    calls, run_pass = [], eager.run_pass

    def spy(pass_name, a, b, key, *rest):
        calls.append((pass_name, "up" if key == mlp.up._key else "down"))
        return run_pass(pass_name, a, b, key, *rest)

    monkeypatch.setattr(eager, "run_pass", spy)
    mlp(x).sum().backward()
    assert sorted(calls) == sorted((p, layer) for p in ("fprop", "bprop", "updat") for layer in ("up", "down")), calls


def test_from_modules_computes_what_the_modules_compute():
    torch.manual_seed(4)
    gate, up, down = (torch.nn.Linear(64, 96, dtype=torch.float64), torch.nn.Linear(64, 96, dtype=torch.float64),
                      torch.nn.Linear(96, 64, dtype=torch.float64))
    x = torch.randn(6, 64, dtype=torch.float64)
    expected = down(torch.nn.functional.silu(gate(x)) * up(x))
    full = bt.BlockSparseMLP.from_modules(gate, up, down, torch.nn.SiLU(), density=1.0, block_size=32)
    assert rel_error(host(full(x)), host(expected)) <= 1e-13
    half = bt.BlockSparseMLP.from_modules(gate, up, down, "silu", density=0.5, block_size=32)

    def kept(mask, weight):  # the dense (out, in) weight where the (in, out) block mask keeps it
        return torch.where(mask.repeat_interleave(32, 0).repeat_interleave(32, 1).T, weight, 0)

    gate_mask, up_mask = half.up.layout.bool().chunk(2, dim=1)
    for mask, p in ((gate_mask, gate), (up_mask, up)):
        blocks = p.weight.detach().T.reshape(2, 32, 3, 32).norm(dim=(1, 3))
        assert int(mask.sum()) == 3 and blocks[mask].min() >= blocks[~mask].max()  # each matrix its own largest half
    linear = torch.nn.functional.linear
    expected = linear(torch.nn.functional.silu(linear(x, kept(gate_mask, gate.weight), gate.bias))
                      * linear(x, kept(up_mask, up.weight), up.bias), kept(half.down.layout.bool(), down.weight), down.bias)
    assert rel_error(host(half(x)), host(expected)) <= 1e-13


def test_torch_compile_traces_the_block_without_a_graph_break():
    torch.manual_seed(5)
    mlp = bt.BlockSparseMLP(32, 64, density=0.5, block_size=16, seed=1)

    def step(run, x):
        mlp.zero_grad()
        x.grad = None
        y = run(x)
        y.square().sum().backward()
        return [y.detach(), x.grad, mlp.up.weight.grad.clone(), mlp.down.weight.grad.clone()]

    pairs, graphs = eager_and_compiled(mlp, [torch.randn(4, 32, requires_grad=True) for _ in range(3)], step)
    for eager, compiled in pairs:
        for a, b in zip(eager, compiled):
            assert rel_error(host(b), host(a)) <= 1e-6
    assert graphs == 1


def test_a_sparsified_decoder_compiles_whole_without_recompiles():
    """torch.compile(fullgraph=True) of the benchmark's decoder with its MLPs made BlockSparseMLP: one graph
    over three training steps, the same loss and gradients as eager."""
    config = DecoderConfig(d_model=64, d_hidden=128, layers=2, heads=4, vocab=50, batch=2, sequence=12, prompt=4,
                           new_tokens=4)
    torch.manual_seed(1)
    model = bt.sparsify(BenchDecoder(config), 0.5, 32, include="*mlp*", fuse_mlp=True)

    def step(run, tokens):
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(run(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return [loss.detach(), model.blocks[0].mlp.up.weight.grad.clone(),
                model.blocks[1].attention.q_proj.weight.grad.clone()]

    pairs, graphs = eager_and_compiled(model, [torch.randint(config.vocab, (config.batch, 9)) for _ in range(3)],
                                       step)
    for eager, compiled in pairs:
        for a, b in zip(eager, compiled):
            assert torch.allclose(b, a, rtol=1e-4, atol=1e-6)
    assert graphs == 1


def test_the_sparsified_decoder_s_cached_step_compiles_whole():
    """The bench's "decode compiled graphs" row: torch.compile(step, fullgraph=True) of the sparsified
    decoder writes its static caches as eager does and gives the same logits, in one graph over positions."""
    config = DecoderConfig(d_model=64, d_hidden=128, layers=2, heads=4, vocab=50, batch=2, sequence=12, prompt=4,
                           new_tokens=4)
    torch.manual_seed(3)
    model = bt.sparsify(BenchDecoder(config), 0.5, 32, include="*mlp*", fuse_mlp=True)
    tokens = torch.randint(config.vocab, (config.batch, 6))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(model.step, fullgraph=True)
    results = []
    for step in (model.step, compiled):
        caches, position = model.caches(config.batch, 6), torch.zeros(1, dtype=torch.long)
        with torch.no_grad():
            logits = []
            for p in range(6):
                position.fill_(p)
                logits.append(step(tokens[:, p:p + 1], position, caches).clone())
        results.append((torch.cat(logits, 1), caches[1][0].clone()))
    (eager_logits, eager_keys), (compiled_logits, compiled_keys) = results
    assert eager_keys.abs().sum() > 0  # the cache was written
    assert torch.allclose(compiled_logits, eager_logits, rtol=1e-4, atol=1e-5)
    assert torch.allclose(compiled_keys, eager_keys, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def test_activation_of_and_errors():
    assert activation_of(torch.nn.SiLU()) == "silu" and activation_of(torch.nn.functional.gelu) == "gelu"
    assert activation_of(torch.nn.ReLU()) == "relu" and activation_of(torch.sigmoid) is None
    assert activation_of("not a function") is None
    with pytest.raises(ValueError, match="pass layouts or a density"):
        bt.BlockSparseMLP(32, 64, block_size=16)
    with pytest.raises(ValueError, match="activation must be one of"):
        bt.BlockSparseMLP(32, 64, density=0.5, block_size=16, activation="none")
    with pytest.raises(ValueError, match=r"layouts must be \(gate, up, down\)"):
        bt.BlockSparseMLP(32, 64, block_size=16, layouts=[np.ones((2, 4)), np.ones((4, 2))])
    with pytest.raises(ValueError, match=r"d_hidden \(60\) must be a multiple of block_size \(16\)"):
        bt.BlockSparseMLP(32, 60, density=0.5, block_size=16)
    linear = torch.nn.Linear(32, 64)
    with pytest.raises(ValueError, match="activation must compute one of"):
        bt.BlockSparseMLP.from_modules(linear, linear, torch.nn.Linear(64, 32), torch.nn.Tanh(), density=0.5,
                                       block_size=16)
    with pytest.raises(ValueError, match="all have a bias or all have none"):
        bt.BlockSparseMLP.from_modules(linear, linear, torch.nn.Linear(64, 32, bias=False), "silu", density=0.5,
                                       block_size=16)
    with pytest.raises(ValueError, match="gate_proj must map 32 to 64 features"):
        bt.BlockSparseMLP.from_modules(torch.nn.Linear(32, 96), linear, torch.nn.Linear(64, 32), "silu", density=0.5,
                                       block_size=16)
    with pytest.raises(TypeError, match="down_proj must be a torch.nn.Linear; got ReLU"):
        bt.BlockSparseMLP.from_modules(linear, linear, torch.nn.ReLU(), "silu", density=0.5, block_size=16)
    with pytest.raises(ValueError, match="give layouts or density, not both"):
        bt.BlockSparseMLP.from_modules(linear, linear, torch.nn.Linear(64, 32), "silu", density=0.5, block_size=16,
                                       layouts=[np.ones((2, 4))] * 3)
    with pytest.raises(ValueError, match=r"in_features \(32\) must be a multiple of block_size \(64\)"):
        bt.BlockSparseMLP.from_modules(linear, linear, torch.nn.Linear(64, 32), "silu", density=0.5, block_size=64)
    with pytest.raises(ValueError, match=r"the up layout must have shape \(2, 4\)"):
        bt.BlockSparseMLP(32, 64, block_size=16, layouts=[np.ones((2, 4)), np.ones((2, 3)), np.ones((4, 2))])


def test_from_modules_leaves_the_random_streams_alone():
    linear, down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
    state = torch.random.get_rng_state()
    bt.BlockSparseMLP.from_modules(linear, linear, down, "gelu", density=0.5, block_size=16)
    assert torch.equal(torch.random.get_rng_state(), state)


# -- sparsify(fuse_mlp=True) ---------------------------------------------------------------------------------
class LlamaLikeMLP(torch.nn.Module):
    """A model library's GLU block, named as Llama's."""

    def __init__(self, d, h, act=None):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(d, h, bias=False), torch.nn.Linear(d, h, bias=False)
        self.down_proj = torch.nn.Linear(h, d, bias=False)
        self.act_fn = act or torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class NotGLU(LlamaLikeMLP):
    """The same names, another formula: must not be fused."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(64, 64)
        self.mlp = LlamaLikeMLP(64, 128)
        self.other = NotGLU(64, 128, torch.nn.GELU(approximate="tanh"))
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.other(self.mlp(self.attn(x))))


def test_sparsify_fuses_glu_blocks_and_keeps_the_model_s_values():
    torch.manual_seed(6)
    model = Decoder().double()
    x = torch.randn(3, 64, dtype=torch.float64)
    expected = model(x)
    model, report = bt.sparsify(model, density=1.0, block_size=32, fuse_mlp=True, return_report=True)
    assert report.fused == ["mlp"] and isinstance(model.mlp, bt.BlockSparseMLP)
    assert report.not_fused == {"other": "its forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))"}
    assert report.skipped == {"head": "out_features 10 is not a multiple of block_size 32"}
    assert report.replaced == ["attn", "other.gate_proj", "other.up_proj", "other.down_proj"]
    assert rel_error(host(model(x)), host(expected)) <= 1e-12


def test_sparsify_fused_blocks_follow_the_layout_rule_and_filters():
    torch.manual_seed(7)
    model, report = bt.sparsify(Decoder(), density=0.25, block_size=32, fuse_mlp=True, layout="random", seed=0,
                                exclude="*attn*", return_report=True)
    assert report.fused == ["mlp"] and model.mlp.up.op.density == 0.25 and model.mlp.down.op.density == 0.25
    assert type(model.attn) is torch.nn.Linear
    _, report = bt.sparsify(Decoder(), density=0.25, block_size=32, fuse_mlp=True, exclude="*up_proj",
                            return_report=True)
    assert report.fused == [] and report.not_fused["mlp"] == "a projection is left out by include/exclude"
    with pytest.raises(ValueError, match="fuse_mlp makes BlockSparseMLP blocks"):
        bt.sparsify(Decoder(), density=0.5, fuse_mlp=True, feature_axis=0)


def test_the_glu_check_looks_at_what_reaches_down_proj():
    """A zero down_proj makes every formula's output zero: the check reads down_proj's input instead. The
    probe leaves the model's mode and random streams as they were."""
    torch.manual_seed(8)
    model = Decoder()
    for module in (model.mlp, model.other):
        torch.nn.init.zeros_(module.down_proj.weight)
    model.train()
    state = torch.random.get_rng_state()
    _, report = bt.sparsify(model, density=0.5, block_size=32, fuse_mlp=True, return_report=True)
    assert report.fused == ["mlp"] and "other" in report.not_fused
    assert torch.equal(torch.random.get_rng_state(), state) and model.training
    gelu = LlamaLikeMLP(64, 96, torch.nn.GELU())
    _, report = bt.sparsify(gelu, density=0.5, block_size=32, fuse_mlp=True, return_report=True)
    assert report.fused == [""] and report.not_fused == {}
    tanh = LlamaLikeMLP(64, 128, torch.nn.Tanh())
    _, report = bt.sparsify(tanh, density=0.5, block_size=32, fuse_mlp=True, return_report=True)
    assert report.not_fused == {"": "act_fn Tanh is none of bsmm's activations"}

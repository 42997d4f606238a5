"""bsmm.torch.sparsify and BlockSparseLinear(density=): a model's nn.Linear layers made block-sparse in one
call, with every layer it keeps dense reported and why."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import bsmm  # noqa: E402
import bsmm.torch as bt  # noqa: E402


class Block(torch.nn.Module):
    """A model library's MLP block, its layers nested and named."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(64, 10))  # a 10-class head


def test_replaces_every_linear_it_can_and_keeps_their_values():
    model = _model()
    dense = [(name, m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    model, report = bt.sparsify(model, density=0.5, block_size=32, return_report=True)
    assert report.replaced == ["0.up", "0.down", "1.up", "1.down"]
    assert report.skipped == {"2": "out_features 10 is not a multiple of block_size 32"}
    for name, weight, bias in dense[:4]:
        layer = model.get_submodule(name)
        assert isinstance(layer, bt.BlockSparseLinear) and layer.op.density == 0.5
        kept = layer.to_linear().weight.detach()
        present = kept != 0
        assert torch.equal(kept[present], weight[present])  # kept blocks copied exactly
        # magnitude: every kept block's norm is at least every dropped block's
        blocks = weight.reshape(weight.shape[0] // 32, 32, weight.shape[1] // 32, 32).norm(dim=(1, 3))
        mask = present.reshape(weight.shape[0] // 32, 32, weight.shape[1] // 32, 32).any(dim=(1, 3))
        assert blocks[mask].min() >= blocks[~mask].max()
        assert (layer.bias is None) == (bias is None) and (bias is None or torch.equal(layer.bias.detach(), bias))
    assert type(model[2]) is torch.nn.Linear
    x = torch.randn(3, 64)
    assert model(x).shape == (3, 10)


def test_the_sizes_it_skips_are_warned_about_without_a_report():
    with pytest.warns(bsmm.BsmmWarning, match=r"kept 1 nn\.Linear layer\(s\) dense.*2 \(out_features 10 is not"):
        model = bt.sparsify(_model(), density=0.25, block_size=32)
    assert isinstance(model[0].up, bt.BlockSparseLinear)


@pytest.mark.parametrize("include,exclude,replaced", [
    ("*.up", None, ["0.up", "1.up"]),
    (["0.*"], None, ["0.up", "0.down"]),
    (None, "1.*", ["0.up", "0.down"]),
    ("*", lambda name, module: module.bias is None, ["0.up", "1.up"]),
])
def test_filters(include, exclude, replaced):
    model, report = bt.sparsify(_model(), density=0.5, block_size=32, include=include, exclude=exclude,
                                return_report=True)
    assert report.replaced == replaced
    assert all(why in ("not matched by include", "matched by exclude") or "block_size" in why
               for why in report.skipped.values())
    assert f"kept dense: 2: {report.skipped['2']}" in str(report)


def test_random_and_callable_layouts():
    model, _ = bt.sparsify(_model(), density=0.25, block_size=32, layout="random", seed=3, return_report=True)
    again, _ = bt.sparsify(_model(), density=0.25, block_size=32, layout="random", seed=3, return_report=True)
    assert np.array_equal(model[0].up.op.layout, again[0].up.op.layout) and model[0].up.op.density == 0.25

    def diagonal(name, linear):
        return np.eye(linear.in_features // 32, linear.out_features // 32)

    model, report = bt.sparsify(_model(), density=0.5, block_size=32, layout=diagonal, return_report=True)
    assert np.array_equal(model[0].up.op.layout, np.eye(2, 4))
    with pytest.raises(ValueError, match=r"layout\('0\.up', linear\) must return a layout of shape \(2, 4\)"):
        bt.sparsify(_model(), density=0.5, block_size=32, layout=lambda name, linear: np.ones((4, 2)))


def test_a_model_that_is_one_linear_and_the_training_flag():
    linear = torch.nn.Linear(64, 64).eval()
    layer = bt.sparsify(linear, density=0.5, block_size=32)
    assert isinstance(layer, bt.BlockSparseLinear) and not layer.training


@pytest.mark.parametrize("arguments,error,match", [
    ({"model": "a model"}, TypeError, "model must be a torch.nn.Module; got str"),
    ({"density": 1.5}, ValueError, r"density must be a number in \[0, 1\]; got 1.5"),
    ({"layout": "norm"}, ValueError, "layout must be one of 'magnitude', 'random' or a callable"),
    ({"include": 3}, TypeError, "include must be None, a name pattern"),
])
def test_errors_leave_the_model_alone(arguments, error, match):
    model = _model()
    before = [type(m) for m in model.modules()]
    call = {"model": model, "density": 0.5, "block_size": 32, **arguments}
    with pytest.raises(error, match=match):
        bt.sparsify(call.pop("model"), **call)
    assert [type(m) for m in model.modules()] == before


def test_block_sparse_linear_from_a_density():
    layer = bt.BlockSparseLinear(256, 128, density=0.25, block_size=32, seed=0)
    again = bt.BlockSparseLinear(256, 128, density=0.25, block_size=32, seed=0)
    assert layer.op.blocks == 8 and np.array_equal(layer.op.layout, again.op.layout)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert layer(torch.randn(2, 256)).shape == (2, 128)
    with pytest.raises(ValueError, match="pass a layout or a density .* not neither"):
        bt.BlockSparseLinear(256, 128, block_size=32)
    with pytest.raises(ValueError, match="not both"):
        bt.BlockSparseLinear(256, 128, np.ones((8, 4)), block_size=32, density=0.5)
    with pytest.raises(ValueError, match="seed draws a layout of the given density"):
        bt.BlockSparseLinear(256, 128, np.ones((8, 4)), block_size=32, seed=1)
    with pytest.raises(ValueError, match=r"in_features must be a multiple of block_size 32; got 784"):
        bt.BlockSparseLinear(784, 128, density=0.25, block_size=32)

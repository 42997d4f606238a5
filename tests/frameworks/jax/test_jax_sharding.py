"""bsmm.jax on several devices: data parallel (jax.jit with a batch-sharded x, shard_map) and model
parallel (bsmm.jax.ShardedMatMul, sharded_matmul).

Forcing JAX onto several CPU devices must happen before it starts its backends, so the sharded
computations run in one child process (sharding_child.py, four forced CPU devices) that prints
its measurements as JSON; each case here checks one part of them: every output and gradient
against one device computing the whole problem, the collectives in compiled programs. Argument
errors and the one-device paths run in this process (mark gpu: on the first GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed: bsmm.jax tests skipped")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import bsmm  # noqa: E402
import bsmm.jax  # noqa: E402
import jax_cases  # noqa: E402
from conftest import REPO_ROOT  # noqa: E402
from reference import random_data, random_layout, tolerance  # noqa: E402

SCRIPT = REPO_ROOT / "tests" / "frameworks" / "jax" / "sharding_child.py"
BS = 8
DATA_PARALLEL_JIT = ["dp-jit-axis1-n1", "dp-jit-axis1-n3", "dp-jit-axis0-n1", "dp-jit-axis0-n3", "dp-jit-gspmd",
                     "dp-jit-explicit", "dp-jit-float64"]
MODES = [f"{by}-in_{input}-out_{output}" for by, input, output in (
    ("columns", "replicated", "replicated"), ("columns", "replicated", "sharded"),
    ("rows", "replicated", "replicated"), ("rows", "replicated", "sharded"),
    ("rows", "sharded", "replicated"), ("rows", "sharded", "sharded"))]
CASES = DATA_PARALLEL_JIT + [
    "dp-shard_map-pmean-axis1", "dp-shard_map-pmean-axis0", "dp-shard_map-vma-axis1", "dp-shard_map-vma-axis0",
    *(f"mp-2d-{mode}" for mode in MODES), *(f"mp-empty-part-{mode}" for mode in MODES),
    "mp-4parts-columns", "mp-4parts-rows", "mp-explicit-columns", "mp-megatron-shard_map", "mp-float64-rows",
    "dp-explicit-rows-features-gradgrad",
]
device = jax_cases.device  # the fixture (tests take it by name)


@pytest.fixture(scope="module")
def measured() -> dict:
    """The child's JSON: errors, dtypes, collectives and output shardings."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_child_ran_every_case(measured):
    assert sorted(measured["dtypes"]) == sorted(CASES)
    assert {key.split("/")[0] for key in measured["errors"]} == set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_outputs_and_gradients_match_one_device(measured, case):
    """y and the gradients of x, w and the bias (and of both layers' in the Megatron case) within the
    dtype's tolerance of the same loss on one device over the whole problem."""
    dtype = measured["dtypes"][case]
    errors = {key.split("/")[1]: value for key, value in measured["errors"].items() if key.split("/")[0] == case}
    expected = {"y", "dx", "dw", "db"} | ({"fprop"} if case in DATA_PARALLEL_JIT else set())
    if case == "mp-megatron-shard_map":
        expected = {"y", "dx", "dw1", "db1", "dw2", "db2"}
    if case == "dp-explicit-rows-features-gradgrad":
        expected = {"y", "penalised", "dx", "dw", "db"}  # (the loss with a gradient penalty)
    assert set(errors) == expected
    for name, error in errors.items():
        assert error <= tolerance(dtype), f"{case} {name}: relative error {error:.3g} ({dtype})"


@pytest.mark.parametrize("case", DATA_PARALLEL_JIT)
def test_batch_sharded_fprop_runs_shard_by_shard(measured, case):
    """jit of the forward with x sharded along its batch: no collective (no all-gather of x), and
    y comes out sharded as x is (and dx in the training step)."""
    assert measured["hlo"][f"{case}/fprop"] == []
    assert measured["kept"][case]


@pytest.mark.parametrize("case", DATA_PARALLEL_JIT)
def test_training_step_reduces_only_the_gradients(measured, case):
    """The batch-sharded training step's only collectives are all-reduces of the loss, dW and the
    bias gradient (XLA combines them into one), dW among them."""
    found = measured["hlo"][f"{case}/step"]
    allowed = measured["hlo"][f"{case}/reductions"]
    assert found and all(kind == "all-reduce" for kind, _ in found), found
    shapes = [shape for _, results in found for shape in results]
    assert set(shapes) <= set(allowed), found
    assert allowed[1] in shapes, f"no all-reduce of dW {allowed[1]}: {found}"


# -- in this process: one device --------------------------------------------------------------------------
def one_device_mesh(dev, names=("model",)):
    return jax.sharding.Mesh(np.array([dev]).reshape((1,) * len(names)), names)


def test_one_device_program_is_the_plain_pass(device):
    """On one device (a NamedSharding over a mesh of one), the pass lowers to the buffer callback
    itself, as before the partitioning rule existed: no custom partitioning, no FFI call by index."""
    rng = np.random.default_rng(1)
    op = bsmm.BlocksparseMatMul(random_layout(rng, 3, 2, 0.7), block_size=BS)
    x = jax.device_put(random_data(rng, (4, op.C), "float32"), NamedSharding(one_device_mesh(device, ("data",)),
                                                                             P("data")))
    w = jax.device_put(random_data(rng, op.w_shape, "float32"), device)
    step = jax.jit(jax.grad(lambda x, w: bsmm.jax.blocksparse_matmul(x, w, op).sum(), argnums=(0, 1)))
    lowered = step.lower(x, w)
    assert "CustomSPMDPartitioning" not in lowered.as_text()
    compiled = lowered.compile().as_text()
    assert compiled.count("custom_call_target=\"xla_buffer_python_") == 2  # bprop and updat
    assert "ffi_call" not in compiled


@pytest.mark.parametrize("by, input, output", [("columns", "replicated", "replicated"),
                                               ("columns", "replicated", "sharded"),
                                               ("rows", "sharded", "sharded")])
def test_sharded_matmul_on_a_mesh_of_one_device(device, by, input, output):
    """One part: sharded_matmul with mesh=... and inside a user's shard_map equal the whole product."""
    rng = np.random.default_rng(2)
    layout = random_layout(rng, 3, 4, 0.6)
    layout[0] = 1
    whole = bsmm.BlocksparseMatMul(layout, block_size=BS)
    layer = bsmm.jax.ShardedMatMul(layout, 1, BS, by=by, input=input, output=output)
    x = jax.device_put(random_data(rng, (5, whole.C), "float32"), device)
    w = jax.device_put(random_data(rng, whole.w_shape, "float32"), device)
    b = jax.device_put(random_data(rng, (whole.K,), "float32"), device)
    mesh = one_device_mesh(device)
    stacked = layer.shard_weight(w)
    features = {"replicated": P(), "sharded": P(None, "model")}
    y = bsmm.jax.sharded_matmul(x, stacked, layer, "model", bias=b, mesh=mesh)
    inside = jax.jit(jax.shard_map(lambda x, w, b: bsmm.jax.sharded_matmul(x, w, layer, "model", bias=b),
                                   mesh=mesh, in_specs=(features[input], P("model"), P()),
                                   out_specs=features[output]))(x, stacked, b)
    expected = jax.jit(lambda x, w: bsmm.jax.blocksparse_matmul(x, w, whole) + b)(x, w)
    for got in (y, inside):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.asarray(layer.gather_weight(stacked)), np.asarray(w))


def test_parts_form_round_trip():
    """to_parts pads each part's features to the widest part; from_parts drops the padding."""
    layout = np.ones((2, 5), np.uint8)
    layer = bsmm.jax.ShardedMatMul(layout, 2, BS, by="columns", bounds=(0, 1, 5))  # widths 8 and 32
    assert layer.counts == (8, 32) and layer.width == 32
    y = jnp.arange(3 * 40, dtype=jnp.float32).reshape(3, 40)
    parts = layer.to_parts(y)
    assert parts.shape == (3, 64)
    assert np.array_equal(np.asarray(parts[:, :8]), np.asarray(y[:, :8])) and not np.asarray(parts[:, 8:32]).any()
    assert np.array_equal(np.asarray(layer.from_parts(parts)), np.asarray(y))


# -- errors -----------------------------------------------------------------------------------------------
def test_layer_arguments_are_checked():
    layout = np.ones((3, 4), np.uint8)  # C 24, K 32
    with pytest.raises(ValueError, match="out_features.*divisible by 3; got 32"):
        bsmm.jax.ShardedMatMul(layout, 3, BS, by="rows", output="sharded")
    with pytest.raises(ValueError, match="input must be 'replicated' or 'sharded'; got 'split'"):
        bsmm.jax.ShardedMatMul(layout, 2, BS, input="split")
    with pytest.raises(ValueError, match="input='sharded' needs by='rows'"):
        bsmm.jax.ShardedMatMul(layout, 2, BS, by="columns", input="sharded")
    with pytest.raises(ValueError, match="by must be 'columns' or 'rows'"):
        bsmm.jax.ShardedMatMul(layout, 2, BS, by="diagonal")
    layer = bsmm.jax.ShardedMatMul(layout, 2, BS)
    with pytest.raises(ValueError, match=r"w must have the whole layer's shape \(12, 8, 8\); got \(11, 8, 8\)"):
        layer.shard_weight(np.zeros((11, BS, BS), np.float32))
    with pytest.raises(ValueError, match=r"stacked must have shape w_shape \(2, 6, 8, 8\); got \(6, 8, 8\)"):
        layer.gather_weight(np.zeros((6, BS, BS), np.float32))
    with pytest.raises(ValueError, match="a must have 32 features along axis 1"):
        layer.to_parts(np.zeros((2, 24), np.float32))
    with pytest.raises(ValueError, match="a must have parts \\* width = 32 features"):
        layer.from_parts(np.zeros((2, 24), np.float32))


def test_call_arguments_name_what_is_wrong():
    dev = jax.devices("cpu")[0]
    layout = np.ones((2, 2), np.uint8)  # C 16, K 16
    layer = bsmm.jax.ShardedMatMul(layout, 1, BS)
    two_parts = bsmm.jax.ShardedMatMul(layout, 2, BS)
    mesh = one_device_mesh(dev, ("data", "model"))
    x, stacked = np.zeros((3, 16), np.float32), np.zeros(layer.w_shape, np.float32)
    call = bsmm.jax.sharded_matmul
    with pytest.raises(TypeError, match="layer must be a bsmm.jax.ShardedMatMul; got BlocksparseMatMul"):
        call(x, stacked, bsmm.BlocksparseMatMul(layout, block_size=BS), "model", mesh=mesh)
    with pytest.raises(ValueError, match=r"axis_name 'tensor' is not an axis of mesh \(its axes: \['data', 'model'\]\)"):
        call(x, stacked, layer, "tensor", mesh=mesh)
    with pytest.raises(ValueError, match="mesh axis 'model' has 1 devices but layer has 2 parts"):
        call(x, np.zeros(two_parts.w_shape, np.float32), two_parts, "model", mesh=mesh)
    with pytest.raises(ValueError, match="batch_axis must name axes of mesh other than axis_name 'model'"):
        call(x, stacked, layer, "model", mesh=mesh, batch_axis="model")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh; got str"):
        call(x, stacked, layer, "model", mesh="model")
    with pytest.raises(ValueError, match=r"w must be the stacked weight of shape layer.w_shape \(1, 4, 8, 8\)"):
        call(x, stacked[0], layer, "model", mesh=mesh)
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., F\) with F = 16 .*got \(3, 24\)"):
        call(np.zeros((3, 24), np.float32), stacked, layer, "model", mesh=mesh)
    with pytest.raises(ValueError, match=r"bias must have shape \(16,\)"):
        call(x, stacked, layer, "model", bias=np.zeros(8, np.float32), mesh=mesh)
    with pytest.raises(TypeError, match="w has dtype float16 but x has float32"):
        call(x, stacked.astype(np.float16), layer, "model", mesh=mesh)
    with pytest.raises(ValueError, match="axis_name 'model' is not a mesh axis of the enclosing shard_map"):
        call(x, stacked, layer, "model")  # outside any shard_map

    def inside(x, w):
        return call(x, w[:, :2], layer, "model")

    with pytest.raises(ValueError, match=r"w must be this device's row of the stacked weight, shape \(1, 4, 8, 8\)"):
        jax.shard_map(inside, mesh=mesh, in_specs=(P(), P("model")), out_specs=P())(x, stacked)
    with pytest.raises(ValueError, match="mesh axis 'data' has 1 devices but layer has 2 parts"):
        jax.shard_map(lambda x, w: call(x, w, two_parts, "data"), mesh=mesh, in_specs=(P(), P()),
                      out_specs=P())(x, np.zeros((1,) + two_parts.w_shape[1:], np.float32))


def test_explicit_axes_keep_the_operands_types(measured):
    """Explicit mesh axes, x sharded on rows and features: dx comes back with x's own sharding (a custom_vjp
    cotangent must have its primal's type), through a gradient penalty too."""
    assert measured["kept"]["dp-explicit-rows-features-gradgrad"] is True


def test_an_uneven_batch_is_named(measured):
    assert measured["messages"]["uneven-batch"] == (
        "x's batch (3 rows along axis 0) must be divisible by the 2 devices of batch_axis 'data'")


def test_eager_calls_reuse_one_compiled_program():
    """sharded_matmul(mesh=...) called eagerly twice with the same layer and shapes compiles once."""
    from bsmm.jax import sharded

    dev = jax.devices("cpu")[0]
    layer = bsmm.jax.ShardedMatMul(np.ones((2, 2), np.uint8), 1, BS)
    mesh = one_device_mesh(dev)
    x, stacked = np.ones((3, 16), np.float32), np.ones(layer.w_shape, np.float32)
    first = bsmm.jax.sharded_matmul(x, stacked, layer, "model", mesh=mesh)
    compiled = sharded._placed._cache_size()
    second = bsmm.jax.sharded_matmul(x, stacked, layer, "model", mesh=mesh)
    assert sharded._placed._cache_size() == compiled
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))

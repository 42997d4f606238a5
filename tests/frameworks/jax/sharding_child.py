"""The measurements of test_jax_sharding.py, on forced CPU devices: one JSON line on stdout.

XLA_FLAGS=--xla_force_host_platform_device_count=4 must be set before JAX starts, hence a process
of its own. Every case runs a sharded computation and the same loss on one device over the whole
problem (bsmm's own passes, unsharded) and reports the relative error of each output and gradient,
``{"<case>/<quantity>": error}``; ``hlo`` holds the collectives found in the compiled programs of
the data-parallel jit cases (and the shapes their reductions may have), ``kept`` whether their
outputs stayed batch-sharded, and ``dtypes`` each case's dtype.
"""

from __future__ import annotations

import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # tests/: reference.py
import bsmm  # noqa: E402
import bsmm.jax  # noqa: E402
from reference import random_data, random_layout, rel_error, skewed_layout  # noqa: E402

BS = 8
errors: dict[str, float] = {}
dtypes: dict[str, str] = {}
hlo: dict[str, list] = {}
kept: dict[str, bool] = {}  # whether y and dx of a data-parallel jit came out sharded like x
ONE = jax.devices()[0]
COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                        r"collective-permute)(?:-start)?\(", re.MULTILINE)


def data(rng, shape, dtype) -> np.ndarray:
    """Random normal data of ``dtype`` (a name; float64 too)."""
    return random_data(rng, shape, np.dtype(dtype))


def collectives(compiled) -> list:
    """[kind, [result shapes]] of each collective in a compiled program (XLA may combine several
    all-reduces into one of a tuple)."""
    return [[kind, re.findall(r"[a-z]+[0-9]*\[[0-9,]*\]", result)]
            for result, kind in COLLECTIVE.findall(compiled.as_text())]


def record(case: str, got: dict, expected: dict, dtype) -> None:
    dtypes[case] = np.dtype(dtype).name
    for name, value in got.items():
        errors[f"{case}/{name}"] = rel_error(np.asarray(value), np.asarray(expected[name]))


def make_mesh(shape: tuple, names: tuple, explicit: bool = False):
    """A mesh of Auto axes (jax.jit with NamedSharding inputs, as most code is written), or of Explicit
    axes (sharding in types: jax.make_mesh's default since JAX 0.7)."""
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def on_one_device(f, *args):
    """``f`` jitted on the first device alone, over the whole (unsharded) arguments."""
    return jax.jit(f)(*(jax.device_put(np.asarray(a), ONE) for a in args))


# -- data parallel ------------------------------------------------------------------------------------
def data_parallel_loss(op):
    def loss(x, w, b, r):
        y = bsmm.jax.blocksparse_matmul(x, w, op)
        y = y + (b if op.feature_axis == 1 else b[:, None])
        return jnp.sum(jnp.tanh(y) * r), y
    return loss


def data_parallel_jit(case: str, axis: int, n: int, dtype="float32", shardy: bool = True,
                      explicit: bool = False) -> None:
    """jit with a batch-sharded x (NamedSharding) over a 1-D mesh of 4 devices; w and b replicated."""
    rng = np.random.default_rng(len(case))
    op = bsmm.BlocksparseMatMul(random_layout(rng, 4, 3, 0.6), block_size=BS, feature_axis=axis)  # C 32, K 24
    rows = (n, op.C) if axis == 1 else (op.C, n)
    x, w = data(rng, rows, dtype), data(rng, op.w_shape, dtype)
    b = data(rng, (op.K,), dtype)
    r = data(rng, (n, op.K) if axis == 1 else (op.K, n), dtype)
    loss = data_parallel_loss(op)
    step = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    mesh = make_mesh((4,), ("data",), explicit)
    batch = NamedSharding(mesh, P("data", None) if axis == 1 else P(None, "data"))
    whole = NamedSharding(mesh, P())
    args = (jax.device_put(x, batch), jax.device_put(w, whole), jax.device_put(b, whole), jax.device_put(r, batch))
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
        forward = jax.jit(lambda x, w: bsmm.jax.blocksparse_matmul(x, w, op))
        train = jax.jit(step)
        hlo[f"{case}/fprop"] = collectives(forward.lower(*args[:2]).compile())
        hlo[f"{case}/step"] = collectives(train.lower(*args).compile())
        element = {"float32": "f32", "float64": "f64"}[dtype]
        # What a data-parallel step must reduce: the loss, dW and the bias gradient.
        hlo[f"{case}/reductions"] = [f"{element}[]", f"{element}[{','.join(map(str, op.w_shape))}]",
                                     f"{element}[{op.K}]"]
        (_, y), (dx, dw, db) = train(*args)
        y_fprop = forward(*args[:2])
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
    (_, y_ref), (dx_ref, dw_ref, db_ref) = on_one_device(step, x, w, b, r)
    record(case, {"y": y, "fprop": y_fprop, "dx": dx, "dw": dw, "db": db},
           {"y": y_ref, "fprop": y_ref - (b if axis == 1 else b[:, None]), "dx": dx_ref, "dw": dw_ref, "db": db_ref},
           dtype)
    kept[case] = y.sharding.is_equivalent_to(batch, y.ndim) and dx.sharding.is_equivalent_to(batch, dx.ndim)


def explicit_rows_and_features(case: str) -> None:
    """Explicit mesh axes (jax.set_mesh) with x sharded on its rows and its features: the training step and
    a gradient penalty (grad of grad), whose cotangents must keep x's and w's types."""
    rng = np.random.default_rng(len(case))
    op = bsmm.BlocksparseMatMul(random_layout(rng, 4, 3, 0.6), block_size=BS)  # C 32, K 24
    x, w, b, r = (data(rng, shape, "float32") for shape in ((8, op.C), op.w_shape, (op.K,), (8, op.K)))
    loss = data_parallel_loss(op)

    def penalised(x, w, b, r):
        dx = jax.grad(lambda x: loss(x, w, b, r)[0])(x)
        return loss(x, w, b, r)[0] + jnp.sum(dx ** 2)

    step = jax.value_and_grad(penalised, argnums=(0, 1, 2))
    mesh = make_mesh((2, 2), ("data", "fsdp"), explicit=True)
    with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(mesh):
        placed = (jax.device_put(x, P("data", "fsdp")), jax.device_put(w, P()), jax.device_put(b, P()),
                  jax.device_put(r, P("data", None)))
        value, (dx, dw, db) = jax.jit(step)(*placed)
        y = jax.jit(lambda *args: loss(*args)[1])(*placed)
        kept[case] = jax.typeof(dx).sharding.spec == P("data", "fsdp")
    ref_value, (dx_ref, dw_ref, db_ref) = on_one_device(step, x, w, b, r)
    y_ref = on_one_device(lambda *args: loss(*args)[1], x, w, b, r)
    record(case, {"y": y, "penalised": value, "dx": dx, "dw": dw, "db": db},
           {"y": y_ref, "penalised": ref_value, "dx": dx_ref, "dw": dw_ref, "db": db_ref}, "float32")


def uneven_batch_message() -> str:
    """What sharded_matmul says of a batch the devices of batch_axis do not divide."""
    layout = np.ones((2, 2), np.uint8)
    layer = bsmm.jax.ShardedMatMul(layout, 2, BS)
    try:
        bsmm.jax.sharded_matmul(np.zeros((3, 16), np.float32), np.zeros(layer.w_shape, np.float32), layer, "model",
                                mesh=make_mesh((2, 2), ("data", "model")), batch_axis="data")
    except ValueError as error:
        return str(error)
    return "no error"


def data_parallel_shard_map(case: str, axis: int, n: int, check_vma: bool) -> None:
    """shard_map over a 1-D mesh of 4 devices, the two ways of writing it:

    - ``check_vma=False``: each device's mean loss, its gradients ``lax.pmean``-ed;
    - ``check_vma=True`` (shard_map's default): JAX sums the gradients of the replicated w and b over
      the devices itself (as for its own dense layers), so each device's loss is its share of the
      whole mean and nothing is pmean-ed.
    """
    rng = np.random.default_rng(len(case))
    op = bsmm.BlocksparseMatMul(random_layout(rng, 3, 4, 0.6), block_size=BS, feature_axis=axis)  # C 24, K 32
    rows_dim = 0 if axis == 1 else 1
    x = data(rng, (n, op.C) if axis == 1 else (op.C, n), "float32")
    w, b = data(rng, op.w_shape, "float32"), data(rng, (op.K,), "float32")
    r = data(rng, (n, op.K) if axis == 1 else (op.K, n), "float32")
    loss = data_parallel_loss(op)

    def mean_loss(x, w, b, r, rows):
        total, y = loss(x, w, b, r)
        return total / rows, y

    def local_step(x, w, b, r):
        rows = x.shape[rows_dim] * (4 if check_vma else 1)
        (_, y), (dx, dw, db) = jax.value_and_grad(mean_loss, argnums=(0, 1, 2), has_aux=True)(x, w, b, r, rows)
        if check_vma:
            return y, dx, dw, db
        return y, dx, jax.lax.pmean(dw, "data"), jax.lax.pmean(db, "data")

    mesh = make_mesh((4,), ("data",))
    batch = P("data", None) if axis == 1 else P(None, "data")
    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(batch, P(), P(), batch),
                                 out_specs=(batch, batch, P(), P()), check_vma=check_vma))
    y, dx, dw, db = step(x, w, b, r)
    (_, y_ref), (dx_ref, dw_ref, db_ref) = on_one_device(
        jax.value_and_grad(lambda *args: mean_loss(*args, n), argnums=(0, 1, 2), has_aux=True), x, w, b, r)
    # Without check_vma each device's mean is over n / 4 rows: its dx is 4 times the whole mean's.
    record(case, {"y": y, "dx": dx, "dw": dw, "db": db},
           {"y": y_ref, "dx": np.asarray(dx_ref) * (1 if check_vma else 4), "dw": dw_ref, "db": db_ref}, "float32")


# -- model parallel -----------------------------------------------------------------------------------
def whole_loss(op):
    """The loss of the whole layer on one device: sum(tanh(x·W + b) * r)."""
    def loss(x, w, b, r):
        y = bsmm.jax.blocksparse_matmul(x, w, op) + (b if op.feature_axis == 1 else b[:, None])
        return jnp.sum(jnp.tanh(y) * r), y
    return loss


def model_parallel(case: str, layout, mesh_shape: tuple, by: str, input: str, output: str, axis: int = 1,
                   dtype="float32", bounds=None, explicit: bool = False) -> None:
    """sharded_matmul with mesh=... (the parts along "model", the batch along "data" when the mesh has
    it) against the whole layer on one device; inputs and outputs in the parts form where sharded."""
    rng = np.random.default_rng(len(case) + 7)
    names = ("data", "model") if len(mesh_shape) == 2 else ("model",)
    mesh = make_mesh(mesh_shape, names, explicit)
    layer = bsmm.jax.ShardedMatMul(layout, mesh.shape["model"], BS, by=by, input=input, output=output,
                                   feature_axis=axis, bounds=bounds)
    whole = bsmm.BlocksparseMatMul(layout, block_size=BS, feature_axis=axis)
    n = 6
    x = data(rng, (n, whole.C) if axis == 1 else (whole.C, n), dtype)
    w, b = data(rng, whole.w_shape, dtype), data(rng, (whole.K,), dtype)
    r = data(rng, (n, whole.K) if axis == 1 else (whole.K, n), dtype)
    batch_axis = "data" if "data" in names else None
    x_in = layer.to_parts(x) if input == "sharded" else x

    def loss(x_in, stacked, b, r):
        y = bsmm.jax.sharded_matmul(x_in, stacked, layer, "model", bias=b, mesh=mesh, batch_axis=batch_axis)
        y_whole = layer.from_parts(y) if (by, output) == ("columns", "sharded") else y
        return jnp.sum(jnp.tanh(y_whole) * r), y_whole

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, y), (dx, dstacked, db) = step(x_in, layer.shard_weight(w), b, r)
    (_, y_ref), (dx_ref, dw_ref, db_ref) = on_one_device(jax.value_and_grad(whole_loss(whole), argnums=(0, 1, 2),
                                                                            has_aux=True), x, w, b, r)
    dx = layer.from_parts(dx) if input == "sharded" else dx
    record(case, {"y": y, "dx": dx, "dw": layer.gather_weight(dstacked), "db": db},
           {"y": y_ref, "dx": dx_ref, "dw": dw_ref, "db": db_ref}, dtype)


def megatron_in_shard_map(case: str) -> None:
    """Inside one user shard_map over data × model: a by="columns" layer with a sharded output feeding
    a by="rows" layer with a sharded input cut at the same bounds, then a replicated output."""
    rng = np.random.default_rng(99)
    up_layout, down_layout = skewed_layout(rng, 4, 6), random_layout(rng, 6, 3, 0.5)
    down_layout[3, 1] = 1
    up = bsmm.jax.ShardedMatMul(up_layout, 2, BS, by="columns", output="sharded")
    down = bsmm.jax.ShardedMatMul(down_layout, 2, BS, by="rows", input="sharded", bounds=up.split.bounds)
    whole_up, whole_down = (bsmm.BlocksparseMatMul(layout, block_size=BS) for layout in (up_layout, down_layout))
    x = data(rng, (8, whole_up.C), "float32")
    w1, w2 = data(rng, whole_up.w_shape, "float32"), data(rng, whole_down.w_shape, "float32")
    b1, b2 = data(rng, (whole_up.K,), "float32"), data(rng, (whole_down.K,), "float32")
    mesh = make_mesh((2, 2), ("data", "model"))

    def local(x, w1, b1, w2, b2):
        h = jax.nn.gelu(bsmm.jax.sharded_matmul(x, w1, up, "model", bias=b1))
        return bsmm.jax.sharded_matmul(h, w2, down, "model", bias=b2)

    forward = jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("model"), P(), P("model"), P()),
                            out_specs=P("data"))

    def loss(x, w1, b1, w2, b2):
        y = forward(x, w1, b1, w2, b2)
        return jnp.sum(y ** 2), y

    def whole_loss_(x, w1, b1, w2, b2):
        h = jax.nn.gelu(bsmm.jax.blocksparse_matmul(x, w1, whole_up) + b1)
        y = bsmm.jax.blocksparse_matmul(h, w2, whole_down) + b2
        return jnp.sum(y ** 2), y

    argnums = (0, 1, 2, 3, 4)
    step = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))
    (_, y), (dx, dw1, db1, dw2, db2) = step(x, up.shard_weight(w1), b1, down.shard_weight(w2), b2)
    (_, y_ref), grads = on_one_device(jax.value_and_grad(whole_loss_, argnums=argnums, has_aux=True),
                                      x, w1, b1, w2, b2)
    record(case, {"y": y, "dx": dx, "dw1": up.gather_weight(dw1), "db1": db1, "dw2": down.gather_weight(dw2),
                  "db2": db2}, dict(zip(("y", "dx", "dw1", "db1", "dw2", "db2"), (y_ref, *grads))), "float32")


def main() -> None:
    assert len(jax.devices()) == 4, jax.devices()
    data_parallel_jit("dp-jit-axis1-n1", 1, 4)  # one row per device
    data_parallel_jit("dp-jit-axis1-n3", 1, 12)  # an odd number per device
    data_parallel_jit("dp-jit-axis0-n1", 0, 4)
    data_parallel_jit("dp-jit-axis0-n3", 0, 12)
    data_parallel_jit("dp-jit-gspmd", 1, 12, shardy=False)
    data_parallel_jit("dp-jit-explicit", 1, 12, explicit=True)
    explicit_rows_and_features("dp-explicit-rows-features-gradgrad")
    data_parallel_shard_map("dp-shard_map-pmean-axis1", 1, 12, check_vma=False)
    data_parallel_shard_map("dp-shard_map-pmean-axis0", 0, 4, check_vma=False)
    data_parallel_shard_map("dp-shard_map-vma-axis1", 1, 12, check_vma=True)
    data_parallel_shard_map("dp-shard_map-vma-axis0", 0, 4, check_vma=True)

    rng = np.random.default_rng(5)
    skewed = skewed_layout(rng, 5, 6)  # C 40, K 48
    empty_part = random_layout(rng, 3, 4, 0.7)
    empty_part[:, 3] = 0  # with bounds (0, 3, 4) part 1 holds no block; C 24, K 32
    empty_part[0, :3] = 1
    for by, modes in (("columns", (("replicated", "replicated"), ("replicated", "sharded"))),
                      ("rows", (("replicated", "replicated"), ("replicated", "sharded"), ("sharded", "replicated"),
                                ("sharded", "sharded")))):
        for input, output in modes:
            tag = f"{by}-in_{input}-out_{output}"
            model_parallel(f"mp-2d-{tag}", skewed, (2, 2), by, input, output)
            model_parallel(f"mp-empty-part-{tag}", empty_part, (2, 2), by, input, output, axis=0,
                           bounds=(0, 3, 4) if by == "columns" else (0, 2, 3))
    model_parallel("mp-4parts-columns", skewed, (4,), "columns", "replicated", "replicated")
    model_parallel("mp-4parts-rows", skewed, (4,), "rows", "sharded", "sharded")
    model_parallel("mp-explicit-columns", skewed, (2, 2), "columns", "replicated", "sharded", explicit=True)
    megatron_in_shard_map("mp-megatron-shard_map")

    jax.config.update("jax_enable_x64", True)
    data_parallel_jit("dp-jit-float64", 1, 12, dtype="float64")
    model_parallel("mp-float64-rows", skewed, (2, 2), "rows", "replicated", "sharded", dtype="float64")
    messages = {"uneven-batch": uneven_batch_message()}
    print(json.dumps({"errors": errors, "dtypes": dtypes, "hlo": hlo, "kept": kept, "messages": messages}))


if __name__ == "__main__":
    main()

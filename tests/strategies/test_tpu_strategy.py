"""`TPUStrategy`: replicas of several logical devices, on 8 simulated CPU devices.

The model-parallel annotations are checked in the compiled HLO (per-device shapes
of the ops that consume an annotated value); training is compared with plain
single-device JAX + optax (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist as jd
from jaxdist.tpu.experimental import DeviceAssignment

from _hlo import group_sets

RTOL, ATOL = 1e-5, 1e-6


def _strategy(cores: int, replicas: int) -> jd.TPUStrategy:
    assignment = DeviceAssignment.build(computation_shape=[1, 1, 1, cores], num_replicas=replicas)
    return jd.TPUStrategy(device_assignment=assignment)


@pytest.fixture(scope="module")
def tp() -> jd.TPUStrategy:
    """4 replicas x 2 logical devices."""
    return _strategy(2, 4)


def _op_shapes(hlo: str, opcode: str) -> set[tuple[int, ...]]:
    """The per-device output shapes of every ``opcode`` instruction of a compiled module,
    without leading 1s (XLA may keep the replica's one row of a per-replica input)."""
    found = re.findall(rf"= \w+\[([\d,]*)\]\S* {opcode}\(", hlo)
    assert found, f"no {opcode} instruction in the compiled HLO"
    shapes = set()
    for text in found:
        dims = [int(d) for d in text.split(",") if d]
        while len(dims) > 1 and dims[0] == 1:
            dims.pop(0)
        shapes.add(tuple(dims))
    return shapes


def _hlo(strategy: jd.Strategy, fn, *args) -> str:
    return strategy.function(fn).lower(*args).compile().as_text()


# Properties ----------------------------------------------------------------------------


def test_mesh_replicas_and_worker_devices(tp: jd.TPUStrategy) -> None:
    devices = jax.devices()
    assert tp.mesh.axis_names == ("replica", "logical")
    assert tp.mesh.devices.shape == (4, 2)
    assert tp.axis_name == "replica" and tp.logical_axis_name == "logical"
    assert [[d.id for d in row] for row in tp.mesh.devices] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert tp.num_replicas_in_sync == 4
    assert tp.num_logical_devices_per_replica == 2
    assert tp.extended.worker_devices == tuple(devices[i] for i in (0, 2, 4, 6))
    assert tp.extended.num_hosts == 1
    assert tp.extended.num_replicas_per_host == 4  # min(4 replicas, 8 devices // 2)
    assert _strategy(4, 1).extended.num_replicas_per_host == 1
    assert tp.cluster_resolver is None
    assert tp == _strategy(2, 4) and hash(tp) == hash(_strategy(2, 4))
    assert tp != _strategy(2, 2) and tp != jd.MirroredStrategy(tp.extended.worker_devices)
    assert jd.experimental.TPUStrategy is jd.TPUStrategy
    assert "num_replicas=4, logical_devices_per_replica=2" in repr(tp)


def test_variable_and_outputs_have_one_local_result_per_replica(tp: jd.TPUStrategy) -> None:
    with tp.scope():
        v = jd.Variable(jnp.arange(3.0))
    local = tp.experimental_local_results(v)
    assert len(local) == 4
    for copy, device in zip(local, tp.extended.worker_devices, strict=True):
        np.testing.assert_array_equal(copy, np.arange(3.0))
        assert copy.devices() == {device}

    x = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    total, rows = tp.run(lambda ctx, x: (ctx.all_reduce("sum", x), x * 2), args=(jd.PerReplica(x),))
    assert isinstance(total, jd.Mirrored) and isinstance(rows, jd.PerReplica)
    assert [np.asarray(t).tolist() for t in tp.experimental_local_results(total)] == [
        x.sum(0).tolist()
    ] * 4
    # TF's `.values`: one component per replica, on its logical device 0.
    assert [c.devices() for c in total.values] == [{d} for d in tp.extended.worker_devices]
    np.testing.assert_array_equal(np.stack(tp.experimental_local_results(rows)), x * 2)
    np.testing.assert_allclose(float(tp.reduce("sum", rows, axis=0).sum()), 2 * x.sum())

    made = tp.experimental_distribute_values_from_function(
        lambda ctx: jnp.full((2,), ctx.replica_id_in_sync_group, jnp.float32)
    )
    assert len(made.array.sharding.device_set) == 8  # on both logical devices of a replica
    np.testing.assert_array_equal(made.array[:, 0], [0.0, 1.0, 2.0, 3.0])


def test_distributed_dataset_feeds_each_replica(tp: jd.TPUStrategy) -> None:
    data = np.arange(40.0, dtype=np.float32).reshape(20, 2)
    dataset = tp.experimental_distribute_dataset(jd.data.from_arrays(data, batch_size=8))
    sums = []
    for batch in dataset:  # 8, 8, then 4 rows padded to 8
        assert batch.array.shape == (4, 2, 2)
        total = tp.run(
            lambda ctx, b: ctx.all_reduce("sum", jnp.sum(b * ctx.valid_mask(2)[:, None], 0)),
            args=(batch,),
        )
        sums.append(np.asarray(total.array))
    np.testing.assert_allclose(np.sum(sums, 0), data.sum(0), rtol=RTOL)  # padding masked


def test_replica_id_and_collectives_run_over_the_replica_axis(tp: jd.TPUStrategy) -> None:
    def fn(ctx, x):
        return ctx.all_reduce("sum", x), ctx.replica_id_in_sync_group

    x = jd.PerReplica(np.arange(4.0, dtype=np.float32).reshape(4, 1) + np.zeros((4, 6)))
    total, ids = tp.run(fn, args=(x,))
    np.testing.assert_allclose(np.asarray(total.array), np.full(6, 6.0))
    assert [int(i) for i in tp.experimental_local_results(ids)] == [0, 1, 2, 3]
    # The all-reduce groups the replicas that share a logical device index.
    groups = group_sets(_hlo(tp, fn, x), "all-reduce")
    assert frozenset({frozenset({0, 2, 4, 6}), frozenset({1, 3, 5, 7})}) in groups


def test_default_is_data_parallel_like_mirrored() -> None:
    tpu, mirrored = jd.TPUStrategy(), jd.MirroredStrategy()
    assert tpu.mesh.shape == mirrored.mesh.shape and tpu.mesh.axis_names == ("replica",)
    assert tuple(tpu.mesh.devices.flat) == tuple(mirrored.mesh.devices.flat)
    assert tpu.num_replicas_in_sync == 8 and tpu.logical_axis_name is None
    assert tpu.extended.worker_devices == mirrored.extended.worker_devices
    assert tpu.extended.num_hosts == 1 and tpu.extended.num_replicas_per_host == 8

    def fn(ctx, x, w, annotate=lambda y: y):
        y = annotate(x @ w)
        return ctx.all_reduce("mean", jnp.tanh(y)), y

    def annotated(ctx, x, w):  # one logical device: nothing to split
        return fn(ctx, x, w, lambda y: tpu.experimental_split_to_logical_devices(y, [1, 1]))

    x = np.random.default_rng(0).normal(size=(8, 4, 3)).astype(np.float32)
    w = np.ones((3, 2), np.float32)
    a = tpu.run(annotated, args=(jd.PerReplica(x), w))
    b = mirrored.run(fn, args=(jd.PerReplica(x), w))
    np.testing.assert_allclose(np.asarray(a[0].array), np.asarray(b[0].array), rtol=RTOL)
    np.testing.assert_allclose(np.asarray(a[1].array), x @ w, rtol=RTOL, atol=ATOL)


# The annotations, in the compiled HLO ----------------------------------------------------


@pytest.mark.parametrize(("dims", "shard"), [([1, 2], (8, 8)), ([2, 1], (4, 16))])
def test_split_shards_the_logical_axis(
    tp: jd.TPUStrategy, dims: list[int], shard: tuple[int, int]
) -> None:
    def fn(ctx, x):
        return jnp.sin(tp.experimental_split_to_logical_devices(x, dims))

    x = jd.PerReplica(np.random.default_rng(1).normal(size=(4, 8, 16)).astype(np.float32))
    assert _op_shapes(_hlo(tp, fn, x), "sine") == {shard}
    np.testing.assert_allclose(np.asarray(tp.run(fn, args=(x,)).array), np.sin(x.array), rtol=RTOL)


def test_split_several_dimensions_over_four_logical_devices() -> None:
    s = _strategy(4, 2)
    assert s.mesh.devices.shape == (2, 4)

    def fn(ctx, x):
        return jnp.sin(s.experimental_split_to_logical_devices(x, [1, 2, 2]))

    x = jd.PerReplica(np.random.default_rng(2).normal(size=(2, 3, 8, 16)).astype(np.float32))
    assert _op_shapes(_hlo(s, fn, x), "sine") == {(3, 4, 8)}
    np.testing.assert_allclose(np.asarray(s.run(fn, args=(x,)).array), np.sin(x.array), rtol=RTOL)
    # One dimension split four ways.
    one = s.function(lambda ctx, x: jnp.sin(s.experimental_split_to_logical_devices(x, [1, 1, 4])))
    assert _op_shapes(one.lower(x).compile().as_text(), "sine") == {(3, 8, 4)}


def test_replicate_and_assign_keep_whole_values(tp: jd.TPUStrategy) -> None:
    def fn(ctx, x):
        split = jnp.sin(tp.experimental_split_to_logical_devices(x, [1, 2]))
        whole = jnp.cos(tp.experimental_replicate_to_logical_devices(split))
        one = jnp.exp(tp.experimental_assign_to_logical_device(whole, 1))
        return one

    x = jd.PerReplica(np.random.default_rng(3).normal(size=(4, 8, 16)).astype(np.float32))
    hlo = _hlo(tp, fn, x)
    assert _op_shapes(hlo, "sine") == {(8, 8)}
    assert _op_shapes(hlo, "cosine") == {(8, 16)}
    assert _op_shapes(hlo, "exponential") == {(8, 16)}
    # Replicating a split value gathers it within each replica's logical devices.
    pairs = frozenset(frozenset({r, r + 1}) for r in range(0, 8, 2))
    assert pairs in group_sets(hlo, "all-gather")
    np.testing.assert_allclose(
        np.asarray(tp.run(fn, args=(x,)).array), np.exp(np.cos(np.sin(x.array))), rtol=RTOL
    )


def test_one_replica_of_eight_logical_devices() -> None:
    s = _strategy(8, 1)
    assert s.mesh.devices.shape == (1, 8) and s.num_replicas_in_sync == 1
    x = np.random.default_rng(4).normal(size=(8, 16)).astype(np.float32)

    def fn(ctx, x):
        return jnp.sin(s.experimental_split_to_logical_devices(x, [2, 4]))

    assert _op_shapes(_hlo(s, fn, x), "sine") == {(4, 4)}
    out = s.run(fn, args=(x,))
    assert isinstance(out, jax.Array)  # one replica: plain arrays, as TF
    np.testing.assert_allclose(np.asarray(out), np.sin(x), rtol=RTOL)

    # Every collective over the replica axis (size 1) is an identity, and emits no
    # collective: XLA cannot compile one beside the sharded logical axis.
    def collectives(ctx, x):
        y = fn(ctx, x)
        merged = ctx.merge_call(lambda strategy, v: strategy.reduce("sum", v, axis=None), (y,))
        return (
            ctx.all_reduce("sum", y),
            ctx.all_reduce("max", y),
            ctx.all_gather(y, 0),
            ctx.reduce_scatter("mean", y, 0),
            ctx.broadcast(y),
            ctx.all_to_all(y, 0, 1),
            ctx.ppermute(y, [(0, 0)]),
            ctx.ppermute(y, []),
            merged,
        )

    outs = s.run(collectives, args=(x,))
    for out in outs[:7] + outs[8:]:
        np.testing.assert_allclose(np.asarray(out), np.sin(x), rtol=RTOL)
    np.testing.assert_array_equal(np.asarray(outs[7]), 0.0)
    hlo = _hlo(s, collectives, x)
    assert not re.search(r"all-reduce\(|reduce-scatter\(|collective-permute\(", hlo)

    with s.scope():
        total = jd.Variable(np.zeros(3, np.float32), aggregation="sum")
        mean = jd.Variable(np.zeros(3, np.float32), aggregation="mean")

    def update(ctx, total, mean, x):
        return ctx.assign_add(total, x), ctx.assign(mean, x * 2)

    total, mean = s.run(update, args=(total, mean, np.arange(3, dtype=np.float32)))
    np.testing.assert_array_equal(np.asarray(total), [0, 1, 2])
    np.testing.assert_array_equal(np.asarray(mean), [0, 2, 4])


# TF's errors, in TF's order -------------------------------------------------------------


def _raises_inside(strategy: jd.TPUStrategy, annotate, x, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        strategy.run(lambda ctx, x: annotate(x), args=(x,))


def test_split_errors_in_tf_order(tp: jd.TPUStrategy) -> None:
    split = tp.experimental_split_to_logical_devices
    x = np.ones((6, 4), np.float32)
    # Wrong length beats everything else (3 is also not divisible, and the product is off).
    _raises_inside(
        tp,
        lambda v: split(v, [5, 5, 5]),
        x,
        ValueError,
        r"length of `partition_dimensions` must equal the rank of `tensor.shape` \(2, shape "
        r"\(6, 4\)\)\. Received len\(partition_dimensions\)=3",
    )
    # Not divisible beats a wrong product.
    _raises_inside(
        tp,
        lambda v: split(v, [4, 1]),
        x,
        ValueError,
        r"partition_dimensions\[0\]` must be divisible .* \(4\)\. Received: 6",
    )
    _raises_inside(
        tp,
        lambda v: split(v, [2, 2]),
        x,
        ValueError,
        r"product of `partition_dimensions` should be the same as the number of logical "
        r"devices per replica \(=2\)\. Received `partition_dimensions`=\[2, 2\], and their "
        r"product is 4",
    )
    _raises_inside(tp, lambda v: split(v, [0, 2]), x, ValueError, r"\[0\] must be a positive")
    _raises_inside(tp, lambda v: split(v, [1.0, 2]), x, TypeError, r"\[0\] must be an int")


@pytest.mark.parametrize("bad", [2, -1, 7])
def test_assign_rejects_an_id_out_of_range(tp: jd.TPUStrategy, bad: int) -> None:
    _raises_inside(
        tp,
        lambda v: tp.experimental_assign_to_logical_device(v, bad),
        np.ones(3, np.float32),
        ValueError,
        rf"Received logical device id {bad} but there are only 2 logical devices",
    )


def test_annotations_need_a_replica_function_and_an_assignment(tp: jd.TPUStrategy) -> None:
    x = jnp.ones((4, 4))
    with pytest.raises(RuntimeError, match=r"inside the function given to this strategy's run"):
        tp.experimental_replicate_to_logical_devices(x)
    other = _strategy(2, 2)
    with pytest.raises(RuntimeError, match=r"experimental_split_to_logical_devices annotates"):
        other.run(lambda ctx, x: tp.experimental_split_to_logical_devices(x, [1, 2]), args=(x,))
    with pytest.raises(TypeError, match=r"expected a jaxdist.tpu.experimental.DeviceAssignment"):
        jd.TPUStrategy(device_assignment=[[0, 1]])
    with pytest.raises(TypeError, match=r"expected a jaxdist.cluster_resolver.ClusterResolver"):
        jd.TPUStrategy(cluster_resolver="local")


# A 2-way tensor-parallel MLP ------------------------------------------------------------

STEPS, BATCH, D, H, OUT = 20, 32, 12, 16, 4


def _data() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    params = {
        "w1": rng.normal(size=(D, H)).astype(np.float32) / np.sqrt(D),
        "b1": np.zeros(H, np.float32),
        "w2": rng.normal(size=(H, OUT)).astype(np.float32) / np.sqrt(H),
    }
    x = rng.normal(size=(STEPS, BATCH, D)).astype(np.float32)
    y = np.sin(x @ rng.normal(size=(D, OUT))).astype(np.float32)  # a target the MLP can learn
    return params, x, y


def _mlp(params, x, annotate=None, ways=2):
    w1, w2 = params["w1"], params["w2"]
    if annotate is not None:
        w1 = annotate(w1, [1, ways])  # the hidden (output) dimension over the logical devices
        w2 = annotate(w2, [ways, 1])  # ... and the matching input dimension
    return jnp.tanh(x @ w1 + params["b1"]) @ w2


def _reference(params, xs, ys, tx) -> tuple[dict[str, np.ndarray], list[float]]:
    @jax.jit
    def step(params, opt, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((_mlp(p, x) - y) ** 2))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    params = jax.tree.map(jnp.asarray, params)
    opt, losses = tx.init(params), []
    for x, y in zip(xs, ys, strict=True):
        params, opt, loss = step(params, opt, x, y)
        losses.append(float(loss))
    return params, losses


def _split(strategy: jd.Strategy, batch: np.ndarray) -> jd.PerReplica:
    n = strategy.num_replicas_in_sync
    return jd.PerReplica(batch.reshape(n, batch.shape[0] // n, *batch.shape[1:]))


def test_tensor_parallel_mlp_trains_like_one_device(tp: jd.TPUStrategy) -> None:
    params, xs, ys = _data()
    tx = optax.adam(1e-2)
    split = tp.experimental_split_to_logical_devices

    def step(ctx, params, opt, x, y):
        def loss_fn(p):
            return jnp.mean((_mlp(p, x, split) - y) ** 2) / ctx.num_replicas_in_sync

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = ctx.all_reduce("sum", grads)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, ctx.all_reduce("sum", loss)

    compiled = tp.function(step)
    p, opt = jax.tree.map(jnp.asarray, params), tx.init(params)
    hlo = compiled.lower(p, opt, _split(tp, xs[0]), _split(tp, ys[0])).compile().as_text()
    # The first layer runs on half the hidden units per logical device: (8 rows, 16 / 2).
    assert (8, H // 2) in _op_shapes(hlo, "dot")
    losses = []
    for x, y in zip(xs, ys, strict=True):
        p, opt, loss = compiled(p, opt, _split(tp, x), _split(tp, y))
        losses.append(float(loss))
    ref, ref_losses = _reference(params, xs, ys, tx)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    assert losses[-1] < 0.7 * losses[0]
    for name in params:
        assert isinstance(p[name], jd.Mirrored)
        np.testing.assert_allclose(np.asarray(p[name]), ref[name], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(("cores", "replicas"), [(2, 4), (8, 1)])
def test_tensor_parallel_mlp_with_train_step(cores: int, replicas: int) -> None:
    tp = _strategy(cores, replicas)  # (8, 1): one replica, collectives are identities
    params, xs, ys = _data()
    tx = optax.sgd(0.1)
    split = tp.experimental_split_to_logical_devices
    with tp.scope():
        state = jd.TrainState.create(apply_fn=None, params=params, tx=tx)

    @jd.train_step(tp)
    def step(ctx, state, x, y):
        def loss_fn(p):
            per_example = jnp.mean((_mlp(p, x, split, ways=cores) - y) ** 2, axis=-1)
            return jd.compute_average_loss(per_example, global_batch_size=BATCH)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=ctx.all_reduce("sum", grads)), ctx.all_reduce(
            "sum", loss
        )

    losses = []
    for x, y in zip(xs, ys, strict=True):
        state, loss = step(state, _split(tp, x), _split(tp, y))
        losses.append(float(loss))
    ref, ref_losses = _reference(params, xs, ys, tx)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    assert int(state.step) == STEPS
    for name in params:
        np.testing.assert_allclose(np.asarray(state.params[name]), ref[name], rtol=RTOL, atol=ATOL)

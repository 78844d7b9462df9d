"""Distributed variables: every aggregation x synchronization x context case, with its
exact expected value on 2 and 8 replicas (values are small integers: compared exactly)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd

from _helpers import strategy_params

Sync, Agg = jd.VariableSynchronization, jd.VariableAggregation


def _strategies() -> list:
    return strategy_params("one_device", "mirrored2", "mirrored8", "central8", "central2")


def _ids(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32)


def _replica_id_value(ctx: jd.ReplicaContext) -> jax.Array:
    return ctx.replica_id_in_sync_group.astype(jnp.float32)


# Replica r assigns r (or adds r to 10): expected mirrored results by aggregation.
ON_WRITE_ASSIGN = {
    "MEAN": lambda r: r.mean(),
    "SUM": lambda r: r.sum(),
    "ONLY_FIRST_REPLICA": lambda r: r[0],
}


@pytest.mark.parametrize("make", _strategies())
@pytest.mark.parametrize("agg", list(ON_WRITE_ASSIGN))
@pytest.mark.parametrize("kind", ["assign", "assign_add", "assign_sub"])
def test_on_write_updates_are_aggregated(make, agg: str, kind: str) -> None:
    s = make()
    n = s.num_replicas_in_sync
    with s.scope():
        v = jd.Variable(10.0, aggregation=agg)

    def step(ctx, v):
        return getattr(ctx, kind)(v, _replica_id_value(ctx))

    out = s.run(step, args=(v,))
    assert isinstance(out, jd.Variable) and out.synchronization is Sync.ON_WRITE
    red = ON_WRITE_ASSIGN[agg](_ids(n))
    expected = {"assign": red, "assign_add": 10 + red, "assign_sub": 10 - red}[kind]
    assert float(out.read_value()) == expected
    # mirrored: the same value on every local copy
    assert {float(x) for x in s.experimental_local_results(out)} == {expected}


def test_exact_values_from_the_issue() -> None:
    two = jd.MirroredStrategy(jax.devices()[:2])
    with two.scope():
        v = jd.Variable(0.0, aggregation="mean")
    assert float(two.run(lambda ctx, v: ctx.assign(v, _replica_id_value(ctx)), args=(v,))) == 0.5
    eight = jd.MirroredStrategy()
    with eight.scope():
        c = jd.Variable(0.0, synchronization="on_read", aggregation="sum")
    c = eight.run(lambda ctx, c: ctx.assign(c, _replica_id_value(ctx)), args=(c,))
    assert float(c.read_value()) == 28.0


def test_on_write_none_requires_identical_values(mirrored8: jd.MirroredStrategy) -> None:
    with mirrored8.scope():
        v = jd.Variable(1.0, name="w")
    same = mirrored8.run(lambda ctx, v: ctx.assign_add(v, 2.0), args=(v,))
    assert float(same.read_value()) == 3.0
    reduced = mirrored8.run(
        lambda ctx, v: ctx.assign(v, ctx.all_reduce("sum", _replica_id_value(ctx))), args=(v,)
    )
    assert float(reduced.read_value()) == 28.0
    with pytest.raises(
        ValueError,
        match=r"ReplicaContext.assign: variable 'w' is mirrored with "
        r"aggregation NONE, but the update differs across replicas",
    ):
        mirrored8.run(lambda ctx, v: ctx.assign(v, _replica_id_value(ctx)), args=(v,))


def test_integer_variables_reject_differing_mean_updates(mirrored8: jd.MirroredStrategy) -> None:
    with mirrored8.scope():
        v = jd.Variable(jnp.int32(4), aggregation="mean", name="count")
    ok = mirrored8.run(lambda ctx, v: ctx.assign_add(v, 1), args=(v,))
    assert int(ok.read_value()) == 5 and ok.dtype == jnp.int32
    with pytest.raises(
        ValueError,
        match=r"variable 'count' has integer dtype int32 and "
        r"aggregation MEAN, but the update differs",
    ):
        mirrored8.run(lambda ctx, v: ctx.assign(v, ctx.replica_id_in_sync_group), args=(v,))
    with mirrored8.scope():
        s = jd.Variable(jnp.int32(0), aggregation="sum")
    total = mirrored8.run(lambda ctx, v: ctx.assign(v, ctx.replica_id_in_sync_group), args=(s,))
    assert int(total.read_value()) == 28
    with mirrored8.scope():
        copies = jd.Variable(jnp.int32(0), synchronization="on_read", aggregation="mean")
    copies = mirrored8.run(
        lambda ctx, v: ctx.assign(v, ctx.replica_id_in_sync_group), args=(copies,)
    )
    read = copies.read_value()  # the mean of 0..7 read back in the variable's dtype
    assert read.dtype == jnp.int32 and int(read) == 3


ON_READ_READ = {"SUM": np.sum, "MEAN": np.mean, "ONLY_FIRST_REPLICA": lambda r: r[0]}


@pytest.mark.parametrize("make", _strategies())
@pytest.mark.parametrize("agg", list(ON_READ_READ))
def test_on_read_updates_stay_local_and_aggregate_on_read(make, agg: str) -> None:
    s = make()
    n = s.num_replicas_in_sync
    with s.scope():
        m = jd.Variable(0.0, synchronization=Sync.ON_READ, aggregation=agg)
    assert not m.trainable

    def step(ctx, m):
        m = ctx.assign_add(m, _replica_id_value(ctx))
        return m, m.read_value()  # inside a replica: this replica's own copy

    m, local = s.run(step, args=(m,))
    # one replica: run returns the plain value
    np.testing.assert_array_equal(np.asarray(getattr(local, "array", local)).reshape(n), _ids(n))
    assert [float(x) for x in s.experimental_local_results(m)] == list(_ids(n))
    assert float(m.read_value()) == ON_READ_READ[agg](_ids(n))
    assert float(jnp.asarray(m)) == ON_READ_READ[agg](_ids(n))


def test_on_read_none_cannot_be_read_in_cross_replica(mirrored8: jd.MirroredStrategy) -> None:
    with mirrored8.scope():
        m = jd.Variable(jnp.zeros(2), synchronization="ON_READ")
    m = mirrored8.run(lambda ctx, m: ctx.assign(m, jnp.ones(2)), args=(m,))
    with pytest.raises(ValueError, match=r"is ON_READ with aggregation NONE, so its 8 per-replica"):
        m.read_value()


def test_cross_replica_reads_and_updates(mirrored8: jd.MirroredStrategy) -> None:
    with mirrored8.scope():
        w = jd.Variable(jnp.ones(3), aggregation="mean")
        total = jd.Variable(0.0, synchronization="on_read", aggregation="sum")
        avg = jd.Variable(0.0, synchronization="on_read", aggregation="mean")
    np.testing.assert_array_equal(w.assign_add(2.0).read_value(), [3.0] * 3)
    np.testing.assert_array_equal(w.assign_sub(jnp.arange(3.0)).read_value(), [1.0, 0.0, -1.0])
    np.testing.assert_array_equal(np.asarray(w.assign(jnp.zeros(3))), [0.0] * 3)
    assert w.assign(5.0).read_value().sharding.is_fully_replicated
    t = total.assign(8.0)
    assert float(t.read_value()) == 8.0
    assert [float(x) for x in mirrored8.experimental_local_results(t)] == [1.0] * 8  # 8 / N
    with pytest.raises(
        ValueError,
        match=r"Variable.assign_add: .* is ON_READ with aggregation "
        r"SUM; adding to it in cross-replica context",
    ):
        t.assign_add(1.0)
    with pytest.raises(ValueError, match=r"Variable.assign_sub: .*ON_READ with aggregation SUM"):
        t.assign_sub(1.0)
    assert float(avg.assign(3.0).assign_add(1.0).read_value()) == 4.0
    with pytest.raises(
        ValueError,
        match=r"Variable.assign: value of shape \(2,\) does not fit "
        r"variable None of shape \(3,\)",
    ):
        w.assign(jnp.ones(2))


def test_variable_creation_rules(mirrored8: jd.MirroredStrategy) -> None:
    with mirrored8.scope():
        with pytest.raises(
            ValueError,
            match=r"synchronization NONE is not supported under "
            r"MirroredStrategy",
        ):
            jd.Variable(1.0, synchronization="none")
        with pytest.raises(ValueError, match=r"ON_READ is only for non-trainable"):
            jd.Variable(1.0, synchronization="on_read", trainable=True)
        with pytest.raises(ValueError, match=r"unknown VariableAggregation 'avg'"):
            jd.Variable(1.0, aggregation="avg")
        w = jd.Variable(lambda: jnp.zeros(2), name="w")
        assert w.trainable and w.name == "w" and w.shape == (2,)
    assert jd.Variable(1.0, synchronization="none").read_value() == 1.0  # default strategy

    def creates(ctx, x):
        jd.Variable(x)
        return x

    with pytest.raises(RuntimeError, match=r"variables cannot be created inside a replica"):
        mirrored8.run(creates, args=(1.0,))


def test_mirrored_variable_changed_per_replica_is_an_error(mirrored8: jd.MirroredStrategy) -> None:
    with mirrored8.scope():
        w = jd.Variable(jnp.ones(2), name="w")
    x = jd.PerReplica(jnp.ones((8, 2)))
    with pytest.raises(
        ValueError,
        match=r"mirrored \(ON_WRITE\) variable 'w' holds a value that "
        r"differs across replicas",
    ):
        mirrored8.run(lambda ctx, w, x: jax.tree.map(lambda v: v * x, w), args=(w, x))


def test_placement() -> None:
    devs = jax.devices()
    with jd.MirroredStrategy().scope():
        w = jd.Variable(jnp.ones(2))
        m = jd.Variable(0.0, synchronization="on_read", aggregation="sum")
    assert w.device_values.sharding.is_fully_replicated
    assert w.device_values.sharding.device_set == set(devs)
    assert m.device_values.shape == (8,)
    assert m.device_values.sharding.spec == jax.sharding.PartitionSpec("replica")
    with jd.OneDeviceStrategy(devs[3]).scope():
        one = jd.Variable(jnp.ones(2))
    assert one.device_values.devices() == {devs[3]}
    central = jd.CentralStorageStrategy(parameter_device=devs[5])
    with central.scope():
        c = jd.Variable(jnp.ones(2), aggregation="mean")
    assert c.device_values.devices() == {devs[5]}
    assert central.extended.parameter_devices == (devs[5],)
    c = central.run(lambda ctx, c: ctx.assign_add(c, _replica_id_value(ctx)), args=(c,))
    assert c.device_values.devices() == {devs[5]}  # the update came back to the parameter device
    np.testing.assert_array_equal(c.read_value(), [4.5, 4.5])
    assert central != jd.CentralStorageStrategy(parameter_device=devs[4])


def _mlp_step(ctx, params, x, y):
    def loss_fn(p):
        h = jnp.tanh(x @ p["w1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    grads = ctx.all_reduce("mean", grads)
    new = {k: ctx.assign_sub(params[k], 0.1 * grads[k]) for k in params}
    return new, ctx.all_reduce("mean", loss)


def test_training_same_on_mirrored_central_and_single_device() -> None:
    rng = np.random.default_rng(0)
    init = {"w1": rng.normal(size=(4, 8)), "w2": rng.normal(size=(8, 1))}
    init = jax.tree.map(lambda a: a.astype(np.float32), init)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    y = rng.normal(size=(32, 1)).astype(np.float32)

    def ref_loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    ref = init
    for _ in range(5):
        ref = jax.tree.map(lambda p, g: p - 0.1 * g, ref, jax.grad(ref_loss)(ref, x, y))
    for s in (jd.MirroredStrategy(), jd.CentralStorageStrategy(), jd.OneDeviceStrategy()):
        n = s.num_replicas_in_sync
        with s.scope():
            params = {k: jd.Variable(v, aggregation="mean") for k, v in init.items()}
        xs, ys = jd.PerReplica(x.reshape(n, -1, 4)), jd.PerReplica(y.reshape(n, -1, 1))
        for _ in range(5):
            params, _ = s.run(_mlp_step, args=(params, xs, ys))
        for k in init:
            np.testing.assert_allclose(params[k].read_value(), ref[k], rtol=1e-5, atol=1e-6)


def test_metric_update_has_no_cross_replica_traffic(mirrored8: jd.MirroredStrategy) -> None:
    with mirrored8.scope():
        total = jd.Variable(0.0, synchronization="on_read", aggregation="sum")
        count = jd.Variable(0.0, synchronization="on_read", aggregation="sum")

    @mirrored8.function
    def update(ctx, total, count, x):
        return ctx.assign_add(total, jnp.sum(x)), ctx.assign_add(count, x.shape[0])

    @mirrored8.function
    def update_synced(ctx, total, count, x):  # the contrast: an all-reduce per step
        return ctx.assign_add(total, ctx.all_reduce("sum", jnp.sum(x))), count

    x = jd.PerReplica(np.arange(8 * 4, dtype=np.float32).reshape(8, 4))
    assert "all-reduce" not in update.lower(total, count, x).compile().as_text()
    assert "all-reduce" in update_synced.lower(total, count, x).compile().as_text()
    for _ in range(10):
        total, count = update(total, count, x)
    mean = float(total.read_value()) / float(count.read_value())
    assert mean == pytest.approx(np.arange(32).mean())


def test_strategy_extended(mirrored8: jd.MirroredStrategy) -> None:
    ext = mirrored8.extended
    x = jd.PerReplica(_ids(8))
    r = ext.reduce_to("sum", x, destinations=x)
    assert isinstance(r, jd.Mirrored) and float(r.array) == 28.0
    assert r.array.sharding.is_fully_replicated
    one = ext.reduce_to("mean", x, destinations="/cpu:2")
    assert float(one) == 3.5 and one.devices() == {jax.devices()[2]}
    a, b = ext.batch_reduce_to("max", [(x, x), (jd.PerReplica(-_ids(8)), x)])
    assert float(a.array) == 7.0 and float(b.array) == 0.0
    bc = ext.broadcast_to(jnp.ones(2), destinations=x)
    assert isinstance(bc, jd.Mirrored) and bc.array.sharding.is_fully_replicated
    out = ext.call_for_each_replica(lambda ctx, v: v * 2, args=(x,))
    np.testing.assert_array_equal(out.array, 2 * _ids(8))
    with mirrored8.scope():
        w = jd.Variable(jnp.ones(2))
        m = jd.Variable(0.0, synchronization="on_read", aggregation="sum")
        with ext.colocate_vars_with(w):
            w2 = jd.Variable(jnp.zeros(2))
    assert w2.device_values.sharding == w.device_values.sharding
    with jd.OneDeviceStrategy(jax.devices()[3]).scope():
        on_dev3 = jd.Variable(jnp.ones(2))
    with mirrored8.scope(), ext.colocate_vars_with(on_dev3):
        near = jd.Variable(jnp.zeros(2))  # not replicated: placed with on_dev3
    assert near.device_values.devices() == {jax.devices()[3]}
    assert ext.variable_created_in_scope(w) and not ext.variable_created_in_scope(jd.Variable(1.0))
    assert not jd.OneDeviceStrategy().extended.variable_created_in_scope(w)
    assert ext.value_container(w) is w
    w3 = ext.update(w, lambda c, d: c + d, args=(jd.Mirrored(jnp.full(2, 3.0)),))
    np.testing.assert_array_equal(w3.read_value(), [4.0, 4.0])
    m2 = ext.update(m, lambda c, d: c + d, args=(x,))  # per copy, per-replica argument
    assert [float(v) for v in ext.update(m, lambda c, d: c + d, args=(x,), group=False)] == list(
        _ids(8)
    )
    assert float(m2.read_value()) == 28.0
    with pytest.raises(ValueError, match=r"is mirrored \(one logical copy\) but got PerReplica"):
        ext.update(w, lambda c, d: c + d, args=(x,))
    assert ext.worker_devices == tuple(jax.devices())
    assert ext.parameter_devices == tuple(jax.devices())


@pytest.mark.parametrize("make", [jd.OneDeviceStrategy, None], ids=["one_device", "default"])
def test_on_read_without_aggregation_on_one_replica_reads_its_copy(make: Any) -> None:
    s = make() if make is not None else jd.get_strategy()
    with s.scope():
        v = jd.Variable(jnp.zeros(2), synchronization="on_read")  # aggregation NONE
    v = s.run(lambda ctx, v: ctx.assign_add(v, jnp.array([1.0, 2.0])), args=(v,))
    np.testing.assert_array_equal(v.read_value(), [1.0, 2.0])  # TF: a plain variable
    np.testing.assert_array_equal(np.asarray(v), [1.0, 2.0])
    saved = jd.checkpoint.to_saveable({"v": v})
    np.testing.assert_array_equal(saved["v"], [1.0, 2.0])

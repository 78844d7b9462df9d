"""strategy.reduce / gather / experimental_local_results / distribute_values_from_function,
checked against NumPy (rtol=1e-6); NaN in MAX / MIN as in NumPy; errors for bad axes,
replica counts and string arrays, naming the leaf."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd

from _helpers import value


def _per_replica(strategy: jd.Strategy, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    n = strategy.num_replicas_in_sync
    return np.random.default_rng(seed).normal(size=(n, *shape)).astype(np.float32)


@pytest.mark.parametrize("op", ["SUM", "mean", "max", "min"])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_reduce_matches_numpy(strategy: jd.Strategy, op: str, axis: int | None) -> None:
    x = _per_replica(strategy, (3, 4))
    placed = strategy.run(lambda ctx, v: v + 0.0, args=(jd.PerReplica(x),))  # on the devices
    ref_fn = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op.lower()]
    axes = (0,) if axis is None else (0, axis % 2 + 1)
    np.testing.assert_allclose(
        strategy.reduce(op, placed, axis=axis), ref_fn(x, axis=axes), rtol=1e-5
    )


def test_reduce_mean_with_axis_is_element_weighted(mirrored8: jd.MirroredStrategy) -> None:
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    assert float(mirrored8.reduce("mean", jd.PerReplica(x), axis=0)) == pytest.approx(x.mean())


def test_reduce_mirrored_and_plain_values(mirrored8: jd.MirroredStrategy) -> None:
    m = mirrored8.run(lambda ctx: ctx.all_reduce("mean", jnp.array([1.0, 2.0])))
    np.testing.assert_allclose(mirrored8.reduce("sum", m), [8.0, 16.0])  # 8 identical copies
    np.testing.assert_allclose(mirrored8.reduce("mean", m), [1.0, 2.0])
    np.testing.assert_allclose(mirrored8.reduce("sum", m, axis=0), 24.0)
    np.testing.assert_allclose(mirrored8.reduce("mean", jnp.array([1.0, 3.0])), [1.0, 3.0])
    np.testing.assert_allclose(mirrored8.reduce("sum", 0.0), 0.0)
    with pytest.raises(ValueError, match=r"MirroredStrategy.reduce: cannot SUM-reduce a non-distr"):
        mirrored8.reduce("sum", jnp.array([1.0]))
    one = jd.OneDeviceStrategy()
    np.testing.assert_allclose(one.reduce("sum", jnp.array([1.0])), [1.0])


def test_reduce_errors(mirrored8: jd.MirroredStrategy) -> None:
    v = jd.PerReplica(jnp.ones((8, 3)))
    with pytest.raises(
        ValueError,
        match=r"MirroredStrategy.reduce: axis=1 is out of range for "
        r"per-replica values of shape \(3,\) \(rank 1\)",
    ):
        mirrored8.reduce("sum", v, axis=1)
    with pytest.raises(ValueError, match=r"MirroredStrategy.reduce: unknown reduce op 'avg'"):
        mirrored8.reduce("avg", v)


def test_gather(strategy: jd.Strategy) -> None:
    x = _per_replica(strategy, (2, 3))
    v = jd.PerReplica(x)
    np.testing.assert_allclose(strategy.gather(v, axis=0), np.concatenate(list(x), axis=0))
    np.testing.assert_allclose(strategy.gather(v, axis=1), np.concatenate(list(x), axis=1))
    m = jd.Mirrored(jnp.ones((2,)))
    np.testing.assert_allclose(strategy.gather(m, 0), np.ones(2 * strategy.num_replicas_in_sync))
    with pytest.raises(ValueError, match=r"gather: axis=2 is out of range"):
        strategy.gather(v, axis=2)


def test_local_results(strategy: jd.Strategy) -> None:
    n = strategy.num_replicas_in_sync
    x = _per_replica(strategy, (2,))
    out = strategy.run(
        lambda ctx, v: {"v": v, "s": ctx.all_reduce("sum", v)}, args=(jd.PerReplica(x),)
    )
    local = strategy.experimental_local_results(out)
    assert len(local) == n
    for r, entry in enumerate(local):
        np.testing.assert_allclose(entry["v"], x[r])
        np.testing.assert_allclose(entry["s"], x.sum(0), rtol=1e-6)
        assert entry["v"].devices() == {strategy.extended.worker_devices[r]}
    assert strategy.experimental_local_results(3.0) == (3.0,)


def test_distribute_values_from_function(strategy: jd.Strategy) -> None:
    n = strategy.num_replicas_in_sync

    def value_fn(ctx):
        assert ctx.num_replicas_in_sync == n
        r = ctx.replica_id_in_sync_group
        return {"x": np.full((2,), r, np.float32), "id": r}

    v = strategy.experimental_distribute_values_from_function(value_fn)
    assert isinstance(v["x"], jd.PerReplica)
    np.testing.assert_allclose(v["x"].array, np.repeat(np.arange(n), 2).reshape(n, 2))
    out = strategy.run(lambda ctx, v: ctx.all_reduce("sum", v["id"]), args=(v,))
    assert int(value(out)) == n * (n - 1) // 2
    assert v["x"].array.sharding.spec == jax.sharding.PartitionSpec("replica")


def test_distribute_values_from_function_errors(mirrored8: jd.MirroredStrategy) -> None:
    where = r"MirroredStrategy.experimental_distribute_values_from_function"
    with pytest.raises(ValueError, match=where + r": value_fn returned different structures"):
        mirrored8.experimental_distribute_values_from_function(
            lambda c: (1.0,) if c.replica_id_in_sync_group else {"a": 1.0}
        )
    with pytest.raises(ValueError, match=where + r": leaf \['a'\] differs in shape"):
        mirrored8.experimental_distribute_values_from_function(
            lambda c: {"a": np.zeros(c.replica_id_in_sync_group % 2 + 1)}
        )


def test_reduce_of_a_tree_and_batch_reduce_to_run_as_one_program(
    mirrored8: jd.MirroredStrategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jaxdist._jax_compat import is_tracer
    from jaxdist.values import cross_replica

    traced = []
    kernel = cross_replica._reduce_jit

    def spy(x, *args, **kwargs):
        traced.append(is_tracer(x))  # False would mean a separate eager program per leaf
        return kernel(x, *args, **kwargs)

    monkeypatch.setattr(cross_replica, "_reduce_jit", spy)
    grads = {"w": jd.PerReplica(jnp.ones((8, 13, 3))), "b": jd.PerReplica(jnp.ones((8, 13)))}
    programs = cross_replica.reduce_distributed._cache_size()
    out = mirrored8.reduce("sum", grads)
    np.testing.assert_allclose(out["w"], np.full((13, 3), 8.0))
    pairs = [
        (grads["w"], grads["w"]),
        (grads["b"], grads["b"]),
        (jd.PerReplica(jnp.ones((8, 7))), None),
    ]
    reduced = mirrored8.extended.batch_reduce_to("mean", pairs)
    np.testing.assert_allclose(reduced[2].array, np.ones(7))
    assert traced and all(traced)  # each leaf reduced only inside the fused program's trace
    assert cross_replica.reduce_distributed._cache_size() == programs + 2  # one per call


def test_padded_per_replica_values_in_any_layout(mirrored8: jd.MirroredStrategy) -> None:
    array = np.arange(6.0).reshape(3, 2)
    valid = np.array([2, 1, 0])
    sharded = jax.device_put(
        np.arange(16.0).reshape(8, 2),
        jax.sharding.NamedSharding(mirrored8.mesh, jax.sharding.PartitionSpec("replica")),
    )
    for v, rows in [
        (
            jd.PerReplica(jnp.asarray(array), valid=jnp.asarray(valid)),
            [[0.0, 1.0], [2.0], []],
        ),  # one device
        (jd.PerReplica(array, valid=valid), [[0.0, 1.0], [2.0], []]),  # host NumPy
        (
            jd.PerReplica(sharded, valid=jnp.arange(8) % 3),
            [list(np.arange(16.0).reshape(8, 2)[r][: r % 3]) for r in range(8)],
        ),
    ]:
        assert [np.asarray(x).tolist() for x in v.values] == rows


def test_string_arrays_in_reduce_and_gather_name_the_leaf(mirrored8: jd.MirroredStrategy) -> None:
    names = {"ids": jd.PerReplica(jnp.zeros((8, 2))), "words": np.array(["a", "b"])}
    for method, call in (
        ("reduce", lambda: mirrored8.reduce("sum", names)),
        ("gather", lambda: mirrored8.gather(names, axis=0)),
    ):
        with pytest.raises(
            TypeError,
            match=rf"MirroredStrategy.{method}: value\['words'\] is an array of dtype <U1 "
            r"\(shape \(2,\)\); only numeric and bool arrays live on the devices of mesh "
            r"\{'replica': 8\}",
        ):
            call()


def test_extrema_propagate_nan_like_numpy(mirrored8: jd.MirroredStrategy) -> None:
    rows = np.arange(48, dtype=np.float32).reshape(8, 3, 2)
    rows[3, 1, 0] = np.nan
    per = jd.PerReplica(jnp.asarray(rows))
    for op in ("max", "min"):
        ref = getattr(np, op)
        inside = mirrored8.run(lambda ctx, x, op=op: ctx.all_reduce(op, x), args=(per,))
        np.testing.assert_array_equal(inside.array, ref(rows, axis=0))  # NaN == NaN here
        np.testing.assert_array_equal(mirrored8.reduce(op, per), ref(rows, axis=0))
        along = mirrored8.reduce(op, per, axis=0)
        np.testing.assert_array_equal(along, ref(rows.reshape(24, 2), axis=0))
        assert np.isnan(np.asarray(along)[0]) and not np.isnan(np.asarray(along)[1])


def test_gather_and_reduce_argument_errors(mirrored8: jd.MirroredStrategy) -> None:
    v = jd.PerReplica(jnp.ones((8, 3)))
    with pytest.raises(TypeError, match=r"MirroredStrategy.gather: axis must be an int"):
        mirrored8.gather(v, axis=None)
    with pytest.raises(TypeError, match=r"gather: axis must be an int.*got True"):
        mirrored8.gather(v, axis=True)
    with pytest.raises(TypeError, match=r"reduce: axis must be an int or None, got True"):
        mirrored8.reduce("sum", v, axis=True)
    with pytest.raises(TypeError, match=r"reduce: axis must be an int or None, got 0.5"):
        mirrored8.reduce("sum", v, axis=0.5)
    # Integers of other kinds, as TF takes them (a NumPy integer, a 0-d integer array).
    x = np.arange(24.0, dtype=np.float32).reshape(8, 3)
    for axis in (np.int64(0), jnp.int32(0), np.asarray(0)):
        np.testing.assert_array_equal(mirrored8.reduce("sum", jd.PerReplica(x), axis=axis), 276.0)
        np.testing.assert_array_equal(mirrored8.gather(jd.PerReplica(x), axis=axis), x.ravel())
    with pytest.raises(ValueError, match=r"cannot take the MAX along axis 0 .* empty"):
        mirrored8.reduce("max", jd.PerReplica(jnp.ones((8, 0))), axis=0)
    for bad in (jd.PerReplica(jnp.ones((3, 2))), jd.PerReplica(jnp.ones((7, 2)))):
        rows = bad.array.shape[0]
        msg = rf"has {rows} per-replica values .* has 8 replicas"
        with pytest.raises(ValueError, match=r"reduce: a PerReplica value " + msg):
            mirrored8.reduce("sum", bad)
        with pytest.raises(ValueError, match=r"gather: a PerReplica value " + msg):
            mirrored8.gather(bad, axis=0)
        with pytest.raises(ValueError, match=r"local_results: a PerReplica value " + msg):
            mirrored8.experimental_local_results(bad)

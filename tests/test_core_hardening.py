"""TF habits, array-like values, padding-safe results and errors that teach (issue 11).

References are NumPy; float tolerance rtol=1e-6 unless stated.
"""

from __future__ import annotations

import copy
import functools
import gc
import pickle
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd
from jaxdist import _programs

# Values that behave like arrays ----------------------------------------------------


def test_mirrored_converts_like_an_array(mirrored8: jd.MirroredStrategy) -> None:
    out = mirrored8.run(lambda ctx, x: ctx.all_reduce("sum", x), args=(jnp.float32(1.5),))
    assert isinstance(out, jd.Mirrored)
    assert float(out) == 12.0 and int(out) == 12 and bool(out)
    np.testing.assert_allclose(np.asarray(out), 12.0)
    np.testing.assert_allclose(jnp.asarray(out), 12.0)
    np.testing.assert_allclose(jnp.add(out, 1.0), 13.0)
    vec = mirrored8.run(lambda ctx: ctx.all_reduce("sum", jnp.arange(3.0)))
    np.testing.assert_allclose(np.asarray(vec, dtype=np.float64), [0.0, 8.0, 16.0])


def test_per_replica_refuses_and_names_reduce(mirrored8: jd.MirroredStrategy) -> None:
    out = mirrored8.run(lambda ctx: ctx.replica_id_in_sync_group * 1.0)
    assert isinstance(out, jd.PerReplica)
    for convert in (float, int, np.asarray, jnp.asarray):
        with pytest.raises(TypeError, match=r"strategy.reduce.*experimental_local_results"):
            convert(out)


def test_one_replica_returns_plain_values() -> None:
    s = jd.OneDeviceStrategy()
    out = s.run(lambda ctx, x: (x * 2, ctx.all_reduce("sum", x)), args=(jnp.arange(3.0),))
    assert all(isinstance(o, jax.Array) for o in out)
    assert s.experimental_local_results(out[0]) == (out[0],)
    np.testing.assert_allclose(out[0], [0.0, 2.0, 4.0])


def test_per_replica_from_a_list_as_in_tf(mirrored8: jd.MirroredStrategy) -> None:
    with mirrored8.scope():
        v = jd.PerReplica([np.full(2, i, np.float32) for i in range(8)])
    assert v.array.shape == (8, 2)
    assert v.array.sharding.spec == jax.sharding.PartitionSpec("replica")
    out = mirrored8.run(lambda ctx, v: ctx.all_reduce("sum", v), args=(v,))
    np.testing.assert_allclose(out.array, [28.0, 28.0])
    with pytest.raises(ValueError, match=r"must share shape and dtype"):
        jd.PerReplica([np.ones(2), np.ones(3)])
    with pytest.raises(TypeError, match=r"experimental_distribute_values_from_function"):
        jd.PerReplica([{"a": 1.0}, {"a": 2.0}])


def test_deepcopy_and_pickle(mirrored8: jd.MirroredStrategy) -> None:
    per = mirrored8.run(lambda ctx: ctx.replica_id_in_sync_group * jnp.ones(2))
    mir = mirrored8.run(lambda ctx: ctx.all_reduce("sum", jnp.ones(2)))
    for v in (per, mir):
        c = copy.deepcopy(v)
        assert type(c) is type(v) and c.array is not v.array
        np.testing.assert_array_equal(c.array, v.array)
        assert copy.copy(v).array is v.array
    with mirrored8.scope():  # placement re-applied by the strategy in effect
        per2, mir2 = pickle.loads(pickle.dumps((per, mir)))
    np.testing.assert_array_equal(per2.array, per.array)
    assert per2.array.sharding.spec == jax.sharding.PartitionSpec("replica")
    assert mir2.array.sharding.is_fully_replicated
    assert mirrored8.run(lambda ctx, p: ctx.all_reduce("sum", p), args=(per2,)).array.shape == (2,)


# TF behaviour users rely on ----------------------------------------------------------


def test_merge_call_in_default_strategy_is_cross_replica() -> None:
    ctx = jd.get_replica_context()
    seen = {}

    def merge_fn(strategy, x):
        seen["cross"] = jd.in_cross_replica_context()
        seen["strategy"] = strategy
        return x * 2

    assert float(ctx.merge_call(merge_fn, args=(3.0,))) == 6.0
    assert seen["cross"] is True and seen["strategy"] is jd.get_strategy()
    assert not jd.in_cross_replica_context()


def test_tf_names(mirrored8: jd.MirroredStrategy) -> None:
    x = np.arange(32, dtype=np.float32)
    with pytest.warns(DeprecationWarning, match=r"call distribute_datasets_from_function"):
        ds = mirrored8.experimental_distribute_datasets_from_function(
            lambda ictx: jd.data.from_arrays(x, batch_size=ictx.get_per_replica_batch_size(16))
        )
    assert sum(float(mirrored8.reduce("sum", b, axis=0)) for b in ds) == x.sum()
    rows = mirrored8.experimental_make_numpy_dataset((x, x * 2)).batch(16)
    it = iter(mirrored8.experimental_distribute_dataset(rows))
    out = mirrored8.experimental_run(lambda ctx, b: ctx.all_reduce("sum", jnp.sum(b[1])), it)
    assert float(out) == 2 * x[:16].sum()


# Results that stay right with padding -------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 8])
def test_outputs_of_padded_batches_carry_their_valid_rows(n: int) -> None:
    s = jd.MirroredStrategy(jax.devices()[:n])
    x = np.random.default_rng(0).normal(size=(100, 3)).astype(np.float32)
    ds = s.experimental_distribute_dataset(jd.data.from_arrays(x, batch_size=32))
    step = s.function(lambda ctx, b: b * 2.0 + 1.0)  # per-example outputs, padded rows too
    gathered, means = [], []
    for batch in ds:
        out = step(batch)
        gathered.append(np.asarray(s.gather(out, axis=0)))
        means.append((np.asarray(s.reduce("mean", out, axis=0)), len(gathered[-1])))
    np.testing.assert_allclose(np.concatenate(gathered), x * 2 + 1, rtol=1e-6)
    total = sum(m * k for m, k in means) / 100
    np.testing.assert_allclose(total, (x * 2 + 1).mean(axis=0), rtol=1e-5)
    local = np.concatenate(
        [np.concatenate(s.experimental_local_results(step(b))) for b in ds], axis=0
    )
    np.testing.assert_allclose(local, x * 2 + 1, rtol=1e-6)


# Errors that teach ---------------------------------------------------------------


def test_replica_fn_without_ctx_is_explained(mirrored8: jd.MirroredStrategy) -> None:
    def step(x):
        return x * 2

    with pytest.raises(TypeError, match=r"does not take the replica context.*def step\(ctx, x\)"):
        mirrored8.run(step, args=(1.0,))


def test_context_used_after_run_is_named(mirrored8: jd.MirroredStrategy) -> None:
    kept = []
    mirrored8.run(lambda ctx: kept.append(ctx))
    with pytest.raises(RuntimeError, match=r"ReplicaContext.all_reduce: this context belongs"):
        kept[0].all_reduce("sum", 1.0)
    with pytest.raises(RuntimeError, match=r"replica_id_in_sync_group: this context belongs"):
        _ = kept[0].replica_id_in_sync_group


def test_recompiling_a_new_lambda_every_step_warns_once() -> None:
    s = jd.MirroredStrategy(jax.devices()[:2])
    with pytest.warns(RuntimeWarning, match=r"compiled 17 times.*strategy.function") as record:
        for i in range(20):
            s.run(functools.partial(lambda ctx, x, k: x + k, k=i), args=(1.0,))
    assert len([w for w in record if "compiled" in str(w.message)]) == 1


def test_run_inside_merge_call_is_explained(mirrored8: jd.MirroredStrategy) -> None:
    def merge_fn(strategy, x):
        return strategy.run(lambda ctx, y: y, args=(x,))

    with pytest.raises(RuntimeError, match=r"run was called inside a merge_fn"):
        mirrored8.run(lambda ctx: ctx.merge_call(merge_fn, args=(1.0,)))


def test_bad_ppermute(mirrored8: jd.MirroredStrategy) -> None:
    with pytest.raises(ValueError, match=r"pairs \[\(0, 9\)\] name replicas outside \[0, 8\)"):
        mirrored8.run(lambda ctx: ctx.ppermute(1.0, [(0, 9)]))
    with pytest.raises(ValueError, match=r"replica\(s\) \[1\] appear more than once as a dest"):
        mirrored8.run(lambda ctx: ctx.ppermute(1.0, [(0, 1), (2, 1)]))
    with pytest.raises(TypeError, match=r"list of \(source, destination\) replica pairs"):
        mirrored8.run(lambda ctx: ctx.ppermute(1.0, [0, 1]))


def test_gather_and_reduce_argument_errors(mirrored8: jd.MirroredStrategy) -> None:
    v = jd.PerReplica(jnp.ones((8, 3)))
    with pytest.raises(TypeError, match=r"MirroredStrategy.gather: axis must be an int"):
        mirrored8.gather(v, axis=None)
    with pytest.raises(TypeError, match=r"gather: axis must be an int.*got True"):
        mirrored8.gather(v, axis=True)
    with pytest.raises(TypeError, match=r"reduce: axis must be an int or None, got True"):
        mirrored8.reduce("sum", v, axis=True)
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


def test_string_arguments_name_the_leaf(mirrored8: jd.MirroredStrategy) -> None:
    with pytest.raises(TypeError, match=r"args\[0\]\['names'\] is an array of dtype <U1"):
        mirrored8.run(lambda ctx, t: 1.0, args=({"names": np.array(["a", "b"])},))


def test_variable_of_another_strategy_is_refused(mirrored8: jd.MirroredStrategy) -> None:
    two = jd.MirroredStrategy(jax.devices()[:2])
    with two.scope():
        v = jd.Variable(jnp.zeros(2), aggregation="mean")
    with pytest.raises(ValueError, match=r"args\[0\] is variable None, created in the scope of"):
        mirrored8.run(lambda ctx, v: ctx.assign_add(v, 1.0), args=(v,))


def test_thread_without_the_scope_is_warned(mirrored8: jd.MirroredStrategy) -> None:
    seen = {}

    def worker() -> None:
        with pytest.warns(RuntimeWarning, match=r"scope does not carry over to threads"):
            seen["strategy"] = jd.get_strategy()

    with mirrored8.scope():
        t = threading.Thread(target=worker, name="loader")
        t.start()
        t.join()
    assert seen["strategy"].num_replicas_in_sync == 1


# Nothing kept forever --------------------------------------------------------------


def test_programs_die_with_their_functions() -> None:
    s = jd.MirroredStrategy(jax.devices()[:2])
    gc.collect()
    before = _programs.cached_program_count()
    for _ in range(5):
        s.run(eval("lambda ctx, x: x + 1"), args=(1.0,))  # a new code object each time
    gc.collect()
    assert _programs.cached_program_count() == before


def test_program_cache_is_bounded() -> None:
    s = jd.MirroredStrategy(jax.devices()[:2])
    old = _programs.get_program_cache_size()
    kept = [eval(f"lambda ctx, x: x + {i}") for i in range(6)]
    try:
        _programs.set_program_cache_size(3)
        for fn in kept:
            s.run(fn, args=(1.0,))
        assert _programs.cached_program_count() <= 3
        assert float(s.run(kept[0], args=(1.0,))) == 1.0  # evicted: compiled again
    finally:
        _programs.set_program_cache_size(old)
    with pytest.raises(ValueError, match=r"size must be an int >= 1"):
        _programs.set_program_cache_size(0)

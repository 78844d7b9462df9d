"""`Mirrored` and `PerReplica` behave like arrays where one value is meant: conversions and
truth values (a `PerReplica` refuses them and names `strategy.reduce`), construction from a
list as in TF, copies and pickles. References are NumPy."""

from __future__ import annotations

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd


def test_per_replica_has_no_truth_value(mirrored8: jd.MirroredStrategy) -> None:
    out = mirrored8.run(lambda ctx: ctx.replica_id_in_sync_group)
    with pytest.raises(TypeError, match=r"no single truth value.*strategy.reduce"):
        bool(out)


def test_mirrored_converts_like_an_array(mirrored8: jd.MirroredStrategy) -> None:
    out = mirrored8.run(lambda ctx, x: ctx.all_reduce("sum", x), args=(jnp.float32(1.5),))
    assert isinstance(out, jd.Mirrored)
    assert float(out) == 12.0 and int(out) == 12 and bool(out)
    np.testing.assert_allclose(np.asarray(out), 12.0)
    np.testing.assert_allclose(jnp.asarray(out), 12.0)
    np.testing.assert_allclose(jnp.add(out, 1.0), 13.0)
    vec = mirrored8.run(lambda ctx: ctx.all_reduce("sum", jnp.arange(3.0)))
    np.testing.assert_allclose(np.asarray(vec, dtype=np.float64), [0.0, 8.0, 16.0])
    # Python's operators, comparisons and indexing, as on TF's Mirrored (they raised).
    ref = np.array([0.0, 8.0, 16.0])
    np.testing.assert_allclose(vec + 1, ref + 1)
    np.testing.assert_allclose(2 * vec - 1, 2 * ref - 1)
    np.testing.assert_allclose(1 / (vec + 1), 1 / (ref + 1))
    np.testing.assert_array_equal(vec > 4, ref > 4)
    np.testing.assert_allclose(-vec, -ref)
    assert float(vec[1]) == 8.0 and float(out**2) == 144.0
    reduced = mirrored8.extended.reduce_to("sum", jd.PerReplica(jnp.ones(8)), None)
    assert isinstance(reduced, jd.Mirrored) and float(reduced + 1) == 9.0


def test_per_replica_refuses_and_names_reduce(mirrored8: jd.MirroredStrategy) -> None:
    out = mirrored8.run(lambda ctx: ctx.replica_id_in_sync_group * 1.0)
    assert isinstance(out, jd.PerReplica)
    for convert in (float, int, np.asarray, jnp.asarray):
        with pytest.raises(TypeError, match=r"strategy.reduce.*experimental_local_results"):
            convert(out)


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

"""Variables that behave like arrays and refuse the wrong thing: dtypes, conversions, use
inside a user's jax.jit, distributed values in cross-replica updates, strategy ownership,
exact integer splits, copies and pickling. Values are small integers: compared exactly."""

from __future__ import annotations

import copy
import operator
import pickle
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxdist as jd

from _helpers import strategy_params

Sync, Agg = jd.VariableSynchronization, jd.VariableAggregation


def _ids(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float32)


def _copies(v: jd.Variable) -> list:
    return np.asarray(v.device_values).tolist()


# 1. Strong, TF-like dtypes -----------------------------------------------------------


@pytest.mark.parametrize(
    ("initial", "kwargs", "dtype"),
    [
        (0.0, {}, jnp.float32),
        (3, {}, jnp.int32),
        (True, {}, jnp.bool_),
        (1 + 2j, {}, jnp.complex64),
        ([1.0, 2.0], {}, jnp.float32),
        ([[1, 2]], {}, jnp.int32),
        (np.arange(3, dtype=np.int16), {}, jnp.int16),
        (np.float64(1.5), {}, jnp.float32),  # JAX's canonical dtype with x64 off
        (jnp.asarray(0.5), {}, jnp.float32),  # a weakly typed JAX scalar
        (2, {"dtype": "float32"}, jnp.float32),
        (1.5, {"dtype": jnp.bfloat16}, jnp.bfloat16),
        (True, {"dtype": jnp.int32}, jnp.int32),
        (lambda: jnp.zeros(2, jnp.int8), {}, jnp.int8),
    ],
)
def test_variables_are_strongly_typed_like_tf(initial, kwargs, dtype) -> None:
    v = jd.Variable(initial, **kwargs)
    assert v.dtype == dtype
    assert not v.device_values.weak_type
    expected = np.asarray(initial() if callable(initial) else initial).astype(dtype)
    np.testing.assert_array_equal(np.asarray(v.read_value()), expected)
    with jd.MirroredStrategy().scope():
        m = jd.Variable(initial, synchronization="on_read", aggregation="mean", **kwargs)
    assert m.dtype == dtype and not m.device_values.weak_type


def test_lossy_initial_dtypes_are_refused() -> None:
    with pytest.raises(
        TypeError,
        match=r"jaxdist.Variable\(name='n'\): cannot create a int32 variable from an initial "
        r"value of dtype float32: a cast from floating point to an integer drops the fraction",
    ):
        jd.Variable(1.5, dtype="int32", name="n")
    with pytest.raises(TypeError, match=r"a cast to bool keeps only zero / non-zero"):
        jd.Variable(jnp.arange(3), dtype=bool)
    with pytest.raises(TypeError, match=r"dtype='float33' is not a dtype"):
        jd.Variable(1.0, dtype="float33")
    with pytest.raises(TypeError, match=r"initial_value 'abc' is not a number"):
        jd.Variable("abc")
    with pytest.raises(OverflowError, match=r"does not fit int32 and 64-bit types are disabled"):
        jd.Variable(2**40)
    with pytest.raises(TypeError, match=r"initial_value is a PerReplica \(2 per-replica"):
        jd.Variable(jd.PerReplica(jnp.zeros(2)))


def _strategies() -> list:
    return strategy_params("one_device", "mirrored8", "central2")


@pytest.mark.parametrize("make", _strategies())
@pytest.mark.parametrize("sync", ["on_write", "on_read"])
def test_updating_steps_compile_once(make, sync: str) -> None:
    s = make()
    with s.scope():
        v = jd.Variable(0.0, synchronization=sync, aggregation="sum")
        k = jd.Variable(0, synchronization=sync, aggregation="sum")
    traces = []

    def step(ctx, v, k):
        traces.append(1)
        return ctx.assign_add(v, 1.0), ctx.assign_add(k, 1)

    compiled = s.function(step)
    for _ in range(3):
        v, k = compiled(v, k)
    assert len(traces) == 1
    for _ in range(3):
        v, k = s.run(step, args=(v, k))
    assert len(traces) == 2  # run has its own cache entry, then hits it
    n = s.num_replicas_in_sync
    expected = 6.0 * n  # ON_WRITE SUM adds every replica's 1; ON_READ SUM sums the copies
    assert float(v.read_value()) == expected and int(k.read_value()) == expected
    assert v.dtype == jnp.float32 and k.dtype == jnp.int32


# 2. Conversions, inside and outside a user's jax.jit -----------------------------------


def _invariant_variables() -> dict[str, jd.Variable]:
    s = jd.MirroredStrategy()
    with s.scope():
        mirrored = jd.Variable(3.0, aggregation="mean")
        total = jd.Variable(0.0, synchronization="on_read", aggregation="sum")
        mean = jd.Variable(0.0, synchronization="on_read", aggregation="mean")
        first = jd.Variable(0.0, synchronization="on_read", aggregation="only_first_replica")
    rows = jd.PerReplica(jnp.asarray([3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    return {
        "mirrored": mirrored,
        "on_read_sum": total.assign(rows),
        "on_read_mean": mean.assign(jd.PerReplica(jnp.full(8, 3.0))),
        "on_read_first": first.assign(rows),
    }


@pytest.mark.parametrize("kind", ["mirrored", "on_read_sum", "on_read_mean", "on_read_first"])
def test_invariant_variables_convert_like_arrays(kind: str) -> None:
    v = _invariant_variables()[kind]  # every one reads 3.0
    assert float(v) == 3.0 and int(v) == 3 and bool(v) and complex(v) == 3 + 0j
    assert np.asarray(v).tolist() == 3.0 and v.numpy().tolist() == 3.0
    assert float(jnp.asarray(v)) == 3.0 and float(v.__jax_array__()) == 3.0
    assert float(jnp.add(v, 1)) == 4.0 and float(jnp.sin(v)) == pytest.approx(np.sin(3.0))
    assert float(v + 1) == 4.0 and float(2**v) == 8.0 and float(v // 2) == 1.0
    assert bool(v > 2) and not bool(v <= 2) and float(abs(-v)) == 3.0

    @jax.jit
    def traced(v):
        return jnp.asarray(v) + jnp.sin(v) + v.read_value() * v.__jax_array__()

    assert float(traced(v)) == pytest.approx(3.0 + np.sin(3.0) + 9.0, rel=1e-6)


def test_falsy_and_integer_conversions() -> None:
    assert not bool(jd.Variable(0.0)) and bool(jd.Variable(2))
    assert operator.index(jd.Variable(3)) == 3 and [10, 11, 12, 13][jd.Variable(2)] == 12
    with pytest.raises(TypeError):
        operator.index(jd.Variable(3.0))
    with pytest.raises(ValueError, match=r"truth value of an array with more than one element"):
        bool(jd.Variable(jnp.ones(2)))


def test_on_read_none_and_per_replica_refuse_conversion(mirrored8) -> None:
    with mirrored8.scope():
        none = jd.Variable(1.0, synchronization="on_read")
    for convert in (float, int, bool, np.asarray, jnp.asarray):
        with pytest.raises(ValueError, match=r"is ON_READ with aggregation NONE, so its 8"):
            convert(none)


@pytest.mark.parametrize("sync", ["on_write", "on_read"])
def test_every_method_works_inside_a_user_jit(mirrored8, sync: str) -> None:
    with mirrored8.scope():
        v = jd.Variable(jnp.ones(3), synchronization=sync, aggregation="mean", name="v")
    rows = jd.PerReplica(jnp.arange(24.0).reshape(8, 3))

    seen = []

    @jax.jit
    def step(v, x):
        seen.append((v.shape, v.dtype, repr(v)))
        a = v.assign(x)
        b = a.assign_add(jd.Mirrored(x)).assign_sub(1.0)
        c = b.assign(rows)  # ON_WRITE MEAN: the mean of the rows; ON_READ: row r each
        d = copy.deepcopy(c)
        return a, b, c, d, v.value() + v.read_value()

    a, b, c, d, doubled = step(v, jnp.full(3, 2.0))
    assert seen == [((3,), jnp.float32, repr(v))]
    np.testing.assert_array_equal(a.read_value(), [2.0] * 3)
    np.testing.assert_array_equal(b.read_value(), [3.0] * 3)
    np.testing.assert_array_equal(c.read_value(), np.arange(24.0).reshape(8, 3).mean(0))
    np.testing.assert_array_equal(d.read_value(), c.read_value())
    np.testing.assert_array_equal(doubled, [2.0] * 3)
    assert isinstance(c, jd.Variable) and c.synchronization is Sync(sync.upper())
    if sync == "on_read":
        assert c.device_values.sharding.spec == jax.sharding.PartitionSpec("replica")
        np.testing.assert_array_equal(c.device_values, np.arange(24.0).reshape(8, 3))
    # the updated variables keep working under the strategy
    out = mirrored8.run(lambda ctx, v: ctx.assign_add(v, 1.0), args=(b,))
    np.testing.assert_array_equal(out.read_value(), [4.0] * 3)


def test_closed_over_variable_assigned_inside_jit(mirrored8) -> None:
    with mirrored8.scope():
        w = jd.Variable(jnp.zeros(2), aggregation="sum")
        t = jd.Variable(0, synchronization="on_read", aggregation="sum")
    new_w, new_t = jax.jit(lambda x: (w.assign(x), t.assign(jnp.int32(10))))(jnp.ones(2))
    np.testing.assert_array_equal(new_w.read_value(), [1.0, 1.0])
    assert new_w.device_values.sharding.is_fully_replicated
    assert _copies(new_t) == [2, 2, 1, 1, 1, 1, 1, 1] and int(new_t) == 10


# 3. Distributed values in cross-replica updates ---------------------------------------

# Initial 10, PerReplica rows r = 0..7: the expected copies (ON_READ) or value (ON_WRITE).
ON_READ_EXPECTED = {
    "assign": lambda r: r,
    "assign_add": lambda r: 10 + r,
    "assign_sub": lambda r: 10 - r,
}
ON_WRITE_AGG = {"SUM": np.sum, "MEAN": np.mean, "ONLY_FIRST_REPLICA": lambda r: r[0]}


@pytest.mark.parametrize("agg", ["NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA"])
@pytest.mark.parametrize("kind", list(ON_READ_EXPECTED))
def test_on_read_copies_take_their_rows(mirrored8, agg: str, kind: str) -> None:
    with mirrored8.scope():
        v = jd.Variable(10.0, synchronization="on_read", aggregation=agg)
    out = getattr(v, kind)(jd.PerReplica(_ids(8)))
    assert _copies(out) == ON_READ_EXPECTED[kind](_ids(8)).tolist()
    assert out.device_values.sharding.spec == jax.sharding.PartitionSpec("replica")


@pytest.mark.parametrize("agg", list(ON_WRITE_AGG))
@pytest.mark.parametrize("kind", list(ON_READ_EXPECTED))
def test_on_write_aggregates_per_replica_values(mirrored8, agg: str, kind: str) -> None:
    with mirrored8.scope():
        v = jd.Variable(jnp.full(2, 10.0), aggregation=agg)
    out = getattr(v, kind)(jd.PerReplica(_ids(8)))  # scalar rows broadcast to the shape
    red = ON_WRITE_AGG[agg](_ids(8))
    expected = {"assign": red, "assign_add": 10 + red, "assign_sub": 10 - red}[kind]
    np.testing.assert_array_equal(out.read_value(), [expected] * 2)
    assert out.device_values.sharding.is_fully_replicated
    # the same as the replica-context update with the same per-replica values
    ref = mirrored8.run(
        lambda ctx, v, x: getattr(ctx, kind)(v, x), args=(v, jd.PerReplica(_ids(8)))
    )
    np.testing.assert_array_equal(out.read_value(), ref.read_value())


def test_mirrored_values_are_their_array(mirrored8) -> None:
    with mirrored8.scope():
        w = jd.Variable(jnp.zeros(2), name="w")
        total = jd.Variable(0.0, synchronization="on_read", aggregation="sum")
    np.testing.assert_array_equal(w.assign(jd.Mirrored(jnp.ones(2))).read_value(), [1.0, 1.0])
    assert float(total.assign(jd.Mirrored(jnp.float32(8.0)))) == 8.0


def test_per_replica_updates_that_mean_nothing_are_refused(mirrored8) -> None:
    rows = jd.PerReplica(_ids(8))
    with mirrored8.scope():
        w = jd.Variable(0.0, name="w")
        count = jd.Variable(0, aggregation="mean", name="count")
        total = jd.Variable(0.0, synchronization="on_read", aggregation="sum", name="t")
    with pytest.raises(
        ValueError,
        match=r"Variable.assign: variable 'w' is mirrored \(ON_WRITE\) with aggregation NONE, "
        r"so it cannot combine the 8 values of a PerReplica into its one value. Give it an "
        r"aggregation",
    ):
        w.assign(rows)
    with pytest.raises(
        ValueError,
        match=r"Variable.assign_add: variable 'count' has integer dtype int32 and aggregation "
        r"MEAN; the mean of the 8 per-replica values need not be an integer",
    ):
        count.assign_add(jd.PerReplica(np.arange(8, dtype=np.int32)))
    with pytest.raises(
        ValueError,
        match=r"Variable.assign: the PerReplica value has 2 per-replica values \(shape \(2,\)\) "
        r"but variable 'w' belongs to MirroredStrategy\(.*\), which has 8 replicas",
    ):
        w.assign(jd.PerReplica(jnp.zeros(2)))
    with pytest.raises(ValueError, match=r"is a padded batch \(it carries valid-row counts\)"):
        total.assign(jd.PerReplica(jnp.zeros((8, 2)), valid=jnp.full(8, 1)))
    with pytest.raises(
        ValueError,
        match=r"Variable.assign: value of shape \(3,\) does not fit variable 't' of shape \(\)",
    ):
        total.assign(jd.PerReplica(jnp.zeros((8, 3))))
    with pytest.raises(
        ValueError, match=r"Variable.assign_add: .* is ON_READ with aggregation SUM"
    ):
        total.assign_add(jd.Mirrored(jnp.float32(1.0)))
    # a PerReplica delta is meaningful for ON_READ SUM: copy r adds row r
    assert float(total.assign_add(rows)) == 28.0


def test_lossy_assignments_are_refused(mirrored8) -> None:
    with mirrored8.scope():
        n = jd.Variable(0, name="n")
        flag = jd.Variable(False, name="flag")
        x = jd.Variable(0.0, name="x")
    with pytest.raises(
        TypeError,
        match=r"Variable.assign: cannot assign a value of dtype float32 to variable 'n' of "
        r"dtype int32: a cast from floating point to an integer drops the fraction. Convert",
    ):
        n.assign(1.5)
    with pytest.raises(TypeError, match=r"variable 'flag' of dtype bool: a cast to bool"):
        flag.assign(1)
    with pytest.raises(TypeError, match=r"ReplicaContext.assign_add: cannot assign a value of "):
        mirrored8.run(lambda ctx, n: ctx.assign_add(n, 0.5), args=(n,))
    assert float(x.assign(2)) == 2.0 and int(n.assign(jnp.int8(3))) == 3
    with mirrored8.scope():
        pair = jd.Variable(jnp.zeros(2, jnp.bfloat16))
    assert pair.assign([1.5, 2]).read_value().tolist() == [1.5, 2.0]
    assert pair.assign([1.5, 2]).dtype == jnp.bfloat16
    assert bool(flag.assign(True))


# 4. A variable belongs to its strategy ----------------------------------------------


def test_variable_used_under_another_strategy_names_both() -> None:
    a = jd.MirroredStrategy(jax.devices()[:2])
    b = jd.MirroredStrategy()
    with a.scope():
        v = jd.Variable(1.0, aggregation="mean", name="v")
        m = jd.Variable(1.0, synchronization="on_read", aggregation="sum", name="m")
    plain = jd.Variable(2.0)  # the default strategy's: usable anywhere
    both = re.escape(repr(a)) + r", but " + re.escape(repr(b)) + r" is in effect here"
    with b.scope():
        for use in (
            lambda: v.read_value(),
            lambda: float(m),
            lambda: np.asarray(v),
            lambda: v + 1,
        ):
            with pytest.raises(
                ValueError,
                match=r"Variable.read_value: variable '[vm]' was created in the "
                r"scope of " + both,
            ):
                use()
        for method in ("assign", "assign_add", "assign_sub"):
            with pytest.raises(ValueError, match=rf"Variable.{method}: variable 'v' .*" + both):
                getattr(v, method)(1.0)
        assert float(plain.assign_add(1.0)) == 3.0
    with a.scope():
        assert float(v.assign_add(1.0)) == 2.0 and float(m) == 2.0
    assert float(v) == 1.0  # outside any scope: fine

    def closes_over(ctx, x):
        return x + v.read_value()

    with pytest.raises(ValueError, match=r"variable 'v' was created in the scope of " + both):
        b.run(closes_over, args=(1.0,))


# 5. Exact integer splits of ON_READ SUM variables -------------------------------------


@pytest.mark.parametrize(
    ("total", "n", "copies"),
    [
        (100, 8, [13, 13, 13, 13, 12, 12, 12, 12]),
        (-100, 8, [-13, -13, -13, -13, -12, -12, -12, -12]),
        (10, 3, [4, 3, 3]),
        (5, 8, [1, 1, 1, 1, 1, 0, 0, 0]),
        (-3, 2, [-2, -1]),
        (16, 8, [2] * 8),
        (0, 2, [0, 0]),
    ],
)
def test_integer_on_read_sum_splits_exactly(total: int, n: int, copies: list) -> None:
    s = jd.MirroredStrategy(jax.devices()[:n])
    with s.scope():
        v = jd.Variable(0, synchronization="on_read", aggregation="sum")
    out = v.assign(total)
    assert _copies(out) == copies and sum(copies) == total
    assert int(out.read_value()) == total and out.dtype == jnp.int32
    restored = jd.checkpoint.from_saveable(np.int32(total), v)
    assert int(restored.read_value()) == total and _copies(restored) == copies


def test_integer_split_of_arrays_and_unsigned(mirrored8) -> None:
    with mirrored8.scope():
        v = jd.Variable(np.zeros(3, np.int32), synchronization="on_read", aggregation="sum")
        u = jd.Variable(np.uint8(0), synchronization="on_read", aggregation="sum")
    out = v.assign(np.array([100, -3, 7], np.int32))
    np.testing.assert_array_equal(np.asarray(out.device_values).sum(0), [100, -3, 7])
    np.testing.assert_array_equal(out.read_value(), [100, -3, 7])
    assert np.ptp(np.asarray(out.device_values), axis=0).max() <= 1  # as even as possible
    assert _copies(u.assign(np.uint8(250))) == [32, 32, 31, 31, 31, 31, 31, 31]
    with mirrored8.scope():
        f = jd.Variable(0.0, synchronization="on_read", aggregation="sum")
    assert _copies(f.assign(4.0)) == [0.5] * 8  # floats: value / N, as TF


# 8. Copies and pickling ---------------------------------------------------------------


def test_deepcopy_copies_storage_and_keeps_placement(mirrored8) -> None:
    with mirrored8.scope():
        w = jd.Variable(jnp.arange(3.0), aggregation="mean", name="w")
        m = jd.Variable(1.0, synchronization="on_read", aggregation="sum")
    for v in (w, m):
        c = copy.deepcopy(v)
        assert isinstance(c, jd.Variable) and c is not v
        assert c.device_values is not v.device_values
        assert c.device_values.sharding == v.device_values.sharding
        assert c.meta == v.meta
        np.testing.assert_array_equal(c.device_values, v.device_values)
        old = {s.device: s.data.unsafe_buffer_pointer() for s in v.device_values.addressable_shards}
        new = {s.device: s.data.unsafe_buffer_pointer() for s in c.device_values.addressable_shards}
        assert all(old[d] != new[d] for d in old)
    assert copy.copy(w).device_values is w.device_values  # immutable: shallow shares
    tree = copy.deepcopy({"w": w, "m": m})
    assert float(tree["m"]) == 8.0


def test_pickle_round_trips_and_places_under_the_strategy_in_effect(mirrored8) -> None:
    with mirrored8.scope():
        w = jd.Variable(jnp.arange(3.0), aggregation="mean", name="w")
        m = jd.Variable(0.0, synchronization="on_read", aggregation="sum", name="m")
        k = jd.Variable(0, synchronization="on_read", aggregation="sum")
        copies = jd.Variable(0.0, synchronization="on_read", name="c")  # aggregation NONE
    m = m.assign(jd.PerReplica(_ids(8)))
    k = k.assign(10)
    copies = copies.assign(jd.PerReplica(_ids(8)))
    blob = pickle.dumps({"w": w, "m": m, "k": k, "c": copies})

    with mirrored8.scope():  # same replica count: copies kept as they were
        same = pickle.loads(blob)
    assert same["w"].strategy == mirrored8 and same["w"].name == "w"
    assert same["w"].aggregation is Agg.MEAN and same["w"].trainable
    assert same["w"].device_values.sharding.is_fully_replicated
    assert _copies(same["m"]) == _ids(8).tolist() and _copies(same["c"]) == _ids(8).tolist()
    assert same["m"].synchronization is Sync.ON_READ and not same["m"].trainable

    two = jd.MirroredStrategy(jax.devices()[:2])
    with two.scope():  # another replica count: the aggregate, re-split
        moved = pickle.loads(blob)
    assert _copies(moved["m"]) == [14.0, 14.0] and _copies(moved["k"]) == [5, 5]
    assert _copies(moved["c"]) == [0.0, 0.0]  # no aggregate: replica 0's copy, as a checkpoint

    plain = pickle.loads(pickle.dumps(w))  # outside any scope: the default strategy
    assert plain.strategy == jd.get_strategy() and len(plain.device_values.devices()) == 1
    np.testing.assert_array_equal(plain.read_value(), [0.0, 1.0, 2.0])

    @jax.jit
    def traced(v):
        pickle.dumps(v)
        return v

    with pytest.raises(TypeError, match=r"pickle: variable 'w' holds a traced value"):
        traced(w)


@pytest.mark.parametrize("initial", [0.0, 0, [0.0, 1.0]])
def test_first_updates_do_not_retrace_under_a_user_jit(initial: Any) -> None:
    v = jd.Variable(initial)
    traces = []

    @jax.jit
    def step(v: jd.Variable) -> jd.Variable:
        traces.append(1)
        return v.assign_add(1).assign_sub(0)

    for _ in range(3):
        v = step(v)
    v = v.assign(2)  # a Python int, eagerly: the variable keeps its strong dtype
    v = step(v)
    assert len(traces) == 1
    assert not v.device_values.weak_type and v.dtype == jnp.asarray(np.asarray(initial)).dtype
    np.testing.assert_array_equal(v.read_value(), np.full(np.shape(initial), 3))


@pytest.mark.parametrize("sync", ["on_write", "on_read"])
@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
def test_updates_inside_a_user_jit_keep_the_placement(sync: str, method: str) -> None:
    s = jd.MirroredStrategy()
    with s.scope():
        v = jd.Variable(jnp.zeros(2), synchronization=sync, aggregation="mean")
    out = jax.jit(lambda v, x: getattr(v, method)(x))(v, jnp.ones(2))  # x: uncommitted
    expected = {"assign": 1.0, "assign_add": 1.0, "assign_sub": -1.0}[method]
    np.testing.assert_array_equal(out.read_value(), [expected] * 2)
    sharding = out.device_values.sharding
    assert sharding.device_set == set(jax.devices())  # every replica's copy, not one device
    assert sharding.is_equivalent_to(v.device_values.sharding, v.device_values.ndim)
    assert sharding.spec == (P() if sync == "on_write" else P("replica"))


def test_variable_of_another_strategy_is_refused(mirrored8: jd.MirroredStrategy) -> None:
    two = jd.MirroredStrategy(jax.devices()[:2])
    with two.scope():
        v = jd.Variable(jnp.zeros(2), aggregation="mean")
    with pytest.raises(ValueError, match=r"args\[0\] is variable None, created in the scope of"):
        mirrored8.run(lambda ctx, v: ctx.assign_add(v, 1.0), args=(v,))


@pytest.mark.parametrize("agg", ["NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA"])
@pytest.mark.parametrize("kind", list(ON_READ_EXPECTED))
@pytest.mark.parametrize(
    "make", [jd.OneDeviceStrategy, lambda: jd.MirroredStrategy(jax.devices()[:1])],
    ids=["one_device", "mirrored1"],
)  # fmt: skip
def test_one_replica_keeps_an_update_that_depends_on_its_data(make, agg: str, kind: str) -> None:
    """With one replica nothing can diverge: every aggregation (NONE too, as TF's
    OneDeviceStrategy updates a plain variable) applies the update made from the
    function's argument, as NumPy does."""
    strategy = make()
    with strategy.scope():
        v = jd.Variable(jnp.full(2, 10.0), aggregation=agg)
    x = np.array([1.5, -2.0], np.float32)
    out = strategy.run(lambda ctx, v, x: getattr(ctx, kind)(v, x), args=(v, x))
    expected = {"assign": x, "assign_add": 10 + x, "assign_sub": 10 - x}[kind]
    np.testing.assert_array_equal(np.asarray(out.read_value()), expected)

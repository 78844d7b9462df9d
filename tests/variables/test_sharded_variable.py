"""Sharded variables (``jd.experimental.ShardedVariable``, ``jd.Variable(partitioner=...)``).

TensorFlow's semantics (its sharded_variable_test.py is the reference for the cases):
every read, slice, update and checkpoint is compared with NumPy on the full array
(exact: the values are small integers or sums of them).
"""

from __future__ import annotations

import copy
import itertools
import pickle
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd
from jaxdist.variables._sharded import div_rows

SV = jd.experimental.ShardedVariable
P = jd.experimental.partitioners


def _sharded(data: Any, rows: list[int], **kwargs: Any) -> jd.experimental.ShardedVariable:
    data = np.asarray(data)
    offsets = np.cumsum([0, *rows])
    return SV([jd.Variable(data[a:b], **kwargs) for a, b in itertools.pairwise(offsets)])


def _rows(v: Any) -> list[int]:
    return [s.shape[0] for s in v.variables]


# Partitioners -> shards --------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "partitioner", "rows"),
    [
        ((10, 2), P.FixedShardsPartitioner(4), [3, 3, 2, 2]),
        ((10, 2), P.FixedShardsPartitioner(3), [4, 3, 3]),
        ((10,), P.FixedShardsPartitioner(2), [5, 5]),
        ((3, 2), P.FixedShardsPartitioner(5), [1, 1, 1]),  # n = min(5, 3)
        ((6, 1), P.MinSizePartitioner(min_shard_bytes=4, max_shards=2), [3, 3]),
        ((6, 1), P.MinSizePartitioner(min_shard_bytes=4, max_shards=10), [1] * 6),
        ((6, 1), P.MaxSizePartitioner(max_shard_bytes=4), [1] * 6),
        ((6, 1), P.MaxSizePartitioner(max_shard_bytes=4, max_shards=2), [3, 3]),
        ((7, 3, 2), lambda shape, dtype: [3, 1, 1], [3, 2, 2]),
    ],
)
def test_partitioner_gives_div_shards_holding_the_value(
    strategy: jd.Strategy, shape: tuple[int, ...], partitioner: Any, rows: list[int]
) -> None:
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    with strategy.scope():
        v = jd.Variable(value, partitioner=partitioner, name="w", aggregation="mean")
    assert isinstance(v, SV)
    assert _rows(v) == rows == div_rows(shape[0], len(rows))
    assert v.shape == shape and v.dtype == np.float32 and v.name == "w"
    assert [s.name for s in v.variables] == [f"w/part_{i}" for i in range(len(rows))]
    for s in v.variables:
        assert s.strategy == strategy and s.aggregation is jd.VariableAggregation.MEAN
        assert s.device_values.sharding.device_set == set(strategy.extended.worker_devices)
    np.testing.assert_array_equal(v.numpy(), value)
    np.testing.assert_array_equal(np.concatenate([s.numpy() for s in v.variables]), value)


@pytest.mark.parametrize(
    ("value", "partitioner"),
    [
        (np.arange(6.0), P.FixedShardsPartitioner(1)),
        (np.arange(6.0).reshape(6, 1), P.MaxSizePartitioner(max_shard_bytes=1024)),
        (np.ones((1, 4)), P.FixedShardsPartitioner(3)),  # one row: one shard
        (np.float32(2.0), P.FixedShardsPartitioner(3)),  # a scalar is never split
        (np.zeros((0, 2)), P.FixedShardsPartitioner(3)),
    ],
)
def test_one_shard_gives_a_plain_variable(value: Any, partitioner: Any) -> None:
    v = jd.Variable(value, partitioner=partitioner, name="w")
    assert type(v) is jd.Variable
    assert v.name == "w" and v.shape == np.shape(value)
    np.testing.assert_array_equal(v.numpy(), value)


@pytest.mark.parametrize(
    "result",
    [[2, 2], [0, 1], [-1, 1], [2], [2, 1, 1], 2, (2.0, 1), [True, 1], None, [2, 0]],
)
def test_partitioner_results_that_are_not_shard_counts_raise(result: Any) -> None:
    with pytest.raises(ValueError, match=r"partitioner .* returned .* for shape \(4, 3\)"):
        jd.Variable(np.ones((4, 3)), partitioner=lambda shape, dtype: result)


def test_partitioner_must_be_callable_and_gets_shape_and_dtype() -> None:
    with pytest.raises(TypeError, match="partitioner=3 is not callable"):
        jd.Variable(np.ones((4, 3)), partitioner=3)
    seen = []

    def spy(shape: tuple[int, ...], dtype: Any) -> list[int]:
        seen.append((shape, np.dtype(dtype)))
        return [2, 1]

    v = jd.Variable([[1, 2], [3, 4], [5, 6]], partitioner=spy)
    assert seen == [((3, 2), np.dtype(np.int32))]  # TF's dtype for Python ints
    assert _rows(v) == [2, 1] and v.dtype == np.int32


def test_callable_initial_value_is_called_once_and_keywords_reach_the_shards() -> None:
    calls = []

    def init() -> np.ndarray:
        calls.append(1)
        return np.arange(8.0).reshape(4, 2)

    v = jd.Variable(
        init,
        partitioner=P.FixedShardsPartitioner(2),
        dtype="bfloat16",
        trainable=False,
        synchronization="on_read",
        aggregation="sum",
    )
    assert calls == [1]
    assert v.dtype == jnp.bfloat16 and not v.trainable
    assert all(s.is_on_read and s.aggregation is jd.VariableAggregation.SUM for s in v)
    np.testing.assert_array_equal(np.asarray(v, dtype=np.float32), np.arange(8.0).reshape(4, 2))


def test_initial_value_keyword_and_errors_name_the_variable() -> None:
    v = jd.Variable(initial_value=np.ones((4, 1)), partitioner=P.FixedShardsPartitioner(2))
    assert _rows(v) == [2, 2]
    with pytest.raises(TypeError, match=r"jaxdist.Variable\(name='s'\): initial_value"):
        jd.Variable(["a", "b"], partitioner=P.FixedShardsPartitioner(2), name="s")


# Construction ------------------------------------------------------------------------


def test_simple_properties_as_tf() -> None:
    v0, v1 = jd.Variable([0]), jd.Variable([1])
    s = SV([v0, v1], name="s")
    assert s.variables[0] is v0 and s.variables[1] is v1
    assert list(s) == [v0, v1]  # iteration is over the shards, as in TF
    assert s.shape == (2,) and s.dtype == v0.dtype and s.name == "s" and s.ndim == 1
    assert SV([v0]).name is None and SV((v0, v1)).shape == (2,)
    assert s.trainable and s.strategy == v0.strategy
    assert "shard_rows=[1, 1]" in repr(s)
    with pytest.raises(AttributeError, match="immutable"):
        s.name = "t"  # type: ignore[misc]


@pytest.mark.parametrize("bad", [None, [], [jd.Variable([0]), "not-a-variable"], np.ones(3)])
def test_construction_needs_a_non_empty_list_of_variables(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"should be a non-empty list of jaxdist\.Variable"):
        SV(bad)


def test_construction_errors_as_tf() -> None:
    with pytest.raises(ValueError, match="must have the same dtype"):
        SV([jd.Variable([0], dtype="int8"), jd.Variable([1], dtype="int32")])
    with pytest.raises(ValueError, match="the same shapes except for the first axis"):
        SV([jd.Variable(jnp.ones((5, 10))), jd.Variable(jnp.ones((5, 20)))])
    with pytest.raises(ValueError, match="rank 1 or higher"):
        SV([jd.Variable(1.0), jd.Variable(2.0)])
    with pytest.raises(ValueError, match="same trainable property"):
        SV([jd.Variable([0.0]), jd.Variable([1.0], trainable=False)])
    with jd.MirroredStrategy(jax.devices()[:2]).scope():
        v2 = jd.Variable([1.0])
    with pytest.raises(ValueError, match="belong to one strategy"):
        SV([jd.Variable([0.0]), v2])


# Reads -------------------------------------------------------------------------------


def test_reads_are_the_concatenation() -> None:
    data = [[0, 0], [1, 1], [2, 2], [3, 3]]
    s = _sharded(data, [1, 2, 1])
    expect = np.asarray(data, dtype=np.int32)
    for got in (s.numpy(), np.asarray(s), s.read_value(), s.value(), jnp.asarray(s)):
        np.testing.assert_array_equal(got, expect)
    assert isinstance(s.numpy(), np.ndarray)
    np.testing.assert_array_equal(s + s, expect * 2)  # TF's operator overloads
    np.testing.assert_array_equal(3 - s, 3 - expect)
    np.testing.assert_array_equal(s @ np.ones(2, np.int32), expect @ np.ones(2, np.int32))
    np.testing.assert_array_equal(jnp.sum(s, axis=0), expect.sum(0))
    np.testing.assert_array_equal(-s, -expect)


_DATA = np.array([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]])

# TF's test_slicing cases (all, beyond its int/Tensor-only error cases), plus more.
_KEYS: list[Any] = [
    *range(8),
    *range(-8, 0),
    slice(None),
    slice(None, 2),
    slice(-8, 2),
    slice(-10, 2),
    slice(5, None),
    slice(5, -1),
    slice(None, None, 3),
    slice(None, None, 5),
    slice(1, None, 6),
    slice(1, 5, 6),
    slice(1, None, 7),
    slice(2, 7),
    slice(2, 7, 2),
    slice(2, 7, 3),
    slice(None, None, -1),
    slice(2, None, -1),
    slice(2, -8, -1),
    slice(2, -10, -1),
    slice(4, None, -1),
    slice(-1, -3, -1),
    slice(None, None, -5),
    slice(6, None, -6),
    slice(6, 5, -6),
    slice(6, None, -7),
    slice(7, 1, -1),
    slice(7, 1, -2),
    slice(7, 1, -4),
    slice(0, 0),
    slice(5, 3),
    slice(3, 5, -1),
    slice(-1, 0),
    slice(2, -1, -1),
    slice(100, 200),
    (slice(None), 0),
    (slice(None), slice(0, 1)),
    (2, 1),
    (-2, -1),
    (slice(5, 3), 0),
    (slice(1, 6, 2), slice(None, None, -1)),
    Ellipsis,
    (Ellipsis, 0),
    (slice(0, 1), Ellipsis),
    (3, Ellipsis),
    (Ellipsis, 1, None),
    (None, Ellipsis),
    (None, slice(0, 5)),
    (None, 2),
    (slice(1, 4), None, 0),
    (),
    np.int64(5),
    (np.int32(-3), np.int32(0)),
    _DATA > 10,  # boolean mask: read in full
    np.array([0, 7, 3]),  # integer array: read in full
    (np.array([1, 6]), 1),
]


@pytest.mark.parametrize("rows", [[3, 3, 2], [1, 6, 1], [8], [2, 0, 4, 2]])
@pytest.mark.parametrize("key", _KEYS, ids=repr)
def test_slicing_matches_numpy(rows: list[int], key: Any) -> None:
    sv = _sharded(_DATA, rows)
    got = sv[key]
    want = _DATA[key]
    assert np.shape(got) == want.shape
    np.testing.assert_array_equal(np.asarray(got), want)


def test_every_basic_slice_matches_numpy() -> None:
    sv = _sharded(np.arange(10), [3, 3, 2, 2])
    ref = np.arange(10)
    bounds = [None, *range(-12, 13)]
    for start in bounds:
        for stop in bounds:
            for step in (None, 1, 2, 3, 4, 9, 11, -1, -2, -3, -7, -12):
                got = np.asarray(sv[start:stop:step])
                np.testing.assert_array_equal(got, ref[start:stop:step])


def test_slicing_errors() -> None:
    sv = _sharded(_DATA, [3, 3, 2])
    for i in (8, 100, -9, -100):
        with pytest.raises(
            IndexError, match=rf"ShardedVariable: slice index {i} of dimension 0 out of bounds\."
        ):
            sv[i]
    with pytest.raises(ValueError, match="slice step cannot be zero"):
        sv[::0]
    with pytest.raises(IndexError, match="ellipsis"):
        sv[..., ...]


def test_integer_index_reads_only_its_shard() -> None:
    reads = []

    class Spy(jd.Variable):
        def read_value(self) -> Any:
            reads.append(self.name)
            return super().read_value()

    plain = [
        jd.Variable(_DATA[a:b], name=f"s{i}") for i, (a, b) in enumerate([(0, 3), (3, 6), (6, 8)])
    ]
    spied = SV([Spy.from_stored(v.stored, v.meta) for v in plain])
    np.testing.assert_array_equal(spied[4], _DATA[4])
    assert reads == ["s1"]
    reads.clear()
    np.testing.assert_array_equal(spied[6:8], _DATA[6:8])
    assert reads == ["s2"]


def test_slicing_inside_jit() -> None:
    sv = _sharded(_DATA, [3, 3, 2])
    got = jax.jit(lambda s, i: (s[:, 0], s[2, 1], s[i]))(sv, 5)
    np.testing.assert_array_equal(got[0], _DATA[:, 0])
    assert int(got[1]) == 6
    np.testing.assert_array_equal(got[2], _DATA[5])


# Sparse reads / embedding lookup -----------------------------------------------------


def test_sparse_read_as_tf() -> None:
    values = np.arange(30, dtype=np.float32).reshape(30, 1)
    sv = _sharded(values, [10, 10, 10])
    for ids in ([21, 0, 12, 22, 10], [], [10, 10, 0, 21], [[29, 0], [9, 20]]):
        ids = np.asarray(ids, dtype=np.int32)
        got = sv.sparse_read(ids)
        np.testing.assert_array_equal(got, values[ids])
        assert got.shape == (*ids.shape, 1)
    got = jax.jit(lambda s, i: s.sparse_read(i))(sv, jnp.array([21, 0, 12, 22, 10]))
    np.testing.assert_array_equal(got, values[[21, 0, 12, 22, 10]])
    # Out-of-range ids: eager raises; compiled reads zeros (TF's GPU/TPU embedding_lookup).
    with pytest.raises(IndexError, match=r"indices in \[-1, 30\]"):
        sv.sparse_read(np.array([-1, 30]))
    got = jax.jit(lambda s, i: s.sparse_read(i))(sv, jnp.array([30, 5, -1, 29, 1000]))
    np.testing.assert_array_equal(got, [[0.0], [5.0], [0.0], [29.0], [0.0]])


def test_embedding_lookup_as_tf_and_uneven_shards() -> None:
    sv = SV(
        [
            jd.Variable([[1.0, 2.0], [3.0, 4.0]]),
            jd.Variable([[5.0, 6.0], [7.0, 8.0]]),
            jd.Variable([[9.0, 10.0]]),
        ]
    )
    np.testing.assert_array_equal(sv.sparse_read([0, 3, 4]), [[1, 2], [7, 8], [9, 10]])
    table = np.arange(33, dtype=np.float32).reshape(11, 3)
    sv = _sharded(table, [4, 0, 4, 3])
    ids = np.array([[10, 0, 3, 4], [7, 8, 8, 1]])
    np.testing.assert_array_equal(sv.sparse_read(ids), table[ids])
    with pytest.raises(IndexError, match=r"indices in \[0, 11\] but .* has 11 rows"):
        sv.sparse_read([0, 11])
    with pytest.raises(IndexError, match=r"indices in \[-1, 2\]"):
        sv.sparse_read([2, -1])
    with pytest.raises(TypeError, match="indices must be integers"):
        sv.sparse_read([0.0])


# Updates -----------------------------------------------------------------------------


def _tf_triplet() -> jd.experimental.ShardedVariable:
    return SV([jd.Variable([[0, 0]]), jd.Variable([[1, 1], [2, 2]]), jd.Variable([[3, 3]])])


@pytest.mark.parametrize(
    ("method", "value", "shards"),
    [
        ("assign", [[4, 4], [5, 5], [6, 6], [7, 7]], [[[4, 4]], [[5, 5], [6, 6]], [[7, 7]]]),
        ("assign_add", [[1, 1], [1, 1], [2, 2], [2, 2]], [[[1, 1]], [[2, 2], [4, 4]], [[5, 5]]]),
        ("assign_sub", [[0, 0], [1, 1], [1, 1], [3, 3]], [[[0, 0]], [[0, 0], [1, 1]], [[0, 0]]]),
    ],
)
def test_updates_as_tf_return_new_objects(method: str, value: Any, shards: list[Any]) -> None:
    s = _tf_triplet()
    before = s.numpy()
    ret = getattr(s, method)(value)
    assert isinstance(ret, SV) and ret is not s
    for got, want in zip(ret.variables, shards, strict=True):
        np.testing.assert_array_equal(got.numpy(), want)
        assert got.dtype == np.int32
    np.testing.assert_array_equal(s.numpy(), before)  # the old object is unchanged


def test_updates_broadcast_and_take_variables_and_mirrored_values() -> None:
    base = np.arange(12.0).reshape(6, 2)
    s = _sharded(base, [2, 2, 2])
    np.testing.assert_array_equal(s.assign_add(1.0).numpy(), base + 1)
    np.testing.assert_array_equal(s.assign_sub(np.array([1.0, 2.0])).numpy(), base - [1, 2])
    np.testing.assert_array_equal(s.assign(np.ones((1, 2))).numpy(), np.ones((6, 2)))
    np.testing.assert_array_equal(s.assign(s.assign_add(s)).numpy(), base * 2)
    np.testing.assert_array_equal(s.assign(jd.Variable(base + 5)).numpy(), base + 5)
    np.testing.assert_array_equal(s.assign(jd.Mirrored(jnp.asarray(-base))).numpy(), -base)
    with pytest.raises(
        ValueError, match=r"ShardedVariable.assign: value of shape \(5, 2\) does not fit"
    ):
        s.assign(np.ones((5, 2)))
    with pytest.raises(TypeError, match="cannot assign a value of dtype float"):
        _tf_triplet().assign_add(0.5)


def test_cross_replica_per_replica_update_is_aggregated_per_shard() -> None:
    strategy = jd.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        s = jd.Variable(
            np.zeros((5, 2), np.float32),
            partitioner=P.FixedShardsPartitioner(2),
            aggregation="mean",
        )
    rows = np.arange(n * 10, dtype=np.float32).reshape(n, 5, 2)
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: jnp.asarray(rows[ctx.replica_id_in_sync_group])
    )
    got = s.assign(per_replica)
    np.testing.assert_allclose(got.numpy(), rows.mean(0), rtol=1e-6)
    with pytest.raises(ValueError, match=r"ShardedVariable.assign_add: value of shape \(3,\)"):
        s.assign_add(jd.PerReplica(jnp.zeros((n, 3))))


def test_pickle_and_deepcopy_round_trip() -> None:
    s = _sharded(_DATA, [3, 3, 2])
    s = SV(s.variables, name="emb")
    for other in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert isinstance(other, SV) and other.name == "emb" and _rows(other) == [3, 3, 2]
        np.testing.assert_array_equal(other.numpy(), _DATA)


# Pytrees, jit and strategy.run -------------------------------------------------------


def test_is_a_pytree_of_its_shards_and_jit_compiles_once() -> None:
    s = _sharded(_DATA, [3, 3, 2])
    leaves = jax.tree.leaves(s)
    assert len(leaves) == 3
    np.testing.assert_array_equal(np.concatenate(leaves), _DATA)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(s)[0]]
    assert paths == ["[0].value", "[1].value", "[2].value"]
    traces = []

    @jax.jit
    def step(sv: Any) -> Any:
        traces.append(1)
        return sv.assign([[0, 0]] * 8)

    for data in (_DATA, _DATA * 2):
        out = step(_sharded(data, [3, 3, 2]))
        assert isinstance(out, SV) and _rows(out) == [3, 3, 2]
        np.testing.assert_array_equal(out.numpy(), np.zeros((8, 2)))
    assert len(traces) == 1  # TF's test_as_function_input
    doubled = jax.tree.map(lambda x: x * 2, s)
    assert isinstance(doubled, SV)
    np.testing.assert_array_equal(doubled.numpy(), _DATA * 2)


def test_cross_replica_methods_see_the_whole_variable() -> None:
    """``experimental_local_results``, ``reduce`` and ``gather`` take a sharded variable as
    one value (its shards concatenated), as they take a plain variable."""
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    with strategy.scope():
        v = jd.Variable(_DATA, partitioner=P.FixedShardsPartitioner(3))
        plain = jd.Variable(_DATA)
    local = strategy.experimental_local_results(v)
    assert len(local) == 2
    for r in local:
        assert isinstance(r, jax.Array)
        np.testing.assert_array_equal(np.asarray(r), _DATA)
    for op in ("sum", "mean", "max"):
        for axis in (None, 0):
            got = strategy.reduce(op, {"w": v}, axis=axis)["w"]
            want = strategy.reduce(op, {"w": plain}, axis=axis)["w"]
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(
        np.asarray(strategy.reduce("sum", v, axis=None)), _DATA * 2
    )  # two mirrored copies


def test_tree_maps_that_put_arrays_in_place_of_the_shards() -> None:
    strategy = jd.MirroredStrategy(jax.devices()[:2])
    with strategy.scope():
        v = jd.Variable(_DATA, partitioner=P.FixedShardsPartitioner(3))
    r = jax.tree.map(np.asarray, v, is_leaf=lambda x: isinstance(x, jd.Variable))
    assert isinstance(r, SV) and not isinstance(r.variables[0], jd.Variable)
    np.testing.assert_array_equal(r.numpy(), _DATA)
    np.testing.assert_array_equal(r[4], _DATA[4])
    np.testing.assert_array_equal(r.sparse_read([7, 0]), _DATA[[7, 0]])
    with pytest.raises(TypeError, match="holds arrays, not variables"):
        r.assign_add(1)


def test_training_step_through_run_on_eight_replicas_matches_numpy() -> None:
    strategy = jd.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    assert n == 8
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(10, 3)).astype(np.float32)
    x = rng.normal(size=(8 * 4, 10)).astype(np.float32)
    y = rng.normal(size=(8 * 4, 3)).astype(np.float32)
    with strategy.scope():
        w = jd.Variable(w0, partitioner=P.FixedShardsPartitioner(4), aggregation="mean")
    assert _rows(w) == [3, 3, 2, 2]
    batches = strategy.experimental_distribute_values_from_function(
        lambda ctx: (
            jnp.asarray(x.reshape(n, 4, 10)[ctx.replica_id_in_sync_group]),
            jnp.asarray(y.reshape(n, 4, 3)[ctx.replica_id_in_sync_group]),
        )
    )

    def step(ctx: jd.ReplicaContext, w: Any, batch: Any) -> Any:
        xb, yb = batch
        grad = jax.grad(lambda m: jnp.mean((xb @ m - yb) ** 2))(w.read_value())
        new = w.assign_sub(0.1 * grad)  # each shard's rows, averaged over replicas
        return new, new[2], w.sparse_read(jnp.array([9, 0]))

    new, row, looked_up = strategy.run(step, args=(w, batches))
    ref_grad = 2.0 * x.T @ (x @ w0 - y) / (x.shape[0] * 3)
    assert isinstance(new, SV) and _rows(new) == [3, 3, 2, 2]
    np.testing.assert_allclose(new.numpy(), w0 - 0.1 * ref_grad, rtol=1e-5, atol=1e-6)
    for shard in new.variables:  # one replicated copy per shard, not per-replica ones
        assert shard.device_values.shape == shard.shape
        assert shard.device_values.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(row), (w0 - 0.1 * ref_grad)[2], rtol=1e-5, atol=1e-6)
    for r in strategy.experimental_local_results(looked_up):
        np.testing.assert_array_equal(r, w0[[9, 0]])
    # The updated variable trains on: a second step through the cached program.
    again, _, _ = strategy.run(step, args=(new, batches))
    w1 = w0 - 0.1 * ref_grad
    ref2 = w1 - 0.1 * 2.0 * x.T @ (x @ w1 - y) / (x.shape[0] * 3)
    np.testing.assert_allclose(again.numpy(), ref2, rtol=1e-5, atol=1e-6)


def test_ctx_assign_and_extended_update_take_sharded_variables() -> None:
    """``ctx.assign*`` and ``extended.update`` of a ShardedVariable (formerly a TypeError)
    update shard by shard, ``ctx.assign*`` aggregated as each shard says, ``update`` not
    aggregated (TF's); NumPy reference, exact (small integers), on eight replicas."""
    strategy = jd.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    start = np.arange(10.0, dtype=np.float32)
    with strategy.scope():
        w = jd.Variable(start, partitioner=P.FixedShardsPartitioner(3), aggregation="mean")
        total = jd.Variable(start, partitioner=P.FixedShardsPartitioner(3), aggregation="sum")

    def step(ctx: jd.ReplicaContext, w: Any, total: Any) -> Any:
        r = ctx.replica_id_in_sync_group.astype(jnp.float32)
        w = ctx.assign_sub(w, jnp.full(10, r))  # MEAN: minus the mean of 0..n-1
        total = ctx.assign_add(total, jnp.full(10, 1.0))  # SUM: plus n
        w = strategy.extended.update(w, lambda v, d: v.assign_add(d), args=(jnp.ones(10),))
        # TF's update does not aggregate, whatever the variable's aggregation (SUM here).
        total = strategy.extended.update(total, lambda v: v.assign_sub(1.0))
        return w, total, len(ctx.updates)

    w2, total2, recorded = strategy.run(step, args=(w, total))
    assert isinstance(w2, SV) and _rows(w2) == [4, 3, 3]
    np.testing.assert_array_equal(w2.numpy(), start - np.mean(np.arange(n)) + 1.0)
    np.testing.assert_array_equal(total2.numpy(), start + n - 1.0)
    assert int(recorded) == 12  # four updates of three shards, as ReplicaContext.updates
    # Cross-replica: every argument of the full shape is cut into the shards' rows.
    w3 = strategy.extended.update(w, lambda v, a, b: v.assign_add(a * b), args=(start, 2.0))
    assert isinstance(w3, SV)
    np.testing.assert_array_equal(w3.numpy(), start + 2.0 * start)
    with pytest.raises(ValueError, match=r"StrategyExtended.update: value of shape \(3,\)"):
        strategy.extended.update(w, lambda v, a: v.assign_add(a), args=(np.ones(3),))


# Checkpoints -------------------------------------------------------------------------


def test_to_saveable_stores_the_full_array() -> None:
    s = _sharded(_DATA, [3, 3, 2])
    saved = jd.checkpoint.to_saveable({"s": s})
    assert isinstance(saved["s"], np.ndarray)
    np.testing.assert_array_equal(saved["s"], _DATA)
    with pytest.raises(
        ValueError, match=r"has shape \(8, 2\) in the checkpoint, but sharded variable"
    ):
        jd.checkpoint.from_saveable(saved, {"s": _sharded(np.zeros((6, 2), np.int64), [3, 3])})


@pytest.mark.parametrize(
    ("before", "after"), [(4, 1), (1, 4), (4, 2), (2, 3), (4, 4), (0, 4), (4, 0)]
)
def test_save_restore_across_shard_counts(tmp_path: Path, before: int, after: int) -> None:
    """TF's 4->1, 1->4 and 4->2 cases, and more; 0 stands for a plain Variable."""

    def make(shards: int, value: np.ndarray) -> Any:
        if shards == 0:
            return jd.Variable(value)
        return _sharded(value, div_rows(len(value), shards))

    full = np.array([0, 1, 2, 3, 4, 5], np.int32)
    jd.checkpoint.save(tmp_path / "ckpt", {"s": make(before, full)})
    got = jd.checkpoint.restore(tmp_path / "ckpt", {"s": make(after, np.zeros(6, np.int32))})["s"]
    if after:
        assert isinstance(got, SV) and _rows(got) == div_rows(6, after)
        for shard, part in zip(
            got.variables, np.split(full, np.cumsum(_rows(got))[:-1]), strict=True
        ):
            np.testing.assert_array_equal(shard.numpy(), part)
    else:
        assert type(got) is jd.Variable
    np.testing.assert_array_equal(np.asarray(got), full)


def test_checkpoint_object_restores_into_another_sharding_and_strategy(tmp_path: Path) -> None:
    s8 = jd.MirroredStrategy()
    with s8.scope():
        emb = jd.Variable(np.arange(20.0).reshape(10, 2), partitioner=P.FixedShardsPartitioner(4))
    ckpt = jd.checkpoint.Checkpoint(emb=emb)
    path = ckpt.save(str(tmp_path / "ckpt"))
    ckpt.emb = emb.assign(np.zeros((10, 2)))  # changed after the save

    ckpt.restore(path)
    assert isinstance(ckpt.emb, SV) and _rows(ckpt.emb) == [3, 3, 2, 2]
    np.testing.assert_array_equal(ckpt.emb.numpy(), np.arange(20.0).reshape(10, 2))

    s2 = jd.MirroredStrategy(jax.devices()[:2])
    with s2.scope():
        other = jd.Variable(np.zeros((10, 2)), partitioner=P.FixedShardsPartitioner(3))
    ckpt2 = jd.checkpoint.Checkpoint(emb=other)
    ckpt2.restore(path)
    assert _rows(ckpt2.emb) == [4, 3, 3]
    np.testing.assert_array_equal(ckpt2.emb.numpy(), np.arange(20.0).reshape(10, 2))
    for shard in ckpt2.emb.variables:
        assert shard.device_values.sharding.device_set == set(jax.devices()[:2])


def test_on_read_sum_shards_save_the_aggregate() -> None:
    strategy = jd.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        counts = jd.Variable(
            np.zeros(6, np.int32),
            partitioner=P.FixedShardsPartitioner(2),
            synchronization="on_read",
            aggregation="sum",
        )

    def step(ctx: jd.ReplicaContext, c: Any) -> Any:
        return c.assign_add(jnp.ones(6, jnp.int32) * (ctx.replica_id_in_sync_group + 1))

    counts = strategy.run(step, args=(counts,))
    total = np.full(6, n * (n + 1) // 2)
    np.testing.assert_array_equal(counts.numpy(), total)
    saved = jd.checkpoint.to_saveable(counts)
    np.testing.assert_array_equal(saved, total)
    restored = jd.checkpoint.from_saveable(saved, jd.Variable(np.zeros(6, np.int32)))
    np.testing.assert_array_equal(restored.numpy(), total)

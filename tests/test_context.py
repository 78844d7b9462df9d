"""ReplicaContext collectives and merge_call against NumPy references (exact or rtol=1e-6),
and the errors of a context misused: kept after its run, running inside merge_call, bad
ppermute pairs."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd

from _helpers import assert_kind, rows, value

REFS = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}


@pytest.mark.parametrize("op", ["sum", "MEAN", "Max", jd.ReduceOp.MIN])
def test_all_reduce_ops_over_pytrees(strategy: jd.Strategy, op) -> None:
    n = strategy.num_replicas_in_sync
    rng = np.random.default_rng(1)
    tree = {"a": rng.normal(size=(n, 3)).astype(np.float32), "b": rng.normal(size=(n,))}
    tree["b"] = tree["b"].astype(np.float32)
    out = strategy.run(
        lambda ctx, t: ctx.all_reduce(op, t), args=(jax.tree.map(jd.PerReplica, tree),)
    )
    name = op.name.lower() if isinstance(op, jd.ReduceOp) else op.lower()
    for k in tree:
        assert_kind(out[k], jd.Mirrored, strategy)
        np.testing.assert_allclose(value(out[k]), REFS[name](tree[k], axis=0), rtol=1e-6)


def test_unknown_reduce_op_raises(mirrored8: jd.MirroredStrategy) -> None:
    with pytest.raises(ValueError, match=r"ReplicaContext.all_reduce: unknown reduce op 'prod'"):
        mirrored8.run(lambda ctx: ctx.all_reduce("prod", 1.0))


def test_all_gather_reduce_scatter_all_to_all(mirrored8: jd.MirroredStrategy) -> None:
    x = np.arange(8 * 8 * 2, dtype=np.float32).reshape(8, 8, 2)  # replica r holds x[r] (8, 2)

    def fn(ctx, v):
        return (
            ctx.all_gather(v, axis=1),
            ctx.reduce_scatter("sum", v, axis=0),
            ctx.reduce_scatter("mean", v, axis=0),
            ctx.all_to_all(v, split_axis=0, concat_axis=0),
        )

    gathered, scattered, scattered_mean, a2a = mirrored8.run(fn, args=(jd.PerReplica(x),))
    ref_gather = np.concatenate(list(x), axis=1)  # (8, 16)
    assert isinstance(gathered, jd.Mirrored)  # every replica holds the same concatenation
    np.testing.assert_allclose(gathered.array, ref_gather)
    for r in range(8):
        np.testing.assert_allclose(scattered.array[r], x.sum(0)[r : r + 1])
        np.testing.assert_allclose(scattered_mean.array[r], x.mean(0)[r : r + 1], rtol=1e-6)
        # replica r receives chunk r of every replica, in replica order
        np.testing.assert_allclose(a2a.array[r], x[:, r, :])


def test_reduce_scatter_errors(mirrored8: jd.MirroredStrategy) -> None:
    with pytest.raises(ValueError, match=r"reduce_scatter: value of shape \(3,\) cannot be split"):
        mirrored8.run(lambda ctx: ctx.reduce_scatter("sum", jnp.ones(3)))
    with pytest.raises(ValueError, match=r"reduce_scatter: reduce op MAX is not supported"):
        mirrored8.run(lambda ctx: ctx.reduce_scatter("max", jnp.ones(8)))


def test_broadcast_and_ppermute(mirrored8: jd.MirroredStrategy) -> None:
    x = np.arange(8, dtype=np.float32) * 10

    def fn(ctx, v):
        shifted = ctx.ppermute(v, [(i, (i + 1) % 8) for i in range(8)])
        return ctx.broadcast(v, source_replica=3), shifted

    b, shifted = mirrored8.run(fn, args=(jd.PerReplica(x),))
    assert isinstance(b, jd.Mirrored)
    np.testing.assert_allclose(b.array, 30.0)
    np.testing.assert_allclose(shifted.array, np.roll(x, 1))
    with pytest.raises(ValueError, match=r"source_replica=8 is outside \[0, 8\)"):
        mirrored8.run(lambda ctx: ctx.broadcast(1.0, source_replica=8))


def test_merge_call_gathers_and_returns_to_each_replica(strategy: jd.Strategy) -> None:
    n = strategy.num_replicas_in_sync
    x = np.arange(1, 2 * n + 1, dtype=np.float32).reshape(n, 2)
    seen = {}

    def merge_fn(s, per_replica, mirrored, scale):
        seen["types"] = (type(per_replica), type(mirrored))
        assert jd.in_cross_replica_context()
        assert jd.get_replica_context() is None
        total = s.reduce("sum", per_replica)
        (reduced_to,) = s.extended.batch_reduce_to("max", [(per_replica, per_replica)])
        gathered = s.gather(per_replica, axis=0)
        return total * scale, reduced_to, gathered, jd.PerReplica(per_replica.array * 2)

    def fn(ctx, v):
        m = ctx.all_reduce("mean", v)
        return ctx.merge_call(merge_fn, args=(v, m), kwargs={"scale": 2.0})

    total, mx, gathered, doubled = strategy.run(fn, args=(jd.PerReplica(x),))
    assert seen["types"] == (jd.PerReplica, jd.Mirrored)
    np.testing.assert_allclose(value(total), 2 * x.sum(0))
    np.testing.assert_allclose(value(mx), x.max(0))
    np.testing.assert_allclose(value(gathered), x.reshape(-1))
    assert_kind(doubled, jd.PerReplica, strategy)  # each replica got its own row back
    np.testing.assert_allclose(rows(doubled, strategy), 2 * x)


def test_default_replica_context_outside_run() -> None:
    ctx = jd.get_replica_context()
    assert ctx is not None and ctx.num_replicas_in_sync == 1
    assert int(ctx.replica_id_in_sync_group) == 0
    assert float(ctx.all_reduce("sum", 2.0)) == 2.0
    assert ctx.merge_call(lambda s, v: v + 1, args=(1.0,)) == 2.0


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


def test_context_used_after_run_is_named(mirrored8: jd.MirroredStrategy) -> None:
    kept = []
    mirrored8.run(lambda ctx: kept.append(ctx))
    with pytest.raises(RuntimeError, match=r"ReplicaContext.all_reduce: this context belongs"):
        kept[0].all_reduce("sum", 1.0)
    with pytest.raises(RuntimeError, match=r"replica_id_in_sync_group: this context belongs"):
        _ = kept[0].replica_id_in_sync_group


def test_run_inside_merge_call_is_explained(mirrored8: jd.MirroredStrategy) -> None:
    def merge_fn(strategy, x):
        return strategy.run(lambda ctx, y: y, args=(x,))

    with pytest.raises(RuntimeError, match=r"run was called inside a merge_fn"):
        mirrored8.run(lambda ctx: ctx.merge_call(merge_fn, args=(1.0,)))


@pytest.mark.parametrize("bound", [True, False], ids=["in_run", "default_context"])
def test_replica_context_collectives_inside_merge_fn_are_refused(
    mirrored8: jd.MirroredStrategy, bound: bool
) -> None:
    """TF: merge_call and the collectives need replica context ("Need to be inside
    call_for_each_replica()"); a merge_fn runs in cross-replica context. They ran."""
    calls = {
        "merge_call": lambda ctx: ctx.merge_call(lambda s: 1.0),
        "all_reduce": lambda ctx: ctx.all_reduce("sum", 1.0),
        "all_gather": lambda ctx: ctx.all_gather(jnp.ones(2), axis=0),
        "broadcast": lambda ctx: ctx.broadcast(1.0),
    }
    for method, call in calls.items():

        def fn(ctx: jd.ReplicaContext, call: Any = call) -> Any:
            return ctx.merge_call(lambda strategy: call(ctx))

        match = rf"ReplicaContext.{method}: called inside a merge_fn, which runs in cross-replica"
        with pytest.raises(RuntimeError, match=match):
            mirrored8.run(fn) if bound else fn(jd.get_replica_context())
    # What merge_fn should use instead works, and the ids still read outside it.
    out = mirrored8.run(
        lambda ctx: ctx.merge_call(
            lambda s, x: s.reduce("sum", x), args=(ctx.replica_id_in_sync_group,)
        )
    )
    np.testing.assert_array_equal(np.asarray(out.array), 28)


def test_bad_ppermute(mirrored8: jd.MirroredStrategy) -> None:
    with pytest.raises(ValueError, match=r"pairs \[\(0, 9\)\] name replicas outside \[0, 8\)"):
        mirrored8.run(lambda ctx: ctx.ppermute(1.0, [(0, 9)]))
    with pytest.raises(ValueError, match=r"replica\(s\) \[1\] appear more than once as a dest"):
        mirrored8.run(lambda ctx: ctx.ppermute(1.0, [(0, 1), (2, 1)]))
    with pytest.raises(TypeError, match=r"list of \(source, destination\) replica pairs"):
        mirrored8.run(lambda ctx: ctx.ppermute(1.0, [0, 1]))

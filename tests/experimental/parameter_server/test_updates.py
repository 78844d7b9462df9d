"""What a scheduled closure's ``ctx.assign*`` amount to (`RecordingUpdates`), checked without
Ray's actors: the recorder runs under an eight-replica `MirroredStrategy` here, as a worker
with eight devices would run it. References: NumPy sums and means over the replicas (exact:
small integers and their means)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd

pytest.importorskip("ray")

from jaxdist.experimental.parameter_server.updates import RecordingUpdates


def test_updates_combine_in_order_and_per_aggregation() -> None:
    strategy = jd.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    assert n == 8
    with strategy.scope():
        w = jd.Variable(jnp.zeros(3), aggregation="mean", name="w")
        s = jd.Variable(10.0, name="s", aggregation="sum")
        counters = {
            agg: jd.Variable(
                0, synchronization="on_read", aggregation=agg, trainable=False, name=agg
            )
            for agg in ("sum", "only_first_replica")
        }
        mean = jd.Variable(
            0.0, synchronization="on_read", aggregation="mean", trainable=False, name="mean"
        )
        untouched = jd.Variable(1.0, name="untouched")

    def step(ctx: Any, w: Any, s: Any, counters: Any, mean: Any, untouched: Any) -> Any:
        r = ctx.replica_id_in_sync_group
        ctx.assign_sub(w, jnp.ones(3) * r)  # MEAN: minus the mean replica id...
        ctx.assign_sub(w, jnp.ones(3))  # ...then minus 1 (on the old value: still counted)
        ctx.assign(s, 2.0)  # SUM: every replica's 2.0 added up
        ctx.assign_add(s, 1.0)  # then every replica's 1.0: 2n + n
        for v in counters.values():
            ctx.assign_add(v, r + 1)
        ctx.assign_add(mean, r.astype(jnp.float32))
        return untouched.read_value()

    out, (sets, adds) = strategy.run(RecordingUpdates(step), args=(w, s, counters, mean, untouched))
    ids = np.arange(n)
    np.testing.assert_array_equal(np.asarray(adds["w"]), -(np.mean(ids) + 1) * np.ones(3))
    assert sorted(sets) == ["s"] and float(np.asarray(sets["s"])) == 3.0 * n
    assert int(np.asarray(adds["sum"])) == np.sum(ids + 1)  # every replica's increment
    assert int(np.asarray(adds["only_first_replica"])) == 1  # replica 0's
    assert float(np.asarray(adds["mean"])) == np.mean(ids)
    assert "untouched" not in adds and float(np.asarray(out)) == 1.0

"""Distributed input in a real job of 2 processes x 4 CPU devices (``jax.distributed`` over
loopback), checked against NumPy sums of the rows each step should see."""

from __future__ import annotations

import numpy as np
import pytest

from _helpers import run_workers, worker_script

_WORKER = worker_script(
    """
    import jax.numpy as jnp
    import numpy as np
    import jaxdist as jd

    me = jax.process_index()
    s = jd.MirroredStrategy(jax.devices())  # 8 replicas over both processes
    x = np.arange(40, dtype=np.float32)

    def masked_sum(ctx, b):
        mask = ctx.valid_mask(b.shape[0])
        return ctx.all_reduce("sum", jnp.sum(jnp.where(mask, b, 0.0)))

    step = s.function(masked_sum)
    sums = lambda ds: [float(step(b).array) for b in ds]
    out = {}
    out["data"] = sums(s.experimental_distribute_dataset(jd.data.from_arrays(x, batch_size=16)))
    off = jd.InputOptions(experimental_auto_shard_policy=jd.experimental.AutoShardPolicy.OFF)
    mine = jd.data.from_arrays(x[me * 20 : (me + 1) * 20], batch_size=8)
    off_batches = list(s.experimental_distribute_dataset(mine, off))
    out["off"] = sums(off_batches)
    out["off_valid_replicated"] = [b.valid.sharding.is_fully_replicated for b in off_batches]
    contexts = []

    def dataset_fn(ctx):
        contexts.append([ctx.num_input_pipelines, ctx.input_pipeline_id])
        rows = x[ctx.input_pipeline_id :: ctx.num_input_pipelines]
        return jd.data.from_arrays(rows, batch_size=ctx.get_per_replica_batch_size(8))

    out["fn"] = sums(s.distribute_datasets_from_function(dataset_fn))
    per_replica = jd.InputOptions(
        experimental_replication_mode=jd.InputReplicationMode.PER_REPLICA
    )
    out["per_replica"] = sums(s.distribute_datasets_from_function(dataset_fn, per_replica))
    out["contexts"] = contexts

    def gen():
        for i in range(3):
            yield x[i * 16 : (i + 1) * 16]

    out["generator"] = sums(s.experimental_distribute_dataset(gen()))
    partial = next(iter(s.experimental_distribute_dataset([x[:12]])))
    out["partial_mean"] = float(s.reduce("mean", partial, axis=0))
    print(json.dumps(out), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_processes_feed_their_own_replicas() -> None:
    results = run_workers(_WORKER)
    x = np.arange(40, dtype=np.float32)
    for me, r in enumerate(results):
        # DATA: every process reads each global batch and keeps its replicas' rows.
        assert r["data"] == [x[:16].sum(), x[16:32].sum(), x[32:].sum()]
        # OFF: the global batch is the processes' batches side by side (the last one
        # partial on both: each process knows only its own replicas' valid counts).
        a, b = x[:20], x[20:]
        assert r["off"] == [a[i : i + 8].sum() + b[i : i + 8].sum() for i in (0, 8, 16)]
        # Split by replica on every step, full or not: one compiled step, and no process
        # claims counts for the other's replicas.
        assert r["off_valid_replicated"] == [False, False, False]
        # PER_WORKER: one pipeline per process, with its id; 4 rows per process per step.
        assert r["contexts"][0] == [2, me]
        evens, odds = x[0::2], x[1::2]
        assert r["fn"] == [evens[i : i + 4].sum() + odds[i : i + 4].sum() for i in range(0, 20, 4)]
        # PER_REPLICA: one pipeline per replica of this process (ids 4 me .. 4 me + 3).
        assert r["contexts"][1:] == [[8, 4 * me + k] for k in range(4)]
        shards = [x[k::8] for k in range(8)]
        assert r["per_replica"] == [sum(s[i] for s in shards) for i in range(5)]
        assert r["generator"] == [x[:16].sum(), x[16:32].sum(), x[32:48].sum()]
        assert r["partial_mean"] == x[:12].mean()

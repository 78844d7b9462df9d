"""Which rows each process feeds in a job of several processes, simulated in one process.

`replica_layout` takes a device-to-process map, so a single process can play process
``p`` of a 2 x 4 job: these tests check the row selection, the valid counts and the
`InputContext` each pipeline gets against NumPy slicing of the global batch. (The
transfers themselves, `jax.make_array_from_process_local_data`, need real processes.)
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import jaxdist as jd
from jaxdist.input import batching, distribute


def _layout(strategy: jd.Strategy, me: int, owner: str = "blocks") -> batching.Layout:
    def process_of(d: jax.Device) -> int:  # 2 processes of 4 devices
        return d.id // 4 if owner == "blocks" else d.id % 2

    return batching.replica_layout(strategy, process_index=me, process_of=process_of)


def _batcher(strategy: jd.Strategy, layout: batching.Layout, **options) -> batching.Batcher:
    opts = jd.InputOptions(**options)
    return batching.Batcher(strategy, opts, "test", layout)


def test_layouts(mirrored8: jd.MirroredStrategy) -> None:
    assert batching.replica_layout(mirrored8) == batching.Layout(8, tuple(range(8)), 1, 0)
    assert _layout(mirrored8, 1) == batching.Layout(8, (4, 5, 6, 7), 2, 1)
    assert _layout(mirrored8, 0, "interleaved") == batching.Layout(8, (0, 2, 4, 6), 2, 0)
    assert _layout(mirrored8, 1).multi_process
    # A replica axis made of two mesh axes, ("host", "local"), as MultiWorkerMirroredStrategy
    # lays out processes: replica r is row-major position r.
    grid = jd.Strategy(jax.devices(), mesh_shape=(2, 4), axis_names=("host", "local"))
    assert _layout(grid, 1) == batching.Layout(8, (4, 5, 6, 7), 2, 1)
    assert _layout(grid, 1, "interleaved") == batching.Layout(8, (1, 3, 5, 7), 2, 1)
    # A strategy over one process's devices is a single-process one, whatever the job.
    local = jd.MirroredStrategy(jax.devices()[4:])
    assert _layout(local, 1) == batching.Layout(4, (0, 1, 2, 3), 1, 0)
    assert not _layout(local, 1).multi_process
    with pytest.raises(
        ValueError,
        match=r"MirroredStrategy: process 0 owns none of the strategy's devices \(they belong "
        r"to processes \[1\]\), so it has no replicas to feed",
    ):
        _layout(local, 0)


@pytest.mark.parametrize(("me", "owner"), [(0, "blocks"), (1, "blocks"), (1, "interleaved")])
def test_data_policy_keeps_this_process_rows(
    mirrored8: jd.MirroredStrategy, me: int, owner: str
) -> None:
    layout = _layout(mirrored8, me, owner)
    local = list(layout.local)
    b = _batcher(mirrored8, layout)
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)  # 2 rows per replica
    leaves, counts = b.from_global({"x": x, "y": -x[:, 0]})
    np.testing.assert_array_equal(leaves[0], x.reshape(8, 2, 3)[local])
    np.testing.assert_array_equal(leaves[1], -x[:, 0].reshape(8, 2)[local])
    np.testing.assert_array_equal(counts, np.full(8, 2))  # every replica's: replicated
    if owner == "blocks":  # a contiguous block of replicas: a view, no copy
        assert np.shares_memory(leaves[0], x)
    # A last partial batch of 7 rows: tf.distribute's split, ceil(7/8) = 1 row per replica.
    part = x[:7]
    leaves, counts = b.from_global({"x": part, "y": -part[:, 0]})
    np.testing.assert_array_equal(counts, [1, 1, 1, 1, 1, 1, 1, 0])
    expected = np.zeros((8, 2, 3), np.float32)
    expected[:7, 0] = part
    np.testing.assert_array_equal(leaves[0], expected[local])


@pytest.mark.parametrize("me", [0, 1])
def test_off_policy_splits_this_process_batch_and_counts_only_its_replicas(
    mirrored8: jd.MirroredStrategy, me: int
) -> None:
    layout = _layout(mirrored8, me)
    off = jd.experimental.AutoShardPolicy.OFF
    b = _batcher(mirrored8, layout, experimental_auto_shard_policy=off)
    x = np.arange(8 * 2, dtype=np.float32).reshape(8, 2) + 100 * me  # this process's batch
    leaves, counts = b.from_global(x)
    np.testing.assert_array_equal(leaves[0], x.reshape(4, 2, 2))
    # Only this process's 4 replicas' counts are known here, full batch or not: the valid
    # counts are split by replica, never claimed for the other process's replicas.
    np.testing.assert_array_equal(counts, [2, 2, 2, 2])
    leaves, counts = b.from_global(x[:3])
    np.testing.assert_array_equal(counts, [1, 1, 1, 0])
    np.testing.assert_array_equal(leaves[0][:, 0], np.concatenate([x[:3], np.zeros((1, 2))]))
    # An uneven batch is this process's share, split over its own replicas.
    uneven = _batcher(mirrored8, layout, experimental_auto_shard_policy=off)
    for _ in range(2):
        uneven.from_global(x[:6])
    assert uneven.pending == [
        "test: this process's batch size 6 is not divisible by the 4 replicas, so every step "
        "pads each replica to 2 rows (2 padding rows per step, masked out of reductions but "
        "still computed). Use a batch size that is a multiple of 4, for example 4 or 8."
    ]


def test_per_replica_batches_count_local_replicas(mirrored8: jd.MirroredStrategy) -> None:
    layout = _layout(mirrored8, 1)
    b = _batcher(mirrored8, layout)
    elements = [np.full((2,), r, np.float32) for r in layout.local]
    leaves, counts = b.from_per_replica(elements)
    np.testing.assert_array_equal(leaves[0], np.repeat(np.arange(4, 8.0)[:, None], 2, axis=1))
    np.testing.assert_array_equal(counts, [2, 2, 2, 2])
    leaves, counts = b.from_per_replica([elements[0], elements[1][:1], None, None])
    np.testing.assert_array_equal(counts, [2, 1, 0, 0])
    np.testing.assert_array_equal(leaves[0], [[4, 4], [5, 0], [0, 0], [0, 0]])


def test_input_contexts_of_a_simulated_process(
    mirrored8: jd.MirroredStrategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        distribute, "replica_layout", functools.partial(_layout, me=1, owner="interleaved")
    )
    seen: list[jd.InputContext] = []

    def dataset_fn(ctx: jd.InputContext) -> list[np.ndarray]:
        seen.append(ctx)
        return [np.zeros(ctx.get_per_replica_batch_size(16))]

    mirrored8.distribute_datasets_from_function(dataset_fn)  # dataset_fn runs right away
    assert seen == [jd.InputContext(2, 1, 8)]  # one pipeline per process
    seen.clear()
    opts = jd.InputOptions(experimental_replication_mode=jd.InputReplicationMode.PER_REPLICA)
    mirrored8.distribute_datasets_from_function(dataset_fn, opts)
    assert seen == [jd.InputContext(8, r, 8) for r in (1, 3, 5, 7)]  # this process's replicas
    host = jd.InputOptions(experimental_fetch_to_device=False)
    with pytest.raises(
        ValueError,
        match=r"InputOptions\(experimental_fetch_to_device=False\) yields host NumPy batches, "
        r"which cannot hold the replicas of the 2 processes this strategy spans",
    ):
        mirrored8.experimental_distribute_dataset([np.zeros(8)], host)

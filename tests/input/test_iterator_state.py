"""Iterator positions: a stopped stream resumed from `get_state` equals the uninterrupted one,
bit for bit, and the rows are NumPy's permutation of the data."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import pytest

import jaxdist as jd

from _helpers import run_workers, worker_script

ROWS, BATCH, SEED, EPOCHS = 100, 24, 7, 3  # 5 batches an epoch, the last of 4 rows


def _features() -> np.ndarray:
    return np.arange(ROWS * 3, dtype=np.float32).reshape(ROWS, 3)


def _source() -> jd.data.ArrayDataset:
    x = _features()
    return jd.data.from_arrays(
        {"x": x, "i": np.arange(ROWS, dtype=np.int32)}, batch_size=BATCH, shuffle=True, seed=SEED
    )


def _host(batch: Any) -> list[np.ndarray]:
    """A distributed batch as host arrays (every leaf's rows and its valid counts)."""
    leaves = jax.tree.leaves(batch, is_leaf=lambda x: isinstance(x, jd.PerReplica))
    return [a for p in leaves for a in (np.asarray(p.array), np.asarray(p.valid))]


def _same(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x, y, strict=True):
            assert u.dtype == v.dtype and u.shape == v.shape
            np.testing.assert_array_equal(u, v)  # bitwise: no tolerance


def _stream(make: Callable[[], jd.DistributedDataset], epochs: int) -> list[list[np.ndarray]]:
    ds = make()
    return [_host(b) for _ in range(epochs) for b in ds]


def _resumed(
    make: Callable[[], jd.DistributedDataset], epochs: int, stop_epoch: int, stop_batch: int
) -> tuple[list[list[np.ndarray]], dict]:
    """Batches of a run stopped after ``stop_batch`` batches of epoch ``stop_epoch`` and
    resumed from its state (through JSON) with a new dataset over a new source."""
    ds = make()
    seen = []
    for _ in range(stop_epoch):
        seen += [_host(b) for b in ds]
    it = iter(ds)
    seen += [_host(next(it)) for _ in range(stop_batch)]
    state = json.loads(json.dumps(it.get_state()))
    it.close()
    again = make()
    it = iter(again)
    it.set_state(state)
    seen += [_host(b) for b in it]
    for _ in range(stop_epoch + 1, epochs):
        seen += [_host(b) for b in again]
    return seen, state


def _reference(epoch: int) -> list[np.ndarray]:
    """NumPy's order of the rows in epoch ``epoch`` of `_source` (what the replicas see)."""
    order = np.random.default_rng((SEED, epoch)).permutation(ROWS)
    return [order[i : i + BATCH] for i in range(0, ROWS, BATCH)]


@pytest.mark.parametrize(
    ("stop_epoch", "stop_batch"),
    [(0, 0), (0, 2), (1, 4), (1, 5), (2, 3)],
    ids=["first-batch", "mid-epoch", "before-the-partial-batch", "epoch-end", "last-epoch"],
)
def test_resume_equals_the_uninterrupted_stream(
    mirrored8: jd.MirroredStrategy, stop_epoch: int, stop_batch: int
) -> None:
    opts = jd.InputOptions(experimental_per_replica_buffer_size=3)  # prefetched, not counted

    def make() -> jd.DistributedDataset:
        return mirrored8.experimental_distribute_dataset(_source(), opts)

    full = _stream(make, EPOCHS)
    got, state = _resumed(make, EPOCHS, stop_epoch, stop_batch)
    _same(got, full)
    assert state["epoch"] == stop_epoch + 1 and state["batches"] == stop_batch
    assert state["source_epochs"] == [stop_epoch]
    # The stream itself is NumPy's permutation of the rows, split 3 per replica, padded last.
    for epoch in range(EPOCHS):
        for k, rows in enumerate(_reference(epoch)):
            i, valid, x, _ = full[epoch * 5 + k]  # the leaves in key order: "i", "x"
            flat = np.concatenate([i[r, : valid[r]] for r in range(8)])
            np.testing.assert_array_equal(flat, rows)
            np.testing.assert_array_equal(
                np.concatenate([x[r, : valid[r]] for r in range(8)]), _features()[rows]
            )
    assert got[4][1].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]  # the partial batch, padded to 3


def test_prefetched_and_peeked_batches_are_not_counted(mirrored8: jd.MirroredStrategy) -> None:
    opts = jd.InputOptions(experimental_per_replica_buffer_size=4)
    ds = mirrored8.experimental_distribute_dataset(_source(), opts)
    it = iter(ds)
    _ = it.element_spec  # reads (and keeps) the first batch
    assert it.get_state()["batches"] == 0
    first = _host(next(it))
    assert it.get_state()["batches"] == 1
    again = iter(mirrored8.experimental_distribute_dataset(_source(), opts))
    state = it.get_state()
    state["batches"] = 0  # back to the epoch's start: the same first batch again
    again.set_state(state)
    _same([_host(next(again))], [first])


def test_set_state_on_a_used_iterator_moves_it_back_and_forth(
    mirrored8: jd.MirroredStrategy,
) -> None:
    ds = mirrored8.experimental_distribute_dataset(_source())
    it = iter(ds)
    batches = [_host(b) for b in it]
    state = it.get_state()
    assert state["batches"] == 5
    it2 = iter(ds)  # epoch 2 of the same dataset, moved back into epoch 1
    next(it2)
    state["batches"] = 2
    it2.set_state(state)
    _same([_host(b) for b in it2], batches[2:])


@pytest.mark.parametrize("kind", ["list", "tuple"])
def test_lists_and_tuples_seek(mirrored8: jd.MirroredStrategy, kind: str) -> None:
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(16, 2)).astype(np.float32)} for _ in range(6)]
    source = batches if kind == "list" else tuple(batches)
    full = _stream(lambda: mirrored8.experimental_distribute_dataset(source), 2)
    got, state = _resumed(lambda: mirrored8.experimental_distribute_dataset(source), 2, 0, 4)
    _same(got, full)
    assert state["source_epochs"] == [None]
    for k, b in enumerate(batches):
        np.testing.assert_array_equal(full[k][0].reshape(16, 2), b["x"])


def _batches() -> Iterator[np.ndarray]:
    for k in range(5):
        yield np.full((16, 2), float(k), np.float32)


def test_generators_drop_the_batches_before_the_position(
    mirrored8: jd.MirroredStrategy,
) -> None:
    full = _stream(lambda: mirrored8.experimental_distribute_dataset(_batches()), 1)
    it = iter(mirrored8.experimental_distribute_dataset(_batches()))
    seen = [_host(next(it)) for _ in range(2)]
    state = it.get_state()
    again = iter(mirrored8.experimental_distribute_dataset(_batches()))
    with pytest.warns(
        UserWarning,
        match=r"set_state: the dataset's source \(generator\) cannot seek, so the 2 batches "
        r"before the saved position are read and dropped",
    ):
        again.set_state(state)
    _same(seen + [_host(b) for b in again], full)
    # A generator cannot go back.
    with pytest.raises(
        ValueError,
        match=r"set_state: the state is at batch 2 of its epoch, but this iterator has returned "
        r"5 batches of a source that can be iterated only once",
    ):
        again.set_state(state)


def test_from_generator_drops_and_restarts(mirrored8: jd.MirroredStrategy) -> None:
    ds = jd.data.from_generator(_batches)
    full = _stream(lambda: mirrored8.experimental_distribute_dataset(ds), 2)
    with pytest.warns(UserWarning, match=r"\(GeneratorDataset\) cannot seek, so the 3 batches"):
        got, _ = _resumed(lambda: mirrored8.experimental_distribute_dataset(ds), 2, 0, 3)
    _same(got, full)
    it = iter(mirrored8.experimental_distribute_dataset(ds))
    tail = [_host(b) for b in it]
    state = it.get_state()
    state["batches"] = 1
    with pytest.warns(UserWarning, match=r"the 1 batches before"):  # rewinds: a new generator
        it.set_state(state)
    _same([_host(b) for b in it], tail[1:])


@pytest.mark.parametrize("mode", ["per_worker", "per_replica"])
def test_datasets_from_function_resume(mirrored8: jd.MirroredStrategy, mode: str) -> None:
    options = jd.InputOptions(
        experimental_replication_mode=jd.InputReplicationMode.PER_REPLICA
        if mode == "per_replica"
        else jd.InputReplicationMode.PER_WORKER
    )

    def make() -> jd.DistributedDataset:
        def dataset_fn(ctx: jd.InputContext) -> jd.data.ArrayDataset:
            x = np.arange(60, dtype=np.float32) + 1000 * ctx.input_pipeline_id
            return jd.data.from_arrays(x, batch_size=2, shuffle=True, seed=ctx.input_pipeline_id)

        return mirrored8.distribute_datasets_from_function(dataset_fn, options)

    full = _stream(make, 3)
    got, state = _resumed(make, 3, 1, 2)
    _same(got, full)
    assert len(state["source_epochs"]) == (8 if mode == "per_replica" else 1)
    assert state["rows_per_replica"] == 2
    # per worker: 60 rows in batches of 2 -> 30 per-replica batches, 4 steps of 8 (the last of 6)
    assert len(full) == 3 * (4 if mode == "per_worker" else 30)


def test_bad_states_are_refused(mirrored8: jd.MirroredStrategy) -> None:
    it = iter(mirrored8.experimental_distribute_dataset(_source()))
    state = it.get_state()
    with pytest.raises(ValueError, match=r"set_state: expected a state returned by "):
        it.set_state({"epoch": 1})
    with pytest.raises(
        ValueError,
        match=r"set_state: the state was saved by process 1 of 2, but this is process 0 of 1. "
        r"Each process restores its own",
    ):
        it.set_state({**state, "process_index": 1, "num_processes": 2})
    with pytest.raises(ValueError, match=r"state\['batches'\] must be a non-negative int"):
        it.set_state({**state, "batches": -1})
    with pytest.raises(
        ValueError, match=r"state\['source_epochs'\] is \[0, 0\], but this dataset reads 1"
    ):
        it.set_state({**state, "source_epochs": [0, 0]})


_WORKER = worker_script(
    """
    import numpy as np
    import jaxdist as jd

    me = jax.process_index()
    s = jd.MultiWorkerMirroredStrategy()

    def make():
        def dataset_fn(ctx):  # uneven pipelines: 40 and 28 rows, shuffled each epoch
            rows = 40 if ctx.input_pipeline_id == 0 else 28
            x = np.arange(rows, dtype=np.float32) + 100 * ctx.input_pipeline_id
            return jd.data.from_arrays(x, batch_size=3, shuffle=True, seed=5)
        return s.distribute_datasets_from_function(dataset_fn)

    def local(b):
        return [np.asarray(r).tolist() for r in s.experimental_local_results(b)]

    reference = make()
    full = [local(b) for _ in range(2) for b in reference]
    ds = make()
    seen = [local(b) for b in ds]
    it = iter(ds)
    seen += [local(next(it)) for _ in range(2)]
    state = json.loads(json.dumps(it.get_state()))
    it.close()
    again = make()
    it = iter(again)
    it.set_state(state)
    seen += [local(b) for b in it]
    print(json.dumps({"full": full, "seen": seen, "state": state}), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_processes_resume_their_own_positions() -> None:
    results = run_workers(_WORKER)
    for me, r in enumerate(results):
        assert r["seen"] == r["full"]  # exact floats (JSON keeps float32 values exactly)
        assert r["state"]["process_index"] == me and r["state"]["batches"] == 2
        assert r["state"]["epoch"] == 2 and r["state"]["source_epochs"] == [1]
    # the pipelines differ, and the shorter one pads while the longer still has batches
    assert results[0]["full"] != results[1]["full"]
    assert len(results[0]["full"]) == len(results[1]["full"]) == 2 * 4

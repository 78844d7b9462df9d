"""A distributed iterator feeding ``steps_per_execution`` groups: full batches placed a group
at a time (one host stack, one transfer per leaf), checked against the dataset's own rows
in NumPy (exact) and against single steps (rtol 1e-6 / atol 1e-7: the same programs, XLA
may fuse the scanned step differently)."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

import jaxdist as jd
from jaxdist.input.batching import Batcher
from jaxdist.input.group import PlacedGroup
from jaxdist.training.step.grouped import plan_runs

from _helpers import mse_step, regression_data, small_nnx_model

BATCH = 16
ROWS = 88  # 5 full batches of 16 and a partial one of 8
SAME = {"rtol": 1e-6, "atol": 1e-7}


def _data(rows: int = ROWS) -> tuple[np.ndarray, np.ndarray]:
    return regression_data(rows, 6, 3)


def _global_rows(piece: object, count: int, strategy: jd.Strategy) -> list[np.ndarray]:
    """The x rows of each batch in a piece `_next_group` returned, padding dropped."""
    if type(piece) is PlacedGroup:
        x = np.asarray(piece.tree[0].array)  # (N, count, b, 6)
        assert x.shape[1] == count
        return [x[:, j].reshape(-1, 6) for j in range(count)]
    return [np.asarray(strategy.gather(piece[0], axis=0))]


def _train(strategy: jd.Strategy, dataset: object, k: int) -> tuple[list[np.ndarray], Any]:
    """Losses of every step and the model, trained one epoch by the grouped tests' step."""
    model, opt = small_nnx_model(strategy)
    step = mse_step(strategy, steps_per_execution=k, stack_outputs=True)
    it = iter(dataset)  # type: ignore[call-overload]
    losses: list[np.ndarray] = []
    if k == 1:
        return [np.asarray(step(model, opt, batch)) for batch in it], model
    while True:
        try:
            out = step(model, opt, it)
        except StopIteration:
            return losses, model
        losses.extend(np.atleast_1d(np.asarray(out)))


def test_a_grouped_call_places_each_group_of_full_batches_once(monkeypatch) -> None:
    strategy = jd.MirroredStrategy()
    calls = {"place": 0, "place_group": 0}
    for name in calls:
        original = getattr(Batcher, name)

        def counted(self, *a, _original=original, _name=name):
            calls[_name] += 1
            return _original(self, *a)

        monkeypatch.setattr(Batcher, name, counted)
    ds = strategy.experimental_distribute_dataset(jd.data.from_arrays(*_data(), batch_size=BATCH))
    grouped, model = _train(strategy, ds, 4)
    # Groups: 4 full batches, then 1 full batch (ended by the padded one), placed as
    # groups; the padded last batch alone.
    assert calls == {"place": 1, "place_group": 2}
    monkeypatch.undo()
    single, reference = _train(strategy, ds, 1)
    np.testing.assert_allclose(np.stack(grouped), np.stack(single), **SAME)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **SAME),
        nnx.state(model, nnx.Param),
        nnx.state(reference, nnx.Param),
    )


@pytest.mark.parametrize("source", ["from_arrays", "generator", "per_replica"])
def test_groups_hold_the_datasets_rows_in_order(source: str) -> None:
    strategy = jd.MirroredStrategy()
    x, y = _data()
    if source == "per_replica":  # each replica's in-memory batches (placed row by row)
        b = BATCH // strategy.num_replicas_in_sync

        def fn(ctx: jd.InputContext):
            r = ctx.input_pipeline_id
            return [
                (
                    x[i * BATCH + r * b : i * BATCH + (r + 1) * b],
                    y[i * BATCH + r * b : i * BATCH + (r + 1) * b],
                )
                for i in range(5)
            ]

        ds = strategy.distribute_datasets_from_function(
            fn, jd.InputOptions(experimental_replication_mode=jd.InputReplicationMode.PER_REPLICA)
        )
        expected = [x[i * BATCH : (i + 1) * BATCH] for i in range(5)]
    else:
        batches = jd.data.from_arrays(x, y, batch_size=BATCH)
        if source == "generator":
            batches = _from_generator(x, y)
        ds = strategy.experimental_distribute_dataset(batches)
        expected = [x[i : i + BATCH] for i in range(0, ROWS, BATCH)]
    it = iter(ds)
    got: list[np.ndarray] = []
    groups = 0
    while True:
        pieces = it.next_group(3)
        if not pieces:
            break
        assert sum(c for _, c in pieces) <= 3
        for piece, count in pieces:
            groups += type(piece) is PlacedGroup and count > 1
            got.extend(_global_rows(piece, count, strategy))
    assert groups >= 1  # the full batches came placed together
    assert len(got) == len(expected)
    for a, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, e)


def test_next_element_spec_and_state_mix_with_grouped_calls() -> None:
    strategy = jd.MirroredStrategy()
    x, y = _data()
    ds = strategy.experimental_distribute_dataset(jd.data.from_arrays(x, y, batch_size=BATCH))
    it = iter(ds)
    spec = it.element_spec  # peeks batch 0
    assert spec[0].array.shape == (8, 2, 6)
    # Batch 0 (peeked) and batch 1 (read ahead then) were placed alone; batch 2 is split
    # off the first group of 3.
    pieces = it.next_group(3)
    assert [c for _, c in pieces] == [1, 1, 1]
    assert type(pieces[2][0]) is PlacedGroup
    rows = [r for p, c in pieces for r in _global_rows(p, c, strategy)]
    one = next(it)  # batch 3: split off the rest of that group, as a plain batch
    assert one[0].array.shape == (8, 2, 6)
    rows.append(np.asarray(strategy.gather(one[0], axis=0)))
    for i, r in enumerate(rows):
        np.testing.assert_array_equal(r, x[i * BATCH : (i + 1) * BATCH])
    state = it.get_state()
    assert state["batches"] == 4
    again = iter(ds)
    again.set_state(state)
    rest = [np.asarray(strategy.gather(b[0], axis=0)) for b in again]
    np.testing.assert_array_equal(np.concatenate(rest), x[4 * BATCH :])


def _from_generator(x: np.ndarray, y: np.ndarray) -> Any:
    """The batches of ``from_arrays`` through a generator (read by the prefetch thread)."""
    return jd.data.from_generator(lambda: iter(list(jd.data.from_arrays(x, y, batch_size=BATCH))))


def test_set_state_drops_batches_grouped_ahead() -> None:
    strategy = jd.MirroredStrategy()
    x, y = _data()

    def dataset():
        return strategy.experimental_distribute_dataset(_from_generator(x, y))

    saver = iter(dataset())
    for _ in range(3):
        next(saver)
    state = saver.get_state()
    it = iter(dataset())
    assert [c for _, c in it.next_group(2)] == [2]  # and a group of 2 is read ahead
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a generator cannot seek
        it.set_state(state)
    rest = [np.asarray(strategy.gather(b[0], axis=0)) for b in it]
    np.testing.assert_array_equal(np.concatenate(rest), x[3 * BATCH :])


def test_a_failure_after_some_batches_is_raised_by_the_next_call() -> None:
    strategy = jd.MirroredStrategy()
    x, y = _data()

    def broken():
        for i in range(3):
            yield x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]
        raise OSError("the disk is gone")

    it = iter(strategy.experimental_distribute_dataset(jd.data.from_generator(broken)))
    pieces = it.next_group(8)
    assert sum(c for _, c in pieces) == 3
    with pytest.raises(OSError, match="the disk is gone"):
        it.next_group(8)


def test_host_batches_are_never_grouped() -> None:
    strategy = jd.MirroredStrategy()
    ds = strategy.experimental_distribute_dataset(
        jd.data.from_arrays(*_data(), batch_size=BATCH),
        jd.InputOptions(experimental_fetch_to_device=False),
    )
    pieces = iter(ds).next_group(4)
    assert [c for _, c in pieces] == [1, 1, 1, 1]
    assert all(isinstance(p[0].array, np.ndarray) for p, _ in pieces)


def test_runs_are_cut_by_the_batches_alone() -> None:
    """Batches placed alone before the first grouped call (how many depends on the prefetch
    thread's timing) join the group after them, so every process of a job runs the same
    programs; a padded batch runs alone."""
    strategy = jd.MirroredStrategy()
    x, y = _data()
    ds = strategy.experimental_distribute_dataset(
        jd.data.from_arrays(x, y, batch_size=BATCH),
        jd.InputOptions(experimental_per_replica_buffer_size=0),
    )
    it = iter(ds)
    _ = it.element_spec  # batch 0 placed alone (nothing read ahead with buffer 0)
    pieces = it.next_group(3)
    assert [count for _, count in pieces] == [1, 2]  # then 2 split off a group of 3
    it = iter(ds)
    _ = it.element_spec
    planned = plan_runs(it, 3)
    assert [steps for _, steps in planned] == [3]
    stacked = np.asarray(planned[0][0].tree[0].array)  # (N, 3, b, 6)
    for j in range(3):
        np.testing.assert_array_equal(stacked[:, j].reshape(-1, 6), x[j * BATCH : (j + 1) * BATCH])
    planned = plan_runs(it, 3)  # batches 3 and 4 (full), 5 (padded)
    assert [steps for _, steps in planned] == [2, 1]
    assert plan_runs(it, 3) == []

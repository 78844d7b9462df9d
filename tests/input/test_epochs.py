"""Epochs of distributed datasets: a warning for uneven global batches, ``dataset_fn``
called once, one-shot sources refused on a second epoch, `jd.data.from_generator`.

References are NumPy arrays; the data are small integers stored as float32, so every
comparison is exact.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd


def _rows(strategy: jd.Strategy, batches: list) -> np.ndarray:
    """Every data row of a list of distributed batches, in order, padding left out."""
    return np.concatenate([np.concatenate(strategy.experimental_local_results(b)) for b in batches])


# A global batch that does not split evenly ---------------------------------------------


def test_uneven_global_batch_warns_once_per_dataset(mirrored8: jd.MirroredStrategy) -> None:
    x = np.arange(36, dtype=np.float32)  # batches of 12, 12, 12 on 8 replicas
    ds = mirrored8.experimental_distribute_dataset(jd.data.from_arrays(x, batch_size=12))
    with pytest.warns(UserWarning) as record:
        first = list(ds)
    assert len(record) == 1
    message = str(record[0].message)
    assert message == (
        "MirroredStrategy.experimental_distribute_dataset: the global batch size 12 is not "
        "divisible by the 8 replicas, so every step pads each replica to 2 rows (4 padding "
        "rows per step, masked out of reductions but still computed). Use a global batch "
        "size that is a multiple of 8, for example 8 or 16."
    )
    assert record[0].filename == __file__  # points at the loop that iterates
    np.testing.assert_array_equal(_rows(mirrored8, first), x)  # nothing lost to padding
    # Once per dataset: warnings are errors in this suite, so another would raise here.
    np.testing.assert_array_equal(_rows(mirrored8, list(ds)), x)
    # A new dataset warns again, and the fix names the nearest multiples.
    with pytest.warns(
        UserWarning,
        match=r"batch size 5 is not divisible by the 2 replicas.*"
        r"pads each replica to 3 rows \(1 padding rows per step.*for example 4 "
        r"or 6\.$",
    ):
        list(
            jd.MirroredStrategy(jax.devices()[:2]).experimental_distribute_dataset(
                jd.data.from_arrays(x[:10], batch_size=5)
            )
        )
    with pytest.warns(
        UserWarning,
        match=r"batch size 3 is not divisible by the 8 replicas.*"
        r"for example 8\.$",
    ):
        list(mirrored8.experimental_distribute_dataset([x[:3], x[3:6]]))


def test_no_warning_when_only_the_last_batch_is_uneven(mirrored8: jd.MirroredStrategy) -> None:
    x = np.arange(21, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # A last partial batch is padded once, not on every step.
        batches = list(
            mirrored8.experimental_distribute_dataset(jd.data.from_arrays(x, batch_size=8))
        )
        np.testing.assert_array_equal(_rows(mirrored8, batches), x)
        # One batch only: it is the last one.
        one = list(mirrored8.experimental_distribute_dataset([x[:3]]))
        np.testing.assert_array_equal(_rows(mirrored8, one), x[:3])
        # Per-replica batches (dataset_fn) are never split.
        per = mirrored8.distribute_datasets_from_function(
            lambda ctx: jd.data.from_arrays(x[:12], batch_size=3)
        )
        assert len(list(per)) == 1


def test_uneven_warning_from_a_generator_in_the_consumer_thread(
    mirrored8: jd.MirroredStrategy,
) -> None:
    def batches():
        for i in range(4):
            yield np.full((10,), i, np.float32)

    ds = mirrored8.experimental_distribute_dataset(jd.data.from_generator(batches))
    with pytest.warns(UserWarning, match=r"the global batch size 10 is not divisible by the 8"):
        got = list(ds)  # the thread found it; the warning is raised here, not lost
    assert [float(mirrored8.reduce("sum", b, axis=0)) for b in got] == [0.0, 10.0, 20.0, 30.0]
    assert len(list(ds)) == 4  # second epoch: no second warning


# distribute_datasets_from_function ------------------------------------------------------


def test_dataset_fn_runs_once_and_each_epoch_reshuffles(mirrored8: jd.MirroredStrategy) -> None:
    x = np.arange(64, dtype=np.float32)
    calls: list[jd.InputContext] = []

    def dataset_fn(ctx: jd.InputContext) -> jd.data.ArrayDataset:
        calls.append(ctx)
        bs = ctx.get_per_replica_batch_size(16)
        return jd.data.from_arrays(x, batch_size=bs, shuffle=True, seed=1)

    ds = mirrored8.distribute_datasets_from_function(dataset_fn)
    assert calls == [jd.InputContext(1, 0, 8)]  # at distribute time, as in TF
    epochs = [_rows(mirrored8, list(ds)) for _ in range(3)]
    assert calls == [jd.InputContext(1, 0, 8)]  # not again per epoch
    for rows in epochs:
        np.testing.assert_array_equal(np.sort(rows), x)  # every row once per epoch
    assert not np.array_equal(epochs[0], epochs[1])  # a new order each epoch
    assert not np.array_equal(epochs[1], epochs[2])
    # The order is the one the dataset would give on its own, epoch after epoch.
    reference = jd.data.from_arrays(x, batch_size=2, shuffle=True, seed=1)
    for rows in epochs:
        np.testing.assert_array_equal(rows, np.concatenate(list(reference)))


def test_dataset_fn_once_per_replica_pipeline(mirrored8: jd.MirroredStrategy) -> None:
    calls = []

    def dataset_fn(ctx: jd.InputContext) -> list[np.ndarray]:
        calls.append(ctx.input_pipeline_id)
        return [np.full((2,), ctx.input_pipeline_id, np.float32)] * 3

    opts = jd.InputOptions(experimental_replication_mode=jd.InputReplicationMode.PER_REPLICA)
    ds = mirrored8.distribute_datasets_from_function(dataset_fn, opts)
    for _ in range(2):
        batches = list(ds)
        assert len(batches) == 3
        np.testing.assert_array_equal(batches[0].array[:, 0], np.arange(8))
    assert calls == list(range(8))


def test_dataset_fn_errors_surface_at_distribute_time(mirrored8: jd.MirroredStrategy) -> None:
    def broken(ctx: jd.InputContext) -> None:
        raise OSError("no such bucket")

    with pytest.raises(OSError, match="no such bucket"):
        mirrored8.distribute_datasets_from_function(broken)
    with pytest.raises(
        TypeError,
        match=r"distribute_datasets_from_function \(the dataset returned by dataset_fn\): "
        r"expected an iterable of global batches .* got int",
    ):
        mirrored8.distribute_datasets_from_function(lambda ctx: 3)


# One-shot sources -------------------------------------------------------------------------


def _gen(n: int, rows: int = 8):
    for i in range(n):
        yield np.full((rows,), i, np.float32)


def test_generator_second_epoch_raises(mirrored8: jd.MirroredStrategy) -> None:
    ds = mirrored8.experimental_distribute_dataset(_gen(3))
    assert len(list(ds)) == 3
    with pytest.raises(
        RuntimeError,
        match=r"^MirroredStrategy.experimental_distribute_dataset: the dataset is a generator, "
        r"an iterator that gives one epoch, and iter\(\) already started it; another iter\(\) "
        r"would yield nothing. Distribute a source that can be iterated again: a list of "
        r"batches, jaxdist.data.from_arrays\(...\), or jaxdist.data.from_generator\(fn\)",
    ):
        iter(ds)
    # Other iterators too (map objects, iterators of lists).
    ds = mirrored8.experimental_distribute_dataset(iter([np.zeros(8)]))
    list(ds)
    with pytest.raises(RuntimeError, match=r"the dataset is a list_iterator, an iterator"):
        iter(ds)


def test_dataset_fn_returning_a_generator_second_epoch_raises(
    mirrored8: jd.MirroredStrategy,
) -> None:
    ds = mirrored8.distribute_datasets_from_function(lambda ctx: _gen(2, rows=1))
    assert len(list(ds)) == 1  # 2 per-replica batches feed 8 replicas: one padded step
    with pytest.raises(
        RuntimeError,
        match=r"distribute_datasets_from_function: dataset_fn returned a generator, an "
        r"iterator that gives one epoch.*Return a source that can be iterated again from "
        r"dataset_fn",
    ):
        iter(ds)


def test_element_spec_of_a_generator_dataset_loses_no_batch(
    mirrored8: jd.MirroredStrategy,
) -> None:
    ds = mirrored8.experimental_distribute_dataset(_gen(3))
    spec = ds.element_spec
    assert spec.array.shape == (8, 1) and spec.array.dtype == np.float32
    got = [float(mirrored8.reduce("sum", b, axis=0)) for b in ds]
    assert got == [0.0, 8.0, 16.0]  # the batch read for the spec is the first one served
    with pytest.raises(RuntimeError, match=r"the dataset is a generator"):
        iter(ds)


def test_from_generator_is_reiterable(mirrored8: jd.MirroredStrategy) -> None:
    starts = []

    def batches():
        starts.append(1)
        yield from _gen(3)

    source = jd.data.from_generator(batches)
    ds = mirrored8.experimental_distribute_dataset(source)
    for _ in range(2):
        assert [float(mirrored8.reduce("sum", b, axis=0)) for b in ds] == [0.0, 8.0, 16.0]
    assert len(starts) == 2  # one generator per epoch
    assert ds.element_spec.array.shape == (8, 1)
    assert len(list(ds)) == 3
    with pytest.raises(
        TypeError,
        match=r"from_generator: generator_fn must be a callable returning an iterable of "
        r"batches, got a generator. It is a generator object: pass the generator function "
        r"\(from_generator\(gen\), not from_generator\(gen\(\)\)\)",
    ):
        jd.data.from_generator(_gen(1))
    bad = jd.data.from_generator(lambda: 3)
    with pytest.raises(
        TypeError, match=r"generator_fn <lambda>\(\) returned a value of type int, not an"
    ):
        iter(bad)


@pytest.mark.parametrize("n", [1, 8])
def test_dataset_reduce_folds_an_epoch(n: int) -> None:
    """TF's ``DistributedDataset.reduce``: the masked sum of a 100-row epoch in batches of
    32 (the last one padded) equals NumPy's sum of the 100 rows; a second call is a new
    epoch."""
    s = jd.OneDeviceStrategy() if n == 1 else jd.MirroredStrategy()
    x = np.arange(100 * 2, dtype=np.float32).reshape(100, 2)
    ds = s.experimental_distribute_dataset(jd.data.from_arrays(x, batch_size=32))

    def add(total: jax.Array, batch: jd.PerReplica) -> jax.Array:
        return total + s.reduce("sum", batch, axis=0)

    for _ in range(2):
        np.testing.assert_allclose(np.asarray(ds.reduce(jnp.zeros(2), add)), x.sum(0), rtol=1e-6)
    assert ds.reduce(0, lambda count, _: count + 1) == 4
    with pytest.raises(TypeError, match=r"reduce_func must be callable as reduce_func\(state"):
        ds.reduce(0, "sum")

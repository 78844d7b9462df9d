"""Distributed input against NumPy references on 1, 2 and 8 replicas (exact: data are
small integers stored as float32)."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd

from _helpers import value

REPLICAS = [1, 2, 8]


def _strategy(n: int) -> jd.Strategy:
    return jd.OneDeviceStrategy() if n == 1 else jd.MirroredStrategy(jax.devices()[:n])


def test_input_context() -> None:
    ctx = jd.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
    assert ctx.get_per_replica_batch_size(512) == 64
    assert (
        repr(ctx)
        == "InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)"
    )
    with pytest.raises(
        ValueError,
        match=r"the global batch size 100 is not divisible by "
        r"num_replicas_in_sync 8; use a multiple of 8 \(for example 104\)",
    ):
        ctx.get_per_replica_batch_size(100)
    with pytest.raises(ValueError, match=r"input_pipeline_id=2 is outside"):
        jd.InputContext(2, 2, 8)
    with pytest.raises(ValueError, match=r"experimental_per_replica_buffer_size=-1\): must be"):
        jd.InputOptions(experimental_per_replica_buffer_size=-1)
    with pytest.raises(ValueError, match=r"experimental_per_replica_buffer_size=True\): must"):
        jd.InputOptions(experimental_per_replica_buffer_size=True)
    with pytest.raises(ValueError, match=r"partial_batches='keep'"):
        jd.InputOptions(partial_batches="keep")
    # TF: None is the default, fetching to the devices (it was kept, and read as False).
    assert jd.InputOptions(experimental_fetch_to_device=None) == jd.InputOptions()
    with pytest.raises(TypeError, match=r"experimental_fetch_to_device='yes'\): expected True"):
        jd.InputOptions(experimental_fetch_to_device="yes")  # type: ignore[arg-type]


def test_from_arrays() -> None:
    x = np.arange(10)
    assert [b.tolist() for b in jd.data.from_arrays(x, batch_size=4)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    assert len(jd.data.from_arrays(x, batch_size=4, drop_remainder=True)) == 2
    ds = jd.data.from_arrays({"x": x, "y": -x}, batch_size=5, shuffle=True, seed=3)
    e1, e2 = [b["x"].tolist() for b in ds], [b["x"].tolist() for b in ds]
    assert sorted(v for b in e1 for v in b) == list(range(10)) and e1 != e2  # new order per epoch
    assert all((b["y"] == -b["x"]).all() for b in ds)
    with pytest.raises(ValueError, match=r"every array needs the same leading \(row\) axis"):
        jd.data.from_arrays(np.zeros(3), np.zeros(4), batch_size=2)
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1, got 0"):
        jd.data.from_arrays(x, batch_size=0)


@pytest.mark.parametrize("n", REPLICAS)
def test_global_batches_split_by_rows(n: int) -> None:
    s = _strategy(n)
    x = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    y = np.arange(40, dtype=np.int32)
    ds = s.experimental_distribute_dataset(jd.data.from_arrays(x, y, batch_size=8))
    seen = []
    for bx, by in ds:
        assert isinstance(bx, jd.PerReplica) and bx.array.shape == (n, 8 // n, 3)
        assert bx.array.sharding.spec == jax.sharding.PartitionSpec("replica")
        for r, (lx, ly) in enumerate(
            zip(s.experimental_local_results(bx), s.experimental_local_results(by), strict=True)
        ):
            lo = len(seen) * 8 + r * (8 // n)
            np.testing.assert_array_equal(lx, x[lo : lo + 8 // n])
            np.testing.assert_array_equal(ly, y[lo : lo + 8 // n])
        seen.append(1)
    assert len(seen) == 5
    assert len(list(ds)) == 5  # re-iterable


def test_partial_batch_split_and_weighted_reduce() -> None:
    s = jd.MirroredStrategy(jax.devices()[:2])
    element = next(iter(s.experimental_distribute_dataset([np.array([5.0, 6.0, 7.0])])))
    a, b = s.experimental_local_results(element)
    assert a.tolist() == [5.0, 6.0] and b.tolist() == [7.0]  # no padding shown
    assert float(s.reduce("MEAN", element, axis=0)) == 6.0
    assert float(s.reduce("SUM", element, axis=0)) == 18.0
    assert float(s.reduce("MAX", element, axis=0)) == 7.0
    assert float(s.reduce("MIN", element, axis=0)) == 5.0
    np.testing.assert_array_equal(s.gather(element, axis=0), [5.0, 6.0, 7.0])


@pytest.mark.parametrize("n", REPLICAS)
def test_last_partial_batch_is_padded_masked_and_not_recompiled(n: int) -> None:
    s = _strategy(n)
    x = np.arange(21, dtype=np.float32)  # batches of 8, 8, then 5
    ds = s.experimental_distribute_dataset(jd.data.from_arrays(x, batch_size=8))
    traces = []

    def step(ctx, batch):
        traces.append(1)
        mask = ctx.valid_mask(batch.shape[0])
        total = ctx.all_reduce("sum", jnp.sum(jnp.where(mask, batch, 0.0)))
        count = ctx.all_reduce("sum", jnp.sum(mask))
        return total, count

    sums, counts, means = [], [], []
    for batch in ds:
        t, c = s.run(step, args=(batch,))
        sums.append(float(value(t)))
        counts.append(int(value(c)))
        means.append(float(s.reduce("mean", batch, axis=0)))
    assert len(traces) == 1  # the padded last batch has the same shapes
    assert counts == [8, 8, 5]
    assert sums == [x[:8].sum(), x[8:16].sum(), x[16:].sum()]
    assert means == [x[:8].mean(), x[8:16].mean(), x[16:].mean()]
    last = s.experimental_local_results(batch)
    np.testing.assert_array_equal(np.concatenate(last), x[16:])


def test_drop_remainder_and_partial_batch_policies() -> None:
    s = jd.MirroredStrategy()
    x = np.arange(20, dtype=np.float32)
    dropped = s.experimental_distribute_dataset(
        jd.data.from_arrays(x, batch_size=8, drop_remainder=True)
    )
    assert len(list(dropped)) == 2
    opts = jd.InputOptions(partial_batches="drop")
    assert (
        len(list(s.experimental_distribute_dataset(jd.data.from_arrays(x, batch_size=8), opts)))
        == 2
    )
    strict = s.experimental_distribute_dataset([x[:4]], jd.InputOptions(partial_batches="error"))
    first = s.experimental_distribute_dataset(
        [x[:8], x[:4]], jd.InputOptions(partial_batches="error")
    )
    it = iter(first)
    next(it)
    with pytest.raises(
        ValueError,
        match=r"a batch of 4 rows is smaller than the full 8 rows and "
        r"InputOptions\(partial_batches='error'\) forbids padding it",
    ):
        next(it)
    with pytest.raises(ValueError, match=r"a batch of 4 rows is smaller than the full 8"):
        next(iter(strict))


def test_batch_smaller_than_replica_count_is_padded() -> None:
    s = jd.MirroredStrategy()
    element = next(iter(s.experimental_distribute_dataset([np.array([1.0, 2.0, 3.0])])))
    assert element.array.shape == (8, 1)
    assert [v.tolist() for v in element.values] == [[1.0], [2.0], [3.0]] + [[]] * 5
    assert float(s.reduce("mean", element, axis=0)) == 2.0


def test_iterator_protocol_and_element_spec(mirrored8: jd.MirroredStrategy) -> None:
    x = np.arange(32, dtype=np.float32).reshape(16, 2)
    ds = mirrored8.experimental_distribute_dataset(jd.data.from_arrays(x, batch_size=8))
    it = iter(ds)
    spec = it.element_spec
    assert spec.array.shape == (8, 1, 2) and spec.array.sharding.spec == jax.sharding.PartitionSpec(
        "replica"
    )
    assert ds.element_spec.array.shape == (8, 1, 2)

    @mirrored8.function
    def step(ctx, b):
        return ctx.all_reduce("sum", jnp.sum(b))

    compiled = step.lower(spec).compile()  # ahead of time, from the spec
    first = it.get_next()
    assert float(compiled(first).array) == x[:8].sum()
    opt = it.get_next_as_optional()
    assert opt.has_value() and float(step(opt.get_value()).array) == x[8:].sum()
    empty = it.get_next_as_optional()
    assert not empty.has_value()
    with pytest.raises(ValueError, match="exhausted"):
        empty.get_value()
    with pytest.raises(StopIteration):
        next(it)
    # TF's get_next ends with OutOfRangeError (a StopIteration here); next() stays plain.
    with pytest.raises(jd.errors.OutOfRangeError, match=r"get_next: the end of the data"):
        it.get_next()
    assert issubclass(jd.errors.OutOfRangeError, StopIteration)
    with pytest.raises(StopIteration) as plain:
        next(it)
    assert type(plain.value) is StopIteration


def test_sources_lists_generators_dicts(mirrored8: jd.MirroredStrategy) -> None:
    batches = [{"x": np.full((8, 2), i, np.float32), "id": np.arange(8) + 8 * i} for i in range(3)]

    def gen():
        yield from batches

    for source in (batches, gen()):
        got = list(mirrored8.experimental_distribute_dataset(source))
        assert len(got) == 3
        for i, b in enumerate(got):
            np.testing.assert_array_equal(b["x"].array, np.full((8, 1, 2), i))
            np.testing.assert_array_equal(b["id"].array[:, 0], np.arange(8) + 8 * i)


def test_grain_source(mirrored8: jd.MirroredStrategy) -> None:
    grain = pytest.importorskip("grain")
    x = np.arange(64, dtype=np.float32)
    ds = grain.MapDataset.source(x).batch(16)
    got = [b.array for b in mirrored8.experimental_distribute_dataset(ds)]
    assert len(got) == 4
    np.testing.assert_array_equal(np.concatenate([g.reshape(-1) for g in got]), x)


def test_tf_data_source(mirrored8: jd.MirroredStrategy) -> None:
    tf = pytest.importorskip("tensorflow")
    ds = tf.data.Dataset.from_tensor_slices(np.arange(20, dtype=np.float32)).batch(8)
    got = list(mirrored8.experimental_distribute_dataset(ds))
    assert [float(mirrored8.reduce("sum", b, axis=0)) for b in got] == [28.0, 92.0, 70.0]


def test_bad_input_errors(mirrored8: jd.MirroredStrategy) -> None:
    where = r"MirroredStrategy.experimental_distribute_dataset"

    def first(source, **kw):
        return next(iter(mirrored8.experimental_distribute_dataset(source, **kw)))

    with pytest.raises(
        ValueError,
        match=where + r": the leaves of a global batch disagree on the "
        r"batch size: \{\"\['x'\]\": 8, \"\['y'\]\": 6\}",
    ):
        first([{"x": np.zeros(8), "y": np.zeros(6)}])
    with pytest.raises(TypeError, match=where + r": leaf \['name'\] of a global batch is a str"):
        first([{"x": np.zeros(8), "name": "a"}])
    with pytest.raises(TypeError, match=where + r": the dataset yielded a PerReplica at <batch>"):
        first([jd.PerReplica(np.zeros((8, 2)))])
    with pytest.raises(
        TypeError, match=where + r": got arrays, not a dataset of batches. Wrap them"
    ):
        mirrored8.experimental_distribute_dataset(np.zeros((16, 2)))
    with pytest.raises(
        ValueError,
        match=where + r": a global batch of 16 rows is larger than the "
        r"first \(8 rows, 1 per replica for 8 replicas\)",
    ):
        list(mirrored8.experimental_distribute_dataset([np.zeros(8), np.zeros(16)]))
    with pytest.raises(ValueError, match=where + r": leaf <batch> has rows of shape \(3,\)"):
        list(mirrored8.experimental_distribute_dataset([np.zeros((8, 2)), np.zeros((8, 3))]))
    with pytest.raises(ValueError, match=r"AutoShardPolicy.FILE splits a dataset by its files"):
        mirrored8.experimental_distribute_dataset(
            [np.zeros(8)],
            jd.InputOptions(experimental_auto_shard_policy=jd.experimental.AutoShardPolicy.FILE),
        )
    # A string would silently act as DATA (only the enum members are compared).
    with pytest.raises(TypeError, match=r"experimental_auto_shard_policy=...\): expected an"):
        jd.InputOptions(experimental_auto_shard_policy="OFF")  # type: ignore[arg-type]

    def failing():
        yield np.zeros(8)
        raise OSError("disk gone")

    it = iter(mirrored8.experimental_distribute_dataset(failing()))
    next(it)
    with pytest.raises(OSError, match="disk gone"):
        next(it)


@pytest.mark.parametrize("n", REPLICAS)
def test_distribute_datasets_from_function(n: int) -> None:
    s = _strategy(n)
    x = np.arange(44, dtype=np.float32)
    calls = []

    def dataset_fn(ctx: jd.InputContext):
        calls.append(ctx)
        bs = ctx.get_per_replica_batch_size(8 if n != 1 else 4)
        return jd.data.from_arrays(x, batch_size=bs)

    ds = s.distribute_datasets_from_function(dataset_fn)
    batches = list(ds)
    assert calls == [jd.InputContext(1, 0, n)]
    per = 8 // n if n != 1 else 4
    flat = np.concatenate([np.concatenate(s.experimental_local_results(b)) for b in batches])
    np.testing.assert_array_equal(flat, x)  # every row once, in order, no padding
    assert all(b.array.shape == (n, per) for b in batches)
    total = sum(float(s.reduce("sum", b, axis=0)) for b in batches)
    assert total == x.sum()


def test_per_replica_mode_and_errors(mirrored8: jd.MirroredStrategy) -> None:
    calls = []

    def dataset_fn(ctx):
        calls.append((ctx.input_pipeline_id, ctx.num_input_pipelines))
        return [np.full((2,), ctx.input_pipeline_id, np.float32)] * 2

    opts = jd.InputOptions(experimental_replication_mode=jd.InputReplicationMode.PER_REPLICA)
    batches = list(mirrored8.distribute_datasets_from_function(dataset_fn, opts))
    assert calls == [(r, 8) for r in range(8)] and len(batches) == 2
    np.testing.assert_array_equal(batches[0].array[:, 0], np.arange(8))

    def too_big(ctx):
        return [np.zeros(2), np.zeros(16)]

    with pytest.raises(
        ValueError,
        match=r"a per-replica batch of 16 rows is larger than the first "
        r"\(2 rows\).*did it yield global batches\?",
    ):
        list(mirrored8.distribute_datasets_from_function(too_big))
    with pytest.raises(TypeError, match=r"dataset_fn must be callable"):
        mirrored8.distribute_datasets_from_function(3)


def test_prefetch_is_bounded() -> None:
    s = jd.MirroredStrategy()
    pulled = []

    def source():
        for i in range(50):
            pulled.append(i)
            yield np.full((8, 4), i, np.float32)

    opts = jd.InputOptions(experimental_per_replica_buffer_size=2)
    it = iter(s.experimental_distribute_dataset(source(), opts))
    next(it)
    time.sleep(0.5)  # let the prefetch thread run as far as it can
    # Ran ahead: up to 2 batches on the devices, a host queue of max(4, 2), one in the
    # making; no further.
    assert 1 + 4 <= len(pulled) <= 1 + 2 + 4 + 1
    it.close()
    for size in (1, 8):  # the host queue grows with a larger buffer
        pulled.clear()
        opts = jd.InputOptions(experimental_per_replica_buffer_size=size)
        it = iter(s.experimental_distribute_dataset(source(), opts))
        next(it)
        time.sleep(0.3)
        assert 1 + max(4, size) <= len(pulled) <= 1 + size + max(4, size) + 1
        it.close()


def test_host_batches_without_fetch_to_device(mirrored8: jd.MirroredStrategy) -> None:
    opts = jd.InputOptions(experimental_fetch_to_device=False)
    b = next(iter(mirrored8.experimental_distribute_dataset([np.arange(8.0)], opts)))
    assert isinstance(b.array, np.ndarray) and b.array.shape == (8, 1)
    out = mirrored8.run(lambda ctx, v: ctx.all_reduce("sum", v), args=(b,))
    np.testing.assert_array_equal(out.array, [28.0])


def test_no_thread_left_behind() -> None:
    s = jd.MirroredStrategy()
    before = threading.active_count()
    for _ in range(5):
        it = iter(
            s.experimental_distribute_dataset(jd.data.from_arrays(np.zeros(64), batch_size=8))
        )
        next(it)
        it.close()
    time.sleep(0.5)
    assert threading.active_count() <= before + 1


def test_partial_batch_policies_for_dataset_fn() -> None:
    s = jd.MirroredStrategy(jax.devices()[:2])

    def dataset_fn(ctx):  # 10 rows in per-replica batches of 2: the last step is 2 + 0 rows
        return jd.data.from_arrays(np.arange(10.0), batch_size=2)

    padded = list(s.distribute_datasets_from_function(dataset_fn))
    assert len(padded) == 3 and padded[-1].valid.tolist() == [2, 0]
    drop = jd.InputOptions(partial_batches="drop")
    assert len(list(s.distribute_datasets_from_function(dataset_fn, drop))) == 2
    strict = jd.InputOptions(partial_batches="error")
    with pytest.raises(ValueError, match=r"a batch of 2 rows is smaller than the full 4 rows"):
        list(s.distribute_datasets_from_function(dataset_fn, strict))


def test_batches_do_not_share_memory_with_the_source() -> None:
    """A generator reusing one host buffer: every batch keeps the values it was given
    (the CPU backend may otherwise wrap the buffer without copying it)."""
    buf = np.zeros((64, 16), np.float32)

    def gen():
        for i in range(3):
            buf[:] = i
            yield buf

    s = jd.MirroredStrategy()
    got = [float(np.asarray(b.array).mean()) for b in s.experimental_distribute_dataset(gen())]
    assert got == [0.0, 1.0, 2.0]


def test_full_batches_share_one_device_copy_of_their_valid_counts(
    mirrored8: jd.MirroredStrategy,
) -> None:
    x = np.arange(40, dtype=np.float32)
    glob = list(mirrored8.experimental_distribute_dataset(jd.data.from_arrays(x, batch_size=16)))
    per = list(
        mirrored8.distribute_datasets_from_function(
            lambda ctx: jd.data.from_arrays(x, batch_size=2)
        )
    )
    # Global batches of 16, 16, 8 rows; per-replica steps of 8, 8, 4 batches of 2 rows.
    for batches, last in ((glob, [1] * 8), (per, [2] * 4 + [0] * 4)):
        assert batches[0].valid is batches[1].valid  # placed once, not per step
        np.testing.assert_array_equal(np.asarray(batches[0].valid), [2] * 8)
        np.testing.assert_array_equal(np.asarray(batches[2].valid), last)


def test_valid_counts_are_placed_once_per_dataset_not_per_epoch(
    mirrored8: jd.MirroredStrategy,
) -> None:
    x = np.arange(48, dtype=np.float32)
    ds = mirrored8.experimental_distribute_dataset(jd.data.from_arrays(x, batch_size=16))
    epochs = [list(ds) for _ in range(3)]
    assert all(e[0].valid is epochs[0][0].valid for e in epochs)  # one device copy
    other = next(iter(mirrored8.experimental_distribute_dataset([x[:16]])))
    assert other.valid is not epochs[0][0].valid  # another dataset places its own
    for e in epochs:
        np.testing.assert_array_equal(np.concatenate([value(b).ravel() for b in e]), x)
        np.testing.assert_array_equal(np.asarray(e[0].valid), [2] * 8)


def test_batches_that_change_after_full_ones_are_checked(mirrored8: jd.MirroredStrategy) -> None:
    # Full batches take a fast path once the first was checked; any batch unlike them
    # (dtype, structure, a jax.Array, a larger or smaller batch) goes through the checks.
    where = r"MirroredStrategy.experimental_distribute_dataset"
    a = np.arange(32, dtype=np.float32).reshape(16, 2)

    def run(*batches):
        return list(mirrored8.experimental_distribute_dataset(list(batches)))

    with pytest.raises(
        ValueError,
        match=where + r": leaf <batch> has rows of shape \(2,\) and "
        r"dtype int32, but the first global batch had \(2,\) and float32",
    ):
        run(a, a, a.astype(np.int32))
    with pytest.raises(ValueError, match=where + r": a global batch has structure"):
        run(a, a, (a, a))
    with pytest.raises(ValueError, match=where + r": a global batch of 32 rows is larger"):
        run(a, a, np.concatenate([a, a]))
    out = run(a, jnp.asarray(a) + 100, a[:5] + 200)  # a jax.Array, then a partial batch
    np.testing.assert_array_equal(value(out[1]).reshape(16, 2), a + 100)
    np.testing.assert_array_equal(np.asarray(out[2].valid), [1] * 5 + [0] * 3)
    np.testing.assert_array_equal(value(out[2])[:5, 0], a[:5] + 200)


@pytest.mark.parametrize("source", ["list", "generator"])
def test_buffer_size_zero_places_each_batch_when_asked(source: str) -> None:
    # TF: "Users can set it to 0 to completely disable prefetching behavior".
    s = jd.MirroredStrategy()
    placed = []
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    batches = [x + 100 * i for i in range(4)]
    opts = jd.InputOptions(experimental_per_replica_buffer_size=0)
    ds = s.experimental_distribute_dataset(
        batches if source == "list" else (b for b in batches), opts
    )
    it = iter(ds)
    place = it._batcher.place

    def counting(*args):
        placed.append(1)
        return place(*args)

    it._batcher.place = counting
    got = []
    for i, b in enumerate(it):
        assert len(placed) == i + 1  # nothing placed ahead of the batch returned
        got.append(value(b).reshape(8, 8))
    np.testing.assert_array_equal(np.stack(got), np.stack(batches))
    if source == "list":  # with the default, one batch is placed ahead
        it = iter(s.experimental_distribute_dataset(batches))
        placed.clear()
        place = it._batcher.place
        it._batcher.place = counting
        next(it)
        assert len(placed) == 2


@pytest.mark.parametrize(
    "make",
    [
        lambda: jd.OneDeviceStrategy(),
        lambda: jd.MirroredStrategy(jax.devices()[:2]),
        lambda: jd.MirroredStrategy(mesh_shape=(2, 4), axis_names=("host", "local")),
    ],
    ids=["one_device", "mirrored2", "mirrored_2x4"],
)
def test_per_replica_steps_from_memory_are_placed_row_by_row(make) -> None:
    # In one process, a full step of in-memory per-replica batches goes to the devices
    # replica by replica (no stacked host copy); values as NumPy's stack of the batches.
    from jaxdist.input.batching import Rows

    s = make()
    n = s.num_replicas_in_sync
    x = np.arange(n * 4 * 7 * 3, dtype=np.float32).reshape(n * 4 * 7, 3)
    y = np.arange(n * 4 * 7, dtype=np.int32)

    def dataset_fn(ctx):
        return jd.data.from_arrays(x, y, batch_size=4)

    ds = s.distribute_datasets_from_function(dataset_fn)
    it = iter(ds)
    kinds = []
    place = it._batcher.place

    def spy(leaves, counts):
        kinds.append({type(a) for a in leaves})
        return place(leaves, counts)

    it._batcher.place = spy
    steps = list(it)
    assert len(steps) == 7 and kinds == [{Rows}] * 7
    for i, (bx, by) in enumerate(steps):
        rows = range(i * n * 4, (i + 1) * n * 4)
        np.testing.assert_array_equal(value(bx).reshape(-1, 3), x[rows])
        np.testing.assert_array_equal(value(by).reshape(-1), y[rows])
        assert bx.array.sharding.is_equivalent_to(
            jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(s.axis_name)), 3
        )
    # A prefetch thread (a generator source) still hands over stacked host copies.
    gen = s.distribute_datasets_from_function(lambda ctx: (b for b in dataset_fn(ctx)))
    got = [value(bx).reshape(-1, 3) for bx, _ in gen]
    np.testing.assert_array_equal(np.concatenate(got), x)


@pytest.mark.parametrize("n", [1, 8])
def test_lean_placement_matches_jax_device_put(n: int) -> None:
    from jaxdist._jax_compat import place_host_arrays

    s = _strategy(n)
    sharding = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(s.axis_name))
    rng = np.random.default_rng(0)
    wide = rng.normal(size=(n, 6, 4)).astype(np.float32)
    arrays = [
        wide,
        wide[:, ::2],  # not contiguous
        rng.integers(0, 5, size=(n, 3)).astype(np.int32),
        rng.integers(0, 5, size=(n, 3)),  # int64: JAX converts it, so device_put does
        rng.random((n, 2)) > 0.5,
        rng.normal(size=(n, 2)).astype(np.float16),
        rng.normal(size=(n, 2)),  # float64
    ]
    from jaxdist import _jax_compat

    lean = _jax_compat._BATCHED_DEVICE_PUT[0]
    used: list[bool] = []

    def counting(*args):
        used.append(True)
        return lean(*args)

    _jax_compat._BATCHED_DEVICE_PUT[0] = counting
    try:
        for a in arrays:
            used.clear()
            got = place_host_arrays([a], sharding)[0]
            # The lean path for NumPy arrays JAX keeps as they are; device_put otherwise.
            assert used == ([] if a.dtype in (np.int64, np.float64) else [True]), a.dtype
            want = jax.device_put(a, sharding)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.sharding == want.sharding and got.committed
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    finally:
        _jax_compat._BATCHED_DEVICE_PUT[0] = lean
    for a in arrays:
        got = place_host_arrays([a], sharding)[0]
        want = jax.device_put(a, sharding)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.sharding == want.sharding and got.committed
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_every_bad_leaf_of_a_batch_is_listed() -> None:
    s = jd.MirroredStrategy(jax.devices()[:2])
    batches = [{"a": np.array(["x", "y"]), "b": np.zeros(2), "c": object()}]
    with pytest.raises(TypeError) as info:
        next(iter(s.experimental_distribute_dataset(batches)))
    msg = str(info.value)
    assert "leaf ['a'] of a global batch is an array of dtype <U1" in msg, msg
    assert "leaf ['c'] of a global batch is a object, not an array" in msg, msg
    assert "['b']" not in msg


def test_string_arrays_in_batches_and_variables_name_the_leaf(
    mirrored8: jd.MirroredStrategy,
) -> None:
    batch = {"x": np.zeros((8, 2), np.float32), "words": np.array(["a"] * 8)}
    with pytest.raises(
        TypeError,
        match=r"experimental_distribute_dataset: leaf \['words'\] of a global batch is an array "
        r"of dtype <U1 \(shape \(8,\)\), which cannot be placed on the devices.*"
        r"experimental_fetch_to_device=False",
    ):
        list(mirrored8.experimental_distribute_dataset([batch]))
    with pytest.raises(
        TypeError,
        match=r"distribute_datasets_from_function: leaf \['words'\] of a per-replica batch",
    ):
        list(mirrored8.distribute_datasets_from_function(lambda ctx: [batch]))
    host = jd.InputOptions(experimental_fetch_to_device=False)  # host batches may hold text
    (got,) = list(mirrored8.experimental_distribute_dataset([batch], host))
    assert [w.tolist() for w in got["words"].values] == [["a"]] * 8
    with pytest.raises(
        TypeError, match=r"jaxdist.Variable\(name='w'\): initial_value is an array of dtype <U1"
    ):
        jd.Variable(np.array(["a"]), name="w")
    with pytest.raises(TypeError, match=r"dtype=<class 'str'> \(<U0\) is not a numeric dtype"):
        jd.Variable(1.0, dtype=str)
    with pytest.raises(
        TypeError,
        match=r"Variable.assign: cannot assign an array of dtype <U1 \(shape \(\)\) to variable "
        r"'v' of dtype float32",
    ):
        jd.Variable(0.0, name="v").assign(np.array("a"))

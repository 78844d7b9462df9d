"""Processes whose own sources yield different numbers of batches end every epoch on the same
step.

A real job of 2 processes x 4 CPU devices (``jax.distributed`` over loopback): process 0's
sources yield 3 steps of data, process 1's 5; both run 5 steps, process 0 feeding
all-padding batches (valid counts 0) in steps 4 and 5, and both get ``StopIteration``
after the 5th. The masked sums of every step are checked against NumPy. The agreement's
block logic is also checked in one process, with threads as processes and an in-memory
key-value store, over many combinations of lengths and failures.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import jaxdist as jd
from jaxdist.input import agreement

from _helpers import run_workers, worker_script

STEPS = (3, 5)  # steps of data in process 0's and process 1's sources
ROWS = 2  # rows per replica per step; 4 replicas per process

_WORKER = worker_script(
    """
    import time
    import jax.numpy as jnp
    import numpy as np
    import jaxdist as jd
    from jax._src.distributed import global_state

    STEPS, ROWS = (3, 5), 2
    me = jax.process_index()
    s = jd.MirroredStrategy(jax.devices())  # 8 replicas, 4 per process

    def data(owner, rows):  # distinct values per owner (a process or a replica)
        return (1000.0 * (owner + 1) + np.arange(rows, dtype=np.float32)).astype(np.float32)

    def masked_sum(ctx, b):
        return ctx.all_reduce("sum", jnp.sum(jnp.where(ctx.valid_mask(b.shape[0]), b, 0.0)))

    step = s.function(masked_sum)

    def run(ds):
        sums, reduced, valid = [], [], []
        it = iter(ds)
        while True:
            try:
                b = next(it)
            except StopIteration:
                break
            sums.append(float(step(b).array))
            reduced.append(float(s.reduce("sum", b, axis=0)))
            shards = sorted(b.valid.addressable_shards, key=lambda sh: sh.index[0].start)
            valid.append([int(np.asarray(sh.data)[0]) for sh in shards])
        return {"sums": sums, "reduced": reduced, "valid": valid}

    def outcome(fn):
        try:
            return {"ok": fn()}
        except Exception as e:
            return {"error": type(e).__name__, "message": str(e)}

    out = {}
    mine = data(me, STEPS[me] * 4 * ROWS)

    def per_worker(ctx):
        return jd.data.from_arrays(mine, batch_size=ROWS)

    fn_ds = s.distribute_datasets_from_function(per_worker)
    out["spec_shape"] = list(fn_ds.element_spec.array.shape)  # an epoch of its own
    out["fn"] = run(fn_ds)
    out["fn_second_epoch"] = run(fn_ds)
    off = jd.InputOptions(experimental_auto_shard_policy=jd.experimental.AutoShardPolicy.OFF)
    out["off"] = run(s.experimental_distribute_dataset(
        jd.data.from_arrays(mine, batch_size=4 * ROWS), off))

    def per_replica(ctx):
        r = ctx.input_pipeline_id
        return jd.data.from_arrays(data(r, STEPS[r // 4] * ROWS), batch_size=ROWS)

    replica_mode = jd.InputOptions(
        experimental_replication_mode=jd.InputReplicationMode.PER_REPLICA
    )
    out["per_replica"] = run(s.distribute_datasets_from_function(per_replica, replica_mode))

    def gen():  # process 0: 2 full batches and a partial one of 5 rows; process 1: 4 full
        rows = mine[: 21] if me == 0 else mine[: 32]
        for i in range(0, len(rows), 8):
            yield rows[i : i + 8]

    out["off_generator"] = run(s.experimental_distribute_dataset(gen(), off))

    # Break out of an epoch after 2 steps (both processes), then run a whole one.
    it = iter(fn_ds)
    out["abandoned"] = [float(step(next(it)).array) for _ in range(2)]
    it.close()
    del it
    out["after_abandoned"] = run(fn_ds)

    def nothing_on_1(ctx):
        return jd.data.from_arrays(mine[: 0 if me == 1 else 8], batch_size=ROWS)

    long_steps = (9, 2)  # several blocks of agreement, process 1 out early

    def long(ctx):
        return jd.data.from_arrays(data(me, long_steps[me] * 4 * ROWS), batch_size=ROWS)

    out["long"] = run(s.distribute_datasets_from_function(long))
    out["blind"] = outcome(lambda: run(s.distribute_datasets_from_function(nothing_on_1)))

    def failing():
        for i in range(0, len(mine), 8):
            if me == 1 and i == 16:
                raise OSError("disk gone")
            yield mine[i : i + 8]

    out["failure"] = outcome(lambda: run(s.experimental_distribute_dataset(failing(), off)))

    def failing_at_once():
        if me == 0:
            raise KeyError("no such shard")
        yield mine[:8]

    out["failure_at_once"] = outcome(
        lambda: run(s.experimental_distribute_dataset(failing_at_once(), off)))

    # Every epoch's keys are gone once all processes have left it.
    client = global_state.client
    client.wait_at_barrier("uneven-test-done", 60000)
    deadline = time.monotonic() + 10
    while client.key_value_dir_get("jaxdist/input") and time.monotonic() < deadline:
        time.sleep(0.05)
    out["keys_left"] = [k for k, _ in client.key_value_dir_get("jaxdist/input")]
    print(json.dumps(out), flush=True)
    """
)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    """What each process of one 2-process job saw, in process order."""
    return run_workers(_WORKER)


def _data(owner: int, rows: int) -> np.ndarray:
    return (1000.0 * (owner + 1) + np.arange(rows, dtype=np.float32)).astype(np.float32)


def _per_process_sums() -> list[float]:
    """Step sums when process p's source holds 8-row steps of ``_data(p, ...)``."""
    sources = [_data(p, STEPS[p] * 4 * ROWS) for p in range(2)]
    return [
        float(sum(src[i * 8 : (i + 1) * 8].sum() for src in sources)) for i in range(max(STEPS))
    ]


def _valid(step: int) -> list[int]:
    """The valid counts of this step for the 8 replicas (0 once a process has run out)."""
    return [ROWS if step < STEPS[r // 4] else 0 for r in range(8)]


def _check_uneven(runs: list[dict[str, Any]], expected: list[float]) -> None:
    for me, r in enumerate(runs):
        assert len(r["sums"]) == max(STEPS), (me, r)
        assert r["sums"] == pytest.approx(expected), me
        assert r["reduced"] == pytest.approx(expected), me
        # Each process sees the counts of its own 4 replicas.
        assert r["valid"] == [_valid(i)[4 * me : 4 * me + 4] for i in range(max(STEPS))], me


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_from_function_uneven_pipelines_end_together(results: list[dict[str, Any]]) -> None:
    _check_uneven([r["fn"] for r in results], _per_process_sums())
    # A second epoch of the same dataset agrees again, from its first step.
    _check_uneven([r["fn_second_epoch"] for r in results], _per_process_sums())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_several_blocks_of_agreement(results: list[dict[str, Any]]) -> None:
    sources = [_data(p, n * 4 * ROWS) for p, n in enumerate((9, 2))]
    expected = [float(sum(src[i * 8 : (i + 1) * 8].sum() for src in sources)) for i in range(9)]
    for r in results:
        assert r["long"]["sums"] == pytest.approx(expected)
        assert r["spec_shape"] == [8, ROWS]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_off_policy_uneven_sources_end_together(results: list[dict[str, Any]]) -> None:
    _check_uneven([r["off"] for r in results], _per_process_sums())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_per_replica_uneven_pipelines_end_together(results: list[dict[str, Any]]) -> None:
    sources = [_data(r, STEPS[r // 4] * ROWS) for r in range(8)]
    expected = [
        float(sum(src[i * ROWS : (i + 1) * ROWS].sum() for src in sources))
        for i in range(max(STEPS))
    ]
    _check_uneven([r["per_replica"] for r in results], expected)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_uneven_generators_with_a_partial_batch(results: list[dict[str, Any]]) -> None:
    # Process 0: 8, 8 and 5 rows; process 1: 8, 8, 8, 8. Four steps on both.
    rows = [_data(0, 40)[:21], _data(1, 56)[:32]]
    expected = [float(sum(r[i * 8 : (i + 1) * 8].sum() for r in rows)) for i in range(4)]
    for me, r in enumerate(results):
        got = r["off_generator"]
        assert got["sums"] == pytest.approx(expected), me
        assert got["reduced"] == pytest.approx(expected), me
    # A partial batch of 5 rows over 4 replicas is split 2, 2, 1, 0; then padding only.
    assert results[0]["off_generator"]["valid"] == [
        [2, 2, 2, 2],
        [2, 2, 2, 2],
        [2, 2, 1, 0],
        [0, 0, 0, 0],
    ]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_abandoned_epoch_then_a_whole_one(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["abandoned"] == pytest.approx(_per_process_sums()[:2])
        assert r["after_abandoned"]["sums"] == pytest.approx(_per_process_sums())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_process_without_any_batch_raises_on_every_process(
    results: list[dict[str, Any]],
) -> None:
    for r in results:
        assert r["blind"]["error"] == "ValueError", r["blind"]
        message = r["blind"]["message"]
        assert "distribute_datasets_from_function" in message
        assert "the input pipeline of process 1 yielded no batch at all" in message
        assert "1 of 2 processes (0) had a first batch" in message
        assert "at least one batch per epoch" in message


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_source_error_surfaces_on_every_process(results: list[dict[str, Any]]) -> None:
    failing, other = results[1]["failure"], results[0]["failure"]
    assert failing == {"error": "OSError", "message": "disk gone"}  # its own error
    assert other["error"] == "RuntimeError", other
    assert "the input pipeline of process 1 raised an error at batch 2" in other["message"]
    assert "OSError: disk gone" in other["message"]
    # A source that fails before its first batch: no step runs anywhere.
    assert results[0]["failure_at_once"] == {"error": "KeyError", "message": "'no such shard'"}
    assert results[1]["failure_at_once"]["error"] == "RuntimeError"
    assert "process 0 raised an error at batch 0" in results[1]["failure_at_once"]["message"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_agreement_keys_are_deleted(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["keys_left"] == []


# The block logic in one process: threads play the processes, over an in-memory store that
# behaves like the coordination service's key-value store.


class _Store:
    """The key-value calls `jaxdist.input.agreement` makes, in memory."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.changed = threading.Condition()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.changed:
            assert allow_overwrite or key not in self.data, key
            self.data[key] = value
            self.changed.notify_all()

    def key_value_increment(self, key: str, increment: int) -> int:
        with self.changed:
            value = int(self.data.get(key, "0")) + increment
            assert value < 2**31, "the service parses counters as 32-bit integers"
            self.data[key] = str(value)
            self.changed.notify_all()
            return value

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.data, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.data[key]

    def key_value_try_get(self, key: str) -> str:
        with self.changed:
            return self.data[key]

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        with self.changed:
            return [(k, v) for k, v in self.data.items() if k.startswith(key + "/")]

    def key_value_delete(self, key: str) -> None:
        with self.changed:
            for k in [k for k in self.data if k == key or k.startswith(key + "/")]:
                del self.data[k]


class _Batcher:
    """What `agreed` asks of a batcher: an all-padding batch, once shapes are known."""

    def __init__(self) -> None:
        self.seen = False

    def empty(self) -> Any:
        return "pad" if self.seen else None


def _source(p: int, length: int, fail_at: int | None, batcher: _Batcher) -> Iterator[Any]:
    for i in range(length):
        if i == fail_at:
            raise OSError(f"source {p} failed")
        batcher.seen = True
        yield (p, i)


def _agree_in_threads(
    lengths: tuple[int, ...],
    monkeypatch: pytest.MonkeyPatch,
    fail_at: dict[int, int] | None = None,
    timeout_s: float = 10.0,
) -> tuple[list[list[Any]], list[BaseException | None], _Store]:
    """What each thread-process yielded, and what it raised."""
    store = _Store()
    monkeypatch.setattr(agreement, "_client", lambda: store)
    n = len(lengths)
    yielded: list[list[Any]] = [[] for _ in range(n)]
    raised: list[BaseException | None] = [None] * n

    def run(p: int) -> None:
        sync = agreement.StepSync("test/0", n, p, "W.fn", timeout_s)
        batcher = _Batcher()
        source = _source(p, lengths[p], (fail_at or {}).get(p), batcher)
        try:
            for item in agreement.agreed(source, batcher, sync.epoch(1, threading.Event())):
                yielded[p].append(item)
        except BaseException as e:
            raised[p] = e

    threads = [threading.Thread(target=run, args=(p,)) for p in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "an agreement hung"
    return yielded, raised, store


_LENGTHS = sorted(
    {*itertools.product(range(10), repeat=2), *itertools.product((0, 1, 4, 5, 9), repeat=3)}
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lengths", _LENGTHS, ids=str)
def test_agreement_ends_every_process_on_the_same_step(
    lengths: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    yielded, raised, store = _agree_in_threads(lengths, monkeypatch)
    longest = max(lengths)
    if longest and min(lengths) == 0:  # a process without any batch has no shapes
        assert all(isinstance(e, ValueError) for e in raised), raised
        blind = [p for p, n in enumerate(lengths) if n == 0]
        assert f"the input pipeline of process{'es' if len(blind) > 1 else ''} " in str(raised[0])
        assert all(y == [] for y in yielded)
    else:
        assert raised == [None] * len(lengths)
        for p, n in enumerate(lengths):
            assert yielded[p] == [(p, i) for i in range(n)] + ["pad"] * (longest - n)
    assert store.data == {}  # every key deleted once all processes left


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("lengths", "fail_at", "steps"),
    [
        ((5, 9), {1: 2}, 2),  # process 1 fails at its 3rd batch: everyone stops there
        ((5, 9), {1: 6}, 6),  # after process 0 ran out: process 0 pads until then
        ((5, 9), {0: 0}, 0),  # before any batch
        ((9, 9), {0: 7, 1: 5}, 5),  # both fail: the first failure wins
        ((3, 9, 9), {2: 4}, 4),
    ],
)
def test_a_failing_source_stops_every_process_on_its_step(
    lengths: tuple[int, ...],
    fail_at: dict[int, int],
    steps: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    yielded, raised, store = _agree_in_threads(lengths, monkeypatch, fail_at)
    for p, error in enumerate(raised):
        assert len(yielded[p]) == steps, p
        if p in fail_at:
            assert isinstance(error, OSError), error  # its own error, traceback and all
        else:
            assert isinstance(error, RuntimeError), error
            first = min(fail_at, key=lambda q: fail_at[q])
            assert f"the input pipeline of process {first} raised an error at batch" in str(error)
            assert f"OSError: source {first} failed" in str(error)
    assert store.data == {}


@pytest.mark.timeout(60)
def test_a_process_that_never_answers_times_out_with_an_explanation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = _Store()
    monkeypatch.setattr(agreement, "_client", lambda: store)
    sync = agreement.StepSync("test/0", 2, 0, "W.fn", 0.3)  # process 1 never runs
    batcher = _Batcher()
    agreed = agreement.agreed(
        _source(0, 9, None, batcher), batcher, sync.epoch(1, threading.Event())
    )
    with pytest.raises(RuntimeError, match=r"W.fn: process 0 waited 0.3 s .* 1 of 2 processes"):
        next(agreed)


@pytest.mark.timeout(60)
def test_a_closed_iterator_stops_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _Store()
    monkeypatch.setattr(agreement, "_client", lambda: store)
    stop = threading.Event()
    sync = agreement.StepSync("test/0", 2, 0, "W.fn", 60.0)
    batcher = _Batcher()
    agreed = agreement.agreed(_source(0, 9, None, batcher), batcher, sync.epoch(1, stop))
    threading.Timer(0.3, stop.set).start()
    assert list(agreed) == []  # returned once the stop flag was seen


@pytest.mark.timeout(60)
def test_single_process_jobs_do_not_agree(mirrored8: jd.MirroredStrategy) -> None:
    x = np.arange(64, dtype=np.float32)
    before = threading.active_count()
    ds = mirrored8.distribute_datasets_from_function(
        lambda ctx: jd.data.from_arrays(x, batch_size=2)
    )
    off = jd.InputOptions(experimental_auto_shard_policy=jd.experimental.AutoShardPolicy.OFF)
    ds_off = mirrored8.experimental_distribute_dataset(jd.data.from_arrays(x, batch_size=16), off)
    for d in (ds, ds_off):
        assert d._sync is None
        assert len(list(d)) == 4
    assert threading.active_count() == before  # in-memory sources: still no thread

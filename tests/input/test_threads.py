"""Where input work runs: in-memory sources need no thread, transfers stay on the
consumer's thread, failures arrive in order, and interpreter exit never waits long on a
source stuck in user code. One iterator shared by threads serves each batch once, and
closing it wakes a consumer waiting in another thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest

import jaxdist as jd
from jaxdist.input import batching

from _helpers import in_threads


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "jaxdist-input-prefetch"]


def _batches(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    x = np.arange(n * 16 * 3, dtype=np.float32).reshape(n * 16, 3)
    y = np.arange(n * 16, dtype=np.int32)
    return [(x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16]) for i in range(n)]


@pytest.mark.parametrize("kind", ["list", "tuple", "from_arrays"])
def test_in_memory_sources_use_no_thread(mirrored8: jd.MirroredStrategy, kind: str) -> None:
    batches = _batches(5)
    source = {
        "list": batches,
        "tuple": tuple(batches),
        "from_arrays": jd.data.from_arrays(
            np.concatenate([b[0] for b in batches]),
            np.concatenate([b[1] for b in batches]),
            batch_size=16,
        ),
    }[kind]
    before = threading.active_count()
    it = iter(mirrored8.experimental_distribute_dataset(source))
    first = next(it)
    assert threading.active_count() == before
    got = [first, *it]
    assert len(got) == 5
    for (bx, by), (rx, ry) in zip(got, batches, strict=True):
        np.testing.assert_array_equal(np.asarray(bx.array).reshape(16, 3), rx)
        np.testing.assert_array_equal(np.asarray(by.array).reshape(16), ry)


def test_generator_runs_in_a_thread_and_transfers_stay_on_the_consumer(
    mirrored8: jd.MirroredStrategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    source_threads: set[str] = set()
    place_threads: set[str] = set()
    place = batching.Batcher.place

    def recording_place(self: batching.Batcher, leaves: list, counts: np.ndarray) -> object:
        place_threads.add(threading.current_thread().name)
        return place(self, leaves, counts)

    monkeypatch.setattr(batching.Batcher, "place", recording_place)

    def gen():
        for b in _batches(6):
            source_threads.add(threading.current_thread().name)
            yield b

    got = list(mirrored8.experimental_distribute_dataset(gen()))
    assert len(got) == 6
    assert source_threads == {"jaxdist-input-prefetch"}  # a slow source overlaps the step
    assert place_threads == {threading.current_thread().name}  # transfers from the consumer


def test_failures_arrive_at_the_batch_that_failed(mirrored8: jd.MirroredStrategy) -> None:
    def failing():
        yield np.zeros(8)
        yield np.ones(8)
        raise OSError("disk gone")

    for source in (failing(), [np.zeros(8), np.ones(8), np.zeros(5)]):
        opts = jd.InputOptions(partial_batches="error", experimental_per_replica_buffer_size=4)
        it = iter(mirrored8.experimental_distribute_dataset(source, opts))
        assert float(mirrored8.reduce("sum", next(it), axis=0)) == 0.0  # read ahead: no raise
        assert float(mirrored8.reduce("sum", next(it), axis=0)) == 8.0
        with pytest.raises((OSError, ValueError), match=r"disk gone|a batch of 5 rows"):
            next(it)
        with pytest.raises(StopIteration):
            next(it)


def test_threads_stop_when_iterators_are_dropped(mirrored8: jd.MirroredStrategy) -> None:
    before = len(_prefetch_threads())
    for _ in range(3):
        it = iter(mirrored8.experimental_distribute_dataset(iter(_batches(50))))
        next(it)
        del it  # collected: its thread is told to stop while it waits for credits
    deadline = time.monotonic() + 5.0
    while len(_prefetch_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_prefetch_threads()) == before


_EXIT_SCRIPT = textwrap.dedent(
    """
    import threading, time
    import numpy as np
    import jaxdist as jd

    strategy = jd.MirroredStrategy()

    def blocked():  # a source stuck in user code (a socket, a queue) that never returns
        threading.Event().wait()
        yield np.zeros((8, 2), np.float32)

    before = threading.active_count()
    iterators = [iter(strategy.experimental_distribute_dataset(blocked())) for _ in range(4)]
    time.sleep(0.2)  # every prefetch thread is now inside blocked()
    print(threading.active_count() - before, time.monotonic(), flush=True)
    """
)


@pytest.mark.timeout(60)
def test_exit_does_not_wait_on_sources_stuck_in_user_code() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=50,
        env={"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8", "PATH": "/usr/bin:/bin"},
    )
    end = time.monotonic()
    assert proc.returncode == 0, proc.stderr
    threads, before_exit = proc.stdout.split()
    assert int(threads) == 4
    assert end - float(before_exit) < 2.0  # one shared deadline (was 5 s per iterator)


def _blocking_batches(release: threading.Event, rows: np.ndarray) -> Any:
    for i in range(0, len(rows), 16):
        yield rows[i : i + 16]
    release.wait(30)  # a source that hangs after its data (a socket that stays open)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source", ["generator", "list"])
def test_one_iterator_shared_by_threads_serves_each_batch_once(
    mirrored8: jd.MirroredStrategy, source: str
) -> None:
    x = np.arange(16 * 20, dtype=np.float32)
    batches = [x[i : i + 16] for i in range(0, len(x), 16)]
    data = jd.data.from_generator(lambda: iter(batches)) if source == "generator" else batches
    ds = mirrored8.experimental_distribute_dataset(data)
    for _ in range(8):  # epochs: the end of each is where unserialized consumers hang
        it = iter(ds)
        got: list[list[np.ndarray]] = [[], [], [], []]

        def consume(k: int, it: Any = it, got: list = got) -> None:
            for b in it:
                got[k].append(np.concatenate(mirrored8.experimental_local_results(b)))

        assert in_threads(4, consume) == []  # every consumer sees the end, none hangs
        rows = np.concatenate([r for g in got for r in g])
        np.testing.assert_array_equal(np.sort(rows), x)  # each row exactly once


@pytest.mark.timeout(60)
def test_closing_an_iterator_wakes_a_consumer_waiting_in_another_thread(
    mirrored8: jd.MirroredStrategy,
) -> None:
    release = threading.Event()
    x = np.arange(32, dtype=np.float32)
    ds = mirrored8.experimental_distribute_dataset(
        jd.data.from_generator(lambda: _blocking_batches(release, x))
    )
    it = iter(ds)
    assert len([next(it), next(it)]) == 2
    ended = threading.Event()

    def wait_for_more() -> None:
        with pytest.raises(StopIteration):
            next(it)  # the source hangs: this waits until close()
        ended.set()

    t = threading.Thread(target=wait_for_more)
    t.start()
    time.sleep(0.2)
    assert not ended.is_set()
    it.close()
    t.join(10)
    release.set()
    assert ended.is_set() and not t.is_alive()

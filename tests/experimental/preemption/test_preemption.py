"""`jd.experimental.PreemptionCheckpointHandler`: TF's harness (SIGTERM at a random step, twice,
restarts through the launcher, final state bitwise equal to an uninterrupted run) with one
process and with 2 processes x 4 devices; the agreement on one step; grace period, exit_fn,
save_fn, the watcher function, total_run_calls after a restart; errors that teach."""

from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd
from jaxdist.experimental.preemption import handler as handler_module

from _helpers import REPO, run_python, run_workers, worker_script

pytest.importorskip("orbax.checkpoint")

TRAINING = REPO / "tests" / "mp_scripts" / "preemption_training.py"


def _handler(
    directory: Path, ckpt: jd.checkpoint.Checkpoint | None = None, **config: Any
) -> tuple[jd.checkpoint.Checkpoint, jd.experimental.PreemptionCheckpointHandler]:
    ckpt = ckpt if ckpt is not None else jd.checkpoint.Checkpoint(w=jnp.zeros(3))
    termination = jd.experimental.TerminationConfig(**config)
    return ckpt, jd.experimental.PreemptionCheckpointHandler(None, ckpt, directory, termination)


def _step(ckpt: jd.checkpoint.Checkpoint, pause: float = 0.01) -> Callable[[], float]:
    def step() -> float:
        ckpt.w = ckpt.w + 1.0
        time.sleep(pause)
        return float(ckpt.w[0])

    return step


def _run_until(handler: Any, step: Callable[[], Any], done: Callable[[], bool]) -> int:
    """Calls ``handler.run(step)`` until ``done()`` (at most 10 s); returns the calls made."""
    deadline, calls = time.monotonic() + 10, 0
    while not done():
        assert time.monotonic() < deadline, "the notice was not handled within 10 s"
        handler.run(step)
        calls += 1
    return calls


def _saved(directory: Path, size: int = 3) -> tuple[int, list[float]]:
    """The ``total_run_calls`` and ``w`` of the latest checkpoint in ``directory``."""
    fresh = jd.checkpoint.Checkpoint(w=jnp.zeros(size), total_run_calls=0)
    jd.checkpoint.CheckpointManager(fresh, directory).restore_or_initialize()
    return fresh.total_run_calls, np.asarray(fresh.w).tolist()


# One process, in this process ----------------------------------------------------------------


def test_run_returns_the_result_counts_calls_and_a_restart_restores_them(tmp_path: Path) -> None:
    notice, exits = threading.Event(), []
    ckpt, handler = _handler(
        tmp_path, termination_watcher_fn=notice.is_set, exit_fn=lambda: exits.append(1)
    )
    assert handler.restored_from is None and handler.total_run_calls == 0
    step = _step(ckpt)
    with handler.watch_preemption_scope():  # a pass-through, as in TF
        assert [handler.run(step) for _ in range(4)] == [1.0, 2.0, 3.0, 4.0]
    assert handler.total_run_calls == 4 and ckpt.total_run_calls == 4
    assert handler.run(lambda a, b=0: (a, b), 7, b=8) == (7, 8)  # args and kwargs pass through
    notice.set()
    _run_until(handler, step, lambda: bool(exits))
    count, w = _saved(tmp_path)
    # Saved at the start of the call after the notice (TF's moment): the count and state of
    # the calls before it (each step adds 1 to w; the lambda call above added nothing); that
    # call ran once exit_fn returned.
    assert count == handler.total_run_calls - 1 and w == [count - 1.0] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1", "jaxdist_checkpoints.json"]
    # A restarted job: new objects, a new handler over the directory restores everything.
    again, restarted = _handler(tmp_path, termination_watcher_fn=lambda: False)
    assert restarted.restored_from == str(tmp_path / "ckpt-1")
    assert restarted.total_run_calls == count and again.total_run_calls == count
    assert np.asarray(again.w).tolist() == w


def test_an_exit_fn_that_returns_lets_training_go_on_and_watch_again(tmp_path: Path) -> None:
    notice, exits = threading.Event(), []

    def exit_fn() -> None:  # returns: training goes on; the next notice saves again
        exits.append(handler.total_run_calls)
        notice.clear()

    ckpt, handler = _handler(tmp_path, termination_watcher_fn=notice.is_set, exit_fn=exit_fn)
    step = _step(ckpt)
    notice.set()
    _run_until(handler, step, lambda: len(exits) == 1)
    for _ in range(3 * int(handler_module.WATCH_INTERVAL_S / 0.01)):  # no notice: no save
        handler.run(step)
    assert len(exits) == 1 and ckpt.save_counter == 1
    notice.set()
    _run_until(handler, step, lambda: len(exits) == 2)
    assert ckpt.save_counter == 2 and _saved(tmp_path)[0] == exits[1] > exits[0]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")] == ["ckpt-2"]


def test_the_default_exit_fn_exits_with_42_after_saving(tmp_path: Path) -> None:
    ckpt, handler = _handler(tmp_path, termination_watcher_fn=lambda: True)
    with pytest.raises(SystemExit) as exited:
        _run_until(handler, _step(ckpt), lambda: False)
    assert exited.value.code == 42
    # Saved at the start of a call, which then never ran: the count and its state.
    count, w = _saved(tmp_path)
    assert count == handler.total_run_calls and w == [float(count)] * 3


def test_an_asynchronous_manager_is_written_before_exit_fn(tmp_path: Path) -> None:
    # A planted bug called exit_fn while the background write ran; no test used an
    # asynchronous manager, so a restart could find no checkpoint.
    ckpt = jd.checkpoint.Checkpoint(w=jnp.zeros(4_000_000))  # 16 MB: the write takes a while
    manager = jd.checkpoint.CheckpointManager(ckpt, tmp_path, enable_async_checkpointing=True)
    seen: list[tuple[list[str], bool]] = []

    def exit_fn() -> None:  # what a restarted job would find on disk now
        entries = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt"))
        complete = (tmp_path / "ckpt-1" / "jaxdist_checkpoint.json").exists()
        seen.append((entries, complete))

    handler = jd.experimental.PreemptionCheckpointHandler(
        None, manager, None,
        jd.experimental.TerminationConfig(termination_watcher_fn=lambda: True, exit_fn=exit_fn),
    )  # fmt: skip
    _run_until(handler, _step(ckpt, pause=0.0), lambda: bool(seen))
    assert seen == [(["ckpt-1"], True)]
    assert _saved(tmp_path, size=4_000_000)[0] == handler.total_run_calls - 1


def test_save_fn_replaces_the_save(tmp_path: Path) -> None:
    seen: list[int] = []
    ckpt, handler = _handler(
        tmp_path / "c",
        termination_watcher_fn=lambda: True,
        save_fn=lambda: seen.append(ckpt.total_run_calls),
        exit_fn=lambda: None,
    )
    _run_until(handler, _step(ckpt), lambda: bool(seen))
    # The item is up to date when save_fn runs, at the start of the last call (which ran
    # once exit_fn returned).
    assert seen == [handler.total_run_calls - 1]
    assert not (tmp_path / "c").exists()  # the handler saved nothing itself


def test_grace_period_saves_trains_on_and_saves_again_before_the_deadline(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    grace = 2.0
    notice, exits = threading.Event(), []
    ckpt, handler = _handler(
        tmp_path,
        termination_watcher_fn=notice.is_set,
        grace_period=grace,
        exit_fn=lambda: exits.append((time.monotonic(), handler.total_run_calls)),
    )
    step = _step(ckpt, pause=0.02)
    for _ in range(5):
        handler.run(step)
    notice.set()
    noticed_by = time.monotonic() + handler_module.WATCH_INTERVAL_S  # the watcher's latency
    _run_until(handler, step, lambda: bool(exits))
    (exited_at, final), err = exits[0], capfd.readouterr().err
    first = int(re.search(r"ckpt-1 after run\(\) call (\d+); training on for the grace", err)[1])
    assert f"saved {tmp_path / 'ckpt-2'} after run() call {final}; calling exit_fn." in err
    assert ckpt.save_counter == 2 and _saved(tmp_path)[0] == final
    assert final - first >= 10  # it trained on between the two saves
    # The final save leaves the first save's time plus three steps before the deadline;
    # generous bounds for a loaded machine.
    assert exited_at <= noticed_by + grace + 1.0
    assert exited_at >= noticed_by - handler_module.WATCH_INTERVAL_S + grace - 1.0


def test_a_raising_watcher_fn_is_reported_by_run(tmp_path: Path) -> None:
    def broken() -> bool:
        raise OSError("metadata server unreachable")

    ckpt, handler = _handler(tmp_path, termination_watcher_fn=broken)
    with pytest.raises(RuntimeError, match=r"termination_watcher_fn raised OSError: metadata"):
        _run_until(handler, _step(ckpt), lambda: False)


# Errors -------------------------------------------------------------------------------------

Config = jd.experimental.TerminationConfig


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda d: Config(exit_fn=42), TypeError, r"TerminationConfig: exit_fn must be a function"),
        (lambda d: Config(grace_period="1"), TypeError, r"grace_period must be a number of sec"),
        (lambda d: Config(grace_period=-1), ValueError, r"grace_period must be finite and >= 0"),
        (
            lambda d: jd.experimental.PreemptionCheckpointHandler(
                "worker", jd.checkpoint.Checkpoint(), d
            ),
            TypeError,
            r"PreemptionCheckpointHandler: cluster_resolver must be a jaxdist.cluster_resolver",
        ),
        (
            lambda d: jd.experimental.PreemptionCheckpointHandler(None, {"w": 1}, d),
            TypeError,
            r"checkpoint_or_checkpoint_manager must be a jaxdist.checkpoint.Checkpoint or Check",
        ),
        (
            lambda d: jd.experimental.PreemptionCheckpointHandler(None, jd.checkpoint.Checkpoint()),
            ValueError,
            r"checkpoint_dir is required with a Checkpoint \(the handler makes CheckpointManager",
        ),
        (
            lambda d: jd.experimental.PreemptionCheckpointHandler(
                None, jd.checkpoint.CheckpointManager(jd.checkpoint.Checkpoint(), d), d / "other"
            ),
            ValueError,
            r"checkpoint_dir='.*other' differs from the directory of the CheckpointManager",
        ),
        (
            lambda d: jd.experimental.PreemptionCheckpointHandler(
                None, jd.checkpoint.Checkpoint(), d, {"grace_period": 3}
            ),
            TypeError,
            r"termination_config must be a jaxdist.experimental.TerminationConfig or None, got d",
        ),
        (
            lambda d: jd.experimental.PreemptionCheckpointHandler(
                jd.cluster_resolver.SimpleClusterResolver(
                    jd.cluster_resolver.ClusterSpec({"worker": ["a:1", "b:1"]}),
                    task_type="worker",
                    task_id=0,
                ),
                jd.checkpoint.Checkpoint(),
                d,
            ),
            RuntimeError,
            r"the cluster resolver describes 2 processes, but jax.distributed is not running",
        ),
    ],
)
def test_bad_arguments_name_the_argument(
    tmp_path: Path, make: Callable[[Path], Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        make(tmp_path)


def test_a_checkpoint_the_handler_did_not_write_is_refused(tmp_path: Path) -> None:
    jd.checkpoint.CheckpointManager(jd.checkpoint.Checkpoint(w=jnp.zeros(3)), tmp_path).save()
    with pytest.raises(ValueError, match=r"has no 'total_run_calls' item, so it was not saved"):
        _handler(tmp_path, termination_watcher_fn=lambda: False)


def test_sigterm_needs_the_main_thread(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def make() -> None:
        try:
            jd.experimental.PreemptionCheckpointHandler(None, jd.checkpoint.Checkpoint(), tmp_path)
        except ValueError as e:
            errors.append(e)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert "signal handlers only in the main thread; create the handler in the main" in str(
        errors[0]
    )


_CHAINED = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import jax.numpy as jnp
    import jaxdist as jd

    calls = []
    signal.signal(signal.SIGTERM, lambda s, f: calls.append(s))  # the program's own handler
    ckpt = jd.checkpoint.Checkpoint(w=jnp.zeros(2))
    exits = []
    handler = jd.experimental.PreemptionCheckpointHandler(
        None, ckpt, sys.argv[1],
        jd.experimental.TerminationConfig(exit_fn=lambda: exits.append(handler.total_run_calls)))
    def step():
        ckpt.w = ckpt.w + 1.0
    for _ in range(3):
        handler.run(step)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)  # the Python handler runs between bytecodes of the main thread
    handler.run(step)
    after_4 = list(exits)
    handler.run(step)
    print(json.dumps({"calls": calls, "exits": exits, "after_4": after_4, "w": ckpt.w.tolist()}))
    """
)


@pytest.mark.timeout(120)
def test_sigterm_saves_before_the_next_step_and_calls_the_previous_handler(
    tmp_path: Path,
) -> None:
    # The SIGTERM came after 3 steps. As TF's local mode (step to save at = run_counter + 1):
    # the 4th call runs, the 5th saves the 4 steps first, then runs its step once exit_fn
    # returned.
    out = run_python(_CHAINED, str(tmp_path), devices=1)
    want = {"calls": [signal.SIGTERM], "exits": [4], "after_4": [], "w": [5.0, 5.0]}
    assert out == want
    assert _saved(tmp_path, size=2) == (4, [4.0, 4.0])


# Several processes: the agreement ------------------------------------------------------------

_AGREE = worker_script(
    """
    import threading, time
    import jax.numpy as jnp
    import jaxdist as jd

    me = jax.process_index()
    strategy = jd.MultiWorkerMirroredStrategy()
    with strategy.scope():
        w = jd.Variable(jnp.zeros(()), aggregation="sum")
    ckpt = jd.checkpoint.Checkpoint(w=w)
    notice = threading.Event()  # only process 1 gets a notice
    exits = []
    handler = jd.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, ckpt, sys.argv[3],
        jd.experimental.TerminationConfig(
            termination_watcher_fn=notice.is_set,
            exit_fn=lambda: exits.append(handler.total_run_calls)))

    @strategy.function
    def add(ctx, w):
        return ctx.assign_add(w, 1.0)

    def step():
        ckpt.w = add(ckpt.w)
        return float(ckpt.w.read_value())

    # The cost of run() while no notice is under way: one key-value request per call.
    n = 300
    start = time.perf_counter()
    for _ in range(n):
        handler.run(int)
    per_call = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for _ in range(n):
        int()
    per_call -= (time.perf_counter() - start) / n

    noticed_at = None
    while not exits:
        handler.run(step)
        if me == 1 and handler.total_run_calls == n + 5:
            notice.set()
            noticed_at = handler.total_run_calls
        time.sleep(0.01)
    print(json.dumps({"per_call": per_call, "exit_at": exits[0], "w": step(),
                      "noticed_at": noticed_at}))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_processes_save_after_the_same_step(tmp_path: Path) -> None:
    results = run_workers(_AGREE.replace("sys.argv[3]", repr(str(tmp_path))))
    exit_at = results[0]["exit_at"]
    assert results[1]["exit_at"] == exit_at  # one step for both
    assert exit_at > results[1]["noticed_at"]  # after the notice, at a step boundary
    n = 300  # calls before the training steps
    # The reference: w counts the steps (each adds 1 on each of the 8 replicas, summed).
    # The save came at the start of the call after exit_at; that call's step ran once
    # exit_fn returned, and the script's final step() is one more.
    for r in results:
        assert r["w"] == 8.0 * (exit_at - n + 2)
    count, saved = _saved_scalar(tmp_path)
    assert count == exit_at and saved == 8.0 * (exit_at - n)
    for r in results:
        assert r["per_call"] < 0.02, r["per_call"]  # measured about 0.3 ms on 2 loaded cores
    print("run() cost per call, 2 processes:", [f"{r['per_call'] * 1e3:.2f} ms" for r in results])


_GRACE = worker_script(
    """
    import threading, time
    import jax.numpy as jnp
    import jaxdist as jd

    strategy = jd.MultiWorkerMirroredStrategy()
    ckpt = jd.checkpoint.Checkpoint(w=jnp.zeros(()))
    manager = jd.checkpoint.CheckpointManager(ckpt, DIRECTORY, max_to_keep=None)
    notice = threading.Event()  # only process 0 gets a notice, with 2 s to go
    saves, exits = [], []

    def save():  # save_fn: the manager's save, recording when
        saves.append(handler.total_run_calls)
        manager.save()

    handler = jd.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, manager, None,
        jd.experimental.TerminationConfig(
            termination_watcher_fn=notice.is_set, grace_period=2.0, save_fn=save,
            exit_fn=lambda: exits.append((time.monotonic(), handler.total_run_calls))))

    @strategy.function
    def add(ctx, w):
        return w + ctx.all_reduce("sum", 1.0)

    def step():
        ckpt.w = add(ckpt.w)

    while not exits:
        handler.run(step)
        if jax.process_index() == 0 and handler.total_run_calls == 5:
            notice.set()
            set_at = time.monotonic()
        time.sleep(0.02)
    out = {"saves": saves, "exit_at": exits[0][1], "w": float(ckpt.w)}
    if jax.process_index() == 0:
        out["exit_after_s"] = exits[0][0] - set_at
    print(json.dumps(out))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_processes_grace_period_saves_twice_at_agreed_steps(tmp_path: Path) -> None:
    results = run_workers(_GRACE.replace("DIRECTORY", repr(str(tmp_path))))
    first, final = results[0]["saves"]
    # Training went on between the two saves (how many steps depends on the machine's load).
    assert results[1]["saves"] == [first, final] and final > first
    assert results[0]["exit_at"] == results[1]["exit_at"] == final
    # Process 0's notice came within the watcher's 0.5 s of the event; the last save leaves
    # about three steps and a save's time before the 2 s are up (generous bounds).
    assert 1.0 <= results[0]["exit_after_s"] <= 2.0 + 0.5 + 1.5, results[0]
    # w counts the steps; the call that saved ran its step once exit_fn returned.
    assert results[0]["w"] == results[1]["w"] == 8.0 * (final + 1)
    # The manager given was used: both saves are there, the last one holds the last step.
    again = jd.checkpoint.Checkpoint(w=jnp.zeros(()), total_run_calls=0)
    manager = jd.checkpoint.CheckpointManager(again, tmp_path, max_to_keep=None)
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-1", "ckpt-2"]
    manager.restore_or_initialize()
    assert again.total_run_calls == final and float(again.w) == 8.0 * final


def _saved_scalar(directory: Path) -> tuple[int, float]:
    with jd.MirroredStrategy().scope():
        w = jd.Variable(jnp.zeros(()), aggregation="sum")
    fresh = jd.checkpoint.Checkpoint(w=w, total_run_calls=0)
    jd.checkpoint.CheckpointManager(fresh, directory).restore_or_initialize()
    return fresh.total_run_calls, float(fresh.w.read_value())


# TF's harness, through the launcher -----------------------------------------------------------


class _Job:
    """A launcher running the harness script; its output lines, read in the background."""

    def __init__(self, nprocs: int, out: Path, *extra: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env["JAXDIST_HEARTBEAT_TIMEOUT"] = "10"
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "jaxdist.launch", "--nprocs", str(nprocs),
                "--devices-per-proc", str(8 // nprocs), "--max-restarts", "1",
                str(TRAINING), str(out / "ckpt"), str(out / "final"), *extra,
            ],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
        )  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self._queue: queue.Queue[tuple[float, str]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, pipe: IO[str]) -> None:
        for line in pipe:
            self._queue.put((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern: str, timeout: float = 120) -> tuple[float, re.Match[str]]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                at, line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                # The launcher's own lines and the START lines first (a restart the test did
                # not cause shows there), then the last lines.
                marks = [ln for _, ln in self.lines if ln.startswith("jaxdist.") or " START " in ln]
                text = "\n".join(line for _, line in self.lines[-40:])
                raise AssertionError(
                    f"no line matches {pattern!r}; launcher and START lines:\n"
                    + "\n".join(marks[-20:])
                    + f"\nlast lines:\n{text}"
                ) from None
            self.lines.append((at, line))
            if m := re.search(pattern, line):
                return at, m

    def finish(self, timeout: float = 120) -> str:
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        while not self._queue.empty():
            self.lines.append(self._queue.get())
        return "\n".join(line for _, line in self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def jobs() -> Iterator[list[_Job]]:
    started: list[_Job] = []
    yield started
    for job in started:
        job.kill()


def _preempted_twice(
    job: _Job, nprocs: int, rng: random.Random, after: tuple[int, int]
) -> list[dict[str, Any]]:
    """SIGTERMs a random process ``after[r]`` steps into run ``r``, for the first run and
    the one after the restart (the job was started with ``--slow-after`` of them)."""
    events = []
    resumed = 0
    for restart in range(2):
        pids = {}
        for _ in range(nprocs):
            _, m = job.wait_for(rf"^\[(\d)\] START {restart} (\d+) (\d+)$")
            pids[int(m[1])] = int(m[2])
            assert int(m[3]) == resumed  # every process restored the same count
        at_step = resumed + after[restart]
        victim = rng.randrange(nprocs)
        job.wait_for(rf"^\[{victim}\] STEP {at_step}$")
        os.kill(pids[victim], signal.SIGTERM)
        killed_at = time.monotonic()
        saved_at, m = job.wait_for(r"saved .*ckpt-(\d+) after run\(\) call (\d+); calling exit")
        exited_at, ended = job.wait_for(
            r"^jaxdist.launch: process \d exited with code 42 \(first.*"
        )
        # Whichever process exits first, the launcher names the one that got the notice.
        assert f"; process {victim} got the termination notice;" in ended[0], ended[0]
        resumed = int(m[2])
        assert at_step <= resumed <= at_step + 25, (at_step, resumed)  # soon after the notice
        events.append({
            "step": at_step, "victim": victim, "saved": resumed,
            "to_save_s": saved_at - killed_at, "to_exit_s": exited_at - killed_at,
        })  # fmt: skip
    for _ in range(nprocs):
        _, m = job.wait_for(r"^\[\d\] START 2 \d+ (\d+)$")
        assert int(m[1]) == resumed
    return events


def _same_bits(a_dir: Path, b_dir: Path, nprocs: int) -> None:
    for p in range(nprocs):
        a, b = np.load(a_dir / f"final.{p}.npz"), np.load(b_dir / f"final.{p}.npz")
        assert sorted(a) == sorted(b) and len(a) >= 10
        for key in a:
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # bitwise


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs", [1, 2], ids=["1_process", "2_processes_x_4"])
def test_preempted_twice_resumes_to_the_bits_of_an_uninterrupted_run(
    tmp_path: Path, jobs: list[_Job], nprocs: int
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    reference = _Job(nprocs, tmp_path / "reference")
    jobs.append(reference)
    out = reference.finish(timeout=200)
    assert reference.proc.returncode == 0, out[-3000:]

    # From the signal's step on, a run's steps take 1 s: the signal lands before the end.
    after = (rng.randint(3, 40), rng.randint(3, 40))
    slow = ("--sleep", "0.02", "--slow-after", f"{after[0]},{after[1]}")
    job = _Job(nprocs, tmp_path / "preempted", *slow)
    jobs.append(job)
    events = _preempted_twice(job, nprocs, rng, after)
    out = job.finish(timeout=200)
    assert job.proc.returncode == 0, f"seed {seed}: {out[-3000:]}"
    # Two preemptions under --max-restarts 1: neither was counted.
    assert out.count("(first failure: preempted)") == 2
    assert "after preemption 2, not counted against --max-restarts 1" in out
    assert len(re.findall(r"^\[\d\] DONE 120$", out, re.M)) == nprocs
    kept = sorted(os.listdir(tmp_path / "preempted" / "ckpt"))  # max_to_keep=1
    assert kept == ["ckpt-2", "jaxdist_checkpoints.json"], kept
    _same_bits(tmp_path / "reference" / "final", tmp_path / "preempted" / "final", nprocs)
    print(f"seed {seed}, {nprocs} process(es):", json.dumps(events))

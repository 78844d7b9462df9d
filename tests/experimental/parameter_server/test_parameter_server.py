"""ParameterServerStrategy and ClusterCoordinator on a local Ray runtime (CPU).

One Ray runtime (loopback, no dashboard) and one 2 PS x 3 worker strategy serve the whole
module; the test that kills a parameter server makes its own small strategy. References:
NumPy's least-squares solution (async SGD must reach it within 1e-3) and exact counts of
closures (integers).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import itertools
import json
import logging
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd

ray = pytest.importorskip("ray")

from jaxdist.experimental.coordinator import (  # noqa: E402
    ClusterCoordinator,
    PerWorkerValues,
    RemoteValue,
)
from jaxdist.experimental.parameter_server._ray import address_file  # noqa: E402
from jaxdist.experimental.partitioners import FixedShardsPartitioner  # noqa: E402

from _helpers import REPO  # noqa: E402

# Ray and the Server test start processes with subprocess (fork, then exec at once), which
# JAX warns about once its backend runs; it does not apply to fork + exec.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning"),
]


def _resolver(workers: int, ps: int) -> jd.cluster_resolver.SimpleClusterResolver:
    spec = {"chief": ["c0"], "worker": [f"w{i}" for i in range(workers)]}
    spec["ps"] = [f"p{i}" for i in range(ps)]
    return jd.cluster_resolver.SimpleClusterResolver(
        jd.cluster_resolver.ClusterSpec(spec), rpc_layer="ray"
    )


# Ray's ports, pinned. Ray picks most of its ports at random among the free ones (Linux's
# ephemeral range, 32768-60999, where the other tests' job coordinators get theirs from
# `free_port`) and a few at fixed defaults (the dashboard agent's 52365, the autoscaler
# monitor's 44217), so a Ray runtime beside another test's job, or beside another Ray on the
# machine, can lose a race for a port and fail. The module's runtime and the Server test's
# node take every port from a block of consecutive ports below the ephemeral range and
# above Ray's default worker ports (10002-19999), each block checked free when chosen.
PORT_RANGE = (20000, 32768)
WORKER_PORTS = 48  # the actors of the module's strategies, the driver, idle workers
FIRST_WORKER_PORT = 16  # the servers' ports come before it in a block


@dataclasses.dataclass(frozen=True)
class Ports:
    """A block of ``count`` consecutive ports from ``base``."""

    base: int
    count: int

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.base <= port < self.base + self.count

    @property
    def workers(self) -> tuple[int, int]:
        """The first and last port of the workers' range."""
        return self.base + FIRST_WORKER_PORT, self.base + self.count - 1


def _free_block(count: int) -> Ports:
    """``count`` consecutive ports in `PORT_RANGE`, every one free now on every interface."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(PORT_RANGE[0], PORT_RANGE[1] - count)
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("", port))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return Ports(base, count)
    raise RuntimeError(f"no {count} consecutive free ports in {PORT_RANGE}")


@contextlib.contextmanager
def _pinned_head(ports: Ports) -> Iterator[dict[str, int]]:
    """For the length of the block, a `ray.init` that starts a head node takes its ports
    from ``ports``; yields the ones ``ray.init`` takes as arguments. `ray.init` passes the
    node's RayParams no port of the servers and agents, so this fills them in (checked by
    `test_ray_listens_only_on_its_pinned_ports`); the autoscaler monitor reads its port
    from the environment it starts with."""
    from ray._private import parameter

    servers = (
        "gcs_server_port", "node_manager_port", "object_manager_port", "metrics_agent_port",
        "dashboard_agent_listen_port", "runtime_env_agent_port",
    )  # fmt: skip
    pinned = {name: ports.base + i for i, name in enumerate(servers)}
    pinned["min_worker_port"], pinned["max_worker_port"] = ports.workers
    original = parameter.RayParams

    class PinnedRayParams(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, **pinned})

    monitor = os.environ.get("AUTOSCALER_METRIC_PORT")
    os.environ["AUTOSCALER_METRIC_PORT"] = str(ports.base + 8)
    parameter.RayParams = PinnedRayParams
    try:
        yield {"dashboard_port": ports.base + 6, "_metrics_export_port": ports.base + 7}
    finally:
        parameter.RayParams = original
        if monitor is None:
            del os.environ["AUTOSCALER_METRIC_PORT"]
        else:
            os.environ["AUTOSCALER_METRIC_PORT"] = monitor


def _listening(root: Any) -> list[tuple[str, int]]:
    """(process name, port) of every listening TCP socket of ``root`` (a psutil.Process)
    and its descendants."""
    import psutil

    found = []
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # a process that ended meanwhile
            name = proc.name()
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.append((name, conn.laddr.port))
    return found


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[Ports | None]:
    """The module's Ray runtime on pinned ports (None when Ray was running already), its
    files in a private temporary directory (removed at the end); afterwards Ray's default
    directory must not name it (a record left there makes a user's later
    ``ray.init(num_cpus=...)`` try to join the stopped cluster)."""
    started = not ray.is_initialized()
    temp_dir = tempfile.mkdtemp(prefix="jdray")  # short: Ray's socket paths must fit
    head = ports = None
    try:
        if started:
            ports = _free_block(FIRST_WORKER_PORT + WORKER_PORTS)
            with _pinned_head(ports) as init_ports:
                ray.init(
                    address="local",
                    include_dashboard=False,
                    num_cpus=2,
                    _node_ip_address="127.0.0.1",
                    _temp_dir=temp_dir,
                    configure_logging=False,
                    **init_ports,
                )
            head = ray.get_runtime_context().gcs_address
        yield ports
    finally:
        if started:  # the test module's own runtime
            ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert head is None or _recorded_cluster() != head, f"{address_file()} still names {head}"


def _recorded_cluster() -> str | None:
    """The cluster address `ray start` recorded in Ray's default temp directory, if any."""
    try:
        with open(address_file()) as f:
            return f.read().strip()
    except OSError:
        return None


@pytest.fixture(scope="module")
def strategy(ray_runtime: Ports | None) -> Iterator[Any]:
    s = jd.experimental.ParameterServerStrategy(_resolver(3, 2))
    yield s
    s._shutdown()


def _least_squares_problem() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype(np.float32)
    y = (x @ np.array([1.5, -2.0, 0.5, 3.0], np.float32) + 0.7).astype(np.float32)
    y += 0.1 * rng.normal(size=256).astype(np.float32)
    solution = np.linalg.lstsq(np.c_[x, np.ones(256)], y, rcond=None)[0]
    return x, y, solution


def _sgd_step(strategy: Any, lr: float) -> Any:
    """A step that returns the variables it updates (jaxdist's functional habit)."""

    def step(ctx: Any, w: Any, b: Any, count: Any, x: Any, y: Any) -> Any:
        def loss(w: Any, b: Any) -> Any:
            return jnp.mean((x @ w + b - y) ** 2)

        value, (gw, gb) = jax.value_and_grad(loss, argnums=(0, 1))(w.read_value(), b.read_value())
        return (
            w.assign_sub(lr * gw),  # a sharded variable updates shard by shard
            ctx.assign_sub(b, lr * gb),
            ctx.assign_add(count, 1),
            value,
        )

    return strategy.function(step)


def _tf_style_step(strategy: Any, lr: float) -> Any:
    """TF's step: the updates go through ctx.assign*, only the loss is returned."""

    def step(ctx: Any, w: Any, b: Any, count: Any, x: Any, y: Any) -> Any:
        def loss(w: Any, b: Any) -> Any:
            return jnp.mean((x @ w + b - y) ** 2)

        value, (gw, gb) = jax.value_and_grad(loss, argnums=(0, 1))(w.read_value(), b.read_value())
        ctx.assign_sub(w, lr * gw)  # w is a ShardedVariable (FixedShardsPartitioner(2))
        ctx.assign_sub(b, lr * gb)
        ctx.assign_add(count, 1)
        return value

    return strategy.function(step)


def _model(strategy: Any) -> tuple[Any, Any, Any]:
    with strategy.scope():
        w = jd.Variable(
            jnp.zeros(4), aggregation="sum", name="w", partitioner=FixedShardsPartitioner(2)
        )
        b = jd.Variable(0.0, aggregation="sum", name="b")
        count = jd.Variable(
            0, synchronization="on_read", aggregation="sum", trainable=False, name="count"
        )
    return w, b, count


def test_strategy_and_variables(strategy: Any) -> None:
    ext = strategy.extended
    assert len(ext.worker_actors) == 3 and len(ext.ps_actors) == 2
    assert strategy.cluster_resolver.cluster_spec().num_tasks("ps") == 2
    assert hash(strategy) == hash(strategy) and {strategy: 1}[strategy] == 1
    with pytest.raises(Exception, match="immutable"):
        strategy.foo = 1
    with strategy.scope():
        a = jd.Variable(np.arange(6.0).reshape(3, 2), name="a")
        b = jd.Variable(1, name="a")  # same name: made unique
        t = jd.Variable(
            np.arange(20, dtype=np.float32).reshape(10, 2), partitioner=FixedShardsPartitioner(3)
        )
    # TF's contract: a tf.distribute.Strategy holding tf.Variables (a ShardedVariable when
    # partitioned).
    assert isinstance(strategy, jd.Strategy) and strategy.num_replicas_in_sync == 1
    assert isinstance(a, jd.Variable) and isinstance(t, jd.experimental.ShardedVariable)
    assert all(isinstance(v, jd.Variable) for v in t.variables)
    assert strategy.extended.variable_created_in_scope(a) and a.strategy is strategy
    assert strategy.extended.parameter_devices == (
        "/job:ps/replica:0/task:0",
        "/job:ps/replica:0/task:1",
    )
    assert copy.deepcopy(a) is a and pickle.loads(pickle.dumps(a)).strategy is strategy
    with pytest.raises(RuntimeError, match=r"ParameterServerStrategy.run: .* runs on a worker"):
        strategy.run(lambda ctx: 1.0)
    assert a.name == "a" and b.name == "a_1"
    assert {a.device, b.device} == {"/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"}
    assert [v.shape for v in t.variables] == [(4, 2), (3, 2), (3, 2)]
    devices = [v.device for v in t.variables]
    assert devices[0] != devices[1] and devices[0] == devices[2]  # round-robin per shard
    np.testing.assert_array_equal(np.asarray(t), np.arange(20).reshape(10, 2))
    np.testing.assert_array_equal(np.asarray(a.assign_add(1.0)), np.arange(6.0).reshape(3, 2) + 1)
    assert int(b) == 1 and b.dtype == np.int32
    # jd.checkpoint takes them as it takes any jd.Variable: the values on the servers.
    saved = jd.checkpoint.to_saveable({"a": a, "t": t})
    np.testing.assert_array_equal(saved["t"], np.arange(20).reshape(10, 2))
    a.assign(np.zeros((3, 2)))
    t.assign(np.zeros((10, 2)))
    back = jd.checkpoint.from_saveable(saved, {"a": a, "t": t})
    assert back["a"] is a and back["t"] is t
    np.testing.assert_array_equal(np.asarray(a), np.arange(6.0).reshape(3, 2) + 1)
    np.testing.assert_array_equal(np.asarray(t), np.arange(20).reshape(10, 2))


def test_ray_listens_only_on_its_pinned_ports(ray_runtime: Ports | None, strategy: Any) -> None:
    """Every port the module's runtime listens on (its servers and agents, the workers of the
    strategy's actors, this driver) is in the block the fixture pinned."""
    import psutil

    assert ray_runtime is not None, "Ray was running before this module: its ports are not ours"
    listening = _listening(psutil.Process())
    assert {"gcs_server", "raylet"} <= {name for name, _ in listening}, listening
    assert len(listening) >= 2 + len(strategy.extended.worker_actors), listening
    outside = [(name, port) for name, port in listening if port not in ray_runtime]
    assert not outside, f"listening outside {ray_runtime}: {outside}"


def test_coordinator_is_one_per_strategy(strategy: Any) -> None:
    c = ClusterCoordinator(strategy)
    assert ClusterCoordinator(strategy) is c and c.strategy is strategy
    assert jd.experimental.coordinator.ClusterCoordinator is ClusterCoordinator


def test_schedule_refuses_uncompiled_functions_and_remote_values(strategy: Any) -> None:
    c = ClusterCoordinator(strategy)
    with pytest.raises(TypeError, match=r"schedule.*strategy\.function"):
        c.schedule(lambda x: x, args=(1.0,))
    rv = c.schedule(jax.jit(lambda x: x * 2), args=(np.float32(3.0),))
    with pytest.raises(
        ValueError, match=r"RemoteValue cannot be an argument \(at args\[0\]\['k'\]"
    ):
        c.schedule(jax.jit(lambda x: x), args=({"k": rv},))
    c.join()
    assert c.done()
    assert float(rv.fetch()) == 6.0 and float(rv.get()) == 6.0
    with pytest.raises(RuntimeError, match="schedule"):
        strategy.function(lambda ctx, x: x)(1.0)


def test_async_sgd_converges_to_least_squares(strategy: Any) -> None:
    x, y, solution = _least_squares_problem()
    c = ClusterCoordinator(strategy)
    # TF's step (updates through ctx.assign*, nothing returned) and jaxdist's (the updated
    # variables returned as well): each update is applied once either way.
    for returns in (False, True):
        w, b, count = _model(strategy)
        step = (_sgd_step if returns else _tf_style_step)(strategy, lr=0.1)
        results = [c.schedule(step, args=(w, b, count, x, y)) for _ in range(150)]
        c.join()
        losses = [float(r.fetch()[3] if returns else r.fetch()) for r in results]
        assert losses[-1] < losses[0]
        np.testing.assert_allclose(np.asarray(w), solution[:4], atol=1e-3)
        np.testing.assert_allclose(float(b), solution[4], atol=1e-3)
        assert int(count) == 150  # every closure ran exactly once (no worker died)
    fetched = results[0].fetch()
    assert fetched[0] is not None and fetched[0].variables[0].device.startswith("/job:ps")


def test_basic_variable_assignment(strategy: Any) -> None:
    """TF's BasicVariableAssignment: assign_add / assign_sub inside the scheduled function
    reach the parameter servers; the function returns a plain value."""
    with strategy.scope():
        v1 = jd.Variable(0.0)
        v2 = jd.Variable(1.0)

    @strategy.function
    def worker_fn(ctx: Any, v1: Any, v2: Any) -> Any:
        a = ctx.assign_add(v1, 0.1)
        b = v2.assign_sub(0.2)  # the variable's own method goes through the same context
        return a.read_value() / b.read_value()

    c = ClusterCoordinator(strategy)
    result = c.schedule(worker_fn, args=(v1, v2))
    assert abs(float(c.fetch(result)) - 0.125) < 1e-6
    assert abs(float(v1) - 0.1) < 1e-6 and abs(float(v2) - 0.8) < 1e-6


def test_killed_worker_closures_rescheduled_and_worker_restarted(strategy: Any) -> None:
    """TF's WorkerPreemptionMidstFunction: a worker killed while closures run; its running
    closure is rescheduled, Ray restarts it, and training still reaches the least-squares
    solution (1e-3); every closure ran at least once."""
    x, y, solution = _least_squares_problem()
    w, b, count = _model(strategy)
    c = ClusterCoordinator(strategy)
    step = _sgd_step(strategy, lr=0.05)
    victim = strategy.extended.worker_actors[0]
    pid = ray.get(victim.ping.remote())
    restarted = c._queue.restarted
    results = [c.schedule(step, args=(w, b, count, x, y)) for _ in range(300)]
    deadline = time.monotonic() + 60
    while c._queue.completed < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    ray.kill(victim, no_restart=False)
    c.join()
    for r in results:  # none lost
        r.fetch()
    assert ray.get(victim.ping.remote(), timeout=60) != pid  # Ray restarted it
    assert int(count) >= 300  # at least once
    assert c._queue.restarted > restarted  # its running closure was put back
    np.testing.assert_allclose(np.asarray(w), solution[:4], atol=1e-3)
    np.testing.assert_allclose(float(b), solution[4], atol=1e-3)


def _wait_for(condition: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _ping(actor: Any) -> int | None:
    """The actor's process id, or None while Ray restarts it."""
    try:
        return int(ray.get(actor.ping.remote(), timeout=30))
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def _gated(gate: str, message: str | None) -> Any:
    """A function that, when traced on a worker, waits for the file ``gate`` and then
    raises ``message`` (``None``: returns the sum). Each argument shape traces anew."""

    def fn(ctx: Any, x: Any) -> Any:
        deadline = time.monotonic() + 120
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        if message is not None:
            raise ValueError(message)
        return jnp.sum(x)

    return fn


def test_cancellation_and_in_flight_errors_are_one_error(strategy: Any, tmp_path: Any) -> None:
    """TF's Cancellation and its error rules: the first error is raised once, by join, only
    when no closure runs; another closure failing meanwhile is part of that error (a note),
    not raised again; the queued closures are cancelled; the running ones finish."""
    c = ClusterCoordinator(strategy)
    first_gate, others_gate = str(tmp_path / "first"), str(tmp_path / "others")
    fails = strategy.function(_gated(first_gate, "boom from the closure"))
    fails_too = strategy.function(_gated(others_gate, "second boom"))
    finishes = strategy.function(_gated(others_gate, None))
    first = c.schedule(fails, args=(np.ones(1, np.float32),))
    second = c.schedule(fails_too, args=(np.ones(2, np.float32),))
    running_ok = c.schedule(finishes, args=(np.ones(3, np.float32),))
    _wait_for(lambda: len(c._queue._running) == 3, "every worker to be busy")
    queued = [c.schedule(finishes, args=(np.ones(4, np.float32),)) for _ in range(10)]
    open(first_gate, "w").close()
    _wait_for(lambda: c._queue._error is not None, "the first error")
    for r in queued:  # cancelled at once, never run
        with pytest.raises(concurrent.futures.CancelledError, match="cancel"):
            r.fetch()
    assert len(c._queue._running) == 2 and not c._queue._queue
    open(others_gate, "w").close()
    with pytest.raises(ValueError, match="boom from the closure") as raised:
        c.join()
    assert "second boom" in "".join(getattr(raised.value, "__notes__", []))
    c.join()  # raised once, then cleared: the second failure is not raised again
    assert c.done()
    with pytest.raises(ValueError, match="second boom"):
        second.fetch()
    assert float(running_ok.fetch()) == 3.0
    with pytest.raises(ValueError, match="boom from the closure"):
        first.fetch()


def test_schedule_raise_error_with_multiple_failure(strategy: Any, caplog: Any) -> None:
    """TF's ScheduleRaiseErrorWithMultipleFailure: schedule raises the error once; the
    failures of closures scheduled meanwhile are not raised again by join; scheduling then
    works."""
    c = ClusterCoordinator(strategy)
    normal = strategy.function(lambda ctx, x: jnp.sum(x))

    @strategy.function
    def error_fn(ctx: Any, x: Any) -> Any:
        raise ValueError("error_fn failed")

    for _ in range(3):
        c.schedule(normal, args=(np.ones(2, np.float32),))
    c.schedule(error_fn, args=(np.ones(2, np.float32),))
    deadline = time.monotonic() + 120
    with (
        caplog.at_level(logging.ERROR, logger="jaxdist.parameter_server"),
        pytest.raises(ValueError, match="error_fn failed"),
    ):
        while time.monotonic() < deadline:
            c.schedule(error_fn, args=(np.ones(2, np.float32),))
    c.join()  # nothing more to raise
    assert "failed running closure 'test_schedule_raise_error_with_multiple_failure" in caplog.text
    assert "ValueError: error_fn failed" in caplog.text
    ok = c.schedule(normal, args=(np.ones(2, np.float32),))
    c.join()
    assert float(ok.fetch()) == 2.0


def test_join_logs_long_running_closures(strategy: Any, tmp_path: Any, caplog: Any) -> None:
    """While join waits, the closures running for log_interval seconds are logged with
    their workers every log_interval seconds (60 s by default)."""
    c = ClusterCoordinator(strategy)
    gate = str(tmp_path / "go")
    slow = strategy.function(_gated(gate, None))
    assert c.log_interval == 60.0
    c.log_interval = 0.3
    try:
        rv = c.schedule(slow, args=(np.ones(5, np.float32),))
        threading.Timer(2.0, lambda: open(gate, "w").close()).start()
        with caplog.at_level(logging.WARNING, logger="jaxdist.parameter_server"):
            c.join()
    finally:
        c.log_interval = 60.0
    assert float(rv.fetch()) == 5.0
    lines = [r.getMessage() for r in caplog.records if "waiting for 1 closure" in r.getMessage()]
    assert len(lines) >= 2, caplog.text
    assert "_gated.<locals>.fn' (test_parameter_server.py:" in lines[0]
    assert "on /job:worker/replica:0/task:" in lines[0]


def test_fetch_keeps_nested_structures(strategy: Any) -> None:
    c = ClusterCoordinator(strategy)

    @strategy.function
    def nested(ctx: Any, x: Any) -> Any:
        return {"a": x + 1, "b": [x * 2, (x, x - 1)]}

    rv = c.schedule(nested, args=(np.float32(1.0),))
    out = c.fetch({"r": rv, "plain": [3, None], "again": (rv,)})
    assert out["plain"] == [3, None]
    assert jax.tree.map(float, out["r"]) == {"a": 2.0, "b": [2.0, (1.0, 0.0)]}
    assert jax.tree.map(float, out["again"][0]) == jax.tree.map(float, out["r"])
    assert isinstance(rv, RemoteValue)


def test_per_worker_dataset_and_values(strategy: Any) -> None:
    c = ClusterCoordinator(strategy)
    dataset = c.create_per_worker_dataset(lambda: (np.float32(i) for i in range(100)))
    iterator = iter(dataset)
    take = jax.jit(lambda element, offset: element + offset)
    results = [
        c.schedule(take, args=(iterator, PerWorkerValues([0, 1000, 2000]))) for _ in range(12)
    ]
    c.join()
    values = sorted(int(r.fetch()) for r in results)
    per_worker: dict[int, list[int]] = {}
    for v in values:
        per_worker.setdefault(v // 1000, []).append(v % 1000)
    # Each worker read its own dataset from the start: 0, 1, 2, ... with no gaps.
    assert sum(len(v) for v in per_worker.values()) == 12
    for elements in per_worker.values():
        assert elements == list(range(len(elements)))
    with pytest.raises(ValueError, match="2 values for 3 workers"):
        c.schedule(take, args=(iterator, PerWorkerValues([0, 1])))
    with pytest.raises(TypeError, match="schedule"):
        next(iterator)


def test_current_worker_index(strategy: Any) -> None:
    """TF's experimental_get_current_worker_index, in a scheduled strategy.function, a
    jax.jit function and a per-worker dataset_fn; the reference is the running worker's
    entry of PerWorkerValues([0, 1, 2])."""
    c = ClusterCoordinator(strategy)
    index = jd.coordinator.experimental_get_current_worker_index

    def dataset_fn() -> Any:
        return itertools.repeat(np.int32(index()))  # read when the worker makes its copy

    iterator = iter(c.create_per_worker_dataset(dataset_fn))
    expected = PerWorkerValues([0, 1, 2])
    step = strategy.function(lambda ctx, element, want: (jnp.int32(index()), element, want))
    jitted = jax.jit(lambda want: (jnp.int32(index()), want, want))
    results = [c.schedule(step, args=(iterator, expected)) for _ in range(9)]
    results += [c.schedule(jitted, args=(expected,)) for _ in range(9)]
    c.join()
    got = [tuple(int(x) for x in r.fetch()) for r in results]
    assert all(i == element == want for i, element, want in got), got
    with pytest.raises(RuntimeError, match="no worker closure is running here"):
        index()


def test_run_and_reduce_with_assign_add(strategy: Any) -> None:
    """TF's RunAndReduce and RunAndReduceWithAssignAdd: strategy.run and strategy.reduce
    inside the scheduled function, an update made in the inner replica function, and
    reduce / experimental_local_results of the fetched result in the coordinator.
    Reference: 3 + 1 = 4 from every closure, and one update per closure (exact)."""
    with strategy.scope():
        v = jd.Variable(1.0)
        v1 = jd.Variable(0.0, aggregation="only_first_replica")

    @strategy.function
    def worker_fn(ctx: Any, v: Any, v1: Any, x: Any) -> Any:
        def replica_fn(ctx: Any, x: Any) -> Any:
            v1.assign_add(1.0)
            return x + v.read_value()

        run_result = strategy.run(replica_fn, args=(x,))
        return strategy.reduce("sum", run_result, axis=None)

    c = ClusterCoordinator(strategy)
    results = [c.schedule(worker_fn, args=(v, v1, np.float32(3.0))) for _ in range(3)]
    c.join()
    assert [float(r.fetch()) for r in results] == [4.0] * 3
    fetched = results[-1].fetch()
    assert float(strategy.reduce("sum", fetched, axis=None)) == 4.0
    assert [float(x) for x in strategy.experimental_local_results(fetched)] == [4.0]
    assert float(v1) == 3.0 and float(v) == 1.0


def test_distribute_datasets_from_function_on_workers(strategy: Any) -> None:
    """TF's input recipe: create_per_worker_dataset(lambda: strategy.
    distribute_datasets_from_function(dataset_fn)); each worker's pipeline starts at its
    first batch. Reference: the batches' sums, per worker in order."""
    c = ClusterCoordinator(strategy)

    def dataset_fn(input_context: Any) -> Any:
        batch = input_context.get_per_replica_batch_size(4)
        return (np.full((batch,), i, np.float32) for i in range(100))

    iterator = iter(
        c.create_per_worker_dataset(lambda: strategy.distribute_datasets_from_function(dataset_fn))
    )
    total = strategy.function(
        lambda ctx, batch: (jnp.sum(batch), jd.coordinator.experimental_get_current_worker_index())
    )
    results = [c.schedule(total, args=(iterator,)) for _ in range(9)]
    c.join()
    per_worker: dict[int, list[float]] = {}
    for r in results:
        value, worker = r.fetch()
        per_worker.setdefault(int(worker), []).append(float(value))
    for sums in per_worker.values():
        assert sums == [4.0 * i for i in range(len(sums))]


def test_variable_aggregation_counts(strategy: Any) -> None:
    """TF's VariableAggregation: counters updated with ctx.assign_add only (nothing
    returned) count every closure, whatever their aggregation (one replica per worker)."""
    with strategy.scope():
        on_read = jd.Variable(0, synchronization="on_read", aggregation="sum", trainable=False)
        first = jd.Variable(0.0, aggregation="only_first_replica")
        mean = jd.Variable(0.0, aggregation="mean")
    c = ClusterCoordinator(strategy)

    @strategy.function
    def count(ctx: Any, a: Any, b: Any, m: Any) -> Any:
        ctx.assign_add(a, 1)
        ctx.assign_add(b, 1.0)
        ctx.assign_add(m, 0.5)
        return jnp.float32(0.0)

    for _ in range(20):
        c.schedule(count, args=(on_read, first, mean))
    c.join()
    assert int(on_read) == 20 and float(first) == 20.0 and float(mean) == 10.0
    # A plain jax.jit closure updates variables through their own methods.
    add = jax.jit(lambda v, x: v.assign_add(x))
    for _ in range(5):
        c.schedule(add, args=(first, np.float32(2.0)))
    c.join()
    assert float(first) == 30.0


def test_extended_update_in_a_closure_reaches_the_parameter_server(strategy: Any) -> None:
    """TF's replica-context ``strategy.extended.update`` inside a scheduled function changes
    the variable on its parameter server: an update that only adds counts every closure, one
    that assigns sets the value. Reference: 20 closures adding 1.0, and an assign of 5.0."""
    with strategy.scope():
        total = jd.Variable(0.0, aggregation="sum")
        last = jd.Variable(0.0)
    c = ClusterCoordinator(strategy)

    @strategy.function
    def step(ctx: Any, t: Any, w: Any) -> Any:
        strategy.extended.update(t, lambda v: v.assign_add(1.0))
        strategy.extended.update(w, lambda v, x: v.assign(x), args=(5.0,))
        return jnp.asarray([t.aggregation.name == "SUM", w.aggregation.name == "NONE"])

    results = [c.schedule(step, args=(total, last)) for _ in range(20)]
    c.join()
    assert float(total) == 20.0 and float(last) == 5.0
    # A worker's copies keep the variables' own aggregations (NONE stays NONE).
    assert all(np.asarray(c.fetch(r)).tolist() == [True, True] for r in results)


def test_dead_parameter_server_surfaces(strategy: Any) -> None:
    """TF's JoinRaisesUnavailableErrorAtPsFailure: a killed parameter server makes join (and
    schedule) raise an error naming it within 60 s, and reading its variables raises."""
    s = jd.experimental.ParameterServerStrategy(_resolver(1, 1))
    try:
        with pytest.raises(ValueError, match=r"function\(\) of another strategy"):
            ClusterCoordinator(s).schedule(strategy.function(lambda ctx: 1.0))
        with s.scope():
            v = jd.Variable(jnp.zeros(2), aggregation="sum")
        c = ClusterCoordinator(s)
        step = s.function(lambda ctx, v: ctx.assign_add(v, jnp.ones(2)))
        c.schedule(step, args=(v,))
        c.join()
        ray.kill(s.extended.ps_actors[0])
        start = time.monotonic()
        for _ in range(5):
            try:
                c.schedule(step, args=(v,))
            except RuntimeError:
                break
        with pytest.raises(RuntimeError, match=r"/job:ps/replica:0/task:0"):
            c.join()
        assert time.monotonic() - start < 60
        with pytest.raises(RuntimeError, match="parameter server /job:ps"):
            np.asarray(v)
    finally:
        s._shutdown()


def test_server_joins_this_machine_as_a_task(ray_runtime: Ports | None, tmp_path: Any) -> None:
    """TF's two-machine set-up on localhost: a second process runs jd.Server for worker 0;
    the strategy places that task's actor on the node the Server started."""
    head = ray.get_runtime_context().gcs_address
    code = (
        "import json, signal, sys\n"
        "from jaxdist.experimental.parameter_server.server import Server\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # join() then cleans up\n"
        "spec = {'chief': [sys.argv[1]], 'worker': ['w0'], 'ps': ['p0']}\n"
        "config = {'num-cpus': 0, **json.loads(sys.argv[2])}\n"
        "server = Server(spec, job_name='worker', task_index=0, config=config)\n"
        "print('target', server.target, flush=True)\n"
        "server.join()\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed in finally
    ports = _free_block(FIRST_WORKER_PORT + 8)  # the node's own, pinned (see PORT_RANGE)
    options = (
        "node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
    )  # fmt: skip
    config: dict[str, int] = {name: ports.base + i for i, name in enumerate(options)}
    config["min-worker-port"], config["max-worker-port"] = ports.workers
    proc = subprocess.Popen(
        [sys.executable, "-c", code, head, json.dumps(config)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    s = None
    try:
        deadline = time.monotonic() + 120
        while "jaxdist_worker_0" not in ray.cluster_resources():
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the Server's node did not join in 120 s"
            time.sleep(0.5)
        server_node = next(
            n["NodeID"] for n in ray.nodes() if n["Alive"] and "jaxdist_worker_0" in n["Resources"]
        )
        s = jd.experimental.ParameterServerStrategy(_resolver(1, 1))
        assert ray.get(s.extended.worker_actors[0].node_id.remote()) == server_node
        import psutil

        node = _listening(psutil.Process(proc.pid))
        assert "raylet" in {name for name, _ in node}, node
        outside = [(name, port) for name, port in node if port not in ports]
        assert not outside, f"the Server's node listens outside {ports}: {outside}"
        with s.scope():
            v = jd.Variable(jnp.zeros(2), aggregation="sum")
        c = ClusterCoordinator(s)
        rv = c.schedule(
            s.function(lambda ctx, v, x: (ctx.assign_add(v, x), x * 2)),
            args=(v, np.ones(2, np.float32)),
        )
        c.join()
        np.testing.assert_array_equal(rv.fetch()[1], [2.0, 2.0])
        np.testing.assert_array_equal(np.asarray(v), [1.0, 1.0])
        assert f"target {head}" in (tmp_path / "server.log").read_text()
    finally:
        if s is not None:
            s._shutdown()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=90)
        log.close()
    assert _recorded_cluster() != head, "the stopped Server left ray_current_cluster behind"


def test_server_arguments() -> None:
    from jaxdist.experimental.parameter_server.server import Server

    spec = {"chief": ["127.0.0.1:1"], "worker": ["a", "b"], "ps": ["p"]}
    with pytest.raises(ValueError, match="job_name must be given"):
        Server(spec, start=False)
    with pytest.raises(ValueError, match="task_index must be given: job 'worker' has 2 tasks"):
        Server(spec, job_name="worker", start=False)
    with pytest.raises(ValueError, match="protocol='grpc' is not supported"):
        Server(spec, job_name="ps", protocol="grpc", start=False)
    server = Server(spec, job_name="worker", task_index=1, start=False)
    assert server.target == "127.0.0.1:1" and server.resource == "jaxdist_worker_1"


def test_every_worker_gone_fails_the_queue(ray_runtime: Ports | None) -> None:
    """A worker killed for good (no restart) gives its closures to the others; with none
    left, queued closures fail and join says so."""
    s = jd.experimental.ParameterServerStrategy(_resolver(1, 1))
    try:
        c = ClusterCoordinator(s)
        noop = jax.jit(lambda x: x + 1)
        assert float(c.schedule(noop, args=(np.float32(1.0),)).fetch()) == 2.0
        victim = s.extended.worker_actors[0]
        ray.kill(victim, no_restart=True)
        # ray.kill returns before the actor is gone: a closure scheduled at once could still
        # run there and succeed (seen in CI), so wait for the death.
        _wait_for(lambda: _ping(victim) is None, "the worker's death")
        pending: list[Any] = []
        with pytest.raises(RuntimeError, match=r"every worker task \(/job:worker\) is gone"):
            for _ in range(3):  # schedule raises it once the first closure found no worker
                pending.append(c.schedule(noop, args=(np.float32(1.0),)))
            c.join()
        assert pending
        for r in pending:
            with pytest.raises(RuntimeError, match="every worker task"):
                r.fetch()
    finally:
        s._shutdown()


def test_worker_preemption_between_functions(ray_runtime: Ports | None) -> None:
    """TF's WorkerPreemptionBetweenFunctions: a worker killed while idle is restarted; the
    closures scheduled after it all run, each exactly once (none ran on the dead worker)."""
    s = jd.experimental.ParameterServerStrategy(_resolver(2, 1))
    try:
        with s.scope():
            count = jd.Variable(0, aggregation="sum")
        c = ClusterCoordinator(s)
        step = s.function(lambda ctx, v: ctx.assign_add(v, 1))
        c.schedule(step, args=(count,))
        c.join()
        victim = s.extended.worker_actors[0]
        pid = ray.get(victim.ping.remote())
        ray.kill(victim, no_restart=False)
        for _ in range(30):
            c.schedule(step, args=(count,))
        c.join()
        assert int(count) == 31
        _wait_for(lambda: _ping(victim) not in (None, pid), "the worker's restart")
    finally:
        s._shutdown()


def test_closure_that_kills_its_worker_fails_join(ray_runtime: Ports | None, caplog: Any) -> None:
    """A closure that crashes its worker every time (os._exit) is rescheduled
    MAX_WORKER_LOSSES times, then join raises WorkerLossError naming it and the workers,
    well within 60 s; each death and rescheduling is logged."""
    from jaxdist.experimental.parameter_server import WorkerLossError
    from jaxdist.experimental.parameter_server.coordinator import MAX_WORKER_LOSSES

    s = jd.experimental.ParameterServerStrategy(_resolver(2, 1))
    try:
        c = ClusterCoordinator(s)

        @s.function
        def crash(ctx: Any, x: Any) -> Any:
            os._exit(3)

        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="jaxdist.parameter_server"):
            rv = c.schedule(crash, args=(np.ones(2, np.float32),))
            with pytest.raises(WorkerLossError) as raised:
                c.join()
        assert time.monotonic() - start < 60
        message = str(raised.value)
        assert "closure 'test_closure_that_kills_its_worker_fails_join.<locals>.crash'" in message
        assert f"died each of the {MAX_WORKER_LOSSES + 1} times" in message
        assert message.count("/job:worker/replica:0/task:") == MAX_WORKER_LOSSES + 1
        with pytest.raises(WorkerLossError):
            rv.fetch()
        text = caplog.text
        assert text.count("died while running closure") == MAX_WORKER_LOSSES + 1
        assert text.count("rescheduling closure") == MAX_WORKER_LOSSES
        # The workers come back: scheduling works again.
        ok = c.schedule(jax.jit(lambda x: x + 1), args=(np.float32(1.0),))
        c.join()
        assert float(ok.fetch()) == 2.0
    finally:
        s._shutdown()

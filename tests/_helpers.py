"""Small helpers shared by the tests (not a test module)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd


def value(x: Any) -> np.ndarray:
    """The global array behind a run output: ``x.array`` for distributed values; a plain
    output (what run returns with one replica) as it is."""
    return np.asarray(x.array if isinstance(x, jd.DistributedValues) else x)


def assert_kind(x: Any, kind: type, strategy: jd.Strategy) -> None:
    """``x`` is a ``kind`` (`Mirrored`/`PerReplica`), or a plain array with one replica."""
    if strategy.num_replicas_in_sync == 1:
        assert not isinstance(x, jd.DistributedValues), type(x)
    else:
        assert isinstance(x, kind), type(x)


def rows(x: Any, strategy: jd.Strategy) -> np.ndarray:
    """A per-replica output as ``(N, ...)`` rows (a plain one-replica output gets a row axis)."""
    v = value(x)
    return v if isinstance(x, jd.DistributedValues) else v[None]


_MAKERS: dict[str, Any] = {
    "one_device": lambda: jd.OneDeviceStrategy(),
    "mirrored2": lambda: jd.MirroredStrategy(jax.devices()[:2]),
    "mirrored8": lambda: jd.MirroredStrategy(),
    "central2": lambda: jd.CentralStorageStrategy(jax.devices()[:2]),
    "central8": lambda: jd.CentralStorageStrategy(),
}


def per_device_bytes(tree: Any) -> int:
    """The most bytes of ``tree``'s arrays that any one device holds."""
    per: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values())


def total_bytes(tree: Any) -> int:
    """The bytes of ``tree``'s arrays, each counted once."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def strategy_params(*names: str) -> list[Any]:
    """``pytest.param``s of functions that make the named strategies (made per test, so
    that each test gets a fresh one), for ``@pytest.mark.parametrize("make", ...)``."""
    return [pytest.param(_MAKERS[name], id=name) for name in names]


def free_port() -> int:
    """A localhost TCP port that is free now (for a test job's coordinator)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_workers(code: str, processes: int = 2, timeout: float = 200) -> list[Any]:
    """Runs ``python -c code <process id> <port>`` as a job of ``processes`` processes on
    localhost (CPU only); returns each one's last line of output, parsed as JSON, in
    process order. Fails the test with the stderr tails when a process fails or hangs."""
    port = str(free_port())
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(i), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(processes)
    ]
    out = []
    try:
        for i, p in enumerate(procs):
            try:
                stdout, stderr = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                tails = [q.communicate()[1][-2000:] for q in procs]
                pytest.fail(f"process {i} hung; stderr tails: {tails}")
            assert p.returncode == 0, stderr[-3000:]
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, *args: str, timeout: float = 200, devices: int = 8) -> Any:
    """Runs ``python -c code *args`` in a fresh process with ``devices`` simulated CPU
    devices and this checkout's jaxdist; returns its last line of output parsed as JSON.

    For code that can end the process (an XLA abort, a segmentation fault) or hang: the
    test fails with the exit status and the stderr tail instead of taking pytest down."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": str(devices),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"the process did not finish in {timeout} s; stderr tail: {stderr[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(
            f"the process exited with status {proc.returncode} (negative: killed by that "
            f"signal; -11 or 139: segmentation fault; -6: abort); stderr tail: "
            f"{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# orbax may leave a tensorstore callback for an event loop it already closed when a read
# of a deliberately damaged checkpoint fails (seen once in about ten runs on jax 0.12):
# not jaxdist's error, and not what the tests marked with this check.
ORBAX_CLOSED_LOOP = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


# The start of the script each process of a 2 x 4-device localhost job runs (argv: the
# process id, the coordinator port, then the test's own arguments).
WORKER_PREAMBLE = """import json, os, sys
import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{sys.argv[2]}", num_processes=2,
    process_id=int(sys.argv[1]), initialization_timeout=60,
)
"""


def all_reduce_count(hlo: str) -> int:
    """All-reduces in compiled HLO (synchronous or started asynchronously)."""
    return len(re.findall(r"\ball-reduce(-start)?\(", hlo))


def hand_written_step_hlo(
    strategy: jd.Strategy,
    model: Any,
    tx: Any,
    per_example_loss: Any,
    x: np.ndarray,
    y: np.ndarray,
    transform: Any = None,
) -> str:
    """Compiled HLO of the hand-written data-parallel step of ``model`` (an NNX module):
    ``shard_map`` over ``strategy``'s mesh, per-replica gradients of this replica's share of
    the mean loss, one ``psum``, then ``transform`` (e.g. clipping) and ``tx``'s update; the
    baseline a `jd.train_step` is compared with."""
    mesh, axis = strategy.mesh, strategy.axis_name
    graphdef, params = nnx.split(model, nnx.Param)
    opt_state = tx.init(params)
    batch = x.shape[0]

    def body(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
        pv = jax.lax.pcast(params, axis, to="varying")
        loss, g = jax.value_and_grad(
            lambda p: jax.numpy.sum(per_example_loss(nnx.merge(graphdef, p)(x), y)) / batch
        )(pv)
        g = jax.lax.psum(g, axis)
        if transform is not None:
            g = transform(g)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.psum(loss, axis)

    hand = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(axis), P(axis)), out_specs=P())
    )
    data = NamedSharding(mesh, P(axis))
    lowered = hand.lower(params, opt_state, jax.device_put(x, data), jax.device_put(y, data))
    return str(lowered.compile().as_text())

"""Small helpers shared by the tests (not a test module)."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd

TESTS = Path(__file__).resolve().parent
"""This folder: the test folders' shared helpers (this module, ``_hlo``) are imported from
here, and the scripts tests run by path sit in ``mp_scripts/`` and ``launch_scripts/``."""

REPO = TESTS.parent


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


def ruled_share(strategy: Any, objects: Any) -> float:
    """Bytes one device should hold of ``objects``' state under a `MeshStrategy`: each
    leaf's bytes over the product of the sizes of the mesh axes its ruled spec uses."""
    sizes = dict(strategy.mesh.shape)
    share = 0.0
    layout = strategy.state_layout(objects)
    for leaf, spec in zip(jax.tree.leaves(nnx.state(objects)), layout.values(), strict=True):
        axes = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
        share += leaf.nbytes / math.prod(sizes[a] for a in axes)
    return share


def strategy_params(*names: str) -> list[Any]:
    """``pytest.param``s of functions that make the named strategies (made per test, so
    that each test gets a fresh one), for ``@pytest.mark.parametrize("make", ...)``."""
    return [pytest.param(_MAKERS[name], id=name) for name in names]


def load_script(path: Path, name: str) -> ModuleType:
    """The Python file ``path`` (a script the tests also run in other processes) imported
    as module ``name``, for the functions it shares with the test."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": _pythonpath()}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(i), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
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


def _pythonpath() -> str:
    """``PYTHONPATH`` with this checkout first (its jaxdist, not an installed one)."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def _checkout_env(devices: int) -> dict[str, str]:
    """This process's environment for a fresh interpreter on ``devices`` simulated CPU
    devices and this checkout's jaxdist."""
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": str(devices),
        "PYTHONPATH": _pythonpath(),
    }


def start_python(code: str, *args: str, devices: int = 8) -> subprocess.Popen:
    """Starts ``python -c code *args`` like `run_python`, its output piped (text); finish
    it with `finish`."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=_checkout_env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The stdout and stderr of ``proc`` once it ends; fails the test with the stderr tail
    (and kills it) when it does not end within ``timeout`` seconds."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the program did not finish in {timeout} s; stderr tail: {err[-3000:]}")


def sigterm_at(proc: subprocess.Popen, line: str, timeout: float) -> tuple[str, str]:
    """Sends ``proc`` (started by `start_python`) SIGTERM once it prints ``line`` (within
    ``timeout`` seconds), then returns its stdout and stderr from there on (`finish`)."""
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        got = ""
        while got.strip() != line and time.monotonic() < deadline:
            got = proc.stdout.readline()
            if not got and proc.poll() is not None:
                break
        assert got.strip() == line, f"no {line!r}: {proc.communicate()[1][-3000:]}"
        proc.send_signal(signal.SIGTERM)
        return finish(proc, timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


def load_npz(path: Path) -> list[np.ndarray]:
    """The arrays of an ``np.savez(path, *arrays)`` file, in order."""
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def flip_middle_byte(directory: Path, mask: int = 0x10) -> tuple[Path, bytes]:
    """Damages the largest file under ``directory`` (in a checkpoint: an array's data) by
    XOR-ing ``mask`` into its middle byte; returns the file and its damaged bytes."""
    files = [p for p in directory.rglob("*") if p.is_file()]
    data = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= mask
    data.write_bytes(bytes(raw))
    return data, bytes(raw)


def partial_saves(directory: Path) -> list[str]:
    """The temporary directories of a second save (``ckpt-2``) not yet complete: orbax
    writes into "ckpt-2.tmp.orbax-checkpoint-tmp*", renamed to "ckpt-2.tmp" when done."""
    return [n for n in os.listdir(directory) if n.startswith("ckpt-2.tmp")]


def _written(directory: Path) -> int:
    """Bytes in the files of the second save's temporary directories so far."""
    total = 0
    for name in partial_saves(directory):
        for here, _, files in os.walk(directory / name):
            for f in files:
                with contextlib.suppress(OSError):  # renamed or removed meanwhile
                    total += os.path.getsize(os.path.join(here, f))
    return total


# A process that saves 200 MB twice (argv: the directory, then "sync" or "async"); after
# the first save it prints "saved"; an asynchronous one trains on while the second is written.
_SAVES_TWICE = """
import sys
import jax, jax.numpy as jnp
import numpy as np
import jaxdist as jd

asynchronous = sys.argv[2] == "async"


def big(seed):  # 200 MB of random floats (incompressible: 200 MB on disk too)
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(25_000_000, dtype=np.float32)) for k in "ab"}


ckpt = jd.checkpoint.Checkpoint(state=big(1), step=jnp.int32(1))
manager = jd.checkpoint.CheckpointManager(
    ckpt, sys.argv[1], max_to_keep=1, enable_async_checkpointing=asynchronous
)
manager.save()
if asynchronous:
    manager.wait_until_finished()
print("saved", flush=True)
ckpt.state, ckpt.step = big(2), jnp.int32(2)
manager.save()  # killed while this one is written (in the background if asynchronous)
if asynchronous:  # training goes on meanwhile
    step = jax.jit(lambda x: x * 1.0001)
    x = jnp.ones(1000)
    while True:
        x = step(x).block_until_ready()
print("finished", flush=True)
"""


def kill_mid_save(tmp_path: Path, asynchronous: bool, at: int = 16 * 2**20) -> Path:
    """Runs a process that saves 200 MB of random floats (``state``: arrays ``a`` and ``b``
    from ``np.random.default_rng(1)``, then ``(2)``) twice into ``tmp_path / "run"``, as
    ``ckpt-1`` and ``ckpt-2``, and kills it (SIGKILL) once ``at`` bytes of the second save
    are on disk; returns that directory. Its stderr goes to ``tmp_path / "stderr.txt"``; the
    test fails if it ends by itself, writes nothing, or leaves a complete ``ckpt-2`` or no
    partial one."""
    directory, log = tmp_path / "run", tmp_path / "stderr.txt"
    mode = "async" if asynchronous else "sync"
    with (
        log.open("w") as stderr,
        subprocess.Popen(
            [sys.executable, "-c", _SAVES_TWICE, str(directory), mode],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": _pythonpath()},
        ) as proc,
    ):
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "saved", log.read_text()[-3000:]
            deadline = time.monotonic() + 120
            while _written(directory) < at and proc.poll() is None:
                assert time.monotonic() < deadline, "the second save wrote nothing in 120 s"
                time.sleep(0.002)
            assert proc.poll() is None, f"the process ended: {log.read_text()[-3000:]}"
            assert _written(directory) >= at, f"no second save: {log.read_text()[-3000:]}"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not (directory / "ckpt-2").exists()  # killed before the rename
    assert partial_saves(directory)  # what the killed save left
    return directory


def assert_restores_the_first_save(manager: Any, ckpt: Any, directory: Path) -> None:
    """``manager`` (of ``ckpt``, in ``directory`` after `kill_mid_save`) sees ``ckpt-1``
    alone and restores it, verified, bit for bit."""
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-1"]
    assert manager.restore_or_initialize() == str(directory / "ckpt-1")  # verified
    assert int(ckpt.step) == 1 and ckpt.save_counter == 1
    rng = np.random.default_rng(1)  # the first save's values, made again
    for k in "ab":
        np.testing.assert_array_equal(
            np.asarray(ckpt.state[k]), rng.standard_normal(25_000_000, dtype=np.float32)
        )


def run_python(code: str, *args: str, timeout: float = 200, devices: int = 8) -> Any:
    """Runs ``python -c code *args`` in a fresh process with ``devices`` simulated CPU
    devices and this checkout's jaxdist; returns its last line of output parsed as JSON.

    For code that can end the process (an XLA abort, a segmentation fault) or hang: the
    test fails with the exit status and the stderr tail instead of taking pytest down."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, *args],
            cwd=REPO,
            env=_checkout_env(devices),
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


def worker_script(body: str) -> str:
    """The script of each process of a 2 x 4-device localhost job (for `run_workers`):
    `WORKER_PREAMBLE`, then ``body`` (dedented), then ``jax.distributed.shutdown()``."""
    return WORKER_PREAMBLE + textwrap.dedent(body) + "jax.distributed.shutdown()\n"


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


# Shared models and data ------------------------------------------------------------------


def _shape(rows: int | tuple[int, ...], rest: int | tuple[int, ...]) -> tuple[int, ...]:
    """``rows`` (a count, or leading dims such as ``(steps, batch)``) followed by ``rest``."""
    lead = (rows,) if isinstance(rows, int) else tuple(rows)
    return lead + ((rest,) if isinstance(rest, int) else tuple(rest))


def regression_data(
    rows: int | tuple[int, ...],
    features: int | tuple[int, ...],
    targets: int | tuple[int, ...] = (),
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Inputs ``x`` (``rows`` x ``features``) and targets ``y`` (``rows`` x ``targets``;
    one number per row by default), standard normal float32, drawn in that order from
    ``np.random.default_rng(seed)``. ``rows`` may be leading dims, e.g. ``(steps, batch)``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=_shape(rows, features)).astype(np.float32)
    y = rng.normal(size=_shape(rows, targets)).astype(np.float32)
    return x, y


def classification_data(
    rows: int | tuple[int, ...], features: int | tuple[int, ...], classes: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Inputs ``x`` (``rows`` x ``features``, standard normal float32), then integer labels
    ``y`` in ``[0, classes)`` (int32, one per row), from ``np.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=_shape(rows, features)).astype(np.float32)
    y = rng.integers(0, classes, size=_shape(rows, ())).astype(np.int32)
    return x, y


def linear_data(rows: int, weights: Any, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs ``x`` (``rows`` x ``len(weights)``, standard normal) and exact linear targets
    ``y = x @ weights``, float32, from ``np.random.default_rng(seed)``."""
    w = np.asarray(weights, np.float32)
    x = np.random.default_rng(seed).normal(size=(rows, w.shape[0])).astype(np.float32)
    return x, (x @ w).astype(np.float32)


class TanhMLP(nnx.Module):
    """Dense layers ``l1``, ``l2``, ... of the given ``sizes`` (``TanhMLP((4, 8, 3), rngs)``:
    4 -> 8 -> 3) with tanh between them; with a ``dropout`` rate, an ``nnx.Dropout``
    (``drop``, made before the last layer) after the last tanh. Bind the sizes of a test
    module's model once: ``MLP = functools.partial(TanhMLP, (FEATURES, 8, CLASSES))``."""

    def __init__(self, sizes: Sequence[int], rngs: nnx.Rngs, dropout: float | None = None) -> None:
        self.depth = len(sizes) - 1
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes), 1):
            if i == self.depth and dropout is not None:
                self.drop = nnx.Dropout(dropout, rngs=rngs)
            setattr(self, f"l{i}", nnx.Linear(fan_in, fan_out, rngs=rngs))

    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(1, self.depth):
            x = jnp.tanh(getattr(self, f"l{i}")(x))
        if hasattr(self, "drop"):
            x = self.drop(x)
        return getattr(self, f"l{self.depth}")(x)


def small_nnx_model(strategy: jd.Strategy, dropout: float = 0.0) -> tuple[TanhMLP, Any]:
    """A 6 -> 16 -> 3 `TanhMLP` with dropout (``nnx.Rngs(0, dropout=1)``) and its
    ``adamw(1e-2)`` ``nnx.Optimizer``, made in ``strategy``'s scope."""
    with strategy.scope():
        model = TanhMLP((6, 16, 3), nnx.Rngs(0, dropout=1), dropout)
        opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    return model, opt


def mse_step(strategy: jd.Strategy, **kw: Any) -> Any:
    """``jd.train_step(strategy, **kw)`` of an NNX model and optimizer on ``(x, y)``
    batches: mean squared error, gradients all-reduced; returns the summed loss."""

    @jd.train_step(strategy, **kw)
    def step(ctx, model, opt, batch):  # type: ignore[no-untyped-def]
        x, y = batch

        def loss_fn(m):  # type: ignore[no-untyped-def]
            return jd.compute_average_loss(jnp.mean((m(x) - y) ** 2, axis=-1))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return ctx.all_reduce("sum", loss)

    return step


def loss_step(strategy: jd.Strategy, per_example: Any, global_batch_size: int) -> Any:
    """``jd.train_step(strategy)`` of an NNX model and optimizer on ``(x, y)``:
    ``per_example(model, x, y)`` averaged over the global batch, gradients all-reduced;
    returns the summed loss."""

    @jd.train_step(strategy)
    def step(ctx, model, opt, x, y):  # type: ignore[no-untyped-def]
        def loss_fn(m):  # type: ignore[no-untyped-def]
            return jd.compute_average_loss(
                per_example(m, x, y), global_batch_size=global_batch_size
            )

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return ctx.all_reduce("sum", loss)

    return step


def in_threads(count: int, target: Callable[[int], Any]) -> list[BaseException]:
    """Runs ``target(k)`` in ``count`` threads started together; returns their errors."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def run(k: int) -> None:
        try:
            barrier.wait()
            target(k)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,), name=f"audit-{k}") for k in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return errors

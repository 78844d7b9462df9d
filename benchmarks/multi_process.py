"""Multi-process data-parallel step: MultiWorkerMirroredStrategy vs hand-written jax.distributed.

MLP 784-1024-1024-10, SGD, global batch 512, float32. Run with no arguments,
it measures two layouts, one after the other: 2 processes x 4 simulated CPU
devices (gloo collectives over loopback) and 1 process x 8 devices. In each
process the jaxdist step (``strategy.function`` over
``jd.MultiWorkerMirroredStrategy``) and a hand-written program (its own
``("host", "local")`` mesh over ``jax.devices()``, ``jax.jit(jax.shard_map(...))``
with ``pmean``) alternate in rounds: the same donation (every argument), the
same replicated parameters fed back, the same batch placed once. A third
program, the gradient all-reduce alone (a ``pmean`` of a parameter-sized
tree), shows what crossing processes costs. Process 0 of each layout reports;
the launcher prints the table and the ratios. Target: jaxdist >= 0.95 of the
hand-written multi-process program.

The same rounds also time both steps fed from input, ``FED_STEPS`` steps per
call, then a wait. Each process owns its input pipeline's rows (a NumPy array,
``BATCH / processes`` rows a step). The hand-written loop slices them into
per-step batches and places each with ``jax.make_array_from_process_local_data``
(while the previous step runs: it waits on that step's loss just before
dispatching the next, keeping one collective program in flight as XLA's CPU
runtime requires, as jaxdist's CPU gate does). jaxdist iterates a fresh epoch
of ``strategy.distribute_datasets_from_function`` over
``jd.data.from_arrays`` of the same rows (built once) into the
``strategy.function`` step. In a job of several processes that dataset always
agrees, through the ``jax.distributed`` key-value store in its prefetch
thread, whether any process still has a batch (blocks of four steps;
``jaxdist/input/agreement.py``), even when the sources are equally long. So
two source pairs are timed: *equal* (every pipeline ``FED_STEPS`` batches; the
hand-written loop needs no agreement, so the agreement is jaxdist's pure extra
cost) and, with several processes, *uneven* (the last process's source is
``SHORT`` steps shorter: jaxdist feeds all-padding batches there, the
hand-written loop zero batches of the same shapes, as a program that knows
every source's length would). One process has no agreement at all. Fed ratio:
jaxdist's throughput / the hand-written loop's, the median of per-round ratios
with quartiles. Target >= 0.95.

Usage: python benchmarks/multi_process.py            # both layouts
       python benchmarks/multi_process.py --worker   # one process (started by the above)
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

SIZES = (784, 1024, 1024, 10)
BATCH, LR = 512, 0.01
CALLS, ROUNDS = 10, 7
FED_STEPS, SHORT = 32, 2  # steps per fed call; the uneven pair's shorter source


def worker() -> None:
    import jax  # noqa: I001 - the strategy starts jax.distributed before devices are used
    import jaxdist as jd

    strategy = jd.MultiWorkerMirroredStrategy()
    import _harness
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    # Both sides donate every argument; XLA reuses only the parameters' buffers.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    me, procs = jax.process_index(), jax.process_count()
    n = strategy.num_replicas_in_sync

    # The hand-written program's own mesh: one row per process, as jax.distributed users build.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    axes = ("host", "local")
    mesh = Mesh(np.array(devices).reshape(procs, -1), axes, axis_types=(AxisType.Auto,) * 2)
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P(axes))

    def init(key):
        keys = jax.random.split(key, len(SIZES) - 1)
        return [
            {"w": jax.random.normal(k, (a, b)) * np.sqrt(2 / a), "b": jnp.zeros((b,))}
            for k, a, b in zip(keys, SIZES[:-1], SIZES[1:], strict=True)
        ]

    def loss_fn(params, x, y):
        h = x
        for layer in params[:-1]:
            h = jax.nn.relu(h @ layer["w"] + layer["b"])
        logits = h @ params[-1]["w"] + params[-1]["b"]
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 10), axis=-1))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, SIZES[0])).astype(np.float32)
    y = rng.integers(0, 10, size=(BATCH,)).astype(np.int32)
    local = slice(me * BATCH // procs, (me + 1) * BATCH // procs)  # this process's rows
    xg = jax.make_array_from_process_local_data(data, x[local], x.shape)
    yg = jax.make_array_from_process_local_data(data, y[local], y.shape)
    params = jax.jit(init, out_shardings=rep)(jax.random.key(0))

    def body(params, x, y):
        loss, g = jax.value_and_grad(loss_fn)(jax.lax.pcast(params, axes, to="varying"), x, y)
        g = jax.lax.pmean(g, axes)
        return jax.tree.map(lambda p, d: p - LR * d, params, g), jax.lax.pmean(loss, axes)

    hand = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axes), P(axes)), out_specs=P()),
        donate_argnums=(0, 1, 2),
    )

    def all_reduce(g):
        return jax.lax.pmean(jax.lax.pcast(g, axes, to="varying"), axes)

    reduce_only = jax.jit(
        jax.shard_map(all_reduce, mesh=mesh, in_specs=P(), out_specs=P()), donate_argnums=0
    )

    def replica_step(ctx, params, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        g = ctx.all_reduce("mean", g)
        return jax.tree.map(lambda p, d: p - LR * d, params, g), ctx.all_reduce("mean", loss)

    step = strategy.function(replica_step, options=jd.RunOptions(donate_args=True))
    # The same global arrays, seen by jaxdist as one row per replica (no copy, no transfer).
    xs = jd.PerReplica(xg.reshape(n, BATCH // n, SIZES[0]))
    ys = jd.PerReplica(yg.reshape(n, BATCH // n))
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=rep)
    state = {"hand": copy(params), "jd": copy(params), "reduce": copy(params)}

    def run_hand():
        state["hand"], loss = hand(state["hand"], xg, yg)
        loss.block_until_ready()

    def run_jd():
        state["jd"], loss = step(state["jd"], xs, ys)
        jax.block_until_ready(loss)

    def run_reduce():
        state["reduce"] = reduce_only(state["reduce"])
        jax.block_until_ready(state["reduce"])

    # Fed from input: each input pipeline's rows (one pipeline per process), made alike
    # in every process; a pipeline's rows of step s are rows [s*rows, (s+1)*rows).
    rows = BATCH // procs

    def source(pipeline: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
        g = np.random.default_rng(1 + pipeline)
        x = g.normal(size=(FED_STEPS * rows, SIZES[0])).astype(np.float32)
        y = g.integers(0, 10, size=(FED_STEPS * rows,)).astype(np.int32)
        return x[: steps * rows], y[: steps * rows]

    def steps_of(pipeline: int, uneven: bool) -> int:
        return FED_STEPS - SHORT if uneven and pipeline == procs - 1 else FED_STEPS

    def fed_hand(name: str, uneven: bool) -> Callable[[], None]:
        fx, fy = source(me, steps_of(me, uneven))
        pad = np.zeros((rows, SIZES[0]), np.float32), np.zeros((rows,), np.int32)

        def run():
            loss = None
            for s in range(FED_STEPS):
                lo = s * rows
                bx, by = (fx[lo : lo + rows], fy[lo : lo + rows]) if lo < len(fx) else pad
                bx = jax.make_array_from_process_local_data(data, bx, (BATCH, SIZES[0]))
                by = jax.make_array_from_process_local_data(data, by, (BATCH,))
                if loss is not None:  # XLA:CPU: one collective program in flight
                    loss.block_until_ready()
                state[name], loss = hand(state[name], bx, by)
            loss.block_until_ready()

        return run

    def fed_jd(name: str, uneven: bool) -> Callable[[], None]:
        def dataset_fn(ctx):
            pipeline = ctx.input_pipeline_id
            fx, fy = source(pipeline, steps_of(pipeline, uneven))
            return jd.data.from_arrays(fx, fy, batch_size=ctx.get_per_replica_batch_size(BATCH))

        dataset = strategy.distribute_datasets_from_function(dataset_fn)  # built once

        def run():
            loss = None
            for bx, by in dataset:  # a fresh epoch: FED_STEPS steps
                state[name], loss = step(state[name], bx, by)
            jax.block_until_ready(loss)

        return run

    def calls(fn: Callable[[], None], times: int) -> Callable[[], None]:
        def run():
            for _ in range(times):
                fn()

        return run

    # One timed call per candidate and round: CALLS steps (as before), or FED_STEPS.
    candidates: dict[str, Callable[[], object]] = {
        "hand": calls(run_hand, CALLS),
        "jaxdist": calls(run_jd, CALLS),
        "all_reduce": calls(run_reduce, CALLS),
    }
    pairs = ("equal", "uneven") if procs > 1 else ("equal",)
    for pair in pairs:  # every process makes its datasets in the same order
        for side, make in (("fed_hand", fed_hand), ("fed_jd", fed_jd)):
            name = f"{side}_{pair}"
            state[name] = copy(params)
            candidates[name] = make(name, pair == "uneven")
    samples = _harness.sample(candidates, calls=1, rounds=ROUNDS)
    for pair in pairs:  # the same epochs of the same batches: the same parameters
        hand_fed, jd_fed = (jax.tree.leaves(state[f"{s}_{pair}"]) for s in ("fed_hand", "fed_jd"))
        for a, b in zip(hand_fed, jd_fed, strict=True):
            np.testing.assert_allclose(a.addressable_data(0), b.addressable_data(0), rtol=1e-5)
    times = {k: statistics.median(v) / CALLS for k, v in samples.items() if "fed" not in k}
    fed = {}
    for pair in pairs:
        # Per round: the hand-written loop's time / jaxdist's (jaxdist's throughput ratio).
        ratios = _harness.paired_ratios(samples, base=f"fed_jd_{pair}")[f"fed_hand_{pair}"]
        fed[pair] = {
            side: statistics.median(samples[f"{side}_{pair}"]) / FED_STEPS
            for side in ("fed_hand", "fed_jd")
        } | {"ratio": ratios}
    if me == 0:
        result = {"processes": procs, "devices": n // procs, **times, "fed": fed}
        print("RESULT " + json.dumps(result))
    jd.cluster_resolver.shutdown()


def _launch(processes: int, devices: int) -> dict[str, Any]:
    """Runs the worker as ``processes`` processes of ``devices`` devices; process 0's times."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_"))}
    env.update({"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices)})
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
    procs = []
    for i in range(processes):
        penv = dict(env)
        if processes > 1:
            penv.update(
                JAXDIST_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAXDIST_NUM_PROCESSES=str(processes),
                JAXDIST_PROCESS_ID=str(i),
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker"],
                env=penv,
                stdout=subprocess.PIPE,  # gloo's connection chatter goes here too
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [p.communicate() for p in procs]
    codes = [p.returncode for p in procs]
    if any(codes):
        logs = "\n".join(err[-2000:] for _, err in outputs)
        raise SystemExit(f"benchmark processes exited with {codes}:\n{logs}")
    line = next(x for x in outputs[0][0].splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    start = time.perf_counter()
    print(
        f"MLP {'-'.join(map(str, SIZES))}, SGD, global batch {BATCH}, float32, 8 replicas; "
        f"median of {ROUNDS} rounds of {CALLS} steps, {os.cpu_count()} CPU cores"
    )
    rows = {"2 x 4": _launch(2, 4), "1 x 8": _launch(1, 8)}
    print(
        f"{'processes x devices':<20}{'hand-written':>14}{'jaxdist':>10}{'ratio':>8}"
        f"{'all-reduce alone':>18}"
    )
    for name, t in rows.items():
        print(
            f"{name:<20}{1 / t['hand']:>8.2f} st/s{1 / t['jaxdist']:>10.2f}"
            f"{t['hand'] / t['jaxdist']:>8.3f}{t['all_reduce'] * 1e3:>15.1f} ms"
        )
    two, one = rows["2 x 4"], rows["1 x 8"]
    step_gap = (two["jaxdist"] - one["jaxdist"]) * 1e3
    reduce_gap = (two["all_reduce"] - one["all_reduce"]) * 1e3
    print(
        f"2 x 4 vs 1 x 8 (jaxdist): {one['jaxdist'] / two['jaxdist']:.3f} of one process's "
        f"throughput; the step takes {step_gap:+.1f} ms, the gradient all-reduce alone "
        f"{reduce_gap:+.1f} ms"
    )
    print(
        f"\nFed from input: {FED_STEPS} steps per call (a fresh epoch), median of {ROUNDS} "
        "rounds; ratio = jaxdist / hand-written throughput per round [quartiles], target >= 0.95"
    )
    print(
        f"{'processes x devices':<20}{'sources':<16}{'hand-written':>14}{'jaxdist':>10}"
        f"{'ratio':>8}{'quartiles':>14}  agreement"
    )
    for name, t in rows.items():
        for pair, f in t["fed"].items():
            ratio, q1, q3 = f["ratio"]
            short = FED_STEPS - SHORT
            sources = f"{pair} ({FED_STEPS}/{short if pair == 'uneven' else FED_STEPS})"
            agreement = "on (always, >1 process)" if t["processes"] > 1 else "none (1 process)"
            print(
                f"{name:<20}{sources:<16}{1 / f['fed_hand']:>8.2f} st/s{1 / f['fed_jd']:>10.2f}"
                f"{ratio:>8.3f}{f'{q1:.3f}-{q3:.3f}':>14}  {agreement}"
            )
    print(f"({time.perf_counter() - start:.0f} s in all)")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()

"""Throughput of ParameterServerStrategy + ClusterCoordinator on a local Ray runtime.

Models: least-squares linear regression (d=64, 256 rows per closure; once returning the
updated variable, once TF's way, updating it through ``ctx.assign_sub`` only) and an
embedding-lookup regression (a table of ``--rows`` x 64 partitioned over the 2 parameter
servers, 256 ids per closure). For 1, 2 and 3 workers (2 PS each) the benchmark schedules
``--closures`` SGD closures, joins, and reports closures/s and examples/s. The baseline is
the same training run synchronously under MirroredStrategy in this one process (one step
on ``workers`` x 256 rows, all-reduced gradients), timed in the same run. Also measured:
the caller's cost of one ``schedule()`` call (queued while the workers are busy), and the
round trip of a no-op closure on one worker (schedule -> fetch, one at a time).

Workers read every variable they are given in full and send dense deltas back, so the
embedding figures include moving the whole table twice per closure.

Usage: python benchmarks/parameter_server.py [--closures 300] [--rows 100000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _harness

_harness.setup_devices(2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402

import jaxdist as jd  # noqa: E402
from jaxdist.experimental.coordinator import ClusterCoordinator  # noqa: E402
from jaxdist.experimental.partitioners import FixedShardsPartitioner  # noqa: E402

BATCH = 256
DIM = 64
EMBED = 64


def resolver(workers: int) -> Any:
    spec = {"chief": ["c"], "worker": [f"w{i}" for i in range(workers)], "ps": ["p0", "p1"]}
    return jd.cluster_resolver.SimpleClusterResolver(
        jd.cluster_resolver.ClusterSpec(spec), rpc_layer="ray"
    )


def linear_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, DIM)).astype(np.float32)
    return x, (x @ rng.normal(size=DIM)).astype(np.float32)


def embedding_data(rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.integers(0, rows, size=BATCH).astype(np.int32), rng.normal(size=BATCH).astype(
        np.float32
    )


def linear_step(ctx: Any, w: Any, x: Any, y: Any) -> Any:
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w.read_value())
    return ctx.assign_sub(w, 0.01 * g), loss


def linear_step_tf_style(ctx: Any, w: Any, x: Any, y: Any) -> Any:
    """`linear_step` as TF writes it: the update through ctx.assign_sub, only the loss
    returned (the worker sends what ctx.assign_sub recorded)."""
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w.read_value())
    ctx.assign_sub(w, 0.01 * g)
    return loss


def embedding_step(ctx: Any, table: Any, ids: Any, y: Any) -> Any:
    def loss_fn(t: Any) -> Any:
        return jnp.mean((jnp.sum(t[ids], axis=1) - y) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(table.read_value())
    return table.assign_sub(0.01 * g), loss


def ps_throughput(workers: int, closures: int, rows: int) -> dict[str, float]:
    strategy = jd.experimental.ParameterServerStrategy(resolver(workers))
    try:
        with strategy.scope():
            w = jd.Variable(jnp.zeros(DIM), aggregation="sum")
            table = jd.Variable(
                jnp.zeros((rows, EMBED)), aggregation="sum", partitioner=FixedShardsPartitioner(2)
            )
        c = ClusterCoordinator(strategy)
        out = {}
        for name, fn, args in (
            ("linear", linear_step, (w, *linear_data())),
            ("linear, TF style", linear_step_tf_style, (w, *linear_data())),
            ("embedding", embedding_step, (table, *embedding_data(rows))),
        ):
            step = strategy.function(fn)
            n = closures if name.startswith("linear") else max(closures // 10, 3 * workers)
            for _ in range(2 * workers):  # compile on every worker
                c.schedule(step, args=args)
            c.join()
            start = time.perf_counter()
            for _ in range(n):
                c.schedule(step, args=args)
            c.join()
            out[name] = n / (time.perf_counter() - start)
        if workers == 1:
            out.update(overheads(strategy, c))
        return out
    finally:
        strategy._shutdown()


def overheads(strategy: Any, c: Any) -> dict[str, float]:
    noop = jax.jit(lambda x: x)
    x = np.float32(1.0)
    for _ in range(5):
        c.schedule(noop, args=(x,)).fetch()
    trips = []
    for _ in range(200):
        t = time.perf_counter()
        c.schedule(noop, args=(x,)).fetch()
        trips.append(time.perf_counter() - t)
    calls = []
    for _ in range(500):
        t = time.perf_counter()
        c.schedule(noop, args=(x,))
        calls.append(time.perf_counter() - t)
    c.join()
    return {"schedule_call": statistics.median(calls), "round_trip": statistics.median(trips)}


def mirrored_throughput(workers: int, steps: int, rows: int) -> dict[str, float]:
    strategy = jd.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    out = {}
    with strategy.scope():
        w = jd.Variable(jnp.zeros(DIM), aggregation="mean")
        table = jd.Variable(jnp.zeros((rows, EMBED)), aggregation="mean")
    x, y = linear_data()
    ids, t = embedding_data(rows)
    for name, fn, var, data in (
        ("linear", linear_step, w, (np.tile(x, (workers, 1)), np.tile(y, workers))),
        ("embedding", embedding_step, table, (np.tile(ids, workers), np.tile(t, workers))),
    ):
        step = strategy.function(fn)
        per_replica = [
            strategy.experimental_distribute_values_from_function(
                lambda ctx, a=a: a.reshape(n, -1, *a.shape[1:])[ctx.replica_id_in_sync_group]
            )
            for a in data
        ]
        for _ in range(3):
            var, loss = step(var, *per_replica)
        jax.block_until_ready(loss)
        count = steps if name == "linear" else max(steps // 10, 3)
        start = time.perf_counter()
        for _ in range(count):
            var, loss = step(var, *per_replica)
        jax.block_until_ready(loss)
        out[name] = count / (time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--closures", type=int, default=300)
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()
    ray.init(
        address="local",
        include_dashboard=False,
        num_cpus=2,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
    )
    print(_harness.describe_machine(), f"ray {ray.__version__}")
    print(f"embedding table {args.rows} x {EMBED} float32, batch {BATCH} per closure/worker")
    print(
        "| workers | model | PS closures/s | PS examples/s | Mirrored steps/s "
        "| Mirrored examples/s | PS/Mirrored |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    extra: dict[str, float] = {}
    for workers in (1, 2, 3):
        ps = ps_throughput(workers, args.closures, args.rows)
        mirrored = mirrored_throughput(workers, args.closures, args.rows)
        for model in ("linear", "linear, TF style", "embedding"):
            base = "linear" if model.startswith("linear") else model  # the same training
            ps_ex = ps[model] * BATCH
            m_ex = mirrored[base] * BATCH * workers
            print(
                f"| {workers} | {model} | {ps[model]:.0f} | {ps_ex:,.0f} | {mirrored[base]:.0f} "
                f"| {m_ex:,.0f} | {ps_ex / m_ex:.2f} |",
                flush=True,
            )
        extra.update({k: v for k, v in ps.items() if k in ("schedule_call", "round_trip")})
    print(f"schedule() call, median: {extra['schedule_call'] * 1e3:.3f} ms")
    print(f"no-op closure round trip (1 worker), median: {extra['round_trip'] * 1e3:.2f} ms")
    ray.shutdown()


if __name__ == "__main__":
    main()

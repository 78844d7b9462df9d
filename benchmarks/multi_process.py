"""Multi-process data-parallel step: MultiWorkerMirroredStrategy vs hand-written jax.distributed.

MLP 784-1024-1024-10, SGD, global batch 512, float32. Run with no arguments,
it starts the measurement twice: 2 processes x 4 simulated CPU devices (gloo
collectives over loopback) and 1 process x 8 devices. In each, the jaxdist
step (``strategy.function`` over ``jd.MultiWorkerMirroredStrategy``) and a
hand-written ``jax.jit(jax.shard_map(...))`` + ``pmean`` step over the same
``("host", "local")`` mesh alternate in rounds, with the same donation, the
same replicated parameters fed back and the same placed batch. Process 0
prints steps/s and the ratio. Target (issue 10): >= 0.95 of the hand-written
multi-process program.

Usage: python benchmarks/multi_process.py            # both layouts
       python benchmarks/multi_process.py --worker   # one process (started by the above)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

SIZES = (784, 1024, 1024, 10)
BATCH, LR = 512, 0.01


def worker() -> None:
    import jax  # noqa: I001 - the strategy starts jax.distributed before devices are used
    import jaxdist as jd

    strategy = jd.MultiWorkerMirroredStrategy()
    import _harness
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh, axis, n = strategy.mesh, strategy.axis_name, strategy.num_replicas_in_sync
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P(axis))

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
    me, procs = jax.process_index(), jax.process_count()
    x = rng.normal(size=(BATCH, SIZES[0])).astype(np.float32)
    y = rng.integers(0, 10, size=(BATCH,)).astype(np.int32)
    local = slice(me * BATCH // procs, (me + 1) * BATCH // procs)  # this process's rows
    xg = jax.make_array_from_process_local_data(data, x[local], x.shape)
    yg = jax.make_array_from_process_local_data(data, y[local], y.shape)
    params = jax.jit(init, out_shardings=rep)(jax.random.key(0))

    def body(params, x, y):
        loss, g = jax.value_and_grad(loss_fn)(jax.lax.pcast(params, axis, to="varying"), x, y)
        g = jax.lax.pmean(g, axis)
        return jax.tree.map(lambda p, d: p - LR * d, params, g), jax.lax.pmean(loss, axis)

    hand = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis), P(axis)), out_specs=P()),
        donate_argnums=0,
    )

    def replica_step(ctx, params, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        g = ctx.all_reduce("mean", g)
        return jax.tree.map(lambda p, d: p - LR * d, params, g), ctx.all_reduce("mean", loss)

    step = strategy.function(replica_step, options=jd.RunOptions(donate_args=True))
    xs = jd.PerReplica(xg.reshape(n, BATCH // n, SIZES[0]))
    ys = jd.PerReplica(yg.reshape(n, BATCH // n))
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=rep)
    state = {"hand": copy(params), "jd": copy(params)}

    def run_hand():
        state["hand"], loss = hand(state["hand"], xg, yg)
        loss.block_until_ready()

    def run_jd():
        state["jd"], loss = step(state["jd"], xs, ys)
        jax.block_until_ready(loss)

    times = _harness.compare({"hand": run_hand, "jaxdist": run_jd}, calls=10)
    if me == 0:
        base, ours = times["hand"], times["jaxdist"]
        print(
            f"{procs} process(es) x {n // procs} devices: hand-written {1 / base:6.2f} steps/s, "
            f"jaxdist {1 / ours:6.2f} steps/s, throughput ratio {base / ours:.3f}",
            flush=True,
        )
    jd.cluster_resolver.shutdown()


def _launch(processes: int, devices: int) -> None:
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
                stderr=subprocess.DEVNULL,  # gloo's connection chatter
            )
        )
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"benchmark processes exited with {codes}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        start = time.perf_counter()
        _launch(2, 4)
        _launch(1, 8)
        print(f"({time.perf_counter() - start:.0f} s in all)")

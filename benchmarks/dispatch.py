"""Dispatch cost of strategy.run vs a hand-written jax.jit(jax.shard_map(...)).

The step is trivial (add 1, all-reduce sum) so the figure is the per-call
overhead. Every call is waited on. Target: time ratio <= 1.10.
"""

from __future__ import annotations

import sys

import _harness
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd


def main(n_devices: int) -> float:
    strategy = jd.MirroredStrategy(jax.devices()[:n_devices])
    mesh, axis = strategy.mesh, strategy.axis_name
    x = jax.device_put(jnp.zeros((n_devices, 16)), NamedSharding(mesh, P(axis)))

    def step(ctx, v):
        return ctx.all_reduce("sum", v + 1.0)

    hand = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(v[0] + 1.0, axis), mesh=mesh, in_specs=P(axis), out_specs=P()
        )
    )
    per_replica = jd.PerReplica(x)
    times = _harness.compare(
        {
            "hand-written jit(shard_map)": lambda: hand(x).block_until_ready(),
            "strategy.run": lambda: strategy.run(
                step, args=(per_replica,)
            ).array.block_until_ready(),
        },
        calls=300,
    )
    base, ours = times["hand-written jit(shard_map)"], times["strategy.run"]
    print(
        f"{n_devices} replicas: hand-written {base * 1e6:8.1f} us/call   "
        f"strategy.run {ours * 1e6:8.1f} us/call   ratio {ours / base:.3f}"
    )
    return ours / base


if __name__ == "__main__":
    _harness.setup_devices(8)
    print(_harness.describe_machine())
    counts = [int(a) for a in sys.argv[1:]] or [8, 1]
    for n in counts:
        main(min(n, len(jax.devices())))

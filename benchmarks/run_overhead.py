"""Per-call cost of `PreemptionCheckpointHandler.run` vs calling the step directly.

``handler.run(step, *args)`` calls the step, then counts the call (``total_run_calls``,
also a checkpoint item) and tests whether a preemption round has begun. Two figures:

- the Python ``run`` adds: ``handler.run(int)`` vs ``int()`` (a step that does nothing),
  the difference per call in microseconds;
- the cost on a real step: a trivial hand-written ``jax.jit(jax.shard_map(...))`` (add 1,
  ``psum``), every call waited on, called directly (the baseline) and through
  ``handler.run``; a control (the same program through a second ``jax.jit``) shows how far
  two identical programs differ on this machine.

One process (no cluster), a termination watcher that never fires. Rounds run the
candidates in a random order; ratios are medians of per-round ratios, with quartiles.
This was a unit test (``test_run_costs_microseconds``: under 50 us per ``run(int)``,
measured about 1.5 us); a time limit belongs in a benchmark run on a quiet machine.

Usage: python benchmarks/run_overhead.py [replicas ...]   (default: 8 1)
"""

from __future__ import annotations

import statistics
import sys
import tempfile

import _harness
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd


def _report(samples: dict[str, list[float]], base: str, labels: dict[str, str]) -> None:
    times = {k: statistics.median(v) for k, v in samples.items()}
    ratios = _harness.paired_ratios(samples, base)
    print(f"  {labels[base]:34s} {times[base] * 1e6:8.2f} us/call")
    for name, label in labels.items():
        if name == base:
            continue
        med, q1, q3 = ratios[name]
        print(
            f"  {label:34s} {times[name] * 1e6:8.2f} us/call  ratio {med:.3f} "
            f"(quartiles {q1:.3f}-{q3:.3f})  {(times[name] - times[base]) * 1e6:+.2f} us"
        )


def main(n_devices: int, directory: str) -> None:
    mesh = jd.MirroredStrategy(jax.devices()[:n_devices]).mesh
    axis = mesh.axis_names[0]
    x = jax.device_put(jnp.zeros((n_devices, 16)), NamedSharding(mesh, P(axis)))

    def program() -> jax.stages.Wrapped:
        return jax.jit(
            jax.shard_map(
                lambda v: jax.lax.psum(v[0] + 1.0, axis), mesh=mesh, in_specs=P(axis), out_specs=P()
            )
        )

    hand, control = program(), program()
    ckpt = jd.checkpoint.Checkpoint(w=jnp.zeros(3))
    termination = jd.experimental.TerminationConfig(termination_watcher_fn=lambda: False)
    handler = jd.experimental.PreemptionCheckpointHandler(None, ckpt, directory, termination)

    print(f"{n_devices} replica(s):")
    python = _harness.sample({"int": int, "run": lambda: handler.run(int)}, calls=20_000, rounds=21)
    _report(python, "int", {"int": "int() (a step that does nothing)", "run": "handler.run(int)"})
    step = _harness.sample(
        {
            "hand": lambda: jax.block_until_ready(hand(x)),
            "control": lambda: jax.block_until_ready(control(x)),
            "run": lambda: jax.block_until_ready(handler.run(hand, x)),
        },
        calls=60 if n_devices > 1 else 2000,
        rounds=101 if n_devices > 1 else 61,
    )
    _report(
        step,
        "hand",
        {
            "hand": "hand-written jax.jit(shard_map)",
            "control": "hand-written again",
            "run": "handler.run(hand-written, x)",
        },
    )
    print(f"  total_run_calls counted: {handler.total_run_calls}")


if __name__ == "__main__":
    _harness.setup_devices(8)
    print(_harness.describe_machine())
    counts = [int(a) for a in sys.argv[1:]] or [8, 1]
    for n in counts:
        with tempfile.TemporaryDirectory() as directory:
            main(min(n, len(jax.devices())), directory)

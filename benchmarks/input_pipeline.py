"""Serving global batches to 8 replicas: jaxdist's distributed datasets vs hand-written
``jax.device_put(batch, NamedSharding(mesh, P('replica')))`` loops, in one process.

65,536 x 784 float32 rows plus int32 labels, global batches of 512: the same batches
from a list, a tuple, a Python generator (run by the prefetch thread) and
`jd.data.from_arrays`. Each jaxdist loop is compared with the hand-written loop that
runs the same program:

- without prefetching (``InputOptions(experimental_per_replica_buffer_size=0)``, TF's
  way to turn it off): a plain loop that places each batch when it comes to it;
- with jaxdist's default (one batch placed on the devices ahead of the one returned):
  a loop that keeps one placed batch ahead, as ``flax.jax_utils.prefetch_to_device``
  does.

A third pair runs a generator that makes every batch anew (a copy here, as
decoding or reading would): the hand-written loop makes and places each batch
in turn, jaxdist's prefetch thread makes the next ones while batches are
placed.

Each round times every loop once in a fresh random order, and each ratio is taken
against its baseline in the same round (medians of many short rounds, with the
quartiles: on a shared 2-core machine single rounds vary by +-20%). Targets: list and
tuple >= 0.95, generator >= 0.85. Then an MLP step fed by the dataset vs the same step
on one batch already on the devices: prefetch should hide the input cost.

``--groups [k]`` measures the input side of ``steps_per_execution=k`` (default 8):
groups of k global batches placed as one ``(replicas, k, b, ...)`` array per leaf, by

- the hand-written loop: k host batches stacked (one host copy) and one ``device_put``
  per leaf and group;
- jaxdist's grouped train step: the distributed iterator stacks each group's host
  batches once and places them in one transfer per leaf, the next group prefetched
  (what ``jd.train_step(..., steps_per_execution=k)`` does with the iterator);
- for reference, the k batches taken one by one from the distributed dataset (each
  placed, prefetched), then stacked by one program on the devices (the route for a
  plain iterator of placed batches), and the k placed batches without the stacking.

Usage: ``python benchmarks/input_pipeline.py [rounds] [passes per round]`` or
``python benchmarks/input_pipeline.py --groups [k]``.
"""

from __future__ import annotations

import collections
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import _harness
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd

ROWS, FEATURES, BATCH = 65_536, 784, 512


def drain(dataset: Iterable[Any]) -> int:
    """Iterates one epoch and waits for its last batch; returns the batch count."""
    count, batch = 0, None
    for count, batch in enumerate(dataset, 1):  # noqa: B007 (the last batch is waited on)
        pass
    jax.block_until_ready(batch)
    return count


def compare(
    loops: dict[str, Callable[[], int]], rounds: int, passes: int, bases: dict[str, str]
) -> dict[str, tuple[float, float, float, float]]:
    """Batches/s of each loop (median over rounds), and the median and quartiles of its
    per-round rate ratio to its baseline ``bases[name]`` (rounds in random order,
    `_harness.sample`)."""
    batches = {name: loop() for name, loop in loops.items()}  # also warms up
    samples = _harness.sample(loops, calls=passes, rounds=rounds)
    out = {}
    for base in set(bases.values()):
        for name, (ratio, q1, q3) in _harness.paired_ratios(samples, base).items():
            if bases.get(name) == base:
                rate = batches[name] / statistics.median(samples[name])
                out[name] = (rate, 1 / ratio, 1 / q3, 1 / q1)  # rate ratios: time's inverse
    return {name: out[name] for name in loops}


def main(rounds: int, passes: int) -> None:
    strategy = jd.MirroredStrategy()
    x = np.random.default_rng(0).normal(size=(ROWS, FEATURES)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 10, size=(ROWS,)).astype(np.int32)
    sharding = NamedSharding(strategy.mesh, P(strategy.axis_name))
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, ROWS, BATCH)]

    def device_put_loop() -> int:
        last = None
        for bx, by in batches:
            last = (jax.device_put(bx, sharding), jax.device_put(by, sharding))
        jax.block_until_ready(last)
        return len(batches)

    def prefetching_loop() -> int:
        # One placed batch ahead of the one handed on (flax's prefetch_to_device, size 2).
        ahead: collections.deque[Any] = collections.deque()
        last = None
        for bx, by in batches:
            ahead.append((jax.device_put(bx, sharding), jax.device_put(by, sharding)))
            if len(ahead) == 2:
                last = ahead.popleft()
        while ahead:
            last = ahead.popleft()
        jax.block_until_ready(last)
        return len(batches)

    def generator() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        yield from batches

    def making() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        # A generator with work in it: each batch is made anew (here: copied), as
        # decoding or reading files would.
        for bx, by in batches:
            yield bx.copy(), by.copy()

    def device_put_making_loop() -> int:
        last = None
        for bx, by in making():
            last = (jax.device_put(bx, sharding), jax.device_put(by, sharding))
        jax.block_until_ready(last)
        return len(batches)

    arrays = jd.data.from_arrays(x, y, batch_size=BATCH)
    distribute = strategy.experimental_distribute_dataset
    off = jd.InputOptions(experimental_per_replica_buffer_size=0)
    # As a training loop uses them: each dataset is distributed once and every round
    # iterates a new epoch of it. A generator gives one epoch, so it is distributed anew.
    plain = {"list": distribute(batches, off), "tuple": distribute(tuple(batches), off)}
    plain["from_arrays"] = distribute(arrays, off)
    ahead = {"list": distribute(batches), "from_arrays": distribute(arrays)}
    no_prefetch, one_ahead = "hand-written device_put loop", "hand-written, one batch ahead"
    loops: dict[str, Callable[[], int]] = {
        no_prefetch: device_put_loop,
        "  list of batches": lambda: drain(plain["list"]),
        "  tuple of batches": lambda: drain(plain["tuple"]),
        "  generator (prefetch thread)": lambda: drain(distribute(generator(), off)),
        "  jd.data.from_arrays": lambda: drain(plain["from_arrays"]),
        one_ahead: prefetching_loop,
        "  list of batches (default)": lambda: drain(ahead["list"]),
        "  generator (default)": lambda: drain(distribute(generator())),
        "  jd.data.from_arrays (default)": lambda: drain(ahead["from_arrays"]),
        "hand-written, batches made anew": device_put_making_loop,
        "  generator making them (default)": lambda: drain(distribute(making())),
    }
    bases, base = {}, no_prefetch
    for name in loops:
        base = name if not name.startswith(" ") else base
        bases[name] = base
    print(_harness.describe_machine())
    print(f"{rounds} rounds in random order, {passes} passes over {len(batches)} batches each")
    print("ratios: jaxdist's batches/s over the hand-written loop above it (same round)")
    for name, (rate, med, q1, q3) in compare(loops, rounds, passes, bases).items():
        print(f"{name:32s} {rate:7.0f} batches/s   ratio {med:.3f} (quartiles {q1:.2f}-{q3:.2f})")

    # With a training step in the loop: an MLP, plain SGD on all-reduced gradients.
    sizes = (FEATURES, 1024, 1024, 10)
    keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
    params = [
        (jax.random.normal(k, (a, b)) * (2 / a) ** 0.5, jnp.zeros(b))
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]

    def loss_fn(params: Any, bx: jax.Array, by: jax.Array) -> jax.Array:
        h = bx
        for w, b in params[:-1]:
            h = jax.nn.relu(h @ w + b)
        logits = h @ params[-1][0] + params[-1][1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), by[:, None], axis=1))

    def replica_step(ctx: jd.ReplicaContext, params: Any, batch: Any) -> Any:
        bx, by = batch
        loss, g = jax.value_and_grad(loss_fn)(params, bx, by)
        g = ctx.all_reduce("mean", g)
        new = jax.tree.map(lambda p, d: p - 0.01 * d, params, g)
        return new, ctx.all_reduce("mean", loss)

    step = strategy.function(replica_step)
    ds = distribute(arrays)
    fixed = next(iter(ds))
    state = {"p": params}

    def steps(feed: Callable[[], Iterator[Any]], k: int = 32) -> Callable[[], int]:
        def loop() -> int:
            it = feed()
            for _ in range(k):
                state["p"], loss = step(state["p"], next(it))
            loss.array.block_until_ready()
            return k

        return loop

    def fixed_feed() -> Iterator[Any]:
        while True:
            yield fixed

    step_loops = {
        "batch already on the devices": steps(fixed_feed),
        "from jd.data.from_arrays": steps(lambda: iter(ds)),
        "from a generator": steps(lambda: iter(distribute(generator()))),
    }
    print("MLP step 784-1024-1024-10, global batch 512:")
    fixed_base = {name: "batch already on the devices" for name in step_loops}
    for name, (rate, med, _, _) in compare(step_loops, 9, 1, fixed_base).items():
        print(f"  {name:30s} {1e3 / rate:7.2f} ms/step   time ratio {1 / med:.3f}")


def groups(k: int, rounds: int = 15) -> None:
    """Groups of ``k`` batches for ``steps_per_execution=k``: placed as one array per leaf."""
    from jaxdist.training.step.grouped import plan_runs  # the train step's own path

    strategy = jd.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    rows = ROWS // 4
    x = np.random.default_rng(0).normal(size=(rows, FEATURES)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 10, size=(rows,)).astype(np.int32)
    sharding = NamedSharding(strategy.mesh, P(strategy.axis_name))
    count = rows // BATCH // k  # whole groups per epoch

    def hand() -> int:
        last = None
        for g in range(count):
            lo, hi = g * k * BATCH, (g + 1) * k * BATCH
            # (k, n, b, ...) -> (n, k, b, ...): replica r's rows of each of the k batches.
            gx = x[lo:hi].reshape(k, n, BATCH // n, FEATURES).swapaxes(0, 1)
            gy = y[lo:hi].reshape(k, n, BATCH // n).swapaxes(0, 1)
            last = (
                jax.device_put(np.ascontiguousarray(gx), sharding),
                jax.device_put(np.ascontiguousarray(gy), sharding),
            )
        jax.block_until_ready(last)
        return count * k

    dataset = strategy.experimental_distribute_dataset(
        jd.data.from_arrays(x, y, batch_size=BATCH, drop_remainder=True)
    )

    def grouped(how: str) -> Callable[[], int]:
        def loop() -> int:
            it, last = iter(dataset), None
            for _ in range(count):
                if how == "group":  # what the grouped train step does with the iterator
                    ((last, steps),) = plan_runs(it, k)
                    assert steps == k
                    continue
                batches = [next(it) for _ in range(k)]
                if how == "stack":  # the same batches placed one by one, then stacked
                    ((last, steps),) = plan_runs(iter(batches), k)
                else:
                    last = batches[-1]
            jax.block_until_ready(last)
            return count * k

        return loop

    loops = {
        "hand: host stack, one device_put a group": hand,
        "jd: one placed group (the train step's path)": grouped("group"),
        "jd: k placed batches + one stacking program": grouped("stack"),
        "jd: k placed batches, not stacked": grouped("none"),
    }
    base = "hand: host stack, one device_put a group"
    samples = _harness.sample(loops, calls=1, rounds=rounds, warmup=1)
    batch_s = {name: [count * k / t for t in v] for name, v in samples.items()}
    print(_harness.describe_machine())
    print(f"groups of {k} global batches of {BATCH} x {FEATURES} float32, {n} replicas")
    for name, rates in batch_s.items():
        ratios = [r / b for r, b in zip(rates, batch_s[base], strict=True)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(
            f"{name:46s} {statistics.median(rates):8.0f} batches/s   ratio "
            f"{statistics.median(ratios):.3f} (quartiles {q1:.3f}-{q3:.3f})"
        )


if __name__ == "__main__":
    _harness.setup_devices(8)
    if "--groups" in sys.argv:
        rest = [int(a) for a in sys.argv[1:] if a.isdigit()]
        groups(*(rest[:1] or [8]))
    else:
        args = [int(a) for a in sys.argv[1:]]
        main(*(args + [41, 1][len(args) :]))

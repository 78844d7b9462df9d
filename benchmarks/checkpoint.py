"""Save and restore time and bytes of `jaxdist.checkpoint.CheckpointManager` vs orbax's own.

The state is a dict of float32 arrays (a few large ones and some small ones, as
a model's parameters and optimizer state) placed replicated on the devices.
Both sides keep one checkpoint (``max_to_keep=1``, so each save also deletes
the previous one) in directories on the same disk. Saves are timed synchronous
(``enable_async_checkpointing=False`` on both sides) and asynchronous (the
call plus `wait_until_finished`; the time the call alone takes, what a
training step stalls for, is reported beside the time to copy the arrays to
host memory). Restores are placed like the state (orbax: a tree of
`jax.ShapeDtypeStruct`s with the arrays' shardings; jaxdist: the
`Checkpoint`'s current items as the template). jaxdist's save also writes
the SHA-256 manifest of the arrays (hashed while orbax writes them) and
flushes the directory to disk before renaming it into place; its restore
verifies the manifest. Rounds alternate the candidates in a random order;
ratios are medians of per-round ratios with their quartiles. Target (issue
18): jaxdist <= 1.10x orbax's time.

Usage: python benchmarks/checkpoint.py [--mb 100 [1000 ...]] [--devices 8] [--rounds 7]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time

import _harness
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd


def make_state(megabytes: int, mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    """About ``megabytes`` MB of float32: 8 large arrays holding 95% and 24 small ones."""
    rng = np.random.default_rng(0)
    total = megabytes * 1_000_000 // 4
    large, small = int(total * 0.95) // 8, int(total * 0.05) // 24
    sizes = {f"large{i}": large for i in range(8)} | {f"small{i}": small for i in range(24)}
    replicated = NamedSharding(mesh, P())
    return {
        k: jax.device_put(rng.standard_normal(n, dtype=np.float32), replicated)
        for k, n in sizes.items()
    }


def disk_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(here, f)) for here, _, files in os.walk(path) for f in files
    )


def main(megabytes: int, devices: int, rounds: int) -> None:
    import orbax.checkpoint as ocp

    strategy = jd.MirroredStrategy(jax.devices()[:devices])
    state = make_state(megabytes, strategy.mesh)
    nbytes = sum(x.nbytes for x in state.values())
    root = tempfile.mkdtemp(prefix="jaxdist-bench-ckpt-", dir=os.environ.get("BENCH_DIR"))
    try:
        ckpt = jd.checkpoint.Checkpoint(state=state)
        ours = jd.checkpoint.CheckpointManager(ckpt, os.path.join(root, "jaxdist"), max_to_keep=1)
        ours_async = jd.checkpoint.CheckpointManager(
            ckpt, os.path.join(root, "jaxdist-async"), enable_async_checkpointing=True
        )
        theirs, theirs_async = (
            ocp.CheckpointManager(
                os.path.join(root, name),
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=1, enable_async_checkpointing=asynchronous
                ),
            )
            for name, asynchronous in (("orbax", False), ("orbax-async", True))
        )
        abstract = {
            k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for k, x in state.items()
        }
        steps = iter(range(1, 1_000_000))
        last = [0]
        stalls: dict[str, list[float]] = {"orbax": [], "jaxdist": []}

        def orbax_save() -> None:
            last[0] = next(steps)
            theirs.save(last[0], args=ocp.args.StandardSave(state))
            theirs.wait_until_finished()

        def orbax_async_save() -> None:
            start = time.perf_counter()
            theirs_async.save(next(steps), args=ocp.args.StandardSave(state))
            stalls["orbax"].append(time.perf_counter() - start)
            theirs_async.wait_until_finished()

        def jaxdist_async_save() -> None:
            start = time.perf_counter()
            ours_async.save()
            stalls["jaxdist"].append(time.perf_counter() - start)
            ours_async.wait_until_finished()

        def orbax_restore() -> None:
            out = theirs.restore(last[0], args=ocp.args.StandardRestore(abstract))
            jax.block_until_ready(out)

        def jaxdist_restore() -> None:
            ours.restore_or_initialize()
            jax.block_until_ready(ckpt.state)

        candidates = {
            "orbax save": orbax_save,
            "jaxdist save": ours.save,
            "orbax async save": orbax_async_save,
            "jaxdist async save": jaxdist_async_save,
            "orbax restore": orbax_restore,
            "jaxdist restore": jaxdist_restore,
        }
        # One warm-up call each (it also creates the directories).
        samples = _harness.sample(candidates, calls=1, rounds=rounds, warmup=1)
        stalled = {k: statistics.median(v[1:]) for k, v in stalls.items()}  # less the warm-up
        times = {k: statistics.median(v) for k, v in samples.items()}
        on_disk = {
            "orbax": disk_bytes(os.path.join(root, "orbax", str(last[0]))),
            "jaxdist": disk_bytes(ours.latest_checkpoint or ""),
        }
        # jaxdist's own work, alone, on the same arrays: the copy to host memory of its own
        # (what an asynchronous save stalls for) and the SHA-256 of every leaf.
        copy = _harness.seconds_per_call(lambda: [np.array(x) for x in state.values()], 3)
        arrays = [np.asarray(x) for x in state.values()]
        digest = _harness.seconds_per_call(
            lambda: [hashlib.sha256(a.view(np.uint8)).hexdigest() for a in arrays], 3
        )
        theirs.close()
        theirs_async.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"{nbytes / 1e6:.0f} MB state ({len(state)} arrays) replicated on {devices} device(s), "
        f"{rounds} rounds"
    )
    for op in ("save", "async save", "restore"):
        base = samples[f"orbax {op}"]
        ratios = [a / b for a, b in zip(samples[f"jaxdist {op}"], base, strict=True)]
        q1, med, q3 = statistics.quantiles(ratios, n=4)
        print(
            f"  {op:10s} orbax CheckpointManager {times[f'orbax {op}']:.3f} s   "
            f"jaxdist CheckpointManager {times[f'jaxdist {op}']:.3f} s   ratio {med:.2f} "
            f"(quartiles {q1:.2f}-{q3:.2f})"
        )
    print(
        f"  async save stalls the caller: orbax {stalled['orbax']:.3f} s, jaxdist "
        f"{stalled['jaxdist']:.3f} s; copying the arrays to host memory alone takes {copy:.3f} s"
    )
    print(
        f"  on disk: orbax {on_disk['orbax'] / 1e6:.1f} MB, jaxdist {on_disk['jaxdist'] / 1e6:.1f} "
        f"MB ({on_disk['jaxdist'] / on_disk['orbax']:.3f}x)"
    )
    print(f"  SHA-256 of all leaves alone (jaxdist hashes while orbax writes): {digest:.3f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[100], help="state sizes in MB")
    parser.add_argument("--devices", type=int, default=8, help="devices the state is on")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    _harness.setup_devices(max(8, args.devices))
    print(_harness.describe_machine())
    for mb in args.mb:
        main(mb, min(args.devices, len(jax.devices())), args.rounds)

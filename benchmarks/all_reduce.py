"""`ctx.all_reduce` of a gradient tree through each `CrossDeviceOps`, against the same
collectives written by hand in `jax.shard_map`.

The tree is the gradient of `benchmarks/mesh.py`'s decoder at (8, 1, 1): 34 float32
leaves, 12 MiB per replica. Each case sums it over 8 replicas:

- ``nccl``: `NcclAllReduce` (one ``psum`` per leaf, which XLA combines) against
  ``lax.psum(tree, axes)``;
- ``packed``: `NcclAllReduce` with ``CommunicationOptions(bytes_per_pack=4 MiB)``
  against the same concatenation into buffers of at least 4 MiB, ``psum`` and split;
- ``ring``: `HierarchicalCopyAllReduce` over one axis against ``psum_scatter`` +
  ``all_gather`` of each (flattened, padded) leaf;
- ``ring 2x4`` and ``ring 1x8``: over ``(host, local)`` meshes of one process, against
  ``psum_scatter`` over ``local``, ``psum`` over ``host`` (where it has more than one
  device) and ``all_gather`` over ``local``.

Both sides take the same placed arrays (one row per replica) and return the sum on
every device; every result is checked against NumPy first. Rounds run the candidates
in a random order; the ratio is the median of per-round time ratios (jaxdist / hand),
with its quartiles.

Usage: python benchmarks/all_reduce.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import _harness
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd

SHAPES = [(256, 256)] * 16 + [(256, 1024)] * 4 + [(1024, 256)] * 4 + [(256,)] * 10
PACK_BYTES = 4 * 2**20


def _hand_ring(axes: tuple[str, ...]) -> Callable[[jax.Array], jax.Array]:
    """One leaf's ring all-reduce by hand: the axes of size 1 left out, as jaxdist does."""

    def one(x: jax.Array) -> jax.Array:
        *outer, inner = [a for a in axes if lax.axis_size(a) > 1]
        n = lax.axis_size(inner)
        flat = x.reshape(-1)
        pad = (-flat.size) % n
        flat = jnp.pad(flat, (0, pad)) if pad else flat
        part = lax.psum_scatter(flat, inner, scatter_dimension=0, tiled=True)
        if outer:
            part = lax.psum(part, tuple(outer))
        gather = tuple(a for a in axes if a == inner or lax.axis_size(a) == 1)
        whole = lax.all_gather(part, gather, tiled=True, to="invarying")
        return whole[: x.size].reshape(x.shape)

    return one


def _hand_packed(leaves: list[jax.Array], axes: tuple[str, ...]) -> list[jax.Array]:
    """Consecutive leaves concatenated into buffers of at least ``PACK_BYTES``, each
    summed by one ``psum``, then split."""
    packs: list[list[int]] = [[]]
    size = 0
    for i, x in enumerate(leaves):
        packs[-1].append(i)
        size += x.size * x.dtype.itemsize
        if size >= PACK_BYTES and i < len(leaves) - 1:
            packs.append([])
            size = 0
    out: list[Any] = [None] * len(leaves)
    for pack in packs:
        total = lax.psum(jnp.concatenate([leaves[i].reshape(-1) for i in pack]), axes)
        offset = 0
        for i in pack:
            out[i] = total[offset : offset + leaves[i].size].reshape(leaves[i].shape)
            offset += leaves[i].size
    return out


def _case(
    name: str,
    strategy: jd.Strategy,
    hand_sum: Callable[[list[jax.Array]], list[jax.Array]],
    options: Any,
    rows: list[np.ndarray],
    rounds: int,
) -> None:
    mesh = strategy.mesh
    axes = tuple(mesh.axis_names)
    placed = [jax.device_put(r, NamedSharding(mesh, P(axes))) for r in rows]
    per_replica = [jd.PerReplica(x) for x in placed]
    ours = strategy.function(lambda ctx, xs: ctx.all_reduce("sum", xs, options=options))
    hand = jax.jit(
        jax.shard_map(
            lambda xs: hand_sum([x[0] for x in xs]),
            mesh=mesh,
            in_specs=(P(axes),),
            out_specs=P(),
        )
    )
    want = [r.sum(0) for r in rows]
    for out in (ours(per_replica), hand(placed)):
        for got, expected in zip(out, want, strict=True):
            np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-4)
    samples = _harness.sample(
        {
            "hand": lambda: jax.block_until_ready(hand(placed)),
            "jaxdist": lambda: jax.block_until_ready(ours(per_replica)),
        },
        calls=5,
        rounds=rounds,
    )
    med, q1, q3 = _harness.paired_ratios(samples, "hand")["jaxdist"]
    hand_ms = statistics.median(samples["hand"]) * 1e3
    ours_ms = statistics.median(samples["jaxdist"]) * 1e3
    print(
        f"{name:10s} hand {hand_ms:6.1f} ms  jaxdist {ours_ms:6.1f} ms  "
        f"time ratio {med:.3f} (quartiles {q1:.3f}-{q3:.3f})"
    )


def main(rounds: int) -> None:
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((8, *s)).astype(np.float32) for s in SHAPES]
    mib = sum(int(np.prod(s)) for s in SHAPES) * 4 / 2**20
    print(f"{len(SHAPES)} leaves, {mib:.1f} MiB per replica, summed over 8 replicas")
    devices = jax.devices()[:8]
    one = ("replica",)
    ring = jd.HierarchicalCopyAllReduce()
    packed = jd.experimental.CommunicationOptions(bytes_per_pack=PACK_BYTES)
    cases: list[tuple[str, jd.Strategy, Callable[..., Any], Any]] = [
        (
            "nccl",
            jd.MirroredStrategy(devices, cross_device_ops=jd.NcclAllReduce()),
            lambda xs: lax.psum(xs, one),
            None,
        ),
        (
            "packed",
            jd.MirroredStrategy(devices, cross_device_ops=jd.NcclAllReduce()),
            lambda xs: _hand_packed(xs, one),
            packed,
        ),
        (
            "ring",
            jd.MirroredStrategy(devices, cross_device_ops=ring),
            lambda xs: [_hand_ring(one)(x) for x in xs],
            None,
        ),
    ]
    for shape in ((2, 4), (1, 8)):
        two = ("host", "local")
        strategy = jd.Strategy(devices, ring, mesh_shape=shape, axis_names=two)
        cases.append(
            (
                f"ring {shape[0]}x{shape[1]}",
                strategy,
                lambda xs, two=two: [_hand_ring(two)(x) for x in xs],
                None,
            )
        )
    for name, strategy, hand_sum, options in cases:
        assert tuple(strategy.mesh.axis_names) in (one, ("host", "local")), name
        _case(name, strategy, hand_sum, options, rows, rounds)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    _harness.setup_devices(8)
    args = parser.parse_args()
    print(_harness.describe_machine())
    main(args.rounds)

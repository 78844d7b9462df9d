"""Fully sharded data parallelism: `FSDPStrategy` vs hand-written FSDP vs Mirrored, one process.

A small decoder (4 layers, d 256, 4 heads, vocabulary 256, sequence 32),
softmax cross-entropy, adamw(1e-3), float32, global batch 16 over 8 replicas.
Sides, run in interleaved rounds on the same placed batch, each donating its
state and feeding it back:

- ``hand FSDP``: as Flax/MaxText users write it: parameters and optimizer
  state placed with ``NamedSharding`` on their first dimension divisible by 8
  (replicated below 16 KiB), the batch sharded on the replica axis, one
  ``jax.jit`` of the global-batch step (XLA's partitioner inserts the
  all-gathers and reduce-scatters, and runs the optimizer on the shards);
- ``FSDPStrategy``: ``@jd.train_step`` over ``nnx.Module`` / ``nnx.Optimizer``
  under ``jd.experimental.FSDPStrategy()``;
- ``Mirrored``: the same ``@jd.train_step`` under ``jd.MirroredStrategy()``.

Prints steps/s, the ratio to the hand-written FSDP step, and per-device
memory: parameters + optimizer state held between steps (the arrays'
shards) and the compiled step's ``memory_analysis()`` (arguments, temporaries).

Usage: python benchmarks/fsdp.py [--rounds N]
"""

from __future__ import annotations

import sys

import _harness
import jax
import numpy as np
import optax
from _nnx_sides import hand_side, jaxdist_side
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd

LAYERS, D, HEADS, VOCAB, SEQ, BATCH = 4, 256, 4, 256, 32, 16
MIN_SHARD_BYTES = 1 << 14


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.norm1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=D, decode=False, use_bias=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ, D)))
        self.layers = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[None]
        mask = nnx.make_causal_mask(tokens)
        for block in self.layers:
            x = block(x, mask)
        return self.head(self.norm(x))


def _loss(model: Transformer, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean(axis=-1)


def _first_divisible(x: jax.Array, n: int) -> P:
    if x.nbytes < MIN_SHARD_BYTES or x.ndim == 0:
        return P()
    for d, size in enumerate(x.shape):
        if size % n == 0:
            return P(*([None] * d), "replica")
    return P()


def candidates() -> tuple[dict, dict]:
    tx = optax.adamw(1e-3)
    mirrored = jd.MirroredStrategy()
    fsdp = jd.experimental.FSDPStrategy(min_shard_bytes=MIN_SHARD_BYTES)
    n, mesh = mirrored.num_replicas_in_sync, mirrored.mesh
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    batch = NamedSharding(mesh, P("replica"))
    xg, yg = jax.device_put(x, batch), jax.device_put(y, batch)
    xs, ys = jd.PerReplica(xg.reshape(n, BATCH // n, SEQ)), jd.PerReplica(yg.reshape(n, -1, SEQ))
    runs, memory = {}, {}

    # 1. Hand-written FSDP: NamedSharding on the first divisible dimension + jax.jit.
    def shardings_of(state: object) -> object:
        return jax.tree.map(lambda a: NamedSharding(mesh, _first_divisible(a, n)), state)

    model = Transformer(nnx.Rngs(0))
    runs["hand FSDP"], memory["hand FSDP"] = hand_side(model, tx, _loss, shardings_of, xg, yg)

    # 2. and 3. jd.train_step under FSDPStrategy and MirroredStrategy.
    for name, strategy in (("FSDPStrategy", fsdp), ("Mirrored", mirrored)):
        model = Transformer(nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        side = jaxdist_side(strategy, model, opt, _loss, BATCH, xs, ys)
        runs[name], memory[name] = side
    return runs, memory


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 9
    _harness.setup_devices(8)
    runs, memory = candidates()
    samples = _harness.sample(runs, calls=5, rounds=rounds, warmup=2)
    ratios = _harness.paired_ratios(samples, "hand FSDP")
    print(_harness.describe_machine())
    print(
        f"decoder {LAYERS} layers, d {D}, seq {SEQ}, global batch {BATCH}, adamw; {rounds} rounds"
    )
    for name, times in samples.items():
        t = float(np.median(times))
        r, q1, q3 = ratios[name]
        print(
            f"{name:14s} {1 / t:7.2f} steps/s   throughput vs hand FSDP {1 / r:.3f} "
            f"(time ratio {r:.3f}, quartiles {q1:.3f}-{q3:.3f})"
        )
    print("\nper device, MiB: state held between steps | compiled step: arguments, temporaries")
    for name, (state_bytes, compiled) in memory.items():
        analysis = compiled.memory_analysis()
        args, temp = analysis.argument_size_in_bytes, analysis.temp_size_in_bytes
        print(f"{name:14s} {state_bytes() / 2**20:8.2f} | {args / 2**20:8.2f} {temp / 2**20:8.2f}")


if __name__ == "__main__":
    main()

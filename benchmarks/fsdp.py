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
import jax.numpy as jnp
import numpy as np
import optax
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


def _per_device_bytes(tree: object) -> int:
    per: dict[object, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values())


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
    model = Transformer(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    state = (params, tx.init(params))
    shardings = jax.tree.map(lambda a: NamedSharding(mesh, _first_divisible(a, n)), state)
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)
    hand_state = [copy(state)]

    def hand_step(state, x, y):  # type: ignore[no-untyped-def]
        params, opt_state = state

        def loss(p):  # type: ignore[no-untyped-def]
            return _loss(nnx.merge(graphdef, nnx.State(p)), x, y).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    hand = jax.jit(hand_step, out_shardings=(shardings, None), donate_argnums=(0,))

    def run_hand() -> None:
        hand_state[0], value = hand(hand_state[0], xg, yg)
        value.block_until_ready()

    runs["hand FSDP"] = run_hand
    analysis = hand.lower(hand_state[0], xg, yg).compile().memory_analysis()
    memory["hand FSDP"] = (lambda: _per_device_bytes(hand_state[0]), analysis)

    # 2. and 3. jd.train_step under FSDPStrategy and MirroredStrategy.
    def jaxdist_side(strategy: jd.Strategy) -> tuple:
        model = Transformer(nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @jd.train_step(strategy)
        def step(ctx, model, opt, x, y):  # type: ignore[no-untyped-def]
            def loss(m):  # type: ignore[no-untyped-def]
                return jd.compute_average_loss(_loss(m, x, y), global_batch_size=BATCH)

            value, grads = nnx.value_and_grad(loss)(model)
            opt.update(model, ctx.all_reduce("sum", grads))
            return ctx.all_reduce("sum", value)

        def run() -> None:
            step(model, opt, xs, ys).block_until_ready()

        run()  # places the state
        analysis = step.lower(model, opt, xs, ys).compile().memory_analysis()
        return run, (lambda: _per_device_bytes(nnx.state((model, opt))), analysis)

    runs["FSDPStrategy"], memory["FSDPStrategy"] = jaxdist_side(fsdp)
    runs["Mirrored"], memory["Mirrored"] = jaxdist_side(mirrored)
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
    for name, (state_bytes, analysis) in memory.items():
        args, temp = analysis.argument_size_in_bytes, analysis.temp_size_in_bytes
        print(f"{name:14s} {state_bytes() / 2**20:8.2f} | {args / 2**20:8.2f} {temp / 2**20:8.2f}")


if __name__ == "__main__":
    main()

"""A GPT-2-style decoder written once with logical axis names, trained on any mesh.

Token and position embeddings, pre-norm blocks of causal multi-head attention
and a GELU MLP, a final layer norm and a head tied to the token embedding.
Every parameter is annotated with ``nnx.with_partitioning`` (or ``nnx.Param(...,
out_sharding=...)``) and the activations with
``jd.experimental.logical_constraint``, so the same model runs on one device,
under `MirroredStrategy` and on any `MeshStrategy` mesh; `RULES` maps the
logical names to the mesh axes ``data``, ``fsdp`` and ``tensor``.

``python -m jaxdist.examples.gpt --mesh 2,2,2`` trains it on random tokens for a
few steps (8 simulated CPU devices without an accelerator) and prints the loss
and each device's share of the state.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import jaxdist as jd

RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("vocab", "tensor"),
    ("length", None),
    ("norm", None),
)
AXES = ("data", "fsdp", "tensor")
SHAPES = [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (1, 4, 2), (2, 1, 4)]


def _dense(d_in: int, d_out: int, names: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), names),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (names[1],)),
        rngs=rngs,
    )


def _norm(d: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        d,
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("norm",)),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("norm",)),
        rngs=rngs,
    )


Constrain = Callable[[jax.Array, tuple[str, ...]], jax.Array]


class Attention(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs, constrain: Constrain) -> None:
        self.heads = heads
        self.constrain = constrain
        self.q = _dense(d, d, ("embed", "heads"), rngs)
        self.k = _dense(d, d, ("embed", "heads"), rngs)
        self.v = _dense(d, d, ("embed", "heads"), rngs)
        self.o = _dense(d, d, ("heads", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.heads

        def split(y: jax.Array) -> jax.Array:
            y = self.constrain(y, ("batch", "length", "heads"))
            return y.reshape(b, t, h, d // h)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        logits = jnp.einsum("bthc,bshc->bhts", q, k) / jnp.sqrt(d // h)
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        out = jnp.einsum("bhts,bshc->bthc", weights, v).reshape(b, t, d)
        out = self.constrain(out, ("batch", "length", "heads"))
        return self.o(out)


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs, constrain: Constrain) -> None:
        self.constrain = constrain
        self.norm1 = _norm(d, rngs)
        self.attn = Attention(d, heads, rngs, constrain)
        self.norm2 = _norm(d, rngs)
        self.up = _dense(d, 4 * d, ("embed", "mlp"), rngs)
        self.down = _dense(4 * d, d, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        h = jax.nn.gelu(self.up(self.norm2(x)))
        h = self.constrain(h, ("batch", "length", "mlp"))
        return x + self.down(h)


class Decoder(nnx.Module):
    """Vocabulary ``vocab``, width ``d``, ``layers`` blocks of ``heads`` heads, context
    ``length``; the head shares the token embedding (as GPT-2). ``constrain(x, names)``
    lays out activations (default `jaxdist.experimental.logical_constraint`; a
    hand-written program passes Flax's ``nn.with_logical_constraint``)."""

    def __init__(
        self,
        rngs: nnx.Rngs,
        *,
        vocab: int = 64,
        d: int = 32,
        layers: int = 2,
        heads: int = 8,
        length: int = 8,
        constrain: Constrain = jd.experimental.logical_constraint,
    ) -> None:
        self.constrain = constrain
        self.embed = nnx.Embed(
            vocab,
            d,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02), ("vocab", "embed")),
            rngs=rngs,
        )
        self.pos = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (length, d)), out_sharding=("length", "embed")
        )
        self.blocks = nnx.List([Block(d, heads, rngs, constrain) for _ in range(layers)])
        self.norm = _norm(d, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[None, : tokens.shape[1]]
        x = self.constrain(x, ("batch", "length", "embed"))
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))


def mesh_strategy(shape: tuple[int, int, int], **kwargs: Any) -> jd.experimental.MeshStrategy:
    return jd.experimental.MeshStrategy(dict(zip(AXES, shape, strict=True)), RULES, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxdist.examples.gpt")
    parser.add_argument("--mesh", default="2,2,2", help="data,fsdp,tensor sizes")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    import numpy as np
    import optax

    shape = tuple(int(k) for k in args.mesh.split(","))
    strategy = mesh_strategy(shape)  # type: ignore[arg-type]
    with strategy.scope():  # the parameters are born in their ruled layout
        model = Decoder(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    batch = 4 * strategy.num_replicas_in_sync

    @jd.train_step(strategy)
    def step(
        ctx: jd.ReplicaContext,
        model: Decoder,
        opt: nnx.Optimizer,
        tokens: jax.Array,
        targets: jax.Array,
    ) -> jax.Array:
        def loss_fn(m: Decoder) -> jax.Array:
            xent = optax.softmax_cross_entropy_with_integer_labels(m(tokens), targets)
            return jd.compute_average_loss(xent.mean(axis=-1), global_batch_size=batch)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return ctx.all_reduce("sum", loss)

    rng = np.random.default_rng(0)
    data = rng.integers(0, 64, size=(args.steps * batch, 9)).astype(np.int32)
    dataset = strategy.experimental_distribute_dataset(
        jd.data.from_arrays(data[:, :-1], data[:, 1:], batch_size=batch)
    )
    for i, (tokens, targets) in enumerate(dataset):
        print(f"step {i}: loss {float(step(model, opt, tokens, targets)):.4f}")
    state = jax.tree.leaves(nnx.state((model, opt)))
    total = sum(x.nbytes for x in state)
    mine = sum(x.addressable_shards[0].data.nbytes for x in state)
    print(f"{strategy!r}: device 0 holds {mine / total:.3f} of the state")
    return 0


if __name__ == "__main__":
    # Simulate 8 CPU devices when there is no accelerator (before the first device
    # query; it does nothing to GPU or TPU backends).
    jax.config.update("jax_num_cpu_devices", 8)
    raise SystemExit(main(sys.argv[1:]))

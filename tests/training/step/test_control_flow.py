"""A train step whose model and update use every kind of control flow JAX has (lax.scan,
nnx.scan over layers, lax.while_loop, lax.cond, jax.checkpoint, custom_jvp, custom_vjp and
a nested jax.jit), trained under `MirroredStrategy` (8 replicas) against the same steps on
one device with ``nnx.jit``.

Tolerance: float32, rtol 1e-5 / atol 1e-6 (the all-reduce sums per-replica gradients in
another order than one device sums per-example ones). The parameters must come back as one
replicated copy (the invariance analysis follows every construct), with no all-reduce
beyond the hand-written `shard_map` step of the same program.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxdist as jd

from _helpers import all_reduce_count, hand_written_step_hlo

STEPS, BATCH, T, D_IN, D, LAYERS = 10, 16, 4, 6, 8, 3
RTOL, ATOL = 1e-5, 1e-6


@jax.custom_jvp
def softplus(x: jax.Array) -> jax.Array:
    return jnp.logaddexp(x, 0.0)


@softplus.defjvp
def _softplus_jvp(primals: Any, tangents: Any) -> Any:
    (x,), (t,) = primals, tangents
    return softplus(x), t * jax.nn.sigmoid(x)


@jax.custom_vjp
def halve_gradient(x: jax.Array) -> jax.Array:
    return x


halve_gradient.defvjp(lambda x: (x, None), lambda _, g: (0.5 * g,))


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return jnp.tanh(self.linear(h))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.inp = nnx.Linear(D_IN, D, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(r: nnx.Rngs) -> Block:
            return Block(r)

        self.blocks = make(rngs)
        self.out = nnx.Linear(D, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (batch, T, D_IN)
        # lax.scan over time, carry batched: every example stays independent.
        def rnn(c: jax.Array, xt: jax.Array) -> tuple[jax.Array, None]:
            return jnp.tanh(0.5 * c + self.inp(xt)), None

        h0 = jnp.zeros_like(self.inp(x[:, 0]))  # typed like the data (per replica)
        h, _ = jax.lax.scan(rnn, h0, jnp.swapaxes(x, 0, 1))

        # nnx.scan over stacked layers.
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def over_layers(h: jax.Array, block: Block) -> jax.Array:
            return block(h)

        h = over_layers(h, self.blocks)
        h = jax.checkpoint(lambda a: softplus(a) * 0.5)(h)
        h = halve_gradient(h)
        # cond on a value that is the same on every replica (computed from parameters).
        h = jax.lax.cond(jnp.sum(self.out.bias[...]) > 1e3, lambda a: a * 0.0, lambda a: a, h)
        return jax.jit(self.out)(h)


def _ce(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _clip(grads: Any) -> Any:
    """Clips the global gradient norm to 1, the norm's square root found by a while loop
    (Newton's iteration) and applied under a cond."""
    sq = sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))

    def newton(s: tuple[Any, Any]) -> tuple[Any, Any]:
        i, r = s
        return i + 1, 0.5 * (r + sq / r)

    _, norm = jax.lax.while_loop(lambda s: s[0] < 20, newton, (0, jnp.maximum(sq, 1.0)))
    return jax.lax.cond(
        norm > 1.0,
        lambda g: jax.tree.map(lambda a: a / norm, g),
        lambda g: g,
        grads,
    )


def _batches() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, BATCH, T, D_IN)).astype(np.float32)
    y = rng.integers(0, 3, size=(STEPS, BATCH)).astype(np.int32)
    return x, y


def _split(strategy: jd.Strategy, a: np.ndarray) -> jd.PerReplica:
    n = strategy.num_replicas_in_sync
    return jd.PerReplica(a.reshape(n, a.shape[0] // n, *a.shape[1:]))


def _step(strategy: jd.Strategy) -> Any:
    @jd.train_step(strategy)
    def step(ctx: jd.ReplicaContext, model: Model, opt: nnx.Optimizer, x: Any, y: Any) -> Any:
        def loss_fn(m: Model) -> jax.Array:
            return jnp.sum(_ce(m(x), y)) / BATCH

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, _clip(ctx.all_reduce("sum", grads)))
        return ctx.all_reduce("sum", loss)

    return step


def test_control_flow_training_equals_single_device_with_one_replicated_copy() -> None:
    strategy = jd.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 8
    tx = optax.adamw(1e-2)
    xs, ys = _batches()
    with strategy.scope():
        model = Model(nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = _step(strategy)
    losses = [
        float(step(model, opt, _split(strategy, x), _split(strategy, y)))
        for x, y in zip(xs, ys, strict=True)
    ]

    ref = Model(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)

    @nnx.jit
    def ref_step(m: Model, o: nnx.Optimizer, x: Any, y: Any) -> Any:
        loss, grads = nnx.value_and_grad(lambda mm: jnp.mean(_ce(mm(x), y)))(m)
        o.update(m, _clip(grads))
        return loss

    ref_losses = [float(ref_step(ref, ref_opt, x, y)) for x, y in zip(xs, ys, strict=True)]
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    got, want = nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), got, want)
    # One replicated copy of every parameter and optimizer leaf (not averaged copies).
    for leaf in jax.tree.leaves(nnx.state(model)) + jax.tree.leaves(nnx.state(opt)):
        if isinstance(leaf, jax.Array) and leaf.ndim:
            assert leaf.sharding.is_fully_replicated, leaf.sharding
    assert int(opt.step.get_value()) == STEPS

    # No all-reduce beyond the hand-written shard_map step of the same program.
    ours = step.lower(model, opt, _split(strategy, xs[0]), _split(strategy, ys[0]))
    hand_hlo = hand_written_step_hlo(strategy, Model(nnx.Rngs(0)), tx, _ce, xs[0], ys[0], _clip)
    ours_hlo = ours.compile().as_text()
    assert 1 <= all_reduce_count(ours_hlo) <= all_reduce_count(hand_hlo)
    assert "all-gather" not in ours_hlo

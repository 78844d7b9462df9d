"""The two sides of the sharded-training benchmarks (`fsdp.py`, `mesh.py`), written once.

- `hand_side`: the hand-written program, as Flax/MaxText users write it: one
  ``jax.jit`` of the global-batch step over a pure-dict params tree and its optax
  state, placed with the given ``NamedSharding``s, donated and fed back;
- `jaxdist_side`: ``@jd.train_step`` over an ``nnx.Module`` and ``nnx.Optimizer``
  under a strategy, the user's step (``ctx.all_reduce`` of the gradients).

Each returns a function running one step (waiting for it) and the per-device
memory: a function giving the state bytes one device holds between steps, and
the compiled step (``memory_analysis()``, ``cost_analysis()``, its HLO).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxdist as jd

Side = tuple[Callable[[], None], tuple[Callable[[], int], Any]]


def per_device_bytes(tree: object) -> int:
    """The most bytes of ``tree``'s arrays that one device holds."""
    per: dict[object, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values())


def hand_side(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    loss: Callable[[Any, jax.Array, jax.Array], jax.Array],
    shardings_of: Callable[[Any], Any],
    x: jax.Array,
    y: jax.Array,
) -> Side:
    """``shardings_of((params, opt_state))`` gives the state's ``NamedSharding``s;
    ``loss(model, x, y)`` the per-example losses."""
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    state = (params, tx.init(params))
    shardings = shardings_of(state)
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=shardings)
    held = [copy(state)]

    def step(state, x, y):  # type: ignore[no-untyped-def]
        params, opt_state = state

        def mean_loss(p):  # type: ignore[no-untyped-def]
            return loss(nnx.merge(graphdef, nnx.State(p)), x, y).mean()

        value, grads = jax.value_and_grad(mean_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    jitted = jax.jit(step, out_shardings=(shardings, None), donate_argnums=(0,))

    def run() -> None:
        held[0], value = jitted(held[0], x, y)
        value.block_until_ready()

    compiled = jitted.lower(held[0], x, y).compile()
    return run, (lambda: per_device_bytes(held[0]), compiled)


def jaxdist_side(
    strategy: jd.Strategy,
    model: nnx.Module,
    opt: nnx.Optimizer,
    loss: Callable[[Any, jax.Array, jax.Array], jax.Array],
    global_batch: int,
    xs: Any,
    ys: Any,
) -> Side:
    """``jd.train_step(strategy)`` of ``loss(model, x, y)`` (per-example losses)."""

    @jd.train_step(strategy)
    def step(ctx, model, opt, x, y):  # type: ignore[no-untyped-def]
        def mean_loss(m):  # type: ignore[no-untyped-def]
            return jd.compute_average_loss(loss(m, x, y), global_batch_size=global_batch)

        value, grads = nnx.value_and_grad(mean_loss)(model)
        opt.update(model, ctx.all_reduce("sum", grads))
        return ctx.all_reduce("sum", value)

    def run() -> None:
        step(model, opt, xs, ys).block_until_ready()

    run()  # places the state
    compiled = step.lower(model, opt, xs, ys).compile()
    return run, (lambda: per_device_bytes(nnx.state((model, opt))), compiled)

"""Data-parallel training step: jaxdist vs hand-written JAX, in one process.

MLP 784-1024-1024-10 (relu), softmax cross-entropy, adamw(1e-3), float32,
global batch 512 over 8 replicas. Every side runs the same program: per-
replica gradients all-reduced (mean), one adamw update, parameters and
optimizer state kept as one replicated copy, donated and fed back, the same
placed batch. Sides:

- ``shard_map``: hand-written ``jax.jit(jax.shard_map(...))`` + ``pmean`` (the baseline),
- ``nnx.jit``: Flax's own route, ``nnx.jit`` over a replicated model and a
  batch sharded with ``NamedSharding`` (the partitioner inserts the collectives),
- ``train_step nnx``: ``@jd.train_step`` over an ``nnx.Module`` and ``nnx.Optimizer``,
- ``train_step linen``: ``@jd.train_step`` over a Linen model in a ``jd.TrainState``,
- ``strategy.function``: a functional ``(params, opt_state)`` step through
  ``strategy.function`` (``donate_argnums=(0, 1)``: the state donated, the batch kept),
- ``train_step k=8``: the NNX ``train_step`` with ``steps_per_execution=8`` (8 steps per
  call over the same placed batch; its time is per step: per call / 8).

Targets (issue 9): ``train_step`` throughput ratio >= 0.97 vs ``shard_map``.

``--overhead [case ...]`` instead measures the per-call cost with models of
little compute (where Python work dominates; cases in ``OVERHEAD_CASES``, all by
default): hand-written ``jax.jit`` with donation, ``nnx.split``/``merge`` around
``jax.jit``, ``nnx.jit``, ``jd.train_step`` and ``strategy.function``.

Usage: python benchmarks/train_step.py [--overhead [mlp32] [deep48] [deep48x8]]
"""

from __future__ import annotations

import itertools
import statistics
import sys

import _harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen, nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd

SIZES = (784, 1024, 1024, 10)
BATCH = 512


class MLP(nnx.Module):
    def __init__(self, sizes: tuple[int, ...], rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


class LinenMLP(linen.Module):
    sizes: tuple[int, ...]

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for n in self.sizes[1:-1]:
            x = jax.nn.relu(linen.Dense(n)(x))
        return linen.Dense(self.sizes[-1])(x)


def _ce(logits: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _data(batch: int, features: int, n: int, mesh, axis):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, features)).astype(np.float32)
    y = rng.integers(0, 10, size=(batch,)).astype(np.int32)
    data = NamedSharding(mesh, P(axis))
    xg, yg = jax.device_put(x, data), jax.device_put(y, data)
    xs = jd.PerReplica(xg.reshape(n, batch // n, features))
    ys = jd.PerReplica(yg.reshape(n, batch // n))
    return x, y, xg, yg, xs, ys


def candidates(strategy: jd.Strategy, sizes: tuple[int, ...], batch: int) -> dict:
    n, mesh, axis = strategy.num_replicas_in_sync, strategy.mesh, strategy.axis_name
    rep = NamedSharding(mesh, P())
    tx = optax.adamw(1e-3)
    _, _, xg, yg, xs, ys = _data(batch, sizes[0], n, mesh, axis)

    # 1. hand-written shard_map + pmean, params/opt_state donated and fed back. The
    # parameters are a plain dict of arrays (no nnx.Variable nodes to flatten per call).
    graphdef, state0 = nnx.split(MLP(sizes, nnx.Rngs(0)), nnx.Param)
    params0 = nnx.to_pure_dict(state0)

    def loss_fn(params, x, y):
        state = jax.tree.map(lambda v: v, state0)  # a fresh State to fill (at trace time)
        nnx.replace_by_pure_dict(state, params)
        return jnp.mean(_ce(nnx.merge(graphdef, state)(x), y))

    def body(params, opt_state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(jax.lax.pcast(params, axis, to="varying"), x, y)
        g = jax.lax.pmean(g, axis)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axis)

    hand = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(axis), P(axis)), out_specs=P()),
        donate_argnums=(0, 1),
    )
    # Own buffers: each side donates its state, which must share nothing (`jax.device_put`
    # may reuse a source buffer as one shard of a replicated array; a jitted copy never does).
    own = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=rep)
    hand_state = own((params0, tx.init(params0)))

    def run_hand():
        p, o, loss = hand(*hand_state, xg, yg)
        hand_state[:] = [p, o]
        loss.block_until_ready()

    hand_state = list(hand_state)

    # 2. Flax's route: nnx.jit, replicated model, batch sharded by NamedSharding.
    flax_model = MLP(sizes, nnx.Rngs(0))
    flax_opt = nnx.Optimizer(flax_model, tx, wrt=nnx.Param)
    nnx.update((flax_model, flax_opt), jax.device_put(nnx.state((flax_model, flax_opt)), rep))

    @nnx.jit(donate_argnums=(0, 1))
    def flax_step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(_ce(m(x), y)))(model)
        opt.update(model, grads)
        return loss

    def run_flax():
        flax_step(flax_model, flax_opt, xg, yg).block_until_ready()

    # 3. jd.train_step over NNX objects.
    with strategy.scope():
        model = MLP(sizes, nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @jd.train_step(strategy)
    def nnx_step(ctx, model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(_ce(m(x), y)))(model)
        opt.update(model, ctx.all_reduce("mean", grads))
        return ctx.all_reduce("mean", loss)

    def run_nnx():
        nnx_step(model, opt, xs, ys).block_until_ready()

    # 3b. the same step, GROUP steps per call (steps_per_execution) over the same batch.
    with strategy.scope():
        gmodel = MLP(sizes, nnx.Rngs(0))
        gopt = nnx.Optimizer(gmodel, tx, wrt=nnx.Param)

    @jd.train_step(strategy, steps_per_execution=GROUP)
    def group_step(ctx, model, opt, batch):
        x, y = batch
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(_ce(m(x), y)))(model)
        opt.update(model, ctx.all_reduce("mean", grads))
        return ctx.all_reduce("mean", loss)

    batches = itertools.repeat((xs, ys))

    def run_group():
        group_step(gmodel, gopt, batches).block_until_ready()

    # 4. jd.train_step over a Linen model in a TrainState.
    module = LinenMLP(sizes)
    lparams = module.init(jax.random.key(0), jnp.ones((1, sizes[0])))["params"]
    with strategy.scope():
        lstate = [jd.TrainState.create(apply_fn=module.apply, params=lparams, tx=tx)]

    @jd.train_step(strategy)
    def linen_step(ctx, state, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean(_ce(state.apply_fn({"params": p}, x), y))
        )(state.params)
        state = state.apply_gradients(grads=ctx.all_reduce("mean", grads))
        return state, ctx.all_reduce("mean", loss)

    def run_linen():
        lstate[0], loss = linen_step(lstate[0], xs, ys)
        loss.block_until_ready()

    # 5. strategy.function over (params, opt_state), donated.
    def fn_step(ctx, params, opt_state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(ctx.all_reduce("mean", g), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ctx.all_reduce("mean", loss)

    # Parameters and optimizer state donated, the batch kept (it is reused every step).
    function = strategy.function(fn_step, donate_argnums=(0, 1))
    fstate = list(own((params0, tx.init(params0))))

    def run_function():
        p, o, loss = function(*fstate, xs, ys)
        fstate[:] = [p, o]
        jax.block_until_ready(loss)

    return {
        "shard_map": run_hand,
        "nnx.jit": run_flax,
        "train_step nnx": run_nnx,
        f"train_step k={GROUP}": run_group,
        "train_step linen": run_linen,
        "strategy.function": run_function,
    }


GROUP = 8  # steps per call of the steps_per_execution candidate


def per_step(samples: dict[str, list[float]]) -> dict[str, list[float]]:
    """Seconds per step: a grouped candidate's seconds per call divided by its steps."""
    key = f"train_step k={GROUP}"
    return {k: [t / GROUP for t in v] if k == key else v for k, v in samples.items()}


def main() -> None:
    strategy = jd.MirroredStrategy()
    samples = per_step(_harness.sample(candidates(strategy, SIZES, BATCH), calls=20))
    times = {k: statistics.median(v) for k, v in samples.items()}
    base = times["shard_map"]
    print(_harness.describe_machine())
    print(
        f"MLP {'-'.join(map(str, SIZES))}, adamw, global batch {BATCH}, "
        f"{strategy.num_replicas_in_sync} replicas"
    )
    for name, t in times.items():
        print(f"{name:18s} {1 / t:8.2f} steps/s   throughput ratio vs shard_map {base / t:.3f}")


OVERHEAD_CASES = {
    # name: (layer sizes, batch, replicas, calls per round, rounds)
    "mlp32": ((32, 32, 10), 64, 1, 300, 21),
    "deep48": ((8,) * 49, 64, 1, 100, 15),  # 48 Linear(8, 8): 290 state leaves
    "deep48x8": ((8,) * 49, 64, 8, 50, 11),
}


def _shape(sizes: tuple[int, ...]) -> str:
    if len(set(sizes)) == 1:
        return f"{len(sizes) - 1} x Linear({sizes[0]}, {sizes[0]})"
    return "-".join(map(str, sizes))


def overhead(case: str) -> None:
    """Per-call cost with a model of little compute (Python work dominates): ``mlp32`` is
    an MLP 32-32-10 on one device, ``deep48`` 48 layers ``Linear(8, 8)`` (290 state
    leaves with adamw: per-leaf cost shows) on one device, ``deep48x8`` the same over 8
    replicas."""
    sizes, batch, replicas, calls, rounds = OVERHEAD_CASES[case]
    strategy = jd.OneDeviceStrategy() if replicas == 1 else jd.MirroredStrategy()
    cands = candidates(strategy, sizes, batch)
    tx = optax.adamw(1e-3)
    model = MLP(sizes, nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    leaves = len(jax.tree.leaves(nnx.state((model, opt))))
    x, y = jnp.ones((batch, sizes[0])), jnp.zeros((batch,), jnp.int32)

    @jax.jit
    def split_step(graphdef, state, x, y):
        model, opt = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(_ce(m(x), y)))(model)
        opt.update(model, grads)
        return nnx.state((model, opt)), loss

    def run_split():
        graphdef, state = nnx.split((model, opt))
        state, loss = split_step(graphdef, state, x, y)
        nnx.update((model, opt), state)
        loss.block_until_ready()

    cands = {
        "jax.jit (hand)": cands["shard_map"],
        "nnx.jit": cands["nnx.jit"],
        "train_step nnx": cands["train_step nnx"],
        f"train_step k={GROUP}": cands[f"train_step k={GROUP}"],
        "train_step linen": cands["train_step linen"],
        "strategy.function": cands["strategy.function"],
    }
    if replicas == 1:
        cands["split/merge+jit"] = run_split
    samples = per_step(_harness.sample(cands, calls=calls, rounds=rounds))
    ratios = _harness.paired_ratios(samples, "jax.jit (hand)")
    print(_harness.describe_machine())
    print(
        f"{case}: {replicas} replica(s), MLP {_shape(sizes)} ({leaves} state "
        f"leaves), adamw, batch {batch}"
    )
    for name, times in samples.items():
        med, q1, q3 = ratios[name]
        print(
            f"{name:18s} {statistics.median(times) * 1e6:8.1f} us/step   time ratio {med:.3f} "
            f"(quartiles {q1:.3f}-{q3:.3f})"
        )


if __name__ == "__main__":
    _harness.setup_devices(8)
    if "--overhead" in sys.argv:
        named = [a for a in sys.argv[1:] if a in OVERHEAD_CASES]
        for case in named or list(OVERHEAD_CASES):
            overhead(case)
    else:
        main()

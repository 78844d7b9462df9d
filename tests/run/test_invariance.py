"""Outputs that are the same on every replica come back as one replicated copy.

The reference is the same computation on one device (plain JAX / NumPy);
tolerances are stated per test. The compiled HLO is read to check that the
single copy costs no communication beyond what the step itself asks for.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdist as jd


def _collectives(hlo: str) -> dict[str, int]:
    names = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
    return {n: len(re.findall(rf"\b{n}(-start)?\(", hlo)) for n in names}


def _loss(w, x, y):
    return jnp.mean((jnp.tanh(x @ w["a"]) @ w["b"] - y) ** 2)


def _data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = {
        "a": rng.normal(size=(6, 5)).astype(np.float32),
        "b": rng.normal(size=(5, 2)).astype(np.float32),
    }
    x = rng.normal(size=(4 * n, 6)).astype(np.float32)
    y = rng.normal(size=(4 * n, 2)).astype(np.float32)
    return w, x, y


def test_optax_update_comes_back_mirrored_and_matches_one_device(
    mirrored8: jd.MirroredStrategy,
) -> None:
    n = 8
    tx = optax.adamw(1e-2)
    w, x, y = _data(n)
    state = tx.init(w)

    def step(ctx, w, state, x, y):
        loss, g = jax.value_and_grad(_loss)(w, x, y)
        g = ctx.all_reduce("mean", g)
        updates, state = tx.update(g, state, w)
        return optax.apply_updates(w, updates), state, ctx.all_reduce("mean", loss), loss

    xs, ys = jd.PerReplica(x.reshape(n, 4, 6)), jd.PerReplica(y.reshape(n, 4, 2))
    w_d, state_d = w, state
    w_r, state_r = w, state
    for _ in range(3):
        w_d, state_d, mean_loss, local_loss = mirrored8.run(step, args=(w_d, state_d, xs, ys))
        g = jax.grad(_loss)(w_r, x, y)  # the global batch on one device
        updates, state_r = tx.update(g, state_r, w_r)
        w_r = optax.apply_updates(w_r, updates)
    leaves = jax.tree.leaves((w_d, state_d), is_leaf=lambda v: isinstance(v, jd.DistributedValues))
    assert all(isinstance(v, jd.Mirrored) for v in leaves)  # one copy each, not 8
    assert all(v.array.sharding.is_fully_replicated for v in leaves)
    assert isinstance(mean_loss, jd.Mirrored) and isinstance(local_loss, jd.PerReplica)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a.array, b, rtol=1e-5, atol=1e-6),
        (w_d, state_d),
        (w_r, state_r),
        is_leaf=lambda v: isinstance(v, jd.DistributedValues),
    )


def test_no_collective_beyond_the_hand_written_step(mirrored8: jd.MirroredStrategy) -> None:
    n, axis, mesh = 8, mirrored8.axis_name, mirrored8.mesh
    tx = optax.adam(1e-3)
    w, x, y = _data(n)
    state = tx.init(w)

    def update(w, state, g):
        updates, state = tx.update(g, state, w)
        return optax.apply_updates(w, updates), state

    def hand_body(w, state, x, y):
        wv = jax.lax.pcast(w, axis, to="varying")
        loss, g = jax.value_and_grad(_loss)(wv, x, y)
        w, state = update(w, state, jax.lax.pmean(g, axis))
        return w, state, jax.lax.pmean(loss, axis)

    hand = jax.jit(
        jax.shard_map(
            hand_body, mesh=mesh, in_specs=(P(), P(), P(axis), P(axis)), out_specs=(P(), P(), P())
        )
    )

    def step(ctx, w, state, x, y):
        loss, g = jax.value_and_grad(_loss)(w, x, y)
        w, state = update(w, state, ctx.all_reduce("mean", g))
        return w, state, ctx.all_reduce("mean", loss)

    xs, ys = jd.PerReplica(x.reshape(n, 4, 6)), jd.PerReplica(y.reshape(n, 4, 2))
    ours = _collectives(mirrored8.function(step).lower(w, state, xs, ys).compile().as_text())
    data = NamedSharding(mesh, P(axis))
    theirs = _collectives(
        hand.lower(w, state, jax.device_put(x, data), jax.device_put(y, data)).compile().as_text()
    )
    assert ours == theirs
    assert ours["all-reduce"] >= 1 and ours["all-gather"] == 0


def test_per_replica_update_stays_per_replica(mirrored8: jd.MirroredStrategy) -> None:
    w, x, y = _data(8)

    def step(ctx, w, x, y):
        g = jax.grad(_loss)(w, x, y)  # this replica's own gradient, not all-reduced
        return jax.tree.map(lambda p, d: p - 0.1 * d, w, g)

    out = mirrored8.run(
        step, args=(w, jd.PerReplica(x.reshape(8, 4, 6)), jd.PerReplica(y.reshape(8, 4, 2)))
    )
    assert isinstance(out["a"], jd.PerReplica)
    for r in range(8):
        g = jax.grad(_loss)(w, x[4 * r : 4 * r + 4], y[4 * r : 4 * r + 4])
        np.testing.assert_allclose(out["a"].array[r], w["a"] - 0.1 * g["a"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda ctx, c: c + ctx.replica_id_in_sync_group, id="axis_index"),
        pytest.param(
            lambda ctx, c: ctx.ppermute(c, [(i, (i + 1) % 8) for i in range(7)]), id="ppermute"
        ),
        pytest.param(
            lambda ctx, c: ctx.reduce_scatter("sum", jnp.arange(16.0) + c[0]), id="reduce_scatter"
        ),
        pytest.param(lambda ctx, c: ctx.all_to_all(jnp.arange(16.0) + c[0], 0, 0), id="all_to_all"),
        pytest.param(
            lambda ctx, c: jax.random.normal(
                jax.random.fold_in(jax.random.key(0), ctx.replica_id_in_sync_group), (2,)
            ),
            id="random_per_replica",
        ),
    ],
)
def test_what_makes_replicas_differ_is_per_replica(mirrored8: jd.MirroredStrategy, make) -> None:
    c = jnp.arange(2.0)
    out = mirrored8.run(make, args=(c,))
    assert isinstance(out, jd.PerReplica)
    assert (
        len({tuple(np.asarray(v).tolist()) for v in mirrored8.experimental_local_results(out)}) > 1
    )


def test_same_value_from_broadcast_inputs_is_mirrored(mirrored8: jd.MirroredStrategy) -> None:
    def fn(ctx, c, x):
        key = jax.random.key(3)
        return {
            "arith": jnp.sin(c) * 2 + 1,
            "random_same_key": jax.random.normal(key, (2,)) + c,
            "from_sum": ctx.all_reduce("sum", x) * c,
            "gathered": ctx.all_gather(x, axis=0),
            "local": x * c,
        }

    c = jnp.arange(2.0)
    x = jd.PerReplica(jnp.arange(16.0).reshape(8, 2))
    out = mirrored8.run(fn, args=(c, x))
    for k in ("arith", "random_same_key", "from_sum", "gathered"):
        assert isinstance(out[k], jd.Mirrored), k
    assert isinstance(out["local"], jd.PerReplica)
    np.testing.assert_allclose(out["arith"].array, np.sin(np.arange(2.0)) * 2 + 1, rtol=1e-6)
    np.testing.assert_allclose(out["from_sum"].array, np.arange(16.0).reshape(8, 2).sum(0) * c)
    np.testing.assert_allclose(out["gathered"].array, np.arange(16.0).reshape(8, 2).reshape(-1))


def test_control_flow(mirrored8: jd.MirroredStrategy) -> None:
    def fn(ctx, w, x):
        # scan: the carry is updated from all-reduced values only -> the same everywhere.
        def body(carry, xi):
            return carry - 0.1 * ctx.all_reduce("mean", xi * carry), jnp.sum(xi)

        carry, ys = jax.lax.scan(body, w, x)
        # a scan whose carry picks up per-replica data -> differs.
        local, _ = jax.lax.scan(lambda c, xi: (c + xi, None), w, x)
        # cond on a replica-invariant predicate: the same; on a per-replica one: differs.
        same = jax.lax.cond(jnp.sum(w) > 0, lambda: w * 2, lambda: w * 3)
        differs = jax.lax.cond(jnp.sum(x) > 40, lambda: w * 2, lambda: w * 3)
        # while with a per-replica trip count: differs, even though the body adds constants.
        n, _ = jax.lax.while_loop(
            lambda s: s[1] < jnp.sum(x), lambda s: (s[0] + 1.0, s[1] + 8.0), (0.0, 0.0)
        )
        m, _ = jax.lax.while_loop(lambda s: s[1] < 3, lambda s: (s[0] + w, s[1] + 1), (w, 0))
        inner = jax.jit(lambda a: a * 5.0)(w)
        return carry, ys, local, same, differs, n, m, inner

    w = jnp.ones(2)
    x = jd.PerReplica(jnp.arange(8 * 3 * 2, dtype=jnp.float32).reshape(8, 3, 2))
    carry, ys, local, same, differs, n, m, inner = mirrored8.run(fn, args=(w, x))
    assert isinstance(carry, jd.Mirrored) and isinstance(same, jd.Mirrored)
    assert isinstance(m, jd.Mirrored) and isinstance(inner, jd.Mirrored)
    assert isinstance(ys, jd.PerReplica) and isinstance(local, jd.PerReplica)
    assert isinstance(differs, jd.PerReplica) and isinstance(n, jd.PerReplica)
    ref = np.ones(2)
    xs = np.arange(8 * 3 * 2, dtype=np.float32).reshape(8, 3, 2)
    for t in range(3):
        ref = ref - 0.1 * (xs[:, t] * ref).mean(0)
    np.testing.assert_allclose(carry.array, ref, rtol=1e-6)
    np.testing.assert_allclose(m.array, np.full(2, 4.0))


def test_gradient_through_run_of_a_mirrored_output(mirrored8: jd.MirroredStrategy) -> None:
    # d/dw of sum(run(...)) where the output is w * 3 (the same on every replica).
    def outer(w):
        out = mirrored8.run(lambda ctx, w: w * 3.0, args=(w,))
        return jnp.sum(out.array)

    np.testing.assert_allclose(jax.grad(outer)(jnp.ones(4)), np.full(4, 3.0))


def test_mirrored_variable_changed_per_replica_is_an_error(mirrored8: jd.MirroredStrategy) -> None:
    with mirrored8.scope():
        v = jd.Variable(jnp.zeros(2), aggregation="mean")

    def ok(ctx, v, x):
        # arithmetic on the variable's value with replica-invariant values is fine
        return jd.Variable.from_stored(v.stored + ctx.all_reduce("mean", x), v.meta)

    def bad(ctx, v, x):
        return jd.Variable.from_stored(v.stored + x, v.meta)

    x = jd.PerReplica(jnp.arange(16.0).reshape(8, 2))
    out = mirrored8.run(ok, args=(v, x))
    np.testing.assert_allclose(out.read_value(), np.arange(16.0).reshape(8, 2).mean(0))
    with pytest.raises(
        ValueError, match=r"mirrored \(ON_WRITE\) variable None holds a value that differs"
    ):
        mirrored8.run(bad, args=(v, x))

"""Reductions over part of a two-level ``(host, local)`` replica mesh, end to end.

A ``psum`` over ``local`` alone adds the replicas of one host: the result is the
same within a host and differs between hosts, so it must come back `PerReplica`;
over both axes it is the same everywhere and comes back `Mirrored`. Each case is
checked for its type and, replica by replica (every device's copy of a `Mirrored`),
against NumPy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jaxdist as jd

HOST, LOCAL = 2, 4
N = HOST * LOCAL
RTOL = 1e-6  # sums of a few integer-valued float32s: exact in practice

# replica r sits at (host, local) = divmod(r, LOCAL) (row-major mesh)
_H = np.arange(N) // LOCAL
_L = np.arange(N) % LOCAL


def _strategies() -> list[Any]:
    return [
        pytest.param(
            lambda: jd.MirroredStrategy(mesh_shape=(HOST, LOCAL), axis_names=("host", "local")),
            id="mirrored_2x4",
        ),
        pytest.param(
            lambda: jd.Strategy(
                jax.devices(),
                jd.HierarchicalCopyAllReduce(),
                mesh_shape=(HOST, LOCAL),
                axis_names=("host", "local"),
            ),
            id="hierarchical_2x4",
        ),
    ]


def _data() -> np.ndarray:
    """Per-replica rows with negative and positive values, distinct per replica."""
    return (np.arange(N * 3, dtype=np.float32).reshape(N, 3) - 11.0) * np.float32(1.5)


def _per_host(f: Callable[..., np.ndarray], x: np.ndarray) -> np.ndarray:
    """NumPy: ``f`` over the replicas of each host, broadcast back to those replicas."""
    grid = x.reshape(HOST, LOCAL, *x.shape[1:])
    return np.repeat(f(grid, axis=1), LOCAL, axis=0)


def _per_local(f: Callable[..., np.ndarray], x: np.ndarray) -> np.ndarray:
    """NumPy: ``f`` over the hosts at each local index, broadcast back."""
    grid = x.reshape(HOST, LOCAL, *x.shape[1:])
    return np.tile(f(grid, axis=0), (HOST,) + (1,) * (x.ndim - 1))


def _everywhere(f: Callable[..., np.ndarray], x: np.ndarray) -> np.ndarray:
    return np.repeat(f(x, axis=0)[None], N, axis=0)


def _copies(out: Any) -> np.ndarray:
    """Every replica's value, from the devices: a `PerReplica`'s rows; for a `Mirrored`,
    the copy on each device (in replica order), so copies that differ are seen."""
    if isinstance(out, jd.PerReplica):
        return np.asarray(out.array)
    assert isinstance(out, jd.Mirrored), type(out)
    by_device = {s.device: np.asarray(s.data) for s in out.array.addressable_shards}
    return np.stack([by_device[d] for d in np.asarray(out.array.sharding.mesh.devices).ravel()])


x_ = _data()
w_ = np.array([2.0, -3.0, 0.5], np.float32)  # a broadcast argument: the same everywhere

# (name, replica fn of (ctx, x, w), the expected type, the expected value of every replica)
CASES: list[tuple[str, Callable[..., Any], type, np.ndarray]] = [
    ("psum_local", lambda ctx, x, w: lax.psum(x, "local"), jd.PerReplica, _per_host(np.sum, x_)),
    ("psum_host", lambda ctx, x, w: lax.psum(x, "host"), jd.PerReplica, _per_local(np.sum, x_)),
    (
        "psum_both",
        lambda ctx, x, w: lax.psum(x, ("host", "local")),
        jd.Mirrored,
        _everywhere(np.sum, x_),
    ),
    (
        "psum_local_then_host",
        lambda ctx, x, w: lax.psum(lax.psum(x, "local"), "host"),
        jd.Mirrored,
        _everywhere(np.sum, x_),
    ),
    (
        "pmean_local",
        lambda ctx, x, w: lax.pmean(x, "local"),
        jd.PerReplica,
        _per_host(np.mean, x_),
    ),
    ("pmax_local", lambda ctx, x, w: lax.pmax(x, "local"), jd.PerReplica, _per_host(np.max, x_)),
    ("pmin_host", lambda ctx, x, w: lax.pmin(x, "host"), jd.PerReplica, _per_local(np.min, x_)),
    (
        "pmax_both",
        lambda ctx, x, w: lax.pmax(x, ("host", "local")),
        jd.Mirrored,
        _everywhere(np.max, x_),
    ),
    (
        "psum_local_of_broadcast",  # the same on every replica before and after
        lambda ctx, x, w: lax.psum(w, "local"),
        jd.Mirrored,
        np.tile(LOCAL * w_, (N, 1)),
    ),
    (
        "local_index",  # differs along local only
        lambda ctx, x, w: lax.axis_index("local").astype(jnp.float32),
        jd.PerReplica,
        _L.astype(np.float32),
    ),
    (
        "psum_local_of_local_index",  # varied along local only: the same everywhere after
        lambda ctx, x, w: lax.psum(lax.axis_index("local"), "local").astype(jnp.float32),
        jd.Mirrored,
        np.full(N, _L[:LOCAL].sum(), np.float32),
    ),
    (
        "psum_local_of_host_index",  # varied along host: still per host after
        lambda ctx, x, w: lax.psum(lax.axis_index("host"), "local").astype(jnp.float32),
        jd.PerReplica,
        (LOCAL * _H).astype(np.float32),
    ),
    (
        "psum_local_then_arithmetic",
        lambda ctx, x, w: lax.psum(x, "local") * w + 1.0,
        jd.PerReplica,
        _per_host(np.sum, x_) * w_ + 1.0,
    ),
    (
        "all_gather_local",
        lambda ctx, x, w: lax.all_gather(x, "local"),
        jd.PerReplica,
        np.repeat(x_.reshape(HOST, LOCAL, 3), LOCAL, axis=0),
    ),
    (
        "psum_local_in_scan",
        lambda ctx, x, w: lax.scan(lambda c, _: (c + lax.psum(x, "local"), None), x, None, 2)[0],
        jd.PerReplica,
        x_ + 2 * _per_host(np.sum, x_),
    ),
    (
        "all_reduce",
        lambda ctx, x, w: ctx.all_reduce("sum", x),
        jd.Mirrored,
        _everywhere(np.sum, x_),
    ),
]


@pytest.mark.parametrize("make", _strategies())
@pytest.mark.parametrize(
    ("fn", "kind", "expected"),
    [pytest.param(fn, kind, exp, id=name) for name, fn, kind, exp in CASES],
)
def test_partial_axis_reduction_type_and_values(make, fn, kind: type, expected) -> None:
    s = make()
    assert s.axis_name == ("host", "local") and s.num_replicas_in_sync == N
    out = s.run(fn, args=(jd.PerReplica(jnp.asarray(x_)), jnp.asarray(w_)))
    assert type(out) is kind
    np.testing.assert_allclose(_copies(out), expected, rtol=RTOL)
    if kind is jd.PerReplica:  # a per-host value refuses to convert, as any PerReplica
        with pytest.raises(TypeError, match=r"reduce"):
            np.asarray(out)


@pytest.mark.parametrize("make", _strategies())
def test_partial_axis_outputs_of_a_function_and_their_reductions(make) -> None:
    # The compiled form, several outputs at once, and the strategy's reductions of them.
    s = make()

    @s.function
    def step(ctx, x):
        return {"host_sum": lax.psum(x, "local"), "total": lax.psum(x, ("host", "local"))}

    out = step(jd.PerReplica(jnp.asarray(x_)))
    assert type(out["host_sum"]) is jd.PerReplica and type(out["total"]) is jd.Mirrored
    np.testing.assert_allclose(_copies(out["host_sum"]), _per_host(np.sum, x_), rtol=RTOL)
    np.testing.assert_allclose(_copies(out["total"]), _everywhere(np.sum, x_), rtol=RTOL)
    # Reducing the per-host sums over the replicas counts each host's sum LOCAL times.
    np.testing.assert_allclose(
        np.asarray(s.reduce("sum", out["host_sum"], axis=None)), LOCAL * x_.sum(0), rtol=RTOL
    )
    np.testing.assert_allclose(
        np.asarray(s.reduce("max", out["host_sum"], axis=None)),
        x_.reshape(HOST, LOCAL, 3).sum(1).max(0),
        rtol=RTOL,
    )
    locals_ = s.experimental_local_results(out["host_sum"])
    assert len(locals_) == N
    for r, v in enumerate(locals_):
        np.testing.assert_allclose(np.asarray(v), _per_host(np.sum, x_)[r], rtol=RTOL)


@pytest.mark.parametrize("make", _strategies())
def test_train_step_returns_a_per_host_value_per_replica(make) -> None:
    # The train step's output typing on the same mesh: the state updated from gradients
    # reduced over both axes is one replicated copy; a per-host statistic is per replica.
    s = make()
    with s.scope():
        state = jd.TrainState.create(apply_fn=None, params={"w": jnp.zeros(3)}, tx=optax.sgd(1.0))

    @jd.train_step(s)
    def step(ctx, state, x):
        grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(state.params)
        new = state.apply_gradients(grads=ctx.all_reduce("mean", grads))
        return new, lax.psum(jnp.sum(x), "local")

    new, host_stat = step(state, jd.PerReplica(jnp.asarray(x_)))
    assert isinstance(new.params["w"], jax.Array) and not isinstance(
        new.params["w"], jd.DistributedValues
    )
    np.testing.assert_allclose(np.asarray(new.params["w"]), -x_.mean(0), rtol=RTOL)
    assert type(host_stat) is jd.PerReplica
    np.testing.assert_allclose(_copies(host_stat), _per_host(np.sum, x_.sum(1)), rtol=RTOL)

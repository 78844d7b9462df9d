"""Strategy.run: unwrapping, broadcasting, output kinds, caching, gradients, errors, and
the entry points called from several threads at once.

References are plain NumPy / single-device JAX; float tolerance rtol=1e-5
unless stated.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd

from _helpers import assert_kind, in_threads, rows, value


def test_issue_example(mirrored8: jd.MirroredStrategy) -> None:
    def replica_fn(ctx, x):
        y = x * 2.0
        return ctx.all_reduce(jd.ReduceOp.SUM, y), ctx.replica_id_in_sync_group

    total, ids = mirrored8.run(replica_fn, args=(3.0,))
    assert isinstance(total, jd.Mirrored)
    assert isinstance(ids, jd.PerReplica)
    np.testing.assert_allclose(total.array, 6.0 * 8)
    assert [int(i) for i in mirrored8.experimental_local_results(ids)] == list(range(8))
    assert float(mirrored8.reduce("mean", ids, axis=None)) == 3.5


def test_per_replica_unwrapped_and_broadcast(strategy: jd.Strategy) -> None:
    n = strategy.num_replicas_in_sync
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    b = np.array([10.0, 20.0, 30.0], np.float32)
    out = strategy.run(lambda ctx, x, b, c: x * c + b, args=(jd.PerReplica(x), b, 2.0))
    assert_kind(out, jd.PerReplica, strategy)  # with one replica: the plain value (as TF)
    np.testing.assert_allclose(rows(out, strategy), x * 2.0 + b)
    for r, v in enumerate(strategy.experimental_local_results(out)):
        np.testing.assert_allclose(v, x[r] * 2.0 + b)


def test_output_structure_is_kept(strategy: jd.Strategy) -> None:
    n = strategy.num_replicas_in_sync

    def fn(ctx, tree):
        s = ctx.all_reduce("sum", tree["a"])
        return {"sum": s, "pair": (tree["a"] + 1, None), "n": ctx.num_replicas_in_sync}

    a = np.arange(n, dtype=np.float32)
    out = strategy.run(fn, args=({"a": jd.PerReplica(a)},))
    assert set(out) == {"sum", "pair", "n"}
    assert out["n"] == n  # Python values come back as they are
    assert_kind(out["sum"], jd.Mirrored, strategy)
    np.testing.assert_allclose(value(out["sum"]), a.sum())
    assert_kind(out["pair"][0], jd.PerReplica, strategy)
    assert out["pair"][1] is None
    np.testing.assert_allclose(rows(out["pair"][0], strategy), (a + 1).reshape(n))


def test_kwargs_and_function_decorator(strategy: jd.Strategy) -> None:
    n = strategy.num_replicas_in_sync

    @strategy.function
    def step(ctx, x, *, scale):
        return ctx.all_reduce("mean", x * scale)

    x = jd.PerReplica(np.arange(n, dtype=np.float32))
    out = step(x, scale=3.0)
    np.testing.assert_allclose(value(out), 3.0 * np.arange(n).mean())
    assert step.__name__ == "step"


def test_compiled_once_per_signature(mirrored8: jd.MirroredStrategy) -> None:
    traces = []

    def fn(ctx, x, lr):
        traces.append(1)
        return ctx.all_reduce("sum", x * lr)

    x = jd.PerReplica(jnp.ones((8, 4)))
    for lr in (0.1, 0.2, 0.3):  # a new Python number is a new value, not a new program
        mirrored8.run(fn, args=(x, lr))
    assert len(traces) == 1
    mirrored8.run(fn, args=(jd.PerReplica(jnp.ones((8, 5))), 0.1))
    assert len(traces) == 2  # a new shape is a new program


def test_run_inside_user_jit(mirrored8: jd.MirroredStrategy) -> None:
    def fn(ctx, x):
        return ctx.all_reduce("sum", x), x * 2

    @jax.jit
    def outer(x):
        total, doubled = mirrored8.run(fn, args=(jd.PerReplica(x),))
        return total.array, doubled.array

    x = jnp.arange(8.0)
    total, doubled = outer(x)
    np.testing.assert_allclose(total, 28.0)
    np.testing.assert_allclose(doubled, np.arange(8.0) * 2)


def _is_dv(x: object) -> bool:
    return isinstance(x, jd.DistributedValues)


def _mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def test_grad_is_per_replica_and_mean_matches_single_device(strategy: jd.Strategy) -> None:
    n = strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(5, 7)).astype(np.float32),
        "w2": rng.normal(size=(7, 2)).astype(np.float32),
    }
    x = rng.normal(size=(4 * n, 5)).astype(np.float32)
    y = rng.normal(size=(4 * n, 2)).astype(np.float32)

    def step(ctx, params, x, y):
        g = jax.grad(_mlp_loss)(params, x, y)
        return g, ctx.all_reduce("mean", g)

    xs = jd.PerReplica(x.reshape(n, 4, 5))
    ys = jd.PerReplica(y.reshape(n, 4, 2))
    local, mean = strategy.run(step, args=(params, xs, ys))
    # Each replica's own gradient, not one already summed over replicas.
    for r in range(n):
        ref = jax.grad(_mlp_loss)(params, x[4 * r : 4 * r + 4], y[4 * r : 4 * r + 4])
        got = jax.tree.map(lambda v, r=r: rows(v, strategy)[r], local, is_leaf=_is_dv)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, ref)
    ref = jax.grad(_mlp_loss)(params, x, y)  # the global batch on one device
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(value(a), b, rtol=1e-5, atol=1e-6),
        mean,
        ref,
        is_leaf=_is_dv,
    )


def test_grad_of_a_captured_parameter_is_the_sum_over_replicas(
    mirrored8: jd.MirroredStrategy,
) -> None:
    """What `run`'s docstring and the migration guide say: a parameter captured by closure
    is one value for every replica, so its gradient is already summed (JAX's rule); passed
    as an argument, each replica gets its own (TF's). References: NumPy."""
    x = np.arange(1.0, 9.0, dtype=np.float32)
    w = jnp.float32(2.0)

    def captured(ctx, x):
        return jax.grad(lambda w: w * x)(w)

    def passed(ctx, w, x):
        return jax.grad(lambda w: w * x)(w)

    np.testing.assert_allclose(value(mirrored8.run(captured, args=(jd.PerReplica(x),))), x.sum())
    own = mirrored8.run(passed, args=(w, jd.PerReplica(x)))
    np.testing.assert_allclose(rows(own, mirrored8), x)


def test_grad_through_all_reduce_and_all_gather(mirrored8: jd.MirroredStrategy) -> None:
    c = np.arange(1.0, 9.0, dtype=np.float32)

    def fn(ctx, x, c):
        # d/dx_r of sum(c * psum(x)) is sum(c) on every replica.
        g_sum = jax.grad(lambda x: jnp.sum(ctx.all_reduce("sum", x) * c))(x)
        # d/dx_r of sum(w * all_gather(x)) is the sum over replicas of their w slice at r.
        w = c * (ctx.replica_id_in_sync_group + 1)
        g_gather = jax.grad(lambda x: jnp.sum(ctx.all_gather(x, axis=0) * w))(x)
        return g_sum, g_gather

    x = jd.PerReplica(jnp.ones((8, 1)))
    g_sum, g_gather = mirrored8.run(fn, args=(x, c))
    # every replica's cotangent is sum(c): the transpose of psum sums them. The gradient
    # is the same on every replica, so it comes back as one mirrored copy.
    assert isinstance(g_sum, jd.Mirrored)
    np.testing.assert_allclose(g_sum.array, np.full((1,), 8 * c.sum()))
    # replica r contributes c[i] * (r + 1) to x_i's cotangent: sum_r (r + 1) = 36.
    np.testing.assert_allclose(g_gather.array[:, 0], 36.0 * c)


def test_python_control_flow_on_replica_id_explains(mirrored8: jd.MirroredStrategy) -> None:
    def fn(ctx):
        if ctx.replica_id_in_sync_group == 0:
            return jnp.ones(2)
        return jnp.ones(3)

    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        mirrored8.run(fn)
    assert "same structure" in "\n".join(info.value.__notes__)


def test_run_errors(mirrored8: jd.MirroredStrategy) -> None:
    with pytest.raises(TypeError, match=r"MirroredStrategy.run: fn must be callable, got int"):
        mirrored8.run(3)
    with pytest.raises(TypeError, match=r"args=\(x,\)"):
        mirrored8.run(lambda ctx, x: x, args=jnp.ones(3))
    bad = jd.PerReplica(jnp.ones((4, 3)))
    with pytest.raises(
        ValueError,
        match=r"MirroredStrategy.run: args\[1\]\['x'\] is a PerReplica of shape \(4, 3\), but "
        r"its leading \(replica\) axis must have size 8",
    ):
        mirrored8.run(lambda ctx, a, t: t["x"], args=(1.0, {"x": bad}))
    with pytest.raises(TypeError, match=r"kwargs\['name'\] is a str \('hello'\), not an array"):
        mirrored8.run(lambda ctx, name: 1.0, kwargs={"name": "hello"})


def test_cross_replica_methods_rejected_inside_replica_fn(mirrored8: jd.MirroredStrategy) -> None:
    def calls_run(ctx, x):
        return mirrored8.run(lambda c, y: y, args=(x,))

    with pytest.raises(RuntimeError, match=r"MirroredStrategy.run was called inside a replica"):
        mirrored8.run(calls_run, args=(1.0,))

    def calls_reduce(ctx, x):
        return mirrored8.reduce("sum", x)

    with pytest.raises(RuntimeError, match=r"MirroredStrategy.reduce was called inside a replica"):
        mirrored8.run(calls_reduce, args=(1.0,))


def test_run_options(mirrored8: jd.MirroredStrategy) -> None:
    opts = jd.RunOptions(
        donate_args=True, experimental_xla_options={"xla_cpu_enable_fast_math": False}
    )
    x = mirrored8.run(lambda ctx, i: i + 0.0, args=(jd.PerReplica(jnp.arange(8.0)),))
    out = mirrored8.run(lambda ctx, x: x + 1, args=(x,), options=opts)
    np.testing.assert_allclose(out.array, np.arange(8.0) + 1)
    assert x.array.is_deleted()  # donated
    with pytest.raises(TypeError, match="must be a mapping"):
        jd.RunOptions(experimental_xla_options=3)


def test_donating_steps_keep_the_batches_shared_valid_counts(
    mirrored8: jd.MirroredStrategy,
) -> None:
    """A distributed dataset's full batches share one array of valid counts: a step that
    donates its batch donates the rows, never those counts (donating them made the next
    step's call fail, and crashed the process). Reference: NumPy sums of the batches."""
    x = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)

    def step(ctx: jd.ReplicaContext, b: jax.Array) -> tuple[jax.Array, jax.Array]:
        mask = ctx.valid_mask(b.shape[0])[:, None]
        return b * 2.0, ctx.all_reduce("sum", jnp.sum(jnp.where(mask, b, 0.0)))

    donating = mirrored8.function(step, options=jd.RunOptions(donate_args=True))
    ds = mirrored8.experimental_distribute_dataset(jd.data.from_arrays(x, batch_size=16))
    batches = list(ds)
    assert batches[0].valid is batches[1].valid
    outs = [donating(b) for b in batches]
    np.testing.assert_allclose(
        [float(value(total)) for _, total in outs], [x[i : i + 16].sum() for i in range(0, 40, 16)]
    )
    np.testing.assert_allclose(value(outs[1][0]).reshape(-1, 3), 2 * x[16:32])
    assert batches[0].array.is_deleted() and not batches[0].valid.is_deleted()
    lowered = donating.lower(next(iter(ds)))  # ahead-of-time lowering takes the same path
    assert "jaxdist" in lowered.as_text()


def test_arguments_committed_elsewhere_are_placed(mirrored8: jd.MirroredStrategy) -> None:
    two = jd.MirroredStrategy(jax.devices()[:2])
    on_dev5 = jax.device_put(jnp.ones(3), jax.devices()[5])
    out = two.run(lambda ctx, x: ctx.all_reduce("sum", x), args=(on_dev5,))
    np.testing.assert_allclose(out.array, np.full(3, 2.0))
    per8 = mirrored8.run(lambda ctx, i: i * 1.0, args=(jd.PerReplica(jnp.arange(8)),))
    first = mirrored8.experimental_local_results(per8)[0]  # committed to device 0
    out = mirrored8.run(lambda ctx, a, b: a + b, args=(first, jd.PerReplica(jnp.arange(8.0))))
    np.testing.assert_allclose(out.array, np.arange(8.0))


def test_function_places_arguments_committed_elsewhere(mirrored8: jd.MirroredStrategy) -> None:
    step = mirrored8.function(lambda ctx, a, b: a + b)
    per8 = mirrored8.run(lambda ctx, i: i * 1.0, args=(jd.PerReplica(jnp.arange(8)),))
    first = mirrored8.experimental_local_results(per8)[0]  # committed to device 0
    out = step(first, jd.PerReplica(jnp.arange(8.0)))
    np.testing.assert_allclose(out.array, np.arange(8.0))
    with pytest.raises(TypeError, match=r"args\[0\] is a str .*not an array of numbers"):
        step("not an array", 1.0)
    # The same recovery on a strategy whose calls are not gated, through function and
    # through run's repeat-call path.
    one = jd.OneDeviceStrategy(jax.devices()[0])
    on_dev5 = jax.device_put(jnp.ones(3), jax.devices()[5])

    def add_one(ctx, x):
        return x + 1.0

    np.testing.assert_allclose(one.function(add_one)(on_dev5), np.full(3, 2.0))
    for _ in range(2):
        np.testing.assert_allclose(one.run(add_one, args=(on_dev5,)), np.full(3, 2.0))
    with pytest.raises(TypeError, match=r"args\[0\] is a str .*not an array of numbers"):
        one.run(add_one, args=("not an array",))


@pytest.mark.parametrize("name", ["mirrored8", "one_device", "central2"])
def test_function_inside_a_replica_function_is_explained(name: str, request) -> None:
    strategy = {
        "mirrored8": lambda: request.getfixturevalue("mirrored8"),
        "one_device": jd.OneDeviceStrategy,
        "central2": lambda: jd.CentralStorageStrategy(jax.devices()[:2]),
    }[name]()
    inner = strategy.function(lambda ctx, x: x)
    with pytest.raises(RuntimeError, match=r"run was called inside a replica function"):
        strategy.run(lambda ctx: inner(1.0))


def test_output_kinds_and_reprs_for_every_dtype(mirrored8: jd.MirroredStrategy) -> None:
    x = jd.PerReplica(jnp.arange(8))

    def fn(ctx, x):
        return (
            ctx.all_reduce("max", x > 3),
            ctx.broadcast(x > 3, 5),
            x > 3,
            ctx.all_reduce("min", x),
        )

    mx, bc, local, mn = mirrored8.run(fn, args=(x,))
    assert isinstance(mx, jd.Mirrored) and repr(mx).startswith("Mirrored(") and bool(mx.array)
    assert isinstance(bc, jd.Mirrored) and bool(bc.array)
    assert isinstance(local, jd.PerReplica) and repr(local).startswith("PerReplica(")
    assert local.array.tolist() == [False] * 4 + [True] * 4
    assert int(mn.array) == 0 and mn.dtype == jnp.int32
    assert [bool(v) for v in mirrored8.experimental_local_results(mx)] == [True] * 8
    assert len(mx.values) == 8 and all(v.shape == () for v in mx.values)


def test_every_bad_argument_leaf_is_listed(mirrored8: jd.MirroredStrategy) -> None:
    step = mirrored8.function(lambda ctx, a: a)
    bad = {"name": "x", "w": jnp.ones(2), "ids": np.array(["a", "b"])}
    with pytest.raises(TypeError) as info:
        step(bad)
    msg = str(info.value)
    assert "args[0]['ids'] is an array of dtype <U1" in msg, msg
    assert "args[0]['name'] is a str ('x')" in msg, msg
    assert "'w'" not in msg and "not arrays of numbers" in msg
    with pytest.raises(TypeError, match=r"value\['a'\] is an array of dtype <U1.*value\['b'\]"):
        mirrored8.reduce("sum", {"a": np.array(["x"]), "b": np.array(["y"]), "c": 1.0}, None)


def test_a_tf_style_function_that_binds_the_context_to_its_first_input_is_explained(
    mirrored8: jd.MirroredStrategy,
) -> None:
    def step(x, y):  # TF style; run passes (ctx, 1.0), so x is the context
        return x + y

    with pytest.raises(
        TypeError,
        match=r"a ReplicaContext was used as a value.*Declare the context first: "
        r"`def step\(ctx, x, y\): \.\.\.`",
    ):
        mirrored8.run(step, args=(1.0,))


@pytest.mark.timeout(200)
def test_entry_points_are_safe_from_several_threads(mirrored8: jd.MirroredStrategy) -> None:
    s = mirrored8
    summed = s.function(lambda ctx, x: ctx.all_reduce("sum", x))
    with s.scope():
        start = jd.Variable(0.0, aggregation="sum")

    def scaled_mean(ctx: jd.ReplicaContext, x: jax.Array, k: float) -> jax.Array:
        return ctx.all_reduce("mean", x * k)

    def count(ctx: jd.ReplicaContext, v: jd.Variable) -> jd.Variable:
        return ctx.assign_add(v, 1.0)

    def work(k: int) -> None:
        rng = np.random.default_rng(k)
        x = rng.normal(size=(8, 3)).astype(np.float32)
        data = rng.normal(size=(40, 2)).astype(np.float32)
        per = jd.PerReplica(jnp.asarray(x))
        ds = s.experimental_distribute_dataset(jd.data.from_arrays(data, batch_size=16))
        v = start
        for _ in range(4):
            np.testing.assert_allclose(summed(per), x.sum(0), rtol=1e-5)
            np.testing.assert_allclose(
                s.run(scaled_mean, args=(per, float(k))), (x * k).mean(0), rtol=1e-5, atol=1e-6
            )
            np.testing.assert_array_equal(s.reduce("max", per), x.max(0))
            np.testing.assert_array_equal(s.gather(per, axis=0), x.reshape(-1))
            v = s.run(count, args=(v,))
            rows = [np.concatenate(s.experimental_local_results(b)) for b in ds]
            np.testing.assert_array_equal(np.concatenate(rows), data)
        assert float(v.read_value()) == 4 * 8

    assert in_threads(4, work) == []


def test_one_replica_returns_plain_values() -> None:
    s = jd.OneDeviceStrategy()
    out = s.run(lambda ctx, x: (x * 2, ctx.all_reduce("sum", x)), args=(jnp.arange(3.0),))
    assert all(isinstance(o, jax.Array) for o in out)
    assert s.experimental_local_results(out[0]) == (out[0],)
    np.testing.assert_allclose(out[0], [0.0, 2.0, 4.0])


def test_replica_fn_without_ctx_is_explained(mirrored8: jd.MirroredStrategy) -> None:
    def step(x):
        return x * 2

    with pytest.raises(TypeError, match=r"does not take the replica context.*def step\(ctx, x\)"):
        mirrored8.run(step, args=(1.0,))


def test_string_arguments_name_the_leaf(mirrored8: jd.MirroredStrategy) -> None:
    with pytest.raises(TypeError, match=r"args\[0\]\['names'\] is an array of dtype <U1"):
        mirrored8.run(lambda ctx, t: 1.0, args=({"names": np.array(["a", "b"])},))


def test_a_replica_function_returning_a_string_is_named_with_its_file() -> None:
    # Before: JAX's error named jaxdist's own wrapper (programs.py) instead of the function.
    strategy = jd.MirroredStrategy()

    @strategy.function
    def greets(ctx: Any, x: Any) -> Any:
        return {"loss": x, "note": "hello"}

    with pytest.raises(
        TypeError,
        match=r"MirroredStrategy\.run: .*greets \(.*test_run\.py:\d+\) returned a str at "
        r"result\['note'\]; a replica function returns arrays",
    ):
        greets(jnp.ones(()))

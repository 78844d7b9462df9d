"""`StrategyExtended`, `CrossDeviceOps` and cross-replica variable updates against tf.distribute.

The reference for every API here is TF's documented behaviour (the signatures of
``tf.distribute.CrossDeviceOps``, ``ReductionToOneDevice`` and
``StrategyExtended``, and the examples in their docstrings, rewritten for
immutable variables); the reference for every number is NumPy. Placement is
checked on the devices of the returned arrays. Values are small integers, so
float32 results are compared exactly or with ``RTOL``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd

from _hlo import bytes_across, collectives, group_sets, lowered_count, mesh_groups

Sync, Agg = jd.VariableSynchronization, jd.VariableAggregation
RTOL = 1e-6
N = 8


@functools.cache
def _mirrored() -> jd.MirroredStrategy:
    return jd.MirroredStrategy()


@functools.cache
def _central() -> jd.CentralStorageStrategy:
    devices = jax.devices()
    return jd.CentralStorageStrategy(compute_devices=devices[:2], parameter_device=devices[7])


def _rows(n: int = N) -> np.ndarray:
    return (np.arange(n * 3, dtype=np.float32).reshape(n, 3) - 7.0) * 0.5


def _identity(ctx: jd.ReplicaContext, x: Any) -> Any:
    return x


def _placed(rows: np.ndarray | None = None) -> jd.PerReplica:
    """``rows`` as a `PerReplica` spread over the 8 devices (row r on device r), as run gives."""
    data = _rows() if rows is None else rows
    return _mirrored().run(_identity, args=(jd.PerReplica(jnp.asarray(data)),))


def _devices(x: Any) -> set[jax.Device]:
    return set((x.array if isinstance(x, jd.DistributedValues) else x).devices())


def _params(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    sig = inspect.signature(fn)
    return [(p.name, p.default) for p in sig.parameters.values() if p.name != "self"]


_EMPTY = inspect.Parameter.empty


# -- TF's signatures ---------------------------------------------------------------------


def test_signatures_match_tf() -> None:
    assert _params(jd.CrossDeviceOps.reduce) == [
        ("reduce_op", _EMPTY),
        ("per_replica_value", _EMPTY),
        ("destinations", _EMPTY),
        ("options", None),
    ]
    assert _params(jd.CrossDeviceOps.batch_reduce) == [
        ("reduce_op", _EMPTY),
        ("value_destination_pairs", _EMPTY),
        ("options", None),
    ]
    assert _params(jd.CrossDeviceOps.broadcast) == [("tensor", _EMPTY), ("destinations", _EMPTY)]
    assert _params(jd.ReductionToOneDevice)[:2] == [
        ("reduce_to_device", None),
        ("accumulation_fn", None),
    ]
    ext = jd.StrategyExtended
    assert _params(ext.reduce_to)[:4] == [
        ("reduce_op", _EMPTY),
        ("value", _EMPTY),
        ("destinations", _EMPTY),
        ("options", None),
    ]
    assert _params(ext.batch_reduce_to)[:3] == [
        ("reduce_op", _EMPTY),
        ("value_destination_pairs", _EMPTY),
        ("options", None),
    ]
    assert ("experimental_hints", None) in _params(ext.reduce_to)
    assert _params(ext.update) == [
        ("var", _EMPTY),
        ("fn", _EMPTY),
        ("args", ()),
        ("kwargs", None),
        ("group", True),
    ]
    assert _params(ext.broadcast_to) == [("tensor", _EMPTY), ("destinations", _EMPTY)]
    assert _params(jd.experimental.CommunicationOptions) == [
        ("bytes_per_pack", 0),
        ("timeout_seconds", None),
        ("implementation", jd.experimental.CommunicationImplementation.AUTO),
    ]
    assert _params(jd.experimental.CollectiveHints) == [
        ("bytes_per_pack", 0),
        ("timeout_seconds", None),
    ]
    # Positional use, as TF code writes it.
    opts = jd.experimental.CommunicationOptions(64, 5, "nccl")
    assert (opts.bytes_per_pack, opts.timeout_seconds, opts.implementation.name) == (
        64,
        5.0,
        "NCCL",
    )
    ops = jd.ReductionToOneDevice("/cpu:2")
    assert ops.reduce_to_device == jax.devices()[2]


# -- TF's docstring examples ------------------------------------------------------------


def test_update_docstring_example() -> None:
    """TF: ``v = Variable(5.0, aggregation=SUM); extended.update(v, lambda v: v.assign(1.0))``
    gives 1.0 on every device."""
    s = _mirrored()
    with s.scope():
        v = jd.Variable(5.0, aggregation=Agg.SUM)
    out = s.extended.update(v, lambda v: v.assign(1.0))
    assert isinstance(out, jd.Variable) and out.aggregation is Agg.SUM
    assert float(out) == 1.0
    assert _devices(out.device_values) == set(jax.devices())
    assert float(v) == 5.0  # variables are values: the old one is unchanged
    local = s.extended.update(v, lambda v: v.assign(1.0), group=False)
    assert len(local) == N and all(float(x) == 1.0 for x in local)


def _merge_step(batched: bool) -> Callable[..., Any]:
    """TF's reduce_to / batch_reduce_to docstring example, returning the new variable."""

    def step_fn(ctx: jd.ReplicaContext, var: jd.Variable) -> jd.Variable:
        def merge_fn(strategy: jd.Strategy, value: Any, var: jd.Variable) -> jd.Variable:
            if batched:
                reduced = strategy.extended.batch_reduce_to(jd.ReduceOp.SUM, [(value, var)])[0]
            else:
                reduced = strategy.extended.reduce_to(jd.ReduceOp.SUM, value, destinations=var)
            return strategy.extended.update(var, lambda var, value: var.assign(value), (reduced,))

        return ctx.merge_call(merge_fn, args=(jnp.float32(1.0), var))

    return step_fn


_MERGE_STRATEGIES = [
    pytest.param(lambda: jd.MirroredStrategy(jax.devices()[:2]), 2.0, id="mirrored"),
    pytest.param(
        lambda: jd.CentralStorageStrategy(
            compute_devices=jax.devices()[:2], parameter_device=jax.devices()[7]
        ),
        2.0,
        id="central_storage",
    ),
    pytest.param(lambda: jd.OneDeviceStrategy(jax.devices()[3]), 1.0, id="one_device"),
]


@pytest.mark.parametrize("batched", [False, True], ids=["reduce_to", "batch_reduce_to"])
@pytest.mark.parametrize(("make", "expected"), _MERGE_STRATEGIES)
def test_reduce_to_docstring_example_in_merge_call(make: Any, expected: float, batched: bool):
    s = make()
    with s.scope():
        v = jd.Variable(0.0)
    out = s.run(_merge_step(batched), args=(v,))
    assert isinstance(out, jd.Variable)
    assert float(out) == expected
    assert out.device_values.devices() == v.device_values.devices()  # stays where it lives


# -- the cross-replica update pattern -------------------------------------------------------


@pytest.mark.parametrize("make", [_mirrored, _central], ids=["mirrored", "central_storage"])
def test_reduce_to_then_update_is_an_sgd_step(make: Any) -> None:
    """TF's recipe: reduce per-replica gradients to the variable's devices, then update it."""
    s = make()
    n = s.num_replicas_in_sync
    with s.scope():
        w = jd.Variable(jnp.arange(3.0), aggregation=Agg.MEAN)
    grads = s.run(lambda ctx: jnp.arange(3.0) * (1.0 + ctx.replica_id_in_sync_group))
    reduced = s.extended.reduce_to(jd.VariableAggregation.MEAN, grads, destinations=w)
    assert _devices(reduced) == _devices(w.device_values)
    w2 = s.extended.update(w, lambda v, g: v.assign_sub(0.1 * g), args=(reduced,))
    mean_grad = np.arange(3.0) * np.mean(1.0 + np.arange(n))
    np.testing.assert_allclose(np.asarray(w2), np.arange(3.0) - 0.1 * mean_grad, rtol=RTOL)
    assert w2.device_values.sharding == w.device_values.sharding


# -- where results go ---------------------------------------------------------------------


def test_reduce_to_and_broadcast_to_place_on_every_destination_device() -> None:
    s = _mirrored()
    devices = jax.devices()
    x = _placed()
    with s.scope():
        v = jd.Variable(jnp.zeros(3))
    host_built = jd.PerReplica(jnp.asarray(_rows()))  # on one device until run places it
    cases: list[tuple[Any, set[jax.Device], bool]] = [
        ("/cpu:4", {devices[4]}, False),
        (devices[6], {devices[6]}, False),
        (2, {devices[2]}, False),
        ([devices[1]], {devices[1]}, False),
        (["/cpu:0", "/cpu:3", "/cpu:5"], {devices[0], devices[3], devices[5]}, True),
        (v, set(devices), True),
        (x, set(devices), True),
        (host_built, set(devices), True),
        (jd.Mirrored(jnp.ones(3)), set(devices), True),
    ]
    for dest, expected, mirrored in cases:
        reduced = s.extended.reduce_to("sum", x, dest)
        copied = s.extended.broadcast_to(jnp.arange(3.0), dest)
        for out in (reduced, copied):
            assert isinstance(out, jd.Mirrored) is mirrored, (dest, type(out))
            assert _devices(out) == expected, dest
        np.testing.assert_allclose(np.asarray(reduced), _rows().sum(0), rtol=RTOL)
        np.testing.assert_array_equal(np.asarray(copied), np.arange(3.0))
    everywhere = s.extended.broadcast_to({"a": jnp.ones(2), "b": v}, destinations=None)
    assert _devices(everywhere["a"]) == set(devices) == _devices(everywhere["b"])
    first, second = s.extended.batch_reduce_to(Agg.MEAN, [(x, "/cpu:7"), ({"k": x}, x)])
    assert _devices(first) == {devices[7]} and _devices(second["k"]) == set(devices)
    np.testing.assert_allclose(np.asarray(second["k"]), _rows().mean(0), rtol=RTOL)


def test_central_storage_reduces_to_the_parameter_device() -> None:
    s = _central()
    with s.scope():
        v = jd.Variable(jnp.zeros(3))
    x = s.run(lambda ctx: jnp.full(3, 1.0 + ctx.replica_id_in_sync_group))
    out = s.extended.reduce_to(Agg.SUM, x, destinations=v)
    assert not isinstance(out, jd.DistributedValues) and out.devices() == {jax.devices()[7]}
    np.testing.assert_array_equal(np.asarray(out), np.full(3, 3.0))
    assert s.extended.parameter_devices == (jax.devices()[7],)
    assert s.extended.worker_devices == tuple(jax.devices()[:2])


def test_update_copies_its_arguments_to_the_variable_devices() -> None:
    """TF runs ``fn`` where each copy lives, with the arguments copied there."""
    s = _central()
    with s.scope():
        w = jd.Variable(jnp.arange(3.0))
        m = jd.Variable(jnp.zeros(3), synchronization=Sync.ON_READ, aggregation=Agg.MEAN)
    grads = s.run(lambda ctx: jnp.full(3, 1.0 + ctx.replica_id_in_sync_group))
    on_compute = s.extended.reduce_to("mean", grads, destinations=None)  # compute devices
    assert _devices(on_compute) == set(jax.devices()[:2])
    elsewhere = jax.device_put(jnp.ones(3), jax.devices()[4])
    w2 = s.extended.update(
        w, lambda v, g, d: v.assign_sub(g).assign_add(d), (on_compute, elsewhere)
    )
    np.testing.assert_array_equal(np.asarray(w2), np.arange(3.0) - 1.5 + 1.0)
    assert w2.device_values.devices() == {jax.devices()[7]}
    m2 = s.extended.update(m, lambda v, g, d: v.assign_add(g * d), (grads, elsewhere))
    np.testing.assert_array_equal(np.asarray(m2.device_values), [[1.0] * 3, [2.0] * 3])
    assert m2.device_values.sharding == m.device_values.sharding


# -- reduce ops and values, as TF reduces them ----------------------------------------------


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (Agg.SUM, lambda r: r.sum(0)),
        (Agg.MEAN, lambda r: r.mean(0)),
        (Agg.ONLY_FIRST_REPLICA, lambda r: r[0]),
        (jd.ReduceOp.SUM, lambda r: r.sum(0)),
        ("Mean", lambda r: r.mean(0)),
        ("max", lambda r: r.max(0)),
        (jd.ReduceOp.MIN, lambda r: r.min(0)),
    ],
)
def test_reduce_to_of_per_replica_values(op: Any, expected: Any) -> None:
    s = _mirrored()
    out = s.extended.reduce_to(op, _placed(), destinations=None)
    assert isinstance(out, jd.Mirrored) and _devices(out) == set(jax.devices())
    np.testing.assert_allclose(np.asarray(out), expected(_rows()), rtol=RTOL)


def test_reduce_to_of_mirrored_and_plain_values() -> None:
    """As TF: a Mirrored value SUMs its N copies; MEAN and ONLY_FIRST_REPLICA give it back; a
    plain value is the same on every replica, so MEAN keeps it, SUM refuses it (unless 0)."""
    s = _mirrored()
    m = jd.Mirrored(jnp.arange(3.0))
    np.testing.assert_array_equal(np.asarray(s.extended.reduce_to("sum", m, m)), N * np.arange(3))
    for op in ("mean", Agg.ONLY_FIRST_REPLICA, "max"):
        np.testing.assert_array_equal(np.asarray(s.extended.reduce_to(op, m, m)), np.arange(3.0))
    plain = np.arange(3.0, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(s.extended.reduce_to("mean", plain, "/cpu:0")), plain)
    assert float(s.extended.reduce_to("sum", 0.0, "/cpu:0")) == 0.0
    with pytest.raises(
        ValueError,
        match=r"StrategyExtended\.reduce_to: cannot SUM-reduce a non-distributed value of type "
        r"ndarray across 8 replicas.*Return it from strategy\.run",
    ):
        s.extended.reduce_to("sum", plain, "/cpu:0")


def test_options_and_deprecated_hints_give_the_same_numbers() -> None:
    s = _mirrored()
    x = _placed()
    ref = np.asarray(s.extended.reduce_to("sum", x, x))
    opts = jd.experimental.CommunicationOptions(bytes_per_pack=16, implementation="ring")
    np.testing.assert_array_equal(np.asarray(s.extended.reduce_to("sum", x, x, opts)), ref)
    (batched,) = s.extended.batch_reduce_to("sum", [(x, x)], options=opts)
    np.testing.assert_array_equal(np.asarray(batched), ref)
    with pytest.warns(DeprecationWarning, match=r"reduce_to: experimental_hints is deprecated"):
        hinted = s.extended.reduce_to("sum", x, x, experimental_hints=opts)
    np.testing.assert_array_equal(np.asarray(hinted), ref)
    with pytest.warns(DeprecationWarning, match=r"batch_reduce_to: experimental_hints"):
        s.extended.batch_reduce_to("sum", [(x, x)], experimental_hints=opts)


def test_reduce_to_errors_name_the_argument_and_the_fix() -> None:
    s = _mirrored()
    x = _placed()
    ext = s.extended
    with pytest.raises(
        ValueError, match=r"reduce_to: reduce_op VariableAggregation\.NONE.*Use SUM"
    ):
        ext.reduce_to(Agg.NONE, x, x)
    with pytest.raises(ValueError, match=r"reduce_to: unknown reduce op 'median'.*ONLY_FIRST"):
        ext.reduce_to("median", x, x)
    with pytest.raises(
        ValueError, match=r"reduce_to: a PerReplica value has 4 per-replica values \(shape \(4, 2\)"
    ):
        ext.reduce_to("sum", jd.PerReplica(jnp.ones((4, 2))), "/cpu:0")
    with pytest.raises(TypeError, match=r"reduce_to: options must be a jaxdist\.experimental"):
        ext.reduce_to("sum", x, x, options={"bytes_per_pack": 4})
    with pytest.raises(ValueError, match=r"got both options and experimental_hints"):
        opts = jd.experimental.CommunicationOptions()
        ext.reduce_to("sum", x, x, options=opts, experimental_hints=opts)
    with pytest.raises(ValueError, match=r"reduce_to\(destinations=\.\.\.\): no device matches "):
        ext.reduce_to("sum", x, "/gpu:3")
    with pytest.raises(TypeError, match=r"reduce_to\(destinations=\.\.\.\): cannot place a result"):
        ext.reduce_to("sum", x, 2.5)
    with pytest.raises(ValueError, match=r"destination devices must be unique"):
        ext.reduce_to("sum", x, ["/cpu:1", 1])
    with pytest.raises(TypeError, match=r"batch_reduce_to: value_destination_pairs\[1\] must be"):
        ext.batch_reduce_to("sum", [(x, x), x])
    with pytest.raises(TypeError, match=r"broadcast_to: tensor\['g'\] is a PerReplica"):
        ext.broadcast_to({"g": x}, None)
    with pytest.raises(RuntimeError, match=r"extended\.reduce_to was called inside a replica"):
        s.run(lambda ctx, y: ext.reduce_to("sum", y, y), args=(x,))


# -- ReductionToOneDevice -------------------------------------------------------------------


def _recording_sum(seen: list[set[jax.Device]]) -> Callable[[list[jax.Array]], jax.Array]:
    def accumulate(rows: list[jax.Array]) -> jax.Array:
        seen.append({d for r in rows for d in r.devices()})
        return functools.reduce(jnp.add, rows)

    return accumulate


def test_reduction_to_one_device_reduces_on_its_device_then_copies_out() -> None:
    devices = jax.devices()
    seen: list[set[jax.Device]] = []
    ops = jd.ReductionToOneDevice(reduce_to_device=devices[6], accumulation_fn=_recording_sum(seen))
    x = _placed()
    out = ops.reduce("mean", x, destinations=devices[2])
    assert seen == [{devices[6]}]  # every row was moved to the reduce device first
    assert out.devices() == {devices[2]}
    np.testing.assert_allclose(np.asarray(out), _rows().mean(0), rtol=RTOL)
    (both,) = ops.batch_reduce("sum", [(x, devices[:2])])
    assert seen[-1] == {devices[6]} and _devices(both) == set(devices[:2])
    np.testing.assert_allclose(np.asarray(both), _rows().sum(0), rtol=RTOL)
    calls = len(seen)
    np.testing.assert_array_equal(np.asarray(ops.reduce("max", x, x)), _rows().max(0))
    assert len(seen) == calls  # MAX takes the extremum, not accumulation_fn (TF: SUM/MEAN only)


def test_reduction_to_one_device_defaults_to_the_first_destination() -> None:
    devices = jax.devices()
    seen: list[set[jax.Device]] = []
    ops = jd.ReductionToOneDevice(accumulation_fn=_recording_sum(seen))
    out = ops.reduce("sum", _placed(), destinations=[devices[5], devices[1]])
    assert seen == [{devices[5]}] and _devices(out) == {devices[1], devices[5]}
    s = jd.MirroredStrategy(cross_device_ops=ops)
    total = s.extended.reduce_to("sum", _placed(), destinations="/cpu:3")
    assert seen[-1] == {devices[3]} and total.devices() == {devices[3]}
    np.testing.assert_allclose(np.asarray(total), _rows().sum(0), rtol=RTOL)


# -- StrategyExtended.update ------------------------------------------------------------------


def test_update_view_supports_tf_idioms_and_array_functions() -> None:
    s = _mirrored()
    with s.scope():
        v = jd.Variable(jnp.arange(3.0), name="w")
    chained = s.extended.update(v, lambda var, a, b: var.assign_add(a).assign_sub(b), (5.0, 1.0))
    np.testing.assert_array_equal(np.asarray(chained), np.arange(3.0) + 4.0)

    def in_place(var: Any, x: Any) -> None:  # returns nothing: the view's value is kept
        var.assign(var.read_value() * x)

    np.testing.assert_array_equal(
        np.asarray(s.extended.update(v, in_place, (3.0,))), np.arange(3.0) * 3
    )
    np.testing.assert_array_equal(
        np.asarray(s.extended.update(v, jnp.add, (jnp.ones(3),))), np.arange(3.0) + 1
    )
    seen: dict[str, Any] = {}

    def inspect_view(var: Any, *, scale: float) -> Any:
        seen.update(shape=var.shape, dtype=var.dtype, name=var.name, ndim=var.ndim)
        return var.value() * scale + var[0]

    out = s.extended.update(v, inspect_view, kwargs={"scale": 2.0})
    assert seen == {"shape": (3,), "dtype": jnp.float32, "name": "w", "ndim": 1}
    np.testing.assert_array_equal(np.asarray(out), np.arange(3.0) * 2)
    assert out.device_values.sharding == v.device_values.sharding


def test_update_refuses_what_tf_refuses() -> None:
    s = _mirrored()
    with s.scope():
        n = jd.Variable(jnp.zeros(2, jnp.int32), name="n")
    with pytest.raises(
        TypeError,
        match=r"update: assign on the copy of variable 'n': cannot assign a value of dtype "
        r"float32 to variable 'n' of dtype int32",
    ):
        s.extended.update(n, lambda var: var.assign(jnp.ones(2) * 0.5))
    with pytest.raises(ValueError, match=r"update: fn returned shape \(3,\) for a copy of"):
        s.extended.update(n, lambda var: jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"is mirrored \(one logical copy\) but got PerReplica"):
        s.extended.update(n, lambda var, d: var.assign_add(d), (_placed(),))
    with pytest.raises(TypeError, match=r"update: var must be a jaxdist\.Variable, got ArrayImpl"):
        s.extended.update(jnp.zeros(2), lambda var: var)
    with pytest.raises(TypeError, match=r"update: assign on the copy of variable 'n': cannot"):
        s.run(lambda ctx, var: s.extended.update(var, lambda v: v.assign(0.5)), args=(n,))


_REPLICA_UPDATE_STRATEGIES = [
    pytest.param(_mirrored, id="mirrored"),
    pytest.param(_central, id="central_storage"),
    pytest.param(lambda: jd.OneDeviceStrategy(jax.devices()[3]), id="one_device"),
    pytest.param(lambda: jd.TPUStrategy(), id="tpu"),
    pytest.param(
        lambda: jd.experimental.MeshStrategy({"data": 4, "tensor": 2}, (("batch", "data"),)),
        id="mesh",
    ),
]


@pytest.mark.parametrize("make", _REPLICA_UPDATE_STRATEGIES)
def test_update_inside_a_replica_function_updates_this_replicas_copy(make: Any) -> None:
    """TF's replica-context ``extended.update`` (no merge_call): ``fn`` runs on this
    replica's copy with this replica's arguments, no aggregation. A mirrored variable given
    the same arguments everywhere, whatever its aggregation (SUM too: TF's update does not
    aggregate), and an ON_READ one given each replica's own. Reference: NumPy."""
    s = make()
    n = s.num_replicas_in_sync
    with s.scope():
        w = jd.Variable(jnp.arange(3.0), aggregation=Agg.SUM, name="w")
        c = jd.Variable(jnp.zeros(3), synchronization=Sync.ON_READ, aggregation=Agg.SUM)

    def step(ctx: jd.ReplicaContext, w: jd.Variable, c: jd.Variable) -> Any:
        w = s.extended.update(w, lambda v, x: v.assign_add(x).assign_sub(0.5), args=(2.0,))
        w = s.extended.update(w, lambda v, k: v * k, kwargs={"k": 3.0})  # a plain function
        rid = ctx.replica_id_in_sync_group.astype(jnp.float32)
        c = s.extended.update(c, lambda v, d: v.assign_add(d), args=(jnp.full(3, rid + 1),))
        return w, c

    w2, c2 = s.run(step, args=(w, c))
    assert isinstance(w2, jd.Variable) and w2.aggregation is Agg.SUM
    np.testing.assert_allclose(np.asarray(w2), (np.arange(3.0) + 1.5) * 3.0, rtol=RTOL)
    copies = np.arange(1.0, n + 1.0)[:, None] * np.ones(3)
    np.testing.assert_allclose(np.asarray(c2), copies.sum(0), rtol=RTOL)  # SUM on read
    np.testing.assert_array_equal(np.asarray(w), np.arange(3.0))  # w itself is unchanged


def test_update_inside_a_replica_function_refuses_per_replica_values_for_mirrored() -> None:
    """Where TF would let a mirrored variable's copies drift apart (each replica's own
    argument, no aggregation), the error names the variable and the two fixes, and both work."""
    s = _mirrored()
    with s.scope():
        w = jd.Variable(jnp.zeros(2), aggregation=Agg.MEAN, name="w")

    def own(ctx: jd.ReplicaContext, w: jd.Variable) -> Any:
        d = ctx.replica_id_in_sync_group.astype(jnp.float32) * jnp.ones(2)
        return s.extended.update(w, lambda v, d: v.assign_add(d), args=(d,))

    with pytest.raises(
        jd.errors.ReplicaDivergenceError,
        match=r"update: inside a replica function, fn's new value for the mirrored \(ON_WRITE\) "
        r"variable 'w' differs across replicas.*ctx\.all_reduce.*aggregation \(MEAN\)",
    ):
        s.run(own, args=(w,))

    def reduced(ctx: jd.ReplicaContext, w: jd.Variable) -> Any:
        d = ctx.replica_id_in_sync_group.astype(jnp.float32) * jnp.ones(2)
        return s.extended.update(w, lambda v, d: v.assign_add(d), (ctx.all_reduce("mean", d),))

    mean = np.arange(N, dtype=np.float32).mean()
    np.testing.assert_allclose(np.asarray(s.run(reduced, args=(w,))), [mean, mean], rtol=RTOL)
    with pytest.raises(ValueError, match=r"update: fn returned shape \(3,\) for this replica's"):
        s.run(lambda ctx, w: s.extended.update(w, lambda v: jnp.zeros(3)), args=(w,))


def test_update_of_sync_on_read_copies_takes_per_replica_rows() -> None:
    s = _mirrored()
    with s.scope():
        m = jd.Variable(jnp.zeros(3), synchronization=Sync.ON_READ, aggregation=Agg.MEAN)
    out = s.extended.update(m, lambda var, d: var.assign_add(d), (_placed(),))
    np.testing.assert_allclose(np.asarray(out.device_values), _rows(), rtol=RTOL)
    np.testing.assert_allclose(np.asarray(out), _rows().mean(0), rtol=RTOL)
    local = s.extended.update(m, lambda var: var.assign(1.0), group=False)
    assert len(local) == N and all(np.array_equal(np.asarray(c), np.ones(3)) for c in local)


# -- cross-replica assign with distributed values ----------------------------------------------


@pytest.mark.parametrize(
    ("sync", "agg", "method", "expected"),
    [
        # ON_WRITE: the rows combine as the variable's aggregation says.
        (Sync.ON_WRITE, Agg.SUM, "assign", lambda old, r: r.sum(0)),
        (Sync.ON_WRITE, Agg.MEAN, "assign", lambda old, r: r.mean(0)),
        (Sync.ON_WRITE, Agg.ONLY_FIRST_REPLICA, "assign", lambda old, r: r[0]),
        (Sync.ON_WRITE, Agg.MEAN, "assign_add", lambda old, r: old + r.mean(0)),
        (Sync.ON_WRITE, Agg.SUM, "assign_sub", lambda old, r: old - r.sum(0)),
        # ON_READ: copy r takes (adds) row r; reading aggregates the copies.
        (Sync.ON_READ, Agg.SUM, "assign", lambda old, r: r.sum(0)),
        (Sync.ON_READ, Agg.MEAN, "assign_add", lambda old, r: old + r.mean(0)),
        (Sync.ON_READ, Agg.ONLY_FIRST_REPLICA, "assign_sub", lambda old, r: old - r[0]),
    ],
)
def test_cross_replica_assign_of_a_per_replica_value(
    sync: Any, agg: Any, method: str, expected: Any
) -> None:
    s = _mirrored()
    with s.scope():
        v = jd.Variable(jnp.full(3, 2.0), synchronization=sync, aggregation=agg)
    out = getattr(v, method)(_placed())
    np.testing.assert_allclose(np.asarray(out), expected(np.full(3, 2.0), _rows()), rtol=RTOL)
    assert out.device_values.sharding == v.device_values.sharding


def test_cross_replica_assign_of_a_mirrored_value() -> None:
    s = _mirrored()
    with s.scope():
        w = jd.Variable(jnp.zeros(3), aggregation=Agg.NONE)
        m = jd.Variable(jnp.zeros(3), synchronization=Sync.ON_READ, aggregation=Agg.MEAN)
    grads = s.run(lambda ctx: ctx.all_reduce("sum", jnp.ones(3)))  # Mirrored
    assert isinstance(grads, jd.Mirrored)
    w = w.assign(grads).assign_add(grads).assign_sub(jd.Mirrored(jnp.ones(3)))
    np.testing.assert_array_equal(np.asarray(w), np.full(3, N + N - 1))
    m = m.assign(grads)  # every copy takes the value; MEAN reads it back
    np.testing.assert_array_equal(np.asarray(m.device_values), np.full((N, 3), N))
    np.testing.assert_array_equal(np.asarray(m), np.full(3, N))


def test_cross_replica_assign_errors() -> None:
    s = _mirrored()
    with s.scope():
        w = jd.Variable(jnp.zeros(3), aggregation=Agg.NONE, name="w")
        k = jd.Variable(jnp.zeros(3, jnp.int32), aggregation=Agg.MEAN, name="k")
        total = jd.Variable(0.0, synchronization=Sync.ON_READ, aggregation=Agg.SUM, name="t")
    with pytest.raises(
        ValueError, match=r"Variable\.assign: variable 'w' is mirrored \(ON_WRITE\) "
    ):
        w.assign(_placed())
    ints = jd.PerReplica(jnp.arange(N * 3, dtype=jnp.int32).reshape(N, 3))
    with pytest.raises(ValueError, match=r"'k' has integer dtype int32 and aggregation MEAN"):
        k.assign(ints)
    with pytest.raises(ValueError, match=r"the PerReplica value has 2 per-replica values"):
        w.assign_add(jd.PerReplica(jnp.ones((2, 3))))
    with pytest.raises(ValueError, match=r"assign_add: .*ON_READ with aggregation SUM; adding"):
        total.assign_add(1.0)


# -- experimental_require_static_shapes -----------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [jd.OneDeviceStrategy, _mirrored, _central, jd.MultiWorkerMirroredStrategy],
    ids=["one_device", "mirrored", "central_storage", "multi_worker"],
)
def test_require_static_shapes_is_false_as_in_tf_for_these_strategies(make: Any) -> None:
    """TF uses the flag to drop the remainder of numpy datasets; jaxdist pads it instead."""
    s = make()
    assert s.extended.experimental_require_static_shapes is False
    batches = list(s.experimental_make_numpy_dataset(np.arange(10.0)).batch(4))
    assert [len(b) for b in batches] == [4, 4, 2]


# -- MAX / MIN propagate NaN, on sharded values too -------------------------------------------


def _nan_rows() -> np.ndarray:
    rows = _rows()
    rows[3, 1] = np.nan
    rows[5, 0], rows[6, 0] = np.inf, -np.inf
    rows[2, 2], rows[4, 2] = -0.0, -np.inf
    return rows


@pytest.mark.parametrize("op", ["max", "min"])
def test_cross_replica_extrema_propagate_nan_like_numpy(op: str) -> None:
    s = _mirrored()
    rows = _nan_rows()
    x = _placed(rows)
    assert len(_devices(x)) == N  # sharded: the reduction crosses devices
    expected = getattr(np, op)(rows, axis=0)
    outs = {
        "reduce": s.reduce(op, x),
        "reduce_to": s.extended.reduce_to(op, x, x),
        "nccl": jd.NcclAllReduce().reduce(op, x, x),
        "hierarchical": jd.HierarchicalCopyAllReduce().reduce(op, x, "/cpu:1"),
        "one_device": jd.ReductionToOneDevice().reduce(op, x, "/cpu:1"),
    }
    for name, out in outs.items():
        np.testing.assert_array_equal(np.asarray(out), expected, err_msg=name)
    along = s.reduce(op, x, axis=0)  # across replicas and rows
    assert np.isnan(np.asarray(along))
    clean = np.nan_to_num(rows, nan=1.0, posinf=9.0, neginf=-9.0)
    np.testing.assert_array_equal(
        np.asarray(s.reduce(op, _placed(clean), axis=0)), getattr(np, op)(clean)
    )


@pytest.mark.parametrize("op", ["max", "min"])
def test_masked_extrema_skip_padding_and_keep_nan(op: str) -> None:
    """A padded batch (valid rows per replica): padding never wins, NaN in a data row does."""
    s = _mirrored()
    data = np.arange(N * 4, dtype=np.float32).reshape(N, 4) - 10.0
    valid = np.array([4, 4, 3, 2, 1, 1, 1, 1], dtype=np.int32)
    padded = data.copy()
    for r, k in enumerate(valid):
        padded[r, k:] = 1e6 if op == "max" else -1e6  # would win if counted
    batch = _placed(padded)
    x = jd.PerReplica(batch.array, valid=jnp.asarray(valid))
    kept = np.concatenate([data[r, :k] for r, k in enumerate(valid)])
    assert float(s.reduce(op, x, axis=0)) == getattr(np, op)(kept)
    padded[2, 1] = np.nan
    with_nan = jd.PerReplica(_placed(padded).array, valid=jnp.asarray(valid))
    assert np.isnan(float(s.reduce(op, with_nan, axis=0)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int32])
@pytest.mark.parametrize("op", ["max", "min"])
def test_all_reduce_extrema_of_narrow_dtypes(op: str, dtype: Any) -> None:
    s = _mirrored()
    rows = np.arange(N * 3).reshape(N, 3) - 11
    x = jnp.asarray(rows, dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        x = x.at[4, 1].set(jnp.nan).at[2, 0].set(-jnp.inf)
    out = s.run(lambda ctx, a: ctx.all_reduce(op, a), args=(jd.PerReplica(x),))
    assert out.dtype == dtype
    expected = getattr(np, op)(np.asarray(x, np.float32), axis=0)
    np.testing.assert_array_equal(np.asarray(out, np.float32), expected)


# -- two-level strategies: same numbers, the structure the options ask for ---------------------


def _hlo(s: jd.Strategy, options: Any = None) -> str:
    f = s.function(lambda ctx, x: ctx.all_reduce("sum", x, options=options))
    return f.lower(jd.PerReplica(jnp.asarray(_rows()))).compile().as_text()


def _moving(hlo: str) -> list[str]:
    """The opcodes of the collectives in ``hlo`` that move data (groups of 2 devices or more)."""
    return [c.opcode for c in collectives(hlo) if c.group_size > 1]


def test_multi_worker_ring_is_reduce_scatter_then_all_gather() -> None:
    opts = jd.experimental.CommunicationOptions
    ring = jd.MultiWorkerMirroredStrategy(communication_options=opts(implementation="ring"))
    auto = jd.MultiWorkerMirroredStrategy()
    assert ring.axis_name == ("host", "local") and ring.mesh.devices.shape == (1, N)
    ring_hlo, auto_hlo = _hlo(ring), _hlo(auto)
    mesh = {"host": 1, "local": N}  # one process: the host axis has one device
    every = mesh_groups(mesh, over=("host", "local"))
    # The ring's all-reduce across hosts is still there, over groups of one device: it
    # moves nothing (both XLA versions keep it).
    assert _moving(ring_hlo) == ["reduce-scatter", "all-gather"]
    assert group_sets(ring_hlo, "reduce-scatter") == group_sets(ring_hlo, "all-gather") == [every]
    assert all(c.group_size == 1 for c in collectives(ring_hlo, "all-reduce"))
    assert [c.opcode for c in collectives(auto_hlo)] == ["all-reduce"]
    assert group_sets(auto_hlo, "all-reduce") == [every]
    x = jd.PerReplica(jnp.asarray(_rows()))
    for s in (ring, auto):
        out = s.run(lambda ctx, a: ctx.all_reduce("sum", a), args=(x,))
        np.testing.assert_allclose(np.asarray(out), _rows().sum(0), rtol=RTOL)


def _tree() -> dict[str, jax.Array]:
    rng = np.random.default_rng(1)
    tree = {
        f"f{i:02d}": jnp.asarray(rng.normal(size=(N, i % 3 + 1)), jnp.float32) for i in range(6)
    }
    tree.update(
        {f"i{i}": jnp.asarray(rng.integers(-5, 5, size=(N, 2)), jnp.int32) for i in range(3)}
    )
    return tree


def _lowered_collectives(s: jd.Strategy, options: Any) -> tuple[dict[str, int], Any]:
    f = s.function(lambda ctx, t: ctx.all_reduce("sum", t, options=options))
    tree = jax.tree.map(jd.PerReplica, _tree())
    text = f.lower(tree).as_text()
    counts = {
        name: lowered_count(text, name) for name in ("all_reduce", "reduce_scatter", "all_gather")
    }
    return counts, f(tree)


@pytest.mark.parametrize(
    ("ops", "options", "expected"),
    [
        (jd.NcclAllReduce(), None, {"all_reduce": 9}),
        (
            jd.NcclAllReduce(),
            jd.experimental.CommunicationOptions(bytes_per_pack=1 << 20),
            {
                "all_reduce": 2  # one buffer per dtype
            },
        ),
        (jd.NcclAllReduce(num_packs=2), None, {"all_reduce": 4}),  # two per dtype
        (
            jd.HierarchicalCopyAllReduce(),
            jd.experimental.CommunicationOptions(bytes_per_pack=1 << 20),
            {"reduce_scatter": 2, "all_gather": 2},
        ),
    ],
    ids=["nccl", "nccl_bytes_per_pack", "nccl_num_packs", "hierarchical_bytes_per_pack"],
)
def test_packing_mixed_dtypes_changes_collectives_not_numbers(
    ops: jd.CrossDeviceOps, options: Any, expected: dict[str, int]
) -> None:
    s = jd.Strategy(jax.devices(), ops, mesh_shape=(2, 4), axis_names=("host", "local"))
    counts, out = _lowered_collectives(s, options)
    for name, count in expected.items():
        assert counts[name] == count, counts
    for k, v in _tree().items():
        want = np.asarray(v).sum(0)
        assert out[k].dtype == v.dtype
        np.testing.assert_allclose(np.asarray(out[k]), want, rtol=1e-5, atol=1e-5)


def test_per_call_options_override_the_ops_defaults_field_by_field() -> None:
    base = jd.experimental.CommunicationOptions(bytes_per_pack=1 << 20, timeout_seconds=9)
    ops = jd.NcclAllReduce(options=base)
    merged = ops.merged_options(jd.experimental.CommunicationOptions(timeout_seconds=1), "test")
    assert (merged.bytes_per_pack, merged.timeout_seconds) == (1 << 20, 1.0)
    s = jd.Strategy(jax.devices(), ops, mesh_shape=(2, 4), axis_names=("host", "local"))
    counts, _ = _lowered_collectives(s, None)
    assert counts["all_reduce"] == 2  # the ops' own bytes_per_pack applies
    counts, _ = _lowered_collectives(s, jd.experimental.CommunicationOptions(bytes_per_pack=8))
    assert counts["all_reduce"] > 2  # smaller packs asked for this call


def test_mirrored_strategy_on_a_two_level_mesh() -> None:
    s = jd.MirroredStrategy(
        cross_device_ops=jd.HierarchicalCopyAllReduce(), mesh_shape=(2, 4), axis_names=("h", "l")
    )
    assert s.axis_name == ("h", "l") and s.num_replicas_in_sync == N
    hlo = _hlo(s)
    mesh = {"h": 2, "l": 4}
    found = collectives(hlo)  # in schedule order, which follows the data
    assert [c.opcode for c in found] == ["reduce-scatter", "all-reduce", "all-gather"]
    assert [frozenset(map(frozenset, c.groups)) for c in found] == [
        mesh_groups(mesh, over=("l",)),  # inside each host
        mesh_groups(mesh, over=("h",)),  # across hosts
        mesh_groups(mesh, over=("l",)),
    ]
    assert bytes_across(hlo, mesh, "h") == 4  # 3 floats padded to 4, one per device crosses
    out = s.run(
        lambda ctx, a: ctx.all_reduce("sum", a), args=(jd.PerReplica(jnp.asarray(_rows())),)
    )
    np.testing.assert_allclose(np.asarray(out), _rows().sum(0), rtol=RTOL)
    with pytest.raises(
        ValueError,
        match=r"MirroredStrategy\(mesh_shape=\(3, 3\), axis_names=\('h', 'l'\)\): mesh_shape must "
        r"give one positive size per axis name .* number of devices \(8\), e\.g\. "
        r"mesh_shape=\(2, 4\)",
    ):
        jd.MirroredStrategy(mesh_shape=(3, 3), axis_names=("h", "l"))
    with pytest.raises(ValueError, match=r"2 axis names need a mesh_shape"):
        jd.MirroredStrategy(axis_names=("h", "l"))
    with pytest.raises(ValueError, match=r"axis_names must be a non-empty tuple of distinct"):
        jd.MirroredStrategy(mesh_shape=(2, 4), axis_names=("h", "h"))


def test_merge_call_sees_sync_on_read_copies_and_hands_them_back() -> None:
    s = jd.MirroredStrategy(jax.devices()[:4])
    with s.scope():
        m = jd.Variable(0.0, synchronization=Sync.ON_READ, aggregation=Agg.SUM)

    def step(ctx: jd.ReplicaContext, m: jd.Variable) -> tuple[jd.Variable, Any]:
        m = m.assign_add(jnp.float32(ctx.replica_id_in_sync_group))

        def merge_fn(strategy: jd.Strategy, m: jd.Variable) -> tuple[jd.Variable, Any]:
            total = m.read_value()  # cross-replica read: the SUM of the copies
            return m.assign(total * 10), total

        m, total = ctx.merge_call(merge_fn, args=(m,))
        return m.assign_add(1.0), total

    out, total = s.run(step, args=(m,))
    assert float(total) == 6.0  # 0 + 1 + 2 + 3
    np.testing.assert_array_equal(np.asarray(out.device_values), np.full(4, 16.0))  # 60 / 4 + 1
    assert float(out) == 64.0

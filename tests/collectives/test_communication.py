"""Communication options, two-level collectives, packing, CrossDeviceOps and StrategyExtended.

References: NumPy for every number; tf.distribute's documented behaviour for the
API (``CommunicationOptions``, ``CrossDeviceOps.reduce/batch_reduce/broadcast``,
``ReductionToOneDevice``, ``StrategyExtended.update/reduce_to/broadcast_to``).
Collective structure is read from the compiled HLO with ``tests/_hlo.py`` (which
devices each collective groups, how many bytes leave a host), whatever spelling
the installed XLA prints, or, for the number of collectives before XLA's
combiner, from the lowered StableHLO.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import jaxdist as jd
from jaxdist._jax_compat import all_gather_invariant, varying_axes
from jaxdist.collectives.cross_device_ops import cross_device_ops_for

from _hlo import bytes_across, collectives, group_sets, lowered_count, mesh_groups

RTOL = 1e-6  # float32 sums of 8 small integers-valued floats: exact in practice
HOST, LOCAL = 2, 4  # a (host, local) mesh inside one process, as MultiWorkerMirroredStrategy's
MESH = {"host": HOST, "local": LOCAL}
EVERY = mesh_groups(MESH, over=("host", "local"))
INSIDE = mesh_groups(MESH, over=("local",))  # the devices of each host: {0,1,2,3}, {4,5,6,7}
ACROSS = mesh_groups(MESH, over=("host",))  # one device of each host: {0,4}, {1,5}, ...
ROW_BYTES = 6 * 4  # one replica's value: 6 float32


def _two_level(ops: jd.CrossDeviceOps) -> jd.Strategy:
    return jd.Strategy(jax.devices(), ops, mesh_shape=(HOST, LOCAL), axis_names=("host", "local"))


def _rows() -> np.ndarray:
    return np.arange(8 * 6, dtype=np.float32).reshape(8, 6) - 20.0


def _placed() -> jd.PerReplica:
    """`_rows` as a `PerReplica` on the 8 devices (row r on device r), as `run` returns."""
    s = jd.MirroredStrategy()
    return s.run(lambda ctx, x: x, args=(jd.PerReplica(jnp.asarray(_rows())),))


# -- CommunicationOptions ------------------------------------------------------------


def test_options_defaults_names_and_merge() -> None:
    opts = jd.experimental.CommunicationOptions()
    assert (opts.bytes_per_pack, opts.timeout_seconds) == (0, None)
    assert opts.implementation is jd.experimental.CommunicationImplementation.AUTO
    ring = jd.experimental.CommunicationOptions(implementation="ring", bytes_per_pack=64)
    assert ring.implementation is jd.experimental.CommunicationImplementation.RING
    merged = ring.merge(jd.experimental.CommunicationOptions(timeout_seconds=5))
    assert (merged.bytes_per_pack, merged.timeout_seconds, merged.implementation.name) == (
        64,
        5.0,
        "RING",
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"bytes_per_pack": -1}, ValueError, r"bytes_per_pack must be >= 0 .* got -1\. For 4 MiB"),
        (
            {"bytes_per_pack": 1.5},
            TypeError,
            r"bytes_per_pack must be an int .* got float \(1\.5\)",
        ),
        ({"bytes_per_pack": True}, TypeError, r"bytes_per_pack must be an int .* got bool"),
        ({"timeout_seconds": -3}, ValueError, r"timeout_seconds must be None or a finite number"),
        ({"timeout_seconds": float("inf")}, ValueError, r"timeout_seconds .* got inf"),
        ({"timeout_seconds": "30"}, TypeError, r"timeout_seconds must be None or a number .* str"),
        (
            {"implementation": "carrier-pigeon"},
            ValueError,
            r"unknown implementation 'carrier-pigeon'\. Use one of .*AUTO, RING, NCCL",
        ),
        ({"implementation": 2}, TypeError, r"unknown implementation 2\. .*implementation='ring'"),
    ],
)
def test_options_refuse_bad_values(kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=r"^CommunicationOptions: " + message):
        jd.experimental.CommunicationOptions(**kwargs)


def test_collective_hints_is_a_deprecated_alias() -> None:
    with pytest.warns(DeprecationWarning, match="CommunicationOptions"):
        hints = jd.experimental.CollectiveHints(bytes_per_pack=32, timeout_seconds=10)
    assert hints == jd.experimental.CommunicationOptions(bytes_per_pack=32, timeout_seconds=10)


def test_implementation_chooses_the_ops() -> None:
    opts = jd.experimental.CommunicationOptions
    assert isinstance(cross_device_ops_for(opts(), ("host", "local")), jd.NcclAllReduce)
    assert isinstance(cross_device_ops_for(opts(implementation="nccl"), "x"), jd.NcclAllReduce)
    ring = cross_device_ops_for(opts(implementation="RING"), ("host", "local"))
    assert isinstance(ring, jd.HierarchicalCopyAllReduce)
    s = jd.MultiWorkerMirroredStrategy(communication_options=opts(implementation="ring"))
    assert isinstance(s.cross_device_ops, jd.HierarchicalCopyAllReduce)
    assert s.communication_options.implementation.name == "RING"
    with pytest.raises(TypeError, match=r"communication_options=.*CommunicationOptions"):
        jd.MultiWorkerMirroredStrategy(communication_options={"bytes_per_pack": 1})


# -- same numbers, different collective structure --------------------------------------

OPS = [
    pytest.param(lambda: jd.NcclAllReduce(), id="nccl"),
    pytest.param(lambda: jd.HierarchicalCopyAllReduce(), id="hierarchical"),
    pytest.param(lambda: jd.ReductionToOneDevice(), id="one_device"),
    pytest.param(lambda: jd.NcclAllReduce(num_packs=1), id="nccl_packed"),
]


@pytest.mark.parametrize("make_ops", OPS)
def test_two_level_all_reduce_matches_numpy(make_ops: Any) -> None:
    s = _two_level(make_ops())
    rows = _rows()
    rows[3, 2] = np.nan  # MAX/MIN propagate NaN as NumPy does

    def step(ctx: jd.ReplicaContext, x: jax.Array, y: jax.Array) -> dict[str, Any]:
        return {
            "sum": ctx.all_reduce("sum", {"a": y, "b": 2 * y}),
            "mean": ctx.all_reduce("mean", y),
            "max": ctx.all_reduce("max", x),
            "min": ctx.all_reduce("min", x),
        }

    clean = _rows()
    out = s.run(step, args=(jd.PerReplica(jnp.asarray(rows)), jd.PerReplica(jnp.asarray(clean))))
    np.testing.assert_allclose(np.asarray(out["sum"]["a"]), clean.sum(0), rtol=RTOL)
    np.testing.assert_allclose(np.asarray(out["sum"]["b"]), 2 * clean.sum(0), rtol=RTOL)
    np.testing.assert_allclose(np.asarray(out["mean"]), clean.mean(0), rtol=RTOL)
    np.testing.assert_array_equal(np.asarray(out["max"]), rows.max(0))  # NaN in column 2
    np.testing.assert_array_equal(np.asarray(out["min"]), rows.min(0))
    assert np.isnan(np.asarray(out["max"])[2]) and np.isnan(np.asarray(out["min"])[2])


def _compiled(ops: jd.CrossDeviceOps) -> str:
    s = _two_level(ops)
    f = s.function(lambda ctx, x: ctx.all_reduce("sum", x))
    return f.lower(jd.PerReplica(jnp.asarray(_rows()))).compile().as_text()


def test_nccl_is_one_all_reduce_over_every_replica() -> None:
    hlo = _compiled(jd.NcclAllReduce())
    assert [c.opcode for c in collectives(hlo)] == ["all-reduce"]
    assert group_sets(hlo, "all-reduce") == [EVERY]
    assert bytes_across(hlo, MESH, "host") == ROW_BYTES  # the whole value leaves each host


def test_hierarchical_reduces_inside_each_host_first() -> None:
    """Reduce-scatter inside each host, all-reduce of one shard per device across hosts,
    all-gather inside each host: only 1/LOCAL of the (padded) value crosses hosts."""
    hlo = _compiled(jd.HierarchicalCopyAllReduce())
    found = collectives(hlo)  # in schedule order, which follows the data
    assert [c.opcode for c in found] == ["reduce-scatter", "all-reduce", "all-gather"]
    assert [frozenset(map(frozenset, c.groups)) for c in found] == [INSIDE, ACROSS, INSIDE]
    padded = -(-6 // LOCAL) * LOCAL  # 6 floats padded to 8 for the exchange inside a host
    assert bytes_across(hlo, MESH, "host") == padded // LOCAL * 4 == 8
    assert bytes_across(hlo, MESH, "host") < bytes_across(
        _compiled(jd.NcclAllReduce()), MESH, "host"
    )


@pytest.mark.parametrize("shape", [(1, 8), (8, 1)], ids=["one_host", "one_device_per_host"])
def test_hierarchical_takes_no_collective_over_an_axis_of_size_one(
    shape: tuple[int, int],
) -> None:
    """On one host the cross-host all-reduce is left out (its every group would be one
    device: no sum, but XLA's CPU backend runs it); with one device per host the
    reduce-scatter and all-gather run over ``host``. The sum is NumPy's either way,
    the same on every device, and `Mirrored` (typed invariant over both axes)."""
    s = jd.Strategy(
        jax.devices(),
        jd.HierarchicalCopyAllReduce(),
        mesh_shape=shape,
        axis_names=("host", "local"),
    )
    f = s.function(lambda ctx, x: ctx.all_reduce("sum", x))
    x = jd.PerReplica(jnp.asarray(_rows()))
    hlo = f.lower(x).compile().as_text()
    every = mesh_groups(dict(zip(("host", "local"), shape, strict=True)), ("host", "local"))
    found = collectives(hlo)
    assert [c.opcode for c in found] == ["reduce-scatter", "all-gather"]
    assert [frozenset(map(frozenset, c.groups)) for c in found] == [every, every]
    out = f(x)
    assert isinstance(out, jd.Mirrored)
    copies = {str(d.device): np.asarray(d.data) for d in out.array.addressable_shards}
    assert len(copies) == 8
    for copy in copies.values():
        np.testing.assert_allclose(copy, _rows().sum(0), rtol=RTOL)


def test_reduction_to_one_device_gathers_instead_of_reducing() -> None:
    hlo = _compiled(jd.ReductionToOneDevice())
    assert [c.opcode for c in collectives(hlo)] == ["all-gather"]
    assert group_sets(hlo, "all-gather") == [EVERY]
    assert bytes_across(hlo, MESH, "host") == ROW_BYTES  # each device sends its own value


def test_all_gather_invariant_is_one_all_gather_typed_invariant() -> None:
    """The compat helper behind ctx.all_gather and ReductionToOneDevice: one XLA all-gather,
    typed invariant (shard_map checks that out_specs=P() holds). Its fallback, a psum of
    one-hot rows, moves N times the data; jax 0.12 took it silently while the helper
    imported a name that release made private."""
    mesh = Mesh(np.array(jax.devices()).reshape(HOST, LOCAL), ("host", "local"))
    axes: list[frozenset[str]] = []

    def gather(x: jax.Array) -> jax.Array:
        out = all_gather_invariant(x[0], ("host", "local"))
        axes.append(varying_axes(out))
        return out

    f = jax.jit(
        jax.shard_map(
            gather, mesh=mesh, in_specs=PartitionSpec(("host", "local")), out_specs=PartitionSpec()
        )
    )
    rows = jnp.asarray(_rows())
    hlo = f.lower(rows).compile().as_text()
    assert [c.opcode for c in collectives(hlo)] == ["all-gather"]
    assert group_sets(hlo, "all-gather") == [EVERY]
    np.testing.assert_array_equal(np.asarray(f(rows)), _rows())
    assert axes == [frozenset()]


def test_ring_over_one_axis_is_reduce_scatter_then_all_gather() -> None:
    s = jd.MirroredStrategy(cross_device_ops=jd.HierarchicalCopyAllReduce())
    f = s.function(lambda ctx, x: ctx.all_reduce("sum", x))
    x = jd.PerReplica(jnp.asarray(_rows()))
    hlo = f.lower(x).compile().as_text()
    assert [c.opcode for c in collectives(hlo)] == ["reduce-scatter", "all-gather"]
    every = mesh_groups({"replica": 8}, over=("replica",))
    assert group_sets(hlo, "reduce-scatter") == group_sets(hlo, "all-gather") == [every]
    np.testing.assert_allclose(np.asarray(f(x)), _rows().sum(0), rtol=RTOL)


# -- bytes_per_pack ---------------------------------------------------------------------


def _grads() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {
        f"w{i:02d}": jnp.asarray(rng.normal(size=(8, 3, i % 4 + 1)), jnp.float32) for i in range(20)
    }


def _all_reduces_before_combining(options: Any) -> tuple[int, Any]:
    s = jd.MirroredStrategy()
    f = s.function(lambda ctx, g: ctx.all_reduce("sum", g, options=options))
    grads = jax.tree.map(jd.PerReplica, _grads())
    text = f.lower(grads).as_text()  # StableHLO: XLA's all-reduce combiner has not run
    return lowered_count(text, "all_reduce"), f(grads)


def test_bytes_per_pack_packs_small_gradients_into_few_collectives() -> None:
    unpacked, ref = _all_reduces_before_combining(None)
    packed, out = _all_reduces_before_combining(
        jd.experimental.CommunicationOptions(bytes_per_pack=1 << 20)
    )
    two, _ = _all_reduces_before_combining(jd.experimental.CommunicationOptions(bytes_per_pack=100))
    assert unpacked == 20 and packed == 1, (unpacked, packed)
    assert 1 < two < 20, two  # 600 bytes of gradients in packs of >= 100 bytes
    for k, v in _grads().items():
        np.testing.assert_allclose(np.asarray(out[k]), np.asarray(v).sum(0), rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(ref[k]))


def test_strategy_options_apply_to_every_all_reduce() -> None:
    opts = jd.experimental.CommunicationOptions(bytes_per_pack=1 << 20)
    s = jd.MultiWorkerMirroredStrategy(communication_options=opts)  # one-process cluster
    f = s.function(lambda ctx, g: ctx.all_reduce("sum", g))
    grads = jax.tree.map(jd.PerReplica, _grads())
    assert lowered_count(f.lower(grads).as_text(), "all_reduce") == 1
    out = f(grads)
    for k, v in _grads().items():
        np.testing.assert_allclose(np.asarray(out[k]), np.asarray(v).sum(0), rtol=1e-5)


# -- NaN in cross-replica reductions ------------------------------------------------------


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("placed", [True, False], ids=["sharded", "one_device"])
def test_strategy_reduce_propagates_nan(op: str, placed: bool) -> None:
    s = jd.MirroredStrategy()
    rows = _rows()
    rows[5, 0] = np.nan
    x = jd.PerReplica(jnp.asarray(rows))
    if placed:  # spread over the devices, so the reduction is a cross-device all-reduce
        x = s.run(lambda ctx, a: a, args=(x,))
        assert len(x.array.devices()) == 8
    out = np.asarray(s.reduce(op, x, axis=None))
    np.testing.assert_array_equal(out, getattr(np, op)(rows, axis=0))


# -- CrossDeviceOps in cross-replica context ----------------------------------------------


@pytest.mark.parametrize("make_ops", OPS[:3])
def test_cross_device_ops_reduce_batch_reduce_broadcast(make_ops: Any) -> None:
    ops = make_ops()
    devices = jax.devices()
    x = _placed()
    to_all = ops.reduce("sum", x, destinations=x)
    assert isinstance(to_all, jd.Mirrored) and to_all.array.devices() == set(devices)
    np.testing.assert_allclose(np.asarray(to_all), _rows().sum(0), rtol=RTOL)
    one = ops.reduce(jd.ReduceOp.MEAN, x, destinations=devices[5])
    assert isinstance(one, jax.Array) and one.devices() == {devices[5]}
    np.testing.assert_allclose(np.asarray(one), _rows().mean(0), rtol=RTOL)
    some = ops.reduce("max", x, destinations=devices[:3])
    assert some.array.devices() == set(devices[:3])
    np.testing.assert_array_equal(np.asarray(some), _rows().max(0))
    a, b = ops.batch_reduce("sum", [(x, devices[1]), ({"k": x}, devices[2:4])])
    assert a.devices() == {devices[1]} and b["k"].array.devices() == set(devices[2:4])
    np.testing.assert_allclose(np.asarray(b["k"]), _rows().sum(0), rtol=RTOL)
    c = ops.broadcast(jnp.arange(3.0), destinations=devices[4:])
    assert isinstance(c, jd.Mirrored) and c.array.devices() == set(devices[4:])
    np.testing.assert_array_equal(np.asarray(c), np.arange(3.0))


def test_reduction_to_one_device_reduces_there_with_its_accumulation_fn() -> None:
    calls: list[int] = []

    def accumulate(rows: list[jax.Array]) -> jax.Array:
        calls.append(len(rows))
        return jnp.sum(jnp.stack(rows), axis=0)

    devices = jax.devices()
    ops = jd.ReductionToOneDevice(reduce_to_device=devices[6], accumulation_fn=accumulate)
    x = _placed()
    out = ops.reduce("sum", x, destinations=devices[6])
    assert out.devices() == {devices[6]} and calls == [8]
    np.testing.assert_allclose(np.asarray(out), _rows().sum(0), rtol=RTOL)
    s = jd.MirroredStrategy(cross_device_ops=ops)
    total = s.extended.reduce_to("sum", x, destinations=x)
    assert isinstance(total, jd.Mirrored) and total.array.devices() == set(devices)
    np.testing.assert_allclose(np.asarray(total), _rows().sum(0), rtol=RTOL)
    with pytest.raises(TypeError, match=r"accumulation_fn=.*function of a list of arrays"):
        jd.ReductionToOneDevice(accumulation_fn=3)  # type: ignore[arg-type]


def test_cross_device_ops_errors() -> None:
    x = jd.PerReplica(jnp.asarray(_rows()))
    with pytest.raises(ValueError, match=r"NcclAllReduce\.reduce: unknown reduce op"):
        jd.NcclAllReduce().reduce("median", x, destinations=x)
    with pytest.raises(TypeError, match=r"NcclAllReduce\.batch_reduce"):
        jd.NcclAllReduce().batch_reduce("sum", x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"num_packs"):
        jd.HierarchicalCopyAllReduce(num_packs=-1)


# -- StrategyExtended: TF's idioms ------------------------------------------------------


def test_update_calls_fn_with_an_assignable_view() -> None:
    s = jd.MirroredStrategy()
    with s.scope():
        v = jd.Variable(jnp.arange(3.0))
    v = s.extended.update(v, lambda var, x: var.assign(x), args=(jnp.ones(3),))
    np.testing.assert_array_equal(np.asarray(v), np.ones(3))
    v = s.extended.update(
        v, lambda var, d: var.assign_add(d), args=(jd.Mirrored(jnp.full(3, 2.0)),)
    )
    v = s.extended.update(v, lambda var: var.assign_sub(0.5))
    np.testing.assert_array_equal(np.asarray(v), np.full(3, 2.5))
    v = s.extended.update(v, lambda var, x: var * x, args=(2.0,))  # a plain-array function
    np.testing.assert_array_equal(np.asarray(v), np.full(3, 5.0))
    with pytest.raises(ValueError, match=r"mirrored .*PerReplica arguments; reduce them first"):
        s.extended.update(v, lambda var, x: var.assign(x), args=(jd.PerReplica(jnp.ones((8, 3))),))
    with pytest.raises(ValueError, match=r"fn returned shape \(2,\).*shape is \(3,\)"):
        s.extended.update(v, lambda var: jnp.ones(2))


def test_update_of_an_on_read_variable_sees_each_replicas_row() -> None:
    s = jd.MirroredStrategy()
    with s.scope():
        v = jd.Variable(
            0.0,
            synchronization=jd.VariableSynchronization.ON_READ,
            aggregation=jd.VariableAggregation.SUM,
        )
    per = jd.PerReplica(jnp.arange(8.0))
    v = s.extended.update(v, lambda var, x: var.assign_add(x), args=(per,))
    assert float(v) == pytest.approx(np.arange(8.0).sum())


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        (jd.VariableAggregation.SUM, lambda r: r.sum(0)),
        (jd.VariableAggregation.MEAN, lambda r: r.mean(0)),
        (jd.VariableAggregation.ONLY_FIRST_REPLICA, lambda r: r[0]),
        ("only_first_replica", lambda r: r[0]),
        (jd.ReduceOp.MAX, lambda r: r.max(0)),
    ],
)
def test_reduce_to_accepts_variable_aggregations(op: Any, expected: Any) -> None:
    s = jd.MirroredStrategy()
    x = _placed()
    out = s.extended.reduce_to(op, x, destinations=x)
    assert isinstance(out, jd.Mirrored) and out.array.devices() == set(jax.devices())
    np.testing.assert_allclose(np.asarray(out), expected(_rows()), rtol=RTOL)
    (batched,) = s.extended.batch_reduce_to(op, [(x, "/cpu:3")])
    assert batched.devices() == {jax.devices()[3]}
    np.testing.assert_allclose(np.asarray(batched), expected(_rows()), rtol=RTOL)


def test_reduce_to_takes_options_and_the_deprecated_hints() -> None:
    s = jd.MirroredStrategy()
    x = _placed()
    opts = jd.experimental.CommunicationOptions(bytes_per_pack=128)
    out = s.extended.reduce_to("sum", x, x, options=opts)
    np.testing.assert_allclose(np.asarray(out), _rows().sum(0), rtol=RTOL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        hints = jd.experimental.CollectiveHints(bytes_per_pack=128)
    out = s.extended.reduce_to("sum", x, x, experimental_hints=hints)
    np.testing.assert_allclose(np.asarray(out), _rows().sum(0), rtol=RTOL)
    with pytest.raises(ValueError, match=r"reduce_to: reduce_op VariableAggregation.NONE"):
        s.extended.reduce_to(jd.VariableAggregation.NONE, x, x)
    with pytest.raises(TypeError, match=r"options"):
        s.extended.reduce_to("sum", x, x, options={"bytes_per_pack": 1})


def test_broadcast_to_places_a_copy_on_every_destination() -> None:
    s = jd.MirroredStrategy()
    devices = jax.devices()
    m = s.extended.broadcast_to(jnp.arange(4.0), destinations=None)
    assert isinstance(m, jd.Mirrored) and m.array.devices() == set(devices)
    two = s.extended.broadcast_to({"a": jnp.ones(2)}, destinations=devices[2:4])
    assert two["a"].array.devices() == set(devices[2:4])
    one = s.extended.broadcast_to(jnp.ones(2), destinations="/cpu:7")
    assert one.devices() == {devices[7]}
    like = s.extended.broadcast_to(jnp.ones(2), destinations=_placed())
    assert like.array.devices() == set(devices)


def test_cross_replica_assign_of_distributed_values() -> None:
    s = jd.MirroredStrategy()
    with s.scope():
        w = jd.Variable(jnp.zeros(2))
        total = jd.Variable(
            0.0,
            synchronization=jd.VariableSynchronization.ON_READ,
            aggregation=jd.VariableAggregation.SUM,
        )
    w = w.assign(jd.Mirrored(jnp.ones(2)))
    w = w.assign_add(jd.Mirrored(jnp.full(2, 2.0)))
    np.testing.assert_array_equal(np.asarray(w), np.full(2, 3.0))
    total = total.assign(jd.PerReplica(jnp.arange(8.0)))  # one value per replica
    assert float(total) == pytest.approx(28.0)
    total = total.assign_add(jd.PerReplica(jnp.ones(8)))
    assert float(total) == pytest.approx(36.0)


def test_experimental_require_static_shapes_and_names() -> None:
    assert jd.MirroredStrategy().extended.experimental_require_static_shapes is False
    assert jd.experimental.CentralStorageStrategy is jd.CentralStorageStrategy
    assert jd.experimental.MultiWorkerMirroredStrategy is jd.MultiWorkerMirroredStrategy


@pytest.mark.parametrize(
    "ops",
    [
        jd.NcclAllReduce(),
        jd.NcclAllReduce(num_packs=0),
        jd.NcclAllReduce(num_packs=2),
        jd.HierarchicalCopyAllReduce(),
        jd.ReductionToOneDevice(),
    ],
)
def test_cross_device_ops_agree(ops: jd.CrossDeviceOps) -> None:
    s = jd.MirroredStrategy(cross_device_ops=ops)
    rng = np.random.default_rng(2)
    tree = [
        rng.normal(size=(8, 5)).astype(np.float32),
        rng.normal(size=(8, 2, 3)).astype(np.float32),
        np.arange(8, dtype=np.int32),
    ]
    out = s.run(lambda ctx, t: ctx.all_reduce("sum", t), args=(jax.tree.map(jd.PerReplica, tree),))
    for got, x in zip(out, tree, strict=True):
        assert isinstance(got, jd.Mirrored)
        np.testing.assert_allclose(got.array, x.sum(axis=0), rtol=1e-5)
    assert out[2].dtype == jnp.int32


def test_cross_device_ops_validation() -> None:
    with pytest.raises(ValueError, match=r"NcclAllReduce\(num_packs=-1\)"):
        jd.NcclAllReduce(num_packs=-1)
    with pytest.raises(TypeError, match=r"expected a jaxdist.CrossDeviceOps"):
        jd.MirroredStrategy(cross_device_ops="nccl")

"""Strategies are immutable, hashable pytrees without leaves; devices resolve TF-style; TF's
older method names still work."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd


def test_strategies_are_values() -> None:
    a, b = jd.MirroredStrategy(), jd.MirroredStrategy()
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert a != jd.MirroredStrategy(jax.devices()[:2])
    assert a != jd.MirroredStrategy(cross_device_ops=jd.ReductionToOneDevice())
    assert jd.OneDeviceStrategy() != jd.MirroredStrategy(jax.devices()[:1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        a._devices = ()  # type: ignore[misc]
    assert jax.tree.leaves(a) == []
    assert jax.tree.leaves({"s": a, "x": 1.0}) == [1.0]


def test_strategy_passes_through_jit() -> None:
    s = jd.MirroredStrategy()
    traces = []

    @jax.jit
    def f(strategy, x):
        traces.append(1)
        return x * strategy.num_replicas_in_sync

    assert float(f(s, 1.0)) == 8.0 and float(f(jd.MirroredStrategy(), 2.0)) == 16.0
    assert len(traces) == 1
    g = jax.jit(lambda st, x: x + st.num_replicas_in_sync, static_argnums=0)
    assert float(g(s, 1.0)) == 9.0


def test_mesh_axis_and_counts() -> None:
    s = jd.MirroredStrategy()
    assert s.num_replicas_in_sync == 8 and s.axis_name == "replica"
    assert s.mesh.shape == {"replica": 8}
    assert s.extended.worker_devices == tuple(jax.devices())
    assert s.cluster_resolver is None
    one = jd.OneDeviceStrategy("/cpu:3")
    assert one.device == jax.devices()[3] and one.num_replicas_in_sync == 1


@pytest.mark.parametrize("spec", ["/gpu:0", "/device:CPU:0", "/job:worker/task:0/device:CPU:1", 5])
def test_device_specs(spec) -> None:
    s = jd.MirroredStrategy(["/cpu:0", "CPU:1", jax.devices()[2]])
    assert s.extended.worker_devices == tuple(jax.devices()[:3])
    if spec == "/gpu:0":
        with pytest.raises(
            ValueError, match=r"no device matches '/gpu:0'. Available devices: cpu:0"
        ):
            jd.OneDeviceStrategy(spec)
    else:
        assert jd.OneDeviceStrategy(spec).device in jax.devices()


def test_device_errors() -> None:
    with pytest.raises(
        ValueError, match=r"MirroredStrategy\(devices=...\): devices must be unique"
    ):
        jd.MirroredStrategy(["/cpu:0", "/cpu:0"])
    with pytest.raises(ValueError, match=r"the list of devices is empty"):
        jd.MirroredStrategy([])
    with pytest.raises(ValueError, match=r"device index 99 is out of range"):
        jd.OneDeviceStrategy(99)
    with pytest.raises(TypeError, match=r"a device must be a jax.Device"):
        jd.OneDeviceStrategy(1.5)


def test_one_device_strategy_runs_on_its_device() -> None:
    s = jd.OneDeviceStrategy(jax.devices()[2])
    out = s.run(lambda ctx, x: (x + 1, ctx.all_reduce("sum", x)), args=(jnp.ones(3),))
    # One replica: plain values (tf.distribute's regroup of a single value).
    assert isinstance(out[0], jax.Array) and out[0].devices() == {jax.devices()[2]}
    assert out[0].shape == (3,)
    assert float(out[1][0]) == 1.0
    assert s.experimental_local_results(out[0])[0] is out[0]


def test_tf_names(mirrored8: jd.MirroredStrategy) -> None:
    x = np.arange(32, dtype=np.float32)
    with pytest.warns(DeprecationWarning, match=r"call distribute_datasets_from_function"):
        ds = mirrored8.experimental_distribute_datasets_from_function(
            lambda ictx: jd.data.from_arrays(x, batch_size=ictx.get_per_replica_batch_size(16))
        )
    assert sum(float(mirrored8.reduce("sum", b, axis=0)) for b in ds) == x.sum()
    rows = mirrored8.experimental_make_numpy_dataset((x, x * 2)).batch(16)
    it = iter(mirrored8.experimental_distribute_dataset(rows))
    out = mirrored8.experimental_run(lambda ctx, b: ctx.all_reduce("sum", jnp.sum(b[1])), it)
    assert float(out) == 2 * x[:16].sum()

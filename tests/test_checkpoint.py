"""Checkpoint semantics of variables across strategies and replica counts (exact values)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd


def _state(strategy: jd.Strategy) -> dict:
    with strategy.scope():
        return {
            "w": jd.Variable(jnp.zeros(3), aggregation="mean"),
            "total": jd.Variable(0.0, synchronization="on_read", aggregation="sum"),
            "avg": jd.Variable(0.0, synchronization="on_read", aggregation="mean"),
            "step": jnp.int32(0),
        }


def _train(strategy: jd.Strategy, state: dict) -> dict:
    def step(ctx, s):
        r = ctx.replica_id_in_sync_group.astype(jnp.float32)
        return {
            "w": ctx.assign_add(s["w"], jnp.arange(3.0) + r),
            "total": ctx.assign_add(s["total"], r + 1.0),
            "avg": ctx.assign(s["avg"], 2.0),
            "step": s["step"] + 1,
        }

    out = strategy.run(step, args=(state,))
    out["step"] = strategy.experimental_local_results(out["step"])[0]
    return out


def test_save_aggregates_and_restore_divides_across_replica_counts() -> None:
    s8 = jd.MirroredStrategy()
    state = _train(s8, _state(s8))
    saved = jd.checkpoint.to_saveable(state)
    np.testing.assert_array_equal(saved["w"], np.arange(3.0) + 3.5)
    assert saved["total"] == 36.0  # the sum of 1..8, not one copy
    assert saved["avg"] == 2.0 and saved["step"] == 1

    for devices in (jax.devices()[:4], jax.devices()[:1]):
        s = jd.MirroredStrategy(devices)
        n = s.num_replicas_in_sync
        restored = jd.checkpoint.from_saveable(saved, _state(s))
        assert float(restored["total"].read_value()) == 36.0
        assert [float(c) for c in s.experimental_local_results(restored["total"])] == [36.0 / n] * n
        assert [float(c) for c in s.experimental_local_results(restored["avg"])] == [2.0] * n
        np.testing.assert_array_equal(restored["w"].read_value(), saved["w"])
        assert restored["w"].device_values.sharding.device_set == set(devices)
        # the restored state trains on under the new strategy
        again = _train(s, restored)
        assert float(again["total"].read_value()) == 36.0 + n * (n + 1) / 2


def test_restore_into_central_storage_and_one_device() -> None:
    s8 = jd.MirroredStrategy()
    saved = jd.checkpoint.to_saveable(_train(s8, _state(s8)))
    for s in (jd.CentralStorageStrategy(), jd.OneDeviceStrategy()):
        restored = jd.checkpoint.from_saveable(saved, _state(s))
        assert float(restored["total"].read_value()) == 36.0
        np.testing.assert_array_equal(restored["w"].read_value(), saved["w"])


def test_template_structure_mismatch() -> None:
    with pytest.raises(
        ValueError,
        match=r"from_saveable: the saved state has 1 leaves but the "
        r"template has 2",
    ):
        jd.checkpoint.from_saveable({"a": np.zeros(1)}, {"a": jnp.zeros(1), "b": jnp.zeros(1)})


def test_orbax_round_trip(tmp_path) -> None:
    pytest.importorskip("orbax.checkpoint")
    s8 = jd.MirroredStrategy()
    state = _train(s8, _state(s8))
    jd.checkpoint.save(tmp_path / "ckpt", state)
    s2 = jd.MirroredStrategy(jax.devices()[:2])
    restored = jd.checkpoint.restore(tmp_path / "ckpt", _state(s2))
    assert float(restored["total"].read_value()) == 36.0
    assert [float(c) for c in s2.experimental_local_results(restored["total"])] == [18.0, 18.0]
    np.testing.assert_array_equal(restored["w"].read_value(), np.arange(3.0) + 3.5)
    assert int(restored["step"]) == 1

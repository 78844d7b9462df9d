"""Checkpoint semantics of variables across strategies and replica counts (exact values);
restores refuse a wrong shape, dtype, replica count or string, naming the leaf."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd

from _helpers import ORBAX_CLOSED_LOOP, flip_middle_byte


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
        match=r"from_saveable: the checkpoint does not match the template: the template has "
        r"\['b'\], which the checkpoint lacks. Leaves are matched by path",
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


# Matching by path ---------------------------------------------------------------------


class _Params(NamedTuple):  # fields in declaration order: w, b (a dict sorts them b, w)
    w: Any
    b: Any


def test_leaves_are_matched_by_path_not_position() -> None:
    template = _Params(w=jd.Variable(jnp.zeros(2)), b=jd.Variable(jnp.zeros(2)))
    saved = {"b": np.array([1.0, 1.0]), "w": np.array([2.0, 2.0])}  # as orbax gives it back
    restored = jd.checkpoint.from_saveable(saved, template)
    assert isinstance(restored, _Params)
    np.testing.assert_array_equal(restored.w.read_value(), [2.0, 2.0])
    np.testing.assert_array_equal(restored.b.read_value(), [1.0, 1.0])
    # a tuple saved, a list read back: positions are names too
    back = jd.checkpoint.from_saveable([np.float32(1.0), np.float32(2.0)], (jnp.zeros(()),) * 2)
    assert [float(x) for x in back] == [1.0, 2.0]


def test_renamed_missing_and_extra_keys_name_the_paths() -> None:
    template = {"dense": {"kernel": jnp.zeros(2), "bias": jnp.zeros(2)}, "step": jnp.int32(0)}
    renamed = {"dense": {"w": np.zeros(2), "bias": np.zeros(2)}, "step": np.int32(0)}
    with pytest.raises(
        ValueError,
        match=r"from_saveable: the checkpoint does not match the template: the template has "
        r"\['dense'\]\['kernel'\], which the checkpoint lacks; the checkpoint has "
        r"\['dense'\]\['w'\], which the template lacks. Leaves are matched by path .* rename "
        r"the saved entries first",
    ):
        jd.checkpoint.from_saveable(renamed, template)
    extra = {**to_host(template), "opt": [np.zeros(1)] * 7}
    with pytest.raises(
        ValueError,
        match=r"the checkpoint has \['opt'\]\[0\], \['opt'\]\[1\], \['opt'\]\[2\], "
        r"\['opt'\]\[3\], \['opt'\]\[4\] and 2 more, which the template lacks",
    ):
        jd.checkpoint.from_saveable(extra, template)


def to_host(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


# Shapes, dtypes and replica counts ----------------------------------------------------


def test_shapes_must_match_exactly(mirrored8: jd.MirroredStrategy) -> None:
    with mirrored8.scope():
        m = jd.Variable(jnp.zeros(3), synchronization="on_read", aggregation="sum", name="m")
    with pytest.raises(
        ValueError,
        match=r"from_saveable: \['m'\] has shape \(8, 3\) in the checkpoint, but variable 'm' "
        r"has shape \(3,\). It looks like 8 per-replica copies: save the variable itself",
    ):
        jd.checkpoint.from_saveable({"m": np.zeros((8, 3), np.float32)}, {"m": m})
    with pytest.raises(  # no broadcasting of a scalar into a vector
        ValueError, match=r"\['m'\] has shape \(\) in the checkpoint, but variable 'm' has shape"
    ):
        jd.checkpoint.from_saveable({"m": np.float32(1.0)}, {"m": m})
    with pytest.raises(ValueError, match=r"<root> has shape \(2,\) in the checkpoint, but the"):
        jd.checkpoint.from_saveable(np.zeros(2), jnp.zeros(3))


@pytest.mark.parametrize(
    ("saved", "target", "ok"),
    [
        (np.arange(3, dtype=np.int32), np.int64, True),  # widening
        (np.arange(3, dtype=np.int64), np.int32, True),  # values fit
        (np.array([2**40]), np.int32, False),
        (np.array([-1], np.int32), np.uint8, False),
        (np.array([200], np.int32), np.uint8, True),
        (np.arange(3, dtype=np.float32), np.float64, True),
        (np.arange(3, dtype=np.float64), np.float32, True),  # JAX's default with x64 off
        (np.arange(3, dtype=np.float32), jnp.bfloat16, False),
        (np.arange(3, dtype=jnp.bfloat16), np.float32, True),
        (np.arange(3, dtype=np.float16), jnp.bfloat16, False),
        (np.arange(3, dtype=np.float32), np.int32, False),
        (np.array([True, False]), np.float32, True),
        (np.array([1, 0], np.int32), np.bool_, False),
        (np.array([2**24], np.int32), np.float32, True),
        (np.array([2**24 + 1], np.int32), np.float32, False),
        (np.ones(2, np.complex64), np.float32, False),
        (np.ones(2, np.float32), np.complex64, True),
        (np.ones(2, np.complex128), np.complex64, True),
    ],
)
def test_dtype_conversions(saved: np.ndarray, target: Any, ok: bool) -> None:
    template = {"x": np.zeros(saved.shape, target)}
    if ok:
        out = jd.checkpoint.from_saveable({"x": saved}, template)["x"]
        assert out.dtype == np.dtype(target)
        np.testing.assert_array_equal(out.astype(np.complex128), saved.astype(np.complex128))
        return
    with pytest.raises(
        ValueError,
        match=rf"from_saveable: \['x'\] is {saved.dtype} in the checkpoint, but the template's "
        rf"array is {np.dtype(target)}: .*Convert the checkpoint's value yourself",
    ):
        jd.checkpoint.from_saveable({"x": saved}, template)


def test_float_checkpoint_into_an_integer_variable(mirrored8: jd.MirroredStrategy) -> None:
    with mirrored8.scope():
        count = jd.Variable(0, synchronization="on_read", aggregation="sum", name="count")
    with pytest.raises(
        ValueError,
        match=r"\['count'\] is float32 in the checkpoint, but variable 'count' is int32: a "
        r"cast from floating point to an integer drops the fraction",
    ):
        jd.checkpoint.from_saveable({"count": np.float32(3.0)}, {"count": count})
    restored = jd.checkpoint.from_saveable({"count": np.int64(10)}, {"count": count})
    assert int(restored["count"].read_value()) == 10


def test_per_replica_leaves_need_the_same_replica_count() -> None:
    s8, s4 = jd.MirroredStrategy(), jd.MirroredStrategy(jax.devices()[:4])
    rows = s8.experimental_distribute_values_from_function(
        lambda ctx: jnp.full(3, float(ctx.replica_id_in_sync_group))
    )
    saved = jd.checkpoint.to_saveable({"x": rows})
    assert saved["x"].shape == (8, 3)
    template4 = {"x": jd.PerReplica(jax.device_put(np.zeros((4, 3), np.float32)))}
    with pytest.raises(
        ValueError,
        match=r"from_saveable: \['x'\] holds 8 per-replica values \(shape \(8, 3\)\) in the "
        r"checkpoint, but the template's PerReplica has 4 replicas \(shape \(4, 3\)\). "
        r"Per-replica values carry no rule",
    ):
        jd.checkpoint.from_saveable(saved, template4)
    del s4
    back = jd.checkpoint.from_saveable(saved, {"x": rows})["x"]
    assert isinstance(back, jd.PerReplica) and back.array.sharding == rows.array.sharding
    np.testing.assert_array_equal(back.array, np.repeat(np.arange(8.0)[:, None], 3, axis=1))


@pytest.mark.parametrize("n", [1, 3, 8])
def test_variables_restore_under_any_replica_count(n: int) -> None:
    s8 = jd.MirroredStrategy()
    with s8.scope():
        state = {
            "total": jd.Variable(0, synchronization="on_read", aggregation="sum"),
            "mean": jd.Variable(0.0, synchronization="on_read", aggregation="mean"),
            "first": jd.Variable(0.0, synchronization="on_read", aggregation="only_first_replica"),
            "w": jd.Variable(jnp.zeros(2), aggregation="mean"),
        }
    state = {
        "total": state["total"].assign(jd.PerReplica(np.arange(8, dtype=np.int32) * 3 + 1)),
        "mean": state["mean"].assign(jd.PerReplica(np.arange(8, dtype=np.float32))),
        "first": state["first"].assign(jd.PerReplica(np.arange(8, dtype=np.float32) + 5)),
        "w": state["w"].assign(jnp.array([1.5, -2.0])),
    }
    saved = jd.checkpoint.to_saveable(state)
    assert (int(saved["total"]), float(saved["mean"]), float(saved["first"])) == (92, 3.5, 5.0)
    s = jd.MirroredStrategy(jax.devices()[:n])
    with s.scope():
        template = jax.tree.map(
            lambda v: jd.Variable(
                jnp.zeros(v.shape, v.dtype),
                synchronization=v.synchronization,
                aggregation=v.aggregation,
            ),
            state,
            is_leaf=lambda x: isinstance(x, jd.Variable),
        )
    out = jd.checkpoint.from_saveable(saved, template)
    copies = np.asarray(out["total"].device_values)
    assert copies.sum() == 92 and copies.max() - copies.min() <= 1  # split exactly
    assert int(out["total"].read_value()) == 92
    assert np.asarray(out["mean"].device_values).tolist() == [3.5] * n
    assert float(out["first"].read_value()) == 5.0
    np.testing.assert_array_equal(out["w"].read_value(), [1.5, -2.0])


def test_python_and_numpy_leaves_keep_their_types() -> None:
    out = jd.checkpoint.from_saveable(
        {"step": np.int32(7), "lr": np.float32(0.5), "on": np.bool_(True), "g": np.int16(3)},
        {"step": 0, "lr": 0.1, "on": False, "g": np.int16(0)},
    )
    assert out == {"step": 7, "lr": 0.5, "on": True, "g": 3}
    assert type(out["step"]) is int and type(out["lr"]) is float and type(out["on"]) is bool
    assert type(out["g"]) is np.int16
    with pytest.raises(ValueError, match=r"\['step'\] is float32 in the checkpoint, but the "):
        jd.checkpoint.from_saveable({"step": np.float32(7.5)}, {"step": 0})


# Files: path checks, exact integers and checksums ---------------------------------------


def _int_state(strategy: jd.Strategy) -> dict:
    rng = np.random.default_rng(0)
    with strategy.scope():
        return {
            "w": jd.Variable(rng.normal(size=(64, 64)).astype(np.float32), aggregation="mean"),
            "count": jd.Variable(0, synchronization="on_read", aggregation="sum"),
            "debt": jd.Variable(0, synchronization="on_read", aggregation="sum"),
            "step": jnp.int32(3),
        }


def test_orbax_round_trip_is_exact_for_integer_sums(tmp_path) -> None:
    pytest.importorskip("orbax.checkpoint")
    s8 = jd.MirroredStrategy()
    state = _int_state(s8)
    state["count"] = state["count"].assign(100)
    state["debt"] = state["debt"].assign(-100)
    jd.checkpoint.save(tmp_path / "ckpt", state)
    for n in (8, 3):
        s = jd.MirroredStrategy(jax.devices()[:n])
        out = jd.checkpoint.restore(tmp_path / "ckpt", _int_state(s))
        assert int(out["count"].read_value()) == 100 and int(out["debt"].read_value()) == -100
        assert np.asarray(out["count"].device_values).sum() == 100
        np.testing.assert_array_equal(out["w"].read_value(), state["w"].read_value())
    out = jd.checkpoint.restore(tmp_path / "ckpt", _int_state(s8))
    assert np.asarray(out["count"].device_values).tolist() == [13] * 4 + [12] * 4


def test_restore_checks_paths_and_shapes(tmp_path) -> None:
    pytest.importorskip("orbax.checkpoint")
    jd.checkpoint.save(tmp_path / "ckpt", {"a": jnp.zeros(2), "b": (jnp.ones(3), jnp.int32(1))})
    out = jd.checkpoint.restore(tmp_path / "ckpt", {"a": jnp.ones(2), "b": (jnp.zeros(3), 0)})
    assert isinstance(out["b"], tuple) and out["b"][1] == 1  # a tuple saved, read as a list
    with pytest.raises(
        ValueError,
        match=r"jaxdist.checkpoint.restore: the checkpoint does not match the template: the "
        r"template has \['c'\], which the checkpoint lacks; the checkpoint has \['a'\]",
    ):
        jd.checkpoint.restore(tmp_path / "ckpt", {"c": jnp.ones(2), "b": (jnp.zeros(3), 0)})
    with pytest.raises(
        ValueError, match=r"restore: \['b'\]\[0\] has shape \(3,\) in the checkpoint, but the"
    ):
        jd.checkpoint.restore(tmp_path / "ckpt", {"a": jnp.ones(2), "b": (jnp.zeros(4), 0)})
    with pytest.raises(FileNotFoundError, match=r"restore: no checkpoint directory .*nowhere"):
        jd.checkpoint.restore(tmp_path / "nowhere", {})


def _manifest(path: Path) -> dict:
    return json.loads((path / jd.checkpoint.MANIFEST).read_text())


def test_save_writes_a_checksum_manifest(tmp_path) -> None:
    pytest.importorskip("orbax.checkpoint")
    state = _int_state(jd.MirroredStrategy())
    jd.checkpoint.save(tmp_path / "ckpt", state)
    leaves = {tuple(e["path"]): e for e in _manifest(tmp_path / "ckpt")["leaves"]}
    assert set(leaves) == {("w",), ("count",), ("debt",), ("step",)}
    w = np.asarray(state["w"].read_value())
    assert leaves[("w",)] == {
        "path": ["w"],
        "dtype": "float32",
        "shape": [64, 64],
        "sha256": hashlib.sha256(w.tobytes()).hexdigest(),
    }


@ORBAX_CLOSED_LOOP
def test_a_flipped_byte_in_the_data_does_not_restore(tmp_path) -> None:
    pytest.importorskip("orbax.checkpoint")
    s8 = jd.MirroredStrategy()
    jd.checkpoint.save(tmp_path / "ckpt", _int_state(s8))
    flip_middle_byte(tmp_path / "ckpt", 0x40)  # in w's 16 KiB of random floats
    with pytest.raises(
        ValueError,
        match=r"jaxdist.checkpoint.restore: leaf \['w'\] of the checkpoint in .*ckpt does not "
        r"match its manifest: sha256 is [0-9a-f]{64} but [0-9a-f]{64} was saved. Restore an "
        r"earlier checkpoint",
    ):
        jd.checkpoint.restore(tmp_path / "ckpt", _int_state(s8))


@ORBAX_CLOSED_LOOP
def test_a_damaged_or_missing_manifest_does_not_restore(tmp_path) -> None:
    pytest.importorskip("orbax.checkpoint")
    s8 = jd.MirroredStrategy()
    state = _int_state(s8)
    state["count"] = state["count"].assign(5)
    ckpt = tmp_path / "ckpt"
    jd.checkpoint.save(ckpt, state)
    file = ckpt / jd.checkpoint.MANIFEST
    good = file.read_text()
    manifest = json.loads(good)
    for e in manifest["leaves"]:
        if e["path"] == ["count"]:
            e["sha256"] = "0" * 64
    file.write_text(json.dumps(manifest))
    with pytest.raises(
        ValueError,
        match=r"restore: leaf \['count'\] of the checkpoint in .*ckpt does not match its "
        r"manifest: sha256 is [0-9a-f]{64} but 0{64} was saved",
    ):
        jd.checkpoint.restore(ckpt, _int_state(s8))
    manifest["leaves"] = manifest["leaves"][1:]
    file.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"does not hold the leaves its manifest lists: unlisted"):
        jd.checkpoint.restore(ckpt, _int_state(s8))
    file.write_text(good[: len(good) // 2])
    with pytest.raises(
        ValueError,
        match=r"restore: the checksum manifest .*jaxdist_manifest.json is damaged "
        r"\(JSONDecodeError: .*\), so the checkpoint in .*ckpt cannot be verified. Restore an "
        r"earlier checkpoint, or pass verify=False",
    ):
        jd.checkpoint.restore(ckpt, _int_state(s8))
    file.unlink()
    with pytest.raises(
        ValueError,
        match=r"restore: .*ckpt has no checksum manifest jaxdist_manifest.json: the save did "
        r"not finish, or the checkpoint was not written by jaxdist.checkpoint.save",
    ):
        jd.checkpoint.restore(ckpt, _int_state(s8))
    out = jd.checkpoint.restore(ckpt, _int_state(s8), verify=False)
    assert int(out["count"].read_value()) == 5


def test_damage_orbax_cannot_parse_names_the_directory(tmp_path) -> None:
    pytest.importorskip("orbax.checkpoint")
    ckpt = tmp_path / "ckpt"
    jd.checkpoint.save(ckpt, {"a": jnp.zeros(2)})
    (ckpt / "_METADATA").write_text("{not json")
    with pytest.raises(
        ValueError,
        match=r"restore: orbax could not read the checkpoint in .*ckpt \(.*\). It is "
        r"incomplete or damaged",
    ):
        jd.checkpoint.restore(ckpt, {"a": jnp.zeros(2)})


def _leaf(kind: str, strategy: jd.Strategy, dtype: Any) -> Any:
    """A template leaf of shape (3,) (a Python number: shape ()) of ``kind``."""
    zeros = np.zeros(3, dtype)
    with strategy.scope():
        if kind == "variable":
            return jd.Variable(zeros, aggregation="mean", name="t")
        if kind == "on_read_sum":
            return jd.Variable(zeros, synchronization="on_read", aggregation="sum", name="t")
    if kind == "per_replica":
        return strategy.experimental_distribute_values_from_function(lambda ctx: zeros[:1])
    if kind == "mirrored":
        return jd.Mirrored(jnp.asarray(zeros))
    if kind == "jax_array":
        return jnp.asarray(zeros)
    if kind == "numpy":
        return zeros
    return 0 if np.dtype(dtype).kind == "i" else 0.0


LEAF_KINDS = ["variable", "on_read_sum", "per_replica", "mirrored", "jax_array", "numpy", "python"]


@pytest.mark.parametrize("kind", LEAF_KINDS)
def test_from_saveable_checks_every_kind_of_leaf(kind: str) -> None:
    s = jd.MirroredStrategy()
    n = s.num_replicas_in_sync
    template = {"opt": [{"t": _leaf(kind, s, np.int32)}]}
    shape = {"per_replica": (n, 1), "python": ()}.get(kind, (3,))
    wrong = (n, 2) if kind == "per_replica" else (4, 3)
    with pytest.raises(
        ValueError,
        match=rf"from_saveable: \['opt'\]\[0\]\['t'\] has shape {re_shape(wrong)} in the "
        rf"checkpoint, but .* has shape {re_shape(shape)}\..* Restore into a template",
    ):
        jd.checkpoint.from_saveable({"opt": [{"t": np.zeros(wrong, np.int32)}]}, template)
    with pytest.raises(
        ValueError,
        match=r"from_saveable: \['opt'\]\[0\]\['t'\] is float64 in the checkpoint, but .* is "
        r"int(32|64): a cast from floating point to an integer drops the fraction. Convert",
    ):
        jd.checkpoint.from_saveable({"opt": [{"t": np.full(shape, 2.5)}]}, template)
    back = jd.checkpoint.from_saveable({"opt": [{"t": np.full(shape, 7, np.int64)}]}, template)
    leaf = back["opt"][0]["t"]
    value = leaf.read_value() if isinstance(leaf, jd.Variable) else leaf
    value = value.array if isinstance(value, jd.DistributedValues) else value
    np.testing.assert_array_equal(np.asarray(value), np.full(shape, 7))


def re_shape(shape: tuple[int, ...]) -> str:
    """A shape as the regular expression of its repr."""
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


def test_restore_from_files_refuses_wrong_dtypes_and_replica_counts(tmp_path: Any) -> None:
    pytest.importorskip("orbax.checkpoint")
    s8, s4 = jd.MirroredStrategy(), jd.MirroredStrategy(jax.devices()[:4])
    rows = s8.experimental_distribute_values_from_function(
        lambda ctx: np.full(3, ctx.replica_id_in_sync_group, np.float32)
    )
    with s8.scope():
        copies = jd.Variable(np.zeros(3, np.float32), synchronization="on_read", aggregation="sum")
    state = {"rows": rows, "count": np.float64(2.5), "copies": copies.device_values}
    jd.checkpoint.save(tmp_path / "ckpt", state)

    def template(strategy: jd.Strategy, **changes: Any) -> dict:
        with strategy.scope():
            t = {
                "rows": rows,
                "count": jd.Variable(0.0, name="count"),
                "copies": jnp.zeros((8, 3)),
            }
        return {**t, **changes}

    with s4.scope():
        count = jd.Variable(0, name="count")
        on_read = jd.Variable(np.zeros(3, np.float32), synchronization="on_read", name="c")
    with pytest.raises(
        ValueError,
        match=r"restore: \['count'\] is float64 in the checkpoint, but variable 'count' is "
        r"int32: a cast from floating point to an integer drops the fraction",
    ):
        jd.checkpoint.restore(tmp_path / "ckpt", template(s8, count=count))
    four = s4.experimental_distribute_values_from_function(lambda ctx: np.zeros(3, np.float32))
    with pytest.raises(
        ValueError,
        match=r"restore: \['rows'\] holds 8 per-replica values \(shape \(8, 3\)\) in the "
        r"checkpoint, but the template's PerReplica has 4 replicas \(shape \(4, 3\)\)",
    ):
        jd.checkpoint.restore(tmp_path / "ckpt", template(s8, rows=four))
    with pytest.raises(
        ValueError,
        match=r"restore: \['copies'\] has shape \(8, 3\) in the checkpoint, but variable 'c' "
        r"has shape \(3,\). It looks like 8 per-replica copies: save the variable itself",
    ):
        jd.checkpoint.restore(tmp_path / "ckpt", template(s8, copies=on_read))
    out = jd.checkpoint.restore(tmp_path / "ckpt", template(s8))
    assert float(out["count"].read_value()) == 2.5
    np.testing.assert_array_equal(out["rows"].array, np.repeat(np.arange(8.0)[:, None], 3, 1))


def test_string_leaves_restore_only_into_strings() -> None:
    saved = jd.checkpoint.to_saveable({"act": "relu", "step": 3})
    back = jd.checkpoint.from_saveable(saved, {"act": "tanh", "step": 0})
    assert back == {"act": "relu", "step": 3} and type(back["act"]) is str
    with pytest.raises(
        ValueError,
        match=r"from_saveable: \['act'\] is an array of dtype float32 and shape \(2,\) in the "
        r"checkpoint, but the template has the string 'tanh' there",
    ):
        jd.checkpoint.from_saveable({"act": np.zeros(2, np.float32)}, {"act": "tanh"})
    with pytest.raises(
        ValueError,
        match=r"from_saveable: \['w'\] is an array of dtype <U4 in the checkpoint, but the "
        r"template's array is float32: <U4 is not a numeric dtype",
    ):
        jd.checkpoint.from_saveable({"w": np.array("relu")}, {"w": jnp.zeros(())})

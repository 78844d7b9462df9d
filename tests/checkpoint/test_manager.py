"""`Checkpoint` and `CheckpointManager`: exact round trips of every kind of item, TF's
numbering and retention, atomic saves (a process killed mid-save), verification, other
replica and process counts."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd

from _helpers import (
    ORBAX_CLOSED_LOOP,
    assert_restores_the_first_save,
    flip_middle_byte,
    kill_mid_save,
    run_workers,
    worker_script,
)

pytest.importorskip("orbax.checkpoint")


def _host(tree: Any) -> list[np.ndarray]:
    """Every leaf of ``tree`` as a NumPy array (variables as their checkpoint value, random
    keys as their key data), in order."""

    def one(x: Any) -> np.ndarray:
        if isinstance(x, jd.Variable):
            return np.asarray(jd.checkpoint.to_saveable(x))
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(x))
        return np.asarray(x)

    return [one(x) for x in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, jd.Variable))]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)  # bitwise


# Round trips ------------------------------------------------------------------------------


def _variables(strategy: jd.Strategy) -> dict[str, jd.Variable]:
    with strategy.scope():
        return {
            "w": jd.Variable(jnp.zeros((4, 3)), aggregation="mean"),
            "count": jd.Variable(0, synchronization="on_read", aggregation="sum"),
            "avg": jd.Variable(0.0, synchronization="on_read", aggregation="mean"),
        }


def _trained_variables(strategy: jd.Strategy) -> dict[str, jd.Variable]:
    state = _variables(strategy)

    def step(ctx: jd.ReplicaContext, s: dict) -> dict:
        r = ctx.replica_id_in_sync_group
        return {
            "w": ctx.assign_add(s["w"], jnp.full((4, 3), 0.5) + r.astype(jnp.float32)),
            "count": ctx.assign_add(s["count"], r + 1),
            "avg": ctx.assign(s["avg"], r.astype(jnp.float32)),
        }

    return strategy.run(step, args=(state,))


def test_every_kind_of_item_round_trips(tmp_path: Path, mirrored8: jd.MirroredStrategy) -> None:
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")

    class Net(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.dense = nnx.Linear(3, 2, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return self.drop(self.dense(x))

    model = Net(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    rngs = nnx.Rngs(5)
    x = jnp.arange(12.0).reshape(4, 3)

    def train() -> None:
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        optimizer.update(model, grads)
        rngs()  # advances the stream

    train_state = jd.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.adam(0.1), key=jax.random.key(3)
    )
    train_state = train_state.apply_gradients(grads={"w": jnp.arange(3.0)})
    dataset = mirrored8.experimental_distribute_dataset(
        jd.data.from_arrays(np.arange(64.0), batch_size=8, shuffle=True)
    )
    it = iter(dataset)
    next(it)
    train()
    ckpt = jd.checkpoint.Checkpoint(
        variables=_trained_variables(mirrored8),
        state=train_state,
        model=model,
        optimizer=optimizer,
        rngs=rngs,
        data=it,
        extra={"step": jnp.int32(7), "lr": 0.25},
    )
    manager = jd.checkpoint.CheckpointManager(ckpt, tmp_path / "run")
    saved = {  # host copies: NNX state views the live variables
        "variables": _host(ckpt.variables),
        "state": _host(train_state),
        "nnx": _host([nnx.state(model), nnx.state(optimizer), nnx.state(rngs)]),
    }
    path = manager.save()
    assert path == str(tmp_path / "run" / "ckpt-1")
    expected_rest = [np.asarray(mirrored8.gather(b, axis=0)) for b in it]  # the unseen batches

    # Training goes on; the items change (NNX in place, the rest rebound).
    train()
    ckpt.state = train_state.apply_gradients(grads={"w": jnp.ones(3)})
    ckpt.variables = _variables(mirrored8)
    ckpt.extra = {"step": jnp.int32(0), "lr": 0.0}
    assert not np.array_equal(np.asarray(model.dense.kernel[...]), saved["nnx"][1])  # bias, kernel

    restored_from = jd.checkpoint.CheckpointManager(ckpt, tmp_path / "run").restore_or_initialize()
    assert restored_from == path
    assert ckpt.model is model and ckpt.optimizer is optimizer and ckpt.rngs is rngs
    _same(_host([nnx.state(model), nnx.state(optimizer), nnx.state(rngs)]), saved["nnx"])
    _same(_host(ckpt.state), saved["state"])
    _same(_host(ckpt.variables), saved["variables"])
    assert isinstance(ckpt.state, jd.TrainState) and ckpt.state.tx is train_state.tx
    assert int(ckpt.state.step) == 1
    assert ckpt.extra["lr"] == 0.25 and type(ckpt.extra["lr"]) is float
    assert int(ckpt.variables["count"].read_value()) == 36  # 1 + ... + 8, split on 8 copies
    assert ckpt.save_counter == 1
    # The data iterator resumes where it was: the batches it had not returned.
    rest = [np.asarray(mirrored8.gather(b, axis=0)) for b in ckpt.data]
    assert len(rest) == 7
    for a, b in zip(rest, expected_rest, strict=True):
        np.testing.assert_array_equal(a, b)
    # The model trains on from the restored state (an uncommitted template stays so).
    train()


def test_checkpoint_save_write_read_restore(tmp_path: Path) -> None:
    ckpt = jd.checkpoint.Checkpoint(w=jnp.arange(3.0))
    first = ckpt.save(tmp_path / "tf")
    ckpt.w = ckpt.w * 2
    second = ckpt.save(tmp_path / "tf")
    assert (os.path.basename(first), os.path.basename(second)) == ("tf-1", "tf-2")
    assert ckpt.save_counter == 2
    written = ckpt.write(tmp_path / "exact")
    assert written == str(tmp_path / "exact") and ckpt.save_counter == 2
    status = ckpt.restore(first)
    assert ckpt.w.tolist() == [0.0, 1.0, 2.0] and ckpt.save_counter == 1
    # TF's load status and its idioms: all or nothing, so the assertions hold.
    assert status.assert_consumed() is status and status.expect_partial() is status
    assert status.assert_existing_objects_matched().assert_nontrivial_match() is status
    assert status.save_path == first
    ckpt.read(second).assert_consumed()  # read leaves the counter alone
    assert ckpt.w.tolist() == [0.0, 2.0, 4.0] and ckpt.save_counter == 1
    nothing = ckpt.restore(None).expect_partial()  # TF: nothing to restore yet
    assert ckpt.w.tolist() == [0.0, 2.0, 4.0] and nothing.save_path is None
    for method in ("assert_consumed", "assert_existing_objects_matched", "assert_nontrivial_match"):
        with pytest.raises(AssertionError, match=rf"LoadStatus.{method}: no checkpoint was given"):
            getattr(nothing, method)()
    # write replaces a directory there
    ckpt.w = jnp.ones(3)
    ckpt.write(tmp_path / "exact")
    ckpt.w = jnp.zeros(3)
    ckpt.read(tmp_path / "exact")
    assert ckpt.w.tolist() == [1.0, 1.0, 1.0]
    assert sorted(os.listdir(tmp_path)) == ["exact", "tf-1", "tf-2"]  # nothing left over


def test_items_and_names_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'save' is a method or property of Checkpoint"):
        jd.checkpoint.Checkpoint(save=1)
    with pytest.raises(ValueError, match=r"item name '_w' is not a name of letters"):
        jd.checkpoint.Checkpoint(**{"_w": 1})
    ckpt = jd.checkpoint.Checkpoint(w=jnp.zeros(2), b=jnp.zeros(1))
    with pytest.raises(AttributeError, match=r"Checkpoint has no item 'v'; its items are"):
        _ = ckpt.v
    path = ckpt.write(tmp_path / "c")
    other = jd.checkpoint.Checkpoint(w=jnp.zeros(2), v=jnp.zeros(1))
    with pytest.raises(
        ValueError,
        match=r"Checkpoint.restore: the checkpoint in .*c holds the items \['b', 'w'\], but this "
        r"Checkpoint has \['v', 'w'\] \(missing from the checkpoint: \['v'\]; not in this "
        r"Checkpoint: \['b'\]\)",
    ):
        other.restore(path)
    it = iter(jd.MirroredStrategy().experimental_distribute_dataset([np.zeros(8)]))
    with pytest.raises(ValueError, match=r"item 'b' was saved as 'pytree' but is now 'iterator'"):
        jd.checkpoint.Checkpoint(w=jnp.zeros(2), b=it).restore(path)
    with pytest.raises(
        ValueError, match=r"restore: \['items'\]\['w'\] has shape \(2,\) in the checkpoint"
    ):
        jd.checkpoint.Checkpoint(w=jnp.zeros(3), b=jnp.zeros(1)).restore(path)
    with pytest.raises(FileNotFoundError, match=r"Checkpoint.restore: no checkpoint directory"):
        ckpt.restore(tmp_path / "nowhere")


# The manager ------------------------------------------------------------------------------


def _names(paths: list[str]) -> list[str]:
    return [os.path.basename(p) for p in paths]


def test_numbering_and_max_to_keep_follow_tf(tmp_path: Path) -> None:
    ckpt = jd.checkpoint.Checkpoint(step=jnp.int32(0))
    manager = jd.checkpoint.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.checkpoints == []
    for step in range(1, 4):
        ckpt.step = jnp.int32(step)
        manager.save()
    assert _names(manager.checkpoints) == ["ckpt-2", "ckpt-3"]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt")) == ["ckpt-2", "ckpt-3"]
    # A given number names the checkpoint; the save counter still counts every save.
    ckpt.step = jnp.int32(10)
    assert _names([manager.save(checkpoint_number=jnp.int32(10))]) == ["ckpt-10"]
    assert ckpt.save_counter == 4
    ckpt.step = jnp.int32(5)
    manager.save()  # the counter's number: ckpt-5, now the newest though 10 > 5
    assert _names(manager.checkpoints) == ["ckpt-10", "ckpt-5"]
    assert _names([manager.latest_checkpoint or ""]) == ["ckpt-5"]
    # A new manager over the directory (a restarted job) takes over the same order.
    manager.close()  # the first job ends: it lets go of the directory
    again = jd.checkpoint.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    assert again.checkpoints == manager.checkpoints
    ckpt.step = jnp.int32(0)
    assert again.restore_or_initialize() == manager.latest_checkpoint
    assert int(ckpt.step) == 5 and ckpt.save_counter == 5
    # Saving an existing number replaces it and makes it the newest.
    ckpt.step = jnp.int32(100)
    again.save(checkpoint_number=10)
    assert _names(again.checkpoints) == ["ckpt-5", "ckpt-10"]
    ckpt.restore(again.checkpoints[-1])
    assert int(ckpt.step) == 100
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".tmp", ".deleted"))]
    with pytest.raises(ValueError, match=r"checkpoint_number must be a non-negative integer"):
        again.save(checkpoint_number=1.5)


def test_max_to_keep_none_keeps_all_and_names_are_custom(tmp_path: Path) -> None:
    ckpt = jd.checkpoint.Checkpoint(x=jnp.zeros(1))
    manager = jd.checkpoint.CheckpointManager(
        ckpt, tmp_path, max_to_keep=None, checkpoint_name="model"
    )
    for _ in range(5):
        manager.save()
    assert _names(manager.checkpoints) == [f"model-{i}" for i in range(1, 6)]
    # Any file name, as TF takes (a '-' was refused).
    where, ckpt = tmp_path / "dashed", jd.checkpoint.Checkpoint(x=jnp.zeros(1))
    dashed = jd.checkpoint.CheckpointManager(ckpt, where, max_to_keep=2, checkpoint_name="my-m")
    for _ in range(3):
        dashed.save()
    assert _names(dashed.checkpoints) == ["my-m-2", "my-m-3"]
    dashed.close()
    again = jd.checkpoint.CheckpointManager(ckpt, where, max_to_keep=2, checkpoint_name="my-m")
    assert _names([again.latest_checkpoint]) == ["my-m-3"] and len(os.listdir(where)) == 3
    for bad in ("", ".hidden", "a/b"):
        with pytest.raises(ValueError, match=r"checkpoint_name must be a file name .* got"):
            jd.checkpoint.CheckpointManager(ckpt, tmp_path / "x", checkpoint_name=bad)
    with pytest.raises(ValueError, match=r"max_to_keep must be a positive int or None"):
        jd.checkpoint.CheckpointManager(ckpt, tmp_path, max_to_keep=0)
    with pytest.raises(TypeError, match=r"checkpoint must be a jaxdist.checkpoint.Checkpoint"):
        jd.checkpoint.CheckpointManager({"x": 1}, tmp_path)  # type: ignore[arg-type]


def test_restore_or_initialize_calls_init_fn_without_a_checkpoint(tmp_path: Path) -> None:
    calls = []
    ckpt = jd.checkpoint.Checkpoint(x=jnp.zeros(1))
    manager = jd.checkpoint.CheckpointManager(
        ckpt, tmp_path / "new", init_fn=lambda: calls.append(1)
    )
    assert manager.restore_or_initialize() is None and calls == [1]
    manager.save()
    assert manager.restore_or_initialize() == str(tmp_path / "new" / "ckpt-1") and calls == [1]


def test_without_its_record_the_entries_are_ordered_by_number_not_as_strings(
    tmp_path: Path,
) -> None:
    # A planted bug sorted them as strings: ckpt-9 "newer" than ckpt-10.
    ckpt = jd.checkpoint.Checkpoint(x=jnp.zeros(1))
    manager = jd.checkpoint.CheckpointManager(ckpt, tmp_path, max_to_keep=None)
    for number in (2, 9, 10, 11):
        ckpt.x = jnp.full(1, float(number))
        manager.save(checkpoint_number=number)
    manager.close()
    (tmp_path / "jaxdist_checkpoints.json").unlink()  # the record is lost
    again = jd.checkpoint.CheckpointManager(ckpt, tmp_path, max_to_keep=None)
    assert _names(again.checkpoints) == ["ckpt-2", "ckpt-9", "ckpt-10", "ckpt-11"]
    again.restore_or_initialize()
    assert float(ckpt.x[0]) == 11.0


def test_unrecorded_complete_entries_are_taken_over(tmp_path: Path) -> None:
    ckpt = jd.checkpoint.Checkpoint(x=jnp.zeros(1))
    manager = jd.checkpoint.CheckpointManager(ckpt, tmp_path, max_to_keep=None)
    manager.save()
    # A save interrupted after its rename, before the record was updated:
    ckpt.write(tmp_path / "ckpt-7")
    (tmp_path / "ckpt-8.tmp").mkdir()  # and one interrupted before its rename
    manager.close()
    again = jd.checkpoint.CheckpointManager(ckpt, tmp_path, max_to_keep=None)
    assert _names(again.checkpoints) == ["ckpt-1", "ckpt-7"]
    again.save(checkpoint_number=8)  # removes the leftover temporary directory
    assert not (tmp_path / "ckpt-8.tmp").exists()
    (tmp_path / "jaxdist_checkpoints.json").write_text("{damaged")
    with pytest.warns(UserWarning, match=r"ignoring its record .* the checkpoints there are"):
        third = jd.checkpoint.CheckpointManager(ckpt, tmp_path, max_to_keep=None)
    assert _names(third.checkpoints) == ["ckpt-1", "ckpt-7", "ckpt-8"]


def test_an_entry_saved_by_checkpoint_save_before_the_managers_last_save_is_not_the_latest(
    tmp_path: Path,
) -> None:
    """TF's advice without a manager: save into the handler's directory with
    ``Checkpoint.save``. That entry is older than the handler's own save after it, so a
    restart restores the handler's (TF's ``latest_checkpoint`` is the last written). Before,
    every unrecorded entry was taken as the newest: the restart went back to ``ckpt-1``."""
    ckpt = jd.checkpoint.Checkpoint(w=jnp.zeros(()))
    manager = jd.checkpoint.CheckpointManager(ckpt, tmp_path, max_to_keep=None)  # the handler's
    ckpt.w = jnp.asarray(2.0)
    ckpt.save(tmp_path / "ckpt")  # the user's own, ckpt-1, after the manager was made
    ckpt.w = jnp.asarray(5.0)
    assert _names([manager.save(checkpoint_number=2)]) == ["ckpt-2"]
    manager.close()
    again = jd.checkpoint.CheckpointManager(
        restored := jd.checkpoint.Checkpoint(w=jnp.zeros(())), tmp_path, max_to_keep=None
    )
    assert _names(again.checkpoints) == ["ckpt-1", "ckpt-2"]
    assert _names([again.latest_checkpoint]) == ["ckpt-2"]
    again.restore_or_initialize()
    assert float(restored.w) == 5.0
    again.close()


# Verification -----------------------------------------------------------------------------


@ORBAX_CLOSED_LOOP
def test_corrupted_files_fail_verification(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 64)).astype(np.float32)
    it = iter(jd.MirroredStrategy().experimental_distribute_dataset([np.zeros(8)] * 3))
    next(it)
    ckpt = jd.checkpoint.Checkpoint(w=jnp.asarray(w), data=it)
    manager = jd.checkpoint.CheckpointManager(ckpt, tmp_path)
    path = Path(manager.save())
    data, raw = flip_middle_byte(path)
    with pytest.raises(
        ValueError,
        match=r"restore: leaf \['items'\]\['w'\] of the checkpoint in .*ckpt-1 does not match "
        r"its manifest: sha256 is [0-9a-f]{64} but [0-9a-f]{64} was saved",
    ):
        manager.restore_or_initialize()
    data.write_bytes(bytes(raw[: len(raw) // 2]))  # also fails when orbax cannot read it
    with pytest.raises(ValueError, match=r"ckpt-1|sha256"):
        manager.restore_or_initialize()
    # The JSON records carry checksums too.
    path2 = Path(manager.save())
    positions = path2 / "jaxdist_iterators.0.json"
    record = json.loads(positions.read_text())
    record["body"]["iterators"]["data"]["batches"] = 3
    positions.write_text(json.dumps(record))
    with pytest.raises(
        ValueError,
        match=r"Checkpoint.restore: iterator positions .*jaxdist_iterators.0.json does not "
        r"match its SHA-256 checksum: it was changed or damaged after it was written",
    ):
        manager.restore_or_initialize()
    (path2 / "jaxdist_checkpoint.json").write_text("{")
    with pytest.raises(ValueError, match=r"the checkpoint's metadata .* is damaged"):
        manager.restore_or_initialize()
    assert ckpt.w.tolist() == w.tolist()  # nothing was changed by the failed restores


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    directory = kill_mid_save(tmp_path, asynchronous=False)
    ckpt = jd.checkpoint.Checkpoint(
        state={"a": jnp.zeros(25_000_000), "b": jnp.zeros(25_000_000)}, step=jnp.int32(0)
    )
    manager = jd.checkpoint.CheckpointManager(ckpt, directory, max_to_keep=1)
    assert_restores_the_first_save(manager, ckpt, directory)
    # The next save writes ckpt-2 afresh and clears what the killed one left.
    manager.save()
    assert _names(manager.checkpoints) == ["ckpt-2"]
    assert sorted(os.listdir(directory)) == ["ckpt-2", "jaxdist_checkpoints.json"]


# Other replica and process counts --------------------------------------------------------


def test_restore_under_fewer_replicas(tmp_path: Path, mirrored8: jd.MirroredStrategy) -> None:
    saved = _trained_variables(mirrored8)
    expected = {k: np.asarray(jd.checkpoint.to_saveable(v)) for k, v in saved.items()}
    manager = jd.checkpoint.CheckpointManager(jd.checkpoint.Checkpoint(v=saved), tmp_path)
    manager.save()
    s4 = jd.MirroredStrategy(jax.devices()[:4])
    ckpt = jd.checkpoint.Checkpoint(v=_variables(s4))
    jd.checkpoint.CheckpointManager(ckpt, tmp_path).restore_or_initialize()
    for k, v in ckpt.v.items():
        np.testing.assert_array_equal(np.asarray(jd.checkpoint.to_saveable(v)), expected[k])
        assert v.device_values.sharding.device_set == set(jax.devices()[:4])
    assert np.asarray(ckpt.v["count"].device_values).tolist() == [9] * 4  # 36 split on 4
    # The reference: the same sums computed by NumPy.
    assert expected["count"] == sum(range(1, 9))
    np.testing.assert_array_equal(expected["w"], np.full((4, 3), 0.5 + np.mean(np.arange(8))))


def test_shape_dtype_struct_templates(tmp_path: Path, mirrored8: jd.MirroredStrategy) -> None:
    rng = np.random.default_rng(1)
    w, step = rng.normal(size=(5, 2)).astype(np.float32), np.int32(12)
    jd.checkpoint.save(tmp_path / "c", {"w": jnp.asarray(w), "step": step})
    s4 = jd.MirroredStrategy(jax.devices()[:4])
    template = {
        "w": jax.ShapeDtypeStruct((5, 2), jnp.float32),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }
    with s4.scope():
        out = jd.checkpoint.restore(tmp_path / "c", template)
    np.testing.assert_array_equal(np.asarray(out["w"]), w)
    assert int(out["step"]) == 12 and out["step"].dtype == jnp.int32
    assert out["w"].sharding.device_set == set(jax.devices()[:4])
    assert out["w"].sharding.is_fully_replicated
    # Outside a scope: the default strategy's device; a struct's own sharding wins.
    one = jd.checkpoint.restore(tmp_path / "c", template)
    assert len(one["w"].sharding.device_set) == 1
    rows = jax.sharding.NamedSharding(mirrored8.mesh, jax.sharding.PartitionSpec(None))
    own = {**template, "w": jax.ShapeDtypeStruct((5, 2), jnp.float32, sharding=rows)}
    assert jd.checkpoint.restore(tmp_path / "c", own)["w"].sharding == rows
    with pytest.raises(
        ValueError,
        match=r"restore: \['w'\] has shape \(5, 2\) in the checkpoint, but the template's "
        r"jax.ShapeDtypeStruct has shape \(2, 5\)",
    ):
        jd.checkpoint.restore(tmp_path / "c", {**template, "w": jax.ShapeDtypeStruct((2, 5), "f")})


_TWO_PROCESSES = worker_script(
    """
    import jax.numpy as jnp
    import numpy as np
    import jaxdist as jd

    out_dir = sys.argv[3]
    me = jax.process_index()
    s = jd.MultiWorkerMirroredStrategy()

    def variables():
        with s.scope():
            return {
                "w": jd.Variable(jnp.zeros(3), aggregation="mean"),
                "count": jd.Variable(0, synchronization="on_read", aggregation="sum"),
            }

    def step(ctx, v):
        r = ctx.replica_id_in_sync_group
        return {"w": ctx.assign_add(v["w"], jnp.arange(3.0) + r.astype(jnp.float32)),
                "count": ctx.assign_add(v["count"], r + 1)}

    def dataset_fn(ctx):  # each process reads its own rows
        x = np.arange(32, dtype=np.float32) + 1000 * ctx.input_pipeline_id
        return jd.data.from_arrays(x, batch_size=2, shuffle=True, seed=3)

    def local(b):
        return [np.asarray(r).tolist() for r in s.experimental_local_results(b)]

    ds = s.distribute_datasets_from_function(dataset_fn)
    it = iter(ds)
    next(it)
    v = s.run(step, args=(variables(),))
    ckpt = jd.checkpoint.Checkpoint(v=v, data=it)
    manager = jd.checkpoint.CheckpointManager(ckpt, os.path.join(out_dir, "with_data"))
    manager.save()
    rest = [local(b) for b in it]
    jd.checkpoint.CheckpointManager(
        jd.checkpoint.Checkpoint(v=v), os.path.join(out_dir, "arrays")
    ).save()
    # Restored into fresh objects: the values and this process's own position.
    fresh = jd.checkpoint.Checkpoint(
        v=variables(), data=iter(s.distribute_datasets_from_function(dataset_fn))
    )
    restored = jd.checkpoint.CheckpointManager(fresh, os.path.join(out_dir, "with_data"))
    restored.restore_or_initialize()
    print(json.dumps({
        "w": np.asarray(fresh.v["w"].read_value()).tolist(),
        "count": int(fresh.v["count"].read_value()),
        "rest": rest,
        "resumed": [local(b) for b in fresh.data],
        "files": sorted(os.listdir(os.path.join(out_dir, "with_data", "ckpt-1"))),
    }), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_save_and_one_process_restores(tmp_path: Path) -> None:
    results = run_workers(_TWO_PROCESSES.replace("sys.argv[3]", repr(str(tmp_path))))
    reference_w = (np.arange(3.0) + np.mean(np.arange(8))).tolist()
    for me, r in enumerate(results):
        assert r["w"] == reference_w and r["count"] == sum(range(1, 9))
        assert r["resumed"] == r["rest"] and len(r["rest"]) == 3  # 16 batches, 4 a step
        assert {"jaxdist_iterators.0.json", "jaxdist_iterators.1.json"} <= set(r["files"])
        mine = [x for step in r["rest"] for b in step for x in b]
        assert all(1000 * me <= x < 1000 * me + 32 for x in mine)  # its own pipeline's rows
    # Written by 2 processes x 4 devices, read by 1 process x 8: the same values.
    s8 = jd.MirroredStrategy()
    ckpt = jd.checkpoint.Checkpoint(v=_variables_1d(s8))
    jd.checkpoint.CheckpointManager(ckpt, tmp_path / "arrays").restore_or_initialize()
    assert np.asarray(ckpt.v["w"].read_value()).tolist() == reference_w
    assert int(ckpt.v["count"].read_value()) == 36
    it = iter(s8.experimental_distribute_dataset([np.zeros(8)]))
    with pytest.raises(
        ValueError,
        match=r"holds the iterator positions of 2 processes, but this job has 1: each "
        r"process's position belongs to the data that process reads",
    ):
        jd.checkpoint.Checkpoint(v=_variables_1d(s8), data=it).restore(
            str(tmp_path / "with_data" / "ckpt-1")
        )


_ONE_PROCESS_FAILS = worker_script(
    """
    import errno
    import jax.numpy as jnp
    import numpy as np
    import jaxdist as jd
    from jaxdist.checkpoint import _files, _storage

    out_dir = sys.argv[3]
    me = jax.process_index()
    s = jd.MultiWorkerMirroredStrategy()
    with s.scope():
        v = jd.Variable(jnp.arange(4.0), aggregation="mean")
    ds = s.distribute_datasets_from_function(
        lambda ctx: jd.data.from_arrays(np.arange(32, dtype=np.float32), batch_size=2)
    )
    it = iter(ds)
    next(it)
    manager = jd.checkpoint.CheckpointManager(jd.checkpoint.Checkpoint(v=v, data=it), out_dir)

    def fail_once(module, name, process):
        # An I/O error in one process only (as a full or failing disk on one host).
        real = getattr(module, name)

        def failing(*args, **kwargs):
            setattr(module, name, real)
            raise OSError(errno.EIO, f"injected failure in process {process}")

        if me == process:
            setattr(module, name, failing)

    outcomes = []
    for module, name, process in [(_storage, "_write_primary", 0), (_files, "write_json", 1)]:
        fail_once(module, name, process)
        try:
            manager.save()
            outcomes.append("saved")
        except Exception as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    last = manager.save()
    with s.scope():
        fresh = jd.checkpoint.Checkpoint(v=jd.Variable(jnp.zeros(4)), data=iter(ds))
    fresh.restore(last)
    print(json.dumps({
        "outcomes": outcomes,
        "checkpoints": [os.path.basename(c) for c in manager.checkpoints],
        "listing": sorted(os.listdir(out_dir)),
        "restored": np.asarray(fresh.v.read_value()).tolist(),
    }), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_save_failing_in_one_process_fails_in_every_process_at_once(tmp_path: Path) -> None:
    """A save that fails in one process of a job (process 0 writing the arrays; process 1
    writing its iterator positions) raises in every process at that step, instead of
    leaving the others at the next barrier until its 30-minute timeout: the test's job
    would hang past run_workers' timeout. The failing process raises its own error, the
    others a RuntimeError naming it; every process then passes the same barriers, so the
    next save succeeds and restores (reference: the saved values)."""
    results = run_workers(_ONE_PROCESS_FAILS.replace("sys.argv[3]", repr(str(tmp_path))))
    p0, p1 = results[0]["outcomes"], results[1]["outcomes"]  # each by save

    def from_peer(step: str, process: int) -> str:
        return (
            r"RuntimeError: jaxdist\.checkpoint: the save failed in another process of the "
            rf"job, at its '{step}' step \(process {process}: OSError: \[Errno 5\] injected "
            rf"failure in process {process}\)\. Nothing was saved by this save; .*"
        )

    # Save 1: process 0's array write fails.
    assert p0[0] == "OSError: [Errno 5] injected failure in process 0"
    assert re.fullmatch(from_peer("arrays", 0), p1[0]), p1[0]
    # Save 2: process 1's iterator positions fail.
    assert p1[1] == "OSError: [Errno 5] injected failure in process 1"
    assert re.fullmatch(from_peer("written", 1), p0[1]), p0[1]
    for r in results:
        assert r["checkpoints"] == ["ckpt-3"]  # the two failed saves left no entry
        assert not [n for n in r["listing"] if n.startswith("ckpt-") and n != "ckpt-3"]
        assert r["restored"] == [0.0, 1.0, 2.0, 3.0]


def _variables_1d(strategy: jd.Strategy) -> dict[str, jd.Variable]:
    with strategy.scope():
        return {
            "w": jd.Variable(jnp.zeros(3), aggregation="mean"),
            "count": jd.Variable(0, synchronization="on_read", aggregation="sum"),
        }


@ORBAX_CLOSED_LOOP
def test_arrays_placed_whole_are_read_to_their_devices_and_verified(
    tmp_path: Path, mirrored8: jd.MirroredStrategy
) -> None:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdist.checkpoint import _arrays, _storage

    mesh = mirrored8.mesh
    axis = mesh.axis_names[0]
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(axis))
    rng = np.random.default_rng(0)
    values = {
        "w": rng.normal(size=(256, 64)).astype(np.float32),
        "rows": rng.normal(size=(8, 5)).astype(np.float32),
        "count": np.arange(6, dtype=np.int32),
    }
    ckpt = jd.checkpoint.Checkpoint(
        w=jax.device_put(values["w"], replicated),
        rows=jax.device_put(values["rows"], split),
        count=jnp.asarray(values["count"]),
    )
    manager = jd.checkpoint.CheckpointManager(ckpt, tmp_path)
    path = manager.save()
    # Templates placed whole in this process, of the saved shape and dtype, are read straight
    # to their devices; an int32 saved into a float32 template goes through the host (and
    # the conversion rules).
    ckpt.w = jax.device_put(np.zeros((256, 64), np.float32), replicated)
    ckpt.rows = jax.ShapeDtypeStruct((8, 5), jnp.float32, sharding=split)
    ckpt.count = jax.device_put(np.zeros(6, np.float32), replicated)
    template = {"save_counter": 0, "items": {"w": ckpt.w, "rows": ckpt.rows, "count": ckpt.count}}
    saved = _storage._read(path, template)["items"]
    assert isinstance(saved["w"], _arrays.Placed) and isinstance(saved["rows"], _arrays.Placed)
    assert isinstance(saved["count"], np.ndarray)
    manager.restore_or_initialize()
    assert ckpt.w.sharding == replicated and ckpt.rows.sharding == split
    assert ckpt.count.sharding == replicated and ckpt.count.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ckpt.w), values["w"])  # bitwise
    np.testing.assert_array_equal(np.asarray(ckpt.rows), values["rows"])
    np.testing.assert_array_equal(np.asarray(ckpt.count), values["count"].astype(np.float32))
    # A flipped bit in a leaf read to the devices fails verification, naming it.
    flip_middle_byte(Path(path))
    ckpt.w = jax.device_put(np.zeros((256, 64), np.float32), replicated)
    with pytest.raises(
        ValueError,
        match=r"restore: leaf \['items'\]\['w'\] of the checkpoint in .*ckpt-1 does not match "
        r"its manifest: sha256 is [0-9a-f]{64} but [0-9a-f]{64} was saved",
    ):
        manager.restore_or_initialize()
    assert not np.asarray(ckpt.w).any()  # nothing was changed

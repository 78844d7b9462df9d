"""Asynchronous saves of `CheckpointManager` (``enable_async_checkpointing=True``): the
caller stalls only for the host copy, the entry appears complete or not at all, a later
call waits for it and raises its error, a process killed mid-write keeps its previous
checkpoint, and a job of two processes saves in the background while its steps run."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd
from jaxdist.checkpoint import _files, _storage

from _helpers import assert_restores_the_first_save, kill_mid_save, run_workers, worker_script

pytest.importorskip("orbax.checkpoint")

_META = "jaxdist_checkpoint.json"


def _names(paths: list[str]) -> list[str]:
    return [os.path.basename(p) for p in paths]


def _big(seed: int, n: int = 25_000_000) -> dict[str, jax.Array]:
    """200 MB of random float32 (incompressible) in two arrays."""
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(n, dtype=np.float32)) for k in "ab"}


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


@pytest.mark.timeout(300)
def test_async_save_returns_before_the_write_and_restores_bitwise(tmp_path: Path) -> None:
    state = _big(0)
    expected = {k: np.asarray(v).copy() for k, v in state.items()}
    sync = jd.checkpoint.CheckpointManager(jd.checkpoint.Checkpoint(s=state), tmp_path / "sync")
    ckpt = jd.checkpoint.Checkpoint(s=state, host=np.arange(1_000_000.0))
    manager = jd.checkpoint.CheckpointManager(
        ckpt, tmp_path / "async", max_to_keep=None, enable_async_checkpointing=True
    )
    assert manager.enable_async_checkpointing and not sync.enable_async_checkpointing
    # A blocking save writes 200 MB before it returns; an asynchronous one copies them to
    # the host and returns. Compared on the same machine in the same test, with a generous
    # factor (the host copy is a small fraction of the write); best of three attempts.
    ratios = []
    for _ in range(3):
        blocking = _timed(sync.save)
        background = _timed(manager.save)
        ratios.append(background / blocking)
        manager.wait_until_finished()
        if ratios[-1] < 0.5:
            break
    assert min(ratios) < 0.5, f"async save / blocking save call times: {ratios}"
    saves = len(ratios)
    # Training goes on while the write runs: the arrays' buffers are donated and
    # overwritten, and the NumPy item changed in place; the entry holds the values at save.
    path = manager.save()
    ckpt.host[:] = -1.0
    ckpt.s = jax.jit(lambda t: jax.tree.map(lambda x: x * 0.0 - 1.0, t), donate_argnums=0)(ckpt.s)
    manager.wait_until_finished()
    assert path == manager.latest_checkpoint == str(tmp_path / "async" / f"ckpt-{saves + 1}")
    assert _names(manager.checkpoints) == [f"ckpt-{i}" for i in range(1, saves + 2)]
    fresh = jd.checkpoint.Checkpoint(
        s={k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in expected.items()},
        host=np.zeros(1_000_000),
    )
    jd.checkpoint.CheckpointManager(fresh, tmp_path / "async").restore_or_initialize()  # verified
    for k, v in expected.items():
        restored = np.asarray(fresh.s[k])
        assert restored.dtype == v.dtype
        np.testing.assert_array_equal(restored, v)  # bitwise
    np.testing.assert_array_equal(fresh.host, np.arange(1_000_000.0))
    assert fresh.save_counter == saves + 1


@pytest.mark.timeout(120)
def test_an_entry_is_listed_only_when_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = jd.checkpoint.Checkpoint(w=jnp.arange(4_000_000.0), step=jnp.int32(0))
    manager = jd.checkpoint.CheckpointManager(
        ckpt, tmp_path, max_to_keep=2, enable_async_checkpointing=True
    )
    seen_incomplete: list[list[str]] = []
    looks = [0]

    def look() -> None:  # every entry under its final name is complete, at every stage
        looks[0] += 1
        for entry in tmp_path.glob("ckpt-*"):
            if entry.is_dir() and not entry.name.endswith((".tmp", ".deleted")):
                names = set(os.listdir(entry))
                if not {jd.checkpoint.MANIFEST, _META} <= names:
                    seen_incomplete.append(sorted(names))

    # Look before and after each stage of a write (the polling below may miss a short
    # window; these cannot): the arrays, the JSON files, the flush and the rename.
    for module, name in [
        (_storage, "write_saveable"),
        (_files, "write_json"),
        (_files, "fsync_tree"),
        (_files, "publish"),
    ]:
        real = getattr(module, name)

        def staged(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            look()
            try:
                return _real(*args, **kwargs)
            finally:
                look()

        monkeypatch.setattr(module, name, staged)
    for step in range(1, 4):
        ckpt.step = jnp.int32(step)
        path = Path(manager.save())
        # While the write runs, the entry's name is absent or names a complete entry.
        while manager._writer is not None and manager._writer.is_alive():
            if path.exists() and not {jd.checkpoint.MANIFEST, _META} <= set(os.listdir(path)):
                seen_incomplete.append(sorted(os.listdir(path)))
            time.sleep(0.001)
        assert manager.latest_checkpoint == str(path)  # waits for the write
    assert not seen_incomplete and looks[0] >= 3 * 8  # 3 saves, 4 stages, before and after
    assert _names(manager.checkpoints) == ["ckpt-2", "ckpt-3"]  # max_to_keep, as in TF
    assert sorted(os.listdir(tmp_path)) == ["ckpt-2", "ckpt-3", "jaxdist_checkpoints.json"]
    ckpt.step = jnp.int32(0)
    assert manager.restore_or_initialize() == str(tmp_path / "ckpt-3")
    assert int(ckpt.step) == 3
    # A new manager over the directory (a restarted job) takes the entries over.
    again = jd.checkpoint.CheckpointManager(ckpt, tmp_path, enable_async_checkpointing=True)
    assert _names(again.checkpoints) == ["ckpt-2", "ckpt-3"]


def test_latest_checkpoint_waits_for_the_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A planted bug (no wait in latest_checkpoint) was caught only by a slow two-process test.
    ckpt = jd.checkpoint.Checkpoint(w=jnp.arange(3.0))
    manager = jd.checkpoint.CheckpointManager(ckpt, tmp_path, enable_async_checkpointing=True)
    release = threading.Event()
    real = _storage.write_saveable

    def held(*args: Any, **kwargs: Any) -> None:
        release.wait(30)
        real(*args, **kwargs)

    monkeypatch.setattr(_storage, "write_saveable", held)
    path = manager.save()
    answers: list[str | None] = []
    reader = threading.Thread(target=lambda: answers.append(manager.latest_checkpoint))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and not answers  # it waits while the write is held
    release.set()
    reader.join(30)
    assert answers == [path] and (Path(path) / _META).exists()


def test_a_failed_background_write_is_raised_by_the_next_call(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    ckpt = jd.checkpoint.Checkpoint(w=jnp.arange(3.0))
    manager = jd.checkpoint.CheckpointManager(ckpt, directory, enable_async_checkpointing=True)
    directory.write_text("a file where the directory should be")
    manager.save()  # returns: the write fails in the background
    with pytest.raises(
        RuntimeError,
        match=r"CheckpointManager: the asynchronous save of ckpt-1 to .*run failed "
        r"\((FileExistsError|NotADirectoryError): .*\)\. The checkpoints saved before it are "
        r"intact; fix the cause and save again\.",
    ) as info:
        manager.save()  # the next call raises it, and does not save
    assert isinstance(info.value.__cause__, OSError)
    directory.unlink()
    manager.save()
    manager.wait_until_finished()
    directory.rename(tmp_path / "kept")
    directory.write_text("a file again")
    manager.save()
    with pytest.raises(RuntimeError, match=r"the asynchronous save of ckpt-3"):
        manager.wait_until_finished()
    manager.wait_until_finished()  # raised once
    directory.unlink()
    (tmp_path / "kept").rename(directory)
    ckpt.w = jnp.zeros(3)
    assert _names(manager.checkpoints) == ["ckpt-2"]
    assert manager.restore_or_initialize() == str(directory / "ckpt-2")
    np.testing.assert_array_equal(np.asarray(ckpt.w), np.arange(3.0))
    assert ckpt.save_counter == 2


def test_enable_async_checkpointing_is_checked(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"enable_async_checkpointing must be True or False"):
        jd.checkpoint.CheckpointManager(
            jd.checkpoint.Checkpoint(), tmp_path, enable_async_checkpointing="yes"
        )


# A process killed during an asynchronous save -------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_process_killed_mid_async_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    directory = kill_mid_save(tmp_path, asynchronous=True)
    ckpt = jd.checkpoint.Checkpoint(
        state={k: jax.ShapeDtypeStruct((25_000_000,), jnp.float32) for k in "ab"},
        step=jnp.int32(0),
    )
    manager = jd.checkpoint.CheckpointManager(ckpt, directory, enable_async_checkpointing=True)
    assert_restores_the_first_save(manager, ckpt, directory)
    manager.save()  # writes ckpt-2 afresh and clears what the killed save left
    manager.wait_until_finished()
    assert sorted(os.listdir(directory)) == ["ckpt-2", "jaxdist_checkpoints.json"]


# Two processes: background writes beside training steps with collectives ----------------

_TWO_PROCESSES = worker_script(
    """
    import jax.numpy as jnp
    import numpy as np
    import jaxdist as jd

    out_dir = sys.argv[3]
    s = jd.MultiWorkerMirroredStrategy()
    with s.scope():
        v = {
            "w": jd.Variable(jnp.zeros(200_000), aggregation="mean"),
            "count": jd.Variable(0, synchronization="on_read", aggregation="sum"),
        }

    def step(ctx, v):
        r = ctx.replica_id_in_sync_group
        g = ctx.all_reduce("sum", jnp.ones(200_000) * (r + 1).astype(jnp.float32))
        return {"w": ctx.assign_add(v["w"], g), "count": ctx.assign_add(v["count"], r + 1)}

    ckpt = jd.checkpoint.Checkpoint(v=v)
    manager = jd.checkpoint.CheckpointManager(
        ckpt, out_dir, max_to_keep=2, enable_async_checkpointing=True
    )
    saved = {}
    for i in range(1, 7):  # a step with an all-reduce runs while each save is written
        v = s.run(step, args=(v,))
        ckpt.v = v
        manager.save(checkpoint_number=i)
        saved[i] = float(np.asarray(jd.checkpoint.to_saveable(v["w"]))[0])
    latest = manager.latest_checkpoint
    with s.scope():
        fresh = jd.checkpoint.Checkpoint(v={
            "w": jd.Variable(jnp.zeros(200_000), aggregation="mean"),
            "count": jd.Variable(0, synchronization="on_read", aggregation="sum"),
        })
    jd.checkpoint.CheckpointManager(fresh, out_dir).restore_or_initialize()
    print(json.dumps({
        "latest": os.path.basename(latest),
        "checkpoints": [os.path.basename(p) for p in manager.checkpoints],
        "w0": float(np.asarray(jd.checkpoint.to_saveable(fresh.v["w"]))[0]),
        "count": int(fresh.v["count"].read_value()),
        "saved": saved[6],
    }), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_save_in_the_background_while_steps_run(tmp_path: Path) -> None:
    results = run_workers(_TWO_PROCESSES.replace("sys.argv[3]", repr(str(tmp_path))))
    # Each step adds the all-reduced sum of (r + 1) over 8 replicas, 36, to every element.
    for r in results:
        assert r["latest"] == "ckpt-6" and r["checkpoints"] == ["ckpt-5", "ckpt-6"]
        assert r["w0"] == r["saved"] == 6 * 36.0
        assert r["count"] == 6 * 36
    assert sorted(os.listdir(tmp_path)) == ["ckpt-5", "ckpt-6", "jaxdist_checkpoints.json"]
